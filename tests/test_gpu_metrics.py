"""GPU metrics from NVML (robustrl.gpu) and the detector's GPU-lost rule.

NVML needs a GPU and its driver, which this machine lacks: the probe's own logic (which device
is the member's, which memory is its process's, a lost device, a reader stuck in the driver) is
driven here through a stand-in NVML module; the real driver is read by ``scripts/gpu-check.sh``
on a lent GPU machine (metrics of a job's members seen on the bus).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from support import eventually
from test_detector_rules import CFG, JOB, Member, Run, monitor, progressing

from robustrl import gpu as gpu_mod
from robustrl.gpu import GpuProbe, _pick
from robustrl.messages import MetricsSample


class NVMLError(Exception):
    pass


class NVMLError_GpuIsLost(NVMLError):  # noqa: N801 -- pynvml's own name
    pass


class FakeNVML:
    """Two devices, as NVML numbers them; ``lost`` makes every call raise GpuIsLost."""

    NVMLError = NVMLError
    NVMLError_GpuIsLost = NVMLError_GpuIsLost

    def __init__(self, uuids: list[str], procs: list[tuple[int, int | None]], util: int = 87) -> None:
        self.uuids, self.procs, self.util, self.lost = uuids, procs, util, False

    def _check(self) -> None:
        if self.lost:
            raise NVMLError_GpuIsLost()

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return len(self.uuids)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:  # noqa: N802
        return i

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:  # noqa: N802
        return self.uuids[handle].encode()

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:  # noqa: N802
        self._check()
        return SimpleNamespace(gpu=self.util, memory=10)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:  # noqa: N802
        self._check()
        return [SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in self.procs]


def test_the_members_device_is_found_by_uuid_not_by_cuda_index(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNVML(["GPU-aaaa", "GPU-bbbb"], [])
    # CUDA_VISIBLE_DEVICES=1: CUDA's device 0 is NVML's device 1.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert _pick(nvml, "bbbb", 0) == (1, "uuid GPU-bbbb")
    with pytest.raises(LookupError):  # never a guess by index under a mask
        _pick(nvml, "cccc", 0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert _pick(nvml, "", 1) == (1, "index 1")


def test_a_reading_holds_this_process_memory_only_and_a_lost_gpu_says_so() -> None:
    nvml = FakeNVML(["GPU-aaaa"], [(111, 5 << 30), (222, 3 << 30)])
    probe = GpuProbe(nvml, 0, pid=222)
    r = probe.read_once()
    assert (r.util_pct, r.mem_bytes, r.lost) == (87.0, 3 << 30, False)
    assert GpuProbe(nvml, 0, pid=333).read_once().mem_bytes is None  # not listed: unknown, not 0
    nvml.lost = True
    assert probe.read_once().lost


def test_a_reader_stuck_in_the_driver_reports_unknown_not_its_last_values() -> None:
    probe = GpuProbe(FakeNVML(["GPU-aaaa"], [(7, 1 << 20)]), 0, pid=7)
    probe._last = probe.read_once()
    assert probe.reading().util_pct == 87.0
    # The reader thread has not come back from the driver for longer than STALE_S.
    probe._last = dataclasses.replace(probe._last, at=time.monotonic() - gpu_mod.STALE_S - 1)
    stale = probe.reading()
    assert stale.util_pct is None and stale.mem_bytes is None and not stale.lost


def test_no_probe_on_the_cpu() -> None:
    assert GpuProbe.for_device(torch.device("cpu")) is None


@pytest.mark.parametrize("bad", [{"gpu_util_pct": 101.0}, {"gpu_util_pct": math.nan}, {"gpu_util_pct": -1.0},
                                 {"gpu_mem_bytes": -5}, {"gpu_lost": "yes"}])
def test_a_sample_with_impossible_gpu_values_is_refused(bad: dict[str, Any]) -> None:
    base = {"job_id": JOB, "member_id": "t0", "role": "trainer", "seq": 1, "ts": 1.0, "phase": "training"}
    with pytest.raises(ValidationError) as err:
        MetricsSample.model_validate_json(json.dumps({**base, **bad}))  # as it would come off the bus
    assert next(iter(bad)) in str(err.value)


class GpuMember(Member):
    """A fake member that also reports NVML readings."""

    util: float | None = None
    lost: bool = False

    def sample(self, now: float) -> MetricsSample:
        msg = super().sample(now)
        msg = msg.model_copy(update={"gpu_util_pct": self.util, "gpu_lost": self.lost})
        self.sent[-1] = msg
        return msg


def test_a_lost_gpu_is_a_crash_at_once_though_the_member_still_answers() -> None:
    run, t = Run(monitor()), GpuMember("t0", "trainer", phase="training")
    run.advance(2.0, [t], step=progressing)
    t.lost = True
    lost_at = run.now
    run.advance(1.0, [t], step=progressing)  # still sending, even still counting
    assert len(run.faults) == 1
    at, fault = run.faults[0]
    assert fault.kind == "crash" and fault.member_id == "t0" and "GPU lost" in fault.evidence
    assert at - lost_at <= 2 * 0.25 and abs(fault.fault_at - lost_at) <= 0.25 + 1e-6
    assert run.probes == []


def test_a_busy_gpu_is_no_progress_for_a_trainer_stuck_in_training() -> None:
    """A collective stuck in NCCL keeps the GPU at 100 %: still a hang after trainer_idle_s."""
    run, t = Run(monitor()), GpuMember("t0", "trainer", phase="training")
    t.util = 100.0
    run.advance(2.0, [t], step=progressing)
    run.advance(CFG.trainer_idle_s + 1.0, [t])
    assert [f.kind for _, f in run.faults] == ["hang"]


def test_any_other_nvml_error_is_unknown_values_never_a_lost_gpu() -> None:
    nvml = FakeNVML(["GPU-aaaa"], [(7, 1 << 20)])

    def fails(_handle: int) -> Any:
        raise NVMLError("driver busy")
    nvml.nvmlDeviceGetUtilizationRates = fails  # type: ignore[method-assign]
    r = GpuProbe(nvml, 0, pid=7).read_once()
    assert (r.util_pct, r.mem_bytes, r.lost) == (None, None, False)


def test_a_stale_reading_keeps_saying_the_gpu_is_lost() -> None:
    probe = GpuProbe(FakeNVML(["GPU-aaaa"], []), 0)
    probe._last = gpu_mod.GpuReading(lost=True, at=time.monotonic() - gpu_mod.STALE_S - 1)
    assert probe.reading().lost


def test_the_members_sample_carries_its_probes_reading_and_closing_stops_the_reader() -> None:
    from robustrl.config import Settings
    from robustrl.member import Identity, Member

    member = Member(Identity(JOB, "t0", "trainer"), Settings())
    assert member.sample().gpu_util_pct is None and not member.sample().gpu_lost  # no probe: unknown
    nvml = FakeNVML(["GPU-aaaa"], [(4242, 3 << 30)], util=64)
    member.gpu = GpuProbe(nvml, 0, pid=4242).start()
    sample = member.sample()
    assert (sample.gpu_util_pct, sample.gpu_mem_bytes, sample.gpu_lost) == (64.0, 3 << 30, False)
    nvml.lost = True
    eventually(lambda: member.sample().gpu_lost, timeout=5, what="the reader thread saw the lost GPU")
    asyncio.run(member.close())
    assert member.gpu._thread is not None
    member.gpu._thread.join(gpu_mod.READ_INTERVAL_S + 2)
    assert not member.gpu._thread.is_alive()


def test_the_detector_takes_a_sample_only_from_its_own_members_subject() -> None:
    from robustrl.services.detector.service import _consistent

    assert _consistent(JOB, f"rrl.{JOB}.metrics.t0", "t0")
    assert not _consistent(JOB, f"rrl.{JOB}.metrics.r1", "t0")  # r1 speaking for t0 (a lost GPU...)
    assert not _consistent(JOB, "rrl.other.metrics.t0", "t0")


async def test_an_object_collective_run_in_a_thread_runs_on_the_ranks_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.cuda.set_device`` holds for the thread that called it; the trainer runs NCCL's
    ``all_gather_object`` in a worker thread (``to_thread``), where the current device is cuda:0
    again, so every rank of a machine put its object tensors on GPU 0. The wrapped call sets the
    rank's device in the thread it runs in. (Pure logic: ``set_device`` is recorded, not called.)"""
    import asyncio
    import threading

    import torch

    from robustrl.services.trainer.worker import TrainerWorker

    calls: list[tuple[object, int]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: calls.append((dev, threading.get_ident())))
    worker = object.__new__(TrainerWorker)
    worker.device = torch.device("cuda", 1)
    ran: list[int] = []
    out = await asyncio.to_thread(worker._on_device(lambda x: (ran.append(threading.get_ident()), x)[1]), 7)
    assert out == 7 and calls == [(torch.device("cuda", 1), ran[0])] and ran[0] != threading.get_ident()
    worker.device = torch.device("cpu")
    calls.clear()
    assert await asyncio.to_thread(worker._on_device(lambda: 3)) == 3 and not calls
