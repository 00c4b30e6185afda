"""Prometheus text exposition of the controller's job status.

The controller mounts ``GET /metrics`` and answers it with :func:`render_prometheus` fed with the
same job dicts its ``GET /v1/jobs/{id}`` returns. The renderer is hand-written (no
``prometheus_client`` dependency) because every value here is a snapshot of state the
controller already holds: there are no counters to increment in-process, only a document to print.

Rendering is pure and tolerant: a missing key or a non-numeric value drops that one sample
instead of failing the whole scrape, because a scrape that errors hides every other job too.
Histograms of detection delay and recovery time are rebuilt from the job's full fault list on
each scrape, so they are exact (not sampled) and survive a controller restart that reloads jobs.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The ``Content-Type`` the ``/metrics`` response must carry."""

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

Labels = tuple[tuple[str, str], ...]


def escape_label_value(value: str) -> str:
    """Escape a label value for the text format: backslash, double quote and newline."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    # HELP text escapes backslash and newline only (quotes are literal there).
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float) -> str:
    """A sample value as the text format spells it (``NaN``, ``+Inf``, integers without ``.0``)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _number(value: object) -> float | None:
    """``value`` as a float, or None when absent or not a real number (bools are not numbers)."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    return None


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{name}="{escape_label_value(value)}"' for name, value in labels)
    return "{" + inner + "}"


@dataclass
class _Family:
    """One metric family: its HELP/TYPE header and samples (suffix, labels, value)."""

    name: str
    kind: str  # gauge | counter | histogram
    help: str
    samples: list[tuple[str, Labels, float]] = field(default_factory=list)

    def add(self, labels: Labels, value: float, suffix: str = "") -> None:
        self.samples.append((suffix, labels, value))

    def render(self, out: list[str]) -> None:
        out.append(f"# HELP {self.name} {_escape_help(self.help)}")
        out.append(f"# TYPE {self.name} {self.kind}")
        for suffix, labels, value in self.samples:
            out.append(f"{self.name}{suffix}{_labels(labels)} {format_value(value)}")


def _observe_histogram(family: _Family, base: Labels, values: Sequence[float],
                       buckets: Sequence[float]) -> None:
    """Add cumulative buckets, ``_sum`` and ``_count`` for one label set."""
    for bound in buckets:
        count = sum(1 for v in values if v <= bound)
        family.add(base + (("le", format_value(bound)),), count, "_bucket")
    family.add(base + (("le", "+Inf"),), len(values), "_bucket")
    family.add(base, math.fsum(values), "_sum")
    family.add(base, len(values), "_count")


def _text(value: object, default: str = "") -> str:
    return default if value is None else str(value)


def render_prometheus(jobs: Iterable[Mapping[str, object]]) -> str:
    """Render job status dicts (the ``GET /v1/jobs/{id}`` body) as Prometheus text.

    Args:
        jobs: job status dicts with keys ``job_id``, ``name``, ``status``, ``policy``,
            ``committed_step`` (or ``step``), ``durable_step``, ``restarts_total``, ``steps_total``, ``weights_version``, ``reward_by_step``, ``members``, ``faults``,
            ``ettr`` and ``last_step_timings``. Missing keys drop only their samples.

    Returns:
        The exposition text, ending with a newline.
    """
    fam = {
        "jobs": _Family("robustrl_jobs", "gauge", "Jobs by status."),
        "info": _Family("robustrl_job_info", "gauge", "Constant 1 per job; labels carry name, policy, status."),
        "step": _Family("robustrl_job_step", "gauge", "Last committed RL step of the job (-1: none yet)."),
        "durable": _Family("robustrl_job_durable_step", "gauge",
                           "Newest step whose checkpoint is complete in the object store (-1: none)."),
        "steps": _Family("robustrl_job_steps_planned", "gauge", "Steps the job was submitted with."),
        "version": _Family("robustrl_job_weights_version", "gauge", "Trainer's announced weights version."),
        "reward": _Family("robustrl_job_reward_last", "gauge", "Mean reward of the last committed step."),
        "ettr": _Family("robustrl_job_ettr", "gauge",
                        "Effective training time ratio: productive time / wall time (0..1)."),
        "restarts": _Family("robustrl_job_restarts_total", "counter",
                            "Whole-job restarts (escalations and the whole-job baseline policy)."),
        "members": _Family("robustrl_members", "gauge", "Role members by role and launcher state."),
        "member_version": _Family("robustrl_member_weights_version", "gauge",
                                  "Weights version a member holds (rollouts: the version it serves)."),
        "member_info": _Family("robustrl_member_info", "gauge",
                               "Constant 1 per member; labels carry role, state and phase."),
        "faults": _Family("robustrl_faults_total", "counter", "Faults recorded, by kind and role."),
        "detection": _Family("robustrl_fault_detection_seconds", "histogram",
                             "Delay from fault injection/occurrence to detection."),
        "recovery": _Family("robustrl_fault_recovery_seconds", "histogram",
                            "Time from detection until the job made progress again."),
        "timing": _Family("robustrl_last_step_seconds", "gauge",
                          "Wall time of each part of the last step (checkpoint_blocking and "
                          "weight_sync are on the critical path)."),
    }
    by_status: Counter[str] = Counter({status: 0 for status in JOB_STATUSES})
    for job in jobs:
        job_id = _text(job.get("job_id"))
        if not job_id:
            continue  # a job without an id cannot be told apart from another: skip, never fail
        status = _text(job.get("status"), "unknown")
        by_status[status] += 1
        jl: Labels = (("job_id", job_id),)
        fam["info"].add(jl + (("name", _text(job.get("name"))), ("policy", _text(job.get("policy"))),
                              ("status", status)), 1)
        # The controller's ``step`` is the step in progress; ``committed_step`` the last one done.
        # Dicts without ``committed_step`` (older controllers) only have ``step`` to offer.
        committed = "committed_step" if "committed_step" in job else "step"
        for key, name in ((committed, "step"), ("durable_step", "durable"), ("steps_total", "steps"),
                          ("weights_version", "version"), ("ettr", "ettr"), ("restarts_total", "restarts")):
            value = _number(job.get(key))
            if value is not None:
                fam[name].add(jl, value)
        rewards = job.get("reward_by_step")
        if isinstance(rewards, Sequence) and rewards:
            last = _number(rewards[-1])
            if last is not None:
                fam["reward"].add(jl, last)
        _render_members(fam, jl, job.get("members"))
        _render_faults(fam, jl, job.get("faults"))
        timings = job.get("last_step_timings")
        if isinstance(timings, Mapping):
            for part in STEP_PARTS:
                value = _number(timings.get(f"{part}_s"))
                if value is not None:
                    fam["timing"].add(jl + (("part", part),), value)
    for status, count in sorted(by_status.items()):
        fam["jobs"].add((("status", status),), count)
    out: list[str] = []
    for family in fam.values():
        family.render(out)
    return "\n".join(out) + "\n"


def _render_members(fam: dict[str, _Family], jl: Labels, members: object) -> None:
    if not isinstance(members, Sequence):
        return
    counts: Counter[tuple[str, str]] = Counter()
    for member in members:
        if not isinstance(member, Mapping):
            continue
        role, state = _text(member.get("role"), "unknown"), _text(member.get("state"), "unknown")
        counts[(role, state)] += 1
        member_id = _text(member.get("member_id"))
        ml = jl + (("member_id", member_id), ("role", role))
        fam["member_info"].add(ml + (("state", state), ("phase", _text(member.get("phase")))), 1)
        version = _number(member.get("weights_version"))
        if version is not None:
            fam["member_version"].add(ml, version)
    for (role, state), count in sorted(counts.items()):
        fam["members"].add(jl + (("role", role), ("state", state)), count)


def _render_faults(fam: dict[str, _Family], jl: Labels, faults: object) -> None:
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
        fam["faults"].add(jl + (("kind", kind), ("role", role)), count)
    _observe_histogram(fam["detection"], jl, detection, DETECTION_BUCKETS_S)
    _observe_histogram(fam["recovery"], jl, recovery, RECOVERY_BUCKETS_S)
