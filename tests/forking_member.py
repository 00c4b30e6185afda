"""A stand-in member that starts one child (it inherits the member's environment and session),
then waits until signalled: a launcher looking members up must take the member, never its child."""

import subprocess
import sys

from idle_member import idle_until_sigterm

if __name__ == "__main__":
    child = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    print(f"child pid={child.pid}", flush=True)
    idle_until_sigterm()
