"""The independent auditor must FAIL when an invariant breaks.

Unit tests feed ``judge`` synthetic raw state (a sound job, then one defect each). The
integration test runs a real job, audits it clean, then corrupts the raw stores one way at a
time (a flipped blob byte in S3, a checkpoint re-signed with other weights, a deleted episode key,
a duplicate trained record, an edited prefix, a weights_loaded with an unpublished checksum) and
asserts the auditor names each. ``test_audit_invariants.py`` has the checks added after an outside
review (lineage-keyed weights, rank coverage and origins, step sets, idempotence, the outbox).
"""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
from jobs import small_job, wait_done
from typer.testing import CliRunner

from robustrl.audit import AuditInput, AuditOptions, ObservedStep, audit, judge
from robustrl.audit.lineage import job_facts, max_stuck_s
from robustrl.audit.raw import RawCheckpoint, RawEvent, RawRedis
from robustrl.storage.objects import open_object_store
from robustrl.storage.redis_stores import Keys

STEPS, PROMPTS, GROUP = 3, 2, 2


class Log:
    """A synthetic event log."""

    def __init__(self) -> None:
        self.events: list[RawEvent] = []

    def add(self, kind: str, ts: float | None = None, **data: object) -> None:
        seq = len(self.events) + 1
        self.events.append(RawEvent(seq=seq, kind=kind, ts=float(seq) if ts is None else ts, data=dict(data)))


def checkpoint(step: int, epoch: int = 1) -> RawCheckpoint:
    """A manifest of a one-rank gang as the scan leaves it when every blob verified (the synthetic
    jobs do not hash a model: ``weights_checksum`` stays None)."""
    return RawCheckpoint(manifest_key=f"jobs/j/checkpoints/{step:012d}/e{epoch:08d}/manifest.json", step=step,
                         epoch=epoch, manifest={"step": step, "epoch": epoch, "world_size": 1,
                                                "weights_version": step + 1,
                                                "blobs": [{"name": "r00000/state.pt", "rank": 0}]})


def sound_job() -> AuditInput:
    """3 steps, one gang (epoch 1), 2 replicas, every record where the services put it."""
    log, redis = Log(), RawRedis()
    spec = {"steps": STEPS, "staleness": 0, "data": {"prompts_per_step": PROMPTS, "group_size": GROUP}}
    log.add("job_submitted", spec=spec)
    log.add("job_started")
    log.add("member_ready", role="trainer", epoch=1, resume_step=0, weights_version=0)
    log.add("weights_published", version=0, epoch=1, checksum="c0")
    for r in ("r0", "r1"):
        log.add("weights_loaded", member_id=r, version=0, checksum="c0")
    for k in range(STEPS):
        log.add("step_started", step=k, epoch=0)
        ids = [f"s{k}-p{p}-g{g}" for p in range(PROMPTS) for g in range(GROUP)]
        for i, eid in enumerate(ids):
            turns = [{"role": "assistant", "token_ids": [1, 2], "weights_version": k, "member_id": f"r{i % 2}"},
                     {"role": "tool", "token_ids": [3]},
                     {"role": "assistant", "token_ids": [4], "weights_version": k, "member_id": f"r{i % 2}"}]
            redis.episodes[eid] = {"episode_id": eid, "step": k, "prompt_ids": [9], "turns": turns,
                                   "status": "finished", "reward": 0.5}
            redis.prefixes[eid] = {"n_turns": 2, "episode": {"prompt_ids": [9], "turns": copy.deepcopy(turns[:2])}}
        redis.batches[k] = {"step": k, "episode_ids": ids}
        redis.step_keys[k] = [Keys.batch("j", k)]
        log.add("batch_ready", step=k)
        redis.trained.append({"step": k, "epoch": 1, "checksum": f"c{k + 1}"})
        log.add("weights_published", version=k + 1, epoch=1, checksum=f"c{k + 1}")
        log.add("step_committed", step=k, epoch=1, weights_version=k + 1, checksum=f"c{k + 1}", durable_step=k - 1)
        for r in ("r0", "r1"):
            log.add("weights_loaded", member_id=r, version=k + 1, checksum=f"c{k + 1}")
    log.add("job_finished")
    return AuditInput(job_id="j", events=log.events, redis=redis, checkpoints=[checkpoint(k) for k in range(STEPS)])


