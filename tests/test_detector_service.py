"""The real detector process against a real nats-server: probes, reports, and what it ignores."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from support import eventually_async, own_servers

from robustrl.bus import Bus
from robustrl.config import DetectorSpec, Settings, reference_job
from robustrl.infra.embedded import EmbeddedInfra
from robustrl.messages import (
    ControlCommand, FaultReport, MemberExited, MetricsSample, ProbeReply, ProbeRequest, SpecReply, SpecRequest,
)
from robustrl.subjects import Verb, subject

pytestmark = pytest.mark.timeout(60)

THRESHOLDS = DetectorSpec(trainer_idle_s=1.0, rollout_idle_s=0.6, silence_s=1.0, probe_timeout_s=0.3,
                          metrics_interval_s=0.1)
WAIT_S = 8.0


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedInfra]:
    """Servers of this module's own: the session's stack runs a detector of its own, which
    would report the same faults a second time on shared servers."""
    with own_servers(tmp_path_factory, "detector-infra") as servers:
        yield servers


@pytest.fixture(scope="module")
def infra(embedded: EmbeddedInfra) -> Settings:
    assert embedded.settings
    return embedded.settings


@pytest.fixture(scope="module")
def detector(infra: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen[bytes]]:
    """``python -m robustrl.services.detector`` as its own process."""
    log_path = Path(tmp_path_factory.mktemp("detector")) / "detector.log"
    with log_path.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "robustrl.services.detector"],
                                env={**os.environ, **infra.to_env()}, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        print(log_path.read_text()[-4000:])


@dataclass
class Job:
    """A fake controller (answers spec requests) and fake members, all on one bus."""

    bus: Bus
    job_id: str
    faults: list[FaultReport] = field(default_factory=list)
    probed: list[str] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def member(self, member_id: str, *, inflight: int = 0, tool_waiting: int = 0,
                     progress: bool = False, answer_probes: bool = False) -> None:
        """Publish a rollout replica's samples every metrics interval."""

        async def on_probe(msg: ProbeRequest, _subj: str, reply: str | None) -> None:
            self.probed.append(msg.member_id)
            if answer_probes:
                await self.bus.respond(reply, ProbeReply(member_id=member_id, nonce=msg.nonce,
                                                         phase="serving"))

        await self.bus.subscribe(subject(self.job_id, Verb.PROBE, member_id), ProbeRequest, on_probe)

        async def loop() -> None:
            seq, tokens = 0, 100
            while True:
                seq += 1
                tokens += 7 if progress else 0
                await self.bus.publish(subject(self.job_id, Verb.METRICS, member_id), MetricsSample(
                    job_id=self.job_id, member_id=member_id, role="rollout", seq=seq, ts=0.0, phase="serving",
                    step=2, tokens_total=tokens, tokens_per_s=70.0 if progress else 0.0, inflight=inflight,
                    tool_waiting=tool_waiting))
                await asyncio.sleep(THRESHOLDS.metrics_interval_s)  # the member's own sampling period

        self.tasks.append(asyncio.create_task(loop()))

    async def one_sample(self, member_id: str) -> None:
        """A member that says hello with one sample and then goes silent (no probe answers)."""
        await self.bus.publish(subject(self.job_id, Verb.METRICS, member_id), MetricsSample(
            job_id=self.job_id, member_id=member_id, role="rollout", seq=1, ts=0.0, phase="idle"))

    def faults_of(self, member_id: str) -> list[FaultReport]:
        return [f for f in self.faults if f.member_id == member_id]


@pytest.fixture
async def job(infra: Settings, detector: subprocess.Popen[bytes]) -> AsyncIterator[Job]:
    bus = await Bus.connect(infra.nats_url, "test-controller")
    await bus.ensure_event_stream()
    job_id = f"j{uuid.uuid4().hex[:8]}"
    spec = reference_job(steps=3).model_copy(update={"detector": THRESHOLDS}).model_dump(mode="json")
    j = Job(bus, job_id)

    async def on_spec(msg: SpecRequest, _subj: str, reply: str | None) -> None:
        await bus.respond(reply, SpecReply(job_id=msg.job_id, spec=spec, epoch=0))

    async def on_fault(msg: FaultReport, _subj: str, _reply: str | None) -> None:
        j.faults.append(msg)

    await bus.subscribe(subject(job_id, Verb.SPEC), SpecRequest, on_spec)
    await bus.subscribe(subject(job_id, Verb.FAULT), FaultReport, on_fault)
    try:
        yield j
    finally:
        await bus.emit_event(job_id, "job_stopped")  # the detector drops the job: no reports after
        for task in j.tasks:
            task.cancel()
        await asyncio.gather(*j.tasks, return_exceptions=True)
        await bus.close()
    assert detector.poll() is None, "the detector died"


