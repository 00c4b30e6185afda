"""Per-step checkpoint of the trainer: a blocking copy to host memory, then a background upload.

``Checkpointer.snapshot`` copies every tensor of the model, optimizer and RNG state into
preallocated host buffers that are reused from step to step, and returns; that copy is the
only part on the training critical path. A background thread then serializes the buffers into
blobs, uploads them, and writes the step's ``manifest.json`` last: a checkpoint exists only
once its manifest does (DESIGN section 2, step 5). Old checkpoints beyond ``keep`` are then
garbage-collected.

Layout under ``prefix``::

    <prefix>/<step:012d>/state.pt           structure with tensors replaced by references
    <prefix>/<step:012d>/tensors-00000.pt   tensors, in shards of up to ``shard_bytes``
    <prefix>/<step:012d>/manifest.json      step, versions, sha256 and size of every blob

Loading verifies every blob's sha256 and unpickles with ``weights_only=True``; a corrupt or
incomplete newest checkpoint makes ``load_latest`` fall back to the previous one.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from robustrl.errors import CheckpointError
from robustrl.storage.objects import ObjectNotFound, ObjectStore, check_key

log = logging.getLogger(__name__)

UPLOAD_WAIT_S = 300.0
"""How long ``snapshot`` waits for the previous upload before giving up (``CheckpointBusy``)."""
SHARD_BYTES = 256 * 1024 * 1024
"""Largest tensor shard blob; bounds the memory one serialization needs."""
MANIFEST = "manifest.json"
STATE_BLOB = "state.pt"
FORMAT = 1
_REF = "__robustrl_tensor__"


class CheckpointBusy(CheckpointError, TimeoutError):
    """The previous upload did not finish in time, so no new snapshot was taken."""

    retryable = True


@dataclass(frozen=True)
class SnapshotStats:
    """What one ``snapshot`` call cost the trainer."""

    step: int
    blocking_s: float
    """Time spent copying tensors into host buffers (the critical-path cost)."""
    wait_s: float
    """Time spent waiting for the previous upload to finish before copying."""
    bytes: int
    tensors: int


@dataclass(frozen=True)
class UploadStats:
    """The background part of one checkpoint."""

    step: int
    upload_s: float
    """Serialize + upload + manifest, wall time."""
    bytes: int
    """Bytes written to the object store."""


@dataclass
class CheckpointState:
    """A loaded checkpoint; tensors are on CPU."""

    step: int
    weights_version: int
    data_cursor: int
    model_state: dict[str, torch.Tensor]
    optim_state: dict[str, Any]
    rng: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)


# -- RNG --------------------------------------------------------------------------------------------


def capture_rng() -> dict[str, Any]:
    """The state of Python's, NumPy's and torch's global generators (CUDA too when initialized)."""
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            # int64 keeps the uint32 key exact and loads under weights_only.
            "key": torch.from_numpy(np.asarray(np_state["state"]["key"], dtype=np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set the global generators from a ``capture_rng()`` result."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state({
        "bit_generator": np_state["bit_generator"],
        "state": {"key": np.asarray(np_state["key"].numpy(), dtype=np.uint32), "pos": np_state["pos"]},
        "has_gauss": np_state["has_gauss"],
        "gauss": np_state["gauss"],
    })
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- structure <-> tensors --------------------------------------------------------------------------


def _restore(obj: Any, tensors: dict[int, torch.Tensor], key: str) -> Any:
    if isinstance(obj, dict):
        if len(obj) == 1 and _REF in obj:
            try:
                return tensors[obj[_REF]]
            except KeyError:
                raise CheckpointError(f"tensor {obj[_REF]} missing from shards", name=key) from None
        return {k: _restore(v, tensors, key) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_restore(v, tensors, key) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_restore(v, tensors, key) for v in obj)
    return obj


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


