"""The controller runtime: jobs, leadership, messages from members, the job registry.

Workers report, the controller decides. The parts live in their own modules:
:mod:`.launching` (member environment, gangs, replicas, re-attaching), :mod:`.supervision`
(exits, start-up crash loops, control-plane silences, deadlines), :mod:`.recovery` (fault intake,
handled once; the typed action executor), :mod:`.chaos` (fault injection), :mod:`.lease` (one
controller acts at a time), :mod:`.eventlog` (the fault inbox), :mod:`.outbox` (every event owed in
Redis until JetStream stored it; who waits for an append), :mod:`.takeover` (restoring the jobs).

A restarted controller (or a standby taking over) resumes the jobs it finds in the registry: it
catches up on steps committed meanwhile from the event log, re-attaches to the members that are
still running, treats the ones that are gone as crashed, and restarts no healthy member.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from tenacity import (
    AsyncRetrying,
    before_sleep_log,
    retry_if_exception_type,
    retry_if_not_exception_type,
    stop_after_delay,
    wait_exponential,
)
from redis.exceptions import RedisError

from robustrl.aio import cancel_and_wait, wait_event, within
from robustrl.bus import Bus
from robustrl.config import JobSpec, Settings
from robustrl.errors import JobError, LaunchError, RequestTimeout, StorageError, TransportError
from robustrl.event_outbox import stored_of
from robustrl.launcher.base import Launcher
from robustrl.messages import (
    ChaosRequest, ControlCommand, FaultReport, HelloAck, MemberHello, MetricsSample, PhaseChange, SpecReply,
    SpecRequest, StepCommitted, WeightsHave,
)
from robustrl.services.controller import failpoints, outbox
from robustrl.services.controller.chaos import ChaosInjector
from robustrl.services.controller.eventlog import FaultInbox
from robustrl.services.controller.deletion import JobDeleter
from robustrl.services.controller.jobs import JobRun
from robustrl.services.controller.launching import MemberStarter, StartSuperseded, lid
from robustrl.services.controller.lease import LeaderLease, LeaseLost
from robustrl.services.controller.outbox import ControllerEvents
from robustrl.services.controller.recovery import RecoveryExecutor
from robustrl.services.controller.retention import RetentionSweeper
from robustrl.services.controller.supervision import Supervisor
from robustrl.services.controller.takeover import Restorer
from robustrl.services.request_manager.eventlog import STOP_DRAIN_S as RM_STOP_DRAIN_S
from robustrl.storage.fencing import read_gang
from robustrl.storage.control_stores import JobRegistry, OutboxEntry
from robustrl.storage.redis_stores import BatchStore, Keys
from robustrl.subjects import Verb, all_jobs, all_jobs_exact, subject

log = logging.getLogger(__name__)

RECONCILE_TIMEOUT_S = 10.0
"""Bound on reading a job's event log to catch up (after a reconnect, a lease re-acquire)."""
RM_ACK_TIMEOUT_S = 2.0
RM_RESUME_RETRY_S = 5.0
"""How often a resume the request manager has not acknowledged is sent again (``JobRun.rm_resume_owed``)."""
SUPERSEDES_RESUME = ("pause", "restart_step", "stop")
"""Request-manager commands after which an earlier resume must not arrive."""
RM_ACK_ATTEMPTS = 10
"""Attempts of a command to the request manager, each ``RM_ACK_TIMEOUT_S`` (they span its
restart); ``ROBUSTRL_RM_ACK_ATTEMPTS`` overrides."""
FINISH_GRACE_S = 15.0
"""A finished job's members: their stop grace (the last checkpoint is durable by then: see
``FINISH_DURABLE_WAIT_S``)."""
FINISH_DURABLE_WAIT_S = 420.0
"""How long a job whose every step is committed waits, its members live, for the last step's
checkpoint to be durable (the gang's fenced record), before it is stopped all the same (noted in
its log): as long as a rank waits for its upload (``checkpoint.UPLOAD_WAIT_S`` 300 s +
``SHARD_WAIT_S`` 120 s, not imported: the controller does not import torch). Time spent in a
trainer recovery meanwhile is not counted. The members are not stopped before: a rank lost
during the upload is then a trainer fault, recovered, and the steps not durable are trained
again (an outside review: marked stopped first, the rank's loss was an expected exit and the job
ended ``finished`` with its last steps' model nowhere)."""
FINISH_POLL_S = 0.5
"""Period of that wait's read of the gang's durable step."""
FINAL_EVENT = {"finished": "job_finished", "failed": "job_failed"}
PROGRESS_CHECK_S = 2.0
"""Period of the leader's check of each job's durable trained log against the commits it heard."""
CLOSE_TASK_WAIT_S = 2.0
"""At close, per cancellation of a task (``cancel_and_wait`` cancels up to 3 times)."""
CLOSE_ROUNDS = 3
"""At close, rounds of cancellation: tasks spawned by the tasks being cancelled are cancelled too."""
LAUNCHER_CLOSE_S = 60.0
"""At close, the wait for the launcher to stop every member (its thread runs on past it)."""
FAIL_START_RETRY_MAX_S = 10.0
EVENTS_SETTLE_S = 30.0
"""How long a stop waits, before it stops the members, for the job's event outboxes to be empty
(``_events_settled``: a JetStream outage at the job's end; JetStream's own retry budget)."""
EVENTS_SETTLE_LOCKED_S = 5.0
"""The same, while the recovery lock is held (every job's faults wait behind it)."""
EVENTS_SETTLE_LOOKUP_S = 2.0
"""How often that wait looks the entries still owed up in the log (stored, their removal failed)."""
EVENTS_SETTLE_POLL_S = 0.25
EVENTS_SETTLE_CALL_S = 1.0
STOP_RETRY_MAX_S = 30.0
"""Longest pause before a stop that failed part-way is carried out again (``retry_stops``)."""
"""A job whose start failed is failed; a Redis error on the way is retried, backing off to this."""


