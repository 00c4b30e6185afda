"""Warm standby from the rollout pool (issue 13), with real processes and servers.

A trainer fault in an overlapped mode is repaired by borrowing ready rollout replicas: each is
drained (its in-flight turns re-dispatched from their prefixes), switches role in place and
joins the new gang as rank r; a replacement replica restocks the pool. Checked from the raw
event log, a raw NATS observer and the auditor, never from the controller's own state. Plus the
off-policy loss against a hand computation, and the stale-turn drop.
"""

from __future__ import annotations

import asyncio
import math
import threading
from typing import Any

import pytest
import torch
from jobs import TERMINAL, kinds, small_job, wait_done, wait_step
from support import BusObserver, audit_sampled, ended, eventually, eventually_async, sample_batches

from robustrl.bus import Bus
from robustrl.messages import MetricsSample, TurnResult, WeightsHave, decode
from robustrl.rl import grpo
from robustrl.rl.tasks import Prompt, Turn
from robustrl.subjects import Verb, subject, wildcard

pytestmark = pytest.mark.timeout(240)


async def _publish_have(url: str, job_id: str, member_id: str) -> None:
    bus = await Bus.connect(url, "test-ghost-have")
    try:
        await bus.publish(subject(job_id, Verb.HAVE, member_id), WeightsHave(
            job_id=job_id, member_id=member_id, version=10_000, address="127.0.0.1:9", checksum="x"))
    finally:  # close drains: the HAVE has left
        await bus.close()


def _ts(events: list[dict[str, Any]], kind: str) -> list[tuple[float, dict[str, Any]]]:
    return [(e["ts"], e["data"]) for e in events if e["kind"] == kind]


def test_borrowed_replicas_become_trainer_ranks_and_the_pool_is_restocked(api, infra):
    # Tool calls of 1 s make steps (~1.5 s) long enough for the cold replacements to start and load
    # before the end (with 0.5 s calls and 16 steps the job ended 12 s after they started, still
    # importing, on two cores shared at load ~8).
    spec = small_job("borrow", steps=24, mode="semi_sync", staleness=1, rollout={"replicas": 3},
                     recovery={"min_replicas_kept": 1, "keep_survivors": False}, tools={"latency_s": 1.0}, data={"tasks": ["lookup"]})
    jid = api.submit(spec)["job_id"]
    sampler = sample_batches(infra.redis_url, jid)
    with BusObserver(infra.nats_url, [wildcard(jid, Verb.GENERATE)]) as gen:
        wait_step(api, jid, 2)
        api.fault(jid, kind="crash", role="trainer", member=0)

        def restocked() -> bool:
            events = api.events(jid)
            new = {d["member_id"] for d in kinds(events, "replica_restocked")}
            return len(new) == 2 and new <= {d["member_id"] for d in kinds(events, "weights_loaded")}

        eventually(lambda: restocked() or api.job(jid)["status"] in TERMINAL, timeout=120, interval=0.25,
                   what="both borrowed slots restocked and loaded")
        assert restocked(), "the job ended before the pool was back to its size"
        # A late, complete HAVE in a borrowed replica's name (a pull that finished as it was
        # drained) must not bring it back into the pool; the job goes on for steps after it.
        ghost = next(d["member_id"] for d in kinds(api.events(jid), "replica_borrowed"))
        asyncio.run(_publish_have(infra.nats_url, jid, ghost))
        # Three more steps commit after it (the ghost is not dispatched to), then the job is
        # stopped: its finishing after a borrow is the other standby tests' business, and the
        # remaining steps would only add time.
        wait_step(api, jid, min(api.job(jid)["committed_step"] + 3, spec["steps"] - 1))
        api.stop(jid)
        ended = eventually(lambda: (s := api.job(jid))["status"] in TERMINAL and s, timeout=60, interval=0.2,
                           what="the job stopped")
        assert ended["status"] in ("stopped", "finished"), ended.get("error")  # finished: it was the last step
    states = {m["member_id"]: m["state"] for m in api.job(jid)["members"]}
    assert states[ghost] == "dead", states
    events = api.events(jid)
    audit_sampled(infra, jid, sampler)

    decisions = [d for d in kinds(events, "decision") if d["actions"] != ["Ignore"]]
    assert [d["actions"] for d in decisions] == [["RestartTrainerGang"]], decisions
    borrowed = {d["member_id"]: d["rank"] for d in kinds(events, "replica_borrowed")}
    assert len(borrowed) == 2, borrowed  # 3 replicas, 1 kept generating: both ranks borrowed
    # Each borrowed process joined the new gang as the rank it was given, in place.
    switched = {d["from_member"]: d for d in kinds(events, "role_switched")}
    assert set(switched) == set(borrowed)
    for replica, rank in borrowed.items():
        assert switched[replica]["member_id"] == f"trainer-e2-r{rank}" and switched[replica]["rank"] == rank
    started = {d["member_id"]: d for d in kinds(events, "member_started")}
    assert {started[f"trainer-e2-r{r}"]["source"] for r in (0, 1)} == {"borrowed"}
    recovered = [d for d in kinds(events, "recovered") if d["kind"] == "trainer"]
    assert recovered and recovered[0]["source"] == "borrowed" and recovered[0]["recovery_s"] > 0
    # The pool is back to its size: a new incarnation of every borrowed slot started and loaded
    # weights (raw event log).
    loaded = {d["member_id"] for d in kinds(events, "weights_loaded")}
    for replica in borrowed:
        slot = replica.split("-")[1]
        assert f"rollout-{slot}-i1" in started and f"rollout-{slot}-i1" in loaded, (slot, sorted(loaded))
    # Fencing: once drained, a borrowed replica is never sent a turn again (raw bus).
    drained_at = min(ts for ts, d in _ts(events, "replica_borrowed"))
    late = [(t, s) for t, s, _ in gen.seen if t > drained_at + 0.5 and s.rsplit(".", 1)[-1] in borrowed]
    assert not late, late
    assert any(s.rsplit(".", 1)[-1] in borrowed for _, s, _ in gen.seen), "observer saw no turn to them at all"


