"""The RL job end to end as five real services, through the REST API, on real NATS/Redis/S3."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import httpx
import pytest
from jobs import kinds, small_job, wait_done, wait_step
from support import audit_sampled, eventually, raw_job_ids, sample_batches

from robustrl.bus import Bus
from robustrl.client import ApiClient
from robustrl.infra.embedded import EmbeddedInfra
from robustrl.stack import Stack
from robustrl.subjects import Verb, subject

pytestmark = pytest.mark.timeout(240)


def test_short_job_runs_end_to_end(stack, api, infra, tmp_path):
    # Sampling at a temperature and top-p other than 1: the trainer must take its logprobs from
    # the distribution the replicas sampled from.
    # And in micro-batches of one episode each (64 positions; the ranks' counts may differ): DDP
    # syncs the accumulated gradients once per rank per step, the ranks stay in agreement.
    job = api.submit(small_job("e2e", steps=5, rollout={"temperature": 0.8, "top_p": 0.9},
                               trainer={"micro_batch_tokens": 64}))
    sampler = sample_batches(infra.redis_url, job["job_id"])
    status = wait_done(api, job["job_id"])
    events = api.events(job["job_id"])
    report = audit_sampled(infra, job["job_id"], sampler)

    assert status["committed_step"] == 4 and len(status["reward_by_step"]) == 5
    assert all(0.0 <= r <= 1.0 for r in status["reward_by_step"])
    # Real training happened: every step produced new weights (a new checksum per version).
    checksums = [e["checksum"] for e in kinds(events, "step_committed")]
    assert len(set(checksums)) == 5
    # Both replicas served every version the steps needed, with the trainer's checksums.
    loaded = {(d["member_id"], d["version"]) for d in kinds(events, "weights_loaded")}
    assert {(m, v) for m in ("rollout-0-i0", "rollout-1-i0") for v in range(5)} <= loaded
    assert {d["checksum"] for d in kinds(events, "weights_published") if d["version"] == 4} == {checksums[3]}
    # Tool turns really happened (the auditor checked every saved prefix it could still see).
    assert any(d["tool_wait_s"] > 0 for d in kinds(events, "batch_ready")), "no step waited on a tool"
    # Per-step checkpoints exist (keep-K) and every step's timings were reported.
    assert report.facts["manifests"], "no complete checkpoint in the object store"
    timings = kinds(events, "step_committed")[-1]["timings"]
    for key in ("generation_s", "tool_wait_s", "training_s", "checkpoint_blocking_s", "weight_sync_s"):
        assert key in timings
    assert not status["faults"], f"a fault-free job reported faults: {status['faults']}"
    # Sync: each step trains once on turns of the weights it starts from, so its importance ratio
    # to the behaviour policy is 1 up to float error (before, the trainer left out temperature and
    # top-p, and it was not).
    for d in kinds(events, "step_committed"):
        assert abs(d["train"]["ratio_mean"] - 1.0) < 1e-3 and abs(d["train"]["approx_kl"]) < 1e-3, (d["step"], d["train"])
    # The trained policy exported from the job's newest checkpoint (`robustrl export`) is the last
    # committed version, and loads as a later job's model.path (the char tokenizer beside it).
    from typer.testing import CliRunner

    from robustrl.cli import app
    from robustrl.config import ModelSpec
    from robustrl.model.hf import load_tokenizer
    from robustrl.model.policy import build_policy, weights_checksum

    out = tmp_path / "exported"
    run = CliRunner().invoke(app, ["export", job["job_id"], str(out)], env=infra.to_env())
    assert run.exit_code == 0, run.output
    spec = ModelSpec(path=str(out))
    assert weights_checksum(build_policy(spec, load_tokenizer(spec), 0)) == checksums[-1]


def test_bad_rest_bodies_are_rejected_with_the_field_named(stack, api):
    url = stack.api_url
    token = {"Authorization": f"Bearer {stack.settings.api_token}"}
    stored_before = raw_job_ids(stack.settings.redis_url)
    assert httpx.get(f"{url}/v1/jobs").status_code == 401
    assert httpx.get(f"{url}/v1/jobs", headers={"Authorization": "Bearer nope"}).status_code == 401
    r = httpx.post(f"{url}/v1/jobs", headers=token, content=b"{not json")
    assert r.status_code == 400 and "JSON" in r.text
    r = httpx.post(f"{url}/v1/jobs", headers=token, json={"steps": 0, "mode": "warp", "bogus": 1})
    assert r.status_code == 422
    fields = {d["field"] for d in r.json()["error"]["fields"]}
    assert {"steps", "mode", "bogus"} <= fields
    r = httpx.post(f"{url}/v1/jobs", headers=token, json={"mode": "sync", "staleness": 2})
    assert r.status_code == 422 and "staleness" in r.text
    r = httpx.post(f"{url}/v1/jobs", headers=token, json=[1, 2])
    assert r.status_code == 422
    assert httpx.get(f"{url}/v1/jobs/nope", headers=token).status_code == 404
    # Nothing was stored for the rejected requests: the raw registry holds no job it did not hold
    # before.
    # (each xdist worker has a stack of its own, and its tests run one at a time)
    added = raw_job_ids(stack.settings.redis_url) - stored_before
    assert not added, added
    assert "/v1/jobs" in httpx.get(f"{url}/openapi.json").json()["paths"]


def test_bad_fault_requests_are_rejected(stack, api):
    job = api.submit(small_job("badfault", steps=2))
    token = {"Authorization": f"Bearer {stack.settings.api_token}"}
    base = f"{stack.api_url}/v1/jobs/{job['job_id']}/faults"
    r = httpx.post(base, headers=token, json={"kind": "meteor", "role": "trainer"})
    assert r.status_code == 422 and "kind" in r.text
    r = httpx.post(base, headers=token, json={"kind": "crash", "role": "rollout", "member": 7})
    assert r.status_code == 422 and "index 7" in r.text
    assert httpx.post(base, json={"kind": "crash", "role": "trainer"}).status_code == 401
    status = wait_done(api, job["job_id"])
    assert not status["faults"]


def test_garbage_on_subjects_is_dropped_and_the_job_finishes(stack, api, infra):
    job = api.submit(small_job("garbage", steps=4))
    jid = job["job_id"]
    wait_step(api, jid, 0)
    restarts_before = stack.restarts()

    async def spray() -> None:
        bus = await Bus.connect(infra.nats_url, "garbage")
        try:
            for verb in (Verb.METRICS, Verb.PHASE, Verb.HELLO, Verb.TURN, Verb.BATCH, Verb.COMMIT,
                         Verb.WEIGHTS, Verb.HAVE, Verb.FAULT, Verb.EXIT, Verb.CONTROL, Verb.CHAOS, Verb.SPEC):
                for payload in (b"\xff\xfe", b"[]", b'{"job_id": "x y"}', b'{"kind": "nope"}', b"null"):
                    await bus.publish_raw(subject(jid, verb), payload)
                    await bus.publish_raw(subject(jid, verb, "rollout-0-i0"), payload)
                    await bus.publish_raw(subject(jid, verb, "request_manager"), payload)
            await bus.client.flush()
        finally:
            await bus.close()

    asyncio.run(spray())
    status = wait_done(api, jid)
    assert status["committed_step"] == 3
    assert not status["faults"], f"garbage produced faults: {status['faults']}"
    for name, proc in stack.procs.items():
        assert proc.poll() is None, f"{name} died on garbage"
    # ... and none died and came back (``procs`` holds each service's current process: a restart
    # replaces the entry), nor was restarted as hung: the supervisor's own record, raw.
    assert [r for r in stack.restarts() if r not in restarts_before] == [], "a service restarted on garbage"


def test_stop_everything_then_resume_from_checkpoint(infra, tmp_path):
    """Kill every process (control plane and members), start again: the job resumes at the
    step after its newest durable checkpoint, with the checkpoint's weights."""
    spec = small_job("resume", steps=7)
    # Servers of its own: the session's control plane must not serve this job too, and the
    # restarted controller must find only this test's job in Redis.
    own = EmbeddedInfra(tmp_path / "infra")
    infra = own.start()
    st = Stack(tmp_path / "a", external=infra)
    st.start()
    api = ApiClient(st.api_url, st.settings.api_token)
    try:
        jid = api.submit(spec)["job_id"]
        sampler = sample_batches(infra.redis_url, jid)
        wait_step(api, jid, 3)
        # Machine loss of everything: members first (the controller would otherwise stop them
        # gracefully), then the control plane.
        for m in api.job(jid)["members"]:
            if m["pid"]:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(m["pid"], signal.SIGKILL)
        for name in list(st.procs):
            st.kill_service(name)
    finally:
        api.close()
        st.procs.clear()
        st.stop()
    st2 = Stack(tmp_path / "b", external=infra)
    st2.start()
    api2 = ApiClient(st2.api_url, st2.settings.api_token)
    try:
        eventually(lambda: any(j["job_id"] == jid for j in api2.jobs()), timeout=20, what="job restored")
        status = wait_done(api2, jid)
        events = api2.events(jid)
        readies = kinds(events, "member_ready")
        assert len(readies) >= 2, "the job was not relaunched"
        resumed = readies[-1]
        assert resumed["resume_step"] >= 1, "resumed from scratch instead of a checkpoint"
        # The resumed weights are exactly the checkpointed version: same checksum as committed.
        committed = {d["weights_version"]: d["checksum"] for d in kinds(events, "step_committed")
                     if d["epoch"] < resumed["epoch"]}
        republished = [d for d in kinds(events, "weights_published") if d["epoch"] == resumed["epoch"]][0]
        assert republished["version"] == resumed["resume_step"]
        assert republished["checksum"] == committed[republished["version"]]
        assert status["committed_step"] == 6
        audit_sampled(infra, jid, sampler)
    finally:
        api2.close()
        st2.stop()
        own.stop()
