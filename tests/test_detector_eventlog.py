"""A slow or refusing event log (JetStream) must not hold up fault reports (audit, detector 1).

The detector runs in this process on real servers, so its bus's JetStream publish can be made
slow the way a loaded or restarting JetStream is (as tests/test_rm_dispatch.py does for the
request manager); core NATS stays up. Fault reports go to the controller at once, for every
fault of a tick; their events reach the log afterwards, in order, none lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from support import eventually_async, own_servers
from test_detector_service import THRESHOLDS, Job

from robustrl.bus import Bus
from robustrl.config import Settings, reference_job
from robustrl.errors import TransportError
from robustrl.messages import Event, FaultReport, MemberExited, SpecReply, SpecRequest
from robustrl.services.detector.service import MEMBER_NAME, DetectorService
from robustrl.subjects import Verb, subject

pytestmark = pytest.mark.timeout(30)

WAIT_S = 8.0
REPORT_BOUND_S = 0.5
"""Both faults of one tick reach the fault subject this close together (a tick is 0.05 s here)."""
REFUSE_AFTER_S = 2.0
"""Each JetStream publish waits this long, then fails: slow first, then refused."""


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """Servers of this module's own: no other detector may report on them."""
    with own_servers(tmp_path_factory, "detector-eventlog-infra") as embedded:
        yield embedded.settings


@dataclass
class SlowLog:
    """The detector bus's JetStream publish, slow and then refusing until ``back`` is set."""

    bus: Bus
    back: asyncio.Event = field(default_factory=asyncio.Event)
    attempts: int = 0

    def install(self) -> None:
        real = self.bus.publish_durable

        async def slow(*args: object, **kw: object) -> None:
            if not self.back.is_set():
                self.attempts += 1
                try:  # (not wait_for: on 3.11 it can swallow a cancellation that meets the result)
                    async with asyncio.timeout(REFUSE_AFTER_S):
                        await self.back.wait()
                except TimeoutError:
                    raise TransportError("JetStream did not acknowledge (test: slowed)") from None
            await real(*args, **kw)  # type: ignore[arg-type]

        self.bus.publish_durable = slow  # type: ignore[method-assign]


@dataclass
class TimedJob(Job):
    """A :class:`Job` that also records when each member's first fault report arrived."""

    arrived: dict[str, float] = field(default_factory=dict)

    def seen(self, service: DetectorService, member_id: str) -> bool:
        """The detector has the member's sample (so its silence is timed from before what follows)."""
        mon = service.jobs.get(self.job_id)
        return mon is not None and mon.cfg is not None and member_id in mon.members


@pytest.fixture
async def rig(servers: Settings) -> AsyncIterator[tuple[TimedJob, SlowLog]]:
    async with _rig(servers) as (job, slow, _service):
        yield job, slow


@contextlib.asynccontextmanager
async def _rig(servers: Settings, **service_kw: Any) -> AsyncIterator[tuple[TimedJob, SlowLog, DetectorService]]:
    """A fake controller on the bus, and a detector of this process's (``service_kw``: its clocks)."""
    bus = await Bus.connect(servers.nats_url, "test-controller")
    await bus.ensure_event_stream()
    job = TimedJob(bus, f"j{uuid.uuid4().hex[:8]}")
    spec = reference_job(steps=3).model_copy(update={"detector": THRESHOLDS}).model_dump(mode="json")

    async def on_spec(msg: SpecRequest, _subj: str, reply: str | None) -> None:
        await bus.respond(reply, SpecReply(job_id=msg.job_id, spec=spec, epoch=0))

    async def on_fault(msg: FaultReport, _subj: str, _reply: str | None) -> None:
        job.arrived.setdefault(msg.member_id, time.monotonic())
        job.faults.append(msg)

    await bus.subscribe(subject(job.job_id, Verb.SPEC), SpecRequest, on_spec)
    await bus.subscribe(subject(job.job_id, Verb.FAULT), FaultReport, on_fault)
    det_bus = await Bus.connect(servers.nats_url, MEMBER_NAME, role="detector")
    slow = SlowLog(det_bus)
    service = DetectorService(det_bus, **service_kw)
    await service.start()
    try:
        yield job, slow, service
    finally:
        slow.back.set()
        await service.stop()
        await det_bus.close()
        for task in job.tasks:
            task.cancel()
        await asyncio.gather(*job.tasks, return_exceptions=True)
        await bus.close()


async def _fault_events(job: Job) -> list[Event]:
    return [e for e in await job.bus.read_events(job.job_id, timeout=1.0) if e.kind == "fault_detected"]


