"""TCP weight transport on asyncio sockets, with no extra copies of chunk bytes.

asyncio's StreamWriter copies whatever the kernel does not take at once into its own buffer,
and StreamReader returns fresh ``bytes``; for 100 MB+ versions both copies cost as much as the
transfer. So this module uses the loop's socket primitives instead: the server hands the
kernel memoryviews of the published buffer (``sock_sendall``) and the client receives
straight into the destination slice (``sock_recv_into``). Frames are length-prefixed by the
16-byte header from ``transport.py``. A subscription (``transport.py``) has a connection of its
own: the source writes offers and chunks on it, and reads the subscriber's answers and updates
while an offer waits.

Server sockets set TCP_NOTSENT_LOWAT (``NOTSENT_LOWAT``), so a chunk's ``sock_sendall`` returns
when its bytes have nearly left the host rather than when they fit in the socket buffer: the
upload slot is held as long as the chunk is on the wire, and "halfway" (``RequestHandler.halfway``)
means half of it has gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

from robustrl.aio import within
from robustrl.errors import TransportError
from robustrl.weights.manifest import MAX_MANIFEST_BYTES
from robustrl.weights.transport import (
    DEFAULT_CONNECT_TIMEOUT_S,
    HEADER,
    MAX_OFFER_BODY,
    Offer,
    Op,
    Reply,
    RequestHandler,
    Status,
    SubMessage,
    TransportClient,
    TransportServer,
    check_have_length,
    check_reply_length,
    drop_task,
    parse_address,
    release_ticket,
    reply_status,
    send_in_slices,
)

_SOCK_BUF = 4 << 20  # bigger kernel buffers: fewer wakeups per MiB on loopback and LANs
NOTSENT_LOWAT = 64 << 10
"""A source's socket takes more of a chunk only while less than this is still unsent
(TCP_NOTSENT_LOWAT), so sending a chunk ends when all but this much has left the host, not when
the whole chunk sits in a 4 MiB socket buffer (where 16 chunks "sent" at once then shared the
link). 64 KiB: a small overlap of one upload with the next, and at loopback rates (GB/s) a wakeup
per 64 KiB measured no slower than 256 KiB or none."""
SEND_SLICE = 64 << 10
"""Bytes handed to one bounded ``sock_sendall`` (``_sendall``): each slice must leave within the
handler's ``send_stall_s`` (64 KiB in 2 s: a connection getting 0.3 Mbit/s or more, a receiver
that reads, is never taken for one that stopped)."""


def close_socket(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    """Close ``sock`` once nothing of the loop waits on it: a read or write still registered for it
    (another task's, or a cancelled one whose clean-up has not run yet) is unregistered first.
    Closed under such a wait, its descriptor number went to the next socket the process opened,
    which then failed to connect or was never woken, and the old wait's clean-up later
    unregistered the new socket (an outside review: a pull failed 'unavailable' with a complete
    source alive, after a frozen relay's subscription was closed under its waiting task)."""
    with contextlib.suppress(OSError, ValueError, RuntimeError):
        fd = sock.fileno()
        if fd >= 0:
            loop.remove_reader(fd)
            loop.remove_writer(fd)
    sock.close()


def _tune(sock: socket.socket, notsent_lowat: int | None = None) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCK_BUF)
    if notsent_lowat is not None and hasattr(socket, "TCP_NOTSENT_LOWAT"):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, notsent_lowat)


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview,
                        progress: list[int] | None = None, bulk: bool = False) -> None:
    """Fill ``view`` from ``sock``. ``bulk`` (a chunk's bytes): SO_RCVLOWAT is set to what is still
    to come (at most ``RCVLOWAT``), never more, so the wait cannot outlast the chunk."""
    pos, lowat = 0, 1
    try:
        while pos < len(view):
            want = min(RCVLOWAT, len(view) - pos) if bulk else 1
            if want != lowat:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                lowat = want
            n = await loop.sock_recv_into(sock, view[pos:])
            if n == 0:
                raise ConnectionResetError("peer closed the connection")
            pos += n
            if progress is not None:
                progress[0] += n
    finally:
        if lowat != 1:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)


