"""UCX weight transport on ucxx (optional extra ``robustrl[ucx]``).

Same request/reply format as TCP, carried as UCX tag messages on one endpoint: a 16-byte
request, a 16-byte reply header, then the payload as one message received straight into the
destination slice. UCX picks the fastest path it has (RDMA, CUDA IPC on GPU clusters; TCP
here with ``UCX_TLS=tcp``). A UCX message cannot be half-sent, so the "die mid-chunk" fault
sends the header and then kills the source before the payload.

UCX is initialised on first use with ``UCX_OPTIONS`` (larger TCP segments: UCX's defaults of
8 KiB send / 64 KiB receive segments cost one progress-thread wakeup per segment and held a
256 MiB pull to ~25% of a plain socket here; 1 MiB segments double that). ``UCX_*`` environment
variables still win, and ``UCXPY_PROGRESS_MODE`` picks ucxx's progress mode: the default
``thread`` sleeps in epoll when idle; ``polling`` moves ~2x the bytes on loopback but spins a
core for as long as the process lives, which a rollout replica cannot spare.

The UCX listener binds every interface (ucxx has no bind-address parameter); restrict it with
``UCX_NET_DEVICES`` (e.g. ``lo`` for loopback-only tests). This module imports ucxx at import
time: only ``make_server``/``make_client`` import it, when a ``ucx://`` address is used.
"""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import ucxx

from robustrl.errors import TransportError
from robustrl.weights.transport import (
    DEFAULT_CONNECT_TIMEOUT_S,
    HEADER,
    Op,
    RequestHandler,
    Status,
    TransportClient,
    TransportServer,
    decode_have_reply,
    parse_address,
)

UCX_OPTIONS: dict[str, str] = {"TCP_TX_SEG_SIZE": "1M", "TCP_RX_SEG_SIZE": "1M"}
"""UCX configuration applied when this module initialises ucxx (environment variables win)."""


def _ensure_init() -> None:
    """Initialise ucxx with UCX_OPTIONS unless something in this process already did."""
    if ucxx.core._ctx is None:  # ucxx has no public "is initialised" query
        ucxx.init(options=UCX_OPTIONS, env_takes_precedence=True)


# ucxx raises its own exception classes (UCXError subclasses) plus RuntimeError from the C++ side
_UCX_ERRORS: tuple[type[BaseException], ...] = (ucxx.exceptions.UCXError, RuntimeError, OSError)


class UcxServer(TransportServer):
    """A ucxx listener answering FETCH / HAVE on each endpoint."""

    def __init__(self, handler: RequestHandler) -> None:
        self._handler = handler
        self._listener: object | None = None
        self._endpoints: set[object] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    async def start(self, host: str, port: int) -> str:
        _ensure_init()

        def on_connect(ep: object) -> None:
            # ucxx calls this on the loop thread; run the endpoint under our own task so
            # close() can cancel it
            task = asyncio.get_running_loop().create_task(self._serve(ep))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        self._listener = ucxx.create_listener(on_connect, port=port)
        return f"ucx://{host}:{self._listener.port}"  # type: ignore[attr-defined]

    async def _serve(self, ep: object) -> None:
        self._endpoints.add(ep)
        request = np.empty(HEADER.size, dtype=np.uint8)
        try:
            while True:
                await ep.recv(request)  # type: ignore[attr-defined]
                op, index, version = HEADER.unpack(request.tobytes())
                reply = self._handler.handle(Op(op), version, index)
                sent = 0
                try:
                    payload = memoryview(reply.payload).cast("B")
                    header = HEADER.pack(reply.status, self._handler.load(), len(payload))
                    await ep.send(np.frombuffer(header, dtype=np.uint8))  # type: ignore[attr-defined]
                    if reply.cut_after is None and len(payload):
                        await ep.send(np.frombuffer(payload, dtype=np.uint8))  # type: ignore[attr-defined]
                        sent = len(payload)
                finally:
                    self._handler.done(reply, sent)
                if reply.then == "die":
                    asyncio.get_running_loop().create_task(self._handler.die())
                    return
                if reply.then == "stall":
                    await self._handler.stalled()
                    return
        except (*_UCX_ERRORS, ValueError):
            return
        finally:
            self._endpoints.discard(ep)
            with contextlib.suppress(*_UCX_ERRORS):
                ep.abort()  # type: ignore[attr-defined]

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._listener is not None:
            self._listener.close()  # type: ignore[attr-defined]
        for ep in list(self._endpoints):
            with contextlib.suppress(*_UCX_ERRORS):
                ep.abort()  # type: ignore[attr-defined]
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class UcxClient(TransportClient):
    """One UCX endpoint to a weight source."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        _, self._host, self._port = parse_address(address)
        self._ep: object | None = None
        self._header = np.empty(HEADER.size, dtype=np.uint8)

    async def connect(self, timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S) -> None:
        _ensure_init()
        try:
            self._ep = await asyncio.wait_for(
                ucxx.create_endpoint(self._host, self._port, connect_timeout=timeout_s), timeout_s)
        except (*_UCX_ERRORS, TimeoutError) as exc:
            raise TransportError("cannot connect to weight source", address=self.address) from exc

    async def _request(self, op: Op, version: int, index: int) -> tuple[Status, int]:
        if self._ep is None:
            raise TransportError("weight-source connection is closed", address=self.address)
        try:
            await self._ep.send(np.frombuffer(HEADER.pack(op, index, version), dtype=np.uint8))  # type: ignore[attr-defined]
            await self._ep.recv(self._header)  # type: ignore[attr-defined]
        except _UCX_ERRORS as exc:
            raise TransportError("weight source failed", address=self.address) from exc
        status, load, nbytes = HEADER.unpack(self._header.tobytes())
        self.load = load
        return Status(status), nbytes

    async def _recv_payload(self, into: memoryview | np.ndarray, index: int) -> None:
        try:
            await self._ep.recv(into)  # type: ignore[union-attr]
        except _UCX_ERRORS as exc:
            raise TransportError("weight source failed mid-chunk", address=self.address, chunk=index) from exc

    async def fetch_chunk(self, version: int, index: int, into: memoryview) -> bool:
        status, nbytes = await self._request(Op.FETCH, version, index)
        if status != Status.OK:
            return False
        if nbytes != len(into):
            raise TransportError("chunk length differs from manifest", address=self.address,
                                 chunk=index, got=nbytes, want=len(into))
        if nbytes:
            await self._recv_payload(np.frombuffer(into, dtype=np.uint8), index)
            self.payload_received += nbytes
        return True

    async def have(self, version: int, num_chunks: int) -> frozenset[int]:
        status, nbytes = await self._request(Op.HAVE, version, 0)
        if status != Status.OK or nbytes == 0:
            self.pending = frozenset()
            return frozenset()
        bitmap = np.empty(nbytes, dtype=np.uint8)
        await self._recv_payload(bitmap, -1)
        held, self.pending = decode_have_reply(bitmap.tobytes(), num_chunks)
        return held

    async def close(self) -> None:
        if self._ep is not None:
            with contextlib.suppress(*_UCX_ERRORS):
                self._ep.abort()  # type: ignore[attr-defined]
            self._ep = None
