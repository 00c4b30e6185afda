"""The controller's recovery choice (DESIGN section 3, "Restart"), as pure functions.

``decide(now, job, fault, spec)`` maps one fault report and a snapshot of the job to the
actions to take and the reason; ``check_recovery(now, job, spec)`` escalates a recovery that
overran its deadline; ``recovery_failed`` escalates one that failed outright. Nothing here
performs I/O or reads a clock, so every branch is tested with a fake ``now``.

Policies:

* ``whole_job`` (the baseline): any member fault restarts every role from the last checkpoint.
* ``role_local``: a trainer fault restarts the trainer gang; a rollout fault re-dispatches the
  replica's episodes and replaces it. Escalate to a whole-job restart when the fault comes before
  the first committed step, when the same step fails again, when a local recovery fails or
  overruns ``deadline_s``.

A lost control-plane service (request manager, detector) keeps its state in Redis / JetStream, so
in both policies it is resumed in place (``ResumeService``: restarted by its supervisor, then told
to ``resume``) without touching trainer or rollout members; only a service lost again and again at
one step, or a resume that overruns its deadline, escalates to a whole-job restart. A member fault
while the request manager is away is still recovered locally: the new members wait for it, and
its ``resume`` names the replicas that died meanwhile.

In both policies a tool outage is reported only: a tool fault is not a machine fault. After
``max_restarts`` restarts the job is failed instead of restarted again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from robustrl.config import RecoverySpec
from robustrl.messages import FaultReport

SPARE, BORROWED, COLD = "spare", "borrowed", "cold"
"""Where a rank of a new trainer gang comes from (``RecoverySpec.standby_order``)."""
SURVIVOR = "survivor"
"""A rank of the broken gang kept in place (``RecoverySpec.keep_survivors``): before every other source."""
DIVERGED = "diverged"
"""The cause of a trainer rank's exit ``errors.EXIT_DIVERGED`` (its step's loss not finite)."""
KEEPABLE_FAULTS = frozenset({"crash"})
"""Faults after which the other ranks of the gang are kept (not a crash of cause ``gpu_lost``, whose
process still runs): a rank's process exited, so the
survivors' collectives with it fail at once and they are free to rejoin. Not after a hang or a
slow rank: the detector judges each rank on its own activity, and a healthy rank waiting in a
collective for a stalled one shows no activity either, so the rank reported may be the healthy
one (keeping the stalled one would fail the same step again). Not after a silent rank
(``unresponsive``: a link may be down): a survivor may wait on it until the collective's timeout."""
CONTROL_PLANE_ROLES = frozenset({"request_manager", "controller", "detector"})
SERVICE_RESUMES_PER_STEP = 3
"""Resumes in place of one control-plane service at one step before a whole-job restart."""


# --- the job as the controller sees it ----------------------------------------------------


@dataclass(frozen=True)
class RecoveryView:
    """One recovery in progress, as ``decide`` sees it (the runtime's mutable record is
    ``jobs.ActiveRecovery``).

    Attributes:
        role: what is being recovered: ``trainer``, ``rollout``, a control-plane role, or ``job``
            (whole-job restart).
        step: the job step at which the fault happened.
        started_at: when the recovery began (the controller's monotonic clock, as ``now``).
        attempts: recoveries of this role at this step so far, this one included.
        member_ids: members being replaced (their later fault reports are ignored).
        fault_id: the fault that started it.
    """

    role: str
    step: int
    started_at: float
    attempts: int = 1
    member_ids: frozenset[str] = frozenset()
    fault_id: str = ""


