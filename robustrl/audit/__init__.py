"""The independent auditor (DESIGN section 4): invariants checked from the raw stores alone.

``audit(settings, job_id)`` reads the job's JetStream event log, its Redis keys and its object
store listing and blobs directly, never through a service and never trusting a service's own
counters, and returns an :class:`AuditReport`. ``audit_job`` is the one-call form tests use: it
raises ``AssertionError`` listing every violation. ``robustrl audit JOB`` prints the report.

Checks: every committed step trained exactly once per durable lineage; every manifest verifies
(sizes and sha256 of every blob it names); no finished episode lost; every saved prefix is a
prefix of the final episode; replicas load only published checksums, never one they rejected,
and serve only versions they loaded; Redis keeps nothing of steps long durable; and, if a bound
is given, no gap between progress events longer than it.
"""

from __future__ import annotations

import asyncio

from robustrl.audit.lineage import (
    check_checkpoints,
    check_event_log,
    check_progress,
    check_trained_once,
    job_facts,
    newest_loadable,
)
from robustrl.audit.model import AuditInput, AuditOptions, AuditReport, CheckResult, ObservedStep
from robustrl.audit.raw import read_event_log, read_redis, scan_checkpoints, scan_origins
from robustrl.audit.rollout import (
    check_episodes,
    check_prefixes,
    check_redis_bounded,
    check_weights,
    step_views,
)
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
    durable = newest_loadable(inp)
    views = step_views(inp, facts)
    checks: dict[str, CheckResult] = {"event_log": check_event_log(inp, facts)}
    checks["trained_once"], twice, steps_lost = check_trained_once(inp, facts)
    checks["checkpoints"], unloadable = check_checkpoints(inp, facts)
    checks["episodes"], episodes_lost, unverified = check_episodes(inp, facts, views, durable)
    checks["prefixes"] = check_prefixes(inp, views)
    checks["weights"], bad_weights = check_weights(inp, views)
    checks["redis_bounded"], redis_facts = check_redis_bounded(inp, durable, opts.redis_slack_steps, opts.redis_bound)
    checks["progress"], stuck = check_progress(inp, facts, opts.max_stuck_s, opts.require_ended)
    report = AuditReport(
        job_id=inp.job_id, ok=all(c.passed for c in checks.values()), checks=checks,
        steps_trained_twice=twice, steps_lost=steps_lost, episodes_lost=episodes_lost,
        checkpoints_unloadable=unloadable, replicas_served_bad_weights=bad_weights,
        facts={"final_step": facts.final_step, "steps": facts.steps, "finished": facts.finished,
               "newest_loadable_checkpoint": durable, "manifests": len(inp.checkpoints),
               "steps_unverified": unverified, "max_stuck_s": round(stuck, 3), "events": len(inp.events),
               "steps_observed_live": len(inp.observed), **redis_facts})
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
