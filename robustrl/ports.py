"""Free TCP ports for servers this project starts later (a child process binds the number).

A port found by binding port 0 lies in the kernel's ephemeral range, the range every ``bind(0)``
and every outgoing connection draws from: between the pick and the child's bind (seconds, for a
controller that connects and takes its lease first), another process's ``bind(0)`` could be
handed the same number. Seen in a full test run: a member's health server took the port picked
for a stack's REST API, and the stack's client was answered ``no route /v1/jobs`` by it. Ports
are picked here below that range (checked free by a bind), where only explicit picks land.
"""

from __future__ import annotations

import random
import socket

LOWEST = 20000
"""The lowest port handed out (below it: registered services' ports, and other tools' picks)."""
ATTEMPTS = 64
"""Random ports tried before falling back to the kernel's choice."""


def ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The lowest port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        with open(path) as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port of ``host`` free a moment ago, outside the ephemeral range where one exists
    (the server may still lose a race for it, to another explicit pick only)."""
    high = ephemeral_low() - 1
    if high > LOWEST:
        for _ in range(ATTEMPTS):
            port = random.randint(LOWEST, high)  # noqa: S311 - a port number, not a secret
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
