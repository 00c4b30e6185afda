"""Infra faults: NATS, Redis and S3 servers restart under their clients, which ride through.

Each test restarts a server of its own (``EmbeddedInfra.restart``: SIGTERM, then the same port,
credentials and data directory) while a client is using it, and checks from the raw server
afterwards that nothing was lost or stored twice.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
import redis
from support import eventually_async, own_servers

from robustrl import subjects
from robustrl.bus import Bus
from robustrl.config import Settings
from robustrl.errors import TransportError
from robustrl.infra.embedded import EmbeddedInfra
from robustrl.messages import Event
from robustrl.storage.objects import S3ObjectStore
from robustrl.storage.redis_stores import connect


@pytest.fixture(scope="module")
def own_infra(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedInfra]:
    """Servers of this module alone: restarting the session's would disturb other tests."""
    with own_servers(tmp_path_factory, "restart-infra") as infra:
        yield infra


def _restart_in_thread(infra: EmbeddedInfra, name: str) -> tuple[threading.Thread, list[float]]:
    took: list[float] = []
    thread = threading.Thread(target=lambda: took.append(infra.restart(name)), daemon=True)
    thread.start()
    return thread, took


def test_restart_keeps_port_credentials_and_data(own_infra: EmbeddedInfra) -> None:
    settings = own_infra.settings
    assert settings is not None
    before = {r.name: r.pid for r in own_infra.records}
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=2)
    client.set("restart:key", b"kept")  # written just before the stop: must be in the AOF
    took = own_infra.restart("redis")
    assert took < 10
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=2)  # same URL, same password
    assert client.get("restart:key") == b"kept"
    client.close()
    after = {r.name: r.pid for r in own_infra.records}
    assert after["redis"] != before["redis"] and after["nats"] == before["nats"]
    assert own_infra.alive() == {"nats": True, "redis": True, "s3": True}
    with pytest.raises(Exception, match="cannot restart"):
        own_infra.restart("postgres")


async def test_bus_rides_through_nats_restart(own_infra: EmbeddedInfra) -> None:
    settings = own_infra.settings
    assert settings is not None
    bus = await Bus.connect(settings.nats_url, "restart-test")
    await bus.ensure_event_stream()
    got: list[str] = []

    async def on_msg(msg: Event, _s: str, _r: str | None) -> None:
        got.append(msg.data["n"])

    job, probe = "nats-restart", "nats-restart-probe"
    # An event subject (a subscriber checks each Event against its subject), of another job than
    # the one whose stored events are counted below.
    await bus.subscribe(subjects.events(probe, "note"), Event, on_msg)
    try:
        thread, took = _restart_in_thread(own_infra, "nats")
        # Events emitted while the server is going down and coming back: every one is stored, once.
        for n in range(20):
            await bus.emit_event(job, "note", {"n": n})
            await asyncio.sleep(0.05)  # spread the emits over the restart window
        await asyncio.to_thread(thread.join)
        assert took, "restart did not finish"
        assert bus.reconnects >= 1, "the client never saw the restart"
        # The subscription was renewed on reconnect: a publish now reaches the handler.
        await bus.publish(subjects.events(probe, "note"), Event(job_id=probe, kind="note", data={"n": "after"}))
        await eventually_async(lambda: "after" in got, timeout=10, what="message after reconnect")
        events = await bus.read_events(job)
        assert sorted(e.data["n"] for e in events) == list(range(20))
    finally:
        await bus.close()
    # From the raw stream: exactly 20 messages on the job's subjects.
    nc = await nats.connect(settings.nats_url)
    try:
        info = await nc.jetstream().stream_info(subjects.EVENTS_STREAM, subjects_filter=subjects.events_of(job))
        assert sum((info.state.subjects or {}).values()) == 20
    finally:
        await nc.close()


async def test_redis_commands_ride_through_restart(own_infra: EmbeddedInfra) -> None:
    settings = own_infra.settings
    assert settings is not None
    r = connect(settings.redis_url)
    try:
        await r.ping()
        thread, took = _restart_in_thread(own_infra, "redis")
        n = 0
        while thread.is_alive() or n < 10:
            # a pipeline (MULTI/EXEC) and a plain command, as the stores use them
            pipe = r.pipeline(transaction=True)
            pipe.set(f"ride:{n}", n)
            pipe.sadd("ride:set", n)
            await pipe.execute()
            await r.rpush("ride:list", n)
            n += 1
            await asyncio.sleep(0.01)  # paces the load: commands keep coming over the restart window
        await asyncio.to_thread(thread.join)
        assert took
    finally:
        await r.aclose()
    raw = redis.Redis.from_url(settings.redis_url, socket_timeout=2)
    try:
        assert raw.scard("ride:set") == n
        # Nothing lost, nothing out of order. A command whose reply was lost in the restart is
        # run again by the retry, and the server may have run it already: a plain RPUSH can land
        # twice (seen once in a full suite). The stores' own writes are idempotent for that
        # reason (the trained-log append checks its tail: tests/test_fencing.py).
        pushed = [int(x) for x in raw.lrange("ride:list", 0, -1)]
        assert [x for i, x in enumerate(pushed) if i == 0 or x != pushed[i - 1]] == list(range(n)), pushed
        assert len(pushed) <= n + 1, pushed  # at most the one command cut off by the restart
        assert all(raw.get(f"ride:{i}") == str(i).encode() for i in range(n))
    finally:
        raw.close()


