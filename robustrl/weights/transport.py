"""The weight-transport interface, its wire format, and the factory for implementations.

A transport moves chunks of a flat weight buffer between a source (``WeightServer`` in a
trainer rank or a relaying replica) and a puller. Requests by index:

* ``FETCH(version, index)`` -> the chunk's bytes, written straight into the caller's buffer;
* ``HAVE(version)`` -> which chunks of that version the source holds (a bitmap);
* ``MANIFEST(version)`` -> the version's manifest (JSON bytes).

And a subscription, where the *source* schedules (see ``server.py``): a puller sends
``SUB(version, want)`` once on a connection of its own, with the bitmap of the chunks it still
wants; whenever the source can line up an upload and holds a chunk the subscriber wants, it
sends an ``OFFER`` (chunk indices, its preferred first, flagged ``fresh`` from a publisher or
``queued`` behind an upload in progress), and the puller answers ``TAKE`` (one of them: the
chunk's bytes follow, once the source's upload slot is free) or ``PASS`` (none wanted, or busy
receiving until a time it names). Every message from the puller carries its current bitmap, so the source's view of
what it wants is as fresh as their last exchange. A relay's newly verified chunk therefore goes
out to a subscriber at once (no availability poll), and an upload slot never idles while some
subscriber wants a chunk its source holds.

An offer holds the source's place in line until answered, and a chunk its upload slot until sent:
a subscriber that does not answer within ``RequestHandler.answer_timeout_s`` loses its
subscription (its offer's place in line goes on sooner, see ``server.py``), and a reply whose bytes
stand still for ``send_stall_s`` or do not leave within ``send_timeout_s`` ends its connection, so
a frozen or cut-off puller (SIGSTOP, partition) stalls nobody else for longer than the pullers'
own stall bound.

Every reply starts with a fixed 16-byte header carrying a status, the source's current load
(uploads in progress or lined up, offers out, FETCHes waiting), and the payload length, so a puller
learns the load of its sources for free. Two implementations share this format: ``tcp``
(asyncio sockets, see ``tcp.py``) and ``ucx`` (ucxx, see ``ucx.py``, imported only when a
``ucx://`` address is used, so the ``robustrl[ucx]`` extra stays optional).

A source sends at most ``upload_slots`` chunks at a time (``WeightServer``): a chunk that has the
uplink to itself arrives in one chunk-transfer time and can be relayed onward at once, where
sixteen sent side by side all arrive sixteen transfer times later.
"""

from __future__ import annotations

import abc
import asyncio
import enum
import struct
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from robustrl.aio import within
from robustrl.errors import TransportError

HEADER = struct.Struct("!BxxxIQ")
"""Request: (op, index, version). Reply: (status, load, nbytes). Both 16 bytes."""

DEFAULT_CONNECT_TIMEOUT_S = 5.0


class Op(enum.IntEnum):
    FETCH = 1
    HAVE = 2
    MANIFEST = 3
    """The version's manifest (its JSON, ``Manifest.encode``): a manifest grows ~90 B per chunk and
    no longer fits one NATS message at real model sizes, so announcements carry its digest and
    pullers fetch it from a source."""
    SUB = 4
    """Subscribe (or update the subscription): body = ``SubMessage``. The header's ``index`` field
    carries the body's length (also for TAKE and PASS)."""
    TAKE = 5
    """Answer to an OFFER: this chunk (``SubMessage.chunk``); its bytes follow."""
    PASS = 6
    """Answer to an OFFER: none of them (or busy until ``SubMessage.busy_ms`` from now)."""


class Status(enum.IntEnum):
    OK = 0
    MISSING = 1
    OFFER = 3
    """A source's offer to a subscriber: the payload is an ``Offer``."""


