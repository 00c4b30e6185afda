"""Prometheus metrics of the controller's jobs, through ``prometheus_client``.

The controller mounts ``GET /metrics`` and answers it from a registry (:func:`controller_registry`)
holding a :class:`JobCollector` over the same job dicts its ``GET /v1/jobs/{id}`` returns, plus the
library's process and platform collectors (the controller's own CPU, memory, file descriptors).
Every job value is a snapshot of state the controller already holds, so the collector builds
metric families at scrape time (the library's custom-collector pattern) instead of keeping
counters in step with the job records; the library writes the exposition text and escapes it.

Collection is tolerant: a missing key or a non-numeric value drops that one sample instead of
failing the whole scrape, because a scrape that errors hides every other job too. Histograms of
detection delay and recovery time are rebuilt from the job's full fault list on each scrape, so
they are exact (not sampled) and survive a controller restart that reloads jobs.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The ``Content-Type`` the ``/metrics`` response carries (the format ``generate_latest`` writes)."""

JOB_STATUSES: tuple[str, ...] = ("pending", "running", "recovering", "finished", "failed", "stopped")
"""Every job status; each is always exported (zero when no job has it) so alerts see the series."""

STEP_PARTS: tuple[str, ...] = (
    "generation", "tool_wait", "training", "checkpoint_blocking", "upload", "weight_sync",
)
"""Parts of ``last_step_timings`` (keys without their ``_s`` suffix)."""

DETECTION_BUCKETS_S: tuple[float, ...] = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Covers the reference thresholds (seconds) and the paper's production ones (60 s / 300 s)."""

RECOVERY_BUCKETS_S: tuple[float, ...] = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
"""Role-local recovery is seconds; whole-job restarts at scale reach tens of minutes."""

JOB = ["job_id"]
MEMBER = [*JOB, "member_id", "role"]


def _number(value: object) -> float | None:
    """``value`` as a float, or None when absent or not a real number (bools are not numbers)."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    return None


def _text(value: object, default: str = "") -> str:
    return default if value is None else str(value)


def _histogram(family: HistogramMetricFamily, labels: list[str], values: Sequence[float],
               buckets: Sequence[float]) -> None:
    """One label set's cumulative buckets and sum, from every observed value."""
    cumulative = [(floatToGoString(b), float(sum(1 for v in values if v <= b))) for b in buckets]
    family.add_metric(labels, [*cumulative, ("+Inf", float(len(values)))], sum_value=math.fsum(values))


class JobCollector:
    """A ``prometheus_client`` collector of job status dicts, read from ``jobs`` at each scrape."""

    def __init__(self, jobs: Callable[[], Iterable[Mapping[str, object]]]) -> None:
        self.jobs = jobs

    def collect(self) -> Iterator[Metric]:
        yield from job_families(self.jobs())