def test_s3_calls_ride_through_restart(own_infra: EmbeddedInfra, tmp_path: Path) -> None:
    settings: Settings | None = own_infra.settings
    assert settings is not None
    store = S3ObjectStore(settings.s3_endpoint, settings.s3_access_key, settings.s3_secret_key,
                          bucket=settings.s3_bucket, connect_timeout_s=1.0)
    thread, took = _restart_in_thread(own_infra, "s3")
    n = 0
    while thread.is_alive() or n < 5:
        store.put(f"ride/{n:04d}", b"x" * (n + 1))
        n += 1
    thread.join()
    assert took
    keys = store.list("ride/")
    assert keys == [f"ride/{i:04d}" for i in range(n)]
    assert all(store.get(k) == b"x" * (i + 1) for i, k in enumerate(keys))


async def _stored(url: str, job: str) -> int:
    """Messages of ``job`` in the raw event stream (a connection of its own)."""
    nc = await nats.connect(url)
    try:
        info = await nc.jetstream().stream_info(subjects.EVENTS_STREAM, subjects_filter=subjects.events_of(job))
        return sum((info.state.subjects or {}).values())
    finally:
        await nc.close()


async def _emit_while_down(own_infra: EmbeddedInfra, down_s: float, job: str) -> tuple[
        Bus, threading.Thread, asyncio.Task[Event]]:
    """A bus whose server goes down, and an event given to it while the server is away (in its
    retries when this returns)."""
    settings = own_infra.settings
    assert settings is not None
    bus = await Bus.connect(settings.nats_url, f"drain-{job}")
    await bus.ensure_event_stream()
    thread = threading.Thread(target=own_infra.restart, args=("nats", down_s), daemon=True)
    thread.start()
    await eventually_async(lambda: not bus.connected, timeout=10, what="the bus sees the server gone")
    emit = asyncio.get_running_loop().create_task(bus.emit_event(job, "note", {"n": 1}))
    await asyncio.sleep(0)  # a loop step: the emit is in its first JetStream attempt
    assert not emit.done()
    return bus, thread, emit


async def test_a_bus_closed_while_an_event_is_in_its_retries_stores_it_before_closing(
        own_infra: EmbeddedInfra) -> None:
    """A member stops (its bus closes) while an event it emitted waits for JetStream, back within
    the close's bound (a NATS restart as the job ends): the event is stored, not cut off. Before,
    the close drained the connection under the retries and the event was lost."""
    job = "drain-kept"
    bus, thread, emit = await _emit_while_down(own_infra, 1.0, job)
    try:
        # A bound past the outage, its reconnect and a retry's back-off (up to 2 s) with a lost
        # attempt (2 s), on a loaded machine.
        await bus.close(drain_s=8.0)
        assert emit.done(), "the close returned while the event was still being stored"
    finally:
        await asyncio.to_thread(thread.join)
    settings = own_infra.settings
    assert settings is not None
    assert await _stored(settings.nats_url, job) == 1


async def test_a_close_whose_bound_passes_names_what_it_loses_and_stops_retrying(
        own_infra: EmbeddedInfra, caplog: pytest.LogCaptureFixture) -> None:
    """JetStream away past the close's bound: the close returns within it (a stopping member is
    not held for the event's whole retry budget), says which event it gives up, and the event's
    retries end with it (they went on for 30 s on a closed connection)."""
    job = "drain-lost"
    bus, thread, emit = await _emit_while_down(own_infra, 4.0, job)
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with caplog.at_level("ERROR", logger="robustrl.bus"):
            await bus.close(drain_s=0.5)
        assert loop.time() - t0 < 0.5 + 2 * 2.0 + 1.0  # the bound, then NATS's own drain and close bounds
        assert any(subjects.events(job, "note") in r.getMessage() and "not stored" in r.getMessage()
                   for r in caplog.records if r.levelname == "ERROR"), caplog.text
        # Its retries end at once, not after EVENT_PUBLISH_RETRY_S (30 s).
        await asyncio.wait_for(asyncio.shield(emit), 2 * 2.0 + 1.0)
    finally:
        await asyncio.to_thread(thread.join)


async def _set_event_subjects(nats_url: str, subject_list: list[str]) -> None:
    """Point the event stream at ``subject_list`` (another subject: JetStream away for events,
    a publish gets no acknowledgement, while core NATS stays up)."""
    nc = await nats.connect(nats_url, connect_timeout=2, max_reconnect_attempts=0)
    try:
        js = nc.jetstream()
        config = (await js.stream_info(subjects.EVENTS_STREAM)).config
        config.subjects = subject_list
        await js.update_stream(config)
    finally:
        await nc.close()


