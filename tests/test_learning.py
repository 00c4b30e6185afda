"""End-to-end learning check without services: rollouts, tools, rewards and GRPO in one process.

The reference job must learn: mean reward over the last 5 of 30 steps clearly above the first 5.
"""

from __future__ import annotations

import asyncio
import time

import torch

from robustrl.config import JobSpec, reference_job
from robustrl.model.engine import GenerationEngine, GenRequest
from robustrl.model.policy import build_policy
from robustrl.model.tokenizer import CharTokenizer
from robustrl.rl.grpo import build_samples, train_on_samples
from robustrl.rl.tasks import (
    CallTool,
    Finish,
    Generate,
    Prompt,
    Turn,
    episode_ids,
    next_action,
    request_seed,
    sample_prompts,
    score,
    tool_turn,
)
from robustrl.rl.tools import ToolService


def rollout_step(job: JobSpec, engine: GenerationEngine, tools: ToolService, tok: CharTokenizer,
                 step: int) -> tuple[list[tuple[Prompt, list[Turn], float]], int]:
    """Run every episode of ``step`` to the end, batching each round of turns; return episodes, tool calls."""
    prompts = sample_prompts(job.data.tasks, step, job.data.prompts_per_step, job.seed)
    episodes = [(p, g, []) for p in prompts for g in range(job.data.group_size)]
    turns_of: list[list[Turn]] = [e[2] for e in episodes]
    done = [False] * len(episodes)
    tool_calls = 0
    for round_ in range(2 * job.rollout.max_turns + 1):
        gen: list[tuple[int, Generate]] = []
        calls: list[tuple[int, CallTool]] = []
        for i, (prompt, _, turns) in enumerate(episodes):
            if done[i]:
                continue
            action = next_action(prompt, turns, tok, job.rollout.max_turns)
            if isinstance(action, Finish):
                done[i] = True
            elif isinstance(action, Generate):
                gen.append((i, action))
            else:
                calls.append((i, action))
        if gen:
            requests = [
                GenRequest(f"{i}", episode_ids(episodes[i][0], turns_of[i], tok), job.rollout.max_new_tokens,
                           job.rollout.temperature, job.rollout.top_p,
                           seed=request_seed(job.seed, f"{episodes[i][0].prompt_id}/{episodes[i][1]}",
                                             len(turns_of[i])),
                           stop_on_call=a.stop_on_call)
                for i, a in gen
            ]
            for (i, _), res in zip(gen, engine.generate(requests), strict=True):
                turns_of[i].append(Turn("assistant", res.token_ids, res.logprobs, step, res.stop_reason))
        if calls:
            async def run_calls(batch: list[tuple[int, CallTool]] = calls) -> list:
                t = job.tools
                return await asyncio.gather(*(tools.call(c.tool, c.arg, latency_s=0.0, timeout_s=t.timeout_s,
                                                         retries=t.retries, backoff_s=t.backoff_s)
                                              for _, c in batch))
            for (i, _), result in zip(calls, asyncio.run(run_calls()), strict=True):
                turns_of[i].append(tool_turn(result.text, tok))
            tool_calls += len(calls)
        if all(done):
            break
    assert all(done), "episodes did not finish within the turn budget"
    return [(p, turns, score(p, turns, tok)) for p, _, turns in episodes], tool_calls


def train(job: JobSpec, steps: int) -> tuple[list[float], dict[str, list[float]], int]:
    """The in-process GRPO loop; returns the per-step mean reward, per-task curves, tool calls."""
    tok = CharTokenizer.default()
    policy = build_policy(job.model, tok, job.seed)
    engine = GenerationEngine(policy, tok, max_batch=job.rollout.max_batch)
    tools = ToolService(job.seed)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=job.trainer.lr, weight_decay=0.0)
    curve: list[float] = []
    per_task: dict[str, list[float]] = {t: [] for t in job.data.tasks}
    total_calls = 0
    for step in range(steps):
        episodes, calls = rollout_step(job, engine, tools, tok, step)
        total_calls += calls
        rewards = [r for _, _, r in episodes]
        curve.append(sum(rewards) / len(rewards))
        for task in per_task:
            rs = [r for p, _, r in episodes if p.task == task]
            per_task[task].append(sum(rs) / len(rs))
        train_on_samples(policy, optimizer, build_samples(episodes, tok), clip_eps=job.trainer.clip_eps,
                         pad_id=tok.pad_id)
    return curve, per_task, total_calls


def test_reference_job_learns() -> None:
    torch.set_num_threads(1)
    job = reference_job(steps=30, seed=0)
    start = time.perf_counter()
    curve, per_task, calls = train(job, job.steps)
    elapsed = time.perf_counter() - start
    first, last = sum(curve[:5]) / 5, sum(curve[-5:]) / 5
    print(f"\nreward curve ({elapsed:.1f}s, {calls} tool calls): " + " ".join(f"{r:.3f}" for r in curve))
    for task, rs in per_task.items():
        print(f"  {task}: " + " ".join(f"{r:.2f}" for r in rs))
    print(f"first5={first:.3f} last5={last:.3f}")
    # Every lookup episode calls its tool, from step 0 on.
    lookups = job.data.group_size * sum(1 for i in range(job.data.prompts_per_step)
                                        if job.data.tasks[i % len(job.data.tasks)] == "lookup")
    assert calls == lookups * job.steps
    # Seeded and deterministic on CPU; measured 0.080 -> 0.212 (seeds 1, 2: 0.077 -> 0.180,
    # 0.088 -> 0.187). The bar leaves room for numeric drift across torch builds.
    assert last > 1.5 * first and last > first + 0.05, f"no clear learning: first5={first:.3f} last5={last:.3f}"
    assert elapsed < 60


if __name__ == "__main__":
    test_reference_job_learns()
