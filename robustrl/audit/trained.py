"""What the trainer says it trained, judged against the batches and against itself.

Each ``step_committed`` carries ``trained`` (``robustrl.batch_digest``): the ids of the episodes
its gang trained and a digest of what it read of them. The check:

* parses every record (one that does not parse is a violation: a commit with no record at all is
  left to the other checks, as a log from before the record was kept);
* each step's records agree: a redo by a newer gang trained the same episodes, read the same;
* each step trained ``episodes_per_step`` distinct episodes, and no episode was trained in two
  steps;
* where the step's batch is still readable (in Redis, or sampled live), the trained episodes are
  the batch's and the digest recomputed from the raw episode records is the trainer's: it trained
  what the request manager recorded, and the records were not changed after.

Once Redis has collected a step (after its checkpoint was durable), the record is all that is
left: the step is then judged by it (``steps_judged_by_trained_record``) instead of being counted
unverified.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from robustrl.audit.lineage import JobFacts, _int, of_kind
from robustrl.audit.model import AuditInput, CheckResult
from robustrl.audit.rollout import StepView
from robustrl.batch_digest import batch_digest

_DIGEST = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Trained:
    epoch: int
    episodes: tuple[str, ...]
    digest: str


def _parse(data: Any) -> Trained | None | str:
    """The record of one commit: None if it has none, the reason if it does not parse."""
    if "trained" not in data:
        return None
    rec = data["trained"]
    if not isinstance(rec, dict):
        return f"a {type(rec).__name__}, not an object"
    eps, digest = rec.get("episodes"), rec.get("digest")
    if not isinstance(eps, list) or not all(isinstance(e, str) for e in eps):
        return "episodes is not a list of ids"
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        return "digest is not a sha256"
    return Trained(_int(data.get("epoch"), 0), tuple(eps), digest)


def check_trained_batches(inp: AuditInput, facts: JobFacts, views: list[StepView],
                          durable: int) -> tuple[CheckResult, int, set[int]]:
    """Returns (result, episodes lost in steps collected after their checkpoint was durable, those
    steps: judged by the record alone). A step collected before is lost whole already
    (``check_episodes``)."""
    res = CheckResult()
    by_step: dict[int, list[Trained]] = defaultdict(list)
    for e in of_kind(inp.events, "step_committed"):
        step = _int(e.data.get("step"))
        rec = _parse(e.data)
        if isinstance(rec, str):
            res.violations.append(f"step {step}: the trainer's record of what it trained does not parse ({rec})")
        elif rec is not None and step >= 0:
            by_step[step].append(rec)
    lost = 0
    judged: set[int] = set()
    where: dict[str, int] = {}  # episode id -> the first step that trained it
    view_of = {v.step: v for v in views}
    for step in sorted(by_step):
        recs = by_step[step]
        first = recs[0]
        for other in recs[1:]:
            if (sorted(other.episodes), other.digest) != (sorted(first.episodes), first.digest):
                res.violations.append(f"step {step}: gang {other.epoch} trained another batch than gang "
                                      f"{first.epoch} had ({len(set(other.episodes) ^ set(first.episodes))} "
                                      "episodes differ, or the same episodes read otherwise): a redo must train "
                                      "the step's batch as it was")
        distinct = set(first.episodes)
        if len(first.episodes) != facts.episodes_per_step or len(distinct) != len(first.episodes):
            res.violations.append(f"step {step}: the trainer trained {len(first.episodes)} episodes "
                                  f"({len(distinct)} distinct episodes), want {facts.episodes_per_step}")
        for eid in sorted(distinct):
            if eid in where and where[eid] != step:
                res.violations.append(f"episode {eid}: trained in steps {where[eid]} and {step}")
            where.setdefault(eid, step)
        view = view_of.get(step)
        if view is None or view.source == "none":
            if step <= durable:
                judged.add(step)
                lost += max(0, facts.episodes_per_step - len(distinct))
            continue
        ids = view.batch.get("episode_ids") if isinstance(view.batch, dict) else None
        if isinstance(ids, list) and set(map(str, ids)) != distinct:
            res.violations.append(f"step {step}: the trainer trained {len(distinct - set(map(str, ids)))} episodes "
                                  f"its batch does not name and left out {len(set(map(str, ids)) - distinct)} "
                                  f"the batch names ({view.source})")
        elif all(isinstance(view.episodes.get(e), dict) for e in distinct):
            digest = batch_digest(view.episodes[e] for e in first.episodes)  # type: ignore[misc]
            if digest != first.digest:
                res.violations.append(f"step {step}: the episode records ({view.source}) digest to {digest[:12]}, "
                                      f"the trainer's record of what it trained to {first.digest[:12]}: they were "
                                      "changed after training, or it trained other records")
    res.passed = not res.violations
    return res, lost, judged
