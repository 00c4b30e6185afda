"""The auditor's invariants that an outside review found restated or missed: each test builds a
job state the earlier auditor passed and the auditor must now fail.

Weights are judged by gang lineage (not by version alone), batches are compared with their step's
episode set, a turn is applied once per (episode, turn), a batch seen live is still lost when it
left Redis before its checkpoint was durable, and an ended job leaves nothing unappended in the
request manager's outbox. The checkpoint items (rank coverage, own folders, the chain of origins,
durable claims, hashing the checkpointed model) are in ``test_audit_checkpoints.py``.

Redis state is written by the project's own stores into the session's Redis server and read back
raw by the auditor's reader.
"""

from __future__ import annotations

import asyncio
import copy
import uuid
from typing import Any

import pytest
from test_audit import Log, gang_2_redoes_step_2, sound_job

from robustrl.audit import AuditInput, AuditOptions, ObservedStep, judge
from robustrl.audit.raw import RawEvent, RawRedis, read_redis
from robustrl.config import Settings
from robustrl.messages import Event
from robustrl.storage.control_stores import ControllerOutbox, OutboxEntry, RmOutbox
from robustrl.storage.fencing import GangFence
from robustrl.storage.redis_stores import BatchRecord, BatchStore, EpisodeRecord, EpisodeStore, Keys, connect


def _violations(report: Any) -> str:
    return "\n".join(report.violations())


# -- weights keyed by gang lineage ------------------------------------------------------------------


def _take_over(inp: AuditInput) -> Log:
    """The sound job's log up to its end, then gang 2 resumes at step 2 from checkpoint 1 (it
    publishes v2 again, same weights) and redoes step 2 (its own v3, other weights than gang 1's)."""
    log = Log()
    log.events = list(inp.events[:-1])
    log.add("member_ready", role="trainer", epoch=2, resume_step=2, weights_version=2)
    log.add("weights_published", version=2, epoch=2, checksum="c2")
    log.add("step_committed", step=2, epoch=2, weights_version=3, checksum="c3b", durable_step=2)
    log.add("weights_published", version=3, epoch=2, checksum="c3b")
    return log


def test_a_replica_loading_a_superseded_gangs_version_fails_but_loads_before_the_take_over_pass():
    """Keyed by version alone, gang 1's v3 (c3) stayed a published v3 after gang 2 replaced it
    and published its own v3 (c3b): a replica loading c3 then passed."""
    inp = sound_job()
    log = _take_over(inp)
    log.add("weights_loaded", member_id="r0", version=2, epoch=2, checksum="c2")  # gang 2's own v2
    log.add("weights_loaded", member_id="r0", version=3, epoch=2, checksum="c3b")
    log.add("job_finished")
    inp.events = log.events
    # r0 and r1 loaded gang 1's c3 before gang 2 existed: sound.
    assert judge(inp).checks["weights"].passed, _violations(judge(inp))

    log.events = log.events[:-1]
    log.add("weights_loaded", member_id="r1", version=3, epoch=1, checksum="c3")
    log.add("job_finished")
    inp.events = log.events
    report = judge(inp)
    assert not report.checks["weights"].passed and report.replicas_served_bad_weights == 1, _violations(report)
    assert any("r1 loaded v3" in v and "superseded" in v for v in report.violations()), _violations(report)


def test_a_load_logged_before_its_version_was_published_fails():
    inp = sound_job()
    log = Log()
    log.events = list(inp.events[:4])  # job_submitted, job_started, member_ready, weights_published v0
    log.add("weights_loaded", member_id="r0", version=1, checksum="c1")  # before the trainer published c1
    log.events += inp.events[4:]
    inp.events = [RawEvent(i + 1, e.kind, float(i + 1), e.data) for i, e in enumerate(log.events)]
    report = judge(inp)
    assert not report.checks["weights"].passed, _violations(report)
    assert any("before" in v and "published" in v for v in report.violations()), _violations(report)


# -- batches against their step's episode set -----------------------------------------------------


def _with_step_sets(inp: AuditInput) -> AuditInput:
    inp.redis.step_sets = {k: set(b["episode_ids"]) for k, b in inp.redis.batches.items()}
    return inp


