"""Consistency checks run after every recovery in the integration tests (DESIGN section 4).

Each check reads the real stores (Redis, the object store) and the job's event log, and
raises AssertionError naming what is inconsistent.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import defaultdict
from typing import Any

from robustrl.config import JobSpec, Settings
from robustrl.storage.objects import open_object_store
from robustrl.storage.redis_stores import BatchStore, EpisodeStore, connect


def events_of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == kind]


async def _load(settings: Settings, job_id: str, steps: int) -> tuple[dict[int, Any], dict[str, Any], list[Any]]:
    redis = connect(settings.redis_url)
    try:
        batches_store, episodes = BatchStore(redis, job_id), EpisodeStore(redis, job_id)
        batches = {k: await batches_store.get(k) for k in range(steps)}
        eps: dict[str, Any] = {}
        for b in batches.values():
            if b is not None:
                for ep in await episodes.get_many(b.episode_ids):
                    eps[ep.episode_id] = ep
        trained = await batches_store.trained_log()
        return batches, eps, trained
    finally:
        await redis.aclose()


def check_job(settings: Settings, status: dict[str, Any], events: list[dict[str, Any]]) -> dict[str, Any]:
    """Run every invariant on a finished job; return facts the caller may assert more on."""
    spec = JobSpec.parse(next(e["data"]["spec"] for e in events if e["kind"] == "job_submitted"))
    job_id = status["job_id"]
    steps = status["committed_step"] + 1
    batches, eps, trained = asyncio.run(_load(settings, job_id, steps))

    # No finished episode lost: every committed step has its full batch, every episode finished.
    per_step = spec.data.prompts_per_step * spec.data.group_size
    for k in range(steps):
        batch = batches[k]
        assert batch is not None, f"batch of committed step {k} is missing"
        assert len(batch.episode_ids) == per_step, f"step {k}: {len(batch.episode_ids)} episodes, want {per_step}"
        for eid in batch.episode_ids:
            ep = eps[eid]
            assert ep.status == "finished" and ep.reward is not None, f"episode {eid} lost or unfinished"
            # Every turn records the weights version that produced it, within the staleness bound.
            for turn in ep.turns:
                if turn.role == "assistant":
                    assert turn.weights_version >= 0, f"{eid}: assistant turn without a weights version"
                    assert k - turn.weights_version <= spec.staleness, (
                        f"{eid}: turn made by v{turn.weights_version} in step {k} (staleness {spec.staleness})")

    # No batch trained twice in one durable lineage: a step is trained again only by a newer
    # gang that resumed before it (its checkpoint was not durable when the old gang died).
    resumes = {e["data"]["epoch"]: e["data"]["resume_step"] for e in events_of(events, "member_ready")}
    by_step: dict[int, list[int]] = defaultdict(list)
    for entry in trained:
        by_step[entry["step"]].append(entry["epoch"])
    for k in range(steps):
        epochs = by_step.get(k, [])
        assert epochs, f"step {k} committed but never trained"
        assert len(epochs) == len(set(epochs)), f"step {k} trained twice by one gang: {epochs}"
        for later in epochs[1:]:
            assert resumes.get(later, 10**9) <= k, f"step {k} retrained by epoch {later} without a redo"

    # Trainer version after recovery = newest complete checkpoint (+1: version k+1 after step k).
    for e in events_of(events, "member_ready"):
        d = e["data"]
        assert d["weights_version"] == d["resume_step"], f"gang {d['epoch']} resumed at inconsistent version"

    # The final weights: the trainer's last commit; every replica that loaded that version has
    # the same checksum, and the newest durable checkpoint reproduces that version.
    commits = events_of(events, "step_committed")
    final = max(commits, key=lambda e: (e["data"]["step"], e["ts"]))["data"]
    loaded = [e["data"] for e in events_of(events, "weights_loaded") if e["data"]["version"] == final["weights_version"]]
    for d in loaded:
        assert d["checksum"] == final["checksum"], f"{d['member_id']} serves a different v{d['version']}"
    # Every version any replica loaded is one the trainer published (no mixed or torn weights).
    published: dict[int, set[str]] = defaultdict(set)
    for e in events_of(events, "weights_published"):
        published[e["data"]["version"]].add(e["data"]["checksum"])
    for e in events_of(events, "weights_loaded"):
        d = e["data"]
        assert d["checksum"] in published[d["version"]], f"{d['member_id']} loaded v{d['version']} unpublished"

    # Resumed episodes continued from their saved prefix, token for token.
    for e in events_of(events, "episode_redispatched"):
        d = e["data"]
        ep = eps.get(d["episode_id"])
        if ep is None:
            continue  # its step was regenerated from scratch by a whole-job restart
        prefix = list(ep.prompt_ids)
        for turn in ep.turns[: d["prefix_turns"]]:
            prefix.extend(turn.token_ids)
        assert hashlib.sha256(json.dumps(prefix).encode()).hexdigest() == d["prefix_sha"], (
            f"{d['episode_id']} did not resume from its saved prefix")

    store = open_object_store(settings)
    manifests = [k for k in store.list(f"jobs/{job_id}/checkpoints/") if k.endswith("manifest.json")]
    return {"spec": spec, "batches": batches, "episodes": eps, "trained": trained, "published": published,
            "final": final, "loaded_final": loaded, "manifests": manifests}
