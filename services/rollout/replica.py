"""Rollout replica: a generation engine behind NATS, with weight pull and relay.

Turn requests queue up; a worker thread decodes whatever is queued as one batch (many
episodes at once, KV cache), publishing each turn tagged with the weights version that
produced it. A new version is pulled in the background from the trainer ranks and from
other replicas (relays), verified chunk by chunk, swapped in between batches, and then
served onward. A replica never serves a version that mixes two versions.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time

import torch

from robustrl.config import Settings
from robustrl.member import Identity, Member
from robustrl.messages import GenerateTurn, TurnResult, WeightsAnnounce, WeightsHave, decode
from robustrl.model.engine import GenerationEngine, GenRequest
from robustrl.model.policy import build_policy, weights_checksum
from robustrl.model.tokenizer import CharTokenizer
from robustrl.storage.redis_stores import WeightsPointer, connect
from robustrl.subjects import Verb, subject, wildcard
from robustrl.weights.flat import expected_layout, unflatten
from robustrl.weights.manifest import Manifest
from robustrl.weights.puller import pull
from robustrl.weights.server import WeightServer

log = logging.getLogger(__name__)
BATCH_WAIT_S = 0.01
PULL_RETRY_S = 0.5
PULL_TIMEOUT_S = 30.0


class Replica:
    def __init__(self, ident: Identity, settings: Settings) -> None:
        self.ident = ident
        self.settings = settings
        self.member = Member(ident, settings)
        self.requests: queue.Queue[GenerateTurn] = queue.Queue()
        self.version = -1
        self.checksum = ""
        self._pending_weights: tuple[int, str, dict[str, torch.Tensor], threading.Event] | None = None
        self._swap_lock = threading.Lock()
        self._latest_announce: WeightsAnnounce | None = None
        self._pulling: asyncio.Task[None] | None = None
        self._peers: dict[str, tuple[int, str, str]] = {}  # member -> (version, checksum, address)

    async def run(self) -> None:
        spec = await self.member.start()
        torch.set_num_threads(1)
        torch.manual_seed(spec.seed)
        self.loop = asyncio.get_running_loop()
        self.tok = CharTokenizer.default()
        self.model = await asyncio.to_thread(build_policy, spec.model, self.tok, spec.seed)
        self.layout = expected_layout(self.model)
        self.engine = GenerationEngine(self.model, self.tok, max_batch=spec.rollout.max_batch)
        self.server = WeightServer(spec.weights.transport, host=self.settings.bind_host, max_versions=2)
        self.address = await self.server.start()
        bus = self.member.bus
        assert bus
        job = self.ident.job_id
        await bus.subscribe(subject(job, Verb.GENERATE, self.ident.member_id), GenerateTurn, self._on_request)
        await bus.subscribe(subject(job, Verb.WEIGHTS), WeightsAnnounce, self._on_announce)
        await bus.subscribe(wildcard(job, Verb.HAVE), WeightsHave, self._on_have)
        redis = connect(self.settings.redis_url)
        latest = await WeightsPointer(redis, job).get()
        await redis.aclose()
        await self.member.hello(self.address)
        await self.member.set_phase("idle")
        worker = threading.Thread(target=self._worker, name="engine", daemon=True)
        worker.start()
        if latest:
            # A late joiner or replacement: pull the current version from any relay.
            await self._on_announce(decode(WeightsAnnounce, latest), "", None)
        await self.member.stopping.wait()
        await self.server.close()
        await self.member.close()

    # --- weights ----------------------------------------------------------------------------

    def _sources(self) -> list[str]:
        ann = self._latest_announce
        if ann is None:
            return []
        peers = [addr for (v, c, addr) in self._peers.values() if v == ann.version and c == ann.checksum]
        return [*peers, *ann.sources]

    async def _on_have(self, msg: WeightsHave, _s: str, _r: str | None) -> None:
        if msg.member_id != self.ident.member_id:
            self._peers[msg.member_id] = (msg.version, msg.checksum, msg.address)

    async def _on_announce(self, msg: WeightsAnnounce, _s: str, _r: str | None) -> None:
        if msg.version == self.version and msg.checksum == self.checksum:
            return
        cur = self._latest_announce
        if cur and (cur.version, cur.epoch) > (msg.version, msg.epoch):
            return
        self._latest_announce = msg
        if self._pulling and not self._pulling.done():
            log.info("v%d announced while pulling: superseding the running pull", msg.version)
            self._pulling.cancel()
        self._pulling = asyncio.create_task(self._pull(msg))
        self._pulling.add_done_callback(self._pull_done)

    @staticmethod
    def _pull_done(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("weight pull task failed: %r", task.exception())

    async def _pull(self, ann: WeightsAnnounce) -> None:
        manifest = Manifest.model_validate(ann.manifest)
        manifest.check_matches(self.layout)
        spec = self.member.spec
        assert spec
        while True:
            await self.member.set_phase("loading_weights")
            t0 = time.monotonic()
            try:
                self.server.drop_version(manifest.version)  # never mix lineages of one version number
                log.info("pulling v%d from %s", manifest.version, self._sources())
                buffer, stats = await asyncio.wait_for(
                    pull(manifest, self._sources, transport=spec.weights.transport, relay=self.server,
                         timeout_s=PULL_TIMEOUT_S, stall_timeout_s=3.0, seed=hash(self.ident.member_id) & 0xFFFF),
                    PULL_TIMEOUT_S + 5.0)
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # WeightSyncError, or a transport error the puller let through
                log.warning("pull of v%d failed (%r); retrying", manifest.version, exc)
                self.server.drop_version(manifest.version)
                await asyncio.sleep(PULL_RETRY_S)  # back off before asking the sources again
                if self._latest_announce is not ann:
                    return
        state = unflatten(torch.from_numpy(buffer), manifest)
        swapped = threading.Event()
        with self._swap_lock:
            if self._pending_weights is not None:
                self._pending_weights[3].set()  # superseded: release whoever waits for it
            self._pending_weights = (manifest.version, ann.checksum, state, swapped)
        # The swap happens in the engine thread between batches; wait until it took effect.
        await asyncio.to_thread(swapped.wait)
        log.info("loaded v%d in %.2fs (%d B, from %s)", manifest.version, time.monotonic() - t0,
                 stats.bytes_received, stats.chunks_from)
        await self.member.set_phase("serving" if self.member.inflight else "idle")
        assert self.member.bus
        await self.member.bus.publish(
            subject(self.ident.job_id, Verb.HAVE, self.ident.member_id),
            WeightsHave(job_id=self.ident.job_id, member_id=self.ident.member_id, version=self.version,
                        address=self.address, checksum=self.checksum))
        await self.member.bus.emit_event(self.ident.job_id, "weights_loaded", {
            "member_id": self.ident.member_id, "version": self.version, "checksum": self.checksum,
            "pull_s": time.monotonic() - t0,
            "bytes": stats.bytes_received, "sources": len(stats.chunks_from)})

    def _apply_pending(self) -> None:
        with self._swap_lock:
            pending, self._pending_weights = self._pending_weights, None
        if pending is None:
            return
        version, checksum, state, swapped = pending
        self.engine.load_state_dict(state)
        got = weights_checksum(self.model)
        if got != checksum:
            log.error("weights v%d checksum mismatch after load: %s != %s", version, got, checksum)
        self.version, self.checksum = version, got
        self.member.weights_version = version
        swapped.set()

    # --- generation -------------------------------------------------------------------------

    async def _on_request(self, msg: GenerateTurn, _s: str, _r: str | None) -> None:
        self.requests.put(msg)
        self.member.queue_depth = self.requests.qsize()

    def _worker(self) -> None:
        while not self.member.stopping.is_set():
            self._apply_pending()
            try:
                first = self.requests.get(timeout=BATCH_WAIT_S)
            except queue.Empty:
                continue
            batch = [first]
            while len(batch) < self.engine.max_batch:
                try:
                    batch.append(self.requests.get_nowait())
                except queue.Empty:
                    break
            ready = [m for m in batch if m.min_version <= self.version]
            for m in batch:
                if m.min_version > self.version:
                    self.requests.put(m)  # too new for our weights: wait for the pull
            if not ready:
                time.sleep(BATCH_WAIT_S)  # a pull is under way; the requests wait for it
                continue
            # In flight before the chaos gate: a stalled replica holding work must look busy.
            self.member.inflight = len(ready)
            self.member.queue_depth = self.requests.qsize()
            self.member.chaos.gate()
            self._run_batch(ready)
            self.member.inflight = 0

    def _on_token(self, n: int) -> None:
        self.member.tokens_total += n
        self.member.activity += n
        delay = self.member.chaos.slow_delay(0.002)
        self.member.chaos.gate()
        if delay:
            time.sleep(delay)

    def _run_batch(self, batch: list[GenerateTurn]) -> None:
        asyncio.run_coroutine_threadsafe(self.member.set_phase("serving"), self.loop)
        t0 = time.monotonic()
        reqs = [GenRequest(m.request_id, m.prefix_ids, m.max_new_tokens, m.temperature, m.top_p, m.seed,
                           m.stop_on_call) for m in batch]
        results = self.engine.generate(reqs, on_token=self._on_token)
        dt = time.monotonic() - t0
        version = self.version
        for m, r in zip(batch, results, strict=True):
            out = TurnResult(job_id=m.job_id, request_id=m.request_id, episode_id=m.episode_id,
                             member_id=self.ident.member_id, token_ids=r.token_ids, logprobs=r.logprobs,
                             stop_reason=r.stop_reason, weights_version=version, gen_s=dt)
            assert self.member.bus
            asyncio.run_coroutine_threadsafe(
                self.member.bus.publish(subject(m.job_id, Verb.TURN), out), self.loop)
        if self.requests.empty():
            asyncio.run_coroutine_threadsafe(self.member.set_phase("idle"), self.loop)


def main() -> None:
    from robustrl.member import configure_logging

    ident = Identity.from_env(os.environ)
    configure_logging(ident.member_id)
    settings = Settings.from_env(os.environ)
    asyncio.run(Replica(ident, settings).run())