def test_a_batch_naming_an_episode_outside_its_steps_set_fails():
    inp = _with_step_sets(sound_job())
    assert judge(inp).ok, _violations(judge(inp))
    inp.redis.step_sets[1].discard("s1-p0-g0")
    report = judge(inp)
    assert not report.checks["episodes"].passed, _violations(report)
    assert any("s1-p0-g0" in v and "not in" in v for v in report.violations()), _violations(report)


def test_a_finished_episode_of_a_trained_step_left_out_of_its_batch_fails():
    inp = _with_step_sets(sound_job())
    extra = copy.deepcopy(inp.redis.episodes["s1-p0-g0"])
    extra["episode_id"] = "s1-p7-g0"
    inp.redis.episodes["s1-p7-g0"] = extra
    inp.redis.step_sets[1].add("s1-p7-g0")
    report = judge(inp)
    assert not report.checks["episodes"].passed and report.episodes_lost == 1, _violations(report)
    assert any("s1-p7-g0" in v for v in report.violations()), _violations(report)


def test_an_observed_batch_is_compared_with_the_step_set_seen_with_it():
    inp = sound_job()
    ids = [f"s2-p{p}-g{g}" for p in range(2) for g in range(2)]
    extra = {**copy.deepcopy(inp.redis.episodes[ids[0]]), "episode_id": "s2-p7-g0"}
    obs = ObservedStep(2, {"episode_ids": ids}, {**{e: inp.redis.episodes[e] for e in ids}, "s2-p7-g0": extra})
    obs.step_set = {*ids, "s2-p7-g0"}  # the set read with the batch at hand-off: one more finished episode
    inp.observed[2] = obs
    del inp.redis.batches[2]  # collected after its checkpoint (2) became durable
    report = judge(inp)
    assert not report.checks["episodes"].passed, _violations(report)
    assert any("s2-p7-g0" in v for v in report.violations()), _violations(report)


# -- idempotence per (episode, turn) ---------------------------------------------------------------


def _with_request_ids(inp: AuditInput) -> AuditInput:
    for eid, ep in inp.redis.episodes.items():
        for i, t in enumerate(ep["turns"]):
            if t["role"] == "assistant":
                t["request_id"] = f"{eid}-t{i}"
    return inp


def test_a_turn_applied_twice_fails():
    inp = _with_request_ids(sound_job())
    assert judge(inp).ok, _violations(judge(inp))
    ep = inp.redis.episodes["s1-p1-g0"]
    ep["turns"].append(copy.deepcopy(ep["turns"][-1]))  # the last turn's reply kept twice
    report = judge(inp)
    assert not report.checks["episodes"].passed, _violations(report)
    assert any("s1-p1-g0" in v and "twice" in v for v in report.violations()), _violations(report)


def test_one_request_answering_two_turns_fails():
    inp = _with_request_ids(sound_job())
    turns = inp.redis.episodes["s0-p0-g1"]["turns"]
    turns[2]["request_id"] = turns[0]["request_id"]  # turn 2 is the reply to turn 0's request
    report = judge(inp)
    assert not report.checks["episodes"].passed, _violations(report)
    assert any("s0-p0-g1" in v and turns[0]["request_id"] in v for v in report.violations()), _violations(report)


# -- a batch observed live is no excuse for collecting it early -----------------------------------


def test_an_observed_batch_collected_before_its_checkpoint_was_durable_is_lost():
    inp = sound_job()
    inp.checkpoints = inp.checkpoints[:1]  # newest loadable: step 0
    ids = [f"s2-p{p}-g{g}" for p in range(2) for g in range(2)]
    inp.observed[2] = ObservedStep(2, {"episode_ids": ids}, {e: inp.redis.episodes[e] for e in ids})
    del inp.redis.batches[2]  # gone from Redis although checkpoint 2 is not durable
    report = judge(inp)
    assert not report.checks["episodes"].passed and report.episodes_lost == len(ids), _violations(report)


# -- the request manager's outbox ------------------------------------------------------------------


def _outbox_entry(kind: str, ts: float, data: dict[str, Any]) -> dict[str, Any]:
    return {"msg_id": f"j-{kind}-x", "event": {"job_id": "j", "kind": kind, "ts": ts, "data": data}}


