"""Restoring the jobs a controller finds in the registry when it takes over (after a restart, or
as a standby taking the lease).

Each active job is caught up from the event log, its recorded members are re-attached
(``MemberStarter.adopt``), and what a previous leader left half-done is settled:

* a job whose start was interrupted: the members of that start are stopped, and the job is started
  again once this controller leads (``Restorer.relaunch``);
* a gang or whole-job recovery whose start was interrupted: what it started unrecorded
  (``find_unrecorded``) or switched in place (``find_handed_over``) is stopped, and the recovery
  is restarted whole once this controller leads (``RecoveryExecutor.resume_interrupted``). A
  recorded member of that start that is gone (it exited while no controller watched: a rank of
  a half-started gang whose peers never came) is superseded by that restart: its exit is logged
  as expected, never judged a crash before its hello (three of those in a row fail the job);
* members that are gone otherwise are returned as exits, for the supervisor to judge as crashes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from robustrl.services.controller import failpoints
from robustrl.services.controller.jobs import ACTIVE, ActiveRecovery, JobRun
from robustrl.services.controller.launching import gang_id, lid, replica_id, trainer_id

from robustrl.errors import TransportError
from robustrl.launcher.base import ExitInfo, Launcher

if TYPE_CHECKING:
    from robustrl.services.controller.runtime import Controller

log = logging.getLogger(__name__)


class Restorer:
    """A controller's restoring of its jobs at a takeover."""

    def __init__(self, controller: Controller) -> None:
        self.c = controller

    async def restore(self) -> list[ExitInfo]:
        """Resume the registry's active jobs: catch up from the event log, re-attach members.
        Returns the exits of recorded members that are gone, for the supervisor to judge."""
        c = self.c
        gone_exits: list[ExitInfo] = []
        for job_id, rec in (await c.registry.all()).items():
            if rec.get("status") not in ACTIVE:
                # An ended job stays visible through the API until it is deleted; a deletion a
                # previous leader left part-way is finished once this controller leads.
                if rec.get("deleting"):
                    c.deletions_owed[job_id] = dict(rec["deleting"])
                with contextlib.suppress(Exception):  # a damaged record: DELETE still removes it
                    c.jobs[job_id] = JobRun.from_record(job_id, rec)
                continue
            try:
                job = JobRun.from_record(job_id, rec)
            except Exception as exc:  # noqa: BLE001 (damaged in any way, it must not stop the takeover of the others)
                log.error("job %s: stored record unusable: %s", job_id, exc)
                continue
            c.jobs[job_id] = job
            try:
                await c.catch_up(job)
            except TransportError as exc:
                log.warning("job %s: event log not read (%s); resuming from the registry", job_id, exc)
            if job.done:
                continue
            adopted, gone = await c.starter.adopt(job)
            for mid in adopted:
                job.members[mid].adopted = True
            if not job.launched:
                await self.relaunch(job, adopted, gone)
                _carry_on_stop(c, job)  # (being stopped: not started again, the stop carried out)
                continue
            superseded: set[str] = set()
            if (cut := c.recovery.interrupted(job)) is not None:
                # A gang or whole-job start the previous leader did not finish: what it started
                # unrecorded is stopped here, and the recovery is started again once this
                # controller leads (``resume_interrupted``), not left to its deadline.
                found = await find_unrecorded(c.launcher, job, adopted)
                found += await find_handed_over(c.launcher, job, cut.replacing)
                await asyncio.to_thread(c.launcher.stop_many, [lid(job, mid) for mid in found], 3.0)
                superseded = _of_interrupted_start(job, cut, gone)
                # One re-attached before its hello is superseded too: it may exit (its gang's
                # peers never came) before the restart replaces it, and that is no crash.
                job.superseded |= _of_interrupted_start(
                    job, cut, [mid for mid in adopted if job.members[mid].state == "starting"])
            log.warning("job %s: resumed at step %d by %s; %d members re-attached, %d gone", job_id, job.step,
                        c.owner, len(adopted), len(gone))
            await failpoints.hit("takeover_resumed")
            await c.event(job, "note", {"text": "controller took over; job resumed", "owner": c.owner,
                                        "adopted": sorted(adopted), "gone": sorted(gone)})
            job.service_seen_at["request_manager"] = time.monotonic()
            if cut is None and not job.stop_owed:
                # The previous leader may have died with a resume owed (after a whole-job restart,
                # or the launch's): owed here too, sent by the next supervision round. A recovery
                # started again sends its own (its restart_step first).
                job.rm_resume_owed = True
            # A job whose stop a previous leader began: its members that are gone were being stopped
            # (killed before their exits were recorded), not crashed: no recovery for them.
            gone_exits += [ExitInfo(lid(job, mid), job.members[mid].role, None,
                                    mid in superseded or job.stop_owed is not None) for mid in gone]
            await c.persist(job)
            if _carry_on_stop(c, job):
                continue
            # Only now: a stop started before the members were re-attached would leave the ones not
            # yet adopted running, unknown to the launcher (it raced adopt() and won, in CI).
            c.finish_if_trained(job)
        return gone_exits

    async def relaunch(self, job: JobRun, adopted: list[str], gone: list[str]) -> None:
        """A job whose start was interrupted (the leader that started it died or was deposed before
        every first member was started and recorded): the members of that start are stopped; once
        this controller leads, ``_lead`` starts the job anew (a new gang epoch, the next
        incarnation of each replica slot).
        Waiting for them would wait forever: nothing else starts a member never recorded."""
        c = self.c
        log.warning("job %s: its start was interrupted (%d of its members recorded, %d gone): started again "
                    "by %s", job.job_id, len(adopted), len(gone), c.owner)
        await c.event(job, "note", {"text": "its start was interrupted; started again", "owner": c.owner,
                                    "adopted": sorted(adopted), "gone": sorted(gone)})
        live = [mid for mid in adopted if job.members[mid].state not in ("exited", "stopped", "dead")]
        live += await find_unrecorded(c.launcher, job, live)
        await asyncio.to_thread(c.launcher.stop_many, [lid(job, mid) for mid in live], 3.0)
        for mid in [*live, *gone]:
            if mid in job.members:
                job.members[mid].state = "stopped" if mid in live else "dead"
        if job.epoch > 0:  # a gang placed (a Ray placement group) but with no rank recorded
            await asyncio.to_thread(c.launcher.release_unstarted_gang, gang_id(job))
        # What was under way in the interrupted start (a recovery of a member that failed then, a
        # gang start, owed restocks) is superseded by the new start, as by a whole-job restart.
        job.recoveries.clear()
        job.gang_starts.clear()
        job.restock_owed.clear()
        await c.persist(job)  # started again once this controller leads (``_lead``)


