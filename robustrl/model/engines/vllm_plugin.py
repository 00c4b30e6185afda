"""vLLM side of RobustRL's weight transfer: a ``WeightTransferEngine`` named ``robustrl``.

vLLM loads :func:`register` from the ``vllm.general_plugins`` entry point in every engine
process. With ``weight_transfer_config={"backend": "robustrl"}`` each vLLM worker builds a
:class:`RobustRLWeightTransfer` next to its model; ``update_weights`` then hands it one version
in one of two ways:

- **segment** (what :class:`~robustrl.model.engines.vllm.VllmEngine` sends): the version's flat
  buffer lives in a memfd segment of the replica's process (the replica pulled it there, every
  chunk verified against the manifest as it arrived); the worker maps the segment
  (``/proc/<pid>/fd/<fd>``, no copy; mapped on the replica's hint once its pull completed, :class:`SegmentMap`)
  and calls the model's ``load_weights`` with views into it.
  The load is copies only: the bytes were verified when they arrived, so nothing is hashed
  here unless ``checksum`` asks for it (tests, audits).
- **sources**: the worker pulls the version chunk by chunk from RobustRL weight sources (a
  trainer rank, a relay, an in-memory weight server) with RobustRL's puller, each chunk checked
  against the manifest, for a worker that shares no memory with the replica.

Weights go from memory to memory, never through a file. A swap is one round trip to the
worker (:meth:`RobustRLWeightTransfer.__call__` with the update: start, load and finish there),
not the three of vLLM's session API (``start_weight_update``, ``update_weights``,
``finish_weight_update``, which work too). ``start_weight_update`` and
``finish_weight_update`` bracket the loads: layers whose parameters vLLM keeps in checkpoint
layout (embeddings, the LM head, norms; linear layers on GPU) are loaded straight into their
live tensors and their post-processing (on CPU: the oneDNN weight packing) runs again;
only layers that vLLM transformed after loading (CPU linear layers, whose weights it packed
and removed; quantized layers; attention) go through vLLM's layerwise reload, which restores
them in checkpoint layout, loads, re-processes and copies back (:func:`start_reload`). vLLM's
own reload would send every layer that way: for the layers kept in checkpoint layout that is
a fresh tensor, a copy into it and a second copy back, instead of one copy.

**CPU linear layout** (``ROBUSTRL_VLLM_CPU_LINEAR``, set by the engine from
``rollout.vllm_cpu_linear``): vLLM-CPU packs every linear layer's weight into oneDNN's blocked
layout after loading and drops the checkpoint-layout tensor, so each new version is unpacked into
fresh tensors, copied and packed again (most of a swap's time). ``plain`` keeps the weights in
checkpoint layout and multiplies with ``torch.nn.functional.linear``: a swap is copies into the
live tensors only, at some generation speed (``bench/engines.py`` measures both). ``packed``
(default) is vLLM's own choice.

Only ever imported inside a vLLM process (it imports vllm at module level).
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.v1.sample.logits_processor import LogitsProcessor

from robustrl.errors import WeightSyncError
from robustrl.model.engines.segments import SegmentMap

log = logging.getLogger(__name__)
BACKEND = "robustrl"

CPU_LINEAR_ENV = "ROBUSTRL_VLLM_CPU_LINEAR"
"""``plain`` or ``packed`` (module docstring); read by :func:`register` in each vLLM process."""
CPU_LINEARS = ("packed", "plain")

IN_PLACE_METHODS = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})
"""Quant methods whose post-processing keeps a layer's tensors in checkpoint layout and may run
again on new values (on CPU it re-packs the weight for oneDNN; elsewhere it does nothing)."""


def register() -> None:
    """Entry point: register the ``robustrl`` backend (idempotent: every process calls it)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "RobustRLWeightTransfer")
    layout = os.environ.get(CPU_LINEAR_ENV, "packed")
    if layout not in CPU_LINEARS:
        raise ValueError(f"{CPU_LINEAR_ENV}={layout!r}: one of {', '.join(CPU_LINEARS)}")
    if layout == "plain":
        plain_cpu_linear()


SAMPLE_VOCAB_ENV = "ROBUSTRL_VLLM_SAMPLE_VOCAB"
"""The tokenizer's vocabulary size when the model's embedding is padded past it; read by
:class:`SampleVocabMask` in vLLM's worker, set by the engine before vLLM spawns it."""


