"""ETTR benchmark: RobustRL role-local recovery vs whole-job restart, side by side in one run.

    python bench/ettr.py --out bench/results/ettr.json [--steps 30] [--quick]

On one embedded stack it runs the reference job
  * fault-free,
  * with a trainer crash every 10 steps at seeded random moments, under ``role_local`` and
    under ``whole_job`` (same launcher, same checkpoints, parallel restarts), then both again
    with warm spares (``recovery.warm_spares``: pre-started member processes, enough for a gang
    or for every member of a whole-job restart),
  * with rollout crashes during tool-heavy steps, under both policies,
  * a benign scenario (tool waits longer than rollout_idle_s, trainer waiting longer than
    trainer_idle_s, idle replicas, CPU load delaying heartbeats) that must produce no fault,
  * one fault of every kind, for detection delays against their thresholds,
and writes one JSON file. ETTR and recovery times come from each job's event log only.

    python bench/ettr.py --launcher ray --out bench/results/ettr-ray.json [--steps 30] [--quick]
                         [--pairs 3] [--warm-spares N]

runs instead, on a three-node Ray cluster started on this machine (head + 2 workers on
127.0.0.2/.3, ``robustrl.launcher.ray_cluster``), the same job with a trainer crash every 10 steps
in ``--pairs`` interleaved groups of runs: role_local on the local launcher, role_local on Ray,
whole_job on Ray, and (unless ``--quick``) whole_job on the local launcher; the order reversed
every other group, each run on a stack of its own, the machine's load recorded before and after
each, each trainer or whole-job recovery and the time ETTR does not count broken down from the
event log. Then one role_local run on Ray where a worker node is killed mid-job (its raylet and
everything on it, SIGKILL) followed by the auditor, and the time one launcher ``start`` takes
(local process vs Ray actor + process). Both policies get the same tuning (``warm_spares_for``):
warm spares for every member one of its restarts starts (``--warm-spares``, default the trainer's
workers, for a role_local gang; plus one per replica for whole_job), local spare processes or Ray
spare actors; the same checkpoints, steps and fault scenario.

    python bench/ettr.py --launcher ray --testbed --out bench/results/ettr-ray-testbed.json [--quick]

runs the same on a Ray cluster on the testbed (``robustrl.launcher.ray_cluster.TestbedRayCluster``):
two hosts (network namespaces on a bridge, 1 Gbit/s links), a worker node inside each, the head,
the infra and the control plane in the root namespace on the testbed's gateway address. The
local-launcher runs place their members inside the same hosts (trainer gang and replicas
round-robin over both, ``robustrl.testbed.placement``), so both launchers run members on the same
hosts; the local launcher's warm spares run outside every host, so its members start cold there
(Ray's spares are actors on the worker nodes, inside the hosts). The node-loss run cuts the link
of the host running trainer rank 0 (every packet dropped, nothing killed) instead of killing its
node.

    python bench/ettr.py --engine vllm --out bench/results/ettr-vllm.json [--steps 12]
                         [--compare vllm,torch] [--crash-moment mid_tool_turn]

runs instead the job on a small Hugging Face model (``robustrl.model.tiny``: random-init Qwen3,
32k-token BPE, float32) with its rollout replicas on each engine of ``--compare`` (vLLM from
``.venv-vllm``), in one stack: fault-free, then with a rollout crash at steps 4 and 8
(role_local), each crash recovered by re-dispatching the replica's turns and starting a
replacement; the auditor then reads the raw stores (0 finished episodes lost). With
``--crash-moment mid_tool_turn`` each crashed replica dies at the first token of its next turn
after a tool result, so a turn is in flight (``resumed_after_tool_turn`` counts the episodes that
went on from their saved prefix).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from robustrl.chaos.runner import run_job  # noqa: E402
from robustrl.chaos.scenario import Faults, Scenario  # noqa: E402
from robustrl.client import ApiClient  # noqa: E402
from robustrl.config import reference_job  # noqa: E402
from robustrl.stack import Stack  # noqa: E402


def trainer_scenario(seed: int) -> Scenario:
    return Faults("trainer-every-10", seed=seed).crash("trainer", member="random", every=10, start=5).build()


def rollout_scenario(seed: int) -> Scenario:
    """Rollout crashes at moments of generation (issue 12: mid-decode and mid tool turn): three
    wait, after a seeded random delay, until the crashed replica is seen decoding
    (``within_step: decoding``, the harness fires on a metrics sample with a batch in flight, and,
    since 2026-12-07, the replica dies at the first token of its next batch, ``moment: mid_batch``:
    a kill from outside could land after the batch ended; the replica says when it struck,
    ``fault_struck``, and the detection delay is timed from there), two
    land at seeded random moments of the step (mostly a tool wait: the request manager runs the
    tools, so a replica decodes only a small part of a tool-heavy step). With random moments only,
    none of 5 crashes found a turn in flight (bench/results/ettr-rollout-crash.json)."""
    return (Faults("rollout-crash", seed=seed)
            .crash("rollout", member=0, at_step=6, within_step="decoding")
            .crash("rollout", member=1, at_step=11, within_step="random")
            .crash("rollout", member=0, at_step=16, within_step="decoding")
            .crash("rollout", member=1, at_step=21, within_step="random")
            .crash("rollout", member=0, at_step=26, within_step="decoding").build())


def redispatch_summary(report: dict[str, Any]) -> dict[str, Any]:
    """What the rollout crashes cost in generation, measured from the event log."""
    crashes = [f for f in report["faults"] if f["role"] == "rollout"]
    return {"crashes": len(crashes),
            "tokens_regenerated": sum(f["tokens_regenerated"] for f in crashes),
            "turns_redispatched": sum(f["turns_redispatched"] for f in crashes),
            "turns_regenerated": sum(f["turns_regenerated"] for f in crashes),
            "episodes_regenerated": sum(f["episodes_regenerated"] for f in crashes),
            "max_turns_regenerated_per_episode": max(
                (f["turns_regenerated"] / f["episodes_regenerated"] for f in crashes if f["episodes_regenerated"]),
                default=0.0)}


def kinds_scenario(seed: int) -> Scenario:
    return (Faults("every-kind", seed=seed)
            .crash("trainer", member=1, at_step=3, within_step="random")
            .hang("rollout", member=0, at_step=6, within_step=0.5)
            .stall("rollout", member=1, at_step=10, within_step=0.5, duration_s=300)
            .stall("trainer", member=0, at_step=14, within_step=0.0, duration_s=300)
            .net_drop("rollout", member=0, at_step=18, within_step=0.5)
            .tool_outage(at_step=22, within_step=0.1, duration_s=13.0).build())


def policy_spec(spec_base: dict[str, Any], policy: str, warm_spares: int = 0,
                name: str | None = None) -> dict[str, Any]:
    """The reference job under recovery ``policy`` with ``warm_spares``: the one place a bench
    run's policy is set (local and Ray runs, role_local and whole_job alike)."""
    return {**spec_base, "name": name or f"ettr-{policy}",
            "recovery": {**spec_base["recovery"], "policy": policy, "warm_spares": warm_spares}}


