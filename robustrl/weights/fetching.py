"""Fetching a pull's chunks by index (FETCH), for a puller that relays nothing (a late joiner, a
loader that does not serve onward).

It picks the rarest chunk first (ties broken by a per-puller random order) from the least-loaded
source holding it (:class:`robustrl.weights.sources._Index`), relays before publishers; a source
that dies or stalls mid-chunk is dropped and the chunk is fetched again elsewhere.
"""

from __future__ import annotations

import time

from robustrl.errors import TransportError
from robustrl.weights.pull_state import _PullCore
from robustrl.weights.sources import _Source
from robustrl.weights.stall import chunk_limit_s, until_stalled
from robustrl.weights.transport import TransportClient


class _Fetching(_PullCore):
    """Scheduling by index: this puller picks each chunk and its source."""

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
