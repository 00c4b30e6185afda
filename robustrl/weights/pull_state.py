"""One pull's shared state: its sources and their HAVE rounds, and each chunk's arrival.

``_PullCore`` holds what both ways of scheduling a pull share (see :mod:`robustrl.weights.puller`):
the sources and what they hold (HAVE rounds, backing off while answers do not change), the
destination buffer, the check of each chunk that arrives (and its relaying onward), and whether
the pull has stalled or some chunk is held by no live source. Fetching by index
(:mod:`robustrl.weights.fetching`) and subscriptions (:mod:`robustrl.weights.subscribing`) build
on it; :class:`robustrl.weights.puller._Pull` runs them.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

import numpy as np

from robustrl.aio import within
from robustrl.errors import TransportError, WeightSyncError
from robustrl.weights.manifest import Manifest
from robustrl.weights.pull_stats import PullStats, Transfer
from robustrl.weights.server import WeightServer
from robustrl.weights.sources import _Index, _Source, _with_scheme
from robustrl.weights.transport import TransportClient, make_client

Sources = list[str] | Callable[[], list[str]]

HAVE_INTERVAL_MAX_S = 0.25
"""Longest gap between HAVE rounds while nothing changes (the backoff's ceiling)."""
WAIT_POLL_CHUNKS = 0.5
"""With nothing in flight (waiting for relays to get chunks), HAVE rounds are at least this many
chunk-transfer times apart: every 10 ms, 16 pullers waiting on 15 relays each sent 3.8-4.4 HAVE
requests per chunk received and kept the testbed's 2 cores 88% busy."""
POLLS_PER_CHUNK = 0.5
"""While chunks arrive, a HAVE round to k partial sources waits for k x this many chunks received
(so the HAVE requests per chunk received stay <= about 2)."""

# Subscription knobs the shared state reads (``_stalled``; the receive limit set at the start);
# the others live in ``subscribing``.
STARVE_S = 2.0
"""With other sources (relays), a puller asks publishers only for chunks they never sent. After
this long (and ``STARVE_CHUNKS`` chunk times) with nothing received it asks them impatiently: any
chunk it wants, sent again if need be (relays that died holding the only copies, frozen relays)."""
STARVE_CHUNKS = 4.0
RECEIVE_STREAMS = 1
"""Chunks a subscriber receives at once (it passes other offers as busy): one at a time, each
chunk has the downlink to itself, and no source's upload slot is held by a chunk that arrives at
a fraction of the link rate (on the shared 2-core machine two at once measured 2.1-2.5
copy-times at 16 replicas, one 1.8-2.0).
The next is taken ``NEAR_DONE`` before the current one is in, so the offer's round trip overlaps
its last bytes."""
STALLED_POLL_S = 0.25
"""A subscribing puller asks HAVE only when no chunk has arrived or been on its way this long (and
2 chunk times) since a source failed, or when starving: to tell a gone publisher (unavailable)
from relays still filling."""


class _PullCore:
    """State of one pull, shared by its two ways of scheduling; see :func:`robustrl.weights.puller.pull`."""

    def __init__(self, manifest: Manifest, sources: Sources, transport: str, relay: WeightServer | None,
                 into: np.ndarray | None, stall_timeout_s: float, connect_timeout_s: float,
                 max_inflight: int, per_source_inflight: int, have_interval_s: float,
                 unavailable_grace_s: float, seed: int | None, origins: list[str] | None = None,
                 sources_changed: asyncio.Event | None = None) -> None:
        self.m = manifest
        self.sources_changed = sources_changed
        self.wake_task: asyncio.Task[None] | None = None  # waits on sources_changed
        self.origins = None if origins is None else {_with_scheme(a, transport) for a in origins}
        # subscriptions (see the module docstring) when this puller relays: its sources schedule
        self.push = relay is not None and relay.address is not None
        self.last_progress = time.perf_counter()
        self.sources_arg = sources
        self.transport = transport
        self.relay = relay
        if into is None:
            into = np.empty(manifest.total_bytes, dtype=np.uint8)
        if into.nbytes < manifest.total_bytes:
            raise WeightSyncError("destination buffer too small", version=manifest.version)
        self.buffer = into
        self.view = memoryview(into.reshape(-1).view(np.uint8)).cast("B")
        self.stall_timeout_s = stall_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_inflight = max_inflight
        self.per_source_inflight = per_source_inflight
        self.have_interval_s = have_interval_s
        self.unavailable_grace_s = unavailable_grace_s
        rng = random.Random(seed)
        self.rng = rng
        order = list(range(manifest.num_chunks))
        rng.shuffle(order)
        self.rank = {chunk: pos for pos, chunk in enumerate(order)}
        self.pending: set[int] = set(order)
        self.inflight: dict[asyncio.Task[None], int] = {}  # FETCH tasks -> chunk
        self.sources: dict[str, _Source] = {}
        self.stats = PullStats()
        self.t0 = time.perf_counter()
        self.unavailable_since: float | None = None
        self.refresh_task: asyncio.Task[None] | None = None
        self.last_refresh = -1e9
        self.index = _Index(manifest.num_chunks, self.rank)
        self.interval = have_interval_s  # grows while HAVE answers do not change
        self.changed = False  # some answer of the running round changed
        self.received_at_refresh = 0  # chunks received when the last round started
        self.asked_last = 0  # sources asked in the last round
        self.chunk_s = 0.0  # moving average of one chunk's transfer time (0: none yet)
        # subscriptions
        self.want = np.ones(manifest.num_chunks, dtype=bool)  # pending and not on its way to us
        self.assigned: dict[int, _Source] = {}  # chunk -> the source sending it to us
        self.streams: dict[str, tuple[int, TransportClient, int]] = {}  # source -> (chunk, client, bytes before)
        self.starting = 0  # chunks taken whose bytes have not started to arrive
        self.start_s = 0.0  # moving average of the time from an offer (not queued) to its chunk's first bytes
        self.subs: dict[_Source, asyncio.Task[None]] = {}
        self.receive_streams = min(max_inflight, RECEIVE_STREAMS)
        self.patient = True
        self.resync = False  # our wants grew (a chunk on its way failed): tell every source
        self.shares: dict[str, np.ndarray] = {}  # publisher -> chunks asked of it while patient
        self.tell_task: asyncio.Task[None] | None = None
        self.listed_at = -1e9
        self.last_activity = self.t0  # a chunk arrived or started arriving

    # -- sources ----------------------------------------------------------------------------

    def _list_sources(self) -> None:
        addresses = self.sources_arg() if callable(self.sources_arg) else self.sources_arg
        for address in addresses:
            address = _with_scheme(address, self.transport)
            if self.relay is not None and address == self.relay.address:
                continue  # never pull from ourselves
            if address not in self.sources:
                self.sources[address] = _Source(address, tiebreak=self.rng.random())

    def _live(self) -> list[_Source]:
        return [s for s in self.sources.values() if not s.dead]

    async def _kill(self, source: _Source) -> None:
        if source.dead:
            return
        self.index.drop(source)
        self.stats.failed_sources.append(source.address)
        clients = [*source.idle, *(c for c in (source.control, source.sub) if c is not None)]
        source.idle.clear()
        source.control = None
        source.sub = None
        for client in clients:
            await client.close()

    async def _connect(self, address: str) -> TransportClient:
        client = make_client(address)
        await client.connect(self.connect_timeout_s)
        return client

    async def _ask(self, source: _Source) -> None:
        try:
            async with source.lock:
                if source.dead:
                    return
                if source.control is None:
                    source.control = await self._connect(source.address)
                    source.control.decode_have = False  # the index compares the raw bitmaps
                self.stats.control_msgs += 1
                self.stats.have_requests += 1
                have = await within(source.control.have(self.m.version, self.m.num_chunks),
                                    self.stall_timeout_s)
            control = source.control
            if source.dead or control is None:
                return
            payload = control.have_payload
            changed = (self.index.answer(source, payload) if payload is not None
                       else self.index.update(source, have, frozenset()))  # MISSING: holds none of it
        except (TransportError, TimeoutError, OSError, WeightSyncError):  # down, or an answer that is no HAVE
            await self._kill(source)
            return
        self.changed = self.changed or changed
        source.missing = payload is None
        if not source.asked:  # its first answer: a publisher, or a relay of this version?
            source.origin = (source.address in self.origins if self.origins is not None
                             else source.complete)
        source.load = control.load
        source.served, source.fetched = control.served, 0
        source.asked = True

    async def _refresh(self) -> None:
        self._list_sources()
        # A complete source's answer cannot change (its load comes with every chunk it sends).
        asked = [s for s in self._live() if not (s.asked and s.complete)]
        self.asked_last = len(asked)
        self.changed = False
        await asyncio.gather(*(self._ask(s) for s in asked))
        # Back off while nothing changes; answer changes at once when something does.
        self.interval = self.have_interval_s if self.changed else min(self.interval * 2, HAVE_INTERVAL_MAX_S)

    def _busy(self) -> bool:
        """Chunks on their way to us."""
        return bool(self.assigned) if self.push else bool(self.inflight)

    def _round_gap(self) -> float:
        """Least time between two HAVE rounds: the interval, and with nothing in flight at least
        ``WAIT_POLL_CHUNKS`` chunk times."""
        return self.interval if self._busy() else max(self.interval, WAIT_POLL_CHUNKS * self.chunk_s)

    def _received(self) -> int:
        return sum(self.stats.chunks_from.values())

    def _maybe_refresh(self, now: float) -> None:
        if self.refresh_task is not None or now - self.last_refresh < self._round_gap():
            return
        # While chunks are arriving, a round waits for its share of them: HAVE requests per chunk
        # received stay bounded however many relays there are. With nothing in flight (waiting for
        # a relay to get something), the interval alone decides.
        if self.push and not self._stalled(now):
            return  # chunks find us without HAVE answers
        elif self._busy() and self._received() - self.received_at_refresh < self.asked_last * POLLS_PER_CHUNK:
            return
        self.last_refresh = now
        self.received_at_refresh = self._received()
        self.refresh_task = asyncio.create_task(self._refresh(), name="weights-have")

    # -- availability and arrival ----------------------------------------------------------------

    def _check_available(self, now: float) -> None:
        live = self._live()
        if any(not s.asked for s in live):
            return  # still waiting for first answers
        holders, any_bad = self.index.holders, any(s.bad for s in live)
        missing = [c for c in self.pending
                   if holders[c] == 0 or (any_bad and not any(c in s.have and c not in s.bad for s in live))]
        if not missing:
            self.unavailable_since = None
            return
        if self.unavailable_since is None:
            self.unavailable_since = now
        elif now - self.unavailable_since >= self.unavailable_grace_s:
            # Sent corrupt by some source: the bytes on offer are wrong (a fault to count);
            # otherwise nobody alive holds them (the publisher died: wait for a re-announcement).
            lied = sorted(c for c in missing if any(c in s.bad for s in self.sources.values()))
            reason = "corrupt" if lied else "unavailable"
            raise WeightSyncError(f"no live source holds a good copy of some chunks of this version ({reason})",
                                  version=self.m.version, chunk=(lied or [min(missing)])[0], missing=len(missing),
                                  failed_sources=list(self.stats.failed_sources), reason=reason)

    async def _arrived(self, chunk: int, source: _Source, start: float) -> None:
        """Chunk ``chunk`` is in the buffer, from ``source``: verify it and take it."""
        entry = self.m.chunks[chunk]
        dest = self.view[entry.offset:entry.offset + entry.nbytes]
        self.stats.bytes_received += entry.nbytes
        if self.m.hash == "sha256":
            # ~1.5 GiB/s and GIL-free: verify in a thread while the next chunk is on the wire
            good = await asyncio.to_thread(self.m.verify_chunk, chunk, dest)
        else:
            # XXH3 runs at ~10x the wire speed; a thread hop would cost more than the hash
            good = self.m.verify_chunk(chunk, dest)
        end = time.perf_counter() - self.t0
        self.chunk_s = end - start if self.chunk_s == 0.0 else 0.8 * self.chunk_s + 0.2 * (end - start)
        self.stats.schedule.append(Transfer(chunk, source.address, start, end, entry.nbytes, good))
        if not good:
            self.stats.corrupt_chunks += 1
            self.stats.bytes_resent += entry.nbytes
            self.index.mark_bad(source, chunk)
            return
        self.pending.discard(chunk)
        self.want[chunk] = False
        self.last_progress = self.last_activity = time.perf_counter()
        self.stats.chunks_from[source.address] = self.stats.chunks_from.get(source.address, 0) + 1
        if self.relay is not None:
            self.relay.mark_chunk(self.m.version, chunk)

    def _idle_for(self, now: float) -> float:
        """Seconds with no chunk arriving or starting to arrive (0 while one is on the wire)."""
        return 0.0 if self.streams else now - self.last_activity

    def _starving(self, now: float) -> bool:
        return self._idle_for(now) > max(STARVE_S, STARVE_CHUNKS * self.chunk_s)

    def _stalled(self, now: float) -> bool:
        """Time to ask HAVE (is some chunk held by no live source, or only by liars?): starving,
        or idle a while since a source failed or sent a corrupt chunk (a publisher that died
        leaves chunks only it held; no source offers a chunk again to whom it sent it corrupt)."""
        troubled = self.stats.failed_sources or self.stats.corrupt_chunks
        if troubled and self._idle_for(now) > max(STALLED_POLL_S, 2 * self.chunk_s):
            return True
        return self._starving(now)