def warm_spares_for(policy: str, spec_base: dict[str, Any], gang: int | None = None) -> int:
    """Warm spares that give each policy the same tuning: enough for every member one of its
    restarts starts. role_local restarts a trainer gang (``gang`` spares, default the trainer's
    workers); whole_job restarts every member, so it also gets one per rollout replica (none when
    ``gang`` is 0: both start cold)."""
    gang = spec_base["trainer"]["workers"] if gang is None else gang
    if policy == "role_local" or gang == 0:
        return gang
    return gang + spec_base["rollout"]["replicas"]


def _burn(stop_at: float) -> None:
    x = 0
    while time.time() < stop_at:
        x += 1


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    faults = report["faults"]
    rec = [f["recovery_s"] for f in faults if f["recovery_s"] is not None]
    det = [f["detection_s"] for f in faults if f["detection_s"] is not None]
    return {
        "ettr": round(report["ettr"], 4), "completion_s": round(report["completion_s"], 2),
        "steps": report["steps"], "status": report["status"], "faults": faults,
        "recovery_s_median": statistics.median(rec) if rec else None,
        "detection_s_max": max(det) if det else None,
        # armed crashes the log shows no strike of (no batch reached the replica while armed)
        "armed_unstruck": sum(1 for f in faults if f.get("moment", "now") != "now" and f.get("struck_s") is None),
        "reward_first5": statistics.fmean(report["reward_by_step"][:5]) if report["reward_by_step"] else None,
        "reward_last5": statistics.fmean(report["reward_by_step"][-5:]) if report["reward_by_step"] else None,
    }


async def run_one(stack: Stack, api: ApiClient, spec: dict[str, Any], scenario: Scenario | None,
                  label: str) -> dict[str, Any]:
    assert stack.settings
    t0 = time.time()
    report = await run_job(stack.settings, api, spec, scenario, step_time_s=3.5, timeout_s=1200)
    out = summarize(report)
    print(f"{label:28s} ETTR {out['ettr']:.3f}  completion {out['completion_s']:6.1f}s  "
          f"faults {len(out['faults'])}  recovery~{out['recovery_s_median']}  ({time.time() - t0:.0f}s)",
          flush=True)
    return out


async def rollout_crash_runs(stack: Stack, api: ApiClient, spec_base: dict[str, Any],
                             seed: int) -> dict[str, Any]:
    """The rollout-crash scenario under both policies on a tool-heavy job, each with what its
    crashes cost in generation (``redispatch``, measured from the event log)."""
    tool_heavy = {**spec_base, "data": {**spec_base["data"], "tasks": ["lookup"]}}
    out = {pol: await run_one(stack, api, {**tool_heavy, "name": f"rcrash-{pol}",
                                           "recovery": {**spec_base["recovery"], "policy": pol}},
                              rollout_scenario(seed), f"{pol} (rollout crashes)")
           for pol in ("role_local", "whole_job")}
    for pol in out:
        out[pol]["redispatch"] = redispatch_summary(out[pol])
    return out


async def main_rollout(args: argparse.Namespace) -> dict[str, Any]:
    """``--only rollout``: the rollout-crash scenario alone (both policies, one stack)."""
    spec_base = reference_job(steps=args.steps, seed=args.seed).model_dump(mode="json")
    results: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                               "job": {"steps": args.steps, "tool_latency_s": spec_base["tools"]["latency_s"]},
                               "measured": True}
    with tempfile.TemporaryDirectory(prefix="ettr-") as tmp, Stack(Path(tmp)) as stack:
        assert stack.settings
        api = ApiClient(stack.api_url, stack.settings.api_token)
        results["rollout_crash"] = await rollout_crash_runs(stack, api, spec_base, args.seed)
        api.close()
    rl = results["rollout_crash"]["role_local"]
    red = rl["redispatch"]
    results["summary"] = {
        "role_local_ettr": rl["ettr"], "whole_job_ettr": results["rollout_crash"]["whole_job"]["ettr"],
        "role_local_redispatch": red,
        "whole_job_tokens_regenerated": results["rollout_crash"]["whole_job"]["redispatch"]["tokens_regenerated"],
        # issue 12: the scenario must catch work in flight (> 0 tokens regenerated) and re-dispatch
        # an episode from its last tool-turn prefix (<= one turn regenerated per episode).
        "targets": {"tokens_regenerated_gt_0": red["tokens_regenerated"] > 0,
                    "turns_per_redispatched_episode_le_1": red["max_turns_regenerated_per_episode"] <= 1.0},
    }
    return results


