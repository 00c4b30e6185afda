"""A stand-in member that a launcher can switch in place (``Launcher.relabel``): like
``idle_member`` it does nothing until SIGTERM, and it survives the hand-off signal (a real member
re-execs as its new id there; this one just keeps running under it)."""

import signal

from idle_member import idle_until_sigterm

if __name__ == "__main__":
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # robustrl.launcher.spare.HANDOFF_SIGNAL
    idle_until_sigterm()
