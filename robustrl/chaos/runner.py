"""Run one job through a scenario on a running stack and account for it from its event log.

Used by ``robustrl demo``, ``robustrl chaos run`` and ``bench/ettr.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from robustrl.bus import Bus
from robustrl.chaos.accounting import account
from robustrl.chaos.harness import Harness, LocalFaults
from robustrl.chaos.scenario import Scenario, members_of, plan
from robustrl.client import ApiClient
from robustrl.config import Settings
from robustrl.errors import JobError, RequestTimeout, TransportError
from robustrl.messages import Event

POLL_S = 0.2
EVENTS_GRACE_S = 30.0
"""How long past the job's deadline the runner keeps trying to read its log (controller restarting)."""
TERMINAL = ("finished", "failed", "stopped")


async def _tolerant(call: Callable[[str], Any], job_id: str) -> Any:
    """``call(job_id)`` in a thread; None while the controller is unreachable or does not know the
    job yet (a restarted controller restores its jobs before it answers for them)."""
    try:
        return await asyncio.to_thread(call, job_id)
    except (TransportError, JobError):
        return None


def step_durations(events: list[Event]) -> list[float]:
    """Per committed step: its last start to its commit, in step order."""
    started: dict[int, float] = {}
    done: dict[int, float] = {}
    for e in sorted(events, key=lambda e: e.ts):
        if e.kind == "step_started":
            started[int(e.data["step"])] = e.ts
        elif e.kind == "step_committed":
            done[int(e.data["step"])] = e.ts
    return [round(done[k] - started[k], 3) for k in sorted(done) if k in started]


def job_spec_for(scenario: Scenario | None, base: dict[str, Any]) -> dict[str, Any]:
    spec = dict(base)
    if scenario is not None:
        for key, value in scenario.job.items():
            if isinstance(value, dict) and isinstance(spec.get(key), dict):
                spec[key] = {**spec[key], **value}
            else:
                spec[key] = value
        if scenario.policy:
            spec["recovery"] = {**spec.get("recovery", {}), "policy": scenario.policy}
    return spec


async def run_job(settings: Settings, api: ApiClient, spec: dict[str, Any], scenario: Scenario | None,
                  *, step_time_s: float = 3.5, timeout_s: float = 900.0,
                  on_status: Callable[[dict[str, Any]], None] | None = None,
                  local: LocalFaults | None = None) -> dict[str, Any]:
    """Submit ``spec``, inject the scenario's faults, wait until the job ends, return its report.

    ``local`` (the Stack) carries out faults on the controller, the detector and the infra servers.
    """
    # The plan first: a scenario that does not fit the job (a member index past its members) is
    # refused before the job is submitted (it was after, leaving a job running unasked for).
    planned = []
    if scenario is not None and scenario.faults:
        steps = int(spec.get("steps", 30))
        counts = members_of(Scenario(job={k: v for k, v in spec.items() if k in ("trainer", "rollout")}))
        planned = plan(scenario, steps, step_time_s=step_time_s, members=counts)
    bus = await Bus.connect(settings.nats_url, "chaos-harness", role="harness")
    chaos_task: asyncio.Task[list[dict[str, Any]]] | None = None
    try:
        job = await asyncio.to_thread(api.submit, spec)
        job_id = job["job_id"]
        stop = asyncio.Event()
        harness = Harness(bus, job_id, planned, local)
        chaos_task = asyncio.create_task(harness.run(stop))
        deadline = time.monotonic() + timeout_s
        status = job
        while True:
            # The controller may be the fault (restarting, or not yet leading again): keep asking.
            polled = await _tolerant(api.job, job_id)
            if polled is not None:
                status = polled
                if on_status:
                    on_status(status)
                if status["status"] in TERMINAL:
                    break
            if time.monotonic() > deadline:
                await _tolerant(api.stop, job_id)
                raise RequestTimeout(f"job {job_id} not finished after {timeout_s:.0f}s (step {status['step']})")
            await asyncio.sleep(POLL_S)
        stop.set()
        acks = await chaos_task
        raw_events = None
        while raw_events is None and time.monotonic() < deadline + EVENTS_GRACE_S:
            raw_events = await _tolerant(api.events, job_id)
            if raw_events is None:
                await asyncio.sleep(POLL_S)
        events = [Event.model_validate(e) for e in raw_events or []]
        report = account(events).to_dict()
        report["step_durations"] = step_durations(events)
        report.update({
            "job_id": job_id, "status": status["status"], "error": status.get("error"),
            "policy": status["policy"], "reward_by_step": status["reward_by_step"],
            "steps_completed": status["committed_step"] + 1, "injected": acks,
            "weights_checksum": status.get("weights_checksum"),
        })
        return report
    finally:
        if chaos_task is not None and not chaos_task.done():
            chaos_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await chaos_task
        await bus.close()
