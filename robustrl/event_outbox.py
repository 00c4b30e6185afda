"""Events kept in a Redis outbox from before they are queued until JetStream stored them.

An :class:`robustrl.event_queue.EventQueue` holds its events in memory: a process killed while
JetStream is away loses them. An :class:`OutboxWriter` first saves each event in its job's outbox
(a :class:`robustrl.storage.control_stores.EventOutbox`: the request manager's ``RmOutbox``, the
detector's ``DetectorOutbox``, the rollout replicas' ``RolloutOutbox``), then queues it under the
message id saved with it, and removes it from the outbox once JetStream stored it (the queue's
``settled`` callback). What a killed process left is queued again by the next one (``recover``;
every job's outbox is found with :func:`outbox_keys`; a replica reads its own job's) under the
same message ids, so an event stored just before the kill and not
yet removed is stored once (within JetStream's duplicate window, ``bus.EVENT_DUPLICATE_WINDOW_S``;
past it, twice).

One event may sit in an outbox more than once: a save whose reply was lost is carried out twice
(the client's retried RPUSH: two identical entries), and a command handled twice saves its event
twice under its one message id. A removal takes every identical copy, and the entries of one
message id that ``recover`` finds are queued once, their removal taking all of them: a copy left
behind was queued again by a later read and, past the duplicate window, stored a second time.

Redis is treated one of two ways:

* strict (``bound`` None; the request manager): a failed save raises (the caller does not
  acknowledge the command whose event it is), a failed removal is retried by the queue, alone
  (the event is not published again: the queue waits for Redis, as the rest of the service does);
* bounded (a :class:`RedisBound`; the detector, whose tick must not wait on Redis, and a rollout
  replica, whose serving path must not either): every call is cut at ``call_s``; a failed save
  is logged and the event queued in memory only (it is still appended; only its durability is
  lost); after a failure Redis is left alone for ``away_s`` (one call pays the bound, not every
  event of a tick); a failed removal is kept and tried again by
  ``retry_removals``, which the owner calls off its hot path (the detector, a replica: every few
  seconds, with a budget), never by ``give``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from robustrl import subjects
from robustrl.aio import within
from robustrl.errors import SubjectError, TransportError
from robustrl.event_queue import EventQueue
from robustrl.storage.control_stores import EventOutbox, OutboxEntry, Writes
from robustrl.storage.redis_stores import _call

log = logging.getLogger(__name__)

T = TypeVar("T")

OUTBOX_SCAN_BATCH = 200
"""Keys asked for per SCAN when a starting service looks for every job's outbox."""
LOG_CHECK_AGE_S = 60.0
"""Entries ``recover`` finds stamped at least this long ago are looked up in the log first (half of
JetStream's default 2-min duplicate window, which a stream the controller could not update keeps;
the stamp is the writer's clock, which may be off by that much)."""


def may_predate_window(ts: float, wall: float | None = None) -> bool:
    """Whether an outbox entry stamped ``ts`` may have been stored before JetStream's duplicate
    window, so that it is looked up in the log before it is appended again: stamped
    ``LOG_CHECK_AGE_S`` ago or more, or of unknown age, stamped ahead of this wall clock (a clock
    stepped back since, or its writer's ahead: taken as new, it was stored a second time)."""
    age = (time.time() if wall is None else wall) - ts
    return age < 0.0 or age >= LOG_CHECK_AGE_S


LOG_READ_S = 3.0
"""The bound of that look-up; past it the entries are appended as before."""
LOG_SKEW_S = 600.0
"""The look-up starts this long before the oldest such entry's stamp (JetStream stores on the
server's clock, which may be behind the writer's)."""
MAX_UNREMOVED = 10_000
"""Removals kept for a later try (bounded mode); past it the oldest is forgotten (its entry then
stays in Redis: a later ``recover`` appends it again under its message id)."""


@dataclass(frozen=True)
class RedisBound:
    """How long an outbox call may take, and how long Redis is left alone after one failed."""

    call_s: float
    """One Redis call of the outbox (Redis answers in milliseconds; the client's own retries
    through an outage take up to 30 s)."""
    away_s: float
    """After a failed call, events go to memory only for this long before Redis is tried again."""


