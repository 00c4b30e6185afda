"""The detector's ``fault_detected`` events survive a detector killed while JetStream is away, and
a Redis that refuses or stays silent does not stop detection.

Each event is written to the job's detector outbox in Redis (``Keys.detector_outbox``) before it
is queued, and removed once JetStream stored it; a starting detector appends what any job's outbox
still holds, under the message ids saved with it. JetStream is made to store nothing by pointing
the event stream at other subjects (what the detector publishes then gets no acknowledgement, as
when JetStream is away; core NATS, which carries the fault reports, stays up), then given its
subjects back. Judged from outside: the raw JetStream log (the auditor's reader) and the raw Redis
keys, read with the operator's credentials; the detector runs as its own process under its own
role's credentials.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import pytest
from support import eventually_async, own_servers
from test_detector_resume import Detector
from test_detector_service import THRESHOLDS, Job

from robustrl.aio import within
from robustrl.audit.raw import RawEvent, read_event_log
from robustrl.bus import Bus
from robustrl.client import ApiClient
from robustrl.config import Settings, reference_job
from robustrl.infra.credentials import Credentials, role_settings
from robustrl.infra.embedded import EmbeddedInfra
from robustrl.messages import Event, FaultReport, SpecReply, SpecRequest
from robustrl.storage.redis_stores import Keys, connect
from robustrl.subjects import EVENTS_ALL, EVENTS_STREAM, Principal, Verb, subject

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0
REPORT_BOUND_S = 0.5
"""Two faults of one tick reach the fault subject this close together, Redis silent or not."""


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedInfra]:
    """Servers of this module's own: the detector under test scans every job's outbox, and no
    other detector may report on our jobs."""
    with own_servers(tmp_path_factory, "detector-outbox-infra") as servers:
        yield servers


def _role(embedded: EmbeddedInfra, role: Principal) -> Settings:
    assert embedded.settings and embedded.settings.credentials_file
    return role_settings(embedded.settings, Credentials.load(embedded.settings.credentials_file), role)


@dataclass
class HeardJob(Job):
    """A :class:`Job` that knows when a detector first asked for its spec (it hears the job)."""

    heard: asyncio.Event = field(default_factory=asyncio.Event)
    received: dict[str, float] = field(default_factory=dict)
    """member id -> when (monotonic) its latest fault report reached the fake controller."""

    async def heard_by_a_detector(self) -> None:
        """A steady member (progressing) until a detector asks for the job's spec."""
        await self.member("r-steady", inflight=1, progress=True)
        await within(self.heard.wait(), WAIT_S)


@asynccontextmanager
async def _job(settings: Settings) -> AsyncIterator[HeardJob]:
    """A fake controller (answers spec requests, records fault reports) of a fresh job."""
    bus = await Bus.connect(settings.nats_url, "test-controller")
    await bus.ensure_event_stream()
    job = HeardJob(bus, f"j{uuid.uuid4().hex[:8]}")
    spec = reference_job(steps=3).model_copy(update={"detector": THRESHOLDS}).model_dump(mode="json")

    async def on_spec(msg: SpecRequest, _subj: str, reply: str | None) -> None:
        job.heard.set()
        await bus.respond(reply, SpecReply(job_id=msg.job_id, spec=spec, epoch=0))

    async def on_fault(msg: FaultReport, _subj: str, _reply: str | None) -> None:
        job.faults.append(msg)
        job.received[msg.member_id] = time.monotonic()  # when it reached the controller, not its detected_at

    await bus.subscribe(subject(job.job_id, Verb.SPEC), SpecRequest, on_spec)
    await bus.subscribe(subject(job.job_id, Verb.FAULT), FaultReport, on_fault)
    try:
        yield job
    finally:
        for task in job.tasks:
            task.cancel()
        await asyncio.gather(*job.tasks, return_exceptions=True)
        await bus.close()


