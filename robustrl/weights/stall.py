"""How long one chunk's transfer may take: a source that stops sending, or only trickles, is
dropped (a pull takes the chunk from another source).

A chunk's bytes are bounded by a gap with no byte arriving (``until_stalled``), not by their total
time, and by a floor on the source's rate (``chunk_limit_s``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from robustrl.aio import cancel_and_wait

T = TypeVar("T")

PROGRESS_CHECKS = 4
"""A chunk's progress is looked at this many times per stall timeout: a source that stops sending
is dropped at most a quarter of the timeout late."""
SLOW_SOURCE_BYTES_PER_S = 1024 * 1024
"""Slowest rate at which a source may send one chunk: beyond ``stall_s + nbytes / this`` it is
dropped like a stalled one (a throttled relay that still trickles bytes held its chunk until the
whole pull timed out, while the publisher or another relay could have sent it)."""


def chunk_limit_s(stall_s: float, nbytes: int) -> float:
    """Longest a source may take to send one chunk of ``nbytes`` (``until_stalled``'s ``limit_s``)."""
    return stall_s + nbytes / SLOW_SOURCE_BYTES_PER_S


async def until_stalled(aw: Awaitable[T], progress: Callable[[], int], stall_s: float,
                        limit_s: float | None = None) -> T:
    """``await aw``, raising TimeoutError once ``progress()`` (bytes received) has not grown for
    ``stall_s`` (counted from the start until the first byte).

    A chunk's bytes are bounded by a gap without progress, not by their total time: a 64 MiB chunk
    on a 100 Mbit/s link takes 5.4 s and its source is healthy, while a frozen source sends
    nothing and is dropped as soon as before. (The UCX client counts a chunk's bytes one message
    at a time, ``ucx.PAYLOAD_SLICE``: a chunk of one slice or less counts once all is in.)
    ``limit_s`` bounds the whole chunk too (``chunk_limit_s``: a source slower than
    ``SLOW_SOURCE_BYTES_PER_S`` that still trickles).
    """
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(aw)
    seen, since = progress(), loop.time()
    end = None if limit_s is None else since + limit_s
    try:
        while True:
            if end is not None and loop.time() >= end:
                raise TimeoutError(f"slower than {limit_s:.1f} s for one chunk")
            left = since + stall_s - loop.time()
            if end is not None:
                left = min(left, end - loop.time())
            done, _ = await asyncio.wait({task}, timeout=max(0.0, min(left, stall_s / PROGRESS_CHECKS)))
            if done:
                return task.result()
            now = progress()
            if now != seen:
                seen, since = now, loop.time()
            elif loop.time() - since >= stall_s:
                raise TimeoutError(f"no bytes for {stall_s:.1f} s")
    finally:
        if not task.done():  # timed out or cancelled: stop reading before the caller closes the client
            await cancel_and_wait(task, stall_s)

