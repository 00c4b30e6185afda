"""The independent auditor (DESIGN section 4): invariants checked from the raw stores alone.

``audit(settings, job_id)`` reads the job's JetStream event log, its Redis keys and its object
store listing and blobs directly, never through a service and never trusting a service's own
counters, and returns an :class:`AuditReport`. ``audit_job`` is the one-call form tests use: it
raises ``AssertionError`` listing every violation. ``robustrl audit JOB`` prints the report.

Checks (each a pure function of what was read; ``judge`` runs them all):

* ``event_log``: the log starts with ``job_submitted``; a finished job committed its last step.
* ``trained_once``: every committed step trained exactly once per durable lineage (Redis trained
  log, commits, manifests); every gang recorded where it resumed from (its origin), and no gang
  resumed before a checkpoint reported durable.
* ``checkpoints``: every manifest's blobs are present, inside their own rank's folder of the
  manifest's own step and gang, and match their sizes and sha256; every rank of the gang wrote its
  shard; the weights version is the step's. The newest fully loadable checkpoint on the chain of
  gang origins is the job's durable progress (a manifest off the chain never counts), and no
  ``durable_step`` the trainer reported lies beyond it.
* ``checkpoint_weights``: the model in every checkpoint, hashed again from its blobs as published
  weights are hashed, is what its gang published and committed for it and what every gang that
  resumed from it published; a finished job's newest loadable checkpoint was published. (The
  blobs are unpickled with torch where it is installed; without it the count of checkpoints not
  hashed is in the report's facts, ``checkpoints_weights_unhashed``.)
* ``episodes``: a committed step's batch stayed in Redis until its checkpoint was durable (seen
  live or not), names exactly its step's finished episodes (the step's episode set), each
  finished with a reward, its turns made within the staleness bound and each applied once (no
  two replies to one turn, no request answering two turns).
* ``trained_batches``: what the trainer says it trained (``step_committed``'s ``trained``) is its
  step's batch as Redis recorded it, the same for a redo, ``episodes_per_step`` distinct episodes
  never trained in two steps; a step Redis has collected is judged by that record alone.
* ``prefixes``: every saved or re-dispatched prefix is a prefix of the final episode.
* ``weights``: each replica's load is of a checksum published before it by a gang not yet
  superseded (publications keyed by gang and version), never one it rejected; every assistant
  turn was made by a replica that loaded its version soundly; the Redis pointer names its gang's
  publication (the newest gang's once the job finished).
* ``redis_bounded``: Redis keeps nothing of steps long durable.
* ``outbox``: an ended job's request-manager, detector, trainer and rollout outboxes hold no
  event its log lacks, and the controller's none given well before the final event the log holds
  (it appends in order).
* ``progress``: the log ends, with no gap between progress events beyond the job's own deadlines
  (or a given bound).
"""

from __future__ import annotations

import asyncio

from robustrl.audit.checkpoints import check_checkpoints
from robustrl.audit.lineage import check_event_log, check_progress, check_trained_once, job_facts
from robustrl.audit.model import AuditInput, AuditOptions, AuditReport, CheckResult, ObservedStep
from robustrl.audit.raw import read_event_log, read_redis, scan_checkpoints, scan_origins
from robustrl.audit.rollout import (
    check_episodes,
    check_outbox,
    check_prefixes,
    check_redis_bounded,
    step_views,
)
from robustrl.audit.trained import check_trained_batches
from robustrl.audit.weights import check_checkpoint_weights, check_weights
from robustrl.config import Settings
from robustrl.storage.objects import open_object_store

__all__ = ["AuditInput", "AuditOptions", "AuditReport", "ObservedStep", "audit", "audit_job", "collect", "judge"]


async def collect(settings: Settings, job_id: str,
                  observed: dict[int, ObservedStep] | None = None) -> AuditInput:
    """Read everything the checks need from the raw stores."""
    events = await read_event_log(settings.nats_url, job_id)
    facts = job_facts(events)
    steps = max(facts.steps, facts.final_step + 1)
    redis = await read_redis(settings.redis_url, job_id, steps)
    store = open_object_store(settings)
    checkpoints = await asyncio.to_thread(scan_checkpoints, store, job_id)
    origins = await asyncio.to_thread(scan_origins, store, job_id)
    return AuditInput(job_id=job_id, events=events, redis=redis, checkpoints=checkpoints,
                      observed=dict(observed or {}), origins=origins)


def judge(inp: AuditInput, options: AuditOptions | None = None) -> AuditReport:
    """Run every check on already-read raw state (pure: unit tests feed it synthetic state)."""
    opts = options or AuditOptions()
    facts = job_facts(inp.events)
    views = step_views(inp, facts)
    checks: dict[str, CheckResult] = {"event_log": check_event_log(inp, facts)}
    checks["trained_once"], twice, steps_lost = check_trained_once(inp, facts)
    checks["checkpoints"], unloadable, lineage = check_checkpoints(inp, facts)
    durable = lineage.newest_step
    checks["checkpoint_weights"], weight_facts = check_checkpoint_weights(inp, facts, lineage)
    checks["episodes"], episodes_lost, unverified = check_episodes(inp, facts, views, durable)
    checks["trained_batches"], lost_collected, judged = check_trained_batches(inp, facts, views, durable)
    episodes_lost += lost_collected
    unverified -= len(judged)
    checks["prefixes"] = check_prefixes(inp, views)
    checks["weights"], bad_weights, by_turn_checksum = check_weights(inp, views, facts)
    checks["redis_bounded"], redis_facts = check_redis_bounded(inp, durable, opts.redis_slack_steps, opts.redis_bound)
    checks["outbox"], outbox_facts = check_outbox(inp, facts, opts.controller_outbox_slack_s)
    checks["progress"], stuck = check_progress(inp, facts, opts.max_stuck_s, opts.require_ended)
    report = AuditReport(
        job_id=inp.job_id, ok=all(c.passed for c in checks.values()), checks=checks,
        steps_trained_twice=twice, steps_lost=steps_lost, episodes_lost=episodes_lost,
        checkpoints_unloadable=unloadable, replicas_served_bad_weights=bad_weights,
        facts={"final_step": facts.final_step, "steps": facts.steps, "finished": facts.finished,
               "newest_loadable_checkpoint": durable,
               "newest_loadable_epoch": None if lineage.newest is None else lineage.newest.epoch,
               "manifests": len(inp.checkpoints), "manifests_on_lineage": len(lineage.chain),
               "steps_unverified": unverified,
               "steps_judged_by_trained_record": len(judged), "max_stuck_s": round(stuck, 3), "events": len(inp.events),
               "steps_observed_live": len(inp.observed), "loads_judged_by_turn_checksum": by_turn_checksum,
               **weight_facts, **redis_facts, **outbox_facts})
    report._raw = inp
    return report


async def audit(settings: Settings, job_id: str, options: AuditOptions | None = None,
                observed: dict[int, ObservedStep] | None = None) -> AuditReport:
    """Audit one job from the raw stores."""
    return judge(await collect(settings, job_id, observed), options)


def audit_job(settings: Settings, job_id: str, options: AuditOptions | None = None,
              observed: dict[int, ObservedStep] | None = None) -> AuditReport:
    """Audit a job (blocking); raise ``AssertionError`` naming every violation, else return the report."""
    report = asyncio.run(audit(settings, job_id, options, observed))
    if not report.ok:
        raise AssertionError(f"audit of {job_id} found {len(report.violations())} violations:\n  "
                             + "\n  ".join(report.violations()[:40]))
    return report
