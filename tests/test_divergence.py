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

import re
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

ONCE, ALWAYS, GANG, STEPS = "divonce", "divalways", "divgang", 2  # (it diverges at step 1)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    armed = ",".join([f"diverge@{ONCE}/trainer-e1-r0",
                      f"diverge@{ALWAYS}/trainer-e1-r0", f"diverge@{ALWAYS}/trainer-e2-r0",
                      f"diverge@{GANG}/trainer-e1-r0", f"diverge@{GANG}/trainer-e1-r1"])
    with stack_with_failpoints(tmp_path_factory, "divergence", armed) as st:
        yield st


def _spec(name: str, workers: int = 1) -> dict:
    # (borrowing off: the new gang is cold ranks named trainer-e2-r<i>, which the failpoint names)
    return small_job(name, steps=STEPS, rollout={"replicas": 1}, trainer={"workers": workers},
                     recovery={"borrow": "never", "max_restarts": 5})


def _diverged(events: list[dict]) -> list[str]:
    """The trainer ranks that exited diverged, by the launcher's exit codes in the log."""
    return [d["member_id"] for d in kinds(events, "member_exited")
            if d["role"] == "trainer" and d["returncode"] == EXIT_DIVERGED]


def _exits_before_the_end(events: list[dict]) -> None:
    """Every started member's exit is in the log before the job's final event."""
    final = next(i for i, e in enumerate(events) if e["kind"] in ("job_finished", "job_failed", "job_stopped"))
    exited = {e["data"]["member_id"] for e in events[:final] if e["kind"] == "member_exited"}
    started = {d["member_id"] for d in kinds(events, "member_started")}
    assert started <= exited, sorted(started - exited)


def test_a_divergence_that_does_not_come_again_is_recovered_from_the_checkpoint(stack: Stack) -> None:
    api = ApiClient(stack.api_url, stack.settings.api_token)
    jid = api.submit(_spec(ONCE))["job_id"]
    assert wait_done(api, jid, timeout=200)["status"] == "finished"
    events = api.events(jid)
    assert _diverged(events) == ["trainer-e1-r0"]
    [fault] = [f for f in kinds(events, "fault_detected") if f["member_id"] == "trainer-e1-r0"]
    # Nothing of the diverged step was kept: its only commit is the second gang's.
    step1 = [d for d in kinds(events, "step_committed") if d["step"] == 1]
    assert step1 and all(d["epoch"] >= 2 for d in step1), step1
    state = Checkpointer(open_object_store(stack.settings), f"jobs/{jid}/checkpoints").load_latest()
    assert state is not None and state.step == STEPS - 1, None if state is None else state.step
    last = [d for d in kinds(events, "step_committed") if d["step"] == STEPS - 1]
    assert weights_checksum(state.model_state) == last[-1]["checksum"]
    assert raw_job_record(stack.settings.redis_url, jid)["restarts_total"] == 1
    _exits_before_the_end(events)


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
    assert _diverged(events) == ["trainer-e1-r0", "trainer-e2-r0"]
    assert not [d for d in kinds(events, "step_committed") if d["step"] >= 1]
    [failed] = kinds(events, "job_failed")
    assert "diverged again" in failed["reason"], failed
    _exits_before_the_end(events)


def test_a_gang_whose_every_rank_diverges_once_is_restarted_whole_and_finishes(stack: Stack) -> None:
    """Two ranks, both diverged at step 1 (a NaN reaches every rank through the gradients'
    all-reduce), each exiting on its own time. The restart planned to keep the other rank for the
    next gang (``keep_survivors``, on): it would carry the diverged step's state, and had its hand-off
    come before its own exit, that exit under the new gang's id was taken for a second divergence,
    failing the job (an outside review; here the rank exited first, so this test passed on that
    code too, and checks the plan in the log). Now no rank of a diverged gang is kept: one restart,
    every rank of the new gang cold, and the job finishes."""
    api = ApiClient(stack.api_url, stack.settings.api_token)
    jid = api.submit(_spec(GANG, workers=2))["job_id"]
    assert wait_done(api, jid, timeout=200)["status"] == "finished"
    events = api.events(jid)
    assert set(_diverged(events)) <= {"trainer-e1-r0", "trainer-e1-r1"} and _diverged(events), _diverged(events)
    assert raw_job_record(stack.settings.redis_url, jid)["restarts_total"] == 1
    [decision] = [d for d in kinds(events, "decision") if "RestartTrainerGang" in d["actions"]]
    assert not re.search(r"\d+ survivor", decision["reason"]), decision  # (the plan: "1 survivor, 1 cold")
    assert {d["member_id"]: d["source"] for d in kinds(events, "member_started") if d["role"] == "trainer"} == {
        "trainer-e1-r0": "cold", "trainer-e1-r1": "cold", "trainer-e2-r0": "cold", "trainer-e2-r1": "cold"}
    step1 = [d for d in kinds(events, "step_committed") if d["step"] == 1]
    assert step1 and all(d["epoch"] >= 2 for d in step1), step1
    _exits_before_the_end(events)
