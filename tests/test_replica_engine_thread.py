"""The replica's engine thread against an engine that fails (pure logic: the real
``Replica._worker`` / ``_serve`` / ``_run_alone`` / ``_run_batch``; the engine is a stand-in that
raises on chosen turns, and the bus a list). Before, any error of the engine ended the engine
thread alone: the replica answered every probe and served nothing more, and the turns batched
with the bad one were lost (an outside review)."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import types
from typing import Any

import pytest

from robustrl.member import ChaosState
from robustrl.messages import GenerateTurn, TurnResult
from robustrl.model.engine import GenerationAborted, GenRequest, GenResult
from robustrl.services.rollout import replica as replica_module
from robustrl.services.rollout.replica import Replica
from support import eventually_async

pytestmark = pytest.mark.timeout(60)


class Engine:
    """Fails any batch holding a turn whose id starts with ``poison``; ``abort``: the hand-off's."""

    name = "stand-in"
    max_batch = 8

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.abort = False
        self.tokens_generated = 0

    def generate(self, requests: list[GenRequest], on_token: Any = None, should_abort: Any = None) -> list[GenResult]:
        self.batches.append([r.request_id for r in requests])
        self.tokens_generated += 1
        if on_token is not None:
            on_token(1)
        if self.abort and should_abort is not None and should_abort():
            raise GenerationAborted("generation aborted by request", step=0)
        if any(r.request_id.startswith("poison") for r in requests):
            raise IndexError("index out of range in self (an embedding lookup)")
        return [GenResult(r.request_id, [1, 2], [-0.5, -0.5], "eot") for r in requests]


def replica(loop: asyncio.AbstractEventLoop) -> Any:
    r: Any = Replica.__new__(Replica)
    r.published = []

    async def publish(_subject: str, msg: Any) -> None:
        r.published.append(msg)

    async def nothing() -> None:
        return None

    r.member = types.SimpleNamespace(stopping=threading.Event(), chaos=ChaosState(), inflight=0, tokens_total=0,
                                     activity=0, bus=types.SimpleNamespace(publish=publish))
    r.ident = types.SimpleNamespace(member_id="rollout-0-i0", job_id="j")
    r.standby = types.SimpleNamespace(handoff=None)
    r.engine, r.requests, r.loop = Engine(), queue.Queue(), loop
    r.version, r.checksum, r._working, r._awaiting, r._crash_at_token = 1, "c1", False, False, False
    r._swap_lock, r._pending, r._swapping = threading.Lock(), None, None
    r._refresh_phase = nothing
    return r


def turn(request_id: str) -> GenerateTurn:
    return GenerateTurn(job_id="j", request_id=request_id, episode_id=f"e-{request_id}", step=1, prefix_ids=[1, 2],
                        max_new_tokens=4, temperature=1.0, top_p=1.0, seed=1, min_version=1)


def served(r: Any) -> set[str]:
    return {m.request_id for m in r.published if isinstance(m, TurnResult) and not m.refused}


def refused(r: Any) -> dict[str, TurnResult]:
    return {m.request_id: m for m in r.published if isinstance(m, TurnResult) and m.refused}


async def test_a_turn_the_engine_fails_on_is_refused_and_the_rest_of_its_batch_is_served(
        monkeypatch: pytest.MonkeyPatch) -> None:
    exits: list[int] = []
    monkeypatch.setattr(replica_module, "_exit_now", exits.append, raising=False)
    r = replica(asyncio.get_running_loop())
    for rid in ("a", "poison-1", "b", "poison-2", "c"):
        r.requests.put(turn(rid))  # queued before the thread starts: one batch
    thread = threading.Thread(target=r._worker, daemon=True)
    thread.start()
    try:
        await eventually_async(lambda: served(r) == {"a", "b", "c"}, timeout=10, what="the good turns served")
        assert r.engine.batches[0] == ["a", "poison-1", "b", "poison-2", "c"]  # the batch, then each alone
        assert r.engine.batches[1:] == [["a"], ["poison-1"], ["b"], ["poison-2"], ["c"]]
        # the request manager is told of each refused turn, and why (it sends them elsewhere at once)
        no = await eventually_async(lambda: len(refused(r)) == 2 and refused(r), timeout=10, what="the refusals sent")
        assert set(no) == {"poison-1", "poison-2"}, no
        assert all(m.refused == "engine" and "IndexError" in m.error and not m.token_ids for m in no.values()), no
        r.requests.put(turn("later"))
        await eventually_async(lambda: "later" in served(r), timeout=10, what="a later turn served")
        assert thread.is_alive() and exits == [] and r.member.inflight == 0
    finally:
        r.member.stopping.set()
        thread.join(5)


