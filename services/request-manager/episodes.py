"""Tool orchestration: one episode's turns, tool calls and durable prefixes.

An episode alternates generated turns (through :class:`Dispatcher`) and tool calls until the task
says it is finished, then gets its reward. What makes it recoverable and idempotent:

* every applied turn is saved to Redis at once (the episode record, atomically with forgetting
  its dispatch), and after a tool turn the whole prefix is saved *before* the next turn is
  dispatched (the tool-turn prefix, the unit of rollout recovery);
* a run starts from the newest saved record, so a retried step or a restarted request manager
  continues where the episode was and never generates a finished turn again;
* a finished episode is never run again, and one episode never has two runs at once.
"""

from __future__ import annotations

import logging
import time
import uuid

from robustrl.services.request_manager.dispatch import Dispatcher

from robustrl.bus import Bus
from robustrl.config import JobSpec
from robustrl.errors import RobustRLError, TransportError
from robustrl.model.hf import load_tokenizer
from robustrl.rl import tasks
from robustrl.rl.tools import ToolService
from robustrl.storage.redis_stores import DispatchStore, EpisodeRecord, EpisodeStore, TurnRecord

log = logging.getLogger(__name__)


class EpisodeAlreadyRunning(RobustRLError):
    """A second run of an episode was started while one is in progress (a bug, never retried)."""


