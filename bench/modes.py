"""Reward trend and recovery under trainer faults in sync, semi_sync and async (issue 13).

    python bench/modes.py --out bench/results/modes.json [--steps 30] [--seeds 3] [--quick]

On one embedded stack, the same seeded job (2 trainer ranks, 3 rollout replicas, a tool-using
task mix) runs in each mode

  * fault-free, once per seed (the seed-to-seed spread of the reward curve), and
  * with a trainer crash every 10 steps (from step 5, at a seeded random moment of the step),
    recovered with the job's standby policy: in semi_sync/async the new gang borrows ready
    rollout replicas (in place), in sync every rank starts cold,

plus the async job with borrowing switched off (``recovery.borrow: never``, cold starts), the
baseline the borrowed recoveries are compared with in the same run, and the async job with every
rank of the broken gang replaced (``recovery.keep_survivors: false``: the surviving rank is not
kept in place, so two replicas are borrowed per recovery instead of one). Every run has the same
tuning; only the mode (and, for the baselines, one recovery knob) differs.

Measured, never simulated: rewards (commits), recovery_s and its source (the controller's
``recovered`` events: fault detected -> new gang ready), ETTR (event-log accounting), and the
rollout pool's token throughput during each trainer recovery against the same length of time just
before the fault, from the replicas' own ``tokens_total`` counters as they were published on the
bus (``metrics`` subjects, sampled every ``detector.metrics_interval_s``; interpolated linearly
between samples). The window (``THROUGHPUT_WINDOW``, also written into the JSON) runs from the
fault's detection to the new gang's first committed step, at least ``WINDOW_FLOOR_S``.

Every seed runs fault-free and faulted in every mode; the reward check is per seed: each faulted
curve's tail mean against the spread of the fault-free seeds' tail means (and step by step against
the fault-free envelope).

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
EXTRA_KEYS = ("async_cold", "async_replace_all")
"""async with one recovery knob changed: ``borrow: never`` (cold ranks), ``keep_survivors: false``
(every rank of the broken gang replaced, as before survivors were kept)."""
STEP_TIME_S = 1.0
EVENTS_DIR: Path | None = None
"""``--events DIR``: each run's event log is written there (``<label>.json``)."""
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
    """Trainer recoveries from the controller's events: source, recovery_s, and the instants the
    throughput window is built from (the fault, its detection, the new gang's first commit)."""
    detected = {e["data"]["fault_id"]: e for e in events if e["kind"] == "fault_detected"
                and "fault_id" in e["data"]}
    commits = [(e["ts"], int(e["data"].get("epoch", -1))) for e in events if e["kind"] == "step_committed"]
    out = []
    for e in events:
        d = e["data"]
        if e["kind"] == "recovered" and d.get("kind") == "trainer":
            rec_s = float(d.get("recovery_s", d.get("took_s")) or 0.0)
            det = detected.get(d["fault_id"])
            detected_at = det["ts"] if det else e["ts"] - rec_s
            fault_at = (det["data"].get("fault_at") if det else None) or detected_at
            # The new gang's first committed step: the first commit after the detection by an epoch
            # newer than the one committing at the fault.
            epoch_at_fault = max((ep for ts, ep in commits if ts <= detected_at), default=-1)
            first = min((ts for ts, ep in commits if ts > detected_at and ep > epoch_at_fault), default=None)
            out.append({"fault_id": d["fault_id"], "source": d.get("source", "cold"),
                        "sources": d.get("sources"), "recovery_s": round(rec_s, 3),
                        "fault_at": fault_at, "detected_at": detected_at, "recovered_at": e["ts"],
                        "first_commit_at": first})
    return out


