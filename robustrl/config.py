"""Configuration: the job spec (what to train) and the service settings (where things are).

Both are validated once at the edge. ``JobSpec`` arrives through the REST API and is
rejected with the failing field named; ``Settings`` is read from an environment mapping
passed in explicitly (nothing reads ``os.environ`` later).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StringConstraints, ValidationError, ValidationInfo, field_validator, model_validator,
)

from robustrl.errors import ConfigError

# Numbers in a job spec are JSON numbers: strings ("5", a 400-digit "999...") and booleans are
# refused, as are NaN and +-Infinity (Python's json accepts them, and ``1e999`` parses to inf), so
# what the OpenAPI schema promises is what the server accepts.
_STRICT = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ModelSpec(BaseModel):
    """Policy network: a tiny Qwen3-architecture model (random init) or a local directory."""

    model_config = _STRICT
    hidden_size: StrictInt = Field(64, ge=8, le=8192, description="Transformer width.")
    num_layers: StrictInt = Field(2, ge=1, le=128)
    num_heads: StrictInt = Field(4, ge=1, le=128)
    num_kv_heads: StrictInt = Field(2, ge=1, le=128)
    intermediate_size: StrictInt = Field(128, ge=8, le=65536)
    max_positions: StrictInt = Field(256, ge=32, le=65536, description="Longest prompt + response.")
    path: str | None = Field(None, max_length=4096, description=(
        "Local model directory to load instead of random init: one written by save_policy (char "
        "tokenizer) or any Hugging Face causal LM directory with its own tokenizer.json and chat template."))
    device: Literal["cpu", "cuda"] = Field("cpu", description=(
        "Where trainer and torch rollout engine keep the model and optimizer (cuda: GPU path, NCCL)."))
    chat_template_kwargs: dict[Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")],
                               StrictBool | StrictInt | StrictFloat | Annotated[str, StringConstraints(max_length=256)]] = Field(
        default_factory=dict, max_length=16, description=(
            "Extra variables of a Hugging Face directory's chat template, in every role that renders it "
            "(as apply_chat_template's keyword arguments), e.g. {\"enable_thinking\": false} for Qwen3."))

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs_not_reserved(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        taken = sorted(set(kwargs) & {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                      "raise_exception", "strftime_now"})
        if taken:
            raise ValueError(f"{', '.join(taken)}: set by RobustRL itself, not a template variable a job may set")
        return kwargs

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelSpec:
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_heads")
        if (self.hidden_size // self.num_heads) % 2:  # rotary embeddings pair the head's dimensions
            raise ValueError("hidden_size / num_heads (the head dimension) must be even: rotary embeddings "
                             "rotate pairs of dimensions (an odd one passed here and failed every forward pass)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        return self


class DataSpec(BaseModel):
    """Which verifiable tasks feed the job and how many episodes a step has."""

    model_config = _STRICT
    tasks: list[Literal["reverse", "copy", "lookup", "calc"]] = Field(
        default_factory=lambda: ["reverse", "lookup"], min_length=1, max_length=16
    )
    prompts_per_step: StrictInt = Field(8, ge=1, le=4096)
    group_size: StrictInt = Field(8, ge=2, le=256, description="GRPO samples per prompt.")


_K8S_LABEL = r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
_K8S_VALUE = r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$"


class ResourceSpec(BaseModel):
    """What each member of a role reserves on its node. Honoured by the Ray launcher and the
    Kubernetes renderer (requests = limits), by the Docker launcher as container limits; the local
    launcher logs that it ignores them (processes share one machine)."""

    model_config = _STRICT
    cpus: StrictFloat | None = Field(None, ge=0.0, le=1024.0, description=(
        "CPUs per member (fractions allowed); null: the launcher's default (Ray: 1)."))
    gpus: StrictFloat = Field(0.0, ge=0.0, le=64.0, description="GPUs per member.")
    memory_mb: StrictInt | None = Field(None, ge=1, le=16 * 1024 * 1024, description=(
        "Memory per member in MiB; null: no reservation."))


class PlacementSpec(BaseModel):
    """Where a role's members may run (launchers that place members on several nodes)."""

    model_config = _STRICT
    strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = Field("PACK", description=(
        "Trainer gang: ranks packed on few nodes (PACK) or each on its own node (STRICT_SPREAD); "
        "a Ray placement-group strategy. Ignored for rollout replicas."))
    anti_affinity: Literal["none", "preferred", "required"] = Field("none", description=(
        "Rollout replicas of a job on distinct nodes: preferred (when a node is free) or required "
        "(a start fails without one). Ignored for trainer ranks (see strategy)."))
    node_labels: dict[Annotated[str, Field(pattern=_K8S_LABEL, max_length=317)],
                      Annotated[str, Field(pattern=_K8S_VALUE, max_length=63)]] = Field(
        default_factory=dict, max_length=16, description="Labels every node of the role must carry.")


