"""Retention of ended jobs (``JobSpec.retention``): the leading controller deletes an ended job once
``delete_after_s`` has passed since it ended, through the ``DELETE /v1/jobs/{id}`` path.

Checked from outside: the job's keys are looked for with SCAN on raw Redis, its event log is read
raw from JetStream, its checkpoints are listed in the object store. Before retention existed a
finished job's keys stayed in Redis until someone called DELETE, and a spec naming ``retention``
was refused as an unknown field.

The take-over and failure cases run on the controller rig of ``test_controller_runtime`` (real
servers, stand-in members): the due time follows from the job's durable end time, so a leader
that takes over deletes on time; a deletion the store fails is retried, and the job is deleted
once.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import redis as redis_sync
from jobs import small_job, wait_done
from rest_target import ControllerTarget, serve_controller
from robustrl.services.controller import launching
from support import eventually, eventually_async, raw_job_record
from test_controller_runtime import Rig, of_kind, spec

from robustrl.audit.raw import read_event_log
from robustrl.client import ApiClient
from robustrl.config import JobSpec, Settings
from robustrl.errors import ConfigError, JobError, TransportError
from robustrl.infra.embedded import EmbeddedInfra
from robustrl.storage.objects import open_object_store
from robustrl.storage.redis_stores import Keys

pytestmark = pytest.mark.timeout(240)

CHECK_SLACK_S = 8.0
"""What the deletion may take beyond its due time: the periodic check's interval and the purge,
on a loaded 2-core machine."""


def _keys(settings: Settings, job_id: str) -> list[bytes]:
    r = redis_sync.Redis.from_url(settings.redis_url)
    try:
        return sorted(r.scan_iter(match=Keys.job_pattern(job_id), count=1000))
    finally:
        r.close()


def _record(settings: Settings, job_id: str) -> bytes | None:
    r = redis_sync.Redis.from_url(settings.redis_url)
    try:
        return r.hget(Keys.jobs(), job_id)  # type: ignore[return-value]
    finally:
        r.close()


def _log(settings: Settings, job_id: str) -> list[tuple[str, dict[str, object]]]:
    return [(e.kind, e.data) for e in asyncio.run(read_event_log(settings.nats_url, job_id))]


def test_an_ended_job_with_retention_is_deleted_on_time_and_one_without_keeps_everything(
        api: ApiClient, infra: Settings) -> None:
    kept = api.submit(small_job("ret-kept", steps=1))["job_id"]
    gone = api.submit(small_job("ret-gone", steps=2, retention={"delete_after_s": 4.0}))["job_id"]
    kept_end = wait_done(api, kept)["finished_at"]
    status = wait_done(api, gone)
    ended_at = status["finished_at"]
    # The GET says when: the job's durable end time plus delete_after_s.
    assert status["delete_at"] == pytest.approx(ended_at + 4.0), status
    assert raw_job_record(infra.redis_url, gone)["finished_at"] == ended_at
    assert api.job(kept)["delete_at"] is None
    checkpoints = sorted(open_object_store(infra).list(f"jobs/{gone}/"))
    assert checkpoints, "the job wrote checkpoints"
    assert _keys(infra, gone), "a finished job leaves its last steps' keys in Redis"

    # Its keys go once it is due, not before, and within the check's bound.
    eventually(lambda: not _keys(infra, gone) and _record(infra, gone) is None,
               timeout=ended_at + 4.0 + CHECK_SLACK_S - time.time(), interval=0.05,
               what=f"{gone}'s keys and record deleted by retention")
    deleted_at = time.time()
    assert deleted_at >= ended_at + 4.0, f"deleted {ended_at + 4.0 - deleted_at:.2f} s before it was due"

    log = _log(infra, gone)
    assert log[-1][0] == "job_deleted", log[-3:]
    assert [k for k, _ in log].count("job_deleted") == 1
    assert log[-1][1]["retention"] is True and log[-1][1]["events_kept"] is True, log[-1]
    assert sorted(open_object_store(infra).list(f"jobs/{gone}/")) == checkpoints  # the model stays
    with pytest.raises(JobError) as missing:
        api.job(gone)
    assert missing.value.status == 404, missing.value  # type: ignore[attr-defined]

    # The job without retention, ended before the check that deleted the other ran (at or after
    # its due time), keeps everything.
    assert kept_end < ended_at + 4.0
    assert _keys(infra, kept) and _record(infra, kept) is not None
    assert api.job(kept)["status"] == "finished"
    assert "job_deleted" not in [k for k, _ in _log(infra, kept)]
    api.delete(kept)  # tidy: the session's other tests share this Redis


# --- validation on every surface that takes a spec ---------------------------------------------

BAD = [("-1", "greater than or equal to 0"), ("-0.001", "greater than or equal to 0"),
       ("Infinity", "finite"), ("NaN", "finite"), ("1e999", "finite"), ('"60"', "valid number"),
       ("true", "valid number"), ("1e12", "less than or equal to")]


@pytest.mark.parametrize(("value", "why"), BAD)
def test_a_bad_retention_is_refused_by_the_parser_naming_the_field(value: str, why: str) -> None:
    raw = json.loads('{"retention": {"delete_after_s": @@}}'.replace("@@", value),
                     parse_constant=lambda c: float(c))
    with pytest.raises(ConfigError, match=why) as err:
        JobSpec.parse(raw)
    assert err.value.field == "retention.delete_after_s", err.value
    assert "retention.delete_after_s" in str(err.value)


def test_retention_defaults_to_keep_and_survives_the_trip_to_the_members() -> None:
    assert JobSpec().retention.delete_after_s is None
    spec_ = JobSpec.parse({"retention": {"delete_after_s": 0, "checkpoints": True}})
    assert spec_.retention.delete_after_s == 0.0 and spec_.retention.checkpoints and not spec_.retention.events
    assert JobSpec.parse(json.loads(json.dumps(spec_.model_dump(mode="json"), allow_nan=False))) == spec_
    with pytest.raises(ConfigError) as err:
        JobSpec.parse({"retention": {"delete_after_s": 5, "forever": True}})
    assert err.value.field == "retention.forever"


@pytest.mark.parametrize("value", ["-5", ".inf", ".nan", "'5'"])
def test_the_cli_refuses_a_bad_retention_in_a_yaml_spec_before_submitting(tmp_path: Path, value: str) -> None:
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(f"name: yaml-ret\nretention:\n  delete_after_s: {value}\n")
    res = subprocess.run([sys.executable, "-m", "robustrl.cli", "submit", str(spec_file), "--run-dir",
                          str(tmp_path / "no-stack")], capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 2, res
    assert "retention.delete_after_s" in res.stdout.replace("\n", ""), res.stdout


@pytest.mark.parametrize("line", ["name: !!binary aGVsbG8=", "name: 2026-12-06", "name: yaml\nseed: !!set {1}"])
def test_the_cli_refuses_yaml_values_json_cannot_carry_before_submitting(tmp_path: Path, line: str) -> None:
    """YAML bytes, dates and sets passed the CLI's own check (lax on ``str``) and then crashed it in
    the HTTP client with a traceback (an outside review): now a clear error, exit 2."""
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(line + "\n")
    run_dir = tmp_path / "stack"  # a stack file naming a port nothing listens on: the spec is sent
    run_dir.mkdir()
    (run_dir / "stack.json").write_text(json.dumps({"api_url": "http://127.0.0.1:9", "token": "t"}))
    res = subprocess.run([sys.executable, "-m", "robustrl.cli", "submit", str(spec_file), "--run-dir", str(run_dir)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 2 and "JSON can carry" in res.stdout.replace("\n", ""), res
    assert "Traceback" not in res.stderr + res.stdout, res.stderr[-2000:]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControllerTarget]:
    with serve_controller(tmp_path_factory.mktemp("retention-api")) as t:
        yield t


@pytest.mark.parametrize(("value", "why"), BAD)
def test_a_bad_retention_is_a_422_naming_the_field_and_records_nothing(target: ControllerTarget, value: str,
                                                                       why: str) -> None:
    from support import raw_job_ids

    def ids() -> tuple[set[str], set[str]]:  # the API's list, and the registry raw in Redis
        return ({j["job_id"] for j in httpx.get(f"{target.base_url}/v1/jobs", headers=target.headers,
                                                 timeout=15).json()}, raw_job_ids(target.settings.redis_url))

    before = ids()
    body = '{"name": "badret", "retention": {"delete_after_s": @@}}'.replace("@@", value)
    resp = httpx.post(f"{target.base_url}/v1/jobs", content=body,
                      headers={**target.headers, "Content-Type": "application/json"}, timeout=15)
    assert resp.status_code == 422, resp.text[:300]
    fields = {f["field"]: f["error"] for f in resp.json()["error"]["fields"]}
    assert "retention.delete_after_s" in fields, resp.text[:300]
    assert ids() == before


# --- take-over and failure, on the controller rig --------------------------------------------------

@pytest.fixture(scope="module")
def rig_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """Servers of this rig's own: its controllers hold the one lease and registry."""
    embedded = EmbeddedInfra(tmp_path_factory.mktemp("retention-infra"))
    try:
        yield embedded.start()
    finally:
        embedded.stop()


