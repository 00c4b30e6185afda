"""A borrow that goes wrong at its worst moment, with real processes and servers (issue 13).

* The hand-off fails after the replicas were drained and before they switched role: the drained
  replicas are killed (not left running untracked, 'dead' to every later stop), their ranks start
  as any other, their slots are restocked, and the recovery stays role-local.
* The request manager never acknowledges a drain (it is frozen through every attempt): the replica
  it may still send turns to is killed instead of training on the same model, its rank starts
  cold, and its rollout slot is restocked.
* The warm spare is frozen when it is handed the rank: nothing is ever heard from the new rank,
  which is a fault of its own after ``recovery.warm_start_s``; the rank starts again and the job
  recovers role-locally instead of waiting out ``recovery.deadline_s``.

Verdict from outside the controller: the member processes themselves (psutil), the raw event log,
and the auditor.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
from jobs import TERMINAL, kinds, small_job
from support import audit_sampled, eventually, sample_batches

from robustrl.audit.model import AuditOptions
from robustrl.client import ApiClient
from robustrl.launcher.spare import handoff_path
from robustrl.services.controller.runtime import RM_ACK_TIMEOUT_S
from robustrl.stack import Stack
from robustrl.supervisor import RestartPolicy

pytestmark = pytest.mark.timeout(300)
AUDIT = AuditOptions(redis_bound=False)
RM_ACK_ATTEMPTS = 4
"""The controller's attempts at a request-manager command here (10 by default): the frozen request
manager must outlast them all, and fewer make the freeze shorter."""
TOLERANT = {"detector": {"trainer_idle_s": 8.0, "rollout_idle_s": 5.0, "silence_s": 8.0, "probe_timeout_s": 3.0,
                         "metrics_interval_s": 0.5}}


@pytest.fixture(scope="module")
def own_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Servers and a control plane of this module alone; a frozen request manager is not judged
    hung (and replaced) before the controller's acknowledgement attempts have all run out."""
    st = Stack(tmp_path_factory.mktemp("standby-faults"), policy=RestartPolicy(hang_timeout_s=90.0),
               service_extra_env={"controller": {"ROBUSTRL_RM_ACK_ATTEMPTS": str(RM_ACK_ATTEMPTS)}})
    st.start()
    try:
        yield st
    finally:
        st.stop()


@pytest.fixture(scope="module")
def api(own_stack: Stack) -> Iterator[ApiClient]:
    assert own_stack.settings
    client = ApiClient(own_stack.api_url, own_stack.settings.api_token)
    try:
        yield client
    finally:
        client.close()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _replica_pids(status: dict[str, Any]) -> dict[str, int]:
    return {m["member_id"]: m["pid"] for m in status["members"]
            if m["role"] == "rollout" and m["state"] not in ("dead", "exited", "stopped")}


def _wait(api: ApiClient, jid: str, step: int) -> dict[str, Any]:
    return eventually(lambda: (s := api.job(jid))["committed_step"] >= step and s, timeout=120, interval=0.1,
                      what=f"step {step}")


def _done(api: ApiClient, jid: str) -> dict[str, Any]:
    status = eventually(lambda: (s := api.job(jid))["status"] in TERMINAL and s, timeout=240, interval=0.25,
                        what="job ended")
    assert status["status"] == "finished", status.get("error")
    return status


