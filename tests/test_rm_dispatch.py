"""Request-manager bounds and idempotency against real NATS + Redis with scripted replicas
(tests/rm_harness.py): a turn past its deadline, a replica that never reaches the step's weights,
a stuck step, a step retried mid-flight, a request manager killed mid-step. Each checks the
outcome from outside: requests the replicas received, raw Redis keys, the event log, fault reports.
"""

from __future__ import annotations

import asyncio
import collections
import json
import math
import time
from typing import Any

import pytest
from rm_harness import FakeReplica, Harness, rm_spec
from support import eventually_async

from robustrl.config import JobSpec
from robustrl.errors import TransportError
from robustrl.services.request_manager.dispatch import REFUSED_BEFORE_FAULT
from robustrl.messages import GenerateTurn, MemberHello, StepCommitted, TurnResult, WeightsAnnounce
from robustrl.subjects import Verb, subject
from robustrl.storage.redis_stores import Keys

pytestmark = pytest.mark.timeout(120)


def _per_turn(h: Harness) -> collections.Counter[tuple[str, int]]:
    """(episode, turn seed) -> how many GenerateTurn requests the replicas received for it."""
    return collections.Counter((m.episode_id, m.seed) for m in h.requests())


async def test_a_turn_past_its_deadline_goes_to_another_replica_and_its_late_reply_is_dropped(servers):
    async with Harness(servers, rm_spec("deadline", turn_deadline_s=1.0)) as h:
        a, b = await h.replica("rollout-0-i0"), await h.replica("rollout-1-i0")
        a.hold = lambda msg: True  # a dropped reply: replica a never answers on its own
        await h.start_rm()
        await eventually_async(lambda: 0 in h.batches, timeout=20, what="step 0 handed over")
        assert a.held, "replica a was never given a turn"
        # The held turns were generated again by b, once each.
        held_eps = {m.episode_id for m in a.held}
        assert held_eps <= {m.episode_id for m in b.received}
        # Now a's replies arrive, late: they are dropped, never applied over the episode.
        late = await a.release()
        dropped = await eventually_async(lambda: _dropped(h, len(late)), timeout=10, what="late replies dropped")
        assert {d["request_id"] for d in dropped} == {m.request_id for m in late}
        episodes = await h.episodes.get_many(h.batches[0].episode_ids)
        for ep in episodes:
            assistant = [t for t in ep.turns if t.role == "assistant"]
            assert ep.status == "finished" and len(assistant) == 1, ep
            if ep.episode_id in held_eps:
                assert assistant[0].member_id == b.member_id
                assert assistant[0].request_id not in {m.request_id for m in late}
        # Measured, not estimated: each regenerated turn's real token count is in the log.
        regen = await h.events("turn_regenerated")
        assert sorted(d["episode_id"] for d in regen) == sorted(held_eps)
        assert all(d["cause"] == "turn_deadline" and d["tokens"] == 2 for d in regen)


async def test_a_turn_deadline_holds_though_the_wall_clock_steps_back(servers, monkeypatch):
    """Replica a takes turns and never answers (alive: its metrics go on); the wall clock steps
    back an hour the moment it holds its first turn. Its turns still go to b at their deadline
    (1 s) and the step is handed over. On the wall clock, each held turn's deadline lay an hour
    ahead: the step waited on a live, silent owner for an hour."""
    real, offset = time.time, [0.0]
    monkeypatch.setattr(time, "time", lambda: real() + offset[0])
    async with Harness(servers, rm_spec("clockturn", turn_deadline_s=1.0)) as h:
        a, b = await h.replica("rollout-0-i0"), await h.replica("rollout-1-i0")

        def hold(msg: GenerateTurn) -> bool:
            offset[0] = -3600.0  # (from the first turn a holds on)
            return True

        a.hold = hold
        await h.start_rm()
        await eventually_async(lambda: 0 in h.batches, timeout=20, what="step 0 handed over")
        assert a.held and offset[0] == -3600.0
        assert {m.episode_id for m in a.held} <= {m.episode_id for m in b.received}


async def _dropped(h: Harness, n: int) -> list[dict]:
    got = await h.events("turn_dropped")
    return got if len(got) >= n else []


async def test_a_replica_that_never_reaches_the_step_version_is_reported_and_not_waited_for(servers):
    async with Harness(servers, rm_spec("version", steps=2, weights_load_s=1.5, step_deadline_s=30)) as h:
        a, b = await h.replica("rollout-0-i0"), await h.replica("rollout-1-i0")
        await h.start_rm()
        await eventually_async(lambda: 0 in h.batches, timeout=20, what="step 0 handed over")
        await h.commit(0)
        await b.set_version(1)  # a never gets v1 (its pull never succeeds)
        await eventually_async(lambda: 1 in h.batches, timeout=20, what="step 1 handed over without a")
        faults = [f for f in h.faults if f.cause == "weights_deadline"]
        assert [(f.role, f.member_id, f.kind) for f in faults] == [("rollout", a.member_id, "hang")]
        assert all(m.step == 0 for m in a.received), "a was given a turn of step 1 on old weights"


async def test_replicas_are_not_reported_late_for_a_version_the_new_gang_has_not_made(servers):
    """Gang 1 commits step 0 (v1) and dies before the replicas load v1; gang 2 resumes at step 0
    (nothing durable) holding v0 and redoes step 0, longer than ``weights_load_s``. No replica can
    hold v1 meanwhile, and none is late. Before, both were reported ``weights_deadline`` from
    step 1's start: during a whole-job restart the controller took that for a new member failing
    in it and restarted the job whole again (an outside review). Once gang 2 makes v1, a replica
    still below it past ``weights_load_s`` is reported (and only it)."""
    async with Harness(servers, rm_spec("redo", steps=2, weights_load_s=1.5, step_deadline_s=30)) as h:
        a, b = await h.replica("rollout-0-i0"), await h.replica("rollout-1-i0")
        await h.start_rm()
        await eventually_async(lambda: 0 in h.batches, timeout=20, what="step 0 handed over")
        await h.commit(0)  # gang 1: v1
        await h.bus.publish(subject(h.job_id, Verb.HELLO, "trainer-e2-r0"), MemberHello(
            job_id=h.job_id, member_id="trainer-e2-r0", role="trainer", pid=1, epoch=2, resume_step=0))
        redo_s = 2 * 1.5 + 1.0
        await asyncio.sleep(redo_s)  # gang 2 redoing step 0 (the fault's duration, not a wait for an event)
        assert [f.member_id for f in h.faults if f.cause == "weights_deadline"] == [], h.faults
        await h.bus.publish(subject(h.job_id, Verb.COMMIT), StepCommitted(
            job_id=h.job_id, step=0, weights_version=1, epoch=2, reward_mean=0.0, checksum="c", durable_step=-1))
        made = time.time()
        await b.set_version(1)  # a never loads gang 2's v1
        await eventually_async(lambda: 1 in h.batches, timeout=20, what="step 1 handed over without a")
        faults = [f for f in h.faults if f.cause == "weights_deadline"]
        assert [(f.member_id, f.kind) for f in faults] == [(a.member_id, "hang")], faults
        assert faults[0].detected_at >= made + 1.5 - 0.5, (faults[0].detected_at - made)
        assert all(m.step == 0 for m in a.received), "a was given a turn of step 1 on old weights"


