"""An event saved twice in its outbox, or stored while its removal fails, is stored once.

Invariant: no event is appended twice to the job's JetStream log. JetStream drops an append under a
message id it stored within its duplicate window (2 min); past it, an append is a second entry.
The stream's window is cut to 1 s here (restored after), so a second append is a second entry.

* A save (``EventOutbox.add``, an RPUSH) that Redis carried out and whose reply was lost (a Redis
  restart after the AOF write, a stall past the socket timeout) is sent again by redis-py's retry
  layer: the outbox holds two byte-identical entries. One was removed once the event was stored
  (an ``LREM`` of count 1); the other was queued again by a later read of the outbox (the request
  manager's stop, a replica's re-read) under the same message id: stored twice. The removal now
  takes every copy; and the entries of one message id a read finds are queued once.
* Strict mode (the request manager's writer): a removal that failed after JetStream stored the
  event was retried with the append, so the event was published again each round: stored again
  once the Redis outage passed the window. Now only the removal is retried.

Real NATS and Redis of this module's own (``servers``); judged from the raw log and raw Redis.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
import rm_harness
from redis.exceptions import ConnectionError as RedisConnectionError
from rm_harness import Harness, rm_spec
from robustrl.services.rollout.events import ReplicaEvents
from support import duplicate_window, eventually_async

from robustrl.audit.raw import read_event_log
from robustrl.bus import Bus
from robustrl.config import Settings
from robustrl.event_outbox import OutboxWriter
from robustrl.event_queue import EventQueue
from robustrl.infra.credentials import Credentials, role_settings
from robustrl.messages import ControlCommand, Event
from robustrl.storage.control_stores import OutboxEntry, RmOutbox
from robustrl.storage.redis_stores import Keys, connect
from robustrl.subjects import Principal, Verb, subject

pytestmark = pytest.mark.timeout(90)

WINDOW_S = 1.0
"""The event stream's duplicate window here (2 min in service)."""
PAST_WINDOW_S = 1.5
"""A wait past the cut window, from the event's store: a second append then is a second entry."""



async def _ensure_stream(nats_url: str) -> None:
    operator = await Bus.connect(nats_url, "test-operator")
    try:
        await operator.ensure_event_stream()
    finally:
        await operator.close()


def _push_twice(client: Any, key: str) -> list[int]:
    """Make ``client``'s RPUSH to ``key`` run twice, as redis-py's retry of one whose reply was lost
    does (the same command, the same bytes); returns the list of the doubled pushes' lengths."""
    pushed: list[int] = []
    rpush = client.rpush

    async def twice(name: Any, *values: Any) -> Any:
        if (name.decode() if isinstance(name, bytes) else name) == key:
            await rpush(name, *values)  # carried out; its reply lost
            pushed.append(len(values))
        return await rpush(name, *values)

    client.rpush = twice
    return pushed


async def _logged(nats_url: str, job_id: str, kind: str) -> list[dict[str, Any]]:
    return [e.data for e in await read_event_log(nats_url, job_id) if e.kind == kind]


