"""Test helpers that test modules import (``from support import eventually``).

Tests never sleep to wait for something: they poll a condition with a bounded
``eventually`` (or ``eventually_async``) that fails with the last observed problem.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_INTERVAL_S = 0.02


def _fail(what: str, timeout: float, last: object) -> AssertionError:
    return AssertionError(f"{what or 'condition'} not met after {timeout:.2f} s (last: {last!r})")


def eventually(fn: Callable[[], T], *, timeout: float = DEFAULT_TIMEOUT_S,
               interval: float = DEFAULT_INTERVAL_S,
               retry_on: tuple[type[BaseException], ...] = (AssertionError,), what: str = "") -> T:
    """Call ``fn`` until it returns a truthy value without raising one of ``retry_on``.

    Returns:
        The first truthy value.
    Raises:
        AssertionError: still falsy / failing after ``timeout`` seconds (chained to the last error).
    """
    deadline = time.monotonic() + timeout
    last: object = None
    last_exc: BaseException | None = None
    while True:
        try:
            value = fn()
            if value:
                return value
            last, last_exc = value, None
        except retry_on as exc:
            last, last_exc = exc, exc
        if time.monotonic() >= deadline:
            raise _fail(what, timeout, last) from last_exc
        time.sleep(interval)


async def eventually_async(fn: Callable[[], T | Awaitable[T]], *, timeout: float = DEFAULT_TIMEOUT_S,
                           interval: float = DEFAULT_INTERVAL_S,
                           retry_on: tuple[type[BaseException], ...] = (AssertionError,),
                           what: str = "") -> T:
    """Async ``eventually``: ``fn`` may be a plain or a coroutine function; polls with ``asyncio.sleep``."""
    deadline = time.monotonic() + timeout
    last: object = None
    last_exc: BaseException | None = None
    while True:
        try:
            value = fn()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return value  # type: ignore[return-value]
            last, last_exc = value, None
        except retry_on as exc:
            last, last_exc = exc, exc
        if time.monotonic() >= deadline:
            raise _fail(what, timeout, last) from last_exc
        await asyncio.sleep(interval)