async def main(args: argparse.Namespace) -> dict[str, Any]:
    spec_base = reference_job(steps=args.steps, seed=args.seed).model_dump(mode="json")
    results: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                               "job": {"steps": args.steps, "tool_latency_s": spec_base["tools"]["latency_s"],
                                       "detector": spec_base["detector"]}}
    with tempfile.TemporaryDirectory(prefix="ettr-") as tmp, Stack(Path(tmp)) as stack:
        assert stack.settings
        api = ApiClient(stack.api_url, stack.settings.api_token)

        def spec(policy: str) -> dict[str, Any]:
            return policy_spec(spec_base, policy)

        results["fault_free"] = await run_one(stack, api, spec("role_local"), None, "fault_free")
        results["role_local"] = await run_one(stack, api, spec("role_local"), trainer_scenario(args.seed),
                                              "role_local (trainer faults)")
        results["whole_job"] = await run_one(stack, api, spec("whole_job"), trainer_scenario(args.seed),
                                             "whole_job (trainer faults)")
        # Both policies again with warm spares (pre-started member processes, imports done):
        # enough for a whole gang, and for every member of a whole-job restart.
        def warm(policy: str) -> dict[str, Any]:
            return policy_spec(spec_base, policy, warm_spares_for(policy, spec_base), f"ettr-{policy}-warm")

        results["role_local_warm"] = await run_one(
            stack, api, warm("role_local"), trainer_scenario(args.seed),
            "role_local + warm spares (trainer faults)")
        results["whole_job_warm"] = await run_one(
            stack, api, warm("whole_job"), trainer_scenario(args.seed), "whole_job + warm spares (trainer faults)")
        for name in ("fault_free", "role_local", "whole_job", "role_local_warm", "whole_job_warm"):
            results[name]["completion_vs_fault_free"] = round(
                results[name]["completion_s"] / results["fault_free"]["completion_s"], 3)
        if not args.quick:
            results["rollout_crash"] = await rollout_crash_runs(stack, api, spec_base, args.seed)
            results["every_kind"] = await run_one(stack, api, spec("role_local"), kinds_scenario(args.seed),
                                                  "role_local (every fault kind)")
            # Benign: tools slower than rollout_idle_s, trainer waiting longer than trainer_idle_s,
            # replicas idle while the trainer trains, and two CPU burners delaying heartbeats.
            benign = {**spec_base, "name": "benign", "steps": 8,
                      "tools": {**spec_base["tools"], "latency_s": 4.5},
                      "data": {**spec_base["data"], "tasks": ["lookup"]}}
            stop_at = time.time() + 60
            burners = [multiprocessing.Process(target=_burn, args=(stop_at,), daemon=True) for _ in range(2)]
            for b in burners:
                b.start()
            try:
                results["benign"] = await run_one(stack, api, benign, None, "benign (no fault expected)")
            finally:
                for b in burners:
                    b.terminate()
        api.close()

    rl, wj = results["role_local"], results["whole_job"]
    trainer_rec = [f["recovery_s"] for f in rl["faults"] if f["role"] == "trainer" and f["recovery_s"]]
    whole_rec = [f["recovery_s"] for f in wj["faults"] if f["recovery_s"]]
    results["summary"] = {
        "role_local_ettr": rl["ettr"], "whole_job_ettr": wj["ettr"], "fault_free_ettr": results["fault_free"]["ettr"],
        "ettr_gain": round(rl["ettr"] - wj["ettr"], 4),
        "trainer_recovery_s": statistics.median(trainer_rec) if trainer_rec else None,
        "whole_job_restart_s": statistics.median(whole_rec) if whole_rec else None,
    }
    s = results["summary"]
    rlw, wjw = results["role_local_warm"], results["whole_job_warm"]
    warm_rec = [f["recovery_s"] for f in rlw["faults"] if f["role"] == "trainer" and f["recovery_s"]]
    warm_whole = [f["recovery_s"] for f in wjw["faults"] if f["recovery_s"]]
    s.update({"role_local_warm_ettr": rlw["ettr"], "whole_job_warm_ettr": wjw["ettr"],
              "ettr_gain_warm": round(rlw["ettr"] - wjw["ettr"], 4),
              "trainer_recovery_warm_s": statistics.median(warm_rec) if warm_rec else None,
              "whole_job_restart_warm_s": statistics.median(warm_whole) if warm_whole else None})
    if s["trainer_recovery_s"] and s["whole_job_restart_s"]:
        s["recovery_ratio"] = round(s["trainer_recovery_s"] / s["whole_job_restart_s"], 3)
    if "benign" in results:
        s["benign_faults"] = len(results["benign"]["faults"])
    if "every_kind" in results:
        s["detection_by_kind"] = [{"kind": f["kind"], "role": f["role"], "detection_s": f["detection_s"]}
                                  for f in results["every_kind"]["faults"]]
    return results


RAY_INSTANCE = "bench-ettr"


def _ray_spec(spec_base: dict[str, Any], policy: str, launcher: str, warm_spares: int) -> dict[str, Any]:
    # Half a CPU per member: a gang and both replicas fit one 2-CPU worker after a node loss.
    base = policy_spec(spec_base, policy, warm_spares, f"ettr-{launcher}-{policy}".replace("_", "-"))
    return {**base,
            "trainer": {**spec_base["trainer"], "resources": {"cpus": 0.5}},
            "rollout": {**spec_base["rollout"], "resources": {"cpus": 0.5}, "placement": {"anti_affinity": "preferred"}}}


def start_times(cluster: Any, log_dir: Path, n: int = 5) -> dict[str, Any]:
    """Seconds one ``Launcher.start`` takes: a local process vs a Ray actor that starts the process."""
    from robustrl.launcher.base import MemberSpec, Resources
    from robustrl.launcher.local import LocalLauncher
    from robustrl.launcher.ray import RayLauncher

    out: dict[str, Any] = {}
    for name, launcher in (("local", LocalLauncher(log_dir / "local", base_env=dict(os.environ))),
                           ("ray", RayLauncher(cluster.address, log_dir / "ray", base_env=dict(os.environ),
                                               instance="bench-start"))):
        took = []
        try:
            for i in range(n):
                spec = MemberSpec("s", f"s--m{i}", "rollout", "http.server", args=("0", "--bind", "127.0.0.1"),
                                  resources=Resources(cpus=0.1))
                t0 = time.perf_counter()
                launcher.start(spec)
                took.append(time.perf_counter() - t0)
        finally:
            launcher.close()
        out[name] = {"median_s": round(statistics.median(took), 4), "max_s": round(max(took), 4), "n": n}
    return out


