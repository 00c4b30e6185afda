"""A controller to attack through its REST API: the real ``Controller`` and ``create_app``
served by uvicorn on a free port, on private NATS / Redis / S3 servers, with a launcher that
records members instead of starting processes.

Why a ledger launcher: a fuzzer that gets a valid job spec accepted (201) would otherwise start
up to 64 trainer workers and 64 rollout replicas per request on a 2-core machine; the REST
surface, the controller's bookkeeping, the event log and the job registry are all real. Why
private servers: the session's request manager and detector would otherwise adopt the fuzzed
jobs (a fuzzed spec may ask for 4096 x 256 episodes per step).

Used by ``tests/test_api_input.py``, ``tests/test_api_fuzz.py`` and ``bench/fuzz.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from support import eventually_async
from robustrl.services.controller.api import create_app
from robustrl.services.controller.runtime import Controller

from robustrl.bus import Bus
from robustrl.config import Settings
from robustrl.errors import LaunchError
from robustrl.infra.embedded import EmbeddedInfra
from robustrl.launcher.base import ExitInfo, Launcher, MemberSpec, MemberState
from robustrl.storage.redis_stores import connect

SERVE_START_TIMEOUT_S = 30.0
SERVE_STOP_TIMEOUT_S = 30.0
TOKEN = "rest-fuzz-token"
LEASE_TTL_S = 60.0
"""The leader lease of the controller under test: long, so a loaded machine cannot make it lapse
(a standby controller refuses every submission)."""


class LedgerLauncher(Launcher):
    """Remembers which members the controller started and in which state; runs nothing."""

    def __init__(self) -> None:
        self.states: dict[str, MemberState] = {}
        self.started: list[MemberSpec] = []
        self._pids = itertools.count(1_000_000)
        self._pid: dict[str, int] = {}
        self.gate: threading.Event | None = None
        """Set to a cleared event: every start waits for it (a slow launcher: a Ray placement)."""
        self.refuse: str | None = None
        """A start whose member id contains this raises LaunchError (once past the gate)."""

    def start(self, spec: MemberSpec) -> None:
        gate = self.gate
        if gate is not None:
            gate.wait(60)
        if self.refuse is not None and self.refuse in spec.member_id:
            raise LaunchError(f"no node can take {spec.member_id} (test)", member=spec.member_id)
        self.started.append(spec)
        self.states[spec.member_id] = MemberState.RUNNING
        self._pid[spec.member_id] = next(self._pids)

    def stop(self, member_id: str, grace_s: float = 2.0) -> None:
        if member_id in self.states:
            self.states[member_id] = MemberState.STOPPED

    def kill(self, member_id: str, expected: bool = False) -> None:
        if member_id in self.states:
            self.states[member_id] = MemberState.EXITED

    def suspend(self, member_id: str) -> None:
        if self.states.get(member_id) == MemberState.RUNNING:
            self.states[member_id] = MemberState.SUSPENDED

    def resume(self, member_id: str) -> None:
        if self.states.get(member_id) == MemberState.SUSPENDED:
            self.states[member_id] = MemberState.RUNNING

    def poll(self) -> list[ExitInfo]:
        return []  # nothing runs, so nothing exits: fuzzed faults do not cascade into recoveries

    def state(self, member_id: str) -> MemberState | None:
        return self.states.get(member_id)

    def pid(self, member_id: str) -> int | None:
        return self._pid.get(member_id)


@dataclass
class ControllerTarget:
    base_url: str
    token: str
    settings: Settings
    controller: Controller
    launcher: LedgerLauncher

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


@contextmanager
def serve_controller(run_dir: Path, token: str = TOKEN) -> Iterator[ControllerTarget]:
    """Start private infra and the controller's REST API; yield where it listens; stop both."""
    infra = EmbeddedInfra(Path(run_dir) / "infra")
    settings = infra.start().model_copy(update={"api_token": token, "run_dir": str(run_dir)})
    ready = threading.Event()
    box: dict[str, object] = {}

    async def main() -> None:
        bus = await Bus.connect(settings.nats_url, "controller", role="controller")
        redis = connect(settings.redis_url)
        launcher = LedgerLauncher()
        controller = Controller(bus, redis, launcher, settings, lease_ttl_s=LEASE_TTL_S)
        await controller.start()
        await controller.wait_leading(SERVE_START_TIMEOUT_S)
        server = uvicorn.Server(uvicorn.Config(create_app(controller, token), host="127.0.0.1", port=0,
                                               log_level="warning", lifespan="off"))
        server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        box.update(server=server, controller=controller, launcher=launcher, loop=asyncio.get_running_loop())
        serving = asyncio.create_task(server.serve())
        try:
            await eventually_async(lambda: server.started or serving.done(), timeout=SERVE_START_TIMEOUT_S,
                                   interval=0.01, what="uvicorn started")
            box["port"] = server.servers[0].sockets[0].getsockname()[1] if server.started else None
            ready.set()
            await serving
        finally:
            ready.set()
            await controller.close()
            await bus.close()
            await redis.aclose()

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - reported to the caller through box
            box["error"] = exc
            ready.set()

    thread = threading.Thread(target=run, name="rest-target", daemon=True)
    thread.start()
    try:
        if not ready.wait(SERVE_START_TIMEOUT_S) or not box.get("port"):
            raise RuntimeError(f"controller API did not start within {SERVE_START_TIMEOUT_S:.0f}s: "
                               f"{box.get('error')!r}")
        yield ControllerTarget(base_url=f"http://127.0.0.1:{box['port']}", token=token, settings=settings,
                               controller=box["controller"], launcher=box["launcher"])  # type: ignore[arg-type]
    finally:
        server = box.get("server")
        if server is not None:
            server.should_exit = True  # type: ignore[attr-defined]
        thread.join(SERVE_STOP_TIMEOUT_S)
        infra.stop()
