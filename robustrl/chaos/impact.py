"""What one injected fault cost the job, from its event log alone.

Used by ``bench/control_plane.py`` and the control-plane fault tests. For a fault injected at
``ts`` and the window up to the next fault (or the end of the log):

* ``members_restarted``: trainer / rollout members started in the window (``member_started``);
  a control-plane or infra fault handled in place costs none.
* ``steps_redone``: steps committed in the window that had already been committed before (a
  redone step is trained twice: once before the fault, once after).
* ``tokens_regenerated``: tokens of turns generated again (``turn_regenerated``) in the window;
  when none are logged, the ``work_lost`` estimates there.
* ``stall_s``: the time the fault cost the job's progress: how much longer than the median step
  without a fault the steps that commit in the window took, summed (a fault's cost can land on
  the step after the one it hit, e.g. a request manager killed once that step's batch was handed
  to the trainer costs the next step's generation). A step's time runs from the previous step's
  commit (its own start for the first step) to its commit, so a stop between two steps counts
  too (a request manager frozen after one commit delays the next step's start, not its duration).
* ``faulted_step_s``: how long the first step to commit after the fault took.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from robustrl.messages import Event

MEMBER_ROLES = ("trainer", "rollout")


@dataclass(frozen=True)
class FaultImpact:
    """One fault's cost (see the module doc)."""

    role: str
    kind: str
    fault_id: str
    step: int
    job_completed: bool
    members_restarted: int
    steps_redone: int
    tokens_regenerated: int
    stall_s: float | None
    faulted_step_s: float | None
    clean_step_s: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _steps(events: Sequence[Event]) -> tuple[dict[int, float], dict[int, float]]:
    """When each step's time began (the previous step's first commit, else its own first start)
    and its first commit."""
    started: dict[int, float] = {}
    committed: dict[int, float] = {}
    for e in events:
        if e.kind == "step_started":
            started.setdefault(int(e.data["step"]), e.ts)
        elif e.kind == "step_committed":
            committed.setdefault(int(e.data["step"]), e.ts)
    began = {}
    for k, ts in committed.items():
        if k - 1 in committed and committed[k - 1] <= ts:
            began[k] = committed[k - 1]
        elif k in started:
            began[k] = started[k]
    return began, committed


def _overlaps(a0: float, a1: float, windows: Sequence[tuple[float, float]]) -> bool:
    return any(a0 < w1 and w0 < a1 for w0, w1 in windows)


def impacts(events: Sequence[Event], settle_s: float = 0.0) -> list[FaultImpact]:
    """One :class:`FaultImpact` per ``fault_injected`` in the log, in injection order.

    Args:
        events: the job's whole log.
        settle_s: how long after a fault (beyond its own ``duration_s``) steps still count as
            disturbed when choosing the clean steps for the median.
    """
    ordered = sorted(events, key=lambda e: e.ts)
    faults = [e for e in ordered if e.kind == "fault_injected"]
    finished = any(e.kind == "job_finished" for e in ordered)
    began, committed = _steps(ordered)
    end = ordered[-1].ts if ordered else 0.0
    disturbed = [(f.ts, f.ts + float(f.data.get("duration_s") or 0.0) + settle_s) for f in faults]
    # A step is clean when no fault happened between its start and its commit.
    clean = [committed[k] - began[k] for k in committed if k in began
             and not _overlaps(began[k], committed[k], disturbed)]
    clean_s = statistics.median(clean) if clean else None
    out = []
    for i, f in enumerate(faults):
        t0 = f.ts
        t1 = faults[i + 1].ts if i + 1 < len(faults) else end + 1.0
        window = [e for e in ordered if t0 <= e.ts < t1]
        members = sum(1 for e in window if e.kind == "member_started" and e.data.get("role") in MEMBER_ROLES)
        seen_before = {int(e.data["step"]) for e in ordered if e.kind == "step_committed" and e.ts < t0}
        redone = sum(1 for e in window if e.kind == "step_committed" and int(e.data["step"]) in seen_before)
        regenerated = [int(e.data.get("tokens") or 0) for e in window if e.kind == "turn_regenerated"]
        if not regenerated:
            regenerated = [int(e.data.get("tokens") or 0) for e in window if e.kind == "work_lost"]
        after = sorted((ts, k) for k, ts in committed.items() if ts > t0)
        step_s = stall = None
        step = int(f.data.get("step", -1))
        if after:
            step = after[0][1]
            if step in began:
                step_s = after[0][0] - began[step]
            if clean_s is not None:
                stall = sum(max(0.0, ts - began[k] - clean_s) for ts, k in after if ts < t1 and k in began)
        out.append(FaultImpact(
            role=str(f.data.get("role")), kind=str(f.data.get("kind")), fault_id=str(f.data.get("fault_id")),
            step=step, job_completed=finished, members_restarted=members, steps_redone=redone,
            tokens_regenerated=sum(regenerated), stall_s=None if stall is None else round(stall, 3),
            faulted_step_s=None if step_s is None else round(step_s, 3),
            clean_step_s=None if clean_s is None else round(clean_s, 3)))
    return out