def _load() -> list[float]:
    """The machine's load averages (1, 5, 15 min) from /proc/loadavg."""
    try:
        with open("/proc/loadavg") as f:
            return [float(x) for x in f.read().split()[:3]]
    except OSError:
        return []


def recovery_breakdown(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per trainer or whole-job recovery, from the event log: detection -> decision -> the members
    it restarts started (every Launcher.start / relabel returned: what the launcher puts on the
    critical path; a trainer recovery starts the gang, a whole-job restart every member) ->
    recovered (the gang joined, loaded its checkpoint and trained; for a whole job, also every
    replica serving)."""
    first: dict[tuple[str, str], float] = {}
    for e in events:
        fid = (e.get("data") or {}).get("fault_id")
        if fid and e["kind"] in ("fault_detected", "decision"):
            first.setdefault((e["kind"], fid), e["ts"])
    out = []
    for e in events:
        d = e.get("data") or {}
        if e["kind"] != "recovered" or d.get("kind") not in ("trainer", "whole_job"):
            continue
        decided = first.get(("decision", d["fault_id"]))
        if decided is None:
            continue
        roles = ("trainer",) if d["kind"] == "trainer" else ("trainer", "rollout")
        started = [x for x in events if x["kind"] == "member_started" and (x.get("data") or {}).get("role")
                   in roles and decided <= x["ts"] <= e["ts"]]
        starts = [x["ts"] for x in started]
        detected = first.get(("fault_detected", d["fault_id"]), decided)
        out.append({"fault_id": d["fault_id"], "kind": d["kind"], "source": d.get("source"),
                    "members_started": len(started),
                    "warm_starts": sum(1 for x in started if (x.get("data") or {}).get("warm")),
                    "decide_s": round(decided - detected, 3),
                    "gang_start_s": round(max(starts) - decided, 3) if starts else None,
                    "gang_ready_s": round(e["ts"] - max(starts), 3) if starts else None,
                    "recovery_s": d.get("recovery_s") or round(e["ts"] - detected, 3)})
    return out


def ettr_breakdown(raw_events: list[dict[str, Any]]) -> dict[str, Any]:
    """Where a run's wall time that ETTR does not count went, from its event log, by the
    accounting's own definitions (robustrl.chaos.accounting: steps, open-fault intervals, the
    median clean step). ``lost_s`` = completion - effective = ``between_steps_s`` (no step
    running) - ``overlap_s`` (steps running at once) + ``excess_faulted_s`` (steps a fault was
    open during, beyond the median clean step) + ``excess_clean_s`` (clean steps slower than
    their median: the machine's noise, no fault's)."""
    from robustrl.chaos import accounting as acc
    from robustrl.messages import Event

    log = sorted((Event.model_validate(e) for e in raw_events), key=lambda e: e.ts)
    starts = [e.ts for e in log if e.kind == "step_started"]
    end = next((e.ts for e in log if e.kind == "job_finished"), log[-1].ts if log else 0.0)
    if not starts:
        return {}
    completion = end - starts[0]
    intervals = [acc._open_interval(f, end) for f in acc._match_faults(log)]
    steps = acc._step_durations(log)
    clean = {k: v for k, v in steps.items() if not acc._overlaps(v[0], v[1], intervals)}
    ref = statistics.median(d for _, _, d in clean.values()) if clean else 0.0
    spans = sorted((s, e) for s, e, _ in steps.values())
    union, cur_s, cur_e = 0.0, None, None
    for s0, e0 in spans:
        if cur_e is None or s0 > cur_e:
            union += 0.0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s0, e0
        else:
            cur_e = max(cur_e, e0)
    union += 0.0 if cur_e is None else cur_e - cur_s
    effective = sum(min(d, ref) for _, _, d in steps.values())
    clean_d = [d for _, _, d in clean.values()]
    return {"completion_s": round(completion, 2), "effective_s": round(effective, 2),
            "lost_s": round(completion - effective, 2), "median_clean_step_s": round(ref, 3),
            "between_steps_s": round(completion - union, 2),
            "overlap_s": round(sum(d for _, _, d in steps.values()) - union, 2),
            "excess_faulted_s": round(sum(max(0.0, d - ref) for k, (_, _, d) in steps.items()
                                          if k not in clean), 2),
            "excess_clean_s": round(sum(max(0.0, d - ref) for d in clean_d), 2),
            "faulted_steps": len(steps) - len(clean),
            "clean_step_s": {"min": round(min(clean_d), 3), "max": round(max(clean_d), 3),
                             "stdev": round(statistics.pstdev(clean_d), 3)} if clean_d else None}


def _ray_cpu_s(cluster: Any) -> float:
    """CPU seconds used so far by the Ray cluster's own processes (GCS, raylets, agents, the
    actors' worker processes: every process with the cluster's temp dir in its command line; the
    member processes the actors start are not among them)."""
    import psutil

    total = 0.0
    for p in psutil.process_iter(["cmdline", "cpu_times"]):
        if str(cluster.temp_dir) in " ".join(p.info["cmdline"] or []) and p.info["cpu_times"] is not None:
            total += p.info["cpu_times"].user + p.info["cpu_times"].system
    return total


def _ensure_nodes(cluster: Any) -> dict[str, Any]:
    """Every node of the cluster alive before a run: a worker node the GCS failed (its raylet
    missed the health checks, e.g. under a load spike, and exited) is started again and counted
    (a run on a cluster without workers cannot place its members)."""
    want = len(cluster.nodes)
    alive = len(cluster.alive_nodes())
    restarted = cluster.restore() if alive < want else []
    if restarted:
        cluster.wait_nodes(want)
    return {"alive_before": alive, "restarted_before": restarted}


def _stack_kwargs(cluster: Any, launcher: str) -> dict[str, Any]:
    """A stack on the cluster's testbed, if it has one (infra and control plane on the gateway
    address); local-launcher members then go inside the cluster's hosts, round-robin."""
    testbed = getattr(cluster, "testbed", None)
    if testbed is None:
        return {}
    hosts = list(cluster.hosts) if launcher == "local" else []
    return {"testbed": testbed, "placement": {"trainer": hosts, "rollout": hosts} if hosts else {}}