class SampleVocabMask(LogitsProcessor):
    """A batch-level vLLM logits processor: ids at or past the tokenizer's vocabulary (a padded
    embedding's extra rows: Qwen's 151936 rows for 151669 ids) are never sampled, as in the torch
    engine and the trainer (the request manager refuses such an id). One slice assignment per
    decode step for the whole batch, applied before temperature and top-p, so the logprobs vLLM
    returns (``processed_logprobs``) are of the distribution restricted to them. (Before, each
    request carried ``allowed_token_ids``: the whole vocabulary as a list, serialised to vLLM's
    engine process, validated and turned into a mask row, for every turn.)

    vLLM builds it in its worker from ``logits_processors``; the engine names it there only for
    a padded model."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        raw = os.environ.get(SAMPLE_VOCAB_ENV, "")
        try:
            self.vocab = int(raw)
        except ValueError:
            raise ValueError(f"{SAMPLE_VOCAB_ENV}={raw!r}: not a vocabulary size") from None
        if self.vocab <= 0:
            raise ValueError(f"{SAMPLE_VOCAB_ENV}={raw!r}: not a vocabulary size")

    def is_argmax_invariant(self) -> bool:
        return False  # it changes what greedy decoding picks too

    def update_state(self, batch_update: Any) -> None:
        return None  # the same for every request: no per-request state

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.vocab < logits.shape[-1]:
            logits[..., self.vocab:] = float("-inf")
        return logits


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


def plain_cpu_linear() -> None:
    """Keep CPU linear layers (and the LM head) in checkpoint layout: vLLM's CPU GEMM dispatch,
    which runs after every load, is replaced for 2-D weights by one that leaves the weight where
    it is and multiplies with ``torch.nn.functional.linear`` (vLLM's own fallback). Idempotent;
    vLLM's layers import the dispatch at call time, so replacing the module's name reaches them."""
    from vllm.model_executor.layers import utils

    if getattr(utils, "_robustrl_plain_linear", False):
        return
    packed = utils.dispatch_cpu_unquantized_gemm

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        if weight is None or weight.is_meta or weight.ndim != 2:
            return packed(layer, remove_weight)
        layer.cpu_linear = _linear
        return None

    utils.dispatch_cpu_unquantized_gemm = dispatch
    utils._robustrl_plain_linear = True


@dataclass
class RobustRLInitInfo(WeightTransferInitInfo):
    """Nothing to set up: where the weights are is named per update."""


@dataclass
class RobustRLUpdateInfo(WeightTransferUpdateInfo):
    """One version: a memfd segment to map (``segment``), or sources to pull it from.

    ``tensors``: ``[name, dtype, shape, offset]`` of each tensor in the segment. ``checksum``
    (optional, off by default): the worker checksums what it received
    (:func:`~robustrl.model.policy.weights_checksum`) and refuses a mismatch before loading.
    """

    version: int
    segment: str = ""
    segment_bytes: int = 0
    segment_ino: int = 0
    tensors: list[list[Any]] = field(default_factory=list)
    digest: str = ""
    sources: list[str] = field(default_factory=list)
    transport: str = "tcp"
    timeout_s: float = 120.0
    checksum: str = ""


# --- reload: in place where vLLM keeps the checkpoint layout, layerwise elsewhere ------------------


def _in_place(layer: torch.nn.Module, info: Any) -> bool | None:
    """True: the layer's live tensors are in checkpoint layout (load straight into them); False:
    vLLM transformed them (layerwise reload); None: nothing of it is loadable."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    params, buffers = info.restore_metadata
    recorded = params | buffers
    if not recorded:
        return None
    if is_deferred_attention_layer(layer):
        return False
    method = getattr(layer, "quant_method", None)
    if method is not None and type(method).__name__ not in IN_PLACE_METHODS:
        return False
    live = get_layer_tensors(layer)
    for name, meta in recorded.items():
        t = live.get(name)
        if t is None or t.shape != meta.shape or t.dtype != meta.dtype:
            return False
    return True


def start_reload(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Prepare ``model`` for ``load_weights`` of checkpoint-format (HF-named) tensors.

    Layers vLLM keeps in checkpoint layout are left as they are (their loaders copy straight
    into the live tensors); every other layer gets vLLM's layerwise reload (restored in
    checkpoint layout, loaded into fresh tensors, re-processed, copied back into the kernel
    tensors). Returns the in-place layers, for :func:`finish_reload`.
    """
    from vllm.model_executor.model_loader.reload.layerwise import (
        get_layerwise_info,
        initialize_online_processing,
    )
    from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta
    from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers

    # as initialize_layerwise_reload does, for the layers that need it only
    model._original_do_torchao_reload = getattr(model, "_do_torchao_reload", False)
    model._do_torchao_reload = False
    direct: list[torch.nn.Module] = []
    for layer in model.modules():
        info = get_layerwise_info(layer)
        if info.can_load():
            continue
        verdict = _in_place(layer, info)
        if verdict is None:
            continue
        if verdict:
            direct.append(layer)
            continue
        info.kernel_tensors = get_layer_params_buffers(layer)
        info.kernel_non_persistent_buffers = set(layer._non_persistent_buffers_set)
        restore_layer_on_meta(layer, info)
        initialize_online_processing(layer)
    return direct


def finish_reload(model: torch.nn.Module, model_config: Any, direct: list[torch.nn.Module]) -> None:
    """Finish the layerwise layers and re-run the in-place layers' post-processing.

    One exception: the input embedding of a model whose LM head is a layer of its own (untied
    embeddings). On CPU its post-processing packs a copy of the whole embedding matrix for
    oneDNN matmuls that only an LM head makes (the embedding itself is a row lookup), so
    re-packing it would spend a pass over the largest tensor for nothing.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)
    text_config = getattr(model_config, "hf_text_config", None)
    tied = bool(getattr(text_config, "tie_word_embeddings", True))
    for layer in direct:
        method = getattr(layer, "quant_method", None)
        if method is None:
            continue
        if not tied and isinstance(layer, VocabParallelEmbedding) and not isinstance(layer, ParallelLMHead):
            continue
        method.process_weights_after_loading(layer)


