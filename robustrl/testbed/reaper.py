"""A testbed's reaper: a small process, in a session of its own, that removes the testbed when its
owner dies without doing so (SIGKILL, a crash), so nothing is left even if no sweep ever runs.

It blocks on a pidfd of the owner (no polling); the owner checks the start time so a recycled pid
is not mistaken for it. A normal ``down()`` kills the reaper after removing the testbed.

Usage: ``python -m robustrl.testbed.reaper STATE_DIR TAG``
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys
from pathlib import Path

from robustrl.errors import RobustRLError
from robustrl.testbed.state import TestbedState, process_alive, state_path
from robustrl.testbed.teardown import teardown

MODULE = "robustrl.testbed.reaper"
FALLBACK_POLL_MS = 200
"""Only where pidfd_open is missing (Linux < 5.3)."""


def _load(state_dir: Path, tag: str) -> TestbedState | None:
    try:
        return TestbedState.from_json(json.loads(state_path(tag, state_dir).read_text()))
    except (OSError, ValueError, RobustRLError):
        return None


def wait_for_exit(pid: int, start: float | None) -> None:
    """Return once process ``pid`` (started at ``start``) has ended."""
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        fd = None
    if fd is not None:
        try:
            if process_alive(pid, start):  # the pidfd is of the right process, not a recycled pid
                poller = select.poll()
                poller.register(fd, select.POLLIN)
                while not poller.poll():
                    pass
        finally:
            os.close(fd)
        return
    poller = select.poll()
    while process_alive(pid, start):
        poller.poll(FALLBACK_POLL_MS)  # no pidfd: wait a little between checks


def main(argv: list[str]) -> int:
    state_dir, tag = Path(argv[0]), argv[1]
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # only the owner's death or its down() (SIGKILL) ends us
    state = _load(state_dir, tag)
    if state is None or state.owner_pid is None:
        return 0
    wait_for_exit(state.owner_pid, state.owner_start)
    state = _load(state_dir, tag)  # gone when the owner tore the testbed down itself
    if state is not None:
        with contextlib.suppress(RobustRLError):
            teardown(state, state_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