async def test_a_new_life_learns_the_version_made_from_the_weights_pointer_and_a_resent_hello_lowers_nothing(servers):
    """A restarted request manager has heard nothing of the trainer: it learns the version the
    gang announced last from the fenced weights pointer. A hello of the current gang that is
    still being resent (until a controller acknowledges it) after its commits says the gang's
    resume version, lower than what it has made since: that must not stop the weights deadline
    (a replica stuck below the version would never be reported; the step deadline would blame
    the request manager itself: an outside review of the first version of this fix)."""
    async with Harness(servers, rm_spec("seed", steps=2, weights_load_s=1.5, step_deadline_s=30)) as h:
        a, b = await h.replica("rollout-0-i0"), await h.replica("rollout-1-i0")
        await h.start_rm()
        await eventually_async(lambda: 0 in h.batches, timeout=20, what="step 0 handed over")
        await h.redis.rpush(Keys.trained_log(h.job_id), json.dumps({"step": 0, "epoch": 1, "checksum": "c"}))
        await h.redis.set(Keys.weights_latest(h.job_id), WeightsAnnounce(  # as gang 1's fenced write sets it
            job_id=h.job_id, version=1, epoch=1, checksum="c1", sources=["tcp://127.0.0.1:9"],
            manifest_digest="0" * 64).model_dump_json())
        await h.kill_rm()
        h.committed = 0
        await h.start_rm()  # a new life, told to resume at step 1
        await h.bus.publish(subject(h.job_id, Verb.HELLO, "trainer-e1-r0"), MemberHello(  # resent
            job_id=h.job_id, member_id="trainer-e1-r0", role="trainer", pid=1, epoch=1, resume_step=0))
        await b.set_version(1)  # a never loads v1
        await eventually_async(lambda: 1 in h.batches, timeout=20, what="step 1 handed over without a")
        faults = [f for f in h.faults if f.cause == "weights_deadline"]
        assert [(f.member_id, f.kind) for f in faults] == [(a.member_id, "hang")], faults


async def test_a_stuck_step_is_a_fault_naming_its_cause(servers):
    spec = rm_spec("stuck", turn_deadline_s=1.0, step_deadline_s=3.0, weights_load_s=1.0)
    async with Harness(servers, spec) as h:
        for mid in ("rollout-0-i0", "rollout-1-i0"):
            (await h.replica(mid)).hold = lambda msg: True
        await h.start_rm()
        await eventually_async(lambda: any(f.cause == "step_deadline" for f in h.faults), timeout=20,
                               what="a step_deadline fault")
        stuck = next(f for f in h.faults if f.cause == "step_deadline")
        assert stuck.role == "rollout" and stuck.member_id in h.replicas and "outstanding" in stuck.evidence
        # Replicas that let turns pass their deadline again and again are reported too.
        await eventually_async(lambda: any(f.cause == "turn_deadline" and f.kind == "unresponsive"
                                           for f in h.faults), timeout=20, what="an unresponsive replica reported")
        assert 0 not in h.batches
        # In the log, for the controller's durable inbox (appended from the request manager's
        # outbox in the background: shortly after the report on the bus).
        want = {f.fault_id for f in h.faults}

        async def logged() -> bool:
            return {d["fault_id"] for d in await h.events("fault_detected")} >= want
        await eventually_async(logged, timeout=10, what="every reported fault in the log")


async def _a_step_attempt_failed_with_three_turns_in_flight(h: Harness) -> tuple[Any, list[str], Any]:
    """Step 0's four turns held at one replica; Redis trouble mid-step (the step's episode set
    unusable) makes the first episode that finishes fail the attempt (its own record is written,
    the set update refused); the set is then repaired. Returns once every sibling episode has
    stopped (none awaits a turn), the retry still to come: the replica (three turns held), the
    step's episode ids, the request answered."""
    a = await h.replica("rollout-0-i0")
    a.hold = lambda msg: True
    await h.start_rm()
    await eventually_async(lambda: len(a.held) == 4, timeout=20, what="4 turns in flight")
    ids = sorted(m.episode_id for m in a.held)
    await h.redis.set(Keys.step_episodes(h.job_id, 0), b"broken")
    first = a.held.pop(0)
    mark = len(h.rm_samples)
    await a.answer(first)
    await eventually_async(lambda: _finished(h, first.episode_id), timeout=10, what="first episode saved")
    await h.redis.delete(Keys.step_episodes(h.job_id, 0))
    await h.redis.sadd(Keys.step_episodes(h.job_id, 0), *ids)
    await eventually_async(lambda: any(s.inflight == 0 for s in h.rm_samples[mark:]), timeout=10,
                           what="every sibling episode stopped")
    return a, ids, first


async def test_a_failed_step_stops_every_episode_before_retrying_and_runs_none_twice(servers):
    async with Harness(servers, rm_spec("retry")) as h:
        a, ids, _first = await _a_step_attempt_failed_with_three_turns_in_flight(h)
        # The failed step stopped all its episodes before the retry took over the three turns
        # still in flight at the replica.
        await eventually_async(lambda: h.rm_samples[-1].inflight == 3, timeout=10, what="the retry adopted 3 turns")
        a.hold = lambda msg: False
        await a.release()
        await eventually_async(lambda: 0 in h.batches, timeout=30, what="step 0 handed over after the retry")
        # Every turn was asked for once: the retry adopted the turns still in flight instead of
        # starting the episodes again next to their first runs.
        assert max(_per_turn(h).values()) == 1, _per_turn(h)
        for ep in await h.episodes.get_many(ids):
            assert ep.status == "finished" and sum(t.role == "assistant" for t in ep.turns) == 1


async def test_replies_that_come_between_a_failed_attempt_and_its_retry_are_applied_not_asked_again(
        servers, monkeypatch):
    """A step attempt fails (Redis trouble) with three turns in flight; their replies come after
    the attempt let its turns go and before the retry adopts them. They were dropped as late, and
    each adopted turn waited until its replica was idle and was then generated again (three turns
    asked for twice). Now such a reply is kept and the adopting turn takes it: every turn asked
    for once. Judged from the requests the replica received, raw Redis and the log."""
    from robustrl.services.request_manager import batching

    monkeypatch.setattr(batching, "STEP_RETRY_S", 5.0)  # (the replies come in this pause, on a loaded machine too)
    async with Harness(servers, rm_spec("between")) as h:
        a, ids, first = await _a_step_attempt_failed_with_three_turns_in_flight(h)
        a.hold = lambda msg: False
        assert len(await a.release()) == 3  # before the retry (STEP_RETRY_S later) adopts them
        await eventually_async(lambda: 0 in h.batches, timeout=30, what="step 0 handed over after the retry")
        assert max(_per_turn(h).values()) == 1, _per_turn(h)
        held = {m.episode_id: m.request_id for m in a.received if m.episode_id != first.episode_id}
        for ep in await h.episodes.get_many(ids):
            assert ep.status == "finished" and sum(t.role == "assistant" for t in ep.turns) == 1
            if ep.episode_id in held:  # the very reply to the request the failed attempt let go
                assert [t.request_id for t in ep.turns if t.role == "assistant"] == [held[ep.episode_id]]

        async def kept() -> list[dict]:  # (logged in the background)
            found = [e for e in await h.events("turn_dropped") if e.get("kept_for_adoption")]
            return found if len(found) >= 3 else []

        assert len(await eventually_async(kept, timeout=10, what="three replies kept for adoption")) == 3


async def _finished(h: Harness, episode_id: str) -> bool:
    ep = await h.episodes.get(episode_id)
    return ep is not None and ep.status == "finished"


