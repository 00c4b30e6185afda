"""Every side effect of a trainer gang is fenced by its epoch where it lands (issue 9 items 1, 3).

Against the session's real Redis and S3 servers; every check reads the raw keys or the S3 listing.
On 2b13d92 (read in the code) the batch claim accepted any epoch on a step nobody had claimed yet,
and the trained log append, the weights pointer SET and the manifest put looked at no epoch at all.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Iterator

import pytest
import torch
from robustrl.services.trainer.lineage import History, LoopFence, read_history, resume_step

from robustrl.checkpoint import Checkpointer, capture_rng
from robustrl.config import Settings
from robustrl.errors import CheckpointLost, StaleEpoch, StorageError
from robustrl.storage.fencing import GangFence, read_gang
from robustrl.storage.objects import S3ObjectStore
from robustrl.storage.redis_stores import BatchRecord, BatchStore, Keys, connect

pytestmark = pytest.mark.timeout(240)  # the first test also starts the servers: slow on a loaded machine


def _job() -> str:
    return f"fence-{uuid.uuid4().hex[:8]}"


async def test_batch_claims_follow_the_durable_lineage_and_refuse_stale_gangs(redis) -> None:  # type: ignore[no-untyped-def]
    job = _job()
    g1, g2, g3 = (GangFence(redis, job, e) for e in (1, 2, 3))
    assert await g1.claim(5, durable_step=4) == "new"
    assert await g1.claim(5, durable_step=4) == "new"  # idempotent
    assert await g2.claim(5, durable_step=4) == "redo"  # gang 1's step 5 never became durable
    with pytest.raises(StaleEpoch) as err:
        await g1.claim(5, durable_step=4)  # the zombie may not take it back
    assert err.value.newest == 2
    # On 2b13d92 the zombie could take a step nobody had claimed yet ("new").
    with pytest.raises(StaleEpoch):
        await g1.claim(6, durable_step=5)
    assert await redis.get(Keys.fence(job, 6)) is None
    assert await g3.claim(5, durable_step=5) == "refused"  # durable: training it again = twice
    assert await redis.get(Keys.fence(job, 5)) == b"2"


async def test_stale_gang_cannot_log_training_or_move_the_pointer(redis) -> None:  # type: ignore[no-untyped-def]
    job = _job()
    old, new = GangFence(redis, job, 4), GangFence(redis, job, 5)
    await old.enter()
    await old.record_trained(7, "aaa")
    await old.set_pointer(json.dumps({"version": 8, "epoch": 4}))
    await new.enter()
    await new.set_pointer(json.dumps({"version": 6, "epoch": 5}))  # a redo: lower version, newer gang
    for write in (old.record_trained(8, "bbb"), old.set_pointer(json.dumps({"version": 9, "epoch": 4})),
                  old.durable(8), old.admit()):
        with pytest.raises(StaleEpoch):
            await write
    raw_log = [json.loads(x) for x in await redis.lrange(Keys.trained_log(job), 0, -1)]
    assert raw_log == [{"step": 7, "epoch": 4, "checksum": "aaa"}]
    assert json.loads(await redis.get(Keys.weights_latest(job))) == {"version": 6, "epoch": 5}
    assert await redis.hget(Keys.gang(job), "epoch") == b"5"


async def test_durable_record_is_per_lineage(redis) -> None:  # type: ignore[no-untyped-def]
    job = _job()
    g1, g2 = GangFence(redis, job, 1), GangFence(redis, job, 2)
    assert (await g1.enter()).durable == -1
    await g1.durable(5)
    await g1.durable(4)  # never backwards within a gang
    assert (await read_gang(redis, job)).durable == 5
    assert (await g2.enter()).durable == 5
    await g2.durable(3)  # gang 2 resumed below 5 (checkpoint 5 no longer verified): its lineage
    assert await redis.hmget(Keys.gang(job), ["epoch", "durable", "durable_epoch"]) == [b"2", b"3", b"2"]


async def test_no_stale_write_lands_after_the_newer_gang_entered(redis) -> None:  # type: ignore[no-untyped-def]
    """Hundreds of racing writes: in the raw log, nothing of gang 1 follows gang 2's entry."""
    job = _job()
    g1, g2 = GangFence(redis, job, 1), GangFence(redis, job, 2)
    in_flight = asyncio.Semaphore(16)  # within the client's connection pool

    async def zombie(i: int) -> None:
        async with in_flight:
            try:
                await g1.record_trained(i, "z")
            except StaleEpoch:
                pass

    async def takeover() -> None:
        await asyncio.sleep(0)  # one loop step: the takeover lands among the racing writes, not first
        await g2.enter()
        await g2.record_trained(-1, "marker")

    await asyncio.gather(*[zombie(i) for i in range(150)], takeover(), *[zombie(i) for i in range(150, 300)])
    epochs = [json.loads(x)["epoch"] for x in await redis.lrange(Keys.trained_log(job), 0, -1)]
    assert epochs[-1] == 2 and 2 not in epochs[:-1]
    assert len(epochs) < 301  # the fence refused some


