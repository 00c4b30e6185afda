"""A replica's weight loader across a trainer rollback, with real weight servers on loopback.

Gang 1 announced v7 and died before any relay completed it; the replica (serving v6) is still
pulling v7 when gang 2, resumed from checkpoint 6, announces v6 with the very checksum the
replica holds. Then a relay that did complete gang 1's v7 shows up. The replica must not
install gang 1's v7: those are weights the new lineage never had, and the turns it generated
would be tagged v7 under gang 2. Before the fix the announcement of weights already held
returned before it stopped the running pull, and v7 of the dead gang was installed (an outside
review found it). Checked from outside the loader: what its engine was asked to install and
the events it appended.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from robustrl.services.rollout.loader import WeightLoader
from support import eventually_async

from robustrl.config import WeightSyncSpec, reference_job
from robustrl.messages import WeightsAnnounce
from robustrl.model.policy import build_policy, weights_checksum
from robustrl.model.tokenizer import CharTokenizer
from robustrl.weights.flat import expected_layout, flatten_state_dict
from robustrl.weights.server import WeightServer

pytestmark = pytest.mark.timeout(60)
CHUNK = 4096


async def test_a_dead_gangs_version_is_never_installed_once_the_new_gang_announces_the_weights_held() -> None:
    model = build_policy(reference_job().model, CharTokenizer.default(), 7)
    buffer, v7 = flatten_state_dict(model.state_dict(), 7, CHUNK)
    held = (6, "checksum-of-checkpoint-6")
    installs: list[int] = []
    events: list[tuple[str, dict[str, Any]]] = []

    async def install(version: int, checksum: str, _state: dict[str, torch.Tensor], _t: float) -> str:
        installs.append(version)
        return checksum

    async def emit(kind: str, data: dict[str, Any]) -> None:
        events.append((kind, data))

    async def nothing() -> None:
        return None

    dead_trainer, relay_server, relay_of_v7, new_trainer = (WeightServer(host="127.0.0.1") for _ in range(4))
    loader = WeightLoader(WeightSyncSpec(chunk_bytes=CHUNK, pull_timeout_s=1.0, pull_attempts=1), "rollout-0-i1",
                          relay_server,
                          expected_layout(model), install=install, emit=emit, on_change=nothing, held=lambda: held)
    try:
        gone = await dead_trainer.start()  # listening, holding nothing: the gang died mid-version
        await relay_server.start()
        peer = await relay_of_v7.start()
        origin = await new_trainer.start()
        loader.offer(WeightsAnnounce(job_id="j", version=7, epoch=1, checksum=weights_checksum(model),
                                     sources=[gone], manifest=v7.model_dump(mode="json")))
        await eventually_async(lambda: loader.pulling() is not None, timeout=10,
                               what="the pull of gang 1's v7 under way")
        # No source holds v7 past the pull attempts' time: the replica says its pulls failed.
        await eventually_async(lambda: loader.state.failed, timeout=10, what="v7 reported failed")
        # Gang 2 resumed from checkpoint 6 and announces v6: the weights the replica holds.
        loader.offer(WeightsAnnounce(job_id="j", version=6, epoch=2, checksum=held[1], sources=[origin],
                                     manifest_digest="0" * 64))
        # A relay that completed gang 1's v7 before the rollback: a live source of the dead lineage.
        relay_of_v7.add_version(v7, buffer)
        loader.peer_has("rollout-1-i0", 7, weights_checksum(model), peer, True)
        await eventually_async(lambda: loader._task is not None and loader._task.done(), timeout=20,
                               what="the replica's pull of v7 over")
        assert installs == [], "the dead gang's v7 was installed after the new gang's announcement"
        assert not [d for k, d in events if k == "weights_loaded"], events
        assert loader.pulling() is None
        # It serves what the newest announcement names: not loading, not failed (the phase the
        # detector judges; a stopped pull left "loading" set, and the healthy replica was replaced).
        await eventually_async(lambda: not loader.state.loading and not loader.state.failed, timeout=5,
                               what="the replica neither loading nor failed")
    finally:
        await loader.close()
        for s in (dead_trainer, relay_server, relay_of_v7, new_trainer):
            await s.close()


async def test_a_source_address_that_cannot_be_used_is_reported_not_a_silent_end_of_the_pull() -> None:
    """A peer's relay address that does not parse (``WeightsHave.address`` comes off the bus) made
    the manifest fetch raise an error the loader did not catch: the pull task died with a log
    line, no ``weights_rejected`` event, the replica never reported and never loaded that version
    (an outside review found it). It must be a failed attempt like any other, reported. (The
    puller now turns a bad address into an unavailable source itself; the loader also reports any
    error a pull or fetch raises.)"""
    events: list[tuple[str, dict[str, Any]]] = []

    async def emit(kind: str, data: dict[str, Any]) -> None:
        events.append((kind, data))

    async def install(*_a: object) -> str:
        raise AssertionError("nothing can be installed here")

    async def nothing() -> None:
        return None

    relay = WeightServer(host="127.0.0.1")
    loader = WeightLoader(WeightSyncSpec(chunk_bytes=CHUNK, pull_timeout_s=1.0, pull_attempts=1), "rollout-0-i0",
                          relay, {}, install=install, emit=emit, on_change=nothing, held=lambda: (0, "c0"))
    try:
        await relay.start()
        loader.offer(WeightsAnnounce(job_id="j", version=1, epoch=1, checksum="c1", sources=["tcp://not-an-address"],
                                     manifest_digest="0" * 64))
        final = await eventually_async(lambda: [d for k, d in events if k == "weights_rejected" and d["final"]],
                                       timeout=15, what="the failed fetch reported")
        assert final[0]["version"] == 1 and final[0]["reason"] in ("unavailable", "error"), final
        assert loader.state.failed
    finally:
        await loader.close()
        await relay.close()


@pytest.mark.parametrize("stored_after_s", [0.5, None], ids=["stored-within-the-drain", "never-stored"])
async def test_a_close_waits_for_a_loads_report_being_stored_and_no_longer(
        stored_after_s: float | None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The replica stops while a load's ``weights_loaded`` is still being stored (JetStream away:
    the engine may have served turns with those weights already). The loader's close waits for
    it, up to ``REPORT_DRAIN_S``; a report never stored is named in an error when the bound
    passes, and the close returns (the replica's stop is bounded)."""
    from robustrl.services.rollout import loader as loader_module

    monkeypatch.setattr(loader_module, "REPORT_DRAIN_S", 1.5)
    model = build_policy(reference_job().model, CharTokenizer.default(), 7)
    buffer, v1 = flatten_state_dict(model.state_dict(), 1, CHUNK)
    reporting, stored = asyncio.Event(), asyncio.Event()
    events: list[str] = []

    async def install(_v: int, checksum: str, _state: dict[str, torch.Tensor], _t: float) -> str:
        return checksum

    async def emit(kind: str, _data: dict[str, Any]) -> None:
        if kind == "weights_loaded":
            reporting.set()
            await stored.wait()  # JetStream away: the append waits in its retries
        events.append(kind)

    async def nothing() -> None:
        return None

    async with _pulling_one_version(model, buffer, v1, install, emit, nothing, held=(0, "c0")) as loader:
        await eventually_async(reporting.is_set, timeout=20, what="the load's report being stored")
        if stored_after_s is not None:
            asyncio.get_running_loop().call_later(stored_after_s, stored.set)
        t0 = time.monotonic()
        with caplog.at_level("ERROR", logger=loader_module.__name__):
            await loader.close()
        took = time.monotonic() - t0
        if stored_after_s is not None:
            assert events == ["weights_loaded"], "the close returned before the load's report was stored"
            assert took < 1.5, took
        else:
            assert events == [] and 1.4 < took < 1.5 + 3.0, took  # the bound, then no longer
            assert any("not stored" in r.getMessage() for r in caplog.records), caplog.text
        stored.set()


