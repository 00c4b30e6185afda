"""Randomized fault campaign (issue 9): a seeded long job per mode with dozens of faults drawn over
every fault kind x role the harness knows, fired at random moments, phases (checkpoint upload,
weight publish / pull), batch hand-off and during recovery; then the independent auditor.

    python bench/campaign.py --out bench/results/campaign.json --steps 100 --faults 50 --seed 0 \
        --modes sync,semi_sync,async

Writes ``{"config": ..., "modes": {mode: {faults_injected, by_kind_role, job_completed,
steps_trained_twice, steps_lost, episodes_lost, checkpoints_unloadable,
replicas_served_bad_weights, max_stuck_s, redis_bytes_start, redis_bytes_end, ettr, ...}}}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

from robustrl.chaos.campaign import MODES, run_on_fresh_stack


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--faults", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--exclude", default="", help="comma-separated kind or kind/role to leave out")
    ap.add_argument("--run-dir", type=Path, default=None)
    ap.add_argument("--timeout-s", type=float, default=None,
                    help="stop each mode's job after this long and audit what it did (partial numbers)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    modes = tuple(m for m in args.modes.split(",") if m)
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown mode(s) {bad}; choose from {MODES}")
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="campaign-"))
    t0 = time.time()
    report = run_on_fresh_stack(run_dir, modes=modes, steps=args.steps, faults=args.faults, seed=args.seed,
                                exclude=tuple(x for x in args.exclude.split(",") if x), timeout_s=args.timeout_s)
    report["config"]["wall_s"] = round(time.time() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    summary = {m: {k: v for k, v in r.items() if k not in ("by_kind_role", "injections", "violations", "audit_facts")}
               for m, r in report["modes"].items()}
    print(json.dumps(summary, indent=1))
    ok = all(r["job_completed"] and r["audit_ok"] for r in report["modes"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