def test_a_sound_job_passes_every_check():
    report = judge(sound_job())
    assert report.ok, report.violations()
    assert report.counters() == {"steps_trained_twice": 0, "steps_lost": 0, "episodes_lost": 0,
                                 "checkpoints_unloadable": 0, "replicas_served_bad_weights": 0}


def test_duplicate_trained_record_is_a_step_trained_twice():
    inp = sound_job()
    inp.redis.trained.append({"step": 1, "epoch": 1, "checksum": "c2"})
    report = judge(inp)
    assert not report.checks["trained_once"].passed and report.steps_trained_twice == 1


def gang_2_redoes_step_2(inp: AuditInput) -> AuditInput:
    """The sound job, then gang 2 resumes at step 2 (checkpoint 1 durable) and redoes step 2."""
    log = Log()
    log.events = list(inp.events[:-1])
    log.add("member_ready", role="trainer", epoch=2, resume_step=2, weights_version=2)
    log.add("step_committed", step=2, epoch=2, weights_version=3, checksum="c3b", durable_step=2)
    log.add("weights_published", version=3, epoch=2, checksum="c3b")
    log.add("job_finished")
    inp.events = log.events
    inp.checkpoints.append(checkpoint(2, epoch=2))  # the checkpoint gang 2 reported durable
    return inp


def test_redo_by_a_newer_gang_is_allowed_only_before_the_step_was_durable():
    # Gang 2 resumes at step 2 (checkpoint 1 durable) and redoes step 2: one lineage, fine.
    inp = gang_2_redoes_step_2(sound_job())
    assert judge(inp).ok, judge(inp).violations()
    # Resuming at step 0 although checkpoint 1 had been reported durable rolls back and retrains.
    inp.events = [e if not (e.kind == "member_ready" and e.data["epoch"] == 2)
                  else RawEvent(e.seq, e.kind, e.ts, {**e.data, "resume_step": 0, "weights_version": 0})
                  for e in inp.events]
    report = judge(inp)
    assert report.steps_trained_twice >= 2, report.violations()
    # ...and the final lineage (gang 2 from step 0) lacks steps 0 and 1: they are lost.
    assert report.steps_lost == 2


def test_every_gang_must_record_where_it_resumed_from():
    """Origins as the auditor reads them raw from the object store: gang 1 (resumed at step 0)
    and gang 2 (resumed at step 2, from gang 1's checkpoint 1) must each have recorded theirs."""
    inp = gang_2_redoes_step_2(sound_job())
    inp.redis.trained.append({"step": 2, "epoch": 2, "checksum": "c3b"})
    sound = {1: {"epoch": 1, "from_step": None, "from_epoch": None},
             2: {"epoch": 2, "from_step": 1, "from_epoch": 1}}
    inp.origins = sound
    assert judge(inp).ok, judge(inp).violations()
    for origins, says in (({1: sound[1]}, "gang 2 trained but recorded no readable origin"),
                          ({**sound, 2: None}, "gang 2 trained but recorded no readable origin"),
                          ({**sound, 2: {**sound[2], "from_step": 2}}, ("gang 2 resumed at step 2 but its origin "
                                                                        "names checkpoint 2 of gang 1")),
                          ({**sound, 2: {**sound[2], "from_epoch": 2}}, "names checkpoint 1 of gang 2"),
                          ({**sound, 1: {**sound[1], "from_step": 0, "from_epoch": 0}}, "gang 1 resumed at step 0"),
                          ({**sound, 2: {**sound[2], "epoch": 3}}, "gang 2's origin names gang 3")):
        inp.origins = origins
        report = judge(inp)
        assert not report.checks["trained_once"].passed and any(says in v for v in report.violations()), \
            (origins, report.violations())


