"""Multi-source pull of one weight version, with checksum checks, failover and relaying.

``pull`` fetches every chunk of a manifest from whichever source holds it: trainer ranks
(publishers: complete) or other replicas relaying the same version (partial, growing).

A replica that relays (``relay`` given) lets its sources schedule: it subscribes once to every
source with the bitmap of the chunks it still wants, and a source with an upload slot free offers
it chunks it holds (``transport.py``, ``server.py``); the puller takes one (or passes: none
wanted, or busy receiving, until a time it names). Its bitmap rides along on every answer and
leaves out the chunks on their way to it, so two sources never send it the same chunk. A chunk a
relay has just verified thus goes out to a subscriber at once: availability is pushed by the
offers, with no HAVE poll between a chunk's arrival at a relay and its next hop, and no upload
slot idles while a subscriber wants a chunk its source holds. A subscriber receives one chunk at
a time (``RECEIVE_STREAMS``), each at the full rate of its link, and takes the next one when the
current one is nearly in (``NEAR_DONE``; sooner if the offer says its bytes will follow another
upload, ``QUEUED_START``); where getting a chunk started takes longer than its bytes (small chunks,
fast links) it keeps several on their way. Publishers offer a patient subscriber (one with other
sources) only chunks they never sent, so each chunk leaves a publisher about once and the
replicas start out holding different chunks; such a fresh chunk is taken even while receiving
another (``FRESH_STREAMS``: the publisher's uplink is the only source of new chunks). A puller
that has received nothing for ``STARVE_S`` turns impatient (any chunk it wants, sent again if
need be). HAVE is asked only when chunks stopped coming (to tell a dead publisher from relays
still filling up).

Why: on the testbed (``bench/weight_sync.py --testbed``, results in
``bench/results/weight_sync_testbed.json``), index pulls with HAVE polling left links idle most
of the time - replicas waited on stale availability, and the trainer, sending all its chunks at
once, delivered the first of them a whole copy-time late, so relays had nothing to relay.

A puller without a relay (a late joiner, a loader that does not serve onward) fetches chunks by
index (FETCH): it picks the rarest chunk first (ties broken by a per-puller random order) from
the least-loaded source holding it. Picking is O(sources x log chunks): each source keeps a heap
of the pending chunks it holds keyed by rarity, kept current from HAVE differences
(:class:`_Index`), instead of scanning every chunk x source per pick.

Both ways, the puller

* asks sources which chunks they hold (HAVE; by index: every source, re-asking only the partial
  ones - a complete source's answer cannot change - no sooner than ``have_interval_s`` apart,
  backing off while answers do not change, and while chunks are arriving only as often as they
  arrive, so control messages stay a small constant per chunk, ``PullStats.control_msgs``); new
  sources come from a callable;
* verifies each chunk's checksum (XXH3-128 inline; legacy SHA-256 manifests in a worker thread
  while the next chunk is on the wire); a bad chunk is discarded and refetched elsewhere;
* when a source dies or stalls mid-chunk it is dropped for the rest of the pull, completed
  chunks are kept, and the chunk in flight is refetched elsewhere;
* marks each verified chunk into ``relay`` so this replica serves it onward at once;
* raises a retryable WeightSyncError when some chunk stays unavailable from every live source,
  with ``reason``: ``unavailable`` (e.g. the trainer died mid-version and no relay completed
  that chunk), ``corrupt`` (the only copies on offer failed their checksum) or ``timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import heapq
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from robustrl.aio import cancel_and_wait, within
from robustrl.errors import TransportError, WeightSyncError
from robustrl.weights.manifest import Manifest
from robustrl.weights.server import WeightServer
from robustrl.weights.transport import (
    Offer,
    Op,
    Status,
    SubMessage,
    TransportClient,
    have_reply_size,
    make_client,
)

Sources = list[str] | Callable[[], list[str]]
T = TypeVar("T")

PROGRESS_CHECKS = 4
"""A chunk's progress is looked at this many times per stall timeout: a source that stops sending
is dropped at most a quarter of the timeout late."""
SLOW_SOURCE_BYTES_PER_S = 1024 * 1024
"""Slowest rate at which a source may send one chunk: beyond ``stall_s + nbytes / this`` it is
dropped like a stalled one (a throttled relay that still trickles bytes held its chunk until the
whole pull timed out, while the publisher or another relay could have sent it)."""


def chunk_limit_s(stall_s: float, nbytes: int) -> float:
    """Longest a source may take to send one chunk of ``nbytes`` (``until_stalled``'s ``limit_s``)."""
    return stall_s + nbytes / SLOW_SOURCE_BYTES_PER_S


async def until_stalled(aw: Awaitable[T], progress: Callable[[], int], stall_s: float,
                        limit_s: float | None = None) -> T:
    """``await aw``, raising TimeoutError once ``progress()`` (bytes received) has not grown for
    ``stall_s`` (counted from the start until the first byte).

    A chunk's bytes are bounded by a gap without progress, not by their total time: a 64 MiB chunk
    on a 100 Mbit/s link takes 5.4 s and its source is healthy, while a frozen source sends
    nothing and is dropped as soon as before. (The UCX client counts a chunk's bytes only once
    all are in, so there the bound stays on the whole chunk.) ``limit_s`` bounds the whole chunk
    too (``chunk_limit_s``: a source slower than ``SLOW_SOURCE_BYTES_PER_S`` that still trickles).
    """
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(aw)
    seen, since = progress(), loop.time()
    end = None if limit_s is None else since + limit_s
    try:
        while True:
            if end is not None and loop.time() >= end:
                raise TimeoutError(f"slower than {limit_s:.1f} s for one chunk")
            left = since + stall_s - loop.time()
            if end is not None:
                left = min(left, end - loop.time())
            done, _ = await asyncio.wait({task}, timeout=max(0.0, min(left, stall_s / PROGRESS_CHECKS)))
            if done:
                return task.result()
            now = progress()
            if now != seen:
                seen, since = now, loop.time()
            elif loop.time() - since >= stall_s:
                raise TimeoutError(f"no bytes for {stall_s:.1f} s")
    finally:
        if not task.done():  # timed out or cancelled: stop reading before the caller closes the client
            await cancel_and_wait(task, stall_s)


@dataclass(frozen=True, slots=True)
class Transfer:
    """One chunk received: from where, and when (seconds since the pull started)."""

    chunk: int
    source: str
    start_s: float
    end_s: float
    nbytes: int
    ok: bool


@dataclass
class PullStats:
    """What one pull cost. ``bytes_resent`` counts received bytes that had to be fetched again
    (partial chunks from failed sources, corrupt chunks)."""

    bytes_received: int = 0
    bytes_resent: int = 0
    chunks_from: dict[str, int] = field(default_factory=dict)
    corrupt_chunks: int = 0
    failed_sources: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    schedule: list[Transfer] = field(default_factory=list)
    control_msgs: int = 0
    """Messages this puller sent that moved no chunk: HAVE requests, CANCELs, and chunk requests
    answered without one (chunks received: ``sum(chunks_from.values())``)."""
    offers: int = 0
    """Offers sources made to this puller (subscriptions); ``passed_busy`` and ``passed_none`` of
    them it passed (receiving at its limit; nothing in them wanted)."""
    passed_busy: int = 0
    passed_none: int = 0
    have_requests: int = 0
    """HAVE requests sent (part of ``control_msgs``)."""
    sub_messages: int = 0
    """Subscriptions and their updates sent (part of ``control_msgs``)."""
    pick_s: list[float] = field(default_factory=list)
    """Seconds each chunk pick took here (the scheduling cost per chunk; with subscriptions, the
    answer to an offer: the source's pick is ``WeightServer.pick_s``)."""


@dataclass(eq=False)
class _Source:
    address: str
    have: set[int] = field(default_factory=set)
    pending: set[int] = field(default_factory=set)  # chunks the source's own puller is fetching
    load: int = 0  # reported by the source in its last reply
    served: int = 0  # chunks of this version it had uploaded at its last HAVE (all pullers)
    fetched: int = 0  # chunks we fetched from it since that HAVE
    inflight: int = 0  # our requests on the wire to it
    dead: bool = False
    asked: bool = False  # answered at least one HAVE
    bad: set[int] = field(default_factory=set)  # chunks it sent corrupt
    idle: list[TransportClient] = field(default_factory=list)
    control: TransportClient | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one HAVE at a time on `control`
    tiebreak: float = 0.0  # per-puller random: equally loaded sources are picked in different orders
    heap: list[tuple[int, int, int]] = field(default_factory=list)  # (rarity, rank, chunk), see _Index
    complete: bool = False  # holds every chunk: never asked again, never a relay to wait for
    origin: bool = False  # a publisher of the version (a trainer rank), not a relay
    missing: bool = False  # its last answer: it does not hold or pull this version at all
    bits: tuple[np.ndarray, np.ndarray] | None = None  # last HAVE bitmaps (held, pending), unpacked
    not_before: float = 0.0  # no subscription to it before this (it had not got the version)
    absent: int = 0  # subscriptions it answered MISSING in a row
    sub: TransportClient | None = None  # our subscription's connection (with a relay of our own)
    sub_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one message at a time on `sub`


HAVE_INTERVAL_MAX_S = 0.25
"""Longest gap between HAVE rounds while nothing changes (the backoff's ceiling)."""
WAIT_POLL_CHUNKS = 0.5
"""With nothing in flight (waiting for relays to get chunks), HAVE rounds are at least this many
chunk-transfer times apart: every 10 ms, 16 pullers waiting on 15 relays each sent 3.8-4.4 HAVE
requests per chunk received and kept the testbed's 2 cores 88% busy."""
POLLS_PER_CHUNK = 0.5
"""While chunks arrive, a HAVE round to k partial sources waits for k x this many chunks received
(so the HAVE requests per chunk received stay <= about 2)."""


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
FRESH_STREAMS = 2
"""Chunks a subscriber receives at once when the extra one is fresh from a publisher (the rarest
a chunk can be): the publisher's uplink, the only source of new chunks, never waits for a
subscriber that is busy with a relay's chunk."""
NEAR_DONE = 0.25
"""How much (in chunks) a chunk taken may overlap those still arriving (0.15 and 0.5 measured no
better, within the machine's noise)."""
QUEUED_START = 0.5
"""Chunk-times until a queued offer's bytes start (see ``OFFER_QUEUED``)."""
BUSY_MIN_S = 0.002
BUSY_MAX_S = 1.0
BUSY_DEFAULT_S = 0.02
"""A busy subscriber asks to be offered again when a stream stops counting, estimated from the
chunk times measured so far (this default before any), within [BUSY_MIN_S, BUSY_MAX_S]."""
RESUBSCRIBE_S = 0.05
RESUBSCRIBE_MAX_S = 2.0
"""A source that answered a subscription MISSING (it has not registered the version yet, or
dropped it) is subscribed to again after ``RESUBSCRIBE_S``, doubling each time it answers so
again, up to ``RESUBSCRIBE_MAX_S``."""
LIST_SOURCES_S = 0.25
"""How often a subscribing puller re-reads its sources (a callable: late relays), unless told at
once that they changed (``sources_changed``)."""
STALLED_POLL_S = 0.25
"""A subscribing puller asks HAVE only when no chunk has arrived or been on its way this long (and
2 chunk times) since a source failed, or when starving: to tell a gone publisher (unavailable)
from relays still filling."""


_MIX1, _MIX2, _GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def owners(addresses: list[str], num_chunks: int) -> np.ndarray:
    """Index into ``addresses`` of each chunk's owner: rendezvous hashing (the highest score of
    (address, chunk) wins), so pullers that list the same members agree with no coordination,
    each member owns about 1/len of the chunks, and a member leaving moves only its own chunks."""
    chunks = np.arange(num_chunks, dtype=np.uint64)
    scores = np.empty((len(addresses), num_chunks), dtype=np.uint64)
    for i, address in enumerate(addresses):
        seed = np.uint64(int.from_bytes(hashlib.blake2b(address.encode(), digest_size=8).digest(), "little"))
        z = chunks * _GOLDEN + seed  # splitmix64 of (chunk, address): uint64 arithmetic wraps
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        scores[i] = z ^ (z >> np.uint64(31))
    return scores.argmax(axis=0)


def _bitmap_changes(old: np.ndarray | None, new: np.ndarray) -> tuple[list[int], list[int]]:
    """(set, cleared) indices between two unpacked 0/1 bitmaps: O(chunks) in numpy, not Python."""
    if old is None:
        return np.flatnonzero(new).tolist(), []
    changed = np.flatnonzero(old != new)
    if changed.size == 0:
        return [], []
    now = new[changed].astype(bool)
    return changed[now].tolist(), changed[~now].tolist()


class _Index:
    """Which chunk to fetch next: rarity counts kept from HAVE differences, and per source a heap
    of the chunks it holds keyed by (rarity, this puller's rank of the chunk).

    A HAVE answer costs O(chunks that changed) here (the bitmaps are compared in numpy). Heap
    entries go stale as rarity changes; a stale entry is re-keyed when it reaches the top (rarity
    only grows while a version spreads; when it drops - a source died or lost a chunk - fresh
    entries are pushed to the remaining holders). A complete source (the trainer) does not offer
    a chunk that some relay holds or is fetching (``cover``); when that cover drops to zero the
    chunk is offered to the complete sources again.
    """

    def __init__(self, n: int, rank: dict[int, int]) -> None:
        self.n = n
        self.rank = rank
        self.holders = [0] * n
        self.coming = [0] * n
        self.cover = [0] * n
        self.sources: list[_Source] = []

    def key(self, chunk: int) -> int:
        return self.holders[chunk] + self.coming[chunk]

    def _push(self, source: _Source, chunk: int) -> None:
        heapq.heappush(source.heap, (self.key(chunk), self.rank[chunk], chunk))

    @staticmethod
    def _covers(source: _Source, chunk: int) -> bool:
        """Does this source count as a relay that holds (a good copy of) or is fetching ``chunk``?"""
        return (not source.complete and not source.dead
                and ((chunk in source.have and chunk not in source.bad) or chunk in source.pending))

    def _covered(self, source: _Source) -> set[int]:
        if source.complete or source.dead:
            return set()
        return (source.have - source.bad) | source.pending

    def answer(self, source: _Source, payload: bytes) -> bool:
        """Take a source's HAVE payload (``encode_have_reply``); return whether anything changed.

        Raises:
            WeightSyncError: (``reason="corrupt"``) the payload's length does not fit this
                version's chunk count; nothing is changed (bitmaps of another length would make
                the next answer's comparison fail).
        """
        if len(payload) != have_reply_size(self.n):
            raise WeightSyncError("HAVE answer does not fit the version's chunk count", source=source.address,
                                  nbytes=len(payload), want=have_reply_size(self.n), reason="corrupt")
        size = (self.n + 7) // 8
        raw = np.frombuffer(payload, dtype=np.uint8)
        held = np.unpackbits(raw[:size], bitorder="little")[:self.n]
        fetching = np.unpackbits(raw[size:2 * size], bitorder="little")[:self.n]
        old = source.bits
        if old is None and (source.have or source.pending):  # after update(): compare with its sets
            old = (np.zeros(self.n, dtype=np.uint8), np.zeros(self.n, dtype=np.uint8))
            old[0][list(source.have)] = 1
            old[1][list(source.pending)] = 1
        source.bits = (held, fetching)
        add_h, rm_h = _bitmap_changes(old[0] if old else None, held)
        add_p, rm_p = _bitmap_changes(old[1] if old else None, fetching)
        return self.apply(source, add_h, rm_h, add_p, rm_p)

    def update(self, source: _Source, have: set[int] | frozenset[int], pending: set[int] | frozenset[int]) -> bool:
        """Take a source's holdings as whole sets (tests, a MISSING answer); see :meth:`answer`."""
        source.bits = None  # the next HAVE answer is compared against these sets, from scratch
        return self.apply(source, list(set(have) - source.have), list(source.have - set(have)),
                          list(set(pending) - source.pending), list(source.pending - set(pending)))

    def apply(self, source: _Source, add_h: list[int], rm_h: list[int], add_p: list[int], rm_p: list[int]) -> bool:
        if source not in self.sources:
            self.sources.append(source)
        if not (add_h or rm_h or add_p or rm_p):
            return False
        becomes_complete = len(source.have) + len(add_h) - len(rm_h) >= self.n
        # A source that turns complete stops covering anything (relays' chunks are not left to
        # it); one that stops being complete (it dropped a chunk or the version) covers all it
        # holds or fetches again, and offers every chunk it holds as a relay.
        flips = becomes_complete != source.complete
        changed = (*add_h, *rm_h, *add_p, *rm_p)
        before = self._covered(source) if flips else {c for c in changed if self._covers(source, c)}
        for c in add_h:
            self.holders[c] += 1
        for c in rm_h:
            self.holders[c] -= 1
        for c in add_p:
            self.coming[c] += 1
        for c in rm_p:
            self.coming[c] -= 1
        source.have.update(add_h)
        source.have.difference_update(rm_h)
        source.pending.update(add_p)
        source.pending.difference_update(rm_p)
        source.complete = becomes_complete
        after = self._covered(source) if flips else {c for c in changed if self._covers(source, c)}
        self._recover(before, after)
        for c in (source.have if flips and not becomes_complete else add_h):
            self._push(source, c)
        self._refresh_holders(rm_h)
        return True

    def drop(self, source: _Source) -> None:
        """A source died: it holds and fetches nothing any more."""
        before = self._covered(source)
        for c in source.have:
            self.holders[c] -= 1
        for c in source.pending:
            self.coming[c] -= 1
        lost = list(source.have)
        source.have, source.pending, source.heap, source.bits = set(), set(), [], None
        source.dead = True
        self._recover(before, set())
        self._refresh_holders(lost)

    def mark_bad(self, source: _Source, chunk: int) -> None:
        before = {chunk} if self._covers(source, chunk) else set()
        source.bad.add(chunk)
        self._recover(before, {chunk} if self._covers(source, chunk) else set())

    def requeue(self, chunk: int) -> None:
        """A fetch of ``chunk`` did not bring it: offer it again to every holder."""
        for s in self.sources:
            if not s.dead and chunk in s.have and chunk not in s.bad:
                self._push(s, chunk)

    def _recover(self, old: set[int], new: set[int]) -> None:
        for c in new - old:
            self.cover[c] += 1
        freed = []
        for c in old - new:
            self.cover[c] -= 1
            if self.cover[c] == 0:
                freed.append(c)
        if freed:
            for s in self.sources:
                if s.complete and not s.dead:
                    for c in freed:
                        self._push(s, c)

    def _refresh_holders(self, chunks: list[int]) -> None:
        """Rarity of ``chunks`` dropped: entries in holders' heaps are keyed too high; push fresh ones."""
        if not chunks:
            return
        for s in self.sources:
            if s.dead:
                continue
            for c in chunks:
                if c in s.have:
                    self._push(s, c)

    def top(self, source: _Source, pending: set[int], busy: set[int]) -> int | None:
        """The best chunk ``source`` can send now, or None."""
        heap = source.heap
        while heap:
            key, rank, c = heap[0]
            if c not in pending or c in busy or c not in source.have or c in source.bad:
                heapq.heappop(heap)  # fetched, in flight (requeued if that fails), or not held
                continue
            current = self.key(c)
            if key != current:
                heapq.heapreplace(heap, (current, rank, c))
                continue
            if source.complete and self.cover[c] > 0:
                # a relay holds it (but is busy) or is fetching it: wait for the relay rather than
                # make the trainer send it twice (offered again if that cover goes away)
                heapq.heappop(heap)
                continue
            return c
        return None


def _with_scheme(address: str, transport: str) -> str:
    return address if "://" in address else f"{transport}://{address}"


class _Pull:
    """State of one pull; see :func:`pull`."""

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

    # -- scheduling by index (FETCH) ----------------------------------------------------------

    def _pick(self) -> tuple[int, _Source] | None:
        t0 = time.perf_counter()
        busy = set(self.inflight.values())
        free = [s for s in self._live() if s.inflight < self.per_source_inflight]
        best: tuple[tuple[int, int], int] | None = None
        for source in free:
            chunk = self.index.top(source, self.pending, busy)
            if chunk is None:
                continue
            key = (self.index.key(chunk), self.rank[chunk])
            if best is None or key < best[0]:
                best = (key, chunk)
        picked = None
        if best is not None:
            chunk = best[1]
            holders = [s for s in free if chunk in s.have and chunk not in s.bad]
            partial = [s for s in holders if not s.complete]
            # relays first: every chunk they serve is one the trainer doesn't; ties broken per
            # puller, not by address, so pullers do not all pick the same idle relay
            picked = (chunk, min(partial or holders, key=self._cost))
        self.stats.pick_s.append(time.perf_counter() - t0)
        return picked

    @staticmethod
    def _cost(source: _Source) -> tuple[int, int, float]:
        """Which holder to ask: the least busy now, then the one that has uploaded the least of
        this version (so no relay's uplink carries much more than one copy), then per puller."""
        return source.inflight + source.load, source.served + source.fetched, source.tiebreak

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

    async def _fetch(self, chunk: int, source: _Source) -> None:
        try:
            await self._fetch_once(chunk, source)
        finally:
            if chunk in self.pending:  # not brought (failed, corrupt): offer it again
                self.index.requeue(chunk)

    async def _fetch_once(self, chunk: int, source: _Source) -> None:
        entry = self.m.chunks[chunk]
        dest = self.view[entry.offset:entry.offset + entry.nbytes]
        source.inflight += 1
        start = time.perf_counter() - self.t0
        client: TransportClient | None = None
        try:
            client = source.idle.pop() if source.idle else await self._connect(source.address)
            before = client.payload_received
            try:
                ok = await until_stalled(client.fetch_chunk(self.m.version, chunk, dest),
                                         lambda: client.payload_received, self.stall_timeout_s,
                                         chunk_limit_s(self.stall_timeout_s, entry.nbytes))
            except (TransportError, TimeoutError, OSError):
                partial = client.payload_received - before
                self.stats.bytes_received += partial
                self.stats.bytes_resent += partial
                await client.close()
                await self._kill(source)
                return
        except (TransportError, OSError):
            await self._kill(source)  # could not connect
            return
        finally:
            source.inflight -= 1
        source.load = client.load
        source.fetched += ok
        if source.dead:
            await client.close()
        else:
            source.idle.append(client)  # free the connection before verifying: pipelining
        if not ok:
            self.stats.control_msgs += 1  # a request that brought nothing
            if not source.dead:  # it dropped the version or never had it
                self.index.apply(source, [], [chunk] if chunk in source.have else [], [], [])
            return
        await self._arrived(chunk, source, start)

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

    # -- scheduling by the sources (subscriptions) ----------------------------------------------

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

    def _patient(self, now: float) -> bool:
        """Ask publishers only for chunks they never sent: there are other sources (relays) to
        bring the rest, and we are not starving."""
        return len(self._live()) > 1 and not self._starving(now)

    def _message(self, source: _Source, chunk: int = -1, busy_ms: int = 0) -> SubMessage:
        """What we tell ``source`` with every message: the chunks we want from it (not on their way
        to us, not sent corrupt by it; from one of several publishers, while patient, only its
        share: ``_publisher_shares``) and whether we are patient."""
        want = self.want
        share = self.shares.get(source.address) if self.patient else None
        if source.bad or share is not None:
            want = want.copy()
            want[list(source.bad)] = False
            if share is not None:
                want &= share
        return SubMessage(np.packbits(want, bitorder="little").tobytes(), self.patient, chunk, busy_ms)

    def _publisher_shares(self) -> dict[str, np.ndarray]:
        """With several live publishers (``origins``: the trainer ranks that announced the
        version), the chunks each is asked for while we are patient: a rendezvous split that every
        puller computes alike. Each publisher sends only chunks it never sent, so without the split
        each chunk could leave the gang once per rank (two ranks: 40 of 22 chunks measured on the
        testbed job, two replicas); with it, once. A publisher that dies hands its share on."""
        if self.origins is None:
            return {}
        live = sorted(s.address for s in self._live() if s.address in self.origins)
        if len(live) < 2:
            return {}
        if sorted(self.shares) == live:
            return self.shares
        owner = owners(live, self.m.num_chunks)
        return {address: owner == i for i, address in enumerate(live)}

    def _downlink_free_in(self) -> float | None:
        """Chunk-times until the chunks on their way to us have (nearly) all arrived, at the link
        rate measured so far; None if a chunk we took has not started arriving yet."""
        if self.starting:
            return None
        left = 0.0
        for chunk, client, before in self.streams.values():
            nbytes = self.m.chunks[chunk].nbytes
            left = max(left, (nbytes - (client.payload_received - before)) / nbytes)
        return left

    def _choose(self, offer: Offer, bad: set[int] | frozenset[int] = frozenset()) -> tuple[int, int]:
        """Our answer to an offer: (chunk to take or -1, busy ms if we pass for being busy).

        Chunks arrive one at a time (``RECEIVE_STREAMS``): we take an offer if its bytes would
        overlap those on their way to us by at most ``NEAR_DONE`` of a chunk (a queued offer's
        bytes start about half a chunk-time away), or if it is fresh from a publisher. Never a
        chunk in ``bad`` (this source sent it corrupt: an offer made before our bitmap said so).
        """
        wanted = [c for c in offer.chunks if self._wanted(c) and c not in bad]
        if not wanted:
            return -1, 0
        free_in = self._downlink_free_in()
        if offer.fresh and len(self.streams) + self.starting < max(FRESH_STREAMS, self._stream_limit()):
            return wanted[0], 0  # nobody else has it: take it even while receiving
        if len(self.streams) + self.starting < self._stream_limit():
            return wanted[0], 0
        start_in = QUEUED_START if offer.queued else 0.0
        if free_in is not None and free_in - start_in <= NEAR_DONE:
            return wanted[0], 0
        # busy: ask to be offered again once that holds (a source not sending starts at once)
        wait = (free_in - NEAR_DONE) if free_in is not None else 1.0
        chunk_s = self.chunk_s or BUSY_DEFAULT_S
        return -1, int(min(BUSY_MAX_S, max(BUSY_MIN_S, wait * chunk_s)) * 1000)

    def _stream_limit(self) -> int:
        """Chunks to have on their way at once: one (``RECEIVE_STREAMS``) while a chunk takes
        longer to arrive than to get started; more where starting one takes longer than its bytes
        (small chunks on a fast network: only several at once keep the link busy)."""
        if self.chunk_s <= 0 or self.start_s <= self.chunk_s:
            return self.receive_streams
        return min(self.max_inflight, max(self.receive_streams, 1 + int(self.start_s / self.chunk_s)))

    def _wanted(self, chunk: int) -> bool:
        return 0 <= chunk < self.m.num_chunks and bool(self.want[chunk])

    async def _send(self, source: _Source, client: TransportClient, op: Op, msg: SubMessage) -> None:
        async with source.sub_lock:  # one message at a time on the connection (updates come from the loop)
            await client.send_sub(op, self.m.version, msg)

    async def _subscription(self, source: _Source) -> None:
        """Subscribe to ``source`` and answer its offers until the pull ends or the source does."""
        client: TransportClient | None = None
        chunk = -1
        try:
            try:
                client = await self._connect(source.address)
                source.sub = client
                self.stats.control_msgs += 1
                self.stats.sub_messages += 1
                await self._send(source, client, Op.SUB, self._message(source))
            except (TransportError, OSError):
                await self._kill(source)
                return
            while self.pending:
                try:
                    status, offer = await client.next_offer()
                except (TransportError, OSError):
                    await self._kill(source)
                    return
                source.load = client.load
                if status is not Status.OFFER or offer is None:  # MISSING: it has not (or no longer) got this version
                    self.stats.control_msgs += 1
                    source.absent += 1  # ask again later, less often each time
                    source.not_before = time.perf_counter() + min(RESUBSCRIBE_MAX_S,
                                                                  RESUBSCRIBE_S * 2 ** (source.absent - 1))
                    return
                source.absent = 0
                t0 = time.perf_counter()
                self.stats.offers += 1
                chunk, busy_ms = self._choose(offer, source.bad)
                if chunk >= 0:
                    self.assigned[chunk] = source
                    self.want[chunk] = False
                self.stats.pick_s.append(time.perf_counter() - t0)
                try:
                    if chunk < 0:
                        self.stats.control_msgs += 2  # an offer and its pass moved nothing
                        if busy_ms:
                            self.stats.passed_busy += 1
                        else:
                            self.stats.passed_none += 1
                        await self._send(source, client, Op.PASS, self._message(source, busy_ms=busy_ms))
                        continue
                    await self._send(source, client, Op.TAKE, self._message(source, chunk=chunk))
                    self.starting += 1  # (its source may still be sending another chunk)
                    try:
                        status, nbytes = await within(client.chunk_reply(), self.stall_timeout_s)
                    finally:
                        self.starting -= 1
                    if not offer.queued:  # (a queued chunk waits for another by design)
                        lag = time.perf_counter() - t0
                        self.start_s = lag if self.start_s == 0.0 else 0.8 * self.start_s + 0.2 * lag
                except (TransportError, TimeoutError, OSError):
                    await self._kill(source)
                    return
                if status is not Status.OK:
                    self.stats.control_msgs += 3  # offer, take and the refusal moved nothing
                    self._unassign(chunk)
                    chunk = -1
                    continue
                entry = self.m.chunks[chunk]
                if nbytes != entry.nbytes:
                    await self._kill(source)  # bytes that do not fit the manifest
                    return
                start = time.perf_counter() - self.t0
                before = client.payload_received
                self.streams[source.address] = (chunk, client, before)
                self.last_activity = time.perf_counter()
                try:
                    await until_stalled(client.recv_payload(chunk, self.view[entry.offset:entry.offset + nbytes]),
                                        lambda: client.payload_received, self.stall_timeout_s,
                                        chunk_limit_s(self.stall_timeout_s, nbytes))
                except (TransportError, TimeoutError, OSError):
                    partial = client.payload_received - before
                    self.stats.bytes_received += partial
                    self.stats.bytes_resent += partial
                    await self._kill(source)
                    return
                finally:
                    self.streams.pop(source.address, None)
                source.fetched += 1
                got, chunk = chunk, -1
                self.assigned.pop(got, None)
                await self._arrived(got, source, start)
                if got in self.pending:  # corrupt: wanted again (from others), they are told
                    self._unassign(got)
        except asyncio.CancelledError:
            if client is not None:  # the pull ended (or failed): the source forgets us
                await client.close()
                client = None
            raise
        finally:
            if chunk >= 0:
                self._unassign(chunk)
            if client is not None:
                await client.close()
            source.sub = None

    def _unassign(self, chunk: int) -> None:
        """A chunk that was on its way did not come: want it again, and tell every source so
        (their view of what we want left it out)."""
        self.assigned.pop(chunk, None)
        if chunk in self.pending:
            self.want[chunk] = True
            self.index.requeue(chunk)
            self.resync = True

    async def _tell_all(self) -> None:
        """Send every subscription our current bitmap and patience (UPDATE)."""
        for source in self._live():
            client = source.sub
            if client is None:
                continue
            self.stats.control_msgs += 1
            self.stats.sub_messages += 1
            try:
                await self._send(source, client, Op.SUB, self._message(source))
            except (TransportError, OSError):
                pass  # its subscription task notices

    def _tend_subscriptions(self, now: float) -> None:
        """Subscribe to new sources (and again to those that had not got the version yet); tell
        every source when our patience or wants changed behind their back."""
        if now - self.listed_at >= LIST_SOURCES_S:
            self.listed_at = now
            self._list_sources()
        patient = self._patient(now)
        shares = self._publisher_shares()
        if shares.keys() != self.shares.keys():
            self.shares, self.resync = shares, True  # a publisher came or went: shares moved
        if not self.subs:
            self.patient, self.resync = patient, False
        elif (patient != self.patient or self.resync) and (self.tell_task is None or self.tell_task.done()):
            self.patient, self.resync = patient, False
            self.tell_task = asyncio.create_task(self._tell_all(), name="weights-update")
        for source in self._live():
            if source not in self.subs and now >= source.not_before:
                self.subs[source] = asyncio.create_task(self._subscription(source), name="weights-sub")

    # -- the loop ------------------------------------------------------------------------------

    async def run(self, timeout_s: float) -> tuple[np.ndarray, PullStats]:
        if self.relay is not None:
            self.relay.add_version(self.m, self.buffer, complete=False)
        try:
            await self._loop(timeout_s)
        except BaseException:
            if self.relay is not None:
                self.relay.drop_version(self.m.version)  # never serve a version we gave up on
            raise
        finally:
            await self._shutdown()
        self.stats.wall_s = time.perf_counter() - self.t0
        return self.buffer, self.stats

    async def _loop(self, timeout_s: float) -> None:
        deadline = self.t0 + timeout_s
        while self.pending:
            now = time.perf_counter()
            if now > deadline:
                raise WeightSyncError(f"pull timed out after {timeout_s:.1f} s", version=self.m.version,
                                      missing=len(self.pending), reason="timeout")
            self._maybe_refresh(now)
            if self.push:
                self._tend_subscriptions(now)
                if self._stalled(now):
                    self._check_available(now)  # chunks stopped coming: is some chunk gone?
                else:
                    self.unavailable_since = None
            else:
                while len(self.inflight) < self.max_inflight and (pick := self._pick()) is not None:
                    chunk, source = pick
                    self.inflight[asyncio.create_task(self._fetch(chunk, source))] = chunk
                if not self.inflight:
                    self._check_available(now)
            waitables: set[asyncio.Task[None]] = {*self.inflight, *self.subs.values()}
            if self.refresh_task is not None:
                waitables.add(self.refresh_task)
            if self.push:
                if self.sources_changed is not None and self.wake_task is None:
                    self.wake_task = asyncio.create_task(self._until_set(self.sources_changed), name="weights-sources")
                # a patience change waits for the running update: go on when it is out
                waitables.update(t for t in (self.wake_task, self.tell_task) if t is not None)
            if not waitables:
                # nothing in flight: until the next HAVE round may go (a sleep(0) here spun a core)
                await asyncio.sleep(max(0.001, self.last_refresh + self._round_gap() - now))
                continue
            done, _ = await asyncio.wait(waitables, timeout=LIST_SOURCES_S if self.push else self.interval,
                                         return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is self.refresh_task:
                    self.refresh_task = None
                elif task is self.wake_task:
                    self.wake_task = None
                    self.listed_at = -1e9  # re-read the sources on this turn, not at the next tick
                elif task is self.tell_task:
                    self.tell_task = None
                elif task in self.inflight:
                    self.inflight.pop(task)
                else:
                    self.subs = {s: t for s, t in self.subs.items() if t is not task}
                task.result()  # re-raise bugs; transport faults are handled inside

    @staticmethod
    async def _until_set(event: asyncio.Event) -> None:
        await event.wait()
        event.clear()

    async def _shutdown(self) -> None:
        tasks = [*self.inflight, *self.subs.values(),
                 *(t for t in (self.refresh_task, self.tell_task, self.wake_task) if t)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for source in self.sources.values():
            for client in [*source.idle, *([source.control] if source.control else [])]:
                with contextlib.suppress(Exception):
                    await client.close()
            source.idle.clear()
            source.control = None


async def pull(
    manifest: Manifest,
    sources: Sources,
    *,
    transport: str = "tcp",
    relay: WeightServer | None = None,
    into: np.ndarray | None = None,
    timeout_s: float = 300.0,
    stall_timeout_s: float = 10.0,
    connect_timeout_s: float = 5.0,
    max_inflight: int = 4,
    per_source_inflight: int = 1,
    have_interval_s: float = 0.01,
    unavailable_grace_s: float = 1.0,
    seed: int | None = None,
    origins: list[str] | None = None,
    sources_changed: asyncio.Event | None = None,
) -> tuple[np.ndarray, PullStats]:
    """Pull every chunk of ``manifest`` from ``sources`` and verify it.

    Args:
        manifest: the version to pull (from the trainer's announcement).
        sources: addresses (``tcp://h:p`` / ``ucx://h:p``; a bare ``h:p`` gets ``transport``),
            or a callable re-read on every HAVE round so late sources are used.
        transport: scheme for bare addresses.
        relay: this replica's WeightServer; each verified chunk is served onward at once.
            On failure the partial version is dropped from it.
        into: destination uint8 array (allocated if None).
        timeout_s: limit for the whole pull.
        stall_timeout_s: limit for a HAVE answer, for a chunk's reply to start, and for a gap with
            no byte of a chunk arriving (not for its whole transfer: see ``until_stalled``); past
            it the source counts as dead.
        connect_timeout_s: limit for opening one connection.
        max_inflight: chunk requests out at once, over all sources (with a relay: answered or
            waiting at their source).
        per_source_inflight: chunks on the wire at once from one source (1 keeps the bytes
            lost when a source dies at no more than one chunk).
        have_interval_s: how often sources are re-asked which chunks they hold.
        unavailable_grace_s: how long a chunk may be held by no live source before giving up.
        seed: seeds this puller's chunk order (pullers with different orders spread load).
        origins: the publishers' addresses (the trainer ranks that announced the version). With a
            ``relay``, a publisher is asked only for chunks it never sent (see the module
            docstring), so each chunk leaves it about once. None: a source that holds the whole
            version at its first answer counts as a publisher.
        sources_changed: set (by the caller) when ``sources``, a callable, may list a new source;
            a relaying pull then re-reads it at once, not at its next ``LIST_SOURCES_S`` tick, and
            clears it. A replica that started pulling the same version a moment after us (its
            partial announcement arriving after our pull began) is a relay before the publisher
            has sent us more than a chunk or two: on a version that takes less than the tick to
            pull, the tick alone let every replica take the whole version from the publisher.

    Returns:
        (buffer, stats): buffer holds the version's bytes, every chunk verified.

    Raises:
        WeightSyncError: (retryable) a chunk is held by no live source, or the pull timed out;
            ``reason`` is ``unavailable``, ``corrupt`` or ``timeout``.
    """
    state = _Pull(manifest, sources, transport, relay, into, stall_timeout_s, connect_timeout_s,
                  max_inflight, per_source_inflight, have_interval_s, unavailable_grace_s, seed, origins,
                  sources_changed)
    return await state.run(timeout_s)


async def fetch_manifest(sources: list[str], version: int, digest: str, *, transport: str = "tcp",
                         timeout_s: float = 10.0, seed: int | None = None) -> Manifest:
    """The manifest of ``version`` from the first source that serves one matching ``digest``.

    Sources are tried in a per-caller random order (replicas spread these requests); one that is
    down, lacks the version or serves other bytes is skipped.

    Raises:
        WeightSyncError: (retryable) no source served it; ``reason`` ``corrupt`` if some served
            bytes that did not match the digest, else ``unavailable``.
    """
    order = [_with_scheme(a, transport) for a in sources]
    random.Random(seed).shuffle(order)
    lied = False
    for address in order:
        client: TransportClient | None = None
        try:
            client = make_client(address)  # an address from an announcement may be malformed
            await within(client.connect(timeout_s), timeout_s)
            data = await within(client.manifest(version), timeout_s)
        except (TransportError, TimeoutError, OSError) as exc:
            # down or unreachable: skip it; a reply that is no manifest (a length past
            # MAX_MANIFEST_BYTES, an unknown status) counts as bytes that failed the digest
            lied = lied or getattr(exc, "reason", None) == "corrupt"
            continue
        finally:
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.close()
        if data is None:
            continue
        try:
            return Manifest.decode(data, digest)
        except WeightSyncError:
            lied = True
    reason = "corrupt" if lied else "unavailable"
    raise WeightSyncError(f"no source served the manifest of v{version} ({reason})", version=version,
                          sources=len(order), reason=reason)
