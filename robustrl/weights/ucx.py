"""UCX weight transport on ucxx (optional extra ``robustrl[ucx]``).

Same request/reply format as TCP, carried as UCX tag messages on one endpoint: a 16-byte
request, a 16-byte reply header, then the payload as consecutive messages of ``PAYLOAD_SLICE``
bytes (the last shorter), each received straight into its part of the destination. UCX picks the
fastest path it has (RDMA, CUDA IPC on GPU clusters; TCP here with ``UCX_TLS=tcp``). The "die
mid-chunk" fault sends the header and then kills the source before the payload.

Why slices. A UCX send reports nothing until the whole message is taken, so a chunk sent as one
message could only be bounded as a whole (``send_timeout_s``, 30 s): a receiver frozen mid-chunk
held the source's upload slot that long, past every other puller's 3-s stall bound. Sliced, each
message is bounded by the handler's ``send_stall_s`` like a TCP slice (``send_in_slices``), and the
client counts a chunk's bytes slice by slice, so a puller's own stall bound (``until_stalled``)
sees progress on UCX too.

Progress. ucxx's own awaiting is the problem on a small host, not UCX: without its Python-future
notifier, every ``await ep.send/recv`` is a ``while not done: await asyncio.sleep(0)`` loop, so
a source waiting for the next request, or a puller waiting for a payload, spins its event loop
at 100% of a core, in every ucxx progress mode (measured: 100% CPU idle with a listener + an
endpoint, in ``thread``, ``blocking`` and ``polling`` alike). In the default ``thread`` mode
that spin also fights the progress thread for the CPU: 4 busy threads on 2 cores during a pull,
~50% of a plain socket. So this module initialises ucxx in ``blocking`` mode and waits on its
requests itself (``_Driver``): the loop watches the worker's epoll fd; each event progresses
the worker until it is out of work, resolves the futures of completed requests, and re-arms
the worker. Moving bytes, the loop thread copies as the socket becomes ready (like ``polling``,
one thread per process); idle it sleeps (a 50 ms safety tick while requests wait: <1% of a
core). ucxx's ``enable_python_future`` also stops the idle spin (~2%) but adds two thread hops
per completion (pull ~50% of raw), binds futures to the first event loop, and its notifier
thread keeps the process from exiting unless stopped by hand.

Measured (256 MiB pulls, 16 MiB chunks, source in a child process, 2 shared cores; ratio
against a blocking socket copy in the same run; ``bench/weight_sync.py --only p2p``):
``thread`` mode 0.47-0.52 (bare transport 0.49-0.52); ``polling`` 0.84-0.93 but a core spun
for the process's life; this driver 0.85-0.93 (bare transport 1.2-1.3: UCX's 1 MiB writes
beat Python's recv loop), idle CPU 0.3-0.8%. UCX_OPTIONS: 1 MiB TCP segments (defaults of
8 KiB send / 64 KiB receive cost one progress pass per segment: 0.33 with the driver); 256 KiB
and 4 MiB segments, RNDV_SCHEME put/get_zcopy and 8 MiB socket buffers measured the same as
this within noise. ``UCX_*`` environment variables still win; ``UCXPY_PROGRESS_MODE`` is
ignored. If ucxx was initialised elsewhere in the process in another progress mode, this
module falls back to ucxx's own (spinning) waits.

Subscriptions (``transport.py``) run over an endpoint of their own, as tag messages like the rest
(an upload is "halfway" for the next one's handshake as soon as its header is sent).

Buffer lifetime. UCX writes a posted receive into its buffer whenever the peer's bytes arrive,
until the request completes or is cancelled: a waiter that gives up (a timeout, a cancelled pull,
an event loop that ends) must not free that buffer. Every request whose waiter left early is
parked here with its buffer until UCX completes it, across event loops (the worker outlives
them). ucxx's own endpoint handshake (``exchange_peer_info``, 16 bytes each way over UCX
streams) frees its receive buffer when its waiter is cancelled: a connect abandoned mid-handshake,
on either side, later had UCX write a peer's 16 bytes into memory Python had reused (pymalloc's
free list: a segfault in unrelated code, tests/test_ucx_handshake.py). This module installs its own
handshake into ucxx (same bytes on the wire) that parks its buffers the same way.

The UCX listener binds every interface (ucxx has no bind-address parameter); restrict it with
``UCX_NET_DEVICES`` (e.g. ``lo`` for loopback-only tests). This module imports ucxx at import
time: only ``make_server``/``make_client`` import it, when a ``ucx://`` address is used.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import struct
import time
import weakref

import numpy as np
import ucxx
from ucxx._lib.arr import Array
from ucxx._lib_async import application_context as _ucxx_context
from ucxx._lib_async import listener as _ucxx_listener
from ucxx._lib_async.utils import hash64bits
from ucxx.types import Tag, TagMaskFull

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

UCX_OPTIONS: dict[str, str] = {"TCP_TX_SEG_SIZE": "1M", "TCP_RX_SEG_SIZE": "1M"}
"""UCX configuration applied when this module initialises ucxx (environment variables win)."""

PAYLOAD_SLICE = 1 << 20
"""Bytes of a reply's payload per UCX message (see the module docstring): the segment size UCX is
set to (``UCX_OPTIONS``), and half of what the pullers' slowest accepted rate
(``stall.SLOW_SOURCE_BYTES_PER_S``, 1 MiB/s) moves in the send stall bound (2 s): a connection that
slow would be dropped by its puller anyway, so the source never ends one its puller would keep.
Part of the wire format: both ends slice alike."""
SEND_WINDOW = 2
"""Slices of one payload on their way at once: each UCX message starts with a handshake (its
receive matched, then its bytes), which one slice in flight at a time left as a gap between
slices (256 MiB point to point, 16 MiB chunks, 2 cores: 0.69 of a raw socket against 0.90 sent
unsliced; two in flight 0.86-0.87, four 0.94 but no faster in GiB/s, within the machine's noise).
With two, a slice must be taken within ``send_stall_s`` of the one before it while the next is
already on its way: at worst 2 MiB in the 2-s bound, the pullers' own rate floor (1 MiB/s)."""

_SAFETY_TICK_S = 0.05
"""While requests wait, re-check them this often even without an event (ucxx's own blocking
task also progresses the worker once a second, and that progress does not wake our waiters)."""


log = logging.getLogger(__name__)


def _ensure_init() -> None:
    """Initialise ucxx (blocking progress, UCX_OPTIONS) unless something in this process already
    did; either way, install the handshake that keeps its buffers (``_exchange_peer_info``)."""
    _guard_handshake()
    if ucxx.core._ctx is None:  # ucxx has no public "is initialised" query
        ucxx.init(options=UCX_OPTIONS, env_takes_precedence=True, progress_mode="blocking")


class _Driver:
    """Progresses the UCX worker from one asyncio loop and wakes coroutines whose requests completed.

    Event driven: the loop watches the worker's epoll fd; on an event (or after a request is
    posted) one pass progresses the worker until it has nothing left, resolves the futures of
    completed requests, and re-arms the worker (if arming fails, events are pending: pass again
    at once). Idle, nothing runs; moving bytes, the loop thread does the copying as the socket
    becomes ready, like ucxx's ``polling`` mode but without spinning.
    """

    def __init__(self, worker: object, loop: asyncio.AbstractEventLoop) -> None:
        self._worker = worker
        self._loop = loop
        self._waiting: list[tuple[object, asyncio.Future[None]]] = []
        self._scheduled = False
        self._tick: asyncio.TimerHandle | None = None
        # replaces the reader ucxx's BlockingMode put on the same fd (it progressed without
        # telling anyone); its once-a-second fallback task stays and is harmless
        loop.add_reader(worker.epoll_file_descriptor, self._schedule)  # type: ignore[attr-defined]

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._pass)

    def _pass(self) -> None:
        self._scheduled = False
        self._worker.progress()  # type: ignore[attr-defined]
        self._resolve()
        if not self._worker.arm():  # type: ignore[attr-defined]
            self._schedule()  # events arrived since the progress: go again before sleeping
        self._arm_tick()

    def _resolve(self) -> None:
        _release_parked()
        still = []
        for req, fut in self._waiting:
            if fut.done():
                continue  # the waiter was cancelled: its request and buffer are parked
            if req.completed:  # type: ignore[attr-defined]
                fut.set_result(None)
            else:
                still.append((req, fut))
        self._waiting = still

    def _arm_tick(self) -> None:
        if self._waiting and self._tick is None:
            self._tick = self._loop.call_later(_SAFETY_TICK_S, self._on_tick)

    def _on_tick(self) -> None:
        self._tick = None
        self._schedule()

    async def wait(self, req: object, buf: object, peer: str | None = None) -> None:
        """Until ``req`` (posted on ``buf``) completes; then raises its error, if any.

        If the waiter leaves first (cancelled, timed out, its loop closed), UCX still holds
        ``buf``'s address, so both are parked until the request completes (module docstring).
        """
        if not req.completed:  # type: ignore[attr-defined]
            fut = self._loop.create_future()
            self._waiting.append((req, fut))
            self._schedule()
            try:
                await fut
            except BaseException:
                _park(req, buf, peer)
                raise
        req.check_error()  # type: ignore[attr-defined]