def test_async_job_keeps_generating_during_a_trainer_recovery(api, infra):
    spec = small_job("asyncgen", steps=9, mode="async", staleness=2, rollout={"replicas": 3})
    jid = api.submit(spec)["job_id"]
    sampler = sample_batches(infra.redis_url, jid)
    with BusObserver(infra.nats_url, [wildcard(jid, Verb.METRICS), subject(jid, Verb.TURN)]) as obs:
        wait_step(api, jid, 2)
        api.fault(jid, kind="crash", role="trainer", member=1)
        wait_done(api, jid)
    events = api.events(jid)
    audit_sampled(infra, jid, sampler)
    detected = min(ts for ts, d in _ts(events, "fault_detected") if d["role"] == "trainer")
    done = min(ts for ts, d in _ts(events, "recovered") if d["kind"] == "trainer")
    # Tokens decoded by the replicas that were not borrowed, from their raw metrics samples.
    borrowed = {d["member_id"] for d in kinds(events, "replica_borrowed")}
    # The recovery under test is the borrowed one (a cold gang would leave every replica generating).
    assert borrowed, "no replica was borrowed"
    assert [d["source"] for d in kinds(events, "recovered") if d["kind"] == "trainer"][:1] == ["borrowed"]
    per_member: dict[str, list[tuple[float, int]]] = {}
    turns = [decode(TurnResult, data, subj) for _, subj, data in obs.seen if subj.endswith(".turn")]
    assert turns, "no turn observed"
    # Every generated turn carries its behaviour version and one logprob per token.
    assert all(t.weights_version >= 0 and len(t.logprobs) == len(t.token_ids) for t in turns)
    for t, subj, data in obs.seen:
        if subj.endswith(".turn"):
            continue
        m = decode(MetricsSample, data, subj)
        if m.role == "rollout" and m.member_id not in borrowed:
            per_member.setdefault(m.member_id, []).append((t, m.tokens_total))

    def tokens_at(t: float) -> int:
        return sum(max((n for ts, n in s if ts <= t), default=0) for s in per_member.values())

    assert done > detected
    rose = tokens_at(done) - tokens_at(detected)
    assert rose > 0, f"no token decoded during the {done - detected:.2f}s recovery"


def test_a_crashed_ranks_peer_is_kept_in_place_and_only_the_failed_rank_starts_anew(api, infra):
    """``recovery.keep_survivors``: rank 1 is killed while rank 0 trains (rank 0's collective with
    it fails under it); rank 0's process leaves the broken gang and joins the next one as rank 0 in
    place (same pid, the model it had), and only rank 1 starts anew. Sync mode: nothing is
    borrowed, so the kept rank is the only in-place source."""
    spec = small_job("keep", steps=10, mode="sync", tools={"latency_s": 0.3}, data={"tasks": ["lookup"]})
    jid = api.submit(spec)["job_id"]
    sampler = sample_batches(infra.redis_url, jid)
    wait_step(api, jid, 2)

    def training() -> dict[str, dict[str, Any]] | None:
        members = {m["member_id"]: m for m in api.job(jid)["members"]}
        return members if members["trainer-e1-r0"]["phase"] == "training" else None

    before = eventually(training, timeout=60, interval=0.02, what="rank 0 training")
    kept_pid = before["trainer-e1-r0"]["pid"]
    api.fault(jid, kind="crash", role="trainer", member=1)
    status = wait_done(api, jid)
    events = api.events(jid)
    audit_sampled(infra, jid, sampler)

    decisions = [d for d in kinds(events, "decision") if d["actions"] != ["Ignore"]]
    assert [d["actions"] for d in decisions] == [["RestartTrainerGang"]], decisions
    assert "1 survivor" in decisions[0]["reason"], decisions
    started = {d["member_id"]: d for d in kinds(events, "member_started")}
    assert started["trainer-e2-r0"]["source"] == "survivor", started["trainer-e2-r0"]
    assert started["trainer-e2-r0"]["borrowed_from"] == "trainer-e1-r0"
    assert started["trainer-e2-r1"]["source"] in ("cold", "spare"), started["trainer-e2-r1"]
    switched = {d["from_member"]: d for d in kinds(events, "role_switched")}
    assert set(switched) == {"trainer-e1-r0"} and switched["trainer-e1-r0"]["member_id"] == "trainer-e2-r0"
    # Its old id's silence after the hand-off is no fault (the detector reported the kept rank
    # 'unresponsive' 4 s after it left: seen in the demo's fault table).
    faults = [(f["member_id"], f["kind"]) for f in kinds(events, "fault_detected")]
    assert ("trainer-e1-r0", "unresponsive") not in faults, faults
    # The same process: rank 0 of the new gang runs under the broken gang's rank 0 pid.
    now = {m["member_id"]: m for m in status["members"]}
    assert now["trainer-e2-r0"]["pid"] == kept_pid, (kept_pid, now["trainer-e2-r0"])
    assert ended(kept_pid)
    # Nothing of the broken gang's step carries over: every step committed once per lineage, the
    # new gang republished the committed version bit for bit before training on.
    commits = kinds(events, "step_committed")
    assert sorted({d["step"] for d in commits}) == list(range(10))
    first = next(d for d in kinds(events, "weights_published") if d["epoch"] == 2)
    assert {d["checksum"] for d in commits if d["weights_version"] == first["version"] and d["epoch"] == 1} == {
        first["checksum"]}
    recovered = [d for d in kinds(events, "recovered") if d["kind"] == "trainer"]
    assert recovered and recovered[0]["sources"][0] == "survivor", recovered


# --- off-policy correctness (unit) --------------------------------------------------------


