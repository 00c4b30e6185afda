"""The request manager's wait for a commit is bounded (``detector.commit_deadline_s``).

A trainer gang waiting for a batch is the trainer's normal idleness: the detector does not judge
it. A gang that never takes a batch already handed over (its broadcast and its requests lost, a
bug in its wait) therefore stalled the job for good while every member looked healthy: the
request manager waited for the step's commit, the trainer for the batch. Now the request manager
reports the gang once no step was committed for ``commit_deadline_s`` with a batch waiting, naming
the trainer member it last heard; the controller restarts the gang, which takes the batch again.

The member failpoint ``batch_deaf`` (``robustrl.member.FAILPOINTS_ENV``) makes the first gang's
rank 0 never take step 1's batch. Checked from outside: the job's event log (through the API) and
the independent auditor over the raw stores.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from jobs import kinds, small_job, wait_done
from rm_harness import METRICS_S, Harness, rm_spec
from support import audit_sampled, eventually_async, sample_batches, stack_with_failpoints

from robustrl.audit.model import AuditOptions
from robustrl.client import ApiClient
from robustrl.messages import MemberHello, MetricsSample
from robustrl.stack import Stack
from robustrl.subjects import Verb, subject

pytestmark = pytest.mark.timeout(240)

DEAF = "trainer-e1-r0"  # the first gang's rank 0: never takes step 1's batch
DEADLINE_S = 8.0
STEPS = {"cm": 4, "cl": 2}  # job name -> steps: step 1 mid-job, and step 1 the job's last


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    armed = ",".join([*(f"batch_deaf@{name}/{DEAF}" for name in STEPS), f"publish_wedged@cw/{DEAF}"])
    with stack_with_failpoints(tmp_path_factory, "commit-deadline", armed) as st:
        yield st


@pytest.mark.parametrize("name", list(STEPS))
def test_a_gang_that_never_takes_a_handed_over_batch_is_reported_and_replaced(stack: Stack, name: str) -> None:
    """Before (run on the code without the deadline): job ``cm`` sat at step 1 for good, every
    member healthy (the test gave up after 180 s); job ``cl`` the same at its last step, where the
    request manager's loop had already ended. Now one ``commit_deadline`` fault names the deaf
    rank, the gang is restarted role-locally (no whole-job restart), and the job finishes with
    every step committed once and the auditor's checks passing."""
    api = ApiClient(stack.api_url, stack.settings.api_token)
    steps = STEPS[name]
    spec = small_job(name, steps=steps, rollout={"replicas": 1}, trainer={"workers": 1},
                     detector={"commit_deadline_s": DEADLINE_S})
    jid = api.submit(spec)["job_id"]
    sampler = sample_batches(stack.settings.redis_url, jid)
    status = wait_done(api, jid, timeout=180)
    assert status["committed_step"] == steps - 1
    events = api.events(jid)
    found = [d for d in kinds(events, "fault_detected") if d.get("cause") == "commit_deadline"]
    acted = [d for d in kinds(events, "decision") if d["fault_id"] in {f["fault_id"] for f in found}
             and d["actions"] != ["Ignore"]]
    # One acted on, naming the deaf rank at the step it never took; a later one (if the new gang's
    # cold start outlasted a further period) named the gang being replaced and was ignored.
    assert len(acted) == 1, (found, kinds(events, "decision"))
    [fault] = [f for f in found if f["fault_id"] == acted[0]["fault_id"]]
    assert (fault["member_id"], fault["role"], fault["kind"], fault["step"]) == (DEAF, "trainer", "hang", 1), fault
    assert "waiting_batch" in fault["evidence"] and "step 1 handed over" in fault["evidence"], fault
    assert acted[0]["actions"] == ["RestartTrainerGang"], acted
    # Not before the deadline: counted from step 0's commit (the gang's last progress).
    [c0] = [e["ts"] for e in events if e["kind"] == "step_committed" and e["data"]["step"] == 0]
    assert fault["detected_at"] - c0 >= DEADLINE_S - 0.5, (fault, c0)
    # Every step committed, by a gang after the deaf one for step 1.
    commits = kinds(events, "step_committed")
    assert sorted({c["step"] for c in commits}) == list(range(steps)), commits
    assert {c["epoch"] for c in commits if c["step"] == 1} == {2}, commits
    audit_sampled(stack.settings, jid, sampler, AuditOptions(redis_bound=False))


