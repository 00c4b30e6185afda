"""A real rollout replica process against real NATS / Redis and real weight servers: it never
loads, serves or relays weights that fail verification, reports itself failed after N attempts,
counts queued turns in its metrics, and follows the newest gang epoch, not the highest version.

Everything is observed from outside: the JetStream event log, the replica's metrics and phase
messages, its HAVE announcements, its own weight server (as another replica would ask it), and
the turns it sends back.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support import eventually_async

from robustrl.bus import Bus
from robustrl.config import DetectorSpec, Settings, reference_job
from robustrl.launcher.base import MemberSpec
from robustrl.launcher.local import LocalLauncher
from robustrl.messages import (
    ChaosCommand, Event, GenerateTurn, MemberHello, MetricsSample, PhaseChange, SpecReply, SpecRequest, TurnResult,
    WeightsAnnounce, WeightsHave,
)
from robustrl.model.policy import build_policy, weights_checksum
from robustrl.model.tokenizer import CharTokenizer
from robustrl.services.rollout.loader import WeightLoader
from robustrl.subjects import Verb, subject, wildcard
from robustrl.weights import Fault, Manifest, WeightServer
from robustrl.weights.flat import flatten_state_dict
from robustrl.weights.transport import make_client

pytestmark = pytest.mark.timeout(600)

WAIT_S = 60.0  # one condition; the machine is shared by many test runs
START_S = 240.0  # the zygote's imports (torch, transformers) on a loaded 2-core machine, once a module
CHUNK = 16 << 10
ATTEMPTS = 2
TOK = CharTokenizer.default()


@dataclass
class Version:
    version: int
    buffer: torch.Tensor
    manifest: Manifest
    checksum: str


@dataclass
class Replica:
    """A replica process and everything it says on the bus."""

    bus: Bus
    job_id: str
    member_id: str
    log: Path
    log_from: int  # the member's log is appended to by each test's replica of the same id
    hello: list[MemberHello] = field(default_factory=list)
    samples: list[MetricsSample] = field(default_factory=list)
    phases: list[str] = field(default_factory=list)
    haves: list[WeightsHave] = field(default_factory=list)
    turns: list[TurnResult] = field(default_factory=list)

    def log_text(self) -> str:
        with self.log.open("rb") as f:
            f.seek(self.log_from)
            return f.read().decode(errors="replace")

    async def events(self, kind: str) -> list[Event]:
        return [e for e in await self.bus.read_events(self.job_id, timeout=1.0) if e.kind == kind]

    async def announce(self, v: Version, epoch: int, sources: list[str], checksum: str | None = None,
                       inline: bool = False) -> None:
        """As the trainer announces: the manifest by digest (fetched from a source), or inline."""
        await self.bus.publish(subject(self.job_id, Verb.WEIGHTS), WeightsAnnounce(
            job_id=self.job_id, version=v.version, epoch=epoch, checksum=checksum or v.checksum,
            sources=sources, **({"manifest": v.manifest.model_dump(mode="json")} if inline
                                else {"manifest_digest": v.manifest.digest()})))

    async def relay_holds(self, v: Version) -> frozenset[int]:
        """Ask the replica's own weight server, as another replica pulling from it would."""
        client = make_client(self.hello[-1].address or "")
        await client.connect(5.0)
        try:
            return await client.have(v.version, v.manifest.num_chunks)
        finally:
            await client.close()


def make_version(version: int, seed: int) -> Version:
    model = build_policy(reference_job().model, TOK, seed)
    buffer, manifest = flatten_state_dict(model.state_dict(), version, CHUNK)
    assert manifest.num_chunks >= 4
    return Version(version, buffer, manifest, weights_checksum(model))


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalLauncher]:
    """Replicas are started as a controller starts them: forked from the launcher's pre-imported
    zygote (``ROBUSTRL_FORK_START``, set by conftest), which pays the imports once per module."""
    launcher = LocalLauncher(tmp_path_factory.mktemp("replicas"))
    launcher.preload()
    try:
        yield launcher
    finally:
        launcher.close()


