"""Ports picked for servers started later, and a stack whose API port another server holds.

Seen in a full run (suite44): a member's health server, bound to port 0, was handed the port the
testbed stack had picked for its REST API seconds before its controller bound it; the stack took
that server's ``200`` for its controller being ready, and the test's submit was answered ``404
no route /v1/jobs`` by it.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path

import pytest

from robustrl.errors import LaunchError
from robustrl.health import HealthServer
from robustrl.ports import MIN_SPACE, ephemeral_range, free_port, outside_ranges
from robustrl.stack import Stack


def test_picked_ports_lie_outside_the_kernels_ephemeral_range_are_free_and_not_handed_out_twice() -> None:
    """What any ``bind(0)`` (a member's health server, an outgoing connection) is handed comes
    from the ephemeral range; a picked port outside it cannot be handed to one meanwhile. Two
    picks of one process before either is bound (a server's two ports) differ."""
    low, high = ephemeral_range()
    if sum(b - a + 1 for a, b in outside_ranges(low, high)) < MIN_SPACE:
        pytest.skip(f"this kernel's ephemeral range {low}-{high} leaves no room outside it")
    held = []
    try:
        for _ in range(300):  # the kernel's own picks, held while ports are picked
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        picked = [free_port() for _ in range(100)]
    finally:
        for s in held:
            s.close()
    assert all(not low <= p <= high for p in picked), (low, high, sorted(picked))
    assert not taken & set(picked) and len(set(picked)) == len(picked)
    for p in picked[:10]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free indeed


def test_the_kernels_range_is_read_and_the_room_outside_it_found(tmp_path: Path) -> None:
    (tmp_path / "range").write_text("40000\t60999\n")
    assert ephemeral_range(str(tmp_path / "range")) == (40000, 60999)
    (tmp_path / "bad").write_text("garbage")
    assert ephemeral_range(str(tmp_path / "bad")) == (32768, 60999)
    assert ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)
    assert outside_ranges(32768, 60999) == [(20000, 32767), (61000, 65535)]
    assert outside_ranges(10000, 40000) == [(40001, 65535)]  # a range starting low: above it
    assert outside_ranges(1024, 65535) == []  # no room: the kernel's choice, as before


def test_a_stack_whose_api_port_another_server_holds_is_a_clear_error_not_ready(tmp_path: Path) -> None:
    """Another service's health server on the API's port answers ``/healthz`` with 200 but is no
    controller: the stack must not call itself ready (it did, its ``leading`` read with a default
    of True) but fail, naming the controller, which could not bind its port."""
    loop = asyncio.new_event_loop()
    server = HealthServer("squatter", {"ok": lambda: True})
    port = loop.run_until_complete(server.start("127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    stack = Stack(tmp_path / "stack", api_port=port)
    try:
        with pytest.raises(LaunchError, match="controller"):
            stack.start()
    finally:
        stack.stop()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
