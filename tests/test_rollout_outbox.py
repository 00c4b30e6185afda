"""A rollout replica's weight load events survive the replica being killed while JetStream is away.

A replica appended its ``weights_loaded`` / ``weights_rejected`` inline; one JetStream did not
store was kept in the bus's owed queue, in memory, and a replica killed (or cut off and replaced)
during the outage lost it for good. Each event is now saved in the job's rollout outbox in Redis
(``Keys.rollout_outbox``) before it is queued and removed once JetStream stored it, and every
replica appends, at its start, what the job's outbox holds under the message ids saved with it.

Real replica processes (forked from the launcher's zygote, as a controller starts them), each
under the rollout role's own credentials, against NATS and Redis servers of this module's own (the
event stream is taken away here). JetStream is made to store nothing by pointing the event stream
at other subjects: a durable publish then gets no acknowledgement and is retried, as through an
outage; core NATS (announcements, hellos) stays up, and an unrestricted core subscriber sees each
attempt to append, with its message id. Judged from outside: the raw JetStream log and raw Redis.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import nats
import pytest
from support import duplicate_window, eventually_async, own_servers
from test_detector_outbox import SilentServer, _jetstream_away
from test_rollout_replica import START_S, WAIT_S, make_version

from robustrl.audit.raw import RawEvent, read_event_log
from robustrl.bus import MSG_ID_HEADER, Bus
from robustrl.client import ApiClient
from robustrl.config import DetectorSpec, Settings, reference_job
from robustrl.infra.credentials import Credentials, role_settings
from robustrl.infra.embedded import EmbeddedInfra
from robustrl.launcher.base import MemberSpec
from robustrl.launcher.local import LocalLauncher
from robustrl.messages import Event, MemberHello, MetricsSample, SpecReply, SpecRequest, WeightsAnnounce
from robustrl.services.rollout.events import ORPHAN_AFTER_S, REDIS_CALL_S, ReplicaEvents
from robustrl.storage.redis_stores import Keys, connect
from robustrl.subjects import Principal, Verb, subject, wildcard
from robustrl.weights import WeightServer

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedInfra]:
    """Servers of this module's own: the event stream is taken away here."""
    with own_servers(tmp_path_factory, "rollout-outbox-infra") as servers:
        yield servers


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalLauncher]:
    launcher = LocalLauncher(tmp_path_factory.mktemp("rollout-outbox-replicas"))
    launcher.preload()
    try:
        yield launcher
    finally:
        launcher.close()


def _role(embedded: EmbeddedInfra, role: Principal) -> Settings:
    assert embedded.settings and embedded.settings.credentials_file
    return role_settings(embedded.settings, Credentials.load(embedded.settings.credentials_file), role)


@dataclass
class Attempt:
    """One append of an event seen on core NATS (JetStream storing it or not)."""

    msg_id: str
    sender: str
    """The publisher's connection (its inbox prefix: each connection has its own)."""
    kind: str
    ts: float
    data: dict[str, Any]


@dataclass
class Job:
    """A fake controller's view of one job: its replicas' hellos and samples, and every attempt to
    append one of the job's events."""

    embedded: EmbeddedInfra
    launcher: LocalLauncher
    bus: Bus
    job_id: str
    hellos: list[MemberHello] = field(default_factory=list)
    samples: dict[str, MetricsSample] = field(default_factory=dict)
    attempts: list[Attempt] = field(default_factory=list)
    started: list[str] = field(default_factory=list)

    async def start_replica(self, member_id: str) -> None:
        """Start a replica under the rollout role's credentials; return once it is up and idle."""
        env = {**_role(self.embedded, Principal.ROLLOUT).to_env(), "ROBUSTRL_JOB_ID": self.job_id,
               "ROBUSTRL_MEMBER_ID": member_id, "ROBUSTRL_ROLE": "rollout"}
        self.started.append(member_id)
        await asyncio.to_thread(self.launcher.start, MemberSpec(self.job_id, member_id, "rollout",
                                                                 module="robustrl.services.rollout", env=env))
        await eventually_async(lambda: (s := self.samples.get(member_id)) is not None and s.phase == "idle",
                               timeout=START_S, what=f"{member_id} up and idle")

    async def announce(self, version: int, seed: int) -> tuple[WeightServer, str]:
        """Serve a version from a weight server of the test's and announce it, as the trainer
        does; return the server and the version's checksum."""
        v = make_version(version, seed=seed)
        server = WeightServer()
        await server.start()
        server.add_version(v.manifest, v.buffer)
        await self.bus.publish(subject(self.job_id, Verb.WEIGHTS), WeightsAnnounce(
            job_id=self.job_id, version=v.version, epoch=1, checksum=v.checksum, sources=[server.address or ""],
            manifest_digest=v.manifest.digest()))
        return server, v.checksum

    def tried(self, kind: str, **data: object) -> list[Attempt]:
        return [a for a in self.attempts
                if a.kind == kind and all(a.data.get(k) == v for k, v in data.items())]

    def senders(self, kind: str) -> set[str]:
        """The connections that tried to append an event of ``kind``."""
        return {a.sender for a in self.tried(kind)}

    async def logged(self, kind: str) -> list[RawEvent]:
        assert self.embedded.settings
        return [e for e in await read_event_log(self.embedded.settings.nats_url, self.job_id) if e.kind == kind]


