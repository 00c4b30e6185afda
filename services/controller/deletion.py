"""Deleting an ended job (``DELETE /v1/jobs/{id}``): what it left in Redis, its record, and on
request its checkpoints and its event log.

A finished job keeps its last steps' rollout keys in Redis (the request manager deletes a step's
episodes, prefixes and batch only once a newer checkpoint is durable, and the auditor reads what
is left after the job), its gang record, trained log, batch fences and handled faults, and its
record in the job registry; nothing but this deletion removes them, asked for by a request or
by the job's retention (:mod:`.retention`). Every one of them lies under the
job's own key prefix (``Keys.job_pattern``: job ids are ``[A-Za-z0-9_-]``, so the pattern holds
no glob of its own and matches no other job's keys). The checkpoints (the trained model) and the
event log (the job's history) stay unless asked for: a kept log ends with ``job_deleted``.

Crash-safe and repeatable: the job's record is first marked ``deleting`` with what is to go, and
each part can be done again (a SCAN that finds nothing, a prefix already empty, a purge of an
empty log). A controller that takes over finishes every deletion it finds marked (``resume``);
the record goes last, so a job is gone from the API only once everything asked for is gone.

A kept log gets, before the purge, what the job's outboxes still hold: the controller's own
(events owed while JetStream was away, a final event among them: :mod:`.outbox`), then the
request manager's: events of commands the request manager acknowledged and was killed before
JetStream stored (the next request manager to start appends every job's outbox, but one that has
not started yet when the job is deleted would find it purged), and the detector's (its
``fault_detected`` events of a detector killed while JetStream was away, for the same reason). They are appended under their own
message ids, so one that a request manager appends too is stored once within JetStream's
duplicate window; a deletion that cannot append them fails and stays marked, like any other part.
A purged log gets nothing: the controller's flusher of the job is stopped before the purge, so
it appends nothing to the log after it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from robustrl.services.controller import failpoints
from robustrl.services.controller.jobs import ACTIVE
from robustrl.services.controller.lease import LeaseLost

from robustrl import subjects
from robustrl.audit.raw import job_prefix
from robustrl.errors import JobActive, JobError, StorageError, SubjectError
from robustrl.storage.control_stores import DetectorOutbox, RmOutbox, RolloutOutbox, TrainerOutbox
from robustrl.storage.objects import StoreUnavailable, open_object_store
from robustrl.storage.redis_stores import Keys, _call

if TYPE_CHECKING:
    from robustrl.services.controller.runtime import Controller

log = logging.getLogger(__name__)

PURGE_BATCH = 500
"""Keys asked for per SCAN and unlinked per call."""
FINAL_WRITE_WAIT_S = 10.0
"""How long a deletion waits for the final record of a job whose final status is set (a stop in
its last write): the status reads final from then on, so a client may delete at once."""
OWED_FLUSH_S = 30.0
"""How long a deletion that keeps the log waits for the controller's owed events to be stored."""


