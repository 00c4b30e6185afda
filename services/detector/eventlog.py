"""The detector's events, appended to the jobs' logs in the background, kept in Redis until stored.

The fault report itself goes to the controller on core NATS at once; its ``fault_detected``
event is for the log (the harness, the auditor). Appended inline, one event JetStream did not
acknowledge held the detector for the bus's whole retry budget (``EVENT_PUBLISH_RETRY_S``,
30 s): the next faults of the same tick, every other job's tick and the exit subscription all
waited, and the tick gap then rebased every member history (its probes and stall evidence
thrown away). So the events go through one :class:`robustrl.event_queue.EventQueue` for every
job.

That queue is in memory: a detector killed while JetStream is away lost what it held. Each event
is now first saved in its job's detector outbox in Redis (``DetectorOutbox``,
``Keys.detector_outbox``), then queued, and removed from the outbox once JetStream stored it
(:class:`robustrl.event_outbox.OutboxWriter`, shared with the request manager). A starting
detector appends what any job's detector outbox still holds (``recover_left_outboxes``: the
detector watches every job), under the message ids saved with it, so an event stored just before
the kill is stored once within JetStream's duplicate window; a deletion that keeps a job's log
appends its outbox first.

The detector's tick must never wait on Redis: every outbox call is cut at ``REDIS_CALL_S``; a save
that fails (refused, or no answer in time) is logged and the event queued in memory only, still
appended, only not durable; Redis is then left alone for ``REDIS_AWAY_S``. Without a Redis client
at all (no Redis URL) the queue is in memory only, as before.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from robustrl.aio import cancel_and_wait
from robustrl.bus import Bus, event_msg_id
from robustrl.errors import TransportError
from robustrl.event_outbox import OutboxEvents, OutboxWriter, RedisBound, outbox_keys
from robustrl.event_queue import MAX_PENDING_EVENTS, STOP_GRACE_S, EventQueue
from robustrl.messages import Event
from robustrl.storage.control_stores import DetectorOutbox, OutboxEntry
from robustrl.storage.redis_stores import Keys

log = logging.getLogger(__name__)

REDIS_CALL_S = 0.25
"""How long one outbox call may take (Redis answers in milliseconds; the client's own retries
through an outage take up to 30 s, which a tick must not wait for)."""
REDIS_AWAY_S = 5.0
"""After a failed outbox call, events are queued in memory only for this long (one tick pays
``REDIS_CALL_S``, not every fault of it)."""
RECOVER_RETRY_S = 5.0
"""Pause between rounds of the outbox upkeep: the start's scan until it went through, the outboxes
it could not read, and the removals that failed."""
REMOVALS_BUDGET_S = 1.0
"""At most this long per round on removals that failed before (off the tick: a task of its own)."""


class EventWriter(OutboxEvents):
    """One detector's events, for every job it watches: each in its job's outbox, then queued."""

    def __init__(self, bus: Bus, redis: Any = None, *, max_pending: int = MAX_PENDING_EVENTS) -> None:
        self.queue = EventQueue(bus, name="detector-events", max_pending=max_pending)
        self.redis = redis
        self._writer = OutboxWriter(self.queue, lambda job_id: DetectorOutbox(redis, job_id), owner="detector",
                                    bound=RedisBound(call_s=REDIS_CALL_S, away_s=REDIS_AWAY_S))
        self._recovery: asyncio.Task[None] | None = None
        self._unread: set[str] = set()  # jobs whose outbox the scan found and could not read

    @property
    def dropped(self) -> int:
        """Events dropped: the queue was full (or closed)."""
        return self.queue.dropped

    async def emit(self, job_id: str, kind: str, data: dict[str, Any]) -> Event | None:
        """Queue one event of ``job_id``, stamped now, in its outbox first (at most
        ``REDIS_CALL_S``; on a Redis failure in memory only, logged).

        Returns:
            The event, or None when it was dropped (the queue is full, or closed).
        Raises:
            ValueError: ``data`` does not fit ``kind`` (a bug: raised here, not in the background).
        """
        event = Event(job_id=job_id, kind=kind, data=data)  # type: ignore[arg-type]
        entry = OutboxEntry(msg_id=event_msg_id(job_id, kind), event=event)
        dropped = self.queue.dropped
        if self.redis is None:
            self.queue.put(entry.msg_id, event)
        else:
            await self._writer.give(entry)
        return None if self.queue.dropped > dropped else event

    def start_recovery(self) -> None:
        """Start the outbox upkeep in the background, every ``RECOVER_RETRY_S`` for the
        detector's life: append what every job's detector outbox holds (``recover_left_outboxes``,
        until one scan went through), then any outbox that scan could not read, and retry the
        removals that failed (within ``REMOVALS_BUDGET_S``: an entry left would be appended again
        by the next start). Harmless if called twice."""
        if self.redis is None or self._recovery is not None:
            return
        self._recovery = asyncio.get_running_loop().create_task(self._upkeep(), name="detector-outbox-upkeep")

    async def _upkeep(self) -> None:
        scanned = False
        while True:
            if not scanned:
                try:
                    await self.recover_left_outboxes()
                    scanned = True
                except TransportError as exc:
                    log.error("detector outboxes not scanned (%s): tried again in %g s", exc, RECOVER_RETRY_S)
            for job_id in sorted(self._unread):
                try:
                    await self._writer.recover(job_id)
                    self._unread.discard(job_id)
                except TransportError as exc:
                    log.warning("job %s: the detector outbox still not read (%s)", job_id, exc)
            await self._writer.retry_removals(REMOVALS_BUDGET_S)
            await asyncio.sleep(RECOVER_RETRY_S)  # pace the rounds (and the tries while Redis is away)

    async def recover_left_outboxes(self) -> int:
        """Queue what every job's detector outbox holds (a killed detector's events), under the
        message ids saved with them; return how many. A key that names no job, or an outbox that
        cannot be read, is logged and left, and the scan goes on.

        Raises:
            TransportError: a SCAN failed (the outboxes not reached stay for the next try).
        """
        found = 0
        async for key in outbox_keys(self.redis, Keys.detector_outbox_pattern(), call_s=REDIS_CALL_S):
            job_id = Keys.job_of_detector_outbox(key)
            if job_id is None:
                log.error("key %r matches the detector outbox pattern but names no job: left as it is", key[:200])
                continue
            if self._writer.outbox_read(job_id):
                continue
            try:
                found += await self._writer.recover(job_id)
            except TransportError as exc:
                self._unread.add(job_id)
                log.error("job %s: the detector outbox not read (%s): tried again in %g s", job_id, exc,
                          RECOVER_RETRY_S)
        return found

    async def close(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop the outbox scan, take no new events, give the queued ones ``grace_s`` to be stored
        (what is left stays in the outboxes for the next detector); harmless if called twice."""
        await cancel_and_wait(self._recovery, STOP_GRACE_S)
        await self.queue.close(grace_s)
