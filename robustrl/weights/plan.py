"""Shard plan: from the trainer's layout (DP x FSDP) to the rollout's layout (TP), in chunks.

Pure and torch-free. The trainer gang holds each parameter flattened and split into ``fsdp``
contiguous element ranges (FSDP's flat-parameter sharding), replicated over ``dp`` groups.
A rollout replica with tensor parallelism ``tp`` wants, per TP rank, vLLM's slices:

* column-parallel (q/k/v/gate/up projections): rows ``[t*r/tp, (t+1)*r/tp)`` of dim 0;
* row-parallel (o/down projections): columns ``[t*c/tp, (t+1)*c/tp)`` of dim 1 (strided);
* everything else (norms, embeddings, lm head here): the whole tensor on every TP rank.

For each TP rank the plan packs its slices into one flat buffer (one Manifest's layout), cuts
it into chunks, and says for each chunk which byte ranges of which parameters fill it and
which trainer rank sends it. Senders are balanced by bytes, preferring a rank whose FSDP
shard already holds most of the chunk, so all DP x FSDP ranks send in parallel and little
has to be gathered.

Ranks are numbered ``dp_index * fsdp + fsdp_index``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from robustrl.errors import WeightSyncError

ParallelKind = Literal["column", "row", "replicated"]

_COLUMN = re.compile(r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
_ROW = re.compile(r"(o_proj|down_proj)\.weight$")
ALIGN = 64


def infer_parallel_kind(name: str, shape: Sequence[int]) -> ParallelKind:
    """How vLLM splits a Qwen/Llama-style parameter over tensor-parallel ranks."""
    if _COLUMN.search(name):
        return "column"
    if _ROW.search(name) and len(shape) == 2:
        return "row"
    return "replicated"


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One parameter of the policy: name, full shape, bytes per element, TP split kind."""

    name: str
    shape: tuple[int, ...]
    itemsize: int
    kind: ParallelKind

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class TrainerLayout:
    dp: int
    fsdp: int

    @property
    def world(self) -> int:
        return self.dp * self.fsdp


@dataclass(frozen=True, slots=True)
class Piece:
    """``nelem`` elements of ``param`` from flat element ``src_elem`` land at ``dst_offset``
    (bytes, in the TP rank's buffer); they live in FSDP shard ``fsdp_shard``."""

    param: str
    src_elem: int
    nelem: int
    dst_offset: int
    fsdp_shard: int


@dataclass(frozen=True, slots=True)
class PlannedChunk:
    index: int
    offset: int
    nbytes: int
    sender: int
    pieces: tuple[Piece, ...]


@dataclass(frozen=True, slots=True)
class SliceEntry:
    """Where one parameter's TP slice lies in a TP rank's buffer (a TensorEntry without dtype)."""

    name: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class TpBufferPlan:
    tp_rank: int
    total_bytes: int
    slices: tuple[SliceEntry, ...]
    chunks: tuple[PlannedChunk, ...]


@dataclass(frozen=True, slots=True)
class ShardPlan:
    trainer: TrainerLayout
    tp: int
    buffers: tuple[TpBufferPlan, ...]

    def bytes_per_sender(self) -> dict[int, int]:
        """Trainer rank -> bytes it sends (over all TP buffers)."""
        out = dict.fromkeys(range(self.trainer.world), 0)
        for buf in self.buffers:
            for chunk in buf.chunks:
                out[chunk.sender] += chunk.nbytes
        return out


def _slice_segments(p: ParamSpec, t: int, tp: int) -> tuple[tuple[int, ...], list[tuple[int, int]]]:
    """(slice shape, [(src_elem, nelem)]) of TP rank t's slice of p, in row-major order."""
    if p.kind == "replicated" or tp == 1:
        return p.shape, [(0, p.numel)]
    if p.kind == "column":
        rows = p.shape[0]
        if rows % tp:
            raise WeightSyncError("dim 0 not divisible by tp", param=p.name, dim=rows, tp=tp)
        inner = p.numel // rows
        per = rows // tp
        return (per, *p.shape[1:]), [(t * per * inner, per * inner)]
    rows, cols = p.shape
    if cols % tp:
        raise WeightSyncError("dim 1 not divisible by tp", param=p.name, dim=cols, tp=tp)
    per = cols // tp
    return (rows, per), [(r * cols + t * per, per) for r in range(rows)]


