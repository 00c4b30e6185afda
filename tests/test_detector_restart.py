"""A detector killed and started again must give a member's next fault a new id.

The controller handles a fault id once. Fault ids are derived (job, member, cause, times the member
was judged again after a report), so a restarted detector reporting the same ongoing fault sends the
same id. Before the detector saved its marks, a restarted one counted from nothing: a replica
reported once (kept by the controller), healthy again and then faulty the same way was reported
under the first report's id, and the controller dropped it as handled: the replica was never acted
on. Real detector processes (its role credentials) on real NATS and Redis; the fake controller only
answers the spec and collects the reports.
"""

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
import redis
from support import eventually_async, own_servers

from robustrl.bus import Bus
from robustrl.config import DetectorSpec, Settings, reference_job
from robustrl.infra.credentials import Credentials, Principal, role_settings
from robustrl.infra.embedded import EmbeddedInfra
from robustrl.messages import FaultReport, MetricsSample, SpecReply, SpecRequest
from robustrl.services.detector.monitor import rearm_s
from robustrl.storage.redis_stores import Keys
from robustrl.subjects import Verb, subject

pytestmark = pytest.mark.timeout(90)

THRESHOLDS = DetectorSpec(trainer_idle_s=1.0, rollout_idle_s=0.6, silence_s=1.0, probe_timeout_s=0.3,
                          metrics_interval_s=0.1)
WAIT_S = 10.0


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedInfra]:
    with own_servers(tmp_path_factory, "detector-restart") as servers:
        yield servers


@pytest.fixture(scope="module")
def infra(embedded: EmbeddedInfra) -> Settings:
    assert embedded.settings and embedded.settings.credentials_file
    return embedded.settings


class Detectors:
    """Detector processes started one after another, each with the detector's own credentials."""

    def __init__(self, infra: Settings, logs: Path) -> None:
        creds = Credentials.load(infra.credentials_file)
        self.env = {**os.environ, **role_settings(infra, creds, Principal.DETECTOR).to_env()}
        self.logs = logs
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> subprocess.Popen[bytes]:
        path = self.logs / f"detector-{len(self.procs)}.log"
        with path.open("wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "robustrl.services.detector"], env=self.env,
                                    stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def kill(self) -> None:
        """SIGKILL the running one: nothing it holds in memory survives."""
        proc = self.procs[-1]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        for path in sorted(self.logs.glob("detector-*.log")):
            print(f"--- {path.name}\n{path.read_text()[-3000:]}")


@pytest.fixture
def detectors(infra: Settings, tmp_path: Path) -> Iterator[Detectors]:
    d = Detectors(infra, tmp_path)
    try:
        yield d
    finally:
        d.close()


class Replica:
    """A fake rollout replica publishing samples in the phase the test sets."""

    def __init__(self, bus: Bus, job_id: str, member_id: str) -> None:
        self.bus, self.job_id, self.member_id = bus, job_id, member_id
        self.phase = "serving"
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        async def loop() -> None:
            seq = 0
            while True:
                seq += 1
                await self.bus.publish(subject(self.job_id, Verb.METRICS, self.member_id), MetricsSample(
                    job_id=self.job_id, member_id=self.member_id, role="rollout", seq=seq, ts=0.0,
                    phase=self.phase, step=1, tokens_total=100))
                await asyncio.sleep(THRESHOLDS.metrics_interval_s)

        self._task = asyncio.create_task(loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


@pytest.fixture
async def job(infra: Settings) -> AsyncIterator[tuple[Bus, str, list[FaultReport]]]:
    bus = await Bus.connect(infra.nats_url, "test-controller")
    await bus.ensure_event_stream()
    job_id = f"j{uuid.uuid4().hex[:8]}"
    spec = reference_job(steps=3).model_copy(update={"detector": THRESHOLDS}).model_dump(mode="json")
    faults: list[FaultReport] = []

    async def on_spec(msg: SpecRequest, _subj: str, reply: str | None) -> None:
        await bus.respond(reply, SpecReply(job_id=msg.job_id, spec=spec, epoch=0))

    async def on_fault(msg: FaultReport, _subj: str, _reply: str | None) -> None:
        faults.append(msg)

    await bus.subscribe(subject(job_id, Verb.SPEC), SpecRequest, on_spec)
    await bus.subscribe(subject(job_id, Verb.FAULT), FaultReport, on_fault)
    try:
        yield bus, job_id, faults
    finally:
        await bus.emit_event(job_id, "job_stopped")
        await bus.close()


def _marks(infra: Settings, job_id: str) -> dict[bytes, bytes]:
    client = redis.Redis.from_url(infra.redis_url, socket_timeout=5)
    try:
        return client.hgetall(Keys.detector_marks(job_id))
    finally:
        client.close()


async def test_a_kept_member_faulty_again_after_a_detector_restart_is_reported_under_a_new_id(
        job: tuple[Bus, str, list[FaultReport]], detectors: Detectors, infra: Settings) -> None:
    bus, job_id, faults = job
    replica = Replica(bus, job_id, "r0")
    others: list[Replica] = []
    detectors.start()
    replica.start()
    try:
        # 1. Its load fails: reported once. The controller (here: nobody) keeps it.
        replica.phase = "weights_failed"
        await eventually_async(lambda: len(faults) == 1, timeout=WAIT_S, what="the first report")
        first = faults[0]
        assert (first.member_id, first.cause) == ("r0", "weights_failed")
        # What a restarted detector needs is durable before this one dies: r0 reported.
        await eventually_async(lambda: _marks(infra, job_id) == {b"r0": b"1"}, timeout=WAIT_S,
                               what="the reported mark in raw Redis")

        # 2. The detector is killed while the replica, kept, loads and serves again.
        detectors.kill()
        replica.phase = "serving"
        detectors.start()
        # Healthy long enough to be judged again (the new detector re-arms it and saves that)...
        await eventually_async(lambda: _marks(infra, job_id) == {b"r0": b"2"},
                               timeout=WAIT_S + rearm_s(THRESHOLDS), what="the re-arm mark in raw Redis")
        assert len(faults) == 1, f"a healthy replica was reported: {faults[1:]}"

        # 3. ... then its load fails again: a new fault, which the controller must not drop.
        replica.phase = "weights_failed"
        await eventually_async(lambda: len(faults) >= 2, timeout=WAIT_S, what="the second report")
        second = faults[1]
        assert (second.member_id, second.cause) == ("r0", "weights_failed")
        assert second.fault_id != first.fault_id, "the new fault carries the handled fault's id"
        await eventually_async(lambda: _marks(infra, job_id) == {b"r0": b"3"}, timeout=WAIT_S,
                               what="the second reported mark")

        # 4. Killed again while the replica is still failing: the same ongoing fault is not a
        # new one (reported again, it would keep its id). Another replica failing after the
        # restart shows the new detector judging: r0, failing all along, would be reported by then.
        detectors.kill()
        other = Replica(bus, job_id, "r1")
        other.phase = "weights_failed"
        others.append(other)
        detectors.start()
        other.start()
        await eventually_async(lambda: any(f.member_id == "r1" for f in faults), timeout=WAIT_S,
                               what="the other replica's report")
        assert {f.fault_id for f in faults if f.member_id == "r0"} == {first.fault_id, second.fault_id}, faults
    finally:
        for r in [replica, *others]:
            await r.stop()
    assert detectors.procs[-1].poll() is None, "the detector died"
