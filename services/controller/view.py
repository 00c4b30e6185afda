"""The adapter that feeds the pure ``decide``: a :class:`JobView` snapshot of a running job."""

from __future__ import annotations

from robustrl.services.controller import decide as decide_mod
from robustrl.services.controller.jobs import JobRun

from robustrl.launcher.base import SOFT_STRATEGIES


def job_view(job: JobRun, spares_ready: int = 0, can_borrow: bool = False,
             can_keep: bool = False, holds_strict_layout: bool = False) -> decide_mod.JobView:
    """Snapshot ``job`` as ``decide`` sees it.

    ``live_members`` holds the current incarnation's trainers and replicas (a fault about an
    older one is stale); control-plane services are singletons whose liveness is tracked apart,
    from their own signs of life (metrics, acknowledged commands) and silences, in
    ``control_plane_lost``.
    """
    members = job.current_trainers() + job.current_replicas()
    # A replica borrowed by a trainer gang (state dead) is no longer a rollout member.
    live = {m.member_id for m in members if job.is_current(m.member_id) and m.state != "dead"}
    borrowable = [m for m in job.current_replicas()
                  if m.member_id in live and m.state == "ready" and m.weights_version >= 0]
    borrowable.sort(key=lambda m: (-m.weights_version, -m.index))
    # Ranks of the current gang that said hello and have not exited: a rank of a gang that never
    # formed may be blocked in the rendezvous, so only a ready one is kept.
    survivors = sorted((m for m in job.current_trainers() if m.member_id in live and m.state == "ready"),
                       key=lambda m: m.index)
    return decide_mod.JobView(
        job_id=job.job_id, step=job.step, committed_step=job.committed_step, durable_step=job.durable_step,
        recovering=tuple(decide_mod.RecoveryView(role="job" if r.kind == "whole_job" else r.role, step=r.step,
                                                 started_at=r.started_at, member_ids=frozenset(r.replacing),
                                                 fault_id=r.fault_id) for r in job.recoveries),
        faults_per_step=dict(job.failures_by_step), restarts_total=job.restarts_total,
        control_plane_lost=frozenset(job.services_lost), live_members=frozenset(live),
        rollout_replicas=job.spec.rollout.replicas, mode=job.spec.mode,
        trainer_workers=job.spec.trainer.workers, spares_ready=spares_ready,
        borrowable=tuple(m.member_id for m in borrowable), can_borrow=can_borrow,
        survivors=tuple(m.member_id for m in survivors), can_keep=can_keep,
        replica_fits_trainer=replica_fits_trainer(job),
        strict_layout=holds_strict_layout and job.spec.trainer.placement.strategy not in SOFT_STRATEGIES)


def replica_fits_trainer(job: JobRun) -> bool:
    """Whether a rollout replica's reservation covers a trainer rank's: GPUs, and CPUs and memory
    where the trainer reserves them (replicas are homogeneous, so one answer holds for all)."""
    r, t = job.spec.rollout.resources, job.spec.trainer.resources
    if r.gpus < t.gpus:
        return False
    if t.cpus is not None and (r.cpus is None or r.cpus < t.cpus):
        return False
    return t.memory_mb is None or (r.memory_mb is not None and r.memory_mb >= t.memory_mb)
