"""A finished job's last checkpoint is durable, however long its upload takes.

The last step's checkpoint is uploaded in the background after its commit; the controller then
stops every member. With one stop grace for all (15 s), a last upload slower than that was
killed: the job ended ``finished``, its last step's model durable nowhere, and nothing said so
(an outside review). The member failpoint ``final_upload_slow`` (``robustrl.member.FAILPOINTS_ENV``)
writes the last manifest 25 s late, as behind a slow object store. Checked from outside: the
object store, the gang's fenced record in Redis, the job's record and its event log.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
import redis as redis_sync
from jobs import kinds, small_job, wait_done
from support import raw_job_record, stack_with_failpoints

from robustrl.checkpoint import Checkpointer
from robustrl.client import ApiClient
from robustrl.model.policy import weights_checksum
from robustrl.stack import Stack
from robustrl.storage.objects import open_object_store
from robustrl.storage.redis_stores import Keys

pytestmark = pytest.mark.timeout(240)

NAME, STEPS = "slowfinal", 2


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    armed = f"final_upload_slow@{NAME}/trainer-e1-r0"
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
    ranks = [d for d in kinds(events, "member_exited") if d["member_id"] == "trainer-e1-r0"]
    assert ranks and all(d["expected"] and d["returncode"] != -signal.SIGKILL for d in ranks), ranks
    assert not [d for d in kinds(events, "note") if "not durable" in str(d.get("text"))]