@pytest.fixture
async def replica(infra: Settings, launcher: LocalLauncher) -> AsyncIterator[Replica]:
    job_id = f"rep{uuid.uuid4().hex[:8]}"
    member_id = "rollout-0-i0"
    spec = reference_job(steps=3).model_copy(update={
        "detector": DetectorSpec.reference().model_copy(update={"metrics_interval_s": 0.1}),
        "weights": reference_job().weights.model_copy(update={"pull_timeout_s": 3.0, "pull_attempts": ATTEMPTS}),
    }).model_dump(mode="json")
    bus = await Bus.connect(infra.nats_url, "test-controller")
    await bus.ensure_event_stream()

    async def on_spec(msg: SpecRequest, _s: str, reply: str | None) -> None:
        await bus.respond(reply, SpecReply(job_id=msg.job_id, spec=spec, epoch=0))

    await bus.subscribe(subject(job_id, Verb.SPEC), SpecRequest, on_spec)
    log = launcher.log_dir / f"{member_id}.log"
    rep = Replica(bus, job_id, member_id, log, log.stat().st_size if log.exists() else 0)

    async def keep(store: list, msg: object, _s: str, _r: str | None) -> None:
        store.append(msg)

    async def on_phase(msg: PhaseChange, _s: str, _r: str | None) -> None:
        rep.phases.append(msg.phase)

    await bus.subscribe(subject(job_id, Verb.HELLO, member_id), MemberHello, lambda m, s, r: keep(rep.hello, m, s, r))
    await bus.subscribe(subject(job_id, Verb.METRICS, member_id), MetricsSample,
                        lambda m, s, r: keep(rep.samples, m, s, r))
    await bus.subscribe(subject(job_id, Verb.PHASE, member_id), PhaseChange, on_phase)
    await bus.subscribe(wildcard(job_id, Verb.HAVE), WeightsHave, lambda m, s, r: keep(rep.haves, m, s, r))
    await bus.subscribe(subject(job_id, Verb.TURN), TurnResult, lambda m, s, r: keep(rep.turns, m, s, r))
    env = {**infra.to_env(), "ROBUSTRL_JOB_ID": job_id, "ROBUSTRL_MEMBER_ID": member_id, "ROBUSTRL_ROLE": "rollout"}
    await asyncio.to_thread(launcher.start, MemberSpec(job_id, member_id, "rollout", module="robustrl.services.rollout",
                                                        env=env))  # it may wait for the zygote's imports
    try:
        await eventually_async(lambda: rep.hello and rep.samples and rep.samples[-1].phase == "idle",
                               timeout=START_S, what="replica up and idle")
        yield rep
    finally:
        await asyncio.to_thread(launcher.stop, member_id, 10.0)  # SIGTERM, then SIGKILL past 10 s
        await bus.close()
        print(rep.log_text()[-6000:])


async def _served(server: WeightServer, v: Version) -> WeightServer:
    await server.start()
    server.add_version(v.manifest, v.buffer)
    return server