@dataclass(frozen=True)
class JobView:
    """A snapshot of one job, built by the controller from its state.

    Attributes:
        job_id: the job.
        step: the step the job is working on now.
        committed_step: newest committed step (-1 if none yet).
        durable_step: newest step whose checkpoint is complete (-1 if none).
        recovering: every recovery in progress (empty when none).
        faults_per_step: (role, step) -> member faults already decided at that step.
        restarts_total: restarts performed so far (gang restarts, replacements, whole-job).
        control_plane_lost: control-plane roles (``request_manager``, ``detector``) the
            controller currently sees as lost (silent past their threshold, or exited).
        live_members: trainer and rollout member ids of the current incarnation; None when not
            tracked. A fault about such a member outside this set is stale. Control-plane services
            are singletons, not incarnations: their liveness is ``control_plane_lost``.
        rollout_replicas: configured replica count.
        mode: the job's mode (``sync | semi_sync | async``): borrowing is for overlapped modes.
        trainer_workers: ranks of a trainer gang.
        spares_ready: warm spare processes the launcher holds now.
        borrowable: current rollout replicas that hold weights and may be borrowed, best first
            (``view.borrow_order``: by host under the gang's placement strategy, then weights).
        can_borrow: whether the launcher can switch a process's role in place.
        survivors: ranks of the current gang that run and were ready (any may be the faulty one:
            ``plan_gang`` leaves that one out).
        can_keep: whether the launcher can hand a running trainer rank to the next gang in place.
        replica_fits_trainer: whether a rollout replica's reservation covers a trainer rank's
            (``resources`` of both roles; nothing reserved fits anything) and its node is sure
            to carry the trainer's required ``node_labels``.
        strict_layout: the gang has a ``STRICT_*`` strategy that the launcher holds it to (one
            placement group across machines): a borrowed replica, which stays where it runs,
            could break it.
    """

    job_id: str
    step: int
    committed_step: int = -1
    durable_step: int = -1
    recovering: tuple[RecoveryView, ...] = ()
    faults_per_step: Mapping[tuple[str, int], int] = field(default_factory=dict)
    restarts_total: int = 0
    control_plane_lost: frozenset[str] = frozenset()
    live_members: frozenset[str] | None = None
    rollout_replicas: int = 1
    mode: str = "sync"
    trainer_workers: int = 1
    spares_ready: int = 0
    borrowable: tuple[str, ...] = ()
    can_borrow: bool = False
    survivors: tuple[str, ...] = ()
    can_keep: bool = False
    replica_fits_trainer: bool = True
    strict_layout: bool = False

    @property
    def control_plane_ok(self) -> bool:
        return not self.control_plane_lost


# --- actions ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RestartTrainerGang:
    """Stop every trainer worker, start a new gang from checkpoint ``resume_from``.

    ``sources`` names where each rank comes from (index = rank): ``spare``, ``cold``,
    ``borrowed:<replica member id>`` (that replica is drained and switches role in place), or
    ``survivor:<trainer member id>`` (a rank of the broken gang, handed the new rank in place).
    Empty: every rank is started by the launcher (a spare when it has one, else cold)."""

    resume_from: int
    sources: tuple[str, ...] = ()

    @property
    def borrowed(self) -> dict[int, str]:
        """rank -> replica member id to borrow for it."""
        return {r: s.split(":", 1)[1] for r, s in enumerate(self.sources) if s.startswith(BORROWED + ":")}

    @property
    def kept(self) -> dict[int, str]:
        """rank -> member id of the broken gang's rank kept for it."""
        return {r: s.split(":", 1)[1] for r, s in enumerate(self.sources) if s.startswith(SURVIVOR + ":")}

    def describe(self) -> str:
        extra = f", sources={list(self.sources)}" if self.sources else ""
        return f"restart_trainer_gang(resume_from={self.resume_from}{extra})"


@dataclass(frozen=True)
class RedispatchEpisodes:
    """The request manager re-dispatches the member's in-flight episodes from their prefixes."""

    member_id: str

    def describe(self) -> str:
        return f"redispatch_episodes({self.member_id})"


@dataclass(frozen=True)
class ReplaceReplica:
    """Mark the replica dead and start a replacement that pulls current weights and joins."""

    member_id: str

    def describe(self) -> str:
        return f"replace_replica({self.member_id})"


@dataclass(frozen=True)
class RestartWholeJob:
    """Stop every role, restart all from checkpoint ``resume_from``, regenerate the step."""

    reason: str
    resume_from: int

    def describe(self) -> str:
        return f"restart_whole_job(resume_from={self.resume_from})"


@dataclass(frozen=True)
class ResumeService:
    """Resume a lost control-plane service in place: its supervisor restarts it (local stack,
    compose restart policy) and the controller sends it ``resume`` until it acknowledges; it
    continues from its state in Redis / JetStream. No trainer or rollout member is touched."""

    role: str

    def describe(self) -> str:
        return f"resume_service({self.role})"


@dataclass(frozen=True)
class ReportOnly:
    """Record the fault; no restart (tool faults, faults that need no action)."""

    reason: str

    def describe(self) -> str:
        return "report_only"


@dataclass(frozen=True)
class FailJob:
    reason: str

    def describe(self) -> str:
        return "fail_job"


