"""The randomized fault campaign's plan: which faults, on whom, triggered by what (pure, seeded).

Faults are drawn over every (kind, role) pair the scenario format accepts, so kinds and roles
added there join the campaign without a change here. Each fault gets a trigger:

* ``time``: a random moment inside a random step;
* ``phase:<phase>``: the moment a member of the role enters that phase (trainer
  ``checkpointing`` / ``publishing``: checkpoint upload and weight publish; rollout
  ``loading_weights``: weight pull);
* ``batch_handoff``: the moment a batch is handed to the trainer (``batch_ready``);
* ``recovery``: while a recovery is in progress (after a decision, before ``recovered``).

Steps are stratified over the job (fault i lands in the i-th slice of steps, at a random step of
it), so faults spread over the whole run instead of clustering.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

from robustrl.chaos import scenario
from robustrl.errors import ScenarioError

PHASE_TRIGGERS: dict[str, tuple[str, ...]] = {
    "trainer": ("phase:checkpointing", "phase:publishing", "batch_handoff", "recovery"),
    "rollout": ("phase:loading_weights", "recovery"),
}
"""Triggers other than ``time`` that make sense per role; any other role gets ``recovery``."""
TIME_SHARE = 0.4
"""Share of faults on plain random moments; the rest go to phase / hand-off / recovery triggers."""
DURATIONS_S: dict[str, tuple[float, float]] = {"stall": (2.0, 10.0), "slow": (3.0, 10.0),
                                               "tool_outage": (2.0, 6.0)}
"""Timed kinds and the range their duration is drawn from (others last until recovered)."""
CONTROL_PLANE_HANG_S = (3.0, 10.0)
SLOW_FACTOR = 8.0


@dataclass(frozen=True)
class CampaignFault:
    fault_id: str
    kind: str
    role: str
    member: int
    trigger: str
    step: int
    """Earliest step at which the trigger is armed."""
    delay_s: float
    """After the step starts (``time``) or after the trigger fires (others)."""
    duration_s: float
    factor: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def catalog(exclude: tuple[str, ...] = (), testbed: bool = False) -> list[tuple[str, str]]:
    """Every (kind, role) pair the scenario format accepts, minus ``exclude`` ("kind/role" or "kind");
    the kinds that need a testbed (``partition``) only with ``testbed``."""
    pairs = []
    for kind in scenario.KINDS:
        if kind in scenario.TESTBED_KINDS and not testbed:
            continue
        for role in scenario.ROLES:
            if kind in exclude or f"{kind}/{role}" in exclude:
                continue
            entry: dict[str, Any] = {"kind": kind, "role": role, "at_step": 1}
            if kind in DURATIONS_S:
                entry["duration_s"] = 1.0
            try:
                scenario.parse_fault(entry)
            except ScenarioError:
                continue
            pairs.append((kind, role))
    return pairs


def draw(steps: int, faults: int, seed: int, members: dict[str, int], *,
         exclude: tuple[str, ...] = (), step_time_s: float = 2.0, name: str = "campaign") -> list[CampaignFault]:
    """Draw ``faults`` faults over steps ``1..steps-3`` (step 0 is start-up: a fault there restarts
    the whole job by design; the last two steps may end before a trigger comes), covering every pair of :func:`catalog` before repeating one."""
    if steps < 3:
        raise ScenarioError("a campaign needs at least 3 steps", field="steps")
    rng = random.Random(seed)
    pairs = [p for p in catalog(exclude) if members.get(p[1], 1) > 0]
    if not pairs:
        raise ScenarioError("no fault kind/role left to draw from", field="exclude")
    order: list[tuple[str, str]] = []
    while len(order) < faults:
        batch = list(pairs)
        rng.shuffle(batch)
        order.extend(batch)
    order = order[:faults]
    # Steps 1..steps-3: a fault drawn in the job's last step or two can find the job finished before
    # its trigger comes (seen: a stall drawn at step 59 of 60 fired after the job ended).
    span = steps - 1 if steps < 6 else steps - 3
    out = []
    for i, (kind, role) in enumerate(order):
        lo = 1 + (i * span) // faults
        hi = max(lo, 1 + ((i + 1) * span) // faults - 1)
        step = min(span, rng.randint(lo, hi))
        triggers = PHASE_TRIGGERS.get(role, ("recovery",))
        trigger = "time" if rng.random() < TIME_SHARE else rng.choice(triggers)
        delay = rng.random() * step_time_s if trigger == "time" else rng.random() * 0.3
        if trigger == "recovery":
            delay = 0.2 + rng.random() * 1.5
        lo_d, hi_d = DURATIONS_S.get(kind, (0.0, 0.0))
        if kind == "hang" and role in scenario.CONTROL_PLANE:
            lo_d, hi_d = CONTROL_PLANE_HANG_S  # a control-plane hang is SIGSTOP, then SIGCONT
        out.append(CampaignFault(
            fault_id=f"{name}-{i:03d}-{kind}-{role}".replace("_", "-")[:64], kind=kind, role=role,
            member=rng.randrange(max(1, members.get(role, 1))), trigger=trigger, step=step, delay_s=round(delay, 3),
            duration_s=round(lo_d + rng.random() * (hi_d - lo_d), 2) if hi_d else 0.0,
            factor=SLOW_FACTOR if kind == "slow" else 1.0))
    return out
