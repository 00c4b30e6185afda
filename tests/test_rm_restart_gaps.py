"""A restarted request manager, at its worst moments, against real NATS + Redis with scripted
replicas (tests/rm_harness.py): a command that comes before its runner exists, a resume step that
lags what was trained, a hand-over whose event was held in memory when the process died. Each is
judged from outside: the acknowledgements the controller gets, raw Redis keys, the event log.
Each failed before its fix (an outside review found all three).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any
from urllib.parse import urlsplit

import pytest
from rm_harness import METRICS_S, Harness, rm_role_settings, rm_spec
from support import eventually_async
from tcp_hold import HoldingRelay

from robustrl.errors import RequestTimeout, TransportError
from robustrl.services.controller.lease import LeaderLease
from robustrl.services.request_manager.eventlog import STOP_DRAIN_S
from robustrl.messages import ControlCommand, Event, MetricsSample, TurnResult
from robustrl.storage.redis_stores import Keys
from robustrl.subjects import Verb, subject

pytestmark = pytest.mark.timeout(150)


async def _turns_saved(h: Harness, step: int) -> int:
    """Assistant turns saved in Redis over ``step``'s episodes (raw keys)."""
    eps = await h.episodes.get_many(await h.episodes.step_episode_ids(step))
    return sum(1 for e in eps for t in e.turns if t.role == "assistant")


async def _tokens_saved(h: Harness, step: int) -> int:
    """Assistant tokens saved in Redis over ``step``'s episodes (raw keys)."""
    eps = await h.episodes.get_many(await h.episodes.step_episode_ids(step))
    return sum(len(t.token_ids) for e in eps for t in e.turns if t.role == "assistant")


async def test_a_restart_while_a_handed_step_awaits_its_commit_charges_none_of_that_steps_work(servers):
    """Sync mode: step 0 handed over, the request manager waits for its commit before step 1. A
    whole-job restart then restarts step 1 (nothing of it made yet) and keeps step 0's batch (the
    trainer may take it). Its ``work_lost`` charged all of step 0's tokens though nothing of them
    was lost (the in-memory episodes of the step before; an outside review): the baseline's lost
    work grew by a whole step per fault. Judged from the raw batch key, the raw episode records
    and the log."""
    async with Harness(servers, rm_spec("handedrestart", steps=2)) as h:
        rep = await h.replica("r0", version=0)
        await h.start_rm()
        await eventually_async(lambda: 0 in h.batches, timeout=30, what="step 0 handed over")
        batch_key = Keys.batch(h.job_id, 0)
        assert await h.redis.exists(batch_key)
        saved = await _tokens_saved(h, 0)
        assert saved > 0
        cmd = ControlCommand(job_id=h.job_id, target="request_manager", action="restart_step",
                             args={"fault_id": "handed-f1"}, fence=1)
        await _until_acknowledged(h, cmd, "restart_step never acknowledged")
        lost = await eventually_async(
            lambda: _events_for(h, "work_lost", "handed-f1"), timeout=20, what="work_lost of the restart")
        assert (lost[0]["tokens"], lost[0]["episodes"]) == (0, 0), lost
        assert await h.redis.exists(batch_key)  # step 0 kept as handed, its episodes too
        assert await _tokens_saved(h, 0) == saved
        assert len(rep.received) == 4  # and nothing of step 1 was sent


async def test_a_command_before_the_runner_exists_is_carried_out_or_left_unacknowledged(servers):
    """A restarted request manager whose spec has not come: a ``restart_step`` acknowledged then
    restarted nothing and logged no ``work_lost`` (the controller, acknowledged, never sent it
    again). Now it is not acknowledged until it is carried out."""
    async with Harness(servers, rm_spec("noack", steps=2)) as h:
        rep = await h.replica("r0", version=0)
        rep.hold = lambda msg: len(rep.received) > 2  # two turns answered, the rest held
        await h.start_rm()
        await eventually_async(lambda: len(rep.received) >= 4, timeout=30, what="step 0 dispatched")
        await eventually_async(lambda: _turns_saved(h, 0), timeout=10, what="turns saved")
        assert await _turns_saved(h, 0) == 2
        saved = await _tokens_saved(h, 0)
        await h.kill_rm()
        h.answer_spec = False  # the controller is busy: the restarted request manager has no runner
        await h.start_rm(send_resume=False)
        cmd = ControlCommand(job_id=h.job_id, target="request_manager", action="restart_step",
                             args={"fault_id": "gap-f1"}, fence=1)
        subj = subject(h.job_id, Verb.CONTROL, "request_manager")
        with pytest.raises(RequestTimeout):
            await h.bus.request(subj, cmd, ControlCommand, timeout=2)
        assert await _turns_saved(h, 0) == 2  # nothing done, and nothing said done
        h.answer_spec = True
        rep.hold = lambda msg: False
        await _until_acknowledged(h, cmd, "restart_step never acknowledged once the spec came")
        # Acknowledged: the step was restarted (its saved turns gone, raw) and its loss logged.
        assert await _turns_saved(h, 0) == 0
        lost = await eventually_async(
            lambda: _events_for(h, "work_lost", "gap-f1"), timeout=20, what="work_lost of the restart")
        assert (lost[0]["episodes"], lost[0]["tokens"]) == (4, saved), lost  # what the dropped records held
        # The controller's resume: the step is generated again, every episode finished.
        await h.bus.request(subj, ControlCommand(job_id=h.job_id, target="request_manager", action="resume",
                                                 args={"start_step": 0, "committed": -1}, fence=1),
                            ControlCommand, timeout=5)
        await rep.announce()
        await eventually_async(lambda: 0 in h.batches, timeout=30, what="step 0 handed over after the restart")
        eps = await h.episodes.get_many(h.batches[0].episode_ids)
        assert len(eps) == 4 and all(e.status == "finished" for e in eps)


async def test_a_restarted_request_manager_refuses_a_deposed_leaders_command(servers):
    """Two lease terms, controller a's (token 1) then b's (token 2). The request manager restarts
    and has seen no command of b's yet when the deposed a tells it to stop the job. Before, it
    kept the newest token it had seen in memory only, so it acted on a's stop (acknowledged it
    and stopped the job b was running). Now the token is checked against the newest term's, read
    from Redis (with the request manager's own Redis user): refused, unacknowledged, and the job
    goes on (its step handed over, judged from the raw batch key)."""
    async with Harness(servers, rm_spec("deposed-after-restart", steps=2)) as h:
        try:
            await _deposed_stop_after_restart(h)
        finally:
            # The module's other tests send tokens as of no lease term (their servers are shared).
            await h.redis.delete(Keys.controller_fence(), Keys.controller_lease())


async def _deposed_stop_after_restart(h: Harness) -> None:
    a = LeaderLease(h.redis, "ctl-a", ttl_s=0.1)
    assert await a.try_acquire()
    b = LeaderLease(h.redis, "ctl-b", ttl_s=60)
    await eventually_async(b.try_acquire, timeout=10, what="b's term, once a's lapsed")
    assert b.token == a.token + 1
    rep = await h.replica("r0", version=0)
    rep.hold = lambda msg: True  # the step stays open while the request manager restarts
    await h.start_rm()  # b's resume (token 2)
    await eventually_async(lambda: len(rep.received) >= 4, timeout=30, what="step 0 dispatched")
    await h.kill_rm()
    await h.start_rm(send_resume=False)  # finds the job in the registry; no command seen
    stop = ControlCommand(job_id=h.job_id, target="request_manager", action="stop", args={}, fence=a.token)
    with pytest.raises(RequestTimeout):
        await h.bus.request(subject(h.job_id, Verb.CONTROL, "request_manager"), stop, ControlCommand, timeout=3)
    # The job goes on under b: its turns answered, step 0 handed over.
    rep.hold = lambda msg: False
    await rep.release()
    await rep.announce()
    await eventually_async(lambda: 0 in h.batches, timeout=30, what="step 0 handed over after the refused stop")
    assert await h.redis.exists(Keys.batch(h.job_id, 0))


