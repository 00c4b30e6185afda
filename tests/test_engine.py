"""GenerationEngine: determinism, stop reasons, batch == single, KV cache == full forward."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from robustrl.config import ModelSpec
from robustrl.errors import ConfigError, WeightSyncError
from robustrl.model.engine import GenerationAborted, GenerationEngine, GenRequest
from robustrl.model.policy import build_policy, save_policy, weights_checksum
from robustrl.model.tokenizer import CharTokenizer
from robustrl.rl.grpo import token_logprobs

torch.set_num_threads(1)
TOK = CharTokenizer.default()


@pytest.fixture
def engine() -> GenerationEngine:
    return GenerationEngine(build_policy(ModelSpec(), TOK, seed=0), TOK)


def prompt(text: str) -> list[int]:
    return [TOK.bos_id, *TOK.encode(text), TOK.eot_id]


def force_token(engine: GenerationEngine, token_id: int) -> None:
    """Make ``token_id`` overwhelmingly likely by zeroing the head and raising one row's bias."""
    head = engine.model.lm_head
    with torch.no_grad():
        head.weight.zero_()
        head.bias = torch.nn.Parameter(torch.full((TOK.vocab_size,), -50.0))
        head.bias[token_id] = 50.0


def test_same_request_same_tokens_and_seed_matters(engine: GenerationEngine) -> None:
    req = GenRequest("a", prompt("reverse abc:"), 12, seed=7)
    first = engine.generate([req])[0]
    again = engine.generate([req])[0]
    assert first.token_ids == again.token_ids and first.logprobs == again.logprobs
    other = engine.generate([GenRequest("b", req.prompt_ids, 12, seed=8)])[0]
    assert other.token_ids != first.token_ids
    assert len(first.token_ids) == len(first.logprobs)
    assert all(lp <= 0 for lp in first.logprobs)


def test_weights_checksum_is_stable_and_tracks_weights() -> None:
    a, b = build_policy(ModelSpec(), TOK, 0), build_policy(ModelSpec(), TOK, 0)
    assert weights_checksum(a) == weights_checksum(b) == weights_checksum(a.state_dict())
    assert weights_checksum(a) != weights_checksum(build_policy(ModelSpec(), TOK, 1))


def test_policy_save_and_load_from_path(tmp_path: Path) -> None:
    model = build_policy(ModelSpec(), TOK, 3)
    save_policy(model, TOK, tmp_path)
    loaded = build_policy(ModelSpec(path=str(tmp_path)), CharTokenizer.load(tmp_path), seed=99)
    assert weights_checksum(loaded) == weights_checksum(model)
    with pytest.raises(ConfigError):
        build_policy(ModelSpec(path=str(tmp_path / "missing")), TOK, 0)


def test_stop_reasons(engine: GenerationEngine) -> None:
    base = prompt("lookup abc:")
    length = engine.generate([GenRequest("l", base, 5, seed=1)])[0]
    force_token(engine, TOK.eot_id)
    eot = engine.generate([GenRequest("e", base, 5)])[0]
    assert (eot.token_ids, eot.stop_reason) == ([TOK.eot_id], "eot")
    force_token(engine, TOK.call_id)
    call = engine.generate([GenRequest("c", base, 5)])[0]
    assert (call.token_ids, call.stop_reason) == ([TOK.call_id], "tool_call")
    no_stop = engine.generate([GenRequest("n", base, 5, stop_on_call=False)])[0]
    assert (no_stop.token_ids, no_stop.stop_reason) == ([TOK.call_id] * 5, "length")
    # random init: essentially never stops early in 5 tokens
    assert length.stop_reason == "length" and len(length.token_ids) == 5


def test_batch_with_mixed_lengths_equals_one_at_a_time(engine: GenerationEngine) -> None:
    texts = ["reverse ab:", "lookup fedcba:", "c:", "calc 12*7:", "copy abcdefabcdef:"]
    for temperature in (0.0, 1.0):
        reqs = [GenRequest(f"r{i}", prompt(t), 6 + i, temperature=temperature, top_p=0.9, seed=i)
                for i, t in enumerate(texts)]
        batched = engine.generate(reqs)
        single = [engine.generate([r])[0] for r in reqs]
        for b, s in zip(batched, single, strict=True):
            assert b.request_id == s.request_id
            assert b.token_ids == s.token_ids
            assert b.stop_reason == s.stop_reason
            assert b.logprobs == pytest.approx(s.logprobs, abs=1e-4)


