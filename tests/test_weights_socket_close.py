"""A weight connection closed while another task still waits to read on it leaves nothing behind.

A pull closes a source's connections when it gives the source up (``_PullCore._kill``): the
subscription's connection to a frozen relay is closed while the subscription task waits in
``next_offer``. The event loop kept that read registered on the descriptor number, and the next
socket the process opened got the same number: a connect to a healthy source failed, or a
connection stayed deaf, and when the pull ended, the old wait's clean-up unregistered the new
socket (an outside review: a pull failed 'unavailable' with a complete source alive). Real
sockets, a real weight server, a peer that accepts and never answers.
"""

from __future__ import annotations

import asyncio
import socket

import torch

from robustrl.aio import within
from robustrl.weights.flat import flatten_state_dict
from robustrl.weights.server import WeightServer
from robustrl.weights.tcp import TcpClient


async def _closed_under_a_wait_then_reused() -> None:
    frozen = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel's backlog), never answers
    buf, manifest = flatten_state_dict({"w": torch.arange(1024, dtype=torch.float32)}, 1, 1024)
    server = WeightServer()
    address = await server.start()
    server.add_version(manifest, buf)
    try:
        sub = TcpClient(f"tcp://127.0.0.1:{frozen.getsockname()[1]}")
        await sub.connect(2.0)
        old_fd = sub._sock.fileno()  # type: ignore[union-attr]
        waiting = asyncio.create_task(sub.next_offer())  # the subscription task's wait
        await asyncio.sleep(0)  # (one loop step: the read is registered)
        await sub.close()  # the pull gives the frozen source up
        healthy = TcpClient(address)
        await healthy.connect(2.0)
        assert healthy._sock.fileno() == old_fd  # type: ignore[union-attr]  (the number is reused: the case)
        assert await within(healthy.have(1, manifest.num_chunks), 5.0) == frozenset(range(manifest.num_chunks))
        waiting.cancel()  # the pull ends: the old wait's clean-up must leave the new socket alone
        await asyncio.gather(waiting, return_exceptions=True)
        assert await within(healthy.have(1, manifest.num_chunks), 5.0) == frozenset(range(manifest.num_chunks))
        await healthy.close()
    finally:
        await server.close()
        frozen.close()


def test_a_connection_closed_under_a_waiting_read_leaves_the_next_socket_working() -> None:
    asyncio.run(_closed_under_a_wait_then_reused())
