"""Retention of ended jobs: the leading controller deletes a job ``retention.delete_after_s``
after it ended (finished, failed or stopped), through the deletion of ``DELETE /v1/jobs/{id}``
(:mod:`.deletion`: crash-safe, repeatable, finished by a leader that takes over; the same
``job_deleted`` event, marked ``retention``). Like Kubernetes' ``ttlSecondsAfterFinished``.

The due time is the job's end time in its durable record (``finished_at``) plus the delay in its
spec (in the record too), so it follows from what any leader reads: a leader that takes over
deletes on time, and no timer of the leader that went is lost. One periodic check while leading
compares that with the clock for the jobs in memory; only a due job touches a store. A deleted
job's record is gone and the job forgotten, so no later check (nor a later leader) deletes it
again; one cut short stays marked and is finished like any other deletion. A deletion that fails
(a store away) is logged and tried again, backing off up to ``RETRY_MAX_S``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from robustrl.services.controller.jobs import JobRun
from robustrl.services.controller.lease import LeaseLost

from robustrl.aio import wait_event
from robustrl.errors import JobActive, JobError

if TYPE_CHECKING:
    import asyncio

    from robustrl.services.controller.runtime import Controller

log = logging.getLogger(__name__)

RETENTION_CHECK_S = 1.0
"""Period of the check. It reads memory only (a few comparisons per job), so it can be short:
a job is deleted at most this long after it is due, plus the deletion's own time."""
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 60.0
"""A failed deletion is tried again after RETRY_FIRST_S, doubling up to RETRY_MAX_S."""
ENDED = ("finished", "failed", "stopped")


def delete_at(job: JobRun) -> float | None:
    """When retention deletes ``job`` (a Unix time), or None: it is kept, or has not ended."""
    after = job.spec.retention.delete_after_s
    if after is None or job.status not in ENDED or job.finished_at is None:
        return None
    return float(job.finished_at) + after


class RetentionSweeper:
    """The leader's periodic deletion of ended jobs that are due (``run``)."""

    def __init__(self, controller: Controller) -> None:
        self.c = controller
        self.deleted_total = 0
        """Jobs this controller deleted by retention."""
        self.failed_total = 0
        """Deletions by retention that failed (each tried again)."""
        self._retry: dict[str, tuple[float, float]] = {}
        """job -> (not before, back-off) after a failed deletion; in memory: a new leader tries at once."""

    async def run(self, stop: asyncio.Event) -> None:
        """Check every RETENTION_CHECK_S while this controller leads, until ``stop``."""
        while not await wait_event(stop, RETENTION_CHECK_S):
            if not self.c.leading:
                continue
            try:
                await self.sweep(time.time())
            except LeaseLost as exc:  # the next leader deletes what is due
                log.warning("retention: stopped for this round: %s", exc)
            except Exception:  # the check goes on next round
                log.exception("retention check failed")

    async def sweep(self, now: float) -> list[str]:
        """Delete every ended job due at ``now``; return those deleted.

        Raises:
            LeaseLost: this controller no longer leads (the rest are left to the next leader).
        """
        deleted = []
        for job in list(self.c.jobs.values()):
            if job.spec.retention.delete_after_s is None or job.status not in ENDED:
                continue
            if job.finished_at is None:
                await self._stamp_end(job, now)
                continue
            due = delete_at(job)
            if due is None or now < due or now < self._retry.get(job.job_id, (0.0, 0.0))[0]:
                continue
            if await self._delete(job, now - due):
                deleted.append(job.job_id)
        return deleted

    async def _stamp_end(self, job: JobRun, now: float) -> None:
        # An end read from the event log (the leader that ended the job died before it saved the
        # end time): retention counts from now, saved, so the next leader counts from the same.
        job.finished_at = now
        if not await self.c.persist(job):
            raise LeaseLost(f"job {job.job_id}: its end time not saved: a newer controller lease term has begun")
        log.warning("job %s ended with no end time in its record: retention counts from now", job.job_id)

    async def _delete(self, job: JobRun, late_s: float) -> bool:
        r = job.spec.retention
        try:
            out = await self.c.deleter.delete(job.job_id, checkpoints=r.checkpoints, events=r.events,
                                              retention=True)
        except JobActive:  # being stopped again (its status is final only once that is saved)
            return False
        except JobError:  # deleted meanwhile (a DELETE request)
            self._retry.pop(job.job_id, None)
            return False
        except LeaseLost:
            raise
        except Exception as exc:  # noqa: BLE001 (whatever failed, the deletion is tried again)
            backoff = min(RETRY_MAX_S, 2 * self._retry.get(job.job_id, (0.0, RETRY_FIRST_S / 2))[1])
            self._retry[job.job_id] = (time.time() + backoff, backoff)
            self.failed_total += 1
            log.error("job %s: deletion by retention failed (tried again in %.0f s): %s", job.job_id, backoff, exc)
            return False
        self._retry.pop(job.job_id, None)
        self.deleted_total += 1
        log.warning("job %s deleted by retention, %.1f s after it was due: %s", job.job_id, late_s, out)
        return True
