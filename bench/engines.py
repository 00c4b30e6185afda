"""Rollout engines side by side: torch vs vLLM on the same model and prompts.

    python bench/engines.py --out bench/results/engines.json [--model DIR] [--prompts 16] [--tokens 64]

Writes ``{engine: {tokens_per_s, weight_load_s, weight_bytes, first_token_s, ...}}``. The torch
engine runs in this interpreter; the vLLM engine in the vLLM environment's (``.venv-vllm``,
``scripts/setup.sh --vllm``), as a child running this file with ``--child vllm``. Without
``--model`` a small random-init Qwen3 directory with a real BPE tokenizer is made offline
(``robustrl.model.tiny``). Every engine gets the same chat-template prompts, seeds and lengths
(sampling at temperature 1, no stop on tool calls, so every turn runs its full length).

- ``tokens_per_s``: generated tokens / wall time of one ``generate`` of every prompt at once
  (after one warm-up call), best of ``--rounds``;
- ``first_token_s``: from that call to the first token reported (``on_token``), best of rounds;
- ``weight_load_s``: the in-place swap of a version whose bytes were already received, as the
  replica does it: each load's version lies in a new buffer from the engine's ``alloc_buffer``
  (the replica's loader allocates one per version and pulls into it, every chunk verified on
  arrival; here one copy fills it, untimed) and ``load_weights`` takes views into it, no checksum
  asked (median of ``--loads``, alternating two versions, one torch thread as in a replica). ``memcpy_s``: one copy of the same number of bytes from that buffer into a
  preallocated one (median, interleaved with the loads: same machine state); ``load_vs_memcpy``
  their ratio. ``weight_load_parts``: where the time goes (vLLM: the phases seen by the replica
  and by vLLM's worker). ``weight_load_checksummed_s``: one load with the optional checksum
  (tests, audits); ``weight_load_staged_s`` (vLLM): a state dict in plain memory, packed into a
  shared segment first;
- ``start_s``: building the engine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


SIZES: dict[str, dict[str, int]] = {
    "tiny": {},  # make_tiny_hf_model's own: hidden 128, 2 layers (8.5 M parameters, most of them embeddings)
    "small": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 1536},
}
"""Model sizes made offline (``--size``): fixed per-swap costs weigh on the tiny one's 34 MB."""


def prompts(tok: Any, n: int) -> list[list[int]]:
    from robustrl.rl import tasks

    return [tasks.initial_prompt_ids(p, tok) for p in tasks.sample_prompts(["lookup", "reverse"], 0, n, seed=0)]


def measure(kind: str, model_dir: str, n_prompts: int, n_tokens: int, rounds: int, loads: int = 9) -> dict[str, Any]:
    import torch

    from robustrl.config import ModelSpec
    from robustrl.model.engine import GenRequest
    from robustrl.model.hf import ChatTokenizer
    from robustrl.model.policy import build_policy

    torch.set_num_threads(max(1, torch.get_num_threads()))
    tok = ChatTokenizer(model_dir)
    t0 = time.monotonic()
    model = build_policy(ModelSpec(path=model_dir, max_positions=512), tok, 0)
    if kind == "torch":
        from robustrl.model.engine import GenerationEngine

        engine: Any = GenerationEngine(model, tok, max_batch=n_prompts)
    else:
        from robustrl.model.engines.vllm import VllmEngine

        engine = VllmEngine(model_dir, tok, max_batch=n_prompts, max_model_len=512, seed=0,
                            cpu_linear="plain" if kind == "vllm_plain" else "packed")
    start_s = time.monotonic() - t0
    reqs = [GenRequest(f"p{i}", ids, n_tokens, temperature=1.0, top_p=1.0, seed=i, stop_on_call=False)
            for i, ids in enumerate(prompts(tok, n_prompts))]
    engine.generate(reqs[:2])  # warm-up
    best_tps, best_first = 0.0, float("inf")
    for _ in range(rounds):
        first: list[float] = []
        t = time.monotonic()
        out = engine.generate(reqs, on_token=lambda n, t=t, first=first: first or first.append(time.monotonic() - t))
        wall = time.monotonic() - t
        tokens = sum(len(r.token_ids) for r in out)
        best_tps = max(best_tps, tokens / wall)
        best_first = min(best_first, first[0] if first else wall)
    load = measure_loads(kind, engine, model, loads)
    engine.close()
    return {"tokens_per_s": round(best_tps, 1), "first_token_s": round(best_first, 4), **load,
            "start_s": round(start_s, 2), "prompts": n_prompts, "tokens_per_turn": n_tokens, "rounds": rounds,
            "python": sys.executable}