@dataclass(frozen=True)
class Ignore:
    """The fault is about a member already being replaced or of a past incarnation, or (with
    ``recheck``) no fault for now: looked at again once the trainer recovery under way is over."""

    reason: str
    recheck: bool = False

    def describe(self) -> str:
        return "ignore"


Action = (RestartTrainerGang | RedispatchEpisodes | ReplaceReplica | RestartWholeJob | ResumeService
          | ReportOnly | FailJob | Ignore)
RESTARTS = (RestartTrainerGang, ReplaceReplica, RestartWholeJob)


@dataclass(frozen=True)
class Decision:
    actions: list[Action]
    reason: str

    def describe(self) -> list[str]:
        """Action descriptions, with arguments."""
        return [a.describe() for a in self.actions]

    def names(self) -> list[str]:
        """Action class names, as the ``decision`` event records them (for readers, not dispatch)."""
        return [action_name(a) for a in self.actions]

    @property
    def restarts(self) -> int:
        """How many restarts this decision performs (counted against ``max_restarts``)."""
        return sum(isinstance(a, RESTARTS) for a in self.actions)


def action_name(action: Action) -> str:
    """The name an action has in the event log (``RestartTrainerGang``, ...)."""
    return action.__class__.__name__


# --- decisions ----------------------------------------------------------------------------


def decide(now: float, job: JobView, fault: FaultReport, spec: RecoverySpec) -> Decision:
    """Choose the actions for one fault report.

    Args:
        now: the controller's monotonic clock (unused by the rules today; kept so deadlines can be added
            without changing callers).
        job: snapshot of the job before this fault.
        fault: the detector's report.
        spec: the job's recovery policy.

    Returns:
        The actions, in the order to perform them, and a one-line reason.
    """
    del now  # every rule is a function of the job state; the clock only matters in check_recovery
    if fault.kind == "tool_outage":
        reason = "a tool fault is not a machine fault: the request manager retries, backs off, reports"
        return Decision([ReportOnly(reason)], reason)
    stale = _stale(job, fault)
    if stale is not None:
        return Decision([Ignore(stale)], stale)
    if fault.role in CONTROL_PLANE_ROLES:
        return _guarded(job, spec, _control_plane(job, fault))
    waiting = _waiting_for_new_gang(job, fault)
    if waiting is not None:
        return Decision([Ignore(waiting, recheck=True)], waiting)
    if spec.policy == "whole_job":
        return _guarded(job, spec, _whole_job(job, f"policy whole_job: {fault.kind} of {fault.role} "
                                                   f"{fault.member_id} at step {job.step}"))
    return _guarded(job, spec, _role_local(job, fault, spec))


def _stale(job: JobView, fault: FaultReport) -> str | None:
    if fault.cause == "commit_deadline" and fault.step is not None and fault.step <= job.committed_step:
        # the request manager's report of a commit overdue, which came after it (a slow step at
        # the deadline's edge, a report delivered late): the gang is not stuck
        return f"step {fault.step}'s commit, reported overdue, has come (committed up to {job.committed_step})"
    member_role = fault.role not in CONTROL_PLANE_ROLES
    if member_role and job.live_members is not None and fault.member_id not in job.live_members:
        return f"{fault.member_id} is not a member of the current incarnation"
    for rec in job.recovering:
        if fault.member_id in rec.member_ids:
            return f"{fault.member_id} is already being replaced ({rec.role} recovery since step {rec.step})"
    return None


WARM_START_SILENT = "warm_start_silent"
"""The cause of a rank started warm that was never heard from (``Supervisor.watch_starts``): its
start failed, not its step, so it is no second failure of the step. Nor is it counted as a failed
start of its slot (``JobRun.failed_start``): the slot's next start is cold, and cold starts are
what ``STARTUP_FAILURES_MAX`` bounds (``recovery.max_restarts`` bounds the restarts in all)."""
WEIGHTS_CAUSES = frozenset({"weights_failed", "weights_load_timeout", "weights_deadline"})
"""Causes of a replica that could not load the announced weights: the detector's, and the request
manager's (a replica below the step's version past ``weights_load_s``)."""


