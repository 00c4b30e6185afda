"""A step's commit event is not lost with the trainer that committed it.

Rank 0 records a trained step in Redis (the fenced trained log), then sends its ``step_committed``.
Killed between the two, with the step's checkpoint already durable, the next gang resumes past the
step and never trains it again: the step had no ``step_committed`` in the job's log at all, and
with it went the trainer's record of which episodes it trained (``trained``). The same held for a
commit JetStream did not store within its budget (kept in memory only) and a trainer killed after.

Now the event is saved in the job's trainer outbox (``Keys.trainer_outbox``) in the same fenced
script that records the training, removed once JetStream stored it, and appended by the next
gang's rank 0 when it enters the fence, under the same message id. Checked from outside: the raw
event log (through the auditor, which now fails an ended job whose log lacks a step's commit) and
the raw Redis keys.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
from jobs import kinds, small_job, wait_done
from support import audit_sampled, sample_batches

from robustrl.audit.model import AuditOptions
from robustrl.client import ApiClient
from robustrl.config import Settings
from robustrl.errors import StaleEpoch
from robustrl.member import FAILPOINTS_ENV
from robustrl.messages import Event
from robustrl.stack import Stack
from robustrl.storage.control_stores import OutboxEntry
from robustrl.storage.fencing import GangFence
from robustrl.storage.redis_stores import Keys, connect

pytestmark = pytest.mark.timeout(240)

KILLED = "trainer-e1-r0"  # the first gang's rank 0, killed after its first step at the failpoint


@pytest.fixture
async def redis(infra: Settings) -> AsyncIterator[object]:
    client = connect(infra.redis_url)
    try:
        yield client
    finally:
        await client.aclose()


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
    st = Stack(tmp_path_factory.mktemp("trainer-outbox"),
               service_extra_env={"controller": {FAILPOINTS_ENV: f"commit_unsent@cu/{KILLED}"}})
    st.start()
    try:
        yield st
    finally:
        st.stop()


def test_a_rank_killed_between_its_record_and_its_commit_event_loses_no_commit(stack: Stack) -> None:
    """Before: step 0 trained, recorded and durable, its ``step_committed`` never in the log (the
    next gang resumed at step 1); the auditor's new check and the assertion below both failed."""
    api = ApiClient(stack.api_url, stack.settings.api_token)
    spec = small_job("cu", steps=4, rollout={"replicas": 1}, trainer={"workers": 1})
    jid = api.submit(spec)["job_id"]
    sampler = sample_batches(stack.settings.redis_url, jid)
    status = wait_done(api, jid, timeout=180)
    assert status["committed_step"] == 3
    events = api.events(jid)
    faults = [d for d in kinds(events, "fault_detected") if d.get("member_id") == KILLED]
    assert faults, f"{KILLED} was not killed at the failpoint: {kinds(events, 'fault_detected')}"
    # The second gang resumed past step 0 (its checkpoint was durable): only the first gang's
    # commit can name step 0, appended by the second gang from the outbox.
    ready = [d for d in kinds(events, "member_ready") if d.get("role") == "trainer" and d["epoch"] > 1]
    assert ready and ready[0]["resume_step"] == 1, ready
    commits = kinds(events, "step_committed")
    assert sorted({c["step"] for c in commits}) == [0, 1, 2, 3], commits
    [first] = [c for c in commits if c["step"] == 0]
    assert first["epoch"] == 1 and len(first["trained"]["episodes"]) == 16, first
    report = audit_sampled(stack.settings, jid, sampler, AuditOptions(redis_bound=False))
    assert report.facts["trainer_outbox_unappended"] == 0, report.facts
