"""A thin NATS wrapper: typed publish/subscribe, request with timeout, and the JetStream event log.

Raw bytes become typed messages at the edge: a subscription decodes with the model it was
registered for, and anything malformed is logged, counted in ``dropped`` and dropped; the
handler never sees it and the service keeps running. A handler that raises is logged too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import StreamConfig

from robustrl import subjects
from robustrl.errors import MessageError, RequestTimeout, TransportError
from robustrl.messages import Event, Wire, decode

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Wire)
Handler = Callable[[M, str, str | None], Awaitable[None]]

CONNECT_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 2.0
DRAIN_TIMEOUT_S = 2.0
EVENT_READ_TIMEOUT_S = 5.0


class Bus:
    """One NATS connection for one service or member."""

    def __init__(self, nc: NatsClient, name: str) -> None:
        self._nc = nc
        self.name = name
        self.dropped = 0
        self.handler_errors = 0
        self._js = nc.jetstream()
        self._closed = False

    @classmethod
    async def connect(cls, url: str, name: str, *, connect_timeout: float = CONNECT_TIMEOUT_S,
                      reconnect: bool = True) -> Bus:
        """Connect with automatic reconnect; raise TransportError naming the URL if unreachable."""

        async def _err(exc: Exception) -> None:
            log.debug("nats %s: %s", name, exc)

        try:
            nc = await nats.connect(
                servers=[url], name=name, connect_timeout=connect_timeout,
                allow_reconnect=reconnect, max_reconnect_attempts=-1 if reconnect else 0,
                reconnect_time_wait=0.2, error_cb=_err,
            )
        except Exception as exc:  # nats raises several unrelated types here
            raise TransportError(f"cannot connect to NATS at {_redact(url)}: {exc}", url=_redact(url)) from exc
        return cls(nc, name)

    @property
    def connected(self) -> bool:
        return self._nc.is_connected

    @property
    def client(self) -> NatsClient:
        return self._nc

    async def publish(self, subject: str, msg: Wire) -> None:
        await self._nc.publish(subject, msg.encode())

    async def publish_raw(self, subject: str, data: bytes) -> None:
        await self._nc.publish(subject, data)

    async def subscribe(self, subject: str, model: type[M], handler: Handler[M],
                        queue: str | None = None) -> Any:
        """Subscribe; each message is decoded into ``model`` before ``handler`` sees it."""

        async def _cb(raw: Msg) -> None:
            try:
                msg = decode(model, raw.data, raw.subject)
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
        except (NatsTimeout, asyncio.TimeoutError, NoRespondersError) as exc:
            raise RequestTimeout(f"no reply on {subject} within {timeout:.1f}s", subject=subject) from exc
        return decode(reply_model, raw.data, subject)

    async def respond(self, reply: str | None, msg: Wire) -> None:
        if reply:
            await self._nc.publish(reply, msg.encode())

    # --- event log (JetStream) -------------------------------------------------------------

    async def ensure_event_stream(self) -> None:
        """Create the event-log stream if missing (idempotent)."""
        try:
            await self._js.stream_info(subjects.EVENTS_STREAM)
        except Exception:
            await self._js.add_stream(StreamConfig(name=subjects.EVENTS_STREAM, subjects=[subjects.EVENTS_ALL],
                                                   max_age=7 * 24 * 3600.0))

    async def emit_event(self, job_id: str, kind: str, data: dict[str, Any] | None = None,
                         ts: float | None = None) -> Event:
        """Append one event to the job's log (acknowledged by JetStream)."""
        event = Event(job_id=job_id, kind=kind, data=data or {}, **({"ts": ts} if ts is not None else {}))
        try:
            await self._js.publish(subjects.events(job_id, kind), event.encode(), timeout=REQUEST_TIMEOUT_S)
        except Exception as exc:
            # The log is best effort for the service that emits: it must not die because
            # JetStream is briefly unavailable (e.g. during a reconnect).
            log.warning("%s: event %s for %s not stored: %s", self.name, kind, job_id, exc)
        return event

    async def read_events(self, job_id: str, timeout: float = EVENT_READ_TIMEOUT_S) -> list[Event]:
        """Every event of a job, in log order."""
        try:
            info = await self._js.stream_info(subjects.EVENTS_STREAM)
        except Exception as exc:
            raise TransportError(f"event stream unavailable: {exc}") from exc
        if info.state.messages == 0:
            return []
        sub = await self._js.pull_subscribe(subjects.events_of(job_id), durable=None,
                                            stream=subjects.EVENTS_STREAM)
        events: list[Event] = []
        try:
            deadline = asyncio.get_running_loop().time() + timeout
            while True:
                try:
                    batch = await sub.fetch(512, timeout=0.3)
                except (NatsTimeout, asyncio.TimeoutError):
                    break
                for raw in batch:
                    await raw.ack()
                    try:
                        events.append(decode(Event, raw.data, raw.subject))
                    except MessageError as exc:
                        log.warning("skipping bad event: %s", exc)
                if asyncio.get_running_loop().time() > deadline:
                    break
        finally:
            await sub.unsubscribe()
        return events

    async def close(self) -> None:
        """Drain and close; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            await asyncio.wait_for(self._nc.drain(), DRAIN_TIMEOUT_S)
        except Exception:
            await self._nc.close()


def _redact(url: str) -> str:
    """Hide credentials in a URL before it goes to a log or an error message."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.split('@', 1)[1]}"