@pytest.fixture
async def crig(rig_servers: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Rig]:
    """``test_controller_runtime``'s rig: real controllers, stand-in members and request manager."""
    monkeypatch.setattr(launching, "TRAINER_MODULE", "idle_member")
    monkeypatch.setattr(launching, "ROLLOUT_MODULE", "idle_member")
    r = Rig(rig_servers, tmp_path / "logs")
    await r.start()
    try:
        yield r
    finally:
        await r.close()


def _retained(name: str, after_s: float) -> JobSpec:
    raw = spec(name, steps=1).model_dump(mode="json")
    return JobSpec.parse({**raw, "retention": {"delete_after_s": after_s}})


async def _finished(rig: Rig, c: object, job_spec: JobSpec) -> str:
    job = await c.submit(job_spec)  # type: ignore[attr-defined]
    await rig.hello_all(c, job.job_id)  # type: ignore[arg-type]
    await rig.commit(job.job_id, 0)
    await eventually_async(lambda: job.status == "finished", timeout=30, what=f"{job.job_id} finished")
    return str(job.job_id)


async def _gone(rig: Rig, job_id: str) -> bool:
    keys = [k async for k in rig.redis.scan_iter(match=Keys.job_pattern(job_id), count=1000)]
    return not keys and await rig.redis.hget(Keys.jobs(), job_id) is None


