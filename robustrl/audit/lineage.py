"""Trainer-side invariants, judged from the raw trained log, the event log and the S3 listing.

A *durable lineage* is the chain of gangs whose checkpoints the final model descends from: the
last gang trained steps ``resume..final``; the checkpoint it resumed from (step ``resume - 1``)
was written by the newest older gang that trained that step, and so on back to step 0. Every
committed step must be trained exactly once along that chain. A step trained again by a later
gang is allowed only when its first training never became durable (the later gang resumed
before it); resuming before a checkpoint the trainer had reported durable rolls back durable
progress and trains those batches twice.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from robustrl.audit.model import AuditInput, CheckResult
from robustrl.audit.raw import RawEvent

PROGRESS_KINDS = ("step_started", "batch_ready", "step_committed", "job_finished")
ENDED_KINDS = ("job_finished", "job_failed", "job_stopped")


@dataclass(frozen=True)
class JobFacts:
    """What the event log says about the job's shape (parsed minimally from ``job_submitted``)."""

    steps: int
    episodes_per_step: int
    staleness: int
    final_step: int
    """Highest committed step (-1: none)."""
    finished: bool
    ended: bool = False
    """The log holds job_finished, job_failed or job_stopped."""
    trainer_workers: int | None = None
    """Ranks of every trainer gang (the spec's ``trainer.workers``; None: not in the log)."""
    stuck_bound_s: float | None = None
    """The spec's step deadline plus twice its recovery deadline (None: not in the log): a step
    stuck to its deadline, a local recovery run to its own, then the whole-job restart that
    escalation starts, also bounded by it."""


def _int(value: Any, default: int = -1) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def of_kind(events: list[RawEvent], *kinds: str) -> list[RawEvent]:
    return [e for e in events if e.kind in kinds]


def job_facts(events: list[RawEvent]) -> JobFacts:
    submitted = next((e for e in events if e.kind == "job_submitted"), None)
    spec: dict[str, Any] = (submitted.data.get("spec") or {}) if submitted else {}
    data = spec.get("data") or {}
    commits = of_kind(events, "step_committed")
    detector = spec.get("detector") or {}
    # A stall is reported once the step deadline passed (generation) or the commit deadline
    # (training: logs written before it existed have none)
    step_deadline = _num(detector.get("step_deadline_s"))
    commit_deadline = _num(detector.get("commit_deadline_s"))
    if step_deadline is not None and commit_deadline is not None:
        step_deadline = max(step_deadline, commit_deadline)
    recovery_deadline = _num((spec.get("recovery") or {}).get("deadline_s"))
    return JobFacts(steps=_int(spec.get("steps"), 0),
                    episodes_per_step=_int(data.get("prompts_per_step"), 8) * _int(data.get("group_size"), 8),
                    staleness=_int(spec.get("staleness"), 0),
                    final_step=max((_int(e.data.get("step")) for e in commits), default=-1),
                    finished=any(e.kind == "job_finished" for e in events),
                    ended=any(e.kind in ENDED_KINDS for e in events),
                    trainer_workers=_int((spec.get("trainer") or {}).get("workers"), 0) or None,
                    stuck_bound_s=(None if step_deadline is None or recovery_deadline is None
                                   else step_deadline + 2 * recovery_deadline))


