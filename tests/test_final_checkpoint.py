"""A finished job's last checkpoint is durable, however long its upload takes.

The last step's checkpoint is uploaded in the background after its commit; the controller then
stops every member. With one stop grace for all (15 s), a last upload slower than that was
killed: the job ended ``finished``, its last step's model durable nowhere, and nothing said so
(an outside review). The member failpoint ``final_upload_slow`` (``robustrl.member.FAILPOINTS_ENV``)
writes the last manifest 25 s late, as behind a slow object store. Checked from outside: the
object store, the gang's fenced record in Redis, the job's record and its event log.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
import redis as redis_sync
from jobs import kinds, small_job, wait_done
from support import eventually, raw_job_record, stack_with_failpoints

from robustrl.checkpoint import Checkpointer
from robustrl.client import ApiClient
from robustrl.model.policy import weights_checksum
from robustrl.stack import Stack
from robustrl.storage.objects import open_object_store
from robustrl.storage.redis_stores import Keys

pytestmark = pytest.mark.timeout(240)

NAME, STEPS = "slowfinal", 2
KILLED, KILLED_STEPS = "slowfinalkill", 3


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    armed = f"final_upload_slow@{NAME}/trainer-e1-r0,final_upload_slow@{KILLED}/trainer-e1-r0"
    with stack_with_failpoints(tmp_path_factory, "final-checkpoint", armed) as st:
        yield st


def test_a_last_upload_slower_than_the_stop_grace_is_waited_for(stack: Stack) -> None:
    api = ApiClient(stack.api_url, stack.settings.api_token)
    spec = small_job(NAME, steps=STEPS, rollout={"replicas": 1}, trainer={"workers": 1})
    jid = api.submit(spec)["job_id"]
    wait_done(api, jid, timeout=200)
    events = api.events(jid)
    last = max(kinds(events, "step_committed"), key=lambda d: d["step"])
    assert last["step"] == STEPS - 1 and last["durable_step"] < STEPS - 1, last  # uploaded after its commit

    state = Checkpointer(open_object_store(stack.settings), f"jobs/{jid}/checkpoints").load_latest()
    assert state is not None and state.step == STEPS - 1, None if state is None else state.step
    assert weights_checksum(state.model_state) == last["checksum"]
    r = redis_sync.Redis.from_url(stack.settings.redis_url)
    try:
        assert int(r.hget(Keys.gang(jid), "durable")) == STEPS - 1  # the fenced record, after the manifest
    finally:
        r.close()
    assert raw_job_record(stack.settings.redis_url, jid)["durable_step"] == STEPS - 1
    [finished] = kinds(events, "job_finished")
    assert finished["durable_step"] == STEPS - 1, finished
    # Every member's exit is in the log before its final event (a reader of a finished job's log
    # found a rank's exit missing: handled in a supervision round after the stop had ended the log).
    final = next(i for i, e in enumerate(events) if e["kind"] == "job_finished")
    started = {d["member_id"] for d in kinds(events, "member_started")}
    exited = {e["data"]["member_id"]: e["data"] for e in events[:final] if e["kind"] == "member_exited"}
    assert started and started <= set(exited), (sorted(started), sorted(exited))
    rank = exited["trainer-e1-r0"]
    assert rank["expected"] and rank["returncode"] != -signal.SIGKILL, rank
    assert not [d for d in kinds(events, "note") if "not durable" in str(d.get("text"))]


def test_a_rank_lost_during_the_last_upload_is_recovered_and_the_last_step_made_durable(stack: Stack) -> None:
    """Every step committed, the last one's upload under way (held): its rank is killed. The
    members were marked stopped as soon as the last step was committed, so the loss was an
    expected exit: no fault, the job ended ``finished`` with its last step durable nowhere (an
    outside review). Now the job's members run until the last step is durable: the loss is a
    trainer fault, the new gang trains the last step again, and its checkpoint is the job's."""
    api = ApiClient(stack.api_url, stack.settings.api_token)
    spec = small_job(KILLED, steps=KILLED_STEPS, rollout={"replicas": 1}, trainer={"workers": 1})
    jid = api.submit(spec)["job_id"]
    eventually(lambda: any(d["step"] == KILLED_STEPS - 1 for d in kinds(api.events(jid), "step_committed")),
               timeout=150, interval=0.1, what="the last step committed")
    [rank] = [m for m in api.job(jid)["members"] if m["member_id"] == "trainer-e1-r0"]
    os.kill(rank["pid"], signal.SIGKILL)  # its last manifest is held back 25 s: not durable yet
    wait_done(api, jid, timeout=200)
    events = api.events(jid)
    assert [f for f in kinds(events, "fault_detected") if f["member_id"] == "trainer-e1-r0"], \
        kinds(events, "fault_detected")
    assert [r for r in kinds(events, "recovered") if r["kind"] in ("trainer", "whole_job")], kinds(events, "recovered")
    state = Checkpointer(open_object_store(stack.settings), f"jobs/{jid}/checkpoints").load_latest()
    assert state is not None and state.step == KILLED_STEPS - 1, None if state is None else state.step
    last = [d for d in kinds(events, "step_committed") if d["step"] == KILLED_STEPS - 1]
    assert weights_checksum(state.model_state) == last[-1]["checksum"], last
    assert raw_job_record(stack.settings.redis_url, jid)["durable_step"] == KILLED_STEPS - 1
    [finished] = kinds(events, "job_finished")
    assert finished["durable_step"] == KILLED_STEPS - 1, finished