class RolloutSpec(BaseModel):
    model_config = _STRICT
    replicas: StrictInt = Field(2, ge=1, le=64)
    max_new_tokens: StrictInt = Field(12, ge=1, le=4096, description="Length limit of one turn.")
    max_turns: StrictInt = Field(3, ge=1, le=32)
    temperature: StrictFloat = Field(1.0, gt=0.0, le=10.0)
    top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0)
    max_batch: StrictInt = Field(64, ge=1, le=4096, description="Episodes decoded together per replica.")
    resources: ResourceSpec = Field(default_factory=ResourceSpec)
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    engine: Literal["torch", "vllm"] = Field("torch", description=(
        "Generation engine of the replicas: torch (built-in KV-cache decoder) or vllm (vLLM AsyncLLM, run "
        "from its own environment: scripts/setup.sh --vllm)."))
    vllm_cpu_linear: Literal["packed", "plain"] = Field("packed", description=(
        "vLLM on CPU only: packed (vLLM's own: linear weights re-packed for oneDNN after every load) or plain "
        "(kept in checkpoint layout, torch.nn.functional.linear: a weight swap is copies only, generation "
        "somewhat slower; bench/engines.py measures both). No effect on GPU or with the torch engine."))
    vllm_gpu_memory_utilization: StrictFloat | None = Field(None, gt=0.0, le=0.98, description=(
        "vLLM on a GPU only: the fraction of the GPU's memory a replica's vLLM takes (weights, activations, "
        "KV cache). null: 0.9 x resources.gpus where a replica is given part of a GPU (resources.gpus < 1, "
        "replicas sharing one), else vLLM's own default. Without it, a second vLLM on the same GPU (another "
        "replica, or a trainer rank beside it) failed at its start."))

    def vllm_memory_fraction(self) -> float | None:
        """The ``gpu_memory_utilization`` a replica's vLLM is started with (None: vLLM's default)."""
        if self.vllm_gpu_memory_utilization is not None:
            return self.vllm_gpu_memory_utilization
        gpus = self.resources.gpus
        return round(0.9 * gpus, 4) if 0.0 < gpus < 1.0 else None


class TrainerSpec(BaseModel):
    model_config = _STRICT
    workers: StrictInt = Field(2, ge=1, le=64)
    backend: Literal["gloo", "nccl"] = "gloo"
    lr: StrictFloat = Field(1e-2, gt=0.0, le=1.0)
    clip_eps: StrictFloat = Field(0.2, gt=0.0, le=1.0)
    is_cap: StrictFloat | None = Field(2.0, ge=1.0, le=100.0, description=(
        "Truncation of the importance weight pi_old / pi_behaviour applied to off-policy turns when "
        "staleness > 0 (null: no correction, the clipped ratio is taken against the behaviour policy)."))
    micro_batch_tokens: StrictInt = Field(8192, ge=64, le=1 << 24, description=(
        "Most padded token positions one forward/backward of a rank takes; a rank's share of a step "
        "is split into micro-batches this size and their gradients accumulated (the same step, in a "
        "fraction of the activation memory, which is several positions x vocabulary float tensors: "
        "logits, log-softmax and their gradients, a third more with top_p < 1)."))
    checkpoint_keep: StrictInt = Field(3, ge=1, le=100, description="Complete checkpoints kept.")
    max_undurable_steps: StrictInt = Field(16, ge=2, le=100_000, description=(
        "Steps rank 0 trains past the newest durable checkpoint before it stops, named "
        "(CheckpointStalled: uploads keep failing); the gang is restarted from that checkpoint."))
    resources: ResourceSpec = Field(default_factory=ResourceSpec)
    placement: PlacementSpec = Field(default_factory=PlacementSpec)