class EpisodeRunner:
    def __init__(self, bus: Bus, job_id: str, spec: JobSpec, store: EpisodeStore, dispatches: DispatchStore,
                 dispatcher: Dispatcher) -> None:
        self.bus = bus
        self.job_id = job_id
        self.spec = spec
        self.store = store
        self.dispatches = dispatches
        self.dispatcher = dispatcher
        # The char tokenizer, or the model directory's own tokenizer + chat template (no torch).
        self.tok = load_tokenizer(spec.model)
        self.tools = ToolService(spec.seed)
        self.running: set[str] = set()
        self.finished: set[str] = set()  # finished in this life, current step: never run again
        self.tool_waiting = 0
        self.generating = 0
        self.stats = {"tool_failures": 0, "tool_calls_refused": 0, "episodes_run": 0}

    async def make_episodes(self, step: int) -> tuple[list[EpisodeRecord], bool]:
        """The step's episodes: from Redis if it was started before (resumed: True), else new ones.

        A step's episodes are derived from (tasks, step, prompts per step, group size, seed), the
        same in every life. A request manager killed while it stored them (one write each) left
        the step's set with some of them: the next life resumed the step with those alone and
        handed over a short batch (seen in a full run: 2 of 16, the rest of the step lost). Now the
        missing ones are stored again and the step continues with all of them.
        """
        expected = self._new_episodes(step)
        existing = set(await self.store.step_episode_ids(step))
        if not existing:
            for ep in expected:
                await self.store.put(ep)
            return expected, False
        stored = {e.episode_id: e for e in await self.store.get_many(sorted(existing))}
        eps, missing = [], 0
        for ep in expected:
            if ep.episode_id in stored:
                eps.append(stored.pop(ep.episode_id))
            else:
                await self.store.put(ep)
                eps.append(ep)
                missing += 1
        eps.extend(stored[e] for e in sorted(stored))  # (none expected: kept, nothing is dropped)
        if missing:
            log.warning("job %s: step %d was started with %d of its %d episodes stored (a request manager "
                        "killed while it stored them): the %d missing stored again", self.job_id, step,
                        len(existing), len(expected), missing)
        return eps, True

    def _new_episodes(self, step: int) -> list[EpisodeRecord]:
        prompts = tasks.sample_prompts(list(self.spec.data.tasks), step, self.spec.data.prompts_per_step,
                                       self.spec.seed)
        return [EpisodeRecord(job_id=self.job_id, episode_id=f"s{step}-{prompt.prompt_id}-g{g}", step=step,
                              group_id=f"s{step}-{prompt.prompt_id}", prompt=prompt.to_dict(),
                              prompt_ids=tasks.initial_prompt_ids(prompt, self.tok))
                for prompt in prompts for g in range(self.spec.data.group_size)]

    async def run(self, ep: EpisodeRecord, step: int, timing: dict[str, float]) -> None:
        """Run ``ep`` from its saved state to its reward. A finished episode returns at once."""
        if ep.status == "finished" or ep.episode_id in self.finished:
            return
        if ep.episode_id in self.running:
            raise EpisodeAlreadyRunning(f"episode {ep.episode_id} is already running", episode=ep.episode_id)
        self.running.add(ep.episode_id)
        self.stats["episodes_run"] += 1
        try:
            await self._run(ep, step, timing)
            self.finished.add(ep.episode_id)
        finally:
            self.running.discard(ep.episode_id)

    def _turns(self, ep: EpisodeRecord) -> list[tasks.Turn]:
        return [tasks.Turn(t.role, t.token_ids, t.logprobs, t.weights_version, t.stop_reason) for t in ep.turns]

    async def _run(self, ep: EpisodeRecord, step: int, timing: dict[str, float]) -> None:
        prompt = tasks.Prompt.from_dict(ep.prompt)
        while True:
            action = tasks.next_action(prompt, self._turns(ep), self.tok, self.spec.rollout.max_turns)
            if isinstance(action, tasks.Finish):
                break
            if isinstance(action, tasks.Generate):
                ep.status = "generating"
                self.generating += 1
                try:
                    res, request_id = await self.dispatcher.generate(ep, step, action.stop_on_call)
                finally:
                    self.generating -= 1
                ep.turns.append(TurnRecord(role="assistant", token_ids=res.token_ids, logprobs=res.logprobs,
                                           weights_version=res.weights_version,
                                           weights_checksum=res.weights_checksum or None, stop_reason=res.stop_reason,
                                           member_id=res.member_id, request_id=request_id))
                await self.dispatches.applied(ep)  # the turn is durable before anything else happens
                continue
            await self._call_tool(ep, action, step, timing)
            # The tool-turn prefix is durable before the next turn is dispatched.
            await self.store.save_prefix(ep)
        ep.reward = tasks.score(prompt, self._turns(ep), self.tok)
        ep.status = "finished"
        await self.store.put(ep)

    async def _call_tool(self, ep: EpisodeRecord, action: tasks.CallTool, step: int,
                         timing: dict[str, float]) -> None:
        if action.error is not None:
            # The policy's mistake, not the tool service's: answered, no tool called, no fault
            # (the detector's tool-outage rule reads tool faults).
            self.stats["tool_calls_refused"] += 1
            ep.turns.append(TurnRecord(role="tool", token_ids=tasks.tool_turn_ids(
                f"error: {action.error}", self.tok, after=ep.turns[-1].token_ids)))
            return
        ep.status = "tool_wait"
        self.tool_waiting += 1
        t0 = time.monotonic()
        try:
            cfg = self.spec.tools
            result = await self.tools.call(action.tool, action.arg, latency_s=cfg.latency_s,
                                           timeout_s=cfg.timeout_s, retries=cfg.retries, backoff_s=cfg.backoff_s)
        finally:
            self.tool_waiting -= 1
            timing["tool_wait_s"] += time.monotonic() - t0
        if not result.ok:
            self.stats["tool_failures"] += 1
            fault = {"tool": action.tool, "error": result.error, "attempts": result.attempts,
                     "episode_id": ep.episode_id, "step": step}
            try:  # through the outbox (the detector's tool-outage rule reads it), once per call
                await self.dispatcher.record_event("tool_fault", fault, uuid.uuid4().hex)
            except TransportError as exc:  # Redis failed: appended from memory only, as before
                log.warning("job %s: tool_fault not saved in the outbox (%s): appended from memory", self.job_id, exc)
                await self.bus.emit_event(self.job_id, "tool_fault", fault)
        ep.turns.append(TurnRecord(role="tool", token_ids=tasks.tool_turn_ids(result.text, self.tok,
                                                                              after=ep.turns[-1].token_ids)))
