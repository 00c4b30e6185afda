"""vLLM side of RobustRL's weight transfer: a ``WeightTransferEngine`` named ``robustrl``.

vLLM loads :func:`register` from the ``vllm.general_plugins`` entry point in every engine
process. With ``weight_transfer_config={"backend": "robustrl"}`` each vLLM worker builds a
:class:`RobustRLWeightTransfer` next to its model; ``update_weights`` then hands it
``{version, digest, sources, checksum}``, and the worker pulls that version chunk by chunk from
RobustRL's own weight sources (the replica's in-memory weight server; any trainer rank or relay
serves the same protocol), checks each chunk against the manifest and the whole state dict
against the checksum, and calls the model's ``load_weights`` with views into the pulled buffer:
weights go from memory to memory, never through a file.

Only ever imported inside a vLLM process (it imports vllm at module level).
"""

from __future__ import annotations

import asyncio
import logging
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

from robustrl.errors import WeightSyncError

log = logging.getLogger(__name__)
BACKEND = "robustrl"


def register() -> None:
    """Entry point: register the ``robustrl`` backend (idempotent: every process calls it)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "RobustRLWeightTransfer")


@dataclass
class RobustRLInitInfo(WeightTransferInitInfo):
    """Nothing to set up: sources are named per update."""


@dataclass
class RobustRLUpdateInfo(WeightTransferUpdateInfo):
    """One version to pull: its number, manifest digest, where to pull it, and its checksum."""

    version: int
    digest: str
    sources: list[str] = field(default_factory=list)
    checksum: str = ""
    transport: str = "tcp"
    timeout_s: float = 120.0


class RobustRLWeightTransfer(WeightTransferEngine[RobustRLInitInfo, RobustRLUpdateInfo]):
    """Pulls a version from RobustRL weight sources and loads it into the worker's model."""

    init_info_cls = RobustRLInitInfo
    update_info_cls = RobustRLUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: RobustRLInitInfo) -> None:
        return None

    def start_weight_update(self) -> None:
        # Checkpoint-format (HF-named) tensors go through vLLM's layerwise reload: the model's
        # loaders are restored for the update and its post-processing (fused / repacked layouts)
        # runs again when the update finishes.
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.cuda.is_available():  # the base class syncs the accelerator; CPU has none
            torch.cuda.synchronize()

    def receive_weights(self, update_info: RobustRLUpdateInfo) -> None:
        from robustrl.model.policy import weights_checksum
        from robustrl.weights.flat import unflatten
        from robustrl.weights.puller import fetch_manifest, pull

        info = update_info
        t0 = time.monotonic()

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
        manifest, buffer = box["out"]
        state = unflatten(torch.from_numpy(buffer), manifest)
        pulled_s = time.monotonic() - t0
        if info.checksum:
            got = weights_checksum(state)
            if got != info.checksum:
                raise WeightSyncError("pulled weights do not match the announced checksum", version=info.version,
                                      expected=info.checksum, got=got)
        device = getattr(self, "device", None)
        weights = ((name, tensor if device is None else tensor.to(device, non_blocking=True))
                   for name, tensor in state.items())
        self.model.load_weights(weights)
        log.info("robustrl weights v%d: %d B pulled in %.3fs, loaded in %.3fs", info.version, manifest.total_bytes,
                 pulled_s, time.monotonic() - t0 - pulled_s)

    def shutdown(self) -> None:
        return None
