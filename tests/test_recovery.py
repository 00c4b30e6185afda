"""Role-local recovery with real processes and servers: every fault kind, then the independent
auditor's checks of DESIGN section 4 on the raw stores (not only that the job finished)."""

from __future__ import annotations

import time

import pytest
from jobs import kinds, small_job, wait_done, wait_step
from support import audit_sampled, eventually, sample_batches


pytestmark = pytest.mark.timeout(240)


def _decisions(events):
    """Decisions that acted (a report about a member already being replaced is ignored)."""
    return [(d["fault_id"], d["actions"]) for d in kinds(events, "decision") if d["actions"] != ["Ignore"]]


def _faults(events):
    return kinds(events, "fault_detected")


def test_trainer_worker_crash_restarts_only_the_trainer(api, infra):
    jid = api.submit(small_job("tcrash", steps=8))["job_id"]
    sampler = sample_batches(infra.redis_url, jid)
    wait_step(api, jid, 1)
    api.fault(jid, kind="crash", role="trainer", member=1)
    wait_done(api, jid)
    events = api.events(jid)
    audit_sampled(infra, jid, sampler)

    faults = _faults(events)
    assert faults[0]["kind"] == "crash" and faults[0]["role"] == "trainer"
    actions = [a for _, acts in _decisions(events) for a in acts]
    assert actions == ["RestartTrainerGang"]
    # Rollouts kept their state: the original replicas served the whole job.
    started = [d["member_id"] for d in kinds(events, "member_started")]
    assert sorted(m for m in started if m.startswith("rollout")) == ["rollout-0-i0", "rollout-1-i0"]
    assert {"trainer-e2-r0", "trainer-e2-r1"} <= set(started)
    assert kinds(events, "recovered"), "no recovery recorded"
    report = api.report(jid)
    assert report["faults"][0]["detection_s"] is not None and report["faults"][0]["detection_s"] < 2.0


def test_trainer_hang_is_detected_by_silence_and_recovered(api, infra):
    jid = api.submit(small_job("thang", steps=8))["job_id"]
    sampler = sample_batches(infra.redis_url, jid)
    wait_step(api, jid, 1)
    api.fault(jid, kind="hang", role="trainer", member=0)
    wait_done(api, jid)
    events = api.events(jid)
    audit_sampled(infra, jid, sampler)
    faults = [f for f in _faults(events) if f["role"] == "trainer"]
    assert faults and faults[0]["kind"] in ("unresponsive", "hang")
    assert ["RestartTrainerGang"] in [acts for _, acts in _decisions(events)]
    spec_ = kinds(events, "job_submitted")[0]["spec"]["detector"]
    report = api.report(jid)
    delay = report["faults"][0]["detection_s"]
    bound = max(spec_["silence_s"] + spec_["probe_timeout_s"], spec_["trainer_idle_s"]) + 2 * spec_["metrics_interval_s"]
    assert delay is not None and delay <= bound + 0.5, f"detection {delay:.2f}s over {bound:.2f}s"


def test_trainer_stall_in_training_phase_is_a_hang(api, infra):
    jid = api.submit(small_job("tstall", steps=8))["job_id"]
    sampler = sample_batches(infra.redis_url, jid)
    wait_step(api, jid, 1)
    # The stall takes effect at the next forward pass, i.e. inside the training phase.
    api.fault(jid, kind="stall", role="trainer", member=0, duration_s=120)
    wait_done(api, jid)
    events = api.events(jid)
    audit_sampled(infra, jid, sampler)
    faults = [f for f in _faults(events) if f["role"] == "trainer"]
    assert faults and faults[0]["kind"] == "hang", faults


