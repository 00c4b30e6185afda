"""Rollout-side invariants, judged from raw Redis values, live observations and the event log:
no finished episode lost, saved prefixes are prefixes of the final episode, replicas serve only
published weights, and Redis holds only what recovery still needs."""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from robustrl.audit.lineage import JobFacts, _int, of_kind
from robustrl.audit.model import AuditInput, CheckResult

REJECT_KINDS = ("weights_rejected",)
"""Events a replica emits when a pulled version fails its checksum."""


@dataclass(frozen=True)
class StepView:
    """One committed step's batch and episodes from the best raw source available."""

    step: int
    source: str  # "redis" | "observed" | "none"
    batch: dict[str, Any] | None
    episodes: dict[str, dict[str, Any] | None]
    """episode id -> record; a missing id means no source holds it."""
    prefixes: dict[str, dict[str, Any] | None]


def step_views(inp: AuditInput, facts: JobFacts) -> list[StepView]:
    out = []
    for k in range(facts.final_step + 1):
        obs = inp.observed.get(k)
        if k in inp.redis.batches:
            batch = inp.redis.batches[k]
            ids = batch.get("episode_ids", []) if isinstance(batch, dict) else []
            # A batch still in Redis must have every episode in Redis: GC drops them together.
            eps = {e: inp.redis.episodes[e] for e in ids if e in inp.redis.episodes}
            pre = {e: inp.redis.prefixes[e] for e in ids if e in inp.redis.prefixes}
            out.append(StepView(k, "redis", batch, eps, pre))
        elif obs is not None:
            eps = {e: v for e, v in obs.episodes.items() if v is not None}
            out.append(StepView(k, "observed", obs.batch, eps, dict(obs.prefixes)))
        else:
            out.append(StepView(k, "none", None, {}, {}))
    return out


def _finished(ep: dict[str, Any] | None) -> bool:
    return isinstance(ep, dict) and ep.get("status") == "finished" and ep.get("reward") is not None


def check_episodes(inp: AuditInput, facts: JobFacts, views: list[StepView], durable: int) -> tuple[CheckResult, int, int]:
    """Returns (result, episodes_lost, steps_unverified)."""
    res = CheckResult()
    lost = 0
    unverified = 0
    for v in views:
        if v.source == "none":
            if v.step > durable:
                lost += facts.episodes_per_step
                res.violations.append(f"step {v.step}: batch gone from Redis before its checkpoint was durable "
                                      f"(newest loadable checkpoint {durable})")
            else:
                unverified += 1  # garbage-collected after its checkpoint became durable
            continue
        batch = v.batch
        ids = batch.get("episode_ids") if isinstance(batch, dict) else None
        if not isinstance(ids, list):
            lost += facts.episodes_per_step
            res.violations.append(f"step {v.step}: batch record does not parse ({v.source})")
            continue
        if len(ids) != facts.episodes_per_step or len(set(ids)) != len(ids):
            res.violations.append(f"step {v.step}: batch holds {len(ids)} episodes ({len(set(ids))} distinct), "
                                  f"want {facts.episodes_per_step}")
            lost += max(0, facts.episodes_per_step - len(set(ids)))
        for eid in ids:
            ep = v.episodes.get(eid)
            if eid not in v.episodes:
                lost += 1
                res.violations.append(f"step {v.step}: episode {eid} named by the batch is missing ({v.source})")
            elif not _finished(ep):
                lost += 1
                what = "does not parse" if ep is None else f"status {ep.get('status')} reward {ep.get('reward')}"
                res.violations.append(f"step {v.step}: episode {eid} not finished with a reward ({what})")
            else:
                res.violations.extend(_turn_problems(eid, v.step, ep, facts.staleness))  # type: ignore[arg-type]
    res.passed = not res.violations
    return res, lost, unverified


def _turn_problems(eid: str, step: int, ep: dict[str, Any], staleness: int) -> list[str]:
    out = []
    turns = ep.get("turns") or []
    if not any(isinstance(t, dict) and t.get("role") == "assistant" for t in turns):
        out.append(f"episode {eid}: finished without an assistant turn")
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or t.get("role") != "assistant":
            continue
        wv = _int(t.get("weights_version"))
        if wv < 0 or wv > step or step - wv > staleness:
            out.append(f"episode {eid} turn {i}: made by weights v{wv} in step {step} (staleness {staleness})")
    return out


def _ids(ep: dict[str, Any], n_turns: int | None = None) -> list[int]:
    ids = list(ep.get("prompt_ids") or [])
    for t in (ep.get("turns") or [])[:n_turns]:
        ids.extend(t.get("token_ids") or [])
    return ids