async def _until_acknowledged(h: Harness, cmd: ControlCommand, never: str) -> None:
    """Send ``cmd`` to the request manager as the controller does: again until it is acknowledged."""
    subj = subject(h.job_id, Verb.CONTROL, "request_manager")
    for _attempt in range(10):
        try:
            await h.bus.request(subj, cmd, ControlCommand, timeout=4)
            return
        except RequestTimeout:
            continue
    raise AssertionError(never)


async def _events_for(h: Harness, kind: str, fault_id: str) -> list[dict]:
    return [e for e in await h.events(kind) if e.get("fault_id") == fault_id]


async def test_a_resume_step_behind_what_was_trained_does_not_regenerate_it(servers):
    """The controller's view lags one step (a commit it missed): the restarted request manager
    told to start at step 1 generated step 1 again (trained and collected already), then waited
    for its commit for good. It starts after the newest collected / durable step instead."""
    async with Harness(servers, rm_spec("stale", steps=4)) as h:
        rep = await h.replica("r0", version=0)
        await h.start_rm()
        for step in (0, 1):
            await eventually_async(lambda s=step: s in h.batches, timeout=30, what=f"step {step} handed over")
            await h.redis.rpush(Keys.trained_log(h.job_id), json.dumps({"step": step, "epoch": 1, "checksum": "x"}))
            await h.redis.hset(Keys.gang(h.job_id), mapping={"epoch": 1, "durable": step, "durable_epoch": 1})
            await h.commit(step, durable=step)
            await rep.set_version(step + 1)

        async def collected() -> bool:
            raw = await h.redis.get(Keys.rollout_gc(h.job_id))
            return raw is not None and int(raw) >= 0
        # step 0 collected; step 1's state kept (a resume from checkpoint 0 if 1 failed to verify)
        await eventually_async(collected, timeout=20, what="step 0 collected")
        kept = await h.episode_keys(1)
        assert kept
        await h.kill_rm()
        h.committed = 0  # the spec's resume_step: 1
        h.batches.clear()
        await h.start_rm(send_resume=False)
        await eventually_async(lambda: 2 in h.batches, timeout=40,
                               what="step 2 handed over (not a wait for step 1's commit)")
        assert 1 not in h.batches
        assert await h.episode_keys(1) == kept, "step 1 generated again"


async def test_a_batch_handed_over_while_jetstream_was_away_is_logged_by_the_next_life(servers):
    """``batch_ready`` was held in the request manager's memory while JetStream refused it; killed
    then, the event was gone, and the next life, finding the batch handed over, announced it and
    never logged it. It goes through the Redis outbox now, and the re-announcement is logged once."""
    async with Harness(servers, rm_spec("bready", steps=2)) as h:
        rep = await h.replica("r0", version=0)
        rep.hold = lambda msg: True
        await h.start_rm()
        await eventually_async(lambda: len(rep.held) == 4, timeout=30, what="step 0 dispatched")

        _jetstream_refuses(h)
        rep.hold = lambda msg: False
        await rep.release()
        await eventually_async(lambda: 0 in h.batches, timeout=30, what="step 0 handed over")
        await h.kill_rm()
        h.batches.clear()
        await h.start_rm(send_resume=False)
        await eventually_async(lambda: 0 in h.batches, timeout=30, what="step 0 announced by the next life")

        async def logged() -> list[dict]:
            return [d for d in await h.events("batch_ready") if d.get("step") == 0]
        await eventually_async(logged, timeout=20, what="batch_ready of step 0 in the log")
        assert len(await logged()) == 1, "the same batch logged twice"


async def test_redispatch_events_survive_a_kill_while_jetstream_is_away(servers):
    """What a fault cost (``turn_regenerated``) and the prefix each episode resumed from
    (``episode_redispatched``, which the auditor checks) were held in memory while JetStream
    refused them, and lost with a request manager killed then. They go through its outbox now,
    one per dispatch (not one per fault: they share its fault id)."""
    async with Harness(servers, rm_spec("regen", turn_deadline_s=1.0)) as h:
        a = await h.replica("rollout-0-i0")
        await h.replica("rollout-1-i0")
        a.hold = lambda msg: True  # replica a never answers: its turns go to b past their deadline
        await h.start_rm()

        _jetstream_refuses(h)
        await eventually_async(lambda: 0 in h.batches, timeout=30, what="step 0 handed over")
        held = {m.request_id for m in a.held}
        assert held, "replica a was never given a turn"
        await h.kill_rm()
        h.batches.clear()
        await h.start_rm(send_resume=False)

        async def logged() -> bool:
            moved = {d["request_id"] for d in await h.events("episode_redispatched")}
            return moved == held and len(await h.events("turn_regenerated")) == len(held)
        await eventually_async(logged, timeout=30, what="every re-dispatch's events in the log")
        regen = await h.events("turn_regenerated")
        assert all(d["member_id"] == "rollout-1-i0" and d["tokens"] > 0 for d in regen), regen



async def test_late_and_refused_replies_are_logged_though_the_rm_dies_with_jetstream_away(servers):
    """A late reply's ``turn_dropped`` and a refused reply's ``turn_rejected`` were appended from
    memory (the bus's owed queue): a request manager killed while JetStream refused them lost
    them. They go through its outbox now, keyed by the reply's request id: in Redis (raw key)
    before the kill, in the log once after the next life starts."""
    async with Harness(servers, rm_spec("diag", turn_deadline_s=1.0)) as h:
        a = await h.replica("rollout-0-i0")
        await h.replica("rollout-1-i0")
        a.hold = lambda msg: True  # a's turns pass their deadline and go to b; a answers them late
        await h.start_rm()

        _jetstream_refuses(h)
        await eventually_async(lambda: 0 in h.batches, timeout=30, what="step 0 handed over")
        late = {m.request_id for m in await a.release()}
        assert late, "replica a was never given a turn"
        # A reply naming a token the model does not have: refused, never applied.
        await h.bus.publish(subject(h.job_id, Verb.TURN), TurnResult(
            job_id=h.job_id, request_id="bogus-1", episode_id="none", member_id="rollout-1-i0",
            token_ids=[10**6], logprobs=[-1.0], stop_reason="eot", weights_version=0))

        async def saved() -> set[tuple[str, str]]:
            raw = await _outbox(h)
            return {(e["event"]["kind"], e["event"]["data"]["request_id"]) for e in raw
                    if e["event"]["kind"] in ("turn_dropped", "turn_rejected")}
        want = {("turn_dropped", r) for r in late} | {("turn_rejected", "bogus-1")}
        await eventually_async(lambda: _superset(saved(), want), timeout=20, what="the events in the outbox")
        await h.kill_rm()
        await h.start_rm(send_resume=False)

        async def logged() -> list[tuple[str, str]]:
            return [(k, d["request_id"]) for k in ("turn_dropped", "turn_rejected") for d in await h.events(k)]
        await eventually_async(lambda: _superset(logged(), want), timeout=30, what="the events in the log")
        got = await logged()
        assert sorted(got) == sorted(set(got)), f"an event logged twice: {got}"