def test_committed_step_without_training_record_is_lost():
    inp = sound_job()
    inp.events = [e for e in inp.events if not (e.kind == "step_committed" and e.data["step"] == 1)]
    inp.redis.trained = [t for t in inp.redis.trained if t["step"] != 1]
    inp.checkpoints = [ck for ck in inp.checkpoints if ck.step != 1]  # nor a manifest gang 1 wrote for it
    report = judge(inp)
    assert report.steps_lost == 1 and not report.checks["trained_once"].passed


def test_missing_or_unfinished_episodes_are_lost():
    inp = sound_job()
    del inp.redis.episodes["s1-p0-g1"]
    inp.redis.episodes["s2-p1-g0"]["status"] = "generating"
    report = judge(inp)
    assert report.episodes_lost == 2 and not report.checks["episodes"].passed


def test_a_batch_gone_before_its_checkpoint_was_durable_is_lost_but_gc_after_is_not():
    inp = sound_job()
    inp.checkpoints = inp.checkpoints[:1]  # newest loadable checkpoint: step 0
    del inp.redis.batches[0]  # GC'd after checkpoint 0: allowed
    assert judge(inp).checks["episodes"].passed
    del inp.redis.batches[2]  # not durable yet: lost
    report = judge(inp)
    assert report.episodes_lost == PROMPTS * GROUP
    # Seen live at hand-off, it is still lost: a redo from checkpoint 0 needs it in Redis.
    ids = [f"s2-p{p}-g{g}" for p in range(PROMPTS) for g in range(GROUP)]
    inp.observed[2] = ObservedStep(2, {"episode_ids": ids}, {e: inp.redis.episodes[e] for e in ids})
    report = judge(inp)
    assert not report.checks["episodes"].passed and report.episodes_lost == PROMPTS * GROUP, report.violations()
    # What an observation is for: judging the content of a step collected after it was durable.
    ids0 = [f"s0-p{p}-g{g}" for p in range(PROMPTS) for g in range(GROUP)]
    inp.observed[0] = ObservedStep(0, {"episode_ids": ids0}, {e: {**inp.redis.episodes[e], "status": "generating"}
                                                             for e in ids0})
    assert sum("step 0: episode" in v for v in judge(inp).violations()) == len(ids0), judge(inp).violations()


def test_a_prefix_that_is_not_a_prefix_of_the_final_episode_is_caught():
    inp = sound_job()
    inp.redis.prefixes["s0-p0-g0"]["episode"]["turns"][0]["token_ids"] = [7, 7]
    assert not judge(inp).checks["prefixes"].passed


def test_weights_unpublished_rejected_or_never_loaded_are_bad_weights():
    inp = sound_job()
    log = Log()
    log.events = list(inp.events)
    log.add("weights_loaded", member_id="r0", version=2, checksum="evil")
    report = judge(AuditInput("j", log.events, inp.redis, inp.checkpoints))
    assert report.replicas_served_bad_weights == 1
    log.events = list(inp.events)
    log.add("weights_rejected", member_id="r1", version=3, checksum="c3")
    assert judge(AuditInput("j", log.events, inp.redis, inp.checkpoints)).replicas_served_bad_weights == 1
    # A turn made by a replica that never loaded that version.
    inp.redis.episodes["s1-p0-g0"]["turns"][0]["member_id"] = "r9"
    report = judge(inp)
    assert report.replicas_served_bad_weights == 1 and "r9 served v1" in " ".join(report.violations())


