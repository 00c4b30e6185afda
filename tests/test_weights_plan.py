"""Shard plan: every parameter byte lands exactly once per TP rank that needs it, in the
layout vLLM expects, and senders are balanced. Pure numpy, no torch."""

from __future__ import annotations

import numpy as np
import pytest

from robustrl.errors import WeightSyncError
from robustrl.weights.plan import (
    ParamSpec,
    TrainerLayout,
    assemble_chunk,
    infer_parallel_kind,
    make_plan,
)

SHAPES = {
    "model.embed_tokens.weight": (40, 16),
    "model.layers.0.input_layernorm.weight": (16,),
    "model.layers.0.self_attn.q_proj.weight": (16, 16),
    "model.layers.0.self_attn.k_proj.weight": (8, 16),
    "model.layers.0.self_attn.v_proj.weight": (8, 16),
    "model.layers.0.self_attn.q_proj.bias": (16,),
    "model.layers.0.self_attn.o_proj.weight": (16, 16),
    "model.layers.0.mlp.gate_proj.weight": (32, 16),
    "model.layers.0.mlp.up_proj.weight": (32, 16),
    "model.layers.0.mlp.down_proj.weight": (16, 32),
    "model.norm.weight": (16,),
    "lm_head.weight": (40, 16),
}


def _params(itemsize: int = 4) -> list[ParamSpec]:
    return [ParamSpec(n, s, itemsize, infer_parallel_kind(n, s)) for n, s in SHAPES.items()]


def _values(itemsize: int) -> dict[str, np.ndarray]:
    dtype = {2: np.float16, 4: np.float32}[itemsize]
    rng = np.random.default_rng(0)
    return {n: rng.standard_normal(s).astype(dtype) for n, s in SHAPES.items()}


def _expected_slice(name: str, full: np.ndarray, t: int, tp: int) -> np.ndarray:
    kind = infer_parallel_kind(name, full.shape)
    if kind == "column":
        return np.split(full, tp, axis=0)[t]
    if kind == "row":
        return np.split(full, tp, axis=1)[t]
    return full


def test_kinds_follow_vllm_conventions() -> None:
    assert infer_parallel_kind("model.layers.3.self_attn.k_proj.weight", (8, 16)) == "column"
    assert infer_parallel_kind("model.layers.3.mlp.down_proj.weight", (16, 32)) == "row"
    assert infer_parallel_kind("model.layers.3.post_attention_layernorm.weight", (16,)) == "replicated"
    assert infer_parallel_kind("model.embed_tokens.weight", (40, 16)) == "replicated"


@pytest.mark.parametrize(("dp", "fsdp", "tp", "chunk", "itemsize"), [
    (1, 1, 1, 256, 4), (2, 1, 1, 512, 4), (1, 4, 2, 256, 4), (2, 2, 4, 384, 2),
    (4, 2, 2, 64, 4), (3, 3, 1, 1024, 2), (1, 2, 4, 4096, 4),
])
def test_every_byte_exactly_once(dp: int, fsdp: int, tp: int, chunk: int, itemsize: int) -> None:
    params = _params(itemsize)
    values = _values(itemsize)
    plan = make_plan(params, TrainerLayout(dp, fsdp), tp, chunk)
    sizes = {p.name: p.itemsize for p in params}
    for buf in plan.buffers:
        # how often each source element lands in this TP rank's buffer
        covered = {n: np.zeros(v.size, dtype=np.int64) for n, v in values.items()}
        tiled = 0
        flat = bytearray()
        for c in buf.chunks:
            assert c.offset == tiled and 0 < c.nbytes <= chunk
            tiled += c.nbytes
            for piece in c.pieces:
                assert c.offset <= piece.dst_offset
                assert piece.dst_offset + piece.nelem * sizes[piece.param] <= c.offset + c.nbytes
                shard_elems = -(-values[piece.param].size // fsdp)
                assert piece.src_elem // shard_elems == piece.fsdp_shard
                assert (piece.src_elem + piece.nelem - 1) // shard_elems == piece.fsdp_shard
                covered[piece.param][piece.src_elem:piece.src_elem + piece.nelem] += 1
            flat += assemble_chunk(c, sizes, lambda n, s, k: values[n].reshape(-1)[s:s + k].tobytes())
        assert tiled == buf.total_bytes == len(flat)
        for name, full in values.items():
            want = np.zeros(full.size, dtype=np.int64)
            idx = np.arange(full.size).reshape(full.shape)
            want[_expected_slice(name, idx, buf.tp_rank, tp).reshape(-1)] = 1
            assert (covered[name] == want).all(), name  # needed bytes once, others never
        # the assembled buffer holds exactly the slices vLLM's TP rank t would load
        for entry in buf.slices:
            got = np.frombuffer(bytes(flat[entry.offset:entry.offset + entry.nbytes]),
                                dtype=values[entry.name].dtype).reshape(entry.shape)
            assert np.array_equal(got, _expected_slice(entry.name, values[entry.name], buf.tp_rank, tp))


@pytest.mark.parametrize(("dp", "fsdp"), [(2, 1), (1, 4), (2, 2), (4, 2)])
def test_senders_balanced(dp: int, fsdp: int) -> None:
    plan = make_plan(_params(), TrainerLayout(dp, fsdp), tp=2, chunk_bytes=256)
    sent = plan.bytes_per_sender()
    assert set(sent) == set(range(dp * fsdp))
    assert all(v > 0 for v in sent.values())
    assert max(sent.values()) - min(sent.values()) <= 2 * 256


def test_indivisible_tp_names_param() -> None:
    with pytest.raises(WeightSyncError) as info:
        make_plan(_params(), TrainerLayout(1, 1), tp=3, chunk_bytes=256)
    assert "proj" in str(info.value)


def test_chunk_must_hold_whole_elements() -> None:
    with pytest.raises(WeightSyncError):
        make_plan(_params(4), TrainerLayout(1, 1), tp=1, chunk_bytes=258)