async def _ray_bench_run(tmp: Path, cluster: Any, launcher: str, spec: dict[str, Any], seed: int,
                         label: str) -> dict[str, Any]:
    """One trainer-fault job on a stack of its own (started for it, stopped after it: only one
    stack runs at a time), with the machine's load before and after and the recoveries' breakdown."""
    env = {"ROBUSTRL_LAUNCHER": launcher}
    if launcher == "ray":
        env |= {"ROBUSTRL_RAY_ADDRESS": cluster.address, "ROBUSTRL_LAUNCHER_INSTANCE": RAY_INSTANCE}
    nodes = _ensure_nodes(cluster)
    load_before = _load()
    with Stack(tmp / f"stack-{label}", extra_env=env, **_stack_kwargs(cluster, launcher)) as stack:
        assert stack.settings
        api = ApiClient(stack.api_url, stack.settings.api_token)
        try:
            cpu0 = _ray_cpu_s(cluster)
            out = await run_one(stack, api, spec, trainer_scenario(seed), label)
            # The cluster runs during the local runs too (idle): its share of the 2 cores, both ways.
            out["ray_daemons_cpu_s"] = round(_ray_cpu_s(cluster) - cpu0, 2)
            jobs = api.jobs()  # this stack's only job
            if jobs:
                out["job_id"] = jobs[-1]["job_id"]
                events = api.events(out["job_id"])
                out["recoveries"] = recovery_breakdown(events)
                out["ettr_breakdown"] = ettr_breakdown(events)
        finally:
            api.close()
    out.update({"ray_nodes": {**nodes, "alive_after": len(cluster.alive_nodes())},
                "launcher": launcher, "policy": spec["recovery"]["policy"],
                "warm_spares": spec["recovery"]["warm_spares"], "load_before": load_before, "load_after": _load()})
    return out


RAY_RUNS = (("local", "role_local"), ("ray", "role_local"), ("ray", "whole_job"), ("local", "whole_job"))
"""The runs of one group of ``--launcher ray`` (``--quick``: the first three)."""


def _ray_group_summary(group: dict[str, Any]) -> dict[str, Any]:
    """One group's figures for the summary: ETTR, recovery per fault, the launcher's and the
    machine's share (gang start, load, Ray daemons' CPU), and where the lost time went."""
    def one(run: dict[str, Any]) -> dict[str, Any]:
        return {"ettr": run["ettr"], "status": run["status"], "faults": len(run["faults"]),
                "recovery_s": [round(f["recovery_s"], 2) if f["recovery_s"] is not None else None
                               for f in run["faults"]],
                "gang_start_s": [r["gang_start_s"] for r in run.get("recoveries", [])],
                "sources": [r["source"] or f"{r['warm_starts']}/{r['members_started']} warm"
                            for r in run.get("recoveries", [])],
                "load_1min_before": run["load_before"][:1], "ray_daemons_cpu_s": run.get("ray_daemons_cpu_s"),
                "ray_nodes": run.get("ray_nodes"), "ettr_breakdown": run.get("ettr_breakdown")}
    runs = {k: one(v) for k, v in group.items() if isinstance(v, dict) and "ettr" in v}
    out: dict[str, Any] = {"order": group["order"], "runs": runs}
    errors = {k: v["error"] for k, v in group.items() if isinstance(v, dict) and "error" in v and "ettr" not in v}
    if errors:
        out["errors"] = errors
    if "local/role_local" in runs and "ray/role_local" in runs:
        out["gap_ray_vs_local_role_local"] = round(
            runs["ray/role_local"]["ettr"] - runs["local/role_local"]["ettr"], 4)
    if "ray/whole_job" in runs and "ray/role_local" in runs:
        out["gain_role_local_vs_whole_job_ray"] = round(
            runs["ray/role_local"]["ettr"] - runs["ray/whole_job"]["ettr"], 4)
    return out


async def main_ray(args: argparse.Namespace) -> dict[str, Any]:
    if not args.testbed:
        return await _main_ray(args, None)
    from robustrl.testbed import Testbed

    with Testbed(hosts=2, link=TESTBED_LINK) as tb:
        return await _main_ray(args, tb)


TESTBED_LINK = "1gbit"
"""Each testbed host's link rate (``--testbed``)."""