def test_events_left_in_the_outbox_of_an_ended_job_fail_unless_already_appended():
    inp = sound_job()
    lost = {"fault_id": "f1", "tokens": 12, "steps_redone": 0}
    inp.redis.outbox = [_outbox_entry("work_lost", 4.5, lost)]
    report = judge(inp)
    assert not report.ok and any("outbox" in v and "work_lost" in v for v in report.violations()), \
        _violations(report)
    # Stored in the log already (its removal from the outbox not done yet): nothing is missing.
    n = len(inp.events)
    inp.events = [*inp.events[:-1], RawEvent(n + 1, "work_lost", 4.5, lost), RawEvent(n + 2, "job_finished", n + 2.0, {})]
    assert judge(inp).ok, _violations(judge(inp))
    # A job still running may hold events on their way.
    inp = sound_job()
    inp.events = inp.events[:-1]
    inp.redis.outbox = [_outbox_entry("work_lost", 4.5, lost)]
    assert judge(inp, AuditOptions(require_ended=False)).ok, _violations(judge(inp, AuditOptions(require_ended=False)))


def _read_after(infra: Settings, job: str, steps: int, write: Any) -> RawRedis:
    """``await write(redis)`` through the project's own stores, then the job's Redis read back by
    the auditor's raw reader; the job's keys are removed after."""

    async def run() -> RawRedis:
        r = connect(infra.redis_url)
        try:
            await write(r)
            return await read_redis(infra.redis_url, job, steps)
        finally:
            keys = [k async for k in r.scan_iter(match=f"rrl:{job}:*")]
            if keys:
                await r.delete(*keys)
            await r.aclose()

    return asyncio.run(run())


def test_step_sets_and_the_outbox_are_read_raw_from_redis(infra: Settings):
    """Written by the request manager's own stores, read back by the auditor's raw reader."""
    job = f"aud-{uuid.uuid4().hex[:8]}"

    async def write(r: Any) -> None:
        eps = EpisodeStore(r, job)
        ids = [f"s0-p{p}-g0" for p in range(3)]
        for eid in ids:
            await eps.put(EpisodeRecord(job_id=job, episode_id=eid, step=0, group_id="s0-p0", prompt={},
                                        prompt_ids=[1], status="finished", reward=0.5))
        await BatchStore(r, job).put(BatchRecord(job_id=job, step=0, episode_ids=ids[:2], reward_mean=0.5))
        await RmOutbox(r, job).add(OutboxEntry(msg_id=f"{job}-note", event=Event(
            job_id=job, kind="note", data={"text": "never appended"})))

    raw = _read_after(infra, job, 1, write)
    log = Log()
    log.add("job_submitted", spec={"steps": 1, "data": {"prompts_per_step": 1, "group_size": 2}})
    log.add("step_committed", step=0, epoch=1, weights_version=1)
    log.add("job_finished")
    assert raw.step_sets == {0: {"s0-p0-g0", "s0-p1-g0", "s0-p2-g0"}} and raw.outbox is not None, raw
    report = judge(AuditInput(job_id=job, events=log.events, redis=raw, checkpoints=[]))
    # Finished, in the step's set, left out of the batch.
    assert any("s0-p2-g0" in v and "not in its batch" in v for v in report.checks["episodes"].violations), \
        _violations(report)
    assert any("note" in v for v in report.checks["outbox"].violations), _violations(report)


# -- the batch claim's holder ----------------------------------------------------------------------


def test_a_step_trained_past_an_older_gangs_batch_claim_fails():
    """The fence (``Keys.fence``) names the gang holding a step's batch claim: the gang that
    trained the step last must be that gang."""
    inp = gang_2_redoes_step_2(sound_job())  # step 2 trained by gang 1, then redone by gang 2
    inp.redis.fences = {1: 1, 2: 2}
    assert judge(inp).ok, _violations(judge(inp))
    inp.redis.fences = {1: 1, 2: 1}  # gang 2 trained step 2 while gang 1 still held its claim
    report = judge(inp)
    assert not report.checks["trained_once"].passed and any(
        "step 2: trained by gang 2 while gang 1 held its batch claim" in v for v in report.violations()), \
        _violations(report)
    inp.redis.fences = {2: 3}  # a redo by gang 3 never trained, in a finished job
    assert any("held by gang 3, which never trained it" in v for v in judge(inp).violations()), \
        _violations(judge(inp))
    inp.redis.fences = {2: None}
    assert any("does not parse" in v for v in judge(inp).violations()), _violations(judge(inp))


