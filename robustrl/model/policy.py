"""The policy network: a Qwen3-architecture causal LM from transformers, sized by ``ModelSpec``.

Random init is seeded without touching the process's global RNG stream (``fork_rng``), so
building a policy in the middle of a job does not shift any other random draw.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from robustrl.config import ModelSpec
from robustrl.errors import ConfigError
from robustrl.model.tokenizer import CharTokenizer


def policy_config(spec: ModelSpec, tokenizer: CharTokenizer) -> Qwen3Config:
    """The Qwen3Config for ``spec`` and the tokenizer's vocabulary."""
    return Qwen3Config(
        vocab_size=tokenizer.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        # Qwen3Config defaults head_dim to 128 whatever the width; derive it from the spec.
        head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=spec.max_positions,
        # Untied: every parameter has exactly one name, which keeps state dicts, checksums and
        # weight-transfer chunking free of aliasing.
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_id,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eot_id,
        use_cache=True,
    )


def build_policy(spec: ModelSpec, tokenizer: CharTokenizer | Any, seed: int) -> torch.nn.Module:
    """Build the policy: random init seeded by ``seed``, or loaded from ``spec.path``.

    Args:
        spec: sizes (ignored when ``spec.path`` is set, except for the vocabulary check).
        tokenizer: its ``vocab_size`` sets the embedding and head sizes.
        seed: init seed; the same seed gives bit-identical weights in every process.

    Raises:
        ConfigError: ``spec.path`` cannot be loaded or its vocabulary does not fit the tokenizer.
    """
    if spec.path:
        path = Path(spec.path)
        try:
            # Any causal LM architecture transformers knows (Qwen3, Llama, ...), from disk only.
            model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"cannot load policy from {path}: {exc}", field="model.path") from exc
        if model.config.vocab_size < tokenizer.vocab_size:
            raise ConfigError(f"model vocabulary {model.config.vocab_size} is smaller than the "
                              f"tokenizer's {tokenizer.vocab_size}", field="model.path")
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen3ForCausalLM(policy_config(spec, tokenizer))
    model.to(torch.float32)
    model.eval()
    return model


def save_policy(model: torch.nn.Module, tokenizer: CharTokenizer, directory: str | Path) -> Path:
    """Write model and tokenizer to ``directory`` so ``ModelSpec(path=directory)`` loads them."""
    directory = Path(directory)
    model.save_pretrained(str(directory))  # type: ignore[operator]
    tokenizer.save(directory)
    return directory


def parameter_count(model: torch.nn.Module) -> int:
    """Number of scalar parameters."""
    return sum(p.numel() for p in model.parameters())


def weights_checksum(model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor]) -> str:
    """sha256 over the state dict in sorted name order: name, dtype, shape and raw bytes.

    A module and its ``state_dict()`` give the same checksum, so a trainer rank, a replica that
    loaded pulled chunks, and a checkpoint can be compared directly. A DDP wrapper's ``module.``
    prefix is stripped so the wrapper and the bare model agree too.
    """
    if isinstance(model_or_state_dict, torch.nn.Module):
        state = model_or_state_dict.state_dict()
    else:
        state = model_or_state_dict
    digest = hashlib.sha256()
    items = sorted(((name.removeprefix("module."), tensor) for name, tensor in state.items()),
                   key=lambda item: item[0])
    for name, tensor in items:
        t = tensor.detach().to("cpu").contiguous()
        digest.update(name.encode())
        digest.update(f"|{t.dtype}|{tuple(t.shape)}|".encode())
        # view as bytes: works for every dtype numpy lacks (bfloat16) without a copy per element.
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
