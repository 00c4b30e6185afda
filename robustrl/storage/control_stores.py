"""The control plane's records in Redis: the job registry (a controller's jobs, fenced by its
lease) and the event outboxes (events kept until JetStream stored them): the request manager's
(events of acknowledged commands), the detector's (its ``fault_detected`` events), the rollout
replicas' (their weight load events), the trainer's (rank 0's commits) and the controller's (every
event it appends, ``services/controller/outbox.py``). The writers of the first three are
:class:`robustrl.event_outbox.OutboxWriter`. Keys come from :class:`robustrl.storage.redis_stores.Keys`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from robustrl.messages import Event
from robustrl.storage.redis_stores import Guard, Keys, _call, transact

log = logging.getLogger(__name__)


class OutboxEntry(BaseModel):
    """One event in an outbox, with the message id it is appended under (the same id whoever
    appends it, so JetStream stores it once within its duplicate window)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    msg_id: str = Field(min_length=1)
    event: Event


@dataclass(frozen=True)
class Guarded:
    """Writes saved with an event only while ``guard`` holds (``redis_stores.transact``)."""

    guard: Guard
    writes: Callable[[Any], None]


Writes = Callable[[Any], None] | Guarded
"""What ``EventOutbox.add`` saves in its event's transaction."""


class EventOutbox:
    """One job's events owed to its log (a Redis list under ``key``), oldest first, each kept until
    JetStream has stored it."""

    def __init__(self, client: aioredis.Redis, job_id: str, key: str) -> None:
        self.r = client
        self.job_id = job_id
        self.key = key

    async def add(self, entry: OutboxEntry, with_writes: Writes | None = None) -> str:
        """Append ``entry``; return its stored text (what ``remove`` takes). A plain RPUSH: one
        Redis carried out whose reply was lost (a restart after its AOF write, a stall past the
        socket timeout) is sent again by the client's retry layer, so the outbox may hold two
        byte-identical copies of the entry (one event, one message id): ``remove`` takes both.
        ``with_writes``: adds the writes the event tells of to the same transaction (MULTI/EXEC),
        so that both land or neither does (idempotent writes: a retry does them again); a
        ``Guarded`` one, only while its guard holds.

        Raises:
            Superseded: the guard had moved on: nothing was saved (``transact``).
            TransportError: Redis failed.
        """
        text = entry.model_dump_json()
        if with_writes is None:
            await _call(self.r.rpush(self.key, text), self.key)
            return text
        guarded = with_writes if isinstance(with_writes, Guarded) else None
        writes = guarded.writes if guarded is not None else with_writes

        def all_writes(pipe: Any) -> None:
            writes(pipe)  # type: ignore[operator]
            pipe.rpush(self.key, text)

        await transact(self.r, all_writes, self.key, guarded.guard if guarded is not None else None)
        return text

    async def entries(self) -> list[tuple[bytes, OutboxEntry]]:
        """Every entry, oldest first, with its stored text. One that does not parse (or names
        another job) can never be appended: it is removed, logged as an error.

        Raises:
            TransportError: Redis failed, or the key holds no list.
        """
        out = []
        for item in await _call(self.r.lrange(self.key, 0, -1), self.key):
            raw = item if isinstance(item, bytes) else str(item).encode()  # (a client decoding replies)
            try:
                entry = OutboxEntry.model_validate_json(raw)
                problem = "" if entry.event.job_id == self.job_id else f"an event of job {entry.event.job_id}"
            except ValidationError as exc:
                problem = exc.errors()[0]["msg"]
            if problem:
                log.error("job %s: outbox entry unreadable, dropped: %s", self.job_id, problem)
                await self.remove(raw)
                continue
            out.append((raw, entry))
        return out

    async def remove(self, text: bytes | str) -> None:
        """Remove every entry stored as ``text`` (nothing if it is gone already). Every copy: two
        identical entries are one event saved twice (``add``'s retried RPUSH); one copy left
        behind was appended again by a later read of the outbox, past JetStream's duplicate
        window a second time (an outside review found it). (``LREM`` with count 0: the same
        permission as one.)"""
        await _call(self.r.lrem(self.key, 0, text), self.key)

    async def size(self) -> int:
        """How many entries the outbox holds (unread: one that does not parse counts too)."""
        return int(await _call(self.r.llen(self.key), self.key))


