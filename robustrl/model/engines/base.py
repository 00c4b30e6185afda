"""The rollout engine interface: what a replica needs from a generation engine.

Two implementations: :class:`~robustrl.model.engine.GenerationEngine` (``rollout.engine:
torch``, a static-batch KV-cache decoder in the replica's own process, the light default) and
:class:`~robustrl.model.engines.vllm.VllmEngine` (``rollout.engine: vllm``, vLLM's ``AsyncLLM``
v1 engine, which runs from its own virtual environment). The replica talks to either through
this interface only:

- ``generate``: many episodes' turns at once (concurrent requests), each stopping on eos, on
  the tool-call marker (when ``stop_on_call``) or at its length budget; behaviour logprobs of
  the distribution actually sampled.
- ``tokens_generated``: a running token counter (the replica's throughput metric; the vLLM
  engine's is vLLM's own count, from its per-iteration stats).
- ``abort``: ends every in-flight request; the ``generate`` call raises ``GenerationAborted``.
- ``load_weights``: swaps new weights in place (no restart, no disk). Copies only: the bytes
  were verified as they arrived (every chunk against the manifest, the whole version against
  the announced checksum, by the replica's loader before the swap), so the swap hashes nothing
  unless asked to (``checksum``: tests, audits).
- ``alloc_buffer``: where the replica pulls a version so the engine loads it with the fewest
  copies (the vLLM engine's buffers are shared-memory segments its worker process maps);
  ``prepare_buffer``: such a buffer holds a whole version now, likely the next one loaded (a hint:
  vLLM's worker maps it then, while the replica checks the version, not during the swap).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from robustrl.model.engine import GenRequest, GenResult


class Engine(abc.ABC):
    """A generation engine behind a rollout replica."""

    name: str = "engine"
    max_batch: int
    tokens_generated: int

    @abc.abstractmethod
    def generate(self, requests: Sequence[GenRequest], on_token: Callable[[int], None] | None = None,
                 should_abort: Callable[[], bool] | None = None) -> list[GenResult]:
        """Generate every request concurrently; results in request order.

        Raises:
            GenerationAborted: ``abort()`` was called or ``should_abort`` returned True.
        """

    @abc.abstractmethod
    def abort(self) -> None:
        """End every in-flight request (callable from any thread)."""

    @abc.abstractmethod
    def load_weights(self, state: Mapping[str, torch.Tensor], version: int = -1, *, checksum: str = "") -> None:
        """Load ``state`` (HF parameter names) in place, between generations: copies only.

        Args:
            state: the new weights, e.g. views into a buffer from :meth:`alloc_buffer`.
            version: the weights version (for the engine's own records).
            checksum: optional; when given, the engine also checksums the weights as it holds
                or received them (:func:`~robustrl.model.policy.weights_checksum`) and raises
                on a mismatch. Off the hot path: for tests and audits.

        Raises:
            WeightSyncError: the engine could not load them (``reason`` ``load_mismatch`` when
                ``checksum`` did not match).
        """

    def alloc_buffer(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer to pull a version of ``nbytes`` into (plain memory by default)."""
        return np.empty(nbytes, dtype=np.uint8)

    def prepare_buffer(self, buffer: np.ndarray) -> None:  # noqa: B027 - a hint: nothing to do by default
        """``buffer`` (from :meth:`alloc_buffer`) holds a complete version now, which is likely
        the next one loaded. A hint only: never required before :meth:`load_weights`."""

    @abc.abstractmethod
    def layout(self) -> dict[str, tuple[str, list[int]]]:
        """name -> (dtype, shape) of the state dict ``load_weights`` takes."""

    def close(self) -> None:
        """Release the engine (repeat calls are harmless)."""
