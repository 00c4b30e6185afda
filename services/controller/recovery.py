"""Carrying out recovery decisions: fault intake (handled once), the typed action executor, and
recovery progress and deadlines.

A fault report arrives at least once (the plain NATS publish, the event log's durable consumer,
the controller's own exit and silence observations); :meth:`RecoveryExecutor.handle` handles it
once, by fault id, with the ids persisted in Redis so a restarted controller does not act twice.
The pure ``decide`` chooses; this module dispatches on the action's class.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import TYPE_CHECKING

from tenacity import (
    AsyncRetrying,
    before_sleep_log,
    retry_if_exception_type,
    retry_if_not_exception_type,
    stop_after_delay,
    wait_exponential,
)

from robustrl.aio import wait_event
from robustrl.messages import FaultReport, ProbeReply, ProbeRequest
from robustrl.services.controller import decide as decide_mod
from robustrl.services.controller import failpoints
from robustrl.services.controller.decide import (
    Action,
    Decision,
    FailJob,
    Ignore,
    RedispatchEpisodes,
    ReplaceReplica,
    ReportOnly,
    RestartTrainerGang,
    RestartWholeJob,
    ResumeService,
    action_name,
)
from robustrl.services.controller.jobs import (
    STARTUP_FAILURES_MAX, ActiveRecovery, GangStart, JobRun, MemberInfo, still_starting,
)
from robustrl.services.controller.launching import JobStopping, StartSuperseded, lid, replica_id
from robustrl.services.controller.lease import LeaseLost
from robustrl.services.controller.view import borrow_candidates, job_view
from robustrl.storage.redis_stores import Keys
from robustrl.subjects import Verb, subject

if TYPE_CHECKING:
    from robustrl.services.controller.runtime import Controller

log = logging.getLogger(__name__)

RECHECK_RETRY_S = 30.0
"""How long a recheck's fault is tried again when its handling fails, before it is left for the
next recheck (``weights_load_s`` later)."""

SERVICE_RESUME_ATTEMPT_S = 2.0
"""One ``resume`` request to a restarted control-plane service; repeated until its deadline."""
RESTOCK_RETRY_MIN_S = 1.0
"""A rollout slot whose replacement failed to start is tried again this much later, the wait
doubled per failed pass up to ``RESTOCK_RETRY_MAX_S``, until it starts or the job ends."""
RESTOCK_RETRY_MAX_S = 30.0
RESUME_RETRY_MIN_S = 0.5
RESUME_RETRY_MAX_S = 5.0
"""The restart of an interrupted recovery that failed (a Redis or NATS blip at the takeover) is
tried again after this back-off (doubled per try, up to the max), until it is done, the job ends,
this controller stops leading, or the recovery's deadline passes (its escalation takes over then;
``RESUME_RETRY_FLOOR_S`` at least)."""
RESUME_RETRY_FLOOR_S = 30.0
REPEAT_BACKOFF_S = 1.0
"""A recovery action that failed outright and is decided again (a whole-job restart whose start
raised: Redis or NATS away, a launcher error) is carried out again this much later, in a task off
the recovery lock, the wait doubled per repeat up to ``REPEAT_BACKOFF_MAX_S``, until the
restart's recovery passes its deadline (``recovery.deadline_s``), whose escalation takes over."""
REPEAT_BACKOFF_MAX_S = 10.0


class SlotsStillOwed(Exception):
    """A restock pass left slots owed (their start failed): tried again after the back-off."""


