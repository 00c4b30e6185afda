"""Request manager + agent worker: owns each step's episodes.

For step k it samples prompts, creates G episodes per prompt in Redis, dispatches each
episode's next turn to the least-loaded live replica holding an allowed weights version,
runs tool calls, saves the whole tool-turn prefix to Redis *before* the next turn is
dispatched, scores finished episodes and hands the batch to the trainer exactly once.

When the controller reports a replica dead, that replica's in-flight turns are re-dispatched
from the episode's last saved prefix (at most the one turn in flight is regenerated).
Never imports torch.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import statistics
import time
import uuid
from dataclasses import dataclass, field

from robustrl.bus import Bus
from robustrl.config import JobSpec
from robustrl.errors import RequestTimeout
from robustrl.messages import (
    BatchGet, BatchReady, ControlCommand, GenerateTurn, MemberHello, MetricsSample, ProbeReply, ProbeRequest,
    SpecReply, SpecRequest,
    StepCommitted, TurnResult, WeightsHave,
)
from robustrl.model.tokenizer import CharTokenizer
from robustrl.rl import tasks
from robustrl.rl.tools import ToolService
from robustrl.storage.redis_stores import BatchRecord, BatchStore, EpisodeRecord, EpisodeStore, TurnRecord
from robustrl.subjects import Verb, all_jobs, all_jobs_exact, subject

log = logging.getLogger(__name__)
STEP_RETRY_S = 1.0


class Redispatch(Exception):
    """The replica serving a turn was declared dead; retry the turn from the saved prefix."""


@dataclass
class Replica:
    member_id: str
    version: int = -1
    checksum: str = ""
    inflight: set[str] = field(default_factory=set)
    alive: bool = True


@dataclass
class Pending:
    episode_id: str
    member_id: str
    future: asyncio.Future[TurnResult]


class JobRunner:
    """Drives one job's steps on the request-manager side."""

    def __init__(self, bus: Bus, redis: object, job_id: str, spec: JobSpec, start_step: int) -> None:
        self.bus = bus
        self.job_id = job_id
        self.spec = spec
        self.episodes = EpisodeStore(redis, job_id)  # type: ignore[arg-type]
        self.batches = BatchStore(redis, job_id)  # type: ignore[arg-type]
        self.tok = CharTokenizer.default()
        self.tools = ToolService(spec.seed)
        self.replicas: dict[str, Replica] = {}
        self.dead: set[str] = set()  # member ids are per incarnation: a dead one never comes back
        self.pending: dict[str, Pending] = {}
        self.step = start_step
        self.committed = start_step - 1
        self.trainer_version = -1
        self.gang_epoch = 0  # newest trainer gang heard from: commits of older gangs are stale
        self.step_epoch = 0  # bumped by restart_step: in-flight work of older epochs is discarded
        self.tool_waiting = 0
        self.generating = 0
        self.stats = {"redispatched": 0, "tokens_discarded": 0, "tool_failures": 0}
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._step_task: asyncio.Task[BatchReady] | None = None
        self._current: list[EpisodeRecord] = []
        self._started_once = start_step > 0
        self.paused = False

    # --- membership -------------------------------------------------------------------------

    def on_have(self, msg: WeightsHave) -> None:
        if msg.member_id in self.dead:
            return
        rep = self.replicas.setdefault(msg.member_id, Replica(msg.member_id))
        rep.version, rep.checksum, rep.alive = msg.version, msg.checksum, True
        self._changed.set()

    def on_hello(self, msg: MemberHello) -> None:
        if msg.role == "trainer":
            self.gang_epoch = max(self.gang_epoch, msg.epoch)
        if msg.role == "rollout" and msg.member_id not in self.dead:
            self.replicas.setdefault(msg.member_id, Replica(msg.member_id))
            self._changed.set()

    def replica_dead(self, member_id: str) -> int:
        """Fail that replica's in-flight turns so their episodes re-dispatch from the prefix."""
        self.dead.add(member_id)
        rep = self.replicas.get(member_id)
        if rep is None:
            rep = self.replicas[member_id] = Replica(member_id)
        rep.alive = False
        n = 0
        for req_id in list(rep.inflight):
            pend = self.pending.pop(req_id, None)
            if pend and not pend.future.done():
                pend.future.set_exception(Redispatch(member_id))
                n += 1
        rep.inflight.clear()
        self._changed.set()
        return n

    def on_commit(self, msg: StepCommitted) -> None:
        if msg.epoch < self.gang_epoch:
            # An old gang still running after its replacement said hello (it is being stopped):
            # its steps are not this lineage's and must not move the job on.
            log.warning("ignoring step %d committed by stale gang %d (current gang %d)",
                        msg.step, msg.epoch, self.gang_epoch)
            return
        self.gang_epoch = msg.epoch
        self.committed = max(self.committed, msg.step)
        self.trainer_version = max(self.trainer_version, msg.weights_version)
        self._changed.set()

    def on_turn(self, msg: TurnResult) -> None:
        pend = self.pending.pop(msg.request_id, None)
        if pend is None:
            return  # a late reply from a replica already declared dead, or a superseded request
        rep = self.replicas.get(pend.member_id)
        if rep:
            rep.inflight.discard(msg.request_id)
        if not pend.future.done():
            pend.future.set_result(msg)
        self._changed.set()

    # --- dispatch ---------------------------------------------------------------------------

    def _min_version(self, step: int) -> int:
        return max(0, step - self.spec.staleness)

    async def _pick_replica(self, step: int) -> Replica:
        need = self._min_version(step)
        while True:
            ready = [r for r in self.replicas.values() if r.alive and r.version >= need]
            if ready:
                return min(ready, key=lambda r: (len(r.inflight), r.member_id))
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), 1.0)
            except asyncio.TimeoutError:
                pass

    async def _generate(self, ep: EpisodeRecord, action: tasks.Generate, step: int) -> TurnResult:
        while True:
            rep = await self._pick_replica(step)
            req_id = uuid.uuid4().hex[:16]
            fut: asyncio.Future[TurnResult] = asyncio.get_running_loop().create_future()
            self.pending[req_id] = Pending(ep.episode_id, rep.member_id, fut)
            rep.inflight.add(req_id)
            msg = GenerateTurn(
                job_id=self.job_id, request_id=req_id, episode_id=ep.episode_id, step=step,
                prefix_ids=ep.prefix_ids(), max_new_tokens=self.spec.rollout.max_new_tokens,
                temperature=self.spec.rollout.temperature, top_p=self.spec.rollout.top_p,
                seed=tasks.request_seed(self.spec.seed, ep.episode_id, len(ep.turns)),
                stop_on_call=action.stop_on_call, min_version=self._min_version(step))
            await self.bus.publish(subject(self.job_id, Verb.GENERATE, rep.member_id), msg)
            try:
                return await fut
            except Redispatch:
                self.stats["redispatched"] += 1
                ep.redispatches += 1
                prefix = ep.prefix_ids()
                await self.bus.emit_event(self.job_id, "episode_redispatched", {
                    "episode_id": ep.episode_id, "member_id": rep.member_id, "step": step,
                    "prefix_turns": len(ep.turns), "prefix_len": len(prefix),
                    "prefix_sha": hashlib.sha256(json.dumps(prefix).encode()).hexdigest()})

    async def _run_episode(self, ep: EpisodeRecord, step: int, timing: dict[str, float]) -> None:
        prompt = tasks.Prompt.from_dict(ep.prompt)
        while True:
            turns = [tasks.Turn(t.role, t.token_ids, t.logprobs, t.weights_version, t.stop_reason)
                     for t in ep.turns]
            action = tasks.next_action(prompt, turns, self.tok, self.spec.rollout.max_turns)
            if isinstance(action, tasks.Finish):
                break
            if isinstance(action, tasks.Generate):
                ep.status = "generating"
                self.generating += 1
                try:
                    res = await self._generate(ep, action, step)
                finally:
                    self.generating -= 1
                ep.turns.append(TurnRecord(role="assistant", token_ids=res.token_ids, logprobs=res.logprobs,
                                           weights_version=res.weights_version, stop_reason=res.stop_reason,
                                           member_id=res.member_id))
                continue
            ep.status = "tool_wait"
            self.tool_waiting += 1
            t0 = time.monotonic()
            try:
                cfg = self.spec.tools
                result = await self.tools.call(action.tool, action.arg, latency_s=cfg.latency_s,
                                               timeout_s=cfg.timeout_s, retries=cfg.retries,
                                               backoff_s=cfg.backoff_s)
            finally:
                self.tool_waiting -= 1
                timing["tool_wait_s"] += time.monotonic() - t0
            if not result.ok:
                self.stats["tool_failures"] += 1
                await self.bus.emit_event(self.job_id, "tool_fault", {
                    "tool": action.tool, "error": result.error, "attempts": result.attempts,
                    "episode_id": ep.episode_id, "step": step})
            ep.turns.append(TurnRecord(role="tool", token_ids=tasks.tool_turn_ids(result.text, self.tok)))
            # The tool-turn prefix is durable before the next turn is dispatched.
            await self.episodes.save_prefix(ep)
        turns = [tasks.Turn(t.role, t.token_ids, t.logprobs, t.weights_version, t.stop_reason) for t in ep.turns]
        ep.reward = tasks.score(prompt, turns, self.tok)
        ep.status = "finished"
        await self.episodes.put(ep)

    async def _make_episodes(self, step: int) -> list[EpisodeRecord]:
        existing = await self.episodes.step_episode_ids(step)
        if existing:
            eps = await self.episodes.get_many(existing)
            # Resume from each episode's last durable prefix (request-manager restart).
            out = []
            for ep in eps:
                saved = await self.episodes.load_prefix(ep.episode_id) if ep.status != "finished" else None
                out.append(saved or ep)
            return out
        prompts = tasks.sample_prompts(list(self.spec.data.tasks), step, self.spec.data.prompts_per_step,
                                       self.spec.seed)
        eps = []
        for prompt in prompts:
            for g in range(self.spec.data.group_size):
                ep = EpisodeRecord(job_id=self.job_id, episode_id=f"s{step}-{prompt.prompt_id}-g{g}", step=step,
                                   group_id=f"s{step}-{prompt.prompt_id}", prompt=prompt.to_dict(),
                                   prompt_ids=tasks.initial_prompt_ids(prompt, self.tok))
                eps.append(ep)
        for ep in eps:
            await self.episodes.put(ep)
        return eps

    async def run_step(self, step: int) -> BatchReady:
        """Generate every episode of ``step``; hand the batch over (stored first, then announced)."""
        t0 = time.monotonic()
        timing = {"tool_wait_s": 0.0}
        # The job's very first step starts once its members are up: start-up is the same for
        # every recovery policy and is reported apart (job_ready), not as lost training time.
        first = step == 0 and self.step_epoch == 0 and not self._started_once
        if not first:
            await self.bus.emit_event(self.job_id, "step_started", {"step": step, "epoch": self.step_epoch})
        # Sync/semi-sync: every serving replica must hold an allowed version before the step's
        # turns go out (replicas still starting are not waited for: they join when loaded).
        need = self._min_version(step)
        await self._wait(lambda: any(r.alive and r.version >= need for r in self.replicas.values()) and all(
            r.version >= need for r in self.replicas.values() if r.alive and r.version >= 0))
        weight_sync_s = time.monotonic() - t0
        if first:
            self._started_once = True
            await self.bus.emit_event(self.job_id, "job_ready", {"startup_s": weight_sync_s})
            await self.bus.emit_event(self.job_id, "step_started", {"step": step, "epoch": self.step_epoch})
            t0, weight_sync_s = time.monotonic(), 0.0
        eps = await self._make_episodes(step)
        self._current = eps
        todo = [ep for ep in eps if ep.status != "finished"]
        await asyncio.gather(*(self._run_episode(ep, step, timing) for ep in todo))
        rewards = [ep.reward or 0.0 for ep in eps]
        wall = time.monotonic() - t0
        n = max(1, len(eps))
        # Episodes overlap, so per-episode tool wait is averaged to give the step's share.
        rollout_s = wall - weight_sync_s
        timing = {"rollout_s": rollout_s, "tool_wait_s": timing["tool_wait_s"] / n,
                  "generation_s": max(0.0, rollout_s - timing["tool_wait_s"] / n), "weight_sync_s": weight_sync_s}
        batch = BatchRecord(job_id=self.job_id, step=step, episode_ids=[e.episode_id for e in eps],
                            reward_mean=statistics.fmean(rewards), timings=timing)
        await self.batches.put(batch)
        ready = BatchReady(job_id=self.job_id, step=step, episode_ids=batch.episode_ids,
                           reward_mean=batch.reward_mean, timings=timing)
        await self.bus.publish(subject(self.job_id, Verb.BATCH), ready)
        await self.bus.emit_event(self.job_id, "batch_ready", {"step": step, "reward_mean": batch.reward_mean,
                                                               **timing})
        return ready

    async def _wait(self, predicate: object) -> None:
        while not predicate():  # type: ignore[operator]
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), 1.0)
            except asyncio.TimeoutError:
                pass

    async def run(self) -> None:
        """Sync/semi-sync/async loop: step k starts once its weights are available (staleness bound)."""
        while self.step < self.spec.steps:
            step = self.step
            # Step k needs version >= k - staleness on some replica, and the trainer must have
            # committed step k - 1 - staleness (bounded lag between rollout and training).
            await self._wait(lambda: self.committed >= step - 1 - self.spec.staleness and not self.paused)
            self._step_task = asyncio.create_task(self.run_step(step))
            try:
                await self._step_task
            except asyncio.CancelledError:
                if self._task and self._task.cancelling():
                    raise
                continue  # restart_step: same step again from scratch
            except Exception:
                # Redis or NATS trouble mid-step: the episodes resume from their saved prefixes.
                log.exception("job %s: step %d failed; retrying from the saved prefixes", self.job_id, step)
                await asyncio.sleep(STEP_RETRY_S)
                continue
            self.step += 1
        log.info("job %s: all %d steps generated", self.job_id, self.spec.steps)

    async def restart_step(self, fault_id: str | None = None) -> None:
        """Whole-job restart: drop the current step's in-flight work and generate it from scratch."""
        self.paused = True
        lost = sum(len(t.token_ids) for ep in self._current for t in ep.turns if t.role == "assistant")
        if self._step_task and not self._step_task.done():
            self._step_task.cancel()
            try:
                await self._step_task
            except (asyncio.CancelledError, Exception):
                pass
        for pend in self.pending.values():
            if not pend.future.done():
                pend.future.cancel()
        self.pending.clear()
        for rep in self.replicas.values():
            rep.inflight.clear()
            rep.alive = False
        self.dead.update(self.replicas)  # every member is being replaced
        self.replicas.clear()
        n = await self.episodes.clear_step(self.step)
        await self.batches.delete(self.step)  # a batch handed over mid-restart must not survive
        self.step_epoch += 1
        self._current = []
        if fault_id:
            await self.bus.emit_event(self.job_id, "work_lost", {"fault_id": fault_id, "tokens": lost,
                                                                 "steps_redone": 0, "episodes": n})
        log.warning("job %s: step %d restarted from scratch (%d episodes dropped)", self.job_id, self.step, n)

    def start(self) -> None:
        self._task = asyncio.create_task(self.run())

    def sample(self, seq: int) -> MetricsSample:
        return MetricsSample(job_id=self.job_id, member_id="request_manager", role="request_manager", seq=seq,
                             ts=time.time(), phase="generating" if self.generating else "idle", step=self.step,
                             inflight=len(self.pending), tool_waiting=self.tool_waiting,
                             queue_depth=self.generating)


