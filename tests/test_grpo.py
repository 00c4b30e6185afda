"""GRPO math against hand computations, sample building, one training step."""

from __future__ import annotations

import math

import pytest
import torch

from robustrl.config import ModelSpec
from robustrl.model.policy import build_policy, weights_checksum
from robustrl.model.tokenizer import CharTokenizer
from robustrl.rl.grpo import (
    build_samples,
    collate,
    group_advantages,
    group_index,
    grpo_loss,
    micro_batches,
    token_logprobs,
    train_on_samples,
)
from robustrl.rl.tasks import Prompt, Turn, tool_turn

torch.set_num_threads(1)
TOK = CharTokenizer.default()


def test_group_advantages_by_hand() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2])
    groups = torch.tensor([0, 0, 1, 1, 2])
    adv = group_advantages(rewards, groups, eps=0.0 + 1e-6)
    # group 0: mean 0.5, population std 0.5 -> +1, -1; group 1: std 0 -> 0; group 2: single -> 0
    assert adv.tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0, 0.0], abs=1e-5)
    mixed = group_advantages(torch.tensor([3.0, 1.0, 2.0]), torch.tensor([7, 7, 7]), eps=0.0)
    std = math.sqrt(2 / 3)
    assert mixed.tolist() == pytest.approx([1 / std, -1 / std, 0.0])
    assert group_index(["b", "a", "b"]).tolist() == [0, 1, 0]