@pytest.fixture
def loop_thread() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop in a thread of its own, as the trainer's loop is to its upload thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_stale_gang_writes_no_manifest_to_s3(infra: Settings, object_store: S3ObjectStore,
                                             loop_thread: asyncio.AbstractEventLoop) -> None:
    job = _job()
    prefix = f"jobs/{job}/checkpoints"
    client = connect(infra.redis_url)

    def on_loop(coro):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, loop_thread).result(30)

    old, new = GangFence(client, job, 1), GangFence(client, job, 2)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    ck = Checkpointer(object_store, prefix, epoch=1, fence=LoopFence(old, loop_thread))
    try:
        on_loop(old.enter())

        def snap(step: int) -> None:
            ck.snapshot(step, model_state=model.state_dict(), optim_state=opt.state_dict(), rng=capture_rng(),
                        data_cursor=step, weights_version=step)
            ck.wait_uploaded(30)

        snap(1)
        assert ck.last_error is None and on_loop(read_gang(client, job)).durable == 1
        on_loop(new.enter())
        snap(2)  # on 2b13d92 this manifest landed
        assert isinstance(ck.last_error, StaleEpoch)
        manifests = [k for k in object_store.list(prefix + "/") if k.endswith("manifest.json")]
        assert manifests == [f"{prefix}/000000000001/e00000001/manifest.json"]
        assert json.loads(object_store.get(manifests[0]))["epoch"] == 1
        assert on_loop(read_gang(client, job)).durable == 1
    finally:
        on_loop(client.aclose())


# -- resuming over a committed history --------------------------------------------------------------


def test_resume_step_refuses_to_train_over_a_committed_history() -> None:
    # Checkpoint 4 was durable and nothing loads: never start from random weights (step 0).
    with pytest.raises(CheckpointLost) as err:
        resume_step(None, History(durable=4, trained=frozenset({5, 6}), batches=frozenset(range(10))))
    assert (err.value.step, err.value.durable) == (6, 4)
    # Newest loadable is 2, checkpoint 4 was durable, batch 4 already deleted: cannot redo.
    with pytest.raises(CheckpointLost, match=r"\[4\]"):
        resume_step(2, History(durable=4, trained=frozenset({5, 6}), batches=frozenset({3, 5, 6})))
    # Resuming below the durable step is sound while every batch up to it is still there.
    assert resume_step(2, History(durable=4, trained=frozenset({5, 6}), batches=frozenset({3, 4}))) == 3
    # Steps after the durable one are redone as always (kept or regenerated by the request manager).
    assert resume_step(4, History(durable=4, trained=frozenset({5, 6}), batches=frozenset())) == 5
    # A gang died before step 0's checkpoint was durable: redo from the seeded init.
    assert resume_step(None, History(durable=-1, trained=frozenset({0}), batches=frozenset())) == 0
    assert resume_step(None, History(durable=-1, trained=frozenset(), batches=frozenset())) == 0
    assert resume_step(9, History(durable=7, trained=frozenset({8}), batches=frozenset())) == 10


async def test_fresh_gang_with_committed_history_and_no_loadable_checkpoint_raises(
        redis, object_store: S3ObjectStore) -> None:  # type: ignore[no-untyped-def]
    job = _job()
    prefix = f"jobs/{job}/checkpoints"
    old = GangFence(redis, job, 1)
    await old.enter()
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    ck = Checkpointer(object_store, prefix, epoch=1)
    ck.snapshot(3, model_state=model.state_dict(), optim_state=opt.state_dict(), rng=capture_rng(),
                data_cursor=3, weights_version=4)
    assert await asyncio.to_thread(ck.wait_uploaded, 30) == 3
    await old.durable(3)
    await old.record_trained(4, "c4")
    await BatchStore(redis, job).put(BatchRecord(job_id=job, step=4, episode_ids=["e"], reward_mean=0.0))
    # The only checkpoint rots.
    blob = next(k for k in object_store.list(prefix + "/") if k.endswith("tensors-00000.pt"))
    object_store.put(blob, object_store.get(blob)[:-1])
    new = GangFence(redis, job, 2)
    record = await new.enter()
    state = await asyncio.to_thread(Checkpointer(object_store, prefix, epoch=2).load_latest)
    assert state is None
    history = await read_history(redis, job, record, None)
    assert history.committed == 4
    with pytest.raises(CheckpointLost, match="no checkpoint loads"):
        resume_step(None, history)