def test_kv_cache_greedy_equals_full_forward(engine: GenerationEngine) -> None:
    ids = prompt("reverse abcd:")
    res = engine.generate([GenRequest("g", ids, 8, temperature=0.0)])[0]
    seq = list(ids)
    with torch.no_grad():
        for _ in range(len(res.token_ids)):
            logits = engine.model(input_ids=torch.tensor([seq])).logits[0, -1]
            seq.append(int(logits.argmax()))
    assert res.token_ids == seq[len(ids):]
    # greedy decoding samples from a point mass: every behaviour logprob is log 1
    assert res.logprobs == [0.0] * len(res.token_ids)


def test_logprobs_at_temperature_1_are_what_the_trainer_recomputes(engine: GenerationEngine) -> None:
    ids = prompt("reverse abcd:")
    res = engine.generate([GenRequest("s", ids, 10, temperature=1.0, top_p=1.0, seed=3)])[0]
    seq = ids + res.token_ids
    full = token_logprobs(engine.model, torch.tensor([seq]), torch.ones(1, len(seq), dtype=torch.long))
    assert res.logprobs == pytest.approx(full[0, len(ids):].tolist(), abs=1e-4)


def _sampled_distribution_logprob(logits: torch.Tensor, temperature: float, top_p: float, token: int) -> float:
    """Directly: scale by temperature, keep the smallest most-likely set with mass >= top_p,
    renormalise, and read the token's log probability (-inf if it was not in the set)."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = sorted(range(len(probs)), key=lambda i: -float(probs[i]))
    kept, mass = [], 0.0
    for i in order:
        if mass >= top_p:
            break
        kept.append(i)
        mass += float(probs[i])
    return float(torch.log(probs[token] / mass)) if token in kept else float("-inf")


@pytest.mark.parametrize(("temperature", "top_p"), [(0.7, 1.0), (1.0, 0.8), (1.5, 0.6), (0.5, 0.9)])
def test_behaviour_logprobs_are_of_the_distribution_sampled_from(
        engine: GenerationEngine, temperature: float, top_p: float) -> None:
    ids = prompt("reverse abcd:")
    reqs = [GenRequest(f"s{k}", ids, 10, temperature=temperature, top_p=top_p, seed=k) for k in range(4)]
    checked = 0
    for res in engine.generate(reqs):
        seq = list(ids)
        with torch.no_grad():
            for token, logprob in zip(res.token_ids, res.logprobs, strict=True):
                logits = engine.model(input_ids=torch.tensor([seq])).logits[0, -1]
                direct = _sampled_distribution_logprob(logits, temperature, top_p, token)
                assert direct > float("-inf"), "sampled a token outside the top-p set"
                assert logprob == pytest.approx(direct, abs=1e-4)
                seq.append(token)
                checked += 1
            # The trainer's recompute of the whole sequence (one forward): the same distribution.
            full = token_logprobs(engine.model, torch.tensor([seq]), torch.ones(1, len(seq), dtype=torch.long),
                                  temperature=temperature, top_p=top_p)
        assert res.logprobs == pytest.approx(full[0, len(ids):].tolist(), abs=1e-4)
    assert checked >= 8


def test_callbacks_counter_chunks_and_abort(engine: GenerationEngine) -> None:
    counts: list[int] = []
    small = GenerationEngine(engine.model, TOK, max_batch=3)
    reqs = [GenRequest(f"r{i}", prompt("copy ab:"), 4, seed=i) for i in range(7)]
    out = small.generate(reqs, on_token=counts.append)
    assert [r.request_id for r in out] == [r.request_id for r in reqs]
    assert sum(counts) == small.tokens_generated == sum(len(r.token_ids) for r in out)
    with pytest.raises(GenerationAborted):
        small.generate(reqs, should_abort=lambda: True)
    too_long = engine.generate([GenRequest("x", [TOK.bos_id] * 300, 4)])[0]
    assert (too_long.token_ids, too_long.stop_reason) == ([], "length")


def test_load_state_dict_swaps_weights(engine: GenerationEngine) -> None:
    other = build_policy(ModelSpec(), TOK, seed=5)
    engine.load_state_dict(other.state_dict())
    assert weights_checksum(engine.model) == weights_checksum(other)


def test_load_weights_copies_in_place_and_checks_only_when_asked(engine: GenerationEngine) -> None:
    storage = {n: t.data_ptr() for n, t in engine.model.state_dict().items()}
    a = build_policy(ModelSpec(), TOK, seed=6).state_dict()
    engine.load_weights(a, 1)  # no checksum: copies only
    assert {n: t.data_ptr() for n, t in engine.model.state_dict().items()} == storage  # in place
    assert weights_checksum(engine.model) == weights_checksum(a)
    b = build_policy(ModelSpec(), TOK, seed=7).state_dict()
    engine.load_weights(b, 2, checksum=weights_checksum(b))  # asked: read back and compared
    with pytest.raises(WeightSyncError) as bad:
        engine.load_weights(a, 3, checksum=weights_checksum(b))  # a's bytes, b's checksum: refused
    assert bad.value.reason == "load_mismatch"
    # a layout the model cannot take: refused before anything is copied
    wrong = {**b, "lm_head.weight": b["lm_head.weight"][:-1]}
    with pytest.raises(WeightSyncError) as shape:
        engine.load_weights(wrong, 4)
    assert shape.value.reason == "layout"
    assert weights_checksum(engine.model) == weights_checksum(a)
    with pytest.raises(WeightSyncError):
        engine.load_weights({n: t for n, t in b.items() if n != "lm_head.weight"}, 5)


def test_decoding_64_sequences_is_fast(engine: GenerationEngine) -> None:
    reqs = [GenRequest(f"r{i}", prompt("reverse " + "abcdef"[: 3 + i % 4] + ":"), 12, seed=i) for i in range(64)]
    engine.generate(reqs[:2])  # warm-up
    # The CPU time of this thread (torch runs here: one thread, above), not the wall clock: the
    # suite's other worker shares the 2 cores.
    start, wall = time.thread_time(), time.perf_counter()
    out = engine.generate(reqs)
    cpu_s, wall_s = time.thread_time() - start, time.perf_counter() - wall
    print(f"\n64 x 12 tokens: {cpu_s * 1000:.0f} ms of CPU ({wall_s * 1000:.0f} ms of wall time)")
    assert sum(len(r.token_ids) for r in out) >= 64 * 6
    assert cpu_s < 1.0
    assert wall_s < 10.0  # (waits, or work moved to another thread, which the CPU bound misses)


def test_a_padded_embedding_never_yields_an_id_the_tokenizer_lacks() -> None:
    """A model's embedding may be padded past its tokenizer (Qwen: 151936 rows, 151669 ids). The
    padded rows are no action: made overwhelmingly likely here, the engine still samples only the
    tokenizer's ids (a padded one is refused by the request manager and regenerated alike by every
    replica, seed for seed), and its behaviour logprobs are those the trainer recomputes over the
    same ids."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from robustrl.model.policy import policy_config

    base = policy_config(ModelSpec(), TOK)
    cfg = Qwen3Config(**{**base.to_dict(), "vocab_size": TOK.vocab_size + 16})
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).float()
    with torch.no_grad():
        model.lm_head.weight[TOK.vocab_size:] = 50.0  # the padded rows dominate every step
    engine = GenerationEngine(model, TOK)
    ids = prompt("reverse abcd:")
    res = engine.generate([GenRequest("p", ids, 12, temperature=1.0, top_p=1.0, seed=5)])[0]
    assert res.token_ids and all(0 <= t < TOK.vocab_size for t in res.token_ids), res.token_ids
    seq = ids + res.token_ids
    full = token_logprobs(model, torch.tensor([seq]), torch.ones(1, len(seq), dtype=torch.long), TOK.vocab_size)
    assert res.logprobs == pytest.approx(full[0, len(ids):].tolist(), abs=1e-4)