class Checkpointer:
    """Per-step checkpoints of one trainer under ``prefix`` in ``store``.

    Args:
        store: where blobs and manifests go.
        prefix: key prefix of this job's checkpoints, e.g. ``jobs/<job>/checkpoints``.
        keep: complete checkpoints kept; older ones are deleted after each upload.
        shard_bytes: largest tensor blob.
        upload_wait_s: bound on how long ``snapshot`` waits for the previous upload.
    """

    def __init__(self, store: ObjectStore, prefix: str, keep: int = 3, *, shard_bytes: int = SHARD_BYTES,
                 upload_wait_s: float = UPLOAD_WAIT_S) -> None:
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.store = store
        self.prefix = check_key(prefix.strip("/"))
        self.keep = keep
        self.shard_bytes = shard_bytes
        self.upload_wait_s = upload_wait_s
        self._buffers: list[torch.Tensor] = []
        self._idle = threading.Event()
        self._idle.set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._durable: int | None = None
        self._upload_stats: UploadStats | None = None
        self._error: BaseException | None = None
        self._pending_step: int | None = None

    # -- keys -------------------------------------------------------------------------------------

    def _dir(self, step: int) -> str:
        return f"{self.prefix}/{step:012d}"

    def manifest_key(self, step: int) -> str:
        """Object key of step's manifest."""
        return f"{self._dir(step)}/{MANIFEST}"

    # -- snapshot (critical path) -----------------------------------------------------------------

    def snapshot(self, step: int, *, model_state: dict[str, torch.Tensor], optim_state: dict[str, Any],
                 rng: dict[str, Any], data_cursor: int, weights_version: int,
                 extra: dict[str, Any] | None = None) -> SnapshotStats:
        """Copy the state into host buffers and start the background upload of checkpoint ``step``.

        Raises:
            CheckpointBusy: the previous upload was still running after ``upload_wait_s``.
            CheckpointError: the state holds a value that cannot be checkpointed.
        """
        t0 = time.perf_counter()
        if not self._idle.wait(self.upload_wait_s):
            raise CheckpointBusy(f"previous checkpoint upload still running after {self.upload_wait_s:.0f} s",
                                 step=self._pending_step)
        t1 = time.perf_counter()
        tensors: list[torch.Tensor] = []
        with torch.no_grad():
            structure = {
                "model": self._capture(model_state, tensors, "model"),
                "optim": self._capture(optim_state, tensors, "optim"),
                "rng": self._capture(rng, tensors, "rng"),
                "extra": self._capture(extra or {}, tensors, "extra"),
                "step": step, "weights_version": weights_version, "data_cursor": data_cursor,
            }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # non_blocking device->host copies must land before we return
        blocking_s = time.perf_counter() - t1
        nbytes = sum(t.nbytes for t in tensors)
        self._idle.clear()
        self._pending_step = step
        self._thread = threading.Thread(target=self._upload, args=(step, structure, tensors),
                                        name=f"checkpoint-upload-{step}", daemon=True)
        self._thread.start()
        return SnapshotStats(step=step, blocking_s=blocking_s, wait_s=t1 - t0, bytes=nbytes,
                             tensors=len(tensors))

    def _capture(self, obj: Any, tensors: list[torch.Tensor], path: str) -> Any:
        """Copy tensors into reusable host buffers; rebuild containers so later mutation is harmless."""
        if isinstance(obj, torch.Tensor):
            index = len(tensors)
            buf = self._buffer(index, obj)
            buf.copy_(obj.detach(), non_blocking=obj.device.type != "cpu")
            tensors.append(buf)
            return {_REF: index}
        if isinstance(obj, dict):
            return {k: self._capture(v, tensors, f"{path}.{k}") for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._capture(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(self._capture(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj))
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        raise CheckpointError(f"cannot checkpoint a {type(obj).__name__}", name=path)

    def _buffer(self, index: int, like: torch.Tensor) -> torch.Tensor:
        """The host buffer for the index-th tensor, reused when shape and dtype still match."""
        if index < len(self._buffers):
            buf = self._buffers[index]
            if buf.shape == like.shape and buf.dtype == like.dtype:
                return buf
        # Pinned memory makes device->host copies async and fast; plain memory for CPU tensors.
        buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=like.device.type == "cuda")
        if index < len(self._buffers):
            self._buffers[index] = buf
        else:
            self._buffers.append(buf)
        return buf

    # -- upload (background) ----------------------------------------------------------------------

    def _upload(self, step: int, structure: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        t0 = time.perf_counter()
        try:
            blobs = self._write_blobs(step, structure, tensors)
            manifest = {
                "format": FORMAT, "step": step, "weights_version": structure["weights_version"],
                "data_cursor": structure["data_cursor"], "created": time.time(), "blobs": blobs,
            }
            data = json.dumps(manifest, indent=1).encode()
            self.store.put(self.manifest_key(step), data)  # last: now the checkpoint exists
            with self._lock:
                if self._durable is None or step >= self._durable:
                    self._durable = step
                self._upload_stats = UploadStats(step, time.perf_counter() - t0,
                                                 sum(b["bytes"] for b in blobs) + len(data))
                self._error = None
        except Exception as exc:
            log.error("checkpoint upload of step %d failed: %s", step, exc)
            with self._lock:
                self._error = exc
            self._idle.set()
            return
        try:
            self._collect_garbage()
        except Exception as exc:
            log.warning("checkpoint gc after step %d failed: %s", step, exc)
        finally:
            self._idle.set()

    def _write_blobs(self, step: int, structure: dict[str, Any],
                     tensors: list[torch.Tensor]) -> list[dict[str, Any]]:
        # A previous attempt at this step (a trainer that died mid-upload, or a redo) may have left
        # a manifest and stale blobs: drop the manifest first so it never vouches for new blobs.
        self.store.delete(self.manifest_key(step))
        self.store.delete_prefix(self._dir(step) + "/")
        shards: list[dict[int, torch.Tensor]] = [{}]
        size = 0
        for index, tensor in enumerate(tensors):
            if shards[-1] and size + tensor.nbytes > self.shard_bytes:
                shards.append({})
                size = 0
            shards[-1][index] = tensor
            size += tensor.nbytes
        named = [(STATE_BLOB, structure)] + [(f"tensors-{i:05d}.pt", s) for i, s in enumerate(shards)]
        blobs = []
        for name, obj in named:
            data = _torch_bytes(obj)
            self.store.put(f"{self._dir(step)}/{name}", data)
            blobs.append({"name": name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)})
        return blobs

    def _collect_garbage(self) -> None:
        """Keep the newest ``keep`` complete checkpoints; drop older ones and older partial uploads."""
        complete, all_steps = self._scan()
        if not complete:
            return
        kept = set(complete[-self.keep:])
        for step in all_steps:
            # Partial uploads newer than the newest complete one may still be in progress elsewhere.
            if step in kept or step > complete[-1]:
                continue
            self.store.delete(self.manifest_key(step))  # invisible first, then the blobs
            self.store.delete_prefix(self._dir(step) + "/")

    def _scan(self) -> tuple[list[int], list[int]]:
        complete: set[int] = set()
        every: set[int] = set()
        for key in self.store.list(self.prefix + "/"):
            parts = key[len(self.prefix) + 1:].split("/")
            if len(parts) != 2 or not parts[0].isdigit():
                continue
            every.add(int(parts[0]))
            if parts[1] == MANIFEST:
                complete.add(int(parts[0]))
        return sorted(complete), sorted(every)

    # -- upload status ----------------------------------------------------------------------------

    def wait_uploaded(self, timeout_s: float) -> int | None:
        """Wait for the running upload; return the step of the newest durable checkpoint (or None).

        Raises:
            TimeoutError: the upload was still running after ``timeout_s``.
        """
        if not self._idle.wait(timeout_s):
            raise TimeoutError(f"checkpoint upload of step {self._pending_step} not done after {timeout_s} s")
        return self.durable_step

    @property
    def durable_step(self) -> int | None:
        """Newest step this checkpointer has made durable (its manifest is written)."""
        with self._lock:
            return self._durable

    @property
    def upload_stats(self) -> UploadStats | None:
        """Stats of the last successful upload."""
        with self._lock:
            return self._upload_stats

    @property
    def last_error(self) -> BaseException | None:
        """Why the last upload failed, or None if it succeeded."""
        with self._lock:
            return self._error

    def close(self, timeout_s: float = UPLOAD_WAIT_S) -> int | None:
        """Wait for the running upload to finish; return the durable step."""
        return self.wait_uploaded(timeout_s)

    # -- loading ----------------------------------------------------------------------------------

    def list_complete(self) -> list[int]:
        """Steps whose manifest exists, oldest first."""
        return self._scan()[0]

    def load(self, step: int) -> CheckpointState:
        """Load and verify checkpoint ``step``.

        Raises:
            CheckpointError: manifest or a blob is missing, has the wrong size or sha256, or
                cannot be read; ``name`` is the object key.
            StorageError: the store itself failed (retry may help; nothing is known about the data).
        """
        mkey = self.manifest_key(step)
        try:
            manifest = json.loads(self.store.get(mkey))
            blobs = [(str(b["name"]), str(b["sha256"]), int(b["bytes"])) for b in manifest["blobs"]]
            if int(manifest["step"]) != step:
                raise ValueError(f"manifest is for step {manifest['step']}")
        except ObjectNotFound as exc:
            raise CheckpointError("checkpoint manifest missing", name=mkey, step=step) from exc
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"checkpoint manifest unreadable: {exc}", name=mkey, step=step) from exc
        loaded: dict[str, Any] = {}
        for name, sha, size in blobs:
            key = f"{self._dir(step)}/{name}"
            try:
                data = self.store.get(key)
            except ObjectNotFound as exc:
                raise CheckpointError("checkpoint blob missing", name=key, step=step) from exc
            if len(data) != size or hashlib.sha256(data).hexdigest() != sha:
                raise CheckpointError("checkpoint blob corrupt: size or sha256 mismatch", name=key, step=step)
            try:
                loaded[name] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except Exception as exc:
                raise CheckpointError(f"checkpoint blob unreadable: {exc}", name=key, step=step) from exc
        skey = f"{self._dir(step)}/{STATE_BLOB}"
        if STATE_BLOB not in loaded:
            raise CheckpointError("checkpoint manifest lists no state blob", name=skey, step=step)
        tensors: dict[int, torch.Tensor] = {}
        for name, obj in loaded.items():
            if name != STATE_BLOB:
                tensors.update(obj)
        state = _restore(loaded[STATE_BLOB], tensors, skey)
        return CheckpointState(step=step, weights_version=int(state["weights_version"]),
                               data_cursor=int(state["data_cursor"]), model_state=state["model"],
                               optim_state=state["optim"], rng=state["rng"], extra=state["extra"])

    def load_latest(self) -> CheckpointState | None:
        """The newest checkpoint that loads and verifies, or None if there is none.

        A corrupt or incomplete checkpoint is skipped (logged with its reason) and left as it is.
        Store failures (``StorageError`` that is not a ``CheckpointError``) propagate: falling back
        on a transient error would silently lose progress.
        """
        for step in reversed(self.list_complete()):
            try:
                return self.load(step)
            except CheckpointError as exc:
                log.warning("skipping checkpoint step %d: %s", step, exc)
        return None
