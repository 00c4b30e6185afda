"""The trainer's random generators: capture and restore their state, and seed them per step.

Python's, NumPy's and torch's global generators (CUDA too when initialized). Seeding from
(job seed, step, rank) at the start of each step makes a step redone after a recovery draw
exactly what its first run drew, so a redo reproduces the lost work rather than a variant of it.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch


def capture_rng() -> dict[str, Any]:
    """The state of Python's, NumPy's and torch's global generators (CUDA too when initialized)."""
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            # int64 keeps the uint32 key exact and loads under weights_only.
            "key": torch.from_numpy(np.asarray(np_state["state"]["key"], dtype=np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set the global generators from a ``capture_rng()`` result."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state({
        "bit_generator": np_state["bit_generator"],
        "state": {"key": np.asarray(np_state["key"].numpy(), dtype=np.uint32), "pos": np_state["pos"]},
        "has_gauss": np_state["has_gauss"],
        "gauss": np_state["gauss"],
    })
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_rng(seed: int, step: int, rank: int) -> None:
    """Seed Python's, NumPy's and torch's generators from (job seed, step, rank), so a step that
    is redone after a recovery draws exactly what its first run drew."""
    value = int.from_bytes(hashlib.sha256(f"{seed}:{step}:{rank}".encode()).digest()[:8], "little")
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)