OFFER_CHUNK = struct.Struct("!I")
OFFER_FRESH = 1
"""Offer flag: its first chunk has never left this publisher (nobody else holds it: the rarest a
chunk can be), so a subscriber takes it even while receiving another chunk."""
OFFER_QUEUED = 2
"""Offer flag: the source is sending another chunk; this one's bytes follow that one's (about
half a chunk-time away: offers are made when the upload before is halfway)."""
SUB_HEAD = struct.Struct("!BxxxiI")
"""Body of SUB, TAKE and PASS: (flags, chunk taken or -1, busy for this many ms), then the bitmap
of the chunks the puller wants from this source (``encode_have``)."""
SUB_PATIENT = 1
"""The puller has relays to take repeats from: a publisher offers it only chunks it has never sent
(each chunk leaves the publisher once, to pullers taking turns); without it a publisher offers
any chunk it wants, sent again if need be (a puller with nobody else, or one that has waited too
long)."""
SUB_BUSY = 2
"""PASS: the puller is receiving at its limit; offer again in ``busy_ms`` (or after that)."""
MAX_SUB_BODY = SUB_HEAD.size + (1 << 27)
"""Longest SUB/TAKE/PASS body a source reads (a bitmap of 2^30 chunks)."""
MAX_OFFER_BODY = OFFER_CHUNK.size * (1 + 256)
"""Longest OFFER payload a subscriber reads: the flags word and 256 chunks (a source lists at most
``server.OFFER_SIZE``, 32); a longer header is garbage or hostile, not an offer."""


@dataclass(frozen=True, slots=True)
class SubMessage:
    """What a subscriber says in SUB, TAKE and PASS."""

    want: bytes
    patient: bool = False
    chunk: int = -1
    busy_ms: int = 0

    def encode(self) -> bytes:
        flags = (SUB_PATIENT if self.patient else 0) | (SUB_BUSY if self.busy_ms > 0 else 0)
        return SUB_HEAD.pack(flags, self.chunk, max(0, self.busy_ms)) + self.want

    @classmethod
    def decode(cls, body: bytes) -> SubMessage:
        """Raises ValueError on a body too short to hold the head."""
        if len(body) < SUB_HEAD.size:
            raise ValueError("subscription message too short")
        flags, chunk, busy_ms = SUB_HEAD.unpack_from(body)
        return cls(body[SUB_HEAD.size:], bool(flags & SUB_PATIENT), chunk,
                   busy_ms if flags & SUB_BUSY else 0)


@dataclass(frozen=True, slots=True)
class Offer:
    """Chunks a source offers a subscriber, its preferred first; ``fresh``, ``queued``: see
    ``OFFER_FRESH``, ``OFFER_QUEUED``."""

    chunks: list[int]
    fresh: bool = False
    queued: bool = False

    def encode(self) -> bytes:
        flags = (OFFER_FRESH if self.fresh else 0) | (OFFER_QUEUED if self.queued else 0)
        return b"".join(OFFER_CHUNK.pack(c) for c in [flags, *self.chunks])

    @classmethod
    def decode(cls, payload: bytes) -> Offer:
        words = [c for (c,) in OFFER_CHUNK.iter_unpack(payload[:len(payload) - len(payload) % OFFER_CHUNK.size])]
        if not words:
            return cls([])
        return cls(words[1:], bool(words[0] & OFFER_FRESH), bool(words[0] & OFFER_QUEUED))


@dataclass(frozen=True, slots=True)
class Reply:
    """What a source answers to one request, plus test-only fault instructions.

    ``cut_after`` sends only that many payload bytes (the header still announces the full
    length), then ``then`` decides: ``"die"`` kills the whole source, ``"stall"`` keeps the
    connection open and sends nothing more.
    """

    status: Status
    payload: memoryview | bytes = b""
    cut_after: int | None = None
    then: Literal["none", "stall", "die"] = "none"
    is_chunk: bool = False
    """True for chunk bytes (FETCH, or TAKE after an OFFER): it holds an upload slot until ``done``."""
    index: int = -1
    """The chunk sent (-1 if none)."""


class Ticket:
    """A FETCH waiting at a source for an upload slot: ``future`` resolves to the reply to send (a
    chunk, whose upload slot is taken until ``done``, or MISSING)."""

    def __init__(self, future: asyncio.Future[Reply]) -> None:
        self.future = future


class Subscription(abc.ABC):
    """A subscriber as its source's transport sees it (see the module docstring)."""

    offer: asyncio.Future[Offer | None]
    """Resolves to the next offer (an upload slot is held for it until ``take`` or ``pass_``), or
    None: the version is gone from the source (send MISSING and end). A new future is set after
    each answer."""

    @abc.abstractmethod
    def update(self, msg: SubMessage) -> None:
        """The subscriber's new bitmap and flags (any message it sends carries them)."""

    @abc.abstractmethod
    def take(self, msg: SubMessage) -> Reply:
        """The answer TAKE to the last offer: the chunk's reply (it keeps the offer's slot until
        ``done``), or MISSING (the slot is freed) if that chunk was not offered."""

    @abc.abstractmethod
    def pass_(self, msg: SubMessage) -> None:
        """The answer PASS to the last offer: frees its slot."""

    @abc.abstractmethod
    def close(self) -> None:
        """The subscriber went away: forget it (and free an offer's slot). Safe to call twice."""


