"""Reward trend and recovery under trainer faults in sync, semi_sync and async (issue 13).

    python bench/modes.py --out bench/results/modes.json [--steps 30] [--seeds 3] [--quick]

On one embedded stack, the same seeded job (2 trainer ranks, 3 rollout replicas, a tool-using
task mix) runs in each mode

  * fault-free, once per seed (the seed-to-seed spread of the reward curve), and
  * with a trainer crash every 10 steps (from step 5, at a seeded random moment of the step),
    recovered with the job's standby policy: in semi_sync/async the new gang borrows ready
    rollout replicas (in place), in sync every rank starts cold,

plus the async job with borrowing switched off (``recovery.borrow: never``, cold starts), the
baseline the borrowed recoveries are compared with in the same run. Every run has the same
tuning; only the mode (and, for the baseline, the borrow knob) differs.

Measured, never simulated: rewards (commits), recovery_s and its source (the controller's
``recovered`` events: fault detected -> new gang ready), ETTR (event-log accounting), and the
replicas' token throughput during each trainer recovery against the same length of time just
before it, from the replicas' own ``tokens_total`` counters as they were published on the bus
(``metrics`` subjects, sampled every ``detector.metrics_interval_s``; interpolated linearly
between samples).

``--quick``: fewer steps (20), faulted runs on the first seed only (the fault-free spread still
over ``--seeds``). Writes the JSON and a PNG with every reward curve next to it.
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

import nats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from robustrl.chaos.accounting import account
from robustrl.chaos.runner import run_job
from robustrl.chaos.scenario import Faults, Scenario
from robustrl.client import ApiClient
from robustrl.messages import Event, MetricsSample, decode
from robustrl.stack import Stack
from robustrl.subjects import Verb, all_jobs

MODES = {"sync": 0, "semi_sync": 1, "async": 2}
"""mode -> staleness."""
STEP_TIME_S = 1.0
"""Typical step of this job here; ``within_step: random`` draws the crash moment in [0, it)."""


def job_spec(mode: str, seed: int, steps: int, **recovery: Any) -> dict[str, Any]:
    """The benchmark job: the same for every mode but for the mode itself."""
    return {"name": f"modes-{mode.replace('_', '-')}", "seed": seed, "steps": steps, "mode": mode,
            "staleness": MODES[mode],
            "data": {"tasks": ["reverse", "lookup"], "prompts_per_step": 6, "group_size": 4},
            "rollout": {"replicas": 3},
            "trainer": {"workers": 2},
            # Tool calls of 1 s: steps of ~1.5-2 s here, so a fault every 10 steps leaves a cold
            # replacement replica time to start (the paper's regime: recoveries short against the
            # time between faults). With 0.3 s calls (~1 s steps) the replacements were still loading
            # at the next fault, whose gang then started cold.
            "tools": {"latency_s": 1.0},
            "detector": {"metrics_interval_s": 0.25},
            "recovery": {"min_replicas_kept": 1, **recovery}}


def trainer_faults(seed: int) -> Scenario:
    return Faults("trainer-every-10", seed=seed).crash("trainer", member="random", every=10, start=5,
                                                        within_step="random").build()


class TokenTap:
    """Every rollout metrics sample of every job, with its arrival time (a raw view of the bus)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.samples: dict[str, dict[str, list[tuple[float, int]]]] = {}  # job -> member -> [(t, tokens)]
        self._nc: Any = None

    async def start(self) -> None:
        self._nc = await nats.connect(self.url)

        async def on_msg(msg: Any) -> None:
            try:
                m = decode(MetricsSample, msg.data, msg.subject)
            except Exception:  # noqa: BLE001 - not ours to judge
                return
            if m.role == "rollout":
                self.samples.setdefault(m.job_id, {}).setdefault(m.member_id, []).append((time.time(), m.tokens_total))

        await self._nc.subscribe(all_jobs(Verb.METRICS), cb=on_msg)

    async def close(self) -> None:
        if self._nc is not None:
            await self._nc.close()

    def tokens_at(self, job_id: str, t: float) -> float:
        """The pool's tokens decoded by time ``t`` (each replica's counter, interpolated)."""
        total = 0.0
        for series in self.samples.get(job_id, {}).values():
            before = [(ts, n) for ts, n in series if ts <= t]
            after = [(ts, n) for ts, n in series if ts > t]
            if not before:
                continue
            t0, n0 = before[-1]
            if after:
                t1, n1 = after[0]
                total += n0 + (n1 - n0) * (t - t0) / max(1e-9, t1 - t0)
            else:
                total += n0
        return total