def test_a_hand_off_failing_after_the_drain_kills_the_drained_replicas_and_starts_their_ranks(
        own_stack: Stack, api: ApiClient) -> None:
    """The worst moment: the borrowed replicas are drained (the request manager re-dispatches their
    turns and never sends them another) and the hand-off that would switch them cannot be written
    (a directory stands where the file goes). None of the drained processes runs on, untracked:
    each is killed, its rank starts as any other, its slot gets a new replica, and the recovery
    ends role-locally (before this session the failed hand-off failed the gang start into a
    whole-job restart, which this test then expected). The job finishes, the auditor passes."""
    spec = small_job("borrowfail", steps=14, mode="semi_sync", staleness=1, rollout={"replicas": 3},
                     recovery={"min_replicas_kept": 1, "keep_survivors": False}, tools={"latency_s": 0.5}, data={"tasks": ["lookup"]},
                     **TOLERANT)
    jid = api.submit(spec)["job_id"]
    sampler = sample_batches(own_stack.settings.redis_url, jid)
    pids = _replica_pids(_wait(api, jid, 2))
    assert len(pids) == 3, pids
    log_dir = own_stack.run_dir / "logs"
    blockers = [handoff_path(log_dir, pid) for pid in pids.values()]
    for b in blockers:
        b.mkdir()
    try:
        api.fault(jid, kind="crash", role="trainer", member=0)

        def drained_then_recovered() -> list[dict[str, Any]] | None:
            events = api.events(jid)
            return kinds(events, "replica_borrowed") and [
                d for d in kinds(events, "recovered") if d["kind"] == "trainer"] or None

        [recovered] = eventually(drained_then_recovered, timeout=90, interval=0.1,
                                 what="borrow, failed hand-off, recovery")
        borrowed = [d["member_id"] for d in kinds(api.events(jid), "replica_borrowed")]
        assert len(borrowed) == 2, borrowed
        # Killed when the hand-off failed: none of the drained processes runs on, untracked.
        eventually(lambda: not any(_alive(pids[m]) for m in borrowed), timeout=10, interval=0.05,
                   what="the drained replicas killed")
        status = _done(api, jid)
    finally:
        for b in blockers:
            with contextlib.suppress(OSError):
                b.rmdir()
    events = api.events(jid)
    assert not kinds(events, "role_switched"), kinds(events, "role_switched")
    assert "borrowed" not in recovered["sources"], recovered
    assert not [d for d in kinds(events, "decision") if "RestartWholeJob" in d["actions"]], kinds(events, "decision")
    # the borrowed slots got new replicas, none of them an old process; the third slot kept its own
    now = {m["member_id"]: m["pid"] for m in status["members"]}
    for mid in borrowed:
        slot = mid.split("-")[1]
        assert f"rollout-{slot}-i1" in now and now[f"rollout-{slot}-i1"] not in pids.values(), now
    [kept] = set(pids) - set(borrowed)
    assert f"rollout-{kept.split('-')[1]}-i1" not in now, now
    assert own_stack.settings
    audit_sampled(own_stack.settings, jid, sampler, AUDIT)