async def test_a_hand_off_abort_ends_the_engine_thread_and_never_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Borrowed: the hand-off sets ``handoff`` before the replica's stop is set, and the engine's
    abort lands in between. The thread must end quietly (the process becomes a trainer rank);
    a bug outside any decode does end the process, named."""
    exits: list[int] = []
    monkeypatch.setattr(replica_module, "_exit_now", exits.append, raising=False)
    r = replica(asyncio.get_running_loop())
    r.engine.abort, r.standby.handoff = True, object()
    r.requests.put(turn("a"))
    thread = threading.Thread(target=r._worker, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and exits == [] and not r.member.stopping.is_set()

    broken = replica(asyncio.get_running_loop())
    broken.requests = None  # a bug in the thread's own code (no turn to blame)
    thread = threading.Thread(target=broken._worker, daemon=True)
    thread.start()
    thread.join(10)
    assert exits == [1]


@pytest.mark.parametrize(("moment", "crashes"), [("mid_batch", True), ("mid_tool_turn", False)])
async def test_an_armed_crash_strikes_at_the_first_token_of_the_batch_it_is_armed_for(
        monkeypatch: pytest.MonkeyPatch, moment: str, crashes: bool) -> None:
    """A crash armed ``mid_batch`` (the harness's decoding-timed crashes) strikes at the first
    token of the next batch, first turns included, so a batch is in flight by construction (a
    kill sent from outside landed after the batch had ended, under load: suite51); one armed
    ``mid_tool_turn`` waits for a turn that follows a tool result (none here)."""
    r = replica(asyncio.get_running_loop())
    struck: list[str] = []
    emitted: list[tuple[str, dict]] = []

    async def emit(kind: str, data: dict) -> None:
        emitted.append((kind, dict(data)))

    r._emit = emit
    # The strike is said (``fault_struck``, saved before the kill) and then carried out.
    monkeypatch.setattr(r.member.chaos, "crash",
                        lambda: struck.extend([*sorted(r.engine.batches[-1]), *(k for k, _ in emitted)]))
    r.member.chaos.crash_moment, r.member.chaos.crash_armed_until = moment, time.monotonic() + 60
    r.member.chaos.crash_fault_id = "c1"
    r.requests.put(turn("a"))  # a first turn (turn 0)
    thread = threading.Thread(target=r._worker, daemon=True)
    thread.start()
    try:
        await eventually_async(lambda: "a" in served(r), timeout=10, what="the batch decoded")
        assert struck == (["a", "fault_struck"] if crashes else []), struck
        if crashes:
            assert emitted == [("fault_struck", {"fault_id": "c1", "member_id": "rollout-0-i0", "moment": moment})]
    finally:
        r.member.stopping.set()
        thread.join(5)


async def test_an_armed_crash_whose_strike_cannot_be_saved_strikes_within_its_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The event loop never gets the strike saved (Redis away past its bound, the loop busy): the
    engine thread gives up on it after ``STRIKE_SAVE_S`` and crashes anyway, at the same token."""
    monkeypatch.setattr(replica_module, "STRIKE_SAVE_S", 0.3)
    r = replica(asyncio.get_running_loop())
    never = asyncio.Event()

    async def emit(kind: str, data: dict) -> None:
        await never.wait()

    r._emit = emit
    crashed: list[float] = []
    monkeypatch.setattr(r.member.chaos, "crash", lambda: crashed.append(time.monotonic()))
    r.member.chaos.crash_moment, r.member.chaos.crash_armed_until = "mid_batch", time.monotonic() + 60
    r.requests.put(turn("a"))
    t0 = time.monotonic()
    thread = threading.Thread(target=r._worker, daemon=True)
    thread.start()
    try:
        await eventually_async(lambda: crashed, timeout=10, what="the crash carried out")
        assert 0.3 <= crashed[0] - t0 < 3.0, crashed[0] - t0
    finally:
        never.set()
        r.member.stopping.set()
        thread.join(5)