def ettr_to_last_commit(events: list[dict[str, Any]]) -> float:
    """The project's ETTR accounting over the job up to its last commit: the same effective time,
    without the job's end (the last checkpoint upload and the members' stop grace, several seconds
    that weigh on a 20-step job of ~1 s steps, faults or not)."""
    commits = [e["ts"] for e in events if e["kind"] == "step_committed"]
    if not commits:
        return 0.0
    last = max(commits)
    kept = [Event.model_validate(e) for e in events if e["ts"] <= last and e["kind"] != "job_finished"]
    return round(account(kept).ettr, 4)


def recoveries(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Trainer recoveries from the controller's events: source, recovery_s, and their window."""
    detected = {e["data"]["fault_id"]: e["ts"] for e in events if e["kind"] == "fault_detected"
                and "fault_id" in e["data"]}
    out = []
    for e in events:
        d = e["data"]
        if e["kind"] == "recovered" and d.get("kind") == "trainer":
            rec_s = d.get("recovery_s", d.get("took_s"))
            began = detected.get(d["fault_id"], e["ts"] - float(rec_s or 0.0))
            out.append({"fault_id": d["fault_id"], "source": d.get("source", "cold"),
                        "sources": d.get("sources"), "recovery_s": round(float(rec_s), 3),
                        "window": [began, e["ts"]]})
    return out


BASELINE_S = 10.0
"""Pool token rate before a fault is taken over this long: generation here comes in bursts between
1 s tool calls, so a window as short as a borrowed recovery (~1 s) lands on a burst or a tool wait
and says more about the phase than the rate (both are recorded)."""


AFTER_S = 5.0


def throughput(tap: TokenTap, job_id: str, window: list[float]) -> dict[str, float]:
    """Pool tokens/s during ``window``, over ``BASELINE_S`` before it, and over as long as the
    window just before it."""
    a, b = window
    span = max(0.25, b - a)
    during = (tap.tokens_at(job_id, a + span) - tap.tokens_at(job_id, a)) / span
    before = (tap.tokens_at(job_id, a) - tap.tokens_at(job_id, a - BASELINE_S)) / BASELINE_S
    same_span = (tap.tokens_at(job_id, a) - tap.tokens_at(job_id, a - span)) / span
    # A borrowed recovery can be as short as one metrics interval: the rate over the 5 s from the
    # fault's detection (the recovery and what follows it) is the steadier figure.
    after = (tap.tokens_at(job_id, a + AFTER_S) - tap.tokens_at(job_id, a)) / AFTER_S
    return {"before_tok_s": round(before, 1), "during_tok_s": round(during, 1), "span_s": round(span, 3),
            "baseline_s": BASELINE_S, "before_same_span_tok_s": round(same_span, 1),
            "after_detection_tok_s": round(after, 1), "after_s": AFTER_S}


async def run(stack: Stack, api: ApiClient, tap: TokenTap, spec: dict[str, Any], scenario: Scenario | None,
              label: str) -> dict[str, Any]:
    assert stack.settings
    t0 = time.time()
    report = await run_job(stack.settings, api, spec, scenario, step_time_s=STEP_TIME_S, timeout_s=900)
    wall = time.time() - t0
    events = await asyncio.to_thread(api.events, report["job_id"])
    out: dict[str, Any] = {"reward_by_step": [round(r, 4) for r in report["reward_by_step"]],
                           "wall_s": round(report["completion_s"], 2), "status": report["status"],
                           "ettr": round(report["ettr"], 4), "ettr_to_last_commit": ettr_to_last_commit(events),
                           "seed": spec["seed"]}
    if scenario is not None:
        recs = recoveries(events)
        for r in recs:
            r["throughput"] = throughput(tap, report["job_id"], r.pop("window"))
        out["recoveries"] = recs
        out["stale_turns_dropped"] = sum(e["data"].get("turns", 0) for e in events
                                         if e["kind"] == "stale_turns_dropped")
    srcs = [(r["source"], r["recovery_s"]) for r in out.get("recoveries", [])]
    print(f"{label:34s} {report['status']:8s} wall {out['wall_s']:6.1f}s ETTR {out['ettr']:.3f} "
          f"(to last commit {out['ettr_to_last_commit']:.3f}) "
          f"recoveries {srcs} ({wall:.0f}s)", flush=True)
    return out


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    def recs(mode: str, source: str) -> list[float]:
        return [r["recovery_s"] for run_ in results["modes"][mode]["faulted_runs"] for r in run_["recoveries"]
                if r["source"] == source]

    borrowed = recs("semi_sync", "borrowed") + recs("async", "borrowed")
    cold_same_mode = recs("async_cold", "cold") if "async_cold" in results["modes"] else []
    cold_all = cold_same_mode + recs("sync", "cold")
    def tp_ratio(source: str | None, baseline: str = "before_tok_s", during_key: str = "during_tok_s",
                 span_key: str = "span_s") -> float | None:
        tps = [r["throughput"] for run_ in results["modes"]["async"]["faulted_runs"] for r in run_["recoveries"]
               if source is None or r["source"] == source]
        before = sum(t[baseline] * t[span_key] for t in tps)
        during = sum(t[during_key] * t[span_key] for t in tps)
        return round(during / before, 3) if before > 0 else None

    s = {"borrowed_recovery_s_median": _median(borrowed), "cold_recovery_s_median": _median(cold_all),
         "cold_recovery_s_median_async_no_borrow": _median(cold_same_mode),
         "standby_vs_cold_recovery_ratio": (round(statistics.median(borrowed) / statistics.median(cold_all), 3)
                                            if borrowed and cold_all else None),
         "throughput_during_recovery_ratio": tp_ratio(None),
         "throughput_during_recovery_ratio_vs_same_span_before": tp_ratio(None, "before_same_span_tok_s"),
         "throughput_5s_after_detection_ratio": tp_ratio(None, during_key="after_detection_tok_s",
                                                         span_key="after_s"),
         "throughput_during_recovery_ratio_by_source": {src: tp_ratio(src) for src in ("borrowed", "cold", "spare")},
         "ettr_faulted": {m: results["modes"][m]["faulted"]["ettr"] for m in results["modes"]},
         "ettr_faulted_to_last_commit": {m: results["modes"][m]["faulted"]["ettr_to_last_commit"]
                                         for m in results["modes"]},
         "ettr_fault_free_to_last_commit": {m: results["modes"][m]["fault_free"]["ettr_to_last_commit"]
                                            for m in results["modes"] if "fault_free" in results["modes"][m]}}
    # Reward: is each faulted curve within the fault-free seed-to-seed spread (mean of the last
    # third of the steps)?
    for r in results["modes"].values():
        free = [run_["reward_by_step"] for run_ in r["fault_free_runs"]]
        if not free:
            continue
        tail = max(1, len(free[0]) // 3)
        means = [statistics.fmean(c[-tail:]) for c in free if c]
        faulted = [statistics.fmean(run_["reward_by_step"][-tail:]) for run_ in r["faulted_runs"]
                   if run_["reward_by_step"]]
        r["reward_tail_spread"] = {"fault_free_min": round(min(means), 4), "fault_free_max": round(max(means), 4),
                                   "fault_free_mean": round(statistics.fmean(means), 4),
                                   "faulted": [round(x, 4) for x in faulted],
                                   "faulted_within_spread": all(min(means) <= x <= max(means) for x in faulted)}
    return s


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(results["modes"])
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 4), sharey=True)
    for ax, mode in zip(axes, modes, strict=True):
        r = results["modes"][mode]
        # the cold baseline (async, borrow=never) is drawn against async's fault-free seeds
        free = r["fault_free_runs"] or results["modes"].get(r["mode"], {}).get("fault_free_runs", [])
        for i, run_ in enumerate(free):
            ax.plot(run_["reward_by_step"], color="tab:blue", alpha=0.45, label="fault-free (seeds)" if i == 0 else None)
        for i, run_ in enumerate(r["faulted_runs"]):
            ax.plot(run_["reward_by_step"], color="tab:red", lw=2,
                    label="trainer fault every 10 steps" if i == 0 else None)
        knobs = "".join(f", {k}={v}" for k, v in r.get("recovery", {}).items())
        sources = "/".join(sorted({x["source"] for run_ in r["faulted_runs"] for x in run_.get("recoveries", [])}))
        ax.set_title(f"{r['mode']}{knobs}: ETTR faulted {r['faulted']['ettr']:.2f} ({sources})", fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("mean reward")
    axes[0].legend(fontsize=8)
    fig.suptitle("bench/modes.py: measured reward curves (same seeded job per mode)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    steps = args.steps or (20 if args.quick else 30)
    seeds = list(range(args.seed, args.seed + args.seeds))
    faulted_seeds = seeds[:1] if args.quick else seeds
    results: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                               "command": " ".join(sys.argv), "steps": steps, "seeds": seeds,
                               "faulted_seeds": faulted_seeds, "job": job_spec("async", seeds[0], steps),
                               "measured": True, "modes": {}}
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="modes-") as tmp, Stack(Path(tmp)) as stack:
        assert stack.settings
        api = ApiClient(stack.api_url, stack.settings.api_token)
        tap = TokenTap(stack.settings.nats_url)
        await tap.start()
        try:
            plan: list[tuple[str, str, dict[str, Any]]] = [(m, m, {}) for m in MODES]
            plan.append(("async_cold", "async", {"borrow": "never"}))
            for key, mode, knobs in plan:
                r: dict[str, Any] = {"mode": mode, "recovery": knobs, "fault_free_runs": [], "faulted_runs": []}
                if key in MODES:
                    for seed in seeds:
                        r["fault_free_runs"].append(await run(stack, api, tap, job_spec(mode, seed, steps), None,
                                                              f"{key} fault-free seed {seed}"))
                for seed in faulted_seeds:
                    r["faulted_runs"].append(await run(stack, api, tap, job_spec(mode, seed, steps, **knobs),
                                                       trainer_faults(seed), f"{key} faulted seed {seed}"))
                if r["fault_free_runs"]:
                    r["fault_free"] = r["fault_free_runs"][0]
                r["faulted"] = r["faulted_runs"][0]
                results["modes"][key] = r
        finally:
            await tap.close()
            api.close()
    results["summary"] = summarize(results)
    results["standby_vs_cold_recovery_ratio"] = results["summary"]["standby_vs_cold_recovery_ratio"]
    results["throughput_during_recovery_ratio"] = results["summary"]["throughput_during_recovery_ratio"]
    results["total_s"] = round(time.time() - t0, 1)
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results/modes.json"))
    parser.add_argument("--steps", type=int, default=0, help="Steps per job (default 30, --quick 20).")
    parser.add_argument("--seeds", type=int, default=3, help="Seeds of the fault-free spread (>= 3).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="20 steps; faulted runs on the first seed only.")
    parser.add_argument("--plot-only", action="store_true", help="Redraw the PNG from an existing --out JSON.")
    args = parser.parse_args()
    if args.plot_only:
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        sys.exit(0)
    res = asyncio.run(main(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # The shape at the top level: {mode: {fault_free, faulted}, ratios}.
    flat = {m: {"fault_free": r.get("fault_free"), "faulted": r["faulted"]} for m, r in res["modes"].items()}
    args.out.write_text(json.dumps({**flat, **res}, indent=2))
    png = args.out.with_suffix(".png")
    plot(res, png)
    print(json.dumps(res["summary"], indent=2))
    print(f"wrote {args.out} and {png}")
