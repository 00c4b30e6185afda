"""Rollout-side invariants, judged from raw Redis values, live observations and the event log:
no finished episode lost (a batch holds exactly its step's finished episodes and stays in Redis
until its checkpoint is durable), each turn applied once, saved prefixes are prefixes of the final
episode, Redis holds only what recovery still needs, and an ended job's outboxes (request manager,
detector, trainer, rollout replicas) hold no event the log lacks."""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from robustrl.audit.lineage import ENDED_KINDS, JobFacts, _int, of_kind
from robustrl.audit.model import AuditInput, CheckResult


@dataclass(frozen=True)
class StepView:
    """One committed step's batch and episodes from the best raw source available."""

    step: int
    source: str  # "redis" | "observed" | "none"
    batch: dict[str, Any] | None
    episodes: dict[str, dict[str, Any] | None]
    """episode id -> record; a missing id means no source holds it."""
    prefixes: dict[str, dict[str, Any] | None]
    step_set: set[str] | None = None
    """Members of the step's episode set read with the batch (None: no set was read)."""


def step_views(inp: AuditInput, facts: JobFacts) -> list[StepView]:
    out = []
    for k in range(facts.final_step + 1):
        obs = inp.observed.get(k)
        if k in inp.redis.batches:
            batch = inp.redis.batches[k]
            ids = batch.get("episode_ids", []) if isinstance(batch, dict) else []
            members = inp.redis.step_sets.get(k) or None
            # A batch still in Redis must have every episode in Redis: GC drops them together.
            named = [*(ids if isinstance(ids, list) else []), *sorted(members or ())]
            eps = {e: inp.redis.episodes[e] for e in named if e in inp.redis.episodes}
            pre = {e: inp.redis.prefixes[e] for e in named if e in inp.redis.prefixes}
            out.append(StepView(k, "redis", batch, eps, pre, members))
        elif obs is not None:
            eps = {e: v for e, v in obs.episodes.items() if v is not None}
            out.append(StepView(k, "observed", obs.batch, eps, dict(obs.prefixes), obs.step_set or None))
        else:
            out.append(StepView(k, "none", None, {}, {}))
    return out


def _finished(ep: dict[str, Any] | None) -> bool:
    return isinstance(ep, dict) and ep.get("status") == "finished" and ep.get("reward") is not None


def check_episodes(inp: AuditInput, facts: JobFacts, views: list[StepView], durable: int) -> tuple[CheckResult, int, int]:
    """Every committed step's batch stayed in Redis until its checkpoint was durable, names exactly
    its step's finished episodes, and each of them is finished, with its turns each applied once
    and made within the staleness bound. Returns (result, episodes_lost, steps_unverified)."""
    res = CheckResult()
    lost = 0
    unverified = 0
    answered: dict[str, tuple[str, int]] = {}  # request id -> (episode, turn) it answered
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
        lost_here: set[str] = set()
        if v.source == "observed" and v.step > durable:
            # Seen at hand-off, but a redo from the newest loadable checkpoint needs the batch in
            # Redis: collected this early, its episodes cannot be trained again.
            lost_here.update(str(e) for e in ids)
            res.violations.append(f"step {v.step}: batch gone from Redis before its checkpoint was durable "
                                  f"(newest loadable checkpoint {durable}; it was seen live at hand-off)")
        if len(ids) != facts.episodes_per_step or len(set(ids)) != len(ids):
            res.violations.append(f"step {v.step}: batch holds {len(ids)} episodes ({len(set(ids))} distinct), "
                                  f"want {facts.episodes_per_step}")
            lost += max(0, facts.episodes_per_step - len(set(ids)))
        if v.step_set is not None:
            for eid in ids:
                if eid not in v.step_set:
                    res.violations.append(f"step {v.step}: batch names episode {eid}, which is not in the "
                                          f"step's episode set ({v.source})")
            for eid in sorted(v.step_set - {str(e) for e in ids}):
                if _finished(v.episodes.get(eid)):
                    lost_here.add(eid)
                    res.violations.append(f"step {v.step}: finished episode {eid} of the step's episode set is "
                                          f"not in its batch (dropped without a reason; {v.source})")
        for eid in ids:
            ep = v.episodes.get(eid)
            if eid not in v.episodes:
                lost_here.add(eid)
                res.violations.append(f"step {v.step}: episode {eid} named by the batch is missing ({v.source})")
            elif not _finished(ep):
                lost_here.add(eid)
                what = "does not parse" if ep is None else f"status {ep.get('status')} reward {ep.get('reward')}"
                res.violations.append(f"step {v.step}: episode {eid} not finished with a reward ({what})")
            else:
                res.violations.extend(_turn_problems(eid, v.step, ep, facts.staleness, answered))  # type: ignore[arg-type]
        lost += len(lost_here)
    res.passed = not res.violations
    return res, lost, unverified


