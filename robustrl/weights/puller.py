"""Multi-source pull of one weight version, with checksum checks, failover and relaying.

``pull`` fetches every chunk of a manifest from whichever source holds it: trainer ranks
(complete) or other replicas relaying the same version (partial, growing). It

* asks every source which chunks it holds (HAVE) and re-asks every ``have_interval_s`` so it
  discovers chunks that relays completed meanwhile, and new sources from a callable;
* picks the rarest chunk first (ties broken by a per-puller random order) and fetches it from
  the least-loaded source holding it, so concurrent pullers fetch different chunks from the
  trainer and each chunk leaves the trainer about once;
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
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from robustrl.errors import TransportError, WeightSyncError
from robustrl.weights.manifest import Manifest
from robustrl.weights.server import WeightServer
from robustrl.weights.transport import TransportClient, make_client

Sources = list[str] | Callable[[], list[str]]


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


@dataclass
class _Source:
    address: str
    have: frozenset[int] = frozenset()
    pending: frozenset[int] = frozenset()  # chunks the source's own puller is fetching
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


def _with_scheme(address: str, transport: str) -> str:
    return address if "://" in address else f"{transport}://{address}"


class _Pull:
    """State of one pull; see :func:`pull`."""

    def __init__(self, manifest: Manifest, sources: Sources, transport: str, relay: WeightServer | None,
                 into: np.ndarray | None, stall_timeout_s: float, connect_timeout_s: float,
                 max_inflight: int, per_source_inflight: int, have_interval_s: float,
                 unavailable_grace_s: float, seed: int | None) -> None:
        self.m = manifest
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
        self.inflight: dict[asyncio.Task[None], int] = {}
        self.sources: dict[str, _Source] = {}
        self.stats = PullStats()
        self.t0 = time.perf_counter()
        self.unavailable_since: float | None = None
        self.refresh_task: asyncio.Task[None] | None = None
        self.last_refresh = -1e9

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
        source.dead = True
        source.have = frozenset()
        self.stats.failed_sources.append(source.address)
        clients = [*source.idle, *([source.control] if source.control else [])]
        source.idle.clear()
        source.control = None
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
                have = await asyncio.wait_for(source.control.have(self.m.version, self.m.num_chunks),
                                              self.stall_timeout_s)
        except (TransportError, TimeoutError, OSError):
            await self._kill(source)
            return
        if not source.dead and source.control is not None:
            source.have = have
            source.pending = source.control.pending
            source.load = source.control.load
            source.served, source.fetched = source.control.served, 0
            source.asked = True

    async def _refresh(self) -> None:
        self._list_sources()
        await asyncio.gather(*(self._ask(s) for s in self._live()))

    def _maybe_refresh(self, now: float) -> None:
        if self.refresh_task is None and now - self.last_refresh >= self.have_interval_s:
            self.last_refresh = now
            self.refresh_task = asyncio.create_task(self._refresh(), name="weights-have")

    # -- scheduling -------------------------------------------------------------------------

    def _pick(self) -> tuple[int, _Source] | None:
        busy = set(self.inflight.values())
        everyone = self._live()
        n = self.m.num_chunks
        live = [s for s in everyone if s.inflight < self.per_source_inflight]
        best: tuple[tuple[int, int], int, _Source] | None = None
        for chunk in self.pending - busy:
            holders = [s for s in live if chunk in s.have and chunk not in s.bad]
            if not holders:
                continue
            coming = sum(1 for s in everyone if chunk in s.pending)
            partial = [s for s in holders if len(s.have) < n]
            if partial:
                holders = partial  # relays first: every chunk they serve is one the trainer doesn't
            elif any(chunk in s.pending or (chunk in s.have and chunk not in s.bad)
                     for s in everyone if len(s.have) < n):
                # a relay holds it (but is busy) or its replica is fetching it already: wait for
                # the relay instead of making the trainer (a complete source) send it twice
                continue
            rarity = sum(1 for s in everyone if chunk in s.have) + coming
            key = (rarity, self.rank[chunk])
            if best is None or key < best[0]:
                # ties broken per puller, not by address: otherwise every puller would pick
                # the same idle relay and its uplink would carry several copies
                source = min(holders, key=self._cost)
                best = (key, chunk, source)
        return None if best is None else (best[1], best[2])

    @staticmethod
    def _cost(source: _Source) -> tuple[int, int, float]:
        """Which holder to ask: the least busy now, then the one that has uploaded the least of
        this version (so no relay's uplink carries much more than one copy), then per puller."""
        return source.inflight + source.load, source.served + source.fetched, source.tiebreak

    def _check_available(self, now: float) -> None:
        live = self._live()
        if any(not s.asked for s in live):
            return  # still waiting for first answers
        missing = [c for c in self.pending
                   if not any(c in s.have and c not in s.bad for s in live)]
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

    async def _taken_elsewhere(self, chunk: int, source: _Source) -> bool:
        """Before taking a chunk from a complete source (the trainer), re-ask the partial
        sources (relays): if one holds it, or is fetching it and wins the tie (lower
        address), leave it to them. We advertised our own fetch first, so of two replicas
        racing for a chunk at least one sees the other."""
        n = self.m.num_chunks
        if self.relay is None or self.relay.address is None or len(source.have) < n:
            return False
        others = [s for s in self._live() if s is not source and len(s.have) < n]
        if not others:
            return False
        await asyncio.gather(*(self._ask(s) for s in others))
        mine = self.relay.address
        # re-filter: a relay that completed meanwhile is just another complete source
        return any((chunk in s.have and chunk not in s.bad) or (chunk in s.pending and s.address < mine)
                   for s in self._live() if len(s.have) < n)

    async def _fetch(self, chunk: int, source: _Source) -> None:
        try:
            await self._fetch_once(chunk, source)
        finally:
            if self.relay is not None and chunk in self.pending:
                self.relay.mark_pending(self.m.version, chunk, False)

    async def _fetch_once(self, chunk: int, source: _Source) -> None:
        entry = self.m.chunks[chunk]
        dest = self.view[entry.offset:entry.offset + entry.nbytes]
        source.inflight += 1
        if self.relay is not None:
            self.relay.mark_pending(self.m.version, chunk)
        try:
            taken = await self._taken_elsewhere(chunk, source)
        except BaseException:
            source.inflight -= 1
            raise
        if taken:
            source.inflight -= 1
            return
        start = time.perf_counter() - self.t0
        client: TransportClient | None = None
        try:
            client = source.idle.pop() if source.idle else await self._connect(source.address)
            before = client.payload_received
            try:
                ok = await asyncio.wait_for(client.fetch_chunk(self.m.version, chunk, dest), self.stall_timeout_s)
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
            source.have = source.have - {chunk}  # it dropped the version or never had it
            return
        self.stats.bytes_received += entry.nbytes
        if self.m.hash == "sha256":
            # ~1.5 GiB/s and GIL-free: verify in a thread while the next chunk is on the wire
            good = await asyncio.to_thread(self.m.verify_chunk, chunk, dest)
        else:
            # XXH3 runs at ~10x the wire speed; a thread hop would cost more than the hash
            good = self.m.verify_chunk(chunk, dest)
        end = time.perf_counter() - self.t0
        self.stats.schedule.append(Transfer(chunk, source.address, start, end, entry.nbytes, good))
        if not good:
            self.stats.corrupt_chunks += 1
            self.stats.bytes_resent += entry.nbytes
            source.bad.add(chunk)
            return
        self.pending.discard(chunk)
        self.stats.chunks_from[source.address] = self.stats.chunks_from.get(source.address, 0) + 1
        if self.relay is not None:
            self.relay.mark_chunk(self.m.version, chunk)

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
            while len(self.inflight) < self.max_inflight and (pick := self._pick()) is not None:
                chunk, source = pick
                self.inflight[asyncio.create_task(self._fetch(chunk, source))] = chunk
            if not self.inflight:
                self._check_available(now)
            waitables: set[asyncio.Task[None]] = set(self.inflight)
            if self.refresh_task is not None:
                waitables.add(self.refresh_task)
            if not waitables:
                await asyncio.sleep(max(0.0, self.last_refresh + self.have_interval_s - now))
                continue
            done, _ = await asyncio.wait(waitables, timeout=self.have_interval_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is self.refresh_task:
                    self.refresh_task = None
                else:
                    self.inflight.pop(task)
                task.result()  # re-raise bugs; transport faults are handled inside

    async def _shutdown(self) -> None:
        tasks = [*self.inflight, *([self.refresh_task] if self.refresh_task else [])]
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
        stall_timeout_s: limit for one chunk or HAVE answer; past it the source counts as dead.
        connect_timeout_s: limit for opening one connection.
        max_inflight: chunks on the wire at once, over all sources.
        per_source_inflight: chunks on the wire at once from one source (1 keeps the bytes
            lost when a source dies at no more than one chunk).
        have_interval_s: how often sources are re-asked which chunks they hold.
        unavailable_grace_s: how long a chunk may be held by no live source before giving up.
        seed: seeds this puller's chunk order (pullers with different orders spread load).

    Returns:
        (buffer, stats): buffer holds the version's bytes, every chunk verified.

    Raises:
        WeightSyncError: (retryable) a chunk is held by no live source, or the pull timed out;
            ``reason`` is ``unavailable``, ``corrupt`` or ``timeout``.
    """
    state = _Pull(manifest, sources, transport, relay, into, stall_timeout_s, connect_timeout_s,
                  max_inflight, per_source_inflight, have_interval_s, unavailable_grace_s, seed)
    return await state.run(timeout_s)