class ToolSpec(BaseModel):
    model_config = _STRICT
    latency_s: StrictFloat = Field(0.15, ge=0.0, le=600.0, description="Simulated service latency per call.")
    timeout_s: StrictFloat = Field(2.0, gt=0.0, le=3600.0)
    retries: StrictInt = Field(3, ge=0, le=20)
    backoff_s: StrictFloat = Field(0.1, ge=0.0, le=60.0)


MAX_THRESHOLD_S = 7 * 24 * 3600.0
"""Upper bound of every detector threshold: finite values only, and none a timer cannot hold."""

DETECTOR_PROFILES: dict[str, dict[str, float]] = {
    # The reference job on a 2-core machine (DESIGN section 9): thresholds in seconds, not minutes.
    "scaled": {"trainer_idle_s": 4.0, "rollout_idle_s": 2.0, "silence_s": 3.0, "probe_timeout_s": 1.0,
               "metrics_interval_s": 0.25, "weights_load_s": 30.0, "turn_deadline_s": 10.0,
               "step_deadline_s": 180.0, "start_deadline_s": 180.0, "commit_deadline_s": 180.0,
               "trainer_io_s": 600.0},
    # The paper's values for real clusters.
    "production": {"trainer_idle_s": 300.0, "rollout_idle_s": 60.0, "silence_s": 30.0, "probe_timeout_s": 10.0,
                   "metrics_interval_s": 5.0, "weights_load_s": 600.0, "turn_deadline_s": 600.0,
                   "step_deadline_s": 3600.0, "start_deadline_s": 1800.0, "commit_deadline_s": 3600.0,
                   "trainer_io_s": 1800.0},
}
"""Defaults of the detector thresholds per ``DetectorSpec.profile``."""
_SCALED = DETECTOR_PROFILES["scaled"]


def _threshold(name: str, description: str, *, minimum: float = 0.0) -> object:
    prod = DETECTOR_PROFILES["production"][name]
    return Field(_SCALED[name], gt=minimum, le=MAX_THRESHOLD_S,
                 description=f"{description} Default: {_SCALED[name]:g} s (scaled) / {prod:g} s (production).")


