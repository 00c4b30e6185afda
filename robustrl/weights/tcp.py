"""TCP weight transport on asyncio sockets, with no extra copies of chunk bytes.

asyncio's StreamWriter copies whatever the kernel does not take at once into its own buffer,
and StreamReader returns fresh ``bytes``; for 100 MB+ versions both copies cost as much as the
transfer. So this module uses the loop's socket primitives instead: the server hands the
kernel memoryviews of the published buffer (``sock_sendall``) and the client receives
straight into the destination slice (``sock_recv_into``). Frames are length-prefixed by the
16-byte header from ``transport.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

from robustrl.errors import TransportError
from robustrl.weights.transport import (
    DEFAULT_CONNECT_TIMEOUT_S,
    HEADER,
    Op,
    RequestHandler,
    Status,
    TransportClient,
    TransportServer,
    parse_address,
)

_SOCK_BUF = 4 << 20  # bigger kernel buffers: fewer wakeups per MiB on loopback and LANs


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCK_BUF)


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview,
                        progress: list[int] | None = None) -> None:
    pos = 0
    while pos < len(view):
        n = await loop.sock_recv_into(sock, view[pos:])
        if n == 0:
            raise ConnectionResetError("peer closed the connection")
        pos += n
        if progress is not None:
            progress[0] += n


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
            _tune(sock)
            task = asyncio.create_task(self._serve(sock), name="weights-tcp-conn")
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        request = bytearray(HEADER.size)
        try:
            while True:
                await _recv_exactly(loop, sock, memoryview(request))
                op, index, version = HEADER.unpack(request)
                reply = self._handler.handle(Op(op), version, index)
                sent = 0
                try:
                    payload = memoryview(reply.payload).cast("B")
                    await loop.sock_sendall(sock, HEADER.pack(reply.status, self._handler.load(), len(payload)))
                    part = payload if reply.cut_after is None else payload[:reply.cut_after]
                    await loop.sock_sendall(sock, part)
                    sent = len(part)
                finally:
                    self._handler.done(reply, sent)
                if reply.then == "die":
                    asyncio.create_task(self._handler.die())
                    return
                if reply.then == "stall":
                    await self._handler.stalled()
                    return
        except (ConnectionError, OSError, ValueError):
            return  # the puller went away or sent garbage; other connections keep serving
        finally:
            sock.close()

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
            await asyncio.wait_for(loop.sock_connect(sock, (self._host, self._port)), timeout_s)
        except (OSError, TimeoutError) as exc:
            sock.close()
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
        return Status(status), nbytes

    async def fetch_chunk(self, version: int, index: int, into: memoryview) -> bool:
        status, nbytes = await self._request(Op.FETCH, version, index)
        if status != Status.OK:
            return False
        if nbytes != len(into):
            raise TransportError("chunk length differs from manifest", address=self.address,
                                 chunk=index, got=nbytes, want=len(into))
        try:
            await _recv_exactly(asyncio.get_running_loop(), self._sock, into, self._progress)  # type: ignore[arg-type]
        except OSError as exc:
            raise TransportError("weight source failed mid-chunk", address=self.address, chunk=index) from exc
        return True

    async def _reply(self, op: Op, version: int) -> tuple[Status, bytes]:
        """One request whose whole reply payload is read (HAVE, MANIFEST)."""
        status, nbytes = await self._request(op, version, 0)
        payload = bytearray(nbytes)
        try:
            await _recv_exactly(asyncio.get_running_loop(), self._sock, memoryview(payload))  # type: ignore[arg-type]
        except OSError as exc:
            raise TransportError("weight source failed", address=self.address) from exc
        return status, bytes(payload)

    async def have(self, version: int, num_chunks: int) -> frozenset[int]:
        status, payload = await self._reply(Op.HAVE, version)
        if status != Status.OK:
            self.pending, self.have_payload = frozenset(), None
            return frozenset()
        return self._read_have(payload, num_chunks)

    async def manifest(self, version: int) -> bytes | None:
        status, payload = await self._reply(Op.MANIFEST, version)
        return payload if status == Status.OK else None

    async def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