PAYLOAD_PIECE = 1 << 20
"""First piece a HAVE or MANIFEST reply is read into; each next one is as large as all before."""
RCVLOWAT = 128 << 10
"""While a chunk's bytes arrive, its socket wakes the reader only once this much is in (or the
rest of the chunk, if less): ~8 wakeups per MiB instead of one per packet burst (~40 on the
testbed), which on 2 cores shared by 17 processes is CPU the links' pace does not wait for."""


async def _recv_bulk(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview,
                     progress: list[int] | None = None) -> None:
    """``_recv_exactly`` for a chunk's bytes (SO_RCVLOWAT raised while they arrive)."""
    await _recv_exactly(loop, sock, view, progress, bulk=True)


class TcpServer(TransportServer):
    """Accepts connections and answers FETCH / HAVE frames until closed."""

    def __init__(self, handler: RequestHandler) -> None:
        self._handler = handler
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._closed = False

    async def start(self, host: str, port: int) -> str:
        listener = socket.create_server((host, port), backlog=128)
        listener.setblocking(False)
        self._listener = listener
        self._accept_task = asyncio.create_task(self._accept_loop(), name="weights-tcp-accept")
        return f"tcp://{host}:{listener.getsockname()[1]}"

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            sock, _ = await loop.sock_accept(self._listener)
            _tune(sock, NOTSENT_LOWAT)
            task = asyncio.create_task(self._serve(sock), name="weights-tcp-conn")
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    @staticmethod
    async def _read_request(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                            handler: RequestHandler) -> tuple[Op, int, int, bytes]:
        """(op, index, version, body) of the next request; ValueError on garbage."""
        request = bytearray(HEADER.size)
        await _recv_exactly(loop, sock, memoryview(request))
        op_raw, index, version = HEADER.unpack(request)
        op = Op(op_raw)
        body = b""
        if op in (Op.SUB, Op.TAKE, Op.PASS):
            if index > handler.max_body(version):  # its bitmap's size, not whatever the header says
                raise ValueError("subscription message too long")
            buf = bytearray(index)
            await _recv_exactly(loop, sock, memoryview(buf))
            body = bytes(buf)
        return op, index, version, body

    async def _sendall(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, data: bytes | memoryview) -> None:
        """``sock_sendall`` in ``SEND_SLICE`` pieces, each bounded by the handler's ``send_stall_s``:
        a receiver that stopped reading (frozen, cut off) ends its connection within that long of
        the last bytes it took (TimeoutError, an OSError), not after the whole send bound."""
        stall = self._handler.send_stall_s
        if stall is None:
            await loop.sock_sendall(sock, data)
            return
        await send_in_slices(lambda part: loop.sock_sendall(sock, part), data, SEND_SLICE, stall)

    async def _send(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, reply: Reply) -> None:
        sent = 0
        try:
            await self._handler.begin(reply)
            payload = memoryview(reply.payload).cast("B")
            # a receiver that stopped reading (frozen, cut off) must not keep the upload slot: past
            # the limit TimeoutError (an OSError) ends this connection; one timer per reply
            async with asyncio.timeout(self._handler.send_timeout_s):
                await self._sendall(loop, sock, HEADER.pack(reply.status, self._handler.load(), len(payload)))
                part = payload if reply.cut_after is None else payload[:reply.cut_after]
                half = len(part) // 2
                if reply.is_chunk and half:
                    # sendall returns once all but NOTSENT_LOWAT of what it was given has left
                    await self._sendall(loop, sock, part[:half])
                    sent = half
                    self._handler.halfway(reply)
                if len(part) > sent:
                    await self._sendall(loop, sock, part[sent:])
                sent = len(part)
        finally:
            self._handler.done(reply, sent)

    async def _after(self, reply: Reply) -> bool:
        """Carry out a fault's ``then``; True if the connection ends here."""
        if reply.then == "die":
            asyncio.create_task(self._handler.die())
            return True
        if reply.then == "stall":
            await self._handler.stalled()
            return True
        return False

    async def _serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        ahead: asyncio.Task[tuple[Op, int, int, bytes]] | None = None  # the next request, read while one waits
        try:
            while True:
                if ahead is None:
                    op, index, version, body = await self._read_request(loop, sock, self._handler)
                else:
                    op, index, version, body = await ahead
                    ahead = None
                if op is Op.SUB:
                    await self._subscription(loop, sock, version, SubMessage.decode(body))
                    return
                if op is not Op.FETCH:
                    if op in (Op.TAKE, Op.PASS):
                        return  # answers with no offer: protocol error
                    await self._send(loop, sock, self._handler.handle(op, version, index))
                    continue
                ticket = self._handler.request_chunk(version, index)
                if not ticket.future.done():  # waits for an upload slot; notice the puller leaving
                    ahead = asyncio.create_task(self._read_request(loop, sock, self._handler))
                    try:
                        await asyncio.wait({ticket.future, ahead}, return_when=asyncio.FIRST_COMPLETED)
                    except BaseException:
                        release_ticket(self._handler, ticket)
                        raise
                    if not ticket.future.done():
                        self._handler.withdraw(ticket)
                        return  # it spoke out of turn or went away
                reply = ticket.future.result()
                await self._send(loop, sock, reply)
                if await self._after(reply):
                    return
        except (ConnectionError, OSError, ValueError):
            return  # the puller went away or sent garbage; other connections keep serving
        finally:
            drop_task(ahead)
            close_socket(loop, sock)

    async def _subscription(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, version: int,
                            msg: SubMessage) -> None:
        """Serve one subscriber until it goes away (see ``transport.py``)."""
        sub = self._handler.subscribe(version, msg)
        if sub is None:
            await loop.sock_sendall(sock, HEADER.pack(Status.MISSING, self._handler.load(), 0))
            return
        reader = asyncio.create_task(self._read_request(loop, sock, self._handler))
        try:
            while True:
                await asyncio.wait({sub.offer, reader}, return_when=asyncio.FIRST_COMPLETED)
                if not sub.offer.done():  # the subscriber spoke unasked: only an update may
                    op, _, _, body = reader.result()
                    reader = asyncio.create_task(self._read_request(loop, sock, self._handler))
                    if op is not Op.SUB:
                        return
                    sub.update(SubMessage.decode(body))
                    continue
                proposal = sub.offer.result()
                if proposal is None:  # the version is gone from here
                    await loop.sock_sendall(sock, HEADER.pack(Status.MISSING, self._handler.load(), 0))
                    return
                offer = proposal.encode()
                # The offer holds a place in line until answered: a subscriber that does not answer
                # in time (frozen, cut off) loses the subscription, which frees it (``sub.close``)
                # and lets dispatch go on. One timer per offer.
                timeout = self._handler.answer_timeout_s
                try:
                    async with asyncio.timeout(timeout):
                        await loop.sock_sendall(sock, HEADER.pack(Status.OFFER, self._handler.load(),
                                                                  len(offer)) + offer)
                        while True:  # its answer (updates may come first)
                            op, _, _, body = await reader
                            reader = asyncio.create_task(self._read_request(loop, sock, self._handler))
                            answer = SubMessage.decode(body)
                            if op is not Op.SUB:
                                break
                            sub.update(answer)
                except TimeoutError:
                    return
                if op is Op.PASS:
                    sub.pass_(answer)
                elif op is Op.TAKE:
                    reply = sub.take(answer)
                    await self._send(loop, sock, reply)
                    if await self._after(reply):
                        return
                else:
                    return
        finally:
            drop_task(reader)
            sub.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        tasks = [t for t in (self._accept_task, *self._conns) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()


class TcpClient(TransportClient):
    """One TCP connection to a weight source."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        _, self._host, self._port = parse_address(address)
        self._sock: socket.socket | None = None
        self._header = bytearray(HEADER.size)
        self._progress = [0]

    @property
    def payload_received(self) -> int:  # type: ignore[override]
        return self._progress[0]

    @payload_received.setter
    def payload_received(self, value: int) -> None:
        self._progress = [value]

    async def connect(self, timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S) -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        _tune(sock)
        try:
            await within(loop.sock_connect(sock, (self._host, self._port)), timeout_s)
        except (OSError, TimeoutError, ValueError) as exc:  # ValueError: a host IDNA refuses (UnicodeError)
            close_socket(loop, sock)
            raise TransportError("cannot connect to weight source", address=self.address) from exc
        self._sock = sock

    async def _request(self, op: Op, version: int, index: int) -> tuple[Status, int]:
        if self._sock is None:
            raise TransportError("weight-source connection is closed", address=self.address)
        loop = asyncio.get_running_loop()
        try:
            await loop.sock_sendall(self._sock, HEADER.pack(op, index, version))
            await _recv_exactly(loop, self._sock, memoryview(self._header))
        except OSError as exc:
            raise TransportError("weight source failed", address=self.address) from exc
        status, load, nbytes = HEADER.unpack(self._header)
        self.load = load
        return reply_status(status, self.address), nbytes

    async def fetch_chunk(self, version: int, index: int, into: memoryview) -> bool:
        status, nbytes = await self._request(Op.FETCH, version, index)
        if status != Status.OK:
            check_reply_length(nbytes, 0, self.address, "MISSING")  # else its bytes would be read as a header
            return False
        if nbytes != len(into):
            raise TransportError("chunk length differs from manifest", address=self.address,
                                 chunk=index, got=nbytes, want=len(into))
        try:
            await _recv_bulk(asyncio.get_running_loop(), self._sock, into, self._progress)  # type: ignore[arg-type]
        except OSError as exc:
            raise TransportError("weight source failed mid-chunk", address=self.address, chunk=index) from exc
        return True

    async def _read_payload(self, nbytes: int) -> bytes:
        """``nbytes`` of reply payload (already checked against its limit), read in pieces that
        double as bytes arrive: memory follows what the source sent, not what its header claims."""
        payload = bytearray()
        loop = asyncio.get_running_loop()
        try:
            while len(payload) < nbytes:
                part = bytearray(min(nbytes - len(payload), max(PAYLOAD_PIECE, len(payload))))
                await _recv_exactly(loop, self._sock, memoryview(part))  # type: ignore[arg-type]
                payload += part
        except OSError as exc:
            raise TransportError("weight source failed", address=self.address) from exc
        return bytes(payload)

    async def _send_raw(self, data: bytes) -> None:
        if self._sock is None:
            raise TransportError("weight-source connection is closed", address=self.address)
        try:
            await asyncio.get_running_loop().sock_sendall(self._sock, data)
        except OSError as exc:
            raise TransportError("weight source failed", address=self.address) from exc

    async def send_sub(self, op: Op, version: int, msg: SubMessage) -> None:
        body = msg.encode()
        await self._send_raw(HEADER.pack(op, len(body), version) + body)

    async def _head(self) -> tuple[Status, int]:
        if self._sock is None:
            raise TransportError("weight-source connection is closed", address=self.address)
        try:
            await _recv_exactly(asyncio.get_running_loop(), self._sock, memoryview(self._header))
        except OSError as exc:
            raise TransportError("weight source failed", address=self.address) from exc
        status, load, nbytes = HEADER.unpack(self._header)
        self.load = load
        return reply_status(status, self.address), nbytes

    async def next_offer(self) -> tuple[Status, Offer | None]:
        status, nbytes = await self._head()
        if nbytes > MAX_OFFER_BODY:
            raise TransportError("offer longer than any source sends", address=self.address,
                                 nbytes=nbytes, limit=MAX_OFFER_BODY)
        payload = bytearray(nbytes)
        if nbytes:
            await self.recv_payload(-1, memoryview(payload))
        return status, Offer.decode(bytes(payload)) if status is Status.OFFER else None

    async def chunk_reply(self) -> tuple[Status, int]:
        return await self._head()

    async def recv_payload(self, index: int, into: memoryview) -> None:
        if self._sock is None:
            raise TransportError("weight-source connection is closed", address=self.address)
        try:
            await _recv_bulk(asyncio.get_running_loop(), self._sock, into, self._progress)
        except OSError as exc:
            raise TransportError("weight source failed mid-chunk", address=self.address, chunk=index) from exc

    async def have(self, version: int, num_chunks: int) -> frozenset[int]:
        status, nbytes = await self._request(Op.HAVE, version, 0)
        check_have_length(status, nbytes, num_chunks, self.address)
        payload = await self._read_payload(nbytes)
        if status != Status.OK:
            self.pending, self.have_payload = frozenset(), None
            return frozenset()
        return self._read_have(payload, num_chunks)

    async def manifest(self, version: int) -> bytes | None:
        status, nbytes = await self._request(Op.MANIFEST, version, 0)
        check_reply_length(nbytes, MAX_MANIFEST_BYTES, self.address, "manifest")
        payload = await self._read_payload(nbytes)
        return payload if status == Status.OK else None

    async def close(self) -> None:
        if self._sock is not None:
            close_socket(asyncio.get_running_loop(), self._sock)  # (another task may still wait on it)
            self._sock = None
