"""A borrowed replica between its two roles: the replica's event loop has closed (which puts the
hand-off signal back to its default action, terminate) and the trainer rank has not started yet
(the engine thread's join, up to 10 s; for vLLM the policy's build). A hand-off signal that
keeps this rank for the next gang (another rank of the new gang crashed) killed the process
then. Real processes: the child runs the replica's own hook on a real loop, closes it, and takes
up the rank's hook; the test signals it in between and reads whether it
lived and kept the signal. The child runs ``replica.main`` itself (its replica and the
rank's start stood in for): the hook main installs and hands on is what is judged."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from robustrl.launcher.spare import HANDOFF_SIGNAL

CHILD = textwrap.dedent("""
    import asyncio, sys, types
    import robustrl.services.rollout.replica as replica_mod
    from robustrl.services.rollout.standby import Handoff, StandbyHook

    directory = sys.argv[1]

    class Borrowed:  # the replica: its real hand-off hook on a real loop, borrowed as it ends
        def __init__(self, ident, settings, env):
            self.standby = StandbyHook({"ROBUSTRL_HANDOFF_DIR": directory}, stop=lambda: None)
            self.model, self.engine_thread, self.stop_phase = object(), None, None

        async def run(self):
            self.standby.install(asyncio.get_running_loop())
            self.standby.handoff = Handoff({"ROBUSTRL_HANDOFF_DIR": directory}, "")

    def become_trainer(handoff, model, engine_thread, borrowed_from, hook=None):
        # the rank's start, up to which the window runs: the test signals the process here
        print("between roles", flush=True)
        sys.stdin.readline()
        print("alive, signal kept" if hook is not None and hook._drain() else "alive, signal lost", flush=True)

    replica_mod.Identity = types.SimpleNamespace(from_env=lambda env: types.SimpleNamespace(member_id="rollout-0-i0"))
    replica_mod.Settings = types.SimpleNamespace(from_env=lambda env: None)
    replica_mod.Replica, replica_mod.become_trainer = Borrowed, become_trainer
    replica_mod.main()  # the replica's own main: its loop closes, then the rank starts
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
