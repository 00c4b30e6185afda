"""Stand-in for the trainer's entry point in the Docker spare test image (``python -m
robustrl.services.trainer`` runs this there). It imports what the real entry point imports (torch
and the trainer's code, at module level: a spare imports it ahead, a cold start pays for it), then
reports from inside its container what it runs as and stays up until it is stopped."""

import os
import signal
import socket
import sys
import time

import robustrl.services.trainer.worker  # noqa: F401 - what the real entry point imports


def main() -> None:
    env = os.environ
    # SIGTERM caught into a pipe before the line a test waits for (race-free: tests/idle_member.py)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd)
    signal.signal(signal.SIGTERM, lambda *_: None)
    print(f"member pid={os.getpid()} argv={' '.join(sys.argv)} member={env.get('ROBUSTRL_MEMBER_ID')} "
          f"host={socket.gethostname()} bind={env.get('ROBUSTRL_BIND_HOST')} master={env.get('MASTER_ADDR')} "
          f"marker={env.get('ROBUSTRL_TEST_MARKER')} handoff_dir={env.get('ROBUSTRL_HANDOFF_DIR')} "
          f"secret={env.get('ROBUSTRL_TEST_SECRET')} at={time.time():.3f}", flush=True)
    while signal.SIGTERM not in os.read(read_fd, 64):
        pass
    sys.exit(0)


if __name__ == "__main__":
    main()
