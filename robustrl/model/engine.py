"""Batched generation with a KV cache: the rollout replica's engine.

Many episodes' turns decode together. Prompts are left padded; an attention mask hides the
padding and explicit position ids make every row start at position 0, so a row's tokens do not
depend on what else is in the batch. Each request samples from its own seeded
``torch.Generator`` with exactly one uniform draw per step, which makes a turn reproducible from
(request, weights) alone: a replica that replays a turn after recovery gets the same tokens.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from robustrl.errors import RobustRLError, WeightSyncError
from robustrl.model.engines.base import Engine
from robustrl.model.tokenizer import CharTokenizer


def in_top_p(sorted_p: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Which probabilities of a distribution, sorted most likely first, are in its top-p set: those
    the ones more likely than them leave below ``top_p`` (the most likely always is). The rule
    this engine samples by and the trainer's logprobs (``grpo.token_logprobs``) take again."""
    return (sorted_p.cumsum(-1) - sorted_p) < top_p

StopReason = Literal["eot", "tool_call", "length"]


class GenerationAborted(RobustRLError):
    """``should_abort`` returned True mid-batch; no partial results are returned."""

    retryable = True


@dataclass(frozen=True)
class GenRequest:
    """One turn to generate.

    ``temperature`` 0 means greedy decoding (no random draw is used).
    """

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    stop_on_call: bool = True