async def test_a_request_managers_save_carried_out_twice_is_stored_once_past_the_window(
        servers: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """The request manager's save of step 0's ``batch_ready`` carried out twice (its RPUSH retried
    after a lost reply). Once the event is stored and the window passed, the job is stopped: the
    stop reads the outbox again (``_ack_when_drained``). The log holds ``batch_ready`` once and
    the outbox is empty."""
    await _ensure_stream(servers.nats_url)
    window = await duplicate_window(servers.nats_url, WINDOW_S)
    try:
        async with Harness(servers, rm_spec("dup", steps=1)) as h:
            outbox = Keys.rm_outbox(h.job_id)
            pushed: list[list[int]] = []

            def doubling_connect(url: str) -> Any:  # the request manager's client (the harness's stays plain)
                client = connect(url)
                pushed.append(_push_twice(client, outbox))
                return client

            monkeypatch.setattr(rm_harness, "connect", doubling_connect)
            await h.replica("r0", version=0)
            await h.start_rm()
            await eventually_async(lambda: h.events("batch_ready"), timeout=30, what="step 0's batch_ready logged")
            await eventually_async(lambda: h.rm is not None and all(j.events.pending == 0 for j in h.rm.jobs.values()),
                                   timeout=10, what="the request manager's queue empty (stored, settled)")
            assert any(pushed), "no save of the request manager went through the doubled RPUSH"
            await asyncio.sleep(PAST_WINDOW_S)  # past the (cut) window from the store
            cmd = ControlCommand(job_id=h.job_id, target="request_manager", action="stop", fence=1)
            await h.bus.request(subject(h.job_id, Verb.CONTROL, "request_manager"), cmd, ControlCommand,
                                timeout=15)
            logged = [e.data for e in await h.bus.read_events(h.job_id) if e.kind == "batch_ready"]
            left = await h.redis.lrange(outbox, 0, -1)
            assert [d["step"] for d in logged] == [0], logged
            assert left == [], left
    finally:
        await duplicate_window(servers.nats_url, window)


async def test_a_replicas_save_carried_out_twice_is_stored_once_past_the_window(servers: Settings) -> None:
    """A rollout replica's event path (bounded mode, the rollout role's Redis user: +@read +rpush
    +lrem only) with its save carried out twice: once stored, the outbox is empty, and a re-read
    past the window queues nothing; the log holds the event once."""
    await _ensure_stream(servers.nats_url)
    role = role_settings(servers, Credentials.load(servers.credentials_file), Principal.ROLLOUT)
    job_id = f"dup{uuid.uuid4().hex[:8]}"
    admin = connect(servers.redis_url)
    redis = connect(role.redis_url)
    pushed = _push_twice(redis, Keys.rollout_outbox(job_id))
    bus = await Bus.connect(role.nats_url, "rollout-dup", role="rollout")
    events = ReplicaEvents(bus, job_id, redis)
    window = await duplicate_window(servers.nats_url, WINDOW_S)
    try:
        assert await events.emit("weights_loaded", {"member_id": "r-0", "version": 1, "checksum": "c",
                                                    "verified": True})
        assert pushed == [1]
        await eventually_async(lambda: events.pending == 0, timeout=10, what="stored and settled")
        left_after_store = await admin.lrange(Keys.rollout_outbox(job_id), 0, -1)
        await asyncio.sleep(PAST_WINDOW_S)  # past the (cut) window from the store
        requeued = await events.recover()
        await events.close(5.0)
        logged = await _logged(servers.nats_url, job_id, "weights_loaded")
        assert len(logged) == 1, logged
        assert (requeued, left_after_store) == (0, [])
        assert await admin.exists(Keys.rollout_outbox(job_id)) == 0
    finally:
        await events.close(0.5)
        await duplicate_window(servers.nats_url, window)
        await bus.close()
        await redis.aclose()
        await admin.aclose()


class _Removals:
    """A Redis client's LREM raising a connection error (as a client past its retries does)
    while ``failing``; ``failed`` counts the refusals."""

    def __init__(self, client: Any) -> None:
        self.failing = True
        self.failed = 0
        self._lrem = client.lrem
        client.lrem = self._call

    async def _call(self, *args: Any, **kw: Any) -> Any:
        if self.failing:
            self.failed += 1
            raise RedisConnectionError("redis away (test)")
        return await self._lrem(*args, **kw)


def _entry(job_id: str, msg_id: str) -> OutboxEntry:
    return OutboxEntry(msg_id=msg_id, event=Event(job_id=job_id, kind="batch_ready",
                                                  data={"step": 0, "reward_mean": 0.5}))


async def _strict_writer(servers: Settings, name: str) -> tuple[str, Bus, Any, Any, EventQueue, OutboxWriter]:
    await _ensure_stream(servers.nats_url)
    role = role_settings(servers, Credentials.load(servers.credentials_file), Principal.REQUEST_MANAGER)
    job_id = f"{name}{uuid.uuid4().hex[:8]}"
    bus = await Bus.connect(role.nats_url, "request_manager", role="request_manager")
    admin, redis = connect(servers.redis_url), connect(role.redis_url)
    queue = EventQueue(bus, name=f"events-{job_id}")
    writer = OutboxWriter(queue, lambda job: RmOutbox(redis, job), owner="request manager")
    return job_id, bus, admin, redis, queue, writer


async def test_a_strict_removal_failing_past_the_window_does_not_publish_the_event_again(
        servers: Settings) -> None:
    """Strict mode (the request manager's writer): the event stored, its removal refused by Redis
    for several rounds (past the cut window), then Redis back. The event was published once: the
    log holds it once, and the outbox is empty."""
    job_id, bus, admin, redis, queue, writer = await _strict_writer(servers, "settle")
    removals = _Removals(redis)
    window = await duplicate_window(servers.nats_url, WINDOW_S)
    try:
        assert await writer.give(_entry(job_id, f"{job_id}-batch_ready-0"))
        await eventually_async(lambda: _logged(servers.nats_url, job_id, "batch_ready"), timeout=10,
                               what="the event stored")
        # three refused removals, a round (RETRY_WAIT_S, 1 s) apart: past the window from the store
        await eventually_async(lambda: removals.failed >= 3, timeout=15, what="removals refused for 2 s")
        removals.failing = False
        assert await queue.drain(10.0)
        logged = await _logged(servers.nats_url, job_id, "batch_ready")
        assert len(logged) == 1, logged
        assert await admin.exists(Keys.rm_outbox(job_id)) == 0
        assert queue.appended == 1
    finally:
        removals.failing = False
        await queue.close(0.5)
        await duplicate_window(servers.nats_url, window)
        await bus.close()
        await redis.aclose()
        await admin.aclose()


async def test_entries_of_one_message_id_read_from_the_outbox_are_queued_once(servers: Settings) -> None:
    """A previous life's outbox holding two entries of one message id (a command handled twice,
    each saved with its own stamp): the read queues one, whose removal takes both. With the
    removal refused past the cut window after the store, the second was published once that
    passed: stored twice."""
    job_id, bus, admin, redis, queue, writer = await _strict_writer(servers, "group")
    msg_id = f"{job_id}-batch_ready-0"
    first, second = _entry(job_id, msg_id), _entry(job_id, msg_id)
    assert first.model_dump_json() != second.model_dump_json()  # (stamped apart)
    await admin.rpush(Keys.rm_outbox(job_id), first.model_dump_json(), second.model_dump_json())
    removals = _Removals(redis)
    window = await duplicate_window(servers.nats_url, WINDOW_S)
    try:
        found = await writer.recover(job_id)
        await eventually_async(lambda: _logged(servers.nats_url, job_id, "batch_ready"), timeout=10,
                               what="the event stored")
        await eventually_async(lambda: removals.failed >= 3, timeout=15, what="removals refused for 2 s")
        removals.failing = False
        assert await queue.drain(10.0)
        logged = await _logged(servers.nats_url, job_id, "batch_ready")
        assert len(logged) == 1, logged
        assert await admin.exists(Keys.rm_outbox(job_id)) == 0
        assert found == 1
    finally:
        removals.failing = False
        await queue.close(0.5)
        await duplicate_window(servers.nats_url, window)
        await bus.close()
        await redis.aclose()
        await admin.aclose()