async def test_replica_never_loads_serves_or_relays_weights_that_fail_verification(replica: Replica) -> None:
    servers: list[WeightServer] = []
    try:
        # 1. The only source sends chunk 2 corrupt every time: never loaded, failed after N.
        v1 = make_version(1, seed=11)
        liar = await _served(WeightServer(fault=Fault("corrupt", chunk=2, times=10_000)), v1)
        servers.append(liar)
        await replica.announce(v1, epoch=1, sources=[liar.address or ""])
        # a turn that needs v1 waits in the replica's queue, and the metrics say so
        await replica.bus.publish(subject(replica.job_id, Verb.GENERATE, replica.member_id), GenerateTurn(
            job_id=replica.job_id, request_id="t1", episode_id="e1", step=1, prefix_ids=[TOK.bos_id, 5, 6],
            max_new_tokens=4, temperature=1.0, top_p=1.0, seed=1, min_version=1))
        rejected = await eventually_async(
            lambda: _at_least(replica.events("weights_rejected"), ATTEMPTS), timeout=WAIT_S,
            what=f"{ATTEMPTS} weights_rejected events for v1")
        assert {e.data["version"] for e in rejected} == {1}
        assert all(e.data["reason"] == "corrupt" for e in rejected)
        await eventually_async(lambda: "weights_failed" in replica.phases, timeout=WAIT_S,
                               what="replica reports phase weights_failed")
        await eventually_async(lambda: replica.samples[-1].queue_depth >= 1, timeout=WAIT_S,
                               what="the waiting turn counted in queue_depth")
        assert replica.samples[-1].inflight == 0 and replica.samples[-1].weights_version == -1
        assert 2 not in await replica.relay_holds(v1)  # the corrupt chunk is never relayed onward

        # 2. Chunks verify against the manifest, but the announced weights checksum differs
        # (a publisher whose bytes are not the weights it announced): rejected, never loaded.
        v2 = make_version(2, seed=12)
        honest2 = await _served(WeightServer(), v2)
        servers.append(honest2)
        wrong = make_version(2, seed=99).checksum
        await replica.announce(v2, epoch=1, sources=[honest2.address or ""], checksum=wrong)
        mismatch = await eventually_async(
            lambda: _matching(replica.events("weights_rejected"), version=2), timeout=WAIT_S,
            what="weights_rejected for v2")
        assert mismatch[0].data["reason"] == "checksum_mismatch"
        assert mismatch[0].data["expected"] == wrong and mismatch[0].data["got"] == v2.checksum
        assert mismatch[0].data["checksum"] == v2.checksum  # the auditor's key: the bytes rejected
        assert await replica.relay_holds(v2) == frozenset()

        # 3. The only source dies mid-version (the publisher crashed) and nobody re-announces:
        # not the replica's fault, but no wait without end either.
        v7 = make_version(7, seed=17)
        dying = await _served(WeightServer(fault=Fault("die", after_chunks=2)), v7)
        servers.append(dying)
        await replica.announce(v7, epoch=1, sources=[dying.address or ""])
        gone = await eventually_async(
            lambda: _matching(replica.events("weights_rejected"), version=7, final=True), timeout=WAIT_S,
            what="weights_rejected (final) for v7")
        assert gone[0].data["reason"] == "unavailable" and gone[0].data["waited_s"] >= 3.0 * ATTEMPTS
        assert _matching_now(await replica.events("weights_rejected"), version=7, final=False) == []

        # 4. A good version loads; the queued turn is served with it, and only it.
        v8 = make_version(8, seed=13)
        honest8 = await _served(WeightServer(), v8)
        servers.append(honest8)
        await replica.announce(v8, epoch=1, sources=[honest8.address or ""])
        await eventually_async(lambda: replica.turns, timeout=WAIT_S, what="the queued turn served")
        assert [(t.request_id, t.weights_version) for t in replica.turns] == [("t1", 8)]
        loaded = await replica.events("weights_loaded")
        assert [(e.data["version"], e.data["checksum"]) for e in loaded] == [(8, v8.checksum)]
        # only the verified version is announced as held; every followed version was announced
        # as a pull under way (partial: the replica relays it while pulling)
        assert [(h.version, h.checksum) for h in replica.haves if h.complete] == [(8, v8.checksum)]
        assert {h.version for h in replica.haves if not h.complete} == {1, 2, 7, 8}
        await eventually_async(lambda: replica.samples[-1].weights_version == 8
                               and replica.samples[-1].queue_depth == 0
                               and replica.samples[-1].phase in ("idle", "serving"),
                               timeout=WAIT_S, what="metrics show v8, an empty queue, a healthy phase")
        assert len(await replica.relay_holds(v8)) == v8.manifest.num_chunks
    finally:
        for server in servers:
            await server.close()


