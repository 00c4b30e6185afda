"""The detector process: NATS in, fault reports out. It never acts on a fault itself.

It listens to every job's hello, phase, metrics and exit messages, control commands (a member
the controller stopped is forgotten) and the event log (tool faults, job ends). On first sight
of a job it asks the controller for the job spec to learn its thresholds. A ticker evaluates
the rules of :mod:`robustrl.services.detector.rules` every ``metrics_interval_s / 2``, sends
heartbeat probes and publishes each :class:`FaultReport` on ``rrl.<job>.fault`` at once; its
``fault_detected`` event (data: fault_id, kind, role, member_id, step, detected_at, fault_at,
cause, evidence) is saved in the job's detector outbox in Redis and appended to the job's log in
the background (:mod:`robustrl.services.detector.eventlog`), so a slow JetStream delays no report
and no tick, and a detector killed meanwhile loses no event: the next one appends it.
A member's fault id is derived from (job, member), so a restarted detector that reports the same
fault again sends the same id. Control commands carry the controller's fencing token: one older
than the job's newest seen (a deposed controller) is ignored, as the request manager does.

Every time stamp the rules see is this process's clock at receipt, never a member's: its
monotonic clock, so a step of the wall clock (NTP, a VM resumed) neither blinds the rules (a
step back left every silence unjudged for the step's length) nor fakes a gap. Reports carry
wall times (``detected_at``, ``fault_at``, ``last_progress_at``), converted when they are sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from robustrl.aio import within
from robustrl.bus import Bus
from robustrl.config import DetectorSpec, JobSpec
from robustrl.errors import ConfigError, RobustRLError
from robustrl.messages import (
    ControlCommand, Event, FaultReport, MemberExited, MemberHello, MetricsSample, PhaseChange, ProbeReply,
    ProbeRequest, SpecReply, SpecRequest,
)
from robustrl.services.detector.eventlog import EventWriter
from robustrl.services.detector.monitor import JobMonitor, gap_bound_s
from robustrl.storage.control_stores import fence_floor
from robustrl.storage.redis_stores import Keys
from robustrl.subjects import EVENTS_ALL, Verb, all_jobs, all_jobs_exact, parse, subject

log = logging.getLogger(__name__)

SPEC_TIMEOUT_S = 2.0
"""How long one job-spec request to the controller may take."""
SPEC_RETRY_S = 1.0
"""Pause between job-spec requests while the controller does not answer."""
MARKS_CALL_S = 1.0
"""How long one read or write of a job's member marks may take (off the tick)."""
MARKS_READ_TRIES = 3
MARKS_RETRY_S = 1.0
MARKS_RETRY_MAX_S = 30.0
MIN_TICK_S = 0.05
MAX_TICK_S = 1.0
JOB_END_EVENTS = frozenset({"job_finished", "job_failed", "job_stopped"})
MEMBER_NAME = "detector"
ROLE_NAMES = frozenset({"trainer", "rollout", "request_manager"})


@dataclass
class Stats:
    """Counters, for tests and the service's own log."""

    samples: int = 0
    dropped_samples: int = 0
    probes_sent: int = 0
    probes_answered: int = 0
    faults_reported: int = 0