def _jetstream_refuses(h: Harness) -> None:
    """The request manager's durable publishes fail from now on, as with JetStream away."""
    async def refuse(*_a: object, **_k: object) -> None:
        raise TransportError("jetstream away (test)")
    assert h.rm_bus is not None
    h.rm_bus.publish_durable = refuse  # type: ignore[method-assign]


async def _outbox(h: Harness) -> list[dict]:
    """The job's request-manager outbox entries, raw from Redis."""
    return [json.loads(x) for x in await h.redis.lrange(Keys.rm_outbox(h.job_id), 0, -1)]


async def _superset(found, want: set) -> bool:  # type: ignore[no-untyped-def]
    return set(await found) >= want


async def test_a_step_generated_again_after_its_hand_over_is_a_new_batch_ready(servers):
    """A step generated again after its hand-over (a ``restart_step`` did that until it kept a
    handed step: ``test_a_step_handed_over_as_its_restart_comes_is_kept_as_handed``) hands over
    a new batch with the same episode ids (they are the step's). Keyed by the episode ids alone,
    its ``batch_ready`` was taken for the first one's duplicate (JetStream's 2-minute window) and
    never stored. The same stored batch announced again (a later life) is still stored once."""
    async with Harness(servers, rm_spec("twice", steps=2)) as h:
        await h.replica("r0", version=0)
        await h.start_rm()
        first = await eventually_async(lambda: h.batches.get(0), timeout=30, what="step 0 handed over")
        await eventually_async(lambda: _batch_events(h, 0), timeout=20, what="its batch_ready logged")
        assert h.rm is not None
        runner = h.rm.jobs[h.job_id]
        # The step's second generation: the same ids, its own rewards and timings.
        regenerated = first.model_copy(update={"timings": {**first.timings, "rollout_s": first.timings["rollout_s"] + 1}})
        await runner._batch_event(regenerated)
        await runner._batch_event(first)  # the first batch announced again: a duplicate
        logged = await eventually_async(lambda: _batch_events(h, 0, 2), timeout=20,
                                        what="both generations of step 0 in the log")
        await eventually_async(lambda: runner.events.pending == 0, timeout=10, what="the writer drained")
        assert len(await _batch_events(h, 0)) == 2, logged


async def _batch_events(h: Harness, step: int, want: int = 1) -> list[dict]:
    got = [d for d in await h.events("batch_ready") if d.get("step") == step]
    return got if len(got) >= want else []


async def test_a_deadline_report_is_logged_though_the_rm_dies_with_jetstream_away(servers):
    """A passed deadline's ``fault_detected`` (here the commit deadline: a scripted trainer member
    waits for step 0's batch, handed over, and never takes it) was appended from memory (the bus's
    owed queue): a request manager killed while JetStream refused it lost it, and the job's log
    held the controller's decision on a fault it never recorded. It goes through the outbox now,
    keyed by the fault id: in Redis (raw key) before the kill, in the log once after the next
    life starts."""
    async with Harness(servers, rm_spec("faultlog", steps=3, commit_deadline_s=1.0)) as h:
        async def trainer_waits() -> None:
            seq = 0
            while True:
                seq += 1
                await h.bus.publish(subject(h.job_id, Verb.METRICS, "trainer-e1-r0"), MetricsSample(
                    job_id=h.job_id, member_id="trainer-e1-r0", role="trainer", seq=seq, ts=time.time(),
                    phase="waiting_batch", step=0))
                await asyncio.sleep(METRICS_S)

        metrics = asyncio.create_task(trainer_waits())
        try:
            await h.replica("r0", version=0)
            await h.start_rm()

            _jetstream_refuses(h)
            await eventually_async(lambda: 0 in h.batches, timeout=30, what="step 0 handed over")
            reported = await eventually_async(
                lambda: {f.fault_id for f in h.faults if f.cause == "commit_deadline"}, timeout=20,
                what="the commit deadline reported")

            async def saved() -> set[str]:
                raw = await _outbox(h)
                return {e["event"]["data"]["fault_id"] for e in raw if e["event"]["kind"] == "fault_detected"}
            await eventually_async(lambda: _superset(saved(), reported), timeout=10,
                                   what="its fault_detected in the outbox")
            metrics.cancel()  # (no further reports)
            await h.kill_rm()
            await h.start_rm(send_resume=False)

            async def logged() -> list[str]:
                return [d["fault_id"] for d in await h.events("fault_detected")]
            await eventually_async(lambda: _superset(logged(), reported), timeout=30,
                                   what="its fault_detected in the log")
            got = [f for f in await logged() if f in reported]
            assert sorted(got) == sorted(set(got)), f"a fault logged twice: {got}"
        finally:
            metrics.cancel()


async def test_a_refused_reply_is_logged_though_its_outbox_save_fails(servers):
    """Redis refusing the outbox save (a failover): a refused reply's ``turn_rejected`` went
    through the strict outbox writer, whose error was only logged, so the event was dropped (an
    outside review found it; before the outbox it was appended from memory). Now it is appended
    from memory, as before."""
    async with Harness(servers, rm_spec("nosave", steps=2)) as h:
        await h.replica("rollout-0-i0", version=0)
        await h.start_rm()
        await eventually_async(lambda: 0 in h.batches, timeout=30, what="step 0 handed over")
        assert h.rm is not None
        outbox = h.rm.jobs[h.job_id].events.outbox

        async def redis_refuses(*_a: object, **_k: object) -> None:
            raise TransportError("redis failing over (test)")
        outbox.add = redis_refuses  # type: ignore[method-assign]
        await h.bus.publish(subject(h.job_id, Verb.TURN), TurnResult(
            job_id=h.job_id, request_id="bogus-2", episode_id="none", member_id="rollout-0-i0",
            token_ids=[10**6], logprobs=[-1.0], stop_reason="eot", weights_version=0))

        async def logged() -> list[str]:
            return [d["request_id"] for d in await h.events("turn_rejected")]
        await eventually_async(lambda: _superset(logged(), {"bogus-2"}), timeout=20,
                               what="the refused reply's turn_rejected in the log")
        assert not [e for e in await _outbox(h) if e["event"]["kind"] == "turn_rejected"]


async def test_a_stop_is_acknowledged_once_the_jobs_events_are_in_its_log(servers):
    """The controller appends a job's final event once the request manager acknowledged its stop.
    The stop was acknowledged at once, with events still queued (JetStream had refused them: a
    NATS restart near a job's end, a full suite): the job ended, and its log never got its last
    ``batch_ready`` and ``step_started`` (the auditor found them in the outbox). Now the
    acknowledgement waits for them, within ``STOP_DRAIN_S``."""
    async with Harness(servers, rm_spec("stopdrain", steps=3)) as h:
        await h.replica("r0", version=0)
        await h.start_rm()
        _jetstream_refuses(h)
        await eventually_async(lambda: 0 in h.batches, timeout=30, what="step 0 handed over")

        async def saved() -> list[int]:
            return [e["event"]["data"]["step"] for e in await _outbox(h) if e["event"]["kind"] == "batch_ready"]
        await eventually_async(saved, timeout=10, what="its batch_ready in the outbox")
        assert not [d for d in await h.events("batch_ready") if d.get("step") == 0]

        assert h.rm_bus is not None
        # JetStream takes the request manager's events again a second after the stop is sent.
        asyncio.get_running_loop().call_later(1.0, delattr, h.rm_bus, "publish_durable")
        cmd = ControlCommand(job_id=h.job_id, target="request_manager", action="stop", args={}, fence=1)
        await h.bus.request(subject(h.job_id, Verb.CONTROL, "request_manager"), cmd, ControlCommand,
                            timeout=STOP_DRAIN_S + 2)
        # When the controller has the acknowledgement, the log holds them (raw stream, raw Redis).
        assert [d for d in await h.events("batch_ready") if d.get("step") == 0]
        assert await _outbox(h) == []