def test_rollout_crash_mid_tool_turn_resumes_episodes_from_their_prefix(api, infra):
    """The crash at the worst moment for an episode, not raced from outside: replica 0 is armed
    (``moment: mid_tool_turn``) and dies at the first token of the next turn it generates after a
    tool result, with that episode's tool-turn prefix saved and the turn in flight."""
    spec = small_job("rcrash", steps=20, tools={"latency_s": 0.6}, data={"tasks": ["lookup"]})
    jid = api.submit(spec)["job_id"]
    sampler = sample_batches(infra.redis_url, jid)
    wait_step(api, jid, 1)
    api.fault(jid, kind="crash", role="rollout", member=0, moment="mid_tool_turn")
    wait_done(api, jid)
    events = api.events(jid)
    audit_sampled(infra, jid, sampler)

    actions = [a for _, acts in _decisions(events) for a in acts]
    assert actions == ["RedispatchEpisodes", "ReplaceReplica"]
    redispatched = kinds(events, "episode_redispatched")
    assert redispatched, "no in-flight turn was re-dispatched"
    assert any(d["prefix_turns"] >= 2 for d in redispatched), "no episode resumed after its tool turn"
    # At most one turn regenerated per affected episode, and no finished episode lost.
    per_episode = {}
    for d in redispatched:
        per_episode[d["episode_id"]] = per_episode.get(d["episode_id"], 0) + 1
    assert max(per_episode.values()) == 1
    # The report (from the event log) counts what was generated again: turns and their tokens,
    # at most one turn per affected episode.
    crash = [f for f in api.report(jid)["faults"] if f["role"] == "rollout" and f["injected"]]
    assert len(crash) == 1, crash
    assert crash[0]["turns_regenerated"] >= 1 and crash[0]["tokens_regenerated"] > 0, crash
    assert crash[0]["turns_regenerated"] == crash[0]["episodes_regenerated"], crash
    # The replacement joined and pulled the current weights; the trainer never restarted.
    started = [d["member_id"] for d in kinds(events, "member_started")]
    assert "rollout-0-i1" in started and "trainer-e2-r0" not in started
    assert any(d["member_id"] == "rollout-0-i1" for d in kinds(events, "weights_loaded"))


def test_rollout_stall_is_detected_and_replaced(api, infra):
    spec = small_job("rstall", steps=12)
    jid = api.submit(spec)["job_id"]
    sampler = sample_batches(infra.redis_url, jid)
    wait_step(api, jid, 1)
    api.fault(jid, kind="stall", role="rollout", member=1, duration_s=120)
    wait_done(api, jid)
    events = api.events(jid)
    audit_sampled(infra, jid, sampler)
    faults = [f for f in _faults(events) if f["role"] == "rollout"]
    assert faults and faults[0]["kind"] in ("hang", "unresponsive") and faults[0]["member_id"] == "rollout-1-i0"
    assert "rollout-1-i1" in [d["member_id"] for d in kinds(events, "member_started")]


def test_tool_outage_is_a_tool_fault_not_a_rollout_fault(api, infra):
    spec = small_job("tool", steps=12, tools={"latency_s": 0.05, "retries": 1, "backoff_s": 0.05},
                     data={"tasks": ["lookup"]})
    jid = api.submit(spec)["job_id"]
    sampler = sample_batches(infra.redis_url, jid)
    wait_step(api, jid, 1)
    api.fault(jid, kind="tool_outage", role="request_manager", duration_s=2.0)
    wait_done(api, jid)
    events = api.events(jid)
    audit_sampled(infra, jid, sampler)
    faults = _faults(events)
    assert faults and all(f["kind"] == "tool_outage" for f in faults), faults
    assert all(acts == ["ReportOnly"] for _, acts in _decisions(events))
    assert kinds(events, "tool_fault"), "the outage produced no tool failure"
    # Nobody was restarted for a tool fault.
    assert len(kinds(events, "member_started")) == 4