async def test_a_restarted_request_manager_keeps_finished_work_and_redispatches_only_orphaned_turns(servers):
    async with Harness(servers, rm_spec("resume")) as h:
        a, b = await h.replica("rollout-0-i0"), await h.replica("rollout-1-i0")
        a.hold = b.hold = lambda msg: True
        await h.start_rm()
        await eventually_async(lambda: len(a.held) + len(b.held) == 4, timeout=20, what="4 turns in flight")
        done = await a.release()  # a's turns finish before the crash
        await eventually_async(lambda: _all_finished(h, [m.episode_id for m in done]), timeout=10,
                               what="a's episodes finished")
        await h.kill_rm()
        # b finishes one turn while no request manager listens (its reply is lost) and still
        # works on the other when the new one starts.
        lost = b.held.pop(0)
        kept = b.held[0]
        a.hold = b.hold = lambda msg: False
        await h.start_rm(send_resume=False)  # nobody tells it: it finds the job in the registry
        resumed = await eventually_async(lambda: h.events("rm_resumed"), timeout=20, what="rm_resumed")
        assert resumed[0]["finished"] == len(done) and resumed[0]["unfinished"] == 2
        # It took over both turns b owns (its metrics count them in flight) ...
        mark = len(h.rm_samples)
        await eventually_async(lambda: any(x.inflight == 2 for x in h.rm_samples[mark:]), timeout=10,
                               what="the new life adopted b's two turns")
        await b.release()  # ... so the kept turn's reply is applied, not regenerated
        await eventually_async(lambda: 0 in h.batches, timeout=30, what="step 0 handed over after the restart")
        per_turn = _per_turn(h)
        assert all(per_turn[(m.episode_id, m.seed)] == 1 for m in [*done, kept]), per_turn
        assert per_turn[(lost.episode_id, lost.seed)] == 2, "the orphaned turn was not dispatched again"
        eps = {ep.episode_id: ep for ep in await h.episodes.get_many(h.batches[0].episode_ids)}
        assert len(eps) == 4 and all(ep.status == "finished" for ep in eps.values())
        for m in [*done, kept]:
            assert eps[m.episode_id].turns[0].request_id == m.request_id


async def _all_finished(h: Harness, ids: list[str]) -> bool:
    return all([await _finished(h, e) for e in ids])


async def test_rollout_state_is_deleted_once_the_checkpoint_after_it_is_durable(servers):
    """Rollout state of a step goes once a checkpoint after it is durable as well: one durable
    checkpoint's steps are kept. The newest checkpoint may fail its verification when a new gang
    loads it (a rotted blob); the gang then resumes from the one before it and redoes the steps in
    between from their batches. Collected through the newest (before), those were gone and every
    resume raised CheckpointLost: the job failed. Judged from raw Redis."""
    async with Harness(servers, rm_spec("gc", steps=4)) as h:
        a = await h.replica("rollout-0-i0")
        await h.start_rm()
        for k in range(4):
            await eventually_async(lambda k=k: k in h.batches, timeout=20, what=f"step {k} handed over")
            await h.redis.set(Keys.fence(h.job_id, k), b"1")
            await h.commit(k, durable=k - 1)  # checkpoint of step k is still uploading
            await a.set_version(k + 1)
        # durable: 2 newest, 1 before it -> steps 0 and 1 go; 2 (and 3) stay for a resume from 1
        await eventually_async(lambda: _gone(h, steps=(0, 1)), timeout=10, what="steps 0 and 1 collected")
        keys = await h.raw_keys()
        for k in (2, 3):
            assert Keys.batch(h.job_id, k) in keys, (k, keys)
            assert len(await h.episode_keys(k)) == 4
        assert int(await h.redis.get(Keys.rollout_gc(h.job_id))) == 1
        # the trainer's keys of a step are the trainer's to collect (GangFence.collect)
        assert all(Keys.fence(h.job_id, k) in keys for k in range(4)), keys


async def _gone(h: Harness, steps: tuple[int, ...]) -> bool:
    keys = await h.raw_keys()
    for k in steps:
        if {Keys.batch(h.job_id, k), Keys.step_episodes(h.job_id, k)} & set(keys):
            return False
        if await h.episode_keys(k):
            return False
    return True



async def test_a_commit_message_lost_on_the_bus_costs_seconds_not_the_job(servers):
    """The trainer records step 0 trained in Redis but its commit message never reaches the request
    manager (core NATS drops what is published while a subscriber is disconnected). Nothing else
    would notice: the trainer waits for batch 1, its normal idleness. The request manager must
    learn the commit from the trained log and hand over step 1. It reads the log with its own Redis
    user (least privilege: the log is the trainer's, read-only to it; a narrowing that took the
    read away left the wait to its commit deadline and a healthy gang restarted)."""
    import json

    from robustrl.services.request_manager.batching import COMMIT_RECHECK_S

    from robustrl.infra.credentials import Credentials, role_settings
    from robustrl.subjects import Principal

    assert servers.credentials_file
    rm_redis = role_settings(servers, Credentials.load(servers.credentials_file), Principal.REQUEST_MANAGER).redis_url
    async with Harness(servers, rm_spec("lostcommit", steps=3)) as h:
        reps = [await h.replica(mid) for mid in ("rollout-0-i0", "rollout-1-i0")]
        await h.start_rm(redis_url=rm_redis)
        await eventually_async(lambda: 0 in h.batches, timeout=30, what="batch 0 handed over")
        # The trainer's durable record, without the commit message.
        await h.redis.rpush(Keys.trained_log(h.job_id), json.dumps({"step": 0, "epoch": 1, "checksum": "c"}))
        for rep in reps:
            await rep.set_version(1)
        await eventually_async(lambda: 1 in h.batches, timeout=COMMIT_RECHECK_S * 3 + 10,
                               what="batch 1 handed over without a commit message")
        assert not any(f.cause == "step_deadline" for f in h.faults)


async def test_a_step_whose_every_attempt_fails_is_reported_at_its_deadline(servers):
    """A damaged episode record (a torn write, Redis out of memory) makes every attempt at step 0
    fail within a second, and the request manager retries it: the step deadline must still be
    reported, from its first attempt, with the failure named (a watch per attempt restarted its
    clock at each: the step was retried forever and nothing was reported; an outside review
    found it)."""
    async with Harness(servers, rm_spec("failing", step_deadline_s=2.0, turn_deadline_s=1.0,
                                        weights_load_s=1.0)) as h:
        a = await h.replica("rollout-0-i0")
        a.hold = lambda msg: True
        await h.start_rm()
        await eventually_async(lambda: len(a.received) >= 4, timeout=20, what="turns dispatched")
        await h.kill_rm()
        ids = await h.episodes.step_episode_ids(0)
        await h.redis.set(Keys.episode(h.job_id, ids[0]), b"{not json")  # one damaged record
        await h.start_rm()
        fault = await eventually_async(
            lambda: next((f for f in h.faults if f.cause == "step_deadline"), None), timeout=8,
            what="the failing step reported at its deadline")
        assert fault.role == "request_manager" and "attempts failed" in fault.evidence, fault
        assert 0 not in h.batches


