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

Modules: ``sources`` (what is known of each source, which chunk from which), ``stall`` (the bound
on one chunk's transfer), ``pull_stats`` (what a pull cost), ``pull_state`` (a pull's shared
state: HAVE rounds, arrival and checks), ``fetching`` (by index) and ``subscribing`` (by offers);
this module runs a pull (:func:`pull`) and fetches manifests. The names other code imports from
here are re-exported.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

import numpy as np

from robustrl.aio import within
from robustrl.errors import TransportError, WeightSyncError
from robustrl.weights.fetching import _Fetching
from robustrl.weights.manifest import Manifest
from robustrl.weights.pull_state import (
    HAVE_INTERVAL_MAX_S,
    POLLS_PER_CHUNK,
    RECEIVE_STREAMS,
    STALLED_POLL_S,
    STARVE_CHUNKS,
    STARVE_S,
    WAIT_POLL_CHUNKS,
    Sources,
)
from robustrl.weights.pull_stats import PullStats, Transfer
from robustrl.weights.server import WeightServer
from robustrl.weights.sources import _Index, _Source, _with_scheme, owners
from robustrl.weights.stall import PROGRESS_CHECKS, SLOW_SOURCE_BYTES_PER_S, chunk_limit_s, until_stalled
from robustrl.weights.subscribing import (
    BUSY_DEFAULT_S,
    BUSY_MAX_S,
    BUSY_MIN_S,
    FRESH_STREAMS,
    LIST_SOURCES_S,
    NEAR_DONE,
    QUEUED_START,
    RESUBSCRIBE_MAX_S,
    RESUBSCRIBE_S,
    _Subscribing,
)
from robustrl.weights.transport import TransportClient, make_client

__all__ = [
    "BUSY_DEFAULT_S",
    "BUSY_MAX_S",
    "BUSY_MIN_S",
    "FRESH_STREAMS",
    "HAVE_INTERVAL_MAX_S",
    "LIST_SOURCES_S",
    "NEAR_DONE",
    "POLLS_PER_CHUNK",
    "PROGRESS_CHECKS",
    "QUEUED_START",
    "RECEIVE_STREAMS",
    "RESUBSCRIBE_MAX_S",
    "RESUBSCRIBE_S",
    "SLOW_SOURCE_BYTES_PER_S",
    "STALLED_POLL_S",
    "STARVE_CHUNKS",
    "STARVE_S",
    "WAIT_POLL_CHUNKS",
    "PullStats",
    "Sources",
    "Transfer",
    # package-internal, imported by the tests from here
    "_Index",
    "_Pull",
    "_Source",
    "chunk_limit_s",
    "fetch_manifest",
    "owners",
    "pull",
    "until_stalled",
]


class _Pull(_Subscribing, _Fetching):
    """State of one pull; see :func:`pull`."""

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