async def test_a_flood_of_late_replies_is_counted_not_logged_one_by_one(servers):
    """A replica flooding the request manager with replies to turns it never holds, while
    JetStream refuses events: each was a ``turn_dropped`` saved in the job's Redis outbox, one
    entry a reply, without bound, and the saves, all at once, took every connection of the Redis
    client's pool (the request manager's other Redis calls failed: 'Too many connections'). Now a
    burst is logged one by one, a few saves at a time, and the rest counted, by replica, in one
    summary event: the outbox (raw Redis) stays within the burst, and no reply goes uncounted
    (individual events plus the summaries' counts, all in the outbox). Failed before."""
    from robustrl.services.request_manager.dispatch import DIAG_BURST, DIAG_PER_S, DIAG_SUMMARY_S

    async with Harness(servers, rm_spec("flood", steps=2)) as h:
        rep = await h.replica("rollout-0-i0", version=0)
        rep.hold = lambda msg: True
        await h.start_rm()
        await eventually_async(lambda: len(rep.held) == 4, timeout=30, what="step 0 dispatched")
        _jetstream_refuses(h)
        n = 3 * DIAG_BURST
        began = time.monotonic()
        for i in range(n):
            await h.bus.publish(subject(h.job_id, Verb.TURN), TurnResult(
                job_id=h.job_id, request_id=f"flood-{i}", episode_id="none", member_id="rollout-0-i0",
                token_ids=[1], logprobs=[-1.0], stop_reason="eot", weights_version=0))

        async def dropped() -> list[dict]:
            return [e["event"]["data"] for e in await _outbox(h) if e["event"]["kind"] == "turn_dropped"]

        def counted(entries: list[dict]) -> int:
            return sum(int(d.get("suppressed", 1)) for d in entries)
        await eventually_async(lambda: _counted_at_least(dropped(), n), timeout=DIAG_SUMMARY_S + 20,
                               what="every late reply counted in the outbox")
        entries = await dropped()
        elapsed = time.monotonic() - began
        single = [d for d in entries if "suppressed" not in d]
        assert len(single) <= DIAG_BURST + DIAG_PER_S * elapsed + 1, (len(single), elapsed)
        assert counted(entries) == n, counted(entries)
        summaries = [d for d in entries if "suppressed" in d]
        assert summaries and all(d["by_member"] == {"rollout-0-i0": d["suppressed"]} for d in summaries)

        assert h.rm_bus is not None
        del h.rm_bus.publish_durable  # JetStream back: the summaries reach the log
        await eventually_async(lambda: _counted_at_least(h.events("turn_dropped"), n), timeout=30,
                               what="every late reply counted in the log")


async def _counted_at_least(found, n: int) -> bool:  # type: ignore[no-untyped-def]
    return sum(int(d.get("suppressed", 1)) for d in await found) >= n


async def test_a_restarted_rm_acknowledges_a_stop_once_its_previous_lifes_events_are_logged(servers):
    """A request manager killed while JetStream refused its ``work_lost``; the next life has no
    runner yet (the controller is busy: the spec is not answered) when the job's stop comes. The
    stop was acknowledged at once, the killed life's event still in the outbox, appended later,
    after the job's final event (an outside review). Now the stop reads the outbox first: on the
    acknowledgement the log holds the event and the outbox (raw Redis) is empty."""
    async with Harness(servers, rm_spec("stoprestart", steps=3)) as h:
        await h.replica("r0", version=0)
        await h.start_rm()
        await h.replica_dead_with_jetstream_away("f-stop", "r0")
        assert [e for e in await _outbox(h) if e["event"]["kind"] == "work_lost"]
        await h.kill_rm()
        h.answer_spec = False
        await h.start_rm(send_resume=False)
        cmd = ControlCommand(job_id=h.job_id, target="request_manager", action="stop", args={}, fence=1)
        await h.bus.request(subject(h.job_id, Verb.CONTROL, "request_manager"), cmd, ControlCommand,
                            timeout=STOP_DRAIN_S + 2)
        assert [d for d in await h.events("work_lost") if d.get("fault_id") == "f-stop"]
        assert await _outbox(h) == []


async def test_one_jobs_failed_resume_holds_up_no_other_and_is_tried_again(servers, monkeypatch):
    """A restarted request manager resumes every running job of the registry by itself. One job's
    resume failing (Redis past its retries on its resume floor) ended the loop that starts the
    runners: the other job's runner, made, was never started while the service's samples for it
    went on (the controller never saw it lost: the job stalled for good), and the failed job was
    never tried again (an outside review). Judged by the batches each job hands over."""
    from robustrl.services.request_manager.service import RequestManager

    async with Harness(servers, rm_spec("resfail", steps=1)) as a, Harness(servers, rm_spec("resok", steps=1)) as b:
        await a.replica("ra", version=0)
        await b.replica("rb", version=0)
        real = RequestManager._resume_floor
        failures = {"left": 2}

        async def floor(self: RequestManager, job_id: str) -> int:
            if job_id == a.job_id and failures["left"] > 0:
                failures["left"] -= 1
                raise TransportError("Redis away past the client's retries (test)")
            return await real(self, job_id)

        monkeypatch.setattr(RequestManager, "_resume_floor", floor)
        await b.start_rm(send_resume=False)  # (one service runs both jobs: found in the registry)
        for h in (a, b):
            for rep in h.replicas.values():
                await rep.announce()
        await eventually_async(lambda: b.batches.get(0), timeout=40, what="the other job's step 0 handed over")
        await eventually_async(lambda: a.batches.get(0), timeout=40, what="the failed job's step 0, resumed again")
        assert failures["left"] == 0


async def test_a_stop_during_the_restart_scan_leaves_no_runner(servers, monkeypatch):
    """A restarted request manager is making a job's runner (its resume floor being read) when the
    controller's stop of the job comes: the stop found no runner and was acknowledged, then the
    runner was made and started, its events landing after the job's final one and its step
    deadline reporting for a stopped job for good (an outside review). Another job, resumed in
    the same scan, shows the scan went on."""
    from robustrl.services.request_manager.service import RequestManager

    async with Harness(servers, rm_spec("stopscan", steps=2)) as h, Harness(servers, rm_spec("scanwit", steps=1)) as w:
        await h.replica("rs", version=0)
        await w.replica("rw", version=0)
        real = RequestManager._resume_floor
        entered, release = asyncio.Event(), asyncio.Event()

        async def floor(self: RequestManager, job_id: str) -> int:
            if job_id == h.job_id:
                entered.set()
                await release.wait()
            return await real(self, job_id)

        monkeypatch.setattr(RequestManager, "_resume_floor", floor)
        rm = await w.start_rm(send_resume=False)
        await asyncio.wait_for(entered.wait(), 20)
        cmd = ControlCommand(job_id=h.job_id, target="request_manager", action="stop", args={}, fence=1)
        await h.bus.request(subject(h.job_id, Verb.CONTROL, "request_manager"), cmd, ControlCommand,
                            timeout=STOP_DRAIN_S + 2)
        release.set()
        for rep in w.replicas.values():
            await rep.announce()
        await eventually_async(lambda: w.batches.get(0), timeout=40, what="the other job's step 0 handed over")
        await asyncio.wait_for(asyncio.gather(*rm._tasks), 20)  # the restart scan is over
        assert h.job_id not in rm.jobs, "a runner was made for a stopped job"
        assert await h.events("step_started") == [], "the stopped job ran after its stop's acknowledgement"


