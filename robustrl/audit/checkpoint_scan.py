"""The object store read raw: every checkpoint manifest, every blob it names fetched and hashed
here, the model in rank 0's blobs hashed again the way weights are published, and the gang origins.

Only the stored format is assumed (``robustrl.checkpoint_catalog`` documents it): a manifest names
its blobs relative to its own folder, each under the folder of the rank that wrote it
(``r<rank:05d>/``); a rank's ``state.pt`` holds its structure with tensors as references
(``{"__robustrl_tensor__": index}``) into its ``tensors-*.pt`` shards, and rank 0's structure holds
the model's state dict under ``model``. No service is asked and no store class of the services is
used; torch is needed only to unpickle blobs (imported when a checkpoint is hashed, so the control
plane can import the auditor without it).
"""

from __future__ import annotations

import hashlib
import io
import re
from dataclasses import dataclass, field
from typing import Any

from robustrl.checkpoint_catalog import ascii_digits
from robustrl.errors import MessageError, StorageError
from robustrl.messages import loads_bounded
from robustrl.storage.objects import ObjectStore

MANIFEST = "manifest.json"
STATE_BLOB = "state.pt"
TENSOR_REF = "__robustrl_tensor__"
"""How a rank's structure refers to a tensor of its shards (the format's marker)."""
RANK_BLOB = re.compile(r"^r(\d{5})/([^/]+)$")
"""A blob's name relative to its checkpoint folder: inside the folder of the rank that wrote it."""


@dataclass
class RawCheckpoint:
    """One manifest found in the object store and what reading its blobs showed."""

    manifest_key: str
    step: int | None
    manifest: dict[str, Any] | None
    epoch: int | None = None
    problems: list[str] = field(default_factory=list)
    """Why it would not load as its format says (a blob missing, corrupt, outside its folder, a
    state that does not unpickle); empty when every blob read back matches the manifest."""
    weights_checksum: str | None = None
    """sha256 of the model state in rank 0's blobs, computed here as published weights are
    (sorted tensor names; name, dtype, shape, raw bytes). None: not computed (``weights_note``)."""
    weights_note: str | None = None
    """Why the model was not hashed, when ``problems`` does not already say."""

    @property
    def loadable(self) -> bool:
        """Every blob it names is present, inside its folder, and matches its size and sha256."""
        return self.manifest is not None and not self.problems

    @property
    def folder(self) -> str:
        return self.manifest_key.rsplit("/", 1)[0]


def _json(raw: bytes) -> Any:
    try:  # bounded: garbage in a manifest (deep nesting) must not blow the auditor's stack
        return loads_bounded(raw, what="stored value")
    except MessageError:
        return None


def job_prefix(job_id: str) -> str:
    """Everything a job keeps in the object store lives under this prefix."""
    return f"jobs/{job_id}/"


def folder_ref(manifest_key: str) -> tuple[int | None, int | None]:
    """(step, epoch) named by a manifest's folder: ``.../<step:012d>[/e<epoch:08d>]/manifest.json``."""
    parts = manifest_key.split("/")[:-1]
    step = epoch = None
    if parts and parts[-1][:1] == "e" and ascii_digits(parts[-1][1:]):
        epoch = int(parts[-1][1:])
        parts = parts[:-1]
    if parts and ascii_digits(parts[-1]):
        step = int(parts[-1])
    return step, epoch