class DetectorService:
    """One detector serving every job on a NATS server."""

    def __init__(self, bus: Bus, *, redis: Any = None, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time,
                 spec_timeout_s: float = SPEC_TIMEOUT_S, spec_retry_s: float = SPEC_RETRY_S) -> None:
        """``redis``: the client of the detector's outboxes (None: its events are queued in
        memory only, lost if it is killed before JetStream stores them). ``clock``: the rules'
        clock (never stepped); ``wall``: the clock of the times reports carry."""
        self.bus = bus
        self.clock = clock
        self.wall = wall
        self.jobs: dict[str, JobMonitor] = {}
        self.ended: set[str] = set()
        self.stats = Stats()
        self._spec_timeout_s = spec_timeout_s
        self._spec_retry_s = spec_retry_s
        self._tasks: set[asyncio.Task[None]] = set()
        self._subs: list[object] = []
        self._started = False
        self._bus_was_down = False
        self._disconnects_seen = bus.disconnects
        self.events = EventWriter(bus, redis)
        self._redis = redis
        self._marks_wake = asyncio.Event()

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Subscribe and start ticking; harmless if called twice."""
        if self._started:
            return
        self._started = True
        b = self.bus
        self._subs += [
            await b.subscribe(all_jobs(Verb.METRICS), MetricsSample, self._on_metrics),
            await b.subscribe(all_jobs(Verb.PHASE), PhaseChange, self._on_phase),
            await b.subscribe(all_jobs(Verb.EXIT), MemberExited, self._on_exit),
            await b.subscribe(all_jobs(Verb.HELLO), MemberHello, self._on_hello),
            await b.subscribe(all_jobs(Verb.CONTROL), ControlCommand, self._on_control),
            await b.subscribe(all_jobs_exact(Verb.CONTROL), ControlCommand, self._on_control),
            await b.subscribe(EVENTS_ALL, Event, self._on_event),
        ]
        await b.client.flush()
        self.events.start_recovery()  # what a killed detector left in the outboxes, in the background
        self._spawn(self._tick_loop())
        if self._redis is not None:
            self._spawn(self._marks_loop())
        log.info("detector listening")

    async def run(self, stop: asyncio.Event) -> None:
        """Start, run until ``stop`` is set, then shut down in order."""
        await self.start()
        try:
            await stop.wait()
        finally:
            await self.stop()

    async def stop(self) -> None:
        """Take no new work, cancel child tasks and wait for them; harmless if called twice."""
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()  # type: ignore[attr-defined]
        self._subs.clear()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel("detector stopping")
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        await self.events.close()

    def _spawn(self, coro: object) -> None:
        task = asyncio.create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("detector task failed", exc_info=task.exception())

    # --- jobs and specs --------------------------------------------------------------------

    def _job(self, job_id: str) -> JobMonitor | None:
        if job_id in self.ended:
            return None
        mon = self.jobs.get(job_id)
        if mon is None:
            mon = self.jobs[job_id] = JobMonitor(job_id)
            self._spawn(self._learn_spec(mon))
        return mon

    async def _learn_spec(self, mon: JobMonitor) -> None:
        """Ask the controller for the job spec until it answers (members may talk first)."""
        req = SpecRequest(job_id=mon.job_id, member_id=MEMBER_NAME)
        while mon.cfg is None and mon.job_id not in self.ended:
            try:
                reply = await self.bus.request(subject(mon.job_id, Verb.SPEC), req, SpecReply,
                                               timeout=self._spec_timeout_s)
            except RobustRLError as exc:
                log.info("no spec for job %s yet: %s", mon.job_id, exc)
                await asyncio.sleep(self._spec_retry_s)
                continue
            await self._restore_marks(mon)
            mon.configure(detector_spec(reply.spec))
            log.info("job %s: thresholds %s", mon.job_id, mon.cfg)

    # --- inputs ----------------------------------------------------------------------------

    async def _on_metrics(self, msg: MetricsSample, subj: str, _reply: str | None) -> None:
        if not _consistent(msg.job_id, subj, msg.member_id):
            return
        mon = self._job(msg.job_id)
        if mon is None:
            return
        if mon.sample(msg, self.clock()):
            self.stats.samples += 1
        else:
            self.stats.dropped_samples += 1

    async def _on_phase(self, msg: PhaseChange, subj: str, _reply: str | None) -> None:
        mon = self._job(msg.job_id) if _consistent(msg.job_id, subj, msg.member_id) else None
        if mon is not None:
            mon.phase(msg, self.clock())

    async def _on_hello(self, msg: MemberHello, subj: str, _reply: str | None) -> None:
        mon = self._job(msg.job_id) if _consistent(msg.job_id, subj) else None
        if mon is not None:
            mon.hello(msg, self.clock())

    async def _on_exit(self, msg: MemberExited, subj: str, _reply: str | None) -> None:
        mon = self._job(msg.job_id) if _consistent(msg.job_id, subj) else None
        if mon is None:
            return
        # The exit's own time (the launcher's wall clock) on the rules' clock: a crash's fault_at.
        msg = msg.model_copy(update={"ts": msg.ts - self._wall_offset()})
        report = mon.exited(msg, self.clock())
        if report is not None:
            await self._report(report)
            self._marks_wake.set()

    async def _on_control(self, msg: ControlCommand, subj: str, _reply: str | None) -> None:
        """A member the controller stopped or declared dead: its silence from now on is expected."""
        mon = self.jobs.get(msg.job_id) if _consistent(msg.job_id, subj) else None
        if mon is None:
            return
        floor = await fence_floor(self._redis, mon.fence, "detector")
        if not mon.admit_fence(msg.fence, floor):
            # From a deposed controller (one leader at a time, under a lease): the replica it
            # names may still be in the current leader's use, so it stays watched.
            log.warning("job %s: %s %s ignored: fencing token %d is older than %d", msg.job_id, msg.action,
                        msg.args.get("member_id", msg.target), msg.fence, floor)
            return
        if msg.action == "replica_dead":
            # Sent to the request manager; the dead replica is named in the arguments.
            member = msg.args.get("member_id")
            if isinstance(member, str):
                mon.forget(member)
        elif msg.action == "stop":
            if msg.target == "request_manager":
                # Sent only when the controller stops the whole job (stop_job), before it stops the
                # members: their silence from now on is the job ending (the job's final event comes
                # only after every member is gone, up to the trainer's last-upload grace later).
                for role in ROLE_NAMES:
                    mon.forget_role(role)
            elif msg.target in ROLE_NAMES:
                mon.forget_role(msg.target)
            else:
                mon.forget(msg.target)

    async def _on_event(self, msg: Event, _subj: str, _reply: str | None) -> None:
        if msg.kind in JOB_END_EVENTS:
            self.ended.add(msg.job_id)
            self.jobs.pop(msg.job_id, None)
        elif msg.kind == "tool_fault":
            mon = self._job(msg.job_id)
            report = mon.tool_fault(msg, self.clock()) if mon is not None else None
            if report is not None:
                await self._report(report)
        elif msg.kind == "job_started":
            # A job id reused for a new run starts with a clean slate.
            self.ended.discard(msg.job_id)
        elif msg.kind == "member_started" and isinstance(msg.data.get("borrowed_from"), str):
            # A process switched in place (a kept rank, a borrowed replica) goes on under the new
            # member id: its old id's silence from now on is the hand-off, not a fault.
            mon = self.jobs.get(msg.job_id)
            if mon is not None:
                mon.forget(msg.data["borrowed_from"])

    # --- ticking, probing, reporting -------------------------------------------------------

    def tick_period(self) -> float:
        intervals = [m.cfg.metrics_interval_s / 2 for m in self.jobs.values() if m.cfg is not None]
        return min(MAX_TICK_S, max(MIN_TICK_S, min(intervals, default=MAX_TICK_S)))

    async def _tick_loop(self) -> None:
        while True:
            # A periodic tick, not a wait for a condition: the rules are functions of time.
            await asyncio.sleep(self.tick_period())
            try:
                await self.tick()
            except Exception:  # one bad tick must not end detection for every job
                log.exception("detector tick failed")

    async def tick(self) -> None:
        """Evaluate every job once: send the probes and report the faults the rules ask for.

        Not while this detector's own NATS connection is down (a server restart): every member
        falls silent to it then, and judging them would report the whole job unresponsive (seen:
        both replicas replaced after a NATS restart). Once it is back, member clocks restart."""
        now = self.clock()
        if not self.bus.connected:
            self._bus_was_down = True
            return
        disconnects = self.bus.disconnects
        if self._bus_was_down or disconnects != self._disconnects_seen:  # down, even between two ticks
            self._bus_was_down, self._disconnects_seen = False, disconnects
            for mon in self.jobs.values():
                mon.own_outage(now)
            log.warning("NATS connection was down: member clocks restart now")
        for mon in list(self.jobs.values()):
            gaps = mon.gaps
            result = mon.tick(now)
            if mon.gaps != gaps:
                log.warning("job %s: the detector did not run for a while (ticks more than %.1fs apart); "
                            "member clocks restart now", mon.job_id, gap_bound_s(mon.cfg) if mon.cfg else 0.0)
            for probe in result.probes:
                self.stats.probes_sent += 1
                assert mon.cfg is not None
                self._spawn(self._probe(mon, probe, mon.cfg.probe_timeout_s))
            for report in result.faults:
                await self._report(report)
            if mon.dirty:
                self._marks_wake.set()

    # --- marks: what a restarted detector must know of each member --------------------------

    async def _restore_marks(self, mon: JobMonitor) -> None:
        """Read the job's marks a previous detector saved (``JobMonitor.restore``), before any
        rule runs; a few bounded tries, then go on without them (logged): detection must not wait
        for Redis, and what is lost is only the id of a repeated fault."""
        if self._redis is None:
            return
        for attempt in range(MARKS_READ_TRIES):
            try:
                raw = await within(self._redis.hgetall(Keys.detector_marks(mon.job_id)), MARKS_CALL_S)
            except Exception as exc:
                log.warning("job %s: member marks not read (try %d): %s", mon.job_id, attempt + 1, exc)
                await asyncio.sleep(MARKS_RETRY_S)
                continue
            marks: dict[str, int] = {}
            for key, value in raw.items():
                member = key.decode() if isinstance(key, bytes) else str(key)
                try:
                    marks[member] = int(value)
                except (TypeError, ValueError):
                    log.warning("job %s: member mark %r of %s is not a number; ignored", mon.job_id, value, member)
            mon.restore(marks)
            if marks:
                log.info("job %s: member marks of a previous detector taken up: %s", mon.job_id, marks)
            return
        log.error("job %s: member marks not read; a repeated fault of a member reported before this "
                  "detector started may be taken for the handled one", mon.job_id)

    async def _marks_loop(self) -> None:
        """The one writer of every job's marks, off the tick (which never waits on Redis); what
        failed is written again after ``MARKS_RETRY_S``. In order: one write at a time."""
        pause = MARKS_RETRY_S
        while True:
            await self._marks_wake.wait()
            self._marks_wake.clear()
            for mon in list(self.jobs.values()):
                if not mon.dirty:
                    continue
                members, mon.dirty = mon.dirty, set()
                marks = {m: mon.mark(m) for m in members}
                try:
                    await within(self._redis.hset(Keys.detector_marks(mon.job_id), mapping=marks), MARKS_CALL_S)
                    pause = MARKS_RETRY_S
                except Exception as exc:
                    mon.dirty |= members
                    log.warning("job %s: member marks not saved (again in %.0fs): %s", mon.job_id, pause, exc)
                    await asyncio.sleep(pause)
                    pause = min(MARKS_RETRY_MAX_S, 2 * pause)  # (a refusal, e.g. an older ACL, is not retried each second)
                    self._marks_wake.set()
                    break

    async def _probe(self, mon: JobMonitor, probe: ProbeRequest, timeout_s: float) -> None:
        try:
            reply = await self.bus.request(subject(mon.job_id, Verb.PROBE, probe.member_id), probe,
                                           ProbeReply, timeout=timeout_s)
        except RobustRLError as exc:
            # No answer is the rule's business: it times the probe out on its own clock.
            log.info("probe of %s/%s: %s", mon.job_id, probe.member_id, exc)
            return
        if mon.probe_reply(probe.member_id, reply.nonce, self.clock()):
            self.stats.probes_answered += 1

    def _wall_offset(self) -> float:
        """Wall time minus the rules' clock, now."""
        return self.wall() - self.clock()

    def _on_the_wall(self, report: FaultReport) -> FaultReport:
        """``report`` with its times (the rules' clock) as wall times, for the controller and the log."""
        offset = self._wall_offset()
        return report.model_copy(update={
            name: value + offset for name in ("detected_at", "fault_at", "last_progress_at")
            if (value := getattr(report, name)) is not None})

    async def _report(self, report: FaultReport) -> None:
        report = self._on_the_wall(report)
        self.stats.faults_reported += 1
        log.warning("fault %s: %s %s %s: %s", report.fault_id, report.kind, report.role, report.member_id,
                    report.evidence)
        try:
            await self.bus.publish(subject(report.job_id, Verb.FAULT), report)
        except Exception as exc:  # the event below still records it; the controller may re-read
            log.error("could not publish fault %s: %s", report.fault_id, exc)
        # Queued, its append not awaited: JetStream slow to acknowledge must not hold up the next
        # report. Saved in the job's outbox first, the save cut short (``REDIS_CALL_S``) if Redis is slow.
        await self.events.emit(report.job_id, "fault_detected", {
            "fault_id": report.fault_id, "kind": report.kind, "role": report.role,
            "member_id": report.member_id, "step": report.step, "detected_at": report.detected_at,
            "fault_at": report.fault_at, "cause": report.cause, "evidence": report.evidence})


def detector_spec(raw: dict[str, object]) -> DetectorSpec:
    """The detector thresholds of a job spec as the controller sent it."""
    try:
        return JobSpec.parse(raw).detector
    except ConfigError as exc:
        # A spec this version cannot fully parse still tells us its thresholds.
        log.warning("job spec not fully understood (%s); reading only its detector section", exc)
        try:
            return DetectorSpec.model_validate(raw.get("detector"))
        except ValidationError:
            return DetectorSpec.reference()


def _consistent(job_id: str, subj: str, member_id: str | None = None) -> bool:
    """A message must name the job of the subject it came on (no cross-job injection) and, for a
    member's own subject, that member: a sample on ``rrl.<job>.metrics.<a>`` saying it is ``b``
    (a lost GPU, a frozen counter) would act on ``b``."""
    try:
        job, _verb, tokens = parse(subj)
    except RobustRLError:
        return False
    return job == job_id and (member_id is None or tokens == [member_id])