async def test_a_job_whose_resume_keeps_failing_holds_no_other_jobs_left_events_back(servers, monkeypatch):
    """A restarted request manager resumes the running jobs, then appends what every job's outbox
    still holds. One job whose resume keeps failing (here its resume floor, always) held that scan
    back for good once each resume was retried until it went through: another, ended job's event
    its killed predecessor left in the outbox was never appended (an outside review). Judged from
    the raw log and raw Redis."""
    from robustrl.event_outbox import OutboxEntry
    from robustrl.messages import Event
    from robustrl.services.request_manager.service import RequestManager
    from robustrl.storage.control_stores import JobRegistry, RmOutbox

    async with Harness(servers, rm_spec("resnever", steps=1)) as a, Harness(servers, rm_spec("endedjob", steps=1)) as b:
        real = RequestManager._resume_floor

        async def floor(self: RequestManager, job_id: str) -> int:
            if job_id == a.job_id:
                raise TransportError("Redis refuses this job's keys (test)")
            return await real(self, job_id)

        monkeypatch.setattr(RequestManager, "_resume_floor", floor)
        await JobRegistry(b.redis).put(b.job_id, {"spec": b.spec, "status": "finished"})
        left = Event(job_id=b.job_id, kind="batch_ready", data={"step": 0, "reward_mean": 0.5})
        await RmOutbox(b.redis, b.job_id).add(OutboxEntry(msg_id=f"{b.job_id}-batch_ready-0", event=left))
        await a.start_rm(send_resume=False)
        await eventually_async(lambda: b.events("batch_ready"), timeout=15, what="the ended job's left event logged")
        await eventually_async(lambda: _empty(_outbox(b)), timeout=10, what="its outbox emptied")


async def _empty(read) -> bool:  # type: ignore[no-untyped-def]
    return not await read


def _freeze_after_batch_write(r: Any, batch_key: str) -> asyncio.Event:
    """Make ``r`` (the request manager's Redis client) hang every call after the first write of
    ``batch_key`` has been carried out, as a process killed right after that write: nothing it
    would write next reaches Redis. Returns the event set at that write."""
    written, never = asyncio.Event(), asyncio.Event()

    def writes_batch(args: tuple) -> bool:
        return len(args) > 1 and str(args[0]).upper() == "SET" and str(args[1]) == batch_key

    real_cmd, real_pipeline = r.execute_command, r.pipeline

    async def execute_command(*args: Any, **kw: Any) -> Any:
        if written.is_set():
            await never.wait()
        out = await real_cmd(*args, **kw)
        if writes_batch(args):
            written.set()
        return out

    def pipeline(*a: Any, **kw: Any) -> Any:
        pipe = real_pipeline(*a, **kw)
        real_execute = pipe.execute

        async def execute(*ea: Any, **ekw: Any) -> Any:
            if written.is_set():
                await never.wait()
            batch = any(writes_batch(args) for args, _options in pipe.command_stack)
            out = await real_execute(*ea, **ekw)
            if batch:
                written.set()
            return out

        pipe.execute = execute
        return pipe

    r.execute_command, r.pipeline = execute_command, pipeline
    return written


async def test_a_batch_stored_by_a_request_manager_killed_right_after_has_its_batch_ready_in_the_log(servers):
    """A request manager killed right after it wrote its step's batch, before anything else it
    would write: the trainer took the batch (announced) and trained it; the next life resumes
    after that step. Before, the batch and its ``batch_ready`` outbox entry were two writes: the
    batch was stored and the event nowhere, and the job's log never had the step's hand-over (an
    outside review). Now they are one transaction. Judged from the raw event log."""
    async with Harness(servers, rm_spec("batchlog", steps=2)) as h:
        rep = await h.replica("r0", version=0)
        rep.hold = lambda msg: True  # held until the request manager's Redis is rigged
        await h.start_rm()
        await eventually_async(lambda: len(rep.received) >= 4, timeout=30, what="step 0 dispatched")
        assert h.rm_redis is not None
        written = _freeze_after_batch_write(h.rm_redis, Keys.batch(h.job_id, 0))
        _jetstream_refuses(h)  # (this life appends nothing itself: the outbox is what is left)
        rep.hold = lambda msg: False
        await rep.release()
        await asyncio.wait_for(written.wait(), 30)  # (no event to wait on but this one)
        await h.kill_rm()
        raw = await h.redis.get(Keys.batch(h.job_id, 0))
        assert raw is not None and json.loads(raw)["step"] == 0  # the batch is stored
        assert [e["event"]["data"]["step"] for e in await _outbox(h) if e["event"]["kind"] == "batch_ready"] == [0]
        assert not [e for e in await h.events("batch_ready") if e["step"] == 0]
        await h.commit(0)  # the trainer took it and trained it
        await h.start_rm()  # resumes at step 1
        async def step0() -> list[dict]:
            return [e for e in await h.events("batch_ready") if e["step"] == 0]

        logged = await eventually_async(step0, timeout=20, what="step 0's batch_ready in the log")
        assert len(logged) == 1, logged  # (stored once: the next life's recovery is its duplicate)


async def test_a_step_handed_over_as_its_restart_comes_is_kept_as_handed(servers):
    """A whole-job restart's ``restart_step`` that comes once the step's batch is stored (with its
    event), its announcement still under way: the trainer may already have the batch (it asks for
    it too) and trained it. Before, the restart deleted the batch and cleared its episodes, and
    generated the step again: the trained record named episodes whose turns were not the ones
    trained (an outside review). Now the handed step is kept as it was and the next is the one
    restarted. Judged from raw Redis (the batch and episode records, byte for byte) and the log."""
    async with Harness(servers, rm_spec("handedrestart", steps=2)) as h:
        await h.replica("r0", version=0)
        await h.start_rm()
        assert h.rm_bus is not None
        batch_subject, held, real_publish = subject(h.job_id, Verb.BATCH), asyncio.Event(), h.rm_bus.publish

        async def publish(subj: str, msg: Any, *a: Any, **kw: Any) -> Any:
            if subj == batch_subject:
                held.set()
                await asyncio.Event().wait()  # the announcement never ends: the restart cancels it
            return await real_publish(subj, msg, *a, **kw)

        h.rm_bus.publish = publish  # type: ignore[method-assign]
        await asyncio.wait_for(held.wait(), 30)  # (no event to wait on but this one)
        batch_key = Keys.batch(h.job_id, 0)
        before = await h.redis.get(batch_key)
        ids = await h.episodes.step_episode_ids(0)
        episodes_before = {i: await h.redis.get(Keys.episode(h.job_id, i)) for i in ids}
        assert before is not None and len(ids) == 4 and all(episodes_before.values())
        subj = subject(h.job_id, Verb.CONTROL, "request_manager")
        await h.bus.request(subj, ControlCommand(job_id=h.job_id, target="request_manager", action="restart_step",
                                                 args={"fault_id": "handed-f1"}, fence=1), ControlCommand, timeout=10)
        assert await h.redis.get(batch_key) == before  # kept, byte for byte
        assert {i: await h.redis.get(Keys.episode(h.job_id, i)) for i in ids} == episodes_before
        h.rm_bus.publish = real_publish  # type: ignore[method-assign]
        await h.commit(0)  # the trainer trained it
        await h.bus.request(subj, ControlCommand(job_id=h.job_id, target="request_manager", action="resume",
                                                 args={"start_step": 1, "committed": 0}, fence=1),
                            ControlCommand, timeout=5)
        new = await h.replica("r1", version=1)  # (the restart replaced every replica)
        await new.announce()
        await eventually_async(lambda: h.batches.get(1), timeout=30, what="step 1 handed over after the restart")
        assert await h.redis.get(batch_key) == before
        [lost] = await eventually_async(lambda: _events_for(h, "work_lost", "handed-f1"), timeout=20,
                                        what="the restart's work_lost")
        assert lost["episodes"] == 0, lost  # nothing of the handed step was dropped
        step0 = [e for e in await h.events("batch_ready") if e["step"] == 0]
        assert len(step0) == 1, step0


