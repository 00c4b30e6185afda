"""Every wire message, as a validated pydantic model.

Raw bytes become a typed object at the edge with :func:`decode`; anything malformed raises
``MessageError`` naming the subject and the field, and the receiving service logs and drops it.
Encoding and decoding never await.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from robustrl.errors import MessageError
from robustrl.subjects import _TOKEN

Role = Literal["trainer", "rollout", "request_manager", "controller", "detector"]
TrainerPhase = Literal["starting", "idle", "waiting_batch", "training", "checkpointing", "publishing"]
RolloutPhase = Literal["starting", "serving", "idle", "loading_weights", "weights_failed"]
FaultKind = Literal["crash", "hang", "unresponsive", "fail_slow", "tool_outage"]
ChaosKind = Literal["crash", "hang", "stall", "slow", "tool_outage", "net_drop", "infra_restart"]
ChaosRole = Literal["trainer", "rollout", "request_manager", "controller", "detector", "nats", "redis", "s3"]
"""Where a fault can be injected: the job's roles, the control plane, and the infra servers
(``infra_restart`` on ``nats | redis | s3``). Control-plane and infra faults are carried out by
whoever owns those processes (the local stack), not by the controller."""
StopReason = Literal["eot", "tool_call", "length"]

_ID = Field(pattern=_TOKEN.pattern)


class Wire(BaseModel):
    """Base of every wire message: strict fields, JSON on the wire."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def encode(self) -> bytes:
        return self.model_dump_json().encode()


M = TypeVar("M", bound=Wire)


def decode(model: type[M], data: bytes, subject: str = "?") -> M:
    """Parse bytes into ``model``; raise MessageError naming the subject and bad field."""
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MessageError(f"not JSON on {subject}: {exc}", subject=subject) from exc
    if not isinstance(raw, dict):
        raise MessageError(f"expected a JSON object on {subject}", subject=subject)
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "<root>"
        raise MessageError(
            f"bad {model.__name__} on {subject}: {field}: {err['msg']}", subject=subject, field=field
        ) from exc


def now() -> float:
    return time.time()


# --- membership -----------------------------------------------------------------------------


class MemberHello(Wire):
    job_id: str = _ID
    member_id: str = _ID
    role: Role
    pid: int
    epoch: int = 0
    address: str | None = None  # weight-server address for trainers/replicas
    resume_step: int | None = None  # trainers: the step the gang resumes at
    ts: float = Field(default_factory=now)


class SpecRequest(Wire):
    job_id: str = _ID
    member_id: str = _ID


class SpecReply(Wire):
    job_id: str = _ID
    spec: dict[str, Any]
    epoch: int  # trainer gang epoch / job incarnation
    resume_step: int | None = None


class MemberExited(Wire):
    job_id: str = _ID
    member_id: str = _ID
    role: Role
    returncode: int | None
    ts: float = Field(default_factory=now)
    expected: bool = False  # the controller stopped it on purpose


# --- phases, metrics, probes ------------------------------------------------------------------


class PhaseChange(Wire):
    job_id: str = _ID
    member_id: str = _ID
    role: Role
    phase: str
    step: int = -1
    ts: float = Field(default_factory=now)


class MetricsSample(Wire):
    """One periodic sample. ``activity`` is a monotonic counter bumped by real work only
    (decoded tokens, forward/backward kernels), so a hung process cannot fake progress."""

    job_id: str = _ID
    member_id: str = _ID
    role: Role
    seq: int = Field(ge=0)
    ts: float
    phase: str
    step: int = -1
    activity: int = Field(0, ge=0)
    tokens_total: int = Field(0, ge=0)
    tokens_per_s: float = Field(0.0, ge=0)
    queue_depth: int = Field(0, ge=0)  # rollout: turns queued, including those waiting for a version
    inflight: int = Field(0, ge=0)
    tool_waiting: int = Field(0, ge=0)
    weights_version: int = -1
    rss_bytes: int = Field(0, ge=0)


class ProbeRequest(Wire):
    job_id: str = _ID
    member_id: str = _ID
    nonce: str


class ProbeReply(Wire):
    member_id: str = _ID
    nonce: str
    phase: str
    ts: float = Field(default_factory=now)


# --- faults and control -----------------------------------------------------------------------


