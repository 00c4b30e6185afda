"""A trainer whose checkpoints stop becoming durable stops, named, within
``trainer.max_undurable_steps``; the gang restarts from the newest durable checkpoint.

Before, a failed upload was only logged: the gang trained on with nothing durable for good (an
object store refusing manifests: quota, credentials), the request manager kept every batch since
in Redis, and a later fault redid every step since (an outside review). The member failpoint
``manifest_refused`` makes the first gang's object store refuse every manifest after the first
two (steps 0 and 1 durable). Checked from outside: the event log (commits by epoch, exits), the
rank's own log, the object store's checkpoints and the auditor."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from jobs import kinds, small_job, wait_done
from support import audit_sampled, sample_batches, stack_with_failpoints

from robustrl.audit.model import AuditOptions
from robustrl.checkpoint import Checkpointer
from robustrl.client import ApiClient
from robustrl.errors import EXIT_CHECKPOINT_STALLED
from robustrl.stack import Stack
from robustrl.storage.objects import open_object_store

pytestmark = pytest.mark.timeout(240)

NAME, STEPS, LAG = "ckstall", 8, 2
LAST = "cklast"  # a job of 3 steps: the first gang's store refuses its last step's manifest


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with stack_with_failpoints(tmp_path_factory, "checkpoint-stall", f"manifest_refused@{NAME}/trainer-e1-r0,manifest_refused@{LAST}/trainer-e1-r0") as st:
        yield st


def test_a_trainer_whose_checkpoints_stop_becoming_durable_stops_within_the_bound(stack: Stack) -> None:
    api = ApiClient(stack.api_url, stack.settings.api_token)
    spec = small_job(NAME, steps=STEPS, rollout={"replicas": 1},
                     trainer={"workers": 1, "max_undurable_steps": LAG}, recovery={"borrow": "never"})
    jid = api.submit(spec)["job_id"]
    sampler = sample_batches(stack.settings.redis_url, jid)
    assert wait_done(api, jid, timeout=200)["status"] == "finished"
    events = api.events(jid)
    # The first gang stopped within the bound: step 1 was its last durable checkpoint, so no step
    # past 1 + LAG was committed by it (before: every step, with nothing durable after step 1).
    first = sorted(d["step"] for d in kinds(events, "step_committed") if d["epoch"] == 1)
    assert first and max(first) <= 1 + LAG, first
    [exit1] = [d for d in kinds(events, "member_exited") if d["member_id"] == "trainer-e1-r0"]
    assert exit1["returncode"] == EXIT_CHECKPOINT_STALLED, exit1
    [fault] = [d for d in kinds(events, "fault_detected") if d["member_id"] == "trainer-e1-r0"]
    assert "checkpoints stalled" in fault["evidence"] and "manifest_refused" in fault["evidence"], fault
    log = (stack.run_dir / "logs" / f"{jid}--trainer-e1-r0.log").read_text(errors="replace")
    assert "no checkpoint durable since step 1" in log and "manifest_refused" in log, log[-2000:]
    # The next gang resumed from step 1's checkpoint, redid what was not durable, and finished.
    second = sorted({d["step"] for d in kinds(events, "step_committed") if d["epoch"] == 2})
    assert second == list(range(2, STEPS)), second
    state = Checkpointer(open_object_store(stack.settings), f"jobs/{jid}/checkpoints").load_latest()
    assert state is not None and state.step == STEPS - 1
    api.close()
    audit_sampled(stack.settings, jid, sampler, AuditOptions(redis_bound=False))


def test_a_last_checkpoint_that_fails_to_upload_is_retried_then_redone_by_a_new_gang(stack: Stack) -> None:
    """The first gang's store refuses every manifest after steps 0 and 1: the job's last step
    (2) trains, commits, and its checkpoint fails to upload. Before, the rank only logged it and
    waited to be stopped; the controller waited 420 s for the step to become durable and then
    stopped the job as finished without its final checkpoint (an outside review). Now the rank
    uploads it again a few times, then stops, named (``CheckpointStalled``); the next gang
    resumes from step 1's checkpoint, redoes step 2, and the job finishes with step 2's
    checkpoint in the object store (read from the store, the event log and the rank's log)."""
    api = ApiClient(stack.api_url, stack.settings.api_token)
    spec = small_job(LAST, steps=3, rollout={"replicas": 1}, trainer={"workers": 1}, recovery={"borrow": "never"})
    jid = api.submit(spec)["job_id"]
    sampler = sample_batches(stack.settings.redis_url, jid)
    assert wait_done(api, jid, timeout=200)["status"] == "finished"
    events = api.events(jid)
    [exit1] = [d for d in kinds(events, "member_exited") if d["member_id"] == "trainer-e1-r0"]
    assert exit1["returncode"] == EXIT_CHECKPOINT_STALLED, exit1
    log = (stack.run_dir / "logs" / f"{jid}--trainer-e1-r0.log").read_text(errors="replace")
    assert "the last checkpoint's upload failed" in log and "manifest_refused" in log, log[-2000:]
    assert {d["step"] for d in kinds(events, "step_committed") if d["epoch"] == 2} == {2}
    state = Checkpointer(open_object_store(stack.settings), f"jobs/{jid}/checkpoints").load_latest()
    assert state is not None and state.step == 2
    audit_sampled(stack.settings, jid, sampler, AuditOptions(redis_bound=False))
    api.close()