async def test_a_restart_reaching_a_new_life_keeps_every_step_handed_ahead_of_the_trainer(servers):
    """Async, staleness 2: steps 0 and 1 handed over, step 2 under way, nothing committed; the
    request manager is killed and the whole-job restart's ``restart_step`` reaches its next life,
    whose runner starts at the controller's step (0). Keeping only the runner's own step, the
    restart deleted step 1's handed batch (an outside review). Every handed step is kept; the
    first one not handed is restarted. Judged from raw Redis."""
    spec = {**rm_spec("aheadrestart", steps=4), "mode": "async", "staleness": 2}
    async with Harness(servers, spec) as h:
        rep = await h.replica("r0", version=0)
        rep.hold = lambda msg: msg.episode_id.startswith("s2-")  # step 2 never finishes
        await h.start_rm()
        await eventually_async(lambda: h.batches.get(1), timeout=30, what="steps 0 and 1 handed over")
        await eventually_async(lambda: rep.held and h.episodes.step_episode_ids(2), timeout=30,
                               what="step 2 under way")
        kept = {s: await h.redis.get(Keys.batch(h.job_id, s)) for s in (0, 1)}
        assert all(kept.values())
        await h.kill_rm()
        await h.start_rm(send_resume=False)
        cmd = ControlCommand(job_id=h.job_id, target="request_manager", action="restart_step",
                             args={"fault_id": "ahead-f1"}, fence=1)
        await _until_acknowledged(h, cmd, "restart_step never acknowledged")  # (the new life may wait for its spec)
        assert {s: await h.redis.get(Keys.batch(h.job_id, s)) for s in (0, 1)} == kept
        assert await h.episodes.step_episode_ids(2) == []  # the step under way is restarted
        [lost] = await eventually_async(lambda: _events_for(h, "work_lost", "ahead-f1"), timeout=20,
                                        what="the restart's work_lost")
        assert lost["episodes"] > 0, lost


LATE_WRITES = {
    # the batch and its batch_ready, one transaction
    "hand_over": lambda job: lambda d: b"EXEC" in d and Keys.batch(job, 0).encode() in d,
    # a finished episode's record and its place in the step's set
    "finished_episode": lambda job: lambda d: (b"EXEC" in d and Keys.step_episodes(job, 0).encode() in d
                                               and b"finished" in d),
    # a turn applied: the episode with it, its dispatch forgotten
    "applied_turn": lambda job: lambda d: b"EXEC" in d and b"HDEL" in d and Keys.dispatches(job).encode() in d,
}


async def _restart_with_a_write_held(h: Harness, servers: Any, write: str, *, until_look: bool = False) -> None:
    """The request manager's Redis through a relay that holds the step's first ``write``
    (``LATE_WRITES``); once it is held, the controller's ``restart_step``. The server runs the held
    write late: once the restart is acknowledged (the step cleared), or with ``until_look`` right
    after the restart's look at what the step left (its first delete held until the write ran)."""
    url = urlsplit(servers.redis_url)
    async with HoldingRelay((url.hostname, url.port)) as relay:
        late = relay.hold(LATE_WRITES[write](h.job_id))
        look = relay.hold(lambda d: until_look and b"\r\nDEL\r\n" in d and Keys.batch(h.job_id, 0).encode() in d)
        await h.start_rm(redis_url=relay.url(rm_role_settings(servers).redis_url))
        await asyncio.wait_for(late.held.wait(), 30)
        cmd = ControlCommand(job_id=h.job_id, target="request_manager", action="restart_step",
                             args={"fault_id": "late-f1"}, fence=1)
        acked = asyncio.create_task(_until_acknowledged(h, cmd, "restart_step never acknowledged"))
        if until_look:
            await asyncio.wait_for(look.held.wait(), 30)
            late.release()
            await asyncio.wait_for(late.answered.wait(), 10)
            look.release()
            await acked
        else:
            await acked
            late.release()
            await asyncio.wait_for(late.answered.wait(), 10)
        assert await h.episodes.step_episode_ids(0) == []  # the restart cleared the step
        await _regenerated_once(h)


async def _regenerated_once(h: Harness) -> None:
    """After the controller's resume, step 0 is generated again by the new replica alone and
    handed over once, every episode it names stored and finished."""
    batch_key = Keys.batch(h.job_id, 0)
    late = {"batch": await h.redis.get(batch_key), "episodes": await h.episode_keys(0),
            "step set": await h.episodes.step_episode_ids(0),
            "batch_ready owed": [e for e in (json.loads(x)["event"] for x in
                                             await h.redis.lrange(Keys.rm_outbox(h.job_id), 0, -1))
                                 if e["kind"] == "batch_ready"]}
    assert not any(late.values()), f"the late write landed: {late}"
    await h.bus.request(subject(h.job_id, Verb.CONTROL, "request_manager"),
                        ControlCommand(job_id=h.job_id, target="request_manager", action="resume",
                                       args={"start_step": 0, "committed": -1}, fence=1),
                        ControlCommand, timeout=5)
    await h.replica("r1", version=0)  # (the restart replaced every replica)
    await eventually_async(lambda: 0 in h.batches, timeout=30, what="step 0 handed over after the restart")
    stored = json.loads(await h.redis.get(batch_key))
    assert stored["episode_ids"] == h.batches[0].episode_ids
    eps = await h.episodes.get_many(stored["episode_ids"])
    assert len(eps) == 4 and all(e.status == "finished" for e in eps)
    made_by = {t.member_id for e in eps for t in e.turns if t.role == "assistant"}
    assert made_by == {"r1"}, f"turns made before the restart were kept: {made_by}"
    ready = await eventually_async(lambda: h.events("batch_ready"), timeout=20, what="step 0's batch_ready")
    assert [e["reward_mean"] for e in ready] == [stored["reward_mean"]], ready