class DetectorSpec(BaseModel):
    """Fault thresholds. ``profile`` picks the defaults of every threshold the spec does not set:
    ``scaled`` (the default: the reference job on a small machine) or ``production`` (the paper's
    values). A spec that sets one threshold keeps its profile's values for the others."""

    model_config = _STRICT
    profile: Literal["scaled", "production"] = Field("scaled", description=(
        "Where unset thresholds come from: scaled (seconds, for the reference job) or production "
        "(trainer idle 300 s, rollout idle 60 s, probe 10 s)."))
    trainer_idle_s: StrictFloat = _threshold("trainer_idle_s", "Training phase with no compute activity.")
    trainer_io_s: StrictFloat = _threshold("trainer_io_s", (
        "A trainer member in phase checkpointing or publishing for longer than this is a fault "
        "(hang, cause trainer_io_stalled): a snapshot or a publish that never returns while the "
        "member still reports. A backstop: keep it above the snapshot's own bounded waits (the "
        "previous upload, up to 300 s, whose rank 0 waits up to 120 s for the other ranks' "
        "shards), or a slow upload restarts a healthy gang. Rank 0 tries a weights publication "
        "JetStream does not store again until it is stored: an outage longer than this is reported "
        "here (at a gang's start, its start deadline reports it)."))
    rollout_idle_s: StrictFloat = _threshold("rollout_idle_s", "Zero token throughput with work queued.")
    silence_s: StrictFloat = _threshold("silence_s", "No metrics at all from a member.")
    probe_timeout_s: StrictFloat = _threshold("probe_timeout_s", "A heartbeat probe unanswered this long fails.")
    metrics_interval_s: StrictFloat = _threshold("metrics_interval_s", "How often members report metrics.",
                                                 minimum=0.01)
    weights_load_s: StrictFloat = _threshold("weights_load_s", (
        "A replica in phase loading_weights for longer than this is a fault (weights_load_timeout)."))
    # Deadlines the request manager enforces (DESIGN section 4, "every wait is bounded"); it also
    # bounds its wait for serving replicas to reach a step's weights version by weights_load_s.
    turn_deadline_s: StrictFloat = _threshold("turn_deadline_s", (
        "A dispatched turn with no reply after this is re-dispatched from its prefix to another replica."))
    step_deadline_s: StrictFloat = _threshold("step_deadline_s", (
        "A step not handed to the trainer after this is a fault naming what it still waits for."))
    commit_deadline_s: StrictFloat = _threshold("commit_deadline_s", (
        "A batch handed to the trainer with no step committed for this long (the trainer gang "
        "makes no progress while batches wait for it) is a fault of the gang (hang, cause "
        "commit_deadline), reported again each further period. Timed from the hand-over, the "
        "newest commit or the newest gang's hello, whichever is last; not while the job is paused "
        "or a gang is starting (the controller's start and recovery deadlines bound those)."))
    # Enforced by the controller: a start (spec fetched, model built, checkpoint loaded, gang formed)
    # is no phase the detector's rules judge, and a recovery's own deadline covers restarts only.
    start_deadline_s: StrictFloat = _threshold("start_deadline_s", (
        "A member started this long ago that has neither said hello nor reported a phase past "
        "starting (its start is stuck, though it may still send metrics) is a fault (hang). Not "
        "timed while a recovery runs (the recovery's deadline_s bounds the members it starts)."))

    @model_validator(mode="before")
    @classmethod
    def _profile_defaults(cls, raw: Any) -> Any:
        # Unset thresholds come from the named profile; an unknown profile fails on its field.
        if isinstance(raw, dict):
            profile = raw.get("profile", "scaled")
            if isinstance(profile, str) and profile in DETECTOR_PROFILES:
                return {**DETECTOR_PROFILES[profile], **raw}
        return raw

    @model_validator(mode="after")
    def _step_deadline_covers_its_parts(self) -> DetectorSpec:
        if self.step_deadline_s < max(self.turn_deadline_s, self.weights_load_s):
            raise ValueError("step_deadline_s must be >= turn_deadline_s and weights_load_s")
        return self

    @classmethod
    def reference(cls) -> DetectorSpec:
        """Scaled-down thresholds for the reference job on a 2-core machine (profile ``scaled``)."""
        return cls(profile="scaled")

    @classmethod
    def production(cls) -> DetectorSpec:
        """The paper's thresholds (profile ``production``)."""
        return cls(profile="production")


class WeightSyncSpec(BaseModel):
    model_config = _STRICT
    transport: Literal["tcp", "ucx"] = "tcp"
    chunk_bytes: StrictInt = Field(1 << 20, ge=1024, le=1 << 30)
    relays: StrictBool = True
    pull_timeout_s: StrictFloat = Field(30.0, gt=0.0, le=3600.0, description=(
        "Deadline of one pull attempt of a version by a replica; past it the attempt fails."))
    pull_attempts: StrictInt = Field(3, ge=1, le=100, description=(
        "Failed attempts (deadline passed, or checksum mismatch) at one version before the replica "
        "reports itself failed (phase weights_failed, which the detector turns into a fault)."))