async def test_a_leader_that_takes_over_deletes_an_ended_job_on_time_and_once(crig: Rig) -> None:
    """The due time comes from the durable record: the job's end is moved 28 s back in raw Redis
    while no controller leads, so the next leader must delete it about 2 s after it leads (a timer
    started by the leader would wait 30 s). A record with no end time (a job whose end was read from
    the event log) gets one saved, and counts from it."""
    c = await crig.controller()
    await c.wait_leading(10)
    jid = await _finished(crig, c, _retained("rettakeover", 30.0))
    unstamped = await _finished(crig, c, _retained("retnoend", 3.0))
    await crig.redis.set(Keys.batch(jid, 0), b"1")  # what the job left (stand-in members leave little)
    await c.close(stop_members=True)  # the leader goes before either job is due
    rec = json.loads(await crig.redis.hget(Keys.jobs(), jid))
    ended_at = rec["finished_at"] = time.time() - 28.0
    await crig.redis.hset(Keys.jobs(), jid, json.dumps(rec))
    rec = json.loads(await crig.redis.hget(Keys.jobs(), unstamped))
    rec["finished_at"] = None
    await crig.redis.hset(Keys.jobs(), unstamped, json.dumps(rec))

    c2 = await crig.controller()
    await c2.wait_leading(10)
    stamped = await eventually_async(
        lambda: raw_job_record(crig.settings.redis_url, unstamped).get("finished_at"), timeout=10, interval=0.05,
        what="an end time saved for the job whose record had none")
    await eventually_async(lambda: _gone(crig, jid), timeout=ended_at + 30.0 + CHECK_SLACK_S - time.time(),
                           interval=0.05, what="deleted by the leader that took over, when due")
    assert time.time() >= ended_at + 30.0
    # (its keys go before the leader forgets it: suite50 looked in between)
    await eventually_async(lambda: jid not in c2.jobs, timeout=10, what="the deleted job forgotten by the leader")
    assert len(of_kind(await crig.events(jid), "job_deleted")) == 1

    await eventually_async(lambda: _gone(crig, unstamped), timeout=stamped + 3.0 + CHECK_SLACK_S - time.time(),
                           interval=0.05, what="the job with no end time deleted, counted from the one saved")
    assert time.time() >= stamped + 3.0
    assert len(of_kind(await crig.events(unstamped), "job_deleted")) == 1


async def test_a_retention_deletion_the_store_fails_is_retried_and_done_once(
        crig: Rig, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    c = await crig.controller()
    await c.wait_leading(10)
    real = c.deleter._purge_redis
    failed: list[str] = []

    async def store_away_once(job_id: str) -> int:
        if not failed:
            failed.append(job_id)
            raise TransportError("redis unreachable (test)", subject=job_id)
        return await real(job_id)

    monkeypatch.setattr(c.deleter, "_purge_redis", store_away_once)
    jid = await _finished(crig, c, _retained("retfail", 0.0))
    await eventually_async(lambda: _gone(crig, jid), timeout=30, interval=0.05, what="deleted after the retry")
    assert failed == [jid]
    assert len(of_kind(await crig.events(jid), "job_deleted")) == 1
    assert any("retention" in r.getMessage() and "redis unreachable" in r.getMessage() for r in caplog.records)
