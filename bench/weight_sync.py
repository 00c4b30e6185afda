"""Weight-sync benchmark: point-to-point throughput, relay fan-out, failure cost, memory.

    python bench/weight_sync.py --out results/weight_sync.json [--bytes N]

Point-to-point runs the source and the puller in separate processes over loopback and compares
TCP and UCX (``pull`` with checksum verification, and the bare transport without) against a
plain blocking socket copy of the same bytes measured in the same run. Fan-out runs one trainer
source and M replicas in one process, records which chunk came from which source when, and
replays that schedule on a simulated cluster where every machine has its own link of
``--link-gbps``: relays should make cluster time grow slowly with M, trainer-only ~linearly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import sys
import time
from pathlib import Path

os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from robustrl.weights import Fault, Manifest, TensorEntry, WeightServer, build_manifest, pull
from robustrl.weights.puller import PullStats
from robustrl.weights.transport import make_client

GIB = 1 << 30


def _payload(nbytes: int, chunk_bytes: int, version: int = 1) -> tuple[np.ndarray, Manifest]:
    data = np.random.default_rng(version).integers(0, 256, nbytes, dtype=np.uint8)
    entry = TensorEntry(name="flat", dtype="uint8", shape=[nbytes], offset=0, nbytes=nbytes)
    return data, build_manifest(version, [entry], data, chunk_bytes)


# -- raw socket baseline --------------------------------------------------------------------

def _raw_sender(port: int, nbytes: int, rounds: int) -> None:
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    for _ in range(rounds):
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(memoryview(data))


def raw_socket_gibps(nbytes: int, rounds: int = 3) -> float:
    """Best of ``rounds`` blocking sendall -> recv_into copies of ``nbytes`` over loopback."""
    dest = np.empty(nbytes, dtype=np.uint8)
    dest.fill(0)
    view = memoryview(dest)
    best = 0.0
    with socket.create_server(("127.0.0.1", 0)) as listener:
        proc = mp.get_context("spawn").Process(target=_raw_sender, args=(listener.getsockname()[1], nbytes, rounds))
        proc.start()
        for _ in range(rounds):
            conn, _ = listener.accept()
            with conn:
                t0 = time.perf_counter()
                pos = 0
                while pos < nbytes:
                    n = conn.recv_into(view[pos:])
                    if n == 0:
                        break
                    pos += n
                best = max(best, pos / (time.perf_counter() - t0) / GIB)
        proc.join()
    return best


# -- point to point -------------------------------------------------------------------------

def _source_main(kind: str, nbytes: int, chunk_bytes: int, conn) -> None:  # type: ignore[no-untyped-def]
    async def serve() -> None:
        data, manifest = _payload(nbytes, chunk_bytes)
        server = WeightServer(kind)
        address = await server.start()
        server.add_version(manifest, data)
        conn.send((address, manifest.model_dump_json()))
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # wait for "stop"
        await server.close()

    asyncio.run(serve())


async def _bare_fetch(address: str, manifest: Manifest, dest: np.ndarray) -> float:
    """Fetch every chunk on one connection, no verification: the transport alone."""
    client = make_client(address)
    await client.connect()
    view = memoryview(dest)
    t0 = time.perf_counter()
    for c in manifest.chunks:
        await client.fetch_chunk(manifest.version, c.index, view[c.offset:c.offset + c.nbytes])
    dt = time.perf_counter() - t0
    await client.close()
    return manifest.total_bytes / dt / GIB


def point_to_point(kind: str, nbytes: int, chunk_bytes: int, rounds: int = 2) -> dict[str, object]:
    """Throughput of ``kind`` between two processes, best of ``rounds``, plus peak extra RSS."""
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_source_main, args=(kind, nbytes, chunk_bytes, child))
    proc.start()
    try:
        address, manifest_json = parent.recv()
        manifest = Manifest.model_validate_json(manifest_json)
        rss = psutil.Process()

        async def measure() -> dict[str, object]:
            dest = np.empty(manifest.total_bytes, dtype=np.uint8)
            dest.fill(0)  # touch the pages: measure the transport, not page faults
            bare = max([await _bare_fetch(address, manifest, dest) for _ in range(rounds)])
            best, peak_extra = 0.0, 0
            for _ in range(rounds):
                base = rss.memory_info().rss
                peak = base
                done = asyncio.Event()

                async def sample() -> None:
                    nonlocal peak
                    while not done.is_set():
                        peak = max(peak, rss.memory_info().rss)
                        await asyncio.sleep(0.005)

                sampler = asyncio.create_task(sample())
                _buf, stats = await pull(manifest, [address], into=dest, per_source_inflight=2)
                done.set()
                await sampler
                best = max(best, manifest.total_bytes / stats.wall_s / GIB)
                peak_extra = max(peak_extra, peak - base)
            return {"pull_gibps": best, "transport_gibps": bare, "peak_extra_rss_bytes": peak_extra}

        return asyncio.run(measure())
    finally:
        parent.send("stop")
        proc.join(timeout=30)


# -- fan-out --------------------------------------------------------------------------------

def simulate_cluster(schedules: list[list[tuple[int, int, int, float, int]]], link_bps: float) -> float:
    """Replay recorded transfers on a cluster where each machine has its own full-duplex link.

    ``schedules`` holds (src_machine, dst_machine, chunk, recorded_start_s, nbytes) per transfer;
    machine 0 is the trainer. Transfers run in recorded order; one starts when its source holds
    the chunk and both the source's uplink and the destination's downlink are free.
    """
    events = sorted((t for s in schedules for t in s), key=lambda t: t[3])
    up: dict[int, float] = {}
    down: dict[int, float] = {}
    has: dict[tuple[int, int], float] = {}
    end_all = 0.0
    for src, dst, chunk, _, nbytes in events:
        ready = 0.0 if src == 0 else has.get((src, chunk), 0.0)
        start = max(ready, up.get(src, 0.0), down.get(dst, 0.0))
        end = start + nbytes / link_bps
        up[src] = down[dst] = end
        has[(dst, chunk)] = min(end, has.get((dst, chunk), end))
        end_all = max(end_all, end)
    return end_all


async def fanout_run(kind: str, m: int, relay: bool, data: np.ndarray, manifest: Manifest,
                     link_bps: float) -> dict[str, object]:
    trainer = WeightServer(kind)
    await trainer.start()
    trainer.add_version(manifest, data)
    relays = [WeightServer(kind) for _ in range(m)] if relay else []
    for r in relays:
        await r.start()
    machine = {trainer.address: 0, **{r.address: i + 1 for i, r in enumerate(relays)}}
    sources = [trainer.address, *(r.address for r in relays)]
    t0 = time.perf_counter()
    results: list[tuple[np.ndarray, PullStats]] = await asyncio.gather(*(
        pull(manifest, sources, relay=relays[i] if relay else None, seed=i, max_inflight=4)
        for i in range(m)))
    wall = time.perf_counter() - t0
    schedules = [[(machine[t.source], i + 1, t.chunk, t.start_s, t.nbytes) for t in stats.schedule if t.ok]
                 for i, (_, stats) in enumerate(results)]
    for buf, _ in results:
        assert np.array_equal(buf, data)
    out = {"m": m, "mode": "relay" if relay else "trainer_only", "trainer_bytes_sent": trainer.bytes_sent,
           "trainer_copies": trainer.bytes_sent / manifest.total_bytes, "wall_s": wall,
           "simulated_cluster_s": simulate_cluster(schedules, link_bps)}
    for server in [trainer, *relays]:
        await server.close()
    return out


async def relay_failure(kind: str, data: np.ndarray, manifest: Manifest) -> dict[str, object]:
    trainer = WeightServer(kind)
    await trainer.start()
    trainer.add_version(manifest, data)
    relay = WeightServer(kind, fault=Fault("die", after_bytes=manifest.chunk_bytes // 2, after_chunks=3))
    await relay.start()
    relay.add_version(manifest, data)
    try:
        buf, stats = await pull(manifest, [relay.address, trainer.address])
        completed = bool(np.array_equal(buf, data))
    finally:
        await trainer.close()
        await relay.close()
    return {"completed": completed, "bytes_resent": stats.bytes_resent, "chunk_bytes": manifest.chunk_bytes,
            "failed_sources": len(stats.failed_sources)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--bytes", type=int, default=256 << 20, help="point-to-point buffer size")
    ap.add_argument("--chunk-bytes", type=int, default=4 << 20)
    ap.add_argument("--fanout-bytes", type=int, default=32 << 20)
    ap.add_argument("--fanout-chunk-bytes", type=int, default=1 << 20)
    ap.add_argument("--link-gbps", type=float, default=100.0, help="simulated per-machine link")
    args = ap.parse_args()
    link_bps = args.link_gbps * 1e9 / 8

    result: dict[str, object] = {"bytes": args.bytes, "chunk_bytes": args.chunk_bytes, "cpus": os.cpu_count()}
    result["raw_socket_gibps"] = raw_socket_gibps(args.bytes)
    tcp = point_to_point("tcp", args.bytes, args.chunk_bytes)
    result.update(tcp_gibps=tcp["pull_gibps"], tcp_transport_gibps=tcp["transport_gibps"],
                  tcp_peak_extra_rss_bytes=tcp["peak_extra_rss_bytes"])
    try:
        import ucxx  # noqa: F401

        ucx = point_to_point("ucx", args.bytes, args.chunk_bytes)
        result.update(ucx_gibps=ucx["pull_gibps"], ucx_transport_gibps=ucx["transport_gibps"],
                      ucx_peak_extra_rss_bytes=ucx["peak_extra_rss_bytes"])
    except Exception as exc:  # report why instead of failing the whole benchmark
        result.update(ucx_gibps=None, ucx_reason=repr(exc))
    raw = result["raw_socket_gibps"]
    for key in ("tcp_gibps", "tcp_transport_gibps", "ucx_gibps", "ucx_transport_gibps"):
        if result.get(key):
            result[key.replace("gibps", "vs_raw")] = result[key] / raw  # type: ignore[operator]

    data, manifest = _payload(args.fanout_bytes, args.fanout_chunk_bytes, version=2)
    result["fanout_bytes"] = args.fanout_bytes
    result["fanout_chunk_bytes"] = args.fanout_chunk_bytes
    result["link_gbps"] = args.link_gbps
    fanout = []
    for m in (1, 2, 4, 8):
        for relay in (True, False):
            fanout.append(asyncio.run(fanout_run("tcp", m, relay, data, manifest, link_bps)))
            print(json.dumps(fanout[-1]), flush=True)
    result["fanout"] = fanout
    result["relay_failure"] = asyncio.run(relay_failure("tcp", data, manifest))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