async def test_a_late_reply_while_the_event_log_is_slow_holds_no_on_time_reply_back(servers):
    """JetStream slow to acknowledge (a stream leader election, a disk stall) while core NATS
    carries the turns: one late reply (its 'turn_dropped' event waits on JetStream) must not hold
    the on-time replies queued behind it on the same subscription. None of their turns may pass
    its deadline, nothing is regenerated, and the healthy replica is not reported (all were,
    before: the handler awaited the event; an outside review found it)."""
    import asyncio
    import time

    from robustrl.messages import TurnResult
    from robustrl.subjects import Verb, subject

    spec = rm_spec("slowlog", steps=2, turn_deadline_s=2.0, step_deadline_s=60.0)
    spec["data"]["group_size"] = 4  # 8 episodes on one replica
    async with Harness(servers, spec) as h:
        a = await h.replica("rollout-0-i0")
        await h.start_rm()
        await eventually_async(lambda: 0 in h.batches, timeout=30, what="step 0")
        a.hold = lambda msg: True
        await a.set_version(1)
        await h.commit(0)
        await eventually_async(lambda: len(a.held) >= 8, timeout=30, what="step 1 dispatched")
        assert h.rm_bus is not None
        real = h.rm_bus.emit_event
        until = time.monotonic() + 6.0

        async def slow_log(*args: object, **kw: object) -> None:  # JetStream not acknowledging for 6 s
            await asyncio.sleep(max(0.0, until - time.monotonic()))
            await real(*args, **kw)  # type: ignore[arg-type]

        h.rm_bus.emit_event = slow_log  # type: ignore[method-assign]
        await h.bus.publish(subject(h.job_id, Verb.TURN), TurnResult(
            job_id=h.job_id, request_id="stale-req", episode_id="s0-x-g0", member_id="rollout-0-i0",
            token_ids=[1], logprobs=[-1.0], stop_reason="eot", weights_version=0))
        a.hold = lambda msg: False
        await a.release()  # every on-time reply, right behind the late one
        await eventually_async(lambda: 1 in h.batches, timeout=60, what="step 1 handed over")
        assert not [f for f in h.faults if f.cause == "turn_deadline"], h.faults
        assert not await h.events("turn_regenerated")
        assert max(_per_turn(h).values()) == 1  # no turn sent twice


async def test_a_step_handed_over_is_not_reported_while_the_trainer_takes_its_time(servers):
    """Step 0 is handed over, then the trainer does not commit it for three step deadlines (a gang
    recovery, a redo after a rollback): nothing is the request manager's to report, so no
    ``step_deadline`` fault (a watch left running past the hand-over reported step 0 as not handed
    over, every period, blaming the request manager; an outside review found it). Step 1 then runs
    once step 0 commits."""
    import asyncio

    async with Harness(servers, rm_spec("slowtrainer", steps=2, step_deadline_s=1.0, turn_deadline_s=1.0,
                                        weights_load_s=1.0)) as h:
        a = await h.replica("rollout-0-i0")
        await h.start_rm()
        await eventually_async(lambda: 0 in h.batches, timeout=30, what="step 0 handed over")
        await asyncio.sleep(3.5)  # the window checked: three step deadlines without a commit
        assert not [f for f in h.faults if f.cause == "step_deadline"], h.faults
        await a.set_version(1)
        await h.commit(0)
        await eventually_async(lambda: 1 in h.batches, timeout=30, what="step 1 handed over")
        assert not [f for f in h.faults if f.cause == "step_deadline"], h.faults


@pytest.mark.parametrize("damage", ["batch_record", "episode_set"])
async def test_step_0_failing_before_it_begins_is_reported_at_its_deadline(servers, damage):
    """Every attempt at the job's first step fails before the step begins (its first Redis read:
    the batch record torn, or the step's episode set of the wrong type). The step deadline counts
    from the first attempt, like any step's, and is reported again each further deadline; once
    Redis is repaired the step is handed over, begun once. (The watch started its clock only
    when the first step began, so such a step was retried forever and nothing was reported.)"""
    import time

    async with Harness(servers, rm_spec("failfirst", step_deadline_s=2.0, turn_deadline_s=1.0,
                                        weights_load_s=1.0)) as h:
        await h.replica("rollout-0-i0")
        key = Keys.batch(h.job_id, 0) if damage == "batch_record" else Keys.step_episodes(h.job_id, 0)
        await h.redis.set(key, b"{not json")  # before the request manager's first attempt
        first_attempt = time.time()
        await h.start_rm()
        deadline = 2.0
        reports = await eventually_async(
            lambda: [f for f in h.faults if f.cause == "step_deadline"], timeout=deadline + 4,
            what="the first step, failing before it began, reported at its deadline")
        fault = reports[0]
        assert fault.role == "request_manager" and fault.step == 0, fault
        assert "attempts failed" in fault.evidence, fault.evidence
        assert fault.fault_at is not None and abs(fault.fault_at - first_attempt) < 1.0, (
            f"the deadline did not count from the first attempt: fault_at {fault.fault_at} vs {first_attempt}")
        assert fault.detected_at - first_attempt < deadline + 1.5, fault
        # Reported again at the next deadline, and in the log for the controller's durable inbox.
        await eventually_async(lambda: len([f for f in h.faults if f.cause == "step_deadline"]) >= 2,
                               timeout=deadline + 2, what="reported again at the next deadline")
        logged = {d["fault_id"] for d in await h.events("fault_detected")}
        assert fault.fault_id in logged
        assert 0 not in h.batches
        await h.redis.delete(key)  # repaired: the next attempt runs the step
        await eventually_async(lambda: 0 in h.batches, timeout=15, what="step 0 handed over after the repair")
        assert len(await h.events("job_ready")) == 1
        assert [d["step"] for d in await h.events("step_started")] == [0]


async def _logged(h: Harness, kind: str, fault_id: str) -> list:
    return [e for e in await h.bus.read_events(h.job_id) if e.kind == kind and e.data.get("fault_id") == fault_id]


