"""Reading a checkpoint back: every blob verified, unpickled with ``weights_only=True``, and the
ranks' structures reassembled into one :class:`CheckpointState`."""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field
from typing import Any

import torch

from robustrl.checkpoint_catalog import CheckpointRef, fetch_blob, read_manifest
from robustrl.errors import CheckpointError
from robustrl.storage.objects import ObjectStore

STATE_BLOB = "state.pt"
REF = "__robustrl_tensor__"


@dataclass
class CheckpointState:
    """A loaded checkpoint; tensors are on CPU. ``rng`` is rank 0's; ``ranks`` holds each other
    rank's own state (``rng``, ``extra``)."""

    step: int
    weights_version: int
    data_cursor: int
    model_state: dict[str, torch.Tensor]
    optim_state: dict[str, Any]
    rng: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)
    epoch: int = 0
    ranks: dict[int, dict[str, Any]] = field(default_factory=dict)

    def rng_for(self, rank: int) -> dict[str, Any] | None:
        """The RNG state rank ``rank`` saved, or None (a gang of another size)."""
        if rank == 0:
            return self.rng
        return self.ranks.get(rank, {}).get("rng")


def restore_structure(obj: Any, tensors: dict[int, torch.Tensor], key: str) -> Any:
    if isinstance(obj, dict):
        if len(obj) == 1 and REF in obj:
            try:
                return tensors[obj[REF]]
            except KeyError:
                raise CheckpointError(f"tensor {obj[REF]} missing from shards", name=key) from None
        return {k: restore_structure(v, tensors, key) for k, v in obj.items()}
    if isinstance(obj, list):
        return [restore_structure(v, tensors, key) for v in obj]
    if isinstance(obj, tuple):
        return tuple(restore_structure(v, tensors, key) for v in obj)
    return obj


def _torch_load(data: bytes, key: str) -> Any:
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"checkpoint blob unreadable: {exc}", name=key) from exc




def read_checkpoint(store: ObjectStore, prefix: str, ref: CheckpointRef) -> tuple[CheckpointState, str]:
    """Load and verify checkpoint ``ref``; return it with its manifest's sha256.

    Raises:
        CheckpointError: manifest or a blob is missing, has the wrong size or sha256, or cannot be
            read, or rank 0's model state is absent; ``name`` is the object key.
        StorageError: the store itself failed (retry may help; nothing is known about the data).
    """
    manifest, raw = read_manifest(store, prefix, ref)
    per_rank: dict[int, dict[str, Any]] = {}
    for blob in manifest.blobs:
        data = fetch_blob(store, prefix, ref, blob)
        key = f"{ref.folder(prefix)}/{blob.name}"
        per_rank.setdefault(blob.rank, {})[blob.name.split("/", 1)[-1]] = _torch_load(data, key)
    states: dict[int, dict[str, Any]] = {}
    for rank, loaded in per_rank.items():
        skey = f"{ref.rank_folder(prefix, rank)}/{STATE_BLOB}"
        if STATE_BLOB not in loaded:
            raise CheckpointError("checkpoint manifest lists no state blob", name=skey, step=ref.step)
        tensors: dict[int, torch.Tensor] = {}
        for name, obj in loaded.items():
            if name != STATE_BLOB:
                tensors.update(obj)
        states[rank] = restore_structure(loaded[STATE_BLOB], tensors, skey)
    main = states.get(0)
    if main is None or "model" not in main or "optim" not in main:
        raise CheckpointError("checkpoint has no model state from rank 0", name=ref.manifest_key(prefix),
                              step=ref.step)
    state = CheckpointState(step=ref.step, weights_version=manifest.weights_version,
                            data_cursor=manifest.data_cursor, model_state=main["model"],
                            optim_state=main["optim"], rng=main["rng"], extra=main["extra"], epoch=ref.epoch,
                            ranks={r: {"rng": s["rng"], "extra": s["extra"]} for r, s in states.items() if r})
    return state, hashlib.sha256(raw).hexdigest()
