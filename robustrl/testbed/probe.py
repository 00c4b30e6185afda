"""TCP probes run inside testbed hosts: a sink that times what it receives, a source, and a
reachability check. Standard library only, so a probe starts in a few tens of milliseconds.

    python -m robustrl.testbed.probe sink [--port P] [--tuned]         prints {"port"} when ready,
                                                                        then {"bytes", "seconds", "cpu_s"}
    python -m robustrl.testbed.probe source HOST PORT BYTES [--tuned]
    python -m robustrl.testbed.probe listen [--port P]                 accepts and closes, forever
    python -m robustrl.testbed.probe echo [--port P]                   echoes one connection's bytes
    python -m robustrl.testbed.probe reach HOST PORT [--timeout S]     exit 0 if a connection opens

``--tuned`` sets what the weight transport sets (4 MiB socket buffers, TCP_NODELAY, and on the
sending side TCP_NOTSENT_LOWAT as a weight source's socket has it); without it the kernel's
defaults apply, so the two can be compared. ``cpu_s`` is the probe's own CPU time
over the transfer: next to ``seconds`` it shows whether the CPU, not the link, set the rate.
``transfer`` runs a sink and a source on two testbed hosts and returns both reports.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from robustrl.testbed.testbed import HostRef, Testbed

TUNED_BUFFER_BYTES = 4 * 1024 * 1024
TUNED_NOTSENT_LOWAT = 64 * 1024
"""robustrl.weights.tcp.NOTSENT_LOWAT (not imported: this module starts with the standard library only)."""
CHUNK_BYTES = 1024 * 1024
ACCEPT_TIMEOUT_S = 30.0
REACH_TIMEOUT_S = 1.0
MODULE = "robustrl.testbed.probe"


def tune(sock: socket.socket) -> None:
    """The weight transport's socket options."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, TUNED_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, TUNED_BUFFER_BYTES)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _listener(port: int, tuned: bool) -> socket.socket:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if tuned:
        tune(srv)  # accepted sockets inherit the buffers (the window is set at SYN time)
    srv.bind(("0.0.0.0", port))
    srv.listen(64)
    return srv


def sink(port: int, tuned: bool) -> dict[str, float]:
    """Accept one connection, read it to EOF; the time runs from the first byte to EOF."""
    with _listener(port, tuned) as srv:
        print(json.dumps({"port": srv.getsockname()[1]}), flush=True)
        srv.settimeout(ACCEPT_TIMEOUT_S)
        conn, _ = srv.accept()
    with conn:
        buf = bytearray(CHUNK_BYTES)
        total, first, cpu0 = 0, None, time.process_time()
        while n := conn.recv_into(buf):
            first = first or time.perf_counter()
            total += n
        end = time.perf_counter()
    return {"bytes": total, "seconds": end - (first or end), "cpu_s": time.process_time() - cpu0}


def source(host: str, port: int, nbytes: int, tuned: bool) -> dict[str, float]:
    """Connect and send ``nbytes`` zero bytes."""
    with socket.socket() as sock:
        if tuned:
            tune(sock)
            if hasattr(socket, "TCP_NOTSENT_LOWAT"):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, TUNED_NOTSENT_LOWAT)
        sock.connect((host, port))
        chunk = bytes(CHUNK_BYTES)
        start, left, cpu0 = time.perf_counter(), nbytes, time.process_time()
        while left > 0:
            sock.sendall(chunk[: min(left, CHUNK_BYTES)])
            left -= CHUNK_BYTES
        sock.shutdown(socket.SHUT_WR)
        sock.recv(1)  # the sink closes after EOF: everything has arrived
        return {"bytes": nbytes, "seconds": time.perf_counter() - start, "cpu_s": time.process_time() - cpu0}


def listen(port: int) -> None:
    with _listener(port, False) as srv:
        print(json.dumps({"port": srv.getsockname()[1]}), flush=True)
        while True:
            conn, _ = srv.accept()
            conn.close()


def echo(port: int) -> None:
    """Send back whatever one connection sends, until it closes."""
    with _listener(port, False) as srv:
        print(json.dumps({"port": srv.getsockname()[1]}), flush=True)
        conn, _ = srv.accept()
    with conn:
        while data := conn.recv(CHUNK_BYTES):
            conn.sendall(data)


def reach(host: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


@dataclass(frozen=True)
class Transfer:
    """One measured transfer: ``bits_per_s`` at the receiver (first byte to EOF), and each side's
    CPU time as a fraction of the transfer's wall time."""

    nbytes: int
    seconds: float
    tuned: bool
    sink_cpu_fraction: float
    source_cpu_fraction: float

    @property
    def bits_per_s(self) -> float:
        return self.nbytes * 8 / self.seconds if self.seconds > 0 else 0.0


TRANSFER_TIMEOUT_S = 120.0


def transfer(tb: Testbed, src: HostRef, dst: HostRef, nbytes: int, *, tuned: bool,
             timeout: float = TRANSFER_TIMEOUT_S) -> Transfer:
    """Send ``nbytes`` over TCP from host ``src`` to host ``dst`` of ``tb``.

    Raises:
        TimeoutError: the transfer took longer than ``timeout``.
        RuntimeError: a probe failed (its stderr is in the message).
    """
    flag = ["--tuned"] if tuned else []
    sink_proc = tb.popen(dst, [sys.executable, "-m", MODULE, "sink", *flag], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert sink_proc.stdout is not None
        port = json.loads(sink_proc.stdout.readline())["port"]
        try:
            sent = tb.run(src, [sys.executable, "-m", MODULE, "source", tb.address(dst), str(port), str(nbytes),
                                *flag], capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise TimeoutError(f"a {nbytes}-byte transfer did not finish in {timeout:.0f} s") from exc
        if sent.returncode != 0:
            raise RuntimeError(f"probe source failed: {sent.stderr.strip()}")
        got = json.loads(sink_proc.stdout.readline())
    finally:
        sink_proc.kill()
        sink_proc.wait()
    src_report = json.loads(sent.stdout)
    seconds = float(got["seconds"])
    return Transfer(nbytes=int(got["bytes"]), seconds=seconds, tuned=tuned,
                    sink_cpu_fraction=got["cpu_s"] / seconds if seconds else 0.0,
                    source_cpu_fraction=src_report["cpu_s"] / src_report["seconds"] if src_report["seconds"] else 0.0)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("sink")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--tuned", action="store_true")
    p = sub.add_parser("source")
    p.add_argument("host")
    p.add_argument("port", type=int)
    p.add_argument("bytes", type=int)
    p.add_argument("--tuned", action="store_true")
    p = sub.add_parser("listen")
    p.add_argument("--port", type=int, default=0)
    p = sub.add_parser("echo")
    p.add_argument("--port", type=int, default=0)
    p = sub.add_parser("reach")
    p.add_argument("host")
    p.add_argument("port", type=int)
    p.add_argument("--timeout", type=float, default=REACH_TIMEOUT_S)
    args = parser.parse_args(argv)
    if args.cmd == "sink":
        print(json.dumps(sink(args.port, args.tuned)), flush=True)
    elif args.cmd == "source":
        print(json.dumps(source(args.host, args.port, args.bytes, args.tuned)), flush=True)
    elif args.cmd == "listen":
        listen(args.port)
    elif args.cmd == "echo":
        echo(args.port)
    else:
        return 0 if reach(args.host, args.port, args.timeout) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