class RecoverySpec(BaseModel):
    model_config = _STRICT
    policy: Literal["role_local", "whole_job"] = "role_local"
    deadline_s: StrictFloat = Field(120.0, gt=0.0, le=MAX_THRESHOLD_S, description="A local recovery slower than this escalates.")
    max_restarts: StrictInt = Field(20, ge=0, le=1000, description="Give up (job failed) after this many.")
    warm_spares: StrictInt = Field(0, ge=0, le=64, description=(
        "Member processes kept started ahead (imports done) while the job runs: a restart takes one "
        "instead of a cold start. Local and Ray launchers (a Ray spare is a pre-started actor); the "
        "Docker launcher and members placed on testbed hosts start cold. 0 = every restart is a cold start."))
    borrow: Literal["overlapped", "always", "never"] = Field("overlapped", description=(
        "Warm standby from the rollout pool: a trainer gang restart may take ready rollout replicas, "
        "which switch role in place (model built, weights in memory) and join the new gang. "
        "overlapped: in semi_sync/async only (sync has no spare rollout capacity); always: also in "
        "sync; never: no borrowing. Launchers that cannot switch a process in place start cold."))
    keep_survivors: StrictBool = Field(True, description=(
        "A trainer rank whose gang broke because another rank's process exited (crash) keeps its "
        "process: it leaves the broken gang, reloads the newest complete checkpoint and joins the "
        "new gang in place, so only the failed ranks take a spare, a borrowed replica or a cold "
        "start. Not after a hang, a slow or a silent rank (the rank reported may be a healthy one "
        "waiting on the faulty one). Local and Docker launchers; the Ray launcher replaces every rank."))
    survivor_wait_s: StrictFloat | StrictInt = Field(30.0, gt=0, le=600, description=(
        "How long a trainer rank whose gang broke under it (a collective with a lost rank failed) "
        "waits to be kept for the next gang before it exits (keep_survivors)."))
    warm_start_s: StrictFloat | StrictInt = Field(30.0, gt=0, le=600, description=(
        "A rank a trainer recovery started from a warm spare (imports done: it asks for the spec "
        "and sends metrics within a second of its order) from which the controller has heard "
        "nothing this long after its start failed that start: a fault of its own; the launcher's "
        "idle spares are replaced and the rank starts again (else only recovery.deadline_s bounded "
        "it, and the job was then restarted whole). Not borrowed replicas or kept ranks, which end "
        "a running role first."))
    min_replicas_kept: StrictInt = Field(1, ge=1, le=64, description=(
        "Replicas that keep generating during a trainer recovery: borrowing never leaves fewer."))
    standby_order: list[Literal["spare", "borrowed", "cold"]] = Field(
        default_factory=lambda: ["spare", "borrowed", "cold"], min_length=1, max_length=3, description=(
            "Where each rank of a new trainer gang comes from, first choice first: a warm spare "
            "process, a borrowed rollout replica, a cold start. Must name cold (always possible)."))

    @field_validator("standby_order")
    @classmethod
    def _standby_order_valid(cls, order: list[str]) -> list[str]:
        if len(set(order)) != len(order):
            raise ValueError("standby_order names a source twice")
        if "cold" not in order:
            raise ValueError("standby_order must include cold (the start that is always possible)")
        return order


MAX_RETENTION_S = 10 * 366 * 24 * 3600.0
"""Upper bound of ``RetentionSpec.delete_after_s`` (ten years): longer is keeping (null)."""


class RetentionSpec(BaseModel):
    """When the controller deletes the job after it ended (finished, failed or stopped), as
    ``DELETE /v1/jobs/{id}`` would. Kept by default: the auditor reads what a job left in Redis
    after it ended."""

    model_config = _STRICT
    delete_after_s: StrictFloat | None = Field(None, ge=0.0, le=MAX_RETENTION_S, description=(
        "Seconds after the job ended (its record's finished_at) at which the leading controller "
        "deletes it: its Redis keys and record. null: kept until DELETE /v1/jobs/{id}."))
    checkpoints: StrictBool = Field(False, description="That deletion also deletes the job's checkpoints.")
    events: StrictBool = Field(False, description=(
        "That deletion also deletes the job's event log (else the log is kept and ends with job_deleted)."))