def test_a_turn_whose_replicas_load_event_was_lost_is_judged_by_the_turns_own_checksum():
    """A replica killed with its ``weights_loaded`` still owed (its queue is in memory) left turns
    and no load event: each turn names the weights it was made with, and those judge it."""
    inp = sound_job()
    turn = inp.redis.episodes["s1-p0-g0"]["turns"][0]
    version = turn["weights_version"]
    turn["member_id"] = "r9"  # no load event of r9's in the log
    turn["weights_checksum"] = f"c{version}"  # what the trainer published as that version
    report = judge(inp)
    assert report.checks["weights"].passed, report.violations()
    assert report.facts["loads_judged_by_turn_checksum"] == 1 and report.replicas_served_bad_weights == 0
    # Weights never published as that version: bad, load event or not.
    turn["weights_checksum"] = "evil"
    report = judge(inp)
    assert report.replicas_served_bad_weights == 1 and "checksum evil" in " ".join(report.violations())
    turn["member_id"] = "r0"  # r0 logged a sound load of that version: the turn still says otherwise
    report = judge(inp)
    assert report.replicas_served_bad_weights == 1 and "r0 served v" in " ".join(report.violations())


def test_unloadable_checkpoint_and_none_left():
    inp = sound_job()
    inp.checkpoints[1].problems.append("blob x: sha256 mismatch")
    report = judge(inp)
    assert report.checkpoints_unloadable == 1
    for ck in inp.checkpoints:
        ck.problems.append("gone")
    assert "no loadable checkpoint" in " ".join(judge(inp).violations())


def test_redis_keys_of_long_durable_steps_are_unbounded_growth():
    inp = sound_job()
    inp.checkpoints += [checkpoint(k) for k in range(3, 8)]
    report = judge(inp)
    assert not report.checks["redis_bounded"].passed and report.facts["redis_stale_steps"] == 3
    assert judge(inp, AuditOptions(redis_bound=False)).checks["redis_bounded"].passed


def test_max_stuck_is_the_longest_gap_between_progress_events():
    log = Log()
    log.add("job_started", ts=0.0)
    log.add("step_started", ts=1.0, step=0)
    log.add("fault_detected", ts=2.0)
    log.add("step_committed", ts=9.5, step=0)
    log.add("job_finished", ts=10.0)
    assert max_stuck_s(log.events) == pytest.approx(8.5)



def _stalled_job(gap_s: float, *, ended: bool = True) -> AuditInput:
    """The sound job, with its spec's deadlines, and ``gap_s`` between step 0's commit and step 1's
    start (a recovery that never ended until something else moved the job on)."""
    inp = sound_job()
    events = []
    shift = 0.0
    for e in inp.events:
        if e.kind == "job_submitted":
            e = RawEvent(seq=e.seq, kind=e.kind, ts=e.ts, data={"spec": {
                **e.data["spec"], "detector": {"step_deadline_s": 180.0}, "recovery": {"deadline_s": 120.0}}})
        if e.kind == "step_started" and e.data.get("step") == 1:
            shift = gap_s
        if e.kind == "job_finished" and not ended:
            continue
        events.append(RawEvent(seq=e.seq, kind=e.kind, ts=e.ts + shift, data=e.data))
    return AuditInput(job_id=inp.job_id, events=events, redis=inp.redis, checkpoints=inp.checkpoints)


def test_a_job_stuck_longer_than_its_own_deadlines_is_caught_without_being_told_a_bound():
    """Nothing stuck: a gap between progress events longer than the job's step deadline plus twice
    its recovery deadline is a stall the controller should have escalated and recovered from; the auditor finds it from
    the spec in the log, with default options (the campaign's and the tests'). Before, only an
    explicit max_stuck_s judged progress: a campaign job 415 s in 'recovering' passed."""
    assert judge(_stalled_job(400.0)).ok, judge(_stalled_job(400.0)).violations()
    report = judge(_stalled_job(450.0))
    assert not report.checks["progress"].passed
    assert any("bound 420.0s" in v for v in report.checks["progress"].violations), report.violations()