async def test_replica_follows_the_newest_gang_epoch_and_tells_a_new_peer_what_it_holds(replica: Replica) -> None:
    """The newest gang epoch wins, not the highest version; then a replica that joins after the
    publisher died (a replacement during a trainer recovery) learns from this relay what it
    holds: every HAVE sent before the joiner subscribed is lost to it."""
    servers: list[WeightServer] = []
    try:
        v5, v9, v6 = make_version(5, seed=5), make_version(9, seed=9), make_version(6, seed=6)
        for v in (v5, v9, v6):
            servers.append(await _served(WeightServer(), v))
        await replica.announce(v5, epoch=2, sources=[servers[0].address or ""], inline=True)  # older trainers
        await eventually_async(lambda: _matching(replica.events("weights_loaded"), version=5), timeout=WAIT_S,
                               what="v5 of epoch 2 loaded")
        # the old gang (epoch 1), not yet dead on another host, announces a higher version
        await replica.announce(v9, epoch=1, sources=[servers[1].address or ""])
        # the new gang (epoch 3) resumed from an older checkpoint and redoes step 6
        await replica.announce(v6, epoch=3, sources=[servers[2].address or ""])
        await eventually_async(lambda: _matching(replica.events("weights_loaded"), version=6), timeout=WAIT_S,
                               what="v6 of epoch 3 loaded")
        loaded = await replica.events("weights_loaded")
        assert [(e.data["version"], e.data["epoch"]) for e in loaded] == [(5, 2), (6, 3)]
        assert servers[1].bytes_sent == 0  # the stale gang was not even asked
        await eventually_async(lambda: replica.samples[-1].weights_version == 6, timeout=WAIT_S,
                               what="metrics show v6")

        # A new peer starts pulling v6 (its partial HAVE, as a replacement that read the weights
        # pointer sends): the replica says again, on the raw bus, that it holds v6 completely.
        def held_by_replica() -> list[WeightsHave]:
            return [h for h in replica.haves if h.member_id == replica.member_id and h.complete]

        before = len(held_by_replica())
        assert [(h.version, h.checksum) for h in held_by_replica()] == [(5, v5.checksum), (6, v6.checksum)]

        async def joiner_pulls(member_id: str) -> None:
            await replica.bus.publish(subject(replica.job_id, Verb.HAVE, member_id), WeightsHave(
                job_id=replica.job_id, member_id=member_id, version=6, checksum=v6.checksum,
                address="127.0.0.1:9", complete=False))

        await joiner_pulls("rollout-1-i1")
        again = await eventually_async(lambda: held_by_replica()[before:], timeout=WAIT_S,
                                       what="the replica's HAVE repeated for the new peer")
        assert [(h.version, h.checksum, h.address) for h in again] == [(6, v6.checksum, replica.hello[-1].address)]
        # Once per new peer, not per message: the known peer three times more, then a new one.
        # The replica handles one subscription's messages in order and publishes on one
        # connection, so any answer to a repeat would arrive before the new peer's, and both
        # before the HAVE it sends once it loads v10 (announced only after that answer).
        for _ in range(3):
            await joiner_pulls("rollout-1-i1")
        await joiner_pulls("rollout-2-i1")
        await eventually_async(lambda: len(held_by_replica()) >= before + 2, timeout=WAIT_S,
                               what="the replica's HAVE for the second new peer")
        v10 = make_version(10, seed=10)
        servers.append(await _served(WeightServer(), v10))
        await replica.announce(v10, epoch=3, sources=[servers[-1].address or ""])
        await eventually_async(lambda: [h for h in held_by_replica() if h.version == 10], timeout=WAIT_S,
                               what="the replica's HAVE for v10")
        assert [h.version for h in held_by_replica()[before:]] == [6, 6, 10], held_by_replica()[before:]

        # While it pulls a newer version (its only source died mid-version: it keeps following
        # it) it answers a new peer with that version, as a relay of it (partial), not with the
        # one it holds: a peer keeps one announcement per replica, the older would hide it.
        v11 = make_version(11, seed=21)
        servers.append(await _served(WeightServer(fault=Fault("die", after_chunks=2)), v11))

        def pulling_v11() -> list[WeightsHave]:
            return [h for h in replica.haves if h.member_id == replica.member_id and h.version == 11]

        await replica.announce(v11, epoch=3, sources=[servers[-1].address or ""])
        await eventually_async(pulling_v11, timeout=WAIT_S, what="the replica's partial HAVE for v11")
        await joiner_pulls("rollout-3-i1")
        answer = await eventually_async(lambda: pulling_v11()[1:], timeout=WAIT_S,
                                        what="the replica's answer to the third new peer")
        assert [(h.version, h.complete) for h in answer] == [(11, False)]
        assert [h.version for h in held_by_replica()[before:]] == [6, 6, 10]
    finally:
        for server in servers:
            await server.close()


async def _at_least(events: asyncio.Future[list[Event]] | object, n: int) -> list[Event] | None:
    got = await events  # type: ignore[misc]
    return got if len(got) >= n else None


async def _matching(events: object, **data: object) -> list[Event]:
    return _matching_now(await events, **data)  # type: ignore[misc]


def _matching_now(events: list[Event], **data: object) -> list[Event]:
    return [e for e in events if all(e.data.get(k) == v for k, v in data.items())]


async def test_replica_fetches_the_manifest_by_digest_and_never_pulls_against_a_forged_one(
        replica: Replica) -> None:
    """Announcements carry the manifest's digest; the manifest comes from a source. A source that
    serves another manifest under the announced version (another lineage's v3, or a lie) is never
    used to pull: nothing is loaded from it, the replica reports it, and loads from an honest one."""
    servers: list[WeightServer] = []
    try:
        v3, forged = make_version(3, seed=13), make_version(3, seed=14)
        servers.append(await _served(WeightServer(), forged))
        await replica.announce(v3, epoch=0, sources=[servers[0].address or ""])
        rejected = await eventually_async(lambda: _matching(replica.events("weights_rejected"), version=3),
                                          timeout=WAIT_S, what="the forged manifest reported")
        assert rejected[0].data["reason"] == "corrupt" and rejected[0].data["final"]
        assert servers[0].bytes_sent == 0  # not one chunk pulled against it
        servers.append(await _served(WeightServer(), v3))
        await replica.announce(v3, epoch=0, sources=[servers[0].address or "", servers[1].address or ""])
        loaded = await eventually_async(lambda: _matching(replica.events("weights_loaded"), version=3),
                                        timeout=WAIT_S, what="v3 loaded from the honest source")
        # The liar also holds chunks of "v3": those it sent failed their checksums (chunk checks
        # against the honest manifest) and were fetched again from the honest source.
        assert loaded[0].data["checksum"] == v3.checksum
    finally:
        for server in servers:
            await server.close()