def blob_key(folder: str, blob: dict[str, Any]) -> tuple[str | None, str | None]:
    """(object key, problem) of one manifest entry. A blob is read only from its own rank's folder
    inside the manifest's own: a name that leaves it, or an explicit key elsewhere, would make the
    checkpoint borrow bytes another step or gang wrote (the loader reads ``folder/name`` alone)."""
    name = blob.get("name")
    shaped = RANK_BLOB.match(name) if isinstance(name, str) else None
    if shaped is None:
        return None, f"blob {name!r}: not a name inside a rank's folder of this checkpoint"
    key = f"{folder}/{name}"
    for other in ("key", "path"):
        given = blob.get(other)
        if given is not None and given != key:
            return None, f"blob {name}: names {other} {given!r}, outside its checkpoint folder {folder}/"
    rank = blob.get("rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank != int(shaped.group(1)):
        return None, f"blob {name}: says rank {rank!r} but lies in the folder of rank {int(shaped.group(1))}"
    return key, None


def scan_checkpoints(store: ObjectStore, job_id: str) -> list[RawCheckpoint]:
    """Every manifest under the job's prefix, each blob it names fetched and hashed here, and the
    model of every checkpoint whose blobs all verify hashed again.

    Raises:
        StorageError: the store itself failed (listing or a read other than a missing key).
    """
    from robustrl.storage.objects import ObjectNotFound

    out = []
    for mkey in store.list(job_prefix(job_id)):
        if not mkey.endswith("/" + MANIFEST):
            continue
        try:
            manifest = _json(store.get(mkey))
        except ObjectNotFound:
            continue  # deleted between listing and reading (GC); it no longer vouches for anything
        step, epoch = folder_ref(mkey)
        ck = RawCheckpoint(manifest_key=mkey, step=step, epoch=epoch,
                           manifest=manifest if isinstance(manifest, dict) else None)
        if ck.manifest is None:
            ck.problems.append("manifest is not a JSON object")
            out.append(ck)
            continue
        for name, folder in (("step", ck.step), ("epoch", ck.epoch)):
            named = ck.manifest.get(name)
            if folder is None:
                ck.step = named if name == "step" and isinstance(named, int) else ck.step
            elif named != folder:
                ck.problems.append(f"manifest names {name} {named} but sits in the folder of {name} {folder}")
        rank0 = _read_blobs(store, ck)
        if not ck.problems:
            _hash_model(ck, rank0)
        out.append(ck)
    return out


def _read_blobs(store: ObjectStore, ck: RawCheckpoint) -> dict[str, bytes]:
    """Fetch and check every blob of ``ck`` (problems go on ``ck``); return rank 0's, by file name."""
    from robustrl.storage.objects import ObjectNotFound

    assert ck.manifest is not None
    blobs = ck.manifest.get("blobs")
    if not isinstance(blobs, list) or not blobs:
        ck.problems.append("manifest names no blobs")
    rank0: dict[str, bytes] = {}
    for blob in blobs if isinstance(blobs, list) else []:
        if not isinstance(blob, dict):
            ck.problems.append(f"blob entry is not an object: {blob!r}")
            continue
        key, problem = blob_key(ck.folder, blob)
        if key is None:
            ck.problems.append(str(problem))
            continue
        try:
            data = store.get(key)
        except ObjectNotFound:
            ck.problems.append(f"blob missing: {key}")
            continue
        except StorageError:
            raise
        size, sha = blob.get("bytes", blob.get("size")), blob.get("sha256")
        if size is not None and (not isinstance(size, int) or len(data) != size):
            ck.problems.append(f"blob {key}: {len(data)} bytes, manifest says {size}")
        elif sha is None:
            ck.problems.append(f"blob {key}: manifest gives no sha256")
        elif hashlib.sha256(data).hexdigest() != sha:
            ck.problems.append(f"blob {key}: sha256 mismatch")
        elif blob.get("rank") == 0:
            rank0[str(blob["name"]).split("/", 1)[1]] = data
    return rank0


def _hash_model(ck: RawCheckpoint, rank0: dict[str, bytes]) -> None:
    """Set ``ck.weights_checksum`` from rank 0's blobs; a state that cannot be read is a problem
    (the trainer could not load it either)."""
    try:
        import torch
    except ImportError:
        ck.weights_note = "torch is not installed here: the checkpointed model was not hashed"
        return
    if STATE_BLOB not in rank0:
        ck.weights_note = "rank 0 wrote no state blob"  # the coverage check names it
        return
    loaded: dict[str, Any] = {}
    for name, data in rank0.items():
        try:
            loaded[name] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - unpickling garbage raises any type
            ck.problems.append(f"blob r00000/{name} does not unpickle: {exc!r}"[:300])
            return
    tensors: dict[Any, Any] = {}
    for name, obj in loaded.items():
        if name != STATE_BLOB and isinstance(obj, dict):
            tensors.update(obj)
    structure = loaded[STATE_BLOB]
    model = structure.get("model") if isinstance(structure, dict) else None
    if not isinstance(model, dict) or not model:
        ck.problems.append("rank 0's state holds no model")
        return
    state: dict[str, Any] = {}
    for name, ref in model.items():
        index = ref.get(TENSOR_REF) if isinstance(ref, dict) and len(ref) == 1 else None
        tensor = tensors.get(index) if index is not None else ref
        if not isinstance(tensor, torch.Tensor):
            ck.problems.append(f"model tensor {name!r} is missing from rank 0's shards")
            return
        state[str(name)] = tensor
    ck.weights_checksum = state_checksum(state)


def state_checksum(state: dict[str, Any]) -> str:
    """The published weights checksum of a state dict: sha256 over its tensors in sorted name order
    (a DDP wrapper's ``module.`` prefix stripped), each as name, ``|dtype|shape|`` and raw bytes.
    Written here from that definition, not imported, so the auditor does not take the trainer's
    word for how its own checksum is made."""
    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted(((n.removeprefix("module."), t) for n, t in state.items()), key=lambda x: x[0]):
        t = tensor.detach().to("cpu").contiguous()
        digest.update(name.encode())
        digest.update(f"|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def scan_origins(store: ObjectStore, job_id: str) -> dict[int, Any]:
    """Every gang origin under the job's prefix (``.../origins/e<epoch>.json``: where that gang
    says it resumed from), by the epoch its key names; the value is the parsed JSON (None: it
    does not parse).

    Raises:
        StorageError: the store itself failed.
    """
    from robustrl.storage.objects import ObjectNotFound

    out: dict[int, Any] = {}
    for key in store.list(job_prefix(job_id)):
        named = re.search(r"/origins/e(\d+)\.json$", key)
        if named is None:
            continue
        try:
            out[int(named.group(1))] = _json(store.get(key))
        except ObjectNotFound:
            continue
    return out
