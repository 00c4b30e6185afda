"""Partial HAVE announcements (``WeightsHave.complete = False``): a replica announces a version
when it starts pulling it, so replicas pulling at the same moment relay to each other and split
the publisher; the request manager never takes such an announcement for a replica that can serve
the version.

Checked from outside: the raw HAVE messages on the bus, the publisher's own byte counter, the
requests the scripted replicas received, the event log.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from rm_harness import Harness, rm_spec
from robustrl.services.rollout.loader import WeightLoader
from support import eventually_async

from robustrl.bus import Bus
from robustrl.config import Settings, WeightSyncSpec, reference_job
from robustrl.messages import WeightsAnnounce, WeightsHave
from robustrl.model.policy import build_policy, weights_checksum
from robustrl.model.tokenizer import CharTokenizer
from robustrl.subjects import Verb, subject, wildcard
from robustrl.weights.flat import expected_layout, flatten_state_dict
from robustrl.weights.manifest import Manifest
from robustrl.weights.server import WeightServer

pytestmark = pytest.mark.timeout(120)
CHUNK = 4096
REPLICAS = 4


async def test_a_partial_announcement_never_makes_the_request_manager_dispatch_at_that_version(servers):
    """Replica a says it started pulling v1 (partial), b holds v1. Step 1 needs v1: until a says
    it holds v1 completely, none of step 1's turns may go to a."""
    async with Harness(servers, rm_spec("partial", steps=2, weights_load_s=30.0)) as h:
        a, b = await h.replica("rollout-0-i0"), await h.replica("rollout-1-i0")
        received_at: dict[str, float] = {}

        def note(msg: object) -> bool:
            received_at.setdefault(msg.request_id, time.monotonic())  # type: ignore[attr-defined]
            return False

        a.hold = note
        await h.start_rm()
        await eventually_async(lambda: 0 in h.batches, timeout=20, what="step 0 handed over")
        await h.commit(0)
        await h.bus.publish(subject(h.job_id, Verb.HAVE, a.member_id), WeightsHave(
            job_id=h.job_id, member_id=a.member_id, version=1, address="x:1", checksum="c1", complete=False))
        await b.set_version(1)
        # Step 1 waits for every live replica to hold v1: taking a's partial HAVE for v1 would
        # start it now and give a some of its turns.
        await asyncio.sleep(1.5)  # the window in which a wrong dispatch would happen (fault timing)
        assert not [m for m in a.received if m.step == 1], "a partial HAVE made the RM dispatch step 1 to a"
        a.version = 1  # its metrics say v1 from now on
        complete_at = time.monotonic()
        await a.set_version(1)
        await eventually_async(lambda: 1 in h.batches, timeout=20, what="step 1 handed over")
        early = [m.request_id for m in a.received if m.step == 1 and received_at[m.request_id] < complete_at]
        assert not early


class _Server(WeightServer):
    """A relay server that says when its replica's pull registered a version (the pull began)."""

    def __init__(self) -> None:
        super().__init__(host="127.0.0.1", max_versions=2)
        self.pulling = asyncio.Event()

    def add_version(self, manifest: Manifest, buffer: object, complete: bool = True) -> None:
        super().add_version(manifest, buffer, complete)
        self.pulling.set()


