"""A TCP relay in front of a real server that holds back client writes until told: a command sent
by a client, then run by the server late, after the client gave up on it (its sender cancelled,
its connection closed), or run only after another client's command. What the client wrote is
delivered whole, in order, before the relay closes the server's side, as the kernel would deliver
bytes already sent."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from urllib.parse import urlsplit, urlunsplit


class Hold:
    """The first client chunk (of any connection) that ``matches`` waits for ``release``: ``held``
    is set once one waits, ``answered`` once the server replied after it was delivered."""

    def __init__(self, matches: Callable[[bytes], bool]) -> None:
        self.matches = matches
        self.held = asyncio.Event()
        self.released = asyncio.Event()
        self.answered = asyncio.Event()

    def release(self) -> None:
        self.released.set()


class HoldingRelay:
    """Relays each connection to ``upstream`` (host, port), holding the chunks its holds match."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.holds: list[Hold] = []
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def hold(self, matches: Callable[[bytes], bool]) -> Hold:
        self.holds.append(h := Hold(matches))
        return h

    def url(self, url: str) -> str:
        """``url`` with its host and port this relay's."""
        parts = urlsplit(url)
        auth = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
        return urlunsplit(parts._replace(netloc=f"{auth}127.0.0.1:{self.port}"))

    async def __aenter__(self) -> HoldingRelay:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for h in self.holds:
            h.release()
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        server_r, server_w = await asyncio.open_connection(*self.upstream)
        delivered: list[Hold] = []  # this connection's held chunks sent on, their answers awaited

        async def up() -> None:
            while data := await client_r.read(65536):
                hold = next((h for h in self.holds if not h.held.is_set() and h.matches(data)), None)
                if hold is not None:
                    hold.held.set()
                    await hold.released.wait()
                    delivered.append(hold)
                server_w.write(data)
                await server_w.drain()

        async def down() -> None:
            while data := await server_r.read(65536):
                for hold in delivered:
                    hold.answered.set()
                delivered.clear()
                with contextlib.suppress(ConnectionError):
                    client_w.write(data)
                    await client_w.drain()

        downward = asyncio.create_task(down())
        try:
            with contextlib.suppress(ConnectionError):
                await up()
            # the client is gone: the server still answers what it was sent
            pending = [*delivered]  # (down() clears the list as answers come)
            for hold in pending:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(hold.answered.wait(), 10)
        finally:
            downward.cancel()
            for w in (server_w, client_w):
                w.close()
            self._tasks.discard(task)
