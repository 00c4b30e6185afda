"""The real detector process survives its own outages (issue 10): frozen (SIGSTOP) for longer
than every threshold, or killed and restarted, it raises nothing from its own gap, rebuilds
each member from its next messages, and reports a fault it had already reported under the same
fault id, so the controller handles it once."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from support import eventually_async, own_servers
from test_detector_service import THRESHOLDS, Job

from robustrl.bus import Bus
from robustrl.config import Settings, reference_job
from robustrl.messages import FaultReport, SpecReply, SpecRequest
from robustrl.subjects import Verb, subject

pytestmark = pytest.mark.timeout(120)

WAIT_S = 15.0
FREEZE_S = 3 * (THRESHOLDS.silence_s + THRESHOLDS.probe_timeout_s + THRESHOLDS.rollout_idle_s)


@pytest.fixture(scope="module")
def own_infra(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """Servers of this module's own: no other detector may answer for ours."""
    with own_servers(tmp_path_factory, "detector-resume-infra") as embedded:
        yield embedded.settings


class Detector:
    """``python -m robustrl.services.detector`` processes, one life at a time."""

    def __init__(self, settings: Settings, log_dir: Path) -> None:
        self.settings = settings
        self.log_dir = log_dir
        self.lives: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        with (self.log_dir / f"detector-{len(self.lives)}.log").open("wb") as out:
            self.lives.append(subprocess.Popen([sys.executable, "-m", "robustrl.services.detector"],
                                               env={**os.environ, **self.settings.to_env()},
                                               stdout=out, stderr=subprocess.STDOUT))

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.lives[-1]

    def stop_all(self) -> None:
        for proc in self.lives:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait()
        for path in sorted(self.log_dir.glob("detector-*.log")):
            print(path.name, path.read_text()[-3000:])


@pytest.fixture
async def setup(own_infra: Settings, tmp_path: Path) -> AsyncIterator[tuple[Job, Detector]]:
    bus = await Bus.connect(own_infra.nats_url, "test-controller")
    await bus.ensure_event_stream()
    job_id = f"j{uuid.uuid4().hex[:8]}"
    spec = reference_job(steps=3).model_copy(update={"detector": THRESHOLDS}).model_dump(mode="json")
    job = Job(bus, job_id)

    async def on_spec(msg: SpecRequest, _subj: str, reply: str | None) -> None:
        await bus.respond(reply, SpecReply(job_id=msg.job_id, spec=spec, epoch=0))

    async def on_fault(msg: FaultReport, _subj: str, _reply: str | None) -> None:
        job.faults.append(msg)

    await bus.subscribe(subject(job_id, Verb.SPEC), SpecRequest, on_spec)
    await bus.subscribe(subject(job_id, Verb.FAULT), FaultReport, on_fault)
    detector = Detector(own_infra, tmp_path)
    detector.start()
    try:
        yield job, detector
    finally:
        detector.stop_all()
        for task in job.tasks:
            task.cancel()
        await asyncio.gather(*job.tasks, return_exceptions=True)
        await bus.close()


async def test_detector_frozen_then_killed_raises_nothing_false_and_keeps_fault_ids(
        setup: tuple[Job, Detector]) -> None:
    job, detector = setup
    await job.member("r-busy", inflight=3, progress=True)
    await job.member("r-idle")  # samples but never answers probes: a probe of it would fail
    await job.member("r-stuck", inflight=2, answer_probes=True)  # alive, no progress: a hang
    first = await eventually_async(lambda: job.faults_of("r-stuck"), timeout=WAIT_S, what="r-stuck reported")
    assert first[0].kind == "hang" and first[0].fault_at is not None
    assert first[0].fault_at < first[0].detected_at

    # Frozen for three times every threshold, then resumed.
    detector.proc.send_signal(signal.SIGSTOP)
    await asyncio.sleep(FREEZE_S)  # the fault under test is the pause itself
    probed_before = len(job.probed)
    detector.proc.send_signal(signal.SIGCONT)
    await job.one_sample("r-witness1")  # goes silent from here: reported once silence_s passed
    await eventually_async(lambda: job.faults_of("r-witness1"), timeout=WAIT_S, what="witness 1 reported")
    assert "r-idle" not in job.probed[probed_before:], "the detector probed a healthy member for its own gap"
    assert {f.member_id for f in job.faults} == {"r-stuck", "r-witness1"}

    # Killed and restarted: the new life rebuilds every member from its next samples.
    detector.proc.kill()
    detector.proc.wait()
    detector.start()
    await eventually_async(lambda: len(job.faults_of("r-stuck")) == 2, timeout=3 * WAIT_S,
                           what="r-stuck reported by the new life too")
    await job.one_sample("r-witness2")  # the new life listens: it reported r-stuck
    await eventually_async(lambda: job.faults_of("r-witness2"), timeout=WAIT_S, what="witness 2 reported")
    again = job.faults_of("r-stuck")
    assert again[0].fault_id == again[1].fault_id  # one fault, reported twice: handled once
    assert {f.member_id for f in job.faults} == {"r-stuck", "r-witness1", "r-witness2"}