def test_grpo_loss_by_hand() -> None:
    old = torch.tensor([[0.0, -1.0, -1.0, -2.0]])
    new = torch.tensor([[0.0, -1.0, -1.0 + math.log(1.5), -2.0 + math.log(0.5)]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    # ratios 1, 1.5, 0.5 with A = +2: min(r A, clip(r) A) = 2, 2.4, 1.0 -> loss = -(5.4) / 3
    loss, stats = grpo_loss(new, old, torch.tensor([2.0]), mask, clip_eps=0.2)
    assert float(loss) == pytest.approx(-5.4 / 3)
    assert stats["clip_frac"] == pytest.approx(2 / 3)
    assert stats["tokens"] == 3
    # A = -1: min(-r, -clip(r)) = -1, -1.5, -0.8 -> loss = 3.3 / 3
    loss, _ = grpo_loss(new, old, torch.tensor([-1.0]), mask, clip_eps=0.2)
    assert float(loss) == pytest.approx(3.3 / 3)


def test_grpo_loss_gradient_zero_when_clipped() -> None:
    new = torch.tensor([[math.log(1.5)]], requires_grad=True)
    loss, _ = grpo_loss(new, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), clip_eps=0.2)
    loss.backward()
    assert new.grad is not None and float(new.grad) == 0.0


@pytest.mark.parametrize("old", [-95.0, -1e30, -float("inf")])
@pytest.mark.parametrize("advantage", [-1.0, 0.0])
def test_a_behaviour_logprob_far_below_the_policy_gives_a_finite_loss_and_gradient(old: float,
                                                                                    advantage: float) -> None:
    """One behaviour logprob far below the policy's (a hostile or broken replica's reply; the
    request manager refuses non-finite and positive ones): exp(new - old) was inf, the loss inf
    (A < 0) or NaN (A = 0, or the token masked out: 0 x inf), the step diverged and so did its
    redo on the kept batch (an outside review). The log-ratio is bounded now: the loss and the
    gradient stay finite, masked tokens count for nothing, and with an importance weight too."""
    new = torch.tensor([[-0.5, -0.7]], requires_grad=True)
    olds = torch.tensor([[old, -0.7]])
    for mask in (torch.tensor([[1.0, 1.0]]), torch.tensor([[0.0, 1.0]])):
        for behaviour in (None, torch.tensor([[old, -0.7]])):
            loss, stats = grpo_loss(new, olds if behaviour is None else torch.tensor([[-0.5, -0.7]]),
                                    torch.tensor([advantage]), mask, clip_eps=0.2, behaviour_logprobs=behaviour,
                                    is_cap=None)
            new.grad = None
            loss.backward()
            assert math.isfinite(float(loss)) and all(math.isfinite(v) for v in stats.values()), (loss, stats)
            assert new.grad is not None and torch.isfinite(new.grad).all(), new.grad
            if mask[0, 0] == 0 and behaviour is None:
                # the masked token is out of the loss: as if its behaviour logprob were the policy's
                same, _ = grpo_loss(new.detach(), torch.tensor([[-0.5, -0.7]]), torch.tensor([advantage]), mask,
                                    clip_eps=0.2)
                assert float(loss) == pytest.approx(float(same))


def test_truncated_importance_weight_by_hand() -> None:
    """Off-policy turns: the ratio is taken against the proximal policy and each token weighted by
    min(pi_prox / pi_behaviour, cap), a constant of the gradient."""
    behaviour = torch.tensor([[-1.0, -1.0, -1.0]])
    prox = torch.tensor([[-1.0, -1.0 + math.log(1.5), -1.0 + math.log(4.0)]])  # w = 1, 1.5, 4 -> cap 2
    new = (prox + torch.tensor([[0.0, math.log(1.1), math.log(0.5)]])).requires_grad_(True)  # r = 1, 1.1, 0.5
    mask = torch.ones(1, 3)
    loss, stats = grpo_loss(new, prox, torch.tensor([1.0]), mask, clip_eps=0.2,
                            behaviour_logprobs=behaviour, is_cap=2.0)
    # per token -w * min(r A, clip(r) A): -1*min(1, 1), -1.5*min(1.1, 1.1), -2*min(0.5, 0.8)
    assert loss.detach().item() == pytest.approx(-(1.0 + 1.65 + 1.0) / 3)
    assert stats["is_weight_mean"] == pytest.approx((1 + 1.5 + 2) / 3)
    assert stats["is_truncated_frac"] == pytest.approx(1 / 3)
    loss.backward()
    # d/dnew of -w r A / 3 = -w r / 3 where the unclipped term is the min (here every token)
    assert new.grad is not None
    assert new.grad.tolist()[0] == pytest.approx([-1 / 3, -1.5 * 1.1 / 3, -2 * 0.5 / 3], rel=1e-5)
    # without a cap the weight is the raw ratio; without behaviour logprobs, plain GRPO
    uncapped, _ = grpo_loss(new.detach(), prox, torch.tensor([1.0]), mask, clip_eps=0.2,
                            behaviour_logprobs=behaviour, is_cap=None)
    assert float(uncapped) == pytest.approx(-(1.0 + 1.65 + 4 * 0.5) / 3)
    plain, _ = grpo_loss(new.detach(), prox, torch.tensor([1.0]), mask, clip_eps=0.2)
    assert float(plain) == pytest.approx(-(1.0 + 1.1 + 0.5) / 3)


def test_train_step_with_off_policy_correction_runs_one_extra_forward_and_reports_weights() -> None:
    model = build_policy(ModelSpec(), TOK, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    samples = build_samples([episode(1.0, "p0"), episode(0.0, "p0")], TOK)
    stats = train_on_samples(model, opt, samples, clip_eps=0.2, pad_id=TOK.pad_id, is_cap=2.0)
    # the behaviour logprobs above are made up (not the model's): weights differ from 1 and some
    # are truncated at the cap
    assert stats["is_weight_mean"] > 0 and 0.0 <= stats["is_truncated_frac"] <= 1.0
    assert math.isfinite(stats["loss"])


def episode(reward: float, pid: str = "p0") -> tuple[Prompt, list[Turn], float]:
    p = Prompt(pid, "lookup", "lookup abc:", "123", True, "lookup", {"key": "abc"})
    q = TOK.encode("ab") + [TOK.call_id]
    a = TOK.encode("12") + [TOK.eot_id]
    turns = [Turn("assistant", q, [-0.5, -0.6, -0.7], 0, "tool_call"), tool_turn("123", TOK),
             Turn("assistant", a, [-0.1, -0.2, -0.3], 0, "eot")]
    return p, turns, reward


def test_build_samples_masks_only_assistant_tokens() -> None:
    s = build_samples([episode(0.7)], TOK)[0]
    n_prompt = len("lookup abc:") + 2
    assert len(s.token_ids) == len(s.loss_mask) == len(s.old_logprobs) == n_prompt + 3 + 5 + 3
    assert s.loss_mask == [0] * n_prompt + [1, 1, 1] + [0] * 5 + [1, 1, 1]
    assert s.old_logprobs[n_prompt:n_prompt + 3] == [-0.5, -0.6, -0.7]
    assert s.old_logprobs[-3:] == [-0.1, -0.2, -0.3] and sum(s.old_logprobs[:n_prompt]) == 0
    assert (s.episode_id, s.group_id, s.reward) == ("p0/0", "p0", 0.7)
    ids = build_samples([episode(0.1), episode(0.2)], TOK, episode_ids=["x", "y"])
    assert [t.episode_id for t in ids] == ["x", "y"]
    bad_p, bad_turns, _ = episode(0.0)
    bad_turns[0] = Turn("assistant", bad_turns[0].token_ids, [0.0], 0, "tool_call")
    with pytest.raises(ValueError):
        build_samples([(bad_p, bad_turns, 0.0)], TOK)


def test_a_turn_made_with_weights_outside_the_training_lineage_is_dropped() -> None:
    """After a rollback (a new gang resumed below the dead gang's newest version and made those
    versions again), a replica still serving the dead gang's v6 labels its turns v6; the new gang
    trained them as its own v6 (versions compared by number only). A turn whose version the
    lineage made with other weights is dropped like a stale one; one of the lineage's own
    weights, one of a version older than the lineage's start, or one whose replica said no
    checksum, is trained."""
    from dataclasses import replace

    n_prompt = len("lookup abc:") + 2
    p, turns, _ = episode(0.5)
    ours, theirs = "a" * 64, "b" * 64
    turns = [replace(turns[0], weights_version=6, weights_checksum=theirs), turns[1],
             replace(turns[2], weights_version=6, weights_checksum=ours)]
    [s] = build_samples([(p, turns, 0.5)], TOK, lineage={5: "c" * 64, 6: ours})
    assert s.loss_mask == [0] * n_prompt + [0, 0, 0] + [0] * 5 + [1, 1, 1]
    assert (s.stale_turns, s.stale_tokens) == (1, 3)
    older = [replace(turns[0], weights_version=3, weights_checksum=theirs), turns[1],
             replace(turns[2], weights_checksum=None)]
    [s] = build_samples([(p, older, 0.5)], TOK, lineage={5: "c" * 64, 6: ours})
    assert s.loss_mask == [0] * n_prompt + [1, 1, 1] + [0] * 5 + [1, 1, 1] and s.stale_turns == 0
    # A version past those the lineage made (the dead gang ran ahead of the checkpoint): not its
    # policy, whatever the replica said of its checksum (or if it said none).
    ahead = [replace(turns[0], weights_version=7, weights_checksum=None), turns[1],
             replace(turns[2], weights_version=7, weights_checksum=ours)]
    [s] = build_samples([(p, ahead, 0.5)], TOK, lineage={5: "c" * 64, 6: ours})
    assert s.stale_turns == 2 and s.loss_mask == [0] * (n_prompt + 3 + 5 + 3)


def test_collate_pads_right() -> None:
    samples = build_samples([episode(1.0, "a"), episode(0.0, "b")], TOK)
    samples[1].token_ids = samples[1].token_ids[:-2]
    samples[1].loss_mask = samples[1].loss_mask[:-2]
    samples[1].old_logprobs = samples[1].old_logprobs[:-2]
    batch = collate(samples, TOK.pad_id)
    assert batch["input_ids"].shape == (2, len(samples[0].token_ids))
    assert batch["input_ids"][1, -2:].tolist() == [TOK.pad_id] * 2
    assert batch["attention_mask"][1].sum() == len(samples[1].token_ids)
    assert batch["group_ids"].tolist() == [0, 1]


def test_train_step_moves_toward_high_reward() -> None:
    model = build_policy(ModelSpec(), TOK, seed=0)
    before = weights_checksum(model)
    eps = [episode(1.0), episode(0.0)]
    # the two episodes differ in their answer so the advantage has something to prefer
    eps[1][1][2] = Turn("assistant", TOK.encode("99") + [TOK.eot_id], [-4.6] * 3, 0, "eot")
    samples = build_samples(eps, TOK)
    batch = collate(samples, TOK.pad_id)
    with torch.no_grad():
        lp0 = token_logprobs(model, batch["input_ids"], batch["attention_mask"])
    for s, row in zip(samples, lp0, strict=True):  # on-policy old logprobs
        s.old_logprobs = [v if m else 0.0 for v, m in zip(row.tolist(), s.loss_mask, strict=True)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stats = train_on_samples(model, opt, samples, clip_eps=0.2, pad_id=TOK.pad_id)
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert stats["tokens"] == 12 and stats["advantage_abs_mean"] == pytest.approx(1.0, abs=1e-4)
    assert weights_checksum(model) != before
    with torch.no_grad():
        lp1 = token_logprobs(model, batch["input_ids"], batch["attention_mask"])
    good = torch.tensor(samples[0].loss_mask, dtype=torch.bool)
    bad = torch.tensor(samples[1].loss_mask, dtype=torch.bool)
    assert float(lp1[0][good].sum()) > float(lp0[0][good].sum())
    assert float(lp1[1][bad].sum()) < float(lp0[1][bad].sum())
    with pytest.raises(ValueError):
        train_on_samples(model, opt, samples, clip_eps=0.2, pad_id=0, advantages=torch.zeros(3))


def test_micro_batches_group_consecutive_samples_within_the_budget() -> None:
    assert micro_batches([5, 5, 5, 5], None) == [[0, 1, 2, 3]]
    assert micro_batches([5, 5, 5, 5], 10) == [[0, 1], [2, 3]]
    assert micro_batches([3, 9, 2, 2, 2], 10) == [[0], [1], [2, 3, 4]]  # count x longest <= 10
    assert micro_batches([20, 1], 10) == [[0], [1]]  # longer than the budget: a group of its own
    assert micro_batches([], 10) == []


@pytest.mark.parametrize("is_cap", [None, 2.0])
def test_a_micro_batched_step_is_the_step_of_one_forward(is_cap: float | None) -> None:
    """Gradients accumulated over micro-batches (each the mean over its tokens weighted by its
    share) make the same optimizer step and the same statistics as one forward over the whole
    share, within float error; and micro-batching did happen (forwards counted)."""
    eps = [episode(1.0), episode(0.0), episode(0.5), episode(0.2)]
    eps[1][1][2] = Turn("assistant", TOK.encode("99") + [TOK.eot_id], [-4.6] * 3, 0, "eot")
    eps[3][1][2] = Turn("assistant", TOK.encode("1234567") + [TOK.eot_id], [-3.0] * 8, 0, "eot")
    samples = build_samples(eps, TOK)
    widths = [len(s.token_ids) for s in samples]
    results = []
    for budget in (None, max(widths)):  # one forward; one sample (the widest fits) per forward
        model = build_policy(ModelSpec(), TOK, seed=0)
        forwards: list[int] = []
        model.register_forward_hook(lambda _m, _inp, _out, seen=forwards: seen.append(1))
        # plain SGD: the step is the gradient itself (Adam's first step, g / |g|, would magnify
        # float noise in gradients near 0 into whole steps)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        stats = train_on_samples(model, opt, samples, clip_eps=0.2, pad_id=TOK.pad_id, is_cap=is_cap,
                                 micro_batch_tokens=budget, temperature=0.8, top_p=0.9)
        results.append((dict(model.named_parameters()), stats, len(forwards)))
    (whole, s1, n1), (micro, s2, n2) = results
    per_group = 2 if is_cap is not None else 1  # the proximal policy's forward too
    assert n1 == per_group and n2 == per_group * len(micro_batches(widths, max(widths))) > per_group
    for name, p in whole.items():
        assert torch.allclose(p, micro[name], atol=1e-6), name
    assert s1.keys() == s2.keys()
    for key in s1:
        assert s2[key] == pytest.approx(s1[key], rel=1e-5, abs=1e-6), key


def test_top_p_sets_found_in_chunks_of_positions_are_the_sets_found_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer finds each position's top-p set a few positions at a time (memory); the
    logprobs are those of the whole batch's sets found at once."""
    from robustrl.rl import grpo

    model = build_policy(ModelSpec(), TOK, seed=0)
    ids = torch.randint(0, TOK.vocab_size, (3, 17), generator=torch.Generator().manual_seed(1))
    attn = torch.ones_like(ids)
    with torch.no_grad():
        whole = token_logprobs(model, ids, attn, TOK.vocab_size, temperature=0.7, top_p=0.8)
        monkeypatch.setattr(grpo, "TOP_P_ROWS", 5)  # 48 positions in 10 chunks, the last one short
        chunked = token_logprobs(model, ids, attn, TOK.vocab_size, temperature=0.7, top_p=0.8)
    assert torch.equal(whole, chunked)
    assert torch.isfinite(whole).all() and (whole != token_logprobs(model, ids, attn, TOK.vocab_size)).any()
