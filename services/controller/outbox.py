"""The controller's event outbox: every event the controller appends to a job's log is owed in
Redis first (``ControllerOutbox``) and appended in the background, so neither a JetStream outage
nor a change of leader loses one.

Before, an event was appended inline (``Bus.emit_event``): a JetStream outage held the caller for
the bus's whole retry budget (30 s per event, on the recovery path), and then the event was
dropped. A job's final event dropped that way left a job with its final status and a log that
never ends, which the auditor fails for good.

Who waits for what:

* **Enqueue only** (``Controller.event``: decisions, actions, faults detected, exits, notes; the
  members' ``member_started`` / ``member_stopped``): :meth:`ControllerEvents.emit` returns once
  the event is saved in the job's outbox (one RPUSH), stamped with its ``ts`` and message id. If
  Redis itself refuses the save, the event is appended directly in the background (the bus's
  bounded retry, then logged and dropped, as before): with Redis away the controller records
  nothing else either, and that event is the only one that may then land out of order.
* **The final event** (``job_finished`` / ``job_failed`` / ``job_stopped``, ``stop_job``):
  :meth:`ControllerEvents.emit_and_wait` saves it (raising if Redis refuses: the stop is carried
  out again, under the same message id), then waits up to ``FINAL_EVENT_WAIT_S`` for JetStream
  to store it, so a client that sees the final status normally finds the event in the log. Past
  that the final status is saved anyway (the job ends, its members are stopped) and the event
  stays owed until it is stored: by this controller's flusher, or by the next leader's.
* **A deletion that keeps the log** (``deletion``): :meth:`ControllerEvents.flush` appends what
  the job still owes (raising if it cannot: the deletion stays marked and is finished later),
  before ``job_deleted`` and before the purge takes the outbox.

Order: one flusher per job appends its entries one at a time, oldest first (an event waits for
the one before it to be stored), so a job's controller events land in the order they were given.
Readers order a log by ``ts`` anyway (``chaos.accounting``), and ``ts`` is when the event was
given, not when it was stored.

Each entry is removed only once stored. Its message id travels with it, so a repeat (a lost
JetStream ack, a leader that died between the store and the removal, two flushers) is stored once
within JetStream's duplicate window (2 min), as for the request manager's outbox. Past that window
the id protects nothing: an entry that was tried before (by this process or, for one found at a
takeover, by anyone) and may predate the window (``event_outbox.may_predate_window``: a minute
old, or stamped ahead of this clock) is first looked for in the job's log (same kind, ``ts`` and
data) and only removed if it is there.

Fence: an event carries the fencing token of the leader that gave it (``data["fence"]``), not of
the one that flushes it. A new leader flushes whatever a previous one left (:meth:`resume`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from robustrl import subjects
from robustrl.aio import cancel_and_wait, within
from robustrl.bus import Bus, event_msg_id
from robustrl.errors import SubjectError, TransportError
from robustrl.event_outbox import may_predate_window
from robustrl.messages import Event, EventLog
from robustrl.storage.control_stores import ControllerOutbox, OutboxEntry

log = logging.getLogger(__name__)

FINAL_EVENT_WAIT_S = 30.0
"""How long ``stop_job`` waits for the final event to be stored before it saves the final status
anyway (the event stays owed)."""
APPEND_RETRY_S = 5.0
"""One append attempt of the flusher (the bus retries within it); past it the flusher backs off."""
FLUSH_RETRY_MIN_S = 0.25
FLUSH_RETRY_MAX_S = 5.0
"""The flusher's back-off after a failed pass (JetStream or Redis away), doubled up to this."""
CLOSE_GRACE_S = 2.0
FLUSH_POLL_S = 0.05
"""``flush``: pause before it looks again at an outbox a flusher left non-empty."""
"""At close: for the owed events to be stored (what is left stays for the next leader)."""