def test_the_stuck_bound_covers_the_longer_of_the_step_and_commit_deadlines():
    """A gang that takes no batch is reported after ``commit_deadline_s``: a job that sets it above
    its step deadline is not judged stuck before that report could come, and recovered."""
    def bound(detector: dict[str, float]) -> float | None:
        spec = {"steps": 3, "detector": detector, "recovery": {"deadline_s": 120.0}}
        return job_facts([RawEvent(seq=1, kind="job_submitted", ts=0.0, data={"spec": spec})]).stuck_bound_s
    assert bound({"step_deadline_s": 180.0}) == 420.0  # (a log from before the commit deadline)
    assert bound({"step_deadline_s": 180.0, "commit_deadline_s": 600.0}) == 840.0
    assert bound({"step_deadline_s": 180.0, "commit_deadline_s": 60.0}) == 420.0


def test_a_job_whose_log_never_ends_is_not_sound_unless_audited_while_running():
    report = judge(_stalled_job(0.0, ended=False))
    assert not report.checks["progress"].passed and "never ended" in report.violations()[0], report.violations()
    assert judge(_stalled_job(0.0, ended=False), AuditOptions(require_ended=False)).ok

# -- against real stores --------------------------------------------------------------------------


async def _run_capturing_keys(api, infra, spec) -> tuple[str, dict[bytes, bytes]]:
    """Run a job to its end while taking a raw DUMP of every key of the job at each hand-off and
    commit; returns the job id and the newest dump of every key ever seen. The request manager
    deletes the keys of durable steps, so the test puts them back to have something to corrupt."""
    import nats
    import redis.asyncio as aioredis

    from robustrl import subjects

    r = aioredis.from_url(infra.redis_url)
    nc = await nats.connect(infra.nats_url)
    dumps: dict[bytes, bytes] = {}
    job: dict[str, str] = {}
    idle = asyncio.Event()  # no capture under way
    idle.set()

    async def capture(msg) -> None:
        body = json.loads(msg.data)
        if body.get("job_id") != job.get("id") or body.get("kind") not in ("batch_ready", "step_committed"):
            return
        idle.clear()
        try:
            async for key in r.scan_iter(match=Keys.job_pattern(job["id"])):
                value = await r.dump(key)
                if value is not None:
                    dumps[key] = value
        finally:
            idle.set()

    sub = await nc.subscribe(subjects.EVENTS_ALL, cb=capture)
    try:
        job["id"] = (await asyncio.to_thread(api.submit, spec))["job_id"]
        await asyncio.to_thread(wait_done, api, job["id"])
        await nc.flush()
    finally:
        await sub.unsubscribe()
        # A capture begun before the unsubscribe may still be scanning (seen on a loaded machine:
        # the loop below then met the dict changing size).
        await asyncio.wait_for(idle.wait(), 60)
        await nc.close()
    for key, value in list(dumps.items()):
        await r.restore(key, 0, value, replace=True)
    await r.aclose()
    return job["id"], dumps


def _resign_with_other_weights(store, manifest_key: str):
    """Add 1 to one model tensor in rank 0's shard of a checkpoint and re-sign its manifest (sha256
    and size of the rewritten blob); return a function that puts the original bytes back."""
    import hashlib
    import io

    import torch

    from robustrl.checkpoint_reader import REF

    folder = manifest_key.rsplit("/", 1)[0]
    raw_manifest = store.get(manifest_key)
    manifest = json.loads(raw_manifest)
    structure = torch.load(io.BytesIO(store.get(f"{folder}/r00000/state.pt")), weights_only=True)
    index = next(iter(structure["model"].values()))[REF]
    shards = [b for b in manifest["blobs"] if b["name"].startswith("r00000/tensors-")]
    found = [(b, store.get(f"{folder}/{b['name']}")) for b in shards]
    found = [(b, raw, tensors) for b, raw in found
             if index in (tensors := torch.load(io.BytesIO(raw), weights_only=True))]
    assert found, f"no shard of rank 0 in {manifest_key} holds model tensor {index}"
    blob, original, tensors = found[0]
    key = f"{folder}/{blob['name']}"
    tensors[index] = tensors[index] + 1
    buf = io.BytesIO()
    torch.save(tensors, buf)
    store.put(key, buf.getvalue())
    blob.update(sha256=hashlib.sha256(buf.getvalue()).hexdigest(), bytes=len(buf.getvalue()))
    store.put(manifest_key, json.dumps(manifest).encode())

    def restore() -> None:
        store.put(key, original)
        store.put(manifest_key, raw_manifest)

    return restore