async def test_a_retried_trained_log_append_is_recorded_once(redis) -> None:  # type: ignore[no-untyped-def]
    """The Redis client retries a command whose connection dropped, and the server may have run it
    before the drop (seen: a Redis restart under tests/test_infra_restart.py pushed one entry
    twice). The trained-log append runs its script again on a retry: the step must be recorded once,
    or the auditor sees a batch trained twice. A newer gang's redo of the step is still appended."""
    job = _job()
    g1, g2 = GangFence(redis, job, 1), GangFence(redis, job, 2)
    await g1.enter()
    await g1.record_trained(3, "c3")
    await g1.record_trained(3, "c3")  # what the client's retry does: the same script, the same arguments
    await g1.record_trained(4, "c4")
    await g2.enter()
    await g2.record_trained(4, "c4")  # same step and weights, another gang: a redo, recorded
    raw_log = [json.loads(x) for x in await redis.lrange(Keys.trained_log(job), 0, -1)]
    assert [(e["step"], e["epoch"]) for e in raw_log] == [(3, 1), (4, 1), (4, 2)], raw_log


async def test_the_weights_pointer_never_names_a_version_the_event_log_does_not_hold(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Replicas load whatever the pointer names (they read it every 2 s), and the auditor accepts
    a loaded checksum only if the log holds it published. The trainer wrote the pointer first and
    the event last: one that died between them, or whose event JetStream did not store (it gives
    up after its retries), left a loadable version the log never held. Against servers of its
    own: the events stream is deleted (JetStream refuses every event), and the raw pointer key is
    read."""
    from robustrl.services.trainer.worker import publish_weights

    from robustrl.bus import Bus
    from robustrl.errors import TransportError
    from robustrl.infra.embedded import EmbeddedInfra
    from robustrl.messages import WeightsAnnounce
    from robustrl.subjects import EVENTS_STREAM

    infra = EmbeddedInfra(tmp_path / "infra")
    settings = infra.start()
    bus = await Bus.connect(settings.nats_url, "trainer-test", role="trainer")
    r = connect(settings.redis_url)
    try:
        await bus.ensure_event_stream()
        job = _job()
        gang = GangFence(r, job, 1)
        await gang.enter()

        def announce(version: int) -> WeightsAnnounce:
            return WeightsAnnounce(job_id=job, version=version, epoch=1, checksum=f"c{version}",
                                   sources=["127.0.0.1:1"], manifest_digest="d", manifest_bytes=1)

        await publish_weights(bus, gang, announce(1), 10)
        assert json.loads(await r.get(Keys.weights_latest(job)))["version"] == 1
        assert [(e.data["version"], e.data["checksum"]) for e in await bus.read_events(job)
                if e.kind == "weights_published"] == [(1, "c1")]

        await bus.client.jetstream().delete_stream(EVENTS_STREAM)
        with pytest.raises(TransportError):
            await publish_weights(bus, gang, announce(2), 10, retry_s=1.0)
        # Not pointed at: no replica can load v2, which no log holds.
        assert json.loads(await r.get(Keys.weights_latest(job)))["version"] == 1
    finally:
        await bus.close()
        await r.aclose()
        infra.stop()


async def test_damaged_gang_records_trained_log_and_batches_give_a_resume_a_clear_answer(redis) -> None:  # type: ignore[no-untyped-def]
    """Values in Redis that do not parse (a damaged entry, a bad restore): a trained-log entry
    that is not JSON failed every new gang's resume with a bare JSONDecodeError; a damaged batch
    between the loaded checkpoint and the durable step, with a StorageError traceback; a gang
    record whose durable step is not a number, with an IndexError. Now: the log entry is skipped
    (the auditor reports it), the batch is named as gone by ``CheckpointLost``, the record is a
    StorageError naming its key."""
    job = _job()
    g1 = GangFence(redis, job, 1)
    await g1.enter()
    await g1.durable(4)
    await g1.record_trained(5, "c5")
    await redis.rpush(Keys.trained_log(job), b"{not json", b'{"step": "x"}')
    await BatchStore(redis, job).put(BatchRecord(job_id=job, step=4, episode_ids=["e"], reward_mean=0.0))
    await redis.set(Keys.batch(job, 3), b'{"step": "damaged"')
    g2 = GangFence(redis, job, 2)
    record = await g2.enter()
    history = await read_history(redis, job, record, 2)  # resumed from checkpoint 2: steps 3, 4 to redo
    assert history.trained == frozenset({5}) and history.batches == frozenset({4})
    with pytest.raises(CheckpointLost, match=r"steps \[3\] are gone"):
        resume_step(2, history)
    await redis.hset(Keys.gang(job), "durable", "x")
    with pytest.raises(StorageError, match="damaged"):
        await GangFence(redis, job, 3).enter()
    # Its readers (the controller's finish, the request manager's commit wait) get the same named
    # error, which they handle as a read that failed (a ValueError ended the controller's task
    # that finishes the job, for good; an outside review).
    for bad in (b"x", b"7.0"):
        await redis.hset(Keys.gang(job), "durable", bad)
        with pytest.raises(StorageError, match="corrupt gang record"):
            await read_gang(redis, job)


async def test_the_trainer_collects_its_fences_and_trained_log_one_checkpoint_behind(redis) -> None:  # type: ignore[no-untyped-def]
    """A step's batch fence and trained-log entries go once the checkpoint after it is durable
    too (the request manager keeps the step's batch that long): a resume from the checkpoint
    before the newest redoes the steps after it and claims their fences again. Read raw."""
    job = _job()

    def steps() -> list[int]:
        return [json.loads(x)["step"] for x in raw]

    gang = GangFence(redis, job, 1)
    for step in range(4):
        assert await gang.claim(step, durable_step=step - 1) == "new"
        await gang.record_trained(step, "c")
    await gang.durable(0)  # the resume step: nothing behind it yet
    assert await gang.collect() == -1
    await gang.durable(2)
    assert await gang.collect() == 0
    assert [await redis.get(Keys.fence(job, s)) for s in range(4)] == [None, b"1", b"1", b"1"]
    raw = await redis.lrange(Keys.trained_log(job), 0, -1)
    assert steps() == [1, 2, 3]
    # A newer gang resumes from 0 (checkpoint 2 rotted), redoes 1, and appends it after 3: the redo
    # entry goes once the head reaches it; a damaged head entry goes too (counted, not stuck on).
    redo = GangFence(redis, job, 2)
    assert await redo.claim(1, durable_step=0) == "redo"
    await redo.record_trained(1, "c")
    await redis.lpush(Keys.trained_log(job), b"{not json")
    await redo.durable(0)
    await redo.durable(1)
    assert await redo.collect() == 0  # through 0: nothing new (the marker already says 0)
    await redo.durable(3)
    assert await redo.collect() == 1
    raw = await redis.lrange(Keys.trained_log(job), 0, -1)
    assert steps() == [2, 3, 1]  # the redo of 1 is behind 3: kept until the head reaches it
    assert await redis.get(Keys.fence(job, 1)) is None and await redis.get(Keys.fence_gc(job)) == b"1"
    # The older gang may collect nothing any more.
    gang._recorded = [2, 3]
    with pytest.raises(StaleEpoch):
        await gang.collect()
    assert await redis.get(Keys.fence(job, 2)) == b"1"


async def test_collection_catches_up_a_long_way_in_slices_and_past_a_damaged_marker(redis) -> None:  # type: ignore[no-untyped-def]
    job = _job()
    gang = GangFence(redis, job, 1)
    await redis.mset({Keys.fence(job, s): b"1" for s in range(700)})
    await redis.set(Keys.fence_gc(job), b"twelve")
    await gang.durable(600)
    await gang.durable(650)
    assert await gang.collect() == 600
    left = [s for s in range(700) if await redis.exists(Keys.fence(job, s))]
    assert left == list(range(601, 700)) and await redis.get(Keys.fence_gc(job)) == b"600"


async def test_a_gang_resumed_below_the_collection_marker_collects_the_fences_it_claimed_again(redis) -> None:  # type: ignore[no-untyped-def]
    """Gang 1 collected through step 3; its checkpoints 3 and 5 then failed to verify and gang 2
    resumed from 1, claiming 2 and 3 again. Its collections started after the marker (3): the
    fences of steps 2 and 3 it claimed were never deleted (the Redis bound's auditor counts them)."""
    job = _job()
    old = GangFence(redis, job, 1)
    for step in range(6):
        await old.claim(step, durable_step=step - 1)
    await old.durable(3)
    await old.durable(5)
    assert await old.collect() == 3  # fences 0-3 gone, the marker at 3
    new = GangFence(redis, job, 2)
    await new.enter()
    for step in (2, 3):
        assert await new.claim(step, durable_step=1) == "new"
    await new.durable(1)
    await new.durable(3)
    assert await new.collect() == 1  # through its resume step: nothing of the redone ones yet
    assert await redis.exists(Keys.fence(job, 2)) and await redis.exists(Keys.fence(job, 3))
    await new.durable(5)
    assert await new.collect() == 3
    assert [s for s in range(6) if await redis.exists(Keys.fence(job, s))] == [4, 5]