def _waiting_for_new_gang(job: JobView, fault: FaultReport) -> str | None:
    """Why a replica's weights fault is no fault while a trainer recovery is under way, else None.

    The version it could not load is the failed gang's (its publisher is gone, and no relay may
    hold it all); the new gang announces its own, which the replica then pulls. A recovery longer
    than the replica's pull attempts (a cold start of a large model) made every replica report:
    each was replaced, and with all of them reporting at one step the job was restarted whole.
    The fault is looked at again (``Ignore.recheck``) ``weights_load_s`` after the recovery is
    over: a replica still failing then is acted on (the detector reports a member once, and the
    request manager's weights deadline never waits for a replica that holds no version)."""
    if fault.role != "rollout" or fault.cause not in WEIGHTS_CAUSES:
        return None
    rec = next((r for r in job.recovering if r.role in ("trainer", "job")), None)
    if rec is None:
        return None
    # (a whole-job restart forms a new gang too: a new replica below the step's version while the
    # new gang redoes the steps after its checkpoint was taken for a member failing in the
    # restart, and the job restarted whole again, and again, until it failed)
    return (f"{fault.cause} of {fault.member_id} while the trainer gang is being recovered (since step "
            f"{rec.step}): the weights it could not load are the failed gang's; it pulls what the new "
            "gang will announce")


def _control_plane(job: JobView, fault: FaultReport) -> Decision:
    """A control-plane service lost: resume it in place. Only when its resumes keep failing at one
    step (``SERVICE_RESUMES_PER_STEP``: its state for that step may be what kills it) does a
    whole-job restart, which regenerates the step from scratch, follow."""
    what = f"{fault.kind} of {fault.role} at step {job.step}"
    previous = job.faults_per_step.get((fault.role, job.step), 0)
    if previous >= SERVICE_RESUMES_PER_STEP:
        return _whole_job(job, f"{what}: the {fault.role} was lost {previous + 1} times at step {job.step}")
    return Decision([ResumeService(fault.role)],
                    f"{what}: resume it in place from its durable state; no member is restarted")


def _role_local(job: JobView, fault: FaultReport, spec: RecoverySpec) -> Decision:
    what = f"{fault.kind} of {fault.role} {fault.member_id} at step {job.step}"
    if job.committed_step < 0:
        return _whole_job(job, f"{what}: before the first committed step")
    whole = next((r for r in job.recovering if r.role == "job"), None)
    if whole is not None:
        # A new-incarnation member failing during a whole-job restart: that restart failed.
        return _whole_job(job, f"{what} during the whole-job restart begun at step {whole.step}")
    previous = job.faults_per_step.get((fault.role, job.step), 0)
    if fault.role == "trainer":
        again = any(r.role == "trainer" and r.step == job.step for r in job.recovering)
        if (previous >= 1 or again) and fault.cause != WARM_START_SILENT:
            return _whole_job(job, f"{what}: step {job.step} failed again on the trainer")
        sources, why = plan_gang(job, spec, fault)
        return Decision([RestartTrainerGang(job.durable_step, sources)],
                        f"{what}: restart the trainer gang from checkpoint {job.durable_step} ({why})")
    if fault.role == "rollout":
        # Independent replica losses at one step are replaced one by one; more losses than
        # there are replica slots means replacements themselves die: a systemic problem.
        if previous >= max(1, job.rollout_replicas):
            return _whole_job(job, f"{what}: {previous + 1} rollout faults at step {job.step}")
        if fault.kind == "fail_slow":
            reason = f"{what}: replace the slow replica"
        else:
            reason = f"{what}: re-dispatch its episodes and replace it"
        return Decision([RedispatchEpisodes(fault.member_id), ReplaceReplica(fault.member_id)], reason)
    return Decision([ReportOnly(f"no recovery for role {fault.role}")], f"{what}: no recovery for this role")


def may_borrow(job: JobView, spec: RecoverySpec) -> str | None:
    """None if the job may borrow rollout replicas for its trainer gang, else why not."""
    if spec.borrow == "never":
        return "borrowing disabled (recovery.borrow=never)"
    if spec.borrow == "overlapped" and job.mode == "sync":
        return "sync mode has no spare rollout capacity (recovery.borrow=overlapped)"
    if not job.can_borrow:
        return "the launcher cannot switch a process's role in place"
    if not job.replica_fits_trainer:
        return ("a rollout replica reserves less than a trainer rank needs, or may run on a node without "
                "the trainer's node labels (rollout/trainer resources, placement.node_labels)")
    if job.strict_layout:
        return ("the gang's STRICT_* layout is held by the launcher's placement group, which a replica "
                "switched in place would run outside (trainer.placement.strategy)")
    return None