class JobSpec(BaseModel):
    """Everything that defines one RL job. Submitted through ``POST /v1/jobs``."""

    model_config = _STRICT
    # The job id is the name plus 9 characters and must fit a 64-character subject token.
    name: str = Field("reference", min_length=1, max_length=55, pattern=r"^[A-Za-z0-9_-]+$")
    seed: StrictInt = Field(0, ge=0, le=2**31 - 1)
    steps: StrictInt = Field(30, ge=1, le=1_000_000)
    mode: Literal["sync", "semi_sync", "async"] = "sync"
    staleness: StrictInt = Field(0, ge=0, le=64, description="Max versions a turn may lag the trainer.")
    model: ModelSpec = Field(default_factory=ModelSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    tools: ToolSpec = Field(default_factory=ToolSpec)
    detector: DetectorSpec = Field(default_factory=DetectorSpec)
    weights: WeightSyncSpec = Field(default_factory=WeightSyncSpec)
    recovery: RecoverySpec = Field(default_factory=RecoverySpec)
    retention: RetentionSpec = Field(default_factory=RetentionSpec)

    @model_validator(mode="after")
    def _mode_matches_staleness(self, info: ValidationInfo) -> JobSpec:
        if self.mode == "sync" and self.staleness != 0:
            raise ValueError("staleness must be 0 in sync mode")
        if self.mode == "semi_sync" and self.staleness != 1:
            raise ValueError("staleness must be 1 in semi_sync mode")
        if self.mode == "async" and self.staleness < 1:
            raise ValueError("staleness must be >= 1 in async mode")
        saved = bool(info.context and info.context.get("saved"))  # (accepted before the rule: readable)
        if self.trainer.backend == "nccl" and self.model.device != "cuda" and not saved:
            # (before, accepted: every rank then failed its first collective, and the job restarted
            # until max_restarts)
            raise ValueError("trainer.backend nccl needs model.device cuda: NCCL moves GPU tensors only")
        return self

    @field_validator("trainer")
    @classmethod
    def _every_rank_has_episodes(cls, trainer: TrainerSpec, info: ValidationInfo) -> TrainerSpec:
        # Each rank trains its share of the step's episodes (one sample each): a rank with none
        # failed its every first step, and the job restarted until max_restarts.
        if info.context and info.context.get("saved"):
            return trainer  # (a job accepted before this rule: readable, not refused anew)
        data = info.data.get("data")
        episodes = data.prompts_per_step * data.group_size if isinstance(data, DataSpec) else None
        if episodes is not None and trainer.workers > episodes:
            raise ValueError(f"workers ({trainer.workers}) must be at most the episodes of a step, "
                             f"data.prompts_per_step x data.group_size ({episodes}): a rank with no "
                             "episode cannot train")
        return trainer

    def min_version(self, step: int) -> int:
        """The oldest weights version a turn of ``step`` may be made with (the staleness bound)."""
        return max(0, step - self.staleness)

    @classmethod
    def parse(cls, raw: Mapping[str, object], *, saved: bool = False) -> JobSpec:
        """Validate a raw mapping; raise ConfigError naming every bad field. ``saved``: the spec
        of a job accepted earlier (a job record), read back under the rules of its submission
        where a later rule would refuse it (the job would vanish from the controller's view)."""
        try:
            return cls.model_validate(raw, context={"saved": saved})
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in exc.errors()
            )
            first = ".".join(str(p) for p in exc.errors()[0]["loc"]) if exc.errors() else None
            raise ConfigError(f"invalid job spec: {problems}", field=first) from exc