@asynccontextmanager
async def _job(embedded: EmbeddedInfra, launcher: LocalLauncher) -> AsyncIterator[Job]:
    """A fake controller (answers the replicas' spec requests) of a fresh job, and an unrestricted
    core subscriber to the job's event subjects."""
    settings = embedded.settings
    assert settings
    bus = await Bus.connect(settings.nats_url, "test-controller")
    await bus.ensure_event_stream()
    job = Job(embedded, launcher, bus, f"ro{uuid.uuid4().hex[:8]}")
    spec = reference_job(steps=3).model_copy(update={
        "detector": DetectorSpec.reference().model_copy(update={"metrics_interval_s": 0.1}),
    }).model_dump(mode="json")

    async def on_spec(msg: SpecRequest, _s: str, reply: str | None) -> None:
        await bus.respond(reply, SpecReply(job_id=msg.job_id, spec=spec, epoch=0))

    async def on_hello(msg: MemberHello, _s: str, _r: str | None) -> None:
        job.hellos.append(msg)

    async def on_sample(msg: MetricsSample, _s: str, _r: str | None) -> None:
        job.samples[msg.member_id] = msg

    await bus.subscribe(subject(job.job_id, Verb.SPEC), SpecRequest, on_spec)
    await bus.subscribe(wildcard(job.job_id, Verb.HELLO), MemberHello, on_hello)
    await bus.subscribe(wildcard(job.job_id, Verb.METRICS), MetricsSample, on_sample)
    watcher = await nats.connect(settings.nats_url, connect_timeout=2)

    async def on_attempt(msg: Any) -> None:
        body = json.loads(msg.data)
        sender = ".".join((msg.reply or "").split(".")[:2])
        job.attempts.append(Attempt((msg.headers or {}).get(MSG_ID_HEADER, ""), sender, body["kind"], body["ts"],
                                    body.get("data") or {}))

    await watcher.subscribe(f"rrl.events.{job.job_id}.>", cb=on_attempt)
    await watcher.flush()
    try:
        yield job
    finally:
        for member_id in job.started:
            await asyncio.to_thread(launcher.stop, member_id, 10.0)
        await watcher.close()
        await bus.close()
        for member_id in job.started:
            log = launcher.log_dir / f"{member_id}.log"
            if log.exists():
                print(f"--- {member_id}\n{log.read_text(errors='replace')[-4000:]}")


async def _outbox(redis: Any, job_id: str) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in await redis.lrange(Keys.rollout_outbox(job_id), 0, -1)]


async def _outbox_gone(redis: Any, job_id: str) -> bool:
    return not await redis.exists(Keys.rollout_outbox(job_id))