def check_prefixes(inp: AuditInput, views: list[StepView]) -> CheckResult:
    """Every saved prefix (raw Redis key, or a redispatch in the log) is a prefix of the final episode."""
    res = CheckResult()
    finals: dict[str, dict[str, Any]] = {}
    for v in views:
        for eid, ep in v.episodes.items():
            if ep is not None:
                finals[eid] = ep
        for eid, pre in v.prefixes.items():
            final = v.episodes.get(eid)
            if final is None:
                continue
            saved = pre.get("episode") if isinstance(pre, dict) else None
            n = _int(pre.get("n_turns")) if isinstance(pre, dict) else -1
            if not isinstance(saved, dict) or n < 0:
                res.violations.append(f"prefix of {eid} does not parse")
                continue
            s_turns, f_turns = (saved.get("turns") or [])[:n], final.get("turns") or []
            same = (saved.get("prompt_ids") == final.get("prompt_ids") and len(s_turns) <= len(f_turns)
                    and all(a.get("token_ids") == b.get("token_ids") and a.get("role") == b.get("role")
                            and a.get("weights_version") == b.get("weights_version")
                            for a, b in zip(s_turns, f_turns, strict=False)))
            if not same:
                res.violations.append(f"saved prefix of {eid} ({n} turns) is not a prefix of the final episode")

    # A redispatch resumed from a prefix whose hash the request manager logged; skip those whose
    # step was regenerated afterwards (whole-job restart: same ids, new episodes).
    epoch_now: dict[int, int] = {}
    regenerated_after: dict[int, list[int]] = defaultdict(list)
    for e in of_kind(inp.events, "step_started"):
        regenerated_after[_int(e.data.get("step"))].append(_int(e.data.get("epoch"), 0))
    for e in inp.events:
        if e.kind == "step_started":
            epoch_now[_int(e.data.get("step"))] = _int(e.data.get("epoch"), 0)
            continue
        if e.kind != "episode_redispatched":
            continue
        step, eid = _int(e.data.get("step")), str(e.data.get("episode_id"))
        if any(ep > epoch_now.get(step, 0) for ep in regenerated_after.get(step, [])) or eid not in finals:
            continue
        n = _int(e.data.get("prefix_turns"))
        sha = hashlib.sha256(json.dumps(_ids(finals[eid], n)).encode()).hexdigest()
        if n > len(finals[eid].get("turns") or []) or sha != e.data.get("prefix_sha"):
            res.violations.append(f"{eid} was re-dispatched from a {n}-turn prefix that is not a prefix of "
                                  f"its final episode (event seq {e.seq})")
    res.passed = not res.violations
    return res


def check_weights(inp: AuditInput, views: list[StepView]) -> tuple[CheckResult, int]:
    """Loaded checksums are published ones; no rejected checksum is loaded; every assistant turn
    was made by a replica that loaded that version with a published checksum."""
    res = CheckResult()
    published: dict[int, set[str]] = defaultdict(set)
    for e in of_kind(inp.events, "weights_published"):
        published[_int(e.data.get("version"))].add(str(e.data.get("checksum")))
    rejected: dict[tuple[str, int], set[str]] = defaultdict(set)
    for e in of_kind(inp.events, *REJECT_KINDS):
        rejected[(str(e.data.get("member_id")), _int(e.data.get("version")))].add(str(e.data.get("checksum")))
    good: set[tuple[str, int]] = set()
    bad: set[tuple[str, int]] = set()
    for e in of_kind(inp.events, "weights_loaded"):
        key = (str(e.data.get("member_id")), _int(e.data.get("version")))
        checksum = str(e.data.get("checksum"))
        if checksum not in published.get(key[1], set()):
            bad.add(key)
            res.violations.append(f"{key[0]} loaded v{key[1]} with checksum {checksum[:12]} the trainer never "
                                  f"published (event seq {e.seq})")
        elif checksum in rejected.get(key, set()):
            bad.add(key)
            res.violations.append(f"{key[0]} loaded v{key[1]} after rejecting that checksum (event seq {e.seq})")
        else:
            good.add(key)
    unloaded: set[tuple[str, int]] = set()
    for v in views:
        for eid, ep in v.episodes.items():
            for t in (ep or {}).get("turns") or []:
                member = t.get("member_id")
                if t.get("role") != "assistant" or not member:
                    continue
                key = (str(member), _int(t.get("weights_version")))
                if key not in good and key not in bad and key not in unloaded:
                    unloaded.add(key)
                    res.violations.append(f"{key[0]} served v{key[1]} (episode {eid}) but never loaded a "
                                          f"published v{key[1]}")
    pointer = inp.redis.weights_pointer
    if pointer is not None and str(pointer.get("checksum")) not in published.get(_int(pointer.get("version")), set()):
        res.violations.append(f"Redis weights pointer names v{pointer.get('version')} with an unpublished checksum")
    res.passed = not res.violations
    return res, len(bad | unloaded)


def check_redis_bounded(inp: AuditInput, durable: int, slack: int, enforce: bool) -> tuple[CheckResult, dict[str, Any]]:
    res = CheckResult()
    stale = {k: keys for k, keys in inp.redis.step_keys.items() if keys and k < durable - slack}
    facts = {"redis_keys": len(inp.redis.keys), "redis_bytes": inp.redis.total_bytes,
             "redis_stale_steps": len(stale), "redis_stale_keys": sum(len(v) for v in stale.values())}
    if stale and enforce:
        first = min(stale)
        res.violations.append(f"{len(stale)} steps older than durable checkpoint {durable} (minus {slack}) "
                              f"still hold {facts['redis_stale_keys']} keys, e.g. step {first}: "
                              f"{', '.join(stale[first][:3])}")
    res.passed = not res.violations
    return res, facts
