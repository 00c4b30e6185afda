"""The ``vllm`` rollout engine: vLLM's ``AsyncLLM`` (v1 engine) behind the Engine interface.

One vLLM request per episode turn, all of a batch submitted at once (vLLM's scheduler batches
them continuously): token-id prompts, the episode's seed, stop on eos and, for a turn that may
call a tool, on the tool-call marker's token id; logprobs in vLLM's ``processed_logprobs`` mode,
i.e. of the distribution actually sampled (after temperature and top-p), which is what GRPO's
behaviour policy must be. Outputs stream as deltas (the replica's liveness signal); the
throughput metric is vLLM's own count of generated tokens, from its per-iteration stats. A
model whose embedding is padded past its tokenizer samples only the tokenizer's ids (a vLLM
logits processor, ``vllm_plugin.SampleVocabMask``).

New weights are loaded in place through vLLM's pluggable weight transfer (backend ``robustrl``,
:mod:`robustrl.model.engines.vllm_plugin`), never while a generation runs (a swap waits for the
running ``generate`` and the next one for the swap; requests still inside vLLM, e.g. an abort
not yet processed, are paused around it and resumed after). The replica pulls each version into a memfd segment of its own process
(:meth:`VllmEngine.alloc_buffer`; every chunk verified against the manifest as it arrived);
vLLM's worker maps that segment and copies from it into the model: no copy, hash or socket
between the pull and vLLM's own load. (``transfer="tcp"``: the worker pulls the version from an
in-memory RobustRL weight server instead, for a worker that shares no memory with the replica.)

vLLM runs in its own virtual environment (``scripts/setup.sh --vllm``); this module is only
imported there. On this CPU vLLM runs float32 (bfloat16 kills its worker with SIGILL). vLLM
spawns its engine process, so programs that build this engine need a ``__main__`` guard.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from robustrl.errors import ConfigError, WeightSyncError
from robustrl.model.engine import GenerationAborted, GenRequest, GenResult, StopReason
from robustrl.model.engines.base import Engine

log = logging.getLogger(__name__)
START_TIMEOUT_S = 600.0
LOAD_TIMEOUT_S = 300.0
_POLL_S = 0.05
CHILD_EXIT_S = 10.0
"""How long closing waits for vLLM's engine processes to end once vLLM's shutdown returned."""


def hf_layout(path: str | Path, dtype: torch.dtype = torch.float32) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) of the directory's model as transformers names it (meta device:
    nothing is allocated); the layout the trainer publishes and ``load_weights`` takes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from robustrl.weights.flat import dtype_name

    cfg = AutoConfig.from_pretrained(str(path), local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return {n: (dtype_name(dtype), list(t.shape)) for n, t in model.state_dict().items()}


def _sample_vocab(path: str | Path, vocab: int) -> int | None:
    """``vocab`` (the tokenizer's size) when the model's embedding is padded past it (Qwen: 151936
    rows, 151669 ids): as the torch engine and the trainer, sample only ids the tokenizer has (a
    padded id is refused by the request manager). None (no mask, no cost) when the sizes agree.

    Raises:
        ConfigError: (field ``model.path``) the directory's ``config.json`` names no vocabulary
            size, or one smaller than the tokenizer's.
    """
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
        model_vocab = int(cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size") or 0)
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{path}/config.json names no vocabulary size: {exc}", field="model.path") from exc
    if model_vocab < vocab:
        raise ConfigError(f"model vocabulary {model_vocab} ({path}/config.json) is smaller than the "
                          f"tokenizer's {vocab}", field="model.path")
    return vocab if model_vocab > vocab else None


class _Counters:
    """vLLM's own per-iteration stats, summed: ``logger`` is a vLLM stat-logger factory
    (``AsyncLLM(stat_loggers=...)``); vLLM calls each logger it makes in its output handler, in
    this process, once per engine iteration. Read from any thread (ints, replaced whole)."""

    def __init__(self) -> None:
        self.generation_tokens = 0
        self.prompt_tokens = 0
        self.preemptions = 0
        self.iterations = 0

    def logger(self, vllm_config: Any, engine_index: int = 0) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        counters = self

        class _Logger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                       engine_idx: int = 0) -> None:
                if iteration_stats is None:
                    return
                counters.iterations += 1
                counters.generation_tokens += iteration_stats.num_generation_tokens
                counters.prompt_tokens += iteration_stats.num_prompt_tokens
                counters.preemptions += iteration_stats.num_preempted_reqs

            def log_engine_initialized(self) -> None:
                pass

        return _Logger(vllm_config, engine_index)


def _segment_fields(path: str, nbytes: int) -> dict[str, Any]:
    """How the worker finds a segment of this process (``SegmentMap``): path, size and inode."""
    return {"segment": path, "segment_bytes": nbytes, "segment_ino": os.stat(path).st_ino}


def _log_prefetch(done: Any) -> None:
    """Only a hint (the swap maps the segment itself if it must): a failure is logged, no more."""
    if not done.cancelled() and done.exception() is not None:
        log.info("asking vLLM's worker to map the next segment: %r", done.exception())


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
        gpu_memory_utilization: on a GPU, the fraction of its memory vLLM takes (None: vLLM's
            default; ``RolloutSpec.vllm_memory_fraction``).
        chunk_bytes: chunk size of the ``tcp`` transfer's manifests.
        transfer: ``memfd`` (default where supported: the worker maps the replica's buffer) or
            ``tcp`` (the worker pulls from an in-memory weight server).

    Raises:
        ConfigError: (field ``rollout.engine``) vLLM is not importable in this interpreter.
    """

    name = "vllm"

    def __init__(self, path: str | Path, tokenizer: Any, *, max_batch: int = 64, max_model_len: int = 512,
                 seed: int = 0, dtype: str = "float32", kv_cache_gib: int = 1, chunk_bytes: int = 1 << 20,
                 transfer: str | None = None, cpu_linear: str = "packed",
                 gpu_memory_utilization: float | None = None) -> None:
        try:
            import vllm  # noqa: F401
        except ImportError as exc:
            raise ConfigError("rollout.engine is vllm but vllm is not installed in this interpreter "
                              "(run scripts/setup.sh --vllm; members start from .venv-vllm)",
                              field="rollout.engine") from exc
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        from robustrl.model.engines.vllm_plugin import CPU_LINEAR_ENV, CPU_LINEARS

        if cpu_linear not in CPU_LINEARS:
            raise ConfigError(f"cpu_linear {cpu_linear!r}: one of {', '.join(CPU_LINEARS)}",
                              field="rollout.vllm_cpu_linear")
        os.environ[CPU_LINEAR_ENV] = cpu_linear  # read by the plugin in vLLM's spawned processes
        self.cpu_linear = cpu_linear
        self.path = str(path)
        self.tokenizer = tokenizer
        self.sample_vocab = _sample_vocab(path, tokenizer.vocab_size)
        from robustrl.model.engines.vllm_plugin import SAMPLE_VOCAB_ENV

        # read by SampleVocabMask in vLLM's worker, which inherits this process's environment
        os.environ[SAMPLE_VOCAB_ENV] = str(self.sample_vocab or "")
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.counters = _Counters()
        self._counted_from = 0  # vLLM's generation-token count when the warm-up ended
        self.chunk_bytes = chunk_bytes
        from robustrl.model.engines import segments

        self.transfer = transfer or ("memfd" if segments.supported() else "tcp")
        self._segments = segments.Segments()
        self._staging: np.ndarray | None = None
        self.server: Any = None
        self.address = ""
        self.last_load: dict[str, float] = {}
        self._dtype = dtype
        self._seed = seed
        self._gpu_memory = gpu_memory_utilization
        self._ids = itertools.count()
        self._inflight: set[str] = set()
        self._aborted = threading.Event()
        self._busy = threading.Lock()  # a generate() or a weight swap, never both
        self._layout = hf_layout(path, getattr(torch, dtype))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-loop", daemon=True)
        self._thread.start()
        self._closed = False
        self._call(self._start(), START_TIMEOUT_S)
        self.warmup_s = self._warm_up()
        self._check_layout()

    def _check_layout(self) -> None:
        """``plain`` must hold in vLLM's worker for every linear layer (it replaces a vLLM-internal
        dispatch: a vLLM that no longer calls it would leave them packed, silently)."""
        if self.cpu_linear != "plain":
            return
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return  # the layout is a CPU matter: nothing to check
        counts = self.worker_timings()[0]
        if counts["plain_linear_layers"] != counts["linear_layers"]:
            self.close()
            raise ConfigError(f"rollout.vllm_cpu_linear is plain but vLLM's worker multiplies "
                              f"{counts['linear_layers'] - counts['plain_linear_layers']} of "
                              f"{counts['linear_layers']} linear layers in its packed layout",
                              field="rollout.vllm_cpu_linear")

    def _warm_up(self) -> float:
        """Generate a few tokens before the engine counts as started: vLLM's first generation
        pays one-time costs (4 s here on a quiet 2-core machine, more on a busy one) that would
        otherwise fall on the replica's first real batch, where the detector sees work held and
        no tokens (a stall), instead of on its start (phase ``starting``, which it exempts)."""
        t0 = time.monotonic()
        prompt = list(range(1, 9))
        self.generate([GenRequest(f"warmup-{i}", prompt, 4, temperature=1.0, seed=i, stop_on_call=False)
                       for i in range(2)])
        self._counted_from = self.counters.generation_tokens
        return time.monotonic() - t0

    @property
    def tokens_generated(self) -> int:
        """Tokens generated since the engine started, warm-up not counted: vLLM's own count (its
        per-iteration stats, :class:`_Counters`), not RobustRL's count of the outputs it read.
        vLLM's output handler records an iteration's stats in the same pass of its loop that
        queues the iteration's outputs, after them; with at most 128 outputs an iteration (vLLM's
        ``VLLM_V1_OUTPUT_PROC_CHUNK_SIZE``) the pass does not yield in between, so the count
        includes every token a ``generate`` has returned or passed to ``on_token``; with more
        (``max_batch`` above 128) it may lag them by that iteration until the pass ends."""
        return self.counters.generation_tokens - self._counted_from

    # --- loop plumbing -------------------------------------------------------------------

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start(self) -> None:
        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from robustrl.model.engines import vllm_plugin

        masks = [f"{vllm_plugin.__name__}:{vllm_plugin.SampleVocabMask.__name__}"] if self.sample_vocab else None
        memory = {} if self._gpu_memory is None else {"gpu_memory_utilization": self._gpu_memory}
        args = AsyncEngineArgs(**memory, model=self.path, tokenizer=self.path, dtype=self._dtype, seed=self._seed,
                               max_model_len=self.max_model_len, max_num_seqs=self.max_batch,
                               enforce_eager=True, logprobs_mode="processed_logprobs",
                               weight_transfer_config=WeightTransferConfig(backend="robustrl"),
                               enable_prefix_caching=False, disable_log_stats=True, logits_processors=masks)
        # disable_log_stats: none of vLLM's own loggers (its periodic log lines); the one given
        # here still turns vLLM's per-iteration stats on (and, with them, its Prometheus metrics)
        self.llm = AsyncLLM.from_engine_args(args, stat_loggers=[self.counters.logger])

    # --- generation ----------------------------------------------------------------------

    def _params(self, r: GenRequest, budget: int) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        stops = list(self.tokenizer.stop_ids) + ([self.tokenizer.call_id] if r.stop_on_call else [])
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
        elif (ids and ids[-1] in self.tokenizer.stop_ids) or finish == "stop":
            reason = "eot"
        return GenResult(r.request_id, ids, lps, reason)

    async def _batch(self, requests: Sequence[GenRequest], rids: list[str], events: queue.Queue[int]) -> list[GenResult]:
        return list(await asyncio.gather(*(self._one(r, rid, events) for r, rid in zip(requests, rids, strict=True))))

    def generate(self, requests: Sequence[GenRequest], on_token: Callable[[int], None] | None = None,
                 should_abort: Callable[[], bool] | None = None) -> list[GenResult]:
        """Submit every request at once and wait; ``on_token`` and ``should_abort`` run in the
        calling thread (a stalled caller holds nothing inside vLLM's loop)."""
        with self._busy:
            return self._generate(requests, on_token, should_abort)

    def _generate(self, requests: Sequence[GenRequest], on_token: Callable[[int], None] | None,
                  should_abort: Callable[[], bool] | None) -> list[GenResult]:
        self._aborted.clear()
        events: queue.Queue[int] = queue.Queue()
        rids = [f"{r.request_id}#{next(self._ids)}" for r in requests]
        fut = asyncio.run_coroutine_threadsafe(self._batch(requests, rids, events), self._loop)
        while True:
            try:
                n = events.get(timeout=_POLL_S)
            except queue.Empty:
                n = 0
            if n and on_token is not None:
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

    def alloc_buffer(self, nbytes: int) -> np.ndarray:
        """A receive buffer in a memfd segment that vLLM's worker maps: weights pulled into it
        (the replica's loader does) load with no copy before vLLM's own."""
        if self.transfer != "memfd" or nbytes <= 0:
            return super().alloc_buffer(nbytes)
        return self._segments.alloc(nbytes)

    def prepare_buffer(self, buffer: np.ndarray) -> None:
        """Ask vLLM's worker to map ``buffer``'s segment now (it holds a complete version, which
        the replica checks before the swap): the swap finds it mapped (``SegmentMap``). Sent
        once the pull completed, not at allocation: a pull that fails or is superseded costs
        the worker nothing, and the pages exist already (mapping them fills page tables only).
        Fire and forget: a failure is logged, the swap maps the segment itself."""
        if self.transfer != "memfd" or self._closed or not self._loop.is_running():
            return
        found = self._segments.locate({"buffer": torch.from_numpy(buffer)})
        if found is None:
            return
        hint = _segment_fields(found[0], found[1])
        coro = self.llm.collective_rpc("weight_transfer_engine", kwargs={"prefetch": hint})
        try:
            done = asyncio.run_coroutine_threadsafe(coro, self._loop)
        except RuntimeError:  # the loop closed meanwhile (the engine is closing)
            coro.close()
            return
        done.add_done_callback(_log_prefetch)

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int = -1, *, checksum: str = "") -> None:
        """Have vLLM's worker load ``state`` in place, generation paused around the swap.

        ``state`` in a buffer from :meth:`alloc_buffer` (as the replica pulls it): the worker maps
        that segment and copies from it, nothing is copied or hashed before. Any other state is
        first packed into a staging segment (one copy, timed as ``stage``). ``checksum``
        (optional): the worker checksums what it received and refuses a mismatch. The phases
        of the last load, in seconds, are in :attr:`last_load`.

        Raises:
            WeightSyncError: vLLM's worker could not load the version (``reason`` ``load_mismatch``
                for a checksum that did not match).
        """
        t0 = time.perf_counter()
        tag = max(version, 0)
        buffer: torch.Tensor | None = None
        manifest: Any = None
        if self.transfer == "memfd":
            found = self._segments.locate(state)
            staged = found is None
            if found is None:
                found = self._stage(state)
            path, nbytes, tensors = found
            info: dict[str, Any] = {"version": tag, **_segment_fields(path, nbytes), "tensors": tensors,
                                    "checksum": checksum}
        else:
            from robustrl.weights.flat import flatten_state_dict

            staged = True
            buffer, manifest = flatten_state_dict(state, tag, self.chunk_bytes)
            info = {"version": tag, "digest": manifest.digest(), "sources": [self.address], "checksum": checksum}
        stage_s = time.perf_counter() - t0
        try:
            with self._busy:
                phases = self._call(self._swap(info, manifest, buffer), LOAD_TIMEOUT_S)
        except WeightSyncError:
            raise
        except Exception as exc:
            reason = getattr(exc, "reason", None) or ("load_mismatch" if "do not match" in str(exc) else "error")
            raise WeightSyncError(f"vLLM did not load the weights: {exc}", version=version, reason=reason) from exc
        self.last_load = {"stage": stage_s if staged else 0.0, **phases, "total": time.perf_counter() - t0}

    def _stage(self, state: Mapping[str, torch.Tensor]) -> tuple[str, int, list[list[Any]]]:
        """Pack ``state`` into the staging segment (kept between loads: no page faults the
        second time)."""
        from robustrl.weights.flat import ALIGN

        offsets: list[int] = []
        end = 0
        for t in state.values():
            end = (end + ALIGN - 1) // ALIGN * ALIGN
            offsets.append(end)
            end += t.numel() * t.element_size()
        if self._staging is None or self._staging.nbytes < end:
            self._staging = self._segments.alloc(end)
        flat = torch.from_numpy(self._staging)
        with torch.no_grad():
            for off, t in zip(offsets, state.values(), strict=True):
                n = t.numel() * t.element_size()
                if n:
                    flat[off:off + n].view(t.dtype).view(t.shape).copy_(t.detach())
        found = self._segments.locate({n: flat[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                                       for (n, t), o in zip(state.items(), offsets, strict=True)})
        assert found is not None
        return found

    async def _swap(self, info: dict[str, Any], manifest: Any, buffer: torch.Tensor | None) -> dict[str, float]:
        phases: dict[str, float] = {}
        t = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal t
            now = time.perf_counter()
            phases[name] = now - t
            t = now

        if buffer is not None:
            if self.server is None:
                from robustrl.weights.server import WeightServer

                self.server = WeightServer("tcp", host="127.0.0.1", max_versions=1)
                self.address = await self.server.start()
                info["sources"] = [self.address]
            self.server.add_version(manifest, buffer.numpy())
        # Our own generate() and swaps exclude each other (``_busy``), so normally no request is
        # in vLLM now and pausing (a ~20 ms round trip to its worker here) would guard nothing;
        # anything still there (an abort not yet processed) is frozen while the weights change.
        paused = self.llm.output_processor.has_unfinished_requests()
        if paused:
            await self.llm.pause_generation(mode="keep", clear_cache=True)
        lap("pause")
        try:
            # One round trip: the worker starts, loads and finishes the update in one call
            # (vllm_plugin.RobustRLWeightTransfer.__call__), instead of vLLM's three.
            await self.llm.collective_rpc("weight_transfer_engine", kwargs={"update_info": info})
            lap("update")
        finally:
            if buffer is not None and self.server is not None:
                self.server.drop_version(manifest.version)
            if paused:
                await self.llm.resume_generation()
            lap("resume")
        return phases

    def worker_timings(self) -> list[dict[str, float]]:
        """Each vLLM worker's account of the last weight update (seconds per part, see
        :attr:`~robustrl.model.engines.vllm_plugin.RobustRLWeightTransfer.last`): one more round
        trip, so never on the load path."""
        return list(self._call(self.llm.collective_rpc("weight_transfer_engine"), 30.0))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._staging = None
        if self.server is not None:
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
        # vLLM's shutdown ends its engine-core process (and with it the workers and the KV cache),
        # by SIGKILL when SIGTERM did not within its timeout, and returns without reaping it; a
        # process that goes on (a replica borrowed as a trainer rank) must not keep it as a
        # zombie, nor run beside an engine that has not died yet.
        import multiprocessing

        deadline = time.monotonic() + CHILD_EXIT_S
        for child in multiprocessing.active_children():
            child.join(max(0.0, deadline - time.monotonic()))
        left = multiprocessing.active_children()
        if left:
            # Still running (a worker that ignores SIGTERM, an engine core vLLM did not kill): the
            # process goes on as something else (a trainer rank), which must not share the machine
            # (on a GPU: its memory) with an engine nobody tracks any more.
            log.warning("vLLM processes still running %.0f s after its shutdown, killed: %s", CHILD_EXIT_S,
                        [p.name for p in left])
            for child in left:
                child.kill()
                child.join(CHILD_EXIT_S)
