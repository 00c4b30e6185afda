"""A stand-in member process for controller tests: it does nothing until it is signalled, so a
test can start, adopt, kill and count members without importing torch.

SIGTERM ends it with code 0, race-free: the interpreter's C handler writes the signal to a pipe
(``signal.set_wakeup_fd``) that the main thread reads. A Python handler with ``signal.pause``
lost a SIGTERM that landed between the handler's check and the ``pause`` call (the process then
slept until SIGKILL; a loaded CI machine hit that once); ``sigwait`` with SIGTERM blocked in the
main thread alone loses it to another thread's default action (a spare that imported torch).
``idle ready`` in its log says it waits; a SIGTERM before that ends it by the default action."""

import os
import signal
import sys


def idle_until_sigterm() -> None:
    """Wait for SIGTERM, then exit 0 (one that came before the read is waiting in the pipe)."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd)
    signal.signal(signal.SIGTERM, lambda *_: None)  # caught; the pipe carries it
    print(f"idle ready pid={os.getpid()}", flush=True)
    while signal.SIGTERM not in os.read(read_fd, 64):
        pass
    sys.exit(0)


if __name__ == "__main__":
    idle_until_sigterm()
