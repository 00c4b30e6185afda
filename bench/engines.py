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
- ``weight_load_s``: ``load_weights`` of a new state dict in place (median of 3), with
  ``memcpy_s``, one copy of the same bytes in memory, for scale;
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


def prompts(tok: Any, n: int) -> list[list[int]]:
    from robustrl.rl import tasks

    return [tasks.initial_prompt_ids(p, tok) for p in tasks.sample_prompts(["lookup", "reverse"], 0, n, seed=0)]


def measure(kind: str, model_dir: str, n_prompts: int, n_tokens: int, rounds: int) -> dict[str, Any]:
    import torch

    from robustrl.config import ModelSpec
    from robustrl.model.engine import GenRequest
    from robustrl.model.hf import ChatTokenizer
    from robustrl.model.policy import build_policy, weights_checksum

    torch.set_num_threads(max(1, torch.get_num_threads()))
    tok = ChatTokenizer(model_dir)
    t0 = time.monotonic()
    model = build_policy(ModelSpec(path=model_dir, max_positions=512), tok, 0)
    if kind == "torch":
        from robustrl.model.engine import GenerationEngine

        engine: Any = GenerationEngine(model, tok, max_batch=n_prompts)
    else:
        from robustrl.model.engines.vllm import VllmEngine

        engine = VllmEngine(model_dir, tok, max_batch=n_prompts, max_model_len=512, seed=0)
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
    state = {n: p.detach().clone() for n, p in model.state_dict().items()}
    weight_bytes = sum(v.numel() * v.element_size() for v in state.values())
    loads = []
    for i in range(3):
        new = {n: v + 0.01 * (i + 1) for n, v in state.items()}
        t = time.monotonic()
        got = engine.load_weights(new, i + 1)
        loads.append(time.monotonic() - t)
        assert got == weights_checksum(new), "the engine reported other weights than it was given"
    flat = torch.cat([v.reshape(-1).view(torch.uint8) for v in state.values()])
    copies = []
    for _ in range(5):
        t = time.monotonic()
        flat.clone()
        copies.append(time.monotonic() - t)
    engine.close()
    return {"tokens_per_s": round(best_tps, 1), "first_token_s": round(best_first, 4),
            "weight_load_s": round(statistics.median(loads), 4), "weight_bytes": weight_bytes,
            "memcpy_s": round(min(copies), 5), "start_s": round(start_s, 2), "prompts": n_prompts,
            "tokens_per_turn": n_tokens, "rounds": rounds, "python": sys.executable}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=False)
    ap.add_argument("--model", help="Hugging Face model directory (default: a tiny one made offline)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engines", default="torch,vllm")
    ap.add_argument("--child", choices=["torch", "vllm"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.model, args.prompts, args.tokens, args.rounds)))
        return
    if not args.out:
        ap.error("--out is required")
    from robustrl.model.engines.envs import vllm_python

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if not model_dir:
            from robustrl.model.tiny import make_tiny_hf_model

            model_dir = str(make_tiny_hf_model(Path(tmp) / "tiny-hf"))
        results: dict[str, Any] = {}
        for kind in args.engines.split(","):
            python = sys.executable if kind == "torch" else str(vllm_python())
            if not Path(python).exists():
                results[kind] = {"error": f"no interpreter at {python} (scripts/setup.sh --vllm)"}
                continue
            run = subprocess.run([python, __file__, "--child", kind, "--model", model_dir, "--prompts",
                                  str(args.prompts), "--tokens", str(args.tokens), "--rounds", str(args.rounds)],
                                 check=False, capture_output=True, text=True, timeout=1800)
            lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
            if run.returncode != 0 or not lines:
                results[kind] = {"error": (run.stderr or run.stdout)[-1500:]}
            else:
                results[kind] = json.loads(lines[-1])
            print(kind, json.dumps(results[kind])[:300], flush=True)
        results["model"] = {"dir": args.model or "tiny random-init Qwen3 (hidden 128, 2 layers, 32,007-token BPE)",
                            "dtype": "float32"}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
