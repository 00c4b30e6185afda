"""Job accounting from the event log alone: detection delay, recovery time, lost work, ETTR.

Event data contracts (the services emit exactly these; ``Event.ts`` is when it happened):

* ``job_started {}``
* ``step_started {step, epoch}`` — a step (re)starts; a redone step starts again.
* ``step_committed {step, epoch, weights_version}``
* ``fault_injected {fault_id, kind, role, member_id, step}`` (+ optional ``duration_s``) — chaos
  harness; ``fault_id`` is the harness's id.
* ``fault_detected {fault_id, kind, role, member_id, step, detected_at, evidence}`` — detector;
  ``fault_id`` is the detector's id, used by every later event about this fault.
* ``decision {fault_id, actions: [str], reason}`` — controller.
* ``recovered {fault_id, role}`` — ts = recovery done (trainer back in training / replacement
  replica serving / whole job running again).
* ``work_lost {fault_id, tokens, steps_redone}`` — tokens regenerated and steps redone.
* ``turn_regenerated {fault_id, tokens, cause, episode_id}`` — request manager: a turn generated
  again after a fault, with the tokens it really took (measured, not turns x max_new_tokens).
* ``fault_struck {fault_id, member_id, moment}`` — a rollout replica, as an armed crash
  (``moment`` other than now) strikes; ``fault_id`` is the injection's.
* ``job_finished {}``

The typed fields above are checked by ``robustrl.messages.EVENT_DATA`` where an event is written
and again here: an entry that does not validate is skipped and counted, never fatal.

An injected fault is matched to the first unclaimed detection of the same member at or after
its injection; failing that, of the same role (a hung trainer worker may be noticed on a peer
of its gang first). A fault is *open* from its injection (or detection, when not injected) until
its ``recovered`` event, or else ``duration_s`` after injection for a timed fault (a tool outage),
or else the end of the job. An armed crash opens when it struck (``fault_struck``), and its
detection delay runs from there; one with no ``fault_struck`` in the log is reported with
``struck_s`` None (it never struck, or its member died before saying so) and, if nothing
detected it either, is not counted as open.

ETTR = effective training time / wall time. Wall time is ``completion_s`` (first step_started ->
job_finished). Effective time sums, over committed steps, ``min(duration, median clean step
duration)``: a step's duration runs from its last ``step_started`` to its ``step_committed``,
and a step is clean when no fault was open during it, so a faulted step counts only what a
clean step costs.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from robustrl.messages import CHAOS_UNTIMED_S, Event, usable_event

CLOCK_SKEW_S = 0.5
"""How far two hosts' clocks may disagree: a strike (stamped by its replica) stamped up to this
long before its arming (stamped by the controller) is still its, and an armed crash's detection
(stamped by the detector) is looked for from this long before its strike."""


@dataclass(frozen=True)
class FaultAccount:
    """One fault as the harness saw it. ``detection_s``/``recovery_s`` are None if never."""

    kind: str
    role: str
    detection_s: float | None
    recovery_s: float | None
    tokens_regenerated: int
    steps_redone: int
    member_id: str = ""
    fault_id: str = ""
    injected: bool = True
    turns_redispatched: int = 0
    """Turns in flight on the failed member that the request manager sent elsewhere (work_lost)."""
    turns_regenerated: int = 0
    """Turns actually generated again because of this fault (turn_regenerated events)."""
    episodes_regenerated: int = 0
    """Distinct episodes those turns belong to (<= one turn each: only the lost turn is redone)."""
    moment: str = "now"
    """When an injected crash was to strike: ``now``, or armed (``mid_batch``, ``mid_tool_turn``)."""
    struck_s: float | None = None
    """An armed fault: seconds from its arming to its strike (``fault_struck``); None if the log
    holds no strike (never struck: no batch reached the replica while armed; or its replica died
    before the strike was saved) or it was not armed."""
    ignored: bool = False
    """A report nobody injected that the controller only ever decided to ignore (opens no interval)."""
    detected: bool = False
    """A detection was matched to it (``detection_s`` may still be None: an armed crash whose strike
    the log does not hold has no start to time it from)."""


@dataclass(frozen=True)
class JobReport:
    ettr: float
    completion_s: float
    steps: int
    faults: list[FaultAccount] = field(default_factory=list)
    events_skipped: int = 0
    """Log entries left out because they could not be parsed or validated."""

    def to_dict(self) -> dict[str, Any]:
        return {"ettr": self.ettr, "completion_s": self.completion_s, "steps": self.steps,
                "faults": [asdict(f) for f in self.faults], "events_skipped": self.events_skipped}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


@dataclass
class _Fault:
    injected: Event | None
    detected: Event | None
    recovered: Event | None = None
    struck: Event | None = None
    decisions: list[list[str]] = field(default_factory=list)
    tokens: int = 0
    steps_redone: int = 0
    turns: int = 0
    regenerated: int = 0
    episodes: set[str] = field(default_factory=set)


def account(events: Iterable[Event], skipped: int | None = None) -> JobReport:
    """Compute the job report from its event log (any order; sorted by ts here).

    An event that does not validate (wrong inner types, a non-finite time) is skipped and counted
    in ``events_skipped``, together with ``skipped`` (envelopes the reader could not parse; taken
    from an ``EventLog``'s own count when not given).
    """
    if skipped is None:
        skipped = getattr(events, "skipped", 0)
    log: list[Event] = []
    for e in events:
        if usable_event(e):
            log.append(e)
        else:
            skipped += 1
    log.sort(key=lambda e: e.ts)
    if not log:
        return JobReport(ettr=0.0, completion_s=0.0, steps=0, events_skipped=skipped)
    starts = [e for e in log if e.kind == "step_started"]
    finished = next((e for e in log if e.kind == "job_finished"), None)
    t0 = starts[0].ts if starts else log[0].ts
    t_end = finished.ts if finished is not None else log[-1].ts
    completion = max(0.0, t_end - t0)

    faults = _match_faults(log)
    # An armed fault with neither a strike nor a detection never struck (no turn it waited for
    # reached the replica); one that struck is open until recovered, detected or not.
    intervals = [_open_interval(f, t_end) for f in faults
                 if not (_armed(f) and f.detected is None and f.struck is None) and not _ignored(f)]
    durations = _step_durations(log)
    clean = [d for (s, e, d) in durations.values() if not _overlaps(s, e, intervals)]
    reference = statistics.median(clean) if clean else min((d for _, _, d in durations.values()), default=0.0)
    effective = sum(min(d, reference) for _, _, d in durations.values())
    ettr = effective / completion if completion > 0 else 0.0
    return JobReport(ettr=min(1.0, ettr), completion_s=completion, steps=len(durations),
                     faults=[_account_one(f) for f in faults], events_skipped=skipped)


def _step_durations(log: list[Event]) -> dict[int, tuple[float, float, float]]:
    """step -> (start, end, duration) of its final commit, from its last start before it."""
    last_start: dict[int, float] = {}
    out: dict[int, tuple[float, float, float]] = {}
    for e in log:
        step = e.data.get("step")
        if not isinstance(step, int):
            continue
        if e.kind == "step_started":
            last_start[step] = e.ts
        elif e.kind == "step_committed" and step in last_start:
            start = last_start[step]
            out[step] = (start, e.ts, max(0.0, e.ts - start))
    return out


def _window(inj: Event) -> float:
    """An armed injection's arming window (its ``duration_s``; 0 meaning ``CHAOS_UNTIMED_S``)."""
    return float(inj.data.get("duration_s") or 0.0) or CHAOS_UNTIMED_S


def _strikes(log: list[Event], armings: list[Event]) -> dict[int, Event]:
    """id(arming) -> its strike: each ``fault_struck`` goes to the latest arming of its fault id and
    member at or before it (within ``CLOCK_SKEW_S``: the two stamps are two hosts' clocks) whose
    window it falls in: an injection logged and then retried under its id gets it once, on the
    retry; an entry appended twice is one strike, its first."""
    out: dict[int, Event] = {}
    for s in (e for e in log if e.kind == "fault_struck"):
        key = (str(s.data.get("fault_id")), str(s.data.get("member_id")))
        fits = [a for a in armings if (str(a.data.get("fault_id")), str(a.data.get("member_id"))) == key
                and a.ts - CLOCK_SKEW_S <= s.ts <= a.ts + _window(a) + CLOCK_SKEW_S]
        if fits:
            out.setdefault(id(max(fits, key=lambda a: a.ts)), s)
    return out


def _match_faults(log: list[Event]) -> list[_Fault]:
    detections = [e for e in log if e.kind == "fault_detected"]
    injections = [e for e in log if e.kind == "fault_injected"]
    struck = _strikes(log, [e for e in injections if _is_arming(e)])
    claimed: set[int] = set()
    faults: list[_Fault] = []
    matched: dict[int, Event | None] = {}
    # Armed crashes that struck first: each takes its own member's first detection from its strike
    # on (however late; a detection of that member before the strike, a false positive of a stall
    # say, is not this crash's), so an arming that never struck cannot take it by member and window.
    for inj in injections:
        s = struck.get(id(inj))
        if s is not None:
            matched[id(inj)] = match = _first(detections, claimed, inj, same_member=True, since=s.ts - CLOCK_SKEW_S)
            if match is not None:
                claimed.add(id(match))
    for inj in injections:
        if id(inj) in matched:
            match = matched[id(inj)]
        elif _is_arming(inj):
            # Armed, no strike logged (never struck, or its member died before saying so): its own
            # member's detection within its arming window; another member's is that member's fault.
            match = _first(detections, claimed, inj, same_member=True, until=inj.ts + _window(inj))
        else:
            match = _first(detections, claimed, inj, same_member=True) or _first(detections, claimed, inj,
                                                                                same_member=False)
        if match is not None:
            claimed.add(id(match))
        faults.append(_Fault(injected=inj, detected=match, struck=struck.get(id(inj))))
    # Detections that match no injection: natural faults, or false positives worth seeing.
    faults.extend(_Fault(injected=None, detected=d) for d in detections if id(d) not in claimed)
    by_id = {str(f.detected.data.get("fault_id")): f for f in faults if f.detected is not None}
    for e in log:
        f = by_id.get(str(e.data.get("fault_id")))
        if f is None:
            continue
        if e.kind == "recovered" and f.recovered is None:
            f.recovered = e
        elif e.kind == "decision":
            actions = e.data.get("actions")
            f.decisions.append([str(a) for a in actions] if isinstance(actions, list) else [])
        elif e.kind == "work_lost":
            f.tokens += int(e.data.get("tokens", 0) or 0)
            f.steps_redone += int(e.data.get("steps_redone", 0) or 0)
            f.turns += int(e.data.get("turns", 0) or 0)
        elif e.kind == "turn_regenerated":
            f.tokens += int(e.data.get("tokens", 0) or 0)
            f.regenerated += 1
            f.episodes.add(str(e.data.get("episode_id", "")))
    faults.sort(key=lambda f: (f.injected or f.detected).ts)  # type: ignore[union-attr]
    return faults


def _first(detections: list[Event], claimed: set[int], inj: Event, *, same_member: bool,
           until: float = float("inf"), since: float | None = None) -> Event | None:
    for d in detections:
        if id(d) in claimed or d.ts < (inj.ts if since is None else since):
            continue
        if d.ts > until:
            return None
        if same_member and d.data.get("member_id") == inj.data.get("member_id"):
            return d
        if not same_member and d.data.get("role") == inj.data.get("role"):
            return d
    return None


def _is_arming(inj: Event) -> bool:
    """An injection armed (``moment`` other than now): it strikes later, at a moment of its own."""
    return inj.data.get("moment", "now") != "now"


def _ignored(f: _Fault) -> bool:
    """A report nobody injected that the controller only ever ignored (``decision`` Ignore: about a
    member already being replaced or of a past incarnation, e.g. a crashed replica's turns timing
    out during the whole-job restart its crash set off): no fault of its own, so it opens no
    interval (it did, to the job's end, having no recovery). Still listed, as ``ignored``."""
    return f.injected is None and bool(f.decisions) and all(d == ["Ignore"] for d in f.decisions)


def _armed(f: _Fault) -> bool:
    return f.injected is not None and _is_arming(f.injected)


def _began(f: _Fault) -> Event | None:
    """The event that opens the fault: its injection; for an armed fault, its strike, else (its
    member died before saying so) its detection; for one nobody injected, its detection."""
    if _armed(f):
        return f.struck or f.detected or f.injected
    return f.detected if f.injected is None else f.injected


def _open_interval(f: _Fault, t_end: float) -> tuple[float, float]:
    first = _began(f)
    assert first is not None
    if f.recovered is not None:
        return first.ts, f.recovered.ts
    # A timed fault (tool outage, hang for N s) ends by itself when nothing had to recover it (an
    # armed crash's duration_s is its arming window, not a length).
    duration = (float(f.injected.data.get("duration_s") or 0.0)
                if f.injected is not None and f.injected.data.get("kind") != "crash" else 0.0)
    return first.ts, (first.ts + duration if duration > 0 else t_end)


def _overlaps(start: float, end: float, intervals: list[tuple[float, float]]) -> bool:
    return any(s < end and e > start for s, e in intervals)


def _account_one(f: _Fault) -> FaultAccount:
    src = f.injected or f.detected
    assert src is not None
    # an armed fault is detected after it struck: with no strike in the log, the delay is not known
    # (at least 0: a strike and its detection, or an arming and its strike, are stamped by two
    # hosts' clocks, within CLOCK_SKEW_S of each other)
    start = f.struck if _armed(f) else f.injected
    detection = max(0.0, f.detected.ts - start.ts) if start is not None and f.detected is not None else None
    struck_s = max(0.0, f.struck.ts - f.injected.ts) if f.struck is not None and f.injected is not None else None
    recovery = f.recovered.ts - f.detected.ts if f.recovered is not None and f.detected is not None else None
    return FaultAccount(kind=str(src.data.get("kind", "?")), role=str(src.data.get("role", "?")),
                        detection_s=detection, recovery_s=recovery, tokens_regenerated=f.tokens,
                        steps_redone=f.steps_redone, member_id=str(src.data.get("member_id", "")),
                        fault_id=str(src.data.get("fault_id", "")), injected=f.injected is not None,
                        turns_redispatched=f.turns, turns_regenerated=f.regenerated,
                        episodes_regenerated=len(f.episodes),
                        moment=str(f.injected.data.get("moment", "now")) if f.injected is not None else "now",
                        struck_s=struck_s, detected=f.detected is not None, ignored=_ignored(f))