async def _main_ray(args: argparse.Namespace, testbed: Any) -> dict[str, Any]:
    from robustrl.audit import audit
    from robustrl.launcher.ray_cluster import LocalRayCluster, TestbedRayCluster

    spec_base = reference_job(steps=args.steps, seed=args.seed).model_dump(mode="json")
    spares = {policy: warm_spares_for(policy, spec_base, args.warm_spares)
              for policy in ("role_local", "whole_job")}
    runs = RAY_RUNS[:3] if args.quick else RAY_RUNS
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "job": {"steps": args.steps, "tool_latency_s": spec_base["tools"]["latency_s"],
                "warm_spares": spares, "groups": args.pairs, "runs_per_group": [f"{lr}/{p}" for lr, p in runs],
                "scenario": "a trainer crash every 10 steps from step 5 (seeded; the same in every run)"},
        "cluster": "head (0 CPUs) + 2 workers (2 CPUs each) on 127.0.0.1-3, one machine" if testbed is None else
                   f"testbed: head (0 CPUs) in the root namespace on the gateway address, 2 workers (2 CPUs each), "
                   f"each inside a host's network namespace ({TESTBED_LINK} links); one machine",
        "provenance": "every figure measured in this run: ETTR, recovery and the ETTR breakdown from each "
                      "job's event log (robustrl.chaos.accounting), load from /proc/loadavg, CPU from "
                      "psutil, member start from timing Launcher.start; nothing is modelled"}

    def spec(policy: str, launcher: str) -> dict[str, Any]:
        return _ray_spec(spec_base, policy, launcher, spares[policy])

    args.out.parent.mkdir(parents=True, exist_ok=True)
    partial = args.out.with_suffix(".partial.json")
    with tempfile.TemporaryDirectory(prefix="rr-ettr-", dir="/tmp") as tmp:
        cluster = (LocalRayCluster(Path(tmp) / "ray", workers=2, worker_cpus=2) if testbed is None
                   else TestbedRayCluster(testbed, Path(tmp) / "ray", worker_cpus=2)).start()
        try:
            results["member_start"] = start_times(cluster, Path(tmp) / "start")
            print(f"member start: {results['member_start']}", flush=True)
            # Interleaved groups, the order reversed every other group (A B C D, D C B A, ...): a
            # drift of the machine's load during the bench falls on every kind of run alike.
            groups = []
            for i in range(args.pairs):
                order = runs if i % 2 == 0 else runs[::-1]
                group: dict[str, Any] = {"order": [f"{lr}/{p}" for lr, p in order]}
                for launcher, policy in order:
                    label = f"{launcher}-{policy.replace('_', '-')}-{i}"
                    try:
                        group[f"{launcher}/{policy}"] = await _ray_bench_run(
                            Path(tmp), cluster, launcher, spec(policy, launcher), args.seed, label)
                    except Exception as exc:  # noqa: BLE001 - recorded; the other runs go on
                        group[f"{launcher}/{policy}"] = {"status": "bench error", "error": repr(exc)}
                        print(f"{label}: {exc!r}", flush=True)
                g = _ray_group_summary(group)
                print(f"group {i}: " + "  ".join(f"{k} {v['ettr']:.3f}" for k, v in g["runs"].items()),
                      flush=True)
                groups.append(group)
                # What is measured so far survives a later failure of the bench.
                partial.write_text(json.dumps({**results, "groups": groups}, indent=2))
            results["groups"] = groups
            env = {"ROBUSTRL_LAUNCHER": "ray", "ROBUSTRL_RAY_ADDRESS": cluster.address,
                   "ROBUSTRL_LAUNCHER_INSTANCE": RAY_INSTANCE}
            load_before = _load()
            try:
                nodes = _ensure_nodes(cluster)
                with Stack(Path(tmp) / "stack-node-loss", extra_env=env, **_stack_kwargs(cluster, "ray")) as stack:
                    api = ApiClient(stack.api_url, stack.settings.api_token)  # type: ignore[union-attr]
                    results["ray_node_loss"] = await _node_loss_run(stack, api, cluster, spec_base, audit,
                                                                    spares["role_local"])
                    api.close()
                results["ray_node_loss"]["ray_nodes"] = nodes
            except Exception as exc:  # noqa: BLE001 - recorded: the groups measured above are kept
                results["ray_node_loss"] = {"status": "bench error", "error": repr(exc)}
            results["ray_node_loss"].update({"load_before": load_before, "load_after": _load()})
        finally:
            cluster.stop()
            results["ray_processes_left"] = cluster.leftovers()
            partial.write_text(json.dumps(results, indent=2))
    results["summary"] = ray_summary(results)
    return results


def ray_summary(results: dict[str, Any]) -> dict[str, Any]:
    """The ``--launcher ray`` summary from its measured runs (also usable on a .partial.json)."""
    summaries = [_ray_group_summary(g) for g in results["groups"]]

    def mean_of(vals: list[float]) -> float | None:
        return round(statistics.fmean(vals), 4) if vals else None

    def mean(key: str) -> float | None:
        return mean_of([g[key] for g in summaries if key in g])

    def ettrs(run: str) -> list[float]:
        return [g["runs"][run]["ettr"] for g in summaries if run in g["runs"]]

    gaps = [g["gap_ray_vs_local_role_local"] for g in summaries if "gap_ray_vs_local_role_local" in g]
    node_loss = results.get("ray_node_loss", {})
    return {
        "warm_spares": results["job"]["warm_spares"],
        "groups": summaries,
        "role_local_ray_ettr": ettrs("ray/role_local"),
        "whole_job_ray_ettr": ettrs("ray/whole_job"),
        "role_local_local_ettr": ettrs("local/role_local"),
        "whole_job_local_ettr": ettrs("local/whole_job"),
        "mean_role_local_ray_ettr": mean_of(ettrs("ray/role_local")),
        "mean_whole_job_ray_ettr": mean_of(ettrs("ray/whole_job")),
        "mean_gain_role_local_vs_whole_job_ray": mean("gain_role_local_vs_whole_job_ray"),
        "recovery_s_role_local_ray": [g["runs"]["ray/role_local"]["recovery_s"] for g in summaries
                                      if "ray/role_local" in g["runs"]],
        "recovery_s_whole_job_ray": [g["runs"]["ray/whole_job"]["recovery_s"] for g in summaries
                                     if "ray/whole_job" in g["runs"]],
        "gap_ray_vs_local_role_local": gaps,
        "mean_gap_ray_vs_local": mean("gap_ray_vs_local_role_local"),
        "max_abs_gap": round(max(abs(g) for g in gaps), 4) if gaps else None,
        "within_0_05": [abs(g) <= 0.05 for g in gaps],
        "member_start_median_s": {k: v["median_s"] for k, v in results["member_start"].items()},
        "node_loss": {k: node_loss.get(k) for k in ("ettr", "status", "error", "node_lost_at_step", "node_lost_how",
                                                    "recovery_s", "audit_ok", "episodes_lost", "recoveries")},
    }


