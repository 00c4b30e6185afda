"""WeightServer: serves chunks of published weight versions to pullers.

Runs in every trainer rank that publishes (``add_version(..., complete=True)``) and in every
rollout replica as a relay: the replica registers the version it is pulling with
``complete=False`` and marks each chunk once it arrived and its checksum matched, so other
replicas can fetch it onward at once. A chunk is served only if its version is registered and
the chunk is marked, so a relay never serves bytes of a version it has not verified, and
never a mix of two versions: chunks are looked up by (version, index) in that version's own
buffer.

Test-only faults (``Fault``) make the server corrupt, stall on, or die during a chunk.
"""

from __future__ import annotations

import asyncio
import enum
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from robustrl.errors import WeightSyncError
from robustrl.weights.manifest import Manifest
from robustrl.weights.transport import (
    Op,
    Reply,
    RequestHandler,
    Status,
    TransportServer,
    encode_have_reply,
    make_server,
)


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
    served: int = 0  # chunk replies sent for this version (advertised: pullers spread uploads)
    manifest_json: bytes = b""  # served on MANIFEST (relays serve the manifest of what they relay)


def _byte_view(buffer: object) -> memoryview:
    if hasattr(buffer, "numpy"):  # a torch tensor: share its memory through numpy
        buffer = buffer.numpy()  # type: ignore[union-attr]
    return memoryview(buffer).cast("B")  # type: ignore[arg-type]


class WeightServer(RequestHandler):
    """Serves (version, chunk) requests over one transport.

    Args:
        transport: ``'tcp'`` or ``'ucx'``.
        host: address to bind and to advertise (loopback by default).
        port: 0 picks a free port.
        max_versions: versions kept; adding one more drops the oldest.
        fault: test-only misbehaviour (may also be set later through ``self.fault``).
    """

    def __init__(self, transport: str = "tcp", host: str = "127.0.0.1", port: int = 0,
                 max_versions: int = 2, fault: Fault | None = None) -> None:
        if max_versions < 1:
            raise WeightSyncError("max_versions must be >= 1", max_versions=max_versions)
        self.transport = transport
        self.host = host
        self.port = port
        self.max_versions = max_versions
        self.fault = fault
        self.status = ServerStatus.NEW
        self.address: str | None = None
        self.bytes_sent = 0
        self.requests = 0
        self._versions: OrderedDict[int, _Version] = OrderedDict()
        self._inflight = 0
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
        self.address = await self._server.start(self.host, self.port)
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
        held = np.full(manifest.num_chunks, complete, dtype=bool)
        self._versions.pop(manifest.version, None)
        self._versions[manifest.version] = _Version(manifest, view, held,
                                                    np.zeros(manifest.num_chunks, dtype=bool),
                                                    manifest_json=manifest.encode())
        while len(self._versions) > self.max_versions:
            self._versions.popitem(last=False)

    def mark_chunk(self, version: int, index: int) -> None:
        """Start serving chunk ``index`` of ``version`` (its bytes are in place and verified)."""
        entry = self._versions.get(version)
        if entry is None:
            raise WeightSyncError("version not registered on this server", version=version)
        entry.held[index] = True
        entry.pending[index] = False

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
        """Stop serving ``version`` (no-op if absent)."""
        self._versions.pop(version, None)

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
        if entry is None or index >= entry.manifest.num_chunks or not entry.held[index]:
            return Reply(Status.MISSING)
        self._inflight += 1
        entry.served += 1
        chunk = entry.manifest.chunks[index]
        payload = entry.buffer[chunk.offset:chunk.offset + chunk.nbytes]
        fault = self.fault
        if fault is not None and fault.applies(index):
            fault.fired += 1
            if fault.kind == "corrupt":
                return Reply(Status.OK, np.random.default_rng(index).bytes(chunk.nbytes), is_chunk=True)
            return Reply(Status.OK, payload, cut_after=min(fault.after_bytes, chunk.nbytes), then=fault.kind,
                         is_chunk=True)
        return Reply(Status.OK, payload, is_chunk=True)

    def load(self) -> int:
        return self._inflight

    def done(self, reply: Reply, sent: int) -> None:
        if reply.is_chunk:
            self.bytes_sent += sent
            self._inflight = max(0, self._inflight - 1)

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
        self._versions.clear()