async def test_the_deadline_counts_only_a_gang_that_could_take_its_batch(servers) -> None:  # type: ignore[no-untyped-def]
    """The request manager alone (real NATS + Redis, a scripted trainer's metrics). The clock runs
    only while the gang says it waits for a batch already handed over: not while a member is
    ``starting`` (the controller's to bound), nor ``training`` (the detector's: an outside review
    found a busy gang reported, and with a slow step after a recovery a whole-job restart chosen),
    nor while the gang is silent (the detector's), nor across commits of steps already committed
    (a recovered gang redoing them). Waiting, it is reported once the deadline passed, naming
    the member, and again each further period; a commit starts the next wait's clock afresh."""
    bound = 1.5
    async with Harness(servers, rm_spec("cdl", steps=3, commit_deadline_s=bound)) as h:
        said = {"phase": "starting", "step": 0, "silent": False}

        async def trainer_metrics() -> None:
            seq = 0
            while True:
                seq += 1
                if not said["silent"]:
                    await h.bus.publish(subject(h.job_id, Verb.METRICS, "trainer-e2-r0"), MetricsSample(
                        job_id=h.job_id, member_id="trainer-e2-r0", role="trainer", seq=seq, ts=time.time(),
                        phase=str(said["phase"]), step=int(said["step"])))  # type: ignore[call-overload]
                await asyncio.sleep(METRICS_S)  # a member's own sampling period

        def overdue() -> list:  # type: ignore[type-arg]
            return [f for f in h.faults if f.cause == "commit_deadline"]

        async def nothing_for(seconds: float, why: str) -> None:
            await asyncio.sleep(seconds)  # (an absence: only a wait shows it)
            assert overdue() == [], (why, overdue())

        metrics = asyncio.create_task(trainer_metrics())
        try:
            rep = await h.replica("r0", version=0)
            await h.start_rm()
            await eventually_async(lambda: 0 in h.batches, timeout=30, what="step 0 handed over")
            await nothing_for(3 * bound, "a gang starting")
            said["phase"] = "training"
            await nothing_for(3 * bound, "a gang training its batch")
            said["silent"] = True
            await nothing_for(3 * bound, "a silent gang")
            said.update(phase="waiting_batch", silent=False)
            idle_from = time.monotonic()
            [first] = await eventually_async(overdue, timeout=10, what="the commit deadline reported")
            assert time.monotonic() - idle_from >= bound - 0.3
            assert (first.role, first.member_id, first.kind, first.step) == ("trainer", "trainer-e2-r0", "hang", 0)
            assert "waiting_batch" in first.evidence and "commit_deadline_s=1.5" in first.evidence, first.evidence
            # Reported again a further period on, not bunched.
            await eventually_async(lambda: len(overdue()) >= 2, timeout=10, what="reported again")
            assert overdue()[1].detected_at - first.detected_at >= bound - 0.3, overdue()
            # A commit: step 1 is generated and handed over, and the gang waits for it.
            await h.commit(0)
            await rep.set_version(1)  # (sync: step 1 is generated with the weights step 0 made)
            await eventually_async(lambda: 1 in h.batches, timeout=30, what="step 1 handed over")
            h.faults.clear()
            said["step"] = 1
            # A recovered gang redoing step 0 (a commit at or below the newest heard) is progress.
            for _ in range(int(3 * bound / 0.5)):
                redone = time.monotonic()  # (the last one's clock starts once the RM has it: not before)
                await h.commit(0)
                await asyncio.sleep(0.5)  # a redone step every half second
            assert overdue() == [], overdue()
            later = await eventually_async(overdue, timeout=10, what="step 1's commit reported overdue")
            # (measured from the last redo's send: from after the pause that followed it, as
            # before, a pause overrun under load ate into the bound, seen in suite44)
            assert time.monotonic() - redone >= bound - 0.3 and later[0].step == 1, later
        finally:
            metrics.cancel()


