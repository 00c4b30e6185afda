"""Weight-sync fan-out measured on the testbed: one process per host, real shaped links.

Host ``h0`` runs the trainer's WeightServer; hosts ``h1..hM`` each run one replica process that
pulls the version, either relayed (its own WeightServer on its host address serves every verified
chunk onward, and every replica's server is a source) or from the trainer only. Every process
builds the same payload from a seed, so nothing big crosses a process boundary, and each replica
checks the bytes it received against its own copy.

The orchestrator (``run_fanout``) and the workers speak JSON lines: a worker prints ``ready``
once its server listens and its buffer is built, a replica starts pulling when it reads ``go``
on stdin and prints ``done``, and every worker prints its server's ``bytes_sent`` after ``stop``
(relays keep serving until every replica is done). Wall time runs from ``go`` to the last
replica's end, so process start-up is not in it. Per-host transmitted bytes are the receive
counters of each host's bridge port (what left the host, headers included); CPU is read from
/proc/stat (the whole machine, other users included) and from the workers' own CPU times. Each
server logs its uploads (``WeightServer.upload_log``), from which ``uplink_busy`` is the share of
the run each host's upload slot was busy; ``control`` breaks the control messages down.

    python bench/testbed_fanout.py trainer --bind ADDR --port P --bytes N --chunk-bytes C
    python bench/testbed_fanout.py replica --bind ADDR --port P --sources A,B,... [--relay] ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from robustrl.testbed import Testbed
from robustrl.weights import Manifest, TensorEntry, WeightServer, build_manifest, pull

WORKER = Path(__file__).resolve()
READY_TIMEOUT_S = 90.0
"""Start-up of all workers (17 Python processes importing numpy on 2 cores)."""
PULL_TIMEOUT_S = 240.0
"""One replica's pull; trainer-only at M=16 and 100 Mbit/s with 32 MiB is ~45 s."""
STOP_TIMEOUT_S = 30.0
DONE_SLACK_S = 30.0
"""How much longer than PULL_TIMEOUT_S the orchestrator waits for every ``done``."""
PULL_CONNECT_TIMEOUT_S = 30.0
PULL_STALL_TIMEOUT_S = 30.0
"""``pull``'s defaults (5 s connect, 10 s per chunk or HAVE answer) are for a LAN. On a shaped
link the sender's queue is the host's whole backlog: with 16 trainer-only flows of 4 MiB socket
buffers a SYN-ACK or a HAVE answer from the trainer can wait seconds behind it (at 200 Mbit/s,
M=16 trainer-only, a replica that started late lost the trainer to those limits and failed), so
the benchmark gives the pulls longer and records the limits it used."""


def payload(nbytes: int, chunk_bytes: int, version: int) -> tuple[np.ndarray, Manifest]:
    """The version's bytes and manifest, the same in every process for the same arguments."""
    data = np.random.default_rng(version).integers(0, 256, nbytes, dtype=np.uint8)
    entry = TensorEntry(name="flat", dtype="uint8", shape=[nbytes], offset=0, nbytes=nbytes)
    return data, build_manifest(version, [entry], data, chunk_bytes)


# -- workers (run inside a host's namespace) -------------------------------------------------

def _emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


async def _stdin_line() -> str:
    return await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


async def _trainer(args: argparse.Namespace) -> None:
    data, manifest = payload(args.bytes, args.chunk_bytes, args.version)
    server = WeightServer("tcp", host=args.bind, port=args.port)
    server.upload_log = []
    address = await server.start()
    server.add_version(manifest, data)
    _emit({"ready": True, "address": address})
    await _stdin_line()  # "stop" (or EOF: the orchestrator is gone)
    _emit({"bytes_sent": server.bytes_sent, "requests": server.requests, "uploads": server.upload_log})
    await server.close()


