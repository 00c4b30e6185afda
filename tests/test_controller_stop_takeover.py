"""An operator's stop is not undone by the death of the controller carrying it out.

Real servers, a supervised control plane of this module's own (two controllers), real member
processes (local launcher). The leader is armed at the ``stop_members_stopped`` failpoint: asked
to stop a running job, it stops the job's members, records their exits, and freezes before the
job's final event and status. It is SIGKILLed there; the standby takes over.

Before, the record said ``running`` with every member stopped: the new leader resumed the job (a
resume owed to the request manager), its step deadline found no live replica, and a whole-job
restart brought the job back, members and all (an outside review). Now the stop is in the record
from its start (``stop_owed``) and the new leader carries it out.

Verdict from outside the controllers: the raw job record in Redis (the stop owed at the freeze,
``stopped`` after), the event log (one ``job_stopped``; no member started after the stop was
asked) and the process table (no member of the job left running).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest
from jobs import kinds, small_job, wait_step
from robustrl.services.controller.failpoints import ENV as FAILPOINTS_ENV
from support import eventually, leader_and_standby, lease_runs_out, raw_job_record

from robustrl.client import ApiClient
from robustrl.stack import Stack
from robustrl.supervisor import RestartPolicy

pytestmark = pytest.mark.timeout(300)
LEASE_TTL_S = 30.0
TOLERANT = {"detector": {"trainer_idle_s": 90.0, "rollout_idle_s": 90.0, "silence_s": 90.0,
                         "probe_timeout_s": 5.0, "metrics_interval_s": 0.5}}
STOP_BOUND_S = 60.0
"""The new leader must end the job within this once it leads."""


@pytest.fixture(scope="module")
def two_controllers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Servers of this module alone, two controllers; only the first ('controller') is armed."""
    st = Stack(tmp_path_factory.mktemp("stop-takeover"), controllers=2, policy=RestartPolicy(hang_timeout_s=60.0),
               extra_env={"ROBUSTRL_LEASE_TTL_S": f"{LEASE_TTL_S:g}"},
               service_extra_env={"controller": {FAILPOINTS_ENV: "stop_members_stopped"}})
    st.start()
    try:
        yield st
    finally:
        st.stop()


def _job_processes(job_id: str) -> list[psutil.Process]:
    """Live processes whose command line or environment names the job (its members)."""
    found = []
    for p in psutil.process_iter(["cmdline", "environ"]):
        try:
            text = " ".join(p.info["cmdline"] or []) + " " + " ".join(
                f"{k}={v}" for k, v in (p.info["environ"] or {}).items() if k == "ROBUSTRL_JOB_ID")
        except (psutil.Error, TypeError):
            continue
        if job_id in text and p.status() != psutil.STATUS_ZOMBIE:
            found.append(p)
    return found


def test_a_stop_the_leader_began_is_carried_out_by_the_next(two_controllers: Stack) -> None:
    stack = two_controllers
    assert stack.settings and stack.supervisor
    standby_health = leader_and_standby(stack)
    api_a = ApiClient(stack.api_url, stack.settings.api_token)
    jid = api_a.submit(small_job("stop-takeover", steps=40, **TOLERANT))["job_id"]
    wait_step(api_a, jid, 1)
    api_a.close()
    leader = stack.pids()["controller"]
    standby = stack.pids()["controller-2"]
    members = [m["pid"] for m in raw_job_record(stack.settings.redis_url, jid)["members"].values() if m.get("pid")]
    assert members

    # The operator's stop; the leader freezes once the members are stopped and their exits recorded.
    asked_at = time.time()

    def ask_stop() -> None:
        api = ApiClient(stack.api_url, stack.settings.api_token)
        try:
            api.stop(jid)
        except Exception:  # noqa: BLE001, S110 - its controller is frozen, then killed: no answer comes
            pass
        finally:
            api.close()

    asker = threading.Thread(target=ask_stop, daemon=True)
    asker.start()
    eventually(lambda: psutil.Process(leader).status() == psutil.STATUS_STOPPED, timeout=90, interval=0.02,
               what="controller stopped at failpoint stop_members_stopped")
    frozen = raw_job_record(stack.settings.redis_url, jid)
    assert frozen["status"] == "running", frozen["status"]
    assert (frozen.get("stop_owed") or {}).get("status") == "stopped", frozen.get("stop_owed")
    stack.kill_service("controller")  # SIGKILL, not restarted
    lease_runs_out(stack.settings.redis_url)
    t_kill = time.monotonic()
    eventually(lambda: httpx.get(standby_health, timeout=2).json()["leading"] is True, timeout=60, interval=0.1,
               retry_on=(httpx.HTTPError,), what="controller-2 leading")
    final = eventually(lambda: (r := raw_job_record(stack.settings.redis_url, jid))["status"] != "running" and r,
                       timeout=STOP_BOUND_S, interval=0.2, what="the job's record final")
    took_s = time.monotonic() - t_kill
    assert final["status"] == "stopped" and final.get("stop_owed") is None, (final["status"], final.get("error"))
    api_b = ApiClient(f"http://127.0.0.1:{stack.supervisor.specs['controller-2'].env['ROBUSTRL_API_PORT']}",
                      stack.settings.api_token)
    try:
        events: list[dict[str, Any]] = api_b.events(jid)
    finally:
        api_b.close()
    ends = [e["kind"] for e in events if e["kind"] in ("job_finished", "job_failed", "job_stopped")]
    assert ends == ["job_stopped"], ends
    started_after = [d for d in kinds(events, "member_started") if float(d.get("started_at") or 0) > asked_at]
    restarted = [e for e in events if e["kind"] == "member_started" and e["ts"] > asked_at]
    assert not started_after and not restarted, restarted
    assert all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in members)
    assert not _job_processes(jid), [p.pid for p in _job_processes(jid)]
    assert took_s < STOP_BOUND_S
    assert psutil.Process(standby).status() != psutil.STATUS_STOPPED  # (the standby was never armed)