def _split_by_shard(src: int, n: int, shard_elems: int) -> list[tuple[int, int, int]]:
    """Split elements [src, src+n) at FSDP shard boundaries -> [(src, n, shard)]."""
    out = []
    while n > 0:
        shard = src // shard_elems
        take = min(n, (shard + 1) * shard_elems - src)
        out.append((src, take, shard))
        src += take
        n -= take
    return out


def make_plan(params: Sequence[ParamSpec], trainer: TrainerLayout, tp: int, chunk_bytes: int) -> ShardPlan:
    """Build the shard plan for ``params`` from ``trainer`` layout to ``tp`` rollout ranks.

    Raises:
        WeightSyncError: a split dimension is not divisible by ``tp``, or a layout is invalid.
    """
    if tp < 1 or trainer.dp < 1 or trainer.fsdp < 1 or chunk_bytes < 1:
        raise WeightSyncError("invalid layout", tp=tp, dp=trainer.dp, fsdp=trainer.fsdp, chunk_bytes=chunk_bytes)
    if any(chunk_bytes % p.itemsize or ALIGN % p.itemsize for p in params):
        raise WeightSyncError("chunk_bytes must be a multiple of every itemsize", chunk_bytes=chunk_bytes)
    load = [0] * trainer.world
    buffers = []
    for t in range(tp):
        slices: list[SliceEntry] = []
        runs: list[Piece] = []  # contiguous runs in the TP buffer, not yet cut into chunks
        offset = 0
        for p in params:
            offset = (offset + ALIGN - 1) // ALIGN * ALIGN
            shape, segments = _slice_segments(p, t, tp)
            shard_elems = max(1, math.ceil(p.numel / trainer.fsdp))
            start = offset
            for src, n in segments:
                for s_src, s_n, shard in _split_by_shard(src, n, shard_elems):
                    runs.append(Piece(p.name, s_src, s_n, offset, shard))
                    offset += s_n * p.itemsize
            slices.append(SliceEntry(p.name, shape, start, offset - start))
        itemsizes = {p.name: p.itemsize for p in params}
        chunks = _cut(runs, offset, chunk_bytes, itemsizes, trainer, load)
        buffers.append(TpBufferPlan(t, offset, tuple(slices), tuple(chunks)))
    return ShardPlan(trainer, tp, tuple(buffers))


def _cut(runs: list[Piece], total: int, chunk_bytes: int, itemsize: dict[str, int],
         trainer: TrainerLayout, load: list[int]) -> list[PlannedChunk]:
    """Cut runs at chunk boundaries and pick a sender for each chunk."""
    chunks = []
    i = 0
    for index, lo in enumerate(range(0, total, chunk_bytes)):
        hi = min(total, lo + chunk_bytes)
        pieces = []
        while i < len(runs) and runs[i].dst_offset < hi:
            r = runs[i]
            size = itemsize[r.param]
            r_end = r.dst_offset + r.nelem * size
            # no element straddles a chunk boundary: chunk_bytes is a multiple of every
            # itemsize (checked in make_plan) and every parameter starts ALIGN-aligned
            a = max(lo, r.dst_offset)
            b = min(hi, r_end)
            first = (a - r.dst_offset) // size
            pieces.append(Piece(r.param, r.src_elem + first, (b - a) // size, a, r.fsdp_shard))
            if r_end <= hi:
                i += 1
            else:
                break
        owned = [0] * trainer.fsdp
        for piece in pieces:
            owned[piece.fsdp_shard] += piece.nelem * itemsize[piece.param]
        # keep ranks balanced within one chunk; among those, the rank whose shard holds most
        # of the chunk (least to gather)
        floor = min(load) + chunk_bytes
        sender = min((r for r in range(trainer.world) if load[r] < floor or load[r] == min(load)),
                     key=lambda r: (-owned[r % trainer.fsdp], load[r], r))
        load[sender] += hi - lo
        chunks.append(PlannedChunk(index, lo, hi - lo, sender, tuple(pieces)))
    return chunks


def assemble_chunk(chunk: PlannedChunk, itemsize: dict[str, int],
                   read: Callable[[str, int, int], bytes | memoryview]) -> bytearray:
    """The bytes of one planned chunk, built with ``read(param, src_elem, nelem)``.

    ``read`` returns the raw bytes of elements ``[src_elem, src_elem+nelem)`` of the flattened
    parameter; a sender implements it from its own FSDP shard (plus gathered data for pieces
    of other shards). Alignment padding stays zero.
    """
    out = bytearray(chunk.nbytes)
    for piece in chunk.pieces:
        data = read(piece.param, piece.src_elem, piece.nelem)
        start = piece.dst_offset - chunk.offset
        out[start:start + len(data)] = data
    return out
