"""WeightServer: serves chunks of published weight versions to pullers.

Runs in every trainer rank that publishes (``add_version(..., complete=True)``) and in every
rollout replica as a relay: the replica registers the version it is pulling with
``complete=False`` and marks each chunk once it arrived and its checksum matched, so other
replicas can fetch it onward at once. A chunk is served only if its version is registered and
the chunk is marked, so a relay never serves bytes of a version it has not verified, and
never a mix of two versions: chunks are looked up by (version, index) in that version's own
buffer.

Uploads. At most ``upload_slots`` chunks are sent at a time. Sent one after another, each chunk
gets the whole uplink and reaches its puller in one transfer time, ready to be relayed onward
(sent side by side, the publisher's first chunks arrived with its last, one whole copy-time later:
measured on the testbed, 16 replicas). The next upload is lined up while the current one is
halfway (``_dispatch``): its handshake crosses the links' queues behind the bytes in flight, tens
of milliseconds on a shaped link, and so costs the uplink no idle time. A free place in line goes
to a waiting FETCH first (in arrival order), else to an offer to a subscriber (``transport.py``):
of the subscribers that want a chunk held here and are not busy receiving, the one that wants the
most chunks (the furthest behind: the slowest replica sets the fan-out's end; ties in turns) is
offered its wanted chunks held here, rarest first: the fewest holders among this server's
subscribers (by their bitmaps), then the fewest sends from here, then this server's own random
order. So

* a publisher offers a *patient* subscriber (one with relays) only chunks it has never sent:
  each chunk leaves the publisher once, to subscribers taking turns, and the replicas start out
  holding different chunks ("super-seeding"); an impatient one gets its rarest wanted chunks,
  sent again if need be;
* a relay spreads first what has spread least, and a chunk it has just received goes out at once;
* the uplink never idles while some subscriber wants a chunk this server holds and can take it.

Test-only faults (``Fault``) make the server corrupt, stall on, or die during a chunk.
"""

from __future__ import annotations

import asyncio
import enum
import errno
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_fixed

from robustrl.errors import WeightSyncError
from robustrl.weights.manifest import Manifest
from robustrl.weights.transport import (
    SUB_HEAD,
    Offer,
    Op,
    Reply,
    RequestHandler,
    Status,
    SubMessage,
    Subscription,
    Ticket,
    TransportServer,
    encode_have_reply,
    make_server,
)

DEFAULT_UPLOAD_SLOTS = 1
"""Chunks sent at once by one server (see the module docstring). The TCP transport releases a slot
when all but its socket's low-water mark of a chunk has left, so the next chunk follows with no gap."""
DEFAULT_ANSWER_TIMEOUT_S = 5.0
"""Longest wait for a subscriber's answer (TAKE or PASS) to an offer; past it the subscription ends.
A healthy answer takes a round trip; this bound only ends subscriptions that are gone (frozen,
partitioned), so it can be generous: it is not what keeps others waiting. The offer's place in
line is given up much sooner (``send_stall_s``, see ``_Sub.hold``): with the place held for the
whole 5 s, a FETCH lined up behind a frozen subscriber's offer got no byte within the replicas'
3-s stall bound (``STALL_TIMEOUT_S``), which counts from the request, and the replica gave a
healthy source up (an outside review, reproduced)."""
DEFAULT_SEND_TIMEOUT_S = 30.0
"""Longest a chunk's bytes may take to leave once its upload slot is taken; past it the
connection ends (a receiver that stopped reading holds the slot otherwise). 30 s: a 4 MiB chunk
at ~1 Mbit/s."""
DEFAULT_SEND_STALL_S = 2.0
"""Longest one peer may hold this source's line without making progress: a chunk's bytes standing
still once its upload slot is taken (the transports send a chunk in slices, each bounded so), or an
offer left unanswered (then its place in line is given up, the subscription stays). Either is a
peer that stopped. A receiver frozen mid-chunk (a SIGSTOPped replica) held the server's one slot
for the whole ``DEFAULT_SEND_TIMEOUT_S``: no one else got a byte from this source, and the
subscriber lined up behind it gave the source up as dead after its own 3-s stall bound (an outside
review, reproduced). Below the replicas' stall bound (``STALL_TIMEOUT_S``, 3 s), so the next in
line is served before it gives up."""
MAX_UNKNOWN_BODY = SUB_HEAD.size + (1 << 20)
"""Longest subscriber message read for a version not held here (a bitmap of 8M chunks)."""
OFFER_SIZE = 32
"""Chunks listed in one offer at most (the subscriber takes the first it still wants)."""


