"""A step's commit event is not lost with the trainer that committed it.

Rank 0 records a trained step in Redis (the fenced trained log), then sends its ``step_committed``.
Killed between the two, with the step's checkpoint already durable, the next gang resumes past the
step and never trains it again: the step had no ``step_committed`` in the job's log at all, and
with it went the trainer's record of which episodes it trained (``trained``). The same held for a
commit JetStream did not store within its budget (kept in memory only) and a trainer killed after.

A checkpoint made durable before its step was recorded trained (its upload runs while the version
is published) left the same hole; now a step's manifest waits for the record.

Now the event is saved in the job's trainer outbox (``Keys.trainer_outbox``) in the same fenced
script that records the training, removed once JetStream stored it, and appended by the next
gang's rank 0 when it enters the fence, under the same message id. Checked from outside: the raw
event log (through the auditor, which now fails an ended job whose log lacks a step's commit) and
the raw Redis keys.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
from jobs import kinds, small_job, wait_done
from support import audit_sampled, sample_batches, stack_with_failpoints

from robustrl.services.trainer.lineage import RecordGate

from robustrl.audit.model import AuditOptions
from robustrl.client import ApiClient
from robustrl.errors import StaleEpoch
from robustrl.messages import Event
from robustrl.stack import Stack
from robustrl.storage.control_stores import OutboxEntry
from robustrl.storage.fencing import GangFence
from robustrl.storage.redis_stores import Keys

pytestmark = pytest.mark.timeout(240)

KILLED = "trainer-e1-r0"  # the first gang's rank 0, killed at step 1 (``worker.FAILPOINT_STEP``)
# job name -> the failpoint its first rank 0 dies at
POINTS = {"cu": "commit_unsent", "pu": "published_unrecorded", "cl": "claimed", "cf": "commit_unsent", "c2": "commit_unsent"}
STEPS = {"cf": 2}  # job "cf": step 1 is its last
WORKERS = {"c2": 2}  # job "c2": a gang of two (rank 1 survives the kill; kept by the recovery)
READY = "mr"  # this job's first rank 0 dies as its gang is ready (``ready_unsent``)


def _entry(job: str, step: int, epoch: int) -> str:
    return OutboxEntry(msg_id=f"{job}-step_committed-{step}-{epoch}", event=Event(
        job_id=job, kind="step_committed", data={"step": step, "epoch": epoch, "weights_version": step + 1})).model_dump_json()


async def test_the_commit_event_is_saved_with_the_training_record_and_fenced(redis) -> None:  # type: ignore[no-untyped-def]
    """One script writes both: a retried record (the client's retry after a dropped reply) saves
    the event once, and a gang that a newer one fenced out saves nothing."""
    job = f"tob-{uuid.uuid4().hex[:8]}"
    g1, g2 = GangFence(redis, job, 1), GangFence(redis, job, 2)
    await g1.enter()
    await g1.record_trained(0, "c0", _entry(job, 0, 1))
    await g1.record_trained(0, "c0", _entry(job, 0, 1))  # the same script, the same arguments
    await g2.enter()
    with pytest.raises(StaleEpoch):
        await g1.record_trained(1, "c1", _entry(job, 1, 1))
    raw = [json.loads(x) for x in await redis.lrange(Keys.trainer_outbox(job), 0, -1)]
    assert [(e["event"]["data"]["step"], e["event"]["data"]["epoch"]) for e in raw] == [(0, 1)], raw
    trained = [json.loads(x) for x in await redis.lrange(Keys.trained_log(job), 0, -1)]
    assert [(e["step"], e["epoch"]) for e in trained] == [(0, 1)], trained
    await redis.delete(Keys.trainer_outbox(job), Keys.trained_log(job), Keys.gang(job))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    armed = ",".join([*(f"{point}@{name}/{KILLED}" for name, point in POINTS.items()),
                      f"ready_unsent@{READY}/{KILLED}"])
    with stack_with_failpoints(tmp_path_factory, "trainer-outbox", armed) as st:
        yield st


@pytest.mark.parametrize("name", list(POINTS))
def test_a_rank_killed_at_each_moment_of_a_commit_loses_no_step_and_no_commit(stack: Stack, name: str) -> None:
    """``commit_unsent``, before: the job stalled for good (the request manager waited for step 1's
    commit message, the new gang resumed at step 2 and waited for a batch never generated); with
    that fixed, step 1 had no ``step_committed`` in the log (the auditor's new check and the
    assertion below failed). ``published_unrecorded`` (killed once the step's checkpoint upload
    ended, or after 5 s of it held), before: the checkpoint was durable before the step was
    recorded trained; the next gang resumed past step 1, which had neither a training record nor a
    ``step_committed`` (the same assertion failed: steps [0, 2, 3]). Now a manifest waits for its
    step's record (``RecordGate``), so the next gang trains step 1 again. ``claimed``: the same
    checks, nothing trained twice in the durable lineage (the auditor). Job ``cf`` dies at
    ``commit_unsent`` of its last step: before, it never finished (the controller finishes a job on
    its last commit message; the next gang had nothing left to train and sent none), checked by
    running it (180 s, then the test gave up); now the new gang's resume step says the step was
    committed."""
    api = ApiClient(stack.api_url, stack.settings.api_token)
    steps = STEPS.get(name, 4)
    spec = small_job(name, steps=steps, rollout={"replicas": 1}, trainer={"workers": WORKERS.get(name, 1)})
    jid = api.submit(spec)["job_id"]
    sampler = sample_batches(stack.settings.redis_url, jid)
    status = wait_done(api, jid, timeout=180)
    assert status["committed_step"] == steps - 1
    events = api.events(jid)
    faults = [d for d in kinds(events, "fault_detected") if d.get("member_id") == KILLED]
    assert faults, f"{KILLED} was not killed at {POINTS[name]}: {kinds(events, 'fault_detected')}"
    ready = [d for d in kinds(events, "member_ready") if d.get("role") == "trainer" and d["epoch"] > 1]
    commits = kinds(events, "step_committed")
    assert sorted({c["step"] for c in commits}) == list(range(steps)), commits
    if POINTS[name] == "commit_unsent":
        # The next gang resumed past step 1 (its checkpoint was durable): only the first gang's
        # commit can name step 1, appended by the next gang from the outbox.
        assert ready and ready[0]["resume_step"] == 2, ready
        [first] = [c for c in commits if c["step"] == 1]
        assert first["epoch"] == 1 and len(first["trained"]["episodes"]) == 16, first
    else:
        # Step 1 was never recorded trained by the first gang: the next one trains it.
        assert ready and ready[0]["resume_step"] == 1, ready
        assert {c["epoch"] for c in commits if c["step"] == 1} == {ready[0]["epoch"]}, commits
    report = audit_sampled(stack.settings, jid, sampler, AuditOptions(redis_bound=False))
    assert report.facts["trainer_outbox_unappended"] == 0, report.facts


def test_a_manifest_held_for_its_record_fails_at_once_when_the_worker_stops() -> None:
    """A stop (or a hand-off) waits for the running upload; one held for a record that will never
    come must fail then, not after ``RECORD_WAIT_S``: the step is not made durable."""
    gate = RecordGate(timeout_s=60.0)
    gate.recorded(0)
    gate.wait(0)  # recorded: passes
    failed: list[BaseException] = []

    def upload() -> None:
        try:
            gate.wait(1)
        except TimeoutError as exc:
            failed.append(exc)

    thread = threading.Thread(target=upload)
    began = time.monotonic()
    thread.start()
    gate.close()
    thread.join(10.0)
    assert not thread.is_alive() and failed and "stopped first" in str(failed[0]), failed
    assert time.monotonic() - began < 10.0


def test_a_gangs_ready_event_is_not_lost_with_its_rank(stack: Stack) -> None:
    """The first gang's rank 0 is killed as the gang is ready, its ``member_ready`` saved and not
    yet sent (the worst moment: sent with the bus alone, an event JetStream did not take at once
    waited in the rank's memory only). The auditor reads each gang's resume step from these
    events. Now the event is kept in the trainer outbox and the next gang's rank 0 appends it:
    the log holds the first gang's ``member_ready`` (resume step 0) and the next gang's; the
    auditor passes with nothing left unappended. With the save left out, the first gang's event
    was missing."""
    api = ApiClient(stack.api_url, stack.settings.api_token)
    spec = small_job(READY, steps=3, rollout={"replicas": 1}, trainer={"workers": 1})
    jid = api.submit(spec)["job_id"]
    sampler = sample_batches(stack.settings.redis_url, jid)
    status = wait_done(api, jid, timeout=180)
    assert status["committed_step"] == 2
    events = api.events(jid)
    faults = [d for d in kinds(events, "fault_detected") if d.get("member_id") == KILLED]
    assert faults, f"{KILLED} was not killed as its gang was ready: {kinds(events, 'fault_detected')}"
    ready = {d["epoch"]: d for d in kinds(events, "member_ready") if d.get("role") == "trainer"}
    assert 1 in ready, f"the killed gang's member_ready is not in the log: {sorted(ready)}"
    assert (ready[1]["member_id"], ready[1]["resume_step"]) == (KILLED, 0), ready[1]
    assert max(ready) > 1, ready  # the next gang's own
    report = audit_sampled(stack.settings, jid, sampler, AuditOptions(redis_bound=False))
    assert report.facts["trainer_outbox_unappended"] == 0, report.facts