def test_truncated_importance_ratio_loss_matches_a_hand_computation():
    # Two tokens of one episode, advantage +1; clip eps 0.2, IS cap 2.
    new = torch.tensor([[0.0, math.log(0.5), math.log(0.4)]], requires_grad=True)
    prox = torch.tensor([[0.0, math.log(0.5), math.log(0.5)]])
    behaviour = torch.tensor([[0.0, math.log(0.1), math.log(0.5)]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    loss, stats = grpo.grpo_loss(new, prox, torch.tensor([1.0]), mask, 0.2, behaviour_logprobs=behaviour, is_cap=2.0)
    # token 1: r = 0.5/0.5 = 1 -> min(1, clip 1) * A = 1; w = min(0.5/0.1 = 5, 2) = 2 -> -2
    # token 2: r = 0.4/0.5 = 0.8 -> min(0.8, clip(0.8) = 0.8) = 0.8; w = min(0.5/0.5 = 1, 2) = 1 -> -0.8
    assert loss.item() == pytest.approx(-(2 * 1.0 + 1 * 0.8) / 2, rel=1e-6)
    assert stats["is_weight_mean"] == pytest.approx(1.5) and stats["is_truncated_frac"] == pytest.approx(0.5)
    loss.backward()
    # d/d new of -w * r * A = -w * r: token 1: -2 * 1 / 2 tokens; token 2: -1 * 0.8 / 2
    assert new.grad[0, 1].item() == pytest.approx(-1.0) and new.grad[0, 2].item() == pytest.approx(-0.4)


def test_turns_staler_than_the_bound_are_dropped_and_counted():
    from robustrl.model.tokenizer import CharTokenizer

    tok = CharTokenizer.default()
    prompt = Prompt("p0", "copy", "ab", "ab", needs_tool=False, tool=None)
    turns = [Turn("assistant", tok.encode("a"), [-0.5], 3, "call"),  # version 3: too old for min 4
             Turn("tool", tok.encode("x"), [], -1, None),
             Turn("assistant", tok.encode("b"), [-0.25], 5, "stop")]  # partial rollout: a newer version
    samples = grpo.build_samples([(prompt, turns, 1.0)], tok, min_version=4)
    s = samples[0]
    n_prompt = len(s.token_ids) - 3
    assert s.loss_mask[n_prompt:] == [0, 0, 1]  # the stale turn is context, not trained on
    assert s.stale_turns == 1 and s.stale_tokens == 1
    fresh = grpo.build_samples([(prompt, turns, 1.0)], tok, min_version=3)[0]
    assert fresh.loss_mask[n_prompt:] == [1, 0, 1] and fresh.stale_turns == 0


# --- the standby plan (pure) ---------------------------------------------------------------


def _view(**kw: Any):
    from robustrl.services.controller.decide import JobView

    base: dict[str, Any] = {"job_id": "j", "step": 5, "committed_step": 4, "durable_step": 3, "mode": "async",
                            "trainer_workers": 2, "rollout_replicas": 3, "can_borrow": True,
                            "borrowable": ("rollout-2-i0", "rollout-1-i0", "rollout-0-i0")}
    return JobView(**{**base, **kw})


def _rec(**kw: Any):
    from robustrl.config import RecoverySpec

    return RecoverySpec(**kw)


def test_plan_takes_spares_first_then_borrows_down_to_the_replicas_kept_then_cold():
    from robustrl.services.controller.decide import plan_gang

    assert plan_gang(_view(spares_ready=1), _rec())[0] == ("spare", "borrowed:rollout-2-i0")
    assert plan_gang(_view(), _rec())[0] == ("borrowed:rollout-2-i0", "borrowed:rollout-1-i0")
    # keeping 2 of 3 replicas generating leaves one to borrow; the other rank starts cold
    assert plan_gang(_view(), _rec(min_replicas_kept=2))[0] == ("borrowed:rollout-2-i0", "cold")
    # borrowed before spares when the order says so
    order = _rec(standby_order=["borrowed", "spare", "cold"], min_replicas_kept=2)
    assert plan_gang(_view(spares_ready=2), order)[0] == ("borrowed:rollout-2-i0", "spare")


def _crash(member: str, kind: str = "crash", cause: str | None = None):
    from robustrl.messages import FaultReport

    return FaultReport(job_id="j", fault_id="f1", role="trainer", member_id=member, kind=kind,  # type: ignore[arg-type]
                       evidence="test", detected_at=1.0, cause=cause)


def test_plan_keeps_the_broken_gangs_other_ranks_first_and_only_after_a_fault_that_frees_them():
    from robustrl.services.controller.decide import plan_gang

    gang = {"survivors": ("trainer-e1-r0", "trainer-e1-r1"), "can_keep": True}
    # rank 1 crashed: rank 0 is kept (as rank 0: the rendezvous stays where a process runs), and
    # only the failed rank comes from the pool
    assert plan_gang(_view(**gang), _rec(), _crash("trainer-e1-r1"))[0] == (
        "survivor:trainer-e1-r0", "borrowed:rollout-2-i0")
    # rank 0 crashed: rank 1's process becomes rank 0
    assert plan_gang(_view(**gang), _rec(), _crash("trainer-e1-r0"))[0] == (
        "survivor:trainer-e1-r1", "borrowed:rollout-2-i0")
    # sync borrows nothing, but still keeps the survivor (the plan is not empty: one rank is in place)
    assert plan_gang(_view(mode="sync", **gang), _rec(), _crash("trainer-e1-r1"))[0] == (
        "survivor:trainer-e1-r0", "cold")
    assert plan_gang(_view(spares_ready=1, **gang), _rec(), _crash("trainer-e1-r1"))[0] == (
        "survivor:trainer-e1-r0", "spare")
    # without an exit the rank reported may be the healthy one (a hang: its peer waits in a
    # collective with no activity either), or a survivor may be blocked on a silent rank until
    # the collective's timeout: every rank replaced
    for kind in ("hang", "fail_slow", "unresponsive"):
        sources, why = plan_gang(_view(**gang), _rec(), _crash("trainer-e1-r1", kind))
        assert sources == ("borrowed:rollout-2-i0", "borrowed:rollout-1-i0") and "no survivor kept" in why, kind
    # a lost GPU is a crash whose process still runs: its peers may be held in a collective with it
    sources, why = plan_gang(_view(**gang), _rec(), _crash("trainer-e1-r1", cause="gpu_lost"))
    assert sources == ("borrowed:rollout-2-i0", "borrowed:rollout-1-i0") and "no survivor kept" in why, why
    assert "GPU" in why, why
    sources, why = plan_gang(_view(**gang), _rec(keep_survivors=False), _crash("trainer-e1-r1"))
    assert not any(s.startswith("survivor") for s in sources) and "keep_survivors" in why
    sources, why = plan_gang(_view(survivors=gang["survivors"], can_keep=False), _rec(), _crash("trainer-e1-r1"))
    assert not any(s.startswith("survivor") for s in sources) and "launcher" in why
    # a gang that never got ready has no survivors (the view lists only ready ranks)
    assert plan_gang(_view(mode="sync", can_keep=True), _rec(), _crash("trainer-e1-r1"))[0] == ()


def test_only_replicas_and_trainer_ranks_switch_in_place():
    from robustrl.launcher.base import ROLLOUT_MODULE, TRAINER_MODULE, MemberSpec, switchable

    assert switchable(MemberSpec("j", "r", "rollout", ROLLOUT_MODULE))
    assert switchable(MemberSpec("j", "t", "trainer", TRAINER_MODULE))
    assert not switchable(MemberSpec("j", "t", "trainer", "some.other.module"))
    assert not switchable(MemberSpec("j", "q", "request_manager", ROLLOUT_MODULE))


def test_plan_borrows_nothing_in_sync_unless_allowed_nor_when_denied_or_impossible():
    from robustrl.services.controller.decide import plan_gang

    sources, why = plan_gang(_view(mode="sync"), _rec())
    assert sources == () and "sync" in why
    assert plan_gang(_view(mode="sync"), _rec(borrow="always"))[0][0].startswith("borrowed:")
    assert plan_gang(_view(), _rec(borrow="never"))[0] == ()
    sources, why = plan_gang(_view(can_borrow=False), _rec())
    assert sources == () and "in place" in why  # a launcher that cannot switch a member's role
    assert plan_gang(_view(), _rec(standby_order=["cold"]))[0] == ()
    sources, why = plan_gang(_view(replica_fits_trainer=False), _rec())
    assert sources == () and "resources" in why


@pytest.mark.parametrize("strategy", ["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"])
def test_a_strict_gang_on_a_launcher_that_holds_its_layout_borrows_no_replica(strategy):
    """A replica switched in place stays where it runs, outside the gang's placement group: a
    STRICT_* gang on a launcher that holds it to its layout (Ray) borrows none, as it takes no
    warm spare there; a preference (PACK, SPREAD), or a launcher with no such layout, borrows."""
    from robustrl.config import JobSpec
    from robustrl.launcher.local import LocalLauncher
    from robustrl.launcher.ray import RayLauncher
    from robustrl.services.controller.decide import plan_gang
    from robustrl.services.controller.jobs import JobRun, MemberInfo
    from robustrl.services.controller.view import job_view

    spec = JobSpec.parse({"mode": "async", "staleness": 1,
                          "trainer": {"workers": 2, "placement": {"strategy": strategy}},
                          "rollout": {"replicas": 4}})
    job = JobRun("j", spec)
    for i in range(4):
        mid = f"rollout-{i}-i0"
        job.members[mid] = MemberInfo(mid, "rollout", i, 0, state="ready", weights_version=3)
        job.slot_incarnation[i] = 0
    strict = strategy.startswith("STRICT_")
    for holds in (False, True):
        view = job_view(job, can_borrow=True, holds_strict_layout=holds)
        sources, why = plan_gang(view, spec.recovery)
        if holds and strict:
            assert sources == () and "STRICT_" in why and "placement" in why, (sources, why)
        else:
            assert [s.split(":")[0] for s in sources] == ["borrowed", "borrowed"], (holds, sources, why)
    assert RayLauncher.holds_strict_layout(object.__new__(RayLauncher)) is True
    assert LocalLauncher.holds_strict_layout(object.__new__(LocalLauncher)) is False


def test_a_replica_fits_a_trainer_rank_only_if_it_reserves_as_much():
    from robustrl.config import JobSpec
    from robustrl.services.controller.jobs import JobRun
    from robustrl.services.controller.view import replica_fits_trainer

    def fits(rollout: dict[str, Any], trainer: dict[str, Any]) -> bool:
        spec = JobSpec.parse({"rollout": {"resources": rollout}, "trainer": {"resources": trainer}})
        return replica_fits_trainer(JobRun("j", spec))

    assert fits({}, {})  # nothing reserved (the local launcher): any replica fits
    assert not fits({"gpus": 0.5}, {"gpus": 1.0})
    assert fits({"gpus": 1.0, "cpus": 4.0}, {"gpus": 1.0, "cpus": 2.0})
    assert not fits({}, {"cpus": 2.0}) and not fits({"memory_mb": 1024}, {"memory_mb": 2048})


@pytest.mark.parametrize(("knobs", "field"), [
    ({"standby_order": ["spare", "spare", "cold"]}, "recovery.standby_order"),
    ({"standby_order": ["spare", "borrowed"]}, "recovery.standby_order"),
    ({"standby_order": ["warm", "cold"]}, "recovery.standby_order.0"),
    ({"min_replicas_kept": 0}, "recovery.min_replicas_kept"),
    ({"borrow": "sometimes"}, "recovery.borrow"),
    ({"keep_survivors": "yes"}, "recovery.keep_survivors"),
])
def test_bad_standby_knobs_are_a_config_error_naming_the_field(knobs, field):
    from robustrl.config import JobSpec
    from robustrl.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        JobSpec.parse({"recovery": knobs})
    assert err.value.field == field


def test_a_launcher_without_in_place_switching_refuses_to_borrow_with_its_reason():
    from robustrl.errors import LaunchError
    from robustrl.launcher.base import Launcher, MemberSpec
    from robustrl.launcher.docker import DockerLauncher
    from robustrl.launcher.local import LocalLauncher

    # The local and Docker launchers switch a replica in place (Docker: tests/test_docker_standby.py).
    assert LocalLauncher.can_relabel is not Launcher.can_relabel
    assert DockerLauncher.can_relabel is not Launcher.can_relabel and DockerLauncher.relabel is not Launcher.relabel

    class Bare(Launcher):
        start = stop = kill = suspend = resume = poll = state = pid = lambda *a, **k: None  # type: ignore[assignment]

    with pytest.raises(LaunchError, match="cannot switch member j--rollout-0-i0 to another role in place"):
        Bare().relabel("j--rollout-0-i0", MemberSpec("j", "j--trainer-e2-r0", "trainer", "m"))
    assert Bare().can_relabel() is False


def test_a_borrowed_rank_on_a_testbed_host_binds_the_hosts_address(tmp_path):
    """Review fix (d): the rank a replica on a testbed host becomes binds on that host's address
    (ROBUSTRL_BIND_HOST in its hand-off), as a member started on the host would. The stand-in
    host runs a sleeper in place of the replica (the hand-off is read back, not taken)."""
    import json
    import sys

    from robustrl.launcher.base import ROLLOUT_MODULE, MemberSpec
    from robustrl.launcher.local import LocalLauncher
    from robustrl.launcher.spare import handoff_path

    class Hosts:
        def exec_prefix(self, host: str) -> list[str]:
            return [sys.executable, "-c", "import time; time.sleep(60)"]  # a stand-in that lives until killed

        def address(self, host: str) -> str:
            return {"h1": "10.77.0.2"}[host]

    launcher = LocalLauncher(tmp_path, base_env={}, placement=Hosts())
    try:
        launcher.start(MemberSpec("j", "j--rollout-0-i0", "rollout", ROLLOUT_MODULE, {"ROBUSTRL_BIND_HOST": "0.0.0.0"},
                                  host="h1"))
        pid = launcher.pid("j--rollout-0-i0")
        assert pid is not None
        spec = MemberSpec("j", "j--trainer-e2-r0", "trainer", "robustrl.services.trainer", {"ROBUSTRL_RANK": "0"})
        launcher.relabel("j--rollout-0-i0", spec)
        order = json.loads(handoff_path(tmp_path, pid).read_text())
        assert order["env"]["ROBUSTRL_BIND_HOST"] == "10.77.0.2" and order["env"]["ROBUSTRL_RANK"] == "0"
        assert launcher.pid("j--trainer-e2-r0") == pid and launcher.host_for("j--trainer-e2-r0") == "10.77.0.2"
    finally:
        launcher.close()


class _RestockController:
    """The part of the controller a restock uses: a starter whose launcher.start fails as told
    (``fail[slot]`` more times), the job record as persisted, and the events appended."""

    leading = True

    def __init__(self, fail: dict[int, int], on_start: Any = None) -> None:
        from robustrl.services.controller.recovery import RecoveryExecutor

        self.fail = fail
        self.on_start = on_start  # awaited with (job, slot) as a start begins (what happens meanwhile)
        self.persisted: list[dict[int, int]] = []
        self.records: list[dict[str, Any]] = []  # the job record as persisted (owed slots, member states)
        self.durable_at_start: list[tuple[str, dict[str, Any]]] = []  # planned member, record at its start
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.executor = RecoveryExecutor(self)  # type: ignore[arg-type]
        self.starter = self
        self.launcher = self
        self.stopped: list[str] = []  # launcher.stop calls (launcher ids)
        self.handle_write_fails: dict[int, int] = {}

    def stop(self, member_id: str, grace_s: float = 0.0) -> None:
        self.stopped.append(member_id)

    async def start_replica(self, job: Any, slot: int, intent: Any = None) -> str:
        from robustrl.services.controller.jobs import MemberInfo

        # as MemberStarter.start_replica: the incarnation is taken, the planned member recorded
        # and the intent made durable, then launcher.start runs (here: what was durable then)
        inc = job.slot_incarnation[slot] = job.slot_incarnation.get(slot, -1) + 1
        mid = f"rollout-{slot}-i{inc}"
        job.members[mid] = MemberInfo(mid, "rollout", slot, inc)
        assert intent is not None, "a restock starts a replica without persisting its intent first"
        await intent(job)
        self.durable_at_start.append((mid, self.records[-1]))
        if self.on_start is not None:
            await self.on_start(job, slot)
        if self.fail.get(slot, 0) > 0:
            self.fail[slot] -= 1
            job.members[mid].state = "dead"
            raise RuntimeError("no capacity")
        job.members[mid].handle = {"pid": 1}
        if self.handle_write_fails.get(slot, 0) > 0:  # started; its handle's write then fails
            self.handle_write_fails[slot] -= 1
            raise ConnectionError("redis: connection reset")
        return mid

    async def persist(self, job: Any) -> None:
        self.persisted.append(dict(job.restock_owed))
        self.records.append({"restock_owed": dict(job.restock_owed),
                             "members": {m.member_id: m.state for m in job.members.values()}})

    async def event(self, job: Any, kind: str, data: dict[str, Any]) -> None:
        self.events.append((kind, data))

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        return asyncio.get_running_loop().create_task(coro)


async def _restart_every_slot(c: _RestockController, job: Any) -> None:
    """What RecoveryExecutor._restart_whole_job does to the record, under the recovery lock: every
    live member killed, nothing owed, a new incarnation of every slot."""
    from robustrl.services.controller.jobs import MemberInfo

    async with c.executor.lock:
        for m in job.live():
            m.state = "dead"
        job.restock_owed.clear()
        for s in sorted(job.slot_incarnation):
            inc = job.slot_incarnation[s] = job.slot_incarnation[s] + 1
            job.members[f"rollout-{s}-i{inc}"] = MemberInfo(f"rollout-{s}-i{inc}", "rollout", s, inc)


@pytest.fixture
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    from robustrl.services.controller import recovery

    monkeypatch.setattr(recovery, "RESTOCK_RETRY_MIN_S", 0.01)
    monkeypatch.setattr(recovery, "RESTOCK_RETRY_MAX_S", 0.05)


def test_a_failed_restock_is_retried_with_an_event_per_attempt_until_it_starts(quick_retries):
    """Issue 13 (a): a slot leaves ``restock_owed`` only once its replacement started; a start that
    fails keeps the slot owed (at the incarnation it used up, so it is not taken for a slot
    restarted meanwhile) and is tried again, with a ``restock_failed`` event per failed attempt;
    a slot restarted meanwhile is dropped; every change is persisted."""
    from robustrl.config import JobSpec
    from robustrl.services.controller.jobs import JobRun

    job = JobRun("j", JobSpec.parse({"rollout": {"replicas": 4}}))
    job.slot_incarnation = {0: 0, 1: 0, 2: 0, 3: 1}
    job.restock_owed = {1: 0, 2: 0, 3: 0}  # slot 3 was restarted since (incarnation 1)
    c = _RestockController(fail={1: 2})
    asyncio.run(c.executor.restock(job))
    assert job.restock_owed == {}
    assert [(k, {f: d[f] for f in ("slot", "attempt") if f in d} | ({"member_id": d["member_id"]}
                                                                    if "member_id" in d else {}))
            for k, d in c.events] == [
        ("restock_failed", {"slot": 1, "attempt": 1}),
        ("replica_restocked", {"slot": 2, "member_id": "rollout-2-i1"}),
        ("restock_failed", {"slot": 1, "attempt": 2}),
        ("replica_restocked", {"slot": 1, "member_id": "rollout-1-i3"}),
    ], c.events
    assert all("no capacity" in d["error"] for k, d in c.events if k == "restock_failed")
    # Issue 13 (b): before each launcher.start, the record already held the planned member (as
    # starting) and its slot owed at the planned incarnation: a controller killed in between
    # leaves a record from which the next leader finds the member (MemberStarter.adopt).
    assert [m for m, _ in c.durable_at_start] == ["rollout-1-i1", "rollout-2-i1", "rollout-1-i2", "rollout-1-i3"]
    for mid, record in c.durable_at_start:
        slot, inc = int(mid.split("-")[1]), int(mid.split("-i")[1])
        assert record["restock_owed"][slot] == inc and record["members"][mid] == "starting", (mid, record)
    # durable after each change: still owed (at the incarnation a failed start used) until started
    assert c.persisted[-1] == {} and {1: 1} in c.persisted and {1: 2} in c.persisted


def test_a_slot_owed_again_while_its_pass_runs_is_restocked_before_the_loop_ends(quick_retries):
    """A replacement started in this pass is borrowed in turn (a trainer recovery while the next
    slot starts) and its slot owed again: the loop starts it again instead of ending with the
    slot owed and no loop left to wake (an outside audit reproduced that)."""
    from robustrl.config import JobSpec
    from robustrl.services.controller.jobs import JobRun

    job = JobRun("j", JobSpec.parse({"rollout": {"replicas": 3}}))
    job.slot_incarnation = {0: 0, 1: 0, 2: 0}
    job.restock_owed = {0: 0, 1: 0}
    reowed: list[int] = []

    async def borrow_slot_0_meanwhile(job_: JobRun, slot: int) -> None:
        if slot == 1 and not reowed:  # slot 0's new replica (incarnation 1) is borrowed now
            reowed.append(job_.slot_incarnation[0])
            job_.members["rollout-0-i1"].state = "dead"  # as RecoveryExecutor._drain marks a borrowed one
            await c.executor.owe(job_, {0: job_.slot_incarnation[0]})

    c = _RestockController(fail={}, on_start=borrow_slot_0_meanwhile)

    async def scenario() -> None:
        await asyncio.wait_for(c.executor.restock(job), 10)
        await asyncio.sleep(0)  # a loop spawned by the wake-up, if any, would start now
        assert job.job_id not in c.executor._restocking

    asyncio.run(scenario())
    assert reowed == [1]
    assert job.restock_owed == {}, f"slot owed with no restock loop left: {job.restock_owed}"
    restocked = [d["member_id"] for k, d in c.events if k == "replica_restocked"]
    assert restocked == ["rollout-0-i1", "rollout-1-i1", "rollout-0-i2"], c.events
    assert c.persisted[-1] == {}


def test_a_slow_restock_start_does_not_hold_up_a_trainer_fault(quick_retries):
    """A replacement's start can take seconds (a Ray actor, a container): it runs outside the
    recovery lock, so a trainer fault arriving meanwhile is handled at once, not after it."""
    from robustrl.config import JobSpec
    from robustrl.services.controller.jobs import JobRun

    job = JobRun("j", JobSpec.parse({"rollout": {"replicas": 3}}))
    job.slot_incarnation = {0: 0, 1: 0, 2: 0}
    job.restock_owed = {1: 0}
    starting, release = asyncio.Event(), asyncio.Event()

    async def slow_start(job_: JobRun, slot: int) -> None:
        starting.set()
        await release.wait()

    c = _RestockController(fail={}, on_start=slow_start)

    async def scenario() -> None:
        loop = asyncio.create_task(c.executor.restock(job))
        await asyncio.wait_for(starting.wait(), 5)
        # What a trainer fault's handling takes first (RecoveryExecutor.handle): the recovery lock.
        await asyncio.wait_for(c.executor.lock.acquire(), 2)
        c.executor.lock.release()
        release.set()
        await asyncio.wait_for(loop, 5)

    asyncio.run(scenario())
    assert ("replica_restocked", {"member_id": "rollout-1-i1", "slot": 1}) in c.events
    assert job.restock_owed == {} and c.persisted[-1] == {} and c.stopped == []


def test_a_replica_restocked_across_a_whole_job_restart_is_stopped_not_left_running(quick_retries):
    """A whole-job restart while a replacement starts kills every member it knows of (the one
    starting, before its launcher has it) and starts every slot anew: the replacement, once
    started, is stopped (it would run untracked beside the slot's new replica), and neither
    reported restocked nor left owed."""
    from robustrl.config import JobSpec
    from robustrl.services.controller.jobs import JobRun

    job = JobRun("j", JobSpec.parse({"rollout": {"replicas": 3}}))
    job.slot_incarnation = {0: 0, 1: 0, 2: 0}
    job.restock_owed = {1: 0}

    async def whole_job_restart_meanwhile(job_: JobRun, slot: int) -> None:
        await _restart_every_slot(c, job_)

    c = _RestockController(fail={}, on_start=whole_job_restart_meanwhile)
    asyncio.run(asyncio.wait_for(c.executor.restock(job), 10))
    assert c.stopped == ["j--rollout-1-i1"], c.stopped
    assert job.members["rollout-1-i1"].state == "stopped"
    assert not [d for k, d in c.events if k == "replica_restocked"], c.events
    assert job.restock_owed == {} and c.persisted[-1] == {}


@pytest.mark.parametrize("restarted_meanwhile", [False, True])
def test_a_replacement_started_whose_handle_was_not_saved_is_stopped_before_the_slot_goes_on(
        quick_retries, restarted_meanwhile):
    """The replacement started, then its handle's write failed (Redis away): it is stopped, never
    left running beside the slot's next incarnation (a retry, or a whole-job restart's)."""
    from robustrl.config import JobSpec
    from robustrl.services.controller.jobs import JobRun

    job = JobRun("j", JobSpec.parse({"rollout": {"replicas": 3}}))
    job.slot_incarnation = {0: 0, 1: 0, 2: 0}
    job.restock_owed = {1: 0}

    async def whole_job_restart_meanwhile(job_: JobRun, slot: int) -> None:
        if restarted_meanwhile and job_.slot_incarnation[0] == 0:
            await _restart_every_slot(c, job_)

    c = _RestockController(fail={}, on_start=whole_job_restart_meanwhile)
    c.handle_write_fails = {1: 1}
    asyncio.run(asyncio.wait_for(c.executor.restock(job), 10))
    assert c.stopped == ["j--rollout-1-i1"], c.stopped
    assert job.members["rollout-1-i1"].state == "stopped"
    restocked = [d["member_id"] for k, d in c.events if k == "replica_restocked"]
    assert restocked == ([] if restarted_meanwhile else ["rollout-1-i2"]), c.events
    assert job.restock_owed == {}


def test_restock_retries_stop_when_the_job_ends_and_a_slot_owed_meanwhile_does_not_wait(monkeypatch):
    """The retries end with the job; a slot owed while the loop backs off is started at once
    (the loop is woken), not after the back-off, and by the same loop (one per job)."""
    from robustrl.config import JobSpec
    from robustrl.services.controller import recovery
    from robustrl.services.controller.jobs import JobRun

    monkeypatch.setattr(recovery, "RESTOCK_RETRY_MIN_S", 30.0)  # a back-off the test never waits out
    job = JobRun("j", JobSpec.parse({"rollout": {"replicas": 3}}))
    job.slot_incarnation = {0: 0, 1: 0, 2: 0}
    job.restock_owed = {1: 0}
    c = _RestockController(fail={1: 1_000})

    async def scenario() -> None:
        loop = asyncio.create_task(c.executor.restock(job))
        await eventually_async(lambda: [k for k, _ in c.events] == ["restock_failed"], timeout=5, interval=0.01)
        began = asyncio.get_running_loop().time()
        await c.executor.owe(job, {2: 0})  # a second borrow while the first slot backs off
        await eventually_async(lambda: ("replica_restocked", {"member_id": "rollout-2-i1", "slot": 2}) in c.events,
                               timeout=5, interval=0.01)
        assert asyncio.get_running_loop().time() - began < 5
        job.status = "finished"
        c.executor._restocking[job.job_id].set()  # cut the back-off short: the loop sees the job ended
        await asyncio.wait_for(loop, 5)
        assert job.job_id not in c.executor._restocking

    asyncio.run(scenario())
    failed = [d["attempt"] for k, d in c.events if k == "restock_failed"]
    assert failed == list(range(1, len(failed) + 1)) and len(failed) <= 3, c.events
    assert job.restock_owed == {1: job.slot_incarnation[1]}  # still owed: the job ended first


def test_a_local_spare_that_cannot_be_started_is_started_again_later(tmp_path, monkeypatch):
    """A spare restock whose process cannot be started (fork refused) is tried again with back-off
    instead of leaving the pool short for good; the spare is seen as a process from outside."""
    import os
    import subprocess

    import psutil

    from robustrl.launcher import local
    from robustrl.launcher.spare import SPARE_MODULE
    from robustrl.launcher.zygote import FORK_START_ENV

    monkeypatch.setattr(local, "SPARE_RESTOCK_DELAY_S", 0.05)
    real, refused = subprocess.Popen, []

    def popen(argv, *args, **kwargs):  # the first spares are refused, as under a process limit
        if SPARE_MODULE in argv and len(refused) < 5:
            refused.append(argv)
            raise BlockingIOError(11, "fork refused (injected)")
        return real(argv, *args, **kwargs)

    monkeypatch.setattr(local.subprocess, "Popen", popen)
    # cold spares: a forked one (robustrl.launcher.zygote) is no process start of its own
    launcher = local.LocalLauncher(tmp_path, base_env={**os.environ, FORK_START_ENV: "0"})

    def spares() -> list[psutil.Process]:
        return [p for p in psutil.Process().children() if SPARE_MODULE in " ".join(p.cmdline())]

    try:
        launcher.keep_spares(1)  # refused: the retries run in timer threads from here on
        # More calls failing meanwhile (keep_spares of other jobs) join the one retry chain.
        for _ in range(3):
            launcher.keep_spares(1)
        timers = [t for t in threading.enumerate() if isinstance(t, threading.Timer) and t.is_alive()]
        assert len(timers) <= 1, f"{len(timers)} retry chains"
        started = eventually(spares, timeout=10, interval=0.05, what="a spare started after the refusals")
        assert len(refused) == 5 and len(started) == 1 and launcher.spares_ready() == 1
    finally:
        launcher.close()
    assert spares() == []


def test_a_restocked_replica_whose_handle_was_never_written_is_found_and_adopted(tmp_path, quick_retries):
    """Issue 13 (b), the taking-over side, with real processes: controller A persisted a
    restock's intent (slots 1 and 2 owed at incarnation 1, their members starting, no handle),
    its launcher started slot 1's replica, and A died before writing the handle. The next
    leader's launcher finds that very process (pid file next to its log) and adopts it, the slot
    counts as restocked without a second start; slot 2's planned member never ran: dead, no fault,
    restocked anew."""
    import os
    from pathlib import Path

    import psutil

    from robustrl.config import JobSpec, Settings
    from robustrl.launcher.base import MemberSpec
    from robustrl.launcher.local import LocalLauncher
    from robustrl.services.controller.jobs import JobRun, MemberInfo
    from robustrl.services.controller.launching import MemberStarter, lid

    job = JobRun("j", JobSpec.parse({"rollout": {"replicas": 3}}))
    job.slot_incarnation = {0: 0, 1: 1, 2: 1}
    job.restock_owed = {1: 1, 2: 1}
    job.members = {"rollout-1-i0": MemberInfo("rollout-1-i0", "rollout", 1, 0, state="dead"),  # borrowed
                   "rollout-1-i1": MemberInfo("rollout-1-i1", "rollout", 1, 1),
                   "rollout-2-i1": MemberInfo("rollout-2-i1", "rollout", 2, 1)}
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent)}
    old = LocalLauncher(tmp_path, base_env=env)  # controller A's, gone with it (its state unused)
    old.start(MemberSpec("j", lid(job, "rollout-1-i1"), "rollout", "idle_member"))
    pid = old.pid(lid(job, "rollout-1-i1"))
    new = LocalLauncher(tmp_path, base_env=env)
    try:
        adopted, gone = asyncio.run(MemberStarter(None, new, Settings()).adopt(job))  # type: ignore[arg-type]
        assert (adopted, gone) == (["rollout-1-i1"], []), (adopted, gone)
        assert job.members["rollout-1-i1"].pid == pid and new.pid(lid(job, "rollout-1-i1")) == pid
        assert job.members["rollout-2-i1"].state == "dead"
        # the new leader's restock: slot 1 restocked by the adopted member, slot 2 started anew
        c = _RestockController(fail={})
        asyncio.run(c.executor.restock(job))
        assert [(k, d["slot"], d["member_id"]) for k, d in c.events] == [
            ("replica_restocked", 1, "rollout-1-i1"), ("replica_restocked", 2, "rollout-2-i2")], c.events
        assert [m for m, _ in c.durable_at_start] == ["rollout-2-i2"] and job.restock_owed == {}
        assert psutil.Process(pid).status() != psutil.STATUS_ZOMBIE  # still the one running
    finally:
        new.close()
        old.close()
    assert ended(pid)