@pytest.mark.parametrize("action", ["replica_dead", "restart_step"])
async def test_a_control_command_is_acknowledged_while_the_event_log_is_slow(servers, action):
    """JetStream slow to acknowledge (a leader election, a disk stall) when the controller sends a
    command mid-step: the request manager acknowledges within the controller's ack timeout, after
    its state change (a restarted step's records are gone from Redis by then), and the command's
    ``work_lost`` event still reaches the log, once, though the controller sent the command twice
    (a retry after a lost ack). Before: the handler appended the event before acknowledging, so a
    slow log timed the controller out (which then kills a borrowed replica it thinks unheard)."""
    import asyncio
    import time

    from robustrl.services.controller.runtime import RM_ACK_TIMEOUT_S

    from robustrl.errors import RequestTimeout
    from robustrl.messages import ControlCommand
    from robustrl.subjects import Verb, subject

    async with Harness(servers, rm_spec(f"slowctl-{action.replace('_', '')}")) as h:
        a, b = await h.replica("rollout-0-i0"), await h.replica("rollout-1-i0")
        a.hold = b.hold = lambda msg: True
        await h.start_rm()
        await eventually_async(lambda: len(a.held) + len(b.held) == 4 and a.held, timeout=20,
                               what="4 turns in flight, some on a")
        assert h.rm_bus is not None
        real = h.rm_bus.publish_durable
        until = time.monotonic() + 6.0

        async def slow_jetstream(*args: object, **kw: object) -> None:  # no JetStream ack for 6 s
            await asyncio.sleep(max(0.0, until - time.monotonic()))
            await real(*args, **kw)  # type: ignore[arg-type]

        h.rm_bus.publish_durable = slow_jetstream  # type: ignore[method-assign]
        fault_id = f"f-{action}"
        args = {"fault_id": fault_id, **({"member_id": a.member_id} if action == "replica_dead" else {})}
        cmd = ControlCommand(job_id=h.job_id, target="request_manager", action=action, args=args, fence=1)
        sent_at = time.time()
        for attempt in ("sent", "sent again (its ack lost)"):
            t0 = time.monotonic()
            try:
                await h.bus.request(subject(h.job_id, Verb.CONTROL, "request_manager"), cmd, ControlCommand,
                                    timeout=RM_ACK_TIMEOUT_S)
            except RequestTimeout:
                pytest.fail(f"{action} {attempt}: not acknowledged within the controller's "
                            f"RM_ACK_TIMEOUT_S={RM_ACK_TIMEOUT_S:g} s while the event log was slow")
            assert time.monotonic() - t0 < RM_ACK_TIMEOUT_S
            if action == "restart_step":
                assert not await h.episode_keys(0), "acknowledged before the step was cleared in Redis"
        assert time.monotonic() < until, "the event log was not slow during the commands"
        lost = (await eventually_async(lambda: _logged(h, "work_lost", fault_id), timeout=20,
                                       what="work_lost in the log once it is back"))[0]
        assert sent_at <= lost.ts < sent_at + 1.0, "the event does not carry the time of the command"
        a.hold = b.hold = lambda msg: False
        if action == "replica_dead":
            assert lost.data["turns"] == len(a.held)
            await b.release()  # a's turns went to b (re-dispatched), b's own turns answered now
        else:
            await a.release(lose=True)
            await b.release(lose=True)
            resume = ControlCommand(job_id=h.job_id, target="request_manager", action="resume",
                                    args={"start_step": 0, "committed": -1}, fence=1)
            await h.bus.request(subject(h.job_id, Verb.CONTROL, "request_manager"), resume, ControlCommand,
                                timeout=RM_ACK_TIMEOUT_S)
            await h.replica("rollout-0-i1")  # the whole job restarted: a new incarnation serves
        await eventually_async(lambda: 0 in h.batches, timeout=20, what="step 0 handed over")
        await eventually_async(lambda: _logged_batch(h), timeout=10, what="batch_ready logged")
        logged = await _logged(h, "work_lost", fault_id)
        assert len(logged) == 1, f"work_lost of one command logged {len(logged)} times: {logged}"
        if action == "restart_step":
            restarted = [e for e in await h.bus.read_events(h.job_id) if e.kind == "step_started"
                         and e.data.get("epoch") == 1]
            assert restarted and lost.ts < restarted[0].ts


async def _logged_batch(h: Harness) -> bool:
    return bool(await h.events("batch_ready"))


async def test_an_acknowledged_commands_event_survives_the_request_manager_killed_before_the_log_took_it(servers):
    """``replica_dead`` acknowledged while JetStream takes nothing, then the request manager is
    killed: its ``work_lost`` must still reach the log, once, appended by the next request manager
    from the Redis outbox it was written to before the acknowledgement. (With the event queued
    in memory only, the command was acknowledged and its event lost with the process.)"""
    from robustrl.services.controller.runtime import RM_ACK_TIMEOUT_S

    from robustrl.messages import ControlCommand
    from robustrl.subjects import Verb, subject

    async with Harness(servers, rm_spec("outbox")) as h:
        a, b = await h.replica("rollout-0-i0"), await h.replica("rollout-1-i0")
        a.hold = b.hold = lambda msg: True
        await h.start_rm()
        await eventually_async(lambda: len(a.held) + len(b.held) == 4 and a.held, timeout=20,
                               what="4 turns in flight, some on a")
        cmd = await h.replica_dead_with_jetstream_away("f-outbox", a.member_id)
        turns = len(a.held)
        # raw: in the outbox before the ack (with the re-dispatches' own events)
        assert await _outbox_kinds(h.redis, Keys.rm_outbox(h.job_id), "work_lost") == 1
        assert not await _logged(h, "work_lost", "f-outbox")
        await h.kill_rm()

        await h.start_rm()  # the next request manager runs the job
        # The controller never got the first answer in time: it sends the command again, to the
        # new request manager, which knows nothing of it. Still one work_lost, the first's count.
        await h.bus.request(subject(h.job_id, Verb.CONTROL, "request_manager"), cmd, ControlCommand,
                            timeout=RM_ACK_TIMEOUT_S)
        lost = await eventually_async(lambda: _logged(h, "work_lost", "f-outbox"), timeout=20,
                                      what="work_lost appended by the next request manager")
        await eventually_async(lambda: _outbox_empty(h), timeout=10, what="the outbox emptied")
        assert h.rm is not None
        await eventually_async(lambda: all(j.events.pending == 0 for j in h.rm.jobs.values()), timeout=10,
                               what="the new request manager's events all stored")
        lost = await _logged(h, "work_lost", "f-outbox")
        assert len(lost) == 1 and lost[0].data["turns"] == turns, [e.data for e in lost]
        a.hold = b.hold = lambda msg: False
        await b.release()


async def _outbox_kinds(redis: Any, key: str, kind: str) -> int:
    """How many entries of ``kind`` the outbox list ``key`` holds (raw)."""
    return sum(json.loads(raw)["event"]["kind"] == kind for raw in await redis.lrange(key, 0, -1))


async def _outbox_empty(h: Harness) -> bool:
    return await h.redis.llen(Keys.rm_outbox(h.job_id)) == 0



async def test_one_failure_during_a_long_start_up_is_not_a_step_deadline(servers):
    """The first attempt at step 0 fails once (a torn batch record, repaired at once); the retry
    then waits in the start-up, no replica up yet (a cold start longer than the step deadline).
    The step has not begun: no step_deadline may be reported (counted from the first attempt, or
    from the failure, it was; an outside review found it). Once a replica is up the step is
    handed over."""
    import asyncio

    async with Harness(servers, rm_spec("blipstart", step_deadline_s=2.0, turn_deadline_s=1.0,
                                        weights_load_s=2.0)) as h:
        key = Keys.batch(h.job_id, 0)
        await h.redis.set(key, b"{not json")
        await h.start_rm()
        assert h.rm is not None
        await eventually_async(lambda: h.rm is not None and any(j._step_failures for j in h.rm.jobs.values()),
                               timeout=10, what="the first attempt failed")
        await h.redis.delete(key)  # repaired: the next attempt waits for a replica
        loop = asyncio.get_running_loop()
        started = loop.time()
        # Three deadlines' worth of start-up: a report would come within the first.
        while loop.time() - started < 3 * 2.0:
            assert not [f for f in h.faults if f.cause == "step_deadline"], h.faults
            await asyncio.sleep(0.1)  # sampling a window in which nothing may happen
        await h.replica("rollout-0-i0")
        await eventually_async(lambda: 0 in h.batches, timeout=15, what="step 0 handed over")
        assert not [f for f in h.faults if f.cause == "step_deadline"], h.faults