async def test_replica_pulls_a_version_whose_announcement_it_never_received(
        replica: Replica, infra: Settings) -> None:
    """An announcement lost on the bus (published while NATS restarted, before the replica's
    subscription came back on the new server; seen in CI: both replicas held v3 for 30 s while
    step 4 needed v4 and were replaced) must not leave the replica behind: the gang's fenced
    weights pointer in Redis names the version, and the replica finds it there. Here the pointer
    is written and nothing is published at all."""
    from robustrl.storage.redis_stores import Keys, connect

    v3 = make_version(3, seed=3)
    server = await _served(WeightServer(), v3)
    redis = connect(infra.redis_url)
    try:
        ann = WeightsAnnounce(job_id=replica.job_id, version=3, epoch=1, checksum=v3.checksum,
                              sources=[server.address or ""], manifest_digest=v3.manifest.digest())
        await redis.set(Keys.weights_latest(replica.job_id), ann.encode())
        loaded = await eventually_async(lambda: _matching(replica.events("weights_loaded"), version=3),
                                        timeout=WAIT_S, what="v3 loaded from the pointer alone")
        assert [(e.data["version"], e.data["checksum"]) for e in loaded] == [(3, v3.checksum)]
        assert server.bytes_sent > 0
    finally:
        await redis.aclose()
        await server.close()


async def test_a_replica_whose_queued_turns_need_a_version_to_come_says_so_across_a_rollback(
        replica: Replica) -> None:
    """A trainer rollback: the replica holds v6 (gang 2), turns dispatched before the fault need
    v7, and the new gang (3), resumed from an older checkpoint, announces v5. The replica follows
    the new gang down to v5 and waits for v7 holding its turns: its phase says
    ``awaiting_version`` (the detector's stall rule exempts it), not ``idle`` with turns queued and
    no tokens, which the detector reported as hung at twice ``rollout_idle_s`` and the controller
    replaced, replica after replica. Once the new gang's v7 comes, the turns are served, by v7."""
    servers: list[WeightServer] = []
    try:
        v6, v5, v7 = make_version(6, seed=6), make_version(5, seed=5), make_version(7, seed=7)
        for v in (v6, v5, v7):
            servers.append(await _served(WeightServer(), v))
        await replica.announce(v6, epoch=2, sources=[servers[0].address or ""])
        await eventually_async(lambda: _matching(replica.events("weights_loaded"), version=6), timeout=WAIT_S,
                               what="v6 of gang 2 loaded")
        for i in range(2):
            await replica.bus.publish(subject(replica.job_id, Verb.GENERATE, replica.member_id), GenerateTurn(
                job_id=replica.job_id, request_id=f"t{i}", episode_id=f"e{i}", step=7,
                prefix_ids=[TOK.bos_id, 5, 6], max_new_tokens=4, temperature=1.0, top_p=1.0, seed=i,
                min_version=7))
        await eventually_async(lambda: replica.samples[-1].phase == "awaiting_version"
                               and replica.samples[-1].queue_depth == 2, timeout=WAIT_S,
                               what="the waiting turns and the phase that says why")
        await replica.announce(v5, epoch=3, sources=[servers[1].address or ""])  # the rollback
        await eventually_async(lambda: _matching(replica.events("weights_loaded"), version=5), timeout=WAIT_S,
                               what="v5 of gang 3 loaded")
        await eventually_async(lambda: replica.samples[-1].weights_version == 5
                               and replica.samples[-1].phase == "awaiting_version", timeout=WAIT_S,
                               what="still awaiting v7 after the rollback")
        assert not replica.turns and "idle" not in replica.phases[replica.phases.index("awaiting_version"):]
        await replica.announce(v7, epoch=3, sources=[servers[2].address or ""])
        await eventually_async(lambda: len(replica.turns) == 2, timeout=WAIT_S, what="both turns served")
        assert {t.weights_version for t in replica.turns} == {7}
        await eventually_async(lambda: replica.samples[-1].phase != "awaiting_version", timeout=WAIT_S,
                               what="the phase back once the queue is served")
    finally:
        for s in servers:
            await s.close()