def test_a_step_trained_without_its_batch_claim_fails():
    """Every step trained after the trainer's fence collection must hold its batch claim: rank 0
    claims each batch before training it (``GangFence.claim``), and without the claim nothing
    stops a second gang from training it too. Steps through the collection marker are exempt."""
    inp = gang_2_redoes_step_2(sound_job())
    inp.redis.fences = {1: 1, 2: 2}
    inp.redis.fences_collected = 0
    assert judge(inp).ok, _violations(judge(inp))
    inp.redis.fences = {2: 2}  # step 1 trained, never claimed (or its claim deleted)
    report = judge(inp)
    assert not report.checks["trained_once"].passed and any(
        "step 1: trained by gang 1 without a batch claim" in v for v in report.violations()), _violations(report)
    inp.redis.fences_collected = 1  # collected by the trainer: nothing to compare
    assert judge(inp).ok, _violations(judge(inp))
    inp.redis.fences_collected = None  # (not read: a synthetic input)
    assert judge(inp).ok, _violations(judge(inp))
    inp.redis.fence_marker_damaged = True  # (there, and not a step: said, not guessed)
    assert any("fence collection marker does not parse" in v for v in judge(inp).violations())


def test_the_batch_claims_are_read_raw_from_redis(infra: Settings):
    """Claimed through the trainer's own fence (a gang 1 claim, then gang 2's redo of step 1),
    read back raw by the auditor's reader."""
    job = f"aud-{uuid.uuid4().hex[:8]}"

    async def claim(r: Any) -> None:
        await GangFence(r, job, 1).claim(0, -1)
        await GangFence(r, job, 1).claim(1, -1)
        await GangFence(r, job, 2).claim(1, 0)

    raw = _read_after(infra, job, 3, claim)
    assert raw.fences == {0: 1, 1: 2} and raw.fences_collected == -1, (raw.fences, raw.fences_collected)

    async def collected(r: Any) -> None:
        await claim(r)
        gang = GangFence(r, job, 2)
        await gang.durable(0)
        await gang.durable(1)
        await gang.collect()

    raw = _read_after(infra, job, 3, collected)
    assert raw.fences == {1: 2} and raw.fences_collected == 0, (raw.fences, raw.fences_collected)

    async def damaged(r: Any) -> None:
        await claim(r)
        await r.set(Keys.fence_gc(job), b"not a step")

    raw = _read_after(infra, job, 3, damaged)
    assert raw.fences_collected is None and raw.fence_marker_damaged, raw.fences_collected

    async def nothing_left(r: Any) -> None:  # the job's keys gone (deleted with its log kept)
        return None

    raw = _read_after(infra, job, 3, nothing_left)
    assert raw.fences_collected is None and not raw.fence_marker_damaged


def test_a_live_sample_torn_by_the_steps_collection_is_no_sample(infra: Settings, monkeypatch):
    """``observe_batch`` reads a batch, then its episodes: the step collected in between (its
    checkpoint became durable) left a sample of a batch without episodes, which the audit then
    judged lost. The batch is read again last; gone, the sample is nothing seen."""
    import redis.asyncio as aioredis

    from robustrl.audit.raw import observe_batch
    from robustrl.storage.redis_stores import RolloutGC

    job = f"aud-{uuid.uuid4().hex[:8]}"
    plain_mget = aioredis.Redis.mget

    async def run() -> Any:
        r = connect(infra.redis_url)
        try:
            eps = EpisodeStore(r, job)
            await eps.put(EpisodeRecord(job_id=job, episode_id="s0-p0-g0", step=0, group_id="s0-p0", prompt={},
                                        prompt_ids=[1], status="finished", reward=0.5))
            await r.sadd(Keys.step_episodes(job, 0), "s0-p0-g0")
            await BatchStore(r, job).put(BatchRecord(job_id=job, step=0, episode_ids=["s0-p0-g0"], reward_mean=0.5))
            whole = await observe_batch(infra.redis_url, job, 0)
            collected: list[int] = []

            async def mget_after_gc(self: Any, *args: Any, **kw: Any) -> Any:
                if not collected:  # the step is collected between the batch's read and its episodes'
                    collected.append(await RolloutGC(r, job).collect(0))
                return await plain_mget(self, *args, **kw)

            monkeypatch.setattr(aioredis.Redis, "mget", mget_after_gc)
            torn = await observe_batch(infra.redis_url, job, 0)
            return whole, torn, collected
        finally:
            monkeypatch.setattr(aioredis.Redis, "mget", plain_mget)
            keys = [k async for k in r.scan_iter(match=f"rrl:{job}:*")]
            if keys:
                await r.delete(*keys)
            await r.aclose()

    whole, torn, collected = asyncio.run(run())
    assert whole is not None and set(whole[1]) == {"s0-p0-g0"}, whole
    assert collected == [1] and torn is None, torn