WINDOW_FLOOR_S = 4.0
"""The throughput window during a recovery lasts at least this long: a borrowed recovery (fault
detected -> new gang ready) takes ~0.3 s here, about one metrics interval (0.25 s), and generation
comes in bursts between 1 s tool calls, so a shorter window lands on a burst or a tool wait and
says more about the phase than about the rate."""
THROUGHPUT_WINDOW = (
    "during = [fault detected, max(new gang's first committed step, detected + WINDOW_FLOOR_S)]; "
    "before = the same length ending at the fault (its injection, else its detection); rate = tokens "
    "decoded by the rollout pool (sum of every rollout member's published tokens_total counter, "
    "linearly interpolated between samples; a borrowed replica's counter stops when it leaves the pool, "
    "a restocked one's starts when it joins) / window length; ratio = sum of tokens during / sum of "
    "tokens before over the async faulted runs' recoveries (windows of equal length, so a ratio of rates)")


def throughput(tap: TokenTap, job_id: str, rec: dict[str, Any]) -> dict[str, Any]:
    """Pool tokens during a recovery's window and the same length just before the fault
    (``THROUGHPUT_WINDOW``)."""
    a = rec["detected_at"]
    end = rec["first_commit_at"] or rec["recovered_at"]
    span = max(WINDOW_FLOOR_S, end - a)
    before_end = min(rec["fault_at"], a)
    during = tap.tokens_at(job_id, a + span) - tap.tokens_at(job_id, a)
    before = tap.tokens_at(job_id, before_end) - tap.tokens_at(job_id, before_end - span)
    return {"window_s": round(span, 3), "to_first_commit_s": None if rec["first_commit_at"] is None
            else round(rec["first_commit_at"] - a, 3), "floored": span > end - a,
            "tokens_during": round(during, 1), "tokens_before": round(before, 1),
            "during_tok_s": round(during / span, 1), "before_tok_s": round(before / span, 1),
            "ratio": round(during / before, 3) if before > 0 else None}


CONTROL_STEPS = range(5, 10_000, 10)
"""The steps a fault-free run's control windows sit in: the faulted runs' fault steps."""
CONTROL_WINDOW = (
    "the same ratio in a fault-free run, with no recovery: during = [t, t + WINDOW_FLOOR_S], before = "
    "[t - WINDOW_FLOOR_S, t], t = the middle of each step a faulted run has its fault in (5, 15, 25, ...); "
    "the spread of these is how far two adjacent windows of the pool's tokens differ with nothing "
    "happening (tool calls of 1 s make generation come in bursts)")