async def _node_loss_run(stack: Stack, api: ApiClient, cluster: Any, spec_base: dict[str, Any],
                         audit: Any, spares: int = 0) -> dict[str, Any]:
    """role_local on Ray, no injected fault: the worker node running trainer rank 0 is killed when
    the job is half done; then the auditor reads the raw stores."""
    import ray

    assert stack.settings
    lost: dict[str, Any] = {}

    def kill_half_way(status: dict[str, Any]) -> None:
        if lost or status["committed_step"] < args_steps // 2:
            return
        rank0 = next((m for m in status["members"] if m["role"] == "trainer" and m["index"] == 0
                      and m["state"] not in ("exited", "stopped", "dead")), None)
        if rank0 is None:
            return
        gang_rank = re.sub(r"-r([0-9]+)$", r"/r\1", rank0["member_id"])  # the launcher's actor name
        actor = ray.get_actor(f"{RAY_INSTANCE}:{status['job_id']}--{gang_rank}", namespace="robustrl")
        ip = ray.get(actor.info.remote(), timeout=10)["node_ip"]
        lost.update({"node": ip, "at_step": status["committed_step"], "at": time.time()})
        if hasattr(cluster, "cut_node"):  # on the testbed: a network partition, nothing killed
            lost["how"] = f"link of {cluster.cut_node(1 + cluster.node_ips.index(ip))} cut"
        else:
            cluster.kill_node(1 + cluster.node_ips.index(ip))
            lost["how"] = "node killed"
        print(f"node {ip} lost ({lost['how']}) at step {status['committed_step']}", flush=True)

    args_steps = int(spec_base["steps"])
    t0 = time.time()
    spec = _ray_spec(spec_base, "role_local", "ray", spares)
    report = await run_job(stack.settings, api, spec, None, step_time_s=3.5, timeout_s=1200, on_status=kill_half_way)
    out = summarize(report)
    if "job_id" in report:
        out["recoveries"] = recovery_breakdown(api.events(report["job_id"]))
    verdict = await audit(stack.settings, report["job_id"]) if "job_id" in report else None
    node_faults = [f for f in out["faults"] if f["recovery_s"] is not None]
    out.update({"error": report.get("error"), "node_lost": lost.get("node"), "node_lost_at_step": lost.get("at_step"),
                "node_lost_how": lost.get("how"),
                "recovery_s": max((f["recovery_s"] for f in node_faults), default=None),
                "audit_ok": None if verdict is None else verdict.ok,
                "episodes_lost": None if verdict is None else verdict.episodes_lost,
                "audit_violations": [] if verdict is None else verdict.violations()[:20]})
    print(f"ray node loss: ETTR {out['ettr']:.3f} recovery {out['recovery_s']} audit ok {out['audit_ok']} "
          f"({time.time() - t0:.0f}s)", flush=True)
    return out


def _hf_spec(spec_base: dict[str, Any], engine: str, model_dir: str, name: str) -> dict[str, Any]:
    """The reference job on a Hugging Face model directory, rollout on ``engine``: tool-heavy
    (lookup), smaller batches, and the thresholds a vLLM replica needs on 2 busy cores (the same
    for both engines: a fair comparison)."""
    return {**spec_base, "name": name,
            "model": {**spec_base["model"], "path": model_dir, "max_positions": 512},
            "data": {**spec_base["data"], "tasks": ["lookup"], "prompts_per_step": 4, "group_size": 4},
            "rollout": {**spec_base["rollout"], "engine": engine, "max_new_tokens": 8},
            # trainer_idle_s: an HF-model step (32k-token head) on 2 busy cores outlasts the scaled
            # profile's 4 s (a smoke run saw a false trainer hang)
            "detector": {**spec_base["detector"], "weights_load_s": 120.0, "turn_deadline_s": 60.0,
                         "silence_s": 10.0, "step_deadline_s": 600.0, "trainer_idle_s": 20.0},
            "recovery": {**spec_base["recovery"], "deadline_s": 600.0}}


def engine_crash_scenario(seed: int, within_step: float | None = None, moment: str = "now") -> Scenario:
    """A rollout crash at steps 4 and 8: at a seeded random moment of the step, or
    ``within_step`` seconds after it started (0.1: while its first turns are being generated,
    so turns in flight are re-dispatched); with ``moment: mid_tool_turn`` the replica is armed
    then and dies at the first token of its next turn after a tool result."""
    at: float | str = "random" if within_step is None else within_step
    return (Faults("rollout-crash", seed=seed)
            .crash("rollout", member=0, at_step=4, within_step=at, moment=moment)
            .crash("rollout", member=1, at_step=8, within_step=at, moment=moment).build())


def _replica_starts(events: list[dict[str, Any]]) -> list[float]:
    """Seconds from each rollout member's launch to its first weights_loaded: its engine built
    (vLLM's start) and the current version pulled and swapped in (for the first replicas, also
    the wait for the trainer's first version)."""
    started: dict[str, float] = {}
    out = []
    for e in sorted(events, key=lambda e: e["ts"]):
        d = e.get("data") or {}
        if e["kind"] == "member_started" and d.get("role") == "rollout":
            started[d.get("member_id", "")] = e["ts"]
        elif e["kind"] == "weights_loaded" and d.get("member_id") in started:
            out.append(round(e["ts"] - started.pop(d["member_id"]), 2))
    return out