class _Relay:
    """One replica's weight loading, relay server and HAVE wiring, in this process. ``late``: the
    other replicas' announcements reach it only once its own pull has begun (a bus slower than the
    manifest's round trip, as under load)."""

    def __init__(self, bus: Bus, job_id: str, member_id: str, layout: dict[str, tuple[str, list[int]]],
                 partial: bool, late: bool = False) -> None:
        self.bus, self.job_id, self.member_id = bus, job_id, member_id
        self.late = late
        self.server = _Server()
        self.loaded: list[dict[str, object]] = []
        cfg = WeightSyncSpec(chunk_bytes=CHUNK, pull_timeout_s=20.0)

        async def install(version: int, checksum: str, _state: dict[str, torch.Tensor], _t: float) -> str:
            await self.have(version, checksum, True)  # as the replica does once the engine swapped
            return checksum

        async def emit(kind: str, data: dict[str, object]) -> None:
            if kind == "weights_loaded":
                self.loaded.append(data)

        async def nothing() -> None:
            return None

        self.loader = WeightLoader(cfg, member_id, self.server, layout, install=install, emit=emit,
                                   on_change=nothing, held=lambda: (-1, ""), seed=hash(member_id) & 0xFFFF,
                                   have=self.have if partial else None)

    async def start(self) -> None:
        self.address = await self.server.start()
        await self.bus.subscribe(wildcard(self.job_id, Verb.HAVE), WeightsHave, self._on_have)

    async def have(self, version: int, checksum: str, complete: bool) -> None:
        await self.bus.publish(subject(self.job_id, Verb.HAVE, self.member_id), WeightsHave(
            job_id=self.job_id, member_id=self.member_id, version=version, address=self.address,
            checksum=checksum, complete=complete))

    async def _on_have(self, msg: WeightsHave, _s: str, _r: str | None) -> None:
        if msg.member_id != self.member_id:
            if self.late:
                await self.server.pulling.wait()
            self.loader.peer_has(msg.member_id, msg.version, msg.checksum, msg.address, msg.complete)


@pytest.mark.parametrize(("partial", "late"), [(True, False), (False, False), (True, True)],
                         ids=["partial_have", "complete_have_only", "partial_have_after_pull_began"])
async def test_replicas_pulling_together_split_the_publisher_through_partial_announcements(
        servers: Settings, partial: bool, late: bool) -> None:
    """Four replicas follow one announcement at the same moment. With partial announcements they
    list each other as relays and the trainer sends about one copy; with complete announcements
    only (as before) each finds no relay in time and the trainer sends a copy to each.

    ``late``: each replica hears of the others only after its pull began, its first chunks asked of
    the trainer alone. A pull that re-read its sources only on its quarter-second tick took the
    whole version (85 chunks, ~0.1 s) from the trainer before it: 4.00 copies, the failure seen in
    the full suite when the bus lost the race with the manifest by a few milliseconds."""
    tok = CharTokenizer.default()
    model = build_policy(reference_job().model, tok, 7)
    buffer, manifest = flatten_state_dict(model.state_dict(), 1, CHUNK)
    job_id = f"have{int(time.time() * 1000) % 10**8}{int(partial)}{int(late)}"
    bus = await Bus.connect(servers.nats_url, "test-have")
    trainer = WeightServer(host="127.0.0.1")
    relays = [_Relay(bus, job_id, f"rollout-{i}-i0", expected_layout(model), partial, late)
              for i in range(REPLICAS)]
    seen: list[WeightsHave] = []

    async def keep(msg: WeightsHave, _s: str, _r: str | None) -> None:
        seen.append(msg)

    try:
        origin = await trainer.start()
        trainer.add_version(manifest, buffer)
        for r in relays:
            await r.start()
        await bus.subscribe(wildcard(job_id, Verb.HAVE), WeightsHave, keep)
        await bus.client.flush()
        ann = WeightsAnnounce(job_id=job_id, version=1, epoch=1, checksum=weights_checksum(model),
                              sources=[origin], manifest_digest=manifest.digest())
        for r in relays:
            r.loader.offer(ann)
        await eventually_async(lambda: all(r.loaded for r in relays), timeout=60, what="every replica loaded v1")
        copies = trainer.bytes_sent / manifest.total_bytes
        from_origin = sum(int(r.loaded[0]["origin_chunks"]) for r in relays)  # type: ignore[call-overload]
        if partial:
            assert {m.member_id for m in seen if not m.complete and m.version == 1} == {r.member_id for r in relays}
            assert copies <= 1.25, f"the trainer sent {copies:.2f} copies to {REPLICAS} relays"
            assert from_origin <= 1.25 * manifest.num_chunks
        else:
            assert not [m for m in seen if not m.complete]
            assert copies >= 2.5, f"without partial announcements the trainer sent only {copies:.2f} copies"
    finally:
        for r in relays:
            await r.loader.close()
            await r.server.close()
        await trainer.close()
        await bus.close()