class ServerStatus(enum.Enum):
    NEW = "new"
    SERVING = "serving"
    CLOSED = "closed"


@dataclass
class Fault:
    """Test-only misbehaviour for one chunk (or any chunk when ``chunk`` is None).

    kind: ``corrupt`` sends garbage of the right length; ``stall`` sends ``after_bytes`` of the
    chunk then nothing more; ``die`` sends ``after_bytes`` then kills the server (listener and
    every connection), like a killed process. ``after_chunks`` chunks are served normally
    before it can fire; ``times`` limits how often it fires.
    """

    kind: Literal["corrupt", "stall", "die"]
    chunk: int | None = None
    after_bytes: int = 0
    after_chunks: int = 0
    times: int = 1
    fired: int = field(default=0, init=False)
    seen: int = field(default=0, init=False)

    def applies(self, index: int) -> bool:
        self.seen += 1
        return (self.fired < self.times and self.seen > self.after_chunks
                and (self.chunk is None or self.chunk == index))


@dataclass
class _Version:
    manifest: Manifest
    buffer: memoryview
    held: np.ndarray  # bool per chunk
    pending: np.ndarray  # bool per chunk: our puller is fetching it (advertised, never served)
    sent: np.ndarray  # int64 per chunk: times this server sent it
    rank: np.ndarray  # int64 per chunk: this server's random order (ties between equally sent chunks)
    holders: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Per chunk: subscribers that hold it (or have it on its way), by their last bitmaps: offers
    go rarest first (what has spread least is also least likely to have reached a subscriber
    since it last told us what it wants)."""
    publisher: bool = False  # added complete: patient subscribers get only never-sent chunks
    gen: int = 0  # bumped when a chunk is marked: a subscriber with nothing here to take may now have
    served: int = 0  # chunk replies sent for this version (advertised: pullers spread uploads)
    manifest_json: bytes = b""  # served on MANIFEST (relays serve the manifest of what they relay)


class _Ticket(Ticket):
    """A FETCH of ``index`` waiting for a slot."""

    def __init__(self, future: asyncio.Future[Reply], version: int, index: int) -> None:
        super().__init__(future)
        self.version = version
        self.index = index


class _Sub(Subscription):
    """One subscriber, as its server sees it."""

    def __init__(self, server: WeightServer, version: int, n: int) -> None:
        self.server = server
        self.version = version
        self.n = n
        self.view = np.zeros(n, dtype=bool)  # chunks it wants (as of its last message)
        self.viewgen = 0
        self.patient = False
        self.offer: asyncio.Future[Offer | None] = asyncio.get_running_loop().create_future()
        self.offered: list[int] | None = None  # the offer out (until answered or the subscriber is gone)
        self.holds = False  # the offer out still holds its place in the pipeline (see hold)
        self.hold_timer: asyncio.TimerHandle | None = None
        self.busy_until = 0.0  # time.monotonic(): it said it receives at its limit until then
        self.stuck: tuple[int, int] | None = None  # (version gen, viewgen) when nothing here was wanted
        self.closed = False
        self.counted: tuple[_Version, np.ndarray] | None = None  # what it adds to its version's holders

    def set_view(self, msg: SubMessage) -> bool:
        bits = np.frombuffer(msg.want, dtype=np.uint8)
        if bits.size != (self.n + 7) // 8:
            return False
        self.view = np.unpackbits(bits, count=self.n, bitorder="little").view(bool)
        self.viewgen += 1
        self.patient = msg.patient
        self._count()
        return True

    def _count(self) -> None:
        """Keep this subscriber's view in its version's ``holders`` counts (see ``_Version``)."""
        entry = self.server._versions.get(self.version)
        if self.counted is not None:
            old_entry, old = self.counted
            old_entry.holders -= old
            self.counted = None
        if entry is not None and not self.closed and self in self.server._subs:
            has = (~self.view).astype(np.int64)
            entry.holders += has
            self.counted = (entry, has)

    def hold(self, offer: Offer, hold_s: float | None) -> None:
        """Send ``offer`` out holding a place in the pipeline (taken by the caller), for at most
        ``hold_s`` (None: until answered).

        The place is what lines the offered chunk up behind the upload in progress. Unanswered
        past ``hold_s`` (the subscriber froze, or its link did), the place goes to whoever is next
        (a waiting FETCH, another subscriber), while the offer itself stays valid until the answer
        timeout ends the subscription: a late TAKE is still served, its chunk then lined up like
        a FETCH's. Held until the answer timeout instead, the place kept FETCHes from their first
        byte longer than the pullers wait for it, and kept the uplink idle meanwhile."""
        self.offered, self.holds = offer.chunks, True
        if hold_s is not None:
            self.hold_timer = asyncio.get_running_loop().call_later(hold_s, self._hold_expired)
        self.offer.set_result(offer)

    def _hold_expired(self) -> None:
        self.hold_timer = None
        if self.holds and not self.closed:
            self.holds = False
            self.server._release_token()

    def _let_go(self) -> tuple[list[int], bool]:
        """Forget the offer out: (its chunks, whether it still held its place in the pipeline)."""
        offered, held = self.offered or [], self.holds
        self.offered, self.holds = None, False
        if self.hold_timer is not None:
            self.hold_timer.cancel()
            self.hold_timer = None
        return offered, held

    def _answered(self, msg: SubMessage) -> tuple[list[int], bool]:
        offered, held = self._let_go()
        self.set_view(msg)
        if not self.closed:
            self.offer = asyncio.get_running_loop().create_future()
        return offered, held

    def update(self, msg: SubMessage) -> None:
        self.set_view(msg)
        self.server._dispatch()

    def take(self, msg: SubMessage) -> Reply:
        offered, held = self._answered(msg)
        entry = self.server._versions.get(self.version)
        if msg.chunk not in offered or entry is None or not entry.held[msg.chunk]:
            if held:
                self.server._release_token()
            return Reply(Status.MISSING)
        return self.server._chunk_reply(entry, msg.chunk, reserved=held)

    def pass_(self, msg: SubMessage) -> None:
        _, held = self._answered(msg)
        if msg.busy_ms > 0:
            self.busy_until = time.monotonic() + msg.busy_ms / 1000
        if held:
            self.server._release_token()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._count()  # (takes it out of the counts)
        self.server._subs.remove(self)
        if not self.offer.done():
            self.offer.cancel()
        _, held = self._let_go()
        if held:
            self.server._release_token()


def _byte_view(buffer: object) -> memoryview:
    if hasattr(buffer, "numpy"):  # a torch tensor: share its memory through numpy
        buffer = buffer.numpy()  # type: ignore[union-attr]
    return memoryview(buffer).cast("B")  # type: ignore[arg-type]


FIXED_PORT_WAIT_S = 5.0
"""How long a weight server on a fixed port waits for it to be free (see ``WeightServer.start``)."""


class WeightServer(RequestHandler):
    """Serves (version, chunk) requests over one transport.

    Args:
        transport: ``'tcp'`` or ``'ucx'``.
        host: address to bind and to advertise (loopback by default).
        port: 0 picks a free port.
        max_versions: versions kept; adding one more drops the oldest.
        fault: test-only misbehaviour (may also be set later through ``self.fault``).
        upload_slots: chunks sent at once (see the module docstring).
        answer_timeout_s: longest wait for a subscriber's answer to an offer (``DEFAULT_ANSWER_TIMEOUT_S``).
        send_timeout_s: longest a chunk's bytes may take to leave (``DEFAULT_SEND_TIMEOUT_S``).
        send_stall_s: longest they may stand still, and longest an unanswered offer holds its place
            in line (``DEFAULT_SEND_STALL_S``).
    """

    def __init__(self, transport: str = "tcp", host: str = "127.0.0.1", port: int = 0,
                 max_versions: int = 2, fault: Fault | None = None,
                 upload_slots: int = DEFAULT_UPLOAD_SLOTS, answer_timeout_s: float = DEFAULT_ANSWER_TIMEOUT_S,
                 send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
                 send_stall_s: float = DEFAULT_SEND_STALL_S) -> None:
        if max_versions < 1:
            raise WeightSyncError("max_versions must be >= 1", max_versions=max_versions)
        if upload_slots < 1:
            raise WeightSyncError("upload_slots must be >= 1", upload_slots=upload_slots)
        self.transport = transport
        self.host = host
        self.port = port
        self.max_versions = max_versions
        self.fault = fault
        self.status = ServerStatus.NEW
        self.address: str | None = None
        self.bytes_sent = 0
        self.requests = 0
        self.upload_slots = upload_slots
        self.answer_timeout_s = answer_timeout_s
        self.send_timeout_s = send_timeout_s
        self.send_stall_s = send_stall_s
        self.pick_s: deque[float] = deque(maxlen=100_000)
        """Seconds each offer's pick took here (which subscriber, which chunks: the source's share of
        the scheduling cost per chunk)."""
        self.upload_log: list[tuple[int, float, float, int]] | None = None
        """Set to a list to record each chunk upload: (chunk, upload slot taken, freed, bytes sent),
        ``time.time()`` seconds (benchmarks: how busy the uplink was)."""
        self._versions: OrderedDict[int, _Version] = OrderedDict()
        self._pipeline = 0  # offers out, and chunk replies not yet halfway sent (see _dispatch)
        self._slots = asyncio.Semaphore(upload_slots)  # held while a chunk's bytes are sent
        self._uploads: dict[int, list[object]] = {}  # id(reply) -> [reply, holds pipeline, holds slot]
        self._waiting: list[_Ticket] = []  # FETCHes waiting for a slot, in arrival order
        self._subs: list[_Sub] = []
        self._last: _Sub | None = None  # the last subscriber offered to: the next round starts after it
        self._retry: asyncio.TimerHandle | None = None  # a dispatch when a busy subscriber frees up
        self._rng = np.random.default_rng()
        self._server: TransportServer | None = None
        self._closed = asyncio.Event()

    async def start(self) -> str:
        """Start listening; returns the address (``tcp://host:port`` / ``ucx://host:port``)."""
        if self.status is ServerStatus.SERVING:
            assert self.address is not None
            return self.address
        if self.status is ServerStatus.CLOSED:
            raise WeightSyncError("weight server is closed", address=self.address)
        self._server = make_server(self.transport, self)
        # A fixed port (ROBUSTRL_WEIGHTS_PORT) may still be held for a moment by the server this
        # process closed as it switched role in place; beyond FIXED_PORT_WAIT_S it is someone else's.
        taken = retry_if_exception(lambda e: bool(self.port) and getattr(e, "errno", None) == errno.EADDRINUSE)
        try:
            async for attempt in AsyncRetrying(retry=taken, wait=wait_fixed(0.2), reraise=True,
                                               stop=stop_after_delay(FIXED_PORT_WAIT_S)):
                with attempt:
                    self.address = await self._server.start(self.host, self.port)
        except OSError as exc:
            if not self.port:
                raise
            raise WeightSyncError(f"weight server cannot listen on {self.host}:{self.port} "
                                  f"(ROBUSTRL_WEIGHTS_PORT: one member per address): {exc}",
                                  host=self.host, port=self.port) from exc
        self.status = ServerStatus.SERVING
        return self.address

    # -- versions ---------------------------------------------------------------------------

    def add_version(self, manifest: Manifest, buffer: object, complete: bool = True) -> None:
        """Publish ``buffer`` (bytes of ``manifest``) as version ``manifest.version``.

        With ``complete=False`` no chunk is served until :meth:`mark_chunk` marks it. The
        buffer is served in place (no copy): the caller must not modify a marked chunk.
        """
        view = _byte_view(buffer)
        if len(view) < manifest.total_bytes:
            raise WeightSyncError("buffer shorter than manifest", version=manifest.version,
                                  have=len(view), need=manifest.total_bytes)
        n = manifest.num_chunks
        held = np.full(n, complete, dtype=bool)
        self.drop_version(manifest.version)
        self._versions[manifest.version] = _Version(
            manifest, view, held, np.zeros(n, dtype=bool), np.zeros(n, dtype=np.int64),
            self._rng.permutation(n).astype(np.int64), holders=np.zeros(n, dtype=np.int64), publisher=complete,
            manifest_json=manifest.encode())
        while len(self._versions) > self.max_versions:
            self.drop_version(next(iter(self._versions)))

    def mark_chunk(self, version: int, index: int) -> None:
        """Start serving chunk ``index`` of ``version`` (its bytes are in place and verified)."""
        entry = self._versions.get(version)
        if entry is None:
            raise WeightSyncError("version not registered on this server", version=version)
        entry.pending[index] = False
        if not entry.held[index]:
            entry.held[index] = True
            entry.gen += 1
            self._dispatch()

    def mark_pending(self, version: int, index: int, pending: bool = True) -> None:
        """Advertise (or withdraw) that this replica is fetching chunk ``index`` right now.

        Other pullers then fetch a different chunk from the trainer and take this one from us
        once it is marked, so each chunk leaves the trainer about once. No-op if the version
        is not registered.
        """
        entry = self._versions.get(version)
        if entry is not None and not entry.held[index]:
            entry.pending[index] = pending

    def drop_version(self, version: int) -> None:
        """Stop serving ``version`` (no-op if absent); its waiting requests are answered MISSING."""
        if self._versions.pop(version, None) is None:
            return
        for t in [t for t in self._waiting if t.version == version]:
            self._waiting.remove(t)
            t.future.set_result(Reply(Status.MISSING))
        for sub in self._subs:
            if sub.version == version and not sub.offer.done():
                sub.offer.set_result(None)  # its transport answers MISSING and ends it

    def holds(self, version: int, manifest_digest: str) -> bool:
        """Whether ``version`` is registered here with the manifest whose SHA-256 is
        ``manifest_digest`` (held complete or not): a version number names different bytes in
        two gangs' lineages after a rollback."""
        entry = self._versions.get(version)
        return entry is not None and entry.manifest.digest() == manifest_digest

    def versions(self) -> list[int]:
        """Versions currently registered, oldest first."""
        return list(self._versions)

    def is_complete(self, version: int) -> bool:
        """True when every chunk of ``version`` is held."""
        entry = self._versions.get(version)
        return entry is not None and bool(entry.held.all())

    # -- RequestHandler ---------------------------------------------------------------------

    def handle(self, op: Op, version: int, index: int) -> Reply:
        self.requests += 1
        entry = self._versions.get(version)
        if op is Op.HAVE:
            if entry is None:
                return Reply(Status.MISSING)
            return Reply(Status.OK, encode_have_reply(entry.held, entry.pending, entry.served))
        if op is Op.MANIFEST:
            return Reply(Status.MISSING) if entry is None else Reply(Status.OK, entry.manifest_json)
        return Reply(Status.MISSING)  # chunks go through request_chunk

    def request_chunk(self, version: int, index: int) -> Ticket:
        self.requests += 1
        ticket = _Ticket(asyncio.get_running_loop().create_future(), version, index)
        entry = self._versions.get(version)
        if (entry is None or self.status is ServerStatus.CLOSED or index >= entry.manifest.num_chunks
                or not entry.held[index]):
            ticket.future.set_result(Reply(Status.MISSING))
            return ticket
        self._waiting.append(ticket)
        self._dispatch()
        return ticket

    def withdraw(self, ticket: Ticket) -> bool:
        if ticket.future.done():
            return False
        self._waiting.remove(ticket)  # type: ignore[arg-type]
        ticket.future.cancel()
        return True

    def subscribe(self, version: int, msg: SubMessage) -> Subscription | None:
        self.requests += 1
        entry = self._versions.get(version)
        if entry is None or self.status is ServerStatus.CLOSED:
            return None
        sub = _Sub(self, version, entry.manifest.num_chunks)
        self._subs.append(sub)
        if not sub.set_view(msg):
            self._subs.remove(sub)
            return None
        self._dispatch()
        return sub

    def _release_token(self) -> None:
        self._pipeline = max(0, self._pipeline - 1)
        self._dispatch()

    def _dispatch(self) -> None:
        """Start the next upload's handshake: a waiting FETCH (in arrival order), else an offer.

        ``upload_slots`` uploads send at once, and as many more are lined up: the next offer goes
        out when the current upload is halfway sent (``halfway``), and the chunk taken waits for
        the slot. An offer and its answer cross both links' queues behind the bytes in flight
        (tens of ms on a shaped link); made ahead, they cost the uplink no idle time.
        """
        while self._pipeline < self.upload_slots:
            if self._waiting:
                ticket = self._waiting.pop(0)
                entry = self._versions.get(ticket.version)
                if entry is None or not entry.held[ticket.index]:  # dropped meanwhile
                    ticket.future.set_result(Reply(Status.MISSING))
                else:
                    ticket.future.set_result(self._chunk_reply(entry, ticket.index))
                continue
            picked = self._pick_offer()
            if picked is None:
                return
            sub, offer = picked
            self._pipeline += 1
            sub.hold(offer, self.send_stall_s)

    def _pick_offer(self) -> tuple[_Sub, Offer] | None:
        """The subscriber to offer to, and what (see the module docstring); None: nobody wants
        anything here now. One pass over the (subscribers x chunks) matrix of what they want, in
        numpy: of the subscribers that want a chunk held here, the one that wants the most chunks
        (ties: the next in turn after the last one offered to) is offered its wanted chunks held
        here, those with the fewest holders first, then the fewest sends from here, then in this
        server's order."""
        t0 = time.perf_counter()
        now = time.monotonic()
        wake = None
        count = len(self._subs)
        turn = self._subs.index(self._last) + 1 if self._last in self._subs else 0
        groups: dict[int, list[_Sub]] = {}  # version -> eligible subscribers, in turn order
        for k in range(count):
            sub = self._subs[(turn + k) % count]
            if sub.offered is not None or sub.offer.done():
                continue
            if sub.busy_until > now:
                wake = sub.busy_until if wake is None else min(wake, sub.busy_until)
                continue
            entry = self._versions.get(sub.version)
            if entry is None:
                sub.offer.set_result(None)  # the version is gone: the transport ends the subscription
                continue
            if sub.stuck != (entry.gen, sub.viewgen):
                groups.setdefault(sub.version, []).append(sub)
        best: tuple[int, _Sub, np.ndarray] | None = None
        for version, subs in groups.items():
            entry = self._versions[version]
            n = entry.manifest.num_chunks
            views = np.stack([sub.view for sub in subs])
            cand = views & entry.held
            patient = np.array([entry.publisher and sub.patient for sub in subs])
            if patient.any():
                cand[patient] &= entry.sent == 0
            some = cand.any(axis=1)
            for i in np.flatnonzero(~some):
                subs[i].stuck = (entry.gen, subs[i].viewgen)  # nothing here it wants until that changes
            if not some.any():
                continue
            # the subscriber that wants the most: whoever is furthest behind goes first (the
            # slowest replica sets the fan-out's end), ties in turn
            need = np.where(some, views.sum(axis=1), -1)
            i = int(np.argmax(need))
            if best is None or int(need[i]) > best[0]:
                keys = entry.holders * (n * (count + int(entry.sent.max()) + 1)) + entry.sent * n + entry.rank
                best = (int(need[i]), subs[i], np.where(cand[i], keys, np.iinfo(np.int64).max))
        if best is None:
            self.pick_s.append(time.perf_counter() - t0)
            if wake is not None:
                self._retry_at(wake - now)
            return None
        _, sub, row = best
        have = int(np.count_nonzero(row != np.iinfo(np.int64).max))
        if have > OFFER_SIZE:
            top = np.argpartition(row, OFFER_SIZE)[:OFFER_SIZE]
        else:
            top = np.argpartition(row, have - 1)[:have] if have > 1 else np.array([int(np.argmin(row))])
        chunks = top[np.argsort(row[top])].tolist()
        self._last = sub
        entry = self._versions[sub.version]
        self.pick_s.append(time.perf_counter() - t0)
        return sub, Offer(chunks, fresh=bool(entry.publisher and entry.sent[chunks[0]] == 0),
                          queued=self._slots.locked())

    def _retry_at(self, delay: float) -> None:
        """Dispatch again in ``delay`` s (a busy subscriber frees up), unless one is due sooner."""
        loop = asyncio.get_running_loop()
        when = loop.time() + max(0.0, delay)
        if self._retry is not None and not self._retry.cancelled() and self._retry.when() <= when:
            return
        if self._retry is not None:
            self._retry.cancel()
        self._retry = loop.call_at(when, self._retry_now)

    def _retry_now(self) -> None:
        self._retry = None
        if self.status is not ServerStatus.CLOSED:
            self._dispatch()

    def _chunk_reply(self, entry: _Version, index: int, reserved: bool = False) -> Reply:
        """Chunk ``index``'s reply: it holds a place in the pipeline (taken now, or ``reserved``
        by the offer it answers) until halfway sent, and an upload slot while sent (``begin``)."""
        if not reserved:
            self._pipeline += 1
        entry.served += 1
        entry.sent[index] += 1
        chunk = entry.manifest.chunks[index]
        payload = entry.buffer[chunk.offset:chunk.offset + chunk.nbytes]
        info = {"is_chunk": True, "index": index}
        fault = self.fault
        if fault is not None and fault.applies(index):
            fault.fired += 1
            if fault.kind == "corrupt":
                reply = Reply(Status.OK, np.random.default_rng(index).bytes(chunk.nbytes), **info)  # type: ignore[arg-type]
            else:
                reply = Reply(Status.OK, payload, cut_after=min(fault.after_bytes, chunk.nbytes), then=fault.kind,
                              **info)  # type: ignore[arg-type]
        else:
            reply = Reply(Status.OK, payload, **info)  # type: ignore[arg-type]
        self._uploads[id(reply)] = [reply, True, False, 0.0]
        return reply

    def max_body(self, version: int) -> int:
        """A subscriber's message is its head and the bitmap of ``version``: exactly that long if
        the version is here; if not (a subscriber early or late: it is answered MISSING, which
        needs the body read), at most ``MAX_UNKNOWN_BODY``."""
        entry = self._versions.get(version)
        if entry is None:
            return MAX_UNKNOWN_BODY
        return SUB_HEAD.size + (entry.manifest.num_chunks + 7) // 8

    def load(self) -> int:
        return len(self._uploads) + len(self._waiting) + sum(s.offered is not None for s in self._subs)

    async def begin(self, reply: Reply) -> None:
        """Wait for an upload slot before sending a chunk reply's bytes."""
        state = self._uploads.get(id(reply))
        if state is None:
            return
        await self._slots.acquire()
        state[2], state[3] = True, time.time()

    def halfway(self, reply: Reply) -> None:
        """Half of a chunk reply's bytes have left: line up the next upload."""
        state = self._uploads.get(id(reply))
        if state is not None and state[1]:
            state[1] = False
            self._release_token()

    def done(self, reply: Reply, sent: int) -> None:
        state = self._uploads.pop(id(reply), None)
        if state is None:
            return
        self.bytes_sent += sent
        if self.upload_log is not None and state[2]:
            self.upload_log.append((reply.index, state[3], time.time(), sent))  # type: ignore[arg-type]
        if state[2]:
            self._slots.release()
        if state[1]:
            self._release_token()

    async def die(self) -> None:
        """Fault hook: close at once, as if the process had been killed."""
        await self.close()

    async def stalled(self) -> None:
        await self._closed.wait()

    async def close(self) -> None:
        """Stop serving and drop every connection. Safe to call twice."""
        if self.status is ServerStatus.CLOSED:
            return
        self.status = ServerStatus.CLOSED
        self._closed.set()
        if self._server is not None:
            await self._server.close()
        for version in list(self._versions):
            self.drop_version(version)
        if self._retry is not None:
            self._retry.cancel()

