"""A trainer rank kept for the next gang when its gang broke under it (``recovery.keep_survivors``).

Real servers, a supervised control plane of this module's own, real member processes. The
controller is frozen by a failpoint at the worst moment for the kept rank (``gang_planned``: the
crashed rank's gang is broken, nothing is handed over yet), so the kept rank's own collective with
the dead rank fails first and it must wait for its hand-off instead of exiting:

1. the hand-off comes while it waits: the same process (pid) runs on as rank 0 of the next gang;
2. the hand-off comes after ``recovery.survivor_wait_s``: the rank has exited by itself, the
   controller sees that it is gone, starts that rank anew, and the job still finishes.

Verdict from outside the controller: the member's own log, the process table, the raw event log
and the auditor.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from jobs import kinds, small_job, wait_done, wait_step
from robustrl.services.controller.failpoints import ENV as FAILPOINTS_ENV
from support import audit_sampled, eventually, eventually_async, sample_batches

from robustrl.audit.model import AuditOptions
from robustrl.client import ApiClient
from robustrl.stack import Stack
from robustrl.supervisor import RestartPolicy

pytestmark = pytest.mark.timeout(300)
WAIT_S = 4.0
TOLERANT = {"trainer_idle_s": 20.0, "rollout_idle_s": 20.0, "silence_s": 20.0, "probe_timeout_s": 3.0,
            "metrics_interval_s": 0.5}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Servers and a control plane of this module alone; its controller freezes itself the first
    two times a trainer recovery has a rank to keep, and its lease outlives the freeze (a lease
    lost while frozen is tests/test_controller_failover.py's matter: here the recovery goes on)."""
    st = Stack(tmp_path_factory.mktemp("survivor"), policy=RestartPolicy(hang_timeout_s=60.0),
               service_extra_env={"controller": {FAILPOINTS_ENV: "gang_planned,gang_planned",
                                                 "ROBUSTRL_LEASE_TTL_S": "60"}})
    st.start()
    try:
        yield st
    finally:
        # A test failing while the controller is frozen at its failpoint: thawed, it stops its
        # members (Stack.stop kills whatever it left too).
        ctl = st.pids().get("controller")
        if ctl:
            with contextlib.suppress(ProcessLookupError):
                os.kill(ctl, signal.SIGCONT)
        st.stop()


def _status(pid: int) -> str:
    try:
        return str(psutil.Process(pid).status())
    except psutil.NoSuchProcess:
        return "gone"


def _log(stack: Stack, job_id: str, member: str) -> str:
    path = Path(stack.run_dir) / "logs" / f"{job_id}--{member}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def _members(api: ApiClient, job_id: str) -> dict[str, dict[str, Any]]:
    return {m["member_id"]: m for m in api.job(job_id)["members"]}


def _frozen_at_failpoint(stack: Stack) -> int:
    ctl = stack.pids()["controller"]
    eventually(lambda: _status(ctl) == psutil.STATUS_STOPPED, timeout=60, interval=0.05,
               what="the controller frozen at gang_planned")
    return ctl


def test_the_hand_off_signal_is_taken_once_and_in_ordinary_code(tmp_path: Path) -> None:
    """The signal handler only wakes a pipe; the hand-off file is read when a worker attaches (a
    signal before it did), by the worker's loop, or by ``wait`` between workers; the first one
    counts, a repeat is ignored, a signal without a file is ignored."""
    import asyncio

    from robustrl.launcher.spare import HANDOFF_ENV, HANDOFF_SIGNAL, write_handoff
    from robustrl.services.trainer.survivor import SurvivorHook

    before = signal.getsignal(HANDOFF_SIGNAL)
    hook = SurvivorHook({HANDOFF_ENV: str(tmp_path)})
    hook.install()
    loop = asyncio.new_event_loop()
    try:
        assert hook.wait(0.05) is None
        os.kill(os.getpid(), HANDOFF_SIGNAL)  # no hand-off file: ignored
        assert hook.wait(0.05) is None
        write_handoff(tmp_path, os.getpid(), {"ROBUSTRL_MEMBER_ID": "trainer-e2-r0"}, "x.log")
        os.kill(os.getpid(), HANDOFF_SIGNAL)  # before a worker is attached
        stopped: list[int] = []
        hook.attach(loop, lambda: stopped.append(1))
        assert hook.handoff is not None and hook.handoff.member_id == "trainer-e2-r0" and stopped == [1]
        write_handoff(tmp_path, os.getpid(), {"ROBUSTRL_MEMBER_ID": "trainer-e3-r0"}, "y.log")
        os.kill(os.getpid(), HANDOFF_SIGNAL)
        # the loop's reader drains the wake-up byte
        loop.run_until_complete(eventually_async(lambda: not select.select([hook._read_fd], [], [], 0)[0],
                                                 timeout=10, interval=0.01, what="the wake-up drained"))
        assert hook.handoff.member_id == "trainer-e2-r0" and stopped == [1]
        hook.detach()
        assert hook.wait(10.0) is hook.handoff  # at once: it has one
    finally:
        if hook._watchdog is not None:
            hook._watchdog.cancel()  # it would end this process
        loop.close()
        signal.signal(HANDOFF_SIGNAL, before)


def test_a_zombie_is_not_a_running_member_even_while_another_thread_reaps_it() -> None:
    import subprocess
    import sys

    from robustrl.launcher.local import _running

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        eventually(lambda: _status(proc.pid) == psutil.STATUS_ZOMBIE, timeout=20, interval=0.02,
                   what="the child exited, not reaped")
        with proc._waitpid_lock:  # another thread reaping: poll() says nothing (None)
            assert proc.poll() is None
            assert not _running(proc)
    finally:
        proc.wait()


