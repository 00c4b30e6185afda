"""The controller's view of a job: members, progress, faults and recovery state.

Pure data: the runtime mutates it from NATS messages and launcher events; the REST API and
the metrics endpoint render it with :meth:`JobRun.status_dict`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

from robustrl.config import JobSpec
from robustrl.messages import FaultReport
from robustrl.procs import monotonic_of

log = logging.getLogger(__name__)

JobStatus = Literal["pending", "running", "recovering", "finished", "failed", "stopped"]
ACTIVE = ("running", "recovering", "pending")
"""Statuses of a job that has not ended."""


@dataclass
class MemberInfo:
    member_id: str
    role: str
    index: int  # trainer rank or rollout slot
    epoch: int  # trainer gang epoch / rollout incarnation
    state: str = "starting"  # starting | running | ready | exited | stopped | dead
    phase: str = "starting"
    weights_version: int = -1
    pid: int | None = None
    started_at: float = field(default_factory=time.time)
    # The launcher's re-attach handle (pid + start time, or container id), persisted for a restart.
    handle: dict[str, Any] = field(default_factory=dict)
    adopted: bool = False  # re-attached by a restarted controller (its hello may predate this controller)
    heard: bool = False
    """This controller heard from it (a spec request, metrics, a phase, a hello); not in the record:
    a live member's metrics come again within an interval."""
    clock_start: float = field(default_factory=time.monotonic)
    """``started_at`` on this controller's monotonic clock, which its deadlines are judged by (a
    wall clock stepped back an hour held every start unjudged for an hour); not in the record."""
    warm: bool = False
    """Started from a warm spare (the launcher's ``was_warm``): its failed start is the spare's,
    not its slot's (``JobRun.failed_start``)."""

    def to_record(self) -> dict[str, Any]:
        return {"role": self.role, "index": self.index, "epoch": self.epoch, "state": self.state,
                "weights_version": self.weights_version, "pid": self.pid, "started_at": self.started_at,
                "handle": self.handle, "warm": self.warm}

    @classmethod
    def from_record(cls, member_id: str, rec: dict[str, Any]) -> MemberInfo:
        started_at = float(rec.get("started_at", time.time()))
        return cls(member_id, rec["role"], int(rec["index"]), int(rec["epoch"]),
                   state=rec.get("state", "running"), weights_version=int(rec.get("weights_version", -1)),
                   pid=rec.get("pid"), started_at=started_at, handle=dict(rec.get("handle") or {}),
                   clock_start=monotonic_of(started_at), warm=bool(rec.get("warm", False)))


@dataclass
class ActiveRecovery:
    """A recovery the runtime is carrying out (``decide.RecoveryView`` is its snapshot)."""

    fault_id: str
    role: str
    kind: str  # "trainer" | "replica" | "whole_job" | "service"
    started_at: float
    step: int
    deadline_at: float
    waiting_for: set[str] = field(default_factory=set)
    replacing: set[str] = field(default_factory=set)
    committed_at_fault: int = -1
    starts_counted: set[str] = field(default_factory=set)
    """Members whose start this recovery's passed deadline counted as failed
    (``RecoveryExecutor._unstartable``), each once; dropped with the recovery. Changed together
    with ``JobRun.startup_failures`` (no await between): a record a new leader reads holds both
    counts or neither, so it neither counts a start again nor loses one."""
    clock_start: float = field(default_factory=time.monotonic)
    """``started_at`` on this controller's monotonic clock: its deadline is judged by it (on the
    wall clock, a step back of an hour held the recovery unjudged for an hour, a step forward
    escalated it at once); not in the record, where the wall time is what a new leader has."""

    def to_record(self) -> dict[str, Any]:
        return {"fault_id": self.fault_id, "role": self.role, "kind": self.kind,
                "started_at": self.started_at, "step": self.step, "deadline_at": self.deadline_at,
                "waiting_for": sorted(self.waiting_for), "replacing": sorted(self.replacing),
                "committed_at_fault": self.committed_at_fault, "starts_counted": sorted(self.starts_counted)}

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> ActiveRecovery:
        return cls(rec["fault_id"], rec["role"], rec["kind"], float(rec["started_at"]), int(rec["step"]),
                   float(rec["deadline_at"]), set(rec.get("waiting_for", [])), set(rec.get("replacing", [])),
                   int(rec.get("committed_at_fault", -1)), set(rec.get("starts_counted", [])),
                   monotonic_of(float(rec["started_at"])))


