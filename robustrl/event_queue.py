"""Events appended to jobs' logs in the background, in the order given, each once.

A service whose handler or loop must not wait on JetStream (an append it did not acknowledge
holds the caller for the bus's whole retry budget, ``EVENT_PUBLISH_RETRY_S``) gives its events to
an :class:`EventQueue`, which:

* keeps each event's ``ts`` from when it was given (readers order a log by ``ts``);
* appends one event at a time, oldest first, each under one message id, so a retry after a lost
  JetStream ack is stored once (JetStream's duplicate window);
* retries an event until it is stored, however long JetStream stays away, pacing the retries;
* holds at most ``max_pending`` events (memory stays bounded through a long outage): past that a
  new event is dropped, counted in ``dropped`` and logged as an error;
* calls an event's ``settled`` callback once it left the queue (stored, or refused for good), for
  a caller that keeps its own durable copy (the request manager's Redis outbox). A callback that
  raises ``TransportError`` is retried alone, paced, until it returns: the event is not published
  again (each round published it again, and once the caller's store was away longer than
  JetStream's duplicate window, 2 min then, the event was stored a second time; an outside review
  found it). The events behind it wait.

The queue is in memory: a process killed while JetStream is away loses what it held, unless its
caller kept a durable copy.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from robustrl import subjects
from robustrl.aio import cancel_and_wait, within
from robustrl.bus import Bus, event_msg_id
from robustrl.errors import SubjectError, TransportError
from robustrl.messages import Event

log = logging.getLogger(__name__)

MAX_PENDING_EVENTS = 10_000
"""Events held while JetStream is away (a few hundred bytes each)."""
RETRY_WAIT_S = 1.0
"""Pause after JetStream did not store an event within the bus's own retry budget."""
STOP_GRACE_S = 2.0
"""How long ``close`` waits for the queued events to be stored."""

Settled = Callable[[], Awaitable[None]]


class EventQueue:
    """Appends events of any job in order, each once, off the caller's path."""

    def __init__(self, bus: Bus, *, name: str = "events", max_pending: int = MAX_PENDING_EVENTS) -> None:
        self.bus = bus
        self.name = name
        self.max_pending = max_pending
        self._queue: deque[tuple[str, Event, Settled | None]] = deque()  # oldest first
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.appended = 0
        self.retries = 0
        self.dropped = 0

    @property
    def pending(self) -> int:
        """Events given and not stored yet."""
        return len(self._queue)

    def queued(self, msg_id: str) -> bool:
        """Whether an event under ``msg_id`` is waiting to be appended."""
        return any(queued == msg_id for queued, _e, _s in self._queue)

    def emit(self, job_id: str, kind: str, data: dict[str, Any]) -> Event | None:
        """Queue one event of ``job_id``, stamped now, under a message id of its own.

        Returns:
            The event, or None when it was dropped (the queue is full, or closed).
        Raises:
            ValueError: ``data`` does not fit ``kind`` (a bug: raised here, not in the background).
        """
        event = Event(job_id=job_id, kind=kind, data=data)  # type: ignore[arg-type]
        return event if self.put(event_msg_id(job_id, kind), event) else None

    def put(self, msg_id: str, event: Event, settled: Settled | None = None) -> bool:
        """Queue ``event`` under ``msg_id``; False (dropped, logged) when full or closed."""
        if self._closed:
            log.error("%s: event %s for %s given after the queue closed: dropped", self.name, event.kind,
                      event.job_id)
            self.dropped += 1
            return False
        if len(self._queue) >= self.max_pending:
            self.dropped += 1
            # Every drop is logged: each is an event missing from a job's log.
            log.error("%s: event log unavailable: %d events already queued (the bound); %s event for %s "
                      "dropped (%d dropped so far)", self.name, len(self._queue), event.kind, event.job_id,
                      self.dropped)
            return False
        self._queue.append((msg_id, event, settled))
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._write(), name=self.name)
        return True

    async def _write(self) -> None:
        done = False  # the head stored (or refused for good): only its ``settled`` is left
        while self._queue:
            msg_id, event, settled = self._queue[0]
            try:
                if not done:
                    try:
                        await self.bus.publish_durable(subjects.events(event.job_id, event.kind, self.bus.role),
                                                       event.encode(), msg_id=msg_id)
                        self.appended += 1
                    except SubjectError as exc:  # a kind this role may not write: a bug, not worth a retry
                        log.error("%s: %s event for %s refused, dropped: %s", self.name, event.kind, event.job_id,
                                  exc)
                        self.dropped += 1
                    done = True
                if settled is not None:
                    await settled()
            except TransportError as exc:
                self.retries += 1
                if done:
                    log.warning("%s: %s event for %s stored; its settling failed (%d queued), retrying it alone: "
                                "%s", self.name, event.kind, event.job_id, len(self._queue), exc)
                else:
                    log.warning("%s: %s event for %s not stored yet (%d queued), retrying: %s", self.name,
                                event.kind, event.job_id, len(self._queue), exc)
                await asyncio.sleep(RETRY_WAIT_S)  # JetStream (or the caller's store) away: pace the retries
                continue
            self._queue.popleft()
            done = False

    async def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every queued event to be stored; True if they were. The
        queue goes on either way."""
        task = self._task
        if task is None or task.done():
            return not self._queue
        try:
            await within(asyncio.shield(task), timeout_s)
        except TimeoutError:
            log.error("%s: %d events not stored %g s after the stop", self.name, len(self._queue), timeout_s)
            return False
        return not self._queue

    async def close(self, grace_s: float = STOP_GRACE_S) -> None:
        """Take no new events, give the queued ones ``grace_s`` to be stored, then stop; harmless
        if called twice."""
        if self._closed:
            return
        self._closed = True
        if not await self.drain(grace_s) and self._queue:
            log.error("%s: %d events lost at the stop", self.name, len(self._queue))
        task, self._task = self._task, None
        await cancel_and_wait(task, STOP_GRACE_S)