async def test_a_load_event_of_a_replica_killed_while_jetstream_is_away_is_appended_by_the_next_replica(
        embedded: EmbeddedInfra, launcher: LocalLauncher) -> None:
    """A replica loads v1 while the event stream stores nothing: its ``weights_loaded`` is tried
    and not stored. The replica is SIGKILLed, JetStream comes back, and nothing appends the event
    until a new replica of the job starts: then it is in the log once, as the killed replica
    stamped it, and the outbox key is gone. (Before: the event was in the killed replica's memory
    only, and the log never got it.)"""
    assert embedded.settings
    redis = connect(embedded.settings.redis_url)  # the operator's: reads the raw keys
    server = None
    try:
        async with _job(embedded, launcher) as job:
            await job.start_replica("rollout-0-i0")
            async with _jetstream_away(embedded.settings.nats_url):
                server, checksum = await job.announce(1, seed=21)
                tried = await eventually_async(lambda: job.tried("weights_loaded", version=1), timeout=WAIT_S,
                                               what="the replica tried to append weights_loaded v1")
                await asyncio.to_thread(launcher.kill, "rollout-0-i0")  # its memory is gone
            assert await job.logged("weights_loaded") == []  # nobody appended it meanwhile

            await job.start_replica("rollout-0-i1")
            logged = await eventually_async(lambda: job.logged("weights_loaded"), timeout=WAIT_S,
                                            what="the killed replica's weights_loaded in the log")
            await eventually_async(lambda: _outbox_gone(redis, job.job_id), timeout=WAIT_S,
                                   what="the rollout outbox emptied once JetStream stored the event")
            logged = await job.logged("weights_loaded")
            assert [(e.data["member_id"], e.data["version"], e.data["checksum"]) for e in logged] == [
                ("rollout-0-i0", 1, checksum)], [e.data for e in logged]
            assert logged[0].ts == tried[0].ts  # the event the killed replica stamped, not a new one
            # appended by the new replica under the message id the killed one drew
            assert {a.msg_id for a in job.tried("weights_loaded")} == {tried[0].msg_id}
    finally:
        if server is not None:
            await server.close()
        await redis.aclose()


async def test_an_event_a_live_replica_still_retries_is_appended_by_a_new_replica_too_and_stored_once(
        embedded: EmbeddedInfra, launcher: LocalLauncher) -> None:
    """A replica loads v1 while the event stream stores nothing and stays alive, retrying. A new
    replica of the job starts meanwhile and queues the entry it finds in the outbox, under the same
    message id. JetStream comes back: both append it, the log holds it once, and the outbox key
    goes (a second removal is a no-op)."""
    assert embedded.settings
    redis = connect(embedded.settings.redis_url)
    server = None
    try:
        async with _job(embedded, launcher) as job:
            await job.start_replica("rollout-0-i0")
            async with _jetstream_away(embedded.settings.nats_url):
                server, checksum = await job.announce(1, seed=22)
                first = await eventually_async(lambda: job.tried("weights_loaded", version=1), timeout=WAIT_S,
                                               what="the replica tried to append weights_loaded v1")
                await job.start_replica("rollout-1-i0")
                # The new replica tries to append the entry it found, under the same message id,
                # from its own connection.
                both = await eventually_async(lambda: len(job.senders("weights_loaded")) == 2, timeout=WAIT_S,
                                              what="the new replica's attempts at the first replica's event")
                assert both and "" not in job.senders("weights_loaded")
                assert len(await _outbox(redis, job.job_id)) == 1
            logged = await eventually_async(lambda: job.logged("weights_loaded"), timeout=WAIT_S,
                                            what="weights_loaded in the log")
            await eventually_async(lambda: _outbox_gone(redis, job.job_id), timeout=WAIT_S,
                                   what="the rollout outbox emptied")
            # Both replicas are past their appends once the outbox is gone (each removes after storing).
            logged = await job.logged("weights_loaded")
            assert [(e.data["member_id"], e.data["version"], e.data["checksum"]) for e in logged] == [
                ("rollout-0-i0", 1, checksum)], [e.data for e in logged]
            assert {a.msg_id for a in job.tried("weights_loaded")} == {first[0].msg_id}
            assert len(await job.logged("weights_loaded")) == 1
    finally:
        if server is not None:
            await server.close()
        await redis.aclose()


async def _one_killed_while_jetstream_is_away(job: Job, seed: int) -> tuple[Attempt, WeightServer]:
    """Replicas rollout-0-i0 and rollout-1-i0 up; both load v1 while the event stream stores
    nothing; rollout-0-i0 is SIGKILLed with its ``weights_loaded`` in the outbox only; JetStream
    comes back. Returns the killed replica's attempt and the weight server."""
    assert job.embedded.settings
    await job.start_replica("rollout-0-i0")
    await job.start_replica("rollout-1-i0")  # both read the (empty) outbox at their start
    async with _jetstream_away(job.embedded.settings.nats_url):
        server, _checksum = await job.announce(1, seed=seed)
        for member in ("rollout-0-i0", "rollout-1-i0"):
            await eventually_async(lambda m=member: job.tried("weights_loaded", version=1, member_id=m),  # type: ignore[misc]
                                   timeout=WAIT_S, what=f"{member} tried to append weights_loaded v1")
        await asyncio.to_thread(job.launcher.kill, "rollout-0-i0")
    return job.tried("weights_loaded", member_id="rollout-0-i0")[0], server


