"""A stand-in member that a launcher can switch in place (``Launcher.relabel``): like
``idle_member`` it does nothing until SIGTERM, and it survives the hand-off signal (a real member
re-execs as its new id there; this one just keeps running under it)."""

import signal
import sys


def _exit(*_: object) -> None:
    sys.exit(0)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _exit)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # robustrl.launcher.spare.HANDOFF_SIGNAL
    while True:
        signal.pause()