async def test_a_resume_the_request_manager_could_not_carry_out_is_not_acknowledged(servers) -> None:
    """The controller's spec does not come (it is reading a long event log): the request manager
    cannot start the job, and must not acknowledge the resume (an acknowledgement ends what the
    controller owes, with nothing resumed); once the spec comes, the resume sent again runs it."""
    from robustrl.errors import RequestTimeout
    from robustrl.messages import ControlCommand
    from robustrl.services.request_manager.service import SPEC_TIMEOUT_S
    from robustrl.storage.control_stores import JobRegistry
    from robustrl.subjects import Verb, subject

    async with Harness(servers, rm_spec("noack")) as h:
        await JobRegistry(h.redis).put(h.job_id, {"spec": h.spec, "status": "pending"})  # no start-up scan
        h.answer_spec = False
        rm = await h.start_rm(send_resume=False)
        resume = ControlCommand(job_id=h.job_id, target="request_manager", action="resume",
                                args={"start_step": 0, "committed": -1}, fence=1)
        with pytest.raises(RequestTimeout):
            await h.bus.request(subject(h.job_id, Verb.CONTROL, "request_manager"), resume, ControlCommand,
                                timeout=SPEC_TIMEOUT_S + 2.0)
        assert h.job_id not in rm.jobs
        h.answer_spec = True
        await h.bus.request(subject(h.job_id, Verb.CONTROL, "request_manager"), resume, ControlCommand,
                            timeout=SPEC_TIMEOUT_S + 2.0)
        assert h.job_id in rm.jobs and not rm.jobs[h.job_id].paused


async def _answer_out_of_vocab(rep: FakeReplica, msg: GenerateTurn) -> None:
    """``rep`` answers ``msg`` with a token id past its tokenizer's vocabulary."""
    await rep.bus.publish(subject(rep.job_id, Verb.TURN), TurnResult(
        job_id=rep.job_id, request_id=msg.request_id, episode_id=msg.episode_id, member_id=rep.member_id,
        token_ids=[1, rep.tok.vocab_size + 7], logprobs=[-1.0, -1.0], stop_reason="eot", weights_version=rep.version))


async def _answer_too_long(rep: FakeReplica, msg: GenerateTurn) -> None:
    """``rep`` answers ``msg`` with one token more than the turn allows."""
    ids = [1] * (msg.max_new_tokens + 1)
    await rep.bus.publish(subject(rep.job_id, Verb.TURN), TurnResult(
        job_id=rep.job_id, request_id=msg.request_id, episode_id=msg.episode_id, member_id=rep.member_id,
        token_ids=ids, logprobs=[-1.0] * len(ids), stop_reason="length", weights_version=rep.version))


def _answer_odd_logprobs(value: float) -> Any:
    """A replier that answers with one behaviour logprob that is no log-probability."""
    async def answer(rep: FakeReplica, msg: GenerateTurn) -> None:
        await rep.bus.publish(subject(rep.job_id, Verb.TURN), TurnResult(
            job_id=rep.job_id, request_id=msg.request_id, episode_id=msg.episode_id, member_id=rep.member_id,
            token_ids=[1, 2], logprobs=[-1.0, value], stop_reason="eot", weights_version=rep.version))
    return answer


@pytest.mark.parametrize("bad", ["outside_vocabulary", "too_long", "logprob_positive"])
async def test_a_reply_with_token_ids_outside_the_vocabulary_is_refused_and_its_turn_generated_again(servers, bad):
    """A replica's reply that parses but names tokens the model does not have (a corrupt engine,
    a mismatched tokenizer), or a behaviour logprob above 0 (no log-probability; a non-finite
    one does not parse on the wire), must never reach an episode: decoded, it failed the step's every
    attempt; trained on, it fails the trainer's embedding lookup at every redo of the step. Nor
    one longer than the turn's ``max_new_tokens`` (a misconfigured engine): applied, it padded the
    whole batch to its width at the trainer, out of memory at every redo of the step (the step's
    batch is kept across restarts) until the job failed. It is refused on arrival, naming the
    field, and its turn goes to another replica."""
    async with Harness(servers, rm_spec("vocab", turn_deadline_s=1.0)) as h:
        a, b = await h.replica("rollout-0-i0"), await h.replica("rollout-1-i0")
        vocab = a.tok.vocab_size
        limit = JobSpec.model_validate(h.spec).rollout.max_new_tokens

        answer = {"outside_vocabulary": _answer_out_of_vocab, "too_long": _answer_too_long,
                  "logprob_positive": _answer_odd_logprobs(0.002)}[bad]  # (just past the 1e-3 of rounding)
        a.answer = lambda msg: answer(a, msg)  # type: ignore[method-assign]
        await h.start_rm()
        await eventually_async(lambda: 0 in h.batches, timeout=30, what="step 0 handed over")
        assert a.received, "replica a was never given a turn"
        rejected = await eventually_async(lambda: _events_at_least(h, "turn_rejected", 1), timeout=10,
                                          what="turn_rejected events")
        field = "logprobs" if bad.startswith("logprob") else "token_ids"
        assert all(d["member_id"] == a.member_id and field in d["error"] for d in rejected), rejected
        episodes = await h.episodes.get_many(h.batches[0].episode_ids)
        for ep in episodes:
            assert ep.status == "finished", ep
            for turn in ep.turns:
                assert all(0 <= t < vocab for t in turn.token_ids), (ep.episode_id, turn)
                assert all(math.isfinite(x) and x <= 0 for x in turn.logprobs), (ep.episode_id, turn)
                assert turn.role != "assistant" or (turn.member_id == b.member_id and len(turn.token_ids) <= limit)



async def test_a_replica_whose_replies_are_refused_between_good_ones_is_reported_and_its_turns_go_on_at_once(servers):
    """A replica that answers well now and then, and otherwise with tokens the model does not
    have (a flaky engine, a bad GPU), never lets ``TIMEOUTS_BEFORE_FAULT`` deadlines pass in a
    row: each good reply reset its count, so it was never reported, and each refused reply held
    its episode for a whole turn deadline. Its refused replies now count over its last replies
    (a good one in between does not clear them): it is reported, naming the cause, and a refused
    turn is dispatched again at once, not at its deadline."""
    spec = rm_spec("flaky", turn_deadline_s=20.0)
    spec["data"] = {**spec["data"], "prompts_per_step": 8}
    async with Harness(servers, spec) as h:
        a, b = await h.replica("rollout-0-i0"), await h.replica("rollout-1-i0")
        vocab = a.tok.vocab_size
        good_answer = a.answer
        answered: list[bool] = []  # True: answered well

        async def flaky(msg: GenerateTurn) -> None:
            if len(answered) % 3 == 2:  # bad, bad, good, bad, bad, good, ...
                answered.append(True)
                await good_answer(msg)
                return
            answered.append(False)
            await _answer_out_of_vocab(a, msg)
        a.answer = flaky  # type: ignore[method-assign]
        await h.start_rm()
        # A refused turn waiting out its 20 s deadline would take longer than this.
        await eventually_async(lambda: 0 in h.batches, timeout=15, what="step 0 handed over")
        assert answered.count(True) >= 1 and answered.count(False) >= 3, answered
        reported = [f for f in h.faults if f.member_id == a.member_id]
        assert len(reported) == 1 and reported[0].kind == "bad_output" and reported[0].cause == "replies_refused", \
            h.faults
        assert not [f for f in h.faults if f.member_id == b.member_id], h.faults
        logged = await eventually_async(lambda: _events_at_least(h, "fault_detected", 1), timeout=10,
                                        what="the fault in the job's log")
        assert [d["member_id"] for d in logged] == [a.member_id], logged
        again = await h.events("episode_redispatched")
        assert again and all(d["cause"] == "reply_rejected" and d["member_id"] == a.member_id for d in again), again
        episodes = await h.episodes.get_many(h.batches[0].episode_ids)
        for ep in episodes:
            assert ep.status == "finished", ep
            for turn in ep.turns:
                assert all(0 <= t < vocab for t in turn.token_ids), (ep.episode_id, turn)


