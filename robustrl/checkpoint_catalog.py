"""What checkpoints exist in the object store, which of them verify, and which GC may delete.

A checkpoint is one (step, gang epoch) folder. Every rank of the gang writes only its own keys
under ``r<rank>/`` and, last, a receipt listing them; the coordinator (rank 0) verifies every
rank's blobs and then writes the folder's ``manifest.json``. Keys never repeat across gangs, so a
stale writer can add a folder of its own but never overwrite another gang's bytes::

    <prefix>/<step:012d>/e<epoch:08d>/r<rank:05d>/state.pt          structure, tensors as references
    <prefix>/<step:012d>/e<epoch:08d>/r<rank:05d>/tensors-00000.pt  tensors, in shards
    <prefix>/<step:012d>/e<epoch:08d>/r<rank:05d>/receipt.json      that rank's blobs (written last)
    <prefix>/<step:012d>/e<epoch:08d>/manifest.json                 coordinator, after every receipt

Which manifest counts (``lineage``): every gang's coordinator records, before the gang trains
anything, which checkpoint it resumed from, in its *origin* (``<prefix>/origins/e<epoch>.json``:
that step and epoch, or none). The loadable checkpoints are the chain the newest origin names: its
own gang's manifests, then those of the gang it resumed from up to the step it resumed from, and
so on back. A manifest off that chain was written by a gang already replaced (a zombie, or an
upload that passed the fence just before the take-over and landed after the new gang had chosen
where to resume) and is never loaded, even while the new gang has not yet written a checkpoint of
its own. Without origins (folders written before they existed), the rule is the older one: a gang
that wrote step s took over from a checkpoint older than s, so a manifest of an older epoch at step
s or later is *superseded*.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from robustrl.errors import CheckpointError, StorageError
from robustrl.storage.objects import ObjectNotFound, ObjectStore, check_key

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
RECEIPT = "receipt.json"
ORIGINS = "origins"
FORMAT = 2
_ORIGIN_NAME = re.compile(r"^e(\d{8})\.json$")


class BlobEntry(BaseModel):
    """One blob of a checkpoint, named relative to its checkpoint folder."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    @field_validator("name")
    @classmethod
    def _inside_its_folder(cls, name: str) -> str:
        # A name that leaves the folder ("../x") or is no key ("", "a//b") makes this manifest
        # a bad checkpoint (CheckpointError: an older one is loaded), not a storage failure.
        try:
            check_key(name)
        except StorageError as exc:
            raise ValueError(f"blob name {name[:200]!r} is not a key inside the checkpoint's folder") from exc
        return name
    bytes: int = Field(ge=0)
    rank: int = Field(ge=0)


class ShardReceipt(BaseModel):
    """What one rank wrote for one checkpoint; the coordinator verifies it before the manifest."""

    model_config = ConfigDict(extra="forbid")
    step: int
    epoch: int
    rank: int
    blobs: list[BlobEntry]


class Manifest(BaseModel):
    """The manifest: a checkpoint exists once this is written."""

    model_config = ConfigDict(extra="forbid")
    format: Literal[2] = FORMAT
    step: int = Field(ge=0)
    epoch: int = Field(ge=0)
    world_size: int = Field(ge=1)
    weights_version: int
    data_cursor: int
    created: float
    blobs: list[BlobEntry] = Field(min_length=1)


class Origin(BaseModel):
    """Where gang ``epoch``'s lineage starts: the checkpoint it resumed from (none: from the
    initial weights). Written by its coordinator before the gang trains anything."""

    model_config = ConfigDict(extra="forbid")
    format: Literal[1] = 1
    epoch: int = Field(ge=0)
    from_step: int | None = Field(None, ge=0)
    from_epoch: int | None = Field(None, ge=0)
    created: float


@dataclass(frozen=True, order=True)
class CheckpointRef:
    """One checkpoint folder: the step and the gang epoch that wrote it."""

    step: int
    epoch: int

    def folder(self, prefix: str) -> str:
        return f"{prefix}/{self.step:012d}/e{self.epoch:08d}"

    def manifest_key(self, prefix: str) -> str:
        return f"{self.folder(prefix)}/{MANIFEST}"

    def rank_folder(self, prefix: str, rank: int) -> str:
        return f"{self.folder(prefix)}/r{rank:05d}"

    def receipt_key(self, prefix: str, rank: int) -> str:
        return f"{self.rank_folder(prefix, rank)}/{RECEIPT}"


def origin_key(prefix: str, epoch: int) -> str:
    return f"{prefix}/{ORIGINS}/e{epoch:08d}.json"


@dataclass(frozen=True)
class Listing:
    """A scan of the prefix: every checkpoint folder, those with a manifest, and the gang epochs
    that recorded an origin."""

    folders: frozenset[CheckpointRef]
    manifests: frozenset[CheckpointRef]
    origins: frozenset[int] = field(default_factory=frozenset)


