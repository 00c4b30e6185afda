"""One job's events from the request manager's control handler, appended to the job's log in the
background, in the order they were given.

The controller waits for the acknowledgement of each command (``RM_ACK_TIMEOUT_S``, retried): an
event appended before the acknowledgement, while JetStream is slow (its retries take up to 30 s),
timed the controller out; it then sent the command again or, for a borrowed replica, killed the
replica as unheard. The handler now acknowledges once its state change is made (durable where it
has one) and gives the event to this writer, which:

* keeps the time of the command as the event's ``ts`` (readers order the log by ``ts``);
* appends one event at a time, in order, each under one message id, so a retry after a lost
  JetStream ack is stored once (JetStream's duplicate window);
* retries an event until it is stored, however long JetStream stays away (a handful per
  recovery: no bound is needed; the turn handler's ``turn_dropped`` stream is the bounded one,
  ``Dispatcher._emit_later``);
* keeps every event in an outbox in Redis (``Keys.rm_outbox``) from before the acknowledgement
  until JetStream has stored it: a request manager killed in between (or while JetStream is
  away) left the command acknowledged and its event nowhere. The next request manager to run
  the job appends what it finds there first (``recover``), under the same message ids, so an
  event stored just before the kill is not stored twice (within JetStream's duplicate window).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections import deque
from typing import Any

from robustrl import subjects
from robustrl.aio import within
from robustrl.bus import Bus
from robustrl.errors import SubjectError, TransportError
from robustrl.messages import Event
from robustrl.storage.redis_stores import Keys, _call

log = logging.getLogger(__name__)

RETRY_WAIT_S = 1.0
"""Pause after JetStream did not store an event within the bus's own retry budget."""


class EventWriter:
    """Appends one job's events in the background, in order, each once."""

    def __init__(self, bus: Bus, job_id: str, redis: Any) -> None:
        self.bus = bus
        self.job_id = job_id
        self.redis = redis
        self.key = Keys.rm_outbox(job_id)
        self._queue: deque[tuple[str, Event, str]] = deque()  # (message id, event, outbox entry), oldest first
        self._task: asyncio.Task[None] | None = None
        self.stats = {"appended": 0, "retries": 0, "recovered": 0}
        self._recovered = False  # the outbox was read once (``recover``)

    @property
    def pending(self) -> int:
        """Events given and not stored yet."""
        return len(self._queue)

    async def emit(self, kind: str, data: dict[str, Any]) -> Event:
        """Queue one event, stamped now: in the Redis outbox when this returns (acknowledge the
        command after it), in the job's log later.

        Raises:
            ValueError: ``data`` does not fit ``kind`` (a bug: raised here, not in the background).
            TransportError: Redis failed: the event is nowhere, so do not acknowledge.
        """
        if not self._recovered:
            # What a previous request manager left goes first: a command it acknowledged, sent
            # again to this one (its answer lost), is then the duplicate, not the original.
            await self.recover()
        event = Event(job_id=self.job_id, kind=kind, data=data)  # type: ignore[arg-type]
        # One message id per command's event (its fault id): the same command handled twice (a
        # retry reaching a restarted request manager) is stored once, within JetStream's
        # duplicate window (2 min).
        fault_id = data.get("fault_id")
        msg_id = f"{self.job_id}-{kind}-{fault_id if isinstance(fault_id, str) and fault_id else uuid.uuid4().hex}"
        entry = json.dumps({"msg_id": msg_id, "event": event.model_dump(mode="json")})
        await _call(self.redis.rpush(self.key, entry), self.key)
        self._enqueue(msg_id, event, entry)
        return event

    async def recover(self) -> int:
        """Queue what a previous request manager left in the outbox (before anything new);
        return how many. An entry that does not parse is dropped, logged.

        Raises:
            TransportError: Redis failed (the entries stay for the next try).
        """
        found = 0
        for raw in await _call(self.redis.lrange(self.key, 0, -1), self.key):
            entry = raw.decode() if isinstance(raw, bytes) else str(raw)
            try:
                doc = json.loads(entry)
                event = Event.model_validate(doc["event"])
                msg_id = str(doc["msg_id"])
            except (ValueError, KeyError, TypeError) as exc:
                log.error("job %s: outbox entry unreadable, dropped: %s", self.job_id, exc)
                await _call(self.redis.lrem(self.key, 1, raw), self.key)
                continue
            if any(queued == msg_id for queued, _e, _r in self._queue):
                continue
            self._queue.append((msg_id, event, entry))
            found += 1
        self._recovered = True
        self.stats["recovered"] += found
        if found:
            log.warning("job %s: %d events of a previous request manager found in the outbox", self.job_id, found)
            self._kick()
        return found

    def _enqueue(self, msg_id: str, event: Event, entry: str) -> None:
        self._queue.append((msg_id, event, entry))
        self._kick()

    def _kick(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._write(), name=f"events-{self.job_id}")

    async def _write(self) -> None:
        while self._queue:
            msg_id, event, entry = self._queue[0]
            try:
                await self.bus.publish_durable(subjects.events(self.job_id, event.kind, self.bus.role),
                                               event.encode(), msg_id=msg_id)
                await _call(self.redis.lrem(self.key, 1, entry), self.key)
            except TransportError as exc:
                self.stats["retries"] += 1
                log.warning("job %s: %s event not stored yet (%d queued), retrying: %s", self.job_id,
                            event.kind, len(self._queue), exc)
                await asyncio.sleep(RETRY_WAIT_S)  # JetStream (or Redis) away past its retries: pace them
                continue
            except SubjectError as exc:  # a kind this role may not write: a bug, not worth a retry
                log.error("job %s: %s event refused, dropped: %s", self.job_id, event.kind, exc)
                await _call(self.redis.lrem(self.key, 1, entry), self.key)
            self._queue.popleft()
            self.stats["appended"] += 1

    async def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every queued event to be stored; True if they were. The
        writer goes on either way (a service that stops gives it this long, then exits)."""
        if self._task is None or self._task.done():
            return not self._queue
        try:
            await within(asyncio.shield(self._task), timeout_s)
        except TimeoutError:
            log.error("job %s: %d events not stored %g s after the stop", self.job_id, len(self._queue),
                      timeout_s)
            return False
        return not self._queue
