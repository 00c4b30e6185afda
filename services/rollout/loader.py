"""A replica's weight loading: which announcement to follow, bounded pulls, verification.

A version is loaded only after its bytes verify twice: every chunk against the manifest (in
the puller, before the chunk is relayed onward) and the whole state dict against the
checksum the trainer announced (here, before the engine sees it). A version that fails is
never loaded and never relayed (its chunks are dropped from the relay server), and the
replica re-pulls, preferring other sources and relaying nothing of that version until it
verified. Every attempt has a deadline
(``weights.pull_timeout_s``); after ``weights.pull_attempts`` failed attempts at one version the
replica reports itself failed (phase ``weights_failed``, which the detector turns into a fault:
workers report, the controller decides) and keeps retrying more slowly.

A pull that fails because no live source holds the version (the publisher died mid-version and
no relay completed it) is not the replica's fault and is not counted: the replica goes back to
what it was doing and retries when a source shows up (a re-announcement, a relay's HAVE) or
after a back-off. That wait is bounded too: still without the version ``pull_timeout_s x
pull_attempts`` after its announcement (and no newer one), the replica reports weights_failed.

Partial announcements: when the replica starts following a version it announces ``WeightsHave``
with ``complete: false`` (``have``), so replicas pulling the same version at the same moment list
each other as relays and split the publisher among themselves (``robustrl.weights.puller``); a
peer's partial announcement makes it a source of this version, a complete one supersedes it, and
either wakes the running pull to re-read its sources at once (``sources_changed``): one that
arrives a moment after the pull began (the bus slower than the manifest's round trip) must not
wait for the pull's next listing tick, by which a small version is all in from the publisher. The
request manager and the controller ignore partial announcements (the replica cannot serve that
version yet).

Events for the auditor: ``weights_loaded`` (only after both checks) and ``weights_rejected``
``{member_id, version, epoch, expected, got?, checksum?, reason, error?, attempt, attempts_allowed,
final}`` (``checksum``: of the bytes rejected, when they were all pulled)
with reason ``corrupt | timeout | checksum_mismatch | load_mismatch | layout | unavailable | error``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from robustrl.services.rollout.announce import Announcements, Offer

from robustrl.aio import cancel_and_wait, wait_event, within
from robustrl.config import WeightSyncSpec
from robustrl.errors import RobustRLError, WeightSyncError
from robustrl.messages import WeightsAnnounce
from robustrl.model.policy import weights_checksum
from robustrl.weights.flat import unflatten
from robustrl.weights.manifest import Manifest
from robustrl.weights.puller import PullStats, fetch_manifest, pull
from robustrl.weights.server import WeightServer

log = logging.getLogger(__name__)

RETRY_S = 0.5
"""First pause between attempts; doubles up to MAX_RETRY_S."""
MAX_RETRY_S = 5.0
STALL_TIMEOUT_S = 3.0
"""Limit for one chunk or HAVE answer from one source (then the source counts as dead)."""
PULL_GRACE_S = 5.0
"""Extra time over pull_timeout_s before the pull task itself is cancelled (the puller's own
deadline should fire first)."""
CLOSE_WAIT_S = 1.0
"""At close, per cancellation of the pull task (``cancel_and_wait`` repeats it up to 3 times)."""
REPORT_DRAIN_S = 6.0
"""At close, for the reports of loads still being stored (``weights_loaded``: the engine may
have served turns with those weights already). One JetStream attempt whose ack a NATS restart
lost takes 2 s (``REQUEST_TIMEOUT_S``), the pause before the next up to 2 s. Within the replica's
stop bound (``STOP_BOUND_S``) and a finished job's grace before SIGKILL (15 s)."""

Emit = Callable[[str, dict[str, object]], Awaitable[None]]
Install = Callable[[int, str, dict[str, torch.Tensor], float], Awaitable[str | None]]
Have = Callable[[int, str, bool], Awaitable[None]]
"""Announces (version, checksum, complete) to the job's replicas (WeightsHave)."""


@dataclass
class Peer:
    version: int
    checksum: str
    address: str
    complete: bool = True  # False: it is pulling that version and relays what it holds so far


