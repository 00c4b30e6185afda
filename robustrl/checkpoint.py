"""Per-step checkpoint of a trainer gang: a blocking copy to host memory, then a background upload.

``Checkpointer.snapshot`` copies every tensor of the rank's state into preallocated host buffers
that are reused from step to step, and returns; that copy is the only part on the training
critical path. A background thread then serializes the buffers into blobs and uploads them under
keys of this rank and this gang epoch only (``robustrl.checkpoint_catalog`` has the layout).

One writer per key: rank 0 writes the replicated state (model, optimizer, data cursor), every
other rank only its own state (RNG). A rank other than 0 finishes with a receipt naming its
blobs; rank 0, the coordinator, waits for every receipt, reads each named blob back and checks its
size and sha256, asks the gang's fence whether this epoch may still publish, and only then writes
the manifest: a checkpoint exists once its manifest does (DESIGN section 2, step 5). Nothing is
deleted before writing; GC (rank 0, after a manifest) keeps the newest ``keep`` checkpoints that
verify and never deletes the newest loadable one.

Loading verifies every blob's sha256 and unpickles with ``weights_only=True``; a corrupt,
incomplete or superseded newest checkpoint makes ``load_latest`` fall back to the previous one.
"""

from __future__ import annotations

import hashlib
import io
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from tenacity import RetryError, Retrying, retry_if_exception_type, stop_after_delay, stop_any, wait_exponential

from robustrl.checkpoint_catalog import (
    BlobEntry,
    CheckpointRef,
    Manifest,
    ShardReceipt,
    Origin,
    fetch_blob,
    gc_deletions,
    loadable,
    manifest_bytes,
    origin_bytes,
    origin_key,
    read_manifest,
    read_receipt,
    receipt_bytes,
    scan,
    verify,
)
from robustrl.checkpoint_reader import REF, STATE_BLOB, CheckpointState, read_checkpoint
from robustrl.errors import CheckpointError
from robustrl.rng import capture_rng, restore_rng, seed_rng
from robustrl.storage.objects import ObjectNotFound, ObjectStore, check_key

__all__ = ["CheckpointBusy", "CheckpointState", "Checkpointer", "ManifestFence", "SnapshotStats", "UploadStats",
           "capture_rng", "restore_rng", "seed_rng"]

log = logging.getLogger(__name__)

UPLOAD_WAIT_S = 300.0
"""How long ``snapshot`` waits for the previous upload before giving up (``CheckpointBusy``)."""
SHARD_WAIT_S = 120.0
"""How long the coordinator waits for every other rank's receipt before giving up on a step."""
SHARD_BYTES = 256 * 1024 * 1024
"""Largest tensor shard blob; bounds the memory one serialization needs."""


class CheckpointBusy(CheckpointError, TimeoutError):
    """The previous upload did not finish in time, so no new snapshot was taken."""

    retryable = True


class ManifestFence(Protocol):
    """The gang's fence as the upload thread sees it (blocking calls)."""

    def admit(self, step: int) -> None:
        """Raise ``StaleEpoch`` if this gang may no longer publish a checkpoint."""

    def durable(self, step: int) -> None:
        """Record ``step`` as this gang's newest durable checkpoint; raise ``StaleEpoch`` if refused."""


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
    """Serialize + upload (+ verify shards + manifest on the coordinator), wall time."""
    bytes: int
    """Bytes this rank wrote to the object store."""


# -- structure <-> tensors --------------------------------------------------------------------------


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