class RequestHandler(abc.ABC):
    """Server-side logic a transport calls for each request (implemented by WeightServer)."""

    answer_timeout_s: float | None = None
    """Longest a transport waits for a subscriber to take its offer and answer (TAKE or PASS);
    past it the subscription ends (``Subscription.close`` frees the offer's place in line). None:
    no limit."""
    send_timeout_s: float | None = None
    """Longest a reply's bytes may take to leave once its upload slot is taken; past it the
    connection ends (its slot is freed). None: no limit."""
    send_stall_s: float | None = None
    """Longest a reply's bytes may stand still (nothing of it leaves) once its upload slot is
    taken; past it the connection ends (its slot is freed). None: no limit."""

    def max_body(self, version: int) -> int:
        """Longest SUB/TAKE/PASS body about ``version`` the transport reads (a longer one ends
        the connection: it would make the source allocate whatever the header says)."""
        return MAX_SUB_BODY

    @abc.abstractmethod
    def handle(self, op: Op, version: int, index: int) -> Reply:
        """Answer a HAVE or MANIFEST request; must not block."""

    @abc.abstractmethod
    def request_chunk(self, version: int, index: int) -> Ticket:
        """A FETCH, answered when its ticket resolves; must not block."""

    @abc.abstractmethod
    def withdraw(self, ticket: Ticket) -> bool:
        """The puller went away: drop a waiting ticket and return True; a ticket already resolved
        keeps its reply (False: release it with ``done(reply, 0)`` if not sent)."""

    @abc.abstractmethod
    def subscribe(self, version: int, msg: SubMessage) -> Subscription | None:
        """A new subscriber of ``version`` (None: the version is not here, or the bitmap does not
        fit it: answer MISSING); must not block."""

    @abc.abstractmethod
    def load(self) -> int:
        """Requests currently being served (reported in every reply header)."""

    async def begin(self, reply: Reply) -> None:
        """Called before a reply's payload is sent: waits for an upload slot (chunk replies)."""

    def halfway(self, reply: Reply) -> None:
        """Called once half of a chunk reply's payload has left (the next upload may line up)."""

    @abc.abstractmethod
    def done(self, reply: Reply, sent: int) -> None:
        """Account for a reply whose payload bytes have left (``sent`` may be short or 0); what a
        chunk reply held (its place in line, its upload slot) is free again."""

    @abc.abstractmethod
    async def die(self) -> None:
        """Fault hook: stop serving at once, as if the process were killed."""

    @abc.abstractmethod
    async def stalled(self) -> None:
        """Fault hook: returns only when the server closes."""


class TransportServer(abc.ABC):
    """Listens for pullers and serves their requests through a RequestHandler."""

    @abc.abstractmethod
    async def start(self, host: str, port: int) -> str:
        """Start listening; returns the address pullers connect to."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop listening and drop every connection. Safe to call twice."""


