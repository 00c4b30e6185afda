"""A job whose last step commits while a new controller is taking over is still finished.

Real servers, a supervised control plane of this module's own (two controllers), real member
processes (local launcher). The trainer gang is frozen one step before the end, the leader is
SIGKILLed, and the standby takes the lease and freezes itself at the ``takeover_resumed``
failpoint: it has read the job's record and event log and re-attached the members, and does not
lead yet. The trainers are then let go: the last step commits (its StepCommitted message and its
``step_committed`` event, both watched on the raw bus) while the new leader is still frozen, and
only then is the new leader let go. Seen once in the Ray cross-node test at load 15: the commit
reached the new leader before it led, was dropped, and the job was never marked finished.

Verdict from outside the controllers: the raw job record in Redis reaches ``finished`` within a
bound, the event log holds one ``job_finished``, and the auditor is clean.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest
from jobs import small_job
from robustrl.services.controller.failpoints import ENV as FAILPOINTS_ENV
from support import (BusObserver, audit_sampled, ended, eventually, leader_and_standby, lease_runs_out, raw_job_record,
                     sample_batches)

from robustrl.audit.model import AuditOptions
from robustrl.client import ApiClient
from robustrl.errors import JobError
from robustrl.messages import StepCommitted, decode, decode_event
from robustrl.stack import Stack
from robustrl.subjects import Verb, events_of, subject
from robustrl.supervisor import RestartPolicy

pytestmark = pytest.mark.timeout(300)
AUDIT = AuditOptions(redis_bound=False)
LEASE_TTL_S = 30.0
"""The controllers' lease: a frozen new leader comes back still holding it (an expired lease
re-taken makes it read the event log on its own, a different path from the one under test). A
dead leader's lease is ended by deleting its key (``support.lease_runs_out``) when the test chooses."""
TOLERANT = {"detector": {"trainer_idle_s": 90.0, "rollout_idle_s": 90.0, "silence_s": 90.0,
                         "probe_timeout_s": 5.0, "metrics_interval_s": 0.5}}
STEPS = 8
FINISH_BOUND_S = 60.0
"""The new leader must mark the job finished within this (a finished job's stop waits up to the
trainer's last upload, FINISH_GRACE_S = 15 s)."""


