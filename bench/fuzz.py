"""Bad input on every surface (issue 11): REST fuzzing, bus garbage, forbidden publishes.

    python bench/fuzz.py --out bench/results/fuzz.json [--rest-requests 5000] [--bus-payloads 10000]

* ``rest``: schemathesis against the controller's OpenAPI document with the token
  (``tests/rest_fuzz.py`` on ``tests/rest_target.py``: the real controller and API on private
  servers, a launcher that records members instead of starting them). Target: server_errors 0,
  schema_violations 0 over >= 5,000 requests.
* ``bus``: a tiny job on a local stack (embedded servers, per-role credentials); once it has
  committed step 0, >= 10,000 hypothesis-drawn garbage payloads (``robustrl.chaos.garbage``) on
  every subject the services use, published with the operator's unrestricted credentials (the
  worst case). Target: services_crashed 0, the job finishes, events readable, report_ok.
* ``forbidden_publishes_*``: every role's credentials publish on every protocol subject its
  permissions forbid; accepted = received by an unrestricted subscriber. Target: 0 accepted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from robustrl.chaos.garbage import (
    Garbage,
    draw_garbage,
    is_refused,
    probe_forbidden_publishes,
    spray,
    subjects_for,
)
from robustrl.client import ApiClient
from robustrl.infra.credentials import Credentials, role_settings
from robustrl.stack import Stack
from robustrl.subjects import Principal
from robustrl.supervisor import RestartPolicy, read_restarts

JOB_TIMEOUT_S = 900.0
POLL_S = 0.5


def _job_spec(steps: int) -> dict[str, Any]:
    return {"name": "fuzz", "steps": steps, "seed": 3, "data": {"prompts_per_step": 4, "group_size": 4},
            "rollout": {"replicas": 2}}


def _wait(api: ApiClient, job_id: str, pred: Any, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        status = api.job(job_id)
        if pred(status):
            return status
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} not there after {timeout_s:.0f}s: {status['status']}")
        time.sleep(POLL_S)


def run_rest(requests_total: int, seed: int, work: Path) -> dict[str, Any]:
    from rest_fuzz import fuzz_rest
    from rest_target import serve_controller

    with serve_controller(work / "rest") as target:
        job = httpx.post(f"{target.base_url}/v1/jobs", headers=target.headers, json=_job_spec(2), timeout=30)
        job_ids = [job.json()["job_id"]] if job.status_code == 201 else []
        result = fuzz_rest(target.base_url, target.token, requests_total=requests_total, seed_value=seed,
                           job_ids=job_ids)
    out = result.to_dict()
    return {k: out[k] for k in ("requests", "by_status", "server_errors", "schema_violations",
                                "violations_by_check", "failures", "seconds")}


PLACEHOLDER = "fuzzjob-0000000000"
MEMBERS = ["trainer-e1-r0", "trainer-e1-r1", "rollout-0-i0", "rollout-1-i0"]
"""The members a fresh job starts with (the controller's naming); garbage is drawn before the job
exists, for a placeholder job id swapped for the real one, so drawing does not eat the job's run."""


def _for_job(items: list[Garbage], job_id: str) -> list[Garbage]:
    old, new = PLACEHOLDER.encode(), job_id.encode()
    return [Garbage(i.subject.replace(PLACEHOLDER, job_id), i.payload.replace(old, new), i.kind) for i in items]


def run_bus(payloads: int, seed: int, steps: int, work: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    t0 = time.monotonic()
    drawn = list(draw_garbage(PLACEHOLDER, subjects_for(PLACEHOLDER, MEMBERS), payloads, seed=seed))
    drawn_s = time.monotonic() - t0
    # Hang detection is the supervisor's business, not this benchmark's: on a loaded 2-core host a
    # service can miss health checks for many seconds, so only crashes (exits) are counted.
    stack = Stack(work / "bus", policy=RestartPolicy(hang_timeout_s=120.0))
    settings = stack.start()
    api = ApiClient(stack.api_url, settings.api_token)
    try:
        jid = api.submit(_job_spec(steps))["job_id"]
        _wait(api, jid, lambda s: s["committed_step"] >= 0, JOB_TIMEOUT_S)
        members = [m["member_id"] for m in api.job(jid)["members"]]
        subjects = subjects_for(jid, sorted(set(members) | set(MEMBERS)))
        items = _for_job(drawn, jid)
        restarts_before = len(read_restarts(stack.run_dir))
        t_spray = time.time()
        t1 = time.monotonic()
        stats = asyncio.run(spray(settings.nats_url, items))
        sprayed_s = time.monotonic() - t1
        status = _wait(api, jid, lambda s: s["status"] in ("finished", "failed", "stopped"), JOB_TIMEOUT_S)
        restarts = read_restarts(stack.run_dir)[restarts_before:]
        crashed = [r for r in restarts if r.get("returncode") is not None]
        dead = [name for name, proc in stack.procs.items() if proc.poll() is not None]
        headers = {"Authorization": f"Bearer {settings.api_token}"}
        tries: list[dict[str, Any]] = []
        for _ in range(3):  # a client honours 503 + Retry-After (a read past the API's bound)
            t_get = time.monotonic()
            events = httpx.get(f"{stack.api_url}/v1/jobs/{jid}/events", headers=headers, timeout=60)
            tries.append({"status": events.status_code, "s": round(time.monotonic() - t_get, 2),
                          **({"detail": events.text[:300]} if events.status_code != 200 else {})})
            if events.status_code != 503:
                break
            time.sleep(float(events.headers.get("Retry-After") or 1))
        t_get = time.monotonic()
        report = httpx.get(f"{stack.api_url}/v1/jobs/{jid}/report", headers=headers, timeout=60)
        report_s = round(time.monotonic() - t_get, 2)
        member_crashes = []
        if events.status_code == 200:
            member_crashes = [e["data"] for e in events.json() if e["kind"] == "member_exited"
                              and e["ts"] >= t_spray and not e["data"].get("expected")
                              and e["data"].get("returncode") not in (0, None)]
        skipped = report.json().get("events_skipped") if report.status_code == 200 else None
        bus = {
            "payloads": stats.payloads, "bytes": stats.bytes, "by_kind": stats.by_kind,
            "refused_by_every_model": all(is_refused(i.subject, i.payload) for i in items),
            "subjects": len(stats.subjects or ()), "subjects_available": len(subjects),
            "services_crashed": len(crashed) + len(dead), "service_hang_restarts": len(restarts) - len(crashed),
            "members_crashed": len(member_crashes),
            "job_status": status["status"], "steps_committed": status["committed_step"] + 1,
            "events_status": events.status_code, "events_unreadable": int(events.status_code != 200),
            "events_tries": tries, "report_s": report_s,
            "events_read": len(events.json()) if events.status_code == 200 else None,
            "events_garbage_sent": stats.events_payloads, "events_skipped": skipped,
            "report_status": report.status_code,
            "report_ok": report.status_code == 200 and skipped == stats.events_payloads,
            "draw_s": round(drawn_s, 1), "spray_s": round(sprayed_s, 1),
        }
        creds = Credentials.load(settings.credentials_file)
        tried, accepted = 0, []
        for role in Principal:
            res = asyncio.run(probe_forbidden_publishes(settings.nats_url, role_settings(settings, creds, role).nats_url,
                                                        role.value, jid))
            tried += res.tried
            accepted += [f"{role.value}: {s}" for s in res.accepted]
        forbidden = {"forbidden_publishes_tried": tried, "forbidden_publishes_accepted": len(accepted),
                     "forbidden_accepted_subjects": accepted}
        return bus, forbidden
    finally:
        api.close()
        stack.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rest-requests", type=int, default=5000)
    ap.add_argument("--bus-payloads", type=int, default=10_000)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--skip-rest", action="store_true")
    ap.add_argument("--skip-bus", action="store_true", help="REST only (bus and forbidden publishes left empty)")
    args = ap.parse_args()
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="rrl-fuzz-") as tmp:
        work = Path(tmp)
        bus, forbidden = ({}, {}) if args.skip_bus else run_bus(args.bus_payloads, args.seed, args.steps, work)
        print(json.dumps({"bus": bus, **forbidden}, indent=2), flush=True)
        rest = {} if args.skip_rest else run_rest(args.rest_requests, args.seed, work)
    result = {"rest": rest, "bus": bus, **forbidden,
              "targets": {"rest_requests": args.rest_requests, "bus_payloads": args.bus_payloads},
              "seconds": round(time.time() - started, 1),
              "machine": {"cpus": __import__("os").cpu_count(), "python": platform.python_version()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "rest"} | {"rest": {
        k: rest.get(k) for k in ("requests", "by_status", "server_errors", "schema_violations")}}, indent=2))


if __name__ == "__main__":
    main()
