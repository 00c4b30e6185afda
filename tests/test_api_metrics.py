"""``GET /metrics`` of the real controller: a real job with one injected rollout crash, scraped
with the bearer token, parsed strictly, and compared with the job's own status dict."""

from __future__ import annotations

from collections import Counter
from typing import Any

import httpx
import pytest
from jobs import TERMINAL, small_job, wait_step
from support import eventually
from test_metrics import parse, pick

from robustrl.client import ApiClient
from robustrl.metrics import CONTENT_TYPE

pytestmark = pytest.mark.timeout(240)

# Never reached: the job is stopped once the fault has recovered (keeps the test short). A short
# job can end before a loaded machine has started the replacement, and then nothing recovers.
STEPS = 60
SCRAPE_TIMEOUT_S = 10.0


def _job_spec() -> dict[str, Any]:
    # Tool calls with latency make the episodes multi-turn, as in the rollout-crash recovery test.
    return small_job("metrics", steps=STEPS, tools={"latency_s": 0.5}, data={"tasks": ["lookup"]})


def _scrape(stack: Any, token: str | None) -> httpx.Response:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    return httpx.get(f"{stack.api_url}/metrics", headers=headers, timeout=SCRAPE_TIMEOUT_S)


def _samples(stack: Any) -> list[tuple[str, dict[str, str], float]]:
    resp = _scrape(stack, stack.settings.api_token)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"] == CONTENT_TYPE
    return parse(resp.text)[1]


def test_metrics_endpoint_reports_a_real_job_and_its_fault(api: ApiClient, stack: Any) -> None:
    jid = api.submit(_job_spec())["job_id"]
    try:
        wait_step(api, jid, 1)
        # Mid-run: the job and its live trainer gang are there.
        samples = _samples(stack)
        assert pick(samples, "robustrl_job_info", job_id=jid, name="metrics", status="running") == [1]
        assert pick(samples, "robustrl_job_step", job_id=jid)[0] >= 1
        assert pick(samples, "robustrl_job_steps_planned", job_id=jid) == [STEPS]
        assert len(pick(samples, "robustrl_member_info", job_id=jid, role="trainer")) == 2

        api.fault(jid, kind="crash", role="rollout", member=0)
        recovered = eventually(lambda: (s := api.job(jid))["faults"] and s["faults"][0]["recovery_s"] is not None
                               and s, timeout=120, interval=0.2, what=f"{jid} fault recovered")
        # One more step after the recovery, so the replacement served a committed step.
        wait_step(api, jid, recovered["committed_step"] + 1)
    finally:
        api.stop(jid)
    status = eventually(lambda: (s := api.job(jid))["status"] in TERMINAL and s, timeout=30,
                        what=f"{jid} stopped")
    samples = _samples(stack)  # the job is stopped: nothing moves between status and scrape

    labels = {"job_id": jid}
    assert status["status"] == "stopped"
    assert pick(samples, "robustrl_job_info", **labels, name="metrics", status="stopped",
                policy=status["policy"]) == [1]
    assert pick(samples, "robustrl_jobs", status="stopped")[0] >= 1
    assert pick(samples, "robustrl_job_step", **labels) == [status["committed_step"]]
    assert status["committed_step"] >= 2
    assert pick(samples, "robustrl_job_steps_planned", **labels) == [STEPS]
    assert pick(samples, "robustrl_job_weights_version", **labels) == [status["weights_version"]]
    assert pick(samples, "robustrl_job_durable_step", **labels) == [status["durable_step"]]
    assert len(status["reward_by_step"]) == status["committed_step"] + 1
    assert pick(samples, "robustrl_job_reward_last", **labels) == [status["reward_by_step"][-1]]
    if status["ettr"] is not None:
        assert pick(samples, "robustrl_job_ettr", **labels) == [status["ettr"]]

    # Member states: one gauge per (role, state), equal to the status dict's members.
    expected = Counter((m["role"], m["state"]) for m in status["members"])
    got = {(lab["role"], lab["state"]): v for n, lab, v in samples
           if n == "robustrl_members" and lab["job_id"] == jid}
    assert got == expected
    ids = {lab["member_id"] for n, lab, _ in samples if n == "robustrl_member_info" and lab["job_id"] == jid}
    assert ids == {m["member_id"] for m in status["members"]}
    assert {"rollout-0-i0", "rollout-0-i1"} <= ids  # the crashed replica and its replacement

    # The injected crash: counted by kind and role, with its detection and recovery times.
    faults = status["faults"]
    assert [(f["kind"], f["role"]) for f in faults] == [("crash", "rollout")]
    assert pick(samples, "robustrl_faults_total", **labels, kind="crash", role="rollout") == [1]
    detection, recovery = faults[0]["detection_s"], faults[0]["recovery_s"]
    assert recovery is not None and recovery > 0
    assert pick(samples, "robustrl_fault_recovery_seconds_count", **labels) == [1]
    assert pick(samples, "robustrl_fault_recovery_seconds_sum", **labels) == [pytest.approx(recovery)]
    assert pick(samples, "robustrl_fault_recovery_seconds_bucket", **labels, le="+Inf") == [1]
    # The detection histogram always mirrors the status dict ...
    observed = 0 if detection is None else 1
    assert pick(samples, "robustrl_fault_detection_seconds_count", **labels) == [observed]
    assert pick(samples, "robustrl_fault_detection_seconds_sum", **labels) == [pytest.approx(detection or 0)]
    if detection is None:
        # ... which can lack the delay: Controller.inject records the injection time only after
        # the kill returned, and the exit can be detected while the kill still waits on the
        # process. Reported to the lead (record it before the kill); the event-log report has it.
        pytest.xfail("controller race: fault detected before its injection time was recorded")
    assert 0 <= detection < 5.0
    assert pick(samples, "robustrl_fault_detection_seconds_bucket", **labels, le="5.0") == [1]


def test_metrics_need_the_token(stack: Any) -> None:
    for token in (None, "wrong-token"):
        resp = _scrape(stack, token)
        assert resp.status_code == 401
        assert "robustrl_" not in resp.text
