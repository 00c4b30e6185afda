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
* retries an event until it is stored, however long JetStream stays away, and never drops one
  while the process lives (a handful per recovery: no bound is needed; the turn handler's
  ``turn_dropped`` stream is the bounded one, ``Dispatcher._emit_later``).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import deque
from typing import Any

from robustrl import subjects
from robustrl.aio import within
from robustrl.bus import Bus
from robustrl.errors import SubjectError, TransportError
from robustrl.messages import Event

log = logging.getLogger(__name__)

RETRY_WAIT_S = 1.0
"""Pause after JetStream did not store an event within the bus's own retry budget."""


class EventWriter:
    """Appends one job's events in the background, in order, each once."""

    def __init__(self, bus: Bus, job_id: str) -> None:
        self.bus = bus
        self.job_id = job_id
        self._queue: deque[tuple[str, Event]] = deque()  # (message id, event), oldest first
        self._task: asyncio.Task[None] | None = None
        self.stats = {"appended": 0, "retries": 0}

    @property
    def pending(self) -> int:
        """Events given and not stored yet."""
        return len(self._queue)

    def emit_later(self, kind: str, data: dict[str, Any]) -> Event:
        """Queue one event, stamped now, and return at once.

        Raises:
            ValueError: ``data`` does not fit ``kind`` (a bug: raised here, not in the background).
        """
        event = Event(job_id=self.job_id, kind=kind, data=data)  # type: ignore[arg-type]
        self._queue.append((f"{self.job_id}-{kind}-{uuid.uuid4().hex}", event))
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._write(), name=f"events-{self.job_id}")
        return event

    async def _write(self) -> None:
        while self._queue:
            msg_id, event = self._queue[0]
            try:
                await self.bus.publish_durable(subjects.events(self.job_id, event.kind, self.bus.role),
                                               event.encode(), msg_id=msg_id)
            except TransportError as exc:
                self.stats["retries"] += 1
                log.warning("job %s: %s event not stored yet (%d queued), retrying: %s", self.job_id,
                            event.kind, len(self._queue), exc)
                await asyncio.sleep(RETRY_WAIT_S)  # JetStream away past the bus's retries: pace them
                continue
            except SubjectError as exc:  # a kind this role may not write: a bug, not worth a retry
                log.error("job %s: %s event refused, dropped: %s", self.job_id, event.kind, exc)
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