def test_a_drain_the_request_manager_never_acknowledges_kills_the_replica_and_restocks(
        own_stack: Stack, api: ApiClient) -> None:
    spec = small_job("borrowunacked", steps=22, mode="semi_sync", staleness=1, rollout={"replicas": 3},
                     recovery={"min_replicas_kept": 1, "keep_survivors": False}, tools={"latency_s": 0.5}, data={"tasks": ["lookup"]},
                     detector={"trainer_idle_s": 60.0, "rollout_idle_s": 60.0, "silence_s": 60.0,
                               "probe_timeout_s": 3.0, "metrics_interval_s": 0.5})
    jid = api.submit(spec)["job_id"]
    sampler = sample_batches(own_stack.settings.redis_url, jid)
    pids = _replica_pids(_wait(api, jid, 2))
    # The worst moment: the request manager is frozen from just before the trainer fault, through
    # every acknowledgement attempt of the drain, so it never hears that the replicas left the pool.
    freeze_s = RM_ACK_ATTEMPTS * RM_ACK_TIMEOUT_S + 6.0
    t_freeze = time.time()
    rm_pid = own_stack.hang_service("request_manager", freeze_s)
    api.fault(jid, kind="crash", role="trainer", member=0)
    eventually(lambda: kinds(api.events(jid), "replica_borrowed"), timeout=30, interval=0.1, what="a borrow")
    borrowed = [d["member_id"] for d in kinds(api.events(jid), "replica_borrowed")]
    assert len(borrowed) == 2, borrowed
    # Killed once the attempts ran out, while the request manager is still frozen.
    eventually(lambda: not any(_alive(pids[m]) for m in borrowed), timeout=freeze_s + 10, interval=0.1,
               what="the unacknowledged replicas killed")
    killed_at = time.time()
    assert killed_at < t_freeze + freeze_s + 1.0, "killed only after the request manager woke"
    assert psutil.Process(rm_pid).status() == psutil.STATUS_STOPPED  # the same frozen process
    status = _done(api, jid)
    events = api.events(jid)
    assert own_stack.pids()["request_manager"] == rm_pid, "the request manager was restarted"
    notes = [d["text"] for d in kinds(events, "note")]
    assert "request manager never acknowledged replica_dead" in notes, notes
    assert not kinds(events, "role_switched")  # neither switched role: both ranks started cold
    started = {d["member_id"]: d for d in kinds(events, "member_started")}
    assert {started[f"trainer-e2-r{r}"]["source"] for r in (0, 1)} == {"cold"}, started
    # Each killed replica's slot restocked once, and the new incarnation loaded weights.
    slots = sorted(int(m.split("-")[1]) for m in borrowed)
    assert sorted(d["slot"] for d in kinds(events, "replica_restocked")) == slots
    loaded = {d["member_id"] for d in kinds(events, "weights_loaded")}
    assert {f"rollout-{s}-i1" for s in slots} <= loaded, sorted(loaded)
    assert {f"rollout-{s}-i1" for s in slots} <= {m["member_id"] for m in status["members"]}
    assert own_stack.settings
    audit_sampled(own_stack.settings, jid, sampler, AUDIT)



def test_a_replica_hung_just_before_the_trainer_fault_is_not_borrowed(own_stack: Stack, api: ApiClient) -> None:
    """The worst moment: two of three replicas freeze (SIGSTOP, as chaos ``hang`` does) just
    before the trainer rank crashes, well inside the detector's silence bound, so they still look
    ready. Before: one of them was borrowed (the newest weights, then the highest slot), its
    process never took the hand-off, the new gang never formed, and the job was stuck until the
    recovery's deadline (a reduced campaign: 80 s, then a whole-job restart). Now the controller
    probes the replicas it could borrow and borrows only one that answers: the new rank comes
    from the one healthy replica, the gang recovers role-locally, and the frozen replicas are
    left to the detector (reported hung, replaced)."""
    spec = small_job("borrowhung", steps=10, mode="semi_sync", staleness=1, rollout={"replicas": 3},
                     trainer={"workers": 1}, recovery={"min_replicas_kept": 1, "keep_survivors": False},
                     tools={"latency_s": 0.5}, data={"tasks": ["lookup"]}, **TOLERANT)
    jid = api.submit(spec)["job_id"]
    sampler = sample_batches(own_stack.settings.redis_url, jid)
    pids = _replica_pids(_wait(api, jid, 2))
    assert sorted(pids) == [f"rollout-{s}-i0" for s in range(3)], pids
    hung = ["rollout-1-i0", "rollout-2-i0"]
    try:
        for m in hung:
            psutil.Process(pids[m]).suspend()
        t_fault = time.time()
        api.fault(jid, kind="crash", role="trainer", member=0)

        def recovered() -> list[dict[str, Any]]:
            return [d for d in kinds(api.events(jid), "recovered") if d["kind"] == "trainer"]

        eventually(recovered, timeout=60, interval=0.1, what="the trainer gang recovered")
        assert time.time() - t_fault < 45, "recovered only after a deadline ran out"
    finally:
        for m in hung:
            with contextlib.suppress(psutil.Error):
                psutil.Process(pids[m]).resume()
    status = _done(api, jid)
    events = api.events(jid)
    started = {d["member_id"]: d for d in kinds(events, "member_started")}
    rank0 = started["trainer-e2-r0"]
    assert rank0["borrowed_from"] not in hung, rank0
    assert [d["member_id"] for d in kinds(events, "replica_borrowed")] in ([], ["rollout-0-i0"]), \
        kinds(events, "replica_borrowed")
    decisions = [d for d in kinds(events, "decision") if d["actions"] != ["Ignore"]]
    assert not [d for d in decisions if "RestartWholeJob" in d["actions"]], decisions
    assert status["committed_step"] == spec["steps"] - 1
    assert own_stack.settings
    audit_sampled(own_stack.settings, jid, sampler, AUDIT)