class Controller:
    def __init__(self, bus: Bus, redis: Any, launcher: Launcher, settings: Settings,
                 lease_ttl_s: float | None = None, owner: str | None = None,
                 member_credentials: dict[str, dict[str, str]] | None = None,
                 rm_ack_attempts: int | None = None) -> None:
        self.bus = bus
        self.rm_ack_attempts = rm_ack_attempts or RM_ACK_ATTEMPTS
        self.redis = redis
        self.launcher = launcher
        self.settings = settings
        self.registry = JobRegistry(redis)
        self.jobs: dict[str, JobRun] = {}
        self.owner = owner or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.lease = LeaderLease(redis, self.owner, **({"ttl_s": lease_ttl_s} if lease_ttl_s else {}))
        self.leading = False
        self.lost_leadership = asyncio.Event()
        """Set when another controller took the lease: this process must stop acting (exit)."""
        self.events = ControllerEvents(bus, redis)
        self.starter = MemberStarter(bus, launcher, settings, member_credentials,
                                     fence=lambda: self.lease.token, newest_epoch=self._fenced_epoch,
                                     persist=self.persist, leads=self.leads_patiently,
                                     adopted_elsewhere=self._adopted_elsewhere, emit=self.events.emit)
        self.restorer = Restorer(self)
        self.recovery = RecoveryExecutor(self)
        self.supervisor = Supervisor(self)
        self.chaos = ChaosInjector(self)
        self.deleter = JobDeleter(self)
        self.retention = RetentionSweeper(self)
        self.deletions_owed: dict[str, dict[str, Any]] = {}
        """Deletions a previous leader marked and did not finish, resumed once this one leads."""
        self.inbox = FaultInbox(bus, self._inbox_fault)
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._finishing: set[str] = set()
        """Jobs whose every step is committed, waiting for the last one to be durable (``_finish``)."""
        self._persist_locks: dict[str, asyncio.Lock] = {}
        self._stopping: dict[str, dict[str, Any]] = {}
        """Stops under way (``stop_job``), by job: the members they stop, whether the final event is
        appended; removed once the final status is saved."""
        self._unled_commits: dict[str, StepCommitted] = {}
        """The newest commit heard per job while not leading (a standby, a leader restoring its jobs),
        applied once this controller leads."""

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Subscribe, then lead (now, or later as hot standby); returns at once."""
        b = self.bus
        b.on_reconnect.append(self._after_reconnect)
        await b.ensure_event_stream()
        await b.subscribe(all_jobs_exact(Verb.SPEC), SpecRequest, self._on_spec)
        await b.subscribe(all_jobs_exact(Verb.FAULT), FaultReport, self._on_fault)
        await b.subscribe(all_jobs_exact(Verb.COMMIT), StepCommitted, self._on_commit)
        await b.subscribe(all_jobs(Verb.HELLO), MemberHello, self._on_hello)
        await b.subscribe(all_jobs(Verb.PHASE), PhaseChange, self._on_phase)
        await b.subscribe(all_jobs(Verb.HAVE), WeightsHave, self._on_have)
        await b.subscribe(all_jobs(Verb.METRICS), MetricsSample, self._on_metrics)
        await b.subscribe(all_jobs_exact(Verb.CHAOS), ChaosRequest, self.chaos.on_request)
        self.spawn(self._lead())

    async def wait_leading(self, timeout_s: float) -> None:
        """Wait until this controller leads (tests, tools); TimeoutError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.leading:
            if time.monotonic() > deadline:
                raise TimeoutError(f"controller {self.owner} not leading after {timeout_s:g}s")
            await asyncio.sleep(0.05)

    async def _lead(self) -> None:
        try:
            await self._take_lead()
        except asyncio.CancelledError:
            raise
        except Exception:
            # Taking over failed part-way (a JetStream request timed out under load, seen on
            # 2026-12-02): a controller that says it leads but never keeps its lease would answer
            # as leader while a standby takes the lease. It stops acting, as on a lost lease (the
            # process exits and is restarted as a standby).
            log.exception("controller %s could not take over: it stops acting", self.owner)
            self.leading = False
            self.lost_leadership.set()
            # What the take-over had set going (a recovery, a stop, a restock) ends first: once the
            # lease is released a standby leads at once, and a stop or kill is not fenced.
            await asyncio.gather(*(cancel_and_wait(t, CLOSE_TASK_WAIT_S) for t in list(self._tasks)
                                   if t is not asyncio.current_task()))
            await self.lease.release()  # a standby need not wait for its expiry

    async def _take_lead(self) -> None:
        await self.lease.acquire(self._stop)
        # Renewed from the moment it is held, not once the take-over is done: restoring the jobs,
        # reconciling and subscribing can outlast the lease on a loaded machine (a JetStream
        # request waits 5 s), and a lease left to expire meanwhile let a standby take it while this
        # controller went on to say it leads: two leaders at once (an outside review found it).
        keeper = self._own_task(self.lease.keep(self._stop, self._on_new_token))
        takeover = self._own_task(self._take_over())
        try:
            await asyncio.wait({keeper, takeover}, return_when=asyncio.FIRST_COMPLETED)
            if not takeover.done():  # the lease was lost (or this controller stopped) first
                await cancel_and_wait(takeover, CLOSE_TASK_WAIT_S)
            else:
                takeover.result()  # a take-over that failed part-way: raised to _lead
            await keeper
        except LeaseLost as exc:
            log.error("controller %s stops acting: %s", self.owner, exc)
            self.leading = False
            self.lost_leadership.set()
        finally:
            await cancel_and_wait(takeover, CLOSE_TASK_WAIT_S)
            await cancel_and_wait(keeper, CLOSE_TASK_WAIT_S)

    async def _take_over(self) -> None:
        """Restore the jobs, then lead (``_take_lead`` keeps the lease meanwhile)."""
        # A standby keeps no fork server (ROBUSTRL_FORK_START): it imports once this one leads.
        await asyncio.to_thread(self.launcher.preload)
        gone = await self.restorer.restore()
        # The jobs a previous leader left: only these are relaunched or resumed below. A job
        # submitted to this controller once it leads (the reconcile below may take its whole 10 s
        # bound) is started by its own submission: relaunched here too, its second start
        # superseded the first in its first moments, a whole-job restart with no fault (seen in
        # the failover test under load; the "unknown trigger" of earlier sessions).
        restored = set(self.jobs)
        # What previous leaders left owed to the jobs' logs (ended jobs too: a final event JetStream
        # had not stored) is appended now, oldest first, before anything this leader gives.
        self.spawn(self.events.resume(list(self.jobs)))
        if not await self.lease.newest_term():  # deposed while restoring: lead nothing
            raise LeaseLost(f"a newer controller lease term began while {self.owner} restored its jobs")
        self.leading = True
        # Commits heard while restoring were not acted on (a job whose last step committed then was
        # never finished, seen in the Ray cross-node test at load 15): apply them now, then read the
        # event log once more for what was published before it reached this process.
        await self._apply_unled_commits()
        await self.reconcile_all("took over")
        await self.inbox.start()
        for info in gone:  # members that ended while no controller watched: crashes, handled now
            await self.supervisor.on_exit(info)
        for job in [j for j in list(self.jobs.values()) if j.job_id in restored]:  # slots a previous leader owed
            if not job.done:
                self.recovery.resume_restock(job)
                self.recovery.resume_rechecks(job)
                try:
                    await self.recovery.resume_waits(job)
                except LeaseLost:
                    raise
                except Exception:  # (the recovery's deadline still judges it)
                    log.exception("job %s: the waits of its recoveries not looked at again", job.job_id)
                if job.launched and self.recovery.interrupted(job):
                    self.spawn(self.recovery.resume_interrupted(job))
            if not job.done and not job.launched:  # its start was interrupted (``Restorer.relaunch``)
                self.launch_in_background(job)
        # The warm spares the resumed jobs ask for: the launcher takes over those its predecessor
        # left waiting (Ray: detached actors) and restocks the rest; without this call a new
        # leader kept none, and every later trainer fault started cold.
        self.spawn(self._update_spares())
        owed, self.deletions_owed = self.deletions_owed, {}
        for job_id, what in owed.items():
            self.deleter.resume(job_id, what)
        self.spawn(self.supervisor.run(self._stop))
        self.spawn(self._watch_progress(self._stop))
        self.spawn(self.retention.run(self._stop))  # ended jobs whose retention is due (``retention``)

    async def _on_new_token(self, token: int) -> None:
        # The lease had expired (this process was frozen, or Redis restarted): commits may have
        # gone by unseen meanwhile. (Still taking over: the take-over reads them once it leads.)
        # Off the lease keeper (spawned): the reconcile reads each job's log (up to 10 s a job),
        # and awaited here it held the renewals back: the lease expired again, a standby took it
        # and both controllers led until the read ended (an outside review).
        if self.leading:
            self.spawn(self._after_new_token(token))

    async def _after_new_token(self, token: int) -> None:
        await self.reconcile_all("lease re-acquired")
        for job in self.jobs.values():
            if not job.done:
                text = f"controller lease re-acquired (fencing token {token})"
                await self.event(job, "note", {"owner": self.owner, "text": text})

    def _own_task(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """A task ``close`` cancels, whose outcome its creator reads (not logged when it fails)."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("controller task failed", exc_info=task.exception())

    async def close(self, stop_members: bool = True) -> None:
        """Stop acting. ``stop_members`` (a graceful stop of the stack) also stops every member;
        a controller that lost its lease leaves them to the new leader."""
        self._stop.set()
        was_leading, self.leading = self.leading, False  # handlers act no more
        if stop_members:
            # First: the supervisor's grace before SIGKILL may be short, and members of a
            # controller that is gone keep running (by design: a restart re-adopts them).
            try:
                await within(asyncio.to_thread(self.launcher.close), LAUNCHER_CLOSE_S)
            except Exception as exc:  # the rest of the stop must still happen: the lease above all
                log.error("controller %s: stopping the members failed: %r", self.owner, exc)
        await self.inbox.close()
        # Bounded: a task that swallows its cancellation is left, not waited for. Tasks spawned
        # while the others end (a recovery's restock) are cancelled in the next round.
        stuck: set[asyncio.Task[Any]] = set()
        for _ in range(CLOSE_ROUNDS):
            tasks = [t for t in self._tasks if not t.done() and t not in stuck and t is not asyncio.current_task()]
            if not tasks:
                break
            ended = await asyncio.gather(*(cancel_and_wait(t, CLOSE_TASK_WAIT_S) for t in tasks))
            stuck.update(t for t, done in zip(tasks, ended, strict=True) if not done)
        left = [t.get_coro().__qualname__ for t in self._tasks if not t.done() and t is not asyncio.current_task()]
        if left:
            log.error("controller %s: tasks still running after cancellation: %s", self.owner, left)
        await self.events.close()  # (what is still owed stays in Redis, for the next leader)
        if was_leading or not self.lost_leadership.is_set():  # (one still taking over holds it too)
            await self.lease.release()  # only if it still names this controller

    # --- the registry and restoring ---------------------------------------------------------

    async def _fenced_epoch(self, job: JobRun) -> int:
        return (await read_gang(self.redis, job.job_id)).epoch

    async def persist(self, job: JobRun, handled: str | None = None) -> bool:
        """Write the job's record (``handled``: a fault id marked handled in the same write,
        ``JobRegistry.put``). One write per job at a time, each built from the state at its turn:
        two concurrent writes on separate Redis connections can land in either order, and a record
        built before a member was started, landing last, dropped that member from what a restarted
        controller adopts (test_controller_killed_then_frozen_mid_step_restarts_no_member).

        Returns:
            False if the lease fence refused the write (a newer controller lease term has begun):
            the launcher's starts act on it (``MemberStarter``); True once written.
        """
        async with self.persist_lock(job.job_id):
            if job.deleting is not None and self.jobs.get(job.job_id) is not job:
                return True  # deleted meanwhile (``deletion``): its record must not come back
            if await self.fenced(lambda fence: self.registry.put(job.job_id, job.to_record(), fence=fence,
                                                                 handled=handled)):
                return True
            log.error("job %s: record not written: a newer controller lease term (> token %d) has begun",
                      job.job_id, self.lease.token)
            return False

    async def fenced(self, write: Callable[[int | None], Awaitable[bool]]) -> bool:
        """Run a registry write fenced by this controller's lease token (``write(fence)``, False
        if refused): once a newer leader holds the lease, this process's view is stale. A refusal
        while this controller re-acquires its own expired lease is not a deposition: the write is
        made again under the newer term, one the keeper took up while the write was on its way
        (the token moved past the one it carried) or one still in flight in Redis
        (``own_newer_term``: the counter moved, the new token not yet known)."""
        for _ in range(2):
            fence = self.lease.token
            if await write(fence or None):
                return True
            if not fence or (self.lease.token == fence and not await self.lease.own_newer_term()):
                return False
        return False

    async def leads(self) -> bool:
        """Whether this controller may act now: it leads, and no newer lease term has begun (the
        fencing counter in Redis is not above its token: one read). A controller frozen past its
        lease still believes it leads until its next renewal; this read does not."""
        return self.leading and await self.lease.newest_term()

    async def leads_patiently(self) -> bool:
        """``leads`` for a member's start: a read that fails (no answer within its bound, a Redis
        error) is tried again for up to one lease period, by when the keeper has renewed the lease
        or found it lost (and this answers False). One read slower than its 1-s bound, under load,
        failed a submitted job for good with an empty reason (suite51). Raises the last error if
        the reads fail for that long. Only member starts wait so; a recovery starts its members
        under the recovery lock, which such a wait holds too (about 7 s at most per member, with
        Redis answering nothing): one slow read failing a trainer's restart, and escalating to a
        whole-job restart, would cost more. The recovery's own checks keep one read (``leads``)."""
        async for attempt in AsyncRetrying(
                stop=stop_after_delay(self.lease.ttl_s), wait=wait_exponential(multiplier=0.05, max=0.5),
                retry=retry_if_exception_type((TimeoutError, RedisError, OSError)), reraise=True,
                before_sleep=before_sleep_log(log, logging.WARNING)):
            with attempt:
                return await self.leads()
        raise AssertionError("unreachable: the retries end in a return or a raise")

    async def _adopted_elsewhere(self, job: JobRun, member_id: str) -> bool:
        """Whether the durable record (a newer leader's, once this one's write was refused) holds
        ``member_id`` live with a handle: that leader found and adopted it (``Launcher.find``)."""
        rec = await self.registry.get(job.job_id)
        m = ((rec or {}).get("members") or {}).get(member_id) or {}
        return bool(m.get("handle")) and m.get("state") not in ("exited", "stopped", "dead")

    async def reconcile(self, job: JobRun, why: str) -> None:
        """Bring the job's progress up to the durable event log. Commits arrive on core NATS, which
        drops what is published while this process is disconnected or frozen: a controller that
        missed steps 40-47 that way handed a restarted request manager step 40 to resume at (seen
        in the campaign), and the job stalled on a step already trained."""
        if job.done:
            return
        before = job.committed_step
        try:
            await within(self.catch_up(job), RECONCILE_TIMEOUT_S)
        except (TransportError, TimeoutError) as exc:
            log.warning("job %s: event log not read after %s (%s)", job.job_id, why, exc)
            return
        self.finish_if_trained(job)
        if job.committed_step != before:
            log.warning("job %s: %s: caught up from step %d to %d from the event log", job.job_id, why,
                        before, job.committed_step)
            await self.persist(job)

    async def _apply_unled_commits(self) -> None:
        pending, self._unled_commits = self._unled_commits, {}
        for msg in pending.values():
            job = self.jobs.get(msg.job_id)
            if job is not None and msg.step > job.committed_step:  # not older than one heard since
                log.warning("job %s: applying the commit of step %d heard before this controller led",
                            job.job_id, msg.step)
                await self._on_commit(msg, "", None)

    async def _watch_progress(self, stop: asyncio.Event) -> None:
        """Every PROGRESS_CHECK_S, compare each job's durable trained log (rank 0 appends a step to
        it just before announcing the commit) with the commits this leader heard; a step trained
        two checks in a row but not heard of makes the leader read the event log (``reconcile``),
        which also finishes a job whose last step committed unheard. Commits are core NATS
        messages: any that this process missed (a reconnect, a takeover) are caught up here."""
        while not stop.is_set():
            if await wait_event(stop, PROGRESS_CHECK_S):
                return
            if not self.leading:
                continue
            for job in list(self.jobs.values()):
                try:
                    await self._check_progress(job)
                except Exception:  # one job's check must not end the others'
                    log.exception("job %s: progress check failed", job.job_id)

    async def _check_progress(self, job: JobRun) -> None:
        if job.done or job.status == "pending":
            return
        step = await BatchStore(self.redis, job.job_id).newest_trained(job.epoch)
        if step <= job.committed_step:
            job.trained_unheard = -1
            return
        if job.trained_unheard != step:  # the commit may be on its way: look again next round
            job.trained_unheard = step
            return
        job.trained_unheard = -1
        await self.reconcile(job, f"step {step} in the trained log, its commit not heard")

    async def _after_reconnect(self) -> None:
        if self.leading:
            await self.reconcile_all("NATS reconnect")

    async def reconcile_all(self, why: str) -> None:
        for job in list(self.jobs.values()):
            await self.reconcile(job, why)

    async def catch_up(self, job: JobRun) -> None:
        """Apply what the event log recorded while no controller was listening: commits, and the
        job's end if it was stopped already. Read with what the job's outbox still owes the log: a
        leader that died after it owed the final event, before the final status, stopped the job."""
        for e in [*await self.bus.read_events(job.job_id), *await self.events.owed(job.job_id)]:
            if e.kind == "step_committed" and int(e.data.get("epoch", -1)) == job.epoch:
                step = int(e.data["step"])
                if step >= job.spec.steps:  # (as ``_on_commit``: a step the job does not have)
                    log.warning("job %s: a logged commit of step %d ignored: the job has %d steps", job.job_id,
                                step, job.spec.steps)
                    continue
                if step > job.committed_step:
                    job.committed_step = step
                    job.weights_version = int(e.data.get("weights_version", job.weights_version))
                    job.weights_checksum = str(e.data.get("checksum", job.weights_checksum))
                    if isinstance(e.data.get("reward_mean"), (int, float)):
                        job.reward_by_step[step] = float(e.data["reward_mean"])
                job.durable_step = max(job.durable_step, int(e.data.get("durable_step", -1)))
            elif e.kind in ("job_finished", "job_failed", "job_stopped"):
                job.status = {"job_finished": "finished", "job_failed": "failed"}.get(e.kind, "stopped")  # type: ignore[assignment]
                if isinstance(e.data.get("reason"), str):
                    job.error = e.data["reason"]
            elif e.kind == "fault_injected" and isinstance(fid := e.data.get("fault_id"), str) \
                    and fid not in job.chaos_by_id:
                injected: asyncio.Future[str] = asyncio.get_running_loop().create_future()
                injected.set_result(str(e.data.get("member_id", "")))
                job.chaos_by_id[fid] = injected
        if job.done:
            await self.persist(job)

    # --- jobs -------------------------------------------------------------------------------

    async def submit(self, spec: JobSpec) -> JobRun:
        """Record a new job and start its members; returns once they are started (see ``launch``).

        Raises:
            LaunchError: its members could not be started (the job is failed, its members stopped).
        """
        job = await self.create_job(spec)
        await self.launch(job)
        # after the first members: spares warm up while the job starts, and serve restarts
        await self._update_spares()
        return job

    async def create_job(self, spec: JobSpec) -> JobRun:
        """Record a new job (its ``job_submitted`` event durable); ``launch`` starts it."""
        if not self.leading:
            raise JobError(f"controller {self.owner} is a standby; submit to the leader")
        job_id = f"{spec.name}-{uuid.uuid4().hex[:8]}"
        job = JobRun(job_id=job_id, spec=spec)
        self.jobs[job_id] = job
        try:
            await self.event(job, "job_submitted", {"spec": spec.model_dump(mode="json")})
            # Recorded before any start (status pending, not launched): a leader that dies from here
            # on leaves the job to the next one, which starts it (``takeover.Restorer``), not to no one.
            saved = await self.persist(job)
        except BaseException as exc:
            # Not recorded (Redis away past its retries): the caller is told (503) and may submit
            # again. Kept in memory, the job was listed ``pending`` for good and never started (its
            # start runs only after this returns, or from a record), a phantom beside the retry's
            # job (an outside review). Its log, which may hold ``job_submitted``, is ended too,
            # and a record whose write landed though its reply was lost is removed (left
            # ``pending``, the next leader started it beside the retry's job), fenced.
            del self.jobs[job_id]
            with contextlib.suppress(Exception):
                await self.fenced(lambda fence: self.registry.delete(job_id, fence=fence))
            with contextlib.suppress(Exception):
                await self.event(job, "job_failed", {"reason": f"not recorded at its submission: {exc!r}"})
            raise
        if saved is False:
            del self.jobs[job_id]
            raise LeaseLost(f"job {job_id} not recorded: a newer controller lease term has begun")
        return job

    async def launch(self, job: JobRun) -> None:
        """Start a created job's members (``submit`` and ``launch_in_background`` then keep the
        warm spares the running jobs ask for).

        Raises:
            LaunchError: they could not all be started: the job is failed, its members stopped.
            LeaseLost: this controller stopped leading meanwhile (the job is the next leader's).
        """
        job_id = job.job_id
        try:
            await self._launch_all(job)
        except LeaseLost:
            raise  # a newer leader holds the job (its record is durable) and judges it
        except Exception as exc:
            if job.done:  # stopped while it started (POST .../stop): its stop stops what started
                log.info("job %s: stopped while its members started (%s)", job_id, exc)
                return
            # Its members cannot all be started (on Ray: no node takes one; a launcher refusing):
            # the job fails, durably and with the reason, and the members it has are stopped. Left
            # 'running' without them, it would never train and hold what it started. Only by a
            # leader: one stopping (its launcher closed under the start) or deposed fails no job.
            if await self._fail_start(job, exc):
                raise LaunchError(f"job {job_id} failed at its start: {type(exc).__name__}: {exc}") from exc

    async def _fail_start(self, job: JobRun, exc: Exception) -> bool:
        """Fail a job whose start failed with ``exc`` and stop its members; False if it was stopped
        meanwhile. Tried again (back-off up to ``FAIL_START_RETRY_MAX_S``) while a Redis read or
        write on the way fails: one such error let the job stay ``pending`` for good, its started
        members running and nothing to start or judge it (an outside review found it).

        Raises:
            LeaseLost: this controller stopped leading (or is stopping): the next leader finds
                the job not launched and starts it again.
        """
        failing = False  # this controller's stop of the job has begun (and is carried out again)

        async def nap(seconds: float) -> None:  # the back-off, cut short by this controller's stop
            if await wait_event(self._stop, seconds):
                raise LeaseLost(f"job {job.job_id}: its start failed ({exc}) while controller {self.owner} "
                                "stopped: the job is left to the next leader") from exc

        async for attempt in AsyncRetrying(
                wait=wait_exponential(multiplier=0.5, max=FAIL_START_RETRY_MAX_S),
                retry=retry_if_exception_type(Exception) & retry_if_not_exception_type(LeaseLost),
                sleep=nap, reraise=True,
                before_sleep=before_sleep_log(log, logging.WARNING)):
            with attempt:
                async with self.recovery.lock:
                    if not self.leading or not await self.leads():
                        raise LeaseLost(f"job {job.job_id}: its start failed ({exc}) while controller "
                                        f"{self.owner} stopped leading: the job is left to the next leader") from exc
                    if job.done and not failing:
                        return False
                    reason = f"its members could not be started: {type(exc).__name__}: {exc}"
                    log.error("job %s: %s", job.job_id, reason)
                    failing = True
                    await self.stop_job(job.job_id, "failed", reason, again=True)
        return True

    def launch_in_background(self, job: JobRun) -> asyncio.Task[None]:
        """``launch`` in a controller task; the warm spares are updated once it succeeded."""
        task = self.spawn(self.launch(job))

        def then(t: asyncio.Task[None]) -> None:
            if not t.cancelled() and t.exception() is None:
                self.spawn(self._update_spares())

        task.add_done_callback(then)
        return task

    def _spares_wanted(self) -> int:
        """As many warm spares as the running jobs ask for (RecoverySpec.warm_spares)."""
        return sum(j.spec.recovery.warm_spares for j in self.jobs.values() if not j.done)

    def cycle_spares(self) -> None:
        """Replace every idle warm spare of the launcher with a new one (blocking: a thread)."""
        self.launcher.keep_spares(0)
        self.launcher.keep_spares(self._spares_wanted())

    async def _update_spares(self) -> None:
        """Keep as many warm spares as the running jobs ask for."""
        await asyncio.to_thread(self.launcher.keep_spares, self._spares_wanted())

    async def _launch_all(self, job: JobRun) -> None:
        if job.done:  # stopped before its launch began
            return
        # 'pending' until every first member is started and recorded: a job whose members are
        # still starting (a Ray placement, container starts) does not read 'running' with none.
        job.status = "pending"
        job.started_at = job.started_at or time.time()
        await self.persist(job)
        await self.event(job, "job_started", {"policy": job.policy, "resume_step": job.step})
        superseded = False
        try:
            await self.starter.start_all(job)
        except StartSuperseded as exc:
            # A recovery (a whole-job restart for a member lost in the first moments) planned and
            # started newer members while these started: its start stands, and the job runs on it.
            log.warning("%s: the recovery's start stands", exc)
            superseded = True
        if job.done:  # stopped meanwhile: no resume for a stopped job
            return
        job.launched = True
        if job.status == "pending":  # (a recovery begun meanwhile keeps 'recovering' until it ends)
            job.status = "running"
        await self.persist(job)
        # The submitter gets its answer without waiting for the request manager's acknowledgement
        # (retried for up to rm_ack_attempts x RM_ACK_TIMEOUT_S while the service restarts, then
        # owed: sent again each RM_RESUME_RETRY_S until acknowledged). Not after a recovery
        # superseded this start: it sends its own resume once its members are started, and this
        # one, arriving after its restart_step, would let the request manager run the step on
        # the members being replaced.
        if not superseded:
            self.spawn(self.resume_rm(job))

    async def resume_rm(self, job: JobRun, attempts: int | None = None, owed_as_of: int | None = None) -> bool:
        """Send the request manager ``resume`` (the job's current step) and owe it until it is
        acknowledged: a resume lost while the service or the bus was away would otherwise leave the
        job paused at its step for good, with every member healthy and nothing silent. The
        supervision round sends an owed resume again (``resend_owed_resume``), as of the
        request-manager commands sent by then (``owed_as_of``): a restart_step sent between that
        round and this task supersedes it."""
        if owed_as_of is not None and (owed_as_of != job.rm_supersede_seq or not job.rm_resume_owed):
            return False
        job.rm_resume_owed = True
        job.rm_resume_sending += 1
        try:
            return await self.control_rm(job, "resume", {"start_step": job.step, "committed": job.committed_step},
                                         attempts=attempts, quiet=attempts == 1)
        finally:
            job.rm_resume_sending -= 1
            job.rm_resume_next_at = time.monotonic() + RM_RESUME_RETRY_S

    def resend_owed_resume(self, job: JobRun) -> None:
        """One more try of a resume still owed, once ``RM_RESUME_RETRY_S`` has passed."""
        if (job.rm_resume_owed and not job.done and job.launched and not job.rm_resume_sending
                and time.monotonic() >= job.rm_resume_next_at):
            log.warning("job %s: the request manager's resume is still owed: sending it", job.job_id)
            job.rm_resume_next_at = time.monotonic() + RM_RESUME_RETRY_S  # (the task sets it again when done)
            self.spawn(self.resume_rm(job, attempts=1, owed_as_of=job.rm_supersede_seq))

    async def control_rm(self, job: JobRun, action: str, args: dict[str, Any] | None = None,
                         attempts: int | None = None, timeout_s: float = RM_ACK_TIMEOUT_S,
                         quiet: bool = False, pace_last: bool = True) -> bool:
        """Send a command (with this leader's fencing token) to the request manager and wait for
        its acknowledgement, retrying: a lost resume / restart_step / replica_dead would leave the
        job waiting forever. An acknowledgement is also a sign of the service's life."""
        cmd = ControlCommand(job_id=job.job_id, target="request_manager", action=action,  # type: ignore[arg-type]
                             args=args or {}, fence=self.lease.token)
        subj = subject(job.job_id, Verb.CONTROL, "request_manager")
        loop = asyncio.get_running_loop()
        if action in SUPERSEDES_RESUME:
            job.rm_supersede_seq += 1
            job.rm_resume_owed = False
        seq = job.rm_supersede_seq
        for attempt in range(attempts or self.rm_ack_attempts):
            if action == "resume" and job.rm_supersede_seq != seq:
                log.info("job %s: resume superseded by a later command: not sent again", job.job_id)
                return False
            began = loop.time()
            # Under the token held now: once the lease keeper took up a newer term of this
            # controller's, the request manager (which checks a command's token against the
            # newest term's, in Redis) refuses the older one unanswered, and every retry of a
            # command built once timed out. The keeper's own re-acquisition may have run in Redis
            # with its reply still on the way: taken up here first (``newest_term``), or this
            # attempt went out under the older token (a 2-s timeout; a stop's only attempt).
            with contextlib.suppress(TimeoutError, TransportError, RedisError):
                await self.lease.newest_term()
            cmd = cmd.model_copy(update={"fence": self.lease.token})
            try:
                await self.bus.request(subj, cmd, ControlCommand, timeout=timeout_s)
                job.service_seen_at["request_manager"] = time.monotonic()
                if action == "resume" and job.rm_supersede_seq == seq:
                    job.rm_resume_owed = False
                return True
            except RequestTimeout:
                log.warning("job %s: request manager did not acknowledge %s (attempt %d)", job.job_id, action,
                            attempt + 1)
            # "No responders" fails at once while the service is down: each attempt still spans
            # timeout_s, so the attempts cover a restart of the service instead of a few ms (a
            # caller that loops on single attempts is paced by it); ``pace_last`` False: not the
            # last (a stop's single attempt, with the service down, waited out its whole bound).
            if pace_last or attempt + 1 < (attempts or self.rm_ack_attempts):
                await asyncio.sleep(max(0.0, began + timeout_s - loop.time()))
        if not quiet:
            await self.event(job, "note", {"text": f"request manager never acknowledged {action}"})
        return False

    async def stop_job(self, job_id: str, status: str = "stopped", reason: str | None = None, *,
                       again: bool = False) -> JobRun:
        """Stop the job's members, owe its final event, then set its final status: once the event
        is stored, or ``outbox.FINAL_EVENT_WAIT_S`` later with the event still owed (JetStream
        away: the job ends all the same, and its log ends once the event lands).
        ``again``: a stop of the caller's own that failed part-way is carried out once more (each
        part is idempotent), where a job being stopped is otherwise left to that stop.

        Raises:
            TransportError: Redis refused the final event or the final record (the stop is
                carried out again by whoever calls it again, the event under the same message id).
        """
        job = self.get(job_id)
        stop = self._stopping.get(job.job_id)
        # A stop under way is left to itself; one that failed part-way (nothing carries it out
        # now) is carried out again by whoever calls, as first asked (status and reason).
        if job.done and (stop is None or (stop["running"] and not again)):
            return job
        if stop is None:
            stop = self.owe_stop(job, status, reason)
        # One carrying-out at a time: a failed start's stop carried out again (``again``) while a
        # supervision retry of the same stop runs waits for it, and does nothing if it ended the job.
        async with stop["lock"]:
            if self._stopping.get(job.job_id) is not stop:
                return job
            status, reason = stop["status"], stop["reason"]
            job.closing = True
            job.error = reason
            stop["running"] = True
            stop["tries"] += 1
            try:
                return await self._carry_out_stop(job, stop, status, reason)
            except BaseException:
                # Left for the supervision's next rounds (``retry_stops``), paced.
                stop["retry_at"] = time.monotonic() + min(STOP_RETRY_MAX_S, 2.0 ** stop["tries"])
                raise
            finally:
                stop["running"] = False

    def owe_stop(self, job: JobRun, status: str, reason: str | None) -> dict[str, Any]:
        """Record a stop of ``job`` to carry out (``stop_job`` does; ``retry_stops`` once it failed
        part-way, or once this leader took over a stop its predecessor began): in the job's record
        from now on (``JobRun.stop_owed``)."""
        job.stop_owed = {"status": status, "reason": reason}
        stop = self._stopping[job.job_id] = {"ids": [], "event": False, "ended": asyncio.Event(), "running": False,
                                             "status": status, "reason": reason, "tries": 0, "retry_at": 0.0,
                                             "lock": asyncio.Lock()}
        return stop

    def retry_stops(self) -> None:
        """Carry out again, in the background, each stop that failed part-way (Redis or JetStream
        away past their retries: the job, ``done`` for every other check, kept its running status
        and could not be deleted; an outside review found it) once its pause is over."""
        now = time.monotonic()
        for job_id, stop in list(self._stopping.items()):
            if not stop["running"] and now >= stop["retry_at"] and job_id in self.jobs:
                stop["retry_at"] = now + STOP_RETRY_MAX_S  # (until this try sets its own)
                log.warning("job %s: its stop failed part-way (try %d): carried out again", job_id, stop["tries"])
                self.spawn(self._retry_stop(job_id))

    async def _retry_stop(self, job_id: str) -> None:
        # Only while this controller holds the newest lease term: one frozen past its lease must
        # not stop the members a new leader adopted (its ``leading`` is stale until it notices).
        if not await self.leads():
            log.warning("job %s: its failed stop not carried out again: a newer lease term has begun", job_id)
            return
        await self.stop_job(job_id)

    async def _carry_out_stop(self, job: JobRun, stop: dict[str, Any], status: str, reason: str | None) -> JobRun:
        # The stop in the record first: a leader that dies part-way leaves it to the next
        # (``JobRun.stop_owed``), which found the job running with its members stopped. A record
        # refused (a newer lease term began) ends the stop here: the request manager and the
        # detector, which admit any token not older than the last they saw, would have taken this
        # deposed controller's stop (the runner of a job the new leader found running stopped, its
        # members no longer watched; an outside review).
        if not await self.persist(job):
            raise LeaseLost(f"job {job.job_id}: not stopped: controller {self.owner}'s record of the stop was "
                            "refused (a newer lease term began)")
        # (the request manager acknowledges once the job's events are in its log, up to its
        # STOP_DRAIN_S: the final event then ends the log)
        rm_acked = await self.control_rm(job, "stop", attempts=1, timeout_s=RM_STOP_DRAIN_S + RM_ACK_TIMEOUT_S,
                                         pace_last=False)
        # Shorter while the recovery lock is held (a job failed by a fault decision or a failed
        # start): every job's faults wait behind it (an outside review).
        await self._events_settled(job, EVENTS_SETTLE_LOCKED_S if self.recovery.lock.locked() else EVENTS_SETTLE_S,
                                   rm_acked=rm_acked)
        # Fenced like a start: a controller deposed while it waited (up to 12 s) for the request
        # manager must neither kill the members a new leader adopted (their exits would be faults
        # to it) nor end the job's log (an outside review: both happened). The new leader finds
        # the job running; a stop asked through the API answers 503 and may be asked again.
        await self._still_leading(job, "stop its members")
        # (marked stopped before the launcher's stop: a stop carried out again stops them again)
        stop["ids"] += [m.member_id for m in job.live() if m.member_id not in stop["ids"]]
        for m in job.live():
            m.state = "stopped"
        if status == "finished":
            await asyncio.to_thread(self.launcher.stop_many, [lid(job, i) for i in stop["ids"]], FINISH_GRACE_S)
            await self._final_durable(job)
        else:
            await asyncio.to_thread(self.launcher.stop_many, [lid(job, i) for i in stop["ids"]], 3.0)
        await self.supervisor.log_exits_of(job)
        await failpoints.hit("stop_members_stopped")
        await self._update_spares()
        if not stop["event"]:
            await self._still_leading(job, "end its log")
            kind = FINAL_EVENT.get(status, "job_stopped")
            data = {"reason": reason, "steps": job.committed_step + 1, "durable_step": job.durable_step,
                    "fence": self.lease.token}
            # One message id per job's end: a stop carried out again after the save's answer was
            # lost owes it twice, and JetStream stores it once.
            if not await self.events.emit_and_wait(job.job_id, kind, data, outbox.FINAL_EVENT_WAIT_S,
                                                   msg_id=f"{job.job_id}-final"):
                log.error("job %s: %s not stored by JetStream within %g s: the job ends now, the event is "
                          "appended once JetStream takes it", job.job_id, kind, outbox.FINAL_EVENT_WAIT_S)
            stop["event"] = True
        job.ettr = await self._ettr(job)
        job.finished_at = time.time()
        job.status = status  # type: ignore[assignment]
        job.stop_owed = None
        await self.persist(job)
        self._stopping.pop(job.job_id, None)
        stop["ended"].set()  # (a deletion waiting for the final record: ``JobDeleter``)
        return job

    async def _durable_now(self, job: JobRun) -> int:
        """The job's newest durable checkpoint, from the gang's fenced record (written after the
        manifest), also kept in the job's record. The last step's upload ends after its commit
        was announced (which named the step before): only this read tells of it.

        Raises:
            TransportError: Redis failed.
        """
        job.durable_step = max(job.durable_step, (await read_gang(self.redis, job.job_id)).durable)
        return job.durable_step

    async def _final_durable(self, job: JobRun) -> None:
        """Once a finished job's members exited: its newest durable checkpoint (``_durable_now``);
        one that is not the last step's is logged and noted in the log."""
        try:
            await self._durable_now(job)
        except Exception as exc:  # Redis away: the record keeps what the commits said
            log.warning("job %s: newest durable checkpoint not read at its end: %s", job.job_id, exc)
            return
        if job.durable_step < job.spec.steps - 1:
            text = (f"the last step's checkpoint is not durable: the newest durable checkpoint is of step "
                    f"{job.durable_step} (steps {job.spec.steps})")
            log.error("job %s: %s", job.job_id, text)
            await self.event(job, "note", {"text": text})

    async def _events_settled(self, job: JobRun, bound_s: float, *, rm_acked: bool = True) -> None:
        """Wait, up to ``bound_s``, until the job's event outboxes in Redis owe nothing: the
        request manager's (if it acknowledged the stop: else nobody appends it now) and the
        detector's, and the trainer's and the rollout replicas' while a member of that role is
        live to append them. Only those members append their role's outboxes (NATS lets each
        role write its own events); stopped while JetStream was away, they left their last
        events (the last ``step_committed``, a ``weights_loaded``) there for good, the log
        without them, and an event appended after this stop's final one would break the log's
        order (an outside review). An entry whose event the log already holds (stored, its
        removal failed) owes nothing (``Bus.stored_msg_ids``). Nothing waits when JetStream is
        up (the outboxes are empty); past the bound (a longer outage) the stop goes on, logged."""
        live = {m.role for m in job.live()}
        roles = {Keys.detector_outbox(job.job_id): "detector"}
        roles |= {Keys.rm_outbox(job.job_id): "request_manager"} if rm_acked else {}
        roles |= {Keys.trainer_outbox(job.job_id): "trainer"} if "trainer" in live else {}
        roles |= {Keys.rollout_outbox(job.job_id): "rollout"} if "rollout" in live else {}
        deadline = time.monotonic() + bound_s
        stored: set[str] = set()
        looked_up_at = time.monotonic()
        while True:
            try:
                raws = {k: await within(self.redis.lrange(k, 0, -1), EVENTS_SETTLE_CALL_S) for k in roles}
            except Exception as exc:  # Redis away: nothing to learn here; the stop goes on
                log.warning("job %s: event outboxes not read before the stop: %s", job.job_id, exc)
                return
            owed = {k: [e for e in map(_outbox_entry, v) if e is None or e.msg_id not in stored]
                    for k, v in raws.items()}
            owed = {k: v for k, v in owed.items() if v}
            if not owed:
                return
            if time.monotonic() >= deadline:
                log.error("job %s: events still owed after %g s, stopping all the same: %s", job.job_id,
                          bound_s, {k: len(v) for k, v in owed.items()})
                return
            if time.monotonic() - looked_up_at >= EVENTS_SETTLE_LOOKUP_S:
                looked_up_at = time.monotonic()
                stored |= await self._stored_of(job, {roles[k]: v for k, v in owed.items()})
                continue
            await asyncio.sleep(EVENTS_SETTLE_POLL_S)

    async def _stored_of(self, job: JobRun, owed: dict[str, list[OutboxEntry | None]]) -> set[str]:
        """The message ids of ``owed`` entries (by writer role) the job's log holds; none if it
        cannot be read within ``EVENTS_SETTLE_CALL_S`` a request."""
        ids: set[str] = set()
        try:
            for role, entries in owed.items():
                ids |= await stored_of(self.bus, job.job_id, role, [e for e in entries if e is not None],
                                       request_s=EVENTS_SETTLE_CALL_S)
        except Exception as exc:  # (JetStream away): the wait goes on
            log.info("job %s: the log not read for owed events: %s", job.job_id, exc)
        return ids

    async def _still_leading(self, job: JobRun, what: str) -> None:
        """Raise ``LeaseLost`` unless this controller holds the newest lease term (one Redis read)."""
        if not await self.leads():
            raise LeaseLost(f"job {job.job_id}: not {what}: controller {self.owner} no longer leads "
                            "(a newer lease term began)")

    async def stop_settled(self, job_id: str, timeout_s: float) -> bool:
        """Wait, up to ``timeout_s``, for a stop under way of ``job_id`` to end (its final record
        written: ``stop_job`` sets the final status just before). Returns whether none runs now."""
        stop = self._stopping.get(job_id)
        if stop is None:
            return True
        with contextlib.suppress(TimeoutError):
            await within(stop["ended"].wait(), timeout_s)
        return job_id not in self._stopping

    async def delete_job(self, job_id: str, *, checkpoints: bool = False, events: bool = False) -> dict[str, Any]:
        """Delete an ended job (``deletion.JobDeleter.delete``: its Redis state and record; its
        checkpoints and event log only when asked)."""
        return await self.deleter.delete(job_id, checkpoints=checkpoints, events=events)

    def persist_lock(self, job_id: str) -> asyncio.Lock:
        """The lock every write of the job's record holds (one write per job at a time)."""
        return self._persist_locks.setdefault(job_id, asyncio.Lock())

    def forget(self, job_id: str) -> None:
        """Drop a deleted job from this controller's memory (its persist lock stays: a write
        waiting on it finds the job forgotten)."""
        self.jobs.pop(job_id, None)

    async def _ettr(self, job: JobRun) -> float | None:
        from robustrl.chaos.accounting import account

        try:
            return account(await self.bus.read_events(job.job_id)).ettr
        except Exception as exc:  # accounting is a report, never a reason to fail stopping
            log.warning("job %s: ETTR not computed: %s", job.job_id, exc)
            return None

    def get(self, job_id: str) -> JobRun:
        job = self.jobs.get(job_id)
        if job is None:
            raise JobError(f"no such job: {job_id}", job_id=job_id)
        return job

    async def inject(self, req: ChaosRequest) -> str:
        """Carry out one fault (REST API); return the member it hit."""
        return await self.chaos.inject(req)

    async def event(self, job: JobRun, kind: str, data: dict[str, Any] | None = None) -> None:
        """Owe one event to the job's log, stamped now with this leader's fencing token: saved in
        the job's outbox when this returns, appended in the background in order (``outbox``)."""
        await self.events.emit(job.job_id, kind, {**(data or {}), "fence": self.lease.token})

    # --- messages from members --------------------------------------------------------------

    async def _on_spec(self, msg: SpecRequest, _s: str, reply: str | None) -> None:
        job = self.jobs.get(msg.job_id)
        if job is None or job.done or job.closing or not self.leading:
            # (a stopping job's: a request manager that asks now must not run it again after
            # its stop was acknowledged, its events landing after the final one)
            return
        if msg.member_id in job.members:
            job.members[msg.member_id].heard = True
        if msg.member_id == "request_manager":  # it resumes at the step named here: make it current
            await self.reconcile(job, "request manager asked for the spec")
        await self.bus.respond(reply, SpecReply(job_id=job.job_id, spec=job.spec.model_dump(mode="json"),
                                                epoch=job.epoch, resume_step=job.step))

    async def _on_fault(self, fault: FaultReport, _s: str, _r: str | None) -> None:
        try:
            await self.recovery.handle(fault)
        except LeaseLost as exc:  # the fault inbox delivers it to the new leader
            log.warning("fault %s left for the new leader: %s", fault.fault_id, exc)

    async def _inbox_fault(self, fault: FaultReport) -> None:
        if not self.leading:
            # Not acknowledged: the consumer delivers it again, to whoever leads then.
            raise LeaseLost(f"controller {self.owner} does not lead; fault {fault.fault_id} is left "
                            f"for the leader")
        await self.recovery.handle(fault)

    async def _on_hello(self, msg: MemberHello, _s: str, reply: str | None) -> None:
        job = self.jobs.get(msg.job_id)
        if not job or msg.member_id not in job.members or not self.leading:
            return  # unanswered: the member sends it again (a takeover may not know it yet)
        m = job.members[msg.member_id]
        m.heard = True
        # A member sends its hello until this answer reaches it (Member.hello): a hello again is
        # the same news, and one of a member no longer starting (ready, or already gone) changes
        # nothing (before, a late hello brought a dead member back to "running").
        if m.state == "starting":
            m.state, m.pid = "running", msg.pid
            job.started(m)
            if m.role == "trainer" and m.epoch == job.epoch:
                m.state = "ready"
                if msg.resume_step is not None and job.commit_epoch != m.epoch:
                    job.durable_step = msg.resume_step - 1
                    if msg.resume_step - 1 > job.committed_step:
                        # Its checkpoint of that step is durable, so the step was committed, heard
                        # or not (a rank killed between recording its last step and announcing
                        # it: that job never finished, its next gang had nothing left to train).
                        log.warning("job %s: gang %d resumed at step %d: steps up to %d committed (%d heard)",
                                    job.job_id, m.epoch, msg.resume_step, msg.resume_step - 1, job.committed_step)
                        job.committed_step = msg.resume_step - 1
                        await self.persist(job)
                        self.finish_if_trained(job)
                await self.recovery.progress(job, msg.member_id)
        try:  # answered once acted on: a send lost before that is sent again
            await self.bus.respond(reply, HelloAck(job_id=job.job_id, member_id=m.member_id))
        except Exception as exc:  # noqa: BLE001 - the bus away: the member sends its hello again
            log.debug("hello of %s not acknowledged: %s", m.member_id, exc)

    async def _on_phase(self, msg: PhaseChange, _s: str, _r: str | None) -> None:
        job = self.jobs.get(msg.job_id)
        if job and msg.member_id in job.members:
            job.members[msg.member_id].phase = msg.phase
            job.members[msg.member_id].heard = True

    async def _on_metrics(self, msg: MetricsSample, _s: str, _r: str | None) -> None:
        job = self.jobs.get(msg.job_id)
        if job is None or job.done or not self.leading:
            return
        if msg.role == "request_manager":
            await self.recovery.service_back(job, "request_manager")
            return
        m = job.members.get(msg.member_id)
        if m is None:
            return
        m.heard = True
        if m.state == "starting" and m.phase == "starting" and msg.phase != "starting":
            # Its hello (one publish) may have been lost: a phase past starting shows it started,
            # and the start deadline (Supervisor.watch_starts) must not kill it.
            m.phase = msg.phase
        if not m.adopted:
            return
        if m.phase == "starting":
            # Phases are not in the record, and a member announces one only when it changes: a
            # replica re-attached while stuck in ``weights_failed`` says so in its metrics only (a
            # weights fault looked at again after a takeover, ``resume_rechecks``, needs it).
            m.phase = msg.phase
        if m.state != "starting":
            return
        # A member re-attached after a controller restart whose hello this controller never
        # heard: its metrics show it is up (and, for a replica, which weights it holds).
        m.phase, m.weights_version = msg.phase, msg.weights_version
        if msg.phase == "starting":
            return
        m.state = "ready" if m.role == "trainer" else "running"
        job.started(m)
        if m.role == "trainer" or msg.weights_version >= job.weights_version:
            await self.recovery.progress(job, m.member_id)

    async def _on_have(self, msg: WeightsHave, _s: str, _r: str | None) -> None:
        job = self.jobs.get(msg.job_id)
        if not msg.complete or not job or msg.member_id not in job.members or not self.leading:
            return  # a partial announcement is a pull under way, not a replica ready at that version
        m = job.members[msg.member_id]
        if m.state in ("dead", "exited", "stopped") or not job.is_current(m.member_id):
            return  # a late HAVE of a replaced or borrowed replica must not bring it back to the pool
        m.weights_version = msg.version
        if m.state == "starting":  # ready before its hello was heard (that hello is then no news)
            job.started(m)
        m.state = "ready"
        if msg.version >= job.weights_version:
            await self.recovery.progress(job, msg.member_id)

    async def _on_commit(self, msg: StepCommitted, _s: str, _r: str | None) -> None:
        if not self.leading:
            if self._stop.is_set():
                return
            # Kept for when this controller leads (it may be restoring its jobs right now).
            held = self._unled_commits.get(msg.job_id)
            if held is None or (msg.epoch, msg.step) >= (held.epoch, held.step):
                self._unled_commits[msg.job_id] = msg
            return
        job = self.jobs.get(msg.job_id)
        if not job or job.done or msg.epoch != job.epoch:
            return
        if msg.step >= job.spec.steps:
            # No trainer commits a step the job does not have: taken, it finished the job with
            # steps never trained (an outside review).
            log.warning("job %s: a commit of step %d refused: the job has %d steps", job.job_id, msg.step,
                        job.spec.steps)
            return
        job.committed_step = max(job.committed_step, msg.step)
        job.durable_step = max(job.durable_step, msg.durable_step)
        job.commit_epoch = msg.epoch
        job.weights_version, job.weights_checksum = msg.weights_version, msg.checksum
        job.reward_by_step[msg.step] = msg.reward_mean
        job.last_step_timings = dict(msg.timings)
        await self.persist(job)
        self.finish_if_trained(job)

    def finish_if_trained(self, job: JobRun) -> None:
        """Every step of ``job`` committed (heard now, or while no controller was listening):
        finish it (``_finish``), once."""
        if job.committed_step >= job.spec.steps - 1 and not job.done and job.job_id not in self._finishing:
            # In a task: this subscription keeps delivering other jobs' commits meanwhile.
            self._finishing.add(job.job_id)
            self.spawn(self._finish(job))

    async def _finish(self, job: JobRun) -> None:
        """Every step of ``job`` is committed: once the last one is durable too, stop it as
        ``finished``. Until then its members run as before (``FINISH_DURABLE_WAIT_S``): a trainer
        rank lost now is a fault, and its recovery trains the steps not durable again. Left to
        the recovery's commits (they call this again) if one moves the committed step back, and
        to the next leader if this controller stops leading."""
        try:
            counted = 0.0  # (time in a trainer recovery not counted: the recovery has its deadline)
            while not job.done and self.leading and job.committed_step >= job.spec.steps - 1:
                if not any(r.kind in ("trainer", "whole_job") for r in job.recoveries):
                    if await self._last_step_settled(job) or counted >= FINISH_DURABLE_WAIT_S:
                        break
                    counted += FINISH_POLL_S
                await asyncio.sleep(FINISH_POLL_S)
            else:
                return
        finally:
            self._finishing.discard(job.job_id)
        if job.durable_step < job.spec.steps - 1:
            log.error("job %s: its last step not durable after %.0f s: it is stopped all the same", job.job_id,
                      counted)
        await self.stop_job(job.job_id, "finished")

    async def _last_step_settled(self, job: JobRun) -> bool:
        """Whether the finishing ``job`` waits no more: its last step is durable, or its current
        gang's ranks are being stopped already (a previous leader's stop began: none uploads)."""
        ranks = [m for m in job.members.values() if m.role == "trainer" and job.is_current(m.member_id)]
        if ranks and all(m.state == "stopped" for m in ranks):
            return True
        try:
            return await self._durable_now(job) >= job.spec.steps - 1
        except (TransportError, StorageError) as exc:  # Redis away, or the record damaged: read again at the next poll
            log.warning("job %s: its durable step not read while it finishes: %s", job.job_id, exc)
            return False


def _outbox_entry(raw: bytes) -> OutboxEntry | None:
    """An outbox entry as stored (None: one that does not parse, still owed: its appender drops it)."""
    try:
        return OutboxEntry.model_validate_json(raw)
    except ValueError:
        return None
