"""Per-step checkpoints: round trip, manifest-last, corruption fallback, gc, blocking cost."""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from robustrl.checkpoint import (
    CheckpointBusy,
    Checkpointer,
    CheckpointState,
    capture_rng,
    restore_rng,
)
from robustrl.errors import CheckpointError, StorageError
from robustrl.storage.objects import FileObjectStore, ObjectStore, S3ObjectStore

torch.set_num_threads(1)


def _trainer(seed: int = 0, width: int = 16) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(8, model[0].in_features)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _snap(ck: Checkpointer, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer, **kw: Any) -> None:
    ck.snapshot(step, model_state=model.state_dict(), optim_state=opt.state_dict(), rng=capture_rng(),
                data_cursor=step * 10, weights_version=step + 1, **kw)


def _draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


@pytest.fixture
def file_store(tmp_path: Path) -> FileObjectStore:
    return FileObjectStore(tmp_path / "objects")


def _round_trip(store: ObjectStore) -> None:
    model, opt = _trainer()
    for _ in range(2):
        _train_step(model, opt)
    ck = Checkpointer(store, "jobs/j/ckpt")
    _snap(ck, 7, model, opt, extra={"note": "x", "batch_ids": [1, 2]})
    assert ck.wait_uploaded(30) == 7 and ck.durable_step == 7
    stats = ck.upload_stats
    assert stats is not None and stats.step == 7 and stats.bytes > 0
    expected_draws = _draws()
    _train_step(model, opt)
    expected_params = [p.detach().clone() for p in model.parameters()]

    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    state = Checkpointer(store, "jobs/j/ckpt").load_latest()
    assert isinstance(state, CheckpointState)
    assert (state.step, state.weights_version, state.data_cursor) == (7, 8, 70)
    assert state.extra == {"note": "x", "batch_ids": [1, 2]}
    fresh, fresh_opt = _trainer(seed=1)
    fresh.load_state_dict(state.model_state)
    fresh_opt.load_state_dict(state.optim_state)
    restore_rng(state.rng)
    assert _draws() == expected_draws
    _train_step(fresh, fresh_opt)  # consumes the same random batch, uses the restored Adam moments
    for got, want in zip(fresh.parameters(), expected_params, strict=True):
        assert torch.equal(got, want)


def test_round_trip_file(file_store: FileObjectStore) -> None:
    _round_trip(file_store)


def test_round_trip_s3(object_store: S3ObjectStore) -> None:
    _round_trip(object_store)


def test_later_mutation_does_not_leak_into_snapshot(file_store: FileObjectStore) -> None:
    model, opt = _trainer()
    _train_step(model, opt)
    ck = Checkpointer(file_store, "c")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lr_before = opt.param_groups[0]["lr"]
    _snap(ck, 1, model, opt)
    with torch.no_grad():  # the trainer moves on while the upload runs
        for p in model.parameters():
            p.add_(1.0)
    opt.param_groups[0]["lr"] = 123.0
    ck.wait_uploaded(30)
    state = ck.load(1)
    assert all(torch.equal(state.model_state[k], before[k]) for k in before)
    assert state.optim_state["param_groups"][0]["lr"] == lr_before


def test_manifest_missing_means_invisible(file_store: FileObjectStore) -> None:
    model, opt = _trainer()
    ck = Checkpointer(file_store, "c")
    for step in (1, 2):
        _snap(ck, step, model, opt)
        ck.wait_uploaded(30)
    file_store.delete(ck.manifest_key(2))
    assert ck.list_complete() == [1]
    assert any(k.startswith("c/000000000002/") for k in file_store.list("c/"))  # blobs still there
    state = ck.load_latest()
    assert state is not None and state.step == 1
    with pytest.raises(CheckpointError) as err:
        ck.load(2)
    assert err.value.name == ck.manifest_key(2)


@pytest.mark.parametrize("name", ["../x", "", "a//b", "./m"])
def test_a_manifest_naming_a_blob_outside_its_folder_is_a_bad_checkpoint_not_a_store_failure(
        file_store: FileObjectStore, name: str) -> None:
    """Loading falls back to the older checkpoint (a StorageError here used to fail the gang's
    start as if S3 were down)."""
    model, opt = _trainer()
    ck = Checkpointer(file_store, "c")
    for step in (1, 2):
        _snap(ck, step, model, opt)
        ck.wait_uploaded(30)
    raw = json.loads(file_store.get(ck.manifest_key(2)))
    raw["blobs"][0]["name"] = name
    file_store.put(ck.manifest_key(2), json.dumps(raw).encode())
    state = ck.load_latest()
    assert state is not None and state.step == 1
    with pytest.raises(CheckpointError):
        ck.load(2)


class _FailingManifestStore(FileObjectStore):
    """Dies (raises) when the manifest is written: a trainer lost mid-upload."""

    def put(self, key: str, data: bytes) -> None:
        if key.endswith("manifest.json") and "000000000002" in key:
            raise StorageError("store went away", key=key)
        super().put(key, data)