def _placed(mid: str, role: str, index: int, host: str | None, version: int = 3, *, ray: bool = False):
    from robustrl.services.controller.jobs import MemberInfo

    handle = {} if host is None else ({"node_id": host} if ray else {"host": host})
    return MemberInfo(mid, role, index, 0 if role == "rollout" else 1, state="ready", weights_version=version,
                      handle=handle)


@pytest.mark.parametrize("ray", [False, True])
def test_the_replica_borrowed_is_chosen_by_host_under_the_gangs_placement(ray):
    """A borrowed replica becomes a rank where it runs. Under PACK the replica beside the gang's
    running rank is taken first; under SPREAD replicas on hosts without a rank come first, one
    per host in turn. (Before 2026-12-03 the pick was by weights version and slot only: PACK took
    rollout-3 on h2, SPREAD took rollout-0 beside the running rank 0.)"""
    from robustrl.config import JobSpec
    from robustrl.services.controller.decide import plan_gang
    from robustrl.services.controller.jobs import JobRun
    from robustrl.services.controller.view import job_view

    def plan(strategy: str, ranks: int) -> tuple[str, ...]:
        spec = JobSpec.parse({"mode": "async", "staleness": 1, "rollout": {"replicas": 4},
                              "trainer": {"workers": ranks, "placement": {"strategy": strategy}},
                              "recovery": {"min_replicas_kept": 1, "keep_survivors": False}})
        job = JobRun("j", spec)
        job.epoch = 1
        hosts = ["h0", "h1", "h1", "h2"]  # rollout-3 (h2) holds the newest weights
        for i, h in enumerate(hosts):
            m = _placed(f"rollout-{i}-i0", "rollout", i, h, 4 if i == 3 else 3, ray=ray)
            job.members[m.member_id] = m
            job.slot_incarnation[i] = 0
        rank0 = _placed("trainer-e1-r0", "trainer", 0, "h0", ray=ray)
        job.members[rank0.member_id] = rank0
        sources, _why = plan_gang(job_view(job, can_borrow=True), spec.recovery)
        return sources

    assert plan("PACK", 1) == ("borrowed:rollout-0-i0",)
    # SPREAD: hosts without a rank first (h2 holds the newest weights, then h1), h0 last
    assert plan("SPREAD", 3) == ("borrowed:rollout-3-i0", "borrowed:rollout-2-i0", "borrowed:rollout-0-i0")