class ControllerEvents:
    """The controller's events, owed in Redis per job and appended in order in the background."""

    def __init__(self, bus: Bus, redis: Any) -> None:
        self.bus = bus
        self.redis = redis
        self._flushers: dict[str, asyncio.Task[None]] = {}
        self._dirty: set[str] = set()
        """Jobs given an event since their flusher last read the outbox (it reads it again)."""
        self._waiters: dict[str, asyncio.Event] = {}
        """msg id -> set once that entry is stored (``emit_and_wait``)."""
        self._tried: set[bytes] = set()
        """Entries (stored text) whose append was tried by this process and not yet removed."""
        self._given: set[bytes] = set()
        """Entries this process saved (the others were left by a previous leader)."""
        self._stored: set[bytes] = set()
        """Entries stored whose removal from the outbox failed: removed, not appended, next time."""
        self._direct: set[asyncio.Task[None]] = set()
        self._closed = False
        self.appended = 0

    # --- giving events ---------------------------------------------------------------------

    async def emit(self, job_id: str, kind: str, data: dict[str, Any], *, msg_id: str | None = None) -> Event:
        """Owe one event, stamped now: in the job's outbox when this returns, in its log later.
        Redis refusing the save: appended directly in the background instead (see the module).

        Raises:
            ValueError: ``data`` does not fit ``kind``; SubjectError: the controller may not write
                ``kind`` (bugs: raised here, not in the background).
        """
        entry = self._entry(job_id, kind, data, msg_id)
        try:
            await self._save(entry)
        except TransportError as exc:
            log.warning("job %s: %s event not saved in the outbox (%s): appended directly", job_id, kind, exc)
            task = asyncio.get_running_loop().create_task(self._append_directly(entry))
            self._direct.add(task)
            task.add_done_callback(self._direct.discard)
        return entry.event

    async def emit_and_wait(self, job_id: str, kind: str, data: dict[str, Any], timeout_s: float, *,
                            msg_id: str | None = None) -> bool:
        """Owe one event and wait up to ``timeout_s`` for JetStream to store it (and every event
        of the job owed before it); False if it did not: it stays owed.

        Raises:
            TransportError: Redis refused the save (the event is nowhere: the caller tries again).
        """
        entry = self._entry(job_id, kind, data, msg_id)
        stored = self._waiters.setdefault(entry.msg_id, asyncio.Event())
        try:
            await self._save(entry)
            try:
                await within(stored.wait(), timeout_s)
            except TimeoutError:
                return False
            return True
        finally:
            self._waiters.pop(entry.msg_id, None)

    def _entry(self, job_id: str, kind: str, data: dict[str, Any], msg_id: str | None) -> OutboxEntry:
        subjects.events(job_id, kind, self.bus.role)  # a kind this role may not write: SubjectError now
        event = Event(job_id=job_id, kind=kind, data=data)  # type: ignore[arg-type]
        return OutboxEntry(msg_id=msg_id or event_msg_id(job_id, kind), event=event)

    async def _save(self, entry: OutboxEntry) -> None:
        job_id = entry.event.job_id
        text = await ControllerOutbox(self.redis, job_id).add(entry)
        self._given.add(text.encode())
        self.wake(job_id)

    async def _append_directly(self, entry: OutboxEntry) -> None:
        event = entry.event
        try:
            await self.bus.publish_durable(subjects.events(event.job_id, event.kind, self.bus.role),
                                           event.encode(), msg_id=entry.msg_id)
        except TransportError as exc:
            log.error("job %s: %s event lost: neither saved in the outbox nor stored: %s", event.job_id,
                      event.kind, exc)

    async def owed(self, job_id: str) -> list[Event]:
        """The events the job's outbox still owes its log, oldest first: the log's next entries,
        for a reader that must not miss them (a final event owed by a leader that died before it
        saved the job's final status: ``Controller.catch_up``).

        Raises:
            TransportError: Redis failed.
        """
        return [entry.event for _, entry in await ControllerOutbox(self.redis, job_id).entries()]

    # --- flushing --------------------------------------------------------------------------

    def wake(self, job_id: str) -> None:
        """Have the job's outbox appended (a flusher started, or the running one reads it again)."""
        if self._closed:
            return
        self._dirty.add(job_id)
        if job_id not in self._flushers:
            self._flushers[job_id] = asyncio.get_running_loop().create_task(self._flush(job_id),
                                                                            name=f"events-{job_id}")

    async def resume(self, job_ids: list[str]) -> None:
        """After a takeover: append what previous leaders left owed for these jobs (ended ones
        too: a final event owed while JetStream was away). Returns once every outbox was looked
        at (each owing one is flushed in the background); Redis away, it looks again."""
        for job_id in job_ids:
            while True:
                try:
                    owed = await ControllerOutbox(self.redis, job_id).size()
                    break
                except TransportError as exc:  # Redis away: what is owed must still be appended
                    log.warning("job %s: its owed events not read (%s): tried again", job_id, exc)
                    await asyncio.sleep(FLUSH_RETRY_MAX_S)
            if owed:
                log.warning("job %s: %d events owed by a previous controller: appending them", job_id, owed)
                self.wake(job_id)

    async def flush(self, job_id: str, timeout_s: float) -> None:
        """Append everything the job owes now, waiting up to ``timeout_s``.

        Raises:
            TransportError: not all stored in time (they stay owed).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            # Again while the outbox holds something: an event saved as the flusher ended (its
            # save woke a new flusher, which the wait before did not see) is flushed too; before,
            # the deletion that called this failed on it (seen in a full run).
            self.wake(job_id)
            task = self._flushers.get(job_id)
            if task is not None:
                try:
                    await within(asyncio.shield(task), deadline - loop.time())
                except TimeoutError:
                    raise TransportError(f"job {job_id}: owed events not stored within {timeout_s:g}s") from None
            if not await ControllerOutbox(self.redis, job_id).entries():
                return
            if loop.time() >= deadline:
                raise TransportError(f"job {job_id}: events still owed after a flush of {timeout_s:g}s")
            await asyncio.sleep(FLUSH_POLL_S)  # (a flusher that ended with entries left: not at once again)

    async def forget(self, job_id: str) -> None:
        """Stop appending the job's events (its deletion purges its log or its outbox next)."""
        self._dirty.discard(job_id)
        task = self._flushers.pop(job_id, None)
        if task is not None:
            await cancel_and_wait(task, CLOSE_GRACE_S)

    async def _flush(self, job_id: str) -> None:
        outbox = ControllerOutbox(self.redis, job_id)
        delay = FLUSH_RETRY_MIN_S
        try:
            while True:
                self._dirty.discard(job_id)
                try:
                    logged: list[EventLog] = []  # the job's log, read at most once per pass
                    for raw, entry in await outbox.entries():
                        await self._append(outbox, raw, entry, logged)
                except TransportError as exc:
                    log.warning("job %s: owed events not appended yet (%s): tried again in %g s", job_id, exc,
                                delay)
                    await asyncio.sleep(delay)  # JetStream or Redis away: the back-off
                    delay = min(2 * delay, FLUSH_RETRY_MAX_S)
                    continue
                delay = FLUSH_RETRY_MIN_S
                if job_id not in self._dirty:  # nothing given since the read: every entry stored
                    return
        finally:
            if self._flushers.get(job_id) is asyncio.current_task():
                del self._flushers[job_id]

    async def _append(self, outbox: ControllerOutbox, raw: bytes, entry: OutboxEntry,
                      logged: list[EventLog]) -> None:
        """Append one entry (unless it is known stored) and remove it from the outbox.

        Raises:
            TransportError: JetStream or Redis failed (the entry stays, for the next pass).
        """
        event = entry.event
        if raw not in self._stored:
            try:
                subject = subjects.events(event.job_id, event.kind, self.bus.role)
            except SubjectError as exc:  # (a kind another role owns, saved by hand): never appendable
                log.error("job %s: owed %s event dropped: %s", event.job_id, event.kind, exc)
                await outbox.remove(raw)
                return
            if not await self._in_log(raw, entry, logged):
                self._tried.add(raw)
                await self.bus.publish_durable(subject, event.encode(), msg_id=entry.msg_id, retry_s=APPEND_RETRY_S)
                self.appended += 1
            self._stored.add(raw)
        await outbox.remove(raw)
        for known in (self._stored, self._tried, self._given):
            known.discard(raw)
        if (waiter := self._waiters.get(entry.msg_id)) is not None:
            waiter.set()

    async def _in_log(self, raw: bytes, entry: OutboxEntry, logged: list[EventLog]) -> bool:
        """Whether an entry that may be stored already, outside the duplicate window, is in the log."""
        tried = raw in self._tried or raw not in self._given
        if not tried or not may_predate_window(entry.event.ts):
            return False
        if not logged:
            try:
                logged.append(await self.bus.read_events(entry.event.job_id))
            except TransportError:
                raise
            except Exception as exc:  # (a JetStream error the read does not translate)
                raise TransportError(f"event log of {entry.event.job_id} not read: {exc}") from exc
        e = entry.event
        return any((x.kind, x.ts, x.data) == (e.kind, e.ts, e.data) for x in logged[0])

    # --- lifecycle -------------------------------------------------------------------------

    async def close(self, grace_s: float = CLOSE_GRACE_S) -> None:
        """Take no new flushes, give the running ones ``grace_s``, then cancel them (what is still
        owed stays in Redis for the next leader). Harmless if called twice."""
        self._closed = True
        tasks = [*self._flushers.values(), *self._direct]
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s)
        await asyncio.gather(*(cancel_and_wait(t, CLOSE_GRACE_S) for t in tasks))
        self._flushers.clear()