def test_a_rank_whose_gang_broke_waits_for_its_hand_off_and_gives_up_after_the_bound(stack: Stack) -> None:
    assert stack.settings
    api = ApiClient(stack.api_url, stack.settings.api_token)
    spec = small_job("survivor", steps=14, mode="sync", tools={"latency_s": 0.3}, data={"tasks": ["lookup"]},
                     recovery={"survivor_wait_s": WAIT_S}, detector=TOLERANT)
    jid = api.submit(spec)["job_id"]
    sampler = sample_batches(stack.settings.redis_url, jid)
    wait_step(api, jid, 2)
    kept_pid = _members(api, jid)["trainer-e1-r0"]["pid"]

    # 1. Rank 1 crashes (SIGKILL from here: an API call could be cut off by the freeze); the
    # controller stops between seeing it and handing rank 0 over.
    os.kill(_members(api, jid)["trainer-e1-r1"]["pid"], signal.SIGKILL)
    ctl = _frozen_at_failpoint(stack)
    # Rank 0's next collective with the dead rank fails: it waits for a hand-off, not exiting.
    eventually(lambda: "the gang broke" in _log(stack, jid, "trainer-e1-r0"), timeout=60, interval=0.1,
               what="rank 0 saw its gang break")
    assert _status(kept_pid) not in ("gone", psutil.STATUS_ZOMBIE)
    os.kill(ctl, signal.SIGCONT)
    first = wait_step(api, jid, api.job(jid)["committed_step"] + 1)
    now = _members(api, jid)
    assert now["trainer-e2-r0"]["pid"] == kept_pid, (kept_pid, now["trainer-e2-r0"])
    assert "continues as trainer-e2-r0" in _log(stack, jid, "trainer-e2-r0")
    # The broken gang's worker was freed before the next one began (its DDP wrapper is gone: a
    # leftover reducer would hook the same parameters), with the break's traceback in the log.
    old_log = _log(stack, jid, "trainer-e1-r0")
    assert "released the broken gang's worker" in old_log and "Traceback" in old_log, old_log[-2000:]

    # 2. Again at a later step, but the controller stays frozen until the kept rank has given up.
    wait_step(api, jid, first["committed_step"] + 2)
    os.kill(_members(api, jid)["trainer-e2-r1"]["pid"], signal.SIGKILL)
    ctl = _frozen_at_failpoint(stack)
    eventually(lambda: "the gang broke" in _log(stack, jid, "trainer-e2-r0"), timeout=60, interval=0.1,
               what="the kept rank saw its second gang break")
    eventually(lambda: _status(kept_pid) in ("gone", psutil.STATUS_ZOMBIE), timeout=WAIT_S + 30, interval=0.1,
               what=f"the rank gave up after survivor_wait_s={WAIT_S}")
    assert "not kept for a next gang: exiting" in _log(stack, jid, "trainer-e2-r0")
    os.kill(ctl, signal.SIGCONT)
    wait_done(api, jid, timeout=240)
    events = api.events(jid)
    audit_sampled(stack.settings, jid, sampler, AuditOptions(redis_bound=False))

    started = {d["member_id"]: d for d in kinds(events, "member_started")}
    assert started["trainer-e2-r0"]["source"] == "survivor", started["trainer-e2-r0"]
    # The rank that gave up is started anew; no whole-job restart, one gang restart per fault.
    assert started["trainer-e3-r0"]["source"] in ("cold", "spare"), started["trainer-e3-r0"]
    decisions = [d["actions"] for d in kinds(events, "decision") if d["actions"] != ["Ignore"]]
    assert decisions == [["RestartTrainerGang"], ["RestartTrainerGang"]], decisions
    assert sorted({d["step"] for d in kinds(events, "step_committed")}) == list(range(14))
    api.close()


_UNWIND_CHILD = """
import os, sys, time
from robustrl.services.trainer import survivor
survivor.UNWIND_S = 0.5
from robustrl.launcher.spare import HANDOFF_ENV, HANDOFF_SIGNAL, write_handoff
hook = survivor.SurvivorHook({HANDOFF_ENV: sys.argv[1]})
hook.install()
write_handoff(sys.argv[1], os.getpid(), {"ROBUSTRL_MEMBER_ID": "trainer-e2-r0"}, "x.log")
os.kill(os.getpid(), HANDOFF_SIGNAL)
assert hook.wait(10) is not None
print("taken", flush=True)
if sys.argv[2] == "unwinds":
    hook.unwound()
time.sleep(3.0)  # 6x the bound: a worker that never unwinds, or the next one running after
print("still here", flush=True)
"""


@pytest.mark.parametrize("case", ["blocked", "unwinds"])
def test_a_rank_whose_old_worker_never_unwinds_exits_after_the_bound(tmp_path: Path, case: str) -> None:
    """The watchdog started with the hand-off: a process whose old worker is still stuck (in a
    collective with a rank alive somewhere) ``UNWIND_S`` after it exits with status 1 and says
    why; one that unwound in time runs on."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _UNWIND_CHILD, str(tmp_path), case], capture_output=True,
                          text=True, timeout=60)
    assert "taken" in proc.stdout, (proc.stdout, proc.stderr)
    if case == "blocked":
        assert proc.returncode == 1 and "still here" not in proc.stdout, (proc.returncode, proc.stdout)
        assert "did not stop within" in proc.stderr, proc.stderr
    else:
        assert proc.returncode == 0 and "still here" in proc.stdout, (proc.returncode, proc.stdout, proc.stderr)