class Checkpointer:
    """Per-step checkpoints of one trainer rank under ``prefix`` in ``store``.

    Args:
        store: where blobs and manifests go.
        prefix: key prefix of this job's checkpoints, e.g. ``jobs/<job>/checkpoints``.
        keep: verified checkpoints kept by GC (rank 0 only collects garbage).
        rank, world_size: this rank in its gang; rank 0 coordinates and writes the manifest.
        epoch: the gang's epoch; it names this gang's keys and is written in its manifests.
        fence: asked before each manifest (rank 0); None when nothing fences this writer.
        shard_bytes: largest tensor blob.
        upload_wait_s: bound on how long ``snapshot`` waits for the previous upload.
        shard_wait_s: bound on how long rank 0 waits for the other ranks' receipts.
    """

    def __init__(self, store: ObjectStore, prefix: str, keep: int = 3, *, rank: int = 0, world_size: int = 1,
                 epoch: int = 0, fence: ManifestFence | None = None, shard_bytes: int = SHARD_BYTES,
                 upload_wait_s: float = UPLOAD_WAIT_S, shard_wait_s: float = SHARD_WAIT_S) -> None:
        if keep < 1:
            raise ValueError("keep must be >= 1")
        if not 0 <= rank < world_size or epoch < 0:
            raise ValueError(f"bad rank {rank} / world_size {world_size} / epoch {epoch}")
        self.store = store
        self.prefix = check_key(prefix.strip("/"))
        self.keep = keep
        self.rank, self.world_size, self.epoch, self.fence = rank, world_size, epoch, fence
        self.shard_bytes = shard_bytes
        self.upload_wait_s = upload_wait_s
        self.shard_wait_s = shard_wait_s
        self._buffers: list[torch.Tensor] = []
        self._idle = threading.Event()
        self._idle.set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._durable: int | None = None
        self._upload_stats: UploadStats | None = None
        self._error: BaseException | None = None
        self._pending_step: int | None = None
        self._last_snapshot: tuple[int, dict[str, Any], list[torch.Tensor]] | None = None
        self._abandoned = threading.Event()
        # Verification results by manifest sha256, so GC re-reads only checkpoints it has not seen.
        self._verdicts: dict[tuple[CheckpointRef, str], bool] = {}
        self._origins: dict[int, CheckpointRef | None | CheckpointError] = {}
        """Gang origins read so far (written once, never changed)."""

    def manifest_key(self, step: int, epoch: int | None = None) -> str:
        """Object key of the manifest of ``step`` written by ``epoch`` (default: this gang's)."""
        return CheckpointRef(step, self.epoch if epoch is None else epoch).manifest_key(self.prefix)

    # -- snapshot (critical path) -----------------------------------------------------------------

    def snapshot(self, step: int, *, rng: dict[str, Any], data_cursor: int, weights_version: int,
                 model_state: dict[str, torch.Tensor] | None = None, optim_state: dict[str, Any] | None = None,
                 extra: dict[str, Any] | None = None) -> SnapshotStats:
        """Copy this rank's state into host buffers and start the background upload of ``step``.

        Rank 0 passes the replicated state (model, optimizer); other ranks pass only their own.

        Raises:
            CheckpointBusy: the previous upload was still running after ``upload_wait_s``.
            CheckpointError: the state holds a value that cannot be checkpointed.
            ValueError: rank 0 without model/optimizer state, or another rank with it.
        """
        if (self.rank == 0) != (model_state is not None and optim_state is not None):
            raise ValueError("rank 0, and only rank 0, writes the replicated model and optimizer state")
        t0 = time.perf_counter()
        if not self._idle.wait(self.upload_wait_s):
            raise CheckpointBusy(f"previous checkpoint upload still running after {self.upload_wait_s:.0f} s",
                                 step=self._pending_step)
        t1 = time.perf_counter()
        tensors: list[torch.Tensor] = []
        with torch.no_grad():
            structure: dict[str, Any] = {
                "rng": self._capture(rng, tensors, "rng"),
                "extra": self._capture(extra or {}, tensors, "extra"),
                "step": step, "weights_version": weights_version, "data_cursor": data_cursor,
            }
            if self.rank == 0:
                structure["model"] = self._capture(model_state, tensors, "model")
                structure["optim"] = self._capture(optim_state, tensors, "optim")
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # non_blocking device->host copies must land before we return
        blocking_s = time.perf_counter() - t1
        nbytes = sum(t.nbytes for t in tensors)
        self._last_snapshot = (step, structure, tensors)
        self._start_upload(step, structure, tensors)
        return SnapshotStats(step=step, blocking_s=blocking_s, wait_s=t1 - t0, bytes=nbytes,
                             tensors=len(tensors))

    def _start_upload(self, step: int, structure: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        self._idle.clear()
        self._pending_step = step
        self._thread = threading.Thread(target=self._upload, args=(step, structure, tensors),
                                        name=f"checkpoint-upload-{step}", daemon=True)
        self._thread.start()

    def upload_again(self) -> int | None:
        """Upload the last snapshot again, in the background (its upload failed: e.g. the job's
        last step, which no later snapshot replaces). Its host buffers still hold it: no snapshot
        was taken since. Its keys are this rank's and gang's, written again whole. Returns its
        step, or None when there is none or an upload still runs."""
        if self._last_snapshot is None or not self._idle.is_set():
            return None
        step, structure, tensors = self._last_snapshot
        self._start_upload(step, structure, tensors)
        return step

    def _capture(self, obj: Any, tensors: list[torch.Tensor], path: str) -> Any:
        """Copy tensors into reusable host buffers; rebuild containers so later mutation is harmless."""
        if isinstance(obj, torch.Tensor):
            index = len(tensors)
            buf = self._buffer(index, obj)
            buf.copy_(obj.detach(), non_blocking=obj.device.type != "cpu")
            tensors.append(buf)
            return {REF: index}
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
        ref = CheckpointRef(step, self.epoch)
        committed = False
        try:
            own = self._write_blobs(ref, structure, tensors)
            written = sum(b.bytes for b in own)
            if self.rank != 0:
                receipt = receipt_bytes(ShardReceipt(step=step, epoch=self.epoch, rank=self.rank, blobs=own))
                self.store.put(ref.receipt_key(self.prefix, self.rank), receipt)  # last: the shard is whole
                written += len(receipt)
            else:
                blobs = own + self._collect_shards(ref)
                self._check_abandoned(ref)
                if self.fence is not None:
                    self.fence.admit(step)
                data = manifest_bytes(Manifest(step=step, epoch=self.epoch, world_size=self.world_size,
                                               weights_version=structure["weights_version"],
                                               data_cursor=structure["data_cursor"], created=time.time(),
                                               blobs=blobs))
                self.store.put(ref.manifest_key(self.prefix), data)  # last: now the checkpoint exists
                written += len(data)
                # Durable to the rest of the job only once the fenced record says so: advertised
                # first (StepCommitted.durable_step), a failed record write let the request manager
                # delete batch ``step`` while the record, which the next gang resumes by, still
                # named the step before (an outside review found it).
                if self.fence is not None:
                    self.fence.durable(step)
                with self._lock:
                    self._durable = step if self._durable is None else max(self._durable, step)
                committed = True
            with self._lock:
                self._upload_stats = UploadStats(step, time.perf_counter() - t0, written)
                self._error = None
        except Exception as exc:  # noqa: BLE001 - the thread records any failure for the trainer to see
            log.error("checkpoint upload of step %d (rank %d, epoch %d) failed: %s", step, self.rank, self.epoch, exc)
            with self._lock:
                self._error = exc
        try:
            if committed:
                self._collect_garbage()
        except Exception as exc:  # noqa: BLE001 - GC failing must not fail the checkpoint it follows
            log.warning("checkpoint gc after step %d failed: %s", step, exc)
        finally:
            self._idle.set()

    def _write_blobs(self, ref: CheckpointRef, structure: dict[str, Any],
                     tensors: list[torch.Tensor]) -> list[BlobEntry]:
        # Keys of this rank and epoch only, never deleted first: a redo by a newer gang writes
        # keys of its own, and a stale writer can clobber nothing but its own.
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
        folder = f"r{self.rank:05d}"
        for name, obj in named:
            data = _torch_bytes(obj)
            self.store.put(f"{ref.folder(self.prefix)}/{folder}/{name}", data)
            blobs.append(BlobEntry(name=f"{folder}/{name}", sha256=hashlib.sha256(data).hexdigest(),
                                   bytes=len(data), rank=self.rank))
        return blobs

    def _collect_shards(self, ref: CheckpointRef) -> list[BlobEntry]:
        """Every other rank's blobs, each read back and checked against its receipt.

        Raises:
            CheckpointError: a rank reported nothing within ``shard_wait_s``, or a blob it
                reported is missing or differs.
        """
        deadline = time.monotonic() + self.shard_wait_s
        blobs: list[BlobEntry] = []
        for rank in range(1, self.world_size):
            waiting = Retrying(retry=retry_if_exception_type(ObjectNotFound),
                               stop=stop_any(stop_after_delay(max(0.0, deadline - time.monotonic())),
                                             lambda _state: self._abandoned.is_set()),
                               wait=wait_exponential(multiplier=0.01, max=0.5))
            try:
                receipt = waiting(read_receipt, self.store, self.prefix, ref, rank)
            except RetryError as exc:
                raise CheckpointError(f"rank {rank} reported no shard within {self.shard_wait_s:.0f} s",
                                      name=ref.receipt_key(self.prefix, rank), step=ref.step) from exc
            for blob in receipt.blobs:
                fetch_blob(self.store, self.prefix, ref, blob)
            blobs.extend(receipt.blobs)
        return blobs

    # -- GC ---------------------------------------------------------------------------------------

    def _verifies(self, ref: CheckpointRef) -> bool:
        """Whether ``ref`` verifies (cached by manifest sha256). Store failures propagate."""
        try:
            _manifest, raw = read_manifest(self.store, self.prefix, ref)
        except CheckpointError:
            return False
        key = (ref, hashlib.sha256(raw).hexdigest())
        if key not in self._verdicts:
            try:
                verify(self.store, self.prefix, ref)
                self._verdicts[key] = True
            except CheckpointError as exc:
                log.warning("checkpoint step %d epoch %d does not verify: %s", ref.step, ref.epoch, exc)
                self._verdicts[key] = False
        return self._verdicts[key]

    def _collect_garbage(self) -> None:
        """Keep the newest ``keep`` checkpoints that verify; drop what is older or bad below them."""
        listing = scan(self.store, self.prefix)
        kept: list[CheckpointRef] = []
        for ref in loadable(self.store, self.prefix, listing, self._origins):
            if len(kept) == self.keep:
                break
            if self._verifies(ref):
                kept.append(ref)
        doomed = set(gc_deletions(listing, kept, self.epoch))
        for ref in sorted(doomed):
            if ref in listing.manifests:
                self.store.delete(ref.manifest_key(self.prefix))  # invisible first, then the blobs
            self.store.delete_prefix(ref.folder(self.prefix) + "/")
        self._verdicts = {k: v for k, v in self._verdicts.items() if k[0] not in doomed}

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
        """Newest step whose manifest this (coordinating) checkpointer wrote."""
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

    def abandon(self) -> None:
        """Give up the running upload: its thread writes no manifest (and stops waiting for the
        other ranks' shards). For a rank leaving its gang: a newer gang owns the lineage now."""
        self._abandoned.set()

    def _check_abandoned(self, ref: CheckpointRef) -> None:
        if self._abandoned.is_set():
            raise CheckpointError("upload abandoned: this rank left its gang", name=ref.manifest_key(self.prefix),
                                  step=ref.step)

    def close(self, timeout_s: float = UPLOAD_WAIT_S) -> int | None:
        """Wait for the running upload to finish; return the durable step."""
        return self.wait_uploaded(timeout_s)

    # -- loading ----------------------------------------------------------------------------------

    def start_lineage(self, state: CheckpointState | None) -> None:
        """Record where this gang's lineage starts: ``state``, the checkpoint it resumed from
        (None: the initial weights). The coordinator calls it once the gang has agreed where to
        resume and before it trains or commits anything: from then on a manifest of an older gang
        above that step (an upload that passed the fence just before the take-over) is off the
        lineage and never loaded, even before this gang writes a checkpoint of its own.

        Raises:
            StorageError: the store failed (the gang must not train: its start fails).
        """
        origin = Origin(epoch=self.epoch, from_step=None if state is None else state.step,
                        from_epoch=None if state is None else state.epoch, created=time.time())
        self.store.put(origin_key(self.prefix, self.epoch), origin_bytes(origin))
        self._origins.pop(self.epoch, None)

    def list_complete(self) -> list[int]:
        """Steps with a manifest that is not superseded (not yet verified), oldest first."""
        return sorted(r.step for r in loadable(self.store, self.prefix, cache=self._origins))

    def load(self, step: int, epoch: int | None = None) -> CheckpointState:
        """Load and verify checkpoint ``step`` (of ``epoch``; default: the one the lineage picks).

        Raises:
            CheckpointError: manifest or a blob is missing, has the wrong size or sha256, or
                cannot be read; ``name`` is the object key.
            StorageError: the store itself failed (retry may help; nothing is known about the data).
        """
        if epoch is None:
            chosen = [r for r in loadable(self.store, self.prefix, cache=self._origins) if r.step == step]
            epoch = chosen[0].epoch if chosen else self.epoch
        ref = CheckpointRef(step, epoch)
        state, manifest_sha = read_checkpoint(self.store, self.prefix, ref)
        self._verdicts[(ref, manifest_sha)] = True
        return state

    def load_latest(self) -> CheckpointState | None:
        """The newest checkpoint that loads and verifies, or None if there is none.

        A corrupt, incomplete or superseded checkpoint is skipped (logged with its reason) and left
        as it is. Store failures (``StorageError`` that is not a ``CheckpointError``) propagate:
        falling back on a transient error would silently lose progress.
        """
        for ref in loadable(self.store, self.prefix, cache=self._origins):
            try:
                return self.load(ref.step, ref.epoch)
            except CheckpointError as exc:
                log.warning("skipping checkpoint step %d (epoch %d): %s", ref.step, ref.epoch, exc)
        return None
