"""A step's episodes survive a request manager killed while it stored them (real Redis).

The request manager stores a new step's episodes one write each (episode record + the step's
episode set). Killed between two of them, it left the set with some: the next life resumed the
step with those alone and handed over a short batch (a full run's audit: "step 4: batch holds 2
episodes, want 16", the trainer's record of the same). Judged from the raw Redis keys.
"""

from __future__ import annotations

import uuid

from robustrl.services.request_manager.episodes import EpisodeRunner

from robustrl.config import Settings, reference_job
from robustrl.storage.redis_stores import DispatchStore, EpisodeStore, Keys, connect


async def test_a_step_stored_in_part_by_a_killed_request_manager_is_resumed_whole(infra: Settings) -> None:
    spec = reference_job(steps=3)
    job = f"rmeps-{uuid.uuid4().hex[:8]}"
    redis = connect(infra.redis_url)
    try:
        store = EpisodeStore(redis, job)
        # The step's episodes as a life that was not killed stores them (a job of its own).
        scratch = f"{job}-whole"
        whole = EpisodeRunner(None, scratch, spec, EpisodeStore(redis, scratch), DispatchStore(redis, scratch),
                              None)  # type: ignore[arg-type]
        expected = [e.model_copy(update={"job_id": job}) for e in (await whole.make_episodes(1))[0]]
        want = spec.data.prompts_per_step * spec.data.group_size
        assert len(expected) == want > 2
        # The first life stored 2 of the step's episodes, then was killed.
        for ep in expected[:2]:
            await store.put(ep)
        # The next life resumes the step: with every episode of it, the 2 stored ones as stored.
        again = EpisodeRunner(None, job, spec, store, DispatchStore(redis, job), None)  # type: ignore[arg-type]
        eps, resumed = await again.make_episodes(1)
        assert resumed
        assert [e.episode_id for e in eps] == [e.episode_id for e in expected]
        members = {m.decode() for m in await redis.smembers(Keys.step_episodes(job, 1))}
        assert members == {e.episode_id for e in expected}
        assert await redis.exists(*[Keys.episode(job, e.episode_id) for e in expected]) == want
        # A fresh step is stored whole, and a resume of a whole step changes nothing.
        fresh, resumed = await again.make_episodes(2)
        assert not resumed and len(fresh) == want
        same, resumed = await again.make_episodes(2)
        assert resumed and [e.episode_id for e in same] == [e.episode_id for e in fresh]
    finally:
        keys = [k async for k in redis.scan_iter(match=f"rrl:{job}*")]
        if keys:
            await redis.delete(*keys)
        await redis.aclose()
