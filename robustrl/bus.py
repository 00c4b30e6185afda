"""A thin NATS wrapper: typed publish/subscribe, request with timeout, and the JetStream event log.

Raw bytes become typed messages at the edge: a subscription decodes with the model it was
registered for, and anything malformed is logged, counted in ``dropped`` and dropped; the
handler never sees it and the service keeps running. A handler that raises is logged too.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats
import nats.errors
from nats.aio.client import NO_RESPONDERS_STATUS
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, Header, StreamConfig
from nats.js.errors import APIError as JsAPIError
from tenacity import (
    AsyncRetrying,
    before_sleep_log,
    retry_if_exception_type,
    stop_after_delay,
    stop_any,
    wait_random_exponential,
)

from robustrl import subjects
from robustrl.aio import wait_event, within
from robustrl.errors import MessageError, RequestTimeout, TransportError
from robustrl.messages import Event, EventLog, Wire, decode, decode_event

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Wire)
Handler = Callable[[M, str, str | None], Awaitable[None]]

CONNECT_TIMEOUT_S = 5.0
"""One attempt to open the connection."""
CONNECT_RETRY_S = 30.0
"""How long a (re)starting service keeps trying to reach NATS, e.g. while the server restarts."""
RECONNECT_WAIT_S = 0.2
"""Pause between reconnect attempts once connected; attempts never stop (a job outlives a restart)."""
REQUEST_TIMEOUT_S = 2.0
DRAIN_TIMEOUT_S = 2.0
EVENT_READ_TIMEOUT_S = 5.0
EVENT_MAX_AGE_S = 7 * 24 * 3600.0
"""How long the event log keeps a job's events."""
EVENT_DUPLICATE_WINDOW_S = 3600.0
"""How long JetStream remembers an event's message id and drops a second copy: an hour, not its
2-minute default, so that a sender frozen that long after its first try (a zombie rank, a
partitioned member whose owed event is retried) stores nothing twice."""
JETSTREAM_DEFAULT_DUPLICATE_WINDOW_S = 120.0
DIRECT_GET_START_TIME = (2, 11)
"""The first nats-server version whose direct get honours ``start_time`` (``Bus.stored_msg_ids``)."""
EVENT_FETCH_RETRIES = 8
"""Fetches of the event log JetStream may refuse as unavailable (503) before a read gives up."""
EVENT_FETCH_RETRY_WAIT_S = 0.25
EVENT_READER_IDLE_S = 60.0
"""How long JetStream keeps a log reader's consumer between two of its fetches."""
EVENT_FETCH_TIMEOUT_S = 1.0
"""One fetch while reading the event log; an empty fetch ends the read once nothing is pending."""
EVENT_FETCH_STALLS = 8
"""Empty fetches in a row (each ``EVENT_FETCH_TIMEOUT_S``) a log read sits through while JetStream
still counts events pending for it, before it gives up with an error rather than return part of
the log."""
EVENT_PUBLISH_RETRY_S = 30.0
"""How long an event is retried while JetStream is away (server restart, leader change)."""
DURABLE_DRAIN_S = 4.0
"""How long ``close`` waits for durable publishes still in their retries (an event a stopping
member emitted while JetStream was away: lost if the connection is drained under it). One
JetStream attempt whose ack a restart lost takes ``REQUEST_TIMEOUT_S``, the pause before the next
up to ``RETRY_WAIT_MAX_S``. Only a close with publishes in flight waits."""
RETRY_WAIT_INITIAL_S = 0.1
RETRY_WAIT_MAX_S = 2.0
MSG_ID_HEADER = "Nats-Msg-Id"
"""JetStream drops a second publish with the same id (duplicate window), so a retry after a lost
ack never stores an event twice."""


