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
