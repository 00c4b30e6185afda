"""asyncio helpers that never lose a cancellation.

On Python 3.11, ``asyncio.wait_for(aw, timeout)`` returns ``aw``'s result when the task is
cancelled in the moment ``aw`` completes: the cancellation is lost and the caller runs on. A loop
that waits on an event which is set often (the request manager's "something changed") then
survives its own cancellation, and whoever awaits it after cancelling waits forever (seen: the
request manager's ``stop`` of a job never returned, and every later control message on that
subscription waited behind it). ``asyncio.timeout`` (3.11+) accounts for cancellations and has no
such window; these helpers use it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until ``event`` is set or ``timeout_s`` passed; True if it is set."""
    try:
        async with asyncio.timeout(max(0.0, timeout_s)):
            await event.wait()
    except TimeoutError:
        return event.is_set()
    return True


async def within(aw: Awaitable[T], timeout_s: float, what: str = "") -> T:
    """``await aw`` for at most ``timeout_s`` (``TimeoutError`` after), cancellation-safe. With
    ``what``, the ``TimeoutError`` of the bound names it ("<what> got no answer within <t>s"):
    asyncio's own has no message, and a job's failure reason recorded from one was empty (suite51)."""
    try:
        async with asyncio.timeout(max(0.0, timeout_s)) as bound:
            return await aw
    except TimeoutError as exc:
        if what and bound.expired():
            raise TimeoutError(f"{what} got no answer within {timeout_s:g}s") from exc
        raise


async def cancel_and_wait(task: asyncio.Task[object] | None, wait_s: float, attempts: int = 3) -> bool:
    """Cancel ``task`` and wait up to ``wait_s`` for it to end, cancelling it again each time it
    is still running (a cancellation swallowed by the code it runs). Never raises what the task
    raised. Returns whether it ended; the caller decides what a task that did not end means."""
    if task is None:
        return True
    for _ in range(attempts):
        if task.done():
            break
        task.cancel()
        await asyncio.wait({task}, timeout=wait_s)
    if task.done() and not task.cancelled():
        task.exception()  # retrieved: no "never retrieved" warning
    return task.done()