async def test_a_swap_slower_than_the_pull_timeout_is_waited_for_and_a_rollback_during_one_is_obeyed(
        replica: Replica) -> None:
    """The engine thread stalls (chaos ``stall``) longer than ``pull_timeout_s`` (3 s here) while
    it swaps weights in. A swap the engine has begun cannot be withdrawn. Before: the loader
    reported it a timeout while the engine completed it and served that version with no
    ``weights_loaded`` (the auditor's "served v but never loaded"); and a rollback announced during
    such a swap (the new gang resumes at the version the replica held) was taken as "held already",
    so the replica ended up serving the dead gang's newer version for good.
    Checked from outside: every turn's version was loaded (event log) by this replica, the metrics'
    version, and what the replica says it holds."""
    servers: list[WeightServer] = []

    async def stall(seconds: float) -> None:
        await replica.bus.publish(subject(replica.job_id, Verb.CHAOS, replica.member_id), ChaosCommand(
            job_id=replica.job_id, fault_id=uuid.uuid4().hex[:8], kind="stall", member_id=replica.member_id,
            duration_s=seconds))

    async def turn(request_id: str, min_version: int) -> None:
        await replica.bus.publish(subject(replica.job_id, Verb.GENERATE, replica.member_id), GenerateTurn(
            job_id=replica.job_id, request_id=request_id, episode_id=f"e-{request_id}", step=min_version,
            prefix_ids=[TOK.bos_id, 5, 6], max_new_tokens=4, temperature=1.0, top_p=1.0, seed=1,
            min_version=min_version))

    try:
        v1, v2 = make_version(1, seed=21), make_version(2, seed=22)
        for v in (v1, v2):
            servers.append(await _served(WeightServer(), v))
        # 1. A slow swap: waited for, loaded once, never reported a timeout.
        await stall(6.0)
        await replica.announce(v1, epoch=1, sources=[servers[0].address or ""])
        await turn("t1", 1)
        await eventually_async(lambda: replica.turns, timeout=WAIT_S, what="t1 served")
        rejected = await replica.events("weights_rejected")
        assert not rejected, [e.data for e in rejected]
        loaded = await replica.events("weights_loaded")
        assert [(e.data["version"], e.data["checksum"]) for e in loaded] == [(1, v1.checksum)], loaded
        assert [(t.request_id, t.weights_version) for t in replica.turns] == [("t1", 1)]

        # 2. A rollback during a swap: gang 1 announces v2; while the engine (stalled) swaps it
        # in, gang 2 resumes at v1, the version the replica held, and announces it.
        await stall(6.0)
        await replica.announce(v2, epoch=1, sources=[servers[1].address or ""])

        async def pulled() -> bool:
            return len(await replica.relay_holds(v2)) == v2.manifest.num_chunks

        await eventually_async(pulled, timeout=WAIT_S, what="v2 pulled")
        # v2 in the engine's (stalled) swap for ~5 s more: the rollback comes now.
        await eventually_async(lambda: "weights v2: the engine takes them" in replica.log_text(), timeout=WAIT_S,
                               what="v2 taken by the engine")
        await replica.announce(v1, epoch=2, sources=[servers[0].address or ""])
        await turn("t2", 1)
        await eventually_async(lambda: len(replica.turns) == 2, timeout=WAIT_S, what="t2 served")
        # t2 was served once the stalled swap ended. The replica must end up holding what the
        # newest gang announced, v1, by metrics sampled after that (every 0.1 s) ...
        after = len(replica.samples) + 3
        await eventually_async(lambda: len(replica.samples) > after and replica.samples[-1].weights_version == 1
                               and replica.samples[-1].phase in ("idle", "serving"),
                               timeout=WAIT_S, what="the replica back on gang 2's v1")
        # ... and every version it served, it loaded, by the event log.
        loaded = await replica.events("weights_loaded")
        held = {(e.data["version"]) for e in loaded}
        served = {t.weights_version for t in replica.turns}
        assert served <= held, (served, [e.data for e in loaded])
        assert [h.version for h in replica.haves if h.complete][-1] == 1, replica.haves
    finally:
        for s in servers:
            await s.close()


async def late_swap_then_dying_pull(replica: Replica, v2: Version, v2_server: WeightServer, v3: Version,
                                    v3_server: WeightServer, stall_s: float) -> None:
    """The engine stalled (chaos) while it swaps v2 in, then v3 announced from a source that dies
    mid-pull: returns once the late swap of v2 is reported (``weights_loaded`` with ``late``)."""
    await replica.bus.publish(subject(replica.job_id, Verb.CHAOS, replica.member_id), ChaosCommand(
        job_id=replica.job_id, fault_id=uuid.uuid4().hex[:8], kind="stall", member_id=replica.member_id,
        duration_s=stall_s))
    await replica.announce(v2, epoch=1, sources=[v2_server.address or ""])
    await eventually_async(lambda: "the engine took them" in replica.log_text(), timeout=WAIT_S,
                           what="the engine swapping v2 in (stalled)")
    await replica.announce(v3, epoch=1, sources=[v3_server.address or ""])
    await eventually_async(lambda: _matching(replica.events("weights_loaded"), version=2, late=True),
                           timeout=WAIT_S, what="the late swap of v2 reported")