def test_upload_dying_before_manifest_leaves_previous_durable(tmp_path: Path) -> None:
    store = _FailingManifestStore(tmp_path)
    model, opt = _trainer()
    ck = Checkpointer(store, "c")
    _snap(ck, 1, model, opt)
    assert ck.wait_uploaded(30) == 1
    _snap(ck, 2, model, opt)
    assert ck.wait_uploaded(30) == 1
    assert isinstance(ck.last_error, StorageError)
    assert ck.list_complete() == [1]
    assert store.list("c/000000000002/")  # blobs were written, yet the checkpoint does not exist
    state = ck.load_latest()
    assert state is not None and state.step == 1


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_damaged_newest_falls_back(file_store: FileObjectStore, caplog: pytest.LogCaptureFixture,
                                   damage: str) -> None:
    model, opt = _trainer()
    ck = Checkpointer(file_store, "c")
    for step in (1, 2):
        _train_step(model, opt)
        _snap(ck, step, model, opt)
        ck.wait_uploaded(30)
    blob = "c/000000000002/e00000000/r00000/tensors-00000.pt"
    if damage == "corrupt":
        data = bytearray(file_store.get(blob))
        data[len(data) // 2] ^= 0xFF
        file_store.put(blob, bytes(data))
    else:
        file_store.delete(blob)
    listing = file_store.list("")
    with pytest.raises(CheckpointError) as err:
        ck.load(2)
    assert err.value.name == blob and blob in str(err.value)
    with caplog.at_level(logging.WARNING, logger="robustrl.checkpoint"):
        state = ck.load_latest()
    assert state is not None and state.step == 1
    assert "skipping checkpoint step 2" in caplog.text and blob in caplog.text
    assert file_store.list("") == listing, "loading must not delete or alter a damaged checkpoint"
    if damage == "corrupt":
        assert file_store.get(blob) == bytes(data)


def test_store_failure_is_not_treated_as_corruption(file_store: FileObjectStore,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _trainer()
    ck = Checkpointer(file_store, "c")
    _snap(ck, 1, model, opt)
    ck.wait_uploaded(30)

    def down(key: str) -> bytes:
        raise StorageError("connection refused", key=key)

    monkeypatch.setattr(file_store, "get", down)
    with pytest.raises(StorageError) as err:
        ck.load_latest()
    assert not isinstance(err.value, CheckpointError)


def test_gc_keeps_newest_k(file_store: FileObjectStore) -> None:
    model, opt = _trainer()
    ck = Checkpointer(file_store, "c", keep=2)
    file_store.put("c/000000000000/e00000000/r00000/tensors-00000.pt", b"orphan of a crashed upload")
    for step in range(1, 6):
        _snap(ck, step, model, opt)
        ck.wait_uploaded(30)
    assert ck.list_complete() == [4, 5]
    assert {k.split("/")[1] for k in file_store.list("c/")} == {"000000000004", "000000000005"}


class _GatedStore(FileObjectStore):
    """Holds every put until ``gate`` is set: a slow upload."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = threading.Event()

    def put(self, key: str, data: bytes) -> None:
        assert self.gate.wait(30)
        super().put(key, data)


def test_snapshot_waits_for_previous_upload_bounded(tmp_path: Path) -> None:
    store = _GatedStore(tmp_path)
    model, opt = _trainer()
    ck = Checkpointer(store, "c", upload_wait_s=0.05)
    _snap(ck, 1, model, opt)
    with pytest.raises(CheckpointBusy):
        _snap(ck, 2, model, opt)
    with pytest.raises(TimeoutError):
        ck.wait_uploaded(0.01)
    ck.upload_wait_s = 30
    released: list[float] = []

    def release() -> None:
        released.append(time.perf_counter())
        store.gate.set()

    timer = threading.Timer(0.1, release)
    # The arguments first: built between ``called`` and the call, they were time the snapshot's
    # own wait does not count (suite55: 8 ms of it under load, against the 1 ms allowed).
    state = {"model_state": model.state_dict(), "optim_state": opt.state_dict(), "rng": capture_rng()}
    timer.start()
    called = time.perf_counter()
    stats = ck.snapshot(2, **state, data_cursor=0, weights_version=0)
    timer.join()
    # The snapshot could only copy once the first upload (held by the gate) was done.
    assert stats.wait_s >= released[0] - called - 5e-3
    assert ck.wait_uploaded(30) == 2
    assert ck.list_complete() == [1, 2]


def test_unsupported_value_rejected(file_store: FileObjectStore) -> None:
    model, opt = _trainer()
    with pytest.raises(CheckpointError) as err:
        _snap(Checkpointer(file_store, "c"), 1, model, opt, extra={"bad": object()})
    assert err.value.name == "extra.bad"


def _memcpy_s(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src).fill_(0)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return best


def test_blocking_snapshot_within_3x_memcpy(file_store: FileObjectStore) -> None:
    # ~50 MB: 4 x (1024x1024 + 1024) float32 weights (16.8 MB) plus AdamW's two moments.
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    ck = Checkpointer(file_store, "c", keep=1)
    ratios = []
    # Best-of-N on both sides: a loaded 2-core machine only ever makes a run slower.
    for _round in range(3):
        blocking = []
        for step in range(4):
            stats = ck.snapshot(step, model_state=model.state_dict(), optim_state=opt.state_dict(),
                                rng=capture_rng(), data_cursor=step, weights_version=step)
            ck.wait_uploaded(60)  # keep the upload thread out of the next measurement
            blocking.append(stats.blocking_s)
        assert stats.bytes > 45e6
        memcpy = _memcpy_s(stats.bytes)
        ratio = min(blocking[1:]) / memcpy  # the first snapshot allocates the buffers
        ratios.append(ratio)
        print(f"blocking {min(blocking[1:]) * 1e3:.2f} ms, memcpy {memcpy * 1e3:.2f} ms, "
              f"ratio {ratio:.2f}, first {blocking[0] * 1e3:.1f} ms")
        if ratio <= 3.0:
            break
    assert min(ratios) <= 3.0, ratios