def ascii_digits(text: str) -> bool:
    """ASCII digits only (``str.isdigit`` takes '²', which ``int`` refuses: one such key under the
    prefix failed every resume and every GC)."""
    return text.isascii() and text.isdigit()


def scan(store: ObjectStore, prefix: str) -> Listing:
    """List the checkpoint folders and origins under ``prefix`` (keys in any other shape are ignored)."""
    folders: set[CheckpointRef] = set()
    manifests: set[CheckpointRef] = set()
    origins: set[int] = set()
    for key in store.list(prefix + "/"):
        parts = key[len(prefix) + 1:].split("/")
        if len(parts) == 2 and parts[0] == ORIGINS and (named := _ORIGIN_NAME.match(parts[1])):
            origins.add(int(named.group(1)))
            continue
        if len(parts) < 3 or not ascii_digits(parts[0]) or not (parts[1][:1] == "e" and ascii_digits(parts[1][1:])):
            continue
        ref = CheckpointRef(int(parts[0]), int(parts[1][1:]))
        folders.add(ref)
        if len(parts) == 3 and parts[2] == MANIFEST:
            manifests.add(ref)
    return Listing(frozenset(folders), frozenset(manifests), frozenset(origins))


def lineage(manifests: Iterable[CheckpointRef],
            origins: Mapping[int, CheckpointRef | None] | None = None) -> list[CheckpointRef]:
    """The manifests that may be loaded, newest step first (at most one per step).

    ``origins`` maps a gang epoch to the checkpoint it resumed from (None: none); with any, the
    loadable manifests are the chain the newest names (module docstring). A gang resumes only
    from an older one's checkpoint: an origin naming its own epoch or a newer one ends the chain.
    An epoch on the chain without an origin (it wrote before origins existed, or its origin does
    not read: ``origins[e]`` raised ``KeyError``) is judged below by the older rule.
    """
    manifests = frozenset(manifests)
    if not origins:
        return _superseding(manifests)
    out: list[CheckpointRef] = []
    epoch, upper = max(origins), None
    while True:
        try:
            start = origins[epoch]
        except KeyError:
            below = [r for r in manifests if r.epoch <= epoch and (upper is None or r.step <= upper)]
            return out + _superseding(below)
        lower = -1 if start is None else start.step
        out.extend(sorted((r for r in manifests
                           if r.epoch == epoch and r.step > lower and (upper is None or r.step <= upper)),
                          reverse=True))
        if start is None or start.epoch >= epoch:
            return out
        epoch, upper = start.epoch, start.step


def _superseding(manifests: Iterable[CheckpointRef]) -> list[CheckpointRef]:
    """The rule without origins: ``(s, e)`` is superseded when some manifest ``(s2, e2)`` has
    ``e2 > e`` and ``s2 <= s`` (gang e2 resumed below s2, so epoch e's write at s came after e2
    took over)."""
    out: list[CheckpointRef] = []
    newest_epoch_at_or_below = -1
    for ref in sorted(manifests, key=lambda r: (r.step, -r.epoch)):
        if ref.epoch >= newest_epoch_at_or_below and (not out or out[-1].step != ref.step):
            out.append(ref)
        newest_epoch_at_or_below = max(newest_epoch_at_or_below, ref.epoch)
    return out[::-1]


class StoredOrigins(Mapping[int, "CheckpointRef | None"]):
    """The origins of a listing, each read from the store when first asked for (a lineage walk
    reads only the chain it follows: usually one or two). One that is missing or does not parse
    is absent (``KeyError``), logged once.

    Raises (on lookup):
        StorageError: the store itself failed.
    """

    def __init__(self, store: ObjectStore, prefix: str, epochs: frozenset[int],
                 cache: dict[int, CheckpointRef | None | CheckpointError] | None = None) -> None:
        self.store, self.prefix, self.epochs = store, prefix, epochs
        self._cache = {} if cache is None else cache  # an origin never changes once written

    def __getitem__(self, epoch: int) -> CheckpointRef | None:
        if epoch not in self.epochs:
            raise KeyError(epoch)
        if epoch not in self._cache:
            self._cache[epoch] = _read_origin(self.store, self.prefix, epoch)
        got = self._cache[epoch]
        if isinstance(got, CheckpointError):
            raise KeyError(epoch)
        return got

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self.epochs))

    def __len__(self) -> int:
        return len(self.epochs)


def _read_origin(store: ObjectStore, prefix: str, epoch: int) -> CheckpointRef | None | CheckpointError:
    key = origin_key(prefix, epoch)
    try:
        origin = Origin.model_validate_json(store.get(key))
        if origin.epoch != epoch or (origin.from_step is None) != (origin.from_epoch is None):
            raise CheckpointError("origin names another gang, or half a checkpoint", name=key)
    except (ObjectNotFound, ValidationError, CheckpointError) as exc:
        log.warning("checkpoint origin %s ignored: %s", key, exc)
        return exc if isinstance(exc, CheckpointError) else CheckpointError(f"origin unreadable: {exc}", name=key)
    if origin.from_step is None or origin.from_epoch is None:
        return None
    return CheckpointRef(origin.from_step, origin.from_epoch)