REFERENCE_TOOL = {"latency_s": 3.0, "timeout_s": 10.0}


def reference_job(steps: int = 30, seed: int = 0, **overrides: object) -> JobSpec:
    """The reference job of DESIGN section 9: tiny model, scaled-down thresholds, and a tool
    call of 3 s (a sandbox or search call, scaled down like the thresholds), so that a step is
    mostly rollout and tool time as in agentic RL, not orchestration overhead. The tool wait
    is longer than ``rollout_idle_s`` on purpose: it is normal idleness the detector must
    accept."""
    raw: dict[str, object] = {"name": "reference", "steps": steps, "seed": seed, "tools": dict(REFERENCE_TOOL)}
    raw.update(overrides)
    return JobSpec.parse(raw)


class Settings(BaseModel):
    """Where the infrastructure is. Read once from an environment mapping."""

    model_config = ConfigDict(frozen=True)
    nats_url: str = "nats://127.0.0.1:4222"
    redis_url: str = "redis://127.0.0.1:6379/0"
    s3_endpoint: str = "127.0.0.1:9000"
    s3_access_key: str = ""
    s3_secret_key: str = ""
    s3_bucket: str = "robustrl"
    s3_secure: bool = False
    object_store_url: str = Field("", description="file:///path overrides S3 when set.")
    api_token: str = ""
    api_host: str = "127.0.0.1"
    api_port: int = 8321
    run_dir: str = "runs/default"
    bind_host: str = "127.0.0.1"
    weights_port: int = Field(0, ge=0, le=65535, description=(
        "Port of this member's weight server (trainer ranks and replicas serve chunks on it); 0 picks a "
        "free one. Fixed only where each member has an address of its own (a Kubernetes pod: the "
        "manifests set it, so a NetworkPolicy names one port); never passed on to launched members."))
    credentials_file: str = Field("", description="Per-role credentials (0600 JSON) of the embedded "
                                  "servers; only the operator's settings carry it (robustrl.infra.credentials).")

    _ENV: ClassVar[dict[str, str]] = {
        "nats_url": "ROBUSTRL_NATS_URL",
        "redis_url": "ROBUSTRL_REDIS_URL",
        "s3_endpoint": "ROBUSTRL_S3_ENDPOINT",
        "s3_access_key": "ROBUSTRL_S3_ACCESS_KEY",
        "s3_secret_key": "ROBUSTRL_S3_SECRET_KEY",
        "s3_bucket": "ROBUSTRL_S3_BUCKET",
        "s3_secure": "ROBUSTRL_S3_SECURE",
        "object_store_url": "ROBUSTRL_OBJECT_STORE_URL",
        "api_token": "ROBUSTRL_API_TOKEN",
        "api_host": "ROBUSTRL_API_HOST",
        "api_port": "ROBUSTRL_API_PORT",
        "run_dir": "ROBUSTRL_RUN_DIR",
        "bind_host": "ROBUSTRL_BIND_HOST",
        "weights_port": "ROBUSTRL_WEIGHTS_PORT",
        "credentials_file": "ROBUSTRL_CREDENTIALS_FILE",
    }
    _PER_MEMBER: ClassVar[frozenset[str]] = frozenset({"weights_port"})
    """Settings of one member's own (its pod's manifest sets them), not handed on by ``to_env``:
    members of one host sharing a fixed port would collide."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings:
        raw = {field: env[var] for field, var in cls._ENV.items() if var in env}
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            err = exc.errors()[0]
            field = str(err["loc"][0])
            raise ConfigError(f"bad setting {cls._ENV.get(field, field)}: {err['msg']}", field=field) from exc

    def to_env(self) -> dict[str, str]:
        """The inverse of from_env: what a launched member process receives."""
        out: dict[str, str] = {}
        for field, var in self._ENV.items():
            if field in self._PER_MEMBER:
                continue
            value = getattr(self, field)
            out[var] = str(value).lower() if isinstance(value, bool) else str(value)
        return out
