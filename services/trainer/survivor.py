"""A surviving trainer rank kept for the next gang (``recovery.keep_survivors``).

When one rank of a gang crashes (only then: ``KEEPABLE_FAULTS``), the controller kills it and, where the
launcher can hand a running process over (``Launcher.can_keep_trainers``), keeps the other ranks:
it writes each one's new identity (a rank of the next gang) as a hand-off and signals the process
(``LocalLauncher.relabel``, the same path that borrows a rollout replica). Here, in the rank:

* the hand-off signal stops the running worker (no new step; a collective with the killed rank
  fails at once, as its connections are closed);
* a rank whose gang broke before the hand-off came (its collective failed first) does not exit
  at once: it waits up to ``recovery.survivor_wait_s`` for the hand-off, then exits as before;
* once the old worker has unwound (bus, weight server and process group closed), the same process
  runs the trainer again as the new rank, with its model still built: it resumes from the newest
  complete checkpoint like every rank of a new gang (model, optimizer and RNG state are all
  loaded, so nothing of the broken gang's step carries over);
* a worker that has not unwound ``UNWIND_S`` after the hand-off (blocked in a collective with a
  rank that is still alive somewhere) exits: the controller sees the new rank exit and recovers.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Mapping
from types import FrameType

from robustrl.launcher.spare import HANDOFF_ENV, HANDOFF_SIGNAL
from robustrl.services.rollout.standby import Handoff, read_handoff

log = logging.getLogger(__name__)

SURVIVOR_WAIT_S = 30.0
"""How long a rank whose gang broke before it had the job's spec waits to be kept before it exits."""
UNWIND_S = 20.0
"""How long the old worker may take to stop after the hand-off before the process gives up."""


class SurvivorHook:
    """Listens, for the whole life of a trainer process, for the launcher's hand-off signal.

    The signal handler only writes a byte to a pipe (it runs between two bytecodes of the main
    thread, which may hold any lock); the hand-off is read and acted on in ordinary code: by the
    running worker's event loop (a reader on the pipe), or by :meth:`wait` between two workers.

    Args:
        env: the member's start environment (``ROBUSTRL_HANDOFF_DIR``: where hand-offs are
            written; absent: the launcher cannot hand over, and the hook does nothing).
    """

    def __init__(self, env: Mapping[str, str]) -> None:
        self.directory = env.get(HANDOFF_ENV)
        self.handoff: Handoff | None = None
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._stop: Callable[[], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watchdog: threading.Timer | None = None

    def install(self) -> None:
        """Install the signal handler (main thread only)."""
        if self.directory:
            signal.signal(HANDOFF_SIGNAL, self._on_signal)

    def _on_signal(self, _sig: int, _frame: FrameType | None) -> None:
        try:
            os.write(self._write_fd, b"\0")
        except OSError:
            pass  # the pipe is full: a byte is already waiting

    def attach(self, loop: asyncio.AbstractEventLoop, stop: Callable[[], None]) -> None:
        """The running worker: ``stop`` is called on its loop when the hand-off comes."""
        self._loop, self._stop = loop, stop
        loop.add_reader(self._read_fd, self._take)
        if self.handoff is not None:  # taken between two workers
            stop()
        else:
            self._take()  # a signal that came before the reader was added

    def detach(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._read_fd)
        self._loop = self._stop = None

    def _drain(self) -> bool:
        got = False
        while True:
            try:
                got = bool(os.read(self._read_fd, 64)) or got
            except BlockingIOError:
                return got

    def _take(self) -> None:
        """Read the hand-off once a signal came; the first one counts, a repeat is ignored."""
        if not self._drain() or self.handoff is not None or not self.directory:
            return
        self.handoff = read_handoff(self.directory)
        if self.handoff is None:
            return
        log.warning("kept for the next gang as %s: leaving this gang", self.handoff.member_id)
        self._watchdog = threading.Timer(UNWIND_S, _give_up)
        self._watchdog.daemon = True
        self._watchdog.start()
        if self._stop is not None:
            self._stop()

    def wait(self, timeout_s: float) -> Handoff | None:
        """The hand-off, waiting up to ``timeout_s`` for it (between two workers)."""
        deadline = time.monotonic() + timeout_s
        while self.handoff is None:
            self._take()
            left = deadline - time.monotonic()
            if self.handoff is not None or left <= 0:
                break
            select.select([self._read_fd], [], [], left)
        return self.handoff

    def unwound(self) -> None:
        """The old worker has stopped: no more watchdog; the hook is done (the next worker of
        this process installs its own)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.directory:
            signal.signal(HANDOFF_SIGNAL, signal.SIG_IGN)  # before the pipe closes: its fd may be reused
        os.close(self._read_fd)
        os.close(self._write_fd)


def _give_up() -> None:
    # From the watchdog thread: no logging (its locks may be held), straight out; where every
    # thread was is written first (faulthandler writes to the fd itself), to tell what held it.
    os.write(2, f"the old gang's worker did not stop within {UNWIND_S:.0f} s of the hand-off: exiting\n".encode())
    faulthandler.dump_traceback(file=2, all_threads=True)
    os._exit(1)