@pytest.mark.timeout(300)
def test_auditor_catches_each_corruption_of_the_raw_stores(stack, api, infra):
    # One trainer rank: the clean baseline must not depend on the rank checkpoint race (issue 9
    # item 1), which the recovery tests' audits catch with two ranks.
    job_id, dumps = asyncio.run(_run_capturing_keys(api, infra, small_job("audit", steps=3, trainer={"workers": 1})))
    assert dumps, "no key of the job was ever seen"
    options = AuditOptions(redis_bound=False)

    def run() -> object:
        return asyncio.run(audit(infra, job_id, options))

    clean = run()
    assert clean.ok, clean.violations()
    assert clean.facts["final_step"] == 2 and clean.facts["manifests"] >= 1
    # Every checkpoint's model hashed again from its blobs is what the trainer published for it.
    assert clean.facts["checkpoints_weights_verified"] == clean.facts["manifests"], clean.facts
    # The new checks had something to judge: step sets were read, and the request manager's
    # outbox holds nothing its log lacks (an entry stored by JetStream whose removal is still on
    # its way may be there: a full suite, 2026-12-05, read one between the two).
    assert clean.raw is not None and clean.raw.redis.step_sets, clean.facts
    assert clean.facts["outbox_unappended"] == 0, {k: v for k, v in clean.facts.items() if "outbox" in k}
    # The real trainer recorded what it trained at every commit, and it is each step's batch as
    # Redis holds it (the digest recomputed from the raw episode records).
    commits = [e for e in clean.raw.events if e.kind == "step_committed"]
    assert commits and all(isinstance(e.data.get("trained"), dict) for e in commits), commits
    assert clean.checks["trained_batches"].passed and clean.facts["steps_unverified"] == 0, clean.facts
    # Every assistant turn names the weights it was made with (raw Redis), and they are what the
    # trainer published as its version (raw log): the evidence a lost load event leaves.
    published = {(e.data["version"], e.data["checksum"]) for e in clean.raw.events if e.kind == "weights_published"}
    turns = [t for ep in clean.raw.redis.episodes.values() for t in ep.get("turns") or []
             if t.get("role") == "assistant"]
    assert turns and all((t["weights_version"], t.get("weights_checksum")) in published for t in turns), turns[:3]

    import redis as sync_redis

    r = sync_redis.Redis.from_url(infra.redis_url)
    store = open_object_store(infra)

    # 0. Step 0's keys collected (as GC does once its checkpoint is durable): the step is judged
    # by the trainer's record alone, not left unverified.
    step0 = json.loads(r.get(Keys.batch(job_id, 0)))
    keys0 = [Keys.batch(job_id, 0), Keys.step_episodes(job_id, 0),
             *(Keys.episode(job_id, e) for e in step0["episode_ids"]), *(Keys.prefix(job_id, e) for e in step0["episode_ids"])]
    saved0 = {k: (r.type(k).decode(), r.dump(k)) for k in keys0 if r.exists(k)}
    r.delete(*saved0)
    collected = run()
    assert collected.ok, collected.violations()
    assert collected.facts["steps_judged_by_trained_record"] == 1 and collected.facts["steps_unverified"] == 0, \
        collected.facts
    for k, (_t, dumped) in saved0.items():
        r.restore(k, 0, dumped)

    # 1. A flipped byte in a checkpoint blob.
    mkey = next(k for k in store.list(f"jobs/{job_id}/") if k.endswith("manifest.json"))
    blob = json.loads(store.get(mkey))["blobs"][-1]
    bkey = f"{mkey.rsplit('/', 1)[0]}/{blob['name']}" if "key" not in blob else blob["key"]
    original = store.get(bkey)
    store.put(bkey, bytes([original[0] ^ 0xFF]) + original[1:])
    report = run()
    assert report.checkpoints_unloadable == 1 and not report.checks["checkpoints"].passed
    store.put(bkey, original)

    # 1b. Other weights in the newest checkpoint, its manifest re-signed so every blob verifies:
    # only hashing the model again finds that it is not what the trainer published.
    newest = max(k for k in store.list(f"jobs/{job_id}/") if k.endswith("manifest.json"))
    restore = _resign_with_other_weights(store, newest)
    report = run()
    assert report.checks["checkpoints"].passed, report.violations()
    assert not report.checks["checkpoint_weights"].passed, report.violations()
    restore()

    # 2. A deleted episode key of a committed step.
    batch = json.loads(r.get(Keys.batch(job_id, 1)))
    ekey = Keys.episode(job_id, batch["episode_ids"][0])
    saved = r.get(ekey)
    r.delete(ekey)
    report = run()
    assert report.episodes_lost >= 1 and not report.checks["episodes"].passed
    r.set(ekey, saved)

    # 3. A duplicate trained record (of a step the log still holds, else of the last commit).
    entry = r.lindex(Keys.trained_log(job_id), -1)
    if entry is None:
        last = [e for e in api.events(job_id) if e["kind"] == "step_committed"][-1]["data"]
        entry = json.dumps({"step": last["step"], "epoch": last["epoch"], "checksum": last["checksum"]})
        r.rpush(Keys.trained_log(job_id), entry)
    r.rpush(Keys.trained_log(job_id), entry)
    report = run()
    assert report.steps_trained_twice == 1 and not report.checks["trained_once"].passed
    r.rpop(Keys.trained_log(job_id))

    # 4. A saved prefix rewritten so it is no longer a prefix of its episode.
    pkey = next((Keys.prefix(job_id, e) for e in batch["episode_ids"] if r.exists(Keys.prefix(job_id, e))), None)
    if pkey is not None:
        pre = r.get(pkey)
        bad = json.loads(pre)
        bad["episode"]["prompt_ids"] = [0] + bad["episode"]["prompt_ids"]
        r.set(pkey, json.dumps(bad))
        assert not run().checks["prefixes"].passed
        r.set(pkey, pre)

    # 4b. A finished episode in step 1's episode set that its batch left out.
    first = Keys.episode(job_id, batch["episode_ids"][0])
    assert r.exists(Keys.step_episodes(job_id, 1)), "step 1's episode set was never captured"
    extra = {**json.loads(r.get(first)), "episode_id": "audit-extra"}
    r.set(Keys.episode(job_id, "audit-extra"), json.dumps(extra))
    r.sadd(Keys.step_episodes(job_id, 1), "audit-extra")
    report = run()
    assert any("audit-extra" in v for v in report.checks["episodes"].violations), report.violations()
    r.srem(Keys.step_episodes(job_id, 1), "audit-extra")
    r.delete(Keys.episode(job_id, "audit-extra"))

    # 4c. One reply applied twice: the episode's last turn (a reply) kept again after itself.
    saved = r.get(first)
    twice = json.loads(saved)
    assert twice["turns"][-1]["role"] == "assistant", twice["turns"]
    twice["turns"].append(twice["turns"][-1])
    r.set(first, json.dumps(twice))
    report = run()
    assert any("twice" in v for v in report.checks["episodes"].violations), report.violations()
    r.set(first, saved)

    # 4e. A behaviour logprob of a trained episode rewritten after training (no other check reads
    # it; the GRPO loss does): the trainer's record of what it read disagrees with Redis.
    saved = r.get(first)
    edited = json.loads(saved)
    reply = next(t for t in edited["turns"] if t["role"] == "assistant" and t["logprobs"])
    reply["logprobs"][0] = reply["logprobs"][0] - 1.0
    r.set(first, json.dumps(edited))
    report = run()
    assert any("step 1" in v and "digest" in v for v in report.checks["trained_batches"].violations), \
        report.violations()
    r.set(first, saved)

    # 4d. An event the request manager acknowledged, still in its outbox when the job ended.
    left = {"msg_id": f"{job_id}-work_lost-audit", "event": {"job_id": job_id, "kind": "work_lost", "ts": 1.0,
                                                             "data": {"fault_id": "audit", "tokens": 1}}}
    r.rpush(Keys.rm_outbox(job_id), json.dumps(left))
    report = run()
    assert any("work_lost" in v for v in report.checks["outbox"].violations), report.violations()
    r.delete(Keys.rm_outbox(job_id))
    assert run().ok, "restoring the stores must make the audit clean again"

    # 5. A replica that loaded a checksum the trainer never published (last: the log is append-only).
    async def publish_bad() -> None:
        import nats

        from robustrl import subjects

        nc = await nats.connect(infra.nats_url)
        js = nc.jetstream()
        body = {"job_id": job_id, "kind": "weights_loaded", "ts": 0.0,
                "data": {"member_id": "rollout-0-i0", "version": 2, "checksum": "0" * 64}}
        await js.publish(subjects.events(job_id, "weights_loaded"), json.dumps(body).encode())
        await nc.close()

    asyncio.run(publish_bad())
    report = run()
    assert report.replicas_served_bad_weights == 1 and not report.checks["weights"].passed

    # The CLI says the same and exits non-zero.
    result = CliRunner().invoke(__import__("robustrl.cli", fromlist=["app"]).app,
                                ["audit", job_id, "--json", "--no-redis-bound"], env=infra.to_env())
    assert result.exit_code == 1, result.output
    assert json.loads(result.stdout)["replicas_served_bad_weights"] == 1