class RecoveryExecutor:
    """Turns fault reports into decisions and carries the actions out with the launcher."""

    def __init__(self, controller: Controller) -> None:
        self.c = controller
        self.lock = asyncio.Lock()
        self._decided: set[tuple[str, str]] = set()
        """(job id, fault id) decided and acted on here whose record (``persist(handled=...)``) was
        not written yet (Redis failed at it): a retry writes the record, and decides nothing again
        (it ran on the state the first decision changed: a second decision event, a second
        restart of a control-plane role; an outside review)."""
        self._handled: set[tuple[str, str]] = set()
        """(job id, fault id) handled by this process. Fault ids are unique within a job only
        (``exit-trainer-e1-r0`` names a member, and every job has one)."""
        self._restocking: dict[str, asyncio.Event] = {}
        """job id -> the wake-up of its restock loop, while one runs (one per job: a second
        borrow while it backs off wakes it instead of racing it)."""

    # --- intake ------------------------------------------------------------------------------

    async def _seen(self, job: JobRun, fault_id: str) -> bool:
        if (job.job_id, fault_id) in self._handled:
            return True
        return bool(await self.c.redis.sismember(Keys.faults_handled(job.job_id), fault_id))


    async def handle(self, fault: FaultReport) -> None:
        """Decide and act on one fault report, once per fault id."""
        job = self.c.jobs.get(fault.job_id)
        if job is None and self.c.leading and not await self.c.leads():
            # Leading on a stale view (frozen past the lease): a job submitted to the new leader
            # is unknown here, and the inbox would acknowledge its fault for good.
            raise LeaseLost(f"controller {self.c.owner} does not hold the newest lease term; fault "
                            f"{fault.fault_id} of an unknown job is left for the leader")
        if job is None or not self.c.leading:
            return
        async with self.lock:
            if not job.done and await self._seen(job, fault.fault_id):
                return
            if not await self.c.leads():
                # A newer lease term began and this controller has not noticed yet (frozen past its
                # lease): it must not kill or start anything on its stale view, nor drop the fault
                # as one of a job it is stopping (the new leader may have found the job running:
                # this one's stop never reached the record).
                raise LeaseLost(f"controller {self.c.owner} does not hold the newest lease term; fault "
                                f"{fault.fault_id} is left for the leader")
            if job.done:
                return
            key = (job.job_id, fault.fault_id)
            if key not in self._decided:  # (decided, its record still owed: written, not decided again)
                await self._handle_locked(job, fault)
                self._decided.add(key)
            # Marked handled in the write of the record that holds what was decided (both or
            # neither): marked first, a controller killed before the record's write left a fault
            # handled whose decision no one held (an ignored weights fault owed a recheck after the
            # recovery: the replica stayed stuck; an outside review).
            if not await self.c.persist(job, handled=fault.fault_id):
                raise LeaseLost(f"controller {self.c.owner}: the record of fault {fault.fault_id}'s decision "
                                "was refused (a newer lease term has begun): the fault is left for the leader")
            self._decided.discard(key)
            self._handled.add(key)

    async def _handle_locked(self, job: JobRun, fault: FaultReport) -> None:
        injected_at = job.injected_at.pop(fault.member_id, None)
        began = injected_at if injected_at is not None else fault.fault_at
        record = {"fault_id": fault.fault_id, "kind": fault.kind, "role": fault.role,
                  "member_id": fault.member_id, "step": job.step, "detected_at": fault.detected_at,
                  "fault_at": fault.fault_at,
                  "detection_s": None if began is None else fault.detected_at - began,
                  "evidence": fault.evidence, "recovery_s": None, "decision": None}
        # Off the event loop: the Ray launcher's count makes blocking cluster calls (ray.wait, ray.get
        # with a timeout, ray.nodes) that would stall the API and the bus on a slow cluster.
        spares = await asyncio.to_thread(self.c.launcher.spares_ready)
        can_borrow = self.c.launcher.can_relabel()
        unanswered = await self._unanswered(job) if fault.role == "trainer" and can_borrow else frozenset()
        view = job_view(job, spares_ready=spares, can_borrow=can_borrow,
                        can_keep=self.c.launcher.can_keep_trainers(),
                        holds_strict_layout=self.c.launcher.holds_strict_layout(), unanswered=unanswered)
        decision = decide_mod.decide(time.monotonic(), view, fault, job.spec.recovery)
        record["decision"] = {"actions": decision.names(), "reason": decision.reason}
        if not all(isinstance(a, Ignore) for a in decision.actions):
            job.faults.append(record)
        await self.c.event(job, "decision", {"fault_id": fault.fault_id, "actions": decision.names(),
                                             "reason": decision.reason,
                                             **({"not_borrowed": sorted(unanswered)} if unanswered else {})})
        await self.execute_all(job, fault, decision.actions)

    async def _unanswered(self, job: JobRun) -> frozenset[str]:
        """The replicas a trainer gang could borrow that do not answer a probe within the job's
        ``detector.probe_timeout_s`` (probed together). A replica frozen or cut off just before
        the trainer fault still looks ready here until the detector's silence bound passes:
        borrowed, it never took the hand-off, the new gang never formed, and the job waited for
        the recovery's deadline (a reduced campaign: 80 s, then a whole-job restart). Such a
        replica is left to the detector; a healthy one answers in milliseconds."""
        timeout = job.spec.detector.probe_timeout_s

        async def answers(mid: str) -> bool:
            try:
                reply = await self.c.bus.request(
                    subject(job.job_id, Verb.PROBE, mid),
                    ProbeRequest(job_id=job.job_id, member_id=mid, nonce=uuid.uuid4().hex), ProbeReply,
                    timeout=timeout)
            except Exception as exc:  # no answer, the bus away, a garbled reply: not borrowed
                log.warning("job %s: replica %s not borrowed: %s", job.job_id, mid, exc)
                return False
            return reply.member_id == mid

        mids = [m.member_id for m in borrow_candidates(job)]
        ok = await asyncio.gather(*(answers(mid) for mid in mids))
        return frozenset(mid for mid, yes in zip(mids, ok, strict=True) if not yes)

    # --- execution ---------------------------------------------------------------------------

    async def execute_all(self, job: JobRun, fault: FaultReport, actions: list[Action], repeats: int = 0) -> None:
        """Carry out ``actions`` in order. One that fails outright is escalated by
        ``decide.recovery_failed``: a whole-job restart, or the job failed once ``max_restarts``
        is used up. The same action decided again (a whole-job restart that failed) is carried
        out again after a back-off, ``repeats`` counting them: failing the job then (as before)
        failed it on one Redis or NATS blip, whatever restarts it had left (an outside review)."""
        for action in actions:
            try:
                await self.execute(job, fault, action)
            except LeaseLost:
                # A newer controller leads: this one decides nothing more (escalating could fail the
                # job on a stale view). The fault stays unhandled here, for the new leader.
                raise
            except JobStopping as exc:  # the job is being stopped: nothing to recover, nothing to escalate
                log.info("job %s: %s not carried out: %s", job.job_id, action_name(action), exc)
                return
            except Exception as exc:  # a recovery that fails outright escalates (or fails the job)
                if job.done:  # stopped meanwhile: nothing to escalate
                    log.info("job %s: %s failed as the job stopped: %r", job.job_id, action_name(action), exc)
                    return
                if not self.c.leading:
                    # This controller is stopping (its launcher refuses starts and hand-overs
                    # now) or was deposed: no escalation, no failed job on that account.
                    raise LeaseLost(f"job {job.job_id}: {action_name(action)} failed while controller "
                                    f"{self.c.owner} stopped leading: {exc!r}") from exc
                log.exception("job %s: %s failed", job.job_id, action_name(action))
                rec = decide_mod.RecoveryView(role=fault.role, step=job.step, started_at=time.monotonic(),
                                              fault_id=fault.fault_id)
                decision = decide_mod.recovery_failed(time.monotonic(), job_view(job), rec, repr(exc),
                                                      job.spec.recovery)
                await self.c.event(job, "decision", {"fault_id": fault.fault_id, "actions": decision.names(),
                                                     "reason": decision.reason})
                if any(type(a) is type(action) for a in decision.actions):
                    whole = self._whole_job_recovery(job, fault.fault_id)
                    if whole is not None and time.monotonic() - whole.clock_start >= job.spec.recovery.deadline_s:
                        # Repeated until its recovery's deadline (a count of repeats failed a job
                        # with restarts left on a Redis outage of a few seconds: an outside
                        # review); that deadline's escalation (``check_deadlines``) takes over.
                        log.warning("job %s: %s not repeated: its recovery is past its deadline", job.job_id,
                                    action_name(action))
                        return
                    if whole is None and repeats >= job.spec.recovery.max_restarts:
                        await self.c.stop_job(job.job_id, "failed", decision.reason)
                        return
                    # Off the recovery lock, which every job's faults and the supervision share:
                    # slept under it, every other job's recoveries waited out the back-off
                    # (an outside review measured 5.6 s for another job's replica crash).
                    self.c.spawn(self._repeat_later(job, fault, decision.actions, repeats + 1))
                    return
                await self.execute_all(job, fault, decision.actions, repeats + 1)
                return

    async def _repeat_later(self, job: JobRun, fault: FaultReport, actions: list[Action], repeats: int) -> None:
        """``execute_all``'s repeat of a failed action, after its back-off, under the lock again.
        Not carried out when the job ended, this controller no longer holds the newest lease term,
        or another restart came first: for a whole-job restart, its recovery (made before its
        first step, ``_whole_job_recovery``) is gone from the job, replaced by a newer whole-job
        restart's; for another action, any restart since. That recovery is in the job's record:
        a new leader restarts it (``resume_interrupted``), and its deadline is the net under a
        repeat lost here. (Judged by the count of restarts, a replica replaced meanwhile dropped
        the repeat for good: an outside review.)"""
        whole = self._whole_job_recovery(job, fault.fault_id)
        restarts = job.restarts_total
        await asyncio.sleep(min(REPEAT_BACKOFF_MAX_S, REPEAT_BACKOFF_S * 2 ** (repeats - 1)))
        async with self.lock:
            superseded = whole not in job.recoveries if whole is not None else job.restarts_total != restarts
            if job.done or not self.c.leading or superseded:
                log.info("job %s: repeat %d of %s not carried out (ended, not leading, or superseded)",
                         job.job_id, repeats, [action_name(a) for a in actions])
                return
            try:
                if not await self.c.leads():
                    # Frozen past its lease: the restart's restart_step would clear the step of the
                    # request manager the new leader runs (it takes any token not older than the
                    # newest it has seen). The recovery in the record is that leader's.
                    log.warning("job %s: repeat of %s left to the leader of a newer lease term", job.job_id,
                                [action_name(a) for a in actions])
                    return
                await self.execute_all(job, fault, actions, repeats)  # (each kill in it is fenced)
                await self.c.persist(job)
            except LeaseLost as exc:
                log.warning("job %s: repeat of %s left to the new leader: %s", job.job_id,
                            [action_name(a) for a in actions], exc)
            except Exception:  # (the escalation's own event or stop failed: Redis or NATS still away)
                log.exception("job %s: repeat %d of %s failed: carried out again", job.job_id, repeats,
                              [action_name(a) for a in actions])
                self.c.spawn(self._repeat_later(job, fault, actions, repeats + 1))

    @staticmethod
    def _whole_job_recovery(job: JobRun, fault_id: str) -> ActiveRecovery | None:
        """The whole-job restart recovery of ``fault_id`` whose start has not finished (it waits
        for nothing yet), if the job has one."""
        return next((r for r in job.recoveries
                     if r.kind == "whole_job" and r.fault_id == fault_id and not r.waiting_for), None)

    async def execute(self, job: JobRun, fault: FaultReport, action: Action) -> None:
        """Carry out one action (recorded in the event log first)."""
        whole = None
        if isinstance(action, RestartWholeJob):
            # Before any await: a restart that fails from here on is in the job (and, once saved,
            # in its record) as a recovery whose start has not finished (``interrupted``), for its
            # repeat, its deadline and a new leader (kept only in a task's memory, a repeat lost
            # with its controller hung the job: an outside review). Counted once it kills.
            whole = (self._whole_job_recovery(job, fault.fault_id)
                     or self._begin(job, fault, "whole_job", set(), counted=False))
        await self.c.event(job, "action", {"fault_id": fault.fault_id, "action": action_name(action),
                                           "member_id": getattr(action, "member_id", None)})
        match action:
            case RestartTrainerGang():
                await self._restart_trainer(job, fault, action)
            case RedispatchEpisodes(member_id=mid):
                await self.c._still_leading(job, f"killing {mid}")
                await asyncio.to_thread(self.c.launcher.kill, lid(job, mid), True)
                if mid in job.members:
                    job.members[mid].state = "dead"
                await self.c.control_rm(job, "replica_dead", {"member_id": mid, "fault_id": fault.fault_id})
            case ReplaceReplica(member_id=mid):
                await self._replace_replica(job, fault, mid)
            case RestartWholeJob() if whole is not None:  # (always: made above)
                await self._restart_whole_job(job, fault, whole)
            case ResumeService(role=role):
                await self._resume_service(job, fault, role)
            case FailJob(reason=reason):
                await self.c.stop_job(job.job_id, "failed", reason)
            case Ignore(recheck=True):
                job.recheck_after_recovery[fault.member_id] = fault
            case ReportOnly() | Ignore():
                pass  # recorded in the event log; nothing to carry out

    def _begin(self, job: JobRun, fault: FaultReport, kind: str, replacing: set[str],
               counted: bool = True) -> ActiveRecovery:
        if kind != "service" and counted:
            job.restarts_total += 1
        key = (fault.role, job.step)
        job.failures_by_step[key] = job.failures_by_step.get(key, 0) + 1
        # A recovery waiting for a member that is now itself being replaced is superseded; one
        # that waits for a lost service among others (a whole-job restart) waits on, for the
        # service's own recovery to bring it back (dropped, its fault was never recovered, and
        # its new gang had no recovery deadline).
        job.recoveries = [r for r in job.recoveries
                          if not (r.waiting_for & replacing) or (kind == "service" and r.kind != "service")]
        rec = ActiveRecovery(fault_id=fault.fault_id, role=fault.role, kind=kind, started_at=time.time(),
                             step=job.step, deadline_at=time.time() + job.spec.recovery.deadline_s,
                             replacing=replacing, committed_at_fault=job.committed_step)
        job.recoveries.append(rec)
        if not job.done:  # a stop that finished meanwhile keeps its final status
            job.status = "recovering"
        return rec

    async def _restart_trainer(self, job: JobRun, fault: FaultReport, action: RestartTrainerGang) -> None:
        old = [m.member_id for m in job.current_trainers()]
        kept = {r: mid for r, mid in action.kept.items() if mid in old and mid != fault.member_id}
        # Every rank of the broken gang but the kept ones is killed first: a kept rank's
        # collectives with them then fail at once (closed connections), and it leaves the gang.
        # Fenced first: the replica probes that chose the borrowed ones took a while, in which a
        # newer leader may have taken over and adopted these members.
        await self.c._still_leading(job, "killing the trainer gang")
        await asyncio.to_thread(self.c.launcher.kill_many, [lid(job, i) for i in old if i not in kept.values()],
                                True)
        for mid in old:
            job.members[mid].state = "dead"  # the kept ones too: they rejoin under their new ids
        rec = self._begin(job, fault, "trainer", set(old))
        if kept:
            await failpoints.hit("gang_planned")
        # Slots borrowed by a gang whose recovery this one supersedes still owe their replacement.
        owed: dict[int, int] = {}
        for fid in [f for f in job.gang_starts if f not in {r.fault_id for r in job.recoveries}]:
            owed.update(job.gang_starts.pop(fid).borrowed_slots)
        borrowed = await self._drain(job, fault, action.borrowed)
        drained = dict(borrowed)  # (a replica gone before its hand-off leaves ``borrowed``: still owed)
        try:
            new = await self.c.starter.start_gang(job, borrowed, kept)  # drops a kept rank it started anew
        except LeaseLost:
            raise  # (what it drained and kept is the new leader's, which adopts it: nothing killed here)
        except BaseException:
            # A drained replica (or a kept rank) is 'dead' to every later stop (whole-job restart,
            # stop_job, adopt): one the gang start never switched would run on untracked. Those
            # switched already run under their trainer ids and are gone from these launcher ids
            # (kill is a no-op). Fenced: a newer leader may have adopted them meanwhile.
            await self.c._still_leading(job, "killing what a failed gang start drained")
            await asyncio.to_thread(self.c.launcher.kill_many,
                                    [lid(job, mid) for mid in [*drained.values(), *kept.values()]], True)
            raise
        sources = ["survivor" if r in kept else "borrowed" if r in borrowed else
                   "spare" if self.c.launcher.was_warm(lid(job, mid)) else "cold" for r, mid in enumerate(new)]
        slots = {job.members[b].index: job.members[b].epoch for b in drained.values() if b in job.members}
        # In the job's durable record: a controller that fails over before the gang is ready hands
        # the slots owed a replacement to the next leader (and the recovery's source).
        job.gang_starts[fault.fault_id] = GangStart(sources, {**owed, **slots})
        rec.waiting_for = {new[0]}
        await self.c.persist(job)
        await self._ready_already(job, rec)
        if slots:
            await failpoints.hit("gang_borrowed")

    async def _drain(self, job: JobRun, fault: FaultReport, borrowed: dict[int, str]) -> dict[int, str]:
        """Take the replicas a gang borrows out of the rollout pool: the request manager
        re-dispatches their in-flight turns from the saved prefixes and never dispatches to them
        again (the same path as a dead replica), before their processes switch role.

        Returns:
            rank -> replica, for the replicas still running (the others' ranks start as usual).
        """
        taken = {r: mid for r, mid in borrowed.items()
                 if (m := job.members.get(mid)) is not None and m.state not in ("exited", "stopped", "dead")}
        for rank, mid in taken.items():
            job.members[mid].state = "dead"  # no longer a rollout member: faults about it are stale
            await self.c.event(job, "replica_borrowed", {"fault_id": fault.fault_id, "member_id": mid,
                                                         "rank": rank, "epoch": job.epoch + 1})
        acked = await asyncio.gather(*(self.c.control_rm(job, "replica_dead", {"member_id": mid,
                                                                               "fault_id": fault.fault_id,
                                                                               "reason": "borrowed"})
                                       for mid in taken.values()))
        # A replica the request manager did not hear is gone from the pool may still be sent
        # turns: it must not train on the same model. It is killed (the request manager learns of
        # it as of any dead replica: resume's replicas_dead, turn deadlines) and its rank starts.
        unheard = [r for r, ok in zip(taken, acked, strict=True) if not ok]
        if unheard:
            await self.c._still_leading(job, "killing the borrowed replicas the request manager did not hear")
            await asyncio.to_thread(self.c.launcher.kill_many, [lid(job, taken[r]) for r in unheard], True)
            await self.owe(job, {job.members[taken[r]].index: job.members[taken[r]].epoch for r in unheard})
        return {r: mid for r, mid in taken.items() if r not in unheard}

    async def owe(self, job: JobRun, slots: dict[int, int]) -> None:
        """Rollout slots are owed a replacement replica now (slot -> the incarnation borrowed from
        it): recorded durably first, then restocked in the background."""
        if not slots:
            return
        job.restock_owed.update(slots)
        await self.c.persist(job)
        self.spawn_restock(job)

    def spawn_restock(self, job: JobRun) -> None:
        """Start the job's restock loop, or wake the one running (it re-reads what is owed)."""
        wake = self._restocking.get(job.job_id)
        if wake is not None:
            wake.set()
        else:
            self.c.spawn(self.restock(job))

    async def restock(self, job: JobRun) -> None:
        """The pool returns to its size: one new incarnation per slot in ``job.restock_owed``. A
        slot restarted meanwhile (a whole-job restart) is left alone. Each slot leaves the owed
        record only once its replacement has started (a new leader restocks what is still in it).
        A slot whose start failed stays owed and is tried again with exponential back-off
        (``RESTOCK_RETRY_MIN_S`` .. ``RESTOCK_RETRY_MAX_S``, a ``restock_failed`` event per failed
        attempt) until it starts, the job ends or this controller stops leading."""
        await failpoints.hit("restock")
        if job.job_id in self._restocking:  # one loop per job (this one was spawned before it)
            self._restocking[job.job_id].set()
            return
        wake = self._restocking[job.job_id] = asyncio.Event()
        attempts: dict[int, int] = {}

        async def nap(seconds: float) -> None:  # the back-off, cut short by newly owed slots
            await wait_event(wake, seconds)
            wake.clear()

        try:
            while True:
                async for attempt in AsyncRetrying(
                        wait=wait_exponential(multiplier=RESTOCK_RETRY_MIN_S, max=RESTOCK_RETRY_MAX_S),
                        # Any error (Redis or NATS away, too): a restock given up is a pool short for good.
                        retry=retry_if_exception_type(Exception), sleep=nap, reraise=True,
                        before_sleep=before_sleep_log(log, logging.WARNING)):
                    with attempt:
                        wake.clear()
                        await self._restock_pass(job, attempts)
                # A slot owed while the last pass ended (its wake-up came to this loop): go again.
                if not (wake.is_set() and job.restock_owed and not job.done and self.c.leading):
                    break
        finally:
            del self._restocking[job.job_id]

    async def _restock_pass(self, job: JobRun, attempts: dict[int, int]) -> None:
        """Start a replacement for every slot owed, once each (slots owed meanwhile included).
        Raises SlotsStillOwed if one failed."""
        failed: list[int] = []
        # (slot, incarnation owed): a slot owed again during the pass, for a newer borrow of its
        # replacement, is started again in it; a slot whose start failed waits for the back-off.
        tried: set[tuple[int, int]] = set()
        while todo := sorted((s, i) for s, i in job.restock_owed.items() if (s, i) not in tried and s not in failed):
            slot, owed_inc = todo[0]
            tried.add((slot, owed_inc))
            # The checks and the planned incarnation under the recovery lock; the launcher's start
            # (seconds for a Ray actor, a container) outside it, so that a trainer fault arriving
            # meanwhile is handled at once; the outcome under the lock again, where whatever
            # happened meanwhile (a whole-job restart, the job's end) is seen and the start undone.
            async with self.lock:
                if job.done or not self.c.leading:
                    return
                if job.restock_owed.get(slot) != owed_inc:
                    continue  # restocked by a concurrent pass (or owed again, for a newer borrow)
                if job.slot_incarnation.get(slot, 0) != owed_inc:
                    del job.restock_owed[slot]
                    await self.c.persist(job)
                    continue
                planned = job.members.get(replica_id(slot, owed_inc))
                if planned is not None and planned.handle and planned.state not in ("exited", "stopped", "dead"):
                    # Started by the previous leader, which died before it wrote the handle; this
                    # leader found and adopted it (MemberStarter.adopt): the slot is restocked.
                    job.restock_owed.pop(slot, None)
                    self._wait_for_restocked(job, slot, planned.member_id)
                    await self.c.event(job, "replica_restocked", {"member_id": planned.member_id, "slot": slot,
                                                                  "adopted": True})
                    await self.c.persist(job)
                    continue
                inc = job.slot_incarnation.get(slot, -1) + 1  # what start_replica takes, before its first await

            async def intent(job_: JobRun, slot: int = slot) -> bool | None:
                # Durable before the launcher starts anything: the slot owed at the planned
                # incarnation, whose member is recorded as starting (MemberStarter.start_replica).
                job_.restock_owed[slot] = job_.slot_incarnation[slot]
                return await self.c.persist(job_)

            # No await between the lock's checks above and start_replica's first await (after it
            # took incarnation ``inc`` and recorded the member as starting): nothing interleaves.
            try:
                mid = await self.c.starter.start_replica(job, slot, intent)
            except LeaseLost:
                raise  # a newer controller leads: it restocks what its record owes
            except StartSuperseded as exc:
                # The slot was started anew meanwhile (a whole-job restart): the start stopped what
                # it began, and the slot is not owed. A race, not a failure (no traceback).
                log.warning("job %s: restock of rollout slot %d given up: %s", job.job_id, slot, exc)
                continue
            except Exception as exc:  # the other slots are still owed theirs
                log.exception("job %s: restocking rollout slot %d failed", job.job_id, slot)
                async with self.lock:
                    planned = job.members.get(replica_id(slot, inc))
                    if planned is not None and planned.handle:
                        # It started, and what failed came after (its handle's write: Redis away):
                        # stopped, or it would run beside the slot's next incarnation.
                        await asyncio.to_thread(self.c.launcher.stop, lid(job, planned.member_id), 1.0)
                        planned.state = "stopped"
                    if job.slot_incarnation.get(slot) != inc:
                        continue  # the slot was restarted meanwhile (a whole-job restart): not owed
                    # A failed start used up its incarnation (a retry must not reuse the name of
                    # what it may have left behind): the slot stays owed at that incarnation, or the
                    # next pass would take it for a slot restarted meanwhile and drop it.
                    job.restock_owed[slot] = inc
                    attempts[slot] = attempts.get(slot, 0) + 1
                    failed.append(slot)
                    await self.c.persist(job)
                    await self.c.event(job, "restock_failed", {"slot": slot, "attempt": attempts[slot],
                                                               "error": f"{type(exc).__name__}: {exc}"[:300]})
                continue
            async with self.lock:
                member = job.members.get(mid)
                if job.done or job.slot_incarnation.get(slot) != inc:
                    # The job ended, or the slot was started anew meanwhile (a whole-job restart
                    # kills every member it knows of, this one perhaps before its launcher did,
                    # and starts a new incarnation of every slot): this replica would run untracked.
                    log.warning("job %s: replica %s started as the %s: stopping it", job.job_id, mid,
                                "job ended" if job.done else "slot was started anew meanwhile")
                    await asyncio.to_thread(self.c.launcher.stop, lid(job, mid), 1.0)
                    if member is not None:
                        member.state = "stopped"
                    if job.restock_owed.get(slot) == inc:
                        del job.restock_owed[slot]
                    if job.done:
                        return
                    await self.c.persist(job)
                    continue
                if member is not None and member.state not in ("exited", "stopped", "dead"):
                    job.restock_owed.pop(slot, None)
                    self._wait_for_restocked(job, slot, mid)
                # else: borrowed in turn while it started (owed again at this incarnation, left so)
                await self.c.event(job, "replica_restocked", {"member_id": mid, "slot": slot})
                await self.c.persist(job)
        if failed and not job.done and self.c.leading:
            raise SlotsStillOwed(f"job {job.job_id}: rollout slots {failed} still owed a replacement")

    @staticmethod
    def _wait_for_restocked(job: JobRun, slot: int, mid: str) -> None:
        """A replica recovery of ``slot`` that waits only for replacements that never ran (a leader
        died between saving one and starting it; a restock of it failed in turn) waits for the
        slot's restocked replica ``mid`` instead: else it waited for a dead id until its deadline
        escalated to a whole-job restart."""
        for rec in job.recoveries:
            if rec.kind != "replica" or not rec.waiting_for or mid in rec.waiting_for:
                continue
            waited = [job.members.get(w) for w in rec.waiting_for]
            if all(m is not None and m.role == "rollout" and m.index == slot
                   and m.state in ("dead", "exited", "stopped") for m in waited):
                rec.waiting_for = {mid}

    def resume_restock(self, job: JobRun) -> None:
        """After a takeover: restock the slots the previous leader still owed, including those of
        a gang whose recovery ended without its slots being moved to the owed record."""
        active = {r.fault_id for r in job.recoveries}
        for fid in [f for f in job.gang_starts if f not in active]:
            job.restock_owed.update(job.gang_starts.pop(fid).borrowed_slots)
        if job.restock_owed and not job.done:
            log.warning("job %s: restocking rollout slots %s owed by the previous leader", job.job_id,
                        sorted(job.restock_owed))
            self.spawn_restock(job)

    async def _replace_replica(self, job: JobRun, fault: FaultReport, member_id: str) -> None:
        old = job.members.get(member_id)
        if old is None:
            return
        await self.c._still_leading(job, f"killing {member_id}")
        await asyncio.to_thread(self.c.launcher.kill, lid(job, member_id), True)
        old.state = "dead"
        rec = self._begin(job, fault, "replica", {member_id})
        slot = old.index
        inc = job.slot_incarnation.get(slot, -1) + 1  # what start_replica takes, before its first await
        rec.waiting_for = {replica_id(slot, inc)}

        async def intent(job_: JobRun) -> bool | None:
            # Durable before the launcher starts anything, as a restock's: the slot owed at the
            # planned incarnation, its member recorded as starting. A leader that dies between the
            # start and the handle's write leaves the next one a member to find (MemberStarter.adopt)
            # or, never started, a slot to restock. Saved only after the start, the replacement's
            # id was unknown to the next leader, which handled the crash again and started a second
            # process under the same id.
            job_.restock_owed[slot] = inc
            return await self.c.persist(job_)

        try:
            await self.c.starter.start_replica(job, slot, intent)
        finally:
            # Started (or failed: what follows the failure decides, as before): no longer owed,
            # unless a borrow owes the slot anew meanwhile (a newer incarnation).
            if job.restock_owed.get(slot) == inc:
                del job.restock_owed[slot]
        await self.c.persist(job)

    async def _restart_whole_job(self, job: JobRun, fault: FaultReport, rec: ActiveRecovery) -> None:
        """ByteRobust-style in-place restart: stop every role, restart all in parallel from the
        last checkpoint, regenerate the current step from scratch."""
        # Fenced before the request manager's restart_step too: it takes any token not older than
        # the newest it has seen, and from a leader deposed before the new one's first command it
        # cleared the step's episodes under the job the new leader runs (an outside review).
        await self.c._still_leading(job, "restarting the request manager's step for a whole-job restart")
        await self.c.control_rm(job, "restart_step", {"fault_id": fault.fault_id})
        ids = [m.member_id for m in job.live() if m.role in ("trainer", "rollout")]
        # Fenced after the request manager's answer, which may have taken its whole bound (20 s):
        # a leader deposed meanwhile killed every member the new leader had adopted (``stop_job``
        # checks the same before its stop; an outside review).
        await self.c._still_leading(job, "killing every member for a whole-job restart")
        await asyncio.to_thread(self.c.launcher.kill_many, [lid(job, i) for i in ids], True)
        for mid in ids:
            job.members[mid].state = "dead"
        job.restarts_total += 1
        job.recoveries[:] = [rec]  # a whole-job restart supersedes any local recovery in progress
        rec.replacing = set(ids)
        job.gang_starts.clear()  # superseded: start_all starts a new incarnation of every slot
        job.restock_owed.clear()
        gang, replicas = await self.c.starter.start_all(job)
        # A request manager still lost (its own recovery, superseded here, escalated to this) is
        # waited for too: else nothing watched it again (``watch_services`` skips a lost role) and
        # the job ran on with nothing generating, for good. Its answer (``service_back``) or this
        # recovery's deadline ends the wait.
        rec.waiting_for = {gang[0], *replicas, *(job.services_lost & {"request_manager"})}
        await self.c.persist(job)
        await self._ready_already(job, rec)
        await self.c.resume_rm(job)

    async def resume_waits(self, job: JobRun) -> None:
        """After a takeover: the members the job's recoveries wait for that are ready in its record
        end those waits now. A leader that died between saving a member ready and ending the wait
        (``progress``), or between saving the wait and ``_ready_already``, left a recovery waiting
        for a member nothing announces again (a hello is answered once): it waited for its
        deadline and escalated to a whole-job restart (an outside review)."""
        for rec in list(job.recoveries):
            if rec in job.recoveries:
                await self._ready_already(job, rec)

    async def _ready_already(self, job: JobRun, rec: ActiveRecovery) -> None:
        """Count as arrived the members ``rec`` waits for that were ready before it waited: a
        start returns after its members run, and a new rank 0's hello (or a replica's
        announcement) handled in between was news to no recovery; answered, it was never sent
        again, and the recovery waited for it until its deadline escalated to a whole-job
        restart (an outside review: a slow ``member_started`` save of the last rank)."""
        for mid in list(rec.waiting_for):
            m = job.members.get(mid)
            if m is None or not job.is_current(mid):
                continue
            ready = (m.state == "ready" and m.epoch == job.epoch if m.role == "trainer"
                     else m.state == "ready" and m.weights_version >= job.weights_version)
            if ready and rec in job.recoveries:
                await self.progress(job, mid)

    async def _resume_service(self, job: JobRun, fault: FaultReport, role: str) -> None:
        """The lost service is restarted by its supervisor; send it ``resume`` until it answers
        (in a task: the deadline check escalates if it never does)."""
        job.services_lost.add(role)
        rec = self._begin(job, fault, "service", {role})
        rec.waiting_for = {role}
        if role == "request_manager":
            self.c.spawn(self._resume_rm(job, rec))
        else:
            # The detector needs no command: it rebuilds its per-member state from the next
            # metrics. It is back once it is heard from again (see Supervisor.watch_services).
            pass

    async def _resume_rm(self, job: JobRun, rec: ActiveRecovery) -> None:
        await self.c.reconcile(job, "request manager lost")
        as_of = job.rm_supersede_seq
        while rec in job.recoveries and not job.done:
            if job.rm_supersede_seq != as_of:
                # A restart_step (a whole-job restart) was sent since: its own resume follows it,
                # and one of this loop arriving after it would undo it mid-restart.
                log.warning("job %s: request-manager resume superseded by a later command", job.job_id)
                return
            # Replicas that died while it was away: it must not dispatch to them.
            dead = sorted(m.member_id for m in job.members.values()
                          if m.role == "rollout" and (not job.is_current(m.member_id) or m.state == "dead"))
            args = {"start_step": job.step, "committed": job.committed_step, "replicas_dead": dead}
            if await self.c.control_rm(job, "resume", args, attempts=1, timeout_s=SERVICE_RESUME_ATTEMPT_S,
                                       quiet=True):
                await self.service_back(job, "request_manager")
                return

    async def service_back(self, job: JobRun, role: str) -> None:
        """A lost control-plane service answers again."""
        job.service_seen_at[role] = time.monotonic()
        job.services_lost.discard(role)
        # (whether or not this controller saw it lost: ``services_lost`` is not in the job's
        # record, a recovery waiting for it is, and a new leader must end that wait too)
        await self.progress(job, role)

    # --- progress and deadlines --------------------------------------------------------------

    async def progress(self, job: JobRun, member_id: str) -> None:
        """``member_id`` is ready (hello, current weights, service answering): finish the
        recoveries that were waiting only for it."""
        for rec in list(job.recoveries):
            if member_id not in rec.waiting_for:
                continue
            rec.waiting_for.discard(member_id)
            if rec.waiting_for:
                continue
            job.recoveries.remove(rec)
            took = time.monotonic() - rec.clock_start
            gang = job.gang_starts.pop(rec.fault_id, None)
            if gang is not None and gang.borrowed_slots:
                # Moved to the owed record in the same step as the pop: a persist from here on
                # (ours below, or another coroutine's while the events are emitted) must never
                # write a record that has neither the gang start nor its owed slots.
                job.restock_owed.update(gang.borrowed_slots)
            recovery_s = None
            for f in job.faults:
                if f["fault_id"] == rec.fault_id:
                    f["recovery_s"] = recovery_s = time.time() - f["detected_at"]
                    if gang is not None:
                        f["source"] = gang.source
            extra = {} if gang is None else {"source": gang.source, "sources": gang.sources,
                                             "recovery_s": recovery_s if recovery_s is not None else took}
            await self.c.event(job, "recovered", {"fault_id": rec.fault_id, "role": rec.role,
                                                  "kind": rec.kind, "took_s": took, **extra})
            if rec.kind in ("trainer", "whole_job") and job.recheck_after_recovery:
                self.c.spawn(self._recheck(job))
            if rec.kind in ("trainer", "whole_job"):
                # Steps that were committed but not durable are redone by the new gang.
                redone = max(0, rec.committed_at_fault - job.durable_step)
                await self.c.event(job, "work_lost", {"fault_id": rec.fault_id, "tokens": 0,
                                                      "steps_redone": redone})
            if not job.recoveries and job.status == "recovering":
                # (a recovery over while the first members still start: the job is pending still)
                job.status = "running" if job.launched else "pending"
            await self.c.persist(job)
            if gang is not None and gang.borrowed_slots:
                # Restocked once the gang is ready: a borrowed recovery takes about a second, and the
                # replacements' cold imports would otherwise take the CPU from the replicas still
                # generating and from the gang forming (on a cluster a replacement gets its own machine).
                await self.owe(job, gang.borrowed_slots)

    @staticmethod
    def interrupted(job: JobRun) -> ActiveRecovery | None:
        """A gang or whole-job recovery whose start did not finish: the record holds it with
        nothing to wait for (the members it waits for are set once the start returns), so the
        leader that started it went before then."""
        return next((r for r in job.recoveries if r.kind in ("trainer", "whole_job") and not r.waiting_for), None)

    async def resume_interrupted(self, job: JobRun) -> None:
        """After a takeover: a recovery whose start the previous leader did not finish is
        restarted whole now (what it had started unrecorded was stopped by the takeover). Left to
        its deadline (``recovery.deadline_s``), the job waited that long for members no record
        names, and the escalation's restart would have left those running untracked.

        An attempt that fails (a Redis or NATS blip: the takeover is when the stores were likely
        away) is tried again, backing off (``RESUME_RETRY_MIN_S``..``RESUME_RETRY_MAX_S``), until
        the recovery's deadline: a failure left it to that deadline, the job waiting for nothing.

        Raises:
            LeaseLost: a newer lease term began (that leader restarts it).
        """
        first = self.interrupted(job)
        if first is None:
            return
        async for attempt in AsyncRetrying(
                wait=wait_exponential(multiplier=RESUME_RETRY_MIN_S, max=RESUME_RETRY_MAX_S),
                stop=stop_after_delay(max(RESUME_RETRY_FLOOR_S, first.clock_start + job.spec.recovery.deadline_s
                                          - time.monotonic())),
                # (a cancellation, at close, is never retried: tenacity's attempt catches BaseException)
                retry=retry_if_exception_type(Exception) & retry_if_not_exception_type(LeaseLost), reraise=True,
                before_sleep=before_sleep_log(log, logging.WARNING)):
            with attempt:
                async with self.lock:
                    rec = self.interrupted(job)  # (again: restarted, escalated or ended meanwhile)
                    if rec is None or job.done or not self.c.leading:
                        return
                    if not await self.c.leads():
                        raise LeaseLost(f"job {job.job_id}: a newer lease term began before the interrupted "
                                        f"{rec.kind} recovery was started again")
                    now = time.time()
                    view = next(v for v in job_view(job).recovering if v.fault_id == rec.fault_id)
                    decision = decide_mod.recovery_failed(time.monotonic(), job_view(job), view, "its start was interrupted by a "
                                                          "change of controller", job.spec.recovery)
                    # Under the interrupted recovery's own fault id: its restart's recovered and
                    # work_lost events must close that fault (the run report and ETTR match them by id).
                    fault = FaultReport(job_id=job.job_id, fault_id=rec.fault_id,
                                        role=rec.role,  # type: ignore[arg-type]
                                        member_id="controller", kind="unresponsive", evidence=decision.reason,
                                        detected_at=now, step=job.step)
                    await self.c.event(job, "decision", {"fault_id": rec.fault_id, "actions": decision.names(),
                                                         "reason": decision.reason})
                    await self.execute_all(job, fault, decision.actions)
                    await self.c.persist(job)

    def resume_rechecks(self, job: JobRun) -> None:
        """After a takeover: the weights faults the previous leader ignored during a trainer
        recovery are looked at again, ``weights_load_s`` from now (or once the recovery it
        recorded as under way is over: its end starts the recheck)."""
        if job.recheck_after_recovery and not job.done and not self._trainer_recovering(job):
            log.warning("job %s: weights faults of %s ignored by the previous leader looked at again in %g s",
                        job.job_id, sorted(job.recheck_after_recovery), job.spec.detector.weights_load_s)
            self.c.spawn(self._recheck(job))

    @staticmethod
    def _trainer_recovering(job: JobRun) -> bool:
        return any(r.kind in ("trainer", "whole_job") for r in job.recoveries)

    async def _recheck(self, job: JobRun) -> None:
        """Weights faults of replicas ignored while the trainer recovery ran: ``weights_load_s``
        after it, a replica still unable to load (phase ``weights_failed`` / ``loading_weights``:
        it had the new gang's announcement and that long to pull it) is a fault after all.

        Each fault stays in the job (and its record) until it is looked at: a leader that dies in
        the wait leaves them to the next (``resume_rechecks``). Another trainer recovery begun
        meanwhile leaves them all to its own end."""
        await asyncio.sleep(job.spec.detector.weights_load_s)
        if job.done or self._trainer_recovering(job):
            return
        failed = False
        for member_id, fault in list(job.recheck_after_recovery.items()):
            if job.recheck_after_recovery.get(member_id) is not fault:
                continue  # looked at by another recheck meanwhile (one per recovery end or takeover)
            m = job.members.get(member_id)
            if (m is not None and job.is_current(member_id) and m.state not in ("dead", "exited", "stopped")
                    and _still_failing_weights(job, m, fault)):  # (else: loaded since, or gone)
                again = fault.model_copy(update={
                    "fault_id": f"{fault.fault_id}-after-recovery", "detected_at": time.time(),
                    "evidence": f"{fault.evidence}; still {m.phase} {job.spec.detector.weights_load_s:g} s "
                                "after the trainer recovery"})
                try:
                    await self._handle_retried(again, RECHECK_RETRY_S)
                except LeaseLost:
                    raise
                except Exception as exc:
                    # Kept (and in the record) and looked at again below: dropped before it was
                    # handled, a replica stuck in weights_failed was never replaced (the detector
                    # reports a member once; an outside review).
                    log.error("job %s: the recheck of %s failed (%s): looked at again in %g s", job.job_id,
                              member_id, exc, job.spec.detector.weights_load_s)
                    failed = True
                    continue
            if job.recheck_after_recovery.get(member_id) is fault:
                del job.recheck_after_recovery[member_id]
        await self.c.persist(job)
        if failed and not job.done:
            self.c.spawn(self._recheck(job))

    async def _handle_retried(self, fault: FaultReport, within_s: float) -> None:
        """``handle(fault)``, tried again (0.5 s doubling to 5 s) for ``within_s`` while it fails
        with anything but a lost lease (a Redis stall on its lease read, a record write)."""
        async for attempt in AsyncRetrying(
                wait=wait_exponential(multiplier=0.5, max=5.0), stop=stop_after_delay(within_s),
                retry=retry_if_exception_type(Exception) & retry_if_not_exception_type(LeaseLost), reraise=True,
                before_sleep=before_sleep_log(log, logging.WARNING)):
            with attempt:
                await self.handle(fault)

    def _unstartable(self, job: JobRun, late: ActiveRecovery, decision: Decision) -> Decision:
        """The members ``late`` started that are still starting past ``detector.start_deadline_s``
        (the limit of a healthy start; while a recovery runs the start deadline times no one,
        this deadline looks) failed their starts: with a trainer gang, every current rank still
        starting (the recovery waits for rank 0 only; a hung rank holds the others in the
        rendezvous). A slot that failed ``STARTUP_FAILURES_MAX`` starts in a row cannot start: the
        job fails instead of restarting once more (before, a start that hung in every incarnation
        went through ``max_restarts``, a recovery deadline each). Each member is counted once per
        recovery (``ActiveRecovery.starts_counted``, in the job's record): an escalation that raised,
        tried again, and a leader taking over count nobody twice."""
        now = time.monotonic()
        bound = job.spec.detector.start_deadline_s
        gang = late.role == "trainer" or late.kind == "whole_job"  # (a whole-job restart started a gang too)
        stuck = [m for m in job.members.values()
                 if job.is_current(m.member_id) and still_starting(m) and now - m.clock_start > bound
                 and (m.member_id in late.waiting_for or (gang and m.role == "trainer"))
                 and m.member_id not in late.starts_counted]
        counted = []
        for m in sorted(stuck, key=lambda m: m.member_id):
            late.starts_counted.add(m.member_id)
            counted.append((job.failed_start(m), m))
        failures, m = max(counted, key=lambda fm: fm[0], default=(0, None))
        if m is None or failures < STARTUP_FAILURES_MAX:
            return decision
        names = ", ".join(x.member_id for x in stuck)
        reason = (f"{m.role} slot {m.index} did not finish starting {failures} times in a row: it cannot "
                  f"start. Still starting past start_deadline_s={bound:g} when the recovery's deadline "
                  f"passed: {names}. {decision.reason}")
        return Decision([FailJob(reason)], reason)

    async def check_deadlines(self, job: JobRun) -> None:
        if job.done or not job.recoveries:
            return
        if decide_mod.check_recovery(time.monotonic(), job_view(job), job.spec.recovery) is None:
            return
        async with self.lock:
            # Decide again under the lock: a recovery may have finished or been replaced meanwhile.
            decision = decide_mod.check_recovery(time.monotonic(), job_view(job), job.spec.recovery)
            if decision is None or not job.recoveries or job.done:
                return
            if not await self.c.leads():
                # Frozen past its lease (longer than the deadline): the escalation would kill the
                # members the new leader runs now. It is that leader's to judge.
                log.warning("job %s: recovery deadline passed, but a newer lease term has begun: "
                            "not escalating", job.job_id)
                return
            late = min(job.recoveries, key=lambda r: r.clock_start)
            fault = FaultReport(job_id=job.job_id, fault_id=f"{late.fault_id}-late", role=late.role,  # type: ignore[arg-type]
                                member_id=next(iter(late.waiting_for), "controller"), kind="unresponsive",
                                evidence=decision.reason, detected_at=time.time(), step=job.step)
            decision = self._unstartable(job, late, decision)
            await self.c.event(job, "decision", {"fault_id": late.fault_id, "actions": decision.names(),
                                                 "reason": decision.reason})
            await self.execute_all(job, fault, decision.actions)


def _still_failing_weights(job: JobRun, m: MemberInfo, fault: FaultReport) -> bool:
    """Whether replica ``m``, reported by ``fault`` during a trainer recovery, still fails to load
    weights: in ``weights_failed`` / ``loading_weights`` (the detector's causes), or, for the
    request manager's ``weights_deadline``, still below the version the reported step needed
    (such a replica may say ``serving`` on its old version: the phase alone dropped it)."""
    if m.phase in ("weights_failed", "loading_weights"):
        return True
    if fault.cause == "weights_deadline" and fault.step is not None:
        return m.weights_version < job.spec.min_version(fault.step)
    return False