@asynccontextmanager
async def _jetstream_away(nats_url: str) -> AsyncIterator[None]:
    """The event stream takes no event subject until the block ends: a durable publish of an event
    gets no acknowledgement (retried by the publisher, as through a JetStream outage)."""
    nc = await nats.connect(nats_url, connect_timeout=2, max_reconnect_attempts=0)
    js = nc.jetstream()
    try:
        config = (await js.stream_info(EVENTS_STREAM)).config
        config.subjects = ["rrl-parked.>"]
        await js.update_stream(config)
        try:
            yield
        finally:
            config.subjects = [EVENTS_ALL]
            await js.update_stream(config)
    finally:
        await nc.close()


async def _detected(nats_url: str, job_id: str) -> list[RawEvent]:
    return [e for e in await read_event_log(nats_url, job_id) if e.kind == "fault_detected"]


async def _outbox(redis: Any, job_id: str) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in await redis.lrange(Keys.detector_outbox(job_id), 0, -1)]


async def test_events_queued_while_jetstream_is_away_survive_a_killed_detector(
        embedded: EmbeddedInfra, tmp_path: Path) -> None:
    """Two faults detected while JetStream stores nothing: their events are in the detector's
    outbox (raw Redis), not the log. The detector is SIGKILLed; JetStream comes back; a new
    detector starts and appends both, each exactly once, under the ids saved with them, and the
    outbox key goes. The fault detected while all was well is in the log once, its outbox
    emptied as soon as JetStream stored it."""
    settings = embedded.settings
    assert settings is not None
    redis = connect(settings.redis_url)  # the operator's: reads the raw keys
    detector = Detector(_role(embedded, Principal.DETECTOR), tmp_path)
    detector.start()
    try:
        async with _job(settings) as job:
            await job.heard_by_a_detector()
            await job.one_sample("r-seen")
            await eventually_async(lambda: job.faults_of("r-seen"), timeout=WAIT_S, what="r-seen reported")
            await eventually_async(lambda: _detected(settings.nats_url, job.job_id), timeout=WAIT_S,
                                   what="r-seen's event in the log")
            await eventually_async(lambda: _key_gone(redis, job.job_id), timeout=WAIT_S,
                                   what="the outbox emptied once JetStream stored the event")

            async with _jetstream_away(settings.nats_url):
                await job.one_sample("r-a")
                await job.one_sample("r-b")
                await eventually_async(lambda: job.faults_of("r-a") and job.faults_of("r-b"), timeout=WAIT_S,
                                       what="both faults reported (core NATS is up)")
                left = await eventually_async(lambda: _outbox_of_size(redis, job.job_id, 2), timeout=WAIT_S,
                                              what="both events in the detector's outbox")
                detector.proc.kill()  # SIGKILL: its in-memory queue is gone
                detector.proc.wait()
            assert [e.data["member_id"] for e in await _detected(settings.nats_url, job.job_id)] == ["r-seen"]
            assert len(await _outbox(redis, job.job_id)) == 2  # nobody touched it meanwhile

            detector.start()  # a new life: appends what the killed one left
            await eventually_async(lambda: _key_gone(redis, job.job_id), timeout=WAIT_S,
                                   what="the outbox appended and emptied by the new detector")
            logged = await _detected(settings.nats_url, job.job_id)
            members = sorted(e.data["member_id"] for e in logged)
            assert members == ["r-a", "r-b", "r-seen"], [e.data for e in logged]
            reported = {f.member_id: f.fault_id for f in job.faults}
            assert {e.data["member_id"]: e.data["fault_id"] for e in logged} == reported
            saved = {entry["event"]["data"]["member_id"]: entry["event"]["ts"] for entry in left}
            # The events the killed detector stamped, not new ones of the new detector.
            assert {e.data["member_id"]: e.ts for e in logged if e.data["member_id"] != "r-seen"} == saved
    finally:
        detector.stop_all()
        await redis.aclose()


async def _key_gone(redis: Any, job_id: str) -> bool:
    return not await redis.exists(Keys.detector_outbox(job_id))


