"""The trainer's record of what it trained (``step_committed``'s ``trained``) lets the auditor
judge a step whose batch Redis has collected, and cross-check a live one against Redis.

Synthetic raw state (``test_audit.sound_job``), one defect each: every test here failed before
the auditor read the record (a collected step was only counted ``steps_unverified``). The real
trainer's record is checked against a real job in ``test_audit.py``'s integration test.
"""

from __future__ import annotations

import copy

from test_audit import Log, gang_2_redoes_step_2, sound_job

from robustrl.audit import AuditInput, judge
from robustrl.audit.raw import RawEvent
from robustrl.batch_digest import batch_digest


def with_records(inp: AuditInput) -> AuditInput:
    """Each commit carries what its gang trained: its step's batch, as the trainer reports it."""
    events = []
    for e in inp.events:
        if e.kind == "step_committed":
            ids = inp.redis.batches[e.data["step"]]["episode_ids"]
            trained = {"episodes": sorted(ids), "digest": batch_digest(inp.redis.episodes[i] for i in ids)}
            e = RawEvent(e.seq, e.kind, e.ts, {**e.data, "trained": trained})
        events.append(e)
    inp.events = events
    return inp


def collected(inp: AuditInput, *steps: int) -> AuditInput:
    """Redis garbage-collected these steps' keys (their checkpoints are durable)."""
    for k in steps:
        for eid in inp.redis.batches.pop(k)["episode_ids"]:
            inp.redis.episodes.pop(eid)
            inp.redis.prefixes.pop(eid, None)
        inp.redis.step_keys.pop(k, None)
    return inp


def edit_record(inp: AuditInput, step: int, edit) -> AuditInput:  # type: ignore[no-untyped-def]
    inp.events = [RawEvent(e.seq, e.kind, e.ts, {**e.data, "trained": edit(copy.deepcopy(e.data["trained"]))})
                  if e.kind == "step_committed" and e.data["step"] == step else e for e in inp.events]
    return inp


def test_collected_steps_are_judged_by_the_trainers_record():
    inp = collected(with_records(sound_job()), 0, 1)
    report = judge(inp)
    assert report.ok, report.violations()
    assert report.facts["steps_unverified"] == 0
    assert report.facts["steps_judged_by_trained_record"] == 2


def test_a_collected_step_that_trained_fewer_episodes_lost_them():
    inp = collected(edit_record(with_records(sound_job()), 0, lambda t: {**t, "episodes": t["episodes"][1:]}), 0)
    report = judge(inp)
    assert not report.checks["trained_batches"].passed
    assert report.episodes_lost == 1, report.violations()
    assert any("step 0" in v and "3 distinct episodes" in v for v in report.violations()), report.violations()


def test_an_episode_trained_in_two_steps_is_named():
    inp = with_records(sound_job())
    again = inp.redis.batches[0]["episode_ids"][0]
    inp = collected(edit_record(inp, 1, lambda t: {**t, "episodes": sorted([again, *t["episodes"][1:]])}), 0, 1)
    report = judge(inp)
    assert any(again in v and "steps 0 and 1" in v for v in report.checks["trained_batches"].violations), \
        report.violations()


def test_a_redo_that_trained_another_batch_is_named():
    inp = with_records(gang_2_redoes_step_2(sound_job()))
    assert judge(inp).ok, judge(inp).violations()
    # Gang 2's redo of step 2 read other records than gang 1's training of it (an episode
    # changed between the two, or another batch): whatever the final model learnt, step 2's
    # batch as first trained is not what the lineage trained.
    redo = [e for e in inp.events if e.kind == "step_committed" and e.data["epoch"] == 2][0]
    inp.events = [RawEvent(e.seq, e.kind, e.ts, {**e.data, "trained": {**e.data["trained"], "digest": "0" * 64}})
                  if e is redo else e for e in inp.events]
    report = judge(inp)
    assert any("step 2" in v and "gang 2" in v for v in report.checks["trained_batches"].violations), \
        report.violations()


def test_a_live_step_whose_records_differ_from_what_was_trained_is_named():
    inp = with_records(sound_job())
    eid = inp.redis.batches[1]["episode_ids"][2]
    inp.redis.episodes[eid]["turns"][0]["token_ids"] = [1, 7]  # rewritten after training
    report = judge(inp)
    assert any("step 1" in v and "digest" in v for v in report.checks["trained_batches"].violations), \
        report.violations()


def test_a_trained_set_other_than_the_batch_is_named():
    inp = with_records(sound_job())
    other = inp.redis.batches[2]["episode_ids"][0]
    inp = edit_record(inp, 1, lambda t: {**t, "episodes": sorted([other, *t["episodes"][1:]])})
    report = judge(inp)
    assert any("step 1" in v and "batch" in v for v in report.checks["trained_batches"].violations), \
        report.violations()


def test_an_unreadable_record_is_a_violation_not_a_crash():
    for bad in ("x", {"episodes": "s0", "digest": 1}, {"episodes": [1, 2], "digest": "d"}, None):
        inp = edit_record(with_records(sound_job()), 0, lambda _t, bad=bad: bad)
        report = judge(inp)
        assert any("step 0" in v and "does not parse" in v for v in report.checks["trained_batches"].violations), \
            (bad, report.violations())


def test_commits_without_a_record_are_left_to_the_other_checks():
    """A log from a trainer before the record (or a synthetic one): no check of it, as before."""
    report = judge(sound_job())
    assert report.ok and report.facts["steps_judged_by_trained_record"] == 0
    assert Log  # the synthetic log builder is shared with test_audit


def test_the_trainers_record_and_the_auditors_digest_agree_on_a_record_as_redis_holds_it():
    """The trainer digests the records it loaded (pydantic models, dumped); the auditor digests
    the raw JSON it reads from Redis. One record written by another encoder (an int reward and
    logprob, keys in another order, non-ASCII text) must digest the same both ways, and a change
    to the prompt training reads (its id groups the GRPO advantages) must change it."""
    import json

    from robustrl.services.trainer.worker import _trained_record

    from robustrl.storage.redis_stores import EpisodeRecord

    raw = ('{"turns": [{"token_ids": [3, 4], "role": "assistant", "logprobs": [-1, -0.5], "weights_version": 0,'
           ' "stop_reason": "eot"}], "reward": 1, "status": "finished", "prompt_ids": [1, 2], "step": 0,'
           ' "group_id": "g0", "episode_id": "s0-p0-g0", "job_id": "j",'
           ' "prompt": {"prompt_id": "p0", "text": "héllo", "answer": 7}}')
    trained = _trained_record([EpisodeRecord.model_validate_json(raw)])
    assert trained["episodes"] == ["s0-p0-g0"]
    assert trained["digest"] == batch_digest([json.loads(raw)])
    other_prompt = json.loads(raw)
    other_prompt["prompt"]["prompt_id"] = "p1"
    assert batch_digest([other_prompt]) != trained["digest"]


def test_a_live_step_whose_prompt_was_rewritten_after_training_is_named():
    """Training reads the prompt record (its id groups the advantages), not only its tokens: an
    outside review rewrote a prompt id after training and the check passed."""
    inp = sound_job()
    for ep in inp.redis.episodes.values():
        ep["prompt"] = {"prompt_id": ep["episode_id"].split("-")[1], "text": "q"}
    inp = with_records(inp)
    eid = inp.redis.batches[0]["episode_ids"][1]
    inp.redis.episodes[eid]["prompt"]["prompt_id"] = "elsewhere"
    report = judge(inp)
    assert any("step 0" in v and "digest" in v for v in report.checks["trained_batches"].violations), \
        report.violations()
