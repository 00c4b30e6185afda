"""UCX transport tuning: an idle process holding a UCX listener and an endpoint must not spin a
core, and the event-driven progress must still move bytes (and raise on a dead peer)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed"),
]

from robustrl.errors import TransportError
from robustrl.weights import Manifest, TensorEntry, WeightServer, build_manifest
from robustrl.weights.transport import make_client

IDLE_S = 2.0


def _version(nbytes: int, chunk_bytes: int) -> tuple[np.ndarray, Manifest]:
    data = np.random.default_rng(3).integers(0, 256, nbytes, dtype=np.uint8)
    entry = TensorEntry(name="flat", dtype="uint8", shape=[nbytes], offset=0, nbytes=nbytes)
    return data, build_manifest(5, [entry], data, chunk_bytes)


_IDLE_PROBE = """
import asyncio, json, time, psutil
from robustrl.weights import WeightServer
from robustrl.weights.transport import make_client

async def main():
    server = WeightServer("ucx")
    client = make_client(await server.start())
    try:
        await client.connect()
        await client.have(1, 1)  # the server now waits on the endpoint for the next request
        proc = psutil.Process()
        before, t0 = proc.cpu_times(), time.perf_counter()
        await asyncio.sleep(%r)  # the measured thing is idleness itself
        after, t1 = proc.cpu_times(), time.perf_counter()
    finally:
        await client.close()
        await server.close()
    print(json.dumps((after.user + after.system - before.user - before.system) / (t1 - t0)))

asyncio.run(main())
"""


def test_idle_listener_and_endpoint_do_not_spin() -> None:
    # A process of its own: the pytest process carries other tests' threads (stack log readers,
    # store clients) whose CPU would be counted against UCX.
    out = subprocess.run([sys.executable, "-c", _IDLE_PROBE % IDLE_S], capture_output=True, text=True, check=False,
                         timeout=50, env=os.environ.copy())
    assert out.returncode == 0, out.stderr[-2000:]
    fraction = json.loads(out.stdout.strip().splitlines()[-1])
    assert fraction < 0.05, f"idle UCX process used {fraction:.1%} of a core"


async def test_chunks_arrive_intact_and_dead_source_raises() -> None:
    data, manifest = _version(4 << 20, 1 << 20)
    server = WeightServer("ucx")
    address = await server.start()
    server.add_version(manifest, data)
    client = make_client(address)
    dest = np.zeros_like(data)
    try:
        await client.connect()
        view = memoryview(dest)
        for c in manifest.chunks:
            assert await client.fetch_chunk(manifest.version, c.index, view[c.offset:c.offset + c.nbytes])
        assert np.array_equal(dest, data)
        await server.close()
        with pytest.raises(TransportError):
            await asyncio.wait_for(client.fetch_chunk(manifest.version, 0, view[:1 << 20]), 10)
    finally:
        await client.close()
        await server.close()
