"""The per-service health endpoint (robustrl.health) over a real loopback socket."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from robustrl.health import ENV_LOOP_STALL_EXIT_S, EXIT_LOOP_STALLED, HealthServer, serve_health, watch_loop

pytestmark = pytest.mark.timeout(30)


async def _get(port: int, path: str = "/healthz", method: str = "GET") -> httpx.Response:
    async with httpx.AsyncClient(timeout=5) as client:
        return await client.request(method, f"http://127.0.0.1:{port}{path}")


async def test_healthy_then_unhealthy_names_the_failing_check() -> None:
    connected = {"nats": True}

    async def redis_ping() -> bool:
        return True

    server = HealthServer("request_manager", {"nats": lambda: connected["nats"], "redis": redis_ping})
    port = await server.start()
    try:
        ok = await _get(port)
        assert ok.status_code == 200
        assert ok.json() == {"service": "request_manager", "status": "ok",
                             "checks": {"nats": True, "redis": True}}
        connected["nats"] = False
        bad = await _get(port)
        assert bad.status_code == 503 and bad.json()["checks"] == {"nats": False, "redis": True}
    finally:
        await server.close()


async def test_a_raising_or_hanging_check_is_reported_not_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("robustrl.health.CHECK_TIMEOUT_S", 0.2)

    def boom() -> bool:
        raise RuntimeError("redis down")

    async def hang() -> bool:
        await asyncio.Event().wait()
        return True

    server = HealthServer("svc", {"boom": boom, "hang": hang})
    port = await server.start()
    try:
        resp = await _get(port)
        assert resp.status_code == 503
        checks = resp.json()["checks"]
        assert "RuntimeError: redis down" in checks["boom"] and "TimeoutError" in checks["hang"]
        # The server keeps answering after failing checks.
        assert (await _get(port)).status_code == 503
    finally:
        await server.close()


async def test_bad_requests_get_clear_errors_and_the_server_keeps_running() -> None:
    server = HealthServer("svc", {"ok": lambda: True})
    port = await server.start()
    try:
        missing = await _get(port, "/metrics")
        assert missing.status_code == 404 and "/healthz" in missing.json()["error"]
        assert (await _get(port, method="POST")).status_code == 405
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"garbage without a blank line\r\n\r\n")
        await writer.drain()
        assert (await reader.read()).startswith(b"HTTP/1.1 400")
        writer.close()
        assert (await _get(port)).status_code == 200
    finally:
        await server.close()


async def test_serve_health_is_off_without_the_port_and_rejects_a_bad_one() -> None:
    assert await serve_health("svc", {}, {}) is None
    with pytest.raises(ValueError, match="ROBUSTRL_HEALTH_PORT.*'http'"):
        await serve_health("svc", {}, {"ROBUSTRL_HEALTH_PORT": "http"})
    server = await serve_health("svc", {"ok": lambda: True}, {"ROBUSTRL_HEALTH_PORT": "0"})
    assert server is not None and server.port
    try:
        assert (await _get(server.port)).status_code == 200
    finally:
        await server.close()


async def test_a_port_already_taken_leaves_the_service_running_without_the_endpoint() -> None:
    first = await serve_health("svc", {"ok": lambda: True}, {"ROBUSTRL_HEALTH_PORT": "0"})
    assert first is not None and first.port
    try:
        assert await serve_health("svc2", {}, {"ROBUSTRL_HEALTH_PORT": str(first.port)}) is None
        assert (await _get(first.port)).status_code == 200
    finally:
        await first.close()


_WATCHED = """
import asyncio, os, sys, time
from robustrl.health import watch_loop

async def main():
    watch_loop("probe", os.environ)
    print("ready", flush=True)
    if sys.argv[1] == "block":
        time.sleep(60)  # the loop blocked: nothing else runs
    await asyncio.sleep(float(sys.argv[2]))

asyncio.run(main())
"""


def _watched(mode: str, run_s: float, stall_s: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _WATCHED, mode, str(run_s)], text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, ENV_LOOP_STALL_EXIT_S: stall_s})
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.timeout(90)
def test_a_service_whose_loop_is_blocked_exits_to_be_restarted_and_a_frozen_one_does_not() -> None:
    """A real process: its loop blocked (a synchronous call that never returns), it exits with
    ``EXIT_LOOP_STALLED`` once the bound has passed, saying why (under compose a container whose
    health check fails is not restarted; one that exits is). The same process frozen whole
    (SIGSTOP, longer than the bound) and thawed is not taken for a stalled loop, nor is a healthy
    loop that runs past the bound; 0 turns the watchdog off."""
    t0 = time.monotonic()
    blocked = _watched("block", 30, "1.5")
    assert blocked.wait(timeout=20) == EXIT_LOOP_STALLED
    took = time.monotonic() - t0
    assert 1.5 <= took < 10, took
    assert "the event loop has not run" in (blocked.stderr.read() if blocked.stderr else "")

    frozen = _watched("sleep", 8, "1.5")
    try:
        os.kill(frozen.pid, signal.SIGSTOP)
        time.sleep(4)  # the freeze itself is the fault under test: longer than the bound
        os.kill(frozen.pid, signal.SIGCONT)
        assert frozen.wait(timeout=30) == 0  # thawed, it ran on to its end
    finally:
        if frozen.poll() is None:
            frozen.kill()

    off = _watched("block", 0, "0")
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            off.wait(timeout=4)  # blocked, with no watchdog: still there
    finally:
        off.kill()
        off.wait()
    with pytest.raises(ValueError, match=ENV_LOOP_STALL_EXIT_S):
        asyncio.run(_bad_setting())


async def _bad_setting() -> None:
    watch_loop("probe", {ENV_LOOP_STALL_EXIT_S: "soon"})