@pytest.mark.parametrize("write", sorted(LATE_WRITES))
async def test_a_write_of_a_step_the_server_runs_after_its_restart_writes_nothing(servers, write):
    """The worst moment of a whole-job restart: a write of the step is on its way to Redis when
    ``restart_step`` cancels the step, and the server runs it only after the restart has looked
    at what the step left and cleared it (a slow server, a connection's bytes read late). Before
    the step-restart count guarded them (each failed so): the hand-over stored a batch naming the
    restarted step's deleted episodes, with its event owed to the log (the trainer took a batch
    that no longer existed); a finished episode came back into the step, which, "generated again
    from scratch", resumed it with the replaced replica's turns; an applied turn left an episode
    record outside the step's set, which nothing collects. Judged from raw Redis once the server
    answered the late write; then the step is generated again and handed over once."""
    async with Harness(servers, rm_spec(f"late{write.replace('_', '')[:8]}", steps=1)) as h:
        await h.replica("r0", version=0)
        await _restart_with_a_write_held(h, servers, write)


async def test_a_hand_over_the_server_runs_right_after_the_restarts_look_writes_nothing(servers):
    """The same, the late hand-over run between the restart's look (no batch stored: the step is
    restarted) and its delete of the step's keys: the restart count must have moved on before
    the look, not merely before the restart ends (else the batch is deleted, but its batch_ready
    stays owed to the log)."""
    async with Harness(servers, rm_spec("latelook", steps=1)) as h:
        await h.replica("r0", version=0)
        await _restart_with_a_write_held(h, servers, "hand_over", until_look=True)


async def test_a_write_of_a_failed_attempt_the_server_runs_after_the_retry_writes_nothing(servers, monkeypatch):
    """A step attempt that fails (Redis refuses one episode's write) cancels its siblings and is
    retried from the saved records; one sibling's write -- its turn applied -- is on its way to
    Redis and the server runs it only after the retry has finished that episode and handed the
    batch over (a slow server, a connection's bytes read late). Before, the retry wrote under the
    same step-restart count as the failed attempt, so the late write landed: the episode's raw
    record went back to an unscored, unfinished one, which the trainer read for the handed batch
    (reward 0; an outside review). Judged from raw Redis after the server answered the late write."""
    from robustrl.storage.redis_stores import DispatchStore

    async with Harness(servers, rm_spec("lateretry", steps=1, turn_deadline_s=1.0)) as h:
        rep = await h.replica("r0", version=0)
        rep.hold = lambda msg: True
        url = urlsplit(servers.redis_url)
        async with HoldingRelay((url.hostname, url.port)) as relay:
            late = relay.hold(LATE_WRITES["applied_turn"](h.job_id))
            await h.start_rm(redis_url=relay.url(rm_role_settings(servers).redis_url))
            await eventually_async(lambda: len(rep.held) == 4, timeout=30, what="step 0's four turns held")
            first, rep.held = rep.held[0], rep.held[1:]
            await rep.answer(first)
            await asyncio.wait_for(late.held.wait(), 30)  # its turn applied: the write held
            real, refused = DispatchStore.applied, []

            async def refuse_once(self: DispatchStore, ep: Any) -> None:
                if not refused:
                    refused.append(ep.episode_id)
                    raise TransportError("Redis refused the write (injected)")
                await real(self, ep)

            monkeypatch.setattr(DispatchStore, "applied", refuse_once)
            rep.hold = lambda msg: False
            await rep.release()  # a sibling's write refused: the attempt fails, the held one's task cancelled
            await eventually_async(lambda: 0 in h.batches, timeout=30, what="step 0 handed over by the retry")
            assert refused and refused[0] != first.episode_id
            batch = json.loads(await h.redis.get(Keys.batch(h.job_id, 0)))
            before = {e.episode_id: e for e in await h.episodes.get_many(batch["episode_ids"])}
            assert all(e.status == "finished" for e in before.values()), before
            late.release()
            await asyncio.wait_for(late.answered.wait(), 10)
        after = {e.episode_id: e for e in await h.episodes.get_many(batch["episode_ids"])}
        assert after == before, {k: (before[k].status, after[k].status) for k in before if after.get(k) != before[k]}


async def _stubborn(release: asyncio.Event) -> None:
    """A task that swallows its cancellations until ``release`` is set."""
    while not release.is_set():
        try:
            await release.wait()
        except asyncio.CancelledError:
            continue


async def test_a_job_whose_stop_takes_long_holds_back_no_other_jobs_command(servers, monkeypatch):
    """One request manager runs two jobs. Job b is stopped, and a task of its runner swallows its
    cancellations (the stop waits for it, bounded). Every job's commands come through one
    subscription, one at a time: job a's ``pause`` waited for b's stop to end (up to 45 s with the
    service's bounds; 6 s here). It must be acknowledged, and carried out, while b's stop is still
    under way. A resume of b meanwhile (its id run again) is not acknowledged (no second runner
    of one job; waiting for the first in the handler held every job's commands again), and is
    carried out once b's stop is acknowledged, after its runner ended."""
    from robustrl.services.request_manager import batching

    monkeypatch.setattr(batching, "STOP_WAIT_S", 2.0)  # x STOP_ATTEMPTS (3): 6 s for the stubborn task
    async with Harness(servers, rm_spec("ajob")) as a, Harness(servers, rm_spec("bjob")) as b:
        await a.replica("rollout-0-i0", version=0)
        rm = await a.start_rm()
        resume = ControlCommand(job_id=b.job_id, target="request_manager", action="resume",
                                args={"start_step": 0, "committed": -1}, fence=1)
        await b.bus.request(subject(b.job_id, Verb.CONTROL, "request_manager"), resume, ControlCommand, timeout=10)
        assert b.job_id in rm.jobs and a.job_id in rm.jobs
        release = asyncio.Event()
        rm.jobs[b.job_id]._gc_task = stubborn_task = asyncio.create_task(_stubborn(release))
        stop = ControlCommand(job_id=b.job_id, target="request_manager", action="stop", args={}, fence=1)
        t0 = time.monotonic()
        stopping = asyncio.create_task(b.bus.request(subject(b.job_id, Verb.CONTROL, "request_manager"), stop,
                                                     ControlCommand, timeout=30))
        try:
            await eventually_async(lambda: b.job_id not in rm.jobs, timeout=5, what="b's stop taken")
            pause = ControlCommand(job_id=a.job_id, target="request_manager", action="pause", args={}, fence=1)
            await a.bus.request(subject(a.job_id, Verb.CONTROL, "request_manager"), pause, ControlCommand, timeout=3)
            assert not stopping.done(), "b's stop ended before a's pause was answered: nothing was held"
            assert rm.jobs[a.job_id].paused
            with pytest.raises(RequestTimeout):
                await b.bus.request(subject(b.job_id, Verb.CONTROL, "request_manager"), resume, ControlCommand,
                                    timeout=2)
            assert b.job_id not in rm.jobs and not stopping.done()
            await stopping  # acknowledged once b's runner ended (the stubborn task given up on, bounded)
            assert time.monotonic() - t0 >= 6.0
            assert b.job_id not in rm.jobs

            async def resumed() -> bool:  # (the controller sends an unacknowledged resume again)
                try:
                    await b.bus.request(subject(b.job_id, Verb.CONTROL, "request_manager"), resume, ControlCommand,
                                        timeout=2)
                except RequestTimeout:
                    return False
                return b.job_id in rm.jobs
            await eventually_async(resumed, timeout=15, what="b run again once its old runner ended")
        finally:
            release.set()
            stubborn_task.cancel()
            stopping.cancel()


