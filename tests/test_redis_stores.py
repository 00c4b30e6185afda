"""The Redis stores against the session's real valkey server: the batch fence, prefixes, and
corrupt records (named errors, nothing overwritten)."""

from __future__ import annotations

import uuid

import pytest

from robustrl.config import Settings
from robustrl.errors import StorageError
from robustrl.storage.redis_stores import BatchStore, EpisodeRecord, EpisodeStore, Keys, TurnRecord, connect

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def redis(infra: Settings):  # type: ignore[no-untyped-def]
    client = connect(infra.redis_url)
    try:
        yield client
    finally:
        await client.aclose()


async def test_fence_never_lets_a_batch_be_trained_twice_in_one_lineage(redis) -> None:  # type: ignore[no-untyped-def]
    fence = BatchStore(redis, f"fence-{uuid.uuid4().hex[:8]}")
    # gang 1 takes step 5; asking again is idempotent
    assert await fence.claim(5, epoch=1, durable_step=4) == "new"
    assert await fence.claim(5, epoch=1, durable_step=4) == "new"
    # gang 1 died before step 5's checkpoint became durable: gang 2 may redo it
    assert await fence.claim(5, epoch=2, durable_step=4) == "redo"
    # gang 1 is still alive somewhere (a zombie): it may not take the step back
    assert await fence.claim(5, epoch=1, durable_step=4) == "refused"
    # step 5 is durable: a newer gang may not train it again
    assert await fence.claim(5, epoch=3, durable_step=5) == "refused"
    assert await redis.get(Keys.fence(fence.job, 5)) == b"2"


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