async def _replica(args: argparse.Namespace) -> None:
    data, manifest = payload(args.bytes, args.chunk_bytes, args.version)
    relay = WeightServer("tcp", host=args.bind, port=args.port) if args.relay else None
    if relay is not None:
        relay.upload_log = []
        await relay.start()
    dest = np.empty(args.bytes, dtype=np.uint8)
    dest.fill(0)  # touch the pages now: the pull should not pay for page faults
    _emit({"ready": True, "address": relay.address if relay else None})
    if (await _stdin_line()).strip() != "go":
        return
    start, cpu0 = time.time(), time.process_time()
    buf, stats = await pull(manifest, args.sources.split(","), relay=relay, into=dest, seed=args.seed,
                            timeout_s=PULL_TIMEOUT_S, connect_timeout_s=args.connect_timeout_s,
                            stall_timeout_s=args.stall_timeout_s)
    end, cpu = time.time(), time.process_time() - cpu0
    _emit({"done": True, "start_t": start, "end_t": end, "wall_s": stats.wall_s, "cpu_s": cpu,
           "verified": bool(np.array_equal(buf, data)), "chunks_from": stats.chunks_from,
           "control_msgs": stats.control_msgs, "bytes_resent": stats.bytes_resent,
           "offers": stats.offers, "passed_busy": stats.passed_busy, "passed_none": stats.passed_none,
           "have_requests": stats.have_requests, "sub_messages": stats.sub_messages,
           "schedule": [[t.chunk, t.source, round(t.start_s, 4), round(t.end_s, 4)] for t in stats.schedule]})
    await _stdin_line()  # "stop": until then the relay keeps serving the other replicas
    _emit({"bytes_sent": relay.bytes_sent if relay else 0, "uploads": relay.upload_log if relay else []})
    if relay is not None:
        await relay.close()


def worker_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="testbed_fanout.py")
    ap.add_argument("role", choices=["trainer", "replica"])
    ap.add_argument("--bind", required=True, help="this host's testbed address")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--bytes", type=int, required=True)
    ap.add_argument("--chunk-bytes", type=int, required=True)
    ap.add_argument("--version", type=int, default=2, help="seeds the payload")
    ap.add_argument("--sources", default="", help="replica: comma-separated source addresses")
    ap.add_argument("--relay", action="store_true", help="replica: serve verified chunks onward")
    ap.add_argument("--seed", type=int, default=0, help="replica: its chunk order")
    ap.add_argument("--connect-timeout-s", type=float, default=PULL_CONNECT_TIMEOUT_S, help="replica: pull's")
    ap.add_argument("--stall-timeout-s", type=float, default=PULL_STALL_TIMEOUT_S, help="replica: pull's")
    args = ap.parse_args(argv)
    asyncio.run(_trainer(args) if args.role == "trainer" else _replica(args))


# -- orchestrator --------------------------------------------------------------------------

@dataclass(frozen=True)
class ReplicaDone:
    """A replica's ``done`` line, parsed."""

    start_t: float
    end_t: float
    wall_s: float
    cpu_s: float
    verified: bool
    chunks_from: dict[str, int]
    control_msgs: int
    bytes_resent: int
    offers: int = 0
    passed_busy: int = 0
    passed_none: int = 0
    have_requests: int = 0
    sub_messages: int = 0

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> ReplicaDone:
        if not obj.get("done"):
            raise ValueError(f"expected a done report, got {obj}")
        return cls(start_t=float(obj["start_t"]), end_t=float(obj["end_t"]), wall_s=float(obj["wall_s"]),
                   cpu_s=float(obj["cpu_s"]), verified=bool(obj["verified"]),
                   chunks_from={str(k): int(v) for k, v in obj["chunks_from"].items()},
                   control_msgs=int(obj["control_msgs"]), bytes_resent=int(obj["bytes_resent"]),
                   offers=int(obj.get("offers", 0)), passed_busy=int(obj.get("passed_busy", 0)),
                   passed_none=int(obj.get("passed_none", 0)), have_requests=int(obj.get("have_requests", 0)),
                   sub_messages=int(obj.get("sub_messages", 0)))


class _Worker:
    """One worker process in a host, its stderr in a file (read back if it fails)."""

    def __init__(self, tb: Testbed, host: str, argv: list[str], logdir: Path) -> None:
        self.host = host
        self.log = logdir / f"{host}.err"
        with open(self.log, "w") as err:
            self.proc = tb.popen(host, [sys.executable, str(WORKER), *argv], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=err, text=True)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def read(self, deadline: float) -> dict[str, Any]:
        """The worker's next JSON line (exactly one is pending at a time, so select on the pipe
        does not miss a line already buffered)."""
        out: IO[str] = self.proc.stdout  # type: ignore[assignment]
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([out], [], [], left)[0]:
            raise TimeoutError(f"worker on {self.host} said nothing for {left:.0f} s; stderr: {self.stderr()}")
        line = out.readline()
        if not line:
            raise RuntimeError(f"worker on {self.host} exited ({self.proc.poll()}); stderr: {self.stderr()}")
        return json.loads(line)

    def stderr(self) -> str:
        return self.log.read_text()[-2000:]

    def cpu_s(self) -> float:
        try:
            t = psutil.Process(self.proc.pid).cpu_times()
        except psutil.Error:
            return 0.0
        return t.user + t.system

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=STOP_TIMEOUT_S)