@dataclass
class GangStart:
    """Where the ranks of a trainer recovery's new gang came from, and the rollout slots it
    borrowed. Kept in the job's durable record: a controller that fails over mid-recovery hands
    the slots still owed a replacement to the next leader."""

    sources: list[str]
    borrowed_slots: dict[int, int]
    """slot -> the incarnation borrowed from it (restocked unless the slot was restarted since)."""

    @property
    def source(self) -> str:
        """The recovery's source, named after its slowest kind of start: cold > borrowed > spare > survivor."""
        return next((s for s in ("cold", "borrowed", "spare", "survivor") if s in self.sources), "cold")

    def to_record(self) -> dict[str, Any]:
        return {"sources": list(self.sources), "borrowed_slots": {str(k): v for k, v in self.borrowed_slots.items()}}

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> GangStart:
        return cls([str(s) for s in rec.get("sources", [])],
                   {int(k): int(v) for k, v in (rec.get("borrowed_slots") or {}).items()})


def still_starting(m: MemberInfo) -> bool:
    """No hello heard and no phase past ``starting`` reported (a hello may be lost: a member that
    reports a later phase has started)."""
    return m.state == "starting" and m.phase in ("", "starting")


STARTUP_FAILURES_MAX = 3
"""Consecutive failed starts (an exit before the hello, a start past its deadline) per role slot
that fail the job (a member that cannot start)."""


