"""What the auditor reads (``AuditInput``), how it is told to judge (``AuditOptions``), and what
it answers (``AuditReport``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field, PrivateAttr

from robustrl.audit.raw import RawCheckpoint, RawEvent, RawRedis

REDIS_SLACK_STEPS = 2
"""Steps older than the newest loadable checkpoint that Redis may still hold (GC runs after the
checkpoint is durable, so it lags by a step or two)."""

CHECKS = ("event_log", "trained_once", "checkpoints", "checkpoint_weights", "episodes", "trained_batches",
          "prefixes", "weights", "redis_bounded", "outbox", "progress")


@dataclass(frozen=True)
class AuditOptions:
    redis_bound: bool = True
    """Judge Redis growth (keys of steps long durable must be gone)."""
    redis_slack_steps: int = REDIS_SLACK_STEPS
    max_stuck_s: float | None = None
    """A gap longer than this between progress events is a violation. None: the job's own bound,
    its spec's ``detector.step_deadline_s`` (or ``commit_deadline_s``, the longer) plus twice
    ``recovery.deadline_s`` from the log (a
    stall the controller should have acted on, escalated and recovered from by then)."""
    controller_outbox_slack_s: float = 60.0
    """A controller event still owed (in ``Keys.controller_outbox``, not in the log) is a violation
    once the log holds the final event and the owed one was given more than this before it. The
    flusher appends in outbox order, but an event is stamped before its save, and a save may
    retry through a Redis outage (about 30 s): one stamped before the final event can be saved
    after it, and so still be on its way. Events given after the final one (``member_stopped``)
    may be owed whatever their age."""
    require_ended: bool = True
    """The job's log must end (``job_finished``, ``job_failed`` or ``job_stopped``); False for a
    job audited while it runs."""


@dataclass
class ObservedStep:
    """A step's batch and episodes as read raw from Redis at hand-off (the campaign samples them
    live, so steps whose keys were garbage-collected later can still be audited). An observation
    stands in for Redis only in judging what the batch held: a batch gone from Redis before its
    checkpoint was durable is lost however it was seen (a redo could not train it)."""

    step: int
    batch: dict[str, Any] | None
    episodes: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    prefixes: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    step_set: set[str] | None = None
    """The members of the step's episode set read with the batch (None: not read, or no set)."""


@dataclass
class AuditInput:
    job_id: str
    events: list[RawEvent]
    redis: RawRedis
    checkpoints: list[RawCheckpoint]
    observed: dict[int, ObservedStep] = field(default_factory=dict)
    origins: dict[int, Any] | None = None
    """Gang origins as read from the object store (``raw.scan_origins``); None: not read (a
    synthetic input), and the origin check is skipped."""


class CheckResult(BaseModel):
    passed: bool = True
    violations: list[str] = Field(default_factory=list)


class AuditReport(BaseModel):
    """The auditor's verdict. ``counters`` are the campaign's loss counters (all 0 when sound)."""

    job_id: str
    ok: bool
    checks: dict[str, CheckResult]
    steps_trained_twice: int = 0
    steps_lost: int = 0
    episodes_lost: int = 0
    checkpoints_unloadable: int = 0
    replicas_served_bad_weights: int = 0
    facts: dict[str, Any] = Field(default_factory=dict)
    _raw: AuditInput | None = PrivateAttr(None)

    @property
    def raw(self) -> AuditInput | None:
        """What the auditor read (tests assert more on it); not part of the JSON report."""
        return self._raw

    def violations(self) -> list[str]:
        return [f"{name}: {v}" for name, c in self.checks.items() for v in c.violations]

    def counters(self) -> dict[str, int]:
        return {"steps_trained_twice": self.steps_trained_twice, "steps_lost": self.steps_lost,
                "episodes_lost": self.episodes_lost, "checkpoints_unloadable": self.checkpoints_unloadable,
                "replicas_served_bad_weights": self.replicas_served_bad_weights}
