"""Events a killed request manager left in its Redis outbox reach the job's log even when the job
ends before any request manager runs it again.

The request manager keeps each event of its control handler in an outbox in Redis
(``Keys.rm_outbox``) from before the command's acknowledgement until JetStream stored it; the next
request manager to *run* the job appended what it found there. A job that ended in between was
never run again: its acknowledged events were in nobody's hands, and a deletion that keeps the log
purged them unappended. Checked from outside: the raw JetStream log (the auditor's reader) and
the raw Redis keys.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from rm_harness import Harness, rm_spec
from support import eventually_async

from robustrl.audit.raw import RawEvent, read_event_log
from robustrl.bus import Bus
from robustrl.client import ApiClient
from robustrl.config import Settings
from robustrl.infra.credentials import Credentials, role_settings
from robustrl.messages import Event
from robustrl.storage.control_stores import JobRegistry
from robustrl.storage.redis_stores import Keys, connect
from robustrl.subjects import Principal

pytestmark = pytest.mark.timeout(60)


async def _work_lost(nats_url: str, job_id: str, fault_id: str) -> list[RawEvent]:
    return [e for e in await read_event_log(nats_url, job_id)
            if e.kind == "work_lost" and e.data.get("fault_id") == fault_id]


async def test_a_killed_request_managers_outbox_is_appended_though_its_job_ended_unrun(
        servers: Settings) -> None:
    """``replica_dead`` acknowledged while JetStream takes nothing, the request manager killed (its
    ``work_lost`` only in the outbox), then the job stopped: no request manager runs it again. The
    next request manager to start (with its own Redis and NATS credentials) appends the event
    anyway, once, and the outbox key goes. Keys of the outbox pattern that name no job, or hold
    the wrong type, and an entry that does not parse do not stop it."""
    from robustrl.services.request_manager.service import RequestManager

    async with Harness(servers, rm_spec("orphan")) as h:
        a, b = await h.replica("rollout-0-i0"), await h.replica("rollout-1-i0")
        a.hold = b.hold = lambda msg: True
        await h.start_rm()
        await eventually_async(lambda: a.held, timeout=20, what="a turn in flight on replica a")
        await h.replica_dead_with_jetstream_away("f-orphan", a.member_id)
        outbox = Keys.rm_outbox(h.job_id)
        # acknowledged: its event in the outbox, not the log (with the re-dispatches' own events)
        kinds = [json.loads(raw)["event"]["kind"] for raw in await h.redis.lrange(outbox, 0, -1)]
        assert kinds.count("work_lost") == 1, kinds
        await h.kill_rm()
        a.hold = b.hold = lambda msg: False
        # The job ends before any request manager runs it again (the controller stopped it).
        await JobRegistry(h.redis).put(h.job_id, {"spec": h.spec, "status": "stopped"})
        await h.redis.rpush(outbox, b"{not json")  # dropped, logged
        odd = [Keys.rm_outbox("not a job!"), Keys.rm_outbox("a:b"),
               Keys.rm_outbox(f"wrongtype-{uuid.uuid4().hex[:6]}")]
        await h.redis.rpush(odd[0], b"x")
        await h.redis.rpush(odd[1], b"x")
        await h.redis.set(odd[2], b"not a list")
        assert not await _work_lost(servers.nats_url, h.job_id, "f-orphan")

        role = role_settings(servers, Credentials.load(servers.credentials_file), Principal.REQUEST_MANAGER)
        bus = await Bus.connect(role.nats_url, "request_manager", role="request_manager")
        redis = connect(role.redis_url)
        rm = RequestManager(bus, redis)
        try:
            await rm.start()
            await eventually_async(lambda: _work_lost(servers.nats_url, h.job_id, "f-orphan"), timeout=15,
                                   what="the stopped job's work_lost appended from the outbox")
            await eventually_async(lambda: _gone(h, outbox), timeout=10, what="the outbox key gone")
            assert h.job_id not in rm.jobs  # appended, not run
            logged = await _work_lost(servers.nats_url, h.job_id, "f-orphan")
            assert len(logged) == 1, [e.data for e in logged]
            assert logged[0].data["turns"] >= 1
        finally:
            await rm.close()
            await bus.close()
            await redis.aclose()
            await h.redis.delete(*odd)


async def _gone(h: Harness, key: str) -> bool:
    return not await h.redis.exists(key)


# --- deletion -------------------------------------------------------------------------------------


def _left_by_a_killed_request_manager(job_id: str, fault_id: str) -> tuple[str, bytes]:
    """An outbox entry as the request manager writes it (``EventWriter.emit``)."""
    event = Event(job_id=job_id, kind="work_lost", data={"fault_id": fault_id, "turns": 2, "tokens": 0,
                                                        "steps_redone": 0})
    return f"{job_id}-work_lost-{fault_id}", json.dumps({"msg_id": f"{job_id}-work_lost-{fault_id}",
                                                         "event": event.model_dump(mode="json")}).encode()


def test_deleting_an_ended_job_that_keeps_its_log_appends_its_outbox_first(api: ApiClient,
                                                                           infra: Settings) -> None:
    """An ended job whose outbox still holds an acknowledged event (its request manager was killed
    and none ran the job again): ``DELETE`` keeps the log by default, so the event is appended
    before the outbox is purged, once, before ``job_deleted``. With ``events=true`` the log goes
    anyway: the outbox goes with the rest, and nothing fails on it."""
    import redis as redis_sync

    r = redis_sync.Redis.from_url(infra.redis_url)
    try:
        kept, purged = f"outbox-kept-{uuid.uuid4().hex[:8]}", f"outbox-purged-{uuid.uuid4().hex[:8]}"
        for job_id in (kept, purged):
            r.hset(Keys.jobs(), job_id, json.dumps({"spec": {"name": job_id.rsplit("-", 1)[0], "steps": 1},
                                                    "status": "stopped"}))
            entry = _left_by_a_killed_request_manager(job_id, "f-del")[1]
            r.rpush(Keys.rm_outbox(job_id), entry, b"{not json")

        out = api.delete(kept)
        assert out["events_kept"]
        assert not r.exists(Keys.rm_outbox(kept))
        log = asyncio.run(read_event_log(infra.nats_url, kept))
        lost = [e for e in log if e.kind == "work_lost" and e.data.get("fault_id") == "f-del"]
        assert len(lost) == 1, [e.kind for e in log]
        assert [e.kind for e in log][-2:] == ["work_lost", "job_deleted"], [e.kind for e in log]

        out = api.delete(purged, events=True)
        assert not out["events_kept"] and not r.exists(Keys.rm_outbox(purged))
        assert r.hget(Keys.jobs(), purged) is None
        assert asyncio.run(read_event_log(infra.nats_url, purged)) == []
    finally:
        r.close()


async def test_each_work_lost_of_one_fault_reaches_the_log(servers: Settings) -> None:
    """One fault can make the request manager lose work more than once: the controller declares
    two borrowed replicas dead under the gang recovery's fault id, and a replica recovery that
    fails escalates to a whole-job restart under the same id. Each ``work_lost`` is its own event
    (the accounting sums them per fault); under one message id JetStream stored the first and
    dropped the others as duplicates (an outside review). A retry of one command is still stored
    once. Read from the raw log."""
    from robustrl.messages import ControlCommand
    from robustrl.subjects import Verb, subject

    async with Harness(servers, rm_spec("twodead")) as h:
        a, b = await h.replica("rollout-0-i0"), await h.replica("rollout-1-i0")
        a.hold = b.hold = lambda msg: True
        await h.start_rm()
        await eventually_async(lambda: a.held and b.held and len(a.held) + len(b.held) == 4, timeout=20,
                               what="the step's 4 turns in flight on replicas a and b")
        on_a, on_b = len(a.held), len(b.held)
        c = await h.replica("rollout-2-i0")
        c.hold = lambda msg: True  # (the re-dispatched turns wait there: the step does not end)
        fault = f"f-{uuid.uuid4().hex[:6]}"

        async def command(action: str, **args: object) -> None:
            cmd = ControlCommand(job_id=h.job_id, target="request_manager", action=action,
                                 args={"fault_id": fault, **args}, fence=1)
            await h.bus.request(subject(h.job_id, Verb.CONTROL, "request_manager"), cmd, ControlCommand, timeout=10)

        await command("replica_dead", member_id=a.member_id)
        await command("replica_dead", member_id=b.member_id)
        await command("replica_dead", member_id=a.member_id)  # a retry (its answer lost): stored once
        await command("restart_step")
        await command("restart_step")  # a retry too
        # Each acknowledged command's event is in the outbox; the outbox empties as JetStream
        # takes them (a duplicate is taken too, and dropped there).
        outbox = Keys.rm_outbox(h.job_id)
        await eventually_async(lambda: _empty(h, outbox), timeout=20, what="the outbox appended")
        events = await _work_lost(servers.nats_url, h.job_id, fault)
    turns = sorted(int(e.data.get("turns", 0) or 0) for e in events if "turns" in e.data)
    assert turns == sorted([on_a, on_b]), events
    assert len(events) == 3, [e.data for e in events]
    assert sum(1 for e in events if "episodes" in e.data) == 1, [e.data for e in events]


async def _empty(h: Harness, key: str) -> bool:
    return await h.redis.llen(key) == 0