def _turn_problems(eid: str, step: int, ep: dict[str, Any], staleness: int,
                   answered: dict[str, tuple[str, int]]) -> list[str]:
    """A finished episode's turns: at least one reply; each reply made within the staleness
    bound; each applied once. A reply answers the prefix that ends in the prompt or in a tool
    result (a turn is dispatched only then), so two replies in a row are two replies to one
    (episode, turn) both kept; and one request answers one turn of one episode."""
    out = []
    turns = ep.get("turns") or []
    if not any(isinstance(t, dict) and t.get("role") == "assistant" for t in turns):
        out.append(f"episode {eid}: finished without an assistant turn")
    previous = None
    for i, t in enumerate(turns):
        role = t.get("role") if isinstance(t, dict) else None
        if role == "assistant" and previous == "assistant":
            out.append(f"episode {eid}: turns {i - 1} and {i} are both replies: one turn applied twice")
        previous = role
        if role != "assistant":
            continue
        wv = _int(t.get("weights_version"))
        if wv < 0 or wv > step or step - wv > staleness:
            out.append(f"episode {eid} turn {i}: made by weights v{wv} in step {step} (staleness {staleness})")
        rid = t.get("request_id")
        if isinstance(rid, str) and rid:
            first = answered.setdefault(rid, (eid, i))
            if first != (eid, i):
                out.append(f"episode {eid} turn {i}: request {rid} was applied twice (it answered episode "
                           f"{first[0]} turn {first[1]} already)")
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


def _unappended(entries: list[Any], logged: set[tuple[Any, Any, str]]) -> list[tuple[str, float | None]]:
    """(description, ts) of each outbox entry whose event the log lacks (ts None: no usable ts)."""
    missing: list[tuple[str, float | None]] = []
    for entry in entries:
        event = entry.get("event") if isinstance(entry, dict) else None
        if not isinstance(event, dict):
            missing.append(("an entry that does not parse", None))
        elif (event.get("kind"), event.get("ts"), _canonical(event.get("data"))) not in logged:
            ts = event.get("ts")
            ts = float(ts) if isinstance(ts, int | float) and not isinstance(ts, bool) else None
            missing.append((f"{event.get('kind')} (ts {event.get('ts')})", ts))
    return missing


def check_outbox(inp: AuditInput, facts: JobFacts, controller_slack_s: float) -> tuple[CheckResult, dict[str, int]]:
    """Once the job ended, every event the request manager acknowledged is in the log: an entry
    still in its outbox (``Keys.rm_outbox``) that the log lacks was never appended. One the log
    already holds (same kind, time and data) is only waiting for its removal. The detector's
    outbox (``Keys.detector_outbox``: its ``fault_detected`` events, appended by the next detector
    to start or by a deletion that keeps the log), the trainer's (``Keys.trainer_outbox``: rank
    0's ``step_committed`` events, appended by the next gang) and the rollout replicas'
    (``Keys.rollout_outbox``: their ``weights_loaded``/``weights_rejected``/``fault_struck``, appended by any live
    replica of the job once old, by one that stops, or by the next to start) are judged the same
    way.

    The controller's outbox (``Keys.controller_outbox``) is appended in order, one entry at a
    time, so once the log holds the job's final event, every controller event given well before
    it (more than ``controller_slack_s``: ``AuditOptions.controller_outbox_slack_s``) is in the
    log too, and an entry that does not parse can never be; the others may still be on their
    way and are counted (``controller_outbox_owed``), not failed."""
    res = CheckResult()
    logged = {(e.kind, e.ts, _canonical(e.data)) for e in inp.events}
    out: dict[str, int] = {}
    # The request manager's, detector's, trainer's and replicas' outboxes: an ended job's entry the
    # log lacks was lost.
    for owner, entries, prefix in (("the request manager's", inp.redis.outbox, "outbox"),
                                   ("the detector's", inp.redis.detector_outbox, "detector_outbox"),
                                   ("the trainer's", inp.redis.trainer_outbox, "trainer_outbox"),
                                   ("the rollout replicas'", inp.redis.rollout_outbox, "rollout_outbox")):
        if entries is None:
            continue
        missing = [what for what, _ in _unappended(entries, logged)]
        if facts.ended and missing:
            res.violations.append(f"the job ended with {len(missing)} events in {owner} outbox that its log never "
                                  f"got: {', '.join(missing[:5])}")
        out.update({f"{prefix}_entries": len(entries), f"{prefix}_unappended": len(missing)})
    if inp.redis.controller_outbox is not None:
        final_ts = min((e.ts for e in inp.events if e.kind in ENDED_KINDS), default=None)
        missing_c = _unappended(inp.redis.controller_outbox, logged)
        before = [what for what, ts in missing_c
                  if final_ts is not None and (ts is None or ts < final_ts - controller_slack_s)]
        if before:
            res.violations.append(f"the log holds the job's final event but not {len(before)} controller events "
                                  f"given more than {controller_slack_s:g} s before it, still in the controller's "
                                  f"outbox: {', '.join(before[:5])}")
        out.update(controller_outbox_entries=len(inp.redis.controller_outbox),
                   controller_outbox_owed=len(missing_c) - len(before))
    res.passed = not res.violations
    return res, out


def _canonical(data: Any) -> str:
    return json.dumps(data, sort_keys=True, default=str)
