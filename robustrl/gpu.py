"""What the driver says about the GPU a member computes on: NVML readings for its metrics.

GPU path only: ``nvidia-ml-py`` (``pynvml``) is imported when a member places its model on
``cuda``, never otherwise. A member on a GPU reports in each metrics sample its device's
utilisation, the memory its own process holds there, and whether the driver still answers for
the device -- read by the driver, not by the member's own bookkeeping.

``gpu_lost``: NVML says the GPU is lost (Xid 79, "fallen off the bus"). The detector faults the
member at once: a process on a lost GPU can neither compute nor be trusted to exit, and waiting
for its silence or its idle trainer costs ``trainer_idle_s`` and more.

Utilisation is deliberately *not* progress for the hang rules: a collective stuck in NCCL keeps
its GPU 100 % busy while the job goes nowhere.

NVML calls can block for seconds on a failing device, so a thread reads them and the metrics
loop only takes the last reading (older than ``STALE_S``: reported as unknown).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

READ_INTERVAL_S = 1.0
STALE_S = 10.0
"""A reading older than this is reported as unknown (the reader thread is stuck in the driver)."""


@dataclass(frozen=True)
class GpuReading:
    util_pct: float | None = None
    """Device utilisation over NVML's last sample period (percent of time a kernel ran)."""
    mem_bytes: int | None = None
    """GPU memory held by this process (None: NVML does not list it, e.g. another pid namespace)."""
    lost: bool = False
    at: float = 0.0  # monotonic


def _pick(nvml: Any, uuid: str | None, index: int) -> tuple[Any, str]:
    """The NVML handle of the CUDA device: by UUID (CUDA and NVML number devices differently
    under ``CUDA_VISIBLE_DEVICES``), else by index where no mask renumbers them. A MIG slice's
    uuid names no whole device: no handle (no metrics), never another device's."""
    if uuid:
        want = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            found = nvml.nvmlDeviceGetUUID(handle)
            if (found.decode() if isinstance(found, bytes) else found) == want:
                return handle, f"uuid {want}"
    if os.environ.get("CUDA_VISIBLE_DEVICES") is None:
        return nvml.nvmlDeviceGetHandleByIndex(index), f"index {index}"
    raise LookupError(f"no NVML device has the CUDA device's uuid {uuid!r}")


class GpuProbe:
    """Reads one device through NVML in a thread; :meth:`reading` is the newest reading."""

    def __init__(self, nvml: Any, handle: Any, pid: int | None = None) -> None:
        self.nvml = nvml
        self.handle = handle
        self.pid = os.getpid() if pid is None else pid
        self._last = GpuReading()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_device(cls, device: Any) -> GpuProbe | None:
        """A started probe for a ``torch.device`` on CUDA; None on the CPU or without NVML."""
        if getattr(device, "type", None) != "cuda":
            return None
        try:
            import pynvml  # GPU path only
        except ImportError:
            log.info("no nvidia-ml-py: GPU metrics not reported")
            return None
        import torch

        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            pynvml.nvmlInit()
            uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
            handle, how = _pick(pynvml, uuid, index)
        except (pynvml.NVMLError, LookupError, RuntimeError, AssertionError) as exc:  # metrics only: never the start
            log.warning("NVML unavailable for cuda:%d: %s; GPU metrics not reported", index, exc)
            return None
        log.info("GPU metrics for cuda:%d from NVML (%s)", index, how)
        return cls(pynvml, handle).start()

    def read_once(self) -> GpuReading:
        nvml = self.nvml
        util = mem = None
        try:
            util = float(nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)
            for proc in nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
                if proc.pid == self.pid and proc.usedGpuMemory is not None:
                    mem = int(proc.usedGpuMemory)
        except nvml.NVMLError as exc:
            if isinstance(exc, getattr(nvml, "NVMLError_GpuIsLost", ())):
                return GpuReading(lost=True, at=time.monotonic())
            log.debug("NVML read failed: %s", exc)
        return GpuReading(util, mem, False, time.monotonic())

    def _run(self) -> None:
        while not self._stop.is_set():
            self._last = self.read_once()
            self._stop.wait(READ_INTERVAL_S)

    def start(self) -> GpuProbe:
        self._last = self.read_once()
        self._thread = threading.Thread(target=self._run, name="nvml", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()

    def reading(self) -> GpuReading:
        last = self._last
        if time.monotonic() - last.at > STALE_S:
            return GpuReading(lost=last.lost, at=last.at)
        return last