_PARKED: list[tuple[object, object, str | None]] = []
"""Requests whose waiter left before they completed, each with the buffer UCX still reads or
writes and the peer a client connect was for (None: a listener's); one list for the process,
since the UCX worker outlives any event loop."""
_CONNECTING_TO: contextvars.ContextVar[str | None] = contextvars.ContextVar("ucx_connecting_to", default=None)
"""The address a client's connect is for, in that connect's task: read by its own (connector
side) handshake only, which tags what it parks with it; a listener's handshake, or a transfer,
parks untagged whatever context the worker's progress ran it in."""
_SILENT: dict[str, float] = {}
"""Peers a handshake timed out with, whose request is still parked (-> when marked): a connect to
one fails at once. A request parked for a peer that never answers stays for the process's life
(closing its endpoint instead made a connect cancelled mid-handshake segfault), so each retry of a
hung source parked one more request, endpoint and socket; now one per such peer is parked, and one
more each ``SILENT_RETRY_S`` (a replacement at the same address is tried again then)."""
SILENT_RETRY_S = 300.0


def _park(req: object, buf: object, peer: str | None = None) -> None:
    if not req.completed:  # type: ignore[attr-defined]
        _PARKED.append((req, buf, peer))


def _release_parked() -> None:
    if _PARKED:
        _PARKED[:] = [entry for entry in _PARKED if not entry[0].completed]  # type: ignore[attr-defined]
    if _SILENT:
        pending = {peer for _r, _b, peer in _PARKED}
        for peer in [p for p in _SILENT if p not in pending]:
            del _SILENT[peer]