async def test_a_close_during_a_background_stop_ends_the_stopped_jobs_runner_too(servers, monkeypatch):
    """The service closes (its process told to stop) while a job's stop still runs in the
    background: its runner's main task swallows cancellations, so the stop is still waiting for it,
    and its other tasks (the GC, the commit report) have not been cancelled yet. ``close`` cancels
    the background stop and must end that runner itself (``_ending``): every one of its tasks but
    the stubborn one is done once ``close`` returns, within the stop's bound, and nothing is left
    running. (A close that stopped only the running jobs left the stopped job's tasks running.)"""
    from robustrl.services.request_manager import batching

    monkeypatch.setattr(batching, "STOP_WAIT_S", 1.0)  # x STOP_ATTEMPTS (3): 3 s for the stubborn task
    async with Harness(servers, rm_spec("closejob")) as h:
        await h.replica("rollout-0-i0", version=0)
        rm = await h.start_rm()
        runner = rm.jobs[h.job_id]
        release = asyncio.Event()
        real_run, runner._task = runner._task, asyncio.create_task(_stubborn(release))
        gc = runner._gc_task = asyncio.create_task(asyncio.sleep(3600))  # (a task still to be cancelled)
        stop = ControlCommand(job_id=h.job_id, target="request_manager", action="stop", args={}, fence=1)
        stopping = asyncio.create_task(h.bus.request(subject(h.job_id, Verb.CONTROL, "request_manager"), stop,
                                                     ControlCommand, timeout=30))
        try:
            await eventually_async(lambda: h.job_id not in rm.jobs and h.job_id in rm._stopping, timeout=5,
                                   what="the stop under way in the background")
            assert not gc.done(), "the stop reached the GC task before the close: nothing to test"
            t0 = time.monotonic()
            await asyncio.wait_for(rm.close(), 30)
            took = time.monotonic() - t0
            assert gc.done(), "the stopped job's GC task still runs after close"
            assert runner._commit_report is None or runner._commit_report.done()
            assert not runner._task.done()  # (the stubborn one: given up on, bounded)
            assert took < 2 * batching.STOP_ATTEMPTS * batching.STOP_WAIT_S + 5, took
            assert all(t.done() for t in rm._tasks), [t for t in rm._tasks if not t.done()]
        finally:
            release.set()
            real_run.cancel()
            stopping.cancel()
            h.rm = None  # closed here (the harness's kill is for a live one)
            h._rm_metrics.cancel()
            await h.rm_bus.close()
            await h.rm_redis.aclose()


async def test_turns_regenerated_for_a_fault_are_charged_to_it_across_a_request_manager_restart(servers):
    """Replica a declared dead under fault F: its turns go to b. Before b answers, the request
    manager is killed; its next life adopts b's turns (dispatched by the last life) and b answers.
    Those turns were generated again because of F, but the cause lived only in the last life's
    memory: no ``turn_regenerated`` was logged, and the accounting charged F no tokens (an outside
    review). Now the dispatch record carries the cause. Judged from the log by the accounting."""
    from robustrl.chaos.accounting import account

    async with Harness(servers, rm_spec("regenacross")) as h:
        a = await h.replica("rollout-0-i0")
        a.hold = lambda msg: True
        await h.start_rm()
        await eventually_async(lambda: len(a.held) == 4, timeout=20, what="the step's 4 turns on replica a")
        b = await h.replica("rollout-1-i0")
        b.hold = lambda msg: True
        cmd = ControlCommand(job_id=h.job_id, target="request_manager", action="replica_dead",
                             args={"fault_id": "regen-f1", "member_id": a.member_id}, fence=1)
        await _until_acknowledged(h, cmd, "replica_dead never acknowledged")
        await eventually_async(lambda: len(b.held) == 4, timeout=20, what="the 4 turns re-dispatched to b")
        await h.kill_rm()
        await h.start_rm()
        resumed = await eventually_async(lambda: h.events("rm_resumed"), timeout=20, what="the new life resumed")
        assert resumed[0]["dispatched"] == 4, resumed  # it takes b's 4 turns over
        answered = await b.release()
        await eventually_async(lambda: 0 in h.batches, timeout=30, what="step 0 handed over by the new life")
        # (the new life adopted b's turns: nothing was dispatched a third time)
        assert len(b.received) == 4 and len(a.received) == 4
        log = await h.bus.read_events(h.job_id)
    regenerated = [e.data for e in log if e.kind == "turn_regenerated"]
    assert sorted(d["episode_id"] for d in regenerated) == sorted(m.episode_id for m in answered), regenerated
    assert {(d["fault_id"], d["cause"], d["member_id"]) for d in regenerated} == {
        ("regen-f1", "replica_dead", b.member_id)}, regenerated
    assert sum(d["tokens"] for d in regenerated) == 4 * len(b.tok.encode("ab"))
    # And as the accounting reads it, once the fault is in the log as detected:
    detected = Event(job_id=h.job_id, kind="fault_detected", ts=log[0].ts, data={
        "fault_id": "regen-f1", "kind": "crash", "role": "rollout", "member_id": a.member_id})
    [fault] = [f for f in account([detected, *log]).faults if f.fault_id == "regen-f1"]
    assert fault.tokens_regenerated == 4 * len(b.tok.encode("ab")), fault


async def test_a_replica_that_died_while_the_request_manager_was_down_has_its_turns_charged_to_its_fault(servers):
    """Replica a holds the step's turns; the request manager is killed, and a dies meanwhile (it
    falls silent). The next life finds a's turns in the dispatch records; the controller's
    ``replica_dead`` for a (fault F) reaches it while it waits to adopt them. Before, the turns
    were dispatched again silently: no ``episode_redispatched``, no ``turn_regenerated``, nothing
    charged to F. Now each is a logged re-dispatch from its prefix, and its regeneration is F's."""
    from robustrl.chaos.accounting import account

    async with Harness(servers, rm_spec("deadwhiledown")) as h:
        a = await h.replica("rollout-0-i0")
        a.hold = lambda msg: True
        await h.start_rm()
        await eventually_async(lambda: len(a.held) == 4, timeout=20, what="the step's 4 turns on replica a")
        on_a = {m.episode_id for m in a.held}
        await h.kill_rm()
        assert a._task is not None
        a._task.cancel()  # dead: silent from now on (its requests held, unanswered)
        b = await h.replica("rollout-1-i0")
        await h.start_rm()
        cmd = ControlCommand(job_id=h.job_id, target="request_manager", action="replica_dead",
                             args={"fault_id": "down-f1", "member_id": a.member_id}, fence=1)
        await _until_acknowledged(h, cmd, "replica_dead never acknowledged")
        await eventually_async(lambda: 0 in h.batches, timeout=30, what="step 0 handed over by the new life")
        log = await h.bus.read_events(h.job_id)
    redispatched = [e.data for e in log if e.kind == "episode_redispatched"]
    assert {d["episode_id"] for d in redispatched} == on_a, redispatched
    assert {(d["member_id"], d["cause"]) for d in redispatched} == {(a.member_id, "replica_dead")}, redispatched
    regenerated = [e.data for e in log if e.kind == "turn_regenerated"]
    assert {d["episode_id"] for d in regenerated} == on_a, regenerated
    assert {(d["fault_id"], d["member_id"]) for d in regenerated} == {("down-f1", b.member_id)}, regenerated
    detected = Event(job_id=h.job_id, kind="fault_detected", ts=log[0].ts, data={
        "fault_id": "down-f1", "kind": "crash", "role": "rollout", "member_id": a.member_id})
    [fault] = [f for f in account([detected, *log]).faults if f.fault_id == "down-f1"]
    assert fault.tokens_regenerated == sum(d["tokens"] for d in regenerated) > 0, fault