class Bus:
    """One NATS connection for one service or member."""

    def __init__(self, nc: NatsClient, name: str, role: str | None = None) -> None:
        self._nc = nc
        self.name = name
        self.role = role  # the principal whose credentials it holds: the event kinds it may write
        self.dropped = 0
        self.handler_errors = 0
        self._js = nc.jetstream()
        self._closed = False  # close() was called: it may still be waiting for durable publishes
        self._shut = False  # the connection is being drained: durable publishes stop retrying
        self._durable: dict[int, str] = {}
        """Durable publishes not acknowledged yet: a token each -> subject."""
        self._durable_ids = itertools.count()
        self._durable_idle = asyncio.Event()
        self._durable_idle.set()
        self._backlog: Any = None
        """Events whose retry budget ran out, retried in order in the background (an
        ``EventQueue``, made on first use); ``emit_event`` puts what follows them there too."""
        self.disconnects = 0
        self.reconnects = 0
        self.reconnected_at = 0.0
        """Monotonic time of the last reconnect (peers may still be reconnecting for a while after
        it); 0.0: none yet."""
        self.on_reconnect: list[Callable[[], Awaitable[None]]] = []
        """Called (each in a task of its own) after every reconnect: core NATS dropped whatever was
        published while this connection was down, so a subscriber that keeps state re-reads it."""
        self._reconnect_tasks: set[asyncio.Task[None]] = set()

    @classmethod
    async def connect(cls, url: str, name: str, *, connect_timeout: float = CONNECT_TIMEOUT_S,
                      reconnect: bool = True, connect_retry_s: float | None = None,
                      role: str | None = None) -> Bus:
        """Connect with automatic reconnect (never giving up); raise TransportError naming the URL
        if the server cannot be reached within ``connect_retry_s`` (default ``CONNECT_RETRY_S``
        with ``reconnect``, one attempt without).

        Subscriptions survive a reconnect (the client subscribes again), and publishes made
        while disconnected are buffered and flushed on reconnect.
        """
        bus: Bus | None = None

        async def _err(exc: Exception) -> None:
            # A permissions violation means the role's NATS user lacks a subject it uses: loud.
            level = logging.WARNING if "permission" in str(exc).lower() else logging.DEBUG
            log.log(level, "nats %s: %s", name, exc)

        async def _down() -> None:
            if bus is not None:
                bus.disconnects += 1
            log.warning("nats %s: disconnected; reconnecting", name)

        async def _up() -> None:
            if bus is not None:
                bus.reconnects += 1
                bus.reconnected_at = time.monotonic()
                for hook in bus.on_reconnect:
                    task = asyncio.get_running_loop().create_task(hook())
                    bus._reconnect_tasks.add(task)
                    task.add_done_callback(bus._reconnect_done)
            log.warning("nats %s: reconnected", name)

        budget = (CONNECT_RETRY_S if reconnect else 0.0) if connect_retry_s is None else connect_retry_s
        try:
            async for attempt in AsyncRetrying(
                    stop=stop_after_delay(budget), reraise=True,
                    wait=wait_random_exponential(RETRY_WAIT_INITIAL_S, RETRY_WAIT_MAX_S),
                    before_sleep=before_sleep_log(log, logging.WARNING)):
                with attempt:
                    nc = await nats.connect(
                        servers=[url], name=name, connect_timeout=connect_timeout,
                        allow_reconnect=reconnect, max_reconnect_attempts=-1 if reconnect else 0,
                        reconnect_time_wait=RECONNECT_WAIT_S, error_cb=_err, disconnected_cb=_down,
                        reconnected_cb=_up)
        except Exception as exc:  # nats raises several unrelated types here
            raise TransportError(f"cannot connect to NATS at {redact_url(url)}: {exc}", url=redact_url(url)) from exc
        bus = cls(nc, name, role)
        return bus

    def _reconnect_done(self, task: asyncio.Task[None]) -> None:
        self._reconnect_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("nats %s: reconnect hook failed: %s", self.name, task.exception())

    @property
    def connected(self) -> bool:
        return self._nc.is_connected

    @property
    def client(self) -> NatsClient:
        return self._nc

    async def publish(self, subject: str, msg: Wire, reply: str = "") -> None:
        """Core NATS publish (queued while reconnecting).

        Raises:
            TransportError: nats refused it (its reconnect buffer full, the connection closed).
        """
        await self._publish(subject, msg.encode(), reply)

    async def publish_raw(self, subject: str, data: bytes) -> None:
        await self._publish(subject, data)

    async def _publish(self, subject: str, data: bytes, reply: str = "") -> None:
        try:
            await self._nc.publish(subject, data, reply=reply)
        except nats.errors.Error as exc:
            # (nats's own types passed through: callers handling TransportError missed them)
            raise TransportError(f"{subject} not published: {type(exc).__name__}: {exc}", subject=subject) from exc

    async def subscribe(self, subject: str, model: type[M], handler: Handler[M],
                        queue: str | None = None) -> Any:
        """Subscribe; each message is decoded into ``model`` before ``handler`` sees it. An
        ``Event`` is also checked against its subject (``decode_event``: its job and kind, and the
        role that owns the kind), as the log's readers check it: a member must not end another
        job, or write a kind its role does not own, by what it publishes."""

        async def _cb(raw: Msg) -> None:
            if not raw.data and (raw.headers or {}).get(Header.STATUS) == NO_RESPONDERS_STATUS:
                # The server's "no responders" to a publish with a reply inbox (a hello sent while
                # nobody listened on its subject, as across a server restart): no message.
                return
            try:
                msg = (decode_event(raw.data, raw.subject) if model is Event  # type: ignore[assignment]
                       else decode(model, raw.data, raw.subject))
            except MessageError as exc:
                self.dropped += 1
                log.warning("%s dropped a message: %s", self.name, exc)
                return
            try:
                await handler(msg, raw.subject, raw.reply or None)
            except Exception:  # a bad message must not kill the subscription
                self.handler_errors += 1
                log.exception("%s: handler for %s failed", self.name, raw.subject)

        return await self._nc.subscribe(subject, queue=queue or "", cb=_cb)

    async def request(self, subject: str, msg: Wire, reply_model: type[M],
                      timeout: float = REQUEST_TIMEOUT_S) -> M:
        """Request/reply; raise RequestTimeout saying how long it waited."""
        try:
            raw = await self._nc.request(subject, msg.encode(), timeout=timeout)
        except (TimeoutError, NatsTimeout, NoRespondersError) as exc:
            raise RequestTimeout(f"no reply on {subject} within {timeout:.1f}s", subject=subject) from exc
        except nats.errors.Error as exc:
            raise TransportError(f"{subject}: request not sent: {type(exc).__name__}: {exc}", subject=subject) from exc
        return decode(reply_model, raw.data, subject)

    async def respond(self, reply: str | None, msg: Wire) -> None:
        if reply:
            await self._publish(reply, msg.encode())

    # --- event log (JetStream) -------------------------------------------------------------

    async def ensure_event_stream(self) -> None:
        """Create the event-log stream if missing (idempotent), with direct reads allowed (a
        trainer's ``stored_msg_ids``) and an ``EVENT_DUPLICATE_WINDOW_S`` duplicate window. A
        stream made before without them gets them from a bus that may update streams (the
        controller's): one that may not leaves it as it is. A duplicate window other than
        JetStream's default (2 min) was set on purpose (an operator's, a test's) and is kept."""
        try:
            info = await self._js.stream_info(subjects.EVENTS_STREAM)
        except Exception:
            await self._js.add_stream(StreamConfig(name=subjects.EVENTS_STREAM, subjects=[subjects.EVENTS_ALL],
                                                   max_age=EVENT_MAX_AGE_S, allow_direct=True,
                                                   duplicate_window=EVENT_DUPLICATE_WINDOW_S))
            return
        config = info.config
        default_window = (config.duplicate_window or 0) in (0, JETSTREAM_DEFAULT_DUPLICATE_WINDOW_S)
        if self.role not in (None, "controller"):
            return
        # One change at a time: a server that refuses one (direct reads) still takes the other.
        for field, wanted, needed in (("duplicate_window", EVENT_DUPLICATE_WINDOW_S, default_window),
                                      ("allow_direct", True, not config.allow_direct)):
            if not needed:
                continue
            had = getattr(config, field)
            setattr(config, field, wanted)
            try:
                config = (await self._js.update_stream(config)).config
            except Exception as exc:  # as before then (a trainer appends its outbox as it did)
                log.warning("event stream: %s not updated: %s", field, exc)
                setattr(config, field, had)  # (the next change made to the stream as it is)

    async def stored_msg_ids(self, subject: str, since: float, timeout: float = EVENT_READ_TIMEOUT_S) -> set[str]:
        """The message ids (``Nats-Msg-Id``) of the events the log holds on ``subject`` stored from
        ``since`` (wall time) on, read with JetStream's direct get (one message per request, the
        next on the subject each time; read-only: the permission a member needs names no
        consumer it could change). Each request bounded by ``timeout``.

        Raises:
            TransportError: JetStream refused or did not answer (direct reads not enabled on the
                stream, this NATS user not allowed them, the server away).
        """
        server = self._nc.connected_server_version
        version = (server.major, server.minor)
        if version < DIRECT_GET_START_TIME:
            # An older server ignores ``start_time``: the read would walk the subject's whole
            # history (a superset, but slow on a long job); the caller falls back instead.
            raise TransportError(f"events on {subject} not read: nats-server {version[0]}.{version[1]} "
                                 "ignores a direct get's start_time (2.11 or later needed)", subject=subject)
        start = datetime.datetime.fromtimestamp(since, tz=datetime.UTC).isoformat()
        request: dict[str, Any] = {"start_time": start, "next_by_subj": subject}
        ids: set[str] = set()
        while True:
            try:
                reply = await self._nc.request(subjects.JS_DIRECT_GET, json.dumps(request).encode(), timeout=timeout)
            except Exception as exc:  # nats raises several unrelated types (timeout, no responders)
                raise TransportError(f"events on {subject} not read: {exc!r}", subject=subject) from exc
            headers = reply.headers or {}
            status = headers.get("Status")
            if status == "404":
                return ids
            if status is not None or "Nats-Sequence" not in headers:
                raise TransportError(f"events on {subject} not read: {status} {headers}"[:300], subject=subject)
            ids.add(headers.get(MSG_ID_HEADER, ""))
            request = {"seq": int(headers["Nats-Sequence"]) + 1, "next_by_subj": subject}

    async def purge_events(self, job_id: str, timeout: float = EVENT_READ_TIMEOUT_S) -> int:
        """Delete a job's event log (every event of ``job_id`` in the stream); return how many
        were deleted. Idempotent: a log already purged gives 0.

        Raises:
            TransportError: JetStream did not answer, or refused.
        """
        request = json.dumps({"filter": subjects.events_of(job_id)}).encode()
        try:
            reply = await self._nc.request(subjects.JS_EVENTS_PURGE, request, timeout=timeout)
            answer = json.loads(reply.data)
        except Exception as exc:
            raise TransportError(f"event log of {job_id} not purged: {exc}") from exc
        if not isinstance(answer, dict) or not answer.get("success"):
            raise TransportError(f"event log of {job_id} not purged: {answer!r}"[:500])
        return int(answer.get("purged", 0))

    async def publish_durable(self, subject: str, data: bytes, *, msg_id: str | None = None,
                              retry_s: float = EVENT_PUBLISH_RETRY_S) -> None:
        """Publish to a JetStream stream and wait for its ack, retrying with backoff and jitter
        for up to ``retry_s`` (a server restart or a reconnect in progress). The message id makes
        the retries idempotent: JetStream stores it once.

        A close of this bus waits for it (``DURABLE_DRAIN_S``); once the close gave up on it,
        its retries end.

        Raises:
            TransportError: not acknowledged within ``retry_s``, or the bus was closed meanwhile.
        """
        if self._shut:
            raise TransportError(f"{subject} not stored: the bus {self.name} is closed", subject=subject)
        headers = {MSG_ID_HEADER: msg_id or uuid.uuid4().hex}
        token = next(self._durable_ids)
        self._durable[token] = subject
        self._durable_idle.clear()
        try:
            async for attempt in AsyncRetrying(
                    stop=stop_any(stop_after_delay(retry_s), lambda _state: self._shut), reraise=True,
                    wait=wait_random_exponential(RETRY_WAIT_INITIAL_S, RETRY_WAIT_MAX_S),
                    retry=retry_if_exception_type(Exception)):
                with attempt:
                    await self._js.publish(subject, data, timeout=REQUEST_TIMEOUT_S, headers=headers)
        except Exception as exc:
            why = f"the bus {self.name} closed" if self._shut else f"within {retry_s:.0f}s"
            raise TransportError(f"{subject} not stored by JetStream ({why}): {exc}", subject=subject) from exc
        finally:
            del self._durable[token]
            if not self._durable:
                self._durable_idle.set()

    async def emit_event(self, job_id: str, kind: str, data: dict[str, Any] | None = None,
                         ts: float | None = None, *, required: bool = False,
                         retry_s: float = EVENT_PUBLISH_RETRY_S, msg_id: str | None = None,
                         settled: Callable[[], Awaitable[None]] | None = None) -> Event:
        """Append one event to the job's log (acknowledged by JetStream, retried through an outage).

        An event JetStream did not store within ``retry_s`` is not dropped: it is kept, under the
        same message id (a late ack of an earlier attempt stores it once), and retried in the
        background in order (``owed``). While events are owed, what is emitted next queues
        behind them and this returns at once: the caller does not wait on the outage again and
        the log keeps this bus's order. The queue is in memory (bounded, ``EventQueue``): a
        process killed during the outage loses it; ``close`` gives it its drain bound.

        ``msg_id``: the event's message id when the caller saved it elsewhere first (an outbox
        whose later append must be stored once with this one); ``settled`` is awaited once
        JetStream stored it (inline or from the owed queue; it must not raise).

        Raises:
            TransportError: with ``required`` only (an event that must be in the log before what
                follows it is done), when it was not stored within ``retry_s`` (behind any owed
                events); it is then not kept.
        """
        event = Event(job_id=job_id, kind=kind, data=data or {}, **({"ts": ts} if ts is not None else {}))
        # events() refuses a kind this bus's role does not own (SubjectError, raised).
        subj = subjects.events(job_id, kind, self.role)
        msg_id = msg_id or event_msg_id(job_id, kind)
        if self.owed and not required:
            self._owe(msg_id, event, settled)
            return event
        loop = asyncio.get_running_loop()
        deadline = loop.time() + retry_s
        if self.owed and not await self._backlog.drain(retry_s):  # required: after what is owed
            raise TransportError(f"{subj} not stored: {self.owed} earlier events of {self.name} still owed "
                                 f"after {retry_s:.0f}s", subject=subj)
        try:
            await self.publish_durable(subj, event.encode(), msg_id=msg_id,
                                       retry_s=max(0.0, deadline - loop.time()))
        except TransportError as exc:
            if required:
                raise
            if self._shut:
                log.warning("%s: event %s for %s not stored (the bus is closed): %s", self.name, kind, job_id, exc)
                return event
            # The service that emits must not wait on JetStream past its budget, nor lose the event.
            log.warning("%s: event %s for %s not stored within %.0f s: kept, retried in the background "
                        "(%d owed): %s", self.name, kind, job_id, retry_s, self.owed + 1, exc)
            self._owe(msg_id, event, settled)
            return event
        if settled is not None:
            await settled()
        return event

    @property
    def owed(self) -> int:
        """Events kept after their retry budget ran out, not stored yet."""
        return self._backlog.pending if self._backlog is not None else 0

    def _owe(self, msg_id: str, event: Event, settled: Callable[[], Awaitable[None]] | None = None) -> None:
        if self._backlog is None:
            from robustrl.event_queue import EventQueue  # (it imports this module)

            self._backlog = EventQueue(self, name=f"{self.name}-owed-events")
        self._backlog.put(msg_id, event, settled)

    async def read_events(self, job_id: str, timeout: float = EVENT_READ_TIMEOUT_S) -> EventLog:
        """Every event of a job, in log order. An envelope that cannot be parsed, or whose subject
        names a role that does not own its kind, is skipped and counted in ``EventLog.skipped``."""
        try:
            info = await self._js.stream_info(subjects.EVENTS_STREAM)
        except Exception as exc:
            raise TransportError(f"event stream unavailable: {exc}") from exc
        if info.state.messages == 0:
            return EventLog()
        # No acks: a read-only pass over the log (garbage in the log must not cost one ack each).
        # Its idle bound set (JetStream's default for an ephemeral consumer is 5 s): a reader
        # whose loop stalls that long between two fetches found its consumer deleted, and every
        # later fetch refused (503, seen under load in a full test run).
        sub = await self._js.pull_subscribe(subjects.events_of(job_id), durable=None,
                                            stream=subjects.EVENTS_STREAM,
                                            config=ConsumerConfig(ack_policy=AckPolicy.NONE,
                                                                  inactive_threshold=EVENT_READER_IDLE_S))
        events = EventLog()
        unavailable = stalls = 0
        pending: int | None = None  # what JetStream counts pending: the last message's word, or asked after an empty fetch
        try:
            # To the end of the log, however long: each message says how many are still pending
            # after it. ``timeout`` bounds one fetch. A fetch that gets nothing ends the read only
            # when nothing is pending: on a loaded host one can come back empty mid-log, and the
            # read returned a prefix of the log as the whole of it (a takeover's catch-up missed
            # commits, a report and an ETTR were computed short; an outside review).
            while True:
                try:
                    batch = await sub.fetch(512, timeout=min(timeout, EVENT_FETCH_TIMEOUT_S))
                except (TimeoutError, NatsTimeout):
                    # What JetStream counts pending now (the last message's count may be stale:
                    # a log purged meanwhile has nothing more to give)
                    try:
                        pending = (await sub.consumer_info()).num_pending
                    except Exception as exc:
                        raise TransportError(f"event log of {job_id}: its reader's state unavailable: "
                                             f"{exc}") from exc
                    if not pending:
                        break
                    stalls += 1
                    if stalls > EVENT_FETCH_STALLS:
                        raise TransportError(f"event log of {job_id}: {pending} events still pending after "
                                             f"{stalls} fetches got none (read {len(events)})") from None
                    continue
                except JsAPIError as exc:  # JetStream busy (503 on a loaded host): retry, bounded
                    unavailable += 1
                    if unavailable > EVENT_FETCH_RETRIES:
                        raise TransportError(f"event log of {job_id} unavailable: {exc}") from exc
                    await asyncio.sleep(EVENT_FETCH_RETRY_WAIT_S * unavailable)
                    continue
                for raw in batch:
                    try:
                        events.append(decode_event(raw.data, raw.subject))
                    except MessageError as exc:
                        events.skipped += 1
                        log.warning("skipping bad event: %s", exc)
                if batch:
                    pending, stalls = batch[-1].metadata.num_pending, 0
                if not batch or pending == 0:
                    break
        finally:
            await sub.unsubscribe()
        return events

    async def close(self, drain_s: float = DURABLE_DRAIN_S) -> None:
        """Wait up to ``drain_s`` for durable publishes still in their retries (new ones given
        meanwhile too), then drain and close; safe to call twice. What is still not stored then
        is named in an error: the event is lost."""
        if self._closed:
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        deadline = t0 + drain_s
        try:
            # Until nothing is in flight or owed: a publish that ends as the next one begins (an
            # owed queue, a member emitting two events in a row) sets and clears the idle event
            # within one loop step, so one wait for it is not enough.
            while (self._durable or self.owed) and loop.time() < deadline:
                if self.owed:  # events kept past their budget: their queue's own drain, in order
                    if not await self._backlog.drain(deadline - loop.time()):
                        break
                elif not await wait_event(self._durable_idle, deadline - loop.time()):
                    break
            if self._durable or self.owed:
                lost = sorted(set(self._durable.values()))
                log.error("nats %s: %d durable publish(es) and %d owed event(s) not stored by JetStream %.1f s "
                          "into the close, given up (lost): %s", self.name, len(self._durable), self.owed,
                          loop.time() - t0, ", ".join(lost[:10]) + (" ..." if len(lost) > 10 else ""))
        finally:  # a close cancelled while it waits still ends the connection
            self._shut = True
            if self._backlog is not None:
                await self._backlog.close(grace_s=0.0)
            try:
                await within(self._nc.drain(), DRAIN_TIMEOUT_S)
            except Exception:
                try:  # bounded too: its last flush writes to a socket the server may not read
                    await within(self._nc.close(), DRAIN_TIMEOUT_S)
                except Exception as exc:
                    log.warning("nats %s: close did not finish: %s", self.name, exc)


def event_msg_id(job_id: str, kind: str) -> str:
    """A new event's JetStream message id (its retries, and a later life's append of it from an
    outbox, keep it: stored once within the duplicate window)."""
    return f"{job_id}-{kind}-{uuid.uuid4().hex}"


def redact_url(url: str) -> str:
    """Hide credentials in a URL before it goes to a log or an error message."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.split('@', 1)[1]}"

