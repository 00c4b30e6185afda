"""Weight-version manifest: what a flat weight buffer holds and how it is cut into chunks.

The manifest is the contract between the trainer that publishes a version and the replicas
that pull it: tensors (name, dtype, shape, byte range) and chunks (byte range, checksum). It
is torch-free because the control plane (controller, request manager) parses it too.

Chunk checksums guard against corruption and bugs (a truncated or garbled chunk, a relay
serving the wrong bytes), not against an attacker: the sources are our own trainer ranks and
replicas. So the default is XXH3-128 (``xxhash``), ~14 GiB/s on one core here, against ~1.5
GiB/s for SHA-256; on a 2-core machine SHA-256 took half the CPU the transfer needed and
capped a pull at ~45% of the socket's speed. 128 bits make an accidental match of a damaged
chunk negligible (2^-128). ``hash`` names the algorithm in the manifest, so a manifest from
an older publisher (SHA-256, no field) still verifies. The version checksum is SHA-256 over
the chunk digests in order: cheap (a few hundred bytes hashed), and two buffers with the same
version checksum hold the same bytes chunk for chunk.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from robustrl.errors import WeightSyncError

try:
    import xxhash
except ImportError:  # a dependency; kept importable so the control plane can parse manifests
    xxhash = None

ChunkHash = Literal["xxh3_128", "sha256"]
DEFAULT_HASH: ChunkHash = "xxh3_128"
"""Chunk checksum algorithm of new manifests."""

MAX_MANIFEST_BYTES = 512 << 20
"""Longest manifest a puller reads from a source (MANIFEST reply); a longer length on the wire is
garbage or a lie, refused before anything is allocated for it. Why 512 MiB: a chunk's entry
encodes to at most ~140 B (measured 135 B with a 64-hex SHA-256 and a 13-digit offset) and a
tensor's to ~150-250 B, so this holds ~3.5M chunks and 100k tensors. The largest model
``ModelSpec`` allows (128 layers, hidden 8192, intermediate 65536: ~0.9 TiB in fp32) is ~0.9M
chunks at the default 1 MiB ``chunk_bytes`` (~130 MB of manifest); a 2 TB checkpoint loaded from
``path`` (1T parameters in bf16) ~2M chunks (~290 MB). A version that needs more must use larger
chunks (``weights.chunk_bytes``)."""

_FROZEN = ConfigDict(extra="forbid", frozen=True)


class TensorEntry(BaseModel):
    """One tensor inside the flat buffer: ``nbytes`` bytes from ``offset``, dtype as a bare name."""

    model_config = _FROZEN
    name: str = Field(min_length=1)
    dtype: str = Field(min_length=1, description="Bare dtype name, e.g. 'float32', 'bfloat16'.")
    shape: list[int]
    offset: int = Field(ge=0)
    nbytes: int = Field(ge=0)


class ChunkEntry(BaseModel):
    """One transfer unit: bytes ``[offset, offset + nbytes)`` of the buffer and their checksum
    (hex digest, algorithm given by ``Manifest.hash``)."""

    model_config = _FROZEN
    index: int = Field(ge=0)
    offset: int = Field(ge=0)
    nbytes: int = Field(gt=0)
    checksum: str = Field(min_length=1)


class Manifest(BaseModel):
    """A complete description of one weight version's flat buffer.

    Validation guarantees the chunks tile ``[0, total_bytes)`` exactly and in order, and
    that no two tensors overlap or run past the end of the buffer.
    """

    model_config = _FROZEN
    version: int = Field(ge=0)
    total_bytes: int = Field(ge=0)
    chunk_bytes: int = Field(gt=0)
    checksum: str
    hash: ChunkHash = Field(default="sha256", description="Chunk checksum algorithm; absent means "
                            "SHA-256 (manifests published before XXH3-128 became the default).")
    tensors: list[TensorEntry]
    chunks: list[ChunkEntry]

    @model_validator(mode="after")
    def _layout_is_consistent(self) -> Manifest:
        cursor = 0
        for i, chunk in enumerate(self.chunks):
            if chunk.index != i:
                raise ValueError(f"chunk {i} has index {chunk.index}")
            if chunk.offset != cursor:
                raise ValueError(f"chunk {i} starts at {chunk.offset}, expected {cursor} (gap or overlap)")
            if chunk.nbytes > self.chunk_bytes:
                raise ValueError(f"chunk {i} has {chunk.nbytes} bytes > chunk_bytes {self.chunk_bytes}")
            cursor += chunk.nbytes
        if cursor != self.total_bytes:
            raise ValueError(f"chunks cover {cursor} bytes, buffer has {self.total_bytes}")
        names: set[str] = set()
        end = 0
        for tensor in sorted(self.tensors, key=lambda t: t.offset):
            if tensor.name in names:
                raise ValueError(f"tensor {tensor.name!r} listed twice")
            names.add(tensor.name)
            if tensor.offset < end:
                raise ValueError(f"tensor {tensor.name!r} overlaps the tensor before it")
            end = tensor.offset + tensor.nbytes
            if end > self.total_bytes:
                raise ValueError(f"tensor {tensor.name!r} runs past the end of the buffer")
        return self

    def encode(self) -> bytes:
        """The manifest as it travels (served on MANIFEST; its SHA-256 is :meth:`digest`)."""
        return self.model_dump_json().encode()

    def digest(self) -> str:
        return hashlib.sha256(self.encode()).hexdigest()

    @classmethod
    def decode(cls, data: bytes, digest: str) -> Manifest:
        """Parse manifest bytes fetched from a source, refusing any whose SHA-256 is not ``digest``
        (the announcement's): a source cannot make a replica pull against another manifest."""
        got = hashlib.sha256(data).hexdigest()
        if got != digest:
            raise WeightSyncError("manifest bytes do not match the announced digest", want=digest, got=got,
                                  reason="corrupt")
        try:
            return cls.model_validate_json(data)
        except ValueError as exc:
            raise WeightSyncError(f"manifest unreadable: {exc}", reason="corrupt") from exc

    @property
    def num_chunks(self) -> int:
        """How many chunks the buffer is cut into."""
        return len(self.chunks)

    def tensor(self, name: str) -> TensorEntry:
        """The entry for ``name``; raises WeightSyncError if the version has no such tensor."""
        for entry in self.tensors:
            if entry.name == name:
                return entry
        raise WeightSyncError("tensor not in manifest", version=self.version, tensor=name)

    def verify_chunk(self, index: int, data: memoryview | bytes) -> bool:
        """True when ``data`` is exactly chunk ``index`` of this version."""
        chunk = self.chunks[index]
        return len(data) == chunk.nbytes and chunk_checksum(data, self.hash) == chunk.checksum

    def check_matches(self, expected: Mapping[str, tuple[str, Sequence[int]]]) -> None:
        """Check that this version holds exactly the tensors a model expects.

        Args:
            expected: tensor name -> (bare dtype name, shape) of the receiving model.

        Raises:
            WeightSyncError: naming the first tensor (in ``expected`` order, then manifest
                order) that is missing, extra, or differs in dtype or shape. Not retryable:
                re-pulling the same version cannot fix a model mismatch.
        """
        have = {t.name: t for t in self.tensors}
        for name, (dtype, shape) in expected.items():
            entry = have.get(name)
            if entry is None:
                raise _mismatch(self.version, name, "missing from the weight version")
            if entry.dtype != dtype or list(entry.shape) != list(shape):
                raise _mismatch(
                    self.version, name,
                    f"differs: version has {entry.dtype}{list(entry.shape)}, model wants {dtype}{list(shape)}",
                )
        for entry in self.tensors:
            if entry.name not in expected:
                raise _mismatch(self.version, entry.name, "is in the weight version but not in the model")


def _mismatch(version: int, name: str, what: str) -> WeightSyncError:
    err = WeightSyncError(f"tensor {name!r} {what}", version=version, tensor=name)
    err.retryable = False
    return err


def _sha256(data: memoryview | bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _xxh3_128(data: memoryview | bytes) -> str:
    if xxhash is None:
        raise WeightSyncError("the xxhash package is needed for xxh3_128 chunk checksums", hash="xxh3_128")
    return xxhash.xxh3_128_hexdigest(data)


_HASHERS: dict[str, Callable[[memoryview | bytes], str]] = {"sha256": _sha256, "xxh3_128": _xxh3_128}


def chunk_checksum(data: memoryview | bytes, algo: ChunkHash = DEFAULT_HASH) -> str:
    """Hex digest of one chunk's bytes with ``algo`` (XXH3-128 by default)."""
    return _HASHERS[algo](data)


def version_checksum(chunk_checksums: Iterable[str]) -> str:
    """The checksum of a whole version: SHA-256 over its chunk digests in order."""
    digest = hashlib.sha256()
    for checksum in chunk_checksums:
        digest.update(bytes.fromhex(checksum))
    return digest.hexdigest()


def build_manifest(
    version: int, tensors: Sequence[TensorEntry], buffer: memoryview | bytes | bytearray, chunk_bytes: int,
    algo: ChunkHash = DEFAULT_HASH,
) -> Manifest:
    """Cut ``buffer`` into chunks of at most ``chunk_bytes`` and checksum each one.

    Args:
        version: the weights version being published.
        tensors: where each tensor lies in ``buffer``.
        buffer: the flat bytes (anything exposing the buffer protocol, 1-D bytes view).
        chunk_bytes: largest chunk; the last chunk may be shorter.
        algo: chunk checksum algorithm (recorded in the manifest).

    Returns:
        A validated Manifest.
    """
    if chunk_bytes <= 0:
        raise WeightSyncError("chunk_bytes must be positive", chunk_bytes=chunk_bytes)
    view = memoryview(buffer).cast("B")
    total = len(view)
    chunks = []
    for index, offset in enumerate(range(0, total, chunk_bytes)):
        nbytes = min(chunk_bytes, total - offset)
        chunks.append(ChunkEntry(index=index, offset=offset, nbytes=nbytes,
                                 checksum=chunk_checksum(view[offset:offset + nbytes], algo)))
    return Manifest(version=version, total_bytes=total, chunk_bytes=chunk_bytes,
                    checksum=version_checksum(c.checksum for c in chunks), hash=algo,
                    tensors=list(tensors), chunks=chunks)
