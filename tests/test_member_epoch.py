"""A trainer rank is of the gang its member id names, whatever the job's gang is when it asks for
its spec. The controller answers a spec request with the job's current epoch; a rank of a replaced
gang that asked late (its start overtaken by a recovery, or its kill not landed: a node behind a
partition reconnecting within the spec retries) took that epoch for its own, so its fenced writes
(batch claims, the trained log, checkpoint keys) passed as the new gang's: a step could be trained
twice (an outside review). Now it is refused and the process exits ``EXIT_STALE``. Real NATS; the
controller's answer is the real one's (``SpecReply`` with the job's epoch)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from jobs import small_job

from robustrl.bus import Bus
from robustrl.config import JobSpec, Settings
from robustrl.errors import StaleEpoch
from robustrl.member import Identity, Member
from robustrl.messages import SpecReply, SpecRequest
from robustrl.subjects import Verb, subject

pytestmark = pytest.mark.timeout(60)

JOB_EPOCH = 2  # the job's gang: trainer-e2-*; gang 1 was replaced


@pytest.fixture
async def job(infra: Settings) -> AsyncIterator[str]:
    """A job whose controller stand-in answers spec requests as the controller does: the job's
    current epoch, whoever asks."""
    job_id = f"epoch-{uuid.uuid4().hex[:8]}"
    spec = JobSpec.parse(small_job("epoch")).model_dump(mode="json")
    bus = await Bus.connect(infra.nats_url, "controller-stand-in")

    async def answer(msg: SpecRequest, _s: str, reply: str | None) -> None:
        await bus.respond(reply, SpecReply(job_id=job_id, spec=spec, epoch=JOB_EPOCH, resume_step=3))

    await bus.subscribe(subject(job_id, Verb.SPEC), SpecRequest, answer)
    await bus.client.flush()
    try:
        yield job_id
    finally:
        await bus.close()


async def _started(infra: Settings, job_id: str, member_id: str, role: str) -> Member:
    member = Member(Identity(job_id, member_id, role), infra)
    try:
        await member.start()
    finally:
        await member.close(drain_s=0.5)
    return member


async def test_a_rank_of_a_replaced_gang_asking_for_its_spec_late_is_refused(infra: Settings, job: str) -> None:
    with pytest.raises(StaleEpoch, match="gang 1, replaced"):
        await _started(infra, job, "trainer-e1-r0", "trainer")


async def test_ranks_of_the_current_gang_and_other_members_take_the_jobs_epoch(infra: Settings, job: str) -> None:
    assert (await _started(infra, job, "trainer-e2-r1", "trainer")).epoch == JOB_EPOCH
    assert (await _started(infra, job, "rollout-0-i0", "rollout")).epoch == JOB_EPOCH