def may_keep(job: JobView, spec: RecoverySpec, fault: FaultReport | None) -> str | None:
    """None if the ranks of the broken gang other than the faulty one may be kept, else why not."""
    if not spec.keep_survivors:
        return "keeping survivors disabled (recovery.keep_survivors=false)"
    if not job.can_keep:
        return "the launcher cannot hand a running trainer rank to the next gang"
    if fault is None or fault.kind not in KEEPABLE_FAULTS:
        return (f"after a {fault.kind if fault else 'late'} fault (no exit) the rank reported may be a healthy "
                "one waiting on the faulty one, or blocked on it until its collective times out")
    if fault.cause == "gpu_lost":
        return ("its GPU was lost but its process still runs: the other ranks may be held in a collective "
                "with it until the collective times out")
    if fault.cause == DIVERGED:
        return "the gang's training diverged: every rank holds the diverged step's state"
    return None


def plan_gang(job: JobView, spec: RecoverySpec, fault: FaultReport | None = None) -> tuple[tuple[str, ...], str]:
    """Where each rank of a new gang comes from: the broken gang's other ranks first (kept in
    place, ``spec.keep_survivors``), then ``spec.standby_order`` (empty when no rank is kept or
    borrowed: the launcher then starts every rank, from a spare while it holds one).

    A survivor takes the lowest free rank (rank 0's node holds the rendezvous, so a kept rank 0
    keeps it where a process already runs); a spare is taken while the launcher holds one; a
    replica is borrowed while more than ``spec.min_replicas_kept`` replicas would still generate;
    a cold start is always possible.

    Returns:
        (source per rank, a short reason).
    """
    others = [m for m in job.survivors if fault is None or m != fault.member_id]
    not_kept = may_keep(job, spec, fault) if others else None
    kept = [] if not_kept else others
    spares = job.spares_ready
    refused = may_borrow(job, spec)
    pool = [] if refused else list(job.borrowable)
    keep = spec.min_replicas_kept
    generating = len(job.borrowable)
    sources: list[str] = []
    for _rank in range(max(1, job.trainer_workers)):
        if kept:
            sources.append(f"{SURVIVOR}:{kept.pop(0)}")
            continue
        for source in spec.standby_order:
            if source == SPARE and spares > 0:
                spares -= 1
                sources.append(SPARE)
                break
            if source == BORROWED and pool and generating - 1 >= keep:
                generating -= 1
                sources.append(f"{BORROWED}:{pool.pop(0)}")
                break
            if source == COLD:
                sources.append(COLD)
                break
        else:  # unreachable: the config requires cold in standby_order
            sources.append(COLD)
    counts = {s: sum(x.split(":")[0] == s for x in sources) for s in (SURVIVOR, SPARE, BORROWED, COLD)}
    why = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    if refused and BORROWED in spec.standby_order:
        why += f"; no borrowing: {refused}"
    if not_kept:
        why += f"; no survivor kept: {not_kept}"
    if not counts[BORROWED] and not counts[SURVIVOR]:
        return (), why  # every rank is the launcher's to start (a spare while it has one, else cold)
    return tuple(sources), why


def _whole_job(job: JobView, reason: str) -> Decision:
    return Decision([RestartWholeJob(reason, job.durable_step)], reason)


def _guarded(job: JobView, spec: RecoverySpec, decision: Decision) -> Decision:
    """Fail the job instead of restarting once ``max_restarts`` is used up."""
    if decision.restarts and job.restarts_total + decision.restarts > spec.max_restarts:
        reason = (f"giving up after {job.restarts_total} restarts (max_restarts={spec.max_restarts}); "
                  f"last fault: {decision.reason}")
        return Decision([FailJob(reason)], reason)
    return decision


def check_recovery(now: float, job: JobView, spec: RecoverySpec) -> Decision | None:
    """Escalate the first recovery that has run past ``spec.deadline_s``; None if all are on time."""
    for rec in job.recovering:
        took = now - rec.started_at
        if took > spec.deadline_s:
            reason = (f"{rec.role} recovery begun at step {rec.step} still not done after {took:.1f}s "
                      f"(deadline_s={spec.deadline_s:g})")
            return _guarded(job, spec, _whole_job(job, reason))
    return None


def recovery_failed(now: float, job: JobView, rec: RecoveryView, why: str, spec: RecoverySpec) -> Decision:
    """A local recovery failed outright (a replacement could not start, a checkpoint load failed):
    escalate to a whole-job restart, or fail the job once restarts are used up."""
    del now
    return _guarded(job, spec, _whole_job(job, f"{rec.role} recovery at step {rec.step} failed: {why}"))
