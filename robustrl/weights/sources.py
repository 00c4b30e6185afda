"""What a puller knows of each source, and which chunk to fetch from which.

``_Source`` is one source as one pull sees it (what it holds and fetches, its load, its
connections). ``_Index`` picks the next chunk to fetch by index: rarity counts kept from HAVE
differences and, per source, a heap of the chunks it holds keyed by rarity, so a pick costs
O(sources x log chunks) instead of a scan of every chunk x source. ``owners`` splits a version's
chunks among its publishers by rendezvous hashing (every puller computes the same split).

Package-internal (the leading underscores): used by the pull (:mod:`robustrl.weights.pull_state`
and its schedulers), and by the tests through :mod:`robustrl.weights.puller`.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
from dataclasses import dataclass, field

import numpy as np

from robustrl.errors import WeightSyncError
from robustrl.weights.transport import TransportClient, have_reply_size


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
