"""A trainer stand-in that fails when it runs in a warm spare (as spares broken alike would: a
stale spare image, a frozen zygote's forks) and idles like ``idle_member`` when started cold."""

import sys
from pathlib import Path

from idle_member import idle_until_sigterm

if __name__ == "__main__":
    if b"robustrl.launcher.spare" in Path("/proc/self/cmdline").read_bytes():
        print("started in a warm spare: exiting as a broken spare would", flush=True)
        sys.exit(3)
    idle_until_sigterm()