class RequestManager:
    """The service: one JobRunner per job, created when the controller says resume."""

    def __init__(self, bus: Bus, redis: object) -> None:
        self.bus = bus
        self.redis = redis
        self.jobs: dict[str, JobRunner] = {}
        # Sequence numbers only grow, across restarts too (the detector drops older samples).
        self._seq = int(time.time() * 1000)

    async def start(self) -> None:
        b = self.bus
        await b.subscribe(all_jobs_exact(Verb.CONTROL, "request_manager"), ControlCommand, self._on_control)
        await b.subscribe(all_jobs_exact(Verb.TURN), TurnResult, self._route(lambda j, m: j.on_turn(m)))
        await b.subscribe(all_jobs(Verb.HAVE), WeightsHave, self._route(lambda j, m: j.on_have(m)))
        await b.subscribe(all_jobs(Verb.HELLO), MemberHello, self._route(lambda j, m: j.on_hello(m)))
        await b.subscribe(all_jobs_exact(Verb.COMMIT), StepCommitted, self._route(lambda j, m: j.on_commit(m)))
        await b.subscribe(all_jobs_exact(Verb.BATCH_GET), BatchGet, self._on_batch_get)
        await b.subscribe(all_jobs_exact(Verb.PROBE, "request_manager"), ProbeRequest, self._on_probe)

    async def _on_probe(self, msg: ProbeRequest, _subject: str, reply: str | None) -> None:
        job = self.jobs.get(msg.job_id)
        phase = "generating" if job and job.generating else "idle"
        await self.bus.respond(reply, ProbeReply(member_id="request_manager", nonce=msg.nonce, phase=phase))

    def _route(self, fn: object):  # type: ignore[no-untyped-def]
        async def handler(msg, _subject, _reply):  # type: ignore[no-untyped-def]
            job = self.jobs.get(msg.job_id)
            if job:
                fn(job, msg)  # type: ignore[operator]
        return handler

    async def _on_batch_get(self, msg: BatchGet, _subject: str, reply: str | None) -> None:
        job = self.jobs.get(msg.job_id)
        batch = await job.batches.get(msg.step) if job else None
        if batch is None:
            batch = await BatchStore(self.redis, msg.job_id).get(msg.step)  # type: ignore[arg-type]
        if not reply:
            return
        if batch is None:
            # Not ready: an empty answer at once, so the trainer goes back to waiting for the
            # BatchReady broadcast instead of sitting in a request timeout.
            await self.bus.respond(reply, BatchReady(job_id=msg.job_id, step=msg.step, episode_ids=[],
                                                     reward_mean=0.0))
            return
        await self.bus.respond(reply, BatchReady(job_id=batch.job_id, step=batch.step,
                                                 episode_ids=batch.episode_ids, reward_mean=batch.reward_mean,
                                                 timings=batch.timings))

    async def _ensure_job(self, job_id: str, start_step: int | None = None) -> JobRunner | None:
        job = self.jobs.get(job_id)
        if job:
            return job
        try:
            reply = await self.bus.request(subject(job_id, Verb.SPEC),
                                           SpecRequest(job_id=job_id, member_id="request_manager"), SpecReply)
        except RequestTimeout:
            log.error("job %s: controller did not send the spec", job_id)
            return None
        spec = JobSpec.parse(reply.spec)
        step = start_step if start_step is not None else (reply.resume_step or 0)
        job = self.jobs[job_id] = JobRunner(self.bus, self.redis, job_id, spec, step)
        return job

    async def _on_control(self, msg: ControlCommand, _subject: str, reply: str | None) -> None:
        if msg.action == "resume":
            job = await self._ensure_job(msg.job_id, msg.args.get("start_step"))
            if job:
                job.paused = False
                job.committed = max(job.committed, int(msg.args.get("committed", job.committed)))
                for mid in msg.args.get("replicas_dead", []):
                    job.replica_dead(mid)
                if job._task is None:
                    job.start()
                job._changed.set()
        elif msg.action == "replica_dead":
            job = self.jobs.get(msg.job_id)
            if job:
                n = job.replica_dead(str(msg.args["member_id"]))
                # Each re-dispatched turn is regenerated at most once, at most max_new_tokens long.
                await self.bus.emit_event(msg.job_id, "work_lost", {
                    "fault_id": msg.args.get("fault_id"), "turns": n,
                    "tokens": n * job.spec.rollout.max_new_tokens, "steps_redone": 0})
                log.warning("job %s: replica %s dead, %d turns re-dispatched", msg.job_id,
                            msg.args["member_id"], n)
        elif msg.action == "restart_step":
            job = self.jobs.get(msg.job_id)
            if job:
                await job.restart_step(msg.args.get("fault_id"))
        elif msg.action == "pause":
            job = self.jobs.get(msg.job_id)
            if job:
                job.paused = True
        elif msg.action == "stop":
            job = self.jobs.pop(msg.job_id, None)
            if job and job._task:
                job._task.cancel()
        elif msg.action == "tool_outage":
            job = self.jobs.get(msg.job_id)
            if job:
                job.tools.set_outage(time.monotonic() + float(msg.args.get("duration_s", 5.0)))
        if reply:
            await self.bus.respond(reply, msg)

    async def metrics_loop(self, interval: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            for job in list(self.jobs.values()):
                self._seq += 1
                try:
                    await self.bus.publish(subject(job.job_id, Verb.METRICS, "request_manager"),
                                           job.sample(self._seq))
                except Exception as exc:
                    log.debug("metrics: %s", exc)
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except asyncio.TimeoutError:
                pass
