"""Checkpoints written by a gang of ranks: one writer per key, the manifest last and only after every
rank's shard verified, GC that keeps what verifies, and the selection of which manifest counts.

The race tests reproduce the bug of issue 9 item 1: on 2b13d92 every rank wrote (and first deleted)
the same keys, and 24 of 60 checkpoints written by two ranks at once did not load.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from robustrl.checkpoint import Checkpointer, capture_rng, seed_rng
from robustrl.checkpoint_catalog import CheckpointRef, Listing, gc_deletions, lineage, scan
from robustrl.errors import CheckpointError, StaleEpoch
from robustrl.storage.objects import FileObjectStore, ObjectStore, S3ObjectStore

torch.set_num_threads(1)
PREFIX = "jobs/j/checkpoints"


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    return model, opt


def _gang(store: ObjectStore, world: int, epoch: int, **kw: object) -> list[Checkpointer]:
    return [Checkpointer(store, PREFIX, rank=r, world_size=world, epoch=epoch, **kw)  # type: ignore[arg-type]
            for r in range(world)]


def _snap_all(gang: list[Checkpointer], step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Every rank snapshots ``step`` at the same time (ranks' RNG states differ, as in a real gang)."""
    go = threading.Barrier(len(gang))
    rng_lock = threading.Lock()  # the generators are per process here, per rank in a real gang

    def one(ck: Checkpointer) -> None:
        with rng_lock:
            seed_rng(7, step, ck.rank)
            rng = capture_rng()
        go.wait()
        if ck.rank == 0:
            ck.snapshot(step, model_state=model.state_dict(), optim_state=opt.state_dict(), rng=rng,
                        data_cursor=step + 1, weights_version=step + 1)
        else:
            ck.snapshot(step, rng=rng, data_cursor=step + 1, weights_version=step + 1)

    threads = [threading.Thread(target=one, args=(ck,)) for ck in gang]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _wait_all(gang: list[Checkpointer]) -> None:
    for ck in gang:
        ck.wait_uploaded(60)


def _ranks_race(store: ObjectStore, steps: int) -> None:
    model, opt = _model()
    gang = _gang(store, 2, epoch=1, keep=1000)
    for step in range(steps):
        _snap_all(gang, step, model, opt)
        _wait_all(gang)
        assert gang[0].last_error is None and gang[1].last_error is None
    manifests = [k for k in store.list(PREFIX + "/") if k.endswith("manifest.json")]
    assert len(manifests) == steps
    reader = Checkpointer(store, PREFIX)
    for step in range(steps):
        state = reader.load(step)  # raises if any blob of any rank is missing or corrupt
        assert state.epoch == 1 and state.data_cursor == step + 1
        seed_rng(7, step, 1)
        assert torch.equal(state.rng_for(1)["torch"], capture_rng()["torch"])  # rank 1's own RNG
        assert all(torch.equal(state.model_state[k], v) for k, v in model.state_dict().items())
    # One writer per key: every key sits under exactly one rank's folder (or is the manifest).
    for key in store.list(PREFIX + "/"):
        tail = key.split("/")[-2:]
        assert tail[1] == "manifest.json" or tail[0] in ("r00000", "r00001"), key


def test_two_ranks_writing_one_step_concurrently_file(tmp_path: Path) -> None:
    _ranks_race(FileObjectStore(tmp_path), steps=30)


def test_two_ranks_writing_one_step_concurrently_s3(object_store: S3ObjectStore) -> None:
    _ranks_race(object_store, steps=8)


def test_stale_and_new_gang_on_one_step_never_clobber_each_other(tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path)
    model, opt = _model()
    # The new gang's GC may delete the stale gang's step-5 folder, receipts included, while the stale
    # coordinator still waits for them: that upload then fails after shard_wait_s, which is correct (a
    # stale gang's checkpoint is worth nothing), so the wait is kept shorter than _wait_all's bound.
    old, new = _gang(store, 2, epoch=3, shard_wait_s=10), _gang(store, 2, epoch=4)
    _snap_all(old + new, 5, model, opt)  # four writers at once, two gangs, one step
    _wait_all(old + new)
    assert Checkpointer(store, PREFIX).load(5, 4).epoch == 4  # the stale gang clobbered nothing of it
    assert Checkpointer(store, PREFIX).load_latest().epoch == 4  # type: ignore[union-attr]
    # The new gang's GC may already have removed the superseded folder; nothing else is gone.
    assert {r.epoch for r in scan(store, PREFIX).folders} <= {3, 4}
    assert CheckpointRef(5, 4) in scan(store, PREFIX).manifests
    # The stale gang goes on to step 6 after the new gang wrote step 5: that manifest is superseded.
    _snap_all(old, 6, model, opt)
    _wait_all(old)
    assert store.exists(CheckpointRef(6, 3).manifest_key(PREFIX))
    latest = Checkpointer(store, PREFIX).load_latest()
    assert latest is not None and (latest.step, latest.epoch) == (5, 4)


