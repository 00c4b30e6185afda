"""Per-step profile of the RL job, with the checkpoint cost set against a plain memory copy.

    python bench/step_profile.py --out bench/results/step_profile.json [--steps 10] [--small]

Runs the reference job's pipeline (five real services, embedded infra) on a larger
configuration of the same Qwen3-architecture model (>= 100 MB of weights, so fixed per-call
costs do not hide bandwidth), and reports medians over the measured steps (the first two are
warm-up): step time, its breakdown (generation, tool wait, training, checkpoint blocking,
upload, weight sync), checkpoint bytes, and the time of one plain memory copy of the same
bytes measured in this run on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from robustrl.chaos.runner import run_job  # noqa: E402
from robustrl.client import ApiClient  # noqa: E402
from robustrl.config import reference_job  # noqa: E402
from robustrl.stack import Stack  # noqa: E402

LARGE_MODEL = {"hidden_size": 512, "num_layers": 7, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 2048}


def memcpy_s(nbytes: int, repeats: int = 5) -> float:
    """Best time of one plain copy of ``nbytes`` between two preallocated host buffers."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages first
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return best


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


async def main(args: argparse.Namespace) -> dict[str, Any]:
    spec = reference_job(steps=args.steps, seed=args.seed).model_dump(mode="json")
    spec["name"] = "step-profile"
    if not args.small:
        spec["model"] = {**spec["model"], **LARGE_MODEL}
        spec["data"] = {**spec["data"], "prompts_per_step": 4, "group_size": 8}
    with tempfile.TemporaryDirectory(prefix="profile-") as tmp, Stack(Path(tmp)) as stack:
        assert stack.settings
        api = ApiClient(stack.api_url, stack.settings.api_token)
        report = await run_job(stack.settings, api, spec, None, timeout_s=1800)
        events = api.events(report["job_id"])
        api.close()
    commits = sorted((e for e in events if e["kind"] == "step_committed"), key=lambda e: e["data"]["step"])
    starts = {}
    for e in events:
        if e["kind"] == "step_started":
            starts[e["data"]["step"]] = e["ts"]
    rows = []
    for e in commits:
        d = e["data"]
        t = d["timings"]
        rows.append({"step": d["step"], "step_s": e["ts"] - starts.get(d["step"], e["ts"]),
                     "checkpoint_bytes": d["checkpoint_bytes"], **{k: t.get(k) for k in (
                         "generation_s", "tool_wait_s", "training_s", "checkpoint_blocking_s",
                         "checkpoint_wait_s", "upload_s", "weight_sync_s", "publish_s")}})
    measured = [r for r in rows if r["step"] >= 2] or rows
    ckpt_bytes = int(median([r["checkpoint_bytes"] for r in measured]) or 0)
    result: dict[str, Any] = {
        "model": spec["model"], "steps": len(rows), "status": report["status"],
        "weights_bytes": next((e["data"]["bytes"] for e in events if e["kind"] == "weights_published"), None),
        "checkpoint_bytes": ckpt_bytes,
        "memcpy_same_bytes_s": memcpy_s(ckpt_bytes) if ckpt_bytes else None,
        "per_step": rows,
    }
    for key in ("step_s", "generation_s", "tool_wait_s", "training_s", "checkpoint_blocking_s",
                "checkpoint_wait_s", "upload_s", "weight_sync_s", "publish_s"):
        result[key] = median([r[key] for r in measured if r[key] is not None])
    if result["memcpy_same_bytes_s"]:
        result["blocking_over_memcpy"] = result["checkpoint_blocking_s"] / result["memcpy_same_bytes_s"]
        result["blocking_share_of_step"] = result["checkpoint_blocking_s"] / result["step_s"]
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results/step_profile.json"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--small", action="store_true", help="Use the tiny reference model instead.")
    args = parser.parse_args()
    res = asyncio.run(main(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    print(json.dumps({k: v for k, v in res.items() if k != "per_step"}, indent=2))
