"""The local stack: embedded infrastructure plus the control-plane services as processes.

``robustrl up`` / ``robustrl demo``, the tests and the benchmarks all start RobustRL through
:class:`Stack`, so they exercise the same processes a user runs.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from robustrl.config import Settings
from robustrl.errors import LaunchError
from robustrl.infra.embedded import EmbeddedInfra

SERVICES = ("controller", "detector", "request_manager")
READY_TIMEOUT_S = 60.0
STACK_FILE = "stack.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Stack:
    """Infra (embedded unless ``external`` settings are given) + controller, detector, request manager."""

    def __init__(self, run_dir: Path | str, external: Settings | None = None, api_port: int = 0,
                 extra_env: dict[str, str] | None = None, services: tuple[str, ...] = SERVICES) -> None:
        self.services = services
        self.run_dir = Path(run_dir).resolve()
        self.external = external
        self.api_port = api_port
        self.extra_env = extra_env or {}
        self.infra: EmbeddedInfra | None = None
        self.settings: Settings | None = None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def api_url(self) -> str:
        assert self.settings
        return f"http://{self.settings.api_host}:{self.settings.api_port}"

    def start(self, detach: bool = False) -> Settings:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        if self.external is None:
            self.infra = EmbeddedInfra(self.run_dir / "infra")
            base = self.infra.start()
        else:
            base = self.external
        token = base.api_token or secrets.token_urlsafe(24)
        self.settings = base.model_copy(update={
            "api_token": token, "api_port": self.api_port or _free_port(), "run_dir": str(self.run_dir)})
        env = {**os.environ, **self.settings.to_env(), **self.extra_env}
        try:
            for name in self.services:
                self.start_service(name, env)
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        self._write_state()
        return self.settings

    def start_service(self, name: str, env: dict[str, str] | None = None) -> None:
        assert self.settings
        env = env or {**os.environ, **self.settings.to_env(), **self.extra_env}
        log = open(self.run_dir / "logs" / f"{name}.log", "ab")  # noqa: SIM115 - handed to the child
        try:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", f"robustrl.services.{name}"], env=env, stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise LaunchError(f"{name} exited with {proc.returncode}; see {self.run_dir}/logs/{name}.log",
                                      member=name)
            try:
                if httpx.get(f"{self.api_url}/healthz", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)  # polling a process that is starting; bounded by the deadline
        raise LaunchError(f"controller not ready after {timeout_s:.0f}s; see {self.run_dir}/logs/controller.log")

    def detach(self) -> None:
        """Leave everything running after this process exits (``robustrl up``)."""
        if self.infra:
            atexit.unregister(self.infra.stop)

    def kill_service(self, name: str) -> None:
        proc = self.procs.get(name)
        if proc and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop services (controller first, so it stops its members), then the infra. Idempotent."""
        for name in list(self.procs):
            proc = self.procs.get(name)
            if proc and proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(grace_s)
                except (subprocess.TimeoutExpired, ProcessLookupError):
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    proc.wait(5)
        self.procs.clear()
        if self.infra:
            self.infra.stop()
            self.infra = None
        (self.run_dir / STACK_FILE).unlink(missing_ok=True)

    def _write_state(self) -> None:
        assert self.settings
        path = self.run_dir / STACK_FILE
        path.write_text(json.dumps({"api_url": self.api_url, "token": self.settings.api_token,
                                    "pids": {n: p.pid for n, p in self.procs.items()}}))
        path.chmod(0o600)

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_detached(run_dir: Path | str) -> list[str]:
    """``robustrl down``: stop services and infra recorded under ``run_dir``."""
    run_dir = Path(run_dir).resolve()
    stopped = []
    path = run_dir / STACK_FILE
    if path.exists():
        for name, pid in json.loads(path.read_text()).get("pids", {}).items():
            try:
                os.killpg(pid, signal.SIGTERM)
                stopped.append(name)
            except (ProcessLookupError, PermissionError):
                pass
        path.unlink()
    if (run_dir / "infra").exists():
        try:
            EmbeddedInfra.load(run_dir / "infra").stop()
            stopped.append("infra")
        except Exception:
            pass
    return stopped
