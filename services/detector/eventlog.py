"""The detector's events, appended to the jobs' logs in the background, in the order given.

The fault report itself goes to the controller on core NATS at once; its ``fault_detected``
event is for the log (the harness, the auditor). Appended inline, one event JetStream did not
acknowledge held the detector for the bus's whole retry budget (``EVENT_PUBLISH_RETRY_S``,
30 s): the next faults of the same tick, every other job's tick and the exit subscription all
waited, and the tick gap then rebased every member history (its probes and stall evidence
thrown away). This writer:

* stamps each event when it is given (its ``ts`` is the detection, not the append);
* appends one event at a time, oldest first, each under one message id, so a retry after a
  lost JetStream ack is stored once (JetStream's duplicate window);
* retries an event until it is stored, however long JetStream stays away;
* holds at most ``max_pending`` events (memory stays bounded through a long outage): past
  that a new event is dropped, counted in ``dropped`` and logged as an error.

The queue is in memory: a detector killed while JetStream is away loses what it held (the
fault reports themselves were delivered; a restarted detector reports a fault that is still
there again, under the same fault id).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import deque
from typing import Any

from robustrl import subjects
from robustrl.aio import cancel_and_wait, within
from robustrl.bus import Bus
from robustrl.errors import SubjectError, TransportError
from robustrl.messages import Event

log = logging.getLogger(__name__)

MAX_PENDING_EVENTS = 10_000
"""Events held while JetStream is away (a few hundred bytes each)."""
RETRY_WAIT_S = 1.0
"""Pause after JetStream did not store an event within the bus's own retry budget."""
STOP_GRACE_S = 2.0
"""How long a stopping detector waits for its queued events to be stored."""


class EventWriter:
    """Appends events for every job of one detector, in order, each once, off the caller's path."""

    def __init__(self, bus: Bus, *, max_pending: int = MAX_PENDING_EVENTS) -> None:
        self.bus = bus
        self.max_pending = max_pending
        self._queue: deque[tuple[str, Event]] = deque()  # (message id, event), oldest first
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.appended = 0
        self.retries = 0
        self.dropped = 0

    @property
    def pending(self) -> int:
        """Events given and not stored yet."""
        return len(self._queue)

    def emit(self, job_id: str, kind: str, data: dict[str, Any]) -> Event | None:
        """Queue one event, stamped now; it is appended to the job's log in the background.

        Returns:
            The event, or None when it was dropped (the queue is full, or the writer closed).
        Raises:
            ValueError: ``data`` does not fit ``kind`` (a bug: raised here, not in the background).
        """
        event = Event(job_id=job_id, kind=kind, data=data)  # type: ignore[arg-type]
        if self._closed:
            log.error("event %s for %s given after the writer closed: dropped", kind, job_id)
            self.dropped += 1
            return None
        if len(self._queue) >= self.max_pending:
            self.dropped += 1
            # Every drop is logged: each is an event missing from a job's log.
            log.error("event log unavailable: %d events already queued (the bound); %s event for %s dropped "
                      "(%d dropped so far)", len(self._queue), kind, job_id, self.dropped)
            return None
        self._queue.append((f"{job_id}-{kind}-{uuid.uuid4().hex}", event))
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._write(), name="detector-events")
        return event

    async def _write(self) -> None:
        while self._queue:
            msg_id, event = self._queue[0]
            try:
                await self.bus.publish_durable(subjects.events(event.job_id, event.kind, self.bus.role),
                                               event.encode(), msg_id=msg_id)
            except TransportError as exc:
                self.retries += 1
                log.warning("%s event for %s not stored yet (%d queued), retrying: %s", event.kind, event.job_id,
                            len(self._queue), exc)
                await asyncio.sleep(RETRY_WAIT_S)  # JetStream away past the bus's retries: pace them
                continue
            except SubjectError as exc:  # a kind this role may not write: a bug, not worth a retry
                log.error("%s event for %s refused, dropped: %s", event.kind, event.job_id, exc)
                self.dropped += 1
            else:
                self.appended += 1
            self._queue.popleft()

    async def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every queued event to be stored; True if they were."""
        task = self._task
        if task is None or task.done():
            return not self._queue
        try:
            await within(asyncio.shield(task), timeout_s)
        except TimeoutError:
            return False
        return not self._queue

    async def close(self, grace_s: float = STOP_GRACE_S) -> None:
        """Take no new events, give the queued ones ``grace_s`` to be stored, then stop; harmless
        if called twice."""
        if self._closed:
            return
        self._closed = True
        if not await self.drain(grace_s) and self._queue:
            log.error("%d events not stored %g s after the stop: lost", len(self._queue), grace_s)
        task, self._task = self._task, None
        await cancel_and_wait(task, STOP_GRACE_S)
