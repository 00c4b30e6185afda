"""``DELETE /v1/jobs/{id}`` on the real stack: what an ended job left in Redis goes, the job's
checkpoints and event log only when asked, a running job is refused, and another job (running
beside it the whole time) loses nothing: the auditor passes on it afterwards.

Read from the raw stores (Redis keys, the object store's listing, the JetStream log), not from
what the controller says it did. Before the endpoint existed a finished job's last steps' keys
(episodes, prefixes, batches, fences, trained log, gang record) stayed in Redis for good.
"""

from __future__ import annotations

import asyncio

import pytest
import redis as redis_sync
from jobs import small_job, wait_done, wait_step
from support import audit_sampled, eventually, raw_job_record, sample_batches

from robustrl.audit.raw import read_event_log
from robustrl.client import ApiClient
from robustrl.config import Settings
from robustrl.errors import JobError
from robustrl.storage.objects import open_object_store
from robustrl.storage.redis_stores import Keys


def _keys(infra: Settings, job_id: str) -> list[bytes]:
    r = redis_sync.Redis.from_url(infra.redis_url)
    try:
        return sorted(r.scan_iter(match=Keys.job_pattern(job_id), count=1000))
    finally:
        r.close()


def _record(infra: Settings, job_id: str) -> bytes | None:
    r = redis_sync.Redis.from_url(infra.redis_url)
    try:
        return r.hget(Keys.jobs(), job_id)  # type: ignore[return-value]
    finally:
        r.close()


def _objects(infra: Settings, job_id: str) -> list[str]:
    return sorted(open_object_store(infra).list(f"jobs/{job_id}/"))


def _log(infra: Settings, job_id: str) -> list[str]:
    return [e.kind for e in asyncio.run(read_event_log(infra.nats_url, job_id))]


def _refused(call: object, status: int) -> JobError:
    with pytest.raises(JobError) as caught:
        call()  # type: ignore[operator]
    assert caught.value.status == status, caught.value  # type: ignore[attr-defined]
    return caught.value


def test_deleting_an_ended_job_removes_its_state_and_nothing_of_another_job(api: ApiClient,
                                                                            infra: Settings) -> None:
    other = api.submit(small_job("del-other", steps=8))["job_id"]
    sampler = sample_batches(infra.redis_url, other)
    ended = api.submit(small_job("del-ended", steps=2))["job_id"]
    wait_step(api, other, 0)

    # A running job is refused, and nothing of it is marked or touched.
    refusal = _refused(lambda: api.delete(other, checkpoints=True, events=True), 409)
    assert "stop it first" in str(refusal)
    assert raw_job_record(infra.redis_url, other).get("deleting") is None
    assert api.job(other)["status"] in ("running", "recovering")

    wait_done(api, ended)
    # A job whose id begins with the deleted one's (named after it): its keys share that prefix,
    # and a job pattern without the separator after the id took them too.
    twin = api.submit(small_job(ended, steps=1))["job_id"]
    assert twin.startswith(ended)
    wait_done(api, twin)
    # (its outboxes drain on their own meanwhile: the rest is what must stay)
    twin_keys = eventually(lambda: [k for k in _keys(infra, twin) if b":outbox" not in k], timeout=30,
                           what="the twin's keys")
    # The outboxes drain by themselves once their events are in the log (a full run took the
    # controller's into the count and found it gone by the DELETE: 31 deleted of 32 seen).
    outboxes = {Keys.controller_outbox(ended).encode(), Keys.rm_outbox(ended).encode(),
                Keys.detector_outbox(ended).encode()}
    left = eventually(lambda: (ks := _keys(infra, ended)) and not outboxes & set(ks) and ks, timeout=30,
                      what="the job's outboxes drained")
    assert left, "a finished job leaves its last steps' keys (what DELETE is for)"
    checkpoints = _objects(infra, ended)
    assert checkpoints
    again = _keys(infra, ended)
    out = api.delete(ended)  # the defaults: the trained model and the history stay
    # Every key listed is deleted. (A full run counted one more deleted than listed: a key written
    # after the listing; named here if it happens again.)
    late = sorted(set(again) - set(left))
    assert out["redis_keys_deleted"] >= len(left), (out, left)
    if out["redis_keys_deleted"] != len(left):
        print(f"{out['redis_keys_deleted'] - len(left)} key(s) of {ended} written after the listing: {late}")
    assert _keys(infra, ended) == [] and _record(infra, ended) is None
    assert set(twin_keys) <= set(_keys(infra, twin)) and _record(infra, twin) is not None, "the twin's keys went too"
    api.delete(twin, checkpoints=True, events=True)  # (nothing of it left for the tests after)
    assert out["checkpoints_kept"] and out["events_kept"]
    assert _objects(infra, ended) == checkpoints
    assert _log(infra, ended)[-1] == "job_deleted"
    _refused(lambda: api.job(ended), 404)
    _refused(lambda: api.delete(ended), 404)
    assert ended not in [j["job_id"] for j in api.jobs()]

    # The job beside it finishes whole: the auditor reads its raw stores.
    assert wait_done(api, other)["status"] == "finished"
    audit_sampled(infra, other, sampler)

    # Everything, on request.
    out = api.delete(other, checkpoints=True, events=True)
    assert out["checkpoint_objects_deleted"] > 0 and out["events_deleted"] > 0, out
    assert _keys(infra, other) == [] and _record(infra, other) is None
    assert _objects(infra, other) == [] and _log(infra, other) == []


def test_delete_rejects_bad_input_with_a_clear_error(api: ApiClient) -> None:
    _refused(lambda: api.delete("no-such-job"), 404)
    bad = _refused(lambda: api._call("DELETE", "/v1/jobs/a.b"), 422)
    assert "job_id" in str(bad)
    bad = _refused(lambda: api._call("DELETE", "/v1/jobs/x", params={"checkpoints": "perhaps"}), 422)
    assert "checkpoints" in str(bad)
