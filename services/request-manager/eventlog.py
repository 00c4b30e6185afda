"""One job's events from the request manager's control handler, appended to the job's log in the
background, in the order they were given.

The controller waits for the acknowledgement of each command (``RM_ACK_TIMEOUT_S``, retried): an
event appended before the acknowledgement, while JetStream is slow (its retries take up to 30 s),
timed the controller out; it then sent the command again or, for a borrowed replica, killed the
replica as unheard. The handler now acknowledges once its state change is made (durable where it
has one) and gives the event to this writer, which appends it through a
:class:`robustrl.event_queue.EventQueue` (in order, each once, retried; a handful per recovery,
far from its bound) and keeps every event in an outbox in Redis (``Keys.rm_outbox``) from before
the acknowledgement until JetStream has stored it: a request manager killed in between (or while
JetStream is away) left the command acknowledged and its event nowhere. The next request manager
to run the job appends what it finds there first (``recover``), under the same message ids, so an
event stored just before the kill is not stored twice (within JetStream's duplicate window).
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from robustrl.bus import Bus
from robustrl.event_queue import EventQueue
from robustrl.messages import Event
from robustrl.storage.redis_stores import Keys, _call

log = logging.getLogger(__name__)


class EventWriter:
    """Appends one job's events in the background, in order, each once, through its outbox."""

    def __init__(self, bus: Bus, job_id: str, redis: Any) -> None:
        self.job_id = job_id
        self.redis = redis
        self.key = Keys.rm_outbox(job_id)
        self.queue = EventQueue(bus, name=f"events-{job_id}")
        self.recovered = 0
        self._recovered = False  # the outbox was read once (``recover``)

    @property
    def pending(self) -> int:
        """Events given and not stored yet."""
        return self.queue.pending

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
        self._put(msg_id, event, entry)
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
            if self.queue.queued(msg_id):
                continue
            self._put(msg_id, event, entry)
            found += 1
        self._recovered = True
        self.recovered += found
        if found:
            log.warning("job %s: %d events of a previous request manager found in the outbox", self.job_id, found)
        return found

    def _put(self, msg_id: str, event: Event, entry: str) -> None:
        async def out_of_the_outbox() -> None:  # once stored (or refused for good)
            await _call(self.redis.lrem(self.key, 1, entry), self.key)

        self.queue.put(msg_id, event, out_of_the_outbox)

    async def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every queued event to be stored; True if they were. The
        writer goes on either way (a service that stops gives it this long, then exits)."""
        return await self.queue.drain(timeout_s)