async def _await_request(req: object, buf: object, peer: str | None = None) -> None:
    """Until ``req`` (posted on ``buf``) completes, through this loop's driver if it has one;
    parked, tagged with ``peer``, if the waiter leaves first."""
    driver = _driver()
    if driver is not None:
        await driver.wait(req, buf, peer)
        return
    _release_parked()
    try:
        await req.wait()  # type: ignore[attr-defined]
    except BaseException:
        _park(req, buf, peer)
        raise


_PEER_INFO = struct.Struct("QQ")
"""ucxx's endpoint handshake message: the sender's receive tag and hash64bits of it."""


async def _exchange_peer_info(endpoint: object, msg_tag: int, listener: bool,
                              connect_timeout: float = 5.0) -> dict[str, int]:
    """ucxx's endpoint handshake (the listener sends first; same bytes on the wire, so peers
    running ucxx's own interoperate), with each stream request's buffer parked if its waiter
    leaves before UCX completes it."""
    peer = None if listener else _CONNECTING_TO.get()
    mine = bytearray(_PEER_INFO.pack(msg_tag, hash64bits(msg_tag)))
    theirs = bytearray(_PEER_INFO.size)
    send = (endpoint.stream_send, mine)  # type: ignore[attr-defined]
    recv = (endpoint.stream_recv, theirs)  # type: ignore[attr-defined]
    for post, buf in (send, recv) if listener else (recv, send):
        req = post(Array(buf))
        await within(_await_request(req, buf, peer), connect_timeout)
    tag, checksum = _PEER_INFO.unpack(theirs)
    if checksum != hash64bits(tag):
        raise RuntimeError(f"UCX handshake checksum invalid: {checksum:#x} != {hash64bits(tag):#x}")
    return {"msg_tag": tag, "checksum": checksum}