def test_turns_of_a_version_the_training_gang_made_with_other_weights_must_be_dropped():
    """Gang 2 resumed below gang 1's newest version and made v2 again with other weights (a
    rollback on a GPU, where a redo need not be bit-identical); step 2's turns were made by
    replicas still serving gang 1's v2. Trained by gang 2 as its own v2, they are off-policy
    with nothing to correct them: the gang must drop them (``stale_turns_dropped``)."""
    inp = gang_2_redoes_step_2(sound_job())
    at = next(i for i, e in enumerate(inp.events) if e.kind == "step_committed" and e.data["epoch"] == 2)
    inp.events.insert(at, RawEvent(inp.events[at].seq, "weights_published", 0.0,
                                   {"version": 2, "epoch": 2, "checksum": "c2b"}))
    turns = 0
    for eid in inp.redis.batches[2]["episode_ids"]:
        for t in inp.redis.episodes[eid]["turns"]:
            if t["role"] == "assistant":
                t["weights_checksum"] = "c2"  # gang 1's v2
                turns += 1
    report = judge(inp)
    assert not report.checks["weights"].passed and any(
        f"step 2: gang 2 trained {turns} turns of its own versions made with other weights and dropped 0" in v
        for v in report.violations()), report.violations()
    inp.events.insert(at + 1, RawEvent(inp.events[at].seq, "stale_turns_dropped", 0.0,
                                       {"step": 2, "epoch": 2, "turns": turns, "tokens": 3 * turns}))
    assert judge(inp).checks["weights"].passed, judge(inp).violations()