def test_rank_that_never_reports_means_no_manifest(tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path)
    model, opt = _model()
    coordinator = _gang(store, 2, epoch=1, shard_wait_s=0.3)[0]
    coordinator.snapshot(1, model_state=model.state_dict(), optim_state=opt.state_dict(), rng=capture_rng(),
                         data_cursor=0, weights_version=1)
    assert coordinator.wait_uploaded(30) is None
    assert isinstance(coordinator.last_error, CheckpointError) and "rank 1" in str(coordinator.last_error)
    assert not [k for k in store.list("") if k.endswith("manifest.json")]


def test_an_abandoned_upload_stops_waiting_and_writes_no_manifest_even_once_the_shard_comes(tmp_path: Path) -> None:
    """A rank 0 leaving its broken gang abandons its upload: it stops waiting for the dead rank's
    shard at once (not after shard_wait_s), and a shard that lands after that makes no manifest."""
    store = FileObjectStore(tmp_path)
    model, opt = _model()
    coordinator, other = _gang(store, 2, epoch=1, shard_wait_s=120.0)
    coordinator.snapshot(1, model_state=model.state_dict(), optim_state=opt.state_dict(), rng=capture_rng(),
                         data_cursor=0, weights_version=1)
    with pytest.raises(TimeoutError):
        coordinator.wait_uploaded(0.3)  # waiting for rank 1's receipt
    coordinator.abandon()
    assert coordinator.wait_uploaded(10) is None  # well before the 120 s shard wait
    other.snapshot(1, rng=capture_rng(), data_cursor=0, weights_version=1)
    assert other.wait_uploaded(30) is None
    assert isinstance(coordinator.last_error, CheckpointError)
    assert not [k for k in store.list("") if k.endswith("manifest.json")]


def test_rank_shard_corrupted_after_its_receipt_means_no_manifest(tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path)
    model, opt = _model()
    rank0, rank1 = _gang(store, 2, epoch=1, shard_wait_s=30)
    rank1.snapshot(1, rng=capture_rng(), data_cursor=0, weights_version=1)
    rank1.wait_uploaded(30)
    receipt = json.loads(store.get(CheckpointRef(1, 1).receipt_key(PREFIX, 1)))
    victim = f"{CheckpointRef(1, 1).folder(PREFIX)}/{receipt['blobs'][0]['name']}"
    store.put(victim, store.get(victim) + b"!")
    rank0.snapshot(1, model_state=model.state_dict(), optim_state=opt.state_dict(), rng=capture_rng(),
                   data_cursor=0, weights_version=1)
    assert rank0.wait_uploaded(30) is None
    assert isinstance(rank0.last_error, CheckpointError) and rank0.last_error.name == victim
    assert not store.exists(CheckpointRef(1, 1).manifest_key(PREFIX))


class _RefusingFence:
    def __init__(self) -> None:
        self.admitted: list[int] = []

    def admit(self, step: int) -> None:
        raise StaleEpoch("a newer gang took over", epoch=1, newest=2)

    def durable(self, step: int) -> None:
        raise AssertionError("durable() after a refused admit()")


def test_fence_refusal_leaves_no_manifest(tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path)
    model, opt = _model()
    ck = Checkpointer(store, PREFIX, epoch=1, fence=_RefusingFence())
    ck.snapshot(1, model_state=model.state_dict(), optim_state=opt.state_dict(), rng=capture_rng(),
                data_cursor=0, weights_version=1)
    assert ck.wait_uploaded(30) is None and isinstance(ck.last_error, StaleEpoch)
    assert not [k for k in store.list("") if k.endswith("manifest.json")]


class _UnrecordedFence:
    """Admits every step; recording step 1 as durable fails (Redis away past its retries)."""

    def admit(self, step: int) -> None:
        pass

    def durable(self, step: int) -> None:
        if step == 1:
            raise TimeoutError("the gang record's write timed out (test)")