_handshake_checked = False
_HANDSHAKE_PARAMS = list(inspect.signature(_exchange_peer_info).parameters)


def _guard_handshake() -> None:
    """Make ucxx's endpoint creation and listener use ``_exchange_peer_info`` (idempotent). A
    ucxx whose handshake is not the one this replaces is left alone, with a warning."""
    global _handshake_checked
    if _handshake_checked:
        return
    _handshake_checked = True
    for module in (_ucxx_context, _ucxx_listener):
        current = getattr(module, "exchange_peer_info", None)
        if current is None or list(inspect.signature(current).parameters) != _HANDSHAKE_PARAMS:
            log.warning("ucxx %s: its endpoint handshake is not the one robustrl guards; a connect "
                        "abandoned mid-handshake may corrupt memory", ucxx.__version__)
            continue
        module.exchange_peer_info = _exchange_peer_info  # type: ignore[attr-defined]


_drivers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Driver] = weakref.WeakKeyDictionary()


def _driver() -> _Driver | None:
    """This loop's driver, or None if ucxx runs its own progress (initialised elsewhere)."""
    ctx = ucxx.core._get_ctx()
    if ctx.progress_mode != "blocking":
        return None
    loop = asyncio.get_running_loop()
    driver = _drivers.get(loop)
    if driver is None:
        ctx.continuous_ucx_progress(loop)  # ucxx's BlockingMode first, so ours replaces its reader
        driver = _drivers[loop] = _Driver(ctx.worker, loop)
    return driver


async def _transfer(ep: object | None, buf: np.ndarray, send: bool) -> None:
    """``ep.send(buf)`` / ``ep.recv(buf)`` without ucxx's wait (a ``sleep(0)`` loop that spins
    the event loop): post the tag request and let this loop's driver wake us."""
    raw = None if ep is None else ep._ep  # type: ignore[attr-defined]
    if raw is None:  # closed under us (the puller drops a source while a request is on the wire)
        raise ucxx.exceptions.UCXCloseError("Endpoint closed")
    driver = _driver()
    if driver is None:
        await (ep.send(buf) if send else ep.recv(buf))  # type: ignore[union-attr]
        return
    raw.raise_on_error()
    if send:
        req = raw.tag_send(Array(buf), Tag(ep._tags["msg_send"]))  # type: ignore[attr-defined]
    else:
        req = raw.tag_recv(Array(buf), Tag(ep._tags["msg_recv"]), TagMaskFull)  # type: ignore[attr-defined]
    await driver.wait(req, buf)


async def _send(ep: object | None, data: np.ndarray) -> None:
    await _transfer(ep, data, send=True)


async def _recv(ep: object | None, into: np.ndarray) -> None:
    await _transfer(ep, into, send=False)


async def _send_payload(ep: object | None, payload: bytes | memoryview, stall_s: float | None) -> None:
    """A reply's payload in ``PAYLOAD_SLICE`` messages, each within ``stall_s`` (TimeoutError)."""
    await send_in_slices(lambda part: _send(ep, np.frombuffer(part, dtype=np.uint8)), payload, PAYLOAD_SLICE,
                         stall_s, window=SEND_WINDOW)