def _median_parts(parts: list[dict[str, float]]) -> dict[str, float]:
    keys = [k for k in parts[0] if k not in ("bytes", "linear_layers", "plain_linear_layers")] if parts else []
    return {k: round(statistics.median(p.get(k, 0.0) for p in parts), 5) for k in keys}


def measure_loads(kind: str, engine: Any, model: Any, n: int) -> dict[str, Any]:
    """The in-place swap of already-received versions, against one memcpy of their bytes."""
    import torch

    from robustrl.model.policy import weights_checksum
    from robustrl.weights.flat import flatten_state_dict, unflatten

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a replica's setting (services/rollout/replica.py)
    base = {name: t.detach().clone() for name, t in model.state_dict().items()}
    sources = [flatten_state_dict({name: t + 0.01 * k for name, t in base.items()}, k, 1 << 20) for k in (1, 2)]

    def receive(k: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """As the replica receives a version: a new buffer from the engine, the verified chunks
        written into it as the puller does, then the engine's hint (vLLM: its worker maps the
        segment) and the whole version's checksum, which the loader takes before every swap."""
        src, manifest = sources[k]
        buf = engine.alloc_buffer(manifest.total_bytes)
        buf[:] = src.numpy()
        engine.prepare_buffer(buf)
        state = unflatten(torch.from_numpy(buf), manifest)
        weights_checksum(state)
        return torch.from_numpy(buf), state

    weight_bytes = sum(t.numel() * t.element_size() for t in base.values())
    dst = torch.empty(weight_bytes, dtype=torch.uint8)
    dst.copy_(sources[0][0][:weight_bytes])  # warm: no first-touch page faults in the baseline
    loads, copies, parts, worker = [], [], [], []
    for i in range(n + 2):  # the first two (one per version) warm up
        flat, state = receive(i % 2)
        t = time.perf_counter()
        dst.copy_(flat[:weight_bytes])
        copy_s = time.perf_counter() - t
        t = time.perf_counter()
        engine.load_weights(state, i + 1)
        load_s = time.perf_counter() - t
        if i < 2:
            continue
        copies.append(copy_s)
        loads.append(load_s)
        if kind != "torch":
            parts.append(dict(engine.last_load))
            worker.append(engine.worker_timings()[0])
    last_state = state
    out: dict[str, Any] = {"weight_load_s": round(statistics.median(loads), 5), "weight_bytes": weight_bytes,
                           "memcpy_s": round(statistics.median(copies), 5), "loads": n}
    out["load_vs_memcpy"] = round(out["weight_load_s"] / out["memcpy_s"], 2)
    out["weight_load_min_s"] = round(min(loads), 5)
    out["memcpy_min_s"] = round(min(copies), 5)
    # The optional checksum (tests, audits), once, off the numbers above.
    want = weights_checksum(last_state)
    t = time.perf_counter()
    engine.load_weights(last_state, n + 3, checksum=want)
    out["weight_load_checksummed_s"] = round(time.perf_counter() - t, 5)
    if kind == "torch":
        assert weights_checksum(engine.model) == want, "the engine holds other weights than it was given"
        out["weight_load_parts"] = {"copy": out["weight_load_s"]}
        out["weight_load_includes"] = ("GenerationEngine.load_weights: one copy_ per tensor from the received "
                                       "buffer's views into the model's parameters, names/dtypes/shapes checked; "
                                       "no hashing")
    else:
        out["weight_load_parts"] = _median_parts(parts)
        out["weight_load_parts_worker"] = _median_parts(worker)
        out["linear_layers"] = {k: worker[-1].get(k) for k in ("linear_layers", "plain_linear_layers")} if worker else None
        out["weight_load_includes"] = (
            "VllmEngine.load_weights, replica side: locate the buffer's memfd segment (stage 0), no pause "
            "(nothing in flight), one round trip to vLLM's engine core and its worker process that starts, "
            "loads and finishes the update (weight_load_parts: update); worker side (weight_load_parts_worker): "
            "find the segment's mapping (map: made on the replica's hint once the pull completed, while the "
            "loader checks the version's sha256; here one copy fills a new buffer per load, the 'pull', then the "
            "hint and the checksum, untimed), vLLM load_weights and finish. "
            + ("vllm: embedding, LM head and norms copied in place; the CPU linear layers through vLLM's "
               "layerwise reload (a fresh tensor, a copy and oneDNN re-packing); finish: oneDNN re-packing of "
               "the LM head." if kind == "vllm" else
               "vllm_plain (rollout.vllm_cpu_linear: plain): every layer kept in checkpoint layout, copied in "
               "place; linear layers multiply with torch.nn.functional.linear, nothing re-packed.")
            + " No hashing.")
        staged = {name: t.clone() for name, t in last_state.items()}
        engine.load_weights(staged, n + 4)  # the first one allocates the staging segment
        t = time.perf_counter()
        engine.load_weights(staged, n + 5)
        out["weight_load_staged_s"] = round(time.perf_counter() - t, 5)
        out["weight_load_staged_parts"] = {k: round(v, 5) for k, v in engine.last_load.items()}
    torch.set_num_threads(threads)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=False)
    ap.add_argument("--model", help="Hugging Face model directory (default: a tiny one made offline)")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny",
                    help="the random-init Qwen3 made offline when no --model is given (tiny: 34 MB, small: 0.2 GB)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--loads", type=int, default=9, help="weight loads timed per engine")
    ap.add_argument("--engines", default="torch,vllm,vllm_plain",
                    help="torch, vllm (vLLM's packed CPU linear layout), vllm_plain (rollout.vllm_cpu_linear: plain)")
    ap.add_argument("--child", choices=["torch", "vllm", "vllm_plain"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.model, args.prompts, args.tokens, args.rounds, args.loads)))
        return
    if not args.out:
        ap.error("--out is required")
    from robustrl.model.engines.envs import vllm_python

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if not model_dir:
            from robustrl.model.tiny import make_tiny_hf_model

            model_dir = str(make_tiny_hf_model(Path(tmp) / "tiny-hf", **SIZES[args.size]))
        results: dict[str, Any] = {}
        for kind in args.engines.split(","):
            python = sys.executable if kind == "torch" else str(vllm_python())
            if not Path(python).exists():
                results[kind] = {"error": f"no interpreter at {python} (scripts/setup.sh --vllm)"}
                continue
            run = subprocess.run([python, __file__, "--child", kind, "--model", model_dir, "--prompts",
                                  str(args.prompts), "--tokens", str(args.tokens), "--rounds", str(args.rounds),
                                  "--loads", str(args.loads)],
                                 check=False, capture_output=True, text=True, timeout=1800)
            lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
            if run.returncode != 0 or not lines:
                results[kind] = {"error": (run.stderr or run.stdout)[-1500:]}
            else:
                results[kind] = json.loads(lines[-1])
            print(kind, json.dumps(results[kind])[:300], flush=True)
        results["model"] = {"dir": args.model or f"{args.size} random-init Qwen3 ({SIZES[args.size]}, 32,007-token BPE)",
                            "dtype": "float32"}
        results["command"] = " ".join(sys.argv)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