def host_tx_bytes(tb: Testbed) -> dict[str, int]:
    """Bytes each host has sent onto its link: the receive counter of its port on the bridge."""
    out = subprocess.run(["ip", "-n", tb.state.switch_netns, "-s", "-j", "link", "show"], check=True,
                         capture_output=True, text=True).stdout
    rx = {link["ifname"]: int(link["stats64"]["rx"]["bytes"]) for link in json.loads(out)}
    return {h.name: rx[h.bridge_port] for h in tb.hosts}


def cpu_busy(before: list[Any], after: list[Any]) -> dict[str, float]:
    """Busy fractions between two ``psutil.cpu_times(percpu=True)`` samples (the whole machine)."""
    per_cpu, softirq, total_all, busy_all = [], 0.0, 0.0, 0.0
    for b, a in zip(before, after, strict=True):
        total = sum(a) - sum(b)
        idle = (a.idle - b.idle) + (getattr(a, "iowait", 0.0) - getattr(b, "iowait", 0.0))
        per_cpu.append((total - idle) / total if total > 0 else 0.0)
        softirq += getattr(a, "softirq", 0.0) - getattr(b, "softirq", 0.0)
        total_all += total
        busy_all += total - idle
    return {"busy_fraction": round(busy_all / total_all, 3) if total_all else 0.0,
            "max_cpu_busy_fraction": round(max(per_cpu), 3),
            "softirq_fraction": round(softirq / total_all, 3) if total_all else 0.0}


def run_fanout(tb: Testbed, m: int, relay: bool, nbytes: int, chunk_bytes: int, link_bps: float,
               port: int, logdir: Path) -> dict[str, Any]:
    """One fan-out: trainer on h0, replicas on h1..hm; returns the measured record."""
    hosts = [h.name for h in tb.hosts[: m + 1]]
    addr = {h: tb.address(h) for h in hosts}
    trainer_addr = f"tcp://{addr['h0']}:{port}"
    relay_addrs = [f"tcp://{addr[h]}:{port}" for h in hosts[1:]]
    sources = [trainer_addr, *relay_addrs] if relay else [trainer_addr]
    common = ["--port", str(port), "--bytes", str(nbytes), "--chunk-bytes", str(chunk_bytes)]
    workers: list[_Worker] = []
    try:
        trainer = _Worker(tb, "h0", ["trainer", "--bind", addr["h0"], *common], logdir)
        workers.append(trainer)
        replicas = [_Worker(tb, h, ["replica", "--bind", addr[h], *common, "--sources", ",".join(sources),
                                    "--seed", str(i), *(["--relay"] if relay else [])], logdir)
                    for i, h in enumerate(hosts[1:])]
        workers.extend(replicas)
        deadline = time.monotonic() + READY_TIMEOUT_S
        for w in workers:
            w.read(deadline)  # ready
        tx0, cpu0, wcpu0 = host_tx_bytes(tb), psutil.cpu_times(percpu=True), sum(w.cpu_s() for w in workers)
        go_t = time.time()
        for w in replicas:
            w.send("go")
        deadline = time.monotonic() + PULL_TIMEOUT_S + DONE_SLACK_S
        lines = [w.read(deadline) for w in replicas]
        done = [ReplicaDone.from_json(line) for line in lines]
        cpu1, wcpu1 = psutil.cpu_times(percpu=True), sum(w.cpu_s() for w in workers)
        wall = max(d.end_t for d in done) - go_t
        for w in workers:
            w.send("stop")
        deadline = time.monotonic() + STOP_TIMEOUT_S
        stops = {w.host: w.read(deadline) for w in workers}
        sent = {h: int(v["bytes_sent"]) for h, v in stops.items()}
        uploads = {h: v.get("uploads") or [] for h, v in stops.items()}
        tx1 = host_tx_bytes(tb)
        LAST_RUN.clear()
        LAST_RUN.update(go_t=go_t, replicas=lines, uploads=uploads)
    finally:
        for w in workers:
            w.stop()
    tx = {h: tx1[h] - tx0[h] for h in hosts}
    copy_s = nbytes * 8 / link_bps
    received = sum(sum(d.chunks_from.values()) for d in done)
    cpu = cpu_busy(cpu0, cpu1)
    cpu["workers_fraction"] = round((wcpu1 - wcpu0) / (wall * (os.cpu_count() or 1)), 3)
    cpu["cpus"] = os.cpu_count() or 1
    busiest = max(tx, key=lambda h: tx[h])
    busy = {h: round(_busy_time(uploads[h], go_t, go_t + wall) / wall, 3) for h in hosts}
    return {
        "m": m, "mode": "relay" if relay else "trainer_only", "link_gbps": link_bps / 1e9, "bytes": nbytes,
        "chunk_bytes": chunk_bytes, "wall_s": round(wall, 3),
        "replica_wall_s": {"min": round(min(d.wall_s for d in done), 3), "max": round(max(d.wall_s for d in done), 3)},
        "single_copy_s": round(copy_s, 3), "wall_over_copy": round(wall / copy_s, 3),
        "trainer_bytes_sent": sent["h0"], "trainer_copies": round(sent["h0"] / nbytes, 3),
        "max_relay_bytes_sent": max((sent[h] for h in hosts[1:]), default=0),
        "max_host_tx_bytes": tx[busiest], "max_host_tx_host": busiest, "host_tx_bytes": tx,
        "control_msgs_per_chunk": round(sum(d.control_msgs for d in done) / max(1, received), 3),
        "control": {"have": sum(d.have_requests for d in done), "subscribe": sum(d.sub_messages for d in done),
                    "offers": sum(d.offers for d in done), "passed_busy": sum(d.passed_busy for d in done),
                    "passed_none": sum(d.passed_none for d in done), "chunks_received": received},
        "uplink_busy": {"trainer": busy["h0"],
                        "relays_mean": round(sum(busy[h] for h in hosts[1:]) / m, 3) if relay else 0.0,
                        "relays_max": max((busy[h] for h in hosts[1:]), default=0.0) if relay else 0.0},
        "replica_cpu_s_mean": round(sum(d.cpu_s for d in done) / m, 3),
        "chunks_from_trainer_fraction": round(sum(d.chunks_from.get(trainer_addr, 0) for d in done)
                                              / max(1, received), 3),
        "bytes_resent": sum(d.bytes_resent for d in done), "verified": all(d.verified for d in done),
        "cpu": cpu, "cpu_limited": cpu["busy_fraction"] >= CPU_LIMITED_BUSY,
        "pull_timeouts_s": {"connect": PULL_CONNECT_TIMEOUT_S, "stall": PULL_STALL_TIMEOUT_S},
    }