@dataclass
class LoaderState:
    """What the replica's phase and metrics need to know about loading."""

    loading: bool = False
    failed: bool = False
    failures: int = 0  # failed attempts at the version followed now
    sources_changed: asyncio.Event = field(default_factory=asyncio.Event)


def _norm(address: str, transport: str) -> str:
    return address if "://" in address else f"{transport}://{address}"


def _digest_of(ann: WeightsAnnounce) -> str:
    """The SHA-256 of the manifest ``ann`` names ("" when an inline one does not parse)."""
    if ann.manifest_digest:
        return ann.manifest_digest
    try:
        return Manifest.model_validate(ann.manifest).digest()
    except (ValueError, TypeError):
        return ""


class WeightLoader:
    """Follows announcements and loads each followed version into the engine, bounded.

    Args:
        cfg: the job's weight-sync settings (transport, deadline, attempts).
        member_id: for events.
        server: this replica's relay server (pulled chunks are served onward from it).
        layout: tensor name -> (dtype, shape) the engine's model expects.
        install: hands a verified state dict to the engine and waits for the swap; returns the
            checksum the engine holds after it ("" when the engine failed to load), or None if
            the swap timed out.
        emit: appends an event to the job's log.
        on_change: called when loading/failed changes (the replica republishes its phase).
        held: the (version, checksum) the engine serves now (or is swapping in).
        withdraw: withdraws weights handed to the engine and not taken by it yet (called before a
            new announcement is judged against ``held``, under the same lock as the engine's
            taking them: else the engine could take a superseded version right after).
        idle: called when a pull ends (however) and no other replaced it: the replica may owe
            peers a HAVE of the weights it holds (the pull's partial HAVE was the last they heard).
        have: announces a pull this replica starts (``complete=False``) to the other replicas;
            None announces nothing (the replica then relays only to peers that ask anyway).
        alloc: allocates the buffer a version is pulled into (the engine's ``alloc_buffer``:
            the vLLM engine's worker maps it, so the swap copies straight from it); None: the
            puller allocates plain memory.
        prepare: called with a pulled buffer once every chunk arrived, before the whole version
            is checked (the engine's ``prepare_buffer``: a hint that it is likely loaded next).
    """

    def __init__(self, cfg: WeightSyncSpec, member_id: str, server: WeightServer,
                 layout: dict[str, tuple[str, list[int]]], install: Install, emit: Emit,
                 on_change: Callable[[], Awaitable[None]], held: Callable[[], tuple[int, str]],
                 seed: int = 0, have: Have | None = None,
                 alloc: Callable[[int], np.ndarray] | None = None,
                 prepare: Callable[[np.ndarray], None] | None = None,
                 withdraw: Callable[[], None] | None = None,
                 idle: Callable[[], None] | None = None) -> None:
        self.cfg = cfg
        self.member_id = member_id
        self.server = server
        self.layout = layout
        self._install = install
        self._emit = emit
        self._on_change = on_change
        self._withdraw = withdraw
        self._idle = idle
        self._reports: set[asyncio.Task[None]] = set()  # shielded reports of loads (see _loaded)
        self._held = held
        self._seed = seed
        self._have = have
        self._alloc = alloc
        self._prepare = prepare
        self.announcements = Announcements()
        self.peers: dict[str, Peer] = {}
        self.state = LoaderState()
        self._task: asyncio.Task[None] | None = None
        self._reporting: asyncio.Task[None] | None = None  # the report of a follow that died

    # --- inputs ------------------------------------------------------------------------

    def offer(self, msg: WeightsAnnounce) -> None:
        """An announcement arrived (or was read from the weights pointer at start)."""
        verdict = self.announcements.offer(msg)
        if verdict in (Offer.STALE_EPOCH, Offer.OLDER):
            log.warning("ignoring v%d of epoch %d (%s; following epoch %d)", msg.version, msg.epoch,
                        verdict.value, self.announcements.newest_epoch)
            return
        if verdict is Offer.NEW and self._withdraw is not None:
            # The running pull is about to be cancelled (held already, or superseded): what it
            # handed to the engine and the engine has not taken must not be taken now.
            self._withdraw()
        if (msg.version, msg.checksum) == self._held():
            # The engine serves these weights already: nothing to pull, and no other pull may go
            # on either. After a rollback the new gang announces the checkpoint's version, whose
            # checksum is what a replica still serves; returning before this let the dead gang's
            # newer version, still being pulled, be installed under the new lineage.
            if verdict is Offer.NEW and self._task is not None and not self._task.done():
                log.warning("v%d (epoch %d), the weights held, announced while pulling: the pull stops",
                            msg.version, msg.epoch)
                self._task.cancel("the newest announcement names the weights already held")
            if verdict is Offer.NEW and (self.state.loading or self.state.failed):
                # The replica serves what the newest announcement names: it is neither loading nor
                # failed (the stopped pull set one of them, and only an install cleared them: a
                # healthy replica kept saying loading_weights / weights_failed and was replaced).
                self._reporting = asyncio.get_running_loop().create_task(self._settle_held())
            return
        if verdict is Offer.REPEAT and self._task is not None and not self._task.done():
            self.state.sources_changed.set()  # the running pull re-reads the sources
            return
        if self._task is not None and not self._task.done():
            log.info("v%d (epoch %d) announced while pulling: superseding the running pull", msg.version,
                     msg.epoch)
            self._task.cancel("superseded by a newer announcement")
        self._task = asyncio.create_task(self._follow(msg), name=f"pull-v{msg.version}")
        self._task.add_done_callback(self._done)

    def resync(self) -> None:
        """After a swap the loader did not see end (its pull was cancelled): if the engine does
        not hold what the newest announcement names and no pull runs, follow it again (a swap
        counted as held that then failed left the replica with no weights and nothing pulling)."""
        target = self.announcements.target
        if target is None or (self._task is not None and not self._task.done()):
            return
        if (target.version, target.checksum) == self._held():
            return
        log.warning("v%d (epoch %d) announced and not held after a swap ended: pulling it again",
                    target.version, target.epoch)
        self._task = asyncio.create_task(self._follow(target), name=f"pull-v{target.version}")
        self._task.add_done_callback(self._done)

    async def _settle_held(self) -> None:
        running = self._task
        if running is not None and not running.done():
            await asyncio.wait({running})  # cancelled just now: its last _set must not come after ours
        await self._set(loading=False, failed=False)

    def pulling(self) -> WeightsAnnounce | None:
        """The announcement whose version is being pulled now (this replica relays it meanwhile)."""
        running = self._task is not None and not self._task.done()
        return self.announcements.target if running else None

    def peer_has(self, member_id: str, version: int, checksum: str, address: str, complete: bool = True) -> None:
        """Another replica holds a version completely, or has started pulling it (``complete``
        False): either way a relay of that version."""
        old = self.peers.get(member_id)
        if (not complete and old is not None and old.complete
                and (old.version, old.checksum, old.address) == (version, checksum, address)):
            return  # a late partial announcement must not hide that it completed
        self.peers[member_id] = Peer(version, checksum, address, complete)
        target = self.announcements.target
        if target is not None and (version, checksum) == (target.version, target.checksum):
            self.state.sources_changed.set()

    async def close(self) -> None:
        """Stop following (bounded: a cancellation a wait swallowed is repeated, then the task is
        named and left; the replica's stop goes on)."""
        if self._task is not None and not self._task.done() and not await cancel_and_wait(self._task, CLOSE_WAIT_S):
            log.error("the weight pull task did not end %.0f s after its cancellation", CLOSE_WAIT_S)
        # A load's report outlives its pull (shielded, ``_verify_and_install``): one still being stored --
        # JetStream just back after an outage, the job ended meanwhile -- gets the time it needs
        # before the bus closes under it. Lost, the log would lack a version turns were made with.
        if self._reports:
            _, unstored = await asyncio.wait(set(self._reports), timeout=REPORT_DRAIN_S)
            if unstored:
                log.error("%d report(s) of a load not stored %.1f s into the stop: the job's log lacks them",
                          len(unstored), REPORT_DRAIN_S)

    def _done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            # (an event or phase publish failing inside the follow): the replica must not go on
            # saying it is loading, which no rule would ever question; it says it failed.
            log.error("weight pull task failed: %r", task.exception())
            if task is self._task:
                self._reporting = asyncio.get_running_loop().create_task(self._set(loading=False, failed=True))
        if task is self._task and self._idle is not None:
            self._idle()  # (a superseded pull's task is not ``_task`` any more: a newer one runs)

    # --- one version -------------------------------------------------------------------

    def _sources(self, ann: WeightsAnnounce, avoid: set[str]) -> list[str]:
        transport = self.cfg.transport
        peers = [p.address for p in self.peers.values() if (p.version, p.checksum) == (ann.version, ann.checksum)]
        every = [_norm(a, transport) for a in [*peers, *ann.sources]]
        preferred = [a for a in every if a not in avoid]
        return preferred or every  # never none at all: retrying the suspects beats waiting forever

    async def _follow(self, ann: WeightsAnnounce) -> None:
        st = self.state
        st.failures = 0
        avoid: set[str] = set()
        relay: WeightServer | None = self.server  # None once the version failed as a whole
        retry_s = RETRY_S
        started = time.monotonic()
        give_up_s = self.cfg.pull_timeout_s * self.cfg.pull_attempts
        gave_up = False
        if ann.version in self.server.versions() and not self.server.holds(ann.version, _digest_of(ann)):
            # This number's bytes of another lineage (a dead gang's, before the rollback): the HAVE
            # below makes this replica a source of the announced version, and peers taking those
            # bytes for it found every chunk corrupt and gave this relay up (and, with the
            # publisher gone, failed their pull as corrupt: an attempt counted; an outside review).
            self.server.drop_version(ann.version)
        if self._have is not None:
            # Before the manifest's round trip, so peers pulling the same version know each other
            # by the time their first HAVE round splits the publisher.
            try:
                await self._have(ann.version, ann.checksum, False)
            except (RobustRLError, OSError, TimeoutError) as exc:  # the pull works without it, sharing less
                log.warning("v%d: partial announcement not sent: %s", ann.version, exc)
        got = await self._manifest(ann, avoid, started, give_up_s)
        if got is None:
            return
        try:
            manifest = got if isinstance(got, Manifest) else Manifest.model_validate(got)
            manifest.check_matches(self.layout)
        except (ValueError, RobustRLError) as exc:
            # a layout this model cannot load: no retry can help
            await self._reject(ann, "layout", error=str(exc), final=True)
            await self._set(loading=False, failed=True)
            return
        while True:
            target = self.announcements.target
            if target is not None and (target.version, target.checksum) == (ann.version, ann.checksum):
                ann = target  # a repeat may carry newer sources
            await self._set(loading=True)
            t0 = time.monotonic()
            self.server.drop_version(manifest.version)  # never mix lineages of one version number
            try:
                buffer, stats = await within(
                    pull(manifest, lambda a=ann: self._sources(a, avoid), transport=self.cfg.transport,
                         relay=relay, into=None if self._alloc is None else self._alloc(manifest.total_bytes),
                         timeout_s=self.cfg.pull_timeout_s,
                         stall_timeout_s=min(STALL_TIMEOUT_S, self.cfg.pull_timeout_s), seed=self._seed,
                         origins=[_norm(a, self.cfg.transport) for a in ann.sources],
                         sources_changed=self.state.sources_changed),
                    self.cfg.pull_timeout_s + PULL_GRACE_S)
            except Exception as exc:  # noqa: BLE001 - whatever a peer provokes is a reported attempt
                # (an unexpected error type, from bytes off the wire or a peer's address off the
                # bus, ended the pull task with a log line only: no event, no report, no retry)
                self.server.drop_version(manifest.version)  # never relay a version we gave up on
                reason = str(getattr(exc, "reason", "")) or ("timeout" if isinstance(exc, TimeoutError) else "error")
                if reason == "unavailable":
                    log.warning("v%d: no live source holds it (%s); waiting for one", manifest.version, exc)
                    await self._set(loading=False)
                    if time.monotonic() - started >= give_up_s and not gave_up:
                        # Not our fault, but still a wait without end: past every attempt's time
                        # together the replica reports it (a re-announcement starts a new clock).
                        gave_up = True
                        await self._reject(ann, "unavailable", error=str(exc), final=True,
                                           waited_s=round(time.monotonic() - started, 3))
                        await self._set(failed=True)
                    await self._wait_sources(retry_s)
                    retry_s = min(2 * retry_s, MAX_RETRY_S)
                    continue
                await self._failed_attempt(ann, reason, error=str(exc))
            else:
                if await self._verify_and_install(ann, manifest, buffer, stats, t0, avoid):
                    return
                relay = None  # its chunks match a manifest whose weights do not: relay none of them
            await self._wait_sources(retry_s)
            retry_s = min(2 * retry_s, MAX_RETRY_S)

    async def _manifest(self, ann: WeightsAnnounce, avoid: set[str], started: float,
                        give_up_s: float) -> Manifest | dict[str, object] | None:
        """The announced version's manifest: inline, or fetched from a source and checked against
        the announced digest. Retried with back-off while no source serves it (the trainer may be
        restarting); past the pull attempts' time together the replica reports it and gives up
        (None). A re-announcement (maybe with new sources) starts the clock again, also one that
        arrives while the replica is reporting that it gave up (it would find the follow still
        running and only wake it: it was lost)."""
        if ann.manifest is not None:
            return ann.manifest
        retry_s = RETRY_S
        while True:
            target = self.announcements.target
            if target is not None and target is not ann and (target.version, target.checksum) == (
                    ann.version, ann.checksum):
                ann, started, retry_s = target, time.monotonic(), RETRY_S
            try:
                return await fetch_manifest(self._sources(ann, avoid), ann.version, ann.manifest_digest,
                                            transport=self.cfg.transport,
                                            timeout_s=min(STALL_TIMEOUT_S, self.cfg.pull_timeout_s), seed=self._seed)
            except Exception as exc:  # noqa: BLE001 - a bad source address, garbage on the wire: see _follow
                log.warning("v%d: manifest not fetched (%s)", ann.version, exc)
                reason = "unavailable" if isinstance(exc, WeightSyncError) else "error"
                if time.monotonic() - started >= give_up_s:
                    await self._reject(ann, str(getattr(exc, "reason", reason)), error=str(exc), final=True,
                                       waited_s=round(time.monotonic() - started, 3))
                    await self._set(loading=False, failed=True)
                    now = self.announcements.target
                    if now is ann or now is None or (now.version, now.checksum) != (ann.version, ann.checksum):
                        return None
                    continue  # re-announced meanwhile: try its sources
            await self._wait_sources(retry_s)
            retry_s = min(2 * retry_s, MAX_RETRY_S)

    async def _verify_and_install(self, ann: WeightsAnnounce, manifest: Manifest, buffer: np.ndarray,
                                  stats: PullStats, t0: float, avoid: set[str]) -> bool:
        state = unflatten(torch.from_numpy(buffer), manifest)
        if self._prepare is not None:
            try:
                self._prepare(buffer)
            except Exception as exc:  # noqa: BLE001 - a hint: the swap does without it
                log.warning("v%d: the engine's prepare_buffer failed (%r); loading without it", manifest.version, exc)
        got = await asyncio.to_thread(weights_checksum, state)
        if got != ann.checksum:
            # Every chunk matched the manifest, yet these are not the announced weights: drop
            # them from the relay, and prefer other sources next time.
            self.server.drop_version(manifest.version)
            avoid.update(stats.chunks_from)
            await self._failed_attempt(ann, "checksum_mismatch", got=got, checksum=got,
                                       sources=sorted(stats.chunks_from))
            return False
        if not self._still_followed(ann):
            # Superseded while the bytes were checked (a cancellation lands only at an await),
            # or the engine holds (or is swapping in) these very weights: never install weights
            # the replica no longer follows, nor the same ones twice.
            if (ann.version, ann.checksum) == self._held():
                await self._set(loading=False, failed=False)  # this follow is done: they are held
            else:
                self.server.drop_version(manifest.version)
                log.warning("v%d (epoch %d) verified after it was superseded: not installed", ann.version,
                            ann.epoch)
            return True
        if not self.server.is_complete(manifest.version):
            # pulled without relaying (a retry after a mismatch): it verified now, serve it onward
            self.server.add_version(manifest, buffer)
        loaded = await self._install(manifest.version, ann.checksum, state, self.cfg.pull_timeout_s)
        if loaded != ann.checksum:
            self.server.drop_version(manifest.version)
            if loaded is None:
                reason, error = "timeout", "the engine did not swap the weights in time"
            else:  # the engine failed to load them, or (asked to check) holds other weights
                reason, error = "load_mismatch", None if loaded else "the engine failed to load the weights"
            await self._failed_attempt(ann, reason, got=loaded or None, checksum=loaded or None, error=error)
            return False
        # The engine serves them now: the report must be made whatever cancels this pull from
        # here on (a new announcement), or the event log would lack a version turns were made with.
        report = asyncio.create_task(self._loaded(ann, manifest, stats, t0, loaded))
        self._reports.add(report)
        report.add_done_callback(self._reports.discard)
        await asyncio.shield(report)
        return True

    async def _loaded(self, ann: WeightsAnnounce, manifest: Manifest, stats: PullStats, t0: float,
                      loaded: str) -> None:
        await self._set(loading=False, failed=False)
        await self._emit("weights_loaded", {
            "member_id": self.member_id, "version": manifest.version, "epoch": ann.epoch,
            "checksum": loaded, "verified": True, "pull_s": time.monotonic() - t0,
            "bytes": stats.bytes_received, "sources": len(stats.chunks_from),
            "chunks": manifest.num_chunks, "origin_chunks": sum(
                n for a, n in stats.chunks_from.items() if a in {_norm(o, self.cfg.transport) for o in ann.sources}),
            "corrupt_chunks": stats.corrupt_chunks})
        log.info("loaded v%d (epoch %d) in %.2fs (%d B, from %s)", manifest.version, ann.epoch,
                 time.monotonic() - t0, stats.bytes_received, stats.chunks_from)

    def _still_followed(self, ann: WeightsAnnounce) -> bool:
        """Whether ``ann``'s weights are still the ones to load (the newest announcement names
        them, and the engine does not serve them already)."""
        target = self.announcements.target
        return (target is not None and (target.epoch, target.version, target.checksum) == (
            ann.epoch, ann.version, ann.checksum) and (ann.version, ann.checksum) != self._held())

    async def _failed_attempt(self, ann: WeightsAnnounce, reason: str, **data: object) -> None:
        self.state.failures += 1
        final = self.state.failures >= self.cfg.pull_attempts
        log.error("v%d attempt %d/%d failed: %s %s", ann.version, self.state.failures, self.cfg.pull_attempts,
                  reason, data)
        await self._reject(ann, reason, final=final, **data)
        if final and not self.state.failed:
            await self._set(failed=True)  # the report; the controller decides what to do

    async def _reject(self, ann: WeightsAnnounce, reason: str, *, final: bool, **data: object) -> None:
        await self._emit("weights_rejected", {
            "member_id": self.member_id, "version": ann.version, "epoch": ann.epoch, "expected": ann.checksum,
            "reason": reason, "attempt": self.state.failures, "attempts_allowed": self.cfg.pull_attempts,
            "final": final, **{k: v for k, v in data.items() if v is not None}})
        # ``checksum`` (auditor's key) is that of the bytes rejected, when they were all pulled:
        # a later load of the announced weights from a good source is then no violation.

    async def _wait_sources(self, delay_s: float) -> None:
        """Until a source may have appeared (a repeat announcement, a relay's HAVE) or
        ``delay_s`` passed: a back-off that ends early for a reason."""
        ev = self.state.sources_changed
        ev.clear()
        await wait_event(ev, delay_s)

    async def _set(self, *, loading: bool | None = None, failed: bool | None = None) -> None:
        st = self.state
        changed = False
        if loading is not None and loading != st.loading:
            st.loading, changed = loading, True
        if failed is not None and failed != st.failed:
            st.failed, changed = failed, True
        if changed:
            try:
                await self._on_change()
            except Exception as exc:  # noqa: BLE001 - the state is set; the metrics carry the phase
                # (NATS away: the phase change was lost, not the load. Raised, it skipped the
                # ``weights_loaded`` that follows, and the follow's failure marked a replica that
                # serves the new weights failed: replaced though healthy; an outside review.)
                log.warning("phase change not published (%r): the next metrics sample carries it", exc)