@dataclass
class JobRun:
    job_id: str
    spec: JobSpec
    status: JobStatus = "pending"
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    epoch: int = 0
    slot_incarnation: dict[int, int] = field(default_factory=dict)
    members: dict[str, MemberInfo] = field(default_factory=dict)
    committed_step: int = -1
    durable_step: int = -1
    weights_version: int = -1
    weights_checksum: str = ""
    reward_by_step: dict[int, float] = field(default_factory=dict)
    last_step_timings: dict[str, float] = field(default_factory=dict)
    faults: list[dict[str, Any]] = field(default_factory=list)
    recoveries: list[ActiveRecovery] = field(default_factory=list)
    failures_by_step: dict[tuple[str, int], int] = field(default_factory=dict)
    restarts_total: int = 0
    error: str | None = None
    ettr: float | None = None
    injected_at: dict[str, float] = field(default_factory=dict)  # member -> last chaos injection
    chaos_by_id: dict[str, asyncio.Future[str]] = field(default_factory=dict)
    """fault id -> the member its injection hit (a future while it is carried out): a request
    repeated with the same fault id (its answer was lost, e.g. across a NATS restart) is answered,
    not carried out again. Rebuilt from the event log's ``fault_injected`` by a new leader."""
    closing: bool = False  # stop_job under way: the final status is set once its event is durable
    stop_owed: dict[str, Any] | None = None
    """The stop under way (``{"status", "reason"}``), in the record from its start to the final
    status: a leader that dies part-way leaves it to the next, which carries it out (before, the
    next found the job running with its members stopped, resumed it, and the job came back)."""
    launched: bool = False
    """Every first member was started and recorded (persisted): a job whose record says otherwise
    had its start interrupted (its leader died or was deposed) and is started again by the next."""
    # (role, slot) -> failed starts in a row (an exit before the hello, a start past its deadline)
    startup_failures: dict[tuple[str, int], int] = field(default_factory=dict)
    diverged_at: tuple[int, int] | None = None
    """(committed step, gang epoch) when a trainer rank last exited diverged (``EXIT_DIVERGED``):
    a later gang diverging with no step committed since fails the job."""
    cold_roles: set[str] = field(default_factory=set)
    """Roles a start from a warm spare failed for: their members start cold until one has started."""
    cold_slots: set[tuple[str, int]] = field(default_factory=set)
    """(role, slot) whose start from a warm spare failed: started cold until it has started (another
    slot of its role starting first ends ``cold_roles``, not this)."""
    service_seen_at: dict[str, float] = field(default_factory=dict)
    """Control-plane role -> its last sign of life, on this controller's monotonic clock (not in
    the record: a new leader starts each from its take-over)."""
    services_lost: set[str] = field(default_factory=set)  # control-plane roles seen lost, not yet resumed
    rm_resume_owed: bool = False
    """A ``resume`` (after the launch, after a whole-job restart) the request manager has not
    acknowledged: sent again every ``RM_RESUME_RETRY_S`` until it is, or until a ``pause``,
    ``restart_step`` or ``stop`` supersedes it. Not persisted: a new leader owes every job it takes
    up a resume (``Takeover.restore``)."""
    rm_resume_next_at: float = 0.0
    rm_resume_sending: int = 0  # resumes in flight: the round sends an owed one only when none is
    rm_supersede_seq: int = 0
    """Counts the request-manager commands that supersede a resume: a resume still being retried
    when one is sent stops there (arriving after it, it would undo the pause)."""
    gang_starts: dict[str, GangStart] = field(default_factory=dict)
    """fault id -> how the gang of a trainer recovery in progress was started (persisted)."""
    restock_owed: dict[int, int] = field(default_factory=dict)
    """Rollout slots owed a replacement replica now (slot -> the incarnation borrowed from it),
    persisted until the replacement is started: a new leader restocks them (``RecoveryExecutor.restock``)."""
    deleting: dict[str, bool] | None = None
    """Set once ``DELETE /v1/jobs/{id}`` marked the job (what is to go: checkpoints, events);
    persisted, so a controller that takes over finishes the deletion."""
    recheck_after_recovery: dict[str, FaultReport] = field(default_factory=dict)
    """Rollout member -> its weights fault ignored while a trainer recovery ran, looked at again
    once it is over (``RecoveryExecutor``). Persisted: a leader that takes over looks at them
    (``RecoveryExecutor.resume_rechecks``); dropped, a replica still unable to load would never be
    reported again (the detector reports a member once)."""
    superseded: set[str] = field(default_factory=set)
    """Members of a recovery start a previous leader left unfinished, re-attached at the takeover
    before their hello: the restart of that recovery supersedes them, so their exit meanwhile is
    expected, not a crash before the hello (in memory: a later takeover finds them again)."""
    commit_epoch: int = -1
    """The gang epoch of the last commit heard (not persisted): a trainer's hello sent again after
    its gang committed (its first was lost) must not move ``durable_step`` back to its resume step."""
    trained_unheard: int = -1
    """A step of the current gang the trained log holds but no commit was heard of, at the last
    progress check (-1: none); the next check still finding it reads the event log."""

    @property
    def policy(self) -> str:
        return self.spec.recovery.policy

    @property
    def step(self) -> int:
        """The step in progress (the next one to commit)."""
        return self.committed_step + 1

    @property
    def done(self) -> bool:
        """Finished, failed or stopped, or being stopped (no more recovery, no more commits)."""
        return self.closing or self.status in ("finished", "failed", "stopped")

    def live(self, role: str | None = None) -> list[MemberInfo]:
        return [m for m in self.members.values()
                if m.state not in ("exited", "stopped", "dead") and (role is None or m.role == role)]

    def current_trainers(self) -> list[MemberInfo]:
        return [m for m in self.members.values() if m.role == "trainer" and m.epoch == self.epoch]

    def current_replicas(self) -> list[MemberInfo]:
        latest: dict[int, MemberInfo] = {}
        for m in self.members.values():
            if m.role == "rollout" and (m.index not in latest or m.epoch > latest[m.index].epoch):
                latest[m.index] = m
        return [latest[i] for i in sorted(latest)]

    def failed_start(self, m: MemberInfo) -> int:
        """Count one more failed start of ``m``'s slot; returns its failed starts in a row. A start
        from a warm spare is not counted: its role's and its slot's next starts are cold
        (``cold_roles``, ``cold_slots``), and only cold starts tell that a slot cannot start.
        Counted, spares broken alike (a frozen zygote's forks, a stale spare image) failed a job
        "cannot start" that a cold start would have run; per slot, the gang's other rank took the
        next broken spare."""
        slot = (m.role, m.index)
        if m.warm:
            self.cold_roles.add(m.role)
            self.cold_slots.add(slot)
            return self.startup_failures.get(slot, 0)
        self.startup_failures[slot] = self.startup_failures.get(slot, 0) + 1
        return self.startup_failures[slot]

    def started(self, m: MemberInfo) -> None:
        """``m`` finished its start (a hello, metrics past ``starting``, current weights): its
        slot's failed starts in a row are over, and the next starts of its role (of its slot, once
        that has started) may take spares again."""
        self.startup_failures.pop((m.role, m.index), None)
        self.cold_roles.discard(m.role)
        self.cold_slots.discard((m.role, m.index))

    def starts_cold(self, role: str, index: int) -> bool:
        """Whether the next start of ``role``'s slot ``index`` must be cold (``failed_start``)."""
        return role in self.cold_roles or (role, index) in self.cold_slots

    def is_current(self, member_id: str) -> bool:
        m = self.members.get(member_id)
        if m is None:
            return False
        if m.role == "trainer":
            return m.epoch == self.epoch
        if m.role == "rollout":
            return self.slot_incarnation.get(m.index) == m.epoch
        return True

    def to_record(self) -> dict[str, Any]:
        """The job's durable record (the registry's value): what a controller taking over resumes."""
        return {
            "spec": self.spec.model_dump(mode="json"), "status": self.status, "epoch": self.epoch,
            "committed_step": self.committed_step, "durable_step": self.durable_step,
            "weights_version": self.weights_version, "weights_checksum": self.weights_checksum,
            "created_at": self.created_at, "started_at": self.started_at, "error": self.error,
            "restarts_total": self.restarts_total,
            "failures_by_step": [[r, s, n] for (r, s), n in self.failures_by_step.items()],
            "startup_failures": [[r, i, n] for (r, i), n in self.startup_failures.items()],
            "diverged_at": self.diverged_at,
            "cold_roles": sorted(self.cold_roles), "cold_slots": sorted([r, i] for r, i in self.cold_slots),
            "slot_incarnation": {str(k): v for k, v in self.slot_incarnation.items()},
            "reward_by_step": {str(k): v for k, v in self.reward_by_step.items()},
            "members": {mid: m.to_record() for mid, m in self.members.items()},
            "recoveries": [r.to_record() for r in self.recoveries], "faults": self.faults[-200:],
            "gang_starts": {fid: g.to_record() for fid, g in self.gang_starts.items()},
            "restock_owed": {str(k): v for k, v in self.restock_owed.items()}, "launched": self.launched,
            "finished_at": self.finished_at, "ettr": self.ettr, "deleting": self.deleting,
            "stop_owed": self.stop_owed,
            "recheck_after_recovery": {mid: fault.model_dump(mode="json")
                                       for mid, fault in self.recheck_after_recovery.items()}}

    @classmethod
    def from_record(cls, job_id: str, rec: dict[str, Any]) -> JobRun:
        """The job a durable record describes (``to_record``'s inverse; older records' missing
        fields take their defaults).

        Raises:
            KeyError, ValueError, TypeError: the record is unusable.
        """
        job = cls(job_id=job_id, spec=JobSpec.parse(rec["spec"], saved=True), created_at=rec.get("created_at", time.time()))
        job.status = rec.get("status", "running")
        job.started_at = rec.get("started_at")
        job.error = rec.get("error")  # (left out, a new leader's next save of a failed job wrote null over it)
        job.epoch = int(rec.get("epoch", 0))
        job.committed_step = int(rec.get("committed_step", -1))
        job.durable_step = int(rec.get("durable_step", -1))
        job.weights_version = int(rec.get("weights_version", -1))
        job.weights_checksum = rec.get("weights_checksum", "")
        job.restarts_total = int(rec.get("restarts_total", 0))
        job.failures_by_step = {(r, int(s)): int(n) for r, s, n in rec.get("failures_by_step", [])}
        # (a new leader goes on counting a slot's failed starts: hangs and failovers come together)
        job.startup_failures = {(str(r), int(i)): int(n) for r, i, n in rec.get("startup_failures", [])}
        diverged = rec.get("diverged_at")
        job.diverged_at = None if not diverged else (int(diverged[0]), int(diverged[1]))
        job.cold_roles = {str(r) for r in rec.get("cold_roles", [])}
        job.cold_slots = {(str(r), int(i)) for r, i in rec.get("cold_slots", [])}
        job.slot_incarnation = {int(k): int(v) for k, v in rec.get("slot_incarnation", {}).items()}
        job.reward_by_step = {int(k): v for k, v in rec.get("reward_by_step", {}).items()}
        job.members = {mid: MemberInfo.from_record(mid, m) for mid, m in rec.get("members", {}).items()}
        job.recoveries = [ActiveRecovery.from_record(r) for r in rec.get("recoveries", [])]
        job.faults = list(rec.get("faults", []))
        job.gang_starts = {fid: GangStart.from_record(g) for fid, g in (rec.get("gang_starts") or {}).items()}
        job.restock_owed = {int(k): int(v) for k, v in (rec.get("restock_owed") or {}).items()}
        job.launched = bool(rec.get("launched", True))  # records from before the flag: started
        job.finished_at = rec.get("finished_at")
        job.ettr = rec.get("ettr")
        job.deleting = rec.get("deleting") or None
        owed = rec.get("stop_owed")
        if isinstance(owed, dict):  # (a final status it does not name is a plain stop)
            final = owed.get("status") if owed.get("status") in ("finished", "failed", "stopped") else "stopped"
            reason = owed.get("reason")
            job.stop_owed = {"status": final, "reason": reason if isinstance(reason, str) else None}
        for mid, fault in (rec.get("recheck_after_recovery") or {}).items():
            try:
                job.recheck_after_recovery[mid] = FaultReport.model_validate(fault)
            except ValidationError as exc:  # the rest of the record is still good
                log.error("job %s: a weights fault to look at again not understood, dropped: %s", job_id, exc)
        return job

    def status_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id, "name": self.spec.name, "status": self.status, "policy": self.policy,
            "mode": self.spec.mode, "step": self.step, "steps_total": self.spec.steps,
            "committed_step": self.committed_step, "durable_step": self.durable_step,
            "weights_version": self.weights_version, "weights_checksum": self.weights_checksum,
            "reward_by_step": [self.reward_by_step[k] for k in sorted(self.reward_by_step)],
            "members": [{"member_id": m.member_id, "role": m.role, "index": m.index, "epoch": m.epoch,
                         "state": m.state, "phase": m.phase, "weights_version": m.weights_version,
                         "pid": m.pid} for m in sorted(self.members.values(), key=lambda m: m.member_id)],
            "faults": self.faults, "ettr": self.ettr, "last_step_timings": self.last_step_timings,
            "created_at": self.created_at, "started_at": self.started_at, "finished_at": self.finished_at,
            "restarts_total": self.restarts_total, "error": self.error,
            "recovering": [{"fault_id": r.fault_id, "kind": r.kind, "waiting_for": sorted(r.waiting_for)}
                           for r in self.recoveries],
        }
