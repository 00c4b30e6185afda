"""Rollout replica: a generation engine behind NATS, with weight pull and relay.

Turn requests queue up; a worker thread decodes whatever is queued as one batch (many
episodes at once, KV cache), publishing each turn tagged with the weights version that
produced it. A new version is pulled in the background from the trainer ranks and from
other replicas (relays), verified chunk by chunk and as a whole, swapped in between batches,
and then served onward (:mod:`robustrl.services.rollout.loader`). A replica never serves a
version that mixes two versions or that failed verification.

Liveness: the metrics sample reports every queued turn (``queue_depth``, including turns
waiting for a version the replica does not hold yet), so a replica whose engine takes no work
is a stall to the detector, not idleness; the phase says ``loading_weights`` while a pull runs
(bounded by the detector's ``weights_load_s``) and ``weights_failed`` once the pulls of the
followed version failed ``weights.pull_attempts`` times.

Events: a replica's ``weights_loaded`` / ``weights_rejected`` / ``fault_struck`` are saved in the job's rollout
outbox in Redis before they are queued for the log, and a starting replica appends what replicas
killed before it left there (:mod:`robustrl.services.rollout.events`).
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from robustrl.aio import cancel_and_wait, wait_event, within
from robustrl.bus import DRAIN_TIMEOUT_S
from robustrl.config import Settings
from robustrl.errors import MessageError, TransportError
from robustrl.gpu import GpuProbe
from robustrl.member import Identity, Member
from robustrl.messages import (
    REFUSAL_ERROR_MAX, GenerateTurn, MetricsSample, StruckData, TurnResult, WeightsAnnounce, WeightsHave,
    decode,
)
from robustrl.model.engine import GenerationAborted, GenRequest
from robustrl.model.engines import make_engine
from robustrl.services.rollout.events import ReplicaEvents
from robustrl.services.rollout.loader import WeightLoader
from robustrl.services.rollout.standby import ENGINE_JOIN_S, StandbyHook, become_trainer, keep_listening, policy_from_served
from robustrl.storage.redis_stores import WeightsPointer, connect
from robustrl.subjects import Verb, subject, wildcard
from robustrl.weights.server import WeightServer

log = logging.getLogger(__name__)
BATCH_WAIT_S = 0.01
STRIKE_SAVE_S = 1.0
"""How long an armed crash waits for its ``fault_struck`` to be saved (Redis answers in
milliseconds; the outbox call is cut at 0.25 s) before it strikes regardless."""
STOP_BOUND_S = 10.0
"""How long a stopped (not borrowed) replica may take to close before it exits anyway (its
loader's reports of loads still being stored take up to ``loader.REPORT_DRAIN_S`` of it)."""
SEED_LIMIT = 2**63  # a turn's seed must fit every engine's generator (a signed 64-bit seed)
SWAP_WAIT_SLICE_S = 0.25  # a wait for the engine thread's swap polls in slices this long
POINTER_POLL_S = 2.0
"""How often a replica reads the weights pointer (one Redis GET) in case an announcement was lost."""
POINTER_READ_S = 5.0
"""Bound on one read of the weights pointer."""
POINTER_CLOSE_S = 1.0
"""Bound on stopping the pointer's watch, and on closing the Redis client (the pointer's and the
rollout outbox's) at stop (a borrow must not wait on it)."""
VERIFY_LOADS_ENV = "ROBUSTRL_VERIFY_LOADS"


class ReplicaMember(Member):
    """A member whose metrics sample counts the replica's queued turns at sampling time, so the
    count stays true even when the engine thread that takes turns is dead."""

    queued: Callable[[], int] = staticmethod(lambda: 0)  # type: ignore[assignment]

    def sample(self) -> MetricsSample:
        self.queue_depth = self.queued()
        return super().sample()


@dataclass
class PendingWeights:
    """A verified state dict waiting for the engine thread to swap it in between batches."""

    version: int
    checksum: str
    state: dict[str, torch.Tensor]
    swapped: threading.Event
    loaded: str | None = None  # the checksum the engine holds after the swap ("" when the load failed)
    taken: bool = False
    """The engine thread took them (under the swap lock): the swap is under way or done and can no
    longer be withdrawn."""


class Replica:
    def __init__(self, ident: Identity, settings: Settings, env: Mapping[str, str] | None = None) -> None:
        self.ident = ident
        self.settings = settings
        self.member = ReplicaMember(ident, settings)
        self.requests: queue.Queue[GenerateTurn] = queue.Queue()
        self.member.queued = self.requests.qsize
        self.version = -1
        self.checksum = ""
        self._pending: PendingWeights | None = None
        self._swap_lock = threading.Lock()
        self._swapping: PendingWeights | None = None  # taken by the engine thread, not swapped in yet
        self._late: set[asyncio.Task[None]] = set()  # reports of swaps whose pulls were superseded
        self._owed: set[asyncio.Task[None]] = set()  # HAVEs of held weights owed after a pull ended
        self._said: tuple[int, str, bool] | None = None
        """The last HAVE this replica published (version, checksum, complete): peers keep one
        announcement per replica, the last, so this is what they believe it relays."""
        self._working = False
        self._awaiting = False  # every queued turn needs a version newer than the one held
        self._crash_at_token = False  # an armed crash this batch carries out (mid_batch; mid_tool_turn: a turn after a tool result)
        self.standby = StandbyHook(env or {}, self.member.stopping.set)
        """Warm standby: the launcher may hand this process over to a trainer rank (standby.py)."""
        self.engine_thread: threading.Thread | None = None
        self.stop_phase = "running"
        """Where the stop sequence is (named in the log if closing hangs)."""
        self.served: dict[str, torch.Tensor] | None = None
        """The version the engine serves, as the tensors it was loaded from (views into the
        buffer it was pulled into), kept only for an engine with no model in this process
        (vLLM): a borrowed replica builds the trainer's policy from it."""
        self.verify_loads = (env or {}).get(VERIFY_LOADS_ENV, "") not in ("", "0")
        """Audit mode: the engine also checksums each version it loaded (off the hot path by
        default: the loader verified the bytes before the swap, the swap itself only copies)."""

    async def run(self) -> None:
        spec = await self.member.start()
        self.spec = spec
        assert self.member.bus
        # The weights pointer's reads and the rollout outbox share one client (lazy: it connects
        # on its first call). The outbox's upkeep starts at once: what replicas killed before this
        # one left is appended while the engine loads.
        redis = connect(self.settings.redis_url)
        self.events = ReplicaEvents(self.member.bus, self.ident.job_id, redis)
        self.events.start_upkeep()
        self.standby.install(asyncio.get_running_loop())
        torch.set_num_threads(1)
        torch.manual_seed(spec.seed)
        self.loop = asyncio.get_running_loop()
        # rollout.engine picks the engine (torch | vllm); the factory also loads the tokenizer.
        self.engine, self.tok = await asyncio.to_thread(make_engine, spec)
        # The torch engine's model (None for vLLM, whose model lives in vLLM's engine process).
        self.model = getattr(self.engine, "model", None)
        if self.model is not None:
            # NVML's first calls off the loop: a failing device can block in the driver.
            self.member.gpu = await asyncio.to_thread(GpuProbe.for_device, next(self.model.parameters()).device)
        self.server = WeightServer(spec.weights.transport, host=self.settings.bind_host,
                                   port=self.settings.weights_port, max_versions=2)
        self.address = await self.server.start()
        self.loader = WeightLoader(spec.weights, self.ident.member_id, self.server, self.engine.layout(),
                                   install=self._install, emit=self._emit, on_change=self._refresh_phase,
                                   held=self._held, withdraw=self._withdraw, idle=self._pull_ended,
                                   seed=hash(self.ident.member_id) & 0xFFFF, have=self._publish_have,
                                   alloc=self.engine.alloc_buffer, prepare=self.engine.prepare_buffer)
        bus = self.member.bus
        assert bus
        job = self.ident.job_id
        await bus.subscribe(subject(job, Verb.GENERATE, self.ident.member_id), GenerateTurn, self._on_request)
        await bus.subscribe(subject(job, Verb.WEIGHTS), WeightsAnnounce, self._on_announce)
        await bus.subscribe(wildcard(job, Verb.HAVE), WeightsHave, self._on_have)
        await self.member.hello(self.address)
        await self.member.set_phase("idle")
        worker = threading.Thread(target=self._worker, name="engine", daemon=True)
        worker.start()
        self.engine_thread = worker
        # The watch's first read is at once: a late joiner or replacement pulls the current
        # version from any relay.
        recheck = asyncio.Event()
        recheck.set()

        async def after_reconnect() -> None:
            recheck.set()

        bus.on_reconnect.append(after_reconnect)
        watch = asyncio.create_task(self._watch_pointer(WeightsPointer(redis, job), recheck),
                                    name="weights-pointer")
        await self.member.stopping.wait()
        log.info("stopping%s", " (borrowed: switching role)" if self.standby.handoff is not None else "")
        stop_t0 = time.monotonic()
        if self.standby.handoff is not None:
            # The model is about to train: the batch being decoded on it ends now (its turns were
            # re-dispatched when the replica was drained).
            self.engine.abort()
        else:
            # Stopped for good: closing is bounded. A close that hangs (seen at a job's end: a
            # replica that never closed its bus after SIGTERM, SIGKILLed after the controller's
            # 15 s grace) is named in the log and the process exits.
            _bound_stop(self, STOP_BOUND_S)
        self.stop_phase = "stopping the weights pointer's watch"
        await cancel_and_wait(watch, POINTER_CLOSE_S)
        with self._swap_lock:  # the engine thread takes no more weights: release a waiting install
            if self._pending is not None:
                self._pending.swapped.set()
        if self.standby.handoff is not None and self.engine_thread is not None:
            # The engine closes next: the thread must be out of it first (a vLLM abort is a call
            # into the engine's loop, which closing stops). Bounded: become_trainer exits if not.
            self.stop_phase = "waiting for the engine thread"
            await asyncio.to_thread(self.engine_thread.join, ENGINE_JOIN_S)
        self.stop_phase = "closing the weight loader"
        await self.loader.close()
        self.stop_phase = "closing the relay server"
        await self.server.close()
        self.stop_phase = "closing the engine"
        await asyncio.to_thread(self.engine.close)
        # The events still queued (a late swap's report, one JetStream has not stored yet) get what
        # is left of the stop's bound, less NATS's own drain and close (each bounded by
        # DRAIN_TIMEOUT_S), the Redis client's close and a second to exit. What is not stored by
        # then stays in the rollout outbox: a live or later replica of the job appends it.
        self.stop_phase = "storing the replica's events"
        await self.events.close(grace_s=max(0.5, STOP_BOUND_S - 1.0 - POINTER_CLOSE_S - 2 * DRAIN_TIMEOUT_S
                                            - (time.monotonic() - stop_t0)))
        self.stop_phase = "closing the Redis client"
        try:
            await within(redis.aclose(), POINTER_CLOSE_S)
        except Exception as exc:  # noqa: BLE001 - a Redis client that cannot close must not stop the stop
            log.debug("Redis client not closed: %r", exc)
        self.stop_phase = "closing the member (bus)"
        await self.member.close(drain_s=max(0.5, STOP_BOUND_S - 1.0 - 2 * DRAIN_TIMEOUT_S
                                            - (time.monotonic() - stop_t0)))
        # Not "closed" yet: asyncio.run still cancels and awaits what is left (a task that
        # swallowed its cancellation would hold the exit): the bound stays armed until main().
        self.stop_phase = "ending the event loop"

    # --- phase -------------------------------------------------------------------------------

    def _phase(self) -> str:
        """One phase from the replica's state: a reported failure wins, then serving (tokens
        flow, so progress is visible), then loading, else idle."""
        if self.loader.state.failed:
            return "weights_failed"
        if self._working:
            return "serving"
        if self.loader.state.loading or self._swapping is not None:
            return "loading_weights"  # (a swap under way, also one whose pull was cancelled)
        # Turns queued, none servable with the version held: they wait for a version the trainer
        # has not made yet (after a trainer rollback the new gang announces a lower version, and
        # the turns dispatched before it need the old gang's newest again). Not a stall: the
        # detector exempts this phase; the request manager's step deadline bounds it.
        return "awaiting_version" if self._awaiting else "idle"

    async def _refresh_phase(self) -> None:
        await self.member.set_phase(self._phase())

    def _refresh_phase_from_thread(self) -> None:
        asyncio.run_coroutine_threadsafe(self._refresh_phase(), self.loop)

    # --- weights ----------------------------------------------------------------------------

    async def _on_have(self, msg: WeightsHave, _s: str, _r: str | None) -> None:
        if msg.member_id == self.ident.member_id:
            return
        new_peer = msg.member_id not in self.loader.peers
        self.loader.peer_has(msg.member_id, msg.version, msg.checksum, msg.address, msg.complete)
        if new_peer and self.standby.handoff is None:
            # A replica this one has not heard of (a replacement, a late joiner: it announces the
            # version it starts pulling) missed every HAVE sent before it subscribed. If the
            # publisher is gone meanwhile (a trainer recovery), this relay is its only source: say
            # again, once per new peer, what this replica holds and serves, or the newer version it
            # is pulling and relays meanwhile (peers keep one announcement per replica: the one it
            # holds would hide that it relays the newer one).
            pulling = self.loader.pulling()
            try:
                if pulling is not None and (pulling.version, pulling.checksum) != (self.version, self.checksum):
                    await self._publish_have(pulling.version, pulling.checksum, False)
                elif self.version >= 0 and self.server.is_complete(self.version):
                    await self._publish_have(self.version, self.checksum, True)
            except Exception as exc:  # a dropped connection is the detector's business
                log.debug("HAVE for a new peer not sent: %s", exc)

    async def _publish_have(self, version: int, checksum: str, complete: bool) -> None:
        assert self.member.bus
        # Recorded before the publish queues the message (it does so before it first awaits):
        # whatever judges next what peers heard last sees this one.
        self._said = (version, checksum, complete)
        try:
            await self.member.bus.publish(
                subject(self.ident.job_id, Verb.HAVE, self.ident.member_id),
                WeightsHave(job_id=self.ident.job_id, member_id=self.ident.member_id, version=version,
                            address=self.address, checksum=checksum, complete=complete))
        except Exception:
            self._said = None  # maybe never sent: the held weights' HAVE is owed again
            raise

    async def _on_announce(self, msg: WeightsAnnounce, _s: str, _r: str | None) -> None:
        self.loader.offer(msg)

    async def _watch_pointer(self, pointer: WeightsPointer, recheck: asyncio.Event) -> None:
        """Read the weights pointer every ``POINTER_POLL_S`` (and right after a NATS reconnect):
        an announcement lost on the bus must not leave this replica on an old version until the
        request manager's weights deadline replaces it. Core NATS drops what the trainer published
        while this replica's subscription was not yet back on a restarted server, and a cut-off
        link drops it outright; the pointer is the gang's fenced record of the same announcement.
        A newer announcement there than the one followed is offered as if it had arrived."""
        failing = False
        while not self.member.stopping.is_set():
            await wait_event(recheck, POINTER_POLL_S)
            recheck.clear()
            try:
                raw = await within(pointer.get(), POINTER_READ_S)
                ann = decode(WeightsAnnounce, raw) if raw else None
            except (TimeoutError, TransportError, MessageError) as exc:
                # once per outage at WARNING, not every poll of it
                log.log(logging.DEBUG if failing else logging.WARNING, "weights pointer not read: %s", exc)
                failing = True
                continue
            if failing:
                log.info("weights pointer read again")
                failing = False
            if self.standby.handoff is not None or self.member.stopping.is_set():
                return  # borrowed (it trains now, it pulls nothing) or stopping
            if ann is None:
                continue
            # Offered only if newer than what this replica follows: one it holds, pulls or gave
            # up on (failed verification, all sources down) is the loader's business already.
            known = self.loader.announcements.target
            if known is None or (ann.epoch, ann.version) > (known.epoch, known.version):
                log.info("weights pointer names v%d (epoch %d), not announced to this replica: pulling it",
                         ann.version, ann.epoch)
                self.loader.offer(ann)

    async def _emit(self, kind: str, data: dict[str, object]) -> None:
        """Save the event in the job's rollout outbox (bounded: the serving path never waits on
        Redis) and queue it for the log (``ReplicaEvents``)."""
        await self.events.emit(kind, data)

    def _held(self) -> tuple[int, str]:
        """The weights the engine serves, or, while it swaps weights in, those it will serve: a
        swap under way cannot be withdrawn, so an announcement naming the weights served before
        it is no longer "held already" (a rollback announced during a swap of the dead gang's
        newer version was taken as held, and the replica served that version for good)."""
        with self._swap_lock:
            swapping = self._swapping
        if swapping is not None:
            return swapping.version, swapping.checksum
        return self.version, self.checksum

    def _withdraw(self) -> None:
        """Withdraw weights handed to the engine thread and not taken yet (their waiter returns)."""
        with self._swap_lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            pending.swapped.set()

    async def _swap_done(self, mine: PendingWeights, timeout_s: float | None) -> bool:
        """Wait until ``mine``'s swap ended (or it was released), up to ``timeout_s`` (None: until
        the replica stops). In short slices: a cancelled wait leaves no thread behind for long (a
        stop joins the executor's threads: one waiting out a whole pull timeout held the stop)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not mine.swapped.is_set() and not self.member.stopping.is_set():
            left = SWAP_WAIT_SLICE_S if deadline is None else min(SWAP_WAIT_SLICE_S, deadline - time.monotonic())
            if left <= 0:
                break
            await asyncio.to_thread(mine.swapped.wait, left)
        return mine.swapped.is_set()

    async def _install(self, version: int, checksum: str, state: dict[str, torch.Tensor],
                       timeout_s: float) -> str | None:
        """Hand verified weights to the engine thread; wait until it swapped them in.

        The engine must take them within ``timeout_s``, else they are withdrawn, unless a batch is
        decoding and made tokens over that time (it is waited for, window by window). Once taken, a swap
        cannot be withdrawn: it is waited for however long it takes (an engine stuck in it stays
        ``loading_weights``, which the detector's ``weights_load_s`` rule reports). Before, a swap
        slower than ``timeout_s`` was reported a timeout while the engine completed it and served
        that version with no ``weights_loaded``. A swap taken and then abandoned (the pull
        superseded by a newer announcement) is reported when it ends (``_report_late``).

        Returns:
            The checksum of the engine's weights after the swap ("" if the engine failed to load
            them), or None if the engine did not take them within ``timeout_s`` or the replica
            stops.
        """
        mine = PendingWeights(version, checksum, state, threading.Event())
        with self._swap_lock:
            if self._pending is not None:
                self._pending.swapped.set()  # superseded before the engine took it: release its waiter
            self._pending = mine
        try:
            seen = self.member.activity
            swapped = await self._swap_done(mine, timeout_s)
            while (not swapped and not mine.taken and self._working and self.member.activity != seen
                   and not self.member.stopping.is_set()):
                # Not taken, because a batch is still decoding (the engine takes weights only
                # between batches), and tokens flowed over the window: a healthy long batch, not
                # a stalled engine. Before, the weights were withdrawn and reported a timeout, and
                # after ``pull_attempts`` windows a healthy replica said ``weights_failed`` and was
                # replaced. Waited for while tokens flow; a window with none withdraws them.
                log.info("weights v%d: a batch is still decoding (%d tokens in %.1f s); waiting for its end",
                         version, self.member.activity - seen, timeout_s)
                seen = self.member.activity
                swapped = await self._swap_done(mine, timeout_s)
            if not swapped:
                with self._swap_lock:
                    taken = mine.taken
                    if self._pending is mine:  # not taken: withdrawn
                        self._pending = None
                if taken and not self.member.stopping.is_set():
                    log.warning("weights v%d: the engine took them %.1f s ago and is still swapping them in; "
                                "a swap under way cannot be withdrawn: waiting for it", version, timeout_s)
                    swapped = await self._swap_done(mine, None)
            if (not swapped or mine.loaded is None) and self.member.stopping.is_set():
                # The wait ended because the replica stops (or its stop released weights not taken
                # yet), not because the engine was too slow: the pull is cancelled, nothing is
                # reported. A timeout here was logged as a rejected version, which the detector,
                # the auditor and the run report read as bad weights.
                raise asyncio.CancelledError("the replica stops")
            if not swapped or mine.loaded is None:
                return None
            if mine.loaded == checksum:
                try:
                    await self._publish_have(version, checksum, True)
                except TransportError as exc:  # the engine holds them: the load stands
                    log.warning("weights v%d: HAVE not sent (%s); owed, sent once the pull ends", version, exc)
            return mine.loaded
        except asyncio.CancelledError:
            with self._swap_lock:
                taken = mine.taken
                if self._pending is mine:
                    self._pending = None
            if taken and not self.member.stopping.is_set():
                # under way or done: the engine serves them (or failed to): say so once it ends
                self._late.add(task := asyncio.get_running_loop().create_task(self._report_late(mine)))
                task.add_done_callback(self._late.discard)
            raise

    async def _report_late(self, mine: PendingWeights) -> None:
        """A swap the engine had begun when its pull was superseded: when it ends, the event log
        says what the engine loaded (it may serve turns with it before the next swap), and the
        relay says it holds it if that is still the last word peers should hear (``_owes_have``)."""
        if not await self._swap_done(mine, None):
            return
        if mine.loaded != mine.checksum:
            self.loader.resync()  # a swap counted as held failed: the announced weights are pulled again
            return
        log.warning("weights v%d: swapped in after its pull was superseded (reported now)", mine.version)
        try:
            await self._say_held()
            await self._emit("weights_loaded", {"member_id": self.ident.member_id, "version": mine.version,
                                                "checksum": mine.checksum, "verified": True, "late": True})
        except Exception as exc:  # noqa: BLE001 - whatever failed, the resync below must happen
            log.error("weights v%d: late load not reported: %r", mine.version, exc)
        self.loader.resync()  # the newest announcement may name other weights: follow them

    def _pull_ended(self) -> None:
        """The loader's pull ended and none replaced it (loaded, given up, or stopped because the
        newest announcement names the weights held, as after a rollback to them): its partial HAVE
        may have been the last word peers heard, and a late swap's HAVE may have been held back
        for it. Whatever the order of swap end, pull end and announcement, the last of them finds
        the HAVE owed (``_say_held``)."""
        if self.member.stopping.is_set():
            return
        self._owed.add(task := asyncio.get_running_loop().create_task(self._say_owed()))
        task.add_done_callback(self._owed.discard)

    async def _say_owed(self) -> None:
        try:
            await self._say_held()
        except Exception as exc:  # noqa: BLE001 - a dropped connection is the detector's business
            log.warning("weights v%d: HAVE of the held weights not sent: %s", self.version, exc)

    async def _say_held(self) -> None:
        """Announce that this replica holds its weights completely, if that is the last word peers
        should hear from it (``_owes_have``) and not what they heard last (once per change)."""
        if self._owes_have():
            await self._publish_have(self.version, self.checksum, True)

    def _owes_have(self) -> bool:
        """Whether "holds the served weights completely" is what peers should hear last from this
        replica and is not what they heard last: the engine serves them (no swap under way), the
        relay server holds them, and no pull of other weights runs. Peers keep one announcement
        per replica, the last: a late swap's HAVE sent after the partial HAVE of the pull that
        superseded it, or after the next swap's HAVE, made them take this replica for a relay of
        the older version only, and pull the newer one elsewhere; and a HAVE never sent once that
        pull stopped (a rollback to the held version) left them, and the controller ending a
        replacement's recovery, with the partial one. Judged and published in one step of the
        event loop (the publish queues the message before it first awaits), so no other HAVE of
        this replica can come between."""
        if self.standby.handoff is not None or self.member.stopping.is_set() or self.version < 0:
            return False  # borrowed or stopping: it relays nothing any more
        with self._swap_lock:
            if self._swapping is not None:
                return False  # its end says what the engine holds then (``_report_late``, ``_install``)
        held = (self.version, self.checksum)
        pulling = self.loader.pulling()
        return ((pulling is None or (pulling.version, pulling.checksum) == held)
                and self.server.is_complete(self.version) and self._said != (*held, True))

    def _apply_pending(self) -> None:
        """Engine thread, between batches: swap in the pending (verified) weights. The swap
        copies only; with ``ROBUSTRL_VERIFY_LOADS`` the engine checks them once more."""
        with self._swap_lock:
            pending, self._pending = self._pending, None
            if pending is None:
                return
            pending.taken = True
            self._swapping = pending
        log.info("weights v%d: the engine takes them (swapping them in)", pending.version)
        try:
            self._swap(pending)
        finally:
            with self._swap_lock:
                self._swapping = None
            pending.swapped.set()
            self._refresh_phase_from_thread()

    def _swap(self, pending: PendingWeights) -> None:
        self.member.chaos.gate()  # a stalled engine thread stalls its swaps too
        t0 = time.monotonic()
        try:
            self.engine.load_weights(pending.state, pending.version,
                                     checksum=pending.checksum if self.verify_loads else "")
            got = pending.checksum
        except Exception as exc:  # noqa: BLE001 - any engine failure: serve nothing from it
            log.error("weights v%d: the engine failed to load them: %r", pending.version, exc)
            got = str(getattr(exc, "got", "") or "")  # asked to check: the checksum the engine found
        log.info("weights v%d swapped into the %s engine in %.4fs", pending.version, self.engine.name,
                 time.monotonic() - t0)
        if got == pending.checksum:
            self.version, self.checksum = pending.version, got
            if self.model is None:
                self.served = pending.state
        else:
            # The state verified before loading, so the load itself went wrong: serve nothing
            # rather than these weights (every turn needs a version >= 0) until a pull succeeds.
            log.error("weights v%d checksum mismatch after load: %s != %s", pending.version, got,
                      pending.checksum)
            self.version, self.checksum = -1, ""
            self.served = None
        self.member.weights_version = self.version
        pending.loaded = got

    # --- generation -------------------------------------------------------------------------

    async def _on_request(self, msg: GenerateTurn, _s: str, _r: str | None) -> None:
        problem = self._undecodable(msg)
        if problem is not None:
            # Before, such a turn raised in the engine thread (IndexError, an overflow), which
            # died: the replica answered probes and served nothing more, its batch's turns lost.
            log.error("turn %s (episode %s, step %d) refused: %s", msg.request_id, msg.episode_id, msg.step, problem)
            await self._refuse(msg, "input", problem)
            return
        self.requests.put(msg)

    async def _refuse(self, msg: GenerateTurn, why: Literal["input", "engine"], error: str) -> None:
        """Tell the request manager this replica did not decode ``msg`` and why (a ``TurnResult``
        with ``refused`` set): it sends the turn elsewhere at once and names the refusal in the
        log. Before, the turn got no answer: it waited out its deadline, and one that every
        replica refused was never named. A refusal the bus does not take is only logged (the
        turn's deadline still sends it elsewhere)."""
        out = TurnResult(job_id=msg.job_id, request_id=msg.request_id, episode_id=msg.episode_id,
                         member_id=self.ident.member_id, token_ids=[], logprobs=[], stop_reason="length",
                         weights_version=self.version, refused=why, error=error[:REFUSAL_ERROR_MAX])
        try:
            assert self.member.bus
            await self.member.bus.publish(subject(msg.job_id, Verb.TURN), out)
        except TransportError as exc:
            log.warning("turn %s: the refusal was not sent: %s", msg.request_id, exc)

    def _undecodable(self, msg: GenerateTurn) -> str | None:
        """Why no engine can decode ``msg`` (None: it can be tried). The schema bounds ids below
        only; a publisher allowed to send turns can send any."""
        vocab = self.tok.vocab_size
        outside = [t for t in msg.prefix_ids if t >= vocab]
        if outside:
            return f"token id {outside[0]} is outside the vocabulary (size {vocab})"
        if not 0 <= msg.seed < SEED_LIMIT:
            return f"seed {msg.seed} is outside [0, 2**63)"
        return None

    def _worker(self) -> None:
        """The engine thread. A failure outside any turn's decode (a bug here, not an input) ends
        the process, named in the log: its turns are re-dispatched from their prefixes, as on a
        crash. Before, the thread died alone and the replica, alive to every probe, served nothing
        more. Borrowed (a hand-off under way) or stopping, the thread just ends."""
        try:
            self._serve()
        except Exception:
            if self.standby.handoff is not None or self.member.stopping.is_set():
                log.warning("the engine thread ended while the replica stops", exc_info=True)
                return
            log.critical("the engine thread failed: the replica exits", exc_info=True)
            _exit_now(1)

    def _serve(self) -> None:
        while not self.member.stopping.is_set():
            self._apply_pending()
            try:
                first = self.requests.get(timeout=BATCH_WAIT_S)
            except queue.Empty:
                self._set_awaiting(False)
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
                    self.requests.put(m)  # too new for our weights: wait for the pull (counted as queued)
            if not ready:
                if self._working:
                    self._working = False  # nothing servable: loading or idle, not serving
                    self._refresh_phase_from_thread()
                self._set_awaiting(True)
                time.sleep(BATCH_WAIT_S)  # a pull is under way; the requests wait for it
                continue
            self._set_awaiting(False)
            # In flight before the chaos gate: a stalled replica holding work must look busy.
            self.member.inflight = len(ready)
            self.member.chaos.gate()
            try:
                self._run_batch(ready)
            except GenerationAborted:
                return  # borrowed (the hand-off's abort): the request manager re-dispatches these turns
            except Exception as exc:  # noqa: BLE001 - which turn? Each is tried alone
                log.error("a batch of %d turns failed (%r): decoding each alone", len(ready), exc)
                if not self._run_alone(ready):
                    return
            self.member.inflight = 0

    def _run_alone(self, turns: list[GenerateTurn]) -> bool:
        """Decode ``turns`` one by one after their batch failed: a turn that fails alone is
        refused (logged by request id, and the request manager told: it sends the turn elsewhere
        at once, and reports a replica whose engine keeps refusing), the others are served.
        Returns False once the replica is borrowed (the hand-off's abort)."""
        for m in turns:
            try:
                self._run_batch([m])
            except GenerationAborted:
                return False
            except Exception as exc:  # noqa: BLE001 - this turn's, whatever it is
                log.error("turn %s (episode %s, step %d) refused: the engine failed on it: %r",
                          m.request_id, m.episode_id, m.step, exc)
                asyncio.run_coroutine_threadsafe(
                    self._refuse(m, "engine", f"the engine failed on it: {exc!r}"), self.loop)
        return True

    def _set_awaiting(self, awaiting: bool) -> None:
        if awaiting != self._awaiting:
            self._awaiting = awaiting
            self._refresh_phase_from_thread()

    def _on_token(self, n: int) -> None:
        if self._crash_at_token:
            self._strike()
        # the throughput metric counts what the engine says it generated (vLLM: its own
        # per-iteration stats); ``n``, this call's share of the stream, is liveness
        self.member.tokens_total = self.engine.tokens_generated
        self.member.activity += n
        delay = self.member.chaos.slow_delay(0.002)
        self.member.chaos.gate()
        if delay:
            time.sleep(delay)

    def _strike(self) -> None:
        """Carry out the armed crash (engine thread), saying first when it struck: ``fault_struck``
        in the job's rollout outbox (``_emit``: bounded; the replica's replacement, or any other
        replica, appends what a dead replica left there). Before, the moment was not logged: an
        armed crash's detection delay was unknown, and an arming that never struck looked like one
        that struck and went unnoticed."""
        chaos = self.member.chaos
        log.warning("chaos: crashing %s (a batch is being decoded)", chaos.crash_moment)
        try:
            data = StruckData(fault_id=chaos.crash_fault_id, member_id=self.ident.member_id,
                              moment=chaos.crash_moment).model_dump()  # (the event's shape, from its owner)
            asyncio.run_coroutine_threadsafe(self._emit("fault_struck", data), self.loop).result(timeout=STRIKE_SAVE_S)
        except Exception:  # noqa: BLE001 - the crash is the point: it happens whatever the log says
            log.warning("chaos: fault_struck not saved; crashing anyway", exc_info=True)
        chaos.crash()

    def _run_batch(self, batch: list[GenerateTurn]) -> None:
        self._working = True
        self._refresh_phase_from_thread()
        t0 = time.monotonic()
        reqs = [GenRequest(m.request_id, m.prefix_ids, m.max_new_tokens, m.temperature, m.top_p, m.seed,
                           m.stop_on_call) for m in batch]
        chaos = self.member.chaos
        self._crash_at_token = chaos.crash_armed() and (chaos.crash_moment == "mid_batch"
                                                        or any(m.turn > 0 for m in batch))
        try:
            results = self.engine.generate(reqs, on_token=self._on_token,
                                           should_abort=lambda: self.standby.handoff is not None)
        except Exception:
            if self.requests.empty():  # a failed batch serves nothing: no longer "serving"
                self._working = False
                self._refresh_phase_from_thread()
            raise
        dt = time.monotonic() - t0
        version, checksum = self.version, self.checksum  # (both set together, in this thread)
        for m, r in zip(batch, results, strict=True):
            out = TurnResult(job_id=m.job_id, request_id=m.request_id, episode_id=m.episode_id,
                             member_id=self.ident.member_id, token_ids=r.token_ids, logprobs=r.logprobs,
                             stop_reason=r.stop_reason, weights_version=version, weights_checksum=checksum,
                             gen_s=dt)
            assert self.member.bus
            asyncio.run_coroutine_threadsafe(
                self.member.bus.publish(subject(m.job_id, Verb.TURN), out), self.loop)
        if self.requests.empty():
            self._working = False
            self._refresh_phase_from_thread()


def _log_stacks(loop: asyncio.AbstractEventLoop | None) -> None:
    """Where a stop that overran its bound is stuck: every thread's stack and every task's
    coroutine stack, in the log (read from another thread: a diagnosis, best effort)."""
    try:
        frames = sys._current_frames()
        for thread in threading.enumerate():
            frame = frames.get(thread.ident or -1)
            if frame is not None:
                log.error("thread %s:\n%s", thread.name, "".join(traceback.format_stack(frame)))
        for task in list(asyncio.all_tasks(loop)) if loop is not None else []:
            out = io.StringIO()
            task.print_stack(file=out)
            log.error("task %s:\n%s", task.get_name(), out.getvalue())
    except Exception:  # noqa: BLE001 - the exit must happen whatever the diagnosis does
        log.exception("could not log the stacks")


def _exit_now(code: int) -> None:
    """Exit now, with the engine's own processes. os._exit skips multiprocessing's cleanup: an
    engine's processes (vLLM's EngineCore and workers, holding the KV cache) would outlive the
    replica."""
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            child.kill()
    except Exception:  # best effort on the way out
        log.exception("could not kill the replica's child processes")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _bound_stop(replica: Replica, seconds: float) -> None:
    """Exit the process if the replica is still closing ``seconds`` from now (a thread: it fires
    even if the event loop is blocked), naming the close it was in."""

    def expire() -> None:
        if replica.stop_phase == "closed":
            return
        log.error("still %s %.0f s after the stop: exiting", replica.stop_phase, seconds)
        _log_stacks(getattr(replica, "loop", None))
        _exit_now(0)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


def main() -> None:
    from robustrl.member import configure_logging

    ident = Identity.from_env(os.environ)
    configure_logging(ident.member_id)
    settings = Settings.from_env(os.environ)
    replica = Replica(ident, settings, dict(os.environ))
    asyncio.run(replica.run())
    replica.stop_phase = "closed"
    if replica.standby.handoff is not None:  # borrowed: the same process goes on as a trainer rank
        hook = keep_listening(replica.standby.handoff)
        model = replica.model
        if model is None:
            # vLLM: its engine (and the model in its worker process) is shut down by now; the
            # policy is built here from the version the replica served.
            model = policy_from_served(replica.spec.model, replica.served)
            log.info("trainer policy %s", f"built from the served v{replica.version}" if model is not None
                     else "left to the trainer to build (no served version to build it from)")
            replica.served = None  # the receive buffer goes with the last view of it
        become_trainer(replica.standby.handoff, model, replica.engine_thread, ident.member_id, hook)
        return
    # Stopped: engine, relay server and bus are closed. Exit without the interpreter's teardown
    # of a torch process (4-10 s per member at a job's end on a loaded machine; the controller
    # waits for every member's exit before the job is finished).
    log.info("replica stopped; exiting")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