async def test_an_older_gangs_member_neither_holds_nor_is_named_by_the_deadline(servers) -> None:  # type: ignore[no-untyped-def]
    """Two trainer gangs heard at once: the new one (epoch 2: its hello came) waits for a batch
    handed over and never takes it; a member of the old one (epoch 1, its kill failed or under
    way) still says ``training``. That member held the clock (no report ever: the job stalled),
    and a report could name it. Now older gangs' members are left out: the deadline is reported
    naming the new gang's member."""
    bound = 1.5
    async with Harness(servers, rm_spec("cdlold", steps=3, commit_deadline_s=bound)) as h:
        async def metrics(member: str, phase: str) -> None:
            seq = 0
            while True:
                seq += 1
                await h.bus.publish(subject(h.job_id, Verb.METRICS, member), MetricsSample(
                    job_id=h.job_id, member_id=member, role="trainer", seq=seq, ts=time.time(),
                    phase=phase, step=0))  # type: ignore[arg-type]
                await asyncio.sleep(METRICS_S)

        tasks = [asyncio.create_task(metrics("trainer-e1-r0", "training")),
                 asyncio.create_task(metrics("trainer-e2-r0", "waiting_batch"))]
        try:
            await h.replica("r0", version=0)
            await h.start_rm()
            await h.bus.publish(subject(h.job_id, Verb.HELLO, "trainer-e2-r0"), MemberHello(
                job_id=h.job_id, member_id="trainer-e2-r0", role="trainer", pid=1, epoch=2))
            await eventually_async(lambda: 0 in h.batches, timeout=30, what="step 0 handed over")
            overdue = await eventually_async(lambda: [f for f in h.faults if f.cause == "commit_deadline"],
                                             timeout=bound + 10, what="the commit deadline reported")
            assert {f.member_id for f in overdue} == {"trainer-e2-r0"}, overdue
        finally:
            for t in tasks:
                t.cancel()


IO_STUCK_S = 6.0


def test_a_gang_wedged_publishing_is_reported_and_replaced(stack: Stack) -> None:
    """A trainer rank that trains step 1 and never returns from publishing it, its metrics still
    flowing (member failpoint ``publish_wedged``): no rule judged the phase, the request manager's
    commit deadline counts only a gang waiting for a batch, and the job sat at step 1 for good.
    Now the detector's trainer I/O rule reports it after ``trainer_io_s``; the gang is restarted
    role-locally, and the job finishes with the auditor's checks passing."""
    api = ApiClient(stack.api_url, stack.settings.api_token)
    spec = small_job("cw", steps=3, rollout={"replicas": 1}, trainer={"workers": 1},
                     detector={"trainer_io_s": IO_STUCK_S})
    jid = api.submit(spec)["job_id"]
    sampler = sample_batches(stack.settings.redis_url, jid)
    status = wait_done(api, jid, timeout=180)
    assert status["committed_step"] == 2
    events = api.events(jid)
    found = [d for d in kinds(events, "fault_detected") if d.get("cause") == "trainer_io_stalled"]
    assert [(f["member_id"], f["role"], f["kind"], f["step"]) for f in found] == [(DEAF, "trainer", "hang", 1)], found
    assert "publishing" in found[0]["evidence"], found
    [decision] = [d for d in kinds(events, "decision") if d["fault_id"] == found[0]["fault_id"]]
    assert decision["actions"] == ["RestartTrainerGang"], decision
    commits = kinds(events, "step_committed")
    assert sorted(c["step"] for c in commits) == [0, 1, 2], commits
    assert {c["epoch"] for c in commits if c["step"] == 1} == {2}, commits
    audit_sampled(stack.settings, jid, sampler, AuditOptions(redis_bound=False))