async def test_stuck_rollout_is_probed_and_reported_unresponsive_but_idle_ones_are_not(job: Job) -> None:
    # garbage first: not JSON, wrong shape, wrong types, a foreign job id in the payload
    metrics = subject(job.job_id, Verb.METRICS, "r-junk")
    for junk in (b"\xff\xfe not json", b"[1, 2]", b'{"job_id": 5}', b'{"job_id": "x", "seq": -1}',
                 b'{"job_id": "other", "member_id": "m", "role": "rollout", "seq": 1, "ts": 0, '
                 b'"phase": "x"}'):
        await job.bus.publish_raw(metrics, junk)
    await job.member("r-stuck", inflight=3)
    await job.member("r-idle")
    await job.member("r-tools", inflight=2, tool_waiting=2)
    await job.member("r-busy", inflight=4, progress=True)

    await eventually_async(lambda: job.faults_of("r-stuck"), timeout=WAIT_S, what="r-stuck reported")
    [fault] = job.faults_of("r-stuck")
    assert fault.kind == "unresponsive" and fault.role == "rollout" and fault.step == 2
    assert "r-stuck" in job.probed
    # The benign replicas had the same time to look faulty (and more: the stall took idle + probe).
    assert [f.member_id for f in job.faults] == ["r-stuck"]
    assert {"r-idle", "r-tools", "r-busy"}.isdisjoint(job.probed)

    events = await eventually_async(
        lambda: _fault_events(job), timeout=WAIT_S, what="fault_detected event in the log")
    assert events[0].data["fault_id"] == fault.fault_id and events[0].data["member_id"] == "r-stuck"


async def _fault_events(job: Job) -> list:
    return [e for e in await job.bus.read_events(job.job_id, timeout=1.0) if e.kind == "fault_detected"]


async def test_stalled_rollout_answering_probes_is_a_hang(job: Job) -> None:
    await job.member("r-stall", inflight=2, answer_probes=True)
    await eventually_async(lambda: job.faults_of("r-stall"), timeout=WAIT_S, what="r-stall reported")
    assert [f.kind for f in job.faults] == ["hang"]
    assert "answers probes" in job.faults[0].evidence


async def test_crash_is_reported_and_stopped_members_are_forgotten(job: Job) -> None:
    await job.member("r-ok", inflight=1, progress=True)
    await job.member("r-dead", inflight=1, progress=True)
    exit_subject = subject(job.job_id, Verb.EXIT, "r-crash")
    await job.bus.publish(exit_subject, MemberExited(job_id=job.job_id, member_id="r-crash", role="rollout",
                                                     returncode=-9))
    await eventually_async(lambda: job.faults_of("r-crash"), timeout=WAIT_S, what="crash reported")
    assert job.faults_of("r-crash")[0].kind == "crash"
    # The controller stops r-ok and declares r-dead dead: their silence from now on is expected.
    for task in job.tasks:
        task.cancel()
    await job.bus.publish(subject(job.job_id, Verb.EXIT, "r-ok"), MemberExited(
        job_id=job.job_id, member_id="r-ok", role="rollout", returncode=0, expected=True))
    await job.bus.publish(subject(job.job_id, Verb.CONTROL, "request_manager"), ControlCommand(
        job_id=job.job_id, target="request_manager", action="replica_dead", args={"member_id": "r-dead"}))
    # A witness that goes silent after them: once it is reported unresponsive, a (wrong)
    # silence report of r-ok or r-dead would have come first.
    await job.one_sample("r-witness")
    await eventually_async(lambda: job.faults_of("r-witness"), timeout=WAIT_S, what="witness reported")
    assert job.faults_of("r-witness")[0].kind == "unresponsive"
    assert job.faults_of("r-ok") == [] and job.faults_of("r-dead") == []


async def test_a_nats_outage_is_not_blamed_on_the_members(job: Job, embedded: EmbeddedInfra) -> None:
    """NATS down for longer than silence + probe: every member falls silent to the detector, and
    its probes cannot reach them. That is the detector's own outage, not the members' (it replaced
    both replicas after a NATS restart before this)."""
    for member_id in ("rollout-0-i0", "rollout-1-i0"):
        await job.member(member_id, progress=True, answer_probes=True)
    # The members run normally first, until the detector is judging this job: a witness that goes
    # silent now is reported only once the detector has the job's thresholds and has watched it
    # for silence_s and a probe, while the members' samples came in.
    await job.one_sample("r-witness")
    await eventually_async(lambda: job.faults_of("r-witness"), timeout=WAIT_S, what="witness reported")
    outage_s = 3 * (THRESHOLDS.silence_s + THRESHOLDS.probe_timeout_s)
    await asyncio.to_thread(embedded.restart, "nats", outage_s)
    await asyncio.sleep(3 * (THRESHOLDS.silence_s + THRESHOLDS.probe_timeout_s))  # window for a false report
    logged = [e for e in await job.bus.read_events(job.job_id)
              if e.kind == "fault_detected" and e.data["member_id"] != "r-witness"]
    assert {f.member_id for f in job.faults} == {"r-witness"} and logged == [], (job.faults, logged)