_RETIRED: list[object] = []
"""Closed listeners, kept alive on purpose (see ``UcxServer.close``)."""

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
            if self._closed:  # a retired listener (see close): refuse, the puller fails over
                with contextlib.suppress(*_UCX_ERRORS):
                    ep.abort()  # type: ignore[attr-defined]
                return
            # ucxx calls this on the loop thread; run the endpoint under our own task so
            # close() can cancel it
            task = asyncio.get_running_loop().create_task(self._serve(ep))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        self._listener = ucxx.create_listener(on_connect, port=port)
        return f"ucx://{host}:{self._listener.port}"  # type: ignore[attr-defined]

    @staticmethod
    async def _read_request(ep: object, handler: RequestHandler) -> tuple[Op, int, int, bytes]:
        """(op, index, version, body) of the next request (a SUB/TAKE/PASS body is a second message)."""
        request = np.empty(HEADER.size, dtype=np.uint8)
        await _recv(ep, request)
        op_raw, index, version = HEADER.unpack(request.tobytes())
        op = Op(op_raw)
        body = b""
        if op in (Op.SUB, Op.TAKE, Op.PASS):
            if not 0 < index <= handler.max_body(version):  # its bitmap's size, not whatever the header says
                raise ValueError("bad subscription message length")
            buf = np.empty(index, dtype=np.uint8)
            await _recv(ep, buf)
            body = buf.tobytes()
        return op, index, version, body

    async def _send_reply(self, ep: object, reply: Reply) -> None:
        sent = 0
        try:
            await self._handler.begin(reply)
            payload = memoryview(reply.payload).cast("B")
            header = HEADER.pack(reply.status, self._handler.load(), len(payload))
            # a receiver that stopped reading must not keep the upload slot: past the limit
            # TimeoutError (an OSError) ends this endpoint; one timer per reply
            stall = self._handler.send_stall_s
            async with asyncio.timeout(self._handler.send_timeout_s):
                await _send_payload(ep, header, stall)
                self._handler.halfway(reply)  # line the next upload up as this one starts
                if reply.cut_after is None and len(payload):
                    await _send_payload(ep, payload, stall)
                    sent = len(payload)
        finally:
            self._handler.done(reply, sent)

    async def _after(self, reply: Reply) -> bool:
        """Carry out a fault's ``then``; True if the endpoint ends here."""
        if reply.then == "die":
            asyncio.get_running_loop().create_task(self._handler.die())
            return True
        if reply.then == "stall":
            await self._handler.stalled()
            return True
        return False

    async def _serve(self, ep: object) -> None:
        self._endpoints.add(ep)
        loop = asyncio.get_running_loop()
        ahead: asyncio.Task[tuple[Op, int, int, bytes]] | None = None  # the next request, read while one waits
        try:
            while True:
                if ahead is None:
                    op, index, version, body = await self._read_request(ep, self._handler)
                else:
                    op, index, version, body = await ahead
                    ahead = None
                if op is Op.SUB:
                    await self._subscription(ep, version, SubMessage.decode(body))
                    return
                if op is not Op.FETCH:
                    if op in (Op.TAKE, Op.PASS):
                        return  # answers with no offer: protocol error
                    await self._send_reply(ep, self._handler.handle(op, version, index))
                    continue
                ticket = self._handler.request_chunk(version, index)
                if not ticket.future.done():  # waits for an upload slot; notice the puller leaving
                    ahead = loop.create_task(self._read_request(ep, self._handler))
                    try:
                        await asyncio.wait({ticket.future, ahead}, return_when=asyncio.FIRST_COMPLETED)
                    except BaseException:
                        release_ticket(self._handler, ticket)
                        raise
                    if not ticket.future.done():
                        self._handler.withdraw(ticket)
                        return  # it spoke out of turn or went away
                reply = ticket.future.result()
                await self._send_reply(ep, reply)
                if await self._after(reply):
                    return
        except (*_UCX_ERRORS, ValueError):
            return
        finally:
            drop_task(ahead)
            self._endpoints.discard(ep)
            with contextlib.suppress(*_UCX_ERRORS):
                ep.abort()  # type: ignore[attr-defined]

    async def _subscription(self, ep: object, version: int, msg: SubMessage) -> None:
        """Serve one subscriber until it goes away (see ``transport.py``)."""
        sub = self._handler.subscribe(version, msg)
        if sub is None:
            await _send(ep, np.frombuffer(HEADER.pack(Status.MISSING, self._handler.load(), 0), dtype=np.uint8))
            return
        loop = asyncio.get_running_loop()
        reader = loop.create_task(self._read_request(ep, self._handler))
        try:
            while True:
                await asyncio.wait({sub.offer, reader}, return_when=asyncio.FIRST_COMPLETED)
                if not sub.offer.done():  # the subscriber spoke unasked: only an update may
                    op, _, _, body = reader.result()
                    reader = loop.create_task(self._read_request(ep, self._handler))
                    if op is not Op.SUB:
                        return
                    sub.update(SubMessage.decode(body))
                    continue
                proposal = sub.offer.result()
                if proposal is None:  # the version is gone from here
                    await _send(ep, np.frombuffer(HEADER.pack(Status.MISSING, self._handler.load(), 0),
                                                  dtype=np.uint8))
                    return
                offer = proposal.encode()
                # The offer holds a place in line until answered: a subscriber that does not answer
                # in time (frozen, cut off) loses the subscription, which frees it (``sub.close``).
                try:
                    async with asyncio.timeout(self._handler.answer_timeout_s):
                        await _send(ep, np.frombuffer(HEADER.pack(Status.OFFER, self._handler.load(), len(offer)),
                                                      dtype=np.uint8))
                        await _send_payload(ep, offer, None)  # (bounded by the answer timeout)
                        while True:  # its answer (updates may come first)
                            op, _, _, body = await reader
                            reader = loop.create_task(self._read_request(ep, self._handler))
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
                    await self._send_reply(ep, reply)
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
        if self._listener is not None:
            # Not destroyed: destroying a UCX listener while a connection request to it is in
            # flight crashed the process (segfault in ucp_cm_server_conn_request_cb on UCX's
            # async thread, seen twice in ~45 test-suite runs). A retired listener refuses every
            # new endpoint (on_connect) and lives as long as the process: servers close at
            # process exit in the services, and only tests create many.
            _RETIRED.append(self._listener)
            self._listener = None
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
        """Raises:
            TransportError: no endpoint within ``timeout_s``; at once if an earlier handshake
                with this peer timed out and is still unanswered (``_SILENT``).
        """
        _ensure_init()
        if self.address in _SILENT:
            # What it owed may have come since (it was only frozen): progress the worker from this
            # loop first (the loop whose connect timed out may be gone, and nothing else would).
            driver = _driver()
            if driver is not None:
                driver._pass()
            _release_parked()
            marked = _SILENT.get(self.address)
            if marked is not None and time.monotonic() - marked > SILENT_RETRY_S:
                del _SILENT[self.address]  # one more try, parking one more request at most
        if self.address in _SILENT:
            raise TransportError("cannot connect to weight source: it did not answer an earlier handshake, "
                                 "still pending", address=self.address)
        token = _CONNECTING_TO.set(self.address)
        try:
            self._ep = await within(
                ucxx.create_endpoint(self._host, self._port, connect_timeout=timeout_s), timeout_s)
        except TimeoutError as exc:
            if any(peer == self.address for _r, _b, peer in _PARKED):
                _SILENT[self.address] = time.monotonic()
            raise TransportError(f"cannot connect to weight source: it did not answer within {timeout_s:g} s",
                                 address=self.address) from exc
        except (*_UCX_ERRORS, ValueError) as exc:
            raise TransportError("cannot connect to weight source", address=self.address) from exc
        finally:
            _CONNECTING_TO.reset(token)

    async def _request(self, op: Op, version: int, index: int) -> tuple[Status, int]:
        if self._ep is None:
            raise TransportError("weight-source connection is closed", address=self.address)
        try:
            await _send(self._ep, np.frombuffer(HEADER.pack(op, index, version), dtype=np.uint8))
            await _recv(self._ep, self._header)
        except _UCX_ERRORS as exc:
            raise TransportError("weight source failed", address=self.address) from exc
        status, load, nbytes = HEADER.unpack(self._header.tobytes())
        self.load = load
        return reply_status(status, self.address), nbytes

    async def _recv_payload(self, into: memoryview | np.ndarray, index: int, count: bool = False) -> None:
        """A reply's payload, slice by slice (``PAYLOAD_SLICE``); ``count``: a chunk's bytes, added
        to ``payload_received`` as each slice arrives (a puller's stall bound watches it)."""
        view = np.frombuffer(into, dtype=np.uint8) if isinstance(into, memoryview) else into
        if len(view) <= PAYLOAD_SLICE:  # one message (an offer, a bitmap, a small chunk)
            try:
                await _recv(self._ep, view)
            except _UCX_ERRORS as exc:
                raise TransportError("weight source failed mid-chunk", address=self.address, chunk=index) from exc
            if count:
                self.payload_received += len(view)
            return
        # every slice's receive posted at once: each is matched as its message comes, with no gap
        parts = [asyncio.ensure_future(_recv(self._ep, view[start:start + PAYLOAD_SLICE]))
                 for start in range(0, len(view), PAYLOAD_SLICE)]
        try:
            for k, part in enumerate(parts):
                await part
                if count:
                    self.payload_received += min(PAYLOAD_SLICE, len(view) - k * PAYLOAD_SLICE)
        except _UCX_ERRORS as exc:
            raise TransportError("weight source failed mid-chunk", address=self.address, chunk=index) from exc
        finally:
            for part in parts:
                drop_task(part)  # (a receive still posted parks its buffer, see _Driver.wait)

    async def fetch_chunk(self, version: int, index: int, into: memoryview) -> bool:
        status, nbytes = await self._request(Op.FETCH, version, index)
        if status != Status.OK:
            check_reply_length(nbytes, 0, self.address, "MISSING")  # a payload would be left unread
            return False
        if nbytes != len(into):
            raise TransportError("chunk length differs from manifest", address=self.address,
                                 chunk=index, got=nbytes, want=len(into))
        if nbytes:
            await self._recv_payload(into, index, count=True)
        return True

    async def _send_msg(self, data: bytes) -> None:
        if self._ep is None:
            raise TransportError("weight-source connection is closed", address=self.address)
        try:
            await _send(self._ep, np.frombuffer(data, dtype=np.uint8))
        except _UCX_ERRORS as exc:
            raise TransportError("weight source failed", address=self.address) from exc

    async def send_sub(self, op: Op, version: int, msg: SubMessage) -> None:
        body = msg.encode()
        await self._send_msg(HEADER.pack(op, len(body), version))
        await self._send_msg(body)

    async def _head(self) -> tuple[Status, int]:
        if self._ep is None:
            raise TransportError("weight-source connection is closed", address=self.address)
        try:
            await _recv(self._ep, self._header)
        except _UCX_ERRORS as exc:
            raise TransportError("weight source failed", address=self.address) from exc
        status, load, nbytes = HEADER.unpack(self._header.tobytes())
        self.load = load
        return reply_status(status, self.address), nbytes

    async def next_offer(self) -> tuple[Status, Offer | None]:
        status, nbytes = await self._head()
        if status is not Status.OFFER or not nbytes:
            return status, None
        if nbytes > MAX_OFFER_BODY:
            raise TransportError("offer longer than any source sends", address=self.address,
                                 nbytes=nbytes, limit=MAX_OFFER_BODY)
        payload = np.empty(nbytes, dtype=np.uint8)
        await self._recv_payload(payload, -1)
        return status, Offer.decode(payload.tobytes())

    async def chunk_reply(self) -> tuple[Status, int]:
        return await self._head()

    async def recv_payload(self, index: int, into: memoryview) -> None:
        if len(into):
            await self._recv_payload(into, index, count=True)

    async def have(self, version: int, num_chunks: int) -> frozenset[int]:
        status, nbytes = await self._request(Op.HAVE, version, 0)
        check_have_length(status, nbytes, num_chunks, self.address)  # before allocating what it says
        if status != Status.OK:
            check_reply_length(nbytes, 0, self.address, "MISSING")  # a payload would be left unread
            self.pending, self.have_payload = frozenset(), None
            return frozenset()
        bitmap = np.empty(nbytes, dtype=np.uint8)
        await self._recv_payload(bitmap, -1)
        return self._read_have(bitmap.tobytes(), num_chunks)

    async def manifest(self, version: int) -> bytes | None:
        status, nbytes = await self._request(Op.MANIFEST, version, 0)
        check_reply_length(nbytes, MAX_MANIFEST_BYTES if status == Status.OK else 0, self.address, "manifest")
        if status != Status.OK or nbytes == 0:
            return None
        payload = np.empty(nbytes, dtype=np.uint8)
        await self._recv_payload(payload, -1)
        return payload.tobytes()

    async def close(self) -> None:
        if self._ep is not None:
            with contextlib.suppress(*_UCX_ERRORS):
                self._ep.abort()  # type: ignore[attr-defined]
            self._ep = None