def test_one_machine_launchers_keep_the_weights_order():
    from robustrl.services.controller.view import borrow_order

    replicas = [_placed(f"rollout-{i}-i0", "rollout", i, None, v) for i, v in enumerate([3, 4, 3])]
    for strategy in ("PACK", "SPREAD"):
        got = [m.member_id for m in borrow_order(replicas, [_placed("trainer-e1-r0", "trainer", 0, None)], strategy)]
        assert got == ["rollout-1-i0", "rollout-2-i0", "rollout-0-i0"], strategy


def test_a_replica_not_sure_to_carry_the_trainers_node_labels_is_not_borrowed():
    from robustrl.config import JobSpec
    from robustrl.services.controller.decide import plan_gang
    from robustrl.services.controller.jobs import JobRun
    from robustrl.services.controller.view import job_view, replica_fits_trainer

    def fits(rollout: dict[str, str], trainer: dict[str, str]) -> bool:
        spec = JobSpec.parse({"rollout": {"placement": {"node_labels": rollout}},
                              "trainer": {"placement": {"node_labels": trainer}}})
        return replica_fits_trainer(JobRun("j", spec))

    assert fits({}, {}) and fits({"pool": "gpu", "zone": "a"}, {"pool": "gpu"})
    assert not fits({}, {"pool": "trainer"})  # a replica may run anywhere, the trainer may not
    assert not fits({"pool": "rollout"}, {"pool": "trainer"})
    spec = JobSpec.parse({"mode": "async", "staleness": 1, "rollout": {"replicas": 3},
                          "trainer": {"workers": 1, "placement": {"node_labels": {"pool": "trainer"}}}})
    job = JobRun("j", spec)
    for i in range(3):
        m = _placed(f"rollout-{i}-i0", "rollout", i, None)
        job.members[m.member_id] = m
        job.slot_incarnation[i] = 0
    sources, why = plan_gang(job_view(job, can_borrow=True), spec.recovery)
    assert sources == () and "node labels" in why, (sources, why)
