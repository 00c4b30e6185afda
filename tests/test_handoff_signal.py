"""A borrowed replica between its two roles: the replica's event loop has closed (which puts the
hand-off signal back to its default action, terminate) and the trainer rank has not started yet
(the engine thread's join, up to 10 s; for vLLM the policy's build). A hand-off signal that
keeps this rank for the next gang (another rank of the new gang crashed) killed the process
then. Real processes: the child runs the replica's own hook on a real loop, closes it, and takes
up the rank's hook as ``replica.main`` does; the test signals it in between and reads whether it
lived and kept the signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from robustrl.launcher.spare import HANDOFF_SIGNAL

CHILD = textwrap.dedent("""
    import asyncio, os, sys, time
    from robustrl.services.rollout.standby import Handoff, StandbyHook, keep_listening

    async def serve():
        hook = StandbyHook({"ROBUSTRL_HANDOFF_DIR": sys.argv[1]}, stop=lambda: None)
        hook.install(asyncio.get_running_loop())
    asyncio.run(serve())
    hook = keep_listening(Handoff({"ROBUSTRL_HANDOFF_DIR": sys.argv[1]}, ""))
    print("between roles", flush=True)
    sys.stdin.readline()  # the test signals us meanwhile
    print("alive, signal kept" if hook._drain() else "alive, signal lost", flush=True)
""")


def test_a_hand_off_signal_between_the_two_roles_is_kept_not_fatal(tmp_path) -> None:  # type: ignore[no-untyped-def]
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        line = child.stdout.readline()
        assert line.strip() == "between roles", (line, child.stderr.read() if child.poll() is not None else "")
        os.kill(child.pid, HANDOFF_SIGNAL)
        child.stdin.write("go\n")
        child.stdin.flush()
        out, err = child.communicate(timeout=30)
        assert child.returncode == 0, (child.returncode, signal.Signals(-child.returncode).name
                                       if child.returncode < 0 else "", err[-500:])
        assert out.strip() == "alive, signal kept", (out, err[-500:])
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
