"""Redis memory of a long job: flat after warm-up, or a leak (issue 9).

    python bench/redis_memory.py --out bench/results/redis_memory.json

Runs the test-sized reference job (4 prompts x 4 samples, 2 trainer workers, 2 replicas) for
``--steps`` steps (200 by default) on a fresh local stack, and reads the job's keys in Redis
(count and ``MEMORY USAGE`` summed over ``SCAN rrl:<job>:*``) each time a step commits. Measured,
nothing modelled. One sample is taken somewhere within a step (the next batch in flight or not:
25-40 kB here), so one step's sample is no baseline. Target: after ``--warm`` steps, the peak
bytes and the peak key count of the second half of the job stay within 1.5x those of the first
half, and the least-squares slope of bytes over steps, times the steps after warm-up, stays
within 0.25x the first half's median (a leak of 560 B a step passes the first test, not this
one). Exits 0 either way: the verdict is ``flat`` in the JSON. The suite's
``tests/test_rm_recovery.py`` checks a shorter job; this is the long run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from control_plane import job_spec

from robustrl.audit.raw import redis_job_bytes
from robustrl.chaos.runner import TERMINAL
from robustrl.client import ApiClient
from robustrl.stack import Stack

POLL_S = 0.05
JOB_TIMEOUT_S = 1800.0
GROWTH_MAX = 1.5
SLOPE_GROWTH_MAX = 0.25


async def _follow(api: ApiClient, redis_url: str, job_id: str) -> tuple[dict[str, Any], dict[int, tuple[int, int]]]:
    """Poll the job; at each newly committed step, the job's (keys, bytes) in Redis."""
    by_step: dict[int, tuple[int, int]] = {}
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while True:
        status = await asyncio.to_thread(api.job, job_id)
        step = int(status["committed_step"])
        if step >= 0 and step not in by_step:
            by_step[step] = await redis_job_bytes(redis_url, job_id)
        if status["status"] in TERMINAL or time.monotonic() > deadline:
            return status, by_step
        await asyncio.sleep(POLL_S)  # a poll interval of a measurement, not a wait for a condition


def _trend(later: dict[int, tuple[int, int]]) -> dict[str, Any]:
    """What a single sample hides (each is taken somewhere within a step, with its batch in flight
    or already collected): the median bytes of the first and second half after warm-up, and the
    least-squares slope of bytes over steps (a leak of a key per step shows as a steady rise)."""
    steps = sorted(later)
    half = len(steps) // 2
    out: dict[str, Any] = {"median_bytes_first_half": statistics.median(later[k][1] for k in steps[:half]) if half else None,
                           "median_bytes_second_half": statistics.median(later[k][1] for k in steps[half:])}
    if len(steps) >= 2:
        out["bytes_per_step_slope"] = round(statistics.linear_regression(steps, [later[k][1] for k in steps]).slope, 2)
    return out


def run(steps: int, warm: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="redis-mem-") as tmp:
        stack = Stack(Path(tmp))
        stack.start()
        try:
            assert stack.settings is not None
            api = ApiClient(stack.api_url, stack.settings.api_token)
            spec = job_spec("redismem", steps)  # the test-sized reference job, as the other benches run it
            t0 = time.monotonic()
            job_id = api.submit(spec)["job_id"]
            status, by_step = asyncio.run(_follow(api, stack.settings.redis_url, job_id))
            wall_s = time.monotonic() - t0
            api.close()
        finally:
            stack.stop()
    out: dict[str, Any] = {"job_id": job_id, "status": status["status"], "error": status.get("error"),
                           "steps": steps, "steps_committed": int(status["committed_step"]) + 1,
                           "wall_s": round(wall_s, 1), "warm_step": warm,
                           "by_step": {str(k): {"keys": n, "bytes": b} for k, (n, b) in sorted(by_step.items())}}
    later = {k: v for k, v in by_step.items() if k >= warm}
    steps_after = sorted(later)
    half = len(steps_after) // 2
    if half == 0:
        out["flat"] = False
        out["why"] = f"too few steps sampled after the warm-up step {warm}: {len(steps_after)}"
        return out
    first, second = steps_after[:half], steps_after[half:]
    out.update(steps_sampled=len(by_step),
               first_half={"steps": [first[0], first[-1]], "peak_bytes": max(later[k][1] for k in first),
                           "peak_keys": max(later[k][0] for k in first)},
               second_half={"steps": [second[0], second[-1]], "peak_bytes": max(later[k][1] for k in second),
                            "peak_keys": max(later[k][0] for k in second)},
               **_trend(later))
    a, b = out["first_half"], out["second_half"]
    out["bytes_ratio"] = round(b["peak_bytes"] / a["peak_bytes"], 3) if a["peak_bytes"] else None
    out["keys_ratio"] = round(b["peak_keys"] / a["peak_keys"], 3) if a["peak_keys"] else None
    # A steady leak raises the second half's peak by at most ~1.8x the first's, so the slope is
    # judged too: over the steps after warm-up, at most SLOPE_GROWTH_MAX of the first half's median.
    out["growth_by_slope_bytes"] = round(out.get("bytes_per_step_slope", 0.0) * len(steps_after))
    out["flat"] = (status["status"] == "finished" and b["peak_bytes"] <= GROWTH_MAX * a["peak_bytes"]
                   and b["peak_keys"] <= GROWTH_MAX * a["peak_keys"]
                   and out["growth_by_slope_bytes"] <= SLOPE_GROWTH_MAX * out["median_bytes_first_half"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warm", type=int, default=20)
    args = parser.parse_args(argv)
    if not 0 <= args.warm < args.steps:
        parser.error(f"--warm must be in [0, --steps): got {args.warm} with --steps {args.steps}")
    out: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "measured": True,
                           "run": run(args.steps, args.warm)}
    r = out["run"]
    out["summary"] = {k: r.get(k) for k in ("status", "steps_committed", "first_half", "second_half", "bytes_ratio",
                                            "keys_ratio", "median_bytes_first_half", "median_bytes_second_half",
                                            "bytes_per_step_slope", "growth_by_slope_bytes", "flat", "wall_s")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
