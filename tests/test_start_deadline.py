"""A member whose start never finishes is a fault (``detector.start_deadline_s``), not a job stuck
before its first step.

Before this rule, a member that hung while starting -- its model or checkpoint load blocked in a
thread, its event loop, metrics and probe answers alive -- was judged by no one: the detector's
rules leave phase ``starting`` alone (a start may be slow), the request manager's step deadline
starts with the first step, and a recovery's deadline covers only restarts. A job whose first
trainer hung so sat at step 0 for good with every member "healthy".

The hang is real and outside the controller: a member failpoint (``ROBUSTRL_MEMBER_FAILPOINTS``,
read by the member process) holds the named members' hellos while the rest of them runs. The
verdict comes from the raw event log, the process table and the auditor.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import psutil
import pytest
from jobs import TERMINAL, kinds, small_job, wait_done, wait_step
from support import audit_sampled, eventually, sample_batches, stack_with_failpoints

from robustrl.audit.model import AuditOptions
from robustrl.client import ApiClient
from robustrl.stack import Stack

pytestmark = pytest.mark.timeout(240)
# Over a healthy start here: a fresh stack's first members took up to 17 s to say hello on 2
# busy cores (imports in a zygote still warming up).
START_DEADLINE_S = 30.0
# Job "sd": the first trainer and replica slot 1 hang while starting; their replacements start.
HUNG = ("trainer-e1-r0", "rollout-1-i0")
# Job "lost": the same members start, but their hellos are lost on the way.
LOST = ("trainer-e1-r0", "rollout-1-i0")
LOST_DEADLINE_S = 15.0  # twice a healthy start here; the job outlasts it
# Job "relost": the trainer that a recovery starts loses its first hello (its resends get through).
RELOST = "trainer-e2-r0"
RELOST_RECOVERY_DEADLINE_S = 90.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    armed = ",".join([*(f"start_hang@sd/{m}" for m in HUNG), *(f"hello_lost@lost/{m}" for m in LOST),
                      f"hello_lost_first@relost/{RELOST}"])
    with stack_with_failpoints(tmp_path_factory, "start-deadline", armed) as st:
        yield st


def test_members_hung_while_starting_no_longer_stall_the_job(stack: Stack) -> None:
    """Before: the job sat at step 0 for good (seen: 180 s, then the test gave up), every member
    "healthy": the trainer never published a version, so nothing else had anything to do; and a
    replica hung so, had the trainer started, would have left the job one replica short for good
    (the request manager uses only replicas that said hello).

    Now the first hung member past the deadline is a fault; at step 0 the decision restarts the
    whole job, which replaces the other hung member too (no second fault: it is no longer current)."""
    api = ApiClient(stack.api_url, stack.settings.api_token)
    # One rank (a peer rank would notice its gang never forming: the trainer-idle rule).
    spec = small_job("sd", steps=3, rollout={"replicas": 2}, trainer={"workers": 1},
                     detector={"start_deadline_s": START_DEADLINE_S})
    jid = api.submit(spec)["job_id"]
    sampler = sample_batches(stack.settings.redis_url, jid)

    def started() -> dict[str, int] | None:
        pids = {m["member_id"]: m.get("pid") for m in api.job(jid)["members"] if m["member_id"] in HUNG}
        return pids if len(pids) == len(HUNG) and all(pids.values()) else None
    pids = eventually(started, timeout=60, what="the hung members started")
    status = wait_done(api, jid, timeout=180)
    assert status["committed_step"] == 2
    events = api.events(jid)
    # One start fault, of a hung member; none of a healthy one (no false positive).
    found = [d for d in kinds(events, "fault_detected") if "start_deadline_s" in d["evidence"]]
    assert len(found) == 1 and found[0]["member_id"] in HUNG, (found, kinds(events, "decision"))
    [fault] = found
    assert fault["kind"] == "hang" and fault["source"] == "controller", fault
    # Not before the deadline after the member was started (the launcher's event), nor long after.
    [started] = [e["ts"] for e in events if e["kind"] == "member_started" and e["data"]["member_id"] == fault["member_id"]]
    assert START_DEADLINE_S - 1 <= fault["detected_at"] - started < START_DEADLINE_S + 10, (fault, started)
    assert any(d["fault_id"] == fault["fault_id"] for d in kinds(events, "decision"))
    # Both slots started anew and served: the new trainer said it was ready, replica slot 1's new
    # incarnation loaded weights.
    assert "trainer-e2-r0" in {d["member_id"] for d in kinds(events, "member_ready")}
    assert any(m["member_id"].startswith("rollout-1-i") and m["member_id"] != "rollout-1-i0"
               and m["weights_version"] >= 0 for m in api.job(jid)["members"]), api.job(jid)["members"]
    # The hung processes were killed, not left holding their slots' resources.
    for member, pid in pids.items():
        eventually(lambda pid=pid: not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie",
                   timeout=30, what=f"{member} (pid {pid}) gone")
    audit_sampled(stack.settings, jid, sampler, AuditOptions(redis_bound=False))


def test_a_member_whose_hello_was_lost_is_not_killed_as_stuck(stack: Stack) -> None:
    """A hello is one publish: lost (a bus reconnect while the member starts), the member still
    runs, trains and reports its phases. Its start must not be judged stuck (an outside review
    found that it was: the trainer would have been killed, healthy, and the whole job restarted)."""
    api = ApiClient(stack.api_url, stack.settings.api_token)
    spec = small_job("lost", steps=60, rollout={"replicas": 2}, trainer={"workers": 1},
                     detector={"start_deadline_s": LOST_DEADLINE_S})
    jid = api.submit(spec)["job_id"]

    def lost_started_at() -> float:
        started = {e["data"]["member_id"]: e["ts"] for e in api.events(jid) if e["kind"] == "member_started"}
        assert set(LOST) <= set(started), sorted(started)
        return max(started[m] for m in LOST)

    since = eventually(lost_started_at, timeout=120, interval=0.2, what="both members started")
    # The deadline passes (5 s of margin for the supervision round that would judge it) while
    # the job trains on; then it is stopped (its 60 steps are only the runway).
    at = api.job(jid)["committed_step"]
    eventually(lambda: time.time() - since > LOST_DEADLINE_S + 5 and api.job(jid)["committed_step"] > at,
               timeout=120, interval=0.2, what="the start deadline passed while the job trained")
    assert api.job(jid)["status"] == "running"
    api.stop(jid)
    status = eventually(lambda: (s := api.job(jid))["status"] in TERMINAL and s, timeout=120, interval=0.2,
                        what="the job stopped")
    assert status["status"] == "stopped", status
    events = api.events(jid)
    started = {e["data"]["member_id"]: e["ts"] for e in events if e["kind"] == "member_started"}
    # The deadline passed while the job ran, with both hellos lost ...
    assert max(e["ts"] for e in events) - max(started[m] for m in LOST) > LOST_DEADLINE_S + 2
    # ... and nothing was faulted, and nobody restarted: the first trainer trained every step.
    assert kinds(events, "fault_detected") == [], kinds(events, "fault_detected")
    assert set(started) == {"trainer-e1-r0", "rollout-0-i0", "rollout-1-i0"}, sorted(started)


def test_a_recovery_whose_new_trainer_lost_its_first_hello_ends_when_the_hello_is_sent_again(stack: Stack) -> None:
    """A recovery waits for its new gang's hello. A hello is one core-NATS publish, and one sent
    while the controller's subscription is not back on a restarted server reaches no one (CI stop
    28: a campaign job stalled 420 s right after a NATS restart). Before, the recovery then waited
    out its whole deadline and escalated to a whole-job restart; now the member sends its hello
    again until the controller acknowledges it.

    The fault: the real trainer of the first gang is killed after step 2; the trainer the recovery
    starts drops its first hello (a member failpoint; its log says so)."""
    import os
    import signal

    api = ApiClient(stack.api_url, stack.settings.api_token)
    spec = small_job("relost", steps=6, rollout={"replicas": 2}, trainer={"workers": 1},
                     recovery={"deadline_s": RELOST_RECOVERY_DEADLINE_S})
    jid = api.submit(spec)["job_id"]
    wait_step(api, jid, 2, timeout=120)
    [pid] = [m["pid"] for m in api.job(jid)["members"] if m["member_id"] == "trainer-e1-r0"]
    os.kill(pid, signal.SIGKILL)
    status = wait_done(api, jid, timeout=180)
    assert status["committed_step"] == 5
    events = api.events(jid)
    log = (stack.run_dir / "logs" / f"{jid}--{RELOST}.log").read_text(errors="replace")
    assert "does not publish its first hello" in log, log[-2000:]  # the fault really happened
    faults = kinds(events, "fault_detected")
    assert [f["member_id"] for f in faults] == ["trainer-e1-r0"], faults
    ended = [d for d in kinds(events, "recovered") if d["fault_id"] == faults[0]["fault_id"]]
    # (Seen on the previous code: the job finished on the new trainer, its recovery never ended.)
    assert len(ended) == 1, ("the recovery never ended", kinds(events, "recovered"))
    [recovered] = ended
    # Role-local and prompt: one resend is half a second after the lost one.
    assert recovered["took_s"] < RELOST_RECOVERY_DEADLINE_S / 3, recovered
    # One decision: the recovery was not escalated (its deadline passed) to a whole-job restart.
    assert len(kinds(events, "decision")) == 1, kinds(events, "decision")
    assert RELOST in {d["member_id"] for d in kinds(events, "member_ready")}, kinds(events, "member_ready")