async def test_a_slow_event_log_does_not_hold_up_fault_reports(rig: tuple[TimedJob, SlowLog]) -> None:
    job, slow = rig
    arrived = job.arrived
    await job.member("r-steady", inflight=1, progress=True)
    await job.one_sample("r-seen")  # reported once the detector judges this job (log still healthy)
    await eventually_async(lambda: job.faults_of("r-seen"), timeout=WAIT_S, what="r-seen reported")
    await eventually_async(lambda: _fault_events(job), timeout=WAIT_S, what="r-seen's event in the log")

    slow.install()
    # Two replicas fall silent together: their probes time out in the same tick.
    await job.one_sample("r-a")
    await job.one_sample("r-b")
    await eventually_async(lambda: "r-a" in arrived or "r-b" in arrived, timeout=WAIT_S, what="a first report")
    await eventually_async(lambda: {"r-a", "r-b"} <= arrived.keys(), timeout=3 * REFUSE_AFTER_S,
                           what="the second fault of the tick")
    assert abs(arrived["r-a"] - arrived["r-b"]) < REPORT_BOUND_S, \
        f"the second report waited {abs(arrived['r-a'] - arrived['r-b']):.2f} s for the event log"
    # A crash while the log is still slow: its exit handler does not wait for the log either.
    exited_at = time.monotonic()
    await job.bus.publish(subject(job.job_id, Verb.EXIT, "r-crash"), MemberExited(
        job_id=job.job_id, member_id="r-crash", role="rollout", returncode=-9))
    await eventually_async(lambda: "r-crash" in arrived, timeout=WAIT_S, what="the crash reported")
    assert arrived["r-crash"] - exited_at < REPORT_BOUND_S
    # Silence that begins while the log is slow is still timed from its start: the detector's
    # ticks did not stop, so no rebase threw the evidence away.
    silent_from = time.monotonic()
    job.tasks.pop().cancel()  # r-steady goes silent (it never answers probes)
    await job.bus.client.flush()
    await eventually_async(lambda: "r-steady" in arrived, timeout=WAIT_S, what="r-steady reported")
    assert arrived["r-steady"] - silent_from < THRESHOLDS.silence_s + THRESHOLDS.probe_timeout_s + 1.0
    assert slow.attempts >= 1 and not slow.back.is_set(), "the event log was not slow meanwhile"
    logged = [e.data["member_id"] for e in await _fault_events(job)]
    assert logged == ["r-seen"], logged

    slow.back.set()  # JetStream is back: every event is appended, in the order of the reports
    await eventually_async(lambda: _all_logged(job), timeout=WAIT_S, what="every fault_detected event in the log")
    events = await _fault_events(job)
    reported = [f.member_id for f in job.faults]
    assert [e.data["member_id"] for e in events] == reported, ([e.data for e in events], reported)
    assert [e.data["fault_id"] for e in events] == [f.fault_id for f in job.faults]
    for event, fault in zip(events, job.faults, strict=True):  # stamped when detected, not when stored
        assert abs(event.ts - fault.detected_at) < REPORT_BOUND_S


async def _all_logged(job: Job) -> bool:
    return len(await _fault_events(job)) >= len(job.faults) == 5


async def test_a_full_queue_drops_new_events_loudly_and_keeps_the_rest(
        servers: Settings, caplog: pytest.LogCaptureFixture) -> None:
    from robustrl.services.detector.eventlog import EventWriter  # here: the other test runs without it

    bus = await Bus.connect(servers.nats_url, MEMBER_NAME, role="detector")
    reader = await Bus.connect(servers.nats_url, "test-reader")
    job_id = f"j{uuid.uuid4().hex[:8]}"
    slow = SlowLog(bus)
    slow.install()
    writer = EventWriter(bus, max_pending=3)
    try:
        await reader.ensure_event_stream()
        with caplog.at_level(logging.ERROR):
            for n in range(5):
                await writer.emit(job_id, "fault_detected", _fault_data(job_id, n))
        assert writer.pending == 3 and writer.dropped == 2
        assert any("dropped" in r.getMessage() and "3" in r.getMessage() for r in caplog.records), caplog.text
        slow.back.set()
        assert await writer.drain(WAIT_S)
        logged = [e.data["member_id"] for e in await reader.read_events(job_id, timeout=1.0)]
        assert logged == ["r-0", "r-1", "r-2"], logged
    finally:
        slow.back.set()
        await writer.close(0.0)
        await bus.close()
        await reader.close()


def _fault_data(job_id: str, n: int) -> dict[str, object]:
    return {"fault_id": f"f{n}", "kind": "crash", "role": "rollout", "member_id": f"r-{n}", "step": 0,
            "detected_at": time.time(), "fault_at": None, "cause": "exit", "evidence": "test"}


async def test_a_step_of_the_wall_clock_neither_blinds_nor_fools_the_rules(servers: Settings) -> None:
    """NTP steps a machine's wall clock (or a VM resumes): an hour back, then two forward. The
    rules run on the monotonic clock, so a member falling silent after either step is reported
    on time, a healthy one is not reported, and each report carries the wall time it was made at
    (rules on the wall clock saw every silence as an hour younger after the step back: no report
    for an hour)."""
    shift = [0.0]
    async with _rig(servers, wall=lambda: time.time() + shift[0]) as (job, _slow, service):
        arrived = job.arrived
        await job.member("r-steady", inflight=1, progress=True)
        bound_s = THRESHOLDS.silence_s + THRESHOLDS.probe_timeout_s + 1.0
        for step_s, member in ((0.0, "r-before"), (-3600.0, "r-after-back"), (7200.0, "r-after-forward")):
            silent_from = time.monotonic()
            await job.one_sample(member)
            await eventually_async(lambda m=member: job.seen(service, m), timeout=WAIT_S, what=f"{member} seen")
            shift[0] += step_s  # the step comes while the member is silent
            await eventually_async(lambda m=member: m in arrived, timeout=WAIT_S,
                                   what=f"{member} reported (detector {service.stats})")
            assert arrived[member] - silent_from < bound_s, (member, arrived[member] - silent_from)
            (report,) = job.faults_of(member)
            assert abs(report.detected_at - (time.time() + shift[0])) < REPORT_BOUND_S + 0.5, report
            assert report.fault_at is not None and 0 <= report.detected_at - report.fault_at < bound_s, report
        assert not job.faults_of("r-steady"), "a wall clock step made a healthy member look silent"
        assert [f.member_id for f in job.faults] == ["r-before", "r-after-back", "r-after-forward"], job.faults
