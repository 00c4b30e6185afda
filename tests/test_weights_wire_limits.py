"""Lengths and answers from the wire are checked before they are used: a peer that sends garbage
(an absurd payload length, a HAVE bitmap that does not fit the version, an unknown status, a
malformed address) is dropped with a TransportError / WeightSyncError, and the pull or manifest
fetch goes on from the other sources. Never an OverflowError, ValueError or MemoryError.

Fake peers are raw TCP servers on loopback that answer each request header with bytes chosen by
the test; the good source is a real ``WeightServer``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable

import numpy as np
import pytest

from robustrl.errors import TransportError, WeightSyncError
from robustrl.weights import Manifest, WeightServer, fetch_manifest, pull
from robustrl.weights.manifest import MAX_MANIFEST_BYTES, build_manifest
from robustrl.weights.puller import _Index, _Source
from robustrl.weights.transport import (
    HAVE_SERVED,
    HEADER,
    Offer,
    Op,
    Reply,
    Status,
    SubMessage,
    encode_have_reply,
    have_reply_size,
    make_client,
)

pytestmark = pytest.mark.timeout(20)

CHUNK = 4096
N = 20

Answer = Callable[[Op, int, int], bytes]
"""(op, version, how many requests of this op came before) -> the bytes the fake peer sends back."""


def _full_have(n: int) -> bytes:
    return encode_have_reply(np.ones(n, dtype=bool), np.zeros(n, dtype=bool), 0)


class FakePeer:
    """A raw TCP peer on loopback: reads each request header (and a SUB/TAKE/PASS body) and sends
    back whatever ``answer`` returns; FETCH is answered MISSING unless ``answer`` says otherwise."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.counts: dict[Op, int] = {}
        self.asked = asyncio.Event()  # some request was answered
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self._tasks: set[asyncio.Task[None]] = set()
        self.address = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._accept = asyncio.create_task(self._accept_loop())

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self._listener)
            task = asyncio.create_task(self._serve(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        with conn:
            conn.setblocking(False)
            try:
                while True:
                    op_raw, index, version = HEADER.unpack(await _recv_n(loop, conn, HEADER.size))
                    op = Op(op_raw)
                    if op in (Op.SUB, Op.TAKE, Op.PASS):
                        await _recv_n(loop, conn, index)
                    nth = self.counts.get(op, 0)
                    self.counts[op] = nth + 1
                    await loop.sock_sendall(conn, self.answer(op, version, nth))
                    self.asked.set()
            except ConnectionError:
                return

    async def close(self) -> None:
        for task in [self._accept, *self._tasks]:
            task.cancel()
        await asyncio.gather(self._accept, *self._tasks, return_exceptions=True)
        self._listener.close()


async def _recv_n(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = await loop.sock_recv(sock, n - len(data))
        if not part:
            raise ConnectionResetError("closed")
        data += part
    return data


def _missing(op: Op, version: int, nth: int) -> bytes:
    return HEADER.pack(Status.MISSING, 0, 0)


@pytest.fixture
def version() -> tuple[np.ndarray, Manifest]:
    buffer = np.random.default_rng(0).integers(0, 256, N * CHUNK - 100, dtype=np.uint8)
    manifest = build_manifest(3, [], memoryview(buffer), CHUNK)
    assert manifest.num_chunks == N
    return buffer, manifest


@pytest.fixture
async def trainer(version) -> AsyncIterator[WeightServer]:
    buffer, manifest = version
    server = WeightServer("tcp")
    await server.start()
    server.add_version(manifest, buffer)
    try:
        yield server
    finally:
        await server.close()


@pytest.fixture
async def fakes() -> AsyncIterator[Callable[[Answer], FakePeer]]:
    started: list[FakePeer] = []

    def start(answer: Answer) -> FakePeer:
        peer = FakePeer(answer)
        started.append(peer)
        return peer

    try:
        yield start
    finally:
        for peer in started:
            await peer.close()


def _ok(payload_len: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(Status.OK, 0, payload_len) + payload


# Replies to HAVE that no source sends: each one is refused before anything is allocated for it.
BAD_HAVE = {
    "length 2**64-1": lambda n: _ok(2**64 - 1),
    "length 100 MiB, nothing follows": lambda n: _ok(100 << 20),
    "one byte short": lambda n: _ok(have_reply_size(n) - 1, _full_have(n)[:-1]),
    "one byte long": lambda n: _ok(have_reply_size(n) + 1, _full_have(n) + b"\0"),
    "bitmap only": lambda n: _ok((n + 7) // 8, b"\xff" * ((n + 7) // 8)),
    "unknown status": lambda n: HEADER.pack(9, 0, 0),
}


@pytest.mark.parametrize("bad", list(BAD_HAVE))
async def test_client_refuses_a_have_reply_that_does_not_fit_the_version(bad: str, fakes) -> None:
    peer = fakes(lambda op, v, nth: BAD_HAVE[bad](N) if op is Op.HAVE else _missing(op, v, nth))
    client = make_client(peer.address)
    await client.connect()
    try:
        with pytest.raises(TransportError, match="HAVE|reply"):
            await asyncio.wait_for(client.have(3, N), 5)
    finally:
        await client.close()


@pytest.mark.parametrize("bad", ["length 2**64-1", "one byte short", "unknown status"])
async def test_pull_drops_a_source_whose_have_reply_is_garbage_and_completes(bad: str, version, trainer,
                                                                              fakes) -> None:
    buffer, manifest = version
    peer = fakes(lambda op, v, nth: BAD_HAVE[bad](N) if op is Op.HAVE else _missing(op, v, nth))
    out, stats = await asyncio.wait_for(pull(manifest, [peer.address, trainer.address], seed=1), 10)
    assert np.array_equal(out[:manifest.total_bytes], buffer)
    assert stats.failed_sources == [peer.address]


async def test_pull_drops_a_source_that_sends_a_short_have_then_a_normal_one(version, trainer, fakes) -> None:
    """The auditor's t3 over real sockets: the short answer used to be taken (as 8 chunks of 20),
    and the next, well-formed one raised ValueError out of the pull (bitmaps of different shapes)."""
    buffer, manifest = version

    def answer(op: Op, v: int, nth: int) -> bytes:
        if op is not Op.HAVE:
            return _missing(op, v, nth)
        return _ok(1, b"\xff") if nth == 0 else _ok(have_reply_size(N), _full_have(N))

    peer = fakes(answer)
    out, stats = await asyncio.wait_for(pull(manifest, [peer.address, trainer.address], seed=2), 10)
    assert np.array_equal(out[:manifest.total_bytes], buffer)
    assert stats.failed_sources == [peer.address]


def test_index_refuses_a_have_payload_of_the_wrong_length() -> None:
    """The pure part: ``_Index.answer`` checks the length against the chunk count and changes
    nothing when it does not fit, so a later good answer is taken as if the bad one never came."""
    idx = _Index(N, {i: i for i in range(N)})
    source = _Source("tcp://x:1")
    full = _full_have(N)
    for bad in (full[:1], full[:-1], full + b"\0", b""):
        with pytest.raises(WeightSyncError) as info:
            idx.answer(source, bad)
        assert info.value.reason == "corrupt"
        assert source.have == set() and source.bits is None
    assert idx.answer(source, full) is True
    assert source.have == set(range(N)) and source.complete


# -- the same checks in the UCX client (a real ucxx listener answering with crafted headers) -------


def _ucx_skip_reason() -> str | None:
    try:
        import ucxx  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means the transport is unusable here
        return f"ucxx is not usable here: {exc!r}"
    return None


async def _ucx_fake(answer: Answer) -> tuple[str, Callable[[], asyncio.Future[None]]]:
    """A UCX listener that answers each request with ``answer``'s bytes: a header, then (if any
    follow) the payload as a second message, the way a UCX source sends. Returns (address, close)."""
    from robustrl.weights.ucx import UcxServer, _send

    class RawReplies(UcxServer):
        async def _send_reply(self, ep: object, reply: Reply) -> None:
            raw = bytes(reply.payload)
            await _send(ep, np.frombuffer(raw[:HEADER.size], dtype=np.uint8))
            if raw[HEADER.size:]:
                await _send(ep, np.frombuffer(raw[HEADER.size:], dtype=np.uint8))

    counts: dict[Op, int] = {}

    class Handler(WeightServer):
        def handle(self, op: Op, version: int, index: int) -> Reply:
            nth = counts.get(op, 0)
            counts[op] = nth + 1
            return Reply(Status.OK, answer(op, version, nth))

    handler = Handler("ucx")
    server = RawReplies(handler)
    address = await server.start("127.0.0.1", 0)
    return address, server.close


@pytest.mark.skipif(_ucx_skip_reason() is not None, reason=str(_ucx_skip_reason()))
@pytest.mark.parametrize("bad", ["length 2**64-1", "length 100 MiB, nothing follows", "one byte short",
                                 "one byte long", "unknown status"])
async def test_ucx_client_refuses_a_have_reply_that_does_not_fit_the_version(bad: str) -> None:
    address, close = await _ucx_fake(lambda op, v, nth: BAD_HAVE[bad](N))
    client = make_client(address)
    try:
        await client.connect()
        with pytest.raises(TransportError, match="HAVE|reply"):
            await asyncio.wait_for(client.have(3, N), 5)
    finally:
        await client.close()
        await close()


@pytest.mark.skipif(_ucx_skip_reason() is not None, reason=str(_ucx_skip_reason()))
@pytest.mark.parametrize("bad", ["length 2**64-1", "one past the limit, nothing follows", "unknown status"])
async def test_ucx_client_refuses_a_manifest_reply_longer_than_any_manifest(bad: str) -> None:
    address, close = await _ucx_fake(lambda op, v, nth: BAD_MANIFEST[bad])
    client = make_client(address)
    try:
        await client.connect()
        with pytest.raises(TransportError, match="manifest|reply"):
            await asyncio.wait_for(client.manifest(3), 5)
    finally:
        await client.close()
        await close()


# -- MANIFEST ------------------------------------------------------------------------------------


BAD_MANIFEST = {
    "length 2**64-1": _ok(2**64 - 1),
    "one past the limit, nothing follows": _ok(MAX_MANIFEST_BYTES + 1),
    "unknown status": HEADER.pack(200, 0, 0),
}


@pytest.mark.parametrize("bad", list(BAD_MANIFEST))
async def test_client_refuses_a_manifest_reply_longer_than_any_manifest(bad: str, fakes) -> None:
    peer = fakes(lambda op, v, nth: BAD_MANIFEST[bad] if op is Op.MANIFEST else _missing(op, v, nth))
    client = make_client(peer.address)
    await client.connect()
    try:
        with pytest.raises(TransportError, match="manifest|reply"):
            await asyncio.wait_for(client.manifest(3), 5)
    finally:
        await client.close()


@pytest.mark.parametrize("bad", list(BAD_MANIFEST))
async def test_fetch_manifest_skips_a_source_with_a_garbage_length(bad: str, version, trainer, fakes) -> None:
    _, manifest = version
    peer = fakes(lambda op, v, nth: BAD_MANIFEST[bad] if op is Op.MANIFEST else _missing(op, v, nth))
    for seed in range(4):  # both orders: the liar first and second
        got = await fetch_manifest([peer.address, trainer.address], 3, manifest.digest(), timeout_s=2, seed=seed)
        assert got == manifest
    assert peer.counts.get(Op.MANIFEST, 0) >= 1  # the liar was asked, and skipped
    with pytest.raises(WeightSyncError) as info:
        await fetch_manifest([peer.address], 3, manifest.digest(), timeout_s=2)
    assert info.value.reason == "corrupt"


# -- addresses -------------------------------------------------------------------------------------


BAD_ADDRESSES = [
    "tcp://127.0.0.1:99999",  # port out of range: OverflowError from connect
    "tcp://127.0.0.1:\u00b2",  # str.isdigit() is True, int() refuses
    "tcp://" + "x" * 100 + ":1",  # a host label too long: UnicodeError from the IDNA codec
    "tcp://" + "x" * 300 + ":1",  # a host name too long
    "tcp://127.0.0.1",  # no port
    "nonsense",
    "http://127.0.0.1:1",
    "tcp://127.0.0.1:1 ",
]


async def test_fetch_manifest_skips_malformed_addresses(version, trainer) -> None:
    _, manifest = version
    for seed in range(3):
        got = await fetch_manifest([*BAD_ADDRESSES, trainer.address], 3, manifest.digest(), timeout_s=5, seed=seed)
        assert got == manifest
    with pytest.raises(WeightSyncError) as info:
        await fetch_manifest(BAD_ADDRESSES, 3, manifest.digest(), timeout_s=5)
    assert info.value.reason == "unavailable"


@pytest.mark.parametrize("relaying", [False, True])
async def test_pull_drops_malformed_addresses_and_completes(relaying: bool, version, trainer) -> None:
    buffer, manifest = version
    relay = None
    if relaying:
        relay = WeightServer("tcp")
        await relay.start()
    try:
        out, stats = await asyncio.wait_for(
            pull(manifest, [*BAD_ADDRESSES, trainer.address], relay=relay, seed=3), 10)
        assert np.array_equal(out[:manifest.total_bytes], buffer)
        assert trainer.address not in stats.failed_sources
    finally:
        if relay is not None:
            with contextlib.suppress(Exception):
                await relay.close()


def test_have_reply_size_matches_what_a_source_sends() -> None:
    for n in (1, 7, 8, 9, N, 1000):
        assert have_reply_size(n) == len(_full_have(n)) == 2 * ((n + 7) // 8) + HAVE_SERVED.size


# -- the stall timeout bounds a gap without progress, not a whole chunk ----------------------------


class SlowSource:
    """A raw TCP source on a slow link: holds the whole version and sends each chunk's bytes in
    ``pieces`` parts ``gap_s`` apart, so a chunk takes ``pieces * gap_s``, longer than the puller's
    stall timeout, while bytes never stop coming for longer than ``gap_s``. Answers HAVE, FETCH
    and subscriptions (an OFFER of the lowest chunk still wanted, then the chunk on TAKE).
    With ``freeze_after`` set, it sends that many bytes of its first chunk and then nothing."""

    def __init__(self, buffer: np.ndarray, manifest: Manifest, pieces: int, gap_s: float,
                 freeze_after: int | None = None) -> None:
        self.buffer, self.m, self.pieces, self.gap_s = buffer, manifest, pieces, gap_s
        self.freeze_after = freeze_after
        self.peer = FakePeer(lambda op, v, nth: b"")  # its listener; connections are served here
        self.peer._serve = self._serve  # type: ignore[method-assign]
        self.address = self.peer.address

    async def _chunk(self, loop: asyncio.AbstractEventLoop, conn: socket.socket, index: int) -> None:
        entry = self.m.chunks[index]
        data = self.buffer[entry.offset:entry.offset + entry.nbytes].tobytes()
        await loop.sock_sendall(conn, HEADER.pack(Status.OK, 1, len(data)))
        if self.freeze_after is not None:
            await loop.sock_sendall(conn, data[:self.freeze_after])
            await asyncio.Event().wait()  # frozen: the connection stays open, nothing more comes
        step = -(-len(data) // self.pieces)
        for start in range(0, len(data), step):
            await asyncio.sleep(self.gap_s)  # the link's pace
            await loop.sock_sendall(conn, data[start:start + step])

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        n = self.m.num_chunks
        with conn:
            conn.setblocking(False)
            try:
                while True:
                    op_raw, index, _ = HEADER.unpack(await _recv_n(loop, conn, HEADER.size))
                    op = Op(op_raw)
                    if op is Op.HAVE:
                        await loop.sock_sendall(conn, _ok(have_reply_size(n), _full_have(n)))
                    elif op is Op.FETCH:
                        await self._chunk(loop, conn, index)
                    elif op is Op.SUB:
                        await self._subscriber(loop, conn, SubMessage.decode(await _recv_n(loop, conn, index)))
                        return
            except ConnectionError:
                return

    async def _subscriber(self, loop: asyncio.AbstractEventLoop, conn: socket.socket, msg: SubMessage) -> None:
        n = self.m.num_chunks
        while True:
            want = np.unpackbits(np.frombuffer(msg.want, dtype=np.uint8), bitorder="little")[:n]
            if not want.any():
                await asyncio.Event().wait()  # nothing wanted: wait for the subscriber to go
            offer = Offer([int(np.flatnonzero(want)[0])]).encode()
            await loop.sock_sendall(conn, HEADER.pack(Status.OFFER, 1, len(offer)) + offer)
            while True:
                op_raw, length, _ = HEADER.unpack(await _recv_n(loop, conn, HEADER.size))
                msg = SubMessage.decode(await _recv_n(loop, conn, length))
                if Op(op_raw) is not Op.SUB:
                    break
            if Op(op_raw) is Op.TAKE:
                await self._chunk(loop, conn, msg.chunk)
            else:
                await asyncio.sleep(self.gap_s)  # passed: offer again a little later

    async def close(self) -> None:
        await self.peer.close()


BIG_CHUNK = 1 << 20
"""Chunks of the slow source: its pieces (1/8) reach the client's receive low-water mark
(``tcp.RCVLOWAT``, 128 KiB), below which a chunk's progress is not seen until it is all in."""


@pytest.fixture
def small() -> tuple[np.ndarray, Manifest]:
    buffer = np.random.default_rng(1).integers(0, 256, 2 * BIG_CHUNK, dtype=np.uint8)
    return buffer, build_manifest(4, [], memoryview(buffer), BIG_CHUNK)


@pytest.mark.parametrize("relaying", [False, True])
async def test_a_slow_but_steady_source_is_not_dropped_for_a_chunk_longer_than_the_stall_timeout(
        relaying: bool, small) -> None:
    """Each chunk takes 0.8 s, the stall timeout is 0.4 s, and bytes arrive every 0.1 s: the
    source is healthy (a 64 MiB chunk on a 100 Mbit link takes 5.4 s) and must not be dropped."""
    buffer, manifest = small
    source = SlowSource(buffer, manifest, pieces=8, gap_s=0.1)
    relay = WeightServer("tcp") if relaying else None
    if relay is not None:
        await relay.start()
    try:
        out, stats = await asyncio.wait_for(
            pull(manifest, [source.address], relay=relay, stall_timeout_s=0.4, seed=0), 15)
        assert np.array_equal(out[:manifest.total_bytes], buffer)
        assert stats.failed_sources == []
    finally:
        await source.close()
        if relay is not None:
            await relay.close()


@pytest.mark.parametrize("relaying", [False, True])
async def test_a_source_frozen_mid_chunk_is_still_dropped_after_the_stall_timeout(relaying: bool, small) -> None:
    """The bound on a frozen source is not weakened: no byte for ``stall_timeout_s`` (0.5 s) drops
    it, and with nobody else holding the chunks the pull fails soon after (grace 0.2 s)."""
    buffer, manifest = small
    frozen = SlowSource(buffer, manifest, pieces=8, gap_s=0.05, freeze_after=BIG_CHUNK // 4)
    relay = WeightServer("tcp") if relaying else None
    if relay is not None:
        await relay.start()
    loop = asyncio.get_running_loop()
    try:
        t0 = loop.time()
        with pytest.raises(WeightSyncError) as info:
            await asyncio.wait_for(pull(manifest, [frozen.address], relay=relay, stall_timeout_s=0.5,
                                        unavailable_grace_s=0.2, seed=0), 15)
        took = loop.time() - t0
        assert info.value.reason == "unavailable"
        assert info.value.failed_sources == [frozen.address]
        assert took < 2.0, f"a frozen source was dropped only after {took:.2f} s"
    finally:
        await frozen.close()
        if relay is not None:
            await relay.close()


def test_a_ucx_address_without_ucxx_installed_is_a_transport_error(monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "robustrl.weights.ucx", None)  # as if ucxx were missing: ImportError
    with pytest.raises(TransportError, match="ucx transport not installed"):
        make_client("ucx://127.0.0.1:1")


async def test_a_source_that_only_trickles_is_dropped_for_the_chunk_limit() -> None:
    """Bytes keep coming, so no gap reaches the stall timeout, but far slower than
    ``SLOW_SOURCE_BYTES_PER_S``: the chunk is given up at ``chunk_limit_s`` (a throttled relay held
    its chunk until the whole pull timed out while faster sources could have sent it)."""
    from robustrl.weights.puller import chunk_limit_s, until_stalled

    received = 0

    async def trickle() -> None:
        nonlocal received
        while True:
            await asyncio.sleep(0.05)  # the trickle's pace (the thing measured), not a wait
            received += 1024  # 20 KiB/s: never a 0.3 s gap

    limit = chunk_limit_s(0.3, 64 * 1024)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(TimeoutError, match="slower than"):
        await until_stalled(trickle(), lambda: received, 0.3, limit)
    assert loop.time() - t0 < limit + 0.3
    # A steady source within the rate is not cut short: 64 KiB in 0.1 s.
    done = await until_stalled(asyncio.sleep(0.1, result="in"), lambda: received, 0.3, limit)
    assert done == "in"