def test_a_step_is_durable_only_once_the_fenced_record_says_so(tmp_path: Path) -> None:
    """The manifest of step 1 is written but the gang record's ``durable`` write fails: the
    checkpointer must not advertise step 1 as durable (the trainer sends it as
    ``StepCommitted.durable_step``, and the request manager then deletes batch 1, which the next
    gang, resuming by the record from step 0, must train again). It did: the step was taken as
    durable before the record was written (an outside review found it)."""
    store = FileObjectStore(tmp_path)
    model, opt = _model()
    ck = Checkpointer(store, PREFIX, epoch=1, fence=_UnrecordedFence())
    for step in (0, 1):
        ck.snapshot(step, model_state=model.state_dict(), optim_state=opt.state_dict(), rng=capture_rng(),
                    data_cursor=step, weights_version=step + 1)
        ck.wait_uploaded(30)
    assert isinstance(ck.last_error, TimeoutError), ck.last_error
    assert ck.durable_step == 0


class _RottingStore(FileObjectStore):
    """Stores tensor blobs of some steps with a flipped byte (a bad disk, or a racing writer)."""

    def __init__(self, root: Path, bad_steps: set[int]) -> None:
        super().__init__(root)
        self.bad = {f"/{s:012d}/" for s in bad_steps}

    def put(self, key: str, data: bytes) -> None:
        if "/tensors-" in key and any(b in key for b in self.bad):
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        super().put(key, data)


def test_gc_keeps_last_good_checkpoint_through_a_run_of_bad_ones(tmp_path: Path) -> None:
    # Old-API calls only, so the same test shows the bug on 2b13d92 (GC kept the 2 newest
    # manifests, all bad, deleted the good ones, and load_latest returned None).
    store = _RottingStore(tmp_path, bad_steps={3, 4, 5, 6})
    model, opt = _model()
    ck = Checkpointer(store, "c", keep=2)
    for step in range(1, 7):
        ck.snapshot(step, model_state=model.state_dict(), optim_state=opt.state_dict(), rng=capture_rng(),
                    data_cursor=step, weights_version=step)
        ck.wait_uploaded(30)
    state = Checkpointer(store, "c").load_latest()
    assert state is not None and state.step == 2
    steps_on_disk = {int(k.split("/")[1]) for k in store.list("c/")}
    assert {1, 2} <= steps_on_disk
    store.bad.clear()
    ck.snapshot(7, model_state=model.state_dict(), optim_state=opt.state_dict(), rng=capture_rng(),
                data_cursor=7, weights_version=7)
    ck.wait_uploaded(30)
    assert {int(k.split("/")[1]) for k in store.list("c/")} == {2, 7}  # keep=2 verified; bad ones gone
    assert Checkpointer(store, "c").load_latest().step == 7  # type: ignore[union-attr]


def test_seed_rng_makes_a_redone_step_draw_the_same() -> None:
    seed_rng(1, 5, 0)
    first = capture_rng()["torch"].clone(), torch.rand(3)
    torch.rand(100)
    seed_rng(1, 5, 0)
    assert torch.equal(capture_rng()["torch"], first[0]) and torch.equal(torch.rand(3), first[1])
    seed_rng(1, 5, 1)
    assert not torch.equal(torch.rand(3), first[1])  # ranks draw differently


# -- pure selection ------------------------------------------------------------------------------


def test_lineage_prefers_newest_epoch_and_drops_zombie_writes() -> None:
    R = CheckpointRef
    # gang 3 wrote 8..10; gang 4 resumed at 8 and rewrote 9; gang 3 (a zombie) then wrote 10 and 11.
    got = lineage({R(8, 3), R(9, 3), R(9, 4), R(10, 3), R(11, 3)})
    assert got == [R(9, 4), R(8, 3)]
    assert lineage({R(1, 0), R(2, 0), R(3, 1), R(3, 2)}) == [R(3, 2), R(2, 0), R(1, 0)]
    assert lineage(set()) == []


refs = st.builds(CheckpointRef, st.integers(0, 12), st.integers(0, 4))


@given(st.frozensets(refs, max_size=25), st.frozensets(refs, max_size=25), st.integers(1, 4), st.integers(0, 4))
def test_gc_never_deletes_kept_newer_or_foreign_epoch(manifests: frozenset[CheckpointRef],
                                                        partial: frozenset[CheckpointRef], keep: int,
                                                        own_epoch: int) -> None:
    listing = Listing(folders=manifests | partial, manifests=manifests)
    kept = lineage(manifests)[:keep]
    doomed = gc_deletions(listing, kept, own_epoch)
    assert not set(doomed) & set(kept)
    if not kept:
        assert doomed == []
    else:
        newest = max(r.step for r in kept)
        assert all(r.step <= newest and r.epoch <= own_epoch for r in doomed)
        # Everything strictly older than the oldest kept step, of our epoch or older, goes.
        oldest = min(r.step for r in kept)
        assert {r for r in listing.folders if r.step < oldest and r.epoch <= own_epoch} <= set(doomed)


