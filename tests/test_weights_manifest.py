"""Manifest checksums: XXH3-128 chunks catch damage, legacy SHA-256 manifests still verify,
and the version checksum pins the bytes. Pure, no sockets."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from robustrl.weights.manifest import (
    DEFAULT_HASH,
    Manifest,
    TensorEntry,
    build_manifest,
    chunk_checksum,
    version_checksum,
)

CHUNK = 4096


def _buffer(nbytes: int = 10 * CHUNK + 123, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _manifest(buf: np.ndarray, **kw: object) -> Manifest:
    entry = TensorEntry(name="flat", dtype="uint8", shape=[buf.nbytes], offset=0, nbytes=buf.nbytes)
    return build_manifest(3, [entry], buf, CHUNK, **kw)  # type: ignore[arg-type]


def _chunk(buf: np.ndarray, m: Manifest, index: int) -> memoryview:
    c = m.chunks[index]
    return memoryview(buf)[c.offset:c.offset + c.nbytes]


def test_default_is_xxh3_128_and_recorded() -> None:
    buf = _buffer()
    m = _manifest(buf)
    assert m.hash == DEFAULT_HASH == "xxh3_128"
    assert all(len(c.checksum) == 32 for c in m.chunks)  # 128-bit hex digests
    assert all(m.verify_chunk(i, _chunk(buf, m, i)) for i in range(m.num_chunks))
    # survives the trip through the announcement (JSON) with its algorithm
    again = Manifest.model_validate_json(m.model_dump_json())
    assert again == m and again.verify_chunk(0, _chunk(buf, m, 0))


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256"])
def test_any_damaged_byte_is_caught(algo: str) -> None:
    buf = _buffer()
    m = _manifest(buf, algo=algo)
    rng = np.random.default_rng(1)
    for index in range(m.num_chunks):
        c = m.chunks[index]
        for pos in (c.offset, c.offset + c.nbytes - 1, int(rng.integers(c.offset, c.offset + c.nbytes))):
            bad = buf.copy()
            bad[pos] ^= 1 << int(rng.integers(0, 8))  # one flipped bit
            assert not m.verify_chunk(index, _chunk(bad, m, index)), (index, pos)
    # a chunk of the right length but from elsewhere, and a truncated chunk
    assert not m.verify_chunk(1, _chunk(buf, m, 2))
    assert not m.verify_chunk(0, _chunk(buf, m, 0)[:-1])
    # zeros (an untouched destination) never pass for random bytes
    assert not m.verify_chunk(0, bytes(m.chunks[0].nbytes))


def test_legacy_sha256_manifest_without_hash_field_verifies() -> None:
    buf = _buffer()
    legacy = _manifest(buf, algo="sha256").model_dump(mode="json")
    del legacy["hash"]  # what a publisher from before the field sends
    m = Manifest.model_validate(legacy)
    assert m.hash == "sha256"
    assert m.chunks[0].checksum == hashlib.sha256(_chunk(buf, m, 0)).hexdigest()
    assert all(m.verify_chunk(i, _chunk(buf, m, i)) for i in range(m.num_chunks))


def test_version_checksum_pins_the_bytes() -> None:
    buf = _buffer()
    m = _manifest(buf)
    same = _manifest(buf.copy())
    assert same.checksum == m.checksum
    recomputed = version_checksum(chunk_checksum(_chunk(buf, m, i)) for i in range(m.num_chunks))
    assert recomputed == m.checksum
    bad = buf.copy()
    bad[5 * CHUNK + 7] ^= 0x80
    assert _manifest(bad).checksum != m.checksum
    # the algorithm is part of what the checksum means: same bytes, other algorithm, other value
    assert _manifest(buf, algo="sha256").checksum != m.checksum