class JobDeleter:
    """The controller's deletions: one at a time per job (a repeated request waits for the one
    under way and gets its answer)."""

    def __init__(self, controller: Controller) -> None:
        self.c = controller
        self._running: dict[str, asyncio.Task[dict[str, Any]]] = {}
        self._store: Any = None

    async def delete(self, job_id: str, *, checkpoints: bool = False, events: bool = False,
                     retention: bool = False) -> dict[str, Any]:
        """Delete ended job ``job_id``; return what was deleted. A request arriving while a
        deletion of the job runs gets that deletion's answer (one deletion per job at a time: two
        at once appended ``job_deleted`` twice, or after the log was purged). ``retention``: asked
        by the job's retention (:mod:`.retention`), which its ``job_deleted`` event says.

        Raises:
            JobError: there is no such job (the API's 404).
            JobActive: the job has not ended, or is being stopped (409).
            LeaseLost: this controller no longer leads (nothing of the record was changed).
            TransportError / StoreUnavailable: a store failed part-way; the job stays marked and
                a repeated request (or the next leader) finishes it.
        """
        running = self._running.get(job_id)
        if running is None:  # registered before any await: a second request finds it
            running = self._start_task(job_id, self._mark_and_purge(job_id, checkpoints, events, retention))
        return await asyncio.shield(running)

    async def _mark_and_purge(self, job_id: str, checkpoints: bool, events: bool,
                              retention: bool) -> dict[str, Any]:
        job = self.c.jobs.get(job_id)
        record = None if job is not None else await self.c.registry.get(job_id)
        if job is None and record is None:
            raise JobError(f"no such job: {job_id}", job_id=job_id)
        status = job.status if job is not None else str((record or {}).get("status"))
        if job is not None and status not in ACTIVE:
            # Its final status may be set with its record still being written (``stop_job``): a
            # client that read the status and deletes at once is not told to stop it first. (A
            # stop that failed in its last write is refused below, as a job being stopped.)
            await self.c.stop_settled(job_id, FINAL_WRITE_WAIT_S)
        if status in ACTIVE or (job is not None and (not job.done or job_id in self.c._stopping)):
            raise JobActive(f"job {job_id} is {status}: stop it first (POST /v1/jobs/{job_id}/stop)",
                            job_id=job_id, status=status)
        marked = (job.deleting if job is not None else (record or {}).get("deleting")) or {}
        what = {"checkpoints": bool(checkpoints or marked.get("checkpoints")),
                "events": bool(events or marked.get("events"))}
        if retention or marked.get("retention"):  # (only then: the mark of a request is as before)
            what["retention"] = True
        # Marked first, fenced: a deposed controller deletes nothing, and a crash from here on
        # leaves a mark that the next leader finishes.
        if job is not None:
            job.deleting = what
            written = await self.c.persist(job)
        else:
            written = await self.c.fenced(lambda fence: self.c.registry.put(
                job_id, {**(record or {}), "deleting": what}, fence=fence))
        if not written:
            raise LeaseLost(f"job {job_id} not deleted: a newer controller lease term has begun")
        return await self._purge(job_id, what)

    def resume(self, job_id: str, what: dict[str, Any]) -> None:
        """Finish a deletion a previous leader marked (called once this controller leads)."""
        if job_id in self._running:
            return

        def report(task: asyncio.Task[dict[str, Any]]) -> None:
            if not task.cancelled() and task.exception() is not None:
                log.error("job %s: deletion not finished (a repeated DELETE finishes it): %s", job_id,
                          task.exception())

        self._start_task(job_id, self._purge(job_id, {"checkpoints": bool(what.get("checkpoints")),
                                                      "events": bool(what.get("events")),
                                                      "retention": bool(what.get("retention"))})).add_done_callback(report)

    def _start_task(self, job_id: str, work: Coroutine[Any, Any, dict[str, Any]]) -> asyncio.Task[dict[str, Any]]:
        task = self.c.spawn(work)
        self._running[job_id] = task

        def done(t: asyncio.Task[dict[str, Any]]) -> None:
            if self._running.get(job_id) is t:
                del self._running[job_id]

        task.add_done_callback(done)
        return task

    async def _purge(self, job_id: str, what: dict[str, bool]) -> dict[str, Any]:
        if not what["events"]:  # the log stays: it must hold every acknowledged event
            await self.c.events.flush(job_id, OWED_FLUSH_S)
            await self._append_outbox(job_id)
        await self.c.events.forget(job_id)  # (its outbox goes with the purge; nothing lands after it)
        out: dict[str, Any] = {"job_id": job_id, "redis_keys_deleted": await self._purge_redis(job_id),
                               "checkpoint_objects_deleted": 0, "events_deleted": 0,
                               "checkpoints_kept": not what["checkpoints"], "events_kept": not what["events"]}
        if what["checkpoints"]:
            if self._store is None:
                self._store = open_object_store(self.c.settings)
            try:
                out["checkpoint_objects_deleted"] = await asyncio.to_thread(self._store.delete_prefix,
                                                                            job_prefix(job_id))
            except StoreUnavailable:
                raise  # the store is away: a repeated request (or the next leader) finishes it
            except StorageError as exc:
                # Refused for good (the controller's S3 key is read-only where the operator keeps
                # it so: compose's MinIO policy): the rest of the deletion goes on and the answer
                # says the checkpoints stayed. Raised, a deletion asked for once could never end.
                log.error("job %s: checkpoints not deleted: %s", job_id, exc)
                out["checkpoints_kept"], out["checkpoints_error"] = True, str(exc)
        if what["events"]:
            out["events_deleted"] = await self.c.bus.purge_events(job_id)
        else:
            await self.c.bus.emit_event(job_id, "job_deleted", {**{k: v for k, v in out.items() if k != "job_id"},
                                                                "retention": bool(what.get("retention")),
                                                                "fence": self.c.lease.token})
        # The record last: until here the job is listed, marked, and a take-over finishes it.
        # Under the job's persist lock: a write of the record in flight (an exit seen late) must
        # not land after the delete and bring the record back (``persist`` skips a forgotten job).
        async with self.c.persist_lock(job_id):
            if not await self.c.fenced(lambda fence: self.c.registry.delete(job_id, fence=fence)):
                raise LeaseLost(f"job {job_id}: its record not deleted: a newer controller lease term has begun")
            self.c.forget(job_id)
        log.warning("job %s deleted: %s", job_id, out)
        return out

    async def _append_outbox(self, job_id: str) -> int:
        """Append what the job's request-manager and detector outboxes hold, under their message
        ids, before the purge takes them; return how many. The purge removes the entries (a repeat
        after a crash appends them again under the same ids). An entry that does not parse is
        dropped, logged; one of a kind the controller may not write is logged and left to go with
        the purge: the trainer outbox's ``step_committed`` (the controller may not write the
        trainer's events; such an entry outlives its job only if JetStream was away when the last
        gang committed and no gang started after) and the rollout outbox's weight load events
        (likewise: a replica's events left while JetStream was away, and no replica of the job
        started after).

        Raises:
            TransportError: Redis failed, or JetStream did not store an event in time.
        """
        appended = 0
        for owner, outbox in (("request manager", RmOutbox(self.c.redis, job_id)),
                              ("detector", DetectorOutbox(self.c.redis, job_id)),
                              ("trainer", TrainerOutbox(self.c.redis, job_id)),
                              ("rollout", RolloutOutbox(self.c.redis, job_id))):
            found = 0
            for _raw, entry in await outbox.entries():
                event = entry.event
                try:
                    subject = subjects.events(job_id, event.kind, self.c.bus.role)
                except SubjectError as exc:
                    log.error("job %s: %s event of the %s's outbox not appended: %s", job_id, event.kind, owner,
                              exc)
                    continue
                await self.c.bus.publish_durable(subject, event.encode(), msg_id=entry.msg_id)
                found += 1
            if found:
                log.warning("job %s: %d events of a killed %s appended from its outbox before the deletion",
                            job_id, found, owner)
            appended += found
        return appended

    async def _purge_redis(self, job_id: str) -> int:
        """Unlink every key under the job's prefix; return how many were unlinked."""
        pattern, cursor, deleted = Keys.job_pattern(job_id), 0, 0
        while True:
            cursor, keys = await _call(self.c.redis.scan(cursor, match=pattern, count=PURGE_BATCH), pattern)
            if keys:
                deleted += int(await _call(self.c.redis.unlink(*keys), pattern))
                await failpoints.hit("job_purging")
            if int(cursor) == 0:
                return deleted
