"""GRPO: group-relative advantages and the clipped-ratio surrogate over assistant tokens.

Each episode is one sequence: prompt, assistant turns and tool turns concatenated. Only tokens
the policy generated are trained on (``loss_mask``); prompt and tool-result tokens are context.
Old logprobs are the ones the rollout engine recorded (the logprobs of the distribution it sampled
from), so in sync mode the first update's ratio is 1 up to numerics and the clip bounds how far a
turn can pull. With staleness > 0 (semi-sync, async) a turn may come from an older policy than the
one being updated: ``train_on_samples(..., is_cap=C)`` then takes the clipped ratio against the
current policy before the update (the proximal policy, one extra forward pass per micro-batch without gradient)
and weights each token by the truncated importance ratio ``min(pi_prox / pi_behaviour, C)``
(decoupled PPO with truncated importance sampling), so a stale turn is neither trusted as on-policy
nor allowed an unbounded weight.
"""

from __future__ import annotations

import contextlib

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from robustrl.model.engine import in_top_p
from robustrl.model.tokenizer import CharTokenizer
from robustrl.rl.tasks import Prompt, Turn, initial_prompt_ids

LOG_RATIO_MAX = 20.0
"""Bound on a token's log importance ratio before exp (``grpo_loss``)."""


@dataclass
class TrainSample:
    """One episode as the trainer sees it; the three lists are aligned token by token."""

    episode_id: str
    group_id: str
    token_ids: list[int]
    loss_mask: list[int]
    old_logprobs: list[float]
    reward: float
    stale_turns: int = 0
    """Assistant turns older than the staleness bound: kept as context, not trained on."""
    stale_tokens: int = 0


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(reward - group mean) / (group std + eps), per group.

    The std is the population std (divide by n): a group of identical rewards gets advantage 0
    for every member, and a group of one gets 0 too.
    """
    rewards = rewards.to(torch.float32)
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    n_groups = counts.numel()
    sums = torch.zeros(n_groups, dtype=torch.float32).index_add_(0, inverse, rewards)
    means = sums / counts
    centered = rewards - means[inverse]
    var = torch.zeros(n_groups, dtype=torch.float32).index_add_(0, inverse, centered**2) / counts
    return centered / (var.sqrt()[inverse] + eps)


def group_index(group_ids: Sequence[str]) -> torch.Tensor:
    """String group ids to a dense int tensor (first appearance order)."""
    index: dict[str, int] = {}
    return torch.tensor([index.setdefault(g, len(index)) for g in group_ids], dtype=torch.long)


def build_samples(
    episodes: Sequence[tuple[Prompt, Sequence[Turn], float]],
    tokenizer: CharTokenizer,
    episode_ids: Sequence[str] | None = None,
    min_version: int | None = None,
    lineage: Mapping[int, str] | None = None,
) -> list[TrainSample]:
    """Turn finished episodes into samples; group = prompt id.

    Every assistant turn carries its behaviour version (``weights_version``) and logprobs; an
    episode's turns may come from different versions (a partial rollout continued across a weights
    update), and each is judged on its own.

    Args:
        episodes: (prompt, turns, reward) per episode.
        episode_ids: ids to carry; default ``<prompt_id>/<index of the episode in its group>``.
        min_version: oldest behaviour version the staleness bound admits (the step minus the
            staleness). An assistant turn of an older version is dropped from the loss (its
            tokens stay in the context, masked out) and counted in ``stale_turns`` /
            ``stale_tokens``. None: no bound.
        lineage: version -> checksum of the weights the training gang's own lineage holds for
            that version (its resume version and those it made since). An assistant turn of such
            a version made with other weights (a replica still serving a dead gang's version the
            new gang made again, after a rollback, with weights that differ), or of a version
            past those it made (the dead gang's, ahead of the checkpoint), is dropped the same
            way: its logprobs are not of the policy this lineage had. Versions older than its
            start are the ancestors' and are judged by ``min_version`` alone.

    Raises:
        ValueError: an assistant turn's logprobs do not match its tokens.
    """
    samples: list[TrainSample] = []
    seen: dict[str, int] = {}
    first = min(lineage) if lineage else None
    for n, (prompt, turns, reward) in enumerate(episodes):
        ids = initial_prompt_ids(prompt, tokenizer)
        mask = [0] * len(ids)
        old = [0.0] * len(ids)
        stale_turns = stale_tokens = 0
        for turn in turns:
            ids.extend(turn.token_ids)
            if turn.role == "assistant":
                if len(turn.logprobs) != len(turn.token_ids):
                    raise ValueError(f"episode {n}: assistant turn has {len(turn.token_ids)} tokens "
                                     f"but {len(turn.logprobs)} logprobs")
                stale = ((min_version is not None and turn.weights_version < min_version)
                         or (lineage is not None and _foreign(turn, lineage, first)))
                stale_turns += stale
                stale_tokens += len(turn.token_ids) if stale else 0
                mask.extend([0 if stale else 1] * len(turn.token_ids))
                old.extend(float(x) for x in turn.logprobs)
            else:
                mask.extend([0] * len(turn.token_ids))
                old.extend([0.0] * len(turn.token_ids))
        index = seen.get(prompt.prompt_id, 0)
        seen[prompt.prompt_id] = index + 1
        eid = episode_ids[n] if episode_ids is not None else f"{prompt.prompt_id}/{index}"
        samples.append(TrainSample(eid, prompt.prompt_id, ids, mask, old, float(reward), stale_turns, stale_tokens))
    return samples


def _foreign(turn: Turn, lineage: Mapping[int, str], first: int | None) -> bool:
    """Whether ``turn`` was made with weights its training lineage never held: a version of the
    lineage's range (from its start) that the lineage has not made (a dead gang ran ahead of the
    checkpoint the new one resumed from, and replicas still serve its newer versions), or one it
    made with other weights (by the replica's checksum, where it said one)."""
    if first is None or turn.weights_version < first:
        return False
    own = lineage.get(turn.weights_version)
    return own is None or (bool(turn.weights_checksum) and turn.weights_checksum != own)


def collate(samples: Sequence[TrainSample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad samples into tensors.

    Returns:
        ``input_ids``, ``attention_mask``, ``loss_mask`` (float), ``old_logprobs`` ([B, T]),
        ``rewards`` ([B]) and ``group_ids`` ([B], dense ints).
    """
    width = max(len(s.token_ids) for s in samples)
    batch = len(samples)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, width), dtype=torch.long)
    loss_mask = torch.zeros((batch, width), dtype=torch.float32)
    old = torch.zeros((batch, width), dtype=torch.float32)
    for b, s in enumerate(samples):
        n = len(s.token_ids)
        input_ids[b, :n] = torch.tensor(s.token_ids, dtype=torch.long)
        attention[b, :n] = 1
        loss_mask[b, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        old[b, :n] = torch.tensor(s.old_logprobs, dtype=torch.float32)
    # Position 0 has no predecessor, so it can never be a trained token.
    loss_mask[:, 0] = 0.0
    return {
        "input_ids": input_ids,
        "attention_mask": attention,
        "loss_mask": loss_mask,
        "old_logprobs": old,
        "rewards": torch.tensor([s.reward for s in samples], dtype=torch.float32),
        "group_ids": group_index([s.group_id for s in samples]),
    }


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   vocab: int | None = None, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    """Logprob of each token given the ones before it, [B, T]; column 0 is 0.

    Works for a bare model and a DDP wrapper (both return ``.logits``). The distribution is the
    one the engines sample from, so that these are logprobs of the same policy as the behaviour
    logprobs they are compared with:

    - ``vocab``: the tokenizer's size (a padded embedding's extra rows are no action);
    - ``temperature``: the logits are divided by it (the job's ``rollout.temperature``);
    - ``top_p`` < 1: only the smallest most-likely set of mass >= ``top_p`` (the engines' rule),
      renormalised there. The token itself always stays in the set: under the policy that
      sampled it, it was in it; under a newer one its probability is renormalised over the set
      plus itself instead of being -inf (a ratio of 0 and no gradient).

    Before, temperature and top-p were left out: with any setting but 1 and 1 the importance
    ratio was off from the first step (an outside review measured 0.13 nats a token at 0.6/0.95).
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    scaled = logits[:, :-1, :vocab].float() / temperature
    target = input_ids[:, 1:].unsqueeze(-1)
    if top_p < 1.0:
        scaled = scaled.masked_fill(~_top_p_keep(scaled, target, top_p), float("-inf"))
    picked = torch.log_softmax(scaled, dim=-1).gather(-1, target).squeeze(-1)
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)


TOP_P_ROWS = 512
"""Positions whose top-p set is found at once: the sort's temporaries (probabilities, sorted values,
int64 indices, cumulative sums) are each rows x vocabulary, for a chunk of rows, not the batch."""


@torch.no_grad()
def _top_p_keep(scaled: torch.Tensor, target: torch.Tensor, top_p: float) -> torch.Tensor:
    """Boolean [.., V]: each position's top-p set (the engines' rule: a token is kept while the
    mass of those more likely is below ``top_p``) plus its own token. Found :data:`TOP_P_ROWS`
    positions at a time: done whole, the sort's temporaries took about as much memory again as
    the rest of the forward (3.76 against 2.03 GiB at 1,024 positions of Qwen3's vocabulary, an
    outside review)."""
    flat = scaled.reshape(-1, scaled.shape[-1])
    keep = torch.zeros(flat.shape, dtype=torch.bool, device=flat.device)
    for start in range(0, flat.shape[0], TOP_P_ROWS):
        rows = slice(start, start + TOP_P_ROWS)
        sorted_p, order = torch.softmax(flat[rows], dim=-1).sort(dim=-1, descending=True)
        keep[rows].scatter_(-1, order, in_top_p(sorted_p, top_p))
        del sorted_p, order
    keep = keep.reshape(scaled.shape)
    keep.scatter_(-1, target, True)
    return keep


def _bounded(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.clamp(log_ratio, -LOG_RATIO_MAX, LOG_RATIO_MAX)


def grpo_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    behaviour_logprobs: torch.Tensor | None = None,
    is_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped-ratio surrogate, averaged over the masked tokens of the whole batch.

    ``loss = -sum(mask * w * min(r * A, clip(r, 1 - eps, 1 + eps) * A)) / sum(mask)`` with
    ``r = exp(new - old)`` per token and ``A`` the episode's advantage ([B] or [B, T]). Without
    ``behaviour_logprobs`` ``w = 1`` (``old`` is the behaviour policy); with them, ``old`` is the
    proximal policy and ``w = min(exp(old - behaviour), is_cap)`` (no cap if ``is_cap`` is None),
    a constant of the gradient.

    Returns:
        (loss, stats) with ``clip_frac``, ``ratio_mean``, ``approx_kl`` (mean of old - new),
        ``tokens`` over the mask, and with behaviour logprobs ``is_weight_mean`` and
        ``is_truncated_frac``.
    """
    mask = mask.to(new_logprobs.dtype)
    adv = advantages.to(new_logprobs.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    # The log-ratio bounded before exp: one behaviour logprob far below the policy's made the
    # ratio inf, and the loss inf or NaN (NaN even under a mask: 0 x inf), so the step diverged
    # and so did its redo on the same batch (an outside review). exp(20) is finite, and the
    # clipped surrogate and the gradient-norm clip bound what such a token does.
    log_ratio = _bounded(new_logprobs - old_logprobs)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped)
    weight = None
    if behaviour_logprobs is not None:
        with torch.no_grad():
            raw = torch.exp(_bounded(old_logprobs - behaviour_logprobs.to(old_logprobs.dtype)))
            weight = raw if is_cap is None else torch.clamp(raw, max=is_cap)
        per_token = per_token * weight
    tokens = mask.sum().clamp(min=1.0)
    loss = (per_token * mask).sum() / tokens
    with torch.no_grad():
        was_clipped = ((ratio - 1.0).abs() > clip_eps).to(mask.dtype)
        stats = {
            "clip_frac": float((was_clipped * mask).sum() / tokens),
            "ratio_mean": float((ratio * mask).sum() / tokens),
            "approx_kl": float((-log_ratio * mask).sum() / tokens),
            "tokens": float(mask.sum()),
        }
        if weight is not None:
            stats["is_weight_mean"] = float((weight * mask).sum() / tokens)
            truncated = (raw > is_cap).to(mask.dtype) if is_cap is not None else torch.zeros_like(mask)
            stats["is_truncated_frac"] = float((truncated * mask).sum() / tokens)
    return loss, stats


def micro_batches(lengths: Sequence[int], budget: int | None) -> list[list[int]]:
    """Consecutive groups of sample indices whose padded size (count x longest) is at most
    ``budget`` token positions; a sample longer than the budget is a group of its own. None or
    a budget no group exceeds: one group of all."""
    if not lengths:
        return []
    if budget is None:
        return [list(range(len(lengths)))]
    groups: list[list[int]] = [[]]
    longest = 0
    for i, n in enumerate(lengths):
        wider = max(longest, n)
        if groups[-1] and wider * (len(groups[-1]) + 1) > budget:
            groups.append([])
            wider = n
        groups[-1].append(i)
        longest = wider
    return groups


def train_on_samples(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: Sequence[TrainSample],
    *,
    clip_eps: float,
    pad_id: int,
    advantages: torch.Tensor | None = None,
    max_grad_norm: float | None = 1.0,
    is_cap: float | None = None,
    vocab: int | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    micro_batch_tokens: int | None = None,
) -> dict[str, float]:
    """One optimizer step on ``samples``, in micro-batches of at most ``micro_batch_tokens``
    padded token positions each (:func:`micro_batches`; None: one forward for all), their
    gradients accumulated: the same step as one forward computes, within float error, in a
    fraction of its activation memory (the logits alone are positions x vocabulary floats:
    151,936 a position for Qwen3).

    Args:
        model: the policy or its DDP wrapper (gradients are averaged by DDP in ``backward``).
        advantages: per-sample advantages aligned with ``samples``; pass them when the samples are
            one rank's share of a batch, computed over the whole batch. Default: computed here
            from the samples' own groups.
        max_grad_norm: clip the gradient norm (None: no clipping).
        is_cap: off-policy correction (module docstring): the ratio is taken against the policy
            before this update and tokens are weighted by the importance ratio to the behaviour
            policy, truncated at ``is_cap``. None: the ratio is taken against the behaviour policy.
        vocab, temperature, top_p: the engines' sampling distribution (:func:`token_logprobs`).
        micro_batch_tokens: the most padded token positions one forward takes.

    Returns:
        loss, grad_norm, reward_mean, advantage_abs_mean and the :func:`grpo_loss` stats.
    """
    if not samples:
        raise ValueError("train_on_samples needs at least one sample")
    batch = collate(samples, pad_id)
    if advantages is None:
        advantages = group_advantages(batch["rewards"], batch["group_ids"])
    if advantages.shape[0] != len(samples):
        raise ValueError(f"{advantages.shape[0]} advantages for {len(samples)} samples")
    device = next(model.parameters()).device
    model.train()
    optimizer.zero_grad(set_to_none=True)
    groups = micro_batches([len(smp.token_ids) for smp in samples], micro_batch_tokens)
    total = batch["loss_mask"].sum().clamp(min=1.0)
    loss = torch.zeros((), device=device)
    stats: dict[str, float] = {}
    for k, rows in enumerate(groups):
        idx = torch.tensor(rows, dtype=torch.long)
        width = int(batch["attention_mask"][idx].sum(dim=1).max())  # right-padded: trim to the group's longest
        ids = batch["input_ids"][idx, :width].to(device)
        attn = batch["attention_mask"][idx, :width].to(device)
        mask = batch["loss_mask"][idx, :width].to(device)
        behaviour = batch["old_logprobs"][idx, :width].to(device)
        adv = advantages[idx].to(device)
        # DDP averages gradients over the ranks in the backward of the last group only; the
        # others accumulate locally (a rank's group count is its own: each rank syncs once).
        sync = k == len(groups) - 1 or not hasattr(model, "no_sync")
        with contextlib.nullcontext() if sync else model.no_sync():
            if is_cap is not None:
                with torch.no_grad():
                    proximal = token_logprobs(model, ids, attn, vocab, temperature, top_p)
                new = token_logprobs(model, ids, attn, vocab, temperature, top_p)
                part, part_stats = grpo_loss(new, proximal, adv, mask, clip_eps, behaviour_logprobs=behaviour,
                                             is_cap=is_cap)
            else:
                new = token_logprobs(model, ids, attn, vocab, temperature, top_p)
                part, part_stats = grpo_loss(new, behaviour, adv, mask, clip_eps)
            # The group's mean over its tokens, weighted by its share of the rank's tokens: the
            # sum over the groups is the mean over all of them, as one forward computed it.
            share = mask.sum() / total
            (part * share).backward()
        loss = loss + part.detach() * share
        weight = float(share)
        for key, value in part_stats.items():
            stats[key] = stats.get(key, 0.0) + (value if key == "tokens" else value * weight)
        del new, part
    grad_norm = 0.0
    if max_grad_norm is not None:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    return {"loss": float(loss.detach()), "grad_norm": grad_norm,
            "reward_mean": float(batch["rewards"].mean()),
            "advantage_abs_mean": float(advantages.abs().mean()), **stats}
