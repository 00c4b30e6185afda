"""Supervision: member exits the launcher sees, start-up crash loops, control-plane silences,
recovery deadlines.

The controller acts on an exit it saw itself (it does not wait for the detector, which may be
down): an unexpected exit of a current member becomes a crash fault whose ``fault_at`` is the
launcher's exit time, recorded as a ``fault_detected`` event and handled at once. The exit is
then forwarded to the detector as handled (``expected``), so it is not reported twice.

A member that exits before its hello, or whose start passes ``detector.start_deadline_s``,
``STARTUP_FAILURES_MAX`` times in a row (per role slot) fails the job at once, with the last lines
of its log in the fault evidence and the job error: a broken environment must not crash-loop (or
hang-loop) through ``max_restarts``.

A member still starting (no hello) ``detector.start_deadline_s`` after this controller first saw
it so is a fault too (hang): no detector rule judges phase ``starting`` (a start may be slow),
the request manager's step deadline begins with the first step, and a recovery's deadline covers
only the members it waits for; so a first trainer whose model load blocked kept its job at step
0 for good, every member healthy.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from robustrl.aio import wait_event
from robustrl.errors import EXIT_CHECKPOINT_LOST, EXIT_CHECKPOINT_STALLED, EXIT_DIVERGED, TransportError
from robustrl.launcher.base import ExitInfo
from robustrl.messages import FaultReport, MemberExited
from robustrl.services.controller.decide import DIVERGED, WARM_START_SILENT
from robustrl.services.controller.jobs import STARTUP_FAILURES_MAX, JobRun, MemberInfo, still_starting
from robustrl.services.controller.launching import split_lid
from robustrl.services.controller.lease import LeaseLost
from robustrl.storage.redis_stores import BatchStore
from robustrl.subjects import Verb, subject

if TYPE_CHECKING:
    from robustrl.services.controller.runtime import Controller

log = logging.getLogger(__name__)

SUPERVISE_INTERVAL_S = 0.05
EXIT_RETRY_S = 60.0
"""How long an exit whose handling keeps failing is tried again, round after round."""
WATCHED_SERVICES = ("request_manager",)
"""Control-plane services whose silence the controller watches itself (their metrics)."""
OWN_GAP_S = 1.0
"""A supervision round this much later than due means this controller itself was away (frozen,
starved): silences it did not watch are not held against the services."""


WARM_SOURCES = frozenset({"spare"})
"""Starts (``GangStart.sources``) of a process that waits for nothing but its order: it asks for
the spec within a second of it. Not a borrowed replica or a kept rank: each first ends a running
role (a vLLM engine shut down, a model cloned and converted, a worker unwound: tens of seconds
for a large model) before it speaks under its new id; a replica is probed just before it is
borrowed, and a kept rank that does not unwind exits by itself (``UNWIND_S``)."""


def warm_ranks(job: JobRun) -> dict[str, str]:
    """The current trainer ranks that a trainer recovery under way started from a warm spare
    (``WARM_SOURCES``) and that this controller has not heard from at all (no spec request, no
    metrics): member id -> source. A spare has its imports done: it asks for the spec and sends
    metrics within a second of its order, also while it waits in the gang's rendezvous for a cold
    rank (its hello comes only once the gang has formed and loaded the checkpoint). A cold rank is
    bounded by the recovery's deadline (a start may import for minutes); a spare silent from its
    order on (frozen, the order never read) held the gang at its rendezvous for that whole deadline."""
    out: dict[str, str] = {}
    for rec in job.recoveries:
        start = job.gang_starts.get(rec.fault_id)
        if rec.kind != "trainer" or start is None:
            continue
        for m in job.current_trainers():
            if not m.heard and 0 <= m.index < len(start.sources) and start.sources[m.index] in WARM_SOURCES:
                out[m.member_id] = start.sources[m.index]
    return out


def exit_fault(job: JobRun, m: MemberInfo, info: ExitInfo, evidence: str, cause: str | None = None) -> FaultReport:
    return FaultReport(job_id=job.job_id, fault_id=f"exit-{m.member_id}", role=m.role,  # type: ignore[arg-type]
                       member_id=m.member_id, kind="crash", evidence=evidence, detected_at=time.time(),
                       step=job.step, fault_at=info.exited_at, cause=cause)


class Supervisor:
    """The controller's periodic round: exits, silences, deadlines."""

    def __init__(self, controller: Controller) -> None:
        self.c = controller
        self._last_round: float | None = None
        self._round: list[ExitInfo] = []
        """The exits of the round under way not handled yet (``once``; ``log_exits_of`` takes its job's)."""
        self._polling = asyncio.Lock()
        self._unhandled: list[ExitInfo] = []
        """Exits whose handling failed (a Redis blip): the launcher returns an exit once, so they
        are kept and handled again next round (the fault id names the member: decided once)."""
        self._starting: dict[tuple[str, str], float] = {}
        """(job, member) -> when this controller first saw the member starting (monotonic): each
        leader counts a start from what it saw itself (a record's start time is another clock's)."""
        self._warm_starting: dict[tuple[str, str], float] = {}
        """The same for the ranks a trainer recovery started warm (``warm_ranks``), timed while it runs."""
        self._start_hung: dict[tuple[str, str], dict[str, Any]] = {}
        """A start past its deadline being handled: what was done, so a retry does nothing twice."""
        self._poll_failing_since: float | None = None  # the launcher's poll failing since (monotonic)
        self._progress: dict[str, dict[str, Any]] = {}
        """Per exit being handled (launcher id): what its first try saw and did, so that a retry
        logs nothing twice and judges the exit as first seen (the member's state has moved on)."""

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if self.c.leading:
                try:
                    await self.once()
                except Exception:  # one bad round must not end exit detection and deadlines for good
                    log.exception("supervision round failed")
            await wait_event(stop, SUPERVISE_INTERVAL_S)

    async def once(self) -> None:
        now = time.monotonic()  # (a wall clock step is no gap of ours)
        if self._last_round is not None and now - self._last_round > SUPERVISE_INTERVAL_S + OWN_GAP_S:
            # No false fault from our own gap: what we did not watch starts from now.
            for job in self.c.jobs.values():
                for role, seen in job.service_seen_at.items():
                    job.service_seen_at[role] = max(seen, now)
            # Nor a start held against a member for the time we did not look (its hello may wait
            # in our socket): the start clocks move on by the gap.
            gap = now - self._last_round
            self._starting = {k: v + gap for k, v in self._starting.items()}
            self._warm_starting = {k: v + gap for k, v in self._warm_starting.items()}
        self._last_round = now
        # Trainer exits first: a node lost takes a gang rank and a replica in one poll, and the
        # replica's replacement, handled first, took the warm spare that survived on another node
        # (the launcher starts any member from a spare), so the new gang -- on the critical path,
        # the replica is not -- started cold (seen on Ray: tests/test_ray_testbed.py's kill).
        try:
            polled = await self._poll()
            if self._poll_failing_since is not None:
                log.warning("the launcher lists its members again after %.0f s",
                            time.monotonic() - self._poll_failing_since)
                self._poll_failing_since = None
        except Exception as exc:
            # The launcher cannot say who exited (a wedged dockerd, a Ray GCS away): the exits
            # wait for a later round, and the rest of this one goes on. It ended here, and with it
            # the watch of the services, the start and recovery deadlines, the owed resumes and
            # stops, for as long as the launcher failed (an outside review).
            if self._poll_failing_since is None:
                self._poll_failing_since = time.monotonic()
                log.error("the launcher cannot list its members (exits are read once it can): %s", exc)
            polled = []
        # (read after the poll: ``log_exits_of`` may have put exits here meanwhile)
        self._round = sorted(self._unhandled + polled, key=lambda e: e.role != "trainer")
        self._unhandled = []
        while self._round:  # (shared: a stop within this round's handling takes its job's exits)
            info = self._round.pop(0)
            try:
                await self.on_exit(info)
            except Exception:  # the rest of the batch is handled; this one next round
                since = self._progress.setdefault(info.member_id, {}).setdefault("failing_since", time.monotonic())
                if time.monotonic() - since > EXIT_RETRY_S:
                    # Failing the same way for so long: given up (its silence is the detector's).
                    log.exception("exit of %s not handled for %.0f s: given up", info.member_id, EXIT_RETRY_S)
                    self._progress.pop(info.member_id, None)
                    continue
                log.exception("exit of %s not handled: tried again next round", info.member_id)
                self._unhandled.append(info)
        self.c.retry_stops()
        for job in list(self.c.jobs.values()):
            try:
                await self.watch_services(job)
                await self.watch_starts(job)
                await self.c.recovery.check_deadlines(job)
                self.c.resend_owed_resume(job)
            except Exception:  # (one job's failing watch is no reason to skip the others')
                log.exception("job %s: supervision failed this round", job.job_id)

    async def log_exits_of(self, job: JobRun) -> None:
        """Handle now the exits of ``job``'s members that the launcher has (a stop that just
        ended them: their ``member_exited`` events must come before the job's final one, not
        in a round after it, where the log's reader finds them missing or past its end). Other
        jobs' exits, and any whose handling fails, are left to the next round (one already failed
        once is tried here too)."""
        try:
            polled = await self._poll()
        except Exception:  # (the members are stopped all the same; the next round polls again)
            log.exception("job %s: exits not polled at its stop: left to the next round", job.job_id)
            return
        self._unhandled += polled
        # Its exits waiting anywhere: polled now, left to be retried, or polled by a round whose
        # handling of an earlier exit is what stops the job (they would be logged after the end).
        mine = [e for e in self._round + self._unhandled if split_lid(e.member_id)[0] == job.job_id]
        self._round = [e for e in self._round if e not in mine]
        self._unhandled = [e for e in self._unhandled if e not in mine]
        for info in mine:
            try:
                await self.on_exit(info)
            except Exception:
                log.exception("exit of %s not handled at its job's stop: tried again next round", info.member_id)
                self._unhandled.append(info)

    async def _newest_trained(self, job: JobRun) -> int:
        """The newest step any gang of ``job`` recorded trained (the fenced trained log, written
        before a commit is announced: the commit may not have reached this controller yet), or
        the newest commit heard where Redis cannot be read."""
        try:
            return max(job.committed_step, await BatchStore(self.c.redis, job.job_id).newest_trained(0))
        except TransportError as exc:
            log.warning("job %s: trained log not read (%s): the newest commit heard is taken", job.job_id, exc)
            return job.committed_step

    async def _poll(self) -> list[ExitInfo]:
        """The launcher's new exits; one poll at a time (a stop's and a round's)."""
        async with self._polling:
            return await asyncio.to_thread(self.c.launcher.poll)

    async def on_exit(self, info: ExitInfo) -> None:
        job_id, member_id = split_lid(info.member_id)
        job = self.c.jobs.get(job_id)
        if job is None or member_id not in job.members:
            return
        m = job.members[member_id]
        seen = self._progress.setdefault(info.member_id, {})
        if "expected" not in seen:  # judged once, as first seen (a retry finds the state moved on)
            seen["before_hello"] = m.state == "starting"
            # A member of a replaced incarnation (e.g. the gang peer that died of the crash of its
            # partner) is not a new fault.
            seen["expected"] = (info.expected or not job.is_current(member_id) or m.state in ("dead", "stopped")
                                or job.done or (member_id in job.superseded and m.state == "starting"))
        before_hello, expected = seen["before_hello"], seen["expected"]
        if m.state != "stopped":
            m.state = "exited"
        if not seen.get("logged"):
            await self.c.event(job, "member_exited", {
                "member_id": member_id, "role": info.role, "returncode": info.returncode, "expected": expected,
                "exited_at": info.exited_at, "before_hello": before_hello})
            seen["logged"] = True
        if not expected and not seen.get("crashed"):
            # Not within a stop of its job: one judged unexpected whose handling failed once, tried
            # again by the stop (perhaps under the recovery lock, which ``_fail_job`` takes), is
            # logged only: a job ending needs no recovery.
            if not job.closing:
                await self._crashed(job, m, info, before_hello, seen)
            seen["crashed"] = True
        # Handled here: the detector forgets the member instead of reporting it once more.
        await self.c.bus.publish(subject(job.job_id, Verb.EXIT, member_id), MemberExited(
            job_id=job.job_id, member_id=member_id, role=info.role,  # type: ignore[arg-type]
            returncode=info.returncode, ts=info.exited_at, expected=True))
        await self.c.persist(job)
        self._progress.pop(info.member_id, None)

    async def _crashed(self, job: JobRun, m: MemberInfo, info: ExitInfo, before_hello: bool,
                       seen: dict[str, Any]) -> None:
        """Log the crash fault and act on it. ``seen`` is the exit's progress: a retry after a
        failure further on (the recovery's handling) neither logs the fault again nor counts the
        start-up failure twice (three counted for two real ones would fail the job)."""
        if "fault" not in seen:
            code = "unknown code" if info.returncode is None else f"code {info.returncode}"
            evidence = f"process exited with {code} (seen by the launcher)"
            diverged = m.role == "trainer" and info.returncode == EXIT_DIVERGED
            # (the one await here, before anything is counted: a retry counts nothing twice)
            trained = await self._newest_trained(job) if diverged else -1
            stalled = m.role == "trainer" and info.returncode == EXIT_CHECKPOINT_STALLED
            tail = self.c.starter.log_tail(job, m.member_id) if before_hello or stalled else ""  # (read once)
            if before_hello:
                job.failed_start(m)
                evidence = f"{evidence} before its hello" + (f"; last output:\n{tail}" if tail else "")
            if stalled:
                evidence = (f"checkpoints stalled: no checkpoint became durable for trainer.max_undurable_steps "
                            f"steps (exit code {EXIT_CHECKPOINT_STALLED})" + (f"; last output:\n{tail}" if tail else ""))
            if diverged:
                before = job.diverged_at
                # Judged once, as first seen: an earlier gang diverged with no step trained since?
                # (Not another rank of the same gang, nor a rank kept for the next gang that exits
                # before its hello there: the same divergence.)
                seen["diverged_again"] = (before is not None and before[0] == trained and before[1] != m.epoch
                                          and not before_hello)
                job.diverged_at = (trained, m.epoch)
                evidence = (f"training diverged (a loss or gradient norm not finite; exit code {EXIT_DIVERGED}) "
                            f"after step {trained} was trained")
            seen["fault"] = exit_fault(job, m, info, evidence, DIVERGED if diverged else None)
        fault: FaultReport = seen["fault"]
        evidence, slot = fault.evidence, (m.role, m.index)
        if not seen.get("fault_logged"):
            await self._detected(job, fault)
            seen["fault_logged"] = True
        failures = job.startup_failures.get(slot, 0) if before_hello else 0
        reason = None
        if m.role == "trainer" and info.returncode == EXIT_CHECKPOINT_LOST:
            tail = self.c.starter.log_tail(job, m.member_id)
            reason = ("the trainer found committed steps that no checkpoint can reproduce (checkpoint lost); "
                      "training on would rewrite the job's history" + (f"; last output:\n{tail}" if tail else ""))
        elif seen.get("diverged_again"):
            reason = (f"training diverged again after step {job.diverged_at[0] if job.diverged_at else '?'} with "
                      f"no step trained since the restart from the newest checkpoint: not a machine fault (the "
                      f"data, the model or the settings); each restart would end the same way")
        elif failures >= STARTUP_FAILURES_MAX:
            reason = (f"{m.role} slot {m.index} failed to start {failures} times in a row (the last: it "
                      f"exited before its hello): it cannot start. {evidence}")
        if reason is not None:
            await self._fail_job(job, fault, reason, seen)
            return
        await self._handle(fault)

    async def _fail_job(self, job: JobRun, fault: FaultReport, reason: str, seen: dict[str, Any]) -> None:
        """Fail the job for ``fault`` (a member that cannot start, a lost checkpoint): the decision
        is recorded once (``seen``), and only by the leader."""
        if not seen.get("fail_decided"):
            async with self.c.recovery.lock:  # first: the same fault reported by the detector waits
                if not await self.c.leads():  # a deposed leader fails no job (the new one judges it)
                    log.warning("job %s: %s; not failing the job: a newer lease term has begun", job.job_id,
                                reason)
                    return
                since = fault.fault_at if fault.fault_at is not None else fault.detected_at
                job.faults.append({"fault_id": fault.fault_id, "kind": fault.kind, "role": fault.role,
                                   "member_id": fault.member_id, "step": job.step,
                                   "detected_at": fault.detected_at, "fault_at": fault.fault_at,
                                   "detection_s": fault.detected_at - since,
                                   "evidence": fault.evidence, "recovery_s": None,
                                   "decision": {"actions": ["FailJob"], "reason": reason}})
                await self.c.event(job, "decision", {"fault_id": fault.fault_id, "actions": ["FailJob"],
                                                     "reason": reason})
                seen["fail_decided"] = True
        await self.c.stop_job(job.job_id, "failed", reason)

    async def watch_starts(self, job: JobRun) -> None:
        """A current member still starting ``detector.start_deadline_s`` after this controller
        first saw it starting is a fault (hang), decided and handled like any other (before the
        first commit: the whole job restarted; after: its role's recovery).

        Started means a hello heard, or a phase past ``starting`` reported (a hello is one publish:
        lost, its member would be killed healthy). While a recovery runs, no cold start is timed:
        the members it starts are bounded by its own deadline, which escalates (timed here too, a
        rank of the gang being recovered would be a second fault of the same recovery); the clocks
        start when it ends. The ranks it started warm (``warm_ranks``) are timed against
        ``recovery.warm_start_s`` meanwhile: one still silent then is a fault of its own, whose
        recovery supersedes this one (a frozen spare held the new gang for the whole deadline,
        then the job was restarted whole)."""
        if job.done or job.status == "pending" or job.recoveries:
            self._forget(self._starting, job.job_id)
            if job.done or job.status == "pending":
                self._forget(self._start_hung, job.job_id)
                self._forget(self._warm_starting, job.job_id)
            else:
                await self._time_starts(job, warm_ranks(job), self._warm_starting,
                                        job.spec.recovery.warm_start_s, "recovery.warm_start_s")
            return
        self._forget(self._warm_starting, job.job_id)
        members = {m.member_id: "" for m in job.members.values()}
        await self._time_starts(job, members, self._starting, job.spec.detector.start_deadline_s,
                                "start_deadline_s")

    async def _time_starts(self, job: JobRun, members: dict[str, str], clocks: dict[tuple[str, str], float],
                           bound: float, knob: str) -> None:
        """Each of ``members`` (member id -> how it was started, '' if not said) still starting
        ``bound`` after this controller first saw it so (``clocks``) failed its start."""
        now = time.monotonic()
        for key in [k for k in clocks if k[0] == job.job_id and k[1] not in members]:
            del clocks[key]
        for mid, how in members.items():
            key, m = (job.job_id, mid), job.members.get(mid)
            if m is None or not still_starting(m) or not job.is_current(mid):
                clocks.pop(key, None)
                continue
            first = clocks.setdefault(key, now)
            seen = self._start_hung.setdefault(key, {}) if now - first > bound else None
            if seen is None or seen.get("handled"):
                continue
            try:
                await self._start_hung_fault(job, m, bound, time.time() - (now - first), seen, knob, how)
            except Exception:  # tried again next round; what was done is not done twice
                if time.monotonic() - seen.setdefault("failing_since", time.monotonic()) > EXIT_RETRY_S:
                    log.exception("stuck start of %s not handled for %.0f s: given up", m.member_id,
                                  EXIT_RETRY_S)
                    seen["handled"] = True
                    continue
                log.exception("stuck start of %s not handled: tried again next round", m.member_id)

    @staticmethod
    def _forget(table: dict[tuple[str, str], Any], job_id: str) -> None:
        for key in [k for k in table if k[0] == job_id]:
            del table[key]

    async def _start_hung_fault(self, job: JobRun, m: MemberInfo, bound: float, since: float,
                                seen: dict[str, Any], knob: str = "start_deadline_s", how: str = "") -> None:
        if "fault" not in seen:
            # Off the loop: a live member's tail is a remote call on Ray (a Docker API one on Docker),
            # slowest when its node is in trouble -- when starts hang.
            tail = await asyncio.to_thread(self.c.starter.log_tail, job, m.member_id)
            evidence = ((f"started warm ({how}) {time.time() - since:.1f}s ago and nothing heard from it "
                         f"({knob}={bound:g})") if how else
                        (f"started {time.time() - since:.1f}s ago and has not said hello "
                         f"({knob}={bound:g}; phase {m.phase or 'starting'})")) + (
                             f"; last output:\n{tail}" if tail else "")
            seen["fault"] = FaultReport(job_id=job.job_id, fault_id=f"start-{m.member_id}-{uuid.uuid4().hex[:8]}",
                                        role=m.role, member_id=m.member_id, kind="hang",  # type: ignore[arg-type]
                                        evidence=evidence, detected_at=time.time(), step=job.step, fault_at=since,
                                        cause=WARM_START_SILENT if how else None)
            job.failed_start(m)  # a start that never finishes fails, as an exit before the hello does
        fault: FaultReport = seen["fault"]
        if not seen.get("logged"):
            await self._detected(job, fault)
            seen["logged"] = True
        if how and not seen.get("spares_cycled"):
            # The launcher's other idle spares may be frozen alike (a stopped node, a frozen
            # zygote's forks): replaced by new ones before the rank starts again, so that it does
            # not take another silent one (those started since cannot be ready yet: it starts cold).
            await asyncio.to_thread(self.c.cycle_spares)
            seen["spares_cycled"] = True
        failures = job.startup_failures.get((m.role, m.index), 0)
        if failures >= STARTUP_FAILURES_MAX:
            await self._fail_job(job, fault, f"{m.role} slot {m.index} did not finish starting {failures} times "
                                             f"in a row: it cannot start. {fault.evidence}", seen)
        else:
            await self._handle(fault)
        seen["handled"] = True

    async def _detected(self, job: JobRun, fault: FaultReport) -> None:
        """The ``fault_detected`` event of a fault this controller found itself."""
        await self.c.event(job, "fault_detected", {
            "fault_id": fault.fault_id, "kind": fault.kind, "role": fault.role, "member_id": fault.member_id,
            "step": fault.step, "detected_at": fault.detected_at, "fault_at": fault.fault_at,
            "evidence": fault.evidence, "source": "controller", "cause": fault.cause})

    async def _handle(self, fault: FaultReport) -> None:
        """Act on a fault this controller detected (it is in the event log already, so the fault
        inbox delivers it to whoever leads): a lease lost meanwhile leaves it to the new leader,
        and this round goes on (the other exits it polled are reported once only)."""
        try:
            await self.c.recovery.handle(fault)
        except LeaseLost as exc:
            log.warning("fault %s left for the new leader: %s", fault.fault_id, exc)

    async def watch_services(self, job: JobRun) -> None:
        """A watched control-plane service silent past ``silence_s`` is lost: a fault of its own
        (the detector may be down too, so the controller does not wait for it)."""
        if job.done or job.status == "pending":
            return
        now = time.monotonic()
        for role in WATCHED_SERVICES:
            seen = job.service_seen_at.get(role)
            if seen is None or role in job.services_lost:
                continue
            if any(role in r.replacing for r in job.recoveries):
                continue
            silent = now - seen
            if silent <= job.spec.detector.silence_s:
                continue
            job.services_lost.add(role)
            fault = FaultReport(job_id=job.job_id, fault_id=f"silent-{role}-{uuid.uuid4().hex[:8]}",
                                role=role, member_id=role, kind="unresponsive",  # type: ignore[arg-type]
                                evidence=f"no metrics from the {role} for {silent:.1f}s "
                                         f"(silence_s={job.spec.detector.silence_s:g})",
                                detected_at=time.time(), step=job.step, fault_at=time.time() - silent)
            await self._detected(job, fault)
            await self._handle(fault)
