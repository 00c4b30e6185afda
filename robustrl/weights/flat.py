"""Flat weight buffers: a state dict packed into one contiguous uint8 tensor, and back.

One contiguous buffer lets the transports send a version as a few large chunks with no
per-tensor framing, and lets a replica read tensors back as views (no copies) of the very
buffer it pulled into. Tensor offsets are aligned to ``ALIGN`` bytes so every view is aligned
for its dtype.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from robustrl.errors import WeightSyncError
from robustrl.weights.manifest import Manifest, TensorEntry, build_manifest

ALIGN = 64
"""Byte alignment of every tensor in the buffer (a cache line; enough for any dtype)."""

BufferLike = torch.Tensor | np.ndarray | bytearray | memoryview


def dtype_name(dtype: torch.dtype) -> str:
    """Bare dtype name as stored in manifests: ``torch.bfloat16`` -> ``'bfloat16'``."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; raises WeightSyncError for an unknown name."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightSyncError("unknown dtype in manifest", dtype=name)
    return dtype


def _aligned(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


def flatten_state_dict(
    state_dict: Mapping[str, torch.Tensor], version: int, chunk_bytes: int
) -> tuple[torch.Tensor, Manifest]:
    """Pack ``state_dict`` into one contiguous uint8 CPU tensor and describe it.

    Args:
        state_dict: tensor name -> tensor (any device; copied to CPU).
        version: the weights version the buffer represents.
        chunk_bytes: transfer chunk size written into the manifest.

    Returns:
        (buffer, manifest): buffer is a 1-D ``torch.uint8`` tensor of ``manifest.total_bytes``.
    """
    entries: list[TensorEntry] = []
    offset = 0
    for name, tensor in state_dict.items():
        offset = _aligned(offset)
        nbytes = tensor.numel() * tensor.element_size()
        entries.append(TensorEntry(name=name, dtype=dtype_name(tensor.dtype), shape=list(tensor.shape),
                                   offset=offset, nbytes=nbytes))
        offset += nbytes
    buffer = torch.zeros(offset, dtype=torch.uint8)  # zeros: padding bytes are deterministic
    with torch.no_grad():
        for entry, tensor in zip(entries, state_dict.values(), strict=True):
            if entry.nbytes:
                dst = buffer[entry.offset:entry.offset + entry.nbytes].view(tensor.dtype).view(tensor.shape)
                dst.copy_(tensor.detach())
    manifest = build_manifest(version, entries, buffer.numpy(), chunk_bytes)
    return buffer, manifest


def as_uint8_tensor(buffer: BufferLike) -> torch.Tensor:
    """A 1-D uint8 torch view of ``buffer`` (no copy; torch<->numpy share memory)."""
    if isinstance(buffer, torch.Tensor):
        return buffer.view(torch.uint8).reshape(-1)
    if isinstance(buffer, np.ndarray):
        return torch.from_numpy(buffer.reshape(-1).view(np.uint8))
    if len(buffer) == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buffer, dtype=torch.uint8)


def unflatten(buffer: BufferLike, manifest: Manifest) -> dict[str, torch.Tensor]:
    """Tensors of ``manifest`` as views into ``buffer`` (no copies).

    Raises:
        WeightSyncError: the buffer is shorter than the manifest says.
    """
    flat = as_uint8_tensor(buffer)
    if flat.numel() < manifest.total_bytes:
        raise WeightSyncError("buffer shorter than manifest", version=manifest.version,
                              have=flat.numel(), need=manifest.total_bytes)
    out: dict[str, torch.Tensor] = {}
    for entry in manifest.tensors:
        dtype = torch_dtype(entry.dtype)
        out[entry.name] = flat[entry.offset:entry.offset + entry.nbytes].view(dtype).view(entry.shape)
    return out


def expected_layout(model: torch.nn.Module) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype name, shape) of a model's state dict, for ``Manifest.check_matches``."""
    return {name: (dtype_name(t.dtype), list(t.shape)) for name, t in model.state_dict().items()}


def load_into(model: torch.nn.Module, buffer: BufferLike, manifest: Manifest) -> None:
    """Copy a pulled version into ``model``'s parameters and buffers in place.

    Raises:
        WeightSyncError: (not retryable) naming the first tensor whose name, dtype or shape
            differs between the version and the model; the model is left untouched.
    """
    manifest.check_matches(expected_layout(model))
    tensors = unflatten(buffer, manifest)
    state = model.state_dict()
    with torch.no_grad():
        for name, target in state.items():
            target.copy_(tensors[name])