def job_families(jobs: Iterable[Mapping[str, object]]) -> list[Metric]:
    """The metric families of job status dicts (the ``GET /v1/jobs/{id}`` body).

    Args:
        jobs: job status dicts with keys ``job_id``, ``name``, ``status``, ``policy``,
            ``committed_step`` (or ``step``), ``durable_step``, ``restarts_total``, ``steps_total``,
            ``weights_version``, ``reward_by_step``, ``members``, ``faults``, ``ettr`` and
            ``last_step_timings``. Missing keys drop only their samples.
    """
    fam: dict[str, Metric] = {
        "jobs": GaugeMetricFamily("robustrl_jobs", "Jobs by status.", labels=["status"]),
        "info": GaugeMetricFamily("robustrl_job_info", "Constant 1 per job; labels carry name, policy, status.",
                                  labels=[*JOB, "name", "policy", "status"]),
        "step": GaugeMetricFamily("robustrl_job_step", "Last committed RL step of the job (-1: none yet).",
                                  labels=JOB),
        "durable": GaugeMetricFamily("robustrl_job_durable_step",
                                     "Newest step whose checkpoint is complete in the object store (-1: none).",
                                     labels=JOB),
        "steps": GaugeMetricFamily("robustrl_job_steps_planned", "Steps the job was submitted with.", labels=JOB),
        "version": GaugeMetricFamily("robustrl_job_weights_version", "Trainer's announced weights version.",
                                     labels=JOB),
        "reward": GaugeMetricFamily("robustrl_job_reward_last", "Mean reward of the last committed step.",
                                    labels=JOB),
        "ettr": GaugeMetricFamily("robustrl_job_ettr",
                                  "Effective training time ratio: productive time / wall time (0..1).", labels=JOB),
        "restarts": CounterMetricFamily("robustrl_job_restarts",
                                        "Whole-job restarts (escalations and the whole-job baseline policy).",
                                        labels=JOB),
        "members": GaugeMetricFamily("robustrl_members", "Role members by role and launcher state.",
                                     labels=[*JOB, "role", "state"]),
        "member_version": GaugeMetricFamily("robustrl_member_weights_version",
                                            "Weights version a member holds (rollouts: the version it serves).",
                                            labels=MEMBER),
        "member_info": GaugeMetricFamily("robustrl_member_info",
                                         "Constant 1 per member; labels carry role, state and phase.",
                                         labels=[*MEMBER, "state", "phase"]),
        "faults": CounterMetricFamily("robustrl_faults", "Faults recorded, by kind and role.",
                                      labels=[*JOB, "kind", "role"]),
        "detection": HistogramMetricFamily("robustrl_fault_detection_seconds",
                                           "Delay from fault injection/occurrence to detection.", labels=JOB),
        "recovery": HistogramMetricFamily("robustrl_fault_recovery_seconds",
                                          "Time from detection until the job made progress again.", labels=JOB),
        "timing": GaugeMetricFamily("robustrl_last_step_seconds",
                                    "Wall time of each part of the last step (checkpoint_blocking and "
                                    "weight_sync are on the critical path).", labels=[*JOB, "part"]),
    }
    by_status: Counter[str] = Counter({status: 0 for status in JOB_STATUSES})
    for job in jobs:
        job_id = _text(job.get("job_id"))
        if not job_id:
            continue  # a job without an id cannot be told apart from another: skip, never fail
        status = _text(job.get("status"), "unknown")
        by_status[status] += 1
        fam["info"].add_metric([job_id, _text(job.get("name")), _text(job.get("policy")), status], 1)
        # The controller's ``step`` is the step in progress; ``committed_step`` the last one done.
        # Dicts without ``committed_step`` (older controllers) only have ``step`` to offer.
        committed = "committed_step" if "committed_step" in job else "step"
        for key, name in ((committed, "step"), ("durable_step", "durable"), ("steps_total", "steps"),
                          ("weights_version", "version"), ("ettr", "ettr"), ("restarts_total", "restarts")):
            value = _number(job.get(key))
            if value is not None:
                fam[name].add_metric([job_id], value)
        rewards = job.get("reward_by_step")
        if isinstance(rewards, Sequence) and rewards:
            last = _number(rewards[-1])
            if last is not None:
                fam["reward"].add_metric([job_id], last)
        _members(fam, job_id, job.get("members"))
        _faults(fam, job_id, job.get("faults"))
        timings = job.get("last_step_timings")
        if isinstance(timings, Mapping):
            for part in STEP_PARTS:
                value = _number(timings.get(f"{part}_s"))
                if value is not None:
                    fam["timing"].add_metric([job_id, part], value)
    for status, count in sorted(by_status.items()):
        fam["jobs"].add_metric([status], count)
    return list(fam.values())


def render_prometheus(jobs: Iterable[Mapping[str, object]]) -> str:
    """The exposition text of job status dicts alone (no process metrics), ending with a newline."""
    snapshot = list(jobs)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobCollector(lambda: snapshot))
    return generate_latest(registry).decode()


def controller_registry(jobs: Callable[[], Iterable[Mapping[str, object]]]) -> CollectorRegistry:
    """The controller's registry: its jobs (read at each scrape) and its own process's metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobCollector(jobs))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


def _members(fam: dict[str, Metric], job_id: str, members: object) -> None:
    if not isinstance(members, Sequence):
        return
    counts: Counter[tuple[str, str]] = Counter()
    for member in members:
        if not isinstance(member, Mapping):
            continue
        role, state = _text(member.get("role"), "unknown"), _text(member.get("state"), "unknown")
        counts[(role, state)] += 1
        ml = [job_id, _text(member.get("member_id")), role]
        fam["member_info"].add_metric([*ml, state, _text(member.get("phase"))], 1)
        version = _number(member.get("weights_version"))
        if version is not None:
            fam["member_version"].add_metric(ml, version)
    for (role, state), count in sorted(counts.items()):
        fam["members"].add_metric([job_id, role, state], count)


def _faults(fam: dict[str, Metric], job_id: str, faults: object) -> None:
    if not isinstance(faults, Sequence):
        return
    counts: Counter[tuple[str, str]] = Counter()
    detection: list[float] = []
    recovery: list[float] = []
    for fault in faults:
        if not isinstance(fault, Mapping):
            continue
        counts[(_text(fault.get("kind"), "unknown"), _text(fault.get("role"), "unknown"))] += 1
        # A fault not yet detected / not yet recovered has None here: it is counted above but
        # has no duration to observe until it completes.
        for key, into in (("detection_s", detection), ("recovery_s", recovery)):
            value = _number(fault.get(key))
            if value is not None and not math.isnan(value):
                into.append(value)
    for (kind, role), count in sorted(counts.items()):
        fam["faults"].add_metric([job_id, kind, role], count)
    _histogram(fam["detection"], [job_id], detection, DETECTION_BUCKETS_S)
    _histogram(fam["recovery"], [job_id], recovery, RECOVERY_BUCKETS_S)