@pytest.fixture(scope="module")
def two_controllers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Servers of this module alone, two controllers, both armed at ``takeover_resumed`` (the first
    leader has no job to resume, so only a controller taking over a job stops there)."""
    env = {FAILPOINTS_ENV: "takeover_resumed", "ROBUSTRL_LEASE_TTL_S": f"{LEASE_TTL_S:g}"}
    st = Stack(tmp_path_factory.mktemp("takeover-finish"), controllers=2, policy=RestartPolicy(hang_timeout_s=60.0),
               extra_env=env)
    st.start()
    try:
        yield st
    finally:
        st.stop()


def _raw_record(stack: Stack, job_id: str) -> dict[str, Any]:
    assert stack.settings
    return raw_job_record(stack.settings.redis_url, job_id)


def _signal_groups(pids: list[int], sig: int) -> None:
    for pid in pids:
        os.killpg(pid, sig)  # the local launcher starts each member in a session of its own


def test_last_step_committed_during_takeover_finishes_the_job(two_controllers: Stack) -> None:
    stack = two_controllers
    assert stack.settings and stack.supervisor
    # 'controller' leads (the stack starts the standby once it does); 'controller-2' stands by, armed
    leader_and_standby(stack)
    api_a = ApiClient(stack.api_url, stack.settings.api_token)
    spec = small_job("takeover-finish", steps=STEPS, tools={"latency_s": 0.5}, data={"tasks": ["lookup"]},
                     **TOLERANT)
    jid = api_a.submit(spec)["job_id"]
    sampler = sample_batches(stack.settings.redis_url, jid)
    api_a.close()
    leader = stack.pids()["controller"]
    standby = stack.pids()["controller-2"]
    observed = [subject(jid, Verb.COMMIT), events_of(jid)]
    frozen: list[int] = []
    try:
        with BusObserver(stack.settings.nats_url, observed) as bus:
            def commits() -> set[int]:
                return {decode(StepCommitted, d, s).step for _, s, d in list(bus.seen) if s == observed[0]}

            def committed_events() -> set[int]:
                out = set()
                for _, s, d in list(bus.seen):
                    if s != observed[0] and (e := decode_event(d, s)).kind == "step_committed":
                        out.add(int(e.data["step"]))
                return out

            eventually(lambda: STEPS - 2 in commits(), timeout=180, interval=0.01, what=f"step {STEPS - 2} committed")
            rec = _raw_record(stack, jid)
            frozen = [m["pid"] for m in rec["members"].values()
                      if m["role"] == "trainer" and m["epoch"] == rec["epoch"] and m["state"] not in ("exited", "dead")]
            assert frozen, rec["members"]
            _signal_groups(frozen, signal.SIGSTOP)  # the last step cannot commit now
            assert STEPS - 1 not in commits(), "the last step committed before the trainers were frozen"

            stack.kill_service("controller")  # SIGKILL, not restarted
            assert ended(leader)
            lease_runs_out(stack.settings.redis_url)
            eventually(lambda: psutil.Process(standby).status() == psutil.STATUS_STOPPED, timeout=60, interval=0.02,
                       what="controller-2 stopped at failpoint takeover_resumed")
            at_takeover = _raw_record(stack, jid)
            # (step STEPS - 2's commit may not be in the record yet: the leader was killed as it
            # came, seen under three workers; the new leader reads it from the log)
            assert at_takeover["status"] == "running" and at_takeover["committed_step"] in (STEPS - 3, STEPS - 2), \
                at_takeover

            # The last step commits while the new leader has resumed the job but does not lead yet.
            _signal_groups(frozen, signal.SIGCONT)
            frozen = []
            eventually(lambda: STEPS - 1 in committed_events() and STEPS - 1 in commits(), timeout=60,
                       interval=0.02, what=f"step {STEPS - 1} committed (message and event)")
            t_resume = time.monotonic()
            os.kill(standby, signal.SIGCONT)

            final = eventually(lambda: (r := _raw_record(stack, jid))["status"] in ("finished", "failed", "stopped")
                               and r, timeout=FINISH_BOUND_S, interval=0.2, what="the job's record final")
            took_s = time.monotonic() - t_resume
    finally:
        if frozen:
            _signal_groups(frozen, signal.SIGCONT)
        if psutil.pid_exists(standby):
            os.kill(standby, signal.SIGCONT)
    assert final["status"] == "finished", final.get("error")
    assert final["committed_step"] == STEPS - 1, final["committed_step"]
    assert took_s < FINISH_BOUND_S
    api_b = ApiClient(f"http://127.0.0.1:{stack.supervisor.specs['controller-2'].env['ROBUSTRL_API_PORT']}",
                      stack.settings.api_token)
    try:
        events = api_b.events(jid)
    finally:
        api_b.close()
    ends = [e for e in events if e["kind"] in ("job_finished", "job_failed", "job_stopped")]
    assert [e["kind"] for e in ends] == ["job_finished"], ends
    took_over = [e for e in events if e["kind"] == "note" and "took over" in e["data"].get("text", "")]
    assert len(took_over) == 1 and ends[0]["data"]["fence"] == took_over[0]["data"]["fence"], (took_over, ends)
    audit_sampled(stack.settings, jid, sampler, AUDIT)


def test_a_member_that_died_while_no_controller_led_is_recovered_by_the_new_leader(two_controllers: Stack) -> None:
    """The symmetric case: a rollout replica SIGKILLed after the leader died and before the standby
    took over is seen by the new leader as gone (not adopted), handled as a crash under its own
    fencing token, and its slot restarted once; the job finishes."""
    stack = two_controllers
    assert stack.settings and stack.supervisor
    # After the test above 'controller-2' leads; 'controller' comes back as a standby, not armed.
    if stack.pids().get("controller") is None or not psutil.pid_exists(stack.pids()["controller"]):
        stack.start_service("controller", env={FAILPOINTS_ENV: ""})
    port_b = stack.supervisor.specs["controller-2"].env["ROBUSTRL_API_PORT"]
    api_b_url = f"http://127.0.0.1:{port_b}"
    leader_name, leader_url, standby_url = "controller-2", api_b_url, stack.api_url
    leads = eventually(lambda: httpx.get(f"{stack.api_url}/healthz", timeout=2).json(), timeout=60, interval=0.1,
                       retry_on=(httpx.HTTPError,), what="'controller' answering")["leading"]
    if leads is True:  # this test run alone: 'controller' is the stack's first leader
        leader_name, leader_url, standby_url = "controller", stack.api_url, api_b_url
        stack.kill_service("controller-2")
        stack.start_service("controller-2", env={FAILPOINTS_ENV: ""})
    eventually(lambda: httpx.get(f"{standby_url}/healthz", timeout=2).json()["leading"] is False, timeout=60,
               interval=0.1, retry_on=(httpx.HTTPError, KeyError), what="a standby controller")
    api_a = ApiClient(leader_url, stack.settings.api_token)
    spec = small_job("takeover-gone", steps=10, tools={"latency_s": 0.5}, data={"tasks": ["lookup"]},
                     rollout={"replicas": 2}, **TOLERANT)
    jid = api_a.submit(spec)["job_id"]
    sampler = sample_batches(stack.settings.redis_url, jid)
    api_a.close()
    eventually(lambda: _raw_record(stack, jid)["committed_step"] >= 2, timeout=180, interval=0.05, what="step 2")
    victim = "rollout-1-i0"
    pid = _raw_record(stack, jid)["members"][victim]["pid"]
    t_kill = time.time()
    stack.kill_service(leader_name)  # no controller leads now (until the lease runs out below)
    os.killpg(pid, signal.SIGKILL)
    eventually(lambda: ended(pid),
               timeout=10, interval=0.02, what=f"{victim} gone")
    lease_runs_out(stack.settings.redis_url)  # only now may the standby take over
    api_b = ApiClient(standby_url, stack.settings.api_token)
    try:
        final = eventually(lambda: (r := _raw_record(stack, jid))["status"] in ("finished", "failed", "stopped")
                           and r, timeout=240, interval=0.25, what="the job's record final")
        events = eventually(lambda: api_b.events(jid), timeout=30, interval=0.25, retry_on=(JobError,),
                            what="the new leader's event log")
    finally:
        api_b.close()
    assert final["status"] == "finished", final.get("error")
    took_over = [e["data"] for e in events if e["kind"] == "note" and "took over" in e["data"].get("text", "")]
    assert len(took_over) == 1 and took_over[0]["gone"] == [victim], took_over
    fence = took_over[0]["fence"]
    exits = [e for e in events if e["kind"] == "member_exited" and e["data"]["member_id"] == victim]
    assert len(exits) == 1 and exits[0]["ts"] > t_kill, exits
    assert exits[0]["data"]["expected"] is False and exits[0]["data"]["fence"] == fence, exits
    started = [e["data"]["member_id"] for e in events if e["kind"] == "member_started"]
    # Its slot is replaced once: one decision to, and no second new incarnation. (The replacement
    # itself may never start: a job that finishes its steps on the other replica first starts no
    # member for a job that is stopping.)
    replace = [e["data"] for e in events if e["kind"] == "action" and e["data"]["action"] == "ReplaceReplica"
               and e["data"]["fault_id"] == f"exit-{victim}"]
    assert len(replace) == 1 and replace[0]["fence"] == fence, replace
    assert "rollout-1-i2" not in started, started
    audit_sampled(stack.settings, jid, sampler, AUDIT)
