"""An outbox entry whose event the log already holds is not appended again, whoever reads it.

Every role that appends what another life (or a dead peer) left in an outbox (a starting request
manager or detector, a replica's upkeep and stop) queued every entry under its saved message id:
JetStream drops an append under an id it stored within its duplicate window (2 min), and past it
stores a second entry. An entry still in the outbox whose event was stored (its writer killed
between the store and the removal, or a live replica still owing the removal after a Redis
outage: the case the README listed as left, "a stopping replica may append again an entry another
live replica stored") was then stored twice. Now ``OutboxWriter.recover`` looks entries stamped a
minute ago or more up in the log first (JetStream's direct get, which each of those roles' NATS
users may make) and only removes those it finds.

Real NATS and Redis of the session's own (``servers``), each role under its own NATS and Redis
credentials; the stream's duplicate window cut to 1 s (restored after); judged from the raw log
and raw Redis.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest
from robustrl.services.rollout.events import ReplicaEvents
from support import duplicate_window, eventually_async
from test_outbox_double_save import PAST_WINDOW_S, WINDOW_S, _ensure_stream, _logged

from robustrl.bus import Bus
from robustrl.config import Settings
from robustrl.event_outbox import OutboxWriter
from robustrl.event_queue import EventQueue
from robustrl.infra.credentials import Credentials, role_settings
from robustrl.messages import Event
from robustrl.storage.control_stores import DetectorOutbox, OutboxEntry, RmOutbox, RolloutOutbox
from robustrl.storage.redis_stores import connect
from robustrl.subjects import Principal

pytestmark = pytest.mark.timeout(90)

ROLES = {
    "request_manager": (Principal.REQUEST_MANAGER, RmOutbox, "batch_ready", {"step": 3, "reward_mean": 0.5}),
    "detector": (Principal.DETECTOR, DetectorOutbox, "fault_detected",
                 {"fault_id": "f1", "kind": "hang", "role": "rollout", "member_id": "r-1"}),
    "rollout": (Principal.ROLLOUT, RolloutOutbox, "weights_loaded",
                {"member_id": "r-0", "version": 2, "checksum": "c", "verified": True}),
}


async def _stored_and_left(servers: Settings, principal: Principal, outbox_type: Any, kind: str,
                           data: dict[str, Any], age_s: float) -> tuple[str, Bus, Any, OutboxEntry]:
    """An event of ``kind`` stamped ``age_s`` ago, stored in the log under its message id by the
    role's own bus (its first writer), and still in the job's outbox (its removal never ran)."""
    role = role_settings(servers, Credentials.load(servers.credentials_file), principal)
    job_id = f"inlog{uuid.uuid4().hex[:8]}"
    event = Event(job_id=job_id, kind=kind, data=data, ts=time.time() - age_s)  # type: ignore[arg-type]
    entry = OutboxEntry(msg_id=f"{job_id}-{kind}-{uuid.uuid4().hex[:6]}", event=event)
    first = await Bus.connect(role.nats_url, f"{principal.value}-first", role=principal.value)
    try:
        await first.emit_event(job_id, kind, data, event.ts, msg_id=entry.msg_id)
    finally:
        await first.close()
    redis = connect(role.redis_url)
    await outbox_type(redis, job_id).add(entry)
    bus = await Bus.connect(role.nats_url, f"{principal.value}-next", role=principal.value)
    return job_id, bus, redis, entry


@pytest.mark.parametrize("age_s", [90.0, -3600.0], ids=["stamped_90s_ago", "stamped_an_hour_ahead"])
@pytest.mark.parametrize("role", sorted(ROLES))
async def test_an_entry_the_log_holds_is_removed_not_appended_again(servers: Settings, role: str,
                                                                     age_s: float) -> None:
    """The next writer of the role reads the outbox past the window (its start, upkeep or stop:
    ``recover``): the event is in the raw log once and the outbox is empty. Also for an entry
    stamped an hour ahead of the reader's wall clock (a clock stepped back since, or its writer's
    ahead): of unknown age, it was taken as new and stored a second time."""
    principal, outbox_type, kind, data = ROLES[role]
    await _ensure_stream(servers.nats_url)
    admin = connect(servers.redis_url)
    window = await duplicate_window(servers.nats_url, WINDOW_S)
    job_id, bus, redis, _entry = await _stored_and_left(servers, principal, outbox_type, kind, data, age_s)
    queue = EventQueue(bus, name=f"events-{job_id}")
    writer = OutboxWriter(queue, lambda job: outbox_type(redis, job), owner=role)
    try:
        await eventually_async(lambda: _logged(servers.nats_url, job_id, kind), timeout=10,
                               what="the first store")
        await asyncio.sleep(PAST_WINDOW_S)  # past the (cut) window from the store
        queued = await writer.recover(job_id)
        assert await queue.drain(10.0)
        assert len(await _logged(servers.nats_url, job_id, kind)) == 1
        assert queued == 0
        assert await admin.exists(outbox_type(admin, job_id).key) == 0
    finally:
        await queue.close(0.5)
        await duplicate_window(servers.nats_url, window)
        await bus.close()
        await redis.aclose()
        await admin.aclose()


async def test_a_stopping_replica_does_not_append_again_what_a_live_peer_stored(servers: Settings) -> None:
    """A live replica stored its ``weights_loaded`` and still owes the removal (Redis away then);
    another replica of the job stops past the window and takes up every entry of the outbox at its
    stop (``ReplicaEvents.close``). Before, it appended the event a second time."""
    principal, outbox_type, kind, data = ROLES["rollout"]
    await _ensure_stream(servers.nats_url)
    admin = connect(servers.redis_url)
    window = await duplicate_window(servers.nats_url, WINDOW_S)
    job_id, bus, redis, _entry = await _stored_and_left(servers, principal, outbox_type, kind, data, 90.0)
    stopping = ReplicaEvents(bus, job_id, redis)
    try:
        await eventually_async(lambda: _logged(servers.nats_url, job_id, kind), timeout=10,
                               what="the first store")
        await asyncio.sleep(PAST_WINDOW_S)
        await stopping.close(5.0)
        assert len(await _logged(servers.nats_url, job_id, kind)) == 1
        assert await admin.exists(outbox_type(admin, job_id).key) == 0
    finally:
        await stopping.close(0.5)
        await duplicate_window(servers.nats_url, window)
        await bus.close()
        await redis.aclose()
        await admin.aclose()


async def test_an_entry_not_in_the_log_is_appended(servers: Settings) -> None:
    """The look-up drops only what the log holds: an old entry whose event was never stored (its
    writer killed before the append) is appended, once."""
    principal, outbox_type, kind, data = ROLES["request_manager"]
    await _ensure_stream(servers.nats_url)
    role = role_settings(servers, Credentials.load(servers.credentials_file), principal)
    job_id = f"notlog{uuid.uuid4().hex[:8]}"
    event = Event(job_id=job_id, kind=kind, data=data, ts=time.time() - 90.0)  # type: ignore[arg-type]
    redis, admin = connect(role.redis_url), connect(servers.redis_url)
    await outbox_type(redis, job_id).add(OutboxEntry(msg_id=f"{job_id}-{kind}-x", event=event))
    bus = await Bus.connect(role.nats_url, "request_manager-next", role=principal.value)
    queue = EventQueue(bus, name=f"events-{job_id}")
    writer = OutboxWriter(queue, lambda job: outbox_type(redis, job), owner="request manager")
    try:
        assert await writer.recover(job_id) == 1
        assert await queue.drain(10.0)
        assert len(await _logged(servers.nats_url, job_id, kind)) == 1
        assert await admin.exists(outbox_type(admin, job_id).key) == 0
    finally:
        await queue.close(0.5)
        await bus.close()
        await redis.aclose()
        await admin.aclose()
