"""Free TCP ports for servers this project starts later (a child process binds the number).

A port found by binding port 0 lies in the kernel's ephemeral range, the range every ``bind(0)``
and every outgoing connection draws from: between the pick and the child's bind (seconds, for a
controller that connects and takes its lease first), another process's ``bind(0)`` could be
handed the same number. Seen in a full test run: a member's health server took the port picked
for a stack's REST API, and the stack's client was answered ``no route /v1/jobs`` by it. Ports
are picked outside that range (below it, or above it where it ends early; checked free by a
bind), where only explicit picks land, and one process never hands out the same port twice
within ``RECENT`` picks (two picks before either is bound: a server's two ports).
"""

from __future__ import annotations

import collections
import random
import socket
import threading

LOWEST = 20000
"""The lowest port handed out (below it: registered services' ports, and other tools' picks)."""
HIGHEST = 65535
ATTEMPTS = 64
"""Random ports tried before falling back to the kernel's choice."""
RECENT = 512
"""Picks of this process remembered, and not handed out again while remembered."""
MIN_SPACE = 2000
"""Fewer ports than this outside the ephemeral range (a range from 1024 to 65535): the kernel's
choice is taken, and the race is as it was."""

_recent: collections.deque[int] = collections.deque(maxlen=RECENT)
_lock = threading.Lock()


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's ephemeral range (32768-60999, Linux's default, where it cannot be read)."""
    try:
        with open(path) as fh:
            low, high = (int(x) for x in fh.read().split()[:2])
            return low, high
    except (OSError, ValueError):
        return 32768, 60999


def outside_ranges(low: int, high: int) -> list[tuple[int, int]]:
    """The port ranges (inclusive) outside ``low``-``high`` and above ``LOWEST``."""
    return [(a, b) for a, b in ((LOWEST, low - 1), (high + 1, HIGHEST)) if b >= a]


def _nth(spans: list[tuple[int, int]], n: int) -> int:
    """The ``n``-th port of ``spans`` taken one after another."""
    for a, b in spans:
        if n <= b - a:
            return a + n
        n -= b - a + 1
    raise IndexError(n)


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port of ``host`` free a moment ago, outside the ephemeral range where there is room
    (the server may still lose a race for it, to another process's explicit pick only)."""
    spans = outside_ranges(*ephemeral_range())
    size = sum(b - a + 1 for a, b in spans)
    if size >= MIN_SPACE:
        with _lock:
            for _ in range(ATTEMPTS):
                port = _nth(spans, random.randrange(size))  # a port number, not a secret
                if port not in _recent and _bindable(host, port):
                    _recent.append(port)
                    return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
