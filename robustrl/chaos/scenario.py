"""Chaos scenarios: which faults to inject, where and when, with seeded triggers (DESIGN section 7).

A scenario file is YAML::

    name: rollout-crash
    seed: 7
    policy: role_local          # optional: overrides the job's recovery policy
    job: {steps: 12}            # optional: job spec overrides
    faults:
      - {kind: crash, role: rollout, member: 1, at_step: 3}
      - {kind: hang, role: trainer, member: random, every: 5, start: 5, within_step: 0.5}
      - {kind: slow, role: rollout, member: all, at_step: 4, duration_s: 10, factor: 8}
      - {kind: tool_outage, role: request_manager, at_step: 6, duration_s: 5}
      - {kind: crash, role: controller, at_step: 7}               # control plane: crash | hang
      - {kind: hang, role: detector, at_step: 8, duration_s: 10}  # SIGSTOP, SIGCONT after 10 s
      - {kind: infra_restart, role: redis, at_step: 9}            # nats | redis | s3
      - {kind: partition, role: rollout, member: 1, at_step: 10, duration_s: 5}  # testbed only
      - {kind: partition, role: rollout, member: 0, at_step: 11, against: [h2]}  # between two hosts
      - {kind: net_drop, role: rollout, member: 0, at_step: 12, duration_s: 5}   # cut its host's link
      - {kind: crash, role: rollout, member: 0, at_step: 13, within_step: decoding}  # mid-decode
      - {kind: crash, role: rollout, member: 1, at_step: 14, moment: mid_tool_turn}  # see below

On a testbed (``robustrl.testbed``) ``net_drop`` and ``partition`` act on the member's host's
link with tc (``robustrl.chaos.network``): ``net_drop`` drops everything to and from the host,
``partition`` cuts it from the hosts in ``against`` (default: every other host and ``gw``, the
infra and control plane); ``duration_s`` > 0 heals it after that long. Without a testbed
``net_drop`` closes the member's NATS connection and ``partition`` is refused.

``member`` is a member index, ``random`` (one drawn from the seed) or ``all``; ``within_step``
is ``random`` (a moment drawn inside the step), a delay in seconds after the step starts, or
``decoding`` (rollout only): after a seeded random delay inside the step, the harness waits until
the target replica's metrics show a batch in flight (``inflight > 0``) and injects at once; if it
sees none within a bounded wait it injects anyway and its ack says ``trigger: timeout``. A crash
so timed is sent as ``moment: mid_batch``: the replica dies at the first token of the next batch
it decodes (a kill sent from outside landed after the batch had ended, under load: suite51).
``moment: mid_tool_turn`` (a rollout crash only) arms the replica when the fault fires: it dies at
the first token of its next turn after a tool result, a turn in flight with its episode's prefix
saved (a ``decoding`` crash may still find no such turn: a batch in flight is often first turns).
``moment: mid_batch`` (a rollout crash only) arms it to die at the first token of its next batch.
The same faults come from the builder: ``Faults().crash("rollout", member=1, at_step=3)``.
:func:`plan` expands a scenario into concrete faults, deterministically from the seed.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast, get_args

import yaml

from robustrl.config import JobSpec
from robustrl.errors import ConfigError, ScenarioError
from robustrl.messages import ChaosKind, ChaosMoment, ChaosRequest, ChaosRole

Policy = Literal["role_local", "whole_job"]
Member = int | Literal["random", "all"]

KINDS: tuple[str, ...] = get_args(ChaosKind)
ROLES: tuple[str, ...] = get_args(ChaosRole)
CONTROL_PLANE: tuple[str, ...] = ("controller", "detector", "request_manager")
INFRA: tuple[str, ...] = ("nats", "redis", "s3")
LOCAL_ROLES: tuple[str, ...] = ("controller", "detector", *INFRA)
"""Roles whose faults the controller cannot carry out (it would be killing itself, or it does not
own the process): the harness does, through the stack that started them."""
DEFAULT_HANG_S = 10.0
"""A control-plane hang without a duration: SIGSTOP, then SIGCONT after this long."""
# A fail-slow fault must be slower than the detector's peer threshold (a quarter of the median)
# to be detectable at all, so the default factor is well past it.
DEFAULT_SLOW_FACTOR = 8.0
DECODING = "decoding"
DECODING_ROLES: tuple[str, ...] = ("rollout",)
"""Roles whose members decode (the only targets of ``within_step: decoding``)."""
_FAULT_KEYS = {"kind", "role", "member", "at_step", "every", "start", "within_step", "duration_s", "factor",
               "against", "moment"}
HOST_RE = re.compile(r"h\d{1,3}|gw")
"""A testbed host name (``h0``...) or ``gw`` (the infra and control plane behind the gateway)."""
NETWORK_ROLES = ("trainer", "rollout")
TESTBED_KINDS = ("partition",)
"""Kinds that act on testbed links only (refused on a stack without a testbed)."""
_TOP_KEYS = {"name", "seed", "policy", "job", "faults"}


@dataclass(frozen=True)
class FaultSpec:
    """One scenario entry (validated)."""

    kind: str
    role: str
    member: Member = 0
    at_step: int | None = None
    every: int | None = None
    start: int = 0
    within_step: float | Literal["random", "decoding"] = "random"
    duration_s: float = 0.0
    factor: float = 1.0
    against: tuple[str, ...] = ()
    moment: str = "now"
    """``mid_tool_turn`` (a rollout crash): the replica is armed when the fault fires and dies at the
    first token of its next turn after a tool result (``messages.ChaosMoment``)."""

    def steps(self, steps: int) -> list[int]:
        """The steps (0-based, < ``steps``) at which this entry fires."""
        if self.at_step is not None:
            return [self.at_step] if self.at_step < steps else []
        assert self.every is not None
        return list(range(self.start, steps, self.every))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "role": self.role, "member": self.member}
        if self.at_step is not None:
            out["at_step"] = self.at_step
        else:
            out.update(every=self.every, start=self.start)
        out.update(within_step=self.within_step, duration_s=self.duration_s, factor=self.factor)
        if self.against:
            out["against"] = list(self.against)
        if self.moment != "now":
            out["moment"] = self.moment
        return out


@dataclass(frozen=True)
class Scenario:
    name: str = "adhoc"
    seed: int = 0
    policy: Policy | None = None
    job: Mapping[str, Any] = field(default_factory=dict)
    faults: tuple[FaultSpec, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "seed": self.seed}
        if self.policy is not None:
            out["policy"] = self.policy
        if self.job:
            out["job"] = dict(self.job)
        out["faults"] = [f.to_dict() for f in self.faults]
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


@dataclass(frozen=True)
class PlannedFault:
    """One concrete fault: fire ``delay_s`` after step ``step`` starts on ``role`` member
    ``member_index``."""

    step: int
    delay_s: float
    kind: str
    role: str
    member_index: int
    duration_s: float
    factor: float
    fault_id: str
    against: tuple[str, ...] = ()
    until: str | None = None
    """``decoding``: after ``delay_s``, wait until the member is seen decoding, then inject."""
    moment: str = "now"


# --- parsing ------------------------------------------------------------------------------


def load_scenario(source: str | Path) -> Scenario:
    """Load a scenario from a file path or from YAML text.

    Raises:
        ScenarioError: malformed YAML, unknown keys, kinds or roles, bad selectors; the
            message names the entry and field.
    """
    text = source.read_text() if isinstance(source, Path) else source
    if isinstance(source, str) and "\n" not in source and source.endswith((".yaml", ".yml")):
        try:
            text = Path(source).read_text()
        except OSError as exc:
            raise ScenarioError(f"cannot read scenario file {source}: {exc}", field="path") from exc
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ScenarioError(f"scenario is not valid YAML: {exc}", field="<root>") from exc
    return parse_scenario(raw)


def parse_scenario(raw: object) -> Scenario:
    """Validate an already-decoded scenario mapping (see :func:`load_scenario`)."""
    if not isinstance(raw, Mapping):
        raise ScenarioError("a scenario must be a mapping with a 'faults' list", field="<root>")
    unknown = set(raw) - _TOP_KEYS
    if unknown:
        raise ScenarioError(f"unknown scenario key(s): {', '.join(sorted(map(str, unknown)))}",
                            field=min(map(str, unknown)))
    name = raw.get("name", "adhoc")
    if not isinstance(name, str) or not name:
        raise ScenarioError("name must be a non-empty string", field="name")
    seed = raw.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ScenarioError(f"seed must be an integer >= 0, got {seed!r}", field="seed")
    policy = raw.get("policy")
    if policy is not None and policy not in get_args(Policy):
        raise ScenarioError(f"policy must be one of {get_args(Policy)}, got {policy!r}", field="policy")
    job = raw.get("job") or {}
    if not isinstance(job, Mapping):
        raise ScenarioError("job must be a mapping of job spec overrides", field="job")
    faults = raw.get("faults") or []
    if not isinstance(faults, list):
        raise ScenarioError("faults must be a list", field="faults")
    return Scenario(name=name, seed=seed, policy=cast(Policy | None, policy), job=dict(job),
                    faults=tuple(parse_fault(entry, i) for i, entry in enumerate(faults)))


def parse_fault(entry: object, index: int = 0) -> FaultSpec:
    """Validate one fault entry; errors name ``faults[index].field``."""

    def bad(fld: str, why: str) -> ScenarioError:
        return ScenarioError(f"faults[{index}].{fld}: {why}", field=f"faults[{index}].{fld}")

    if not isinstance(entry, Mapping):
        raise bad("<entry>", "each fault must be a mapping")
    unknown = set(entry) - _FAULT_KEYS
    if unknown:
        raise bad(min(map(str, unknown)), "unknown key")
    kind = entry.get("kind")
    if kind not in KINDS:
        raise bad("kind", f"must be one of {', '.join(KINDS)}, got {kind!r}")
    role = entry.get("role", "request_manager" if kind == "tool_outage" else None)
    if role not in ROLES:
        raise bad("role", f"must be one of {', '.join(ROLES)}, got {role!r}")
    problem = target_problem(kind, role)
    if problem:
        raise bad("role", problem)
    member = entry.get("member", 0)
    if not (member in ("random", "all") or (_is_int(member) and member >= 0)):
        raise bad("member", f"must be an index >= 0, 'random' or 'all', got {member!r}")
    at_step, every = entry.get("at_step"), entry.get("every")
    if (at_step is None) == (every is None):
        raise bad("at_step", "give exactly one of at_step or every")
    if at_step is not None and not (_is_int(at_step) and at_step >= 0):
        raise bad("at_step", f"must be an integer >= 0, got {at_step!r}")
    if every is not None and not (_is_int(every) and every >= 1):
        raise bad("every", f"must be an integer >= 1, got {every!r}")
    if "start" in entry and every is None:
        raise bad("start", "only meaningful with every")
    start = entry.get("start", every if every is not None else 0)
    if not (_is_int(start) and start >= 0):
        raise bad("start", f"must be an integer >= 0, got {start!r}")
    within = entry.get("within_step", "random")
    if not (within in ("random", DECODING) or (_is_number(within) and 0 <= within <= MAX_WITHIN_STEP_S)):
        raise bad("within_step", f"must be 'random', 'decoding' or seconds in [0, {MAX_WITHIN_STEP_S:g}], "
                                 f"got {within!r}")
    if within == DECODING and role not in DECODING_ROLES:
        raise bad("within_step", f"'decoding' waits for a member to decode: only {', '.join(DECODING_ROLES)} "
                                 f"members decode, not {role}")
    duration = entry.get("duration_s", DEFAULT_HANG_S if kind == "hang" and role in CONTROL_PLANE else 0.0)
    if not (_is_number(duration) and 0 <= duration <= MAX_DURATION_S):
        raise bad("duration_s", f"must be seconds in [0, {MAX_DURATION_S:g}], got {duration!r}")
    if kind == "tool_outage" and duration <= 0:
        raise bad("duration_s", "a tool outage needs a duration > 0 (the job cannot finish otherwise)")
    factor = entry.get("factor", DEFAULT_SLOW_FACTOR if kind == "slow" else 1.0)
    if not (_is_number(factor) and 1.0 <= factor <= MAX_FACTOR):
        raise bad("factor", f"must be a number in [1, {MAX_FACTOR:g}], got {factor!r}")
    if kind == "slow" and factor <= 1.0:
        raise bad("factor", "a slow fault needs a factor > 1")
    against = entry.get("against", [])
    if against and kind != "partition":
        raise bad("against", "only a partition has a group to be cut from")
    if not isinstance(against, list) or not all(isinstance(h, str) and HOST_RE.fullmatch(h) for h in against):
        raise bad("against", f"must be a list of testbed host names like h1, or gw, got {against!r}")
    moment = entry.get("moment", "now")
    if moment not in get_args(ChaosMoment):
        raise bad("moment", f"must be one of {', '.join(get_args(ChaosMoment))}, got {moment!r}")
    problem = moment_problem(kind, role, moment)
    if problem:
        raise bad("moment", problem)
    return FaultSpec(kind=kind, role=role, member=member, at_step=at_step, every=every, start=start,
                     within_step=within if within in ("random", DECODING) else float(within),
                     duration_s=float(duration), factor=float(factor), against=tuple(against), moment=moment)


def target_problem(kind: str, role: str) -> str | None:
    """Why ``kind`` cannot be injected on ``role`` (None if it can). Shared by the scenario
    format and the REST API so both accept the same faults."""
    if kind == "infra_restart" and role not in INFRA:
        return f"infra_restart restarts an infra server: role must be one of {', '.join(INFRA)}"
    if role in INFRA and kind != "infra_restart":
        return f"the only fault of the {role} server is infra_restart"
    if kind == "tool_outage" and role != "request_manager":
        return "a tool outage happens in the request manager's tools"
    if kind == "partition" and role not in NETWORK_ROLES:
        return f"a partition cuts a member's host: role must be one of {', '.join(NETWORK_ROLES)}"
    if role in CONTROL_PLANE and kind not in ("crash", "hang") and not (
            role == "request_manager" and kind == "tool_outage"):
        return f"a {role} fault is crash or hang (the process), not {kind}"
    return None


def moment_problem(kind: str, role: str, moment: str) -> str | None:
    """Why a fault cannot be carried out at ``moment`` (``ChaosMoment``; None if it can)."""
    if moment != "now" and (kind != "crash" or role != "rollout"):
        return f"moment {moment} is for a rollout crash only, not {kind} of {role}"
    return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A finite number (``.inf`` in YAML is a float too: a wait that never ends)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _field_max(name: str) -> float:
    """The upper bound ``ChaosRequest`` puts on a field: a scenario accepts what injection accepts."""
    return next(m.le for m in ChaosRequest.model_fields[name].metadata if getattr(m, "le", None) is not None)


MAX_DURATION_S = _field_max("duration_s")
MAX_FACTOR = _field_max("factor")
MAX_WITHIN_STEP_S = 3600.0
"""A fault's delay into its step: longer is no moment of the step."""


