"""A trainer whose step diverges (loss or gradient norm not finite) keeps nothing of the step; the
gang is restarted from the newest checkpoint once, and the job fails if it diverges again with no
step committed in between, with a reason that says so.

Before, a divergence was a plain crash: every restart trained the same step from the same
checkpoint and diverged again, until ``max_restarts`` was used up, and the job's error said
"giving up after N restarts" (an outside review). The member failpoint ``diverge``
(``robustrl.member.FAILPOINTS_ENV``) takes step 1's loss for NaN in the members it is armed for:
the first gang's rank alone (a transient fault, as silent data corruption on one machine), or
the first two gangs' (a divergence every restart repeats). Checked from outside: the job's record
in Redis, its event log, and the object store's checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from jobs import TERMINAL, kinds, small_job, wait_done
from support import eventually, raw_job_record, stack_with_failpoints

from robustrl.checkpoint import Checkpointer
from robustrl.client import ApiClient
from robustrl.errors import EXIT_DIVERGED
from robustrl.model.policy import weights_checksum
from robustrl.stack import Stack
from robustrl.storage.objects import open_object_store

pytestmark = pytest.mark.timeout(240)

ONCE, ALWAYS, STEPS = "divonce", "divalways", 3


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    armed = ",".join([f"diverge@{ONCE}/trainer-e1-r0",
                      f"diverge@{ALWAYS}/trainer-e1-r0", f"diverge@{ALWAYS}/trainer-e2-r0"])
    with stack_with_failpoints(tmp_path_factory, "divergence", armed) as st:
        yield st


def _spec(name: str) -> dict:
    # (borrowing off: the new gang is a cold rank named trainer-e2-r0, which the failpoint names)
    return small_job(name, steps=STEPS, rollout={"replicas": 1}, trainer={"workers": 1},
                     recovery={"borrow": "never", "max_restarts": 5})


def _diverged_faults(events: list[dict]) -> list[dict]:
    return [f for f in kinds(events, "fault_detected")
            if f["role"] == "trainer" and f"exit code {EXIT_DIVERGED}" in f["evidence"]]


def test_a_divergence_that_does_not_come_again_is_recovered_from_the_checkpoint(stack: Stack) -> None:
    api = ApiClient(stack.api_url, stack.settings.api_token)
    jid = api.submit(_spec(ONCE))["job_id"]
    assert wait_done(api, jid, timeout=200)["status"] == "finished"
    events = api.events(jid)
    [fault] = _diverged_faults(events)
    assert fault["member_id"] == "trainer-e1-r0", fault
    # Nothing of the diverged step was kept: its only commit is the second gang's.
    step1 = [d for d in kinds(events, "step_committed") if d["step"] == 1]
    assert step1 and all(d["epoch"] >= 2 for d in step1), step1
    state = Checkpointer(open_object_store(stack.settings), f"jobs/{jid}/checkpoints").load_latest()
    assert state is not None and state.step == STEPS - 1, None if state is None else state.step
    last = [d for d in kinds(events, "step_committed") if d["step"] == STEPS - 1]
    assert weights_checksum(state.model_state) == last[-1]["checksum"]
    assert raw_job_record(stack.settings.redis_url, jid)["restarts_total"] == 1


def test_a_divergence_every_restart_repeats_fails_the_job_naming_it(stack: Stack) -> None:
    api = ApiClient(stack.api_url, stack.settings.api_token)
    jid = api.submit(_spec(ALWAYS))["job_id"]
    done = eventually(lambda: (j := api.job(jid))["status"] in TERMINAL and j, timeout=200, what="the job ended")
    assert done["status"] == "failed", done
    record = raw_job_record(stack.settings.redis_url, jid)
    assert record["status"] == "failed" and "diverged again" in record["error"], record["error"]
    # One restart (the first divergence may have been a machine's), not max_restarts of them.
    assert record["restarts_total"] == 1, record["restarts_total"]
    events = api.events(jid)
    assert [f["member_id"] for f in _diverged_faults(events)] == ["trainer-e1-r0", "trainer-e2-r0"]
    assert not [d for d in kinds(events, "step_committed") if d["step"] >= 1]
    [failed] = kinds(events, "job_failed")
    assert "diverged again" in failed["reason"], failed
