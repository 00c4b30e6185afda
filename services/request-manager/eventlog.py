"""One job's events from the request manager's control handler, appended to the job's log in the
background, in the order they were given.

The controller waits for the acknowledgement of each command (``RM_ACK_TIMEOUT_S``, retried): an
event appended before the acknowledgement, while JetStream is slow (its retries take up to 30 s),
timed the controller out; it then sent the command again or, for a borrowed replica, killed the
replica as unheard. The handler now acknowledges once its state change is made (durable where it
has one) and gives the event to this writer, which appends it through a
:class:`robustrl.event_queue.EventQueue` (in order, each once, retried; a handful per recovery,
far from its bound) and keeps every event in an outbox in Redis (``RmOutbox``) from before the
acknowledgement until JetStream has stored it: a request manager killed in between (or while
JetStream is away) left the command acknowledged and its event nowhere. What a killed request
manager left is appended (``recover``) under the same message ids, so an event stored just before
the kill is not stored twice (within JetStream's duplicate window): by the next request manager to
run the job, first; and, for a job that ended before any request manager ran it again, by the
next request manager to start, which reads every job's outbox (``RequestManager.append_left_outboxes``).
The outbox logic is :class:`robustrl.event_outbox.OutboxWriter`'s (shared with the detector), in
its strict mode: Redis failing fails the command.
"""

from __future__ import annotations

import uuid
from typing import Any

from robustrl.bus import Bus
from robustrl.event_outbox import OutboxEvents, OutboxWriter
from robustrl.event_queue import EventQueue
from robustrl.messages import Event
from robustrl.storage.control_stores import OutboxEntry, RmOutbox, Writes

STOP_DRAIN_S = 10.0
"""How long a ``stop`` command waits for the job's queued events to reach its log before it is
acknowledged: the controller appends the job's final event after the acknowledgement, so the log
ends with what the request manager said (a NATS restart near a job's end left its last
``batch_ready`` / ``step_started`` queued and the job ended without them). Past it (JetStream
away) the stop is acknowledged all the same and the events land after the final one."""


class EventWriter(OutboxEvents):
    """Appends one job's events in the background, in order, each once, through its outbox."""

    def __init__(self, bus: Bus, job_id: str, redis: Any) -> None:
        self.job_id = job_id
        self.outbox = RmOutbox(redis, job_id)
        self.queue = EventQueue(bus, name=f"events-{job_id}")
        self._writer = OutboxWriter(self.queue, lambda _job: self.outbox, owner="request manager")

    @property
    def outbox_read(self) -> bool:
        """Whether ``recover`` has read the outbox once (what a previous life left is queued)."""
        return self._writer.outbox_read(self.job_id)

    async def emit(self, kind: str, data: dict[str, Any], msg_id: str | None = None,
                   with_writes: Writes | None = None, per: str | None = None) -> Event:
        """Queue one event, stamped now: in the Redis outbox when this returns (acknowledge the
        command after it), in the job's log later. ``msg_id``: JetStream's duplicate key (default:
        the command's fault id, else a fresh one): an event given again under it, within the
        stream's duplicate window, is stored once. ``per``: what, besides the fault, tells this
        command's event apart (one fault declares several replicas dead, then escalates to a
        restart: under the fault's id alone JetStream dropped all but the first as duplicates).
        ``with_writes``: Redis writes the event tells of, made in the same transaction as its
        save (``OutboxWriter.give``).

        Raises:
            ValueError: ``data`` does not fit ``kind`` (a bug: raised here, not in the background).
            TransportError: Redis failed: the event is nowhere, so do not acknowledge.
        """
        if not self.outbox_read:
            # What a previous request manager left goes first: a command it acknowledged, sent
            # again to this one (its answer lost), is then the duplicate, not the original.
            await self.recover()
        event = Event(job_id=self.job_id, kind=kind, data=data)  # type: ignore[arg-type]
        # One message id per command's event (its fault id): the same command handled twice (a
        # retry reaching a restarted request manager) is stored once, within JetStream's
        # duplicate window (2 min).
        fault_id = data.get("fault_id")
        if msg_id is None:
            msg_id = (f"{self.job_id}-{kind}-{fault_id}" + (f"-{per}" if per else "")
                      if isinstance(fault_id, str) and fault_id else f"{self.job_id}-{kind}-{uuid.uuid4().hex}")
        await self._writer.give(OutboxEntry(msg_id=msg_id, event=event), with_writes)
        return event

    async def recover(self) -> int:
        """Queue what a previous request manager left in the outbox (before anything new);
        return how many. An entry that does not parse is dropped, logged. Harmless to call again
        (what this writer queued once is not queued again).

        Raises:
            TransportError: Redis failed (the entries stay for the next try).
        """
        return await self._writer.recover(self.job_id)
