"""Helpers for integration tests that run real jobs on a real stack."""

from __future__ import annotations

from typing import Any

from support import eventually

from robustrl.client import ApiClient

TERMINAL = ("finished", "failed", "stopped")


def small_job(name: str, steps: int = 5, **overrides: Any) -> dict[str, Any]:
    """A job small enough for tests: 4 prompts x 4 samples, reference thresholds."""
    spec: dict[str, Any] = {"name": name, "steps": steps, "seed": 3,
                            "data": {"prompts_per_step": 4, "group_size": 4},
                            "rollout": {"replicas": 2}}
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return spec


def wait_step(api: ApiClient, job_id: str, committed: int, timeout: float = 90.0) -> dict[str, Any]:
    return eventually(lambda: (s := api.job(job_id))["committed_step"] >= committed and s,
                      timeout=timeout, interval=0.05, what=f"{job_id} committed step {committed}")


def wait_done(api: ApiClient, job_id: str, timeout: float = 180.0) -> dict[str, Any]:
    status = eventually(lambda: (s := api.job(job_id))["status"] in TERMINAL and s, timeout=timeout,
                        interval=0.2, what=f"{job_id} finished")
    assert status["status"] == "finished", f"job ended {status['status']}: {status.get('error')}"
    return status


def kinds(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e["data"] for e in events if e["kind"] == kind]