async def test_a_lone_replica_whose_replies_are_refused_is_not_sent_its_turns_back_as_fast_as_it_answers(servers):
    """With no other replica to take a refused turn, the turn waits out its deadline as a turn
    with no reply does: sent straight back, every refused reply made a round trip (a dispatch
    record and two events each) as fast as the replica answered, until the step's deadline. The
    replica is still reported (once)."""
    deadline = 2.0
    async with Harness(servers, rm_spec("lone", turn_deadline_s=deadline)) as h:
        a = await h.replica("rollout-0-i0")
        a.answer = lambda msg: _answer_out_of_vocab(a, msg)  # type: ignore[method-assign]
        t0 = time.monotonic()
        await h.start_rm()
        await eventually_async(lambda: [f for f in h.faults if f.kind == "bad_output"], timeout=20,
                               what="the replica reported")
        await asyncio.sleep(2.5 * deadline)  # an observation window: how often the turns came back
        elapsed = time.monotonic() - t0
        episodes = 4  # rm_spec: 2 prompts x 2 samples, none of them done
        assert not h.batches
        assert len(a.received) <= episodes * (elapsed / deadline + 2), (len(a.received), elapsed)
        assert len([f for f in h.faults if f.kind == "bad_output"]) == 1, h.faults

async def _refuse_turn(rep: FakeReplica, msg: GenerateTurn, why: str) -> None:
    """``rep`` tells the request manager it did not decode ``msg`` (as a real replica does: an
    input no engine can decode, or its engine failing on the turn alone)."""
    await rep.bus.publish(subject(rep.job_id, Verb.TURN), TurnResult(
        job_id=rep.job_id, request_id=msg.request_id, episode_id=msg.episode_id, member_id=rep.member_id,
        token_ids=[], logprobs=[], stop_reason="length", weights_version=rep.version, refused=why,
        error=f"refused by the test ({why})"))


@pytest.mark.parametrize("why", ["input", "engine"])
async def test_a_turn_a_replica_refuses_goes_to_another_at_once_and_is_named_in_the_log(servers, why):
    """A replica that did not decode a turn says so: the turn goes to the other replica at once,
    not at its 20 s deadline (before, a refused turn got no answer: every one waited out its
    deadline), each refusal is in the job's log with its reason (``turn_refused``), and every
    episode's turns come from the other replica. The other replica decoded the very turns it
    refused, so the refusals are charged to it, whatever reason it gave (an ``input`` refusal of
    a turn another replica decodes is a wrong tokenizer, not a bad input): reported
    ``bad_output``, once."""
    spec = rm_spec(f"refused{why}", turn_deadline_s=20.0)
    spec["data"] = {**spec["data"], "prompts_per_step": 8}
    async with Harness(servers, spec) as h:
        a, b = await h.replica("rollout-0-i0"), await h.replica("rollout-1-i0")
        a.answer = lambda msg: _refuse_turn(a, msg, why)  # type: ignore[method-assign]
        await h.start_rm()
        # A refused turn waiting out its 20 s deadline would take longer than this.
        await eventually_async(lambda: 0 in h.batches, timeout=15, what="step 0 handed over")
        assert a.received, "replica a was never given a turn"
        refused = await eventually_async(lambda: _events_at_least(h, "turn_refused", 1), timeout=10,
                                         what="turn_refused events")
        assert all(d["member_id"] == a.member_id and d["refused"] == why and "refused by the test" in d["error"]
                   for d in refused), refused
        again = await h.events("episode_redispatched")
        assert again and all(d["cause"] == "turn_refused" and d["member_id"] == a.member_id for d in again), again
        episodes = await h.episodes.get_many(h.batches[0].episode_ids)
        for ep in episodes:
            assert ep.status == "finished", ep
            assert all(t.member_id == b.member_id for t in ep.turns if t.role == "assistant"), ep
        assert len(a.received) >= REFUSED_BEFORE_FAULT, a.received  # (the precondition of the charge)
        charged = [f for f in h.faults if f.member_id == a.member_id]
        assert [(f.kind, f.cause) for f in charged] == [("bad_output", "replies_refused")], h.faults
        assert not [f for f in h.faults if f.member_id == b.member_id], h.faults


async def test_a_refused_turn_is_not_sent_straight_back_when_the_other_replica_was_reported(servers):
    """Replica b holds every turn and answers none: reported unresponsive in step 0 (not yet
    replaced). Replica a answers every turn but those of one episode of step 1, which its engine
    fails on. That turn has no replica to go to at once (``pick`` skips a reported one and falls
    back to the least-loaded replica, a itself): it waits out its deadline. Before, the check saw
    b as able to take it, and the turn went back to a as fast as a answered (a dispatch record, a
    publish and an event each time; an outside review)."""
    deadline = 1.0
    spec = rm_spec("bouncing", steps=2, turn_deadline_s=deadline)
    spec["data"] = {**spec["data"], "prompts_per_step": 4}
    async with Harness(servers, spec) as h:
        a, b = await h.replica("rollout-0-i0"), await h.replica("rollout-1-i0")
        good = a.answer
        poison: list[str] = []

        async def answer(msg: GenerateTurn) -> None:
            # the step's last episode: its refusal comes after a's other replies, with a holding
            # no other turn (``pick``'s fallback, the least-loaded replica, is a then)
            if msg.step == 1 and msg.episode_id.endswith("-p3-g1") and not poison:
                poison.append(msg.episode_id)
            await (_refuse_turn(a, msg, "engine") if poison and msg.episode_id == poison[0] else good(msg))
        a.answer = answer  # type: ignore[method-assign]
        b.hold = lambda msg: True  # type: ignore[method-assign]
        await h.start_rm()
        await eventually_async(lambda: 0 in h.batches, timeout=30, what="step 0 handed over")
        assert [f.kind for f in h.faults if f.member_id == b.member_id] == ["unresponsive"], h.faults
        await a.set_version(1)
        await b.set_version(1)
        await h.commit(0)
        await eventually_async(lambda: poison, timeout=30, what="a turn of step 1 at a")
        t0 = time.monotonic()
        await asyncio.sleep(4 * deadline)  # an observation window: how often the turn came back to a
        elapsed = time.monotonic() - t0
        refused = sum(1 for m in a.received if m.episode_id == poison[0])
        assert refused <= elapsed / deadline + 3, (refused, elapsed)