def test_scan_ignores_keys_in_other_shapes(tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path)
    # ('²' is a digit to str.isdigit, not to int: one such key failed every resume and GC; '٣' is
    # one to int, but no folder this code writes)
    for key in ("p/000000000001/manifest.json", "p/notastep/e00000001/manifest.json", "p/000000000002/x/manifest.json",
                "p/²/e00000001/manifest.json", "p/000000000005/e٣/manifest.json",
                "p/000000000003/e00000002/manifest.json", "p/000000000003/e00000002/r00000/state.pt",
                "p/000000000004/e00000001/r00001/receipt.json"):
        store.put(key, b"{}")
    listing = scan(store, "p")
    assert listing.manifests == {CheckpointRef(3, 2)}
    assert listing.folders == {CheckpointRef(3, 2), CheckpointRef(4, 1)}
    with pytest.raises(CheckpointError, match="unreadable"):
        Checkpointer(store, "p").load(3)


def test_ranks_whose_scans_saw_different_checkpoints_resume_from_rank_0s(tmp_path: Path) -> None:
    """A manifest lands between two ranks' scans of the store (a stale gang's upload still in
    flight): rank 0 saw step 0 as the newest, rank 1 step 1. Two real processes in a gloo group:
    both must resume from the same checkpoint, rank 0's (before, each loaded its own: gradients of
    different batches averaged, optimizer states apart; an outside review found it)."""
    from robustrl.ports import free_port
    import subprocess
    import sys

    store = FileObjectStore(tmp_path / "store")
    model, opt = _model()
    gang = _gang(store, 2, epoch=1, keep=10)
    for step in (0, 1):
        _snap_all(gang, step, model, opt)
        _wait_all(gang)
    manifest = tmp_path / "store" / CheckpointRef(1, 1).manifest_key(PREFIX)
    hidden = tmp_path / "late-manifest.json"
    manifest.rename(hidden)  # not there yet when rank 0 scans
    port = free_port()
    here = Path(__file__).parent
    procs = [subprocess.Popen([sys.executable, str(here / "resume_rank.py"), str(rank), str(port),
                               str(tmp_path / "store"), PREFIX, str(hidden), str(manifest)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    by_rank = {o["rank"]: o for o in outs}
    assert by_rank[0]["own"] == [0, 1] and by_rank[1]["own"] == [1, 1], outs  # the scans did differ
    assert by_rank[0]["resumes"] == by_rank[1]["resumes"] == [0, 1], outs


class _HeldAfterAdmit:
    """A stale coordinator's fence: it admits the manifest (no newer gang had entered yet), then
    the put is held until released; meanwhile a newer gang enters and resumes. Recording the step
    durable is then refused, as the real fence refuses a replaced gang."""

    def __init__(self) -> None:
        self.admitted = threading.Event()
        self.release = threading.Event()

    def admit(self, step: int) -> None:
        self.admitted.set()
        assert self.release.wait(60), "never released"

    def durable(self, step: int) -> None:
        raise StaleEpoch("a newer gang took over", epoch=1, newest=2)


@pytest.mark.parametrize("backend", ["file", "s3"])
def test_a_stale_manifest_landing_after_a_new_gang_resumed_below_it_is_never_loaded(
        backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Gang 1 wrote step 4; its step-5 manifest passed the fence and is in flight when gang 2
    enters and resumes from step 4 (the newest it can see). The manifest then lands. Gang 2 dies
    before writing a checkpoint of its own, and gang 3 resumes: it must resume where gang 2 did.
    Step 5 of gang 1 was never recorded durable, and gang 2 may have trained (and recorded) batch
    5 again; before the fix gang 3 loaded gang 1's step 5, weights of a training the job's history
    does not hold (the lineage rule needs a newer gang's *manifest* to supersede a stale one)."""
    store: ObjectStore = (FileObjectStore(tmp_path) if backend == "file"
                          else request.getfixturevalue("object_store"))
    model, opt = _model()
    gang1 = Checkpointer(store, PREFIX, epoch=1, keep=10)
    gang1.snapshot(4, model_state=model.state_dict(), optim_state=opt.state_dict(), rng=capture_rng(),
                   data_cursor=5, weights_version=5)
    assert gang1.wait_uploaded(60) == 4
    at_4 = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)  # gang 1 trained step 5
    gang1.fence = fence = _HeldAfterAdmit()
    gang1.snapshot(5, model_state=model.state_dict(), optim_state=opt.state_dict(), rng=capture_rng(),
                   data_cursor=6, weights_version=6)
    assert fence.admitted.wait(60)

    gang2 = Checkpointer(store, PREFIX, epoch=2)  # enters now; resumes as the trainer does
    state2 = gang2.load_latest()
    assert state2 is not None and (state2.step, state2.epoch) == (4, 1)
    gang2.start_lineage(state2)

    fence.release.set()
    gang1.wait_uploaded(60)
    assert store.exists(CheckpointRef(5, 1).manifest_key(PREFIX))  # the stale manifest did land

    gang3 = Checkpointer(store, PREFIX, epoch=3)  # gang 2 died before its first checkpoint
    state3 = gang3.load_latest()
    assert state3 is not None and (state3.step, state3.epoch) == (4, 1), (state3.step, state3.epoch)
    assert all(torch.equal(state3.model_state[k], v) for k, v in at_4.items())
    assert gang3.list_complete() == [4]
    gang3.start_lineage(state3)
    # Gang 3 goes on and writes step 5 itself: that is the step a fourth gang loads.
    gang3.snapshot(5, model_state=at_4, optim_state=opt.state_dict(), rng=capture_rng(), data_cursor=6,
                   weights_version=6)
    assert gang3.wait_uploaded(60) == 5
    state4 = Checkpointer(store, PREFIX, epoch=4).load_latest()
    assert state4 is not None and (state4.step, state4.epoch) == (5, 3)


def test_lineage_follows_the_newest_origin_back() -> None:
    R = CheckpointRef
    manifests = {R(3, 1), R(4, 1), R(5, 1), R(6, 2), R(5, 3), R(6, 3)}
    # Gang 3 resumed from gang 1's step 4: gang 2 (resumed from 5) is off the chain, and so is
    # gang 1's step 5.
    assert lineage(manifests, {1: None, 2: R(5, 1), 3: R(4, 1)}) == [R(6, 3), R(5, 3), R(4, 1), R(3, 1)]
    # Gang 4 resumed from gang 3's step 5 and wrote nothing yet: gang 3's step 6 is off the chain.
    assert lineage(manifests, {1: None, 2: R(5, 1), 3: R(4, 1), 4: R(5, 3)}) == [R(5, 3), R(4, 1), R(3, 1)]
    # A late origin of a replaced gang changes nothing: the newest origin starts the walk.
    assert lineage(manifests, {1: None, 3: R(4, 1), 2: R(6, 1)}) == [R(6, 3), R(5, 3), R(4, 1), R(3, 1)]
    # A gang that started from the initial weights ends the chain.
    assert lineage(manifests, {1: None, 2: None}) == [R(6, 2)]
    # An origin naming its own epoch or a newer one (not written by this code) ends it too.
    assert lineage(manifests, {3: R(4, 3)}) == [R(6, 3), R(5, 3)]


def test_lineage_below_a_gang_without_origin_uses_the_older_rule() -> None:
    R = CheckpointRef
    # Gangs 1 and 2 wrote before origins existed; gang 3 resumed from gang 2's step 4.
    manifests = {R(2, 1), R(3, 1), R(3, 2), R(4, 2), R(5, 1), R(5, 3)}

    class Partial(dict):  # type: ignore[type-arg]
        """Gang 2's origin is listed but does not read (KeyError), gang 1 has none."""

        def __getitem__(self, epoch: int) -> CheckpointRef | None:
            if epoch == 2:
                raise KeyError(epoch)
            return super().__getitem__(epoch)

    origins = Partial({3: R(4, 2), 2: None})
    assert lineage(manifests, origins) == [R(5, 3), R(4, 2), R(3, 2), R(2, 1)]
    assert lineage(manifests) == [R(5, 3), R(4, 2), R(3, 2), R(2, 1)]  # the older rule alone agrees here


def test_an_unreadable_origin_is_ignored_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = FileObjectStore(tmp_path)
    model, opt = _model()
    ck = Checkpointer(store, PREFIX, epoch=1)
    ck.snapshot(0, model_state=model.state_dict(), optim_state=opt.state_dict(), rng=capture_rng(), data_cursor=1,
                weights_version=1)
    assert ck.wait_uploaded(60) == 0
    store.put(f"{PREFIX}/origins/e00000002.json", b"{not json")
    assert scan(store, PREFIX).origins == {2}
    state = Checkpointer(store, PREFIX, epoch=3).load_latest()
    assert state is not None and (state.step, state.epoch) == (0, 1)
    assert "origin" in caplog.text and "e00000002.json" in caplog.text