class RmOutbox(EventOutbox):
    """One job's request-manager outbox (``Keys.rm_outbox``): events whose commands were
    acknowledged. Written by the request manager; read by the next one, and by a deletion that
    keeps the job's log."""

    def __init__(self, client: aioredis.Redis, job_id: str) -> None:
        super().__init__(client, job_id, Keys.rm_outbox(job_id))


class ControllerOutbox(EventOutbox):
    """One job's controller outbox (``Keys.controller_outbox``): every event a controller
    appends to the job's log, saved before its append. Written by any controller (a deposed one
    too: its events carry its own fencing token); appended and emptied by the leader's flusher,
    and by a deletion that keeps the job's log."""

    def __init__(self, client: aioredis.Redis, job_id: str) -> None:
        super().__init__(client, job_id, Keys.controller_outbox(job_id))


class DetectorOutbox(EventOutbox):
    """One job's detector outbox (``Keys.detector_outbox``): the detector's events (its
    ``fault_detected``), each saved before it is queued and removed once JetStream stored it.
    Written by the detector; appended by the next detector to start (any job's), and by a
    deletion that keeps the job's log."""

    def __init__(self, client: aioredis.Redis, job_id: str) -> None:
        super().__init__(client, job_id, Keys.detector_outbox(job_id))


class TrainerOutbox(EventOutbox):
    """One job's trainer outbox (``Keys.trainer_outbox``): each ``step_committed`` of rank 0,
    saved by the fenced script that records the step trained (``GangFence.record_trained``) and
    removed once JetStream stored it. Appended by the next gang's rank 0 when it enters the fence;
    read by a deletion that keeps the job's log (which may not write the trainer's events: logged)
    and by the auditor."""

    def __init__(self, client: aioredis.Redis, job_id: str) -> None:
        super().__init__(client, job_id, Keys.trainer_outbox(job_id))


class RolloutOutbox(EventOutbox):
    """One job's rollout outbox (``Keys.rollout_outbox``): the replicas' events
    (``weights_loaded``, ``weights_rejected``, ``fault_struck``), each saved before it is queued and removed once
    JetStream stored it. Written by every replica of the job; what a dead replica left is appended
    by the next replica to start, by a live one once the entry is ``ORPHAN_AFTER_S`` old, or by
    one that stops (the kinds are the rollout role's, whichever replica writes them); read
    by a deletion that keeps the job's log (which may not write the rollout's events: logged) and
    by the auditor."""

    def __init__(self, client: aioredis.Redis, job_id: str) -> None:
        super().__init__(client, job_id, Keys.rollout_outbox(job_id))


HANDLED_TTL_S = 7 * 24 * 3600
"""How long handled fault ids are kept (``Keys.faults_handled``: as long as the event log keeps events)."""