async def test_a_turn_every_replica_refuses_is_not_passed_between_them_as_fast_as_they_answer(servers):
    """Both replicas refuse every turn (an input no engine can decode): each refusal is named in
    the log, but a turn is sent again at once only to a replica it has not been refused by; after
    that it waits out its deadline, as a turn with no reply does. No replica is charged for an
    input: not as bad output, nor as unresponsive for the deadlines its refused turns wait out;
    the step deadline reports the request manager's stuck step, naming the refusals (blamed on a
    replica, healthy replicas were replaced one by one)."""
    deadline = 2.0
    async with Harness(servers, rm_spec("allrefuse", turn_deadline_s=deadline, step_deadline_s=8.0, weights_load_s=5.0)) as h:
        a, b = await h.replica("rollout-0-i0"), await h.replica("rollout-1-i0")
        a.answer = lambda msg: _refuse_turn(a, msg, "input")  # type: ignore[method-assign]
        b.answer = lambda msg: _refuse_turn(b, msg, "input")  # type: ignore[method-assign]
        t0 = time.monotonic()
        await h.start_rm()
        await eventually_async(lambda: _events_at_least(h, "turn_refused", 8), timeout=20,
                               what="both replicas' refusals in the log")
        await asyncio.sleep(2.5 * deadline)  # an observation window: how often the turns came back
        elapsed = time.monotonic() - t0
        episodes = 4  # rm_spec: 2 prompts x 2 samples, none of them done
        assert not h.batches
        sent = len(a.received) + len(b.received)
        # at most two replicas per deadline for each episode (one refusal, one at once elsewhere)
        assert sent <= episodes * 2 * (elapsed / deadline + 2), (sent, elapsed)
        # nobody charged: neither bad output (an input) nor unresponsive (each refused turn waits
        # out its deadline, but its replica answered it)
        assert not [f for f in h.faults if f.role == "rollout"], h.faults
        [stuck] = await eventually_async(lambda: [f for f in h.faults if f.cause == "step_deadline"], timeout=20,
                                         what="the stuck step reported")
        assert stuck.role == "request_manager" and "every ready replica refused" in stuck.evidence, stuck
        assert "refused by the test" in stuck.evidence, stuck


async def _events_at_least(h: Harness, kind: str, n: int) -> list[dict]:
    got = await h.events(kind)
    return got if len(got) >= n else []


async def test_refused_replies_naming_a_replica_that_does_not_hold_the_turn_charge_nobody(servers):
    """Refused replies sent in another replica's name (a confused or hostile member: the bus's
    rollout credentials are per role) for turns it does not hold: neither that replica nor the one
    holding the turn is charged or reported, and the turns are not taken from their holder."""
    async with Harness(servers, rm_spec("forged", turn_deadline_s=20.0)) as h:
        a, b = await h.replica("rollout-0-i0"), await h.replica("rollout-1-i0")
        a.hold = b.hold = lambda msg: True
        await h.start_rm()
        await eventually_async(lambda: a.held and b.held, timeout=20, what="both replicas hold turns")
        held = list(a.held)
        for _ in range(REFUSED_BEFORE_FAULT + 1):
            for msg in held:  # b's name on a's turns
                await _answer_out_of_vocab(b, msg)
        await eventually_async(lambda: _events_at_least(h, "turn_rejected", len(held) * (REFUSED_BEFORE_FAULT + 1)),
                               timeout=10, what="every forged reply refused")
        await a.release()
        await b.release()
        await eventually_async(lambda: 0 in h.batches, timeout=15, what="step 0 handed over")
        assert not h.faults, h.faults
        assert not await h.events("episode_redispatched")


async def test_a_good_reply_from_a_replica_the_turn_was_not_sent_to_is_never_applied(servers):
    """Well-formed replies in replica b's name to turns a holds (a confused or stale member, the
    bus's rollout credentials being per role): dropped as late, never applied over the episode
    (an outside review found them applied: only refused replies checked the sender). a's own
    replies, released afterwards, are what the episodes hold."""
    async with Harness(servers, rm_spec("sender", turn_deadline_s=20.0)) as h:
        a, b = await h.replica("rollout-0-i0"), await h.replica("rollout-1-i0")
        a.hold = lambda msg: True
        await h.start_rm()
        await eventually_async(lambda: a.held, timeout=20, what="replica a holds turns")
        held = list(a.held)
        for msg in held:  # b's name on a's turns, tokens the model has
            await b.bus.publish(subject(b.job_id, Verb.TURN), TurnResult(
                job_id=b.job_id, request_id=msg.request_id, episode_id=msg.episode_id, member_id=b.member_id,
                token_ids=[1, 2], logprobs=[-1.0, -1.0], stop_reason="eot", weights_version=b.version))
        forged = await eventually_async(lambda: _dropped(h, len(held)), timeout=10, what="the forged replies dropped")
        assert {d["member_id"] for d in forged} == {b.member_id}, forged
        await a.release()
        await eventually_async(lambda: 0 in h.batches, timeout=15, what="step 0 handed over")
        episodes = {ep.episode_id: ep for ep in await h.episodes.get_many(h.batches[0].episode_ids)}
        for msg in held:
            [turn] = [t for t in episodes[msg.episode_id].turns if t.role == "assistant"]
            assert turn.member_id == a.member_id and turn.request_id == msg.request_id, turn


async def test_a_dispatch_whose_record_fails_leaves_no_turn_outstanding(servers, monkeypatch):
    """One turn's dispatch record refused (Redis past its retries) fails the step's attempt; the
    retry hands the step over. The failed dispatches (that one, and its siblings cancelled with
    the attempt) stayed registered as outstanding turns of the replica for good: a later stuck
    step was blamed on it ("turns outstanding on r0"), and the dispatcher shunned it (an outside
    review). Judged from the request manager's own samples on the bus: nothing in flight once
    the only step is handed over."""
    from robustrl.storage.redis_stores import DispatchStore

    real = DispatchStore.record
    calls = {"n": 0}

    async def flaky(self: DispatchStore, episode_id: str, entry: dict) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise TransportError("Redis away past the client's retries (test)")
        await real(self, episode_id, entry)

    monkeypatch.setattr(DispatchStore, "record", flaky)
    async with Harness(servers, rm_spec("displeak", steps=1)) as h:
        await h.replica("r0", version=0)
        await h.start_rm()
        await eventually_async(lambda: h.batches.get(0), timeout=40, what="step 0 handed over")
        seen = len(h.rm_samples)
        await eventually_async(lambda: [s for s in h.rm_samples[seen:] if s.inflight == 0], timeout=10,
                               what="a request-manager sample with no turn in flight")
        assert calls["n"] > 1


async def test_turns_waiting_for_a_version_their_replica_fell_back_from_strike_no_replica(servers):
    """A replica took step 1's turns at v1 and then followed a trainer rollback down to v0 (the new
    gang announced an older version): the turns wait in the replica for v1 past their deadline.
    They are dispatched again, but three of them struck the replica and reported it unresponsive:
    healthy replicas were replaced in the middle of a trainer recovery (an outside review).
    Judged from the faults the request manager reports and the re-dispatches it logs."""
    async with Harness(servers, rm_spec("rollback", steps=2, turn_deadline_s=2.0)) as h:
        r0 = await h.replica("r0", version=0)
        await h.start_rm()
        await eventually_async(lambda: h.batches.get(0), timeout=30, what="step 0 handed over")
        r0.hold = lambda msg: msg.step == 1  # step 1's turns are kept, never answered
        await r0.set_version(1)
        await h.commit(0)
        await eventually_async(lambda: len([m for m in r0.held if m.step == 1]) >= 3, timeout=20,
                               what="step 1's turns held by r0")
        await r0.set_version(0)  # the rollback: it now holds an older version than they need
        async def by_deadline() -> list[dict[str, Any]]:
            return [d for d in await h.events("episode_redispatched") if d["cause"] == "turn_deadline"]

        redispatched = await eventually_async(lambda: _at_least(by_deadline, 3), timeout=20,
                                              what="the held turns dispatched again past their deadline")
        assert len(redispatched) >= 3
        assert [f for f in h.faults if f.member_id == "r0"] == [], h.faults


async def _at_least(read: Any, n: int) -> list[dict[str, Any]] | None:
    got = await read()
    return got if len(got) >= n else None