@pytest.mark.parametrize("ended_by", ["the_member_living_on", "a_close"])
async def test_events_not_stored_within_their_budget_are_kept_in_order_not_dropped(
        own_infra: EmbeddedInfra, ended_by: str) -> None:
    """JetStream away longer than an event's retry budget (a member's ``step_committed`` or
    ``weights_loaded`` through a long outage): the event was dropped with a warning. Now it is
    kept, retried in the background in order with what the member emits after it (which no
    longer waits on the outage), and stored once JetStream is back -- while the member lives on,
    or within its bus's close. Judged from the raw stream."""
    settings = own_infra.settings
    assert settings is not None
    job = f"backlog-{ended_by}"
    bus = await Bus.connect(settings.nats_url, f"backlog-{ended_by}")
    await bus.ensure_event_stream()
    await _set_event_subjects(settings.nats_url, ["rrl-away.>"])
    try:
        loop = asyncio.get_running_loop()
        await bus.emit_event(job, "note", {"n": 1}, retry_s=0.5)  # its budget runs out: kept
        t0 = loop.time()
        await bus.emit_event(job, "note", {"n": 2}, retry_s=0.5)  # behind it, without waiting
        await bus.emit_event(job, "note", {"n": 3}, retry_s=0.5)
        assert loop.time() - t0 < 0.3, "an event emitted behind an owed one waited on the outage"
    finally:
        await _set_event_subjects(settings.nats_url, [subjects.EVENTS_ALL])
    if ended_by == "a_close":
        await bus.close()
    reader = await Bus.connect(settings.nats_url, f"backlog-reader-{ended_by}")
    try:
        log = await eventually_async(lambda: _all_three(reader, job), timeout=15, what="the owed events stored")
        assert [e.data["n"] for e in log] == [1, 2, 3]
    finally:
        await reader.close()
        await bus.close()


async def _all_three(reader: Bus, job: str) -> list[Event] | None:
    log = list(await reader.read_events(job))
    return log if len(log) >= 3 else None


async def test_a_required_event_behind_owed_ones_waits_for_them_and_is_not_kept_when_refused(
        own_infra: EmbeddedInfra) -> None:
    """A required event (``weights_published``: what follows it, pointing replicas at the
    version, must not happen unless it is in the log) emitted while events are owed goes after
    them within its own budget; past it, it raises and is not kept (its caller acts on the
    refusal: it must not land in the log later). Once JetStream is back, a required event is
    stored after the owed ones."""
    settings = own_infra.settings
    assert settings is not None
    job = "backlog-required"
    bus = await Bus.connect(settings.nats_url, "backlog-required")
    await bus.ensure_event_stream()
    try:
        await _set_event_subjects(settings.nats_url, ["rrl-away.>"])
        try:
            await bus.emit_event(job, "note", {"n": 1}, retry_s=0.5)
            assert bus.owed == 1
            with pytest.raises(TransportError, match="still owed"):
                await bus.emit_event(job, "note", {"n": "refused"}, required=True, retry_s=0.5)
        finally:
            await _set_event_subjects(settings.nats_url, [subjects.EVENTS_ALL])
        await bus.emit_event(job, "note", {"n": 2}, required=True)
        assert bus.owed == 0
        assert [e.data["n"] for e in await bus.read_events(job)] == [1, 2]
    finally:
        await bus.close()


async def test_a_close_waits_for_an_event_emitted_as_the_one_before_it_is_stored(own_infra: EmbeddedInfra) -> None:
    """A member emits two events in a row while JetStream is away, and its bus closes meanwhile:
    the first is stored as JetStream comes back and the second begins in the same loop step.
    The close waited for the first only (its idle event was set and cleared before it looked) and
    cut the second off (found by an outside review with a fake server; here on the real one)."""
    settings = own_infra.settings
    assert settings is not None
    job = "drain-chained"
    bus = await Bus.connect(settings.nats_url, "drain-chained")
    await bus.ensure_event_stream()
    await _set_event_subjects(settings.nats_url, ["rrl-away.>"])
    restored = False
    try:
        async def two_in_a_row() -> None:
            await bus.emit_event(job, "note", {"n": 1})
            await bus.emit_event(job, "note", {"n": 2})

        emits = asyncio.get_running_loop().create_task(two_in_a_row())
        await asyncio.sleep(0)  # a loop step: the first is in its first JetStream attempt
        closing = asyncio.get_running_loop().create_task(bus.close(drain_s=10.0))
        await asyncio.sleep(0.5)  # the outage (fault injection), then JetStream is back
        await _set_event_subjects(settings.nats_url, [subjects.EVENTS_ALL])
        restored = True
        await asyncio.wait_for(closing, 15)
        assert emits.done(), "the close returned while the second event was still being stored"
    finally:
        if not restored:
            await _set_event_subjects(settings.nats_url, [subjects.EVENTS_ALL])
    assert await _stored(settings.nats_url, job) == 2
