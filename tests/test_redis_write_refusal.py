"""A Redis that refuses writes for a while costs a pause, not a trainer gang.

A Redis whose writes are refused for a few seconds (``NOREPLICAS`` with ``min-replicas-to-write``
and no replica; ``READONLY`` after a failover, ``MISCONF`` after a failed snapshot) answers every
write with an error reply, and the client retried only connection errors: the trainer gang's
per-step batch claim raised and the rank exited, a whole trainer recovery for a few seconds of
refusal (an outside review). Against a Redis server of this module's own (its config is changed).
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator

import pytest
import redis as redis_sync
from redis import exceptions as rexc
from support import eventually

from robustrl.infra.binaries import free_port, redis_server
from robustrl.storage.fencing import GangFence
from robustrl.errors import Superseded, TransportError
from robustrl.storage.redis_stores import Guard, connect, transact

pytestmark = pytest.mark.timeout(120)

REFUSED_S = 1.5


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([str(redis_server().path), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path_factory.mktemp("refusing-redis"))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        r = redis_sync.Redis(port=port)
        eventually(lambda: r.ping(), timeout=20, retry_on=(rexc.ConnectionError, AssertionError), what="redis up")
        r.close()
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(autouse=True)
def _accepting(url: str) -> None:
    """Each test begins with writes accepted (one that failed early may have left them refused)."""
    r = redis_sync.Redis.from_url(url)
    r.config_set("min-replicas-to-write", 0)
    r.close()


async def _refusing_for(url: str, seconds: float) -> None:
    """Refuse writes now, and accept them again ``seconds`` later (a client of its own)."""
    admin = connect(url)
    await admin.config_set("min-replicas-to-write", 1)
    with pytest.raises(rexc.ResponseError, match="NOREPLICAS"):  # (refused indeed: set straight, unretried)
        await redis_sync.Redis.from_url(url).set("probe", 1)  # type: ignore[func-returns-value]

    async def later() -> None:
        await asyncio.sleep(seconds)  # (the refusal's length: a window held, not a wait for anything)
        await admin.config_set("min-replicas-to-write", 0)
        await admin.aclose()

    asyncio.get_running_loop().create_task(later())


async def test_a_write_refused_for_a_while_is_carried_out_once_writes_are_accepted(url: str) -> None:
    r = connect(url)
    try:
        await _refusing_for(url, REFUSED_S)
        began = time.monotonic()
        await r.set("key", "value")
        assert time.monotonic() - began >= REFUSED_S * 0.8
        assert await r.get("key") == b"value"
    finally:
        await r.aclose()


async def test_the_gangs_batch_claim_waits_out_a_refusal_instead_of_failing_the_rank(url: str) -> None:
    """The trainer's per-step claim is a fenced script (``GangFence``): retried whole, it claims
    the batch once (the scripts are idempotent for one epoch)."""
    r = connect(url)
    try:
        gang = GangFence(r, "refusal-job", 1)
        await gang.enter()
        await _refusing_for(url, REFUSED_S)
        assert await gang.claim(0, durable_step=-1) == "new"
        assert await gang.claim(0, durable_step=-1) == "new"  # (idempotent: the same gang's claim)
    finally:
        await r.aclose()


async def test_an_error_reply_that_is_no_refusal_is_raised_at_once(url: str) -> None:
    r = connect(url)
    try:
        await r.set("text", "not a number")
        began = time.monotonic()
        with pytest.raises(rexc.ResponseError, match="not an integer"):
            await r.incr("text")
        assert time.monotonic() - began < 1.0
    finally:
        await r.aclose()


async def test_a_guarded_transaction_waits_out_a_refusal_and_is_refused_at_once_when_the_guard_moved(url: str) -> None:
    """The request manager's step writes are guarded transactions (``transact``: WATCH on the
    step-restart count), which the client's retry layer does not retry: while a key is watched
    it turns a refusal into a ``WatchError``. Raised as such, the write failed within 0.01 s of a
    refusal (an outside review) where an unguarded write waits it out; now it waits it out too.
    A guard that moved is refused at once, and an error reply that is no refusal is raised."""
    r = connect(url)
    try:
        guard = Guard("refusal-guard", await r.get("refusal-guard"))
        await _refusing_for(url, REFUSED_S)
        began = time.monotonic()
        await transact(r, lambda pipe: pipe.set("guarded", "value"), "guarded", guard)
        assert time.monotonic() - began >= REFUSED_S * 0.8
        assert await r.get("guarded") == b"value"
        await r.incr("refusal-guard")
        with pytest.raises(Superseded):
            await transact(r, lambda pipe: pipe.set("guarded", "later"), "guarded", guard)
        assert await r.get("guarded") == b"value"
        await r.set("text", "not a number")
        began = time.monotonic()
        moved = Guard("refusal-guard", await r.get("refusal-guard"))
        with pytest.raises(TransportError, match="not an integer"):
            await transact(r, lambda pipe: pipe.incr("text"), "text", moved)
        assert time.monotonic() - began < 1.0
    finally:
        await r.aclose()
