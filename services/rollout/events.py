"""A rollout replica's events (``weights_loaded``, ``weights_rejected``, ``fault_struck``), kept in the job's Redis
outbox until JetStream stored them.

Appended inline (``Bus.emit_event``), an event JetStream did not store within the bus's retry
budget was kept in the bus's owed queue, in memory: a replica killed, or cut off and replaced,
while JetStream was away lost it for good (the auditor then judged its turns by their checksums
alone). Each event is now saved in the job's rollout outbox (``RolloutOutbox``,
``Keys.rollout_outbox``), queued, and removed from the outbox once JetStream stored it
(:class:`robustrl.event_outbox.OutboxWriter`, shared with the request manager and the detector).

Who appends what a dead replica left: every replica, at its start, reads the job's rollout outbox
in the background (retried until one read went through) and queues every entry under the message
id saved with it; then, every ``UPKEEP_S`` for its life, it queues the entries at least
``ORPHAN_AFTER_S`` old (a dead replica's, with no replica started after it: only a new replica
appended them before, and a job that never started one, or ended, kept them for good; seen for
that long by the replica's own clock: the stamps are other hosts'); and at
its stop it queues every entry it finds before its last drain (the job's last replicas stop
together at its end). The kinds are the rollout role's own, so any replica of the job may append
them (its NATS permissions name the role, not the member). An entry a live replica is still
retrying is then appended twice under one message id: JetStream stores it once (within its
2-min duplicate window), and a removal of an entry already gone is a no-op. One stored whose
removal failed is skipped by the replica that owes the removal, and left by the others for
``ORPHAN_AFTER_S``, longer than the owner takes to retry it; a replica's stop takes every entry,
and one stopping just as Redis comes back appended such an entry again (stored twice if its first
store was more than 2 min before): every read now looks entries stamped a minute ago or more up in
the log first and only removes those it finds there (``OutboxWriter._in_log``).

A replica's serving path must never wait on Redis: the outbox is used in its bounded mode, every
call cut at ``REDIS_CALL_S``; a save that fails is logged and the event queued in memory only
(still appended, only not durable), and Redis is left alone for ``REDIS_AWAY_S``; a removal that
failed is tried again by the upkeep task, off the serving path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from robustrl import subjects
from robustrl.aio import cancel_and_wait
from robustrl.bus import Bus, event_msg_id
from robustrl.errors import TransportError
from robustrl.event_outbox import LOG_READ_S, OutboxEvents, OutboxWriter, RedisBound
from robustrl.event_queue import MAX_PENDING_EVENTS, STOP_GRACE_S, EventQueue
from robustrl.messages import Event
from robustrl.storage.control_stores import OutboxEntry, RolloutOutbox

log = logging.getLogger(__name__)

REDIS_CALL_S = 0.25
"""How long one outbox call may take (Redis answers in milliseconds; the client's own retries
through an outage take up to 30 s, which a weight swap's report must not wait for)."""
REDIS_AWAY_S = 5.0
"""After a failed outbox call, events are queued in memory only for this long."""
UPKEEP_S = 5.0
"""Pause between rounds of the outbox upkeep: the start's read until it went through, and the
removals that failed."""
REMOVALS_BUDGET_S = 1.0
ORPHAN_AFTER_S = 4 * UPKEEP_S
"""An outbox entry a live replica has seen for this long (its own clock, from its first read that
found it) is taken up by it: the entry's own replica, alive, stored and removed it within
milliseconds (JetStream up), still retries it (JetStream away: the appends of both are stored
once), or retries the removal it owes within ``REDIS_AWAY_S`` + ``UPKEEP_S`` of Redis answering
again (taken up before that, an entry stored more than 2 min before was stored twice)."""
"""At most this long per upkeep round on removals that failed before."""


class ReplicaEvents(OutboxEvents):
    """One replica's events of its job: each saved in the job's rollout outbox, then queued.

    Args:
        bus: the replica's bus (the rollout role's credentials).
        job_id: the replica's job.
        redis: a client of the replica's Redis user (the rollout outbox is the only key it writes).
        max_pending: events held in memory while JetStream is away (``EventQueue``'s bound).
    """

    def __init__(self, bus: Bus, job_id: str, redis: Any, *, max_pending: int = MAX_PENDING_EVENTS) -> None:
        self.bus = bus
        self.job_id = job_id
        self.outbox = RolloutOutbox(redis, job_id)
        self.queue = EventQueue(bus, name=f"{bus.name}-events", max_pending=max_pending)
        self._writer = OutboxWriter(self.queue, lambda _job: self.outbox, owner="rollout replica",
                                    bound=RedisBound(call_s=REDIS_CALL_S, away_s=REDIS_AWAY_S))
        self._upkeep: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def outbox_read(self) -> bool:
        """Whether the start's read of the outbox went through."""
        return self._writer.outbox_read(self.job_id)

    async def emit(self, kind: str, data: dict[str, Any]) -> Event | None:
        """Queue one event of the job, stamped now, in the outbox first (at most
        ``REDIS_CALL_S``; on a Redis failure in memory only, logged). Its message id is drawn here
        and saved with it: whoever appends it (this replica, a later one, a deletion) uses it.

        Returns:
            The event, or None when it was dropped (the queue is full, or closed).
        Raises:
            ValueError: ``data`` does not fit ``kind`` (a bug: raised here, not in the background).
            SubjectError: the rollout role may not write ``kind`` (a bug: nothing is saved).
        """
        subjects.events(self.job_id, kind, self.bus.role)
        event = Event(job_id=self.job_id, kind=kind, data=data)  # type: ignore[arg-type]
        dropped = self.queue.dropped
        await self._writer.give(OutboxEntry(msg_id=event_msg_id(self.job_id, kind), event=event))
        return None if self.queue.dropped > dropped else event

    def start_upkeep(self) -> None:
        """Start the outbox upkeep in the background, every ``UPKEEP_S`` for the replica's life:
        retry the removals that failed (within ``REMOVALS_BUDGET_S``), then queue what the job's
        outbox holds (``recover``: all of it until one read went through, what replicas killed
        before this one left; after that, the entries ``ORPHAN_AFTER_S`` old: what replicas killed
        since left). Harmless if called twice."""
        if self._upkeep is None:
            self._upkeep = asyncio.get_running_loop().create_task(self._keep(), name="rollout-outbox-upkeep")

    async def recover(self, min_age_s: float = 0.0, log_read_s: float = LOG_READ_S) -> int:
        """Queue what the job's rollout outbox holds and this replica did not give itself, under
        the message ids saved with it (only entries ``min_age_s`` old); return how many. Harmless
        to call again.

        Raises:
            TransportError: Redis failed or did not answer within ``REDIS_CALL_S`` (the entries
                stay for the next try).
        """
        return await self._writer.recover(self.job_id, min_age_s=min_age_s, log_read_s=log_read_s)

    async def _keep(self) -> None:
        while True:
            await self._writer.retry_removals(REMOVALS_BUDGET_S)  # (first: a stored entry is not read again)
            await self._take_up(0.0 if not self.outbox_read else ORPHAN_AFTER_S)
            await asyncio.sleep(UPKEEP_S)  # pace the rounds (and the tries while Redis is away)

    async def _take_up(self, min_age_s: float, log_read_s: float = LOG_READ_S) -> None:
        if self.queue.pending >= self.queue.max_pending // 2:
            return  # (JetStream away a long time: the room left is this replica's own events')
        try:
            found = await self.recover(min_age_s, log_read_s)
        except TransportError as exc:
            log.warning("job %s: the rollout outbox not read (%s): tried again in %g s", self.job_id, exc, UPKEEP_S)
            return
        if found:
            log.warning("job %s: %d events other replicas left in the rollout outbox: appending them", self.job_id,
                        found)

    async def close(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop the upkeep, queue every entry of the outbox this replica does not hold yet (one
        read, within ``REDIS_CALL_S``, and the log look-up of its old entries within a quarter of
        ``grace_s``: a replica of the job that stops last, at its end, appends what dead replicas
        left), take no new events, give the queued ones what is left of ``grace_s`` to be stored
        (what is left stays in the outbox for the next replica to start, or a deletion); the whole
        within ``grace_s`` and the upkeep's cancellation; harmless if called twice."""
        await cancel_and_wait(self._upkeep, STOP_GRACE_S)
        began = time.monotonic()
        if not self._closing:
            self._closing = True
            await self._take_up(0.0, log_read_s=min(LOG_READ_S, grace_s / 4))
        await self.queue.close(max(0.0, grace_s - (time.monotonic() - began)))