@dataclass(frozen=True)
class GenResult:
    """A generated turn. ``token_ids`` include the stop token (eot or call) when there is one."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    stop_reason: StopReason


class GenerationEngine(Engine):
    """Decodes batches of requests with the policy; thread-safe (one batch at a time).

    The ``torch`` rollout engine (:class:`~robustrl.model.engines.base.Engine`).

    Logprobs are of the sampled tokens under the distribution actually sampled from (the
    behaviour policy): logits scaled by the request's temperature, truncated to its top-p set
    and renormalised. At temperature 1 and top_p 1 that is the policy the trainer recomputes;
    otherwise GRPO's importance ratio needs exactly these. Greedy decoding samples from a point
    mass, so its logprobs are 0.
    """

    name = "torch"

    def __init__(self, model: torch.nn.Module, tokenizer: CharTokenizer, max_batch: int = 64,
                 max_positions: int | None = None) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.vocab = tokenizer.vocab_size
        """The action space: ids the tokenizer has. A model's embedding may be padded past it
        (Qwen's 151936 rows for 151669 ids); a padded id, sampled, would be refused by the request
        manager (no tokenizer can decode it) and regenerated the same way by every replica."""
        self.max_batch = max_batch
        self.tokens_generated = 0
        self._lock = threading.Lock()
        self._abort = threading.Event()
        config = getattr(model, "config", None)
        # Longest prompt + response: the job's model.max_positions (vLLM's max_model_len, the same
        # limit in both engines: before, this engine took an HF directory's own, 40,960 for Qwen3,
        # where vLLM cut the same turns at 256), never past the model's own.
        self.max_positions: int = min(int(getattr(config, "max_position_embeddings", 1 << 30)),
                                      max_positions or (1 << 30))
        # transformers 5 names the KV cache argument ``cache``; 4.x calls it ``past_key_values``.
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Swap in new weights (strict: every parameter must be present), between batches."""
        self.load_weights(state_dict)

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int = -1, *, checksum: str = "") -> None:
        """In place, between batches: one copy per tensor into the model's own storage.

        Raises:
            WeightSyncError: a name, dtype or shape differs from the model's (nothing is copied
                then), or ``checksum`` is given and the model's weights read back differently.
        """
        with self._lock, torch.no_grad():
            targets = self._targets()
            missing = targets.keys() - state.keys()
            extra = state.keys() - targets.keys()
            if missing or extra:
                raise WeightSyncError("the weights do not match the model's parameters", version=version,
                                      missing=sorted(missing)[:5], unexpected=sorted(extra)[:5], reason="layout")
            for name, target in targets.items():
                src = state[name]
                if src.shape != target.shape or src.dtype != target.dtype:
                    raise WeightSyncError("a tensor's dtype or shape differs from the model's", version=version,
                                          tensor=name, want=f"{target.dtype}{list(target.shape)}",
                                          got=f"{src.dtype}{list(src.shape)}", reason="layout")
            written: set[int] = set()
            for name, target in targets.items():
                if target.data_ptr() in written and target.numel():
                    continue  # tied weights: one storage under two names, copied once
                written.add(target.data_ptr())
                target.copy_(state[name])
        if checksum:
            from robustrl.model.policy import weights_checksum

            got = weights_checksum(self.model)
            if got != checksum:
                raise WeightSyncError("the model's weights read back do not match the expected checksum",
                                      version=version, expected=checksum, got=got, reason="load_mismatch")

    def _targets(self) -> dict[str, torch.Tensor]:
        """name -> the model's tensor to copy into (its state dict: views of its parameters)."""
        return dict(self.model.state_dict())

    def layout(self) -> dict[str, tuple[str, list[int]]]:
        from robustrl.weights.flat import expected_layout

        return expected_layout(self.model)

    def abort(self) -> None:
        """The running ``generate`` raises GenerationAborted before its next decode step."""
        self._abort.set()

    def generate(
        self,
        requests: Sequence[GenRequest],
        on_token: Callable[[int], None] | None = None,
        should_abort: Callable[[], bool] | None = None,
    ) -> list[GenResult]:
        """Generate every request; results in request order.

        Args:
            requests: turns to decode; split into chunks of ``max_batch``.
            on_token: called after each decode step with the number of tokens produced in it.
            should_abort: polled before each step; True raises :class:`GenerationAborted`.

        Raises:
            GenerationAborted: ``should_abort`` asked to stop.
        """
        results: list[GenResult] = []
        asked = should_abort

        def should_abort() -> bool:
            return self._abort.is_set() or (asked is not None and asked())

        with self._lock, torch.inference_mode():
            self._abort.clear()
            for start in range(0, len(requests), self.max_batch):
                chunk = list(requests[start:start + self.max_batch])
                results.extend(self._generate_chunk(chunk, on_token, should_abort))
        return results

    # --- internals -----------------------------------------------------------------------

    def _generate_chunk(
        self,
        requests: list[GenRequest],
        on_token: Callable[[int], None] | None,
        should_abort: Callable[[], bool] | None,
    ) -> list[GenResult]:
        n = len(requests)
        # A prompt that already fills the context cannot grow: it ends at once with "length"
        # instead of failing the whole batch (the episode finishes, the replica keeps serving).
        budgets = [max(0, min(r.max_new_tokens, self.max_positions - len(r.prompt_ids))) for r in requests]
        out_ids: list[list[int]] = [[] for _ in range(n)]
        out_lp: list[list[float]] = [[] for _ in range(n)]
        reasons: list[StopReason | None] = [None if b > 0 and r.prompt_ids else "length"
                                            for r, b in zip(requests, budgets, strict=True)]
        live = [i for i in range(n) if reasons[i] is None]
        if live:
            self._decode(requests, [budgets[i] for i in range(n)], live, out_ids, out_lp, reasons,
                         on_token, should_abort)
        return [GenResult(r.request_id, out_ids[i], out_lp[i], reasons[i] or "length")
                for i, r in enumerate(requests)]

    def _decode(
        self,
        requests: list[GenRequest],
        budgets: list[int],
        live: list[int],
        out_ids: list[list[int]],
        out_lp: list[list[float]],
        reasons: list[StopReason | None],
        on_token: Callable[[int], None] | None,
        should_abort: Callable[[], bool] | None,
    ) -> None:
        tok = self.tokenizer
        device = next(self.model.parameters()).device
        rows = [requests[i] for i in live]
        width = max(len(r.prompt_ids) for r in rows)
        ids = torch.full((len(rows), width), tok.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids, dtype=torch.long)
            mask[b, width - len(r.prompt_ids):] = 1
        # Padding positions get position 0 (masked anyway); real tokens count from 0.
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        ids, mask, positions = ids.to(device), mask.to(device), positions.to(device)

        temps = torch.tensor([r.temperature for r in rows], dtype=torch.float32, device=device)
        top_ps = torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=device)
        gens = [torch.Generator().manual_seed(int(r.seed)) for r in rows]
        active = torch.ones(len(rows), dtype=torch.bool)
        row_budget = [budgets[i] for i in live]

        outputs = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                             use_cache=True, logits_to_keep=1)
        cache = self._cache_of(outputs)
        logits = outputs.logits[:, -1, :]
        next_pos = positions[:, -1:] + 1
        step = 0
        while True:
            if should_abort is not None and should_abort():
                raise GenerationAborted("generation aborted by request", step=step)
            chosen, logps = self._sample(logits[:, :self.vocab].float(), temps, top_ps, gens)
            produced = 0
            for b in range(len(rows)):
                if not active[b]:
                    continue
                i = live[b]
                t = int(chosen[b])
                out_ids[i].append(t)
                out_lp[i].append(float(logps[b]))
                produced += 1
                if t in tok.stop_ids:
                    reasons[i] = "eot"
                elif t == tok.call_id and rows[b].stop_on_call:
                    reasons[i] = "tool_call"
                elif len(out_ids[i]) >= row_budget[b]:
                    reasons[i] = "length"
                if reasons[i] is not None:
                    active[b] = False
            self.tokens_generated += produced
            if on_token is not None:
                on_token(produced)
            step += 1
            if not bool(active.any()):
                return
            # Finished rows keep decoding their last token (ignored) so the cache stays rectangular;
            # at this model size that is cheaper than re-indexing the cache.
            mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype, device=device)], dim=1)
            outputs = self.model(input_ids=chosen.view(-1, 1).to(device), attention_mask=mask,
                                 position_ids=next_pos, use_cache=True, **{self._cache_arg: cache})
            cache = self._cache_of(outputs)
            logits = outputs.logits[:, -1, :]
            next_pos = next_pos + 1

    @staticmethod
    def _cache_of(outputs: object) -> object:
        cache = getattr(outputs, "cache", None)
        return cache if cache is not None else getattr(outputs, "past_key_values")

    @staticmethod
    def _sample(
        logits: torch.Tensor,
        temps: torch.Tensor,
        top_ps: torch.Tensor,
        gens: list[torch.Generator],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pick one token per row; return (tokens, their logprobs under the sampled distribution)."""
        greedy = temps <= 0
        scaled = logits / torch.where(greedy, torch.ones_like(temps), temps).unsqueeze(-1)
        probs = torch.softmax(scaled, dim=-1)
        # Top-p: keep the smallest prefix of the sorted distribution whose mass reaches p
        # (the most likely token always survives).
        sorted_p, order = probs.sort(dim=-1, descending=True)
        sorted_p = torch.where(in_top_p(sorted_p, top_ps.unsqueeze(-1)), sorted_p, torch.zeros_like(sorted_p))
        cdf = sorted_p.cumsum(-1)
        # One uniform per row from the row's own generator, even for inactive or greedy rows:
        # the draw count depends only on the step, never on the batch's other rows.
        u = torch.tensor([float(torch.rand((), generator=g)) for g in gens], dtype=cdf.dtype)
        u = u.to(cdf.device) * cdf[:, -1]
        pick_sorted = torch.searchsorted(cdf, u.unsqueeze(-1)).clamp(max=cdf.shape[-1] - 1)
        sampled = order.gather(-1, pick_sorted).squeeze(-1)
        chosen = torch.where(greedy, logits.argmax(dim=-1), sampled)
        # log p(chosen) under the sampled distribution: the temperature-scaled policy, truncated
        # to the top-p set and renormalised there (the kept mass is the cdf's last value; the
        # sampled token is always in the set).
        sampled_logp = (torch.log_softmax(scaled, dim=-1).gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
                        - torch.log(cdf[:, -1]))
        logps = torch.where(greedy, torch.zeros_like(sampled_logp), sampled_logp)
        return chosen.cpu(), logps.cpu()
