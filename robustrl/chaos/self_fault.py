"""Faults a process injects on itself: the controller's crash or hang asked for through its API.

The controller cannot be killed by the controller's launcher, but it can end or freeze its own
process once its answer is on the wire: SIGKILL after ``REPLY_DELAY_S`` (a crash: the stack's
supervisor, or Docker, starts it again), or SIGSTOP with a detached waker that sends SIGCONT
after the hang's duration (nothing inside a stopped process can wake it).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess

REPLY_DELAY_S = 0.3
"""Time for the API answer (or the NATS ack) to leave before the process stops."""
DEFAULT_HANG_S = 10.0


def schedule_self_fault(kind: str, duration_s: float = 0.0) -> None:
    """Crash (``crash``) or freeze for ``duration_s`` (``hang``) this process, shortly.

    Raises:
        ValueError: any other kind.
    """
    pid = os.getpid()
    loop = asyncio.get_running_loop()
    if kind == "crash":
        loop.call_later(REPLY_DELAY_S, os.kill, pid, signal.SIGKILL)
    elif kind == "hang":
        wake_after = REPLY_DELAY_S + (duration_s or DEFAULT_HANG_S)
        # The waker lives in its own session: it must outlive the stop and is nobody's child to wait for.
        subprocess.Popen(["/bin/sh", "-c", f"sleep {wake_after:.3f}; kill -CONT {pid}"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
        loop.call_later(REPLY_DELAY_S, os.kill, pid, signal.SIGSTOP)
    else:
        raise ValueError(f"a process can only crash or hang itself, not {kind!r}")
