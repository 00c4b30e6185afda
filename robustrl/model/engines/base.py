"""The rollout engine interface: what a replica needs from a generation engine.

Two implementations: :class:`~robustrl.model.engine.GenerationEngine` (``rollout.engine:
torch``, a static-batch KV-cache decoder in the replica's own process, the light default) and
:class:`~robustrl.model.engines.vllm.VllmEngine` (``rollout.engine: vllm``, vLLM's ``AsyncLLM``
v1 engine, which runs from its own virtual environment). The replica talks to either through
this interface only:

- ``generate``: many episodes' turns at once (concurrent requests), each stopping on eos, on
  the tool-call marker (when ``stop_on_call``) or at its length budget; behaviour logprobs of
  the distribution actually sampled.
- ``tokens_generated``: a running token counter (the replica's throughput metric).
- ``abort``: ends every in-flight request; the ``generate`` call raises ``GenerationAborted``.
- ``load_weights``: swaps new weights in place (no restart, no disk), returns the checksum the
  engine verified for them.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

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
    def load_weights(self, state: Mapping[str, torch.Tensor], version: int = -1) -> str:
        """Load ``state`` (HF parameter names) in place, between generations.

        Returns:
            The checksum (``weights_checksum``) of the weights the engine now holds, as the
            engine verified it.
        """

    @abc.abstractmethod
    def layout(self) -> dict[str, tuple[str, list[int]]]:
        """name -> (dtype, shape) of the state dict ``load_weights`` takes."""

    def close(self) -> None:
        """Release the engine (repeat calls are harmless)."""
