"""Member start cost, cold vs forked (``ROBUSTRL_FORK_START``), side by side in one run: on a fresh
local stack per mode, a small job (2 trainer ranks, 2 rollout replicas) is timed from its
``job_started`` event to its first ``weights_published`` and first ``step_committed``; then a
trainer rank is crashed after step 1 and the fault's recovery time (detection to the new gang
running, the controller's ``recovery_s``) is read. Every figure is measured (event timestamps).

    python bench/start.py --out bench/results/start.json --repeats 2

Writes ``{"config": ..., "modes": {"cold"|"forked": {"runs": [{first_weights_s, first_commit_s,
trainer_recovery_s}, ...], "median": {...}}}}``. A forked run waits for the zygote's imports
(``logs/zygote.log``: "ready") before its first job, as a stack that has been up a few seconds would.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from robustrl.client import ApiClient
from robustrl.launcher.zygote import FORK_START_ENV
from robustrl.stack import Stack

TERMINAL = ("finished", "failed", "stopped")
JOB = {"steps": 4, "seed": 3, "data": {"prompts_per_step": 4, "group_size": 4}, "rollout": {"replicas": 2}}


def _until(what: str, fn: Any, timeout_s: float, every_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(every_s)  # polling a running job through its API
    raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")


def _one(api: ApiClient, name: str) -> dict[str, Any]:
    jid = api.submit({**JOB, "name": name})["job_id"]
    _until("step 1 committed", lambda: api.job(jid)["committed_step"] >= 1, 300)
    api.fault(jid, kind="crash", role="trainer", member=0)
    status = _until("job ended", lambda: (s := api.job(jid))["status"] in TERMINAL and s, 300)
    if status["status"] != "finished":
        raise RuntimeError(f"job {jid} ended {status['status']}: {status.get('error')}")
    events = api.events(jid)
    t0 = next(e["ts"] for e in events if e["kind"] == "job_started")
    first = {k: next(e["ts"] for e in events if e["kind"] == k) - t0
             for k in ("weights_published", "step_committed")}
    trainer = [f for f in status["faults"] if f.get("role") == "trainer" and f.get("recovery_s") is not None]
    return {"first_weights_s": round(first["weights_published"], 3), "first_commit_s": round(first["step_committed"], 3),
            "trainer_recovery_s": round(trainer[0]["recovery_s"], 3) if trainer else None}


def run_mode(fork: bool, repeats: int) -> dict[str, Any]:
    os.environ[FORK_START_ENV] = "1" if fork else "0"
    with tempfile.TemporaryDirectory(prefix="rrl-start-") as d:
        stack = Stack(Path(d))
        stack.start()
        try:
            assert stack.settings
            api = ApiClient(stack.api_url, stack.settings.api_token)
            if fork:
                log = Path(d) / "logs" / "zygote.log"
                _until("the zygote ready", lambda: log.exists() and b"ready" in log.read_bytes(), 120)
            runs = [_one(api, f"start-{'forked' if fork else 'cold'}-{i}") for i in range(repeats)]
            api.close()
        finally:
            stack.stop()
    keys = runs[0].keys()
    median = {k: round(statistics.median(r[k] for r in runs if r[k] is not None), 3) for k in keys
              if any(r[k] is not None for r in runs)}
    return {"runs": runs, "median": median}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    report = {"config": {"job": JOB, "repeats": args.repeats, "cpus": os.cpu_count(), "measured": True},
              "modes": {"cold": run_mode(False, args.repeats), "forked": run_mode(True, args.repeats)}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({m: r["median"] for m, r in report["modes"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
