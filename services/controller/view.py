"""The adapter that feeds the pure ``decide``: a :class:`JobView` snapshot of a running job."""

from __future__ import annotations

from robustrl.services.controller import decide as decide_mod
from robustrl.services.controller.jobs import JobRun, MemberInfo

from robustrl.launcher.base import SOFT_STRATEGIES


def borrow_candidates(job: JobRun) -> list[MemberInfo]:
    """The replicas a trainer gang could borrow: current, ready, holding weights."""
    return [m for m in job.current_replicas()
            if job.is_current(m.member_id) and m.state == "ready" and m.weights_version >= 0]


def job_view(job: JobRun, spares_ready: int = 0, can_borrow: bool = False,
             can_keep: bool = False, holds_strict_layout: bool = False,
             unanswered: frozenset[str] = frozenset()) -> decide_mod.JobView:
    """Snapshot ``job`` as ``decide`` sees it.

    ``unanswered``: replicas that did not answer a probe just now (frozen, cut off): not borrowed.

    ``live_members`` holds the current incarnation's trainers and replicas (a fault about an
    older one is stale); control-plane services are singletons whose liveness is tracked apart,
    from their own signs of life (metrics, acknowledged commands) and silences, in
    ``control_plane_lost``.
    """
    members = job.current_trainers() + job.current_replicas()
    # A replica borrowed by a trainer gang (state dead) is no longer a rollout member.
    live = {m.member_id for m in members if job.is_current(m.member_id) and m.state != "dead"}
    # Ranks of the current gang that said hello and have not exited: a rank of a gang that never
    # formed may be blocked in the rendezvous, so only a ready one is kept.
    survivors = sorted((m for m in job.current_trainers() if m.member_id in live and m.state == "ready"),
                       key=lambda m: m.index)
    borrowable = borrow_order(
        [m for m in borrow_candidates(job) if m.member_id not in unanswered],
        [m for m in job.current_trainers() if m.member_id in live], job.spec.trainer.placement.strategy)
    return decide_mod.JobView(
        job_id=job.job_id, step=job.step, committed_step=job.committed_step, durable_step=job.durable_step,
        recovering=tuple(decide_mod.RecoveryView(role="job" if r.kind == "whole_job" else r.role, step=r.step,
                                                 started_at=r.clock_start, member_ids=frozenset(r.replacing),
                                                 fault_id=r.fault_id) for r in job.recoveries),
        faults_per_step=dict(job.failures_by_step), restarts_total=job.restarts_total,
        control_plane_lost=frozenset(job.services_lost), live_members=frozenset(live),
        rollout_replicas=job.spec.rollout.replicas, mode=job.spec.mode,
        trainer_workers=job.spec.trainer.workers, spares_ready=spares_ready,
        borrowable=tuple(m.member_id for m in borrowable), can_borrow=can_borrow,
        survivors=tuple(m.member_id for m in survivors), can_keep=can_keep,
        replica_fits_trainer=replica_fits_trainer(job),
        strict_layout=holds_strict_layout and job.spec.trainer.placement.strategy not in SOFT_STRATEGIES)


def host_of(m: MemberInfo) -> str | None:
    """The machine a member runs on, from its launcher handle: a Ray node, a testbed host; None
    where the launcher runs every member on one machine (or the handle does not say)."""
    where = m.handle.get("node_id") or m.handle.get("host")
    return where if isinstance(where, str) and where else None


def borrow_order(replicas: list[MemberInfo], trainers: list[MemberInfo], strategy: str) -> list[MemberInfo]:
    """Replicas to borrow for trainer ranks, best first. A borrowed replica becomes a rank where it
    runs, so where it runs is the rank's placement: under ``PACK`` a replica on a host of the
    gang's running ranks comes first (the gang's collectives stay on one machine); under
    ``SPREAD`` a replica on a host with no rank comes first, and consecutive picks take distinct
    hosts (the next rank is not put beside the one just borrowed). Within that, the newest
    weights first (fewer to load), then the highest slot (as before: a stable, explainable pick).
    Members whose host is unknown all count as one host (one-machine launchers)."""
    gang_hosts = {host_of(t) for t in trainers}
    by_weights = sorted(replicas, key=lambda m: (-m.weights_version, -m.index))
    if strategy in ("PACK", "STRICT_PACK"):
        return sorted(by_weights, key=lambda m: host_of(m) not in gang_hosts)
    if strategy not in ("SPREAD", "STRICT_SPREAD"):
        return by_weights
    # Round-robin over hosts, hosts without a rank first: each round takes the best replica of each.
    queues: dict[str | None, list[MemberInfo]] = {}
    for m in by_weights:
        queues.setdefault(host_of(m), []).append(m)
    hosts = sorted(queues, key=lambda h: (h in gang_hosts, by_weights.index(queues[h][0])))
    out: list[MemberInfo] = []
    while any(queues.values()):
        out += [queues[h].pop(0) for h in hosts if queues[h]]
    return out


def replica_fits_trainer(job: JobRun) -> bool:
    """Whether a rollout replica's reservation covers a trainer rank's: GPUs, and CPUs and memory
    where the trainer reserves them (replicas are homogeneous, so one answer holds for all); and
    whether a replica's node is sure to carry every node label the trainer requires (the
    replica's own required labels include them: a replica placed without them may run on a node
    the trainer is kept off)."""
    r, t = job.spec.rollout.resources, job.spec.trainer.resources
    rollout_labels = job.spec.rollout.placement.node_labels
    if any(rollout_labels.get(k) != v for k, v in job.spec.trainer.placement.node_labels.items()):
        return False
    if r.gpus < t.gpus:
        return False
    if t.cpus is not None and (r.cpus is None or r.cpus < t.cpus):
        return False
    return t.memory_mb is None or (r.memory_mb is not None and r.memory_mb >= t.memory_mb)