@contextlib.asynccontextmanager
async def _pulling_one_version(model: torch.nn.Module, buffer: Any, manifest: Any, install: Any, emit: Any,
                               on_change: Any, held: tuple[int, str]) -> AsyncIterator[WeightLoader]:
    """A loader pulling ``manifest``'s version (announced inline) from a real trainer weight
    server; closed, with both servers, on the way out."""
    trainer, relay = WeightServer(host="127.0.0.1"), WeightServer(host="127.0.0.1")
    loader = WeightLoader(WeightSyncSpec(chunk_bytes=CHUNK, pull_timeout_s=5.0, pull_attempts=1), "rollout-0-i0",
                          relay, expected_layout(model), install=install, emit=emit, on_change=on_change,
                          held=lambda: held)
    try:
        origin = await trainer.start()
        await relay.start()
        trainer.add_version(manifest, buffer)
        loader.offer(WeightsAnnounce(job_id="j", version=manifest.version, epoch=1, checksum=weights_checksum(model),
                                     sources=[origin], manifest=manifest.model_dump(mode="json")))
        yield loader
    finally:
        await loader.close()
        for server in (trainer, relay):
            await server.close()


async def test_a_bus_error_as_a_loaded_version_is_reported_still_says_it_loaded() -> None:
    """NATS away as the engine finishes a swap (its reconnect buffer full, or the connection
    closed): the phase change the loader publishes on the way to ``weights_loaded`` raised nats's
    own error, the event was never appended and the replica -- serving the new weights -- said
    ``weights_failed`` and was replaced (an outside review). The engine holds the version: the
    event is appended and the replica is not failed; the phase is said again by the metrics."""
    import nats.errors

    model = build_policy(reference_job().model, CharTokenizer.default(), 3)
    buffer, v3 = flatten_state_dict(model.state_dict(), 3, CHUNK)
    events: list[tuple[str, dict[str, Any]]] = []
    fail_phase = [False]

    async def install(version: int, checksum: str, _state: dict[str, torch.Tensor], _t: float) -> str:
        fail_phase[0] = True  # NATS goes away as the swap ends
        return checksum

    async def emit(kind: str, data: dict[str, Any]) -> None:
        events.append((kind, data))

    async def phase() -> None:
        if fail_phase[0]:
            raise nats.errors.OutboundBufferLimitError()

    async with _pulling_one_version(model, buffer, v3, install, emit, phase, held=(-1, "")) as loader:
        await eventually_async(lambda: loader._task is not None and loader._task.done(), timeout=20,
                               what="the pull of v3 over")
        if loader._reporting is not None:  # a failed follow's report (the done callback's)
            await loader._reporting
        assert [d["version"] for k, d in events if k == "weights_loaded"] == [3], events
        assert not loader.state.failed


