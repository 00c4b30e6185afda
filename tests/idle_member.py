"""A stand-in member process for controller tests: it does nothing until it is signalled, so a
test can start, adopt, kill and count members without importing torch.

SIGTERM ends it with code 0. It is blocked and then waited for with ``sigwait``: a handler with
``signal.pause`` loses a SIGTERM that lands between the handler's check and the ``pause`` call (the
process then sleeps until SIGKILL; a loaded CI machine hit that once). ``idle ready`` in its log
says SIGTERM is blocked from then on; one sent before that ends it by the default action (-15)."""

import os
import signal
import sys


def idle_until_sigterm() -> None:
    """Block SIGTERM, say so, and exit 0 once it comes (race-free: ``sigwait`` takes a pending one)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    print(f"idle ready pid={os.getpid()}", flush=True)
    signal.sigwait({signal.SIGTERM})
    sys.exit(0)


if __name__ == "__main__":
    idle_until_sigterm()