def control_windows(tap: TokenTap, job_id: str, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``CONTROL_WINDOW``: the fault-free counterpart of :func:`throughput`."""
    started = {int(e["data"]["step"]): e["ts"] for e in events
               if e["kind"] == "step_started" and isinstance(e["data"].get("step"), int)}
    committed = {int(e["data"]["step"]): e["ts"] for e in events
                 if e["kind"] == "step_committed" and isinstance(e["data"].get("step"), int)}
    out = []
    for step in CONTROL_STEPS:
        if step not in started or step not in committed:
            break
        t, span = (started[step] + committed[step]) / 2, WINDOW_FLOOR_S
        during = tap.tokens_at(job_id, t + span) - tap.tokens_at(job_id, t)
        before = tap.tokens_at(job_id, t) - tap.tokens_at(job_id, t - span)
        out.append({"step": step, "tokens_during": round(during, 1), "tokens_before": round(before, 1),
                    "ratio": round(during / before, 3) if before > 0 else None})
    return out


async def run(stack: Stack, api: ApiClient, tap: TokenTap, spec: dict[str, Any], scenario: Scenario | None,
              label: str) -> dict[str, Any]:
    assert stack.settings
    t0 = time.time()
    report = await run_job(stack.settings, api, spec, scenario, step_time_s=STEP_TIME_S, timeout_s=900)
    wall = time.time() - t0
    events = await asyncio.to_thread(api.events, report["job_id"])
    if EVENTS_DIR is not None:
        EVENTS_DIR.mkdir(parents=True, exist_ok=True)
        (EVENTS_DIR / (label.replace(" ", "_") + ".json")).write_text(json.dumps(events))
    out: dict[str, Any] = {"reward_by_step": [round(r, 4) for r in report["reward_by_step"]],
                           "wall_s": round(report["completion_s"], 2), "status": report["status"],
                           "ettr": round(report["ettr"], 4), "ettr_to_last_commit": ettr_to_last_commit(events),
                           "seed": spec["seed"]}
    if scenario is not None:
        recs = recoveries(events)
        for r in recs:
            r["throughput"] = throughput(tap, report["job_id"], r)
            for k in ("fault_at", "detected_at", "recovered_at", "first_commit_at"):
                r.pop(k)
        out["recoveries"] = recs
        out["stale_turns_dropped"] = sum(e["data"].get("turns", 0) for e in events
                                         if e["kind"] == "stale_turns_dropped")
    else:
        out["control_windows"] = control_windows(tap, report["job_id"], events)
    srcs = [(r["source"], r["recovery_s"]) for r in out.get("recoveries", [])]
    print(f"{label:34s} {report['status']:8s} wall {out['wall_s']:6.1f}s ETTR {out['ettr']:.3f} "
          f"(to last commit {out['ettr_to_last_commit']:.3f}) "
          f"recoveries {srcs} ({wall:.0f}s)", flush=True)
    return out


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def _spread(xs: list[float]) -> dict[str, Any]:
    xs = sorted(xs)
    if not xs:
        return {"n": 0}
    q = statistics.quantiles(xs, n=10, method="inclusive") if len(xs) >= 2 else [xs[0]] * 9
    return {"n": len(xs), "min": xs[0], "p10": round(q[0], 3), "median": round(statistics.median(xs), 3),
            "p90": round(q[-1], 3), "max": xs[-1]}


def control_summary(results: dict[str, Any]) -> dict[str, Any]:
    """The async recoveries' per-window ratios beside the fault-free control windows' (``CONTROL_WINDOW``):
    the same measure with and without a recovery in the window."""
    runs = results["modes"].get("async", {})
    control = [w for run_ in runs.get("fault_free_runs", []) for w in run_.get("control_windows", [])
               if w["ratio"] is not None]
    during = [r["throughput"]["ratio"] for run_ in runs.get("faulted_runs", []) for r in run_["recoveries"]
              if r["throughput"]["ratio"] is not None]
    before = sum(w["tokens_before"] for w in control)
    return {"control_window": CONTROL_WINDOW,
            "control_window_ratio_aggregate": round(sum(w["tokens_during"] for w in control) / before, 3)
            if before > 0 else None,
            "control_window_ratio_spread": _spread([w["ratio"] for w in control]),
            "throughput_during_recovery_ratio_spread": _spread(during),
            "recoveries_below_0_9": sum(x < 0.9 for x in during),
            "control_windows_below_0_9": sum(w["ratio"] < 0.9 for w in control)}


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    def recs(mode: str, source: str) -> list[float]:
        return [r["recovery_s"] for run_ in results["modes"][mode]["faulted_runs"] for r in run_["recoveries"]
                if r["source"] == source]

    have = results["modes"]
    borrowed = ((recs("semi_sync", "borrowed") if "semi_sync" in have else [])
                + (recs("async", "borrowed") if "async" in have else []))
    cold_same_mode = recs("async_cold", "cold") if "async_cold" in results["modes"] else []
    cold_all = cold_same_mode + (recs("sync", "cold") if "sync" in have else [])
    def tp_ratio(source: str | None, key: str = "async") -> float | None:
        if key not in have:
            return None
        tps = [r["throughput"] for run_ in results["modes"][key]["faulted_runs"] for r in run_["recoveries"]
               if source is None or r["source"] == source]
        before = sum(t["tokens_before"] for t in tps)
        return round(sum(t["tokens_during"] for t in tps) / before, 3) if before > 0 else None

    async_tps = [r["throughput"] for run_ in results["modes"].get("async", {}).get("faulted_runs", [])
                 for r in run_["recoveries"]]
    s = {"borrowed_recovery_s_median": _median(borrowed), "cold_recovery_s_median": _median(cold_all),
         "cold_recovery_s_median_async_no_borrow": _median(cold_same_mode),
         "standby_vs_cold_recovery_ratio": (round(statistics.median(borrowed) / statistics.median(cold_all), 3)
                                            if borrowed and cold_all else None),
         "throughput_during_recovery_ratio": tp_ratio(None),
         # the same async job with every rank of a broken gang replaced (keep_survivors false):
         # two replicas borrowed per recovery instead of one
         "throughput_during_recovery_ratio_replace_all": tp_ratio(None, "async_replace_all"),
         "throughput_during_recovery_ratio_no_borrow": tp_ratio(None, "async_cold"),
         "throughput_window": THROUGHPUT_WINDOW, "throughput_window_floor_s": WINDOW_FLOOR_S,
         "throughput_during_recovery_ratio_per_recovery": [t["ratio"] for t in async_tps],
         "throughput_window_s_per_recovery": [t["window_s"] for t in async_tps],
         "throughput_during_recovery_ratio_by_source": {src: tp_ratio(src) for src in ("borrowed", "cold", "spare")},
         **control_summary(results),
         "ettr_faulted": {m: round(statistics.fmean(x["ettr"] for x in results["modes"][m]["faulted_runs"]), 4)
                          for m in results["modes"]},
         "ettr_faulted_per_seed": {m: {x["seed"]: x["ettr"] for x in results["modes"][m]["faulted_runs"]}
                                   for m in results["modes"]},
         "ettr_faulted_first_seed": {m: results["modes"][m]["faulted"]["ettr"] for m in results["modes"]},
         "ettr_faulted_to_last_commit": {m: results["modes"][m]["faulted"]["ettr_to_last_commit"]
                                         for m in results["modes"]},
         "ettr_fault_free_to_last_commit": {m: results["modes"][m]["fault_free"]["ettr_to_last_commit"]
                                            for m in results["modes"] if "fault_free" in results["modes"][m]}}
    # Reward, per seed: is each faulted curve within the fault-free seed-to-seed spread? Judged on
    # the mean of the last third of the steps, and step by step against the fault-free envelope.
    within_all = []
    for r in results["modes"].values():
        free_runs = r["fault_free_runs"] or results["modes"].get(r["mode"], {}).get("fault_free_runs", [])
        free = [run_["reward_by_step"] for run_ in free_runs if run_["reward_by_step"]]
        if not free:
            continue
        tail = max(1, len(free[0]) // 3)
        means = [statistics.fmean(c[-tail:]) for c in free]
        lo, hi = min(means), max(means)
        per_seed = []
        for run_ in r["faulted_runs"]:
            c = run_["reward_by_step"]
            if not c:
                continue
            x = statistics.fmean(c[-tail:])
            same = next((statistics.fmean(f["reward_by_step"][-tail:]) for f in free_runs
                         if f["seed"] == run_["seed"] and f["reward_by_step"]), None)
            n = min(len(c), *(len(f) for f in free))
            inside = sum(1 for i in range(n) if min(f[i] for f in free) <= c[i] <= max(f[i] for f in free))
            per_seed.append({"seed": run_["seed"], "faulted_tail_mean": round(x, 4),
                             "fault_free_same_seed_tail_mean": None if same is None else round(same, 4),
                             "minus_same_seed": None if same is None else round(x - same, 4),
                             "within_spread": lo <= x <= hi,
                             "steps_within_fault_free_envelope": f"{inside}/{n}"})
        within_all += [p["within_spread"] for p in per_seed]
        r["reward_tail_spread"] = {"tail_steps": tail, "fault_free_tail_means": [round(m, 4) for m in means],
                                   "fault_free_min": round(lo, 4), "fault_free_max": round(hi, 4),
                                   "fault_free_spread": round(hi - lo, 4),
                                   "fault_free_mean": round(statistics.fmean(means), 4), "per_seed": per_seed,
                                   "faulted_within_spread": all(p["within_spread"] for p in per_seed)}
    s["reward_faulted_within_spread"] = {k: r["reward_tail_spread"]["faulted_within_spread"]
                                         for k, r in results["modes"].items() if "reward_tail_spread" in r}
    s["reward_faulted_seeds_within_spread"] = f"{sum(within_all)}/{len(within_all)}"
    return s


def pooled(paths: list[Path]) -> dict[str, Any]:
    """Fault-free against faulted reward tails pooled over several result files of this benchmark
    (e.g. the full run and a rerun of some modes with the same job).

    In semi_sync and async the reward curve of one seed is not reproducible: which weights version
    generates each turn depends on timing, so two fault-free runs of the same seed differ. The
    spread of 3 fault-free seeds (``reward_tail_spread``) leaves that run-to-run variation out;
    here every fault-free run of a mode (each seed, each file) is one sample of the fault-free
    tail, every faulted run one of the faulted tail, and the faulted-minus-fault-free difference
    of the means gets an exact permutation p-value (two-sided, over every split of the pooled
    runs). Same-seed fault-free repeats are listed, as the run-to-run variation's direct measure.
    """
    import itertools

    runs: dict[str, dict[str, list[tuple[int, str, float]]]] = {}
    for path in paths:
        data = json.loads(path.read_text())
        for key, r in data["modes"].items():
            if key in EXTRA_KEYS:
                continue  # another recovery policy: not pooled with the mode's own faulted runs
            for kind in ("fault_free_runs", "faulted_runs"):
                for run_ in r.get(kind, []):
                    c = run_["reward_by_step"]
                    if c:
                        tail = max(1, len(c) // 3)
                        runs.setdefault(key, {}).setdefault(kind, []).append(
                            (run_["seed"], path.name, statistics.fmean(c[-tail:])))
    out: dict[str, Any] = {"files": [str(p) for p in paths]}
    for mode, kinds in runs.items():
        free = [x for _, _, x in kinds.get("fault_free_runs", [])]
        faulted = [x for _, _, x in kinds.get("faulted_runs", [])]
        if not free or not faulted:
            continue
        diff = statistics.fmean(faulted) - statistics.fmean(free)
        pool = free + faulted
        extreme = total = 0
        for idx in itertools.combinations(range(len(pool)), len(faulted)):
            chosen = set(idx)
            a = [pool[i] for i in chosen]
            b = [pool[i] for i in range(len(pool)) if i not in chosen]
            total += 1
            extreme += abs(statistics.fmean(a) - statistics.fmean(b)) >= abs(diff) - 1e-12
        repeats: dict[int, list[float]] = {}
        for seed, _, x in kinds["fault_free_runs"]:
            repeats.setdefault(seed, []).append(round(x, 4))
        out[mode] = {
            "fault_free_tail_means": [round(x, 4) for x in free],
            "faulted_tail_means": [round(x, 4) for x in faulted],
            "fault_free_pooled_min": round(min(free), 4), "fault_free_pooled_max": round(max(free), 4),
            "faulted_within_pooled_fault_free_range": sum(min(free) <= x <= max(free) for x in faulted),
            "faulted_runs": len(faulted),
            "fault_free_same_seed_repeats": {str(k): v for k, v in sorted(repeats.items()) if len(v) > 1},
            "fault_free_mean": round(statistics.fmean(free), 4),
            "fault_free_stdev": round(statistics.stdev(free), 4) if len(free) > 1 else None,
            "faulted_mean": round(statistics.fmean(faulted), 4),
            "faulted_stdev": round(statistics.stdev(faulted), 4) if len(faulted) > 1 else None,
            "faulted_minus_fault_free": round(diff, 4),
            "permutation_p_two_sided": round(extreme / total, 4),
        }
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(results["modes"])
    fig, grid = plt.subplots(1, len(modes), figsize=(5 * len(modes), 4), sharey=True, squeeze=False)
    axes = list(grid[0])
    for ax, mode in zip(axes, modes, strict=True):
        r = results["modes"][mode]
        # the cold baseline (async, borrow=never) is drawn against async's fault-free seeds
        free = r["fault_free_runs"] or results["modes"].get(r["mode"], {}).get("fault_free_runs", [])
        curves = [run_["reward_by_step"] for run_ in free if run_["reward_by_step"]]
        if curves:
            n = min(len(c) for c in curves)
            ax.fill_between(range(n), [min(c[i] for c in curves) for i in range(n)],
                            [max(c[i] for c in curves) for i in range(n)], color="tab:blue", alpha=0.12,
                            label="fault-free envelope")
        for run_ in free:
            ax.plot(run_["reward_by_step"], color="tab:blue", alpha=0.5, lw=1, ls=":",
                    label=f"fault-free seed {run_['seed']}")
        reds = ["tab:red", "darkred", "tab:orange", "tab:pink", "tab:brown"]
        for i, run_ in enumerate(r["faulted_runs"]):
            ax.plot(run_["reward_by_step"], color=reds[i % len(reds)], lw=1.6,
                    label=f"faulted seed {run_['seed']} (trainer crash every 10 steps)")
        knobs = "".join(f", {k}={v}" for k, v in r.get("recovery", {}).items())
        sources = "/".join(sorted({x["source"] for run_ in r["faulted_runs"] for x in run_.get("recoveries", [])}))
        ettr = statistics.fmean(x["ettr"] for x in r["faulted_runs"])
        ax.set_title(f"{r['mode']}{knobs}: ETTR faulted {ettr:.2f} mean of {len(r['faulted_runs'])} ({sources})",
                     fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("mean reward")
    axes[0].legend(fontsize=7)
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
            # The same async job with the broken gang's surviving rank replaced too (the policy
            # before recovery.keep_survivors): the same tuning, one knob apart.
            plan.append(("async_replace_all", "async", {"keep_survivors": False}))
            if args.modes:
                plan = [p for p in plan if p[0] in args.modes]
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
    parser.add_argument("--modes", type=lambda s: [m for m in s.split(",") if m], default=None,
                        help="Run only these (comma-separated: sync, semi_sync, async, async_cold, "
                             "async_replace_all); "
                             "async_cold's reward spread is async's fault-free runs when async runs too.")
    parser.add_argument("--events", type=Path, default=None, help="Write each run's event log into this folder.")
    parser.add_argument("--pool", type=Path, nargs="+", default=None,
                        help="Pool the fault-free and faulted reward tails of these result files (no run); "
                             "the pooled comparison is printed, and written to --out if given with --pool.")
    parser.add_argument("--plot-only", action="store_true", help="Redraw the PNG from an existing --out JSON.")
    args = parser.parse_args()
    if args.modes and not set(args.modes) <= {*MODES, *EXTRA_KEYS}:
        parser.error(f"--modes: unknown {sorted(set(args.modes) - {*MODES, *EXTRA_KEYS})}")
    if args.pool:
        summary = pooled(args.pool)
        print(json.dumps(summary, indent=2))
        if "--out" in sys.argv:
            args.out.write_text(json.dumps(summary, indent=2))
        sys.exit(0)
    if args.plot_only:
        plot(json.loads(args.out.read_text()), args.out.with_suffix(".png"))
        sys.exit(0)
    EVENTS_DIR = args.events
    res = asyncio.run(main(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # The shape at the top level: {mode: {fault_free, faulted}, ratios}.
    flat = {m: {"fault_free": r.get("fault_free"), "faulted": r["faulted"]} for m, r in res["modes"].items()}
    args.out.write_text(json.dumps({**flat, **res}, indent=2))
    png = args.out.with_suffix(".png")
    plot(res, png)
    print(json.dumps(res["summary"], indent=2))
    print(f"wrote {args.out} and {png}")