async def test_a_dead_replicas_event_is_appended_by_a_live_replica_with_none_started_after(
        embedded: EmbeddedInfra, launcher: LocalLauncher) -> None:
    """A replica killed while JetStream was away, and no replica of the job started after it (a
    job whose slot is never refilled): its ``weights_loaded`` was appended only by a replica that
    starts later, so it stayed in the outbox for good (a live replica read the outbox once, at its
    start). Now a live replica takes up an entry ``ORPHAN_AFTER_S`` old: the log holds it once,
    under the killed replica's message id, and the outbox key goes."""
    assert embedded.settings
    redis = connect(embedded.settings.redis_url)
    server = None
    try:
        async with _job(embedded, launcher) as job:
            killed, server = await _one_killed_while_jetstream_is_away(job, seed=23)

            async def logged_from_killed() -> list[RawEvent]:
                return [e for e in await job.logged("weights_loaded") if e.data["member_id"] == "rollout-0-i0"]
            await eventually_async(logged_from_killed, timeout=WAIT_S + ORPHAN_AFTER_S,
                                   what="the killed replica's weights_loaded appended by the live one")
            await eventually_async(lambda: _outbox_gone(redis, job.job_id), timeout=WAIT_S,
                                   what="the rollout outbox emptied")
            got = await logged_from_killed()
            assert len(got) == 1 and got[0].ts == killed.ts, [e.data for e in got]
            assert {a.msg_id for a in job.tried("weights_loaded", member_id="rollout-0-i0")} == {killed.msg_id}
    finally:
        if server is not None:
            await server.close()
        await redis.aclose()


async def test_the_last_replica_to_stop_appends_what_a_dead_replica_left(
        embedded: EmbeddedInfra, launcher: LocalLauncher) -> None:
    """The job ends right after JetStream came back: its last replica is stopped (as the
    controller stops a finished job's members), and the event a killed replica left in the outbox
    had nobody to append it (the auditor fails such a job). Now a replica's stop reads the outbox
    once more before its last drain: once the stop returned, the log holds the event, once."""
    assert embedded.settings
    redis = connect(embedded.settings.redis_url)
    server = None
    try:
        async with _job(embedded, launcher) as job:
            killed, server = await _one_killed_while_jetstream_is_away(job, seed=24)
            # (right away: the live replica's upkeep leaves the entry for ORPHAN_AFTER_S, so only
            # the stop's read appends it)
            t0 = time.monotonic()
            await asyncio.to_thread(launcher.stop, "rollout-1-i0", 10.0)
            assert time.monotonic() - t0 < 10.0, "the stop outlived its bound"
            got = [e for e in await job.logged("weights_loaded") if e.data["member_id"] == "rollout-0-i0"]
            assert len(got) == 1 and got[0].ts == killed.ts, [e.data for e in got]
            assert await _outbox_gone(redis, job.job_id), await _outbox(redis, job.job_id)
    finally:
        if server is not None:
            await server.close()
        await redis.aclose()


async def test_an_entry_stored_whose_removal_failed_is_not_queued_again_by_a_reread(
        embedded: EmbeddedInfra) -> None:
    """A replica's event stored by JetStream while Redis took no write (its removal failed, kept
    for a retry) is still in the outbox when the replica's upkeep reads the outbox again (it does
    every round now, for what dead replicas left): queued again, it would be stored a second time
    once past JetStream's duplicate window. The stream's window is cut to 1 s here, so a second
    append is a second entry. The replica's event path on real NATS and Redis, the re-read and the
    stop's last read; judged from the raw log and raw Redis."""
    assert embedded.settings
    settings = _role(embedded, Principal.ROLLOUT)
    admin = connect(embedded.settings.redis_url)
    redis = connect(settings.redis_url)
    # Connected (and logged in) now: the client is lazy, and a first save that also pays for the
    # connection can run past the replica's 0.25-s save bound under load (the event is then kept
    # in memory only, and the outbox below is empty: suite51).
    await redis.ping()
    operator = await Bus.connect(embedded.settings.nats_url, "test-operator")
    await operator.ensure_event_stream()
    await operator.close()
    bus = await Bus.connect(settings.nats_url, "rollout-reread", role="rollout")
    job_id = f"ro{uuid.uuid4().hex[:8]}"
    events = ReplicaEvents(bus, job_id, redis)
    window = await duplicate_window(embedded.settings.nats_url, 1.0)
    try:
        async with _jetstream_away(embedded.settings.nats_url):
            assert await events.emit("weights_loaded", {"member_id": "r-0", "version": 1, "checksum": "c",
                                                        "verified": True})
            assert events.unsaved == 0, "the save was cut off at the replica's bound (REDIS_CALL_S)"
            assert len(await _outbox(admin, job_id)) == 1
            await admin.execute_command("CLIENT", "PAUSE", "5000", "WRITE")
        await eventually_async(lambda: events.unremoved == 1, timeout=WAIT_S,
                               what="stored by JetStream, its removal cut off by the pause")
        assert len(await _outbox(admin, job_id)) == 1
        await asyncio.sleep(1.5)  # past the (cut) duplicate window: a second append is a second entry
        assert await events.recover() == 0  # not queued a second time
        assert events.pending == 0
        await events.close(1.0)  # the stop's last read: not queued either
        assert events.pending == 0
    finally:
        await admin.execute_command("CLIENT", "UNPAUSE")
        await events.close(0.5)
        await duplicate_window(embedded.settings.nats_url, window)
        await bus.close()
        await redis.aclose()
        await admin.aclose()
    logged = [e for e in await read_event_log(embedded.settings.nats_url, job_id) if e.kind == "weights_loaded"]
    assert len(logged) == 1, [e.data for e in logged]



