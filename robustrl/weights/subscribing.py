"""Subscriptions: a relaying puller lets its sources schedule its chunks.

It subscribes once to every source with the bitmap of the chunks it still wants; a source with an
upload slot free offers it chunks it holds, and the puller takes one or passes (none wanted, or
busy receiving, until a time it names). Its bitmap rides along on every answer and leaves out the
chunks on their way to it, so two sources never send it the same chunk. Publishers offer a
patient subscriber (one with other sources) only chunks they never sent, each publisher its own
share when there are several (``owners``). Why, and what was measured: :mod:`robustrl.weights.puller`.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from robustrl.aio import within
from robustrl.errors import TransportError
from robustrl.weights.pull_state import _PullCore
from robustrl.weights.sources import _Source, owners
from robustrl.weights.stall import chunk_limit_s, until_stalled
from robustrl.weights.transport import Offer, Op, Status, SubMessage, TransportClient

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


class _Subscribing(_PullCore):
    """Scheduling by the sources: offers taken or passed, patience, publishers' shares."""

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