def fault_id_part(name: str) -> str:
    """The scenario's name as it may appear in a fault id (``[A-Za-z0-9_-]``, 40 characters:
    the step and member suffix keeps the id within the bus's 64)."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", name)[:40] or "scenario"


# --- planning -----------------------------------------------------------------------------


def members_of(scenario: Scenario) -> dict[str, int]:
    """Member counts per role of the job the scenario runs (its overrides on the defaults)."""
    try:
        spec = JobSpec.parse(dict(scenario.job))
    except ConfigError as exc:
        raise ScenarioError(f"job overrides: {exc.message}", field=f"job.{exc.fields.get('field')}") from exc
    return {"trainer": spec.trainer.workers, "rollout": spec.rollout.replicas,
            **{role: 1 for role in (*CONTROL_PLANE, *INFRA)}}


def plan(scenario: Scenario, steps: int, *, step_time_s: float = 1.0,
         members: Mapping[str, int] | None = None) -> list[PlannedFault]:
    """Expand a scenario into concrete faults, deterministic from ``scenario.seed``.

    Args:
        scenario: the validated scenario.
        steps: how many steps the job runs (entries past the end are dropped).
        step_time_s: typical step duration; ``within_step: random`` and ``decoding`` draw a
            delay in ``[0, step_time_s)`` (``decoding`` then waits for the member to decode).
            With the default 1.0 the delay is a fraction of a step.
        members: member count per role; default from the scenario's job overrides.

    Returns:
        Faults sorted by (step, delay_s).
    """
    counts = dict(members) if members is not None else members_of(scenario)
    rng = random.Random(scenario.seed)
    out: list[PlannedFault] = []
    for i, f in enumerate(scenario.faults):
        count = counts.get(f.role, 0)
        if count <= 0:
            raise ScenarioError(f"faults[{i}].role: the job has no {f.role} member",
                                field=f"faults[{i}].role")
        for step in f.steps(steps):
            if f.member == "all":
                targets = list(range(count))
            elif f.member == "random":
                targets = [rng.randrange(count)]
            else:
                if f.member >= count:
                    raise ScenarioError(f"faults[{i}].member: index {f.member} but the job has {count} "
                                        f"{f.role} member(s)", field=f"faults[{i}].member")
                targets = [int(f.member)]
            delay = (rng.random() * step_time_s if f.within_step in ("random", DECODING)
                     else float(f.within_step))
            for member in targets:
                out.append(PlannedFault(step=step, delay_s=delay, kind=f.kind, role=f.role,
                                        member_index=member, duration_s=f.duration_s, factor=f.factor,
                                        fault_id=f"{fault_id_part(scenario.name)}-{i}-s{step}-m{member}", against=f.against,
                                        until=DECODING if f.within_step == DECODING else None,
                                        moment=f.moment))
    out.sort(key=lambda p: (p.step, p.delay_s, p.fault_id))
    return out


# --- builder ------------------------------------------------------------------------------


class Faults:
    """Fluent scenario builder: ``Faults(seed=3).crash("rollout", member=1, at_step=3).build()``.

    Every method validates its entry exactly as a scenario file would.
    """

    def __init__(self, name: str = "adhoc", seed: int = 0) -> None:
        self._name, self._seed = name, seed
        self._policy: Policy | None = None
        self._job: dict[str, Any] = {}
        self._faults: list[FaultSpec] = []

    def add(self, kind: str, role: str, **fields: Any) -> Faults:
        entry = {"kind": kind, "role": role, **{k: v for k, v in fields.items() if v is not None}}
        self._faults.append(parse_fault(entry, len(self._faults)))
        return self

    def crash(self, role: str, **fields: Any) -> Faults:
        return self.add("crash", role, **fields)

    def hang(self, role: str, **fields: Any) -> Faults:
        return self.add("hang", role, **fields)

    def stall(self, role: str, **fields: Any) -> Faults:
        return self.add("stall", role, **fields)

    def slow(self, role: str, **fields: Any) -> Faults:
        return self.add("slow", role, **fields)

    def net_drop(self, role: str, **fields: Any) -> Faults:
        return self.add("net_drop", role, **fields)

    def partition(self, role: str, **fields: Any) -> Faults:
        """Cut a member's host from ``against`` (default: every other host and the infra); testbed only."""
        return self.add("partition", role, **fields)

    def infra_restart(self, server: str, **fields: Any) -> Faults:
        """Restart an infra server (``nats | redis | s3``) on its port and data dir."""
        return self.add("infra_restart", server, **fields)

    def tool_outage(self, **fields: Any) -> Faults:
        return self.add("tool_outage", "request_manager", **fields)

    def policy(self, policy: Policy) -> Faults:
        self._policy = policy
        return self

    def job(self, **overrides: Any) -> Faults:
        self._job.update(overrides)
        return self

    def build(self) -> Scenario:
        return parse_scenario({"name": self._name, "seed": self._seed, "policy": self._policy,
                               "job": self._job, "faults": [f.to_dict() for f in self._faults]})