async def test_a_silent_redis_does_not_hold_the_replicas_events(embedded: EmbeddedInfra) -> None:
    """The replica's event path (``ReplicaEvents``, as the replica builds it, on real NATS) with a
    Redis that accepts connections and never answers: each emit returns within the outbox bound,
    and the events are still appended (in memory only: not durable, counted)."""
    assert embedded.settings
    settings = _role(embedded, Principal.ROLLOUT)
    operator = await Bus.connect(embedded.settings.nats_url, "test-operator")
    await operator.ensure_event_stream()
    await operator.close()
    silent = SilentServer()
    await silent.start()
    redis = connect(silent.url)
    bus = await Bus.connect(settings.nats_url, "rollout-silent-redis", role="rollout")
    job_id = f"ro{uuid.uuid4().hex[:8]}"
    events = ReplicaEvents(bus, job_id, redis)
    events.start_upkeep()
    try:
        for version in (1, 2):
            t0 = time.monotonic()
            ev = await events.emit("weights_loaded", {"member_id": "r-silent", "version": version,
                                                      "checksum": "c", "verified": True})
            assert ev is not None
            assert time.monotonic() - t0 < REDIS_CALL_S + 0.25, "an emit waited on Redis"
        assert await events.drain(WAIT_S)
        logged = [e for e in await read_event_log(embedded.settings.nats_url, job_id) if e.kind == "weights_loaded"]
        assert [e.data["version"] for e in logged] == [1, 2]
        assert events.unsaved == 2 and not events.outbox_read
    finally:
        await events.close(0.5)
        await bus.close()
        await silent.close()
        try:
            await asyncio.wait_for(redis.aclose(), 1.0)
        except Exception:  # noqa: BLE001 - a client of a silent server may not close cleanly
            pass


# --- deletion -------------------------------------------------------------------------------------


def test_a_deletion_that_keeps_the_log_logs_the_rollout_outbox_and_purges_it(api: ApiClient,
                                                                              infra: Settings) -> None:
    """An ended job whose rollout outbox still holds an event (its replica killed while JetStream
    was away, none started since): the controller may not write a replica's events, so a deletion
    that keeps the log logs the entry (as the trainer outbox's) and purges it with the job's keys;
    the deletion ends, its log ends with ``job_deleted``."""
    import redis as redis_sync

    r = redis_sync.Redis.from_url(infra.redis_url)
    try:
        kept = f"ro-kept-{uuid.uuid4().hex[:8]}"
        r.hset(Keys.jobs(), kept, json.dumps({"spec": {"name": "ro-kept", "steps": 1}, "status": "stopped"}))
        event = Event(job_id=kept, kind="weights_loaded", data={"member_id": "rollout-0-i0", "version": 1,
                                                                "checksum": "c", "verified": True})
        r.rpush(Keys.rollout_outbox(kept), json.dumps({"msg_id": f"{kept}-weights_loaded-{uuid.uuid4().hex}",
                                                       "event": event.model_dump(mode="json")}))
        out = api.delete(kept)
        assert out["events_kept"] and not r.exists(Keys.rollout_outbox(kept))
        log = asyncio.run(read_event_log(infra.nats_url, kept))
        assert [e.kind for e in log] == ["job_deleted"], [e.kind for e in log]
    finally:
        r.close()