async def test_a_relay_holding_another_lineages_bytes_of_a_version_never_offers_them_for_it() -> None:
    """The replica's relay holds gang 1's v5 complete; gang 2 (resumed below it) announces its own
    v5, other weights. The loader's first HAVE says the replica pulls v5: peers then subscribe to
    its relay for v5, which matched on the number alone and offered gang 1's bytes (every chunk
    corrupt to them, the relay given up, the pull failed as corrupt once the publisher was gone).
    At the moment of that HAVE the old bytes must be gone from the relay, and the pull completes
    with gang 2's."""
    old_model = build_policy(reference_job().model, CharTokenizer.default(), 1)
    new_model = build_policy(reference_job().model, CharTokenizer.default(), 2)
    old_buf, old_v5 = flatten_state_dict(old_model.state_dict(), 5, CHUNK)
    new_buf, new_v5 = flatten_state_dict(new_model.state_dict(), 5, CHUNK)
    assert old_v5.digest() != new_v5.digest()
    at_have: list[bool] = []
    installs: list[str] = []

    async def have(version: int, checksum: str, complete: bool) -> None:
        if not complete:
            at_have.append(relay.holds(5, old_v5.digest()))

    async def install(version: int, checksum: str, _state: dict[str, torch.Tensor], _t: float) -> str:
        installs.append(checksum)
        return checksum

    async def emit(kind: str, data: dict[str, Any]) -> None:
        return None

    async def nothing() -> None:
        return None

    relay, trainer = WeightServer(host="127.0.0.1"), WeightServer(host="127.0.0.1")
    loader = WeightLoader(WeightSyncSpec(chunk_bytes=CHUNK, pull_timeout_s=5.0, pull_attempts=1), "rollout-0-i0",
                          relay, expected_layout(new_model), install=install, emit=emit, on_change=nothing,
                          held=lambda: (5, weights_checksum(old_model)), have=have)
    try:
        await relay.start()
        origin = await trainer.start()
        relay.add_version(old_v5, old_buf)  # gang 1's v5, served by this replica's relay
        trainer.add_version(new_v5, new_buf)
        loader.offer(WeightsAnnounce(job_id="j", version=5, epoch=2, checksum=weights_checksum(new_model),
                                     sources=[origin], manifest_digest=new_v5.digest()))
        await eventually_async(lambda: installs, timeout=20, what="gang 2's v5 installed")
        assert at_have == [False], "the relay still held the other lineage's v5 when it said it pulls v5"
        assert installs == [weights_checksum(new_model)] and relay.holds(5, new_v5.digest())
    finally:
        await loader.close()
        for server in (relay, trainer):
            await server.close()