class TransportClient(abc.ABC):
    """One connection from a puller to one source; one request at a time."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.load = 0
        """Load the source reported in its last reply."""
        self.payload_received = 0
        """Payload bytes received so far, including partial chunks (for resend accounting)."""
        self.pending: frozenset[int] = frozenset()
        """Chunks the source said (in its last HAVE) its own puller is fetching right now."""
        self.served = 0
        """Chunks of the asked version the source said (in its last HAVE) it has uploaded."""

    decode_have = True
    """False: ``have`` returns an empty set and leaves ``pending`` alone, keeping the raw reply in
    ``have_payload`` (a puller that tracks differences of the bitmaps itself sets this: decoding
    every reply into sets costs O(chunks) per HAVE)."""
    have_payload: bytes | None = None
    """The last HAVE reply's payload (``encode_have_reply``); None after a MISSING answer."""

    def _read_have(self, payload: bytes, num_chunks: int) -> frozenset[int]:
        """Take a HAVE payload: set ``pending`` and ``served``; return the held chunks."""
        self.have_payload = payload
        self.served = decode_have_served(payload, num_chunks)
        if not self.decode_have:
            return frozenset()
        held, self.pending = decode_have_reply(payload, num_chunks)
        return held

    @abc.abstractmethod
    async def connect(self, timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S) -> None:
        """Open the connection; raises TransportError if the source is unreachable."""

    @abc.abstractmethod
    async def fetch_chunk(self, version: int, index: int, into: memoryview) -> bool:
        """Fetch chunk ``index`` of ``version`` into ``into`` (exactly its size).

        Returns False when the source does not hold that chunk; raises TransportError when
        the connection fails or the reply length does not match ``into``.
        """

    async def send_sub(self, op: Op, version: int, msg: SubMessage) -> None:
        """Send SUB (subscribe or update), TAKE or PASS on this (subscription) connection."""
        raise TransportError("subscriptions not supported by this transport", address=self.address)

    async def next_offer(self) -> tuple[Status, Offer | None]:
        """The source's next message on a subscription: (OFFER, offer) or (MISSING, None)."""
        raise TransportError("subscriptions not supported by this transport", address=self.address)

    async def chunk_reply(self) -> tuple[Status, int]:
        """After TAKE: (status, payload length) of the reply; the bytes follow (``recv_payload``)."""
        raise TransportError("subscriptions not supported by this transport", address=self.address)

    async def recv_payload(self, index: int, into: memoryview) -> None:
        """The bytes ``chunk_reply`` announced, into ``into`` (exactly their size)."""
        raise TransportError("subscriptions not supported by this transport", address=self.address)

    @abc.abstractmethod
    async def have(self, version: int, num_chunks: int) -> frozenset[int]:
        """Indices of the chunks of ``version`` this source holds (empty if none).

        Also sets ``self.pending`` from the reply (chunks the source is fetching itself)."""

    @abc.abstractmethod
    async def manifest(self, version: int) -> bytes | None:
        """The manifest JSON of ``version`` this source serves (None if it has not that version)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Close the connection. Safe to call twice."""


def encode_have(held: np.ndarray) -> bytes:
    """Bitmap of a boolean array of chunk flags (little bit order)."""
    return np.packbits(held.astype(bool), bitorder="little").tobytes()


def decode_have(bitmap: bytes, num_chunks: int) -> frozenset[int]:
    """Chunk indices set in a bitmap made by :func:`encode_have`."""
    bits = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8), bitorder="little")[:num_chunks]
    return frozenset(np.flatnonzero(bits).tolist())


HAVE_SERVED = struct.Struct("!Q")
"""Trailer of a HAVE reply: chunks of that version the source has uploaded so far."""