def test_keys_of_another_type_are_reported_where_they_stand_and_the_rest_is_still_read(infra: Settings):
    """A fence, a batch, a step set and an episode key of a type the services never write (a
    list where a string is due, a string where a set is): the raw read goes on (before, one
    WRONGTYPE reply ended the whole audit with a transport error) and each reads as a value that
    does not parse; the good step beside them is read as written."""
    job = f"aud-{uuid.uuid4().hex[:8]}"

    async def write(r: Any) -> None:
        await GangFence(r, job, 1).claim(0, -1)
        await BatchStore(r, job).put(BatchRecord(job_id=job, step=0, episode_ids=["e0"], reward_mean=0.5))
        await r.sadd(Keys.step_episodes(job, 0), "e0")
        await r.rpush(Keys.fence(job, 1), "1")  # the wrong types
        await r.rpush(Keys.batch(job, 1), "{}")
        await r.set(Keys.step_episodes(job, 1), "e1")
        await r.rpush(Keys.episode(job, "e0"), "x")

    raw = _read_after(infra, job, 2, write)
    assert raw.fences == {0: 1, 1: None}, raw.fences
    assert raw.batches[1] is None and raw.batches[0]["episode_ids"] == ["e0"], raw.batches
    assert raw.step_sets.get(0) == {"e0"} and 1 not in raw.step_sets, raw.step_sets
    assert raw.episodes.get("e0", "absent") is None, raw.episodes


def test_a_trained_record_of_an_older_gang_after_a_newer_gangs_is_a_write_past_the_fence():
    """The trained log is appended only through the gang fence, which refuses an older gang once
    a newer one has written: in the raw list, gangs never go back. A stale rank's record landing
    after the new gang's (a fence that guarded only the start of training) must fail, even for a
    step the new gang never trained."""
    inp = gang_2_redoes_step_2(sound_job())
    inp.redis.trained.append({"step": 2, "epoch": 2, "checksum": "c3b"})
    assert judge(inp).ok, _violations(judge(inp))
    inp.redis.trained.append({"step": 3, "epoch": 1, "checksum": "c4"})  # gang 1, after gang 2's record
    report = judge(inp)
    assert not report.checks["trained_once"].passed and any(
        "gang 1 recorded step 3 trained after gang 2 had written" in v for v in report.violations()), \
        _violations(report)
    inp.redis.trained_in_order = False  # a log read from a hash or sorted set: no append order to judge
    assert not any("after gang 2 had written" in v for v in judge(inp).violations()), _violations(judge(inp))


def test_the_fence_refuses_an_older_gangs_trained_record_and_the_raw_log_shows_it(infra: Settings):
    """Through the trainer's own fence on the real server: gang 2 enters, gang 1's late record is
    refused, and the auditor's raw read of the log keeps the order it was written in."""
    from robustrl.errors import StaleEpoch

    job = f"aud-{uuid.uuid4().hex[:8]}"

    async def write(r: Any) -> None:
        await GangFence(r, job, 1).record_trained(0, "c1")
        await GangFence(r, job, 2).record_trained(1, "c2")
        with pytest.raises(StaleEpoch):
            await GangFence(r, job, 1).record_trained(1, "c2x")

    raw = _read_after(infra, job, 2, write)
    assert [(e["step"], e["epoch"]) for e in raw.trained if e] == [(0, 1), (1, 2)], raw.trained


# -- the controller's outbox -----------------------------------------------------------------------


