"""The Redis stores against the session's real valkey server: prefixes and corrupt records (named
errors, nothing overwritten). The gang fence (batch claims, trained log, pointer) is tests/test_fencing.py."""

from __future__ import annotations

import uuid

import pytest

from robustrl.errors import StorageError
from robustrl.storage.redis_stores import EpisodeRecord, EpisodeStore, Keys, TurnRecord

pytestmark = pytest.mark.timeout(30)


async def test_prefix_round_trip_and_corrupt_records_are_named(redis) -> None:  # type: ignore[no-untyped-def]
    job = f"store-{uuid.uuid4().hex[:8]}"
    store = EpisodeStore(redis, job)
    ep = EpisodeRecord(job_id=job, episode_id="s1-p0-g0", step=1, group_id="s1-p0", prompt={"task": "calc"},
                       prompt_ids=[1, 2, 3],
                       turns=[TurnRecord(role="assistant", token_ids=[4, 5], logprobs=[-0.1, -0.2],
                                         weights_version=1, stop_reason="tool_call")])
    await store.save_prefix(ep)
    back = await store.load_prefix(ep.episode_id)
    assert back is not None and back.prefix_ids() == [1, 2, 3, 4, 5]
    # Garbage under an episode key: reading it raises an error naming the key; nothing else
    # is touched (the prefix of the same episode still loads).
    await redis.set(Keys.episode(job, ep.episode_id), b"{not json")
    with pytest.raises(StorageError, match=Keys.episode(job, ep.episode_id)):
        await store.get(ep.episode_id)
    assert (await store.load_prefix(ep.episode_id)).prefix_ids() == [1, 2, 3, 4, 5]  # type: ignore[union-attr]
    await redis.set(Keys.prefix(job, ep.episode_id), b"\xff\x00")
    with pytest.raises(StorageError, match="corrupt prefix"):
        await store.load_prefix(ep.episode_id)


async def test_the_tokens_a_restart_drops_are_counted_past_missing_and_corrupt_records(redis) -> None:  # type: ignore[no-untyped-def]
    """``assistant_tokens`` (what a whole-job restart charges as lost) sums the assistant turns
    saved in the records; one missing or unreadable counts nothing and stops nothing (a restart
    must not fail on its own count)."""
    job = f"store-{uuid.uuid4().hex[:8]}"
    store = EpisodeStore(redis, job)

    def ep(name: str, *turns: tuple[str, int]) -> EpisodeRecord:
        return EpisodeRecord(job_id=job, episode_id=name, step=0, group_id="s0-p0", prompt={"task": "calc"},
                             prompt_ids=[1], turns=[TurnRecord(role=role, token_ids=[7] * n, logprobs=[0.0] * n,
                                                               weights_version=0, stop_reason="eot")
                                                    for role, n in turns])

    await store.put(ep("s0-p0-g0", ("assistant", 3), ("tool", 5), ("assistant", 2)))
    await store.put(ep("s0-p0-g1", ("assistant", 4)))
    await redis.set(Keys.episode(job, "s0-p0-g2"), b"{not json")
    assert await store.assistant_tokens(["s0-p0-g0", "s0-p0-g1"]) == 9
    assert await store.assistant_tokens(["s0-p0-g0", "s0-p0-g1", "s0-p0-g2", "s0-p0-g3"]) == 9
    assert await store.assistant_tokens([]) == 0