LAST_RUN: dict[str, Any] = {}
"""The last ``run_fanout``'s raw reports (replica ``done`` lines with their schedules, upload logs),
for analysis scripts; not written to the JSON."""


def _busy_time(uploads: list[list[float]], start: float, end: float) -> float:
    """Seconds in [start, end] during which some upload of ``uploads`` (chunk, from, to, bytes) ran."""
    spans = sorted((max(start, u[1]), min(end, u[2])) for u in uploads if u[2] > start and u[1] < end)
    total, cur_start, cur_end = 0.0, None, None
    for a, b in spans:
        if cur_end is None or a > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start  # type: ignore[operator]
            cur_start, cur_end = a, b
        else:
            cur_end = max(cur_end, b)
    if cur_end is not None:
        total += cur_end - cur_start  # type: ignore[operator]
    return total


CPU_LIMITED_BUSY = 0.85
"""Above this busy fraction of the whole machine during a run, the cores, not the links, may set
the pace (flagged as ``cpu_limited``)."""


def run_testbed(link: str, ms: list[int], nbytes: int, chunk_bytes: int, link_bps: float,
                log: Any = None, relay_repeats: int = 1) -> list[dict[str, Any]]:
    """Every M in ``ms``, relay then trainer-only, on one testbed of max(ms)+1 hosts at ``link``;
    the relayed run at the largest M ``relay_repeats`` times (records numbered by ``repeat``)."""
    records = []
    with tempfile.TemporaryDirectory(prefix="fanout-") as tmp, Testbed(hosts=max(ms) + 1, link=link) as tb:
        port = 7100
        for m in ms:
            runs = [(True, i) for i in range(relay_repeats if m == max(ms) else 1)] + [(False, 0)]
            for relay, repeat in runs:
                port += 1  # a fresh port per run: no listener of the last run in the way
                record = run_fanout(tb, m, relay, nbytes, chunk_bytes, link_bps, port, Path(tmp))
                records.append({**record, "repeat": repeat})
                if log is not None:
                    log(records[-1])
    return records


if __name__ == "__main__":
    worker_main(sys.argv[1:])