# --- the segment ----------------------------------------------------------------------------------


def segment_views(mm: mmap.mmap, tensors: list[list[Any]]) -> dict[str, torch.Tensor]:
    """name -> tensor viewing the mapped segment (no copy)."""
    flat = torch.frombuffer(mm, dtype=torch.uint8)
    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape, offset in tensors:
        dt = getattr(torch, dtype)
        n = 1
        for s in shape:
            n *= int(s)
        nbytes = n * torch.empty((), dtype=dt).element_size()
        out[name] = flat[offset:offset + nbytes].view(dt).view(*shape)
    return out


class RobustRLWeightTransfer(WeightTransferEngine[RobustRLInitInfo, RobustRLUpdateInfo]):
    """Loads a version from the replica's memory (or pulls it from weight sources) into the
    worker's model."""

    init_info_cls = RobustRLInitInfo
    update_info_cls = RobustRLUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: RobustRLInitInfo) -> None:
        return None

    last: dict[str, float]
    """Seconds of the last update's parts in this worker: ``start`` (layers prepared), ``map``
    (segment mapped / version pulled), ``checksum`` (only when asked), ``load`` (vLLM's
    ``load_weights``: the copies, and the layerwise layers' processing), ``finish`` (the
    remaining post-processing, e.g. CPU weight packing of the in-place layers); and
    ``plain_linear_layers``, a count: layers multiplying in checkpoint layout after it."""

    def __call__(self, update_info: dict[str, Any] | None = None,
                 prefetch: dict[str, Any] | None = None) -> dict[str, float]:
        """``collective_rpc("weight_transfer_engine")`` runs this in each worker: :attr:`last`.

        With ``update_info``, first the whole swap (start, load, finish) in this one call: one
        round trip from the replica instead of three. The replica never runs two swaps, or a swap
        and a generation, at once (its engine's lock), which is all vLLM's session flag guards.
        With ``prefetch`` (``segment``, ``segment_bytes``, ``segment_ino``): start mapping that
        segment, the next version's (:class:`SegmentMap`), and return at once.
        Asked with neither, the answer also counts the model's linear layers (``linear_layers``) and those that
        multiply in checkpoint layout (``plain_linear_layers``, :func:`plain_cpu_linear`).
        """
        if prefetch is not None:
            self._segments().prefetch(str(prefetch["segment"]), int(prefetch["segment_bytes"]),
                                      int(prefetch.get("segment_ino", 0)))
        if update_info is not None:
            from vllm.config import set_current_vllm_config

            t0 = time.perf_counter()
            with set_current_vllm_config(self.vllm_config):
                self.start_weight_update()
                self.update_weights(update_info)
                self.finish_weight_update()
            self.last["total"] = time.perf_counter() - t0
        out = dict(getattr(self, "last", {}))
        if update_info is None and prefetch is None:  # a query only: off the swap's path
            linears = [m for m in self.model.modules()
                       if type(getattr(m, "quant_method", None)).__name__ in IN_PLACE_METHODS]
            out["linear_layers"] = len(linears)
            out["plain_linear_layers"] = sum(getattr(m, "cpu_linear", None) is _linear for m in linears)
        return out

    def _segments(self) -> SegmentMap:
        if getattr(self, "_segment_map", None) is None:
            self._segment_map = SegmentMap()
        return self._segment_map

    def start_weight_update(self) -> None:
        t0 = time.perf_counter()
        self._direct = start_reload(self.model)
        self.last = {"start": time.perf_counter() - t0}

    def finish_weight_update(self) -> None:
        t0 = time.perf_counter()
        try:
            finish_reload(self.model, self.model_config, getattr(self, "_direct", []))
        finally:
            self._direct = []
            self._segments().release()  # held by receive_weights: the reload may read it until here
        self.last["finish"] = time.perf_counter() - t0

    def update_weights(self, update_info: dict[str, Any]) -> None:
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            # vLLM ends the update session without finish_weight_update: put the layers the
            # layerwise reload took apart back together (a model left half on the meta device
            # could not generate at all), then report.
            try:
                self.finish_weight_update()
            except Exception as exc:  # noqa: BLE001 - the first error is the one to report
                log.error("restoring the model after a failed weight update: %r", exc)
            raise
        if torch.cuda.is_available():  # the base class syncs the accelerator; CPU has none
            torch.cuda.synchronize()

    def receive_weights(self, update_info: RobustRLUpdateInfo) -> None:
        info = update_info
        t0 = time.perf_counter()
        buffer: Any = None
        if info.segment:
            # held until finish_weight_update (also on failure: update_weights calls it)
            state = segment_views(self._segments().hold(info.segment, info.segment_bytes, info.segment_ino),
                                  info.tensors)
            nbytes = info.segment_bytes
        else:
            from robustrl.weights.flat import unflatten

            manifest, buffer = self._pull(info)
            state = unflatten(torch.from_numpy(buffer), manifest)
            nbytes = manifest.total_bytes
        t1 = time.perf_counter()
        self.last["map" if info.segment else "pull"] = t1 - t0
        try:
            if info.checksum:
                from robustrl.model.policy import weights_checksum

                got = weights_checksum(state)
                t2 = time.perf_counter()
                self.last["checksum"], t1 = t2 - t1, t2
                if got != info.checksum:
                    raise WeightSyncError("the weights received do not match the expected checksum",
                                          version=info.version, expected=info.checksum, got=got,
                                          reason="load_mismatch")
            device = getattr(self, "device", None)
            on_cpu = device is None or torch.device(device).type == "cpu"
            weights = ((name, t if on_cpu else t.to(device, non_blocking=True)) for name, t in state.items())
            self.model.load_weights(weights)
            self.last["load"] = time.perf_counter() - t1
            self.last["bytes"] = nbytes
        finally:
            state.clear()  # the segment stays mapped (SegmentMap) until the next one is

    @staticmethod
    def _pull(info: RobustRLUpdateInfo) -> tuple[Any, Any]:
        from robustrl.weights.puller import fetch_manifest, pull

        async def fetch() -> tuple[Any, Any]:
            manifest = await fetch_manifest(info.sources, info.version, info.digest, transport=info.transport)
            buffer, _stats = await pull(manifest, info.sources, transport=info.transport, timeout_s=info.timeout_s)
            return manifest, buffer

        # collective_rpc runs in the engine core's thread; the pull gets an event loop of its own.
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["out"] = asyncio.run(fetch())
            except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread below
                box["err"] = exc

        t = threading.Thread(target=run, name="robustrl-weight-pull")
        t.start()
        t.join()
        if "err" in box:
            raise box["err"]
        return box["out"]

    def shutdown(self) -> None:
        return None
