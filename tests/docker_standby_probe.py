"""Stand-in for the rollout replica's entry point in the Docker standby test image
(``python -m robustrl.services.rollout`` runs this there): the real ``StandbyHook`` waits for the
launcher's hand-off; the process then reports, from inside its container, what it was handed and
that the trainer's code and torch are there, and stays up as the rank until it is stopped."""

import asyncio
import os
import signal
import sys

from robustrl.services.rollout.standby import StandbyHook


async def _wait_for_handoff() -> StandbyHook:
    stopped = asyncio.Event()
    hook = StandbyHook(os.environ, stopped.set)
    hook.install(asyncio.get_running_loop())
    print(f"replica ready pid={os.getpid()} member={os.environ.get('ROBUSTRL_MEMBER_ID')}", flush=True)
    await stopped.wait()
    return hook


def main() -> None:
    hook = _wait_for_handoff_sync()
    assert hook.handoff is not None
    env = hook.handoff.env
    import torch  # noqa: F401 - the trainer's dependencies are in this container

    import robustrl.services.trainer.worker  # noqa: F401 - and the trainer's code
    # SIGTERM caught into a pipe before the line a test waits for (race-free: tests/idle_member.py)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd)
    signal.signal(signal.SIGTERM, lambda *_: None)
    left = sorted(f for f in os.listdir(hook.directory or "/tmp") if f.startswith("handoff-"))
    print(f"switched pid={os.getpid()} member={env.get('ROBUSTRL_MEMBER_ID')} rank={env.get('ROBUSTRL_RANK')} "
          f"bind={env.get('ROBUSTRL_BIND_HOST')} master={env.get('MASTER_ADDR')} "
          f"marker={env.get('ROBUSTRL_TEST_MARKER')} handoff_files_left={len(left)}", flush=True)
    while signal.SIGTERM not in os.read(read_fd, 64):
        pass
    sys.exit(0)


def _wait_for_handoff_sync() -> StandbyHook:
    return asyncio.run(_wait_for_handoff())


if __name__ == "__main__":
    main()