def have_reply_size(num_chunks: int) -> int:
    """Length of a HAVE payload for a version of ``num_chunks`` chunks (``encode_have_reply``):
    two bitmaps and the served count. A reply of any other length is garbage."""
    return 2 * ((num_chunks + 7) // 8) + HAVE_SERVED.size


def encode_have_reply(held: np.ndarray, pending: np.ndarray, served: int) -> bytes:
    """A HAVE payload: the held bitmap, the pending bitmap, then the served count."""
    return encode_have(held) + encode_have(pending) + HAVE_SERVED.pack(served)


def decode_have_reply(payload: bytes, num_chunks: int) -> tuple[frozenset[int], frozenset[int]]:
    """(held, pending) from a HAVE payload made by :func:`encode_have_reply`."""
    size = (num_chunks + 7) // 8
    return decode_have(payload[:size], num_chunks), decode_have(payload[size:2 * size], num_chunks)


def decode_have_served(payload: bytes, num_chunks: int) -> int:
    """The served count of a HAVE payload (0 from a source that sends none)."""
    tail = payload[2 * ((num_chunks + 7) // 8):]
    return HAVE_SERVED.unpack(tail[:HAVE_SERVED.size])[0] if len(tail) >= HAVE_SERVED.size else 0


def reply_status(raw: int, address: str) -> Status:
    """The status byte of a reply header; raises TransportError (``reason="corrupt"``) on one no
    source sends."""
    try:
        return Status(raw)
    except ValueError as exc:
        raise TransportError("bad reply from weight source: unknown status", address=address, status=raw,
                             reason="corrupt") from exc


def check_reply_length(nbytes: int, limit: int, address: str, what: str) -> None:
    """Refuse a reply payload length read from the wire that is longer than any source sends
    (``limit``), before anything is allocated for it: TransportError with ``reason="corrupt"``."""
    if nbytes > limit:
        raise TransportError(f"{what} reply longer than any source sends", address=address, nbytes=nbytes,
                             limit=limit, reason="corrupt")


def check_have_length(status: Status, nbytes: int, num_chunks: int, address: str) -> None:
    """A HAVE reply's payload must be exactly ``have_reply_size(num_chunks)`` long when the source
    holds the version (OK), and no longer than that otherwise; raises TransportError."""
    size = have_reply_size(num_chunks)
    if status is Status.OK and nbytes != size:
        raise TransportError("HAVE reply does not fit the version's chunk count", address=address,
                             nbytes=nbytes, want=size, chunks=num_chunks, reason="corrupt")
    check_reply_length(nbytes, size, address, "HAVE")


def parse_address(address: str) -> tuple[str, str, int]:
    """``'tcp://127.0.0.1:5000'`` -> ``('tcp', '127.0.0.1', 5000)``; raises TransportError.

    Addresses arrive in announcements from other members (``WeightsHave.address``), so anything
    but a known scheme, a printable ASCII host and a port in 1-65535 is refused here rather than
    failing later with whatever exception the socket layer picks (OverflowError, UnicodeError)."""
    scheme, sep, rest = address.partition("://")
    host, colon, port = rest.rpartition(":")
    if (not sep or not colon or scheme not in ("tcp", "ucx") or not host or len(host) > 255
            or not host.isascii() or not host.isprintable() or " " in host
            or not port.isascii() or not port.isdigit() or not 0 < int(port) <= 65535):
        raise TransportError("bad weight-source address", address=address)
    return scheme, host, int(port)


def make_server(kind: str, handler: RequestHandler) -> TransportServer:
    """A server of transport ``kind`` ('tcp' or 'ucx') answering through ``handler``."""
    if kind == "tcp":
        from robustrl.weights.tcp import TcpServer

        return TcpServer(handler)
    if kind == "ucx":
        from robustrl.weights.ucx import UcxServer

        return UcxServer(handler)
    raise TransportError("unknown weight transport", transport=kind)


def make_client(address: str) -> TransportClient:
    """An unconnected client for ``address``; the scheme picks the transport."""
    scheme, _, _ = parse_address(address)
    if scheme == "tcp":
        from robustrl.weights.tcp import TcpClient

        return TcpClient(address)
    try:
        from robustrl.weights.ucx import UcxClient
    except ImportError as exc:  # the robustrl[ucx] extra is optional: a ucx:// source is then unreachable
        raise TransportError("ucx transport not installed (pip install robustrl[ucx])", address=address) from exc
    return UcxClient(address)


async def send_in_slices(send: Callable[[memoryview], Awaitable[object]], data: bytes | memoryview,
                         slice_bytes: int, stall_s: float | None, window: int = 1) -> None:
    """Send ``data`` as consecutive slices of at most ``slice_bytes`` (``send`` sends one), up to
    ``window`` of them on their way at once, the oldest each time within ``stall_s`` of the one
    before it (None: no bound); raises TimeoutError (an OSError) on the first that is not.

    This is what "a send stalled" means for both transports (``RequestHandler.send_stall_s``): a
    slice did not leave in that long. A whole chunk is bounded only by ``send_timeout_s`` (30 s),
    so a receiver frozen mid-chunk held the source's upload slot past every puller's own stall
    bound; a slice that stands still frees it within ``stall_s`` of the last bytes taken. (A window
    above 1 hides a per-slice handshake, as UCX has; each slice runs as a task, and those still on
    their way when one fails are cancelled.)"""
    view = memoryview(data).cast("B")
    if window <= 1:
        for start in range(0, len(view), slice_bytes):
            part = view[start:start + slice_bytes]
            await (send(part) if stall_s is None else within(send(part), stall_s))
        return
    flying: deque[asyncio.Future[object]] = deque()
    try:
        for start in range(0, len(view), slice_bytes):
            flying.append(asyncio.ensure_future(send(view[start:start + slice_bytes])))
            if len(flying) >= window:
                oldest = flying.popleft()
                await (oldest if stall_s is None else within(oldest, stall_s))
        while flying:
            oldest = flying.popleft()
            await (oldest if stall_s is None else within(oldest, stall_s))
    finally:
        for task in flying:
            drop_task(task)  # type: ignore[arg-type]


def release_ticket(handler: RequestHandler, ticket: Ticket) -> None:
    """A FETCH whose reply will not be sent: withdraw it, or free the slot its reply took."""
    if not handler.withdraw(ticket) and not ticket.future.cancelled():
        handler.done(ticket.future.result(), 0)


def drop_task(task: asyncio.Task[object] | None) -> None:
    """Cancel a reader task, or take its outcome if it has one (no 'never retrieved' warnings)."""
    if task is None:
        return
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()
