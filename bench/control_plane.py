"""Control-plane and infra faults: what each costs the job, from the event log alone.

    python bench/control_plane.py --out bench/results/control_plane.json

Runs the reference job (scaled like the test jobs) on a supervised local stack, several times:

* ``crash``: SIGKILL of the controller, the detector and the request manager, each at a random
  moment of a different step (the supervisor restarts it; it resumes);
* ``hang``: SIGSTOP of each for 10 s, then SIGCONT (the supervisor may judge it hung first and
  replace it: ``supervisor_restarts`` says which happened);
* ``infra_restart``: NATS, Redis and S3 servers stopped and started on their port and data;
* ``failover``: two controllers, the leader SIGKILLed mid-step: time until the standby holds the
  lease (read from Redis), and double actions: per fault id, actions logged under more than one
  fencing token, after a rollout crash that both controllers hear about.

Per fault: ``{role, kind, job_completed, members_restarted, steps_redone, tokens_regenerated,
stall_s}`` (``robustrl.chaos.impact``; stall = the faulted step's duration minus the median clean
step). Targets (issue 10): job completed, 0 trainer/rollout members restarted, 0 steps redone,
stall <= 10 s for a crash, failover <= lease + 2 s, 0 double actions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from robustrl.bus import Bus
from robustrl.chaos.impact import impacts
from robustrl.chaos.runner import run_job
from robustrl.chaos.scenario import Faults, Scenario
from robustrl.client import ApiClient
from robustrl.errors import JobError, TransportError
from robustrl.messages import Event
from robustrl.stack import Stack
from robustrl.storage.redis_stores import Keys, connect

LEASE_TTL_S = 3.0
FAILOVER_TIMEOUT_S = 60.0
JOB_TIMEOUT_S = 900.0


def job_spec(name: str, steps: int) -> dict[str, Any]:
    """The test-sized reference job: 4 prompts x 4 samples, 2 trainer workers, 2 replicas."""
    return {"name": name, "steps": steps, "seed": 3, "data": {"prompts_per_step": 4, "group_size": 4},
            "rollout": {"replicas": 2}}


FAULT_STEPS = (2, 5, 8)
"""One fault per step here, clean steps between them (for the median clean step)."""
STEP_TIME_S = 0.4
"""About one fault-free step of this job here (0.37-0.45 s): each fault lands at a random moment
of its own step. (3.0 put them up to 6 steps late, and two of three after the last commit.)"""


def _scenario(kind: str, seed: int) -> Scenario:
    """Three faults of one kind, on ``FAULT_STEPS``, each at a seeded random moment of its step."""
    f = Faults(f"cp-{kind}", seed=seed)
    if kind == "infra_restart":
        for step, server in zip(FAULT_STEPS, ("nats", "redis", "s3"), strict=True):
            f.infra_restart(server, at_step=step)
    else:
        for step, role in zip(FAULT_STEPS, ("controller", "detector", "request_manager"), strict=True):
            f.add(kind, role, at_step=step, **({"duration_s": 10.0} if kind == "hang" else {}))
    return f.build()


def run_kind(kind: str, seed: int, steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"cp-{kind}-") as tmp:
        stack = Stack(Path(tmp))
        stack.start()
        try:
            assert stack.settings is not None
            api = ApiClient(stack.api_url, stack.settings.api_token)
            t0 = time.time()
            report = asyncio.run(run_job(stack.settings, api, job_spec(f"cp{kind.replace('_', '')}", steps),
                                         _scenario(kind, seed), step_time_s=STEP_TIME_S, timeout_s=JOB_TIMEOUT_S,
                                         local=stack))
            events = [Event.model_validate(e) for e in api.events(report["job_id"])]
            api.close()
            restarts = [r for r in stack.restarts() if float(r.get("ts", 0)) >= t0]  # type: ignore[arg-type]
        finally:
            stack.stop()
    faults = [imp.to_dict() for imp in impacts(events)]
    for f, ack in zip(faults, report["injected"], strict=False):
        f["injected_ok"] = ack.get("ok")
        f["infra_down_s"] = ack.get("took_s")
    return {"kind": kind, "job_id": report["job_id"], "status": report["status"], "error": report.get("error"),
            "completion_s": report["completion_s"], "faults": faults,
            "supervisor_restarts": [{k: r.get(k) for k in ("service", "reason", "returncode", "backoff_s")}
                                    for r in restarts]}


async def _lease_owner(redis: Any) -> str | None:
    raw = await redis.get(Keys.controller_lease())
    return None if raw is None else raw.decode()


def _pid_of(owner: str) -> int:
    """``<host>-<pid>-<rand>:<token>`` -> pid."""
    return int(owner.split(":", 1)[0].rsplit("-", 2)[1])


async def _failover(stack: Stack, steps: int) -> dict[str, Any]:
    assert stack.settings is not None
    settings = stack.settings
    redis = connect(settings.redis_url)
    bus = await Bus.connect(settings.nats_url, "bench-failover", role="harness")
    api = ApiClient(stack.api_url, settings.api_token)
    try:
        job_id = (await asyncio.to_thread(api.submit, job_spec("cpfailover", steps)))["job_id"]

        async def events() -> list[Event]:
            return list(await bus.read_events(job_id))

        async def wait_for(pred: Any, timeout: float, what: str) -> list[Event]:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                evs = await events()
                if pred(evs):
                    return evs
                await asyncio.sleep(0.5)
            raise TimeoutError(f"{what} not seen within {timeout:.0f}s")

        def committed(evs: list[Event], k: int) -> bool:
            return any(e.kind == "step_committed" and int(e.data["step"]) >= k for e in evs)

        def started(evs: list[Event], k: int) -> bool:
            return any(e.kind == "step_started" and int(e.data["step"]) >= k for e in evs)

        await wait_for(lambda evs: started(evs, 2), JOB_TIMEOUT_S, "step 2")
        owner = await _lease_owner(redis)
        assert owner, "no controller holds the lease"
        leader_pid = _pid_of(owner)
        name = next(n for n, p in stack.pids().items() if p == leader_pid)
        t_kill = time.monotonic()
        os.killpg(leader_pid, signal.SIGKILL)
        new_owner = None
        while time.monotonic() - t_kill < FAILOVER_TIMEOUT_S:
            cur = await _lease_owner(redis)
            if cur and cur.split(":")[0] != owner.split(":")[0]:
                new_owner = cur
                break
            await asyncio.sleep(0.02)
        failover_s = time.monotonic() - t_kill if new_owner else None
        # Both controllers run again (the killed one restarted as standby): a rollout crash now
        # is heard by both; only the leader may act on it.
        evs = await wait_for(lambda evs: started(evs, 4), JOB_TIMEOUT_S, "step 4")
        stopped = await asyncio.to_thread(_chaos_rollout_crash, stack, job_id)
        evs = await wait_for(lambda evs: any(e.kind in ("job_finished", "job_failed", "job_stopped") for e in evs),
                             JOB_TIMEOUT_S, "job end")
        acts: dict[str, set[Any]] = defaultdict(set)
        per_action: dict[tuple[str, str, str | None], int] = defaultdict(int)
        for e in evs:
            if e.kind == "action":
                fid = str(e.data.get("fault_id"))
                acts[fid].add(e.data.get("fence"))
                per_action[(fid, str(e.data.get("action")), e.data.get("member_id"))] += 1
        double = sum(1 for fences in acts.values() if len(fences) > 1) + sum(n - 1 for n in per_action.values()
                                                                              if n > 1)
        return {"job_id": job_id, "killed": name, "old_lease": owner, "new_lease": new_owner,
                "failover_s": None if failover_s is None else round(failover_s, 3), "lease_ttl_s": LEASE_TTL_S,
                "rollout_crash_injected": stopped,
                "job_completed": any(e.kind == "job_finished" for e in evs),
                "double_actions": double, "actions": sum(per_action.values()),
                "faults": [imp.to_dict() for imp in impacts(evs)]}
    finally:
        api.close()
        await bus.close()
        await redis.aclose()


def _chaos_rollout_crash(stack: Stack, job_id: str) -> Any:
    """Through whichever controller leads now (its API answers for the job)."""
    assert stack.supervisor is not None and stack.settings is not None
    for spec in stack.supervisor.specs.values():
        if spec.module.endswith("controller") and spec.health_url:
            base = spec.health_url.rsplit("/healthz", 1)[0]
            client = ApiClient(base, stack.settings.api_token)
            try:
                return client.fault(job_id, kind="crash", role="rollout", member=0)
            except (TransportError, JobError):  # the standby does not know the job: try the other
                pass
            finally:
                client.close()
    return None


def run_failover(steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="cp-failover-") as tmp:
        stack = Stack(Path(tmp), controllers=2, extra_env={"ROBUSTRL_LEASE_TTL_S": str(LEASE_TTL_S)})
        stack.start()
        try:
            return asyncio.run(_failover(stack, steps))
        finally:
            stack.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=11)
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--only", choices=("crash", "hang", "infra_restart", "failover"), action="append")
    args = parser.parse_args(argv)
    kinds = args.only or ["crash", "hang", "infra_restart", "failover"]
    out: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": {}}
    for kind in kinds:
        t0 = time.monotonic()
        try:
            out["runs"][kind] = run_failover(args.steps) if kind == "failover" else run_kind(kind, args.seed, args.steps)
        except Exception as exc:  # noqa: BLE001 - one failed run is a result, the others still run
            out["runs"][kind] = {"error": f"{type(exc).__name__}: {exc}"}
        out["runs"][kind]["wall_s"] = round(time.monotonic() - t0, 1)
        print(json.dumps({kind: out["runs"][kind]}, indent=1), file=sys.stderr, flush=True)
    rows = [f for k in ("crash", "hang", "infra_restart") for f in out["runs"].get(k, {}).get("faults", [])]
    out["summary"] = {
        "faults": len(rows),
        "jobs_completed": all(r.get("status") == "finished" for k, r in out["runs"].items() if k != "failover"),
        "members_restarted": sum(f["members_restarted"] for f in rows),
        "steps_redone": sum(f["steps_redone"] for f in rows),
        "max_crash_stall_s": max((f["stall_s"] or 0.0 for f in out["runs"].get("crash", {}).get("faults", [])),
                                 default=None),
        "failover_s": out["runs"].get("failover", {}).get("failover_s"),
        "double_actions": out["runs"].get("failover", {}).get("double_actions"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out["summary"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