def _carry_on_stop(c: Controller, job: JobRun) -> bool:
    """A stop a previous leader began (``JobRun.stop_owed``), the job's members re-attached: owed
    as one that failed part-way, carried out by the supervision's first round (``retry_stops``),
    and the job closing from now on (no fault or exit of it starts a recovery meanwhile). False
    when none was owed."""
    if job.stop_owed is None:
        return False
    log.warning("job %s: the stop (%s) a previous leader began is carried out", job.job_id, job.stop_owed["status"])
    c.owe_stop(job, job.stop_owed["status"], job.stop_owed["reason"])
    job.closing = True
    return True


def _of_interrupted_start(job: JobRun, cut: ActiveRecovery, gone: list[str]) -> set[str]:
    """The gone members that the interrupted start ``cut`` had started (the current gang's ranks;
    for a whole-job restart, each slot's current replica too): its restart supersedes them."""
    roles = ("trainer",) if cut.kind == "trainer" else ("trainer", "rollout")
    return {mid for mid in gone if job.members[mid].role in roles and job.is_current(mid)}


async def find_unrecorded(launcher: Launcher, job: JobRun, live: list[str]) -> list[str]:
    """Members an interrupted start may have started without recording them: their ids follow
    from the record (the gang's epoch and each slot's incarnation are saved before a start).
    Found by their launch mark, they are adopted by the launcher and returned, for the caller
    to stop, not left to run untracked (asking for their spec, they would get it from this
    leader)."""
    ranks = ([(trainer_id(job.epoch, r), "trainer") for r in range(job.spec.trainer.workers)]
             if job.epoch > 0 else [])
    candidates = [*ranks, *((replica_id(s, inc), "rollout") for s, inc in job.slot_incarnation.items())]
    found_ids = []
    for mid, role in candidates:
        if mid in live or (mid in job.members and job.members[mid].state in ("exited", "stopped", "dead")):
            continue
        found = await asyncio.to_thread(launcher.find, lid(job, mid))
        if found is not None and await asyncio.to_thread(launcher.adopt, job.job_id, lid(job, mid), role, found):
            log.warning("job %s: %s was started but never recorded: stopping it", job.job_id, mid)
            found_ids.append(mid)
    return found_ids


async def find_handed_over(launcher: Launcher, job: JobRun, replacing: set[str]) -> list[str]:
    """Processes an interrupted gang start may have switched in place (``Launcher.relabel``: a
    kept rank of the broken gang, a borrowed replica) before it recorded the new rank: recorded
    'dead' under their old id, they run on under an id no record names (and a local member
    keeps its old launch mark), so ``find_unrecorded`` does not see them. Found under the old
    id (the broken gang's ranks, each slot's current incarnation) and adopted by the launcher
    for the caller to stop, unless a live member of the record is that process (a hand-over
    the start did record), as the launcher identifies a process (``Launcher.same_process``: a
    pid alone repeats across a Ray cluster's nodes)."""
    held = [m.handle for m in job.live() if m.handle]
    current = {replica_id(s, inc) for s, inc in job.slot_incarnation.items()}
    found_ids = []
    for mid, m in list(job.members.items()):
        if m.state != "dead" or (mid not in replacing and mid not in current):
            continue
        found = await asyncio.to_thread(launcher.find, lid(job, mid))
        if found is None or any(launcher.same_process(h, found) for h in held):
            continue
        if await asyncio.to_thread(launcher.adopt, job.job_id, lid(job, mid), m.role, found):
            log.warning("job %s: %s, recorded dead, runs on (handed over to a rank never recorded): "
                        "stopping it", job.job_id, mid)
            found_ids.append(mid)
    return found_ids