async def _newest_term(infra: Settings) -> int:
    """The newest controller lease term's token on the session's Redis, at least 1: a term is
    taken here if none ever was (the session's stack, when it runs, holds the lease: then this
    changes nothing)."""
    from robustrl.services.controller.lease import LeaderLease
    from robustrl.storage.control_stores import newest_controller_fence
    from robustrl.storage.redis_stores import connect

    r = connect(infra.redis_url)
    try:
        if await newest_controller_fence(r) == 0:
            await LeaderLease(r, "test-detector-service", ttl_s=0.1).try_acquire()
        return await newest_controller_fence(r)
    finally:
        await r.aclose()


async def test_replica_dead_from_a_deposed_controller_is_ignored(job: Job, infra: Settings) -> None:
    """The leader (fence 5 above the newest term's) declares r-gone dead; a deposed controller
    (fence 3 above) then declares r-live dead, a replica the leader still uses. The detector must
    keep watching r-live, as the request manager does (it refuses the older fence): its silence
    is still a fault."""
    term = await _newest_term(infra)
    asked: list[SpecRequest] = []

    async def on_spec(msg: SpecRequest, _subj: str, _reply: str | None) -> None:
        asked.append(msg)  # the fixture's controller answers; this only sees the detector ask

    await job.bus.subscribe(subject(job.job_id, Verb.SPEC), SpecRequest, on_spec)
    await job.member("r-gone", inflight=1, progress=True)
    await job.member("r-live", inflight=1, progress=True)
    await eventually_async(lambda: asked, timeout=WAIT_S, what="the detector asked for the spec")
    await job.one_sample("r-seen")  # the detector is judging this job once it reports r-seen
    await eventually_async(lambda: job.faults_of("r-seen"), timeout=WAIT_S, what="r-seen reported")
    rm = subject(job.job_id, Verb.CONTROL, "request_manager")
    for member_id, fence in (("r-gone", term + 5), ("r-live", term + 3)):
        await job.bus.publish(rm, ControlCommand(job_id=job.job_id, target="request_manager", action="replica_dead",
                                                 args={"member_id": member_id, "fault_id": f"f-{member_id}"},
                                                 fence=fence))
    await job.bus.client.flush()
    for task in job.tasks:  # both fall silent: only r-gone's silence is expected
        task.cancel()
    await eventually_async(lambda: job.faults_of("r-live"), timeout=WAIT_S,
                           what="r-live reported after a stale replica_dead named it")
    assert job.faults_of("r-live")[0].kind == "unresponsive"
    assert job.faults_of("r-gone") == []


async def test_replica_dead_from_a_deposed_controller_is_ignored_by_a_detector_that_saw_no_command(
        job: Job, infra: Settings) -> None:
    """The detector has seen no command of this job (as after its restart) when a deposed
    controller (a token older than the newest lease term's) declares r-live dead. Before, only
    tokens it had seen counted, so it stopped watching r-live; now the token is checked against
    the newest term's, read from Redis: r-live's silence is still a fault."""
    term = await _newest_term(infra)
    asked: list[SpecRequest] = []

    async def on_spec(msg: SpecRequest, _subj: str, _reply: str | None) -> None:
        asked.append(msg)

    await job.bus.subscribe(subject(job.job_id, Verb.SPEC), SpecRequest, on_spec)
    await job.member("r-live", inflight=1, progress=True)
    await eventually_async(lambda: asked, timeout=WAIT_S, what="the detector asked for the spec")
    await job.one_sample("r-seen")  # the detector is judging this job once it reports r-seen
    await eventually_async(lambda: job.faults_of("r-seen"), timeout=WAIT_S, what="r-seen reported")
    await job.bus.publish(subject(job.job_id, Verb.CONTROL, "request_manager"), ControlCommand(
        job_id=job.job_id, target="request_manager", action="replica_dead",
        args={"member_id": "r-live", "fault_id": "f-r-live"}, fence=term - 1))
    await job.bus.client.flush()
    for task in job.tasks:
        task.cancel()
    await eventually_async(lambda: job.faults_of("r-live"), timeout=WAIT_S,
                           what="r-live reported after a deposed controller's replica_dead named it")
    assert job.faults_of("r-live")[0].kind == "unresponsive"
