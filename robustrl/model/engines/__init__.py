"""Rollout engines behind one interface (:class:`~robustrl.model.engines.base.Engine`), and the
factory a replica calls: ``rollout.engine`` picks ``torch`` (default) or ``vllm``."""

from __future__ import annotations

import logging
from typing import Any

from robustrl.errors import ConfigError
from robustrl.model.engines.base import Engine

ENGINES = ("torch", "vllm")
log = logging.getLogger(__name__)

__all__ = ["ENGINES", "Engine", "make_engine"]


def make_engine(spec: Any) -> tuple[Engine, Any]:
    """Build the replica's engine and episode tokenizer for a ``JobSpec``.

    Raises:
        ConfigError: an unknown ``rollout.engine``; ``vllm`` without a Hugging Face ``model.path``
            or without vllm installed; a missing or tokenizer-less ``model.path``.
    """
    from robustrl.model.hf import ChatTokenizer, load_tokenizer

    kind = spec.rollout.engine
    if kind not in ENGINES:
        raise ConfigError(f"unknown rollout engine {kind!r} (known: {', '.join(ENGINES)})", field="rollout.engine")
    tok = load_tokenizer(spec.model)
    if kind == "vllm":
        if not isinstance(tok, ChatTokenizer):
            raise ConfigError("rollout.engine vllm needs model.path: a Hugging Face model directory",
                              field="model.path")
        from robustrl.model.engines.vllm import VllmEngine

        return VllmEngine(spec.model.path, tok, max_batch=spec.rollout.max_batch,
                          max_model_len=spec.model.max_positions, seed=spec.seed,
                          chunk_bytes=spec.weights.chunk_bytes, cpu_linear=spec.rollout.vllm_cpu_linear,
                          gpu_memory_utilization=spec.rollout.vllm_memory_fraction()), tok
    import torch

    from robustrl.model.engine import GenerationEngine
    from robustrl.model.policy import build_policy

    model = build_policy(spec.model, tok, spec.seed)
    if spec.model.device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("model.device is cuda but torch sees no CUDA device", field="model.device")
        model = model.to("cuda")
        log.info("torch engine on %s (%s)", next(model.parameters()).device, torch.cuda.get_device_name())
    return GenerationEngine(model, tok, max_batch=spec.rollout.max_batch, max_positions=spec.model.max_positions), tok