class FaultReport(Wire):
    job_id: str = _ID
    fault_id: str
    role: Role
    member_id: str = _ID
    kind: FaultKind
    evidence: str
    detected_at: float
    step: int = -1
    last_progress_at: float | None = None
    # When the evidence says the fault began (receiver's clock): the last metric before a
    # silence, the first zero-progress sample of a stall, the launcher's exit time of a crash.
    # detected_at - fault_at is the detection delay of a fault nobody injected.
    fault_at: float | None = None
    cause: str | None = None  # named cause, e.g. "queue_stalled", "weights_load_timeout"


class ControlCommand(Wire):
    job_id: str = _ID
    target: str = _ID  # member id or role name
    action: Literal["stop", "replica_dead", "pause", "resume", "restart_step", "tool_outage"]
    args: dict[str, Any] = Field(default_factory=dict)
    # The sending controller's lease fencing token (0: not from a leased controller). A receiver
    # that has seen a larger token refuses the command: it comes from a deposed leader.
    fence: int = Field(0, ge=0)


class ChaosCommand(Wire):
    job_id: str = _ID
    fault_id: str
    kind: ChaosKind
    member_id: str = _ID
    duration_s: float = Field(0.0, ge=0)
    factor: float = Field(1.0, ge=1.0)


# --- rollout --------------------------------------------------------------------------------


class GenerateTurn(Wire):
    job_id: str = _ID
    request_id: str
    episode_id: str
    step: int = Field(ge=0)
    prefix_ids: list[int] = Field(min_length=1)
    max_new_tokens: int = Field(gt=0)
    temperature: float = Field(gt=0)
    top_p: float = Field(gt=0, le=1)
    seed: int
    stop_on_call: bool = True
    min_version: int = -1  # staleness bound: do not serve with an older version


class TurnResult(Wire):
    job_id: str = _ID
    request_id: str
    episode_id: str
    member_id: str = _ID
    token_ids: list[int]
    logprobs: list[float]
    stop_reason: StopReason
    weights_version: int
    gen_s: float = 0.0


# --- trainer --------------------------------------------------------------------------------


class BatchReady(Wire):
    job_id: str = _ID
    step: int = Field(ge=0)
    episode_ids: list[str]
    reward_mean: float
    timings: dict[str, float] = Field(default_factory=dict)


class BatchGet(Wire):
    job_id: str = _ID
    step: int = Field(ge=0)


class StepCommitted(Wire):
    job_id: str = _ID
    step: int = Field(ge=0)
    weights_version: int
    epoch: int
    reward_mean: float
    checksum: str
    durable_step: int = -1  # newest checkpoint whose manifest is written
    timings: dict[str, float] = Field(default_factory=dict)
    checkpoint_bytes: int = 0
    ts: float = Field(default_factory=now)


class WeightsAnnounce(Wire):
    job_id: str = _ID
    version: int
    epoch: int
    checksum: str
    sources: list[str]
    manifest: dict[str, Any]  # robustrl.weights.manifest.Manifest, validated by the puller


class WeightsHave(Wire):
    job_id: str = _ID
    member_id: str = _ID
    version: int
    address: str
    checksum: str


# --- event log ------------------------------------------------------------------------------

EventKind = Literal[
    "job_submitted", "job_started", "job_ready", "job_finished", "job_failed", "job_stopped",
    "member_started", "member_ready", "member_exited", "member_stopped",
    "phase", "fault_injected", "fault_detected", "decision", "action", "recovered",
    "step_started", "step_committed", "batch_ready", "weights_published", "weights_loaded",
    "weights_rejected",
    "episode_redispatched", "tool_fault", "work_lost", "note",
]


class Event(Wire):
    job_id: str = _ID
    kind: EventKind
    ts: float = Field(default_factory=now)
    data: dict[str, Any] = Field(default_factory=dict)


class ChaosRequest(Wire):
    """A fault to inject, addressed by role and member index (or id); resolved by the controller."""

    job_id: str = _ID
    fault_id: str = _ID
    kind: ChaosKind
    role: ChaosRole
    member: int | str = 0
    duration_s: float = Field(0.0, ge=0, le=3600)
    factor: float = Field(4.0, ge=1.0, le=1000)


class ChaosAck(Wire):
    fault_id: str
    member_id: str | None
    ok: bool
    error: str | None = None
