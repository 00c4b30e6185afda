"""The auditor reads the detector's outbox too: an ended job whose detector outbox holds an event
its log lacks lost that event (a detector killed while JetStream was away, and none appended it
since), like the request manager's outbox.

Written by the detector's own store into the session's Redis server, read back raw by the
auditor's reader; the judging is checked on synthetic inputs too.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from test_audit import Log, sound_job

from robustrl.audit import AuditInput, judge
from robustrl.audit.raw import RawEvent, read_redis
from robustrl.config import Settings
from robustrl.messages import Event
from robustrl.storage.control_stores import DetectorOutbox, OutboxEntry, RolloutOutbox
from robustrl.storage.redis_stores import connect

DETECTED = {"fault_id": "f-r0", "kind": "crash", "role": "rollout", "member_id": "r0", "step": 1,
            "detected_at": 5.0, "fault_at": None, "cause": "exit", "evidence": "test"}


def _entry(ts: float) -> dict[str, Any]:
    return {"msg_id": "m1", "event": {"job_id": "j", "kind": "fault_detected", "ts": ts, "data": DETECTED}}


def test_an_ended_jobs_detector_outbox_entry_missing_from_the_log_fails():
    inp = sound_job()
    ts = inp.events[-1].ts - 1.0
    inp.redis.detector_outbox = [_entry(ts)]
    report = judge(inp)
    assert not report.checks["outbox"].passed, report.violations()
    assert any("detector" in v and "fault_detected" in v for v in report.checks["outbox"].violations), \
        report.violations()
    assert report.facts["detector_outbox_unappended"] == 1, report.facts
    # Appended already, its removal from the outbox not done yet: sound.
    n = len(inp.events)
    inp.events = [*inp.events[:-1], RawEvent(n + 1, "fault_detected", ts, DETECTED), inp.events[-1]]
    report = judge(inp)
    assert report.checks["outbox"].passed and report.facts["detector_outbox_unappended"] == 0, report.violations()
    # An entry that does not parse can never be appended.
    inp.redis.detector_outbox.append(None)
    assert any("does not parse" in v for v in judge(inp).checks["outbox"].violations)


def test_the_detector_outbox_is_read_raw_from_redis(infra: Settings):
    job = f"aud-{uuid.uuid4().hex[:8]}"
    log = Log()
    log.add("job_submitted", spec={"steps": 1, "data": {"prompts_per_step": 1, "group_size": 2}})
    log.add("step_committed", step=0, epoch=1, weights_version=1)
    log.add("job_finished")

    async def run() -> Any:
        r = connect(infra.redis_url)
        try:
            await DetectorOutbox(r, job).add(OutboxEntry(msg_id=f"{job}-fault_detected-1", event=Event(
                job_id=job, kind="fault_detected", ts=log.events[-1].ts - 1.0, data=DETECTED)))
            return await read_redis(infra.redis_url, job, 1)
        finally:
            keys = [k async for k in r.scan_iter(match=f"rrl:{job}:*")]
            if keys:
                await r.delete(*keys)
            await r.aclose()

    raw = asyncio.run(run())
    assert raw.detector_outbox is not None and len(raw.detector_outbox) == 1, raw
    report = judge(AuditInput(job_id=job, events=log.events, redis=raw, checkpoints=[]))
    assert any("detector" in v for v in report.checks["outbox"].violations), report.violations()


# --- the rollout replicas' outbox ------------------------------------------------------------------

LOADED = {"member_id": "rollout-0-i0", "version": 1, "checksum": "c1", "verified": True}


def test_an_ended_jobs_rollout_outbox_entry_missing_from_the_log_fails():
    """A replica's ``weights_loaded`` left in the rollout outbox (the replica killed while JetStream
    was away, and no replica of the job started after) and never logged: the event was lost."""
    inp = sound_job()
    ts = inp.events[-1].ts - 1.0
    entry = {"msg_id": "m-r", "event": {"job_id": "j", "kind": "weights_loaded", "ts": ts, "data": LOADED}}
    inp.redis.rollout_outbox = [entry]
    report = judge(inp)
    assert not report.checks["outbox"].passed, report.violations()
    assert any("rollout" in v and "weights_loaded" in v for v in report.checks["outbox"].violations), \
        report.violations()
    assert report.facts["rollout_outbox_unappended"] == 1 and report.facts["rollout_outbox_entries"] == 1
    # Appended already (by the next replica), its removal not done yet: sound.
    n = len(inp.events)
    inp.events = [*inp.events[:-1], RawEvent(n + 1, "weights_loaded", ts, LOADED), inp.events[-1]]
    report = judge(inp)
    assert report.facts["rollout_outbox_unappended"] == 0, report.facts
    assert not any("rollout replicas' outbox" in v for v in report.violations()), report.violations()


def test_the_rollout_outbox_is_read_raw_from_redis(infra: Settings):
    """Written by the replicas' own store (``RolloutOutbox``) into the session's Redis server, read
    back raw by the auditor's reader: an ended job's entry its log lacks fails the outbox check."""
    job = f"aud-{uuid.uuid4().hex[:8]}"
    log = Log()
    log.add("job_submitted", spec={"steps": 1, "data": {"prompts_per_step": 1, "group_size": 2}})
    log.add("step_committed", step=0, epoch=1, weights_version=1)
    log.add("job_finished")

    async def run() -> Any:
        r = connect(infra.redis_url)
        try:
            await RolloutOutbox(r, job).add(OutboxEntry(msg_id=f"{job}-weights_loaded-1", event=Event(
                job_id=job, kind="weights_loaded", ts=log.events[-1].ts - 1.0, data=LOADED)))
            return await read_redis(infra.redis_url, job, 1)
        finally:
            keys = [k async for k in r.scan_iter(match=f"rrl:{job}:*")]
            if keys:
                await r.delete(*keys)
            await r.aclose()

    raw = asyncio.run(run())
    assert raw.rollout_outbox is not None and len(raw.rollout_outbox) == 1, raw
    report = judge(AuditInput(job_id=job, events=log.events, redis=raw, checkpoints=[]))
    assert any("rollout replicas' outbox" in v and "weights_loaded" in v
               for v in report.checks["outbox"].violations), report.violations()
    assert report.facts["rollout_outbox_unappended"] == 1, report.facts
