"""The ``vllm`` rollout engine: vLLM's ``AsyncLLM`` (v1 engine) behind the Engine interface.

One vLLM request per episode turn, all of a batch submitted at once (vLLM's scheduler batches
them continuously): token-id prompts, the episode's seed, stop on eos and, for a turn that may
call a tool, on the tool-call marker's token id; logprobs in vLLM's ``processed_logprobs`` mode,
i.e. of the distribution actually sampled (after temperature and top-p), which is what GRPO's
behaviour policy must be. Outputs stream as deltas; their token counts feed the replica's
throughput metric.

New weights are loaded in place through vLLM's pluggable weight transfer (backend ``robustrl``,
:mod:`robustrl.model.engines.vllm_plugin`): the engine serves the verified state dict from an
in-memory RobustRL weight server, and vLLM's worker pulls it from there with RobustRL's puller
and calls ``load_weights``; generation is paused around the swap and resumed after.

vLLM runs in its own virtual environment (``scripts/setup.sh --vllm``); this module is only
imported there. On this CPU vLLM runs float32 (bfloat16 kills its worker with SIGILL). vLLM
spawns its engine process, so programs that build this engine need a ``__main__`` guard.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from robustrl.errors import ConfigError, WeightSyncError
from robustrl.model.engine import GenerationAborted, GenRequest, GenResult, StopReason
from robustrl.model.engines.base import Engine

log = logging.getLogger(__name__)
START_TIMEOUT_S = 600.0
LOAD_TIMEOUT_S = 300.0
_POLL_S = 0.05


def hf_layout(path: str | Path, dtype: torch.dtype = torch.float32) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) of the directory's model as transformers names it (meta device:
    nothing is allocated); the layout the trainer publishes and ``load_weights`` takes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from robustrl.weights.flat import dtype_name

    cfg = AutoConfig.from_pretrained(str(path), local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return {n: (dtype_name(dtype), list(t.shape)) for n, t in model.state_dict().items()}


class VllmEngine(Engine):
    """``AsyncLLM`` on an event loop of its own thread; the replica's worker thread calls in.

    Args:
        path: Hugging Face model directory (``model.path``).
        tokenizer: the directory's :class:`~robustrl.model.hf.ChatTokenizer` (eos and tool-call ids).
        max_batch: most concurrent sequences (vLLM ``max_num_seqs``).
        max_model_len: longest prompt + response.
        seed: engine seed (every request carries its own seed too).
        dtype: ``float32`` on CPU.
        kv_cache_gib: CPU KV cache size (``VLLM_CPU_KVCACHE_SPACE``).

    Raises:
        ConfigError: (field ``rollout.engine``) vLLM is not importable in this interpreter.
    """

    name = "vllm"

    def __init__(self, path: str | Path, tokenizer: Any, *, max_batch: int = 64, max_model_len: int = 512,
                 seed: int = 0, dtype: str = "float32", kv_cache_gib: int = 1, chunk_bytes: int = 1 << 20) -> None:
        try:
            import vllm  # noqa: F401
        except ImportError as exc:
            raise ConfigError("rollout.engine is vllm but vllm is not installed in this interpreter "
                              "(run scripts/setup.sh --vllm; members start from .venv-vllm)",
                              field="rollout.engine") from exc
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        self.path = str(path)
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.tokens_generated = 0
        self.chunk_bytes = chunk_bytes
        self._dtype = dtype
        self._seed = seed
        self._ids = itertools.count()
        self._inflight: set[str] = set()
        self._aborted = threading.Event()
        self._layout = hf_layout(path, getattr(torch, dtype))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-loop", daemon=True)
        self._thread.start()
        self._closed = False
        self._call(self._start(), START_TIMEOUT_S)

    # --- loop plumbing -------------------------------------------------------------------

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start(self) -> None:
        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from robustrl.weights.server import WeightServer

        args = AsyncEngineArgs(model=self.path, tokenizer=self.path, dtype=self._dtype, seed=self._seed,
                               max_model_len=self.max_model_len, max_num_seqs=self.max_batch,
                               enforce_eager=True, logprobs_mode="processed_logprobs",
                               weight_transfer_config=WeightTransferConfig(backend="robustrl"),
                               enable_prefix_caching=False, disable_log_stats=True)
        self.llm = AsyncLLM.from_engine_args(args)
        self.server = WeightServer("tcp", host="127.0.0.1", max_versions=1)
        self.address = await self.server.start()

    # --- generation ----------------------------------------------------------------------

    def _params(self, r: GenRequest, budget: int) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        stops = [self.tokenizer.eot_id] + ([self.tokenizer.call_id] if r.stop_on_call else [])
        return SamplingParams(max_tokens=budget, temperature=r.temperature, top_p=r.top_p, seed=r.seed,
                              logprobs=0, stop_token_ids=stops, output_kind=RequestOutputKind.DELTA,
                              detokenize=False, skip_special_tokens=False)

    async def _one(self, r: GenRequest, rid: str, events: queue.Queue[int]) -> GenResult:
        budget = max(0, min(r.max_new_tokens, self.max_model_len - len(r.prompt_ids)))
        if budget == 0 or not r.prompt_ids:
            return GenResult(r.request_id, [], [], "length")
        ids: list[int] = []
        lps: list[float] = []
        finish: str | None = None
        self._inflight.add(rid)
        try:
            async for out in self.llm.generate({"prompt_token_ids": list(r.prompt_ids)}, self._params(r, budget),
                                               request_id=rid):
                c = out.outputs[0]
                new = list(c.token_ids)
                for k, t in enumerate(new):
                    ids.append(int(t))
                    lp = 0.0
                    if c.logprobs is not None and r.temperature > 0:
                        entry = c.logprobs[k]
                        lp = float(entry[t].logprob) if t in entry else float("nan")
                    lps.append(lp)
                if new:
                    events.put(len(new))
                finish = c.finish_reason or finish
        finally:
            self._inflight.discard(rid)
        reason: StopReason = "length"
        if ids and ids[-1] == self.tokenizer.call_id and r.stop_on_call:
            reason = "tool_call"
        elif (ids and ids[-1] == self.tokenizer.eot_id) or finish == "stop":
            reason = "eot"
        return GenResult(r.request_id, ids, lps, reason)

    async def _batch(self, requests: Sequence[GenRequest], rids: list[str], events: queue.Queue[int]) -> list[GenResult]:
        return list(await asyncio.gather(*(self._one(r, rid, events) for r, rid in zip(requests, rids, strict=True))))

    def generate(self, requests: Sequence[GenRequest], on_token: Callable[[int], None] | None = None,
                 should_abort: Callable[[], bool] | None = None) -> list[GenResult]:
        """Submit every request at once and wait; ``on_token`` and ``should_abort`` run in the
        calling thread (a stalled caller holds nothing inside vLLM's loop)."""
        self._aborted.clear()
        events: queue.Queue[int] = queue.Queue()
        rids = [f"{r.request_id}#{next(self._ids)}" for r in requests]
        fut = asyncio.run_coroutine_threadsafe(self._batch(requests, rids, events), self._loop)
        while True:
            try:
                n = events.get(timeout=_POLL_S)
            except queue.Empty:
                n = 0
            if n:
                self.tokens_generated += n
                if on_token is not None:
                    on_token(n)
            if self._aborted.is_set() or (should_abort is not None and should_abort()):
                self._call(self.llm.abort(rids), 30.0)
                fut.cancel()
                raise GenerationAborted("generation aborted by request")
            if fut.done() and events.empty():
                return fut.result()

    def abort(self) -> None:
        self._aborted.set()

    # --- weights -------------------------------------------------------------------------

    def layout(self) -> dict[str, tuple[str, list[int]]]:
        return dict(self._layout)

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int = -1) -> str:
        """Serve ``state`` from memory and have vLLM's worker pull and load it, generation paused.

        Raises:
            WeightSyncError: vLLM's worker could not pull or load the version.
        """
        from robustrl.model.policy import weights_checksum
        from robustrl.weights.flat import flatten_state_dict

        checksum = weights_checksum(state)
        tag = max(version, 0)
        buffer, manifest = flatten_state_dict(state, tag, self.chunk_bytes)
        try:
            self._call(self._swap(manifest, buffer, checksum), LOAD_TIMEOUT_S)
        except WeightSyncError:
            raise
        except Exception as exc:
            raise WeightSyncError(f"vLLM did not load the weights: {exc}", version=version) from exc
        return checksum

    async def _swap(self, manifest: Any, buffer: torch.Tensor, checksum: str) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self.server.add_version(manifest, buffer.numpy())
        await self.llm.pause_generation(mode="keep", clear_cache=True)
        try:
            await self.llm.start_weight_update()
            await self.llm.update_weights(WeightTransferUpdateRequest(update_info={
                "version": manifest.version, "digest": manifest.digest(), "sources": [self.address],
                "checksum": checksum}))
            await self.llm.finish_weight_update(weight_version=str(manifest.version))
        finally:
            self.server.drop_version(manifest.version)
            await self.llm.resume_generation()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self.server.close(), 10.0)
        except Exception as exc:  # noqa: BLE001 - closing: report and go on
            log.warning("closing the vLLM engine's weight server: %r", exc)
        try:
            self.llm.shutdown()
        except Exception as exc:  # noqa: BLE001 - closing: report and go on
            log.warning("shutting vLLM down: %r", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
