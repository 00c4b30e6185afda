"""Every wire message, as a validated pydantic model.

Raw bytes become a typed object at the edge with :func:`decode`; anything malformed raises
``MessageError`` naming the subject and the field, and the receiving service logs and drops it.
Encoding and decoding never await.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StringConstraints, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from robustrl import jsonlimits
from robustrl.errors import MessageError, SubjectError
from robustrl.subjects import _TOKEN, parse_event_subject

Role = Literal["trainer", "rollout", "request_manager", "controller", "detector"]
TrainerPhase = Literal["starting", "idle", "waiting_batch", "training", "checkpointing", "publishing"]
RolloutPhase = Literal["starting", "serving", "idle", "loading_weights", "weights_failed", "awaiting_version"]
FaultKind = Literal["crash", "hang", "unresponsive", "fail_slow", "tool_outage", "bad_output"]
ChaosKind = Literal["crash", "hang", "stall", "slow", "tool_outage", "net_drop", "partition", "infra_restart"]
ChaosRole = Literal["trainer", "rollout", "request_manager", "controller", "detector", "nats", "redis", "s3"]
"""Where a fault can be injected: the job's roles, the control plane, and the infra servers
(``infra_restart`` on ``nats | redis | s3``). Control-plane and infra faults are carried out by
whoever owns those processes (the local stack), not by the controller."""
ChaosMoment = Literal["now", "mid_tool_turn", "mid_batch"]
"""When a crash is carried out: ``now``, or armed (rollout only) and carried out by the replica
itself, killing its process group, so that a test or a bench does not have to race the moment from
outside: ``mid_tool_turn`` at the first token of the next turn it generates after a tool result
(that episode's tool-turn prefix saved, the turn in flight: the worst moment for the episode),
``mid_batch`` at the first token of the next batch it decodes (turns in flight by construction;
the harness's ``within_step: decoding`` crashes use it)."""
StopReason = Literal["eot", "tool_call", "length"]

_ID = Field(pattern=_TOKEN.pattern)


TOKENS_PER_S_MAX = 1e9
"""No engine decodes this many tokens a second: a rate above it is garbage, refused on the bus
(one huge finite rate moved the peer median as far as an infinite one)."""


class Wire(BaseModel):
    """Base of every wire message: strict fields, JSON on the wire, finite numbers only (an
    infinite rate from one replica made the peer median infinite, and every healthy peer a
    ``fail_slow`` fault: an outside review)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    def encode(self) -> bytes:
        return self.model_dump_json().encode()


M = TypeVar("M", bound=Wire)


MAX_MESSAGE_BYTES = 8 * 1024 * 1024
"""Largest payload decoded (the compose NATS ``max_payload``); bigger ones are refused unparsed."""
MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays/objects decoded; the messages themselves need fewer than 8 levels."""

def loads_bounded(data: bytes | str, *, max_bytes: int = MAX_MESSAGE_BYTES,
                  max_depth: int = MAX_JSON_DEPTH, what: str = "payload") -> Any:
    """The bus's bounded ``json.loads`` (robustrl.jsonlimits) with the bus's limits."""
    return jsonlimits.loads_bounded(data, max_bytes=max_bytes, max_depth=max_depth, what=what)


def decode(model: type[M], data: bytes, subject: str = "?") -> M:
    """Parse bytes into ``model``; raise MessageError naming the subject and bad field.

    Size and nesting are checked before parsing (``loads_bounded``), so garbage cannot blow the
    parser's stack or memory.
    """
    raw = loads_bounded(data, what=f"message on {subject[:200]}")
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
    except RecursionError as exc:  # belt and braces: validators of nested Any data
        raise MessageError(f"bad {model.__name__} on {subject}: too deep", subject=subject) from exc


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


class HelloAck(Wire):
    """The leading controller heard ``member_id``'s hello (the member stops sending it again)."""
    job_id: str = _ID
    member_id: str = _ID
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
    tokens_per_s: float = Field(0.0, ge=0, le=TOKENS_PER_S_MAX)
    queue_depth: int = Field(0, ge=0)  # rollout: turns queued, including those waiting for a version
    inflight: int = Field(0, ge=0)
    tool_waiting: int = Field(0, ge=0)
    weights_version: int = -1
    rss_bytes: int = Field(0, ge=0)
    episodes_outstanding: int = Field(0, ge=0)  # request manager: episodes of the step not finished
    # GPU path (robustrl.gpu, read by NVML from the driver): None where unknown or on the CPU.
    gpu_util_pct: float | None = Field(None, ge=0, le=100, allow_inf_nan=False)
    gpu_mem_bytes: int | None = Field(None, ge=0)
    gpu_lost: StrictBool = False  # NVML: the device is lost (Xid 79); the detector faults the member at once


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


CHAOS_UNTIMED_S = 3600.0
"""How long a member-side fault given ``duration_s`` 0 lasts (a stall, slow, an armed crash)."""


def _moment_of_a_crash(moment: str, info: ValidationInfo) -> str:
    """A ``moment`` other than now arms a crash; on any other fault it would be dropped silently."""
    kind = info.data.get("kind")
    if moment != "now" and kind is not None and kind != "crash":
        raise ValueError(f"moment {moment} is for a crash only, not {kind}")
    return moment


class ChaosCommand(Wire):
    job_id: str = _ID
    fault_id: str
    kind: ChaosKind
    member_id: str = _ID
    duration_s: float = Field(0.0, ge=0)
    factor: float = Field(1.0, ge=1.0)
    moment: ChaosMoment = "now"

    _moment = field_validator("moment")(_moment_of_a_crash)


# --- rollout --------------------------------------------------------------------------------


TokenId = Annotated[int, Field(ge=0)]


class GenerateTurn(Wire):
    job_id: str = _ID
    request_id: str
    episode_id: str
    step: int = Field(ge=0)
    prefix_ids: list[TokenId] = Field(min_length=1)
    max_new_tokens: int = Field(gt=0)
    temperature: float = Field(gt=0)
    top_p: float = Field(gt=0, le=1)
    seed: int
    stop_on_call: bool = True
    min_version: int = -1  # staleness bound: do not serve with an older version
    turn: int = Field(0, ge=0)
    """Turns of the episode before this one (0: its first reply; more: the prefix ends in a tool result)."""


REFUSAL_ERROR_MAX = 500
"""The longest reason a replica's refusal of a turn carries (``TurnResult.error``)."""


class TurnResult(Wire):
    job_id: str = _ID
    request_id: str
    episode_id: str
    member_id: str = _ID
    token_ids: list[TokenId]
    logprobs: list[float]
    stop_reason: StopReason
    weights_version: int
    weights_checksum: str = Field(default="", max_length=128)
    """The checksum of the weights the turn was made with (the auditor's evidence where the
    replica's ``weights_loaded`` was lost with it; "" from a replica that does not say)."""
    gen_s: float = 0.0
    refused: Literal["", "input", "engine"] = ""
    """Set by a replica that did not decode the turn (``token_ids`` empty then; ``error`` says
    why): ``input``, no engine can (a token id outside its vocabulary, a seed out of range);
    ``engine``, its engine failed on the turn alone. The request manager sends the turn to another
    replica at once and names the refusal in the log (``turn_refused``); before, such a turn got
    no answer and waited out its deadline, and one every replica refused was never named."""
    error: str = Field("", max_length=REFUSAL_ERROR_MAX)

    @model_validator(mode="after")
    def _a_refusal_has_no_tokens(self) -> TurnResult:
        if self.refused and self.token_ids:
            raise ValueError(f"a refusal ({self.refused}) carries no token ids, got {len(self.token_ids)}")
        if self.error and not self.refused:
            raise ValueError("error is a refusal's reason: refused must be set with it")
        return self

    @field_validator("logprobs")
    @classmethod
    def _a_logprob_per_token(cls, logprobs: list[float], info: ValidationInfo) -> list[float]:
        # Stored as the episode's turn, it reaches the trainer's batch: a mismatch there fails
        # every redo of the step until the job does.
        ids = info.data.get("token_ids")
        if ids is not None and len(logprobs) != len(ids):
            raise ValueError(f"{len(logprobs)} logprobs for {len(ids)} token ids")
        return logprobs


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
    manifest: dict[str, Any] | None = None
    """The manifest inline (robustrl.weights.manifest.Manifest, validated by the puller); absent in
    announcements by reference, the default: ~90 B per chunk outgrows one NATS message."""
    manifest_digest: str = ""
    """SHA-256 of the manifest's bytes: pullers fetch it from a source (MANIFEST) and check it."""
    manifest_bytes: int = 0

    @model_validator(mode="after")
    def _names_a_manifest(self) -> WeightsAnnounce:
        if self.manifest is None and not self.manifest_digest:
            raise ValueError("an announcement carries its manifest or the manifest's digest")
        return self


class WeightsHave(Wire):
    job_id: str = _ID
    member_id: str = _ID
    version: int
    address: str
    checksum: str
    complete: bool = True
    """False: the replica has only started pulling this version and relays the chunks it holds
    (peers pulling at the same moment find each other and split the publisher); it neither
    serves nor holds the version yet, so dispatch and readiness ignore such announcements."""


# --- event log ------------------------------------------------------------------------------

EventKind = Literal[
    "job_submitted", "job_started", "job_ready", "job_finished", "job_failed", "job_stopped", "job_deleted",
    "member_started", "member_ready", "member_exited", "member_stopped",
    "phase", "fault_injected", "fault_detected", "decision", "action", "recovered",
    "step_started", "step_committed", "batch_ready", "weights_published", "weights_loaded",
    "weights_rejected", "fault_struck",
    "episode_redispatched", "tool_fault", "work_lost", "note",
    "turn_regenerated", "turn_dropped", "turn_rejected", "turn_refused", "deadline_passed", "rm_resumed",
    "replica_borrowed", "replica_restocked", "restock_failed", "role_switched", "stale_turns_dropped",
]


class EventData(BaseModel):
    """Base of an event's ``data``: the fields readers rely on are typed, strictly (a step of
    ``"5.0"`` is refused, not read as 5 here and fed to ``int()`` by a reader that trusts the
    check), others pass through."""

    model_config = ConfigDict(extra="allow", frozen=True, allow_inf_nan=False, strict=True)


class StepData(EventData):
    step: int
    epoch: int = 0


class StepCommittedData(StepData):
    weights_version: int
    durable_step: int = -1
    reward_mean: float | None = None
    checksum: str = ""


class FaultData(EventData):
    fault_id: str
    kind: str
    role: str
    member_id: str | None = ""
    step: int | None = -1
    duration_s: float | None = Field(0.0, ge=0)


class FaultRefData(EventData):
    fault_id: str | None = None


class DecisionData(FaultRefData):
    actions: list[str] = Field(default_factory=list)
    reason: str = ""


class RecoveredData(FaultRefData):
    role: str = ""


class WorkLostData(FaultRefData):
    tokens: int = Field(0, ge=0)
    turns: int = Field(0, ge=0)
    steps_redone: int = Field(0, ge=0)


class TurnRegeneratedData(FaultRefData):
    tokens: int = Field(0, ge=0)
    episode_id: str = ""


class MemberData(EventData):
    member_id: str = ""
    role: str = ""
    epoch: int = 0


class StruckData(EventData):
    """``fault_struck``: an armed crash (``fault_id``: the injection's) carried out by its member."""

    fault_id: str
    member_id: str
    moment: ChaosMoment


EVENT_DATA: dict[str, type[EventData]] = {
    "step_started": StepData, "step_committed": StepCommittedData,
    "fault_injected": FaultData, "fault_detected": FaultData, "decision": DecisionData,
    "action": FaultRefData, "recovered": RecoveredData, "work_lost": WorkLostData,
    "turn_regenerated": TurnRegeneratedData,
    "member_started": MemberData, "member_ready": MemberData, "member_exited": MemberData,
    "fault_struck": StruckData,
}
"""Typed ``data`` of the event kinds that accounting, the report and the dashboard read; other
kinds carry any JSON object. Checked where an event is written and again where it is read."""


class Event(Wire):
    """One entry of a job's event log (JetStream ``RRL_EVENTS``, subject ``rrl.events.<job>.<role>.<kind>``)."""

    job_id: str = _ID
    kind: EventKind
    ts: float = Field(default_factory=now, allow_inf_nan=False)
    data: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _data_fits_kind(self) -> Event:
        schema = EVENT_DATA.get(self.kind)
        if schema is not None:
            try:
                schema.model_validate(self.data)
            except ValidationError as exc:
                err = exc.errors()[0]
                field = ".".join(str(p) for p in err["loc"])
                raise ValueError(f"data.{field} of a {self.kind} event: {err['msg']}") from None
        return self


class EventLog(list[Event]):
    """Events read from the log, in log order; ``skipped`` counts envelopes that could not be
    parsed (bad JSON, too deep, wrong types, a kind written by a role that does not own it)."""

    def __init__(self, events: list[Event] | None = None, skipped: int = 0) -> None:
        super().__init__(events or [])
        self.skipped = skipped


def decode_event(data: bytes, subject: str) -> Event:
    """Parse one event-log envelope and check it against its subject: the subject's job and kind
    must match the envelope's, and the subject's role must own the kind. Raises MessageError."""
    event = decode(Event, data, subject)
    parts = subject.split(".")
    try:
        if len(parts) == 4:  # rrl.events.<job>.<kind>: logs written before roles were a level
            job_id, kind = parts[2], parts[3]
        else:
            job_id, _role, kind = parse_event_subject(subject)
    except SubjectError as exc:
        raise MessageError(f"event on {subject[:200]}: {exc.message}", subject=subject, field="kind") from exc
    if (job_id, kind) != (event.job_id, event.kind):
        raise MessageError(f"event on {subject[:200]} carries job {event.job_id!r} kind {event.kind!r}",
                           subject=subject, field="kind")
    return event


def usable_event(event: Event) -> bool:
    """Whether an Event object (perhaps built without validation) passes validation now."""
    try:
        Event.model_validate({"job_id": event.job_id, "kind": event.kind, "ts": event.ts, "data": event.data})
    except (ValidationError, TypeError, ValueError, AttributeError, RecursionError):
        return False
    return True


class ChaosRequest(Wire):
    """A fault to inject, addressed by role and member index (or id); resolved by the controller."""

    job_id: str = _ID
    fault_id: str = _ID
    kind: ChaosKind
    role: ChaosRole
    member: int | str = 0
    duration_s: float = Field(0.0, ge=0, le=3600)
    factor: float = Field(4.0, ge=1.0, le=1000)
    against: list[Annotated[str, StringConstraints(pattern=r"^(h\d{1,3}|gw)$")]] = Field(default_factory=list,
                                                                                         max_length=250)
    """``partition`` on a testbed: the hosts the member's host is cut from (``gw``: the infra and
    control plane); empty: every other host and ``gw``."""
    moment: ChaosMoment = "now"

    _moment = field_validator("moment")(_moment_of_a_crash)


class ChaosAck(Wire):
    fault_id: str
    member_id: str | None
    ok: bool
    error: str | None = None
