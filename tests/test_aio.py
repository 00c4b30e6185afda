"""Cancellation-safe waits (``robustrl.aio``): the request manager's loops wait on an event that
is set often; a cancellation landing as that event completes must still end the loop."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from robustrl.aio import cancel_and_wait, wait_event, within


async def _wait_for(ev: asyncio.Event, timeout_s: float) -> bool:  # the code before robustrl.aio
    try:
        await asyncio.wait_for(ev.wait(), timeout_s)
    except TimeoutError:
        pass
    return ev.is_set()


async def _cancel_as_the_event_completes(waiter: Callable[[asyncio.Event, float], Awaitable[bool]]) -> bool:
    """A loop waiting on an event; the event is set and, once its wait has completed but before
    the loop ran on, the loop's task is cancelled. Returns whether the task ended cancelled."""
    ev = asyncio.Event()

    async def loop() -> None:
        while True:
            ev.clear()
            await waiter(ev, 30.0)

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)  # one loop step (the interleaving under test): the loop is waiting
    ev.set()
    await asyncio.sleep(0)  # one step more: the wait itself has completed; the loop has not run on yet
    task.cancel()
    await asyncio.wait({task}, timeout=2.0)
    if not task.done():
        task.cancel()  # clean up (a second cancellation ends it)
        await asyncio.wait({task}, timeout=2.0)
        return False
    return task.cancelled()


def test_a_cancellation_as_the_event_completes_ends_the_loop() -> None:
    # The scenario is real: Python 3.11's wait_for loses this cancellation (the loop runs on).
    assert asyncio.run(_cancel_as_the_event_completes(_wait_for)) is False
    assert asyncio.run(_cancel_as_the_event_completes(wait_event)) is True


def test_wait_event_and_within_time_out_and_answer() -> None:
    async def go() -> None:
        ev = asyncio.Event()
        assert await wait_event(ev, 0.01) is False
        ev.set()
        assert await wait_event(ev, 0.0) is True
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        with pytest.raises(TimeoutError):
            await within(asyncio.shield(fut), 0.01)
        assert not fut.cancelled()  # shielded: the pending reply is still awaited elsewhere
        fut.set_result(7)
        assert await within(fut, 1.0) == 7

    asyncio.run(go())


def test_cancel_and_wait_cancels_again_and_is_bounded() -> None:
    async def go() -> None:
        swallowed = 0
        blocked = asyncio.Event()

        async def stubborn_once() -> None:
            nonlocal swallowed
            try:
                blocked.set()
                await asyncio.sleep(30)  # stands for a long wait: only a cancellation ends it
            except asyncio.CancelledError:
                swallowed += 1  # swallowed once, as the lost cancellation above
            await asyncio.sleep(30)  # stands for a long wait: only a cancellation ends it

        task = asyncio.create_task(stubborn_once())
        await within(blocked.wait(), 2.0)  # inside its try: the first cancellation is swallowed
        assert await cancel_and_wait(task, 0.2) is True and task.cancelled() and swallowed == 1

        held = True
        swallowing = asyncio.Event()

        async def never() -> None:  # swallows every cancellation while held
            while True:
                try:
                    swallowing.set()
                    await asyncio.sleep(30)  # stands for a long wait: only a cancellation ends it
                except asyncio.CancelledError:
                    if not held:
                        raise

        task = asyncio.create_task(never())
        await within(swallowing.wait(), 2.0)  # inside its try: every cancellation is swallowed
        loop = asyncio.get_running_loop()
        began = loop.time()
        assert await cancel_and_wait(task, 0.1, attempts=3) is False
        assert loop.time() - began < 2.0  # bounded: the caller goes on
        held = False
        assert await cancel_and_wait(task, 1.0) is True
        assert await cancel_and_wait(None, 0.1) is True

        async def fails() -> None:
            raise RuntimeError("boom")

        task = asyncio.create_task(fails())
        await asyncio.wait({task}, timeout=2.0)
        assert task.done() and not task.cancelled()  # it has failed already
        assert await cancel_and_wait(task, 0.1) is True  # its error is not raised here

    asyncio.run(go())


def test_no_code_of_the_project_waits_with_asyncio_wait_for() -> None:
    """``asyncio.wait_for`` loses a cancellation that lands as its wait completes (on Python 3.11;
    ``test_a_cancellation_as_the_event_completes_ends_the_loop`` shows it with the code before
    ``robustrl.aio``): a task cancelled there runs on, and whoever stops it waits for ever (a CI
    teardown, a replica's stop). Every wait in the product goes through ``within``. Read from the
    source's syntax trees, so a new use anywhere fails here, not in a rare hang."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    found = []
    for path in sorted([*(root / "robustrl").rglob("*.py"), *(root / "services").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            call = node.func if isinstance(node, ast.Call) else None
            if isinstance(call, ast.Attribute) and call.attr == "wait_for" and isinstance(call.value, ast.Name) \
                    and call.value.id == "asyncio":
                found.append(f"{path.relative_to(root)}:{node.lineno}")
            if isinstance(node, ast.ImportFrom) and node.module == "asyncio" and any(
                    a.name == "wait_for" for a in node.names):
                found.append(f"{path.relative_to(root)}:{node.lineno} (imported)")
    assert found == [], f"asyncio.wait_for used at {found}; use robustrl.aio.within"