async def _outbox_of_size(redis: Any, job_id: str, n: int) -> list[dict[str, Any]] | None:
    entries = await _outbox(redis, job_id)
    return entries if len(entries) == n else None


# --- Redis refusing or silent ---------------------------------------------------------------------


class SilentServer:
    """A TCP server that accepts connections and never answers: a Redis that hangs."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.base_events.Server | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.sock.getsockname()[1]}/0"

    async def start(self) -> None:
        async def hold(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self._writers.append(writer)  # read nothing, answer nothing

        self._server = await asyncio.start_server(hold, sock=self.sock)

    async def close(self) -> None:
        for writer in self._writers:
            writer.close()
        if self._server is not None:
            self._server.close()


@pytest.mark.parametrize("redis_is", ["refusing", "silent"])
async def test_redis_refusing_or_silent_does_not_stop_detection(
        embedded: EmbeddedInfra, redis_is: str, caplog: pytest.LogCaptureFixture) -> None:
    """The detector's Redis user refused every write (a Redis URL whose user may only read), or a
    Redis that accepts connections and never answers: faults are still reported at once, both
    faults of one tick close together (the tick waits on no Redis call past its bound), and
    their events still reach the log (in memory only), the failure logged."""
    from robustrl.services.detector.service import MEMBER_NAME, DetectorService

    settings = embedded.settings
    assert settings is not None
    silent = SilentServer()
    await silent.start()
    url = _role(embedded, Principal.ROLLOUT).redis_url if redis_is == "refusing" else silent.url
    redis = connect(url)
    det_bus = await Bus.connect(_role(embedded, Principal.DETECTOR).nats_url, MEMBER_NAME, role="detector")
    service = DetectorService(det_bus, redis=redis)
    arrived: dict[str, float] = {}
    try:
        with caplog.at_level(logging.WARNING):
            async with _job(settings) as job:
                await service.start()
                await job.heard_by_a_detector()
                await job.one_sample("r-a")
                await job.one_sample("r-b")
                await eventually_async(lambda: job.faults_of("r-a") and job.faults_of("r-b"), timeout=WAIT_S,
                                       what="both faults reported")
                # When the reports arrived, not their detected_at (both are the tick's clock): a tick
                # that waited on a Redis call between its two reports parts them.
                arrived.update(job.received)
                assert abs(arrived["r-a"] - arrived["r-b"]) < REPORT_BOUND_S, arrived
                logged = await eventually_async(lambda: _detected_of(settings.nats_url, job.job_id, 2),
                                                timeout=WAIT_S, what="both events in the log")
                assert sorted(e.data["member_id"] for e in logged) == ["r-a", "r-b"]
                # A fault of a later tick is reported at once too.
                t0 = time.time()
                await job.one_sample("r-c")
                await eventually_async(lambda: job.faults_of("r-c"), timeout=WAIT_S, what="r-c reported")
                assert job.faults_of("r-c")[0].detected_at - t0 < THRESHOLDS.silence_s + THRESHOLDS.probe_timeout_s + 1.0
                await eventually_async(lambda: _detected_of(settings.nats_url, job.job_id, 3), timeout=WAIT_S,
                                       what="r-c's event in the log")
        assert any("outbox" in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING), caplog.text
    finally:
        await service.stop()
        await det_bus.close()
        await redis.aclose()
        await silent.close()


async def _detected_of(nats_url: str, job_id: str, n: int) -> list[RawEvent] | None:
    logged = await _detected(nats_url, job_id)
    return logged if len(logged) == n else None


async def test_a_removal_that_failed_is_retried_without_a_new_fault(embedded: EmbeddedInfra) -> None:
    """JetStream stores a queued event while Redis does not take writes (paused): its removal
    from the outbox fails and is kept. No other fault comes. The detector's upkeep removes it
    once Redis is back (an outside review found it left until the next start, which appended it
    again: twice in the log past JetStream's 2 min duplicate window). Judged from raw Redis."""
    from robustrl.services.detector.service import MEMBER_NAME, DetectorService

    settings = embedded.settings
    assert settings is not None
    admin = connect(settings.redis_url)  # the operator's: reads the raw keys, pauses writes
    redis = connect(_role(embedded, Principal.DETECTOR).redis_url)
    det_bus = await Bus.connect(_role(embedded, Principal.DETECTOR).nats_url, MEMBER_NAME, role="detector")
    service = DetectorService(det_bus, redis=redis)
    try:
        async with _job(settings) as job:
            await service.start()
            await job.heard_by_a_detector()
            async with _jetstream_away(settings.nats_url):
                await job.one_sample("r-a")
                await eventually_async(lambda: _outbox_of_size(admin, job.job_id, 1), timeout=WAIT_S,
                                       what="the event in the detector's outbox")
                await admin.execute_command("CLIENT", "PAUSE", "4000", "WRITE")  # the fault: 4 s
            # JetStream back: the event is stored while Redis takes no write (its removal fails).
            await eventually_async(lambda: _detected(settings.nats_url, job.job_id), timeout=WAIT_S,
                                   what="the event in the log")
            assert len(await _outbox(admin, job.job_id)) == 1, "the removal was not cut off by the pause"
            await eventually_async(lambda: _key_gone(admin, job.job_id), timeout=20,
                                   what="the outbox emptied by the upkeep, with no new fault")
            assert len(await _detected(settings.nats_url, job.job_id)) == 1
            assert [f.member_id for f in job.faults] == ["r-a"]
    finally:
        await admin.execute_command("CLIENT", "UNPAUSE")
        await service.stop()
        await det_bus.close()
        await redis.aclose()
        await admin.aclose()


# --- deletion -------------------------------------------------------------------------------------


def _left_by_a_killed_detector(job_id: str, member_id: str) -> bytes:
    """An outbox entry as the detector writes it."""
    event = Event(job_id=job_id, kind="fault_detected", data={
        "fault_id": f"{job_id}-{member_id}", "kind": "crash", "role": "rollout", "member_id": member_id,
        "step": 0, "detected_at": time.time(), "fault_at": None, "cause": "exit", "evidence": "test"})
    msg_id = f"{job_id}-fault_detected-{uuid.uuid4().hex}"
    return json.dumps({"msg_id": msg_id, "event": event.model_dump(mode="json")}).encode()


def test_deleting_an_ended_job_that_keeps_its_log_appends_its_detector_outbox_first(
        api: ApiClient, infra: Settings) -> None:
    """An ended job whose detector outbox still holds an event (its detector killed while JetStream
    was away, none started since): ``DELETE`` keeps the log by default, so the event is appended
    before the purge, once, before ``job_deleted``; with ``events=true`` it goes with the rest."""
    import redis as redis_sync

    r = redis_sync.Redis.from_url(infra.redis_url)
    try:
        kept, purged = f"det-kept-{uuid.uuid4().hex[:8]}", f"det-purged-{uuid.uuid4().hex[:8]}"
        for job_id in (kept, purged):
            r.hset(Keys.jobs(), job_id, json.dumps({"spec": {"name": job_id.rsplit("-", 1)[0], "steps": 1},
                                                    "status": "stopped"}))
            r.rpush(Keys.detector_outbox(job_id), _left_by_a_killed_detector(job_id, "r-gone"), b"{not json")

        out = api.delete(kept)
        assert out["events_kept"]
        assert not r.exists(Keys.detector_outbox(kept))
        log = asyncio.run(read_event_log(infra.nats_url, kept))
        detected = [e for e in log if e.kind == "fault_detected" and e.data.get("member_id") == "r-gone"]
        assert len(detected) == 1, [e.kind for e in log]
        assert [e.kind for e in log][-2:] == ["fault_detected", "job_deleted"], [e.kind for e in log]

        out = api.delete(purged, events=True)
        assert not out["events_kept"] and not r.exists(Keys.detector_outbox(purged))
        assert asyncio.run(read_event_log(infra.nats_url, purged)) == []
    finally:
        r.close()
