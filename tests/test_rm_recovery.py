"""The request manager in a real job on the real stack: killed (SIGKILL) mid-step and started again,
it resumes the step from Redis; over a long job Redis holds only what recovery needs.

Everything is judged from outside: raw Redis values read while the job runs (each step's batch and
episodes the moment the batch appears, before garbage collection may take them), the memory Redis
reports for the job's keys, and the job's event log.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from typing import Any

import pytest
import redis
from jobs import kinds, small_job, wait_done, wait_step
from support import audit_sampled, eventually, sample_batches

from robustrl.storage.redis_stores import EpisodeRecord, Keys

pytestmark = pytest.mark.timeout(720)
POLL_S = 0.01


class Observer(threading.Thread):
    """Polls Redis for a job: each batch and its episodes when the batch first appears, and the
    memory of all the job's keys at that moment."""

    def __init__(self, redis_url: str, job_id: str) -> None:
        super().__init__(daemon=True)
        self.r = redis.Redis.from_url(redis_url)
        self.job = job_id
        self.steps: dict[int, tuple[dict[str, Any], dict[str, EpisodeRecord]]] = {}
        self.memory: dict[int, tuple[int, int]] = {}  # step -> (bytes, keys) when its batch appeared
        self.errors: list[str] = []
        self._halt = threading.Event()

    def __enter__(self) -> Observer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._halt.set()
        self.join(5)
        self.r.close()

    def job_bytes(self) -> tuple[int, int]:
        keys = list(self.r.scan_iter(match=f"rrl:{self.job}:*", count=1000))
        return sum(self.r.memory_usage(k) or 0 for k in keys), len(keys)

    def run(self) -> None:
        while not self._halt.is_set():
            for key in self.r.scan_iter(match=Keys.batch(self.job, "*"), count=1000):  # type: ignore[arg-type]
                step = int(key.decode().rsplit(":", 1)[1])
                if step not in self.steps:
                    self._take(step, key)
            time.sleep(POLL_S)  # a poll interval of an observer thread, not a wait for a condition

    def _take(self, step: int, key: bytes) -> None:
        raw = self.r.get(key)
        if raw is None:
            return
        batch = json.loads(raw)
        ids = batch["episode_ids"]
        values = self.r.mget([Keys.episode(self.job, e) for e in ids]) if ids else []
        eps = {e: EpisodeRecord.model_validate_json(v) for e, v in zip(ids, values, strict=True) if v is not None}
        if len(eps) != len(ids):
            self.errors.append(f"step {step}: {len(ids) - len(eps)} episodes of the batch missing from Redis")
        self.steps[step] = (batch, eps)
        self.memory[step] = self.job_bytes()


def _raw_episodes(url: str, job: str, step: int) -> dict[str, EpisodeRecord]:
    r = redis.Redis.from_url(url)
    try:
        ids = sorted(m.decode() for m in r.smembers(Keys.step_episodes(job, step)))
        return {e: EpisodeRecord.model_validate_json(r.get(Keys.episode(job, e))) for e in ids}
    finally:
        r.close()


def _full_batches(obs: Observer, committed: int, per_step: int) -> None:
    assert not obs.errors, obs.errors
    for k in range(committed + 1):
        assert k in obs.steps, f"committed step {k}: its batch was never in Redis"
        batch, eps = obs.steps[k]
        assert len(set(batch["episode_ids"])) == per_step, f"step {k}: {len(batch['episode_ids'])} episodes"
        assert all(ep.status == "finished" and ep.reward is not None for ep in eps.values()), f"step {k}"


