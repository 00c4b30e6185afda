"""Health endpoint of a RobustRL process: ``GET /healthz`` on a small HTTP listener.

Every service runs one when ``ROBUSTRL_HEALTH_PORT`` is set (compose sets it; a container's
health check then asks it from inside the container, so the default bind address is loopback).
The controller answers ``/healthz`` on its REST API instead. The answer is 200 with
``{"service": ..., "status": "ok", "checks": {...}}`` while every check passes and 503 with the
failing checks named otherwise; a check is a cheap function (``bus.connected``) or a coroutine
(a Redis ping) bounded by ``CHECK_TIMEOUT_S``. That the event loop answers at all is itself the
first check: a member whose loop is blocked times out in the container's health probe.

It is deliberately not FastAPI: members must stay light, and one route needs no framework.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from http import HTTPStatus

from robustrl.aio import within

log = logging.getLogger("robustrl.health")

ENV_PORT = "ROBUSTRL_HEALTH_PORT"
ENV_HOST = "ROBUSTRL_HEALTH_HOST"
DEFAULT_HOST = "127.0.0.1"
CHECK_TIMEOUT_S = 2.0
READ_TIMEOUT_S = 2.0
MAX_REQUEST_BYTES = 8192

Check = Callable[[], bool | Awaitable[bool]]


class HealthServer:
    """Answer ``GET /healthz`` from ``checks`` (name -> check)."""

    def __init__(self, service: str, checks: Mapping[str, Check]) -> None:
        self.service = service
        self.checks = dict(checks)
        self._server: asyncio.Server | None = None
        self.port: int | None = None

    async def start(self, host: str = DEFAULT_HOST, port: int = 0) -> int:
        """Listen on ``host:port`` (0 = any free port); returns the port."""
        self._server = await asyncio.start_server(self._handle, host, port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def report(self) -> tuple[bool, dict[str, object]]:
        """Run every check; (all passed, JSON body)."""
        results: dict[str, bool | str] = {}
        for name, check in self.checks.items():
            try:
                value = check()
                if inspect.isawaitable(value):
                    value = await within(value, CHECK_TIMEOUT_S)
                results[name] = bool(value)
            except Exception as exc:  # noqa: BLE001 - a failing check is an answer, not a crash
                results[name] = f"error: {type(exc).__name__}: {exc}"[:200]
        ok = all(v is True for v in results.values())
        return ok, {"service": self.service, "status": "ok" if ok else "unhealthy", "checks": results}

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await within(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            if len(head) > MAX_REQUEST_BYTES:
                raise ValueError("request head too long")
            method, target, version = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
            if not version.startswith("HTTP/") or not target.startswith("/"):
                raise ValueError("not an HTTP request line")
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            await self._reply(writer, HTTPStatus.BAD_REQUEST, {"error": "malformed HTTP request"})
            return
        path = target.split("?", 1)[0]
        if path != "/healthz":
            await self._reply(writer, HTTPStatus.NOT_FOUND, {"error": f"no route {path}; use /healthz"})
        elif method not in ("GET", "HEAD"):
            await self._reply(writer, HTTPStatus.METHOD_NOT_ALLOWED, {"error": "use GET /healthz"})
        else:
            ok, body = await self.report()
            await self._reply(writer, HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE, body,
                              head_only=method == "HEAD")

    @staticmethod
    async def _reply(writer: asyncio.StreamWriter, status: HTTPStatus, body: dict[str, object],
                     head_only: bool = False) -> None:
        data = json.dumps(body).encode()
        writer.write(f"HTTP/1.1 {status.value} {status.phrase}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode())
        if not head_only:
            writer.write(data)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None


ENV_LOOP_STALL_EXIT_S = "ROBUSTRL_LOOP_STALL_EXIT_S"
LOOP_STALL_EXIT_S = 60.0
"""Default: a control-plane service whose event loop has not run for this long exits."""
EXIT_LOOP_STALLED = 70
"""Exit status of a service that ``LoopWatchdog`` ended (EX_SOFTWARE)."""
WATCH_INTERVAL_S = 1.0


class LoopWatchdog:
    """Ends the process (``os._exit(EXIT_LOOP_STALLED)``) once its event loop has not run for
    ``stall_s``: a blocked loop answers nothing, and under compose a container whose health check
    fails is not restarted (``restart: unless-stopped`` restarts only one that exits); the
    service's supervisor (compose, or the local stack's) then starts it again (an outside review:
    a hung detector stayed hung, and no one else watches the trainer's I/O phases).

    A thread checks a tick the loop takes every ``WATCH_INTERVAL_S``. A process frozen whole
    (SIGSTOP, a paused container) freezes the thread too: a check that comes late after such a gap
    starts the count again, so a thaw is no stall (the local stack's supervisor judges those)."""

    def __init__(self, service: str, stall_s: float) -> None:
        self.service, self.stall_s = service, stall_s
        self._tick = time.monotonic()
        self._stop = threading.Event()
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()

        def tick() -> None:
            self._tick = time.monotonic()
            self._handle = loop.call_later(WATCH_INTERVAL_S, tick)

        tick()
        threading.Thread(target=self._watch, name=f"{self.service}-loop-watchdog", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        if self._handle is not None:
            self._handle.cancel()

    def _watch(self) -> None:
        checked = time.monotonic()
        while not self._stop.wait(WATCH_INTERVAL_S):
            now = time.monotonic()
            if now - checked > 3 * WATCH_INTERVAL_S:
                self._tick = max(self._tick, now)  # the whole process was frozen: not the loop's doing
            checked = now
            if now - self._tick > self.stall_s:
                log.critical("%s: the event loop has not run for %.0f s: exiting (status %d) to be restarted",
                             self.service, now - self._tick, EXIT_LOOP_STALLED)
                for h in logging.getLogger().handlers:
                    with contextlib.suppress(Exception):
                        h.flush()
                os._exit(EXIT_LOOP_STALLED)


def watch_loop(service: str, env: Mapping[str, str]) -> LoopWatchdog | None:
    """Start a ``LoopWatchdog`` for the running loop (``ROBUSTRL_LOOP_STALL_EXIT_S``, default
    ``LOOP_STALL_EXIT_S``; 0 turns it off).

    Raises:
        ValueError: the setting is not a non-negative number (named in the message).
    """
    raw = env.get(ENV_LOOP_STALL_EXIT_S, "").strip()
    try:
        stall_s = float(raw) if raw else LOOP_STALL_EXIT_S
        if not stall_s >= 0 or stall_s == float("inf"):
            raise ValueError
    except ValueError:
        raise ValueError(f"{ENV_LOOP_STALL_EXIT_S} must be a number of seconds >= 0, got {raw!r}") from None
    if stall_s == 0:
        return None
    dog = LoopWatchdog(service, stall_s)
    dog.start()
    return dog


async def serve_health(service: str, checks: Mapping[str, Check],
                       env: Mapping[str, str]) -> HealthServer | None:
    """Start a HealthServer when ``ROBUSTRL_HEALTH_PORT`` is set in ``env``; else None (also
    when the port is taken: logged, the service runs on without the endpoint).

    Raises:
        ValueError: the port is not an integer in 0..65535 (named in the message).
    """
    raw = env.get(ENV_PORT, "").strip()
    if not raw:
        return None
    try:
        port = int(raw)
        if not 0 <= port <= 65535:
            raise ValueError
    except ValueError:
        raise ValueError(f"{ENV_PORT} must be a port number 0..65535, got {raw!r}") from None
    host = env.get(ENV_HOST, DEFAULT_HOST) or DEFAULT_HOST
    server = HealthServer(service, checks)
    try:
        bound = await server.start(host, port)
    except OSError as exc:
        # e.g. several members on one host inheriting the same port: the member's work matters
        # more than its health endpoint, so it runs on without one
        log.warning("no health endpoint for %s: cannot listen on %s:%d (%s)", service, host, port, exc)
        return None
    log.info("health endpoint on %s:%d/healthz", host, bound)
    return server