async def test_a_swap_that_ends_late_leaves_peers_hearing_the_pull_that_superseded_it(
        replica: Replica) -> None:
    """The engine (stalled) is swapping v2 in when v3 is announced; v3's publisher dies after two
    chunks, so the v3 pull goes on (waiting for a source) when the v2 swap ends. Before: the late
    report announced v2 held after the partial HAVE of v3, and peers keep one announcement per
    replica: a peer pulling v3 no longer listed this replica as a source of it (with a live
    publisher: this relay lost to the version's fan-out until the replica loaded v3). What a peer
    last hears from the replica must be what it pulls and relays now: v3, partial. Observed on the
    raw bus, fed to a real loader as a peer's."""
    servers: list[WeightServer] = []
    try:
        v2, v3 = make_version(2, seed=32), make_version(3, seed=33)
        servers.append(await _served(WeightServer(), v2))
        servers.append(await _served(WeightServer(fault=Fault("die", after_chunks=2)), v3))
        await late_swap_then_dying_pull(replica, v2, servers[0], v3, servers[1], stall_s=12.0)
        own = [h for h in replica.haves if h.member_id == replica.member_id]
        assert [(h.version, h.complete) for h in own][-1] == (3, False), own

        peer = WeightLoader(reference_job().weights, "rollout-1-i0", SimpleNamespace(), {},  # type: ignore[arg-type]
                            install=None, emit=None, on_change=None, held=lambda: (-1, ""))  # type: ignore[arg-type]
        for h in replica.haves:
            peer.peer_has(h.member_id, h.version, h.checksum, h.address, h.complete)
        pulling_v3 = WeightsAnnounce(job_id=replica.job_id, version=3, epoch=1, checksum=v3.checksum,
                                     sources=[servers[1].address or ""], manifest_digest=v3.manifest.digest())
        address = replica.hello[-1].address or ""
        relay = address if "://" in address else f"{reference_job().weights.transport}://{address}"
        assert relay in peer._sources(pulling_v3, set()), peer.peers
    finally:
        for s in servers:
            await s.close()


async def _slow_engine(replica: Replica, per_token_s: float, seconds: float) -> None:
    """Chaos ``slow``: every decoded token takes ``per_token_s`` longer (tokens still flow)."""
    await replica.bus.publish(subject(replica.job_id, Verb.CHAOS, replica.member_id), ChaosCommand(
        job_id=replica.job_id, fault_id=uuid.uuid4().hex[:8], kind="slow", member_id=replica.member_id,
        duration_s=seconds, factor=1.0 + per_token_s / 0.002))


async def test_weights_announced_during_a_batch_longer_than_the_pull_timeout_wait_for_the_batch(
        replica: Replica) -> None:
    """A healthy batch that decodes longer than ``pull_timeout_s`` (3 s here; long generations on
    a real engine) while a new version is pulled: the engine takes new weights only between
    batches. Before, the verified weights were withdrawn after ``pull_timeout_s`` and reported
    ``weights_rejected`` (timeout), pulled again, and after ``pull_attempts`` windows missed the
    replica said ``weights_failed`` and was replaced though it was healthy. Tokens flowing mean
    the engine is alive: the weights wait for the batch's end. Checked on the event log and the
    turns: v2 loaded once, nothing rejected, the batch's turns made with v1, later ones with v2."""
    servers: list[WeightServer] = []

    async def turn(request_id: str, min_version: int, tokens: int) -> None:
        await replica.bus.publish(subject(replica.job_id, Verb.GENERATE, replica.member_id), GenerateTurn(
            job_id=replica.job_id, request_id=request_id, episode_id=f"e-{request_id}", step=min_version,
            prefix_ids=[TOK.bos_id, 5, 6], max_new_tokens=tokens, temperature=1.0, top_p=1.0, seed=7,
            stop_on_call=False, min_version=min_version))

    try:
        v1, v2 = make_version(1, seed=41), make_version(2, seed=42)
        for v in (v1, v2):
            servers.append(await _served(WeightServer(), v))
        await _slow_engine(replica, per_token_s=0.4, seconds=60.0)
        # Four rows in one batch: queued before v1 (they need it), they wait for it together and
        # are taken as one batch once it is loaded; the batch lasts as long as its longest row,
        # up to 24 tokens at 0.4 s.
        for i in range(4):
            await turn(f"long{i}", 1, tokens=24)
        await eventually_async(lambda: replica.samples[-1].queue_depth == 4, timeout=WAIT_S,
                               what="the four turns queued, waiting for v1")
        await replica.announce(v1, epoch=1, sources=[servers[0].address or ""])
        await eventually_async(lambda: _matching(replica.events("weights_loaded"), version=1), timeout=WAIT_S,
                               what="v1 loaded")
        await eventually_async(lambda: replica.samples[-1].phase == "serving", timeout=WAIT_S,
                               what="the long batch decoding")
        await replica.announce(v2, epoch=1, sources=[servers[1].address or ""])
        await eventually_async(lambda: _matching(replica.events("weights_loaded"), version=2), timeout=WAIT_S,
                               what="v2 loaded once the batch ended")
        await turn("after", 2, tokens=2)
        await eventually_async(lambda: any(t.request_id == "after" for t in replica.turns), timeout=WAIT_S,
                               what="a turn served with v2")
        long_turns = [t for t in replica.turns if t.request_id.startswith("long")]
        # the batch outlived the pull timeout (else this test proves nothing)
        assert max(t.gen_s for t in long_turns) > 3.0 * 2, [t.gen_s for t in long_turns]
        rejected = await replica.events("weights_rejected")
        assert not rejected, [e.data for e in rejected]
        loaded = [(e.data["version"], e.data["checksum"]) for e in await replica.events("weights_loaded")]
        assert loaded == [(1, v1.checksum), (2, v2.checksum)], loaded
        assert {t.weights_version for t in long_turns} == {1} and len(long_turns) == 4
        assert [t.weights_version for t in replica.turns if t.request_id == "after"] == [2]
        assert "weights_failed" not in replica.phases
    finally:
        for s in servers:
            await s.close()