def _num(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    return float(value) if ok else None


def check_event_log(inp: AuditInput, facts: JobFacts) -> CheckResult:
    res = CheckResult()
    if not any(e.kind == "job_submitted" for e in inp.events):
        res.violations.append("no job_submitted event: the job's log is missing or truncated")
    if facts.finished and facts.final_step != facts.steps - 1:
        res.violations.append(f"job_finished logged with final committed step {facts.final_step}, "
                              f"spec has {facts.steps} steps")
    if facts.ended:
        # Every step up to the last committed one was committed by some gang: a step without any
        # step_committed is one whose commit event was lost (its gang killed before JetStream
        # stored it, the next gang resuming past it). Once the job ended nothing is on its way.
        committed = {_int(e.data.get("step")) for e in of_kind(inp.events, "step_committed")}
        missing = [s for s in range(facts.final_step + 1) if s not in committed]
        if missing:
            res.violations.append(f"steps {missing[:10]} (of 0..{facts.final_step}) have no step_committed in the "
                                  "log: their commit events were lost")
    res.passed = not res.violations
    return res


@dataclass
class TrainingRecords:
    """(step, epoch) trainings from the raw Redis log and from step_committed events."""

    pairs: set[tuple[int, int]] = field(default_factory=set)
    raw_dupes: list[tuple[int, int]] = field(default_factory=list)
    commit_dupes: list[tuple[int, int]] = field(default_factory=list)
    unparsable: int = 0
    checksum_mismatch: list[str] = field(default_factory=list)
    past_fence: list[str] = field(default_factory=list)
    """Records of a gang appended after a newer gang's (the fence refuses those)."""
    committed_by: dict[int, int] = field(default_factory=dict)
    """step -> the newest gang that recorded training it (trained log or step_committed)."""


def training_records(inp: AuditInput) -> TrainingRecords:
    rec = TrainingRecords()
    raw: Counter[tuple[int, int]] = Counter()
    raw_sums: dict[tuple[int, int], str] = {}
    newest = -1  # the list is in append order, and every append passed the gang fence
    for entry in inp.redis.trained:
        if not isinstance(entry, dict) or _int(entry.get("step")) < 0 or _int(entry.get("epoch")) < 0:
            rec.unparsable += 1
            continue
        pair = (int(entry["step"]), int(entry["epoch"]))
        if pair[1] < newest and inp.redis.trained_in_order:
            rec.past_fence.append(f"gang {pair[1]} recorded step {pair[0]} trained after gang {newest} had "
                                  "written to the trained log (a write past the gang fence)")
        newest = max(newest, pair[1])
        raw[pair] += 1
        if isinstance(entry.get("checksum"), str):
            raw_sums[pair] = entry["checksum"]
    commits: Counter[tuple[int, int]] = Counter()
    for e in of_kind(inp.events, "step_committed"):
        pair = (_int(e.data.get("step")), _int(e.data.get("epoch")))
        commits[pair] += 1
        if pair in raw_sums and e.data.get("checksum") not in (None, raw_sums[pair]):
            rec.checksum_mismatch.append(f"step {pair[0]} epoch {pair[1]}: trained log checksum "
                                         f"{raw_sums[pair][:12]} != committed {str(e.data['checksum'])[:12]}")
    for step, epoch in (*raw, *commits):
        if step >= 0 and epoch >= 0:
            rec.committed_by[step] = max(epoch, rec.committed_by.get(step, -1))
    rec.raw_dupes = sorted(p for p, n in raw.items() if n > 1)
    rec.commit_dupes = sorted(p for p, n in commits.items() if n > 1)
    # A checkpoint that verifies was written by the gang that trained its step (it names it).
    written = {(ck.step, ck.epoch) for ck in inp.checkpoints if ck.loadable and ck.step is not None
               and ck.epoch is not None}
    rec.pairs = set(raw) | set(commits) | written  # type: ignore[arg-type]
    return rec


def _fence_violations(fences: dict[int, int | None], committed_by: dict[int, int], finished: bool,
                      collected: int | None = None) -> list[str]:
    """A step's batch claim (``Keys.fence``, still in Redis) against who trained the step: a gang
    that trained a step whose claim an older gang holds wrote past the fence; a claim held by a
    newer gang than the last that trained the step is a redo never finished, which a finished job
    cannot have. With ``collected`` (the trainer's fence GC marker as read after the fences), a
    step trained after it with no claim at all was trained unclaimed: nothing stopped a second
    gang from training it too."""
    out = []
    if collected is not None:
        out.extend(f"step {step}: trained by gang {gang} without a batch claim (no fence, and the trainer "
                   f"collected fences only through step {collected})"
                   for step, gang in sorted(committed_by.items()) if step > collected and step not in fences)
    for step, holder in sorted(fences.items()):
        if holder is None:
            out.append(f"step {step}: the batch claim (fence) does not parse")
            continue
        trained = committed_by.get(step)
        if trained is None:
            continue  # claimed, not trained (yet): nothing to compare
        if holder < trained:
            out.append(f"step {step}: trained by gang {trained} while gang {holder} held its batch claim")
        elif holder > trained and finished:
            out.append(f"step {step}: the batch claim is held by gang {holder}, which never trained it "
                       f"(last trained by gang {trained}), in a finished job")
    return out


def check_trained_once(inp: AuditInput, facts: JobFacts) -> tuple[CheckResult, int, int]:
    """Returns (result, steps_trained_twice, steps_lost)."""
    res = CheckResult()
    rec = training_records(inp)
    twice: set[int] = set()
    lost: set[int] = set()
    for step, epoch in rec.raw_dupes:
        twice.add(step)
        res.violations.append(f"step {step} recorded trained twice by gang {epoch} in the Redis trained log")
    for step, epoch in rec.commit_dupes:
        twice.add(step)
        res.violations.append(f"step {step} committed more than once by gang {epoch} (step_committed events)")
    if rec.unparsable:
        res.violations.append(f"{rec.unparsable} trained-log entries do not parse")
    res.violations.extend(rec.checksum_mismatch)
    res.violations.extend(rec.past_fence)
    res.violations.extend(_fence_violations(inp.redis.fences, rec.committed_by, facts.finished,
                                            inp.redis.fences_collected))
    if inp.redis.fence_marker_damaged:
        res.violations.append("the trainer's fence collection marker does not parse: which batch claims should "
                              "still be in Redis cannot be told")

    ready = {(_int(e.data.get("epoch"))): e for e in of_kind(inp.events, "member_ready")
             if e.data.get("role", "trainer") == "trainer"}
    by_epoch: dict[int, set[int]] = defaultdict(set)
    for step, epoch in rec.pairs:
        by_epoch[epoch].add(step)
    resume = {ep: _int(ready[ep].data.get("resume_step"), min(steps)) if ep in ready else min(steps)
              for ep, steps in by_epoch.items()}
    if inp.origins is not None:
        res.violations.extend(_origin_violations(inp.origins, ready, by_epoch, resume))
    for ep, e in ready.items():
        if _int(e.data.get("weights_version")) != _int(e.data.get("resume_step")):
            res.violations.append(f"gang {ep} resumed at step {e.data.get('resume_step')} with weights "
                                  f"version {e.data.get('weights_version')}")
        for step in sorted(s for s in by_epoch.get(ep, ()) if s < resume.get(ep, 0)):
            twice.add(step)
            res.violations.append(f"gang {ep} trained step {step} although it resumed at {resume[ep]}")

    # Rolling back past a checkpoint the trainer had reported durable trains its batches again.
    durable_before = -1
    for e in inp.events:
        if e.kind == "step_committed":
            durable_before = max(durable_before, _int(e.data.get("durable_step")))
        elif e.kind == "member_ready" and e in ready.values():
            r = _int(e.data.get("resume_step"))
            if 0 <= r <= durable_before:
                retrained = [s for s in range(r, durable_before + 1)
                             if any(s in steps for ep, steps in by_epoch.items() if ep < _int(e.data.get("epoch")))]
                twice.update(retrained)
                res.violations.append(
                    f"gang {e.data.get('epoch')} resumed at step {r} though checkpoint {durable_before} had been "
                    f"reported durable: steps {r}..{durable_before} rolled back and retrained")

    # Walk the final durable lineage back from the last commit.
    if facts.final_step >= 0:
        commits = of_kind(inp.events, "step_committed")
        last = max(commits, key=lambda e: (_int(e.data.get("step")), e.seq))
        epoch, upper = _int(last.data.get("epoch")), facts.final_step
        while upper >= 0:
            start = resume.get(epoch, upper + 1)
            for step in range(max(start, 0), upper + 1):
                if (step, epoch) not in rec.pairs:
                    lost.add(step)
                    res.violations.append(f"step {step} of the final lineage has no training record by gang {epoch}")
            upper = start - 1
            if upper < 0:
                break
            older = [ep for ep in by_epoch if ep < epoch and upper in by_epoch[ep]]
            if not older:
                lost.update(range(upper + 1))
                res.violations.append(f"gang {epoch} resumed after step {upper}, which no older gang trained "
                                      f"(steps 0..{upper} have no lineage)")
                break
            epoch = max(older)
    res.passed = not res.violations
    return res, len(twice), len(lost)


def _origin_violations(origins: dict[int, Any], ready: dict[int, RawEvent], by_epoch: dict[int, set[int]],
                       resume: dict[int, int]) -> list[str]:
    """Every gang that became ready or trained recorded, in the object store, the checkpoint it
    resumed from: the one before its resume step, of an older gang (none when it resumed at
    step 0). Without it, a stale gang's manifest landing after the gang chose where to resume
    would be loaded by the next one."""
    out = []
    for ep in sorted(set(ready) | set(by_epoch)):
        origin = origins.get(ep)
        start = resume[ep] if ep in resume else _int(ready[ep].data.get("resume_step"))
        if not isinstance(origin, dict):
            out.append(f"gang {ep} {'trained' if ep in by_epoch else 'became ready'} but recorded no readable "
                       "origin in the object store")
            continue
        named = origin.get("from_step"), origin.get("from_epoch")
        if _int(origin.get("epoch")) != ep:
            out.append(f"gang {ep}'s origin names gang {origin.get('epoch')!r}")
        elif start <= 0 and named != (None, None):
            out.append(f"gang {ep} resumed at step 0 but its origin names checkpoint {named[0]} of gang {named[1]}")
        elif start > 0 and (named[0] != start - 1 or not 0 <= _int(named[1]) < ep):
            out.append(f"gang {ep} resumed at step {start} but its origin names checkpoint {named[0]} of gang "
                       f"{named[1]} (not step {start - 1} of an older gang)")
    return out


def max_stuck_s(events: list[RawEvent]) -> float:
    """Longest time between progress events (step started / batch handed over / step committed),
    from the job's start to its end (or its last event)."""
    if not events:
        return 0.0
    start = next((e.ts for e in events if e.kind in ("job_started", "step_started")), events[0].ts)
    end = next((e.ts for e in events if e.kind in ENDED_KINDS), max(e.ts for e in events))
    marks = sorted([start, end] + [e.ts for e in events if e.kind in PROGRESS_KINDS and start <= e.ts <= end])
    return max((b - a for a, b in itertools.pairwise(marks)), default=0.0)


def check_progress(inp: AuditInput, facts: JobFacts, bound_s: float | None,
                   require_ended: bool = True) -> tuple[CheckResult, float]:
    """Nothing stuck: no gap between progress events longer than ``bound_s`` (None: the job's own
    deadlines, ``JobFacts.stuck_bound_s``), and, with ``require_ended``, a log that ends."""
    res = CheckResult()
    stuck = max_stuck_s(inp.events)
    if require_ended and inp.events and not facts.ended:
        last = inp.events[-1]
        res.violations.append(f"the job never ended: no job_finished, job_failed or job_stopped in its log (last "
                              f"event {last.kind!r}, {max(e.ts for e in inp.events) - inp.events[0].ts:.1f}s "
                              "after its first)")
    bound = bound_s if bound_s is not None else facts.stuck_bound_s
    if bound is not None and stuck > bound:
        res.violations.append(f"no progress event for {stuck:.1f}s (bound {bound:.1f}s)")
    res.passed = not res.violations
    return res, stuck