def test_request_manager_killed_mid_step_resumes_the_step_without_rerunning_finished_work(api, infra, stack):
    spec = small_job("rmkill", steps=8, tools={"latency_s": 0.6}, data={"tasks": ["lookup"]})
    jid = api.submit(spec)["job_id"]
    sampler = sample_batches(infra.redis_url, jid)
    with Observer(infra.redis_url, jid) as obs:
        wait_step(api, jid, 1, timeout=300)  # members import torch: slow on a loaded machine
        step = api.job(jid)["step"]
        r = redis.Redis.from_url(infra.redis_url)
        # Mid-step: some episodes of the running step are past their tool call, none handed over.
        eventually(lambda: r.keys(Keys.prefix(jid, f"s{step}-*")), timeout=60, interval=0.005,
                   what="a tool-turn prefix of the running step")
        r.close()
        # SIGKILL; the stack's supervisor starts it again (a new process needs seconds to import
        # before it touches Redis: the raw state read right after the kill is what it resumes).
        stack.crash_service("request_manager")
        at_kill = _raw_episodes(infra.redis_url, jid, step)
        handed_at_kill = step in obs.steps
        status = wait_done(api, jid, timeout=300)
    events = api.events(jid)
    assert at_kill and not handed_at_kill, "not killed mid-step"
    # It resumed the step it was killed in, keeping what was finished.
    [resumed] = [d for d in kinds(events, "rm_resumed") if d["step"] == step]  # one new life, one resume
    finished = {e for e, ep in at_kill.items() if ep.status == "finished"}
    assert resumed["finished"] == len(finished) and resumed["unfinished"] == len(at_kill) - len(finished)
    _, final = obs.steps[step]
    for eid, before in at_kill.items():
        after = final[eid]
        if before.status == "finished":
            assert after == before, f"finished episode {eid} was run again"
        else:
            # Every turn applied before the kill is kept as it was (same dispatch, same tokens).
            assert after.turns[: len(before.turns)] == before.turns, f"{eid}: a finished turn was redone"
    _full_batches(obs, status["committed_step"], 16)
    # Nothing else was restarted: no member, no step regenerated from scratch.
    assert not [d for d in kinds(events, "decision") if "RestartWholeJob" in d["actions"]]
    assert sum(1 for d in kinds(events, "step_started") if d["step"] == step) == 1
    assert len(kinds(events, "member_started")) == 4
    # The auditor over the raw stores, every batch sampled at hand-off: the turn in flight at the
    # kill applied once (its late reply and its re-dispatch are not both in the episode), one
    # request id per turn, nothing lost.
    audit_sampled(infra, jid, sampler)


@pytest.mark.heavy  # a 60-step job (64-78 s under the suite's load): bench/heavy.py, and bench/redis_memory.py's 200 steps
def test_redis_memory_stays_flat_over_a_long_job(api, infra):
    # Flat after warm-up, against the samples from step 10 on (each taken when its step's batch
    # appears): a key left behind per step is 50 keys more here (keys judged by their peak).
    # Issue 9's 200-step job, with its slope, is the benchmark's (bench/redis_memory.py).
    steps, warm = 60, 10
    jid = api.submit(small_job("rmflat", steps=steps))["job_id"]
    with Observer(infra.redis_url, jid) as obs:
        status = wait_done(api, jid, timeout=600)
    _full_batches(obs, status["committed_step"], 16)
    warm_bytes, warm_keys = obs.memory[warm]
    later = {k: v for k, v in obs.memory.items() if k >= warm}

    def sampled(lo: int, hi: int) -> list[int]:
        return [b for s, (b, _) in obs.memory.items() if lo <= s < hi]

    # A sample's bytes swing with what is in flight as it is taken (28-64 kB here with 58 keys
    # throughout: steps not yet collected while the durable checkpoint lags, events still in the
    # outboxes while JetStream lags under load): one early sample (1.76x later, a CI-like run) and
    # the floors over ten steps (one early dip, 1.27x) each failed a full run. So the typical late
    # sample (the median of the last ten steps) is judged against the most seen early (the peak
    # of steps 10-19): something left behind every step lifts the one past the other (~300 B a
    # step, 12 kB over the 40 steps between, passes 1.15x here); a passing backlog does neither.
    early, late = max(sampled(warm, warm + 10)), statistics.median(sampled(steps - 10, steps))
    print(f"redis bytes of job {jid}: step {warm} {warm_bytes} B / {warm_keys} keys; peak over steps "
          f"{warm}-{warm + 9} {early} B, median over steps {steps - 10}-{steps - 1} {late:.0f} B")
    assert late <= 1.15 * early, later
    assert max(n for _, n in later.values()) <= 1.5 * warm_keys, later