class OutboxWriter:
    """Queues events on ``queue``, each kept in its job's outbox (``outbox_of(job_id)``) until
    JetStream stored it.

    Args:
        queue: where the events are appended from (in order, each once, retried).
        outbox_of: the outbox of a job.
        owner: who writes, for the log ("request manager", "detector").
        bound: None for strict, or the bound of every Redis call (see the module's docstring).
        clock: monotonic seconds (the ``away_s`` window).
    """

    def __init__(self, queue: EventQueue, outbox_of: Callable[[str], EventOutbox], *, owner: str,
                 bound: RedisBound | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.queue = queue
        self.owner = owner
        self.recovered = 0
        """Entries of a previous life queued by ``recover``."""
        self.unsaved = 0
        """Events queued in memory only: their save failed (bounded mode)."""
        self._outbox_of = outbox_of
        self._bound = bound
        self._clock = clock
        self._away_until = 0.0
        self._read: set[str] = set()  # jobs whose outbox ``recover`` has read once
        # The outbox entries (stored text, per job) this writer queued and has not removed yet: one
        # still in the outbox (being stored, or stored and not yet removed) is never queued a
        # second time by a later ``recover``. By text: every entry queued (or, read together with
        # others of its message id, removed with the one queued) is here until it is removed.
        self._given: dict[str, set[bytes]] = {}
        self._unremoved: list[tuple[EventOutbox, bytes]] = []
        self._seen: dict[str, dict[bytes, float]] = {}  # job -> entry read -> when first read (``_clock``)
        self._removing = asyncio.Lock()  # one ``retry_removals`` at a time
        self._reading: dict[str, asyncio.Lock] = {}  # job -> one ``recover`` of its outbox at a time

    def outbox_read(self, job_id: str) -> bool:
        """Whether ``recover`` has read ``job_id``'s outbox once."""
        return job_id in self._read

    async def give(self, entry: OutboxEntry, with_writes: Writes | None = None) -> bool:
        """Save ``entry`` in its job's outbox, then queue it. Returns whether it is in the outbox
        (False, bounded mode only: Redis failed or is left alone; queued in memory only, logged).
        ``with_writes`` (strict mode only): the writes the event tells of, in the same transaction
        as its save (``EventOutbox.add``): a process killed after them cannot leave them without
        their event; ``Guarded`` ones only while their guard holds.

        Raises:
            TransportError: strict mode, Redis failed: the event is nowhere, nor are the writes.
            Superseded: guarded writes whose guard had moved on: the event is nowhere either.
            ValueError: ``with_writes`` in bounded mode (a failed save there is not raised).
        """
        if with_writes is not None and self._bound is not None:
            raise ValueError("writes saved with an event need a strict outbox writer")
        outbox = self._outbox_of(entry.event.job_id)
        text = entry.model_dump_json()  # (what ``EventOutbox.add`` stores)
        if self._bound is not None and self._clock() < self._away_until:
            self._in_memory_only(entry)
            return False
        try:
            await self._redis(outbox.add(entry, with_writes), f"save of a {entry.event.kind} event")
        except TransportError as exc:
            if self._bound is None:
                raise
            self._went_away(exc)
            self._in_memory_only(entry)
            if isinstance(exc.__cause__, TimeoutError):
                # Cut by the bound, it may still land: removed once stored (a no-op if it did not).
                self._keep_unremoved(outbox, text.encode())
            return False
        self._put(entry, outbox, text.encode())
        return True

    async def recover(self, job_id: str, *, min_age_s: float = 0.0, log_read_s: float = LOG_READ_S) -> int:
        """Queue what a previous life left in ``job_id``'s outbox (entries this writer queued
        itself, and ones it stored whose removal it still owes, are skipped); return how many.
        The entries of one message id (identical copies, or one event saved twice) are queued
        once, the first of them: its removal takes them all.
        One read of a job's outbox at a time (the log look-up awaits between the read and the
        queuing: two reads side by side queued an old entry twice).
        ``log_read_s``: the bound of that look-up (``_in_log``; a replica's stop gives it less).
        ``min_age_s``: only entries this writer has seen in the outbox for at least this long
        (by its own clock, from the first read that found them: a stamp of another host's clock
        may be off by any amount), so a live peer's entry is left to the peer, which stores and
        removes it within milliseconds, or retries the removal it owes after a Redis outage. An
        entry that does not parse is dropped, logged. Harmless to call again.

        Raises:
            TransportError: Redis failed (or, bounded, did not answer in time): the entries stay
                for the next try.
        """
        async with self._reading.setdefault(job_id, asyncio.Lock()):
            return await self._recover(job_id, min_age_s, log_read_s)

    async def _recover(self, job_id: str, min_age_s: float, log_read_s: float) -> int:
        outbox = self._outbox_of(job_id)
        found = 0
        entries = await self._redis(outbox.entries(), "read")
        # (stored by JetStream, removal owed: queued again it could be stored twice, past the
        # duplicate window)
        unremoved = {stored for box, stored in self._unremoved if box.key == outbox.key}
        now = self._clock()
        seen = self._seen.get(job_id, {})
        seen = self._seen[job_id] = {raw: seen.get(raw, now) for raw, _entry in entries}  # (what is gone, forgotten)
        # message id -> (its first entry, the stored texts of all of them), in outbox order
        owed: dict[str, tuple[OutboxEntry, list[bytes]]] = {}
        for raw, entry in entries:
            if raw in self._given.get(job_id, ()) or raw in unremoved or now - seen[raw] < min_age_s:
                continue
            texts = owed.setdefault(entry.msg_id, (entry, []))[1]
            if raw not in texts:  # (identical copies: one text, one LREM takes them all)
                texts.append(raw)
        in_log = await self._in_log(job_id, [entry for entry, _texts in owed.values()], log_read_s)
        for entry, texts in owed.values():
            if entry.msg_id in in_log:
                # Stored already (its writer died, or still owes the removal): out of the outbox only.
                log.warning("job %s: %s outbox entry %s (%s) is in the log already: removed, not appended",
                            job_id, self.owner, entry.msg_id, entry.event.kind)
                for text in texts:
                    await self._remove(outbox, text)
                continue
            self._put(entry, outbox, *texts)
            found += 1
        self._read.add(job_id)
        self.recovered += found
        if found:
            log.warning("job %s: %d events of a previous %s found in the outbox", job_id, found, self.owner)
        return found

    async def _in_log(self, job_id: str, entries: list[OutboxEntry], bound_s: float = LOG_READ_S) -> set[str]:
        """The message ids of ``entries`` that may predate the window (``may_predate_window``) the job's log
        already holds (``Bus.stored_msg_ids``, read-only, bounded at ``bound_s``): queued again,
        such an entry (its writer killed between the store and the removal, or a live writer
        still owing the removal through a Redis outage) was stored a second time past JetStream's
        duplicate window. Younger entries the window covers. Nothing (logged) when the log cannot
        be read: the entries are appended as before."""
        wall = time.time()
        old = [e for e in entries if may_predate_window(e.event.ts, wall)]
        if not old:
            return set()
        try:
            return await within(stored_of(self.queue.bus, job_id, self.queue.bus.role, old, request_s=bound_s),
                                bound_s)
        except (TransportError, TimeoutError) as exc:
            log.warning("job %s: the log not read for %d %s outbox entries stamped over %g s ago (%s): "
                        "appended again (one stored longer ago than the duplicate window is then stored twice)", job_id, len(old),
                        self.owner, LOG_CHECK_AGE_S, exc or "timed out")
            return set()

    def _put(self, entry: OutboxEntry, outbox: EventOutbox, *stored: bytes) -> None:
        """Queue ``entry``; once stored, every entry saved as one of ``stored`` (its own text,
        and the other entries of its message id a read found) leaves the outbox."""
        job_id = entry.event.job_id

        async def out_of_the_outbox() -> None:  # once stored (or refused for good)
            for text in stored:
                await self._remove(outbox, text)  # (strict: raises, and the queue retries this alone)
            given = self._given.get(job_id)
            if given is not None:
                given.difference_update(stored)
                if not given:
                    del self._given[job_id]

        if self.queue.put(entry.msg_id, entry.event, out_of_the_outbox):
            # (one dropped, the queue full, stays in the outbox for a later ``recover``)
            self._given.setdefault(job_id, set()).update(stored)

    def _in_memory_only(self, entry: OutboxEntry) -> None:
        self.unsaved += 1
        self.queue.put(entry.msg_id, entry.event)

    async def _remove(self, outbox: EventOutbox, stored: bytes) -> None:
        if self._bound is None:
            await outbox.remove(stored)  # raises: the queue retries the removal (not the append)
            return
        if self._clock() < self._away_until:
            self._keep_unremoved(outbox, stored)
            return
        try:
            await self._redis(outbox.remove(stored), "removal")
        except TransportError as exc:
            self._went_away(exc)
            self._keep_unremoved(outbox, stored)

    def _keep_unremoved(self, outbox: EventOutbox, stored: bytes) -> None:
        self._unremoved.append((outbox, stored))
        if len(self._unremoved) > MAX_UNREMOVED:
            gone, _ = self._unremoved.pop(0)
            log.error("job %s: more than %d %s outbox entries stored and not removed: one stays (a later "
                      "start appends it again)", gone.job_id, MAX_UNREMOVED, self.owner)

    @property
    def unremoved(self) -> int:
        """Entries stored by JetStream whose removal from the outbox failed, kept for a retry."""
        return len(self._unremoved)

    async def retry_removals(self, budget_s: float) -> int:
        """Remove what earlier removals could not (bounded mode), oldest first, until one fails
        again or ``budget_s`` is spent; return how many were removed. (Left in the outbox, an
        entry is appended again by the next start, past JetStream's duplicate window: twice.)"""
        removed = 0
        deadline = self._clock() + budget_s
        async with self._removing:
            while self._unremoved and self._clock() >= self._away_until and self._clock() < deadline:
                outbox, stored = self._unremoved.pop(0)  # out before the await: a cap pop meanwhile is harmless
                try:
                    await self._redis(outbox.remove(stored), "removal")
                except TransportError as exc:
                    self._unremoved.insert(0, (outbox, stored))
                    self._went_away(exc)
                    break
                except BaseException:
                    # Cancelled mid-call (the owner's stop): still owed. Dropped here, a later
                    # ``recover`` queued the stored entry again (an outside review found it).
                    self._unremoved.insert(0, (outbox, stored))
                    raise
                removed += 1
        return removed

    async def _redis(self, call: Awaitable[T], what: str) -> T:
        if self._bound is None:
            return await call
        try:
            return await within(call, self._bound.call_s)
        except TimeoutError as exc:
            raise TransportError(f"redis: the {self.owner} outbox's {what} got no answer within "
                                 f"{self._bound.call_s:g}s") from exc

    def _went_away(self, exc: TransportError) -> None:
        assert self._bound is not None
        self._away_until = self._clock() + self._bound.away_s
        log.error("%s outbox: Redis failed (%s): events are queued in memory only for %g s (appended still; "
                  "lost if this process is killed before JetStream stores them)", self.owner, exc,
                  self._bound.away_s)


async def stored_of(bus: Any, job_id: str, role: str | None, entries: Iterable[OutboxEntry], *,
                    request_s: float) -> set[str]:
    """The message ids of ``entries`` (events of ``job_id`` written by ``role``) that the job's log
    holds: JetStream's direct get on each kind's subject from the oldest such entry's stamp less
    ``LOG_SKEW_S`` (from the subject's start if one is stamped ahead of this wall clock: when it
    was stored is unknown) (``Bus.stored_msg_ids``, read-only), each request bounded by ``request_s``; the
    whole is the caller's to bound. A kind ``role`` does not write is skipped (never appended
    under it). Used by every reader of another life's entries: an outbox's (``_in_log``), the
    next gang's rank 0 (the trainer outbox), and the controller's stop.

    Raises:
        TransportError: JetStream refused or did not answer.
    """
    by_kind: dict[str, float] = {}
    now = time.time()
    for e in entries:
        since = e.event.ts - LOG_SKEW_S if e.event.ts <= now else 0.0
        by_kind[e.event.kind] = min(by_kind.get(e.event.kind, since), since)
    ids: set[str] = set()
    for kind, since in sorted(by_kind.items()):
        try:
            on = subjects.events(job_id, kind, role)
        except SubjectError:
            continue
        ids |= await bus.stored_msg_ids(on, since, timeout=request_s)
    return ids


class OutboxEvents:
    """What every role's event writer (request manager, detector, rollout replica) forwards from
    its :class:`OutboxWriter` and :class:`EventQueue`: subclasses set ``queue`` and ``_writer``."""

    queue: EventQueue
    _writer: OutboxWriter

    @property
    def pending(self) -> int:
        """Events given (or recovered) and not stored yet."""
        return self.queue.pending

    @property
    def recovered(self) -> int:
        """Events a previous life (or another process of the role) left in an outbox, queued
        by this one."""
        return self._writer.recovered

    @property
    def unsaved(self) -> int:
        """Events queued in memory only (their save to Redis failed, or no Redis)."""
        return self._writer.unsaved

    @property
    def unremoved(self) -> int:
        """Events stored by JetStream whose removal from the outbox failed (bounded mode), owed."""
        return self._writer.unremoved

    async def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every queued event to be stored; True if they were."""
        return await self.queue.drain(timeout_s)


async def outbox_keys(redis: Any, pattern: str, *, batch: int = OUTBOX_SCAN_BATCH,
                      call_s: float | None = None) -> AsyncIterator[bytes]:
    """Every key matching ``pattern`` (an outbox pattern of ``Keys``), by SCAN in batches of
    ``batch``; each SCAN cut at ``call_s`` when given.

    Raises:
        TransportError: a SCAN failed or (``call_s``) got no answer in time.
    """
    cursor = 0
    while True:
        scan = _call(redis.scan(cursor, match=pattern, count=batch), pattern)
        try:
            cursor, keys = await (scan if call_s is None else within(scan, call_s))
        except TimeoutError as exc:
            raise TransportError(f"redis SCAN {pattern} got no answer within {call_s:g}s", key=pattern) from exc
        for key in keys:
            yield key
        if int(cursor) == 0:
            return