def test_a_controller_event_given_before_the_logged_final_event_and_never_appended_fails():
    """The controller's flusher appends in order: a final event in the log with a controller
    event given well before it still owed means that event was skipped (lost), not late."""
    inp = sound_job()
    final_ts = inp.events[-1].ts
    given = final_ts - AuditOptions().controller_outbox_slack_s - 1.0
    decision = {"fault_id": "f1", "actions": ["restart_role"], "reason": "trainer crash"}
    inp.redis.controller_outbox = [_outbox_entry("decision", given, decision)]
    report = judge(inp)
    assert not report.ok and any("controller" in v and "decision" in v
                                 for v in report.checks["outbox"].violations), _violations(report)
    # Appended already, its removal from the outbox not done yet: sound.
    n = len(inp.events)
    inp.events = [*inp.events[:-1], RawEvent(n + 1, "decision", given, decision), inp.events[-1]]
    assert judge(inp).ok, _violations(judge(inp))
    # Given just before the final event: its save may have retried past it (a Redis blip), so it
    # may still be on its way.
    inp = sound_job()
    inp.redis.controller_outbox = [_outbox_entry("decision", final_ts - 0.5, decision)]
    report = judge(inp)
    assert report.ok and report.facts["controller_outbox_owed"] == 1, (_violations(report), report.facts)


def test_controller_events_given_after_the_final_event_may_still_be_owed():
    """``member_stopped`` of the members the final stop ends is given after the final event: still
    owed when the auditor runs is not a loss (counted, not failed). An entry that does not parse
    is judged as given before."""
    inp = sound_job()
    final_ts = inp.events[-1].ts
    inp.redis.controller_outbox = [_outbox_entry("member_stopped", final_ts + 0.2, {"member_id": "r0"})]
    report = judge(inp)
    assert report.ok and report.facts["controller_outbox_owed"] == 1, (_violations(report), report.facts)
    inp.redis.controller_outbox.append(None)
    assert any("does not parse" in v for v in judge(inp).checks["outbox"].violations), _violations(judge(inp))
    # A job whose log has no final event yet: everything may be on its way.
    inp = sound_job()
    inp.events = inp.events[:-1]
    inp.redis.controller_outbox = [_outbox_entry("decision", 1.0, {"fault_id": "f1", "actions": []})]
    assert judge(inp, AuditOptions(require_ended=False)).ok, _violations(judge(inp, AuditOptions(require_ended=False)))


def test_the_controller_outbox_is_read_raw_from_redis(infra: Settings):
    """Written by the controller's own store, read back by the auditor's raw reader."""
    job = f"aud-{uuid.uuid4().hex[:8]}"
    log = Log()
    log.add("job_submitted", spec={"steps": 1, "data": {"prompts_per_step": 1, "group_size": 2}})
    log.add("step_committed", step=0, epoch=1, weights_version=1)
    log.add("job_finished")
    final_ts = log.events[-1].ts

    async def write(r: Any) -> None:
        box = ControllerOutbox(r, job)
        for kind, ts, data in (("decision", final_ts - 100.0, {"fault_id": "f1", "actions": ["restart_role"]}),
                               ("member_stopped", final_ts + 1.0, {"member_id": "r0", "role": "rollout"})):
            await box.add(OutboxEntry(msg_id=f"{job}-{kind}", event=Event(job_id=job, kind=kind, ts=ts, data=data)))

    raw = _read_after(infra, job, 1, write)
    assert raw.controller_outbox is not None and len(raw.controller_outbox) == 2, raw
    report = judge(AuditInput(job_id=job, events=log.events, redis=raw, checkpoints=[]))
    violations = report.checks["outbox"].violations
    assert any("decision" in v for v in violations), _violations(report)
    assert not any("member_stopped" in v for v in violations) and report.facts["controller_outbox_owed"] == 1, \
        (_violations(report), report.facts)


@pytest.mark.parametrize("redo", [False, True])
def test_redo_helper_still_judges_the_sound_lineage(redo: bool):
    """The synthetic two-gang job the other tests build on stays sound under the new checks."""
    inp = gang_2_redoes_step_2(sound_job()) if redo else sound_job()
    assert judge(_with_request_ids(_with_step_sets(inp))).ok, _violations(judge(inp))