class JobRegistry:
    """Job records, so a restarted controller finds its jobs again.

    A write with a ``fence`` (the writing controller's lease token) is refused once a newer
    lease term has begun (the fencing counter is above it): a controller frozen past its lease
    must not overwrite, with its stale view, the record the new leader acts on (e.g. the rollout
    slots still owed a replacement after a borrow)."""

    # KEYS[3] (optional): a set to add ARGV[4] to in the same write, with expiry ARGV[5] s (a
    # fault marked handled with the record that holds its decision: both or neither).
    _FENCED_PUT = """
local newest = tonumber(redis.call('GET', KEYS[2]) or '0')
if newest > tonumber(ARGV[3]) then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
if KEYS[3] then
  redis.call('SADD', KEYS[3], ARGV[4])
  redis.call('EXPIRE', KEYS[3], ARGV[5])
end
return 1
"""

    _FENCED_DELETE = """
local newest = tonumber(redis.call('GET', KEYS[2]) or '0')
if newest > tonumber(ARGV[2]) then
  return -1
end
return redis.call('HDEL', KEYS[1], ARGV[1])
"""

    def __init__(self, client: aioredis.Redis) -> None:
        self.r = client

    async def delete(self, job_id: str, fence: int | None = None) -> bool:
        """Remove ``job_id``'s record; False (nothing removed) if ``fence`` is older than the newest
        controller lease term. True also when there was no record (a repeat)."""
        if fence is None:
            await _call(self.r.hdel(Keys.jobs(), job_id), Keys.jobs())
            return True
        res = await _call(self.r.eval(self._FENCED_DELETE, 2, Keys.jobs(), Keys.controller_fence(), job_id,
                                      int(fence)), Keys.jobs())
        return int(res) >= 0

    async def put(self, job_id: str, record: dict[str, Any], fence: int | None = None,
                  handled: str | None = None) -> bool:
        """Write ``job_id``'s record; False (nothing written) if ``fence`` is older than the newest
        controller lease term. Without a fence the write is unconditional. ``handled``: a fault id
        marked handled (``Keys.faults_handled``, kept ``HANDLED_TTL_S``) in the same write: a
        fault is handled only with the record of what was decided for it."""
        if fence is None:
            pipe = self.r.pipeline(transaction=True)
            pipe.hset(Keys.jobs(), job_id, json.dumps(record))
            if handled is not None:
                pipe.sadd(Keys.faults_handled(job_id), handled)
                pipe.expire(Keys.faults_handled(job_id), HANDLED_TTL_S)
            await _call(pipe.execute(), Keys.jobs())
            return True
        keys = [Keys.jobs(), Keys.controller_fence()]
        args: list[Any] = [job_id, json.dumps(record), int(fence)]
        if handled is not None:
            keys.append(Keys.faults_handled(job_id))
            args += [handled, HANDLED_TTL_S]
        ok = await _call(self.r.eval(self._FENCED_PUT, len(keys), *keys, *args), Keys.jobs())
        return bool(int(ok))

    async def get(self, job_id: str) -> dict[str, Any] | None:
        """``job_id``'s record; None if there is none (or it is damaged)."""
        raw = await _call(self.r.hget(Keys.jobs(), job_id), Keys.jobs())
        return None if raw is None else _job_record(job_id, raw)

    async def all(self) -> dict[str, dict[str, Any]]:
        """Every job's record; a damaged one (not JSON, not an object, ``deleting`` not an object)
        is logged and skipped, never overwritten here: it must not stop a takeover or a restart
        from taking up the others."""
        raw = await _call(self.r.hgetall(Keys.jobs()), Keys.jobs())
        out = {}
        for k, v in raw.items():
            job_id = k.decode(errors="replace")
            if (rec := _job_record(job_id, v)) is not None:
                out[job_id] = rec
        return out


def _job_record(job_id: str, raw: bytes | str) -> dict[str, Any] | None:
    """A registry value as a record; None (logged) if it is damaged."""
    try:
        rec = json.loads(raw)
    except ValueError as exc:
        log.error("job %s: registry record does not parse (%s): skipped", job_id, exc)
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("deleting") or {}, dict):
        log.error("job %s: registry record is not a job record (%.200r): skipped", job_id, rec)
        return None
    return rec


FENCE_READ_S = 1.0
"""Bound of one read of the controller's fencing counter by a service checking a command."""


async def newest_controller_fence(client: aioredis.Redis) -> int:
    """The fencing token of the newest controller lease term: the raw counter each acquisition of
    the lease increments (0 before any). A service checks a controller command's token against
    it, not only against the largest token it has seen itself: a service restarted since the
    current leader last sent it a command has seen none, and would act on a deposed leader's.

    Raises:
        TransportError: Redis failed.
        StorageError: the counter is not an integer.
    """
    from robustrl.errors import StorageError

    key = Keys.controller_fence()
    raw = await _call(client.get(key), key)
    try:
        return int(raw or 0)
    except ValueError as exc:
        raise StorageError(f"corrupt controller fencing counter at {key}: {raw!r}", key=key) from exc


async def fence_floor(client: aioredis.Redis | None, seen: int, service: str) -> int:
    """The smallest fencing token a controller command may carry: the newest lease term's
    (:func:`newest_controller_fence`, within :data:`FENCE_READ_S`) or ``seen`` (the largest the
    service saw), whichever is larger. Redis not answering leaves ``seen`` (as before this read
    existed): the command is judged on what the service saw, and the failure logged."""
    if client is None:
        return seen
    from robustrl.aio import within
    from robustrl.errors import StorageError, TransportError

    try:
        return max(seen, await within(newest_controller_fence(client), FENCE_READ_S,
                                      "redis: the read of the controller's fencing counter"))
    except (TransportError, StorageError, TimeoutError) as exc:
        log.warning("%s: the controller's fencing counter not read (%s): commands judged on the newest "
                    "token seen (%d)", service, exc, seen)
        return seen