def test_fault_in_first_step_escalates_to_whole_job_restart(api, infra):
    # Long tool calls keep step 0 running well after the members are up.
    spec = small_job("first", steps=2, tools={"latency_s": 3.0, "timeout_s": 10.0}, data={"tasks": ["lookup"]})
    jid = api.submit(spec)["job_id"]
    sampler = sample_batches(infra.redis_url, jid)
    eventually(lambda: any(e["kind"] == "job_ready" for e in api.events(jid)), timeout=90, interval=0.1,
               what="members up")
    assert api.job(jid)["committed_step"] == -1
    api.fault(jid, kind="crash", role="rollout", member=0)
    wait_done(api, jid)
    events = api.events(jid)
    audit_sampled(infra, jid, sampler)
    acts = [a for _, a in _decisions(events)]
    assert ["RestartWholeJob"] in acts
    assert "trainer-e2-r0" in [d["member_id"] for d in kinds(events, "member_started")]


def test_whole_job_policy_restarts_everything_and_regenerates_the_step(api, infra):
    jid = api.submit(small_job("whole", steps=8, recovery={"policy": "whole_job"}))["job_id"]
    sampler = sample_batches(infra.redis_url, jid)
    wait_step(api, jid, 1)
    t0 = time.time()
    api.fault(jid, kind="crash", role="trainer", member=0)
    wait_done(api, jid)
    events = api.events(jid)
    audit_sampled(infra, jid, sampler)
    assert [a for _, a in _decisions(events)] == [["RestartWholeJob"]]
    started_after = [d["member_id"] for e in events if e["kind"] == "member_started" and e["ts"] > t0
                     for d in [e["data"]]]
    assert {"rollout-0-i1", "rollout-1-i1", "trainer-e2-r0", "trainer-e2-r1"} <= set(started_after)
    assert kinds(events, "work_lost"), "whole-job restart did not account for lost work"


@pytest.mark.parametrize(("mode", "staleness"), [("semi_sync", 1), ("async", 2)])
def test_overlapped_modes_recover_a_trainer_crash_within_the_staleness_bound(api, infra, mode, staleness):
    """semi_sync / async: step k's rollouts may run on versions down to k - staleness while the
    trainer trains earlier steps; a trainer crash is recovered role-locally and every invariant
    still holds."""
    jid = api.submit(small_job(mode.replace("_", "-"), steps=8, mode=mode, staleness=staleness))["job_id"]
    sampler = sample_batches(infra.redis_url, jid)
    wait_step(api, jid, 2)
    api.fault(jid, kind="crash", role="trainer", member=0)
    wait_done(api, jid)
    events = api.events(jid)
    audit_sampled(infra, jid, sampler)  # includes: every turn it can still see is within the staleness bound
    assert ["RestartTrainerGang"] in [acts for _, acts in _decisions(events)]
    # Overlap, from the log: some step started before the step before it was committed.
    started = {d["step"]: e["ts"] for e in events if e["kind"] == "step_started" for d in [e["data"]]}
    committed = {e["data"]["step"]: e["ts"] for e in events if e["kind"] == "step_committed"}
    assert any(started[k] < committed[k - 1] for k in started if k - 1 in committed), (
        "no step generated on an older version: rollout and training never overlapped")


def test_trainer_crash_with_warm_spares_restarts_the_gang_from_spares(api, infra):
    jid = api.submit(small_job("tspare", steps=8, recovery={"warm_spares": 2}))["job_id"]
    sampler = sample_batches(infra.redis_url, jid)
    wait_step(api, jid, 2)  # the spares have imported the member code by now
    api.fault(jid, kind="crash", role="trainer", member=0)
    wait_done(api, jid)
    events = api.events(jid)
    audit_sampled(infra, jid, sampler)
    assert [["RestartTrainerGang"]] == [acts for _, acts in _decisions(events)]
    started = {d["member_id"]: d.get("warm") for d in kinds(events, "member_started")}
    # the first members started cold; the new gang came from the two warm spares
    assert started["trainer-e1-r0"] is False and started["rollout-0-i0"] is False
    assert started["trainer-e2-r0"] is True and started["trainer-e2-r1"] is True
    assert api.report(jid)["faults"][0]["recovery_s"] is not None