def origin_bytes(origin: Origin) -> bytes:
    return origin.model_dump_json().encode()


def loadable(store: ObjectStore, prefix: str, listing: Listing | None = None,
             cache: dict[int, CheckpointRef | None | CheckpointError] | None = None) -> list[CheckpointRef]:
    """``lineage`` of what the store holds under ``prefix`` (scanned unless ``listing`` is given)."""
    listing = scan(store, prefix) if listing is None else listing
    return lineage(listing.manifests, StoredOrigins(store, prefix, listing.origins, cache))


def read_manifest(store: ObjectStore, prefix: str, ref: CheckpointRef) -> tuple[Manifest, bytes]:
    """Parse ``ref``'s manifest; return it with its raw bytes.

    Raises:
        CheckpointError: missing, unparsable, or naming another step or epoch (``name``: the key).
        StorageError: the store itself failed.
    """
    key = ref.manifest_key(prefix)
    try:
        raw = store.get(key)
    except ObjectNotFound as exc:
        raise CheckpointError("checkpoint manifest missing", name=key, step=ref.step) from exc
    try:
        manifest = Manifest.model_validate_json(raw)
    except ValidationError as exc:
        raise CheckpointError(f"checkpoint manifest unreadable: {exc.errors()[0]['msg']}", name=key,
                              step=ref.step) from exc
    if (manifest.step, manifest.epoch) != (ref.step, ref.epoch):
        raise CheckpointError(f"manifest is for step {manifest.step} epoch {manifest.epoch}", name=key,
                              step=ref.step)
    return manifest, raw


def fetch_blob(store: ObjectStore, prefix: str, ref: CheckpointRef, blob: BlobEntry) -> bytes:
    """Read one blob and check its size and sha256.

    Raises:
        CheckpointError: the blob is missing or its size or sha256 differ (``name``: the key).
    """
    key = f"{ref.folder(prefix)}/{blob.name}"
    try:
        data = store.get(key)
    except ObjectNotFound as exc:
        raise CheckpointError("checkpoint blob missing", name=key, step=ref.step) from exc
    if len(data) != blob.bytes or hashlib.sha256(data).hexdigest() != blob.sha256:
        raise CheckpointError("checkpoint blob corrupt: size or sha256 mismatch", name=key, step=ref.step)
    return data


def verify(store: ObjectStore, prefix: str, ref: CheckpointRef) -> str:
    """Check that ``ref``'s manifest parses and every blob it names matches; return the manifest's
    sha256 (a later change to the manifest is then a different checkpoint).

    Raises:
        CheckpointError: it does not verify.
        StorageError: the store failed (nothing is known about the checkpoint).
    """
    manifest, raw = read_manifest(store, prefix, ref)
    for blob in manifest.blobs:
        fetch_blob(store, prefix, ref, blob)  # one blob in memory at a time
    return hashlib.sha256(raw).hexdigest()


def read_receipt(store: ObjectStore, prefix: str, ref: CheckpointRef, rank: int) -> ShardReceipt:
    """Parse a rank's receipt.

    Raises:
        ObjectNotFound: not written (yet).
        CheckpointError: unparsable, or for another checkpoint or rank.
    """
    key = ref.receipt_key(prefix, rank)
    raw = store.get(key)
    try:
        receipt = ShardReceipt.model_validate_json(raw)
    except ValidationError as exc:
        raise CheckpointError(f"shard receipt unreadable: {exc.errors()[0]['msg']}", name=key) from exc
    if (receipt.step, receipt.epoch, receipt.rank) != (ref.step, ref.epoch, rank):
        raise CheckpointError("shard receipt is for another checkpoint or rank", name=key)
    if any(not b.name.startswith(f"r{rank:05d}/") or b.rank != rank for b in receipt.blobs):
        raise CheckpointError("shard receipt names a key outside its rank's folder", name=key)
    return receipt


def receipt_bytes(receipt: ShardReceipt) -> bytes:
    return receipt.model_dump_json().encode()


def manifest_bytes(manifest: Manifest) -> bytes:
    return json.dumps(manifest.model_dump(mode="json"), indent=1).encode()


def gc_deletions(listing: Listing, kept: list[CheckpointRef], own_epoch: int) -> list[CheckpointRef]:
    """Folders GC may delete, given the checkpoints it keeps (each verified).

    Deleted: every folder at or below the newest kept step that is not kept (older complete
    checkpoints beyond ``keep``, ones that failed verification, superseded ones, partial uploads
    that can no longer complete). Never deleted: anything when nothing verified (so the newest
    loadable checkpoint survives even a run of bad ones), folders above the newest kept step (an
    upload may be running there), and folders of a newer epoch than ours (a stale GC must not
    touch its replacement's keys).
    """
    if not kept:
        return []
    newest = max(r.step for r in kept)
    keep = set(kept)
    return sorted(r for r in listing.folders if r not in keep and r.step <= newest and r.epoch <= own_epoch)
