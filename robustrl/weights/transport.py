"""The weight-transport interface, its wire format, and the factory for implementations.

A transport moves chunks of a flat weight buffer between a source (``WeightServer`` in a
trainer rank or a relaying replica) and a puller. It knows two requests:

* ``FETCH(version, index)`` -> the chunk's bytes, written straight into the caller's buffer;
* ``HAVE(version)`` -> which chunks of that version the source holds (a bitmap);
* ``MANIFEST(version)`` -> the version's manifest (JSON bytes).

Every reply starts with a fixed 16-byte header carrying a status, the source's current load
(requests in flight), and the payload length, so a puller learns the load of its sources
for free. Two implementations share this format: ``tcp`` (asyncio sockets, see ``tcp.py``)
and ``ucx`` (ucxx, see ``ucx.py``, imported only when a ``ucx://`` address is used, so the
``robustrl[ucx]`` extra stays optional).
"""

from __future__ import annotations

import abc
import enum
import struct
from dataclasses import dataclass
from typing import Literal

import numpy as np

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


class Status(enum.IntEnum):
    OK = 0
    MISSING = 1


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
    """True for a FETCH answered with chunk bytes (counted as load and in bytes_sent)."""


class RequestHandler(abc.ABC):
    """Server-side logic a transport calls for each request (implemented by WeightServer)."""

    @abc.abstractmethod
    def handle(self, op: Op, version: int, index: int) -> Reply:
        """Answer one request; must not block."""

    @abc.abstractmethod
    def load(self) -> int:
        """Requests currently being served (reported in every reply header)."""

    @abc.abstractmethod
    def done(self, reply: Reply, sent: int) -> None:
        """Account for a reply whose payload bytes have left (``sent`` may be short)."""

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


def parse_address(address: str) -> tuple[str, str, int]:
    """``'tcp://127.0.0.1:5000'`` -> ``('tcp', '127.0.0.1', 5000)``; raises TransportError."""
    scheme, sep, rest = address.partition("://")
    host, colon, port = rest.rpartition(":")
    if not sep or not colon or scheme not in ("tcp", "ucx") or not host or not port.isdigit():
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
    from robustrl.weights.ucx import UcxClient

    return UcxClient(address)

