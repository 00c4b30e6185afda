"""Run by ``tests/test_vllm_engine.py`` under the vLLM environment's Python (``.venv-vllm``).

Drives the real ``VllmEngine`` on the small HF directory and writes what it saw as JSON: greedy
and seeded generations, the stop on the tool-call marker, logprobs, the token counter, abort of
in-flight requests, and in-place weight loads through vLLM's weight transfer (the ``robustrl``
plugin). vLLM spawns its engine process, hence the ``__main__`` guard.

    python tests/vllm_probe.py MODEL_DIR OUT.json [packed|plain]

The third argument is the engine's CPU linear layout (``rollout.vllm_cpu_linear``).
"""

from __future__ import annotations

import copy
import json
import sys
import threading
import time


def main(model_dir: str, out: str, cpu_linear: str = "packed") -> None:
    import torch

    from robustrl.config import ModelSpec
    from robustrl.model.engine import GenerationAborted, GenRequest
    from robustrl.model.engines.vllm import VllmEngine
    from robustrl.model.hf import ChatTokenizer
    from robustrl.model.policy import build_policy, weights_checksum

    res: dict[str, object] = {}
    tok = ChatTokenizer(model_dir)
    t0 = time.monotonic()
    engine = VllmEngine(model_dir, tok, max_batch=8, max_model_len=512, seed=0, cpu_linear=cpu_linear)
    res["start_s"] = time.monotonic() - t0
    prompt = tok.prompt_ids("lookup abc:", "lookup")

    def greedy(n: int = 8, stop: bool = False) -> object:
        return engine.generate([GenRequest("g", prompt, n, temperature=0.0, stop_on_call=stop)])[0]

    g = greedy()
    res["greedy"] = g.token_ids
    res["greedy_reason"] = g.stop_reason
    k = next(i for i in range(2, 8) if g.token_ids[i] not in g.token_ids[:i])
    engine.tokenizer = copy.copy(tok)
    engine.tokenizer.call_id = g.token_ids[k]  # a token this random model does emit, as the marker
    m = greedy(stop=True)
    res["marker_k"] = k
    res["marked"] = m.token_ids
    res["marked_reason"] = m.stop_reason
    engine.tokenizer = tok

    before = engine.tokens_generated
    reqs = [GenRequest(f"s{i}", prompt, 12, temperature=1.0, top_p=0.9, seed=100 + i, stop_on_call=True)
            for i in range(6)]
    counted: list[int] = []
    sampled = engine.generate(reqs, on_token=counted.append)
    again = engine.generate(reqs[:2])
    res["sampled"] = [r.token_ids for r in sampled]
    res["sampled_logprobs"] = [r.logprobs for r in sampled]
    res["sampled_again"] = [r.token_ids for r in again]
    res["counter_delta"] = engine.tokens_generated - before
    res["on_token_sum"] = sum(counted)

    # Abort of in-flight requests: a long turn, aborted from another thread.
    long = [GenRequest("long", prompt, 400, temperature=1.0, seed=7, stop_on_call=False)]
    timer = threading.Timer(0.5, engine.abort)
    timer.start()
    t1 = time.monotonic()
    try:
        engine.generate(long)
        res["aborted"] = False
    except GenerationAborted:
        res["aborted"] = True
    res["abort_s"] = time.monotonic() - t1
    res["after_abort"] = greedy().token_ids  # the engine still serves

    # In place: other weights through the weight-transfer plugin, then the original ones back.
    from robustrl.errors import WeightSyncError
    from robustrl.weights.flat import flatten_state_dict, unflatten

    model = build_policy(ModelSpec(path=model_dir), tok, 0)
    original = {n: t.detach().clone() for n, t in model.state_dict().items()}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        other = {n: t + 0.05 * torch.randn_like(t) for n, t in original.items()}
    # As the replica loads: the version pulled into the engine's own (memfd) buffer, loaded with
    # the optional checksum asked for (the worker checksums what it mapped).
    src, manifest = flatten_state_dict(other, 1, 1 << 20)
    buf = engine.alloc_buffer(manifest.total_bytes)
    buf[:] = src.numpy()
    engine.prepare_buffer(buf)  # as the replica does once a pull completed: the worker maps it now
    res["other_checksum"] = weights_checksum(other)
    t2 = time.monotonic()
    engine.load_weights(unflatten(torch.from_numpy(buf), manifest), 1, checksum=res["other_checksum"])
    res["load_s"] = time.monotonic() - t2
    res["load_phases"] = engine.last_load
    res["worker_phases"] = engine.worker_timings()[0]
    res["greedy_other"] = greedy().token_ids
    # The worker keeps that segment mapped. The replica frees it and allocates the next version's
    # buffer, of the same size: the kernel hands out the freed descriptor number again, so the
    # new segment has the old one's path. Its contents (the original weights) must be what loads.
    old_path = engine._segments.locate({"b": torch.from_numpy(buf)})[0]
    del buf, src
    import gc

    gc.collect()
    buf = engine.alloc_buffer(manifest.total_bytes)
    res["same_path_reused"] = engine._segments.locate({"b": torch.from_numpy(buf)})[0] == old_path
    src, manifest = flatten_state_dict(original, 5, 1 << 20)
    buf[:] = src.numpy()
    engine.prepare_buffer(buf)  # as the replica does once a pull completed: the worker maps it now
    engine.load_weights(unflatten(torch.from_numpy(buf), manifest), 5, checksum=weights_checksum(original))
    res["greedy_reused_path"] = greedy().token_ids
    engine.load_weights(other, 6)  # back to the other weights for what follows
    # A wrong checksum: refused, and the engine still serves the weights it held.
    try:
        engine.load_weights(original, 9, checksum="0" * 64)
        res["bad_checksum_refused"] = ""
    except WeightSyncError as exc:
        res["bad_checksum_refused"] = str(getattr(exc, "reason", ""))
    res["greedy_after_refusal"] = greedy().token_ids
    # Any other state dict is staged into a segment first (copies only, no checksum asked).
    engine.load_weights(original, 2)
    res["staged_phases"] = engine.last_load
    res["greedy_restored"] = greedy().token_ids
    # The worker pulling from RobustRL weight sources (tcp) loads the same weights.
    engine.transfer = "tcp"
    engine.load_weights(other, 3, checksum=res["other_checksum"])
    res["greedy_other_tcp"] = greedy().token_ids
    engine.load_weights(original, 4)
    res["greedy_restored_tcp"] = greedy().token_ids
    res["original_checksum"] = weights_checksum(original)
    res["weight_bytes"] = sum(t.numel() * t.element_size() for t in original.values())

    # A padded embedding (rows past the tokenizer's ids): those rows made by far the most likely
    # next tokens (50x the head row of the greedy first token), every other row unchanged. No
    # padded id is sampled, greedy or seeded, and greedy picks what it picked before.
    vocab = tok.vocab_size
    heavy = {n: t.clone() for n, t in original.items()}
    head = heavy["lm_head.weight"]
    res["padded_rows"] = head.shape[0] - vocab
    head[vocab:] = 50.0 * head[g.token_ids[0]]
    engine.load_weights(heavy, 7)
    res["greedy_padded_heavy"] = greedy().token_ids
    heavy_sampled = engine.generate(reqs)
    res["sampled_padded_heavy"] = [r.token_ids for r in heavy_sampled]
    res["sampled_padded_heavy_logprobs"] = [r.logprobs for r in heavy_sampled]
    res["vocab"] = vocab
    res["counters"] = {"generation_tokens": engine.counters.generation_tokens,
                       "prompt_tokens": engine.counters.prompt_tokens, "iterations": engine.counters.iterations}
    engine.close()
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