async def test_a_turn_the_engine_cannot_decode_is_refused_and_its_batch_is_served(replica: Replica) -> None:
    """Bad input on the bus from a publisher allowed to send turns: a token id outside the
    vocabulary, a seed no generator takes. Before, the engine thread raised (IndexError,
    RuntimeError) and died: the replica answered probes, served nothing more, and lost the turns
    batched with the bad one. Each bad turn is refused with a log line naming it; the good ones,
    sent with them and after them, are served."""
    servers: list[WeightServer] = []
    try:
        v1 = make_version(1, seed=51)
        servers.append(await _served(WeightServer(), v1))
        await replica.announce(v1, epoch=1, sources=[servers[0].address or ""])
        await eventually_async(lambda: _matching(replica.events("weights_loaded"), version=1), timeout=WAIT_S,
                               what="v1 loaded")
        await _slow_engine(replica, per_token_s=0.3, seconds=10.0)  # the next turns queue up behind one

        def turn(request_id: str, prefix: list[int], seed: int = 1) -> GenerateTurn:
            return GenerateTurn(job_id=replica.job_id, request_id=request_id, episode_id=f"e-{request_id}", step=1,
                                prefix_ids=prefix, max_new_tokens=4, temperature=1.0, top_p=1.0, seed=seed,
                                min_version=1)

        turns = [turn("first", [TOK.bos_id, 5]), turn("bad-token", [TOK.bos_id, 10**9]),
                 turn("good", [TOK.bos_id, 6]), turn("bad-seed", [TOK.bos_id, 7], seed=2**70), turn("last", [TOK.bos_id, 8])]
        for t in turns:
            await replica.bus.publish(subject(replica.job_id, Verb.GENERATE, replica.member_id), t)
        await eventually_async(lambda: {"first", "good", "last"} <= {t.request_id for t in replica.turns},
                               timeout=WAIT_S, what="the good turns served")
        # the bad ones are answered with a refusal naming why, on the bus (the request manager
        # sends them elsewhere at once and names them in the job's log), never with tokens
        no = {t.request_id: t for t in replica.turns if t.refused}
        assert set(no) == {"bad-token", "bad-seed"}, no
        assert no["bad-token"].refused == "input" and "outside the vocabulary" in no["bad-token"].error, no
        assert no["bad-seed"].refused == "input" and "seed" in no["bad-seed"].error, no
        assert not any(t.token_ids for t in no.values())
        text = replica.log_text()
        assert "bad-token" in text and "bad-seed" in text, text[-3000:]
        # and the engine thread lives on
        await replica.bus.publish(subject(replica.job_id, Verb.GENERATE, replica.member_id),
                                  turn("later", [TOK.bos_id, 9]))
        await eventually_async(lambda: any(t.request_id == "later" for t in replica.turns), timeout=WAIT_S,
                               what="a later turn served")
    finally:
        for s in servers:
            await s.close()
