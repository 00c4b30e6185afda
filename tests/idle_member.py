"""A stand-in member process for controller tests: it does nothing until it is signalled, so a
test can start, adopt, kill and count members without importing torch."""

import signal
import sys


def _exit(*_: object) -> None:
    sys.exit(0)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _exit)
    while True:
        signal.pause()