async def main_engines(args: argparse.Namespace) -> dict[str, Any]:
    """Fault-free and rollout-crash runs of an HF-model job per rollout engine, audited."""
    from robustrl.audit import audit
    from robustrl.model.engines.envs import vllm_python
    from robustrl.model.tiny import make_tiny_hf_model

    engines = [e for e in args.compare.split(",") if e]
    spec_base = reference_job(steps=args.steps, seed=args.seed).model_dump(mode="json")
    results: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                               "job": {"steps": args.steps, "engines": engines,
                                       "model": "tiny random-init Qwen3 (hidden 128, 2 layers, 32,007-token BPE), "
                                                "float32", "vllm_python": str(vllm_python())}}
    with tempfile.TemporaryDirectory(prefix="ettr-engines-") as tmp:
        model_dir = str(make_tiny_hf_model(Path(tmp) / "tiny-hf"))
        results["job"]["crash_within_step"] = args.crash_within_step if args.crash_within_step is not None else "random"
        results["job"]["crash_moment"] = args.crash_moment
        results["job"]["spec"] = {k: v for k, v in _hf_spec(spec_base, "vllm", model_dir, "x").items()
                                  if k in ("data", "rollout", "detector", "recovery", "tools")}
        with Stack(Path(tmp) / "stack") as stack:
            assert stack.settings
            api = ApiClient(stack.api_url, stack.settings.api_token)
            for engine in engines:
                per: dict[str, Any] = {}
                crash = engine_crash_scenario(args.seed, args.crash_within_step, args.crash_moment)
                for run, scenario in (("fault_free", None), ("rollout_crash", crash)):
                    label = f"{engine} {run}"
                    load_before = _load()
                    try:
                        out = await run_one(stack, api, _hf_spec(spec_base, engine, model_dir, f"eng-{engine}-{run}"),
                                            scenario, label)
                    except Exception as exc:  # noqa: BLE001 - recorded; the other runs go on
                        per[run] = {"status": "bench error", "error": repr(exc), "load_before": load_before}
                        print(f"{label}: {exc!r}", flush=True)
                        continue
                    jobs = api.jobs()
                    job_id = jobs[-1]["job_id"] if jobs else None
                    if job_id:
                        events = api.events(job_id)
                        out["replica_start_s"] = _replica_starts(events)
                        # episodes whose turn in flight on a crashed replica followed a tool result:
                        # resumed from their saved tool-turn prefix
                        out["resumed_after_tool_turn"] = sum(
                            1 for e in events if e["kind"] == "episode_redispatched"
                            and (e["data"].get("prefix_turns") or 0) >= 2)
                        verdict = await audit(stack.settings, job_id)
                        out.update({"job_id": job_id, "audit_ok": verdict.ok, "episodes_lost": verdict.episodes_lost,
                                    "audit_violations": verdict.violations()[:20]})
                    if scenario is not None:
                        out["redispatch"] = redispatch_summary(out)
                    out.update({"load_before": load_before, "load_after": _load()})
                    per[run] = out
                    args.out.with_suffix(".partial.json").write_text(json.dumps({**results, engine: per}, indent=2))
                results[engine] = per
            api.close()
    s = results["summary"] = {}
    for engine in engines:
        per = results[engine]
        crash = per.get("rollout_crash", {})
        rec = [f["recovery_s"] for f in crash.get("faults", []) if f.get("role") == "rollout" and f.get("recovery_s")]
        det = [f["detection_s"] for f in crash.get("faults", []) if f.get("role") == "rollout"
               and f.get("detection_s") is not None]
        s[engine] = {"fault_free_ettr": per.get("fault_free", {}).get("ettr"),
                     "rollout_crash_ettr": crash.get("ettr"), "status": crash.get("status"),
                     "rollout_faults": len([f for f in crash.get("faults", []) if f.get("role") == "rollout"]),
                     "recovery_s": rec, "detection_s": det,
                     "other_faults": [f"{f['role']}/{f['kind']}" for f in crash.get("faults", []) if f.get("role") != "rollout"],
                     "episodes_lost": crash.get("episodes_lost"), "audit_ok": crash.get("audit_ok"),
                     "fault_free_audit_ok": per.get("fault_free", {}).get("audit_ok"),
                     "replica_start_s": crash.get("replica_start_s"),
                     "turns_redispatched": crash.get("redispatch", {}).get("turns_redispatched"),
                     "resumed_after_tool_turn": crash.get("resumed_after_tool_turn")}
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results/ettr.json"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="Only the three trainer-fault runs (--launcher ray: no local whole_job).")
    parser.add_argument("--only", choices=("rollout",), default=None,
                        help="rollout: only the rollout-crash scenario, role_local and whole_job.")
    parser.add_argument("--launcher", choices=("local", "ray"), default="local",
                        help="ray: local vs Ray launcher on a 3-node Ray cluster on this machine (module docstring).")
    parser.add_argument("--testbed", action="store_true",
                        help="--launcher ray: the Ray cluster on the testbed, a worker node per host (module docstring).")
    parser.add_argument("--pairs", type=int, default=3,
                        help="--launcher ray: interleaved groups (local and Ray role_local, Ray and local whole_job).")
    parser.add_argument("--engine", choices=("torch", "vllm"), default="torch",
                        help="vllm: the HF-model job per rollout engine of --compare (module docstring).")
    parser.add_argument("--compare", default="vllm,torch",
                        help="--engine vllm: the rollout engines to run, in this order.")
    parser.add_argument("--crash-within-step", type=float, default=None,
                        help="--engine vllm: crash this many seconds into the step (default: a random moment).")
    parser.add_argument("--crash-moment", choices=("now", "mid_tool_turn"), default="now",
                        help="--engine vllm: mid_tool_turn arms each crashed replica to die at the first token of "
                             "its next turn after a tool result (a turn in flight with its prefix saved).")
    parser.add_argument("--warm-spares", type=int, default=None,
                        help="--launcher ray: recovery.warm_spares of every role_local run, local and Ray "
                             "alike (default: the trainer's workers); whole_job runs get one more per replica.")
    args = parser.parse_args()
    res = asyncio.run(main_ray(args) if args.launcher == "ray"
                      else main_engines(args) if args.engine == "vllm"
                      else main_rollout(args) if args.only == "rollout" else main(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    print(json.dumps(res["summary"], indent=2))