WARM_START_S = 3.0
SPARE_LOG = re.compile(r"spare-\d+\.log$")


def _waiting_spares(stack: Stack) -> set[int]:
    """Warm spares of this stack's launcher still waiting for an order: processes whose output
    goes to a ``spare-N.log`` of its run dir (a cold spare's command line names its module, a
    forked one's is the zygote's; a spare that took its order writes to its member's log)."""
    root = str(stack.run_dir)
    found = set()
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.status() != psutil.STATUS_ZOMBIE and any(
                    f.path.startswith(root) and SPARE_LOG.search(f.path) for f in p.open_files()):
                found.add(p.pid)
    return found


def test_a_warm_spare_frozen_when_it_is_handed_the_rank_is_replaced_long_before_the_deadline(
        own_stack: Stack, api: ApiClient) -> None:
    """The worst moment for a warm spare: frozen (SIGSTOP) just before the trainer rank crashes,
    so the new gang's rank is a process that never reads its order and never says a word. Before:
    only ``recovery.deadline_s`` (here 120 s) bounded it, then the job was restarted whole. Now
    nothing heard from a warm rank ``recovery.warm_start_s`` after its start is a fault of its
    own: the frozen process is killed, the rank starts again, the recovery stays role-local."""
    spec = small_job("sparefrozen", steps=8, trainer={"workers": 1},
                     recovery={"warm_spares": 1, "warm_start_s": WARM_START_S, "deadline_s": 120.0},
                     **TOLERANT)
    jid = api.submit(spec)["job_id"]
    sampler = sample_batches(own_stack.settings.redis_url, jid)
    _wait(api, jid, 1)
    (frozen,) = eventually(lambda: _waiting_spares(own_stack), timeout=60, interval=0.25, what="a waiting spare")
    try:
        psutil.Process(frozen).suspend()
        t_fault = time.time()
        api.fault(jid, kind="crash", role="trainer", member=0)

        def silent_reported() -> list[dict[str, Any]]:
            return [d for d in kinds(api.events(jid), "fault_detected") if "started warm" in d["evidence"]]

        (silent,) = eventually(silent_reported, timeout=WARM_START_S + 30, interval=0.2,
                               what="the silent warm rank reported")
        assert time.time() - t_fault < WARM_START_S + 30
        eventually(lambda: not _alive(frozen), timeout=20, interval=0.1, what="the frozen spare killed")
    finally:
        with contextlib.suppress(psutil.Error):
            psutil.Process(frozen).kill()
    status = _done(api, jid)
    events = api.events(jid)
    started = {d["member_id"]: d for d in kinds(events, "member_started")}
    assert started[silent["member_id"]]["warm"] is True, started  # the frozen spare took the rank
    assert "warm (spare)" in silent["evidence"], silent
    # (in the log: a leader that takes over before it is handled must not escalate it either)
    assert silent["cause"] == "warm_start_silent", silent
    decisions = [d["actions"] for d in kinds(events, "decision") if d["actions"] != ["Ignore"]]
    assert decisions == [["RestartTrainerGang"], ["RestartTrainerGang"]], decisions
    recovered = [d for d in kinds(events, "recovered") if d["kind"] == "trainer"]
    assert recovered and recovered[-1]["recovery_s"] < WARM_START_S + 60, recovered
    assert status["committed_step"] == spec["steps"] - 1
    assert own_stack.settings
    audit_sampled(own_stack.settings, jid, sampler, AUDIT)
