"""Embedded infrastructure: NATS (JetStream), a Redis-protocol server and an S3 server as processes.

``EmbeddedInfra(run_dir).start()`` runs ``nats-server -js``, ``redis-server``/``valkey-server``
and ``rclone serve s3`` on free loopback ports, each with random credentials, data under
``run_dir`` and logs in ``run_dir/logs/``. It returns the ``Settings`` that point at them and
writes them to ``run_dir/infra.json`` (mode 0600) so ``robustrl down`` can later stop the same
processes with ``EmbeddedInfra.load(run_dir).stop()``.

This module owns the lifecycle (spawn, readiness wait, stop, ``infra.json``); what each server
needs (binary, config, readiness probe) lives in ``robustrl.infra.binaries``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType

import psutil

from robustrl.config import Settings
from robustrl.errors import ConfigError, LaunchError
from robustrl.infra import binaries, credentials
from robustrl.procs import is_running, start_time

START_TIMEOUT_S = 20.0
"""How long one server may take to answer its protocol-level ping after being spawned."""
STOP_GRACE_S = 5.0
"""How long a server gets to exit after SIGTERM before it is sent SIGKILL."""
PORT_ATTEMPTS = 3
"""Spawns per server: a free port picked by binding port 0 can be taken before the server binds it."""
_POLL_S = 0.02
_LOG_TAIL = 2000

INFRA_FILE = "infra.json"
CREDENTIALS_FILE = "credentials.json"


@dataclass(frozen=True)
class ProcessRecord:
    """A started server, as written to ``infra.json``."""

    name: str
    binary: str
    pid: int
    create_time: float  # seconds since boot (robustrl.procs), not wall-clock time
    log: str


def _log_tail(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-_LOG_TAIL:].decode(errors="replace")


class EmbeddedInfra:
    """NATS + Redis-protocol server + S3 server as local processes under one run directory.

    Use as a context manager (``with EmbeddedInfra(path) as settings``) or call ``start()`` /
    ``stop()``. ``stop()`` is idempotent and also runs at interpreter exit.
    """

    def __init__(self, run_dir: Path | str, *, bucket: str = "robustrl",
                 start_timeout_s: float = START_TIMEOUT_S, host: str = binaries.LOOPBACK) -> None:
        self.run_dir = Path(run_dir).resolve()
        self.host = host
        """Where the servers listen: loopback, or an address hosts elsewhere reach (a testbed's
        gateway, ``robustrl.testbed``); one address, never every interface."""
        self.bucket = bucket
        self.start_timeout_s = start_timeout_s
        self.settings: Settings | None = None
        self.records: list[ProcessRecord] = []
        self._popens: dict[int, subprocess.Popen[bytes]] = {}
        self._services: dict[str, binaries.Service] = {}
        self._atexit_registered = False
        self.credentials: credentials.Credentials | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> Settings:
        """Start the three servers, wait until each answers, and return their Settings.

        Raises:
            LaunchError: a binary is missing, a server exited or did not become ready in time
                (the message names the binary and its log), or infra is already running here.
        """
        if self.settings is not None:
            return self.settings
        self._refuse_if_running()
        for sub in ("logs", "conf"):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        (self.run_dir / "conf").chmod(0o700)
        # One user per role on each server, limited to what the role owns; the Settings returned
        # are the operator's (unrestricted), the roles' are in conf/credentials.json (0600).
        self.credentials = credentials.generate()
        creds_file = self.run_dir / "conf" / CREDENTIALS_FILE
        self.credentials.save(creds_file)
        nats = binaries.NatsServer(self.run_dir, binaries.nats_server(), self.credentials)
        redis = binaries.RedisServer(self.run_dir, binaries.redis_server(), self.credentials)
        s3 = binaries.S3Server(self.run_dir, binaries.rclone(), self.bucket, self.credentials)
        services: list[binaries.Service] = [nats, redis, s3]
        for svc in services:
            svc.host = self.host
        self._services = {svc.name: svc for svc in services}
        self._register_atexit()
        try:
            # Spawn all first, then wait: the servers start in parallel.
            pending = {svc.name: self._spawn(svc) for svc in services}
            for svc in services:
                self._wait_ready(svc, pending[svc.name])
        except BaseException:
            self.stop()
            raise
        self.settings = Settings(
            nats_url=nats.url, redis_url=redis.url, s3_endpoint=f"{self.host}:{s3.port}",
            s3_access_key=s3.access_key, s3_secret_key=s3.secret_key, s3_bucket=self.bucket,
            s3_secure=False, run_dir=str(self.run_dir), credentials_file=str(creds_file),
        )
        self._write_infra_file()
        return self.settings

    def stop(self) -> None:
        """Stop every server started (or loaded) by this object. Safe to call twice."""
        for record in reversed(self.records):
            self._terminate(record)
        if self.records:
            infra_file = self.run_dir / INFRA_FILE
            with contextlib.suppress(FileNotFoundError, OSError, ValueError):
                on_disk = json.loads(infra_file.read_text())
                if {p["pid"] for p in on_disk.get("processes", [])} <= {r.pid for r in self.records}:
                    infra_file.unlink()
        self.records = []
        self._popens.clear()
        self.settings = None
        if self._atexit_registered:
            atexit.unregister(self.stop)
            self._atexit_registered = False

    def restart(self, name: str, down_s: float = 0.0) -> float:
        """Stop one server (SIGTERM, so it flushes its data) and start it again on the SAME port,
        credentials and data directory: clients reconnect to the same URL and find their state
        (Redis keys from the AOF, JetStream streams from the store dir, S3 objects on disk).

        Args:
            name: ``nats``, ``redis`` or ``s3``.
            down_s: keep it stopped this long before starting it again (an outage of that length).
        Returns:
            Seconds the server was unavailable (stop + start until it answers its ping).
        Raises:
            LaunchError: not started by this object (``load()`` cannot restart), unknown
                name, or the server did not come back on its port.
        """
        svc = self._services.get(name)
        record = next((r for r in self.records if r.name == name), None)
        if svc is None or record is None:
            raise LaunchError(f"cannot restart {name!r}: not a server this object started "
                              f"(have {sorted(self._services)})", member=name)
        t0 = time.monotonic()
        self._terminate(record)
        self.records = [r for r in self.records if r.pid != record.pid]
        self._popens.pop(record.pid, None)
        if down_s > 0:
            time.sleep(down_s)  # the outage itself (fault injection), not a wait for a condition
        popen = self._spawn(svc, prepare=False)
        deadline = time.monotonic() + self.start_timeout_s
        while not svc.ready():
            if popen.poll() is not None or time.monotonic() > deadline:
                raise LaunchError(f"{svc.binary.name} did not come back on its port after a restart; "
                                  f"log {svc.log}:\n{_log_tail(svc.log)}", member=name)
            time.sleep(_POLL_S)
        self._write_infra_file()
        return time.monotonic() - t0

    def __enter__(self) -> Settings:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    @classmethod
    def load(cls, run_dir: Path | str) -> EmbeddedInfra:
        """Attach to infra started earlier (maybe by another process) from ``run_dir/infra.json``.

        The result's ``settings`` are the running endpoints and ``stop()`` terminates them.

        Raises:
            ConfigError: there is no readable ``infra.json`` in ``run_dir``.
        """
        infra = cls(run_dir)
        path = infra.run_dir / INFRA_FILE
        try:
            raw = json.loads(path.read_text())
            infra.settings = Settings.model_validate(raw["settings"])
            infra.records = [ProcessRecord(**p) for p in raw["processes"]]
            infra.bucket = infra.settings.s3_bucket
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"no embedded infra recorded in {path}: {exc}", field="run_dir") from exc
        return infra

    def alive(self) -> dict[str, bool]:
        """Whether each recorded server process is still the one that was started."""
        return {r.name: self._live_process(r) is not None for r in self.records}

    # -- internals ------------------------------------------------------------------------------

    def _refuse_if_running(self) -> None:
        if not (self.run_dir / INFRA_FILE).exists():
            return
        try:
            previous = EmbeddedInfra.load(self.run_dir)
        except ConfigError:
            return
        if any(previous.alive().values()):
            raise LaunchError(f"embedded infra already running in {self.run_dir}; stop it first "
                              "(robustrl down)", member="infra")

    def _register_atexit(self) -> None:
        if not self._atexit_registered:
            atexit.register(self.stop)
            self._atexit_registered = True

    def _spawn(self, svc: binaries.Service, prepare: bool = True) -> subprocess.Popen[bytes]:
        if prepare:  # a restart keeps the port and config of the first start
            svc.prepare()
        argv, extra_env = svc.command()
        env = dict(os.environ)
        env.update(extra_env)
        with open(svc.log, "ab") as log:
            try:
                popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=env, cwd=self.run_dir, start_new_session=True)
            except OSError as exc:
                raise LaunchError(f"cannot run {svc.binary.path}: {exc}", member=svc.name) from exc
        create_time = start_time(popen.pid) or 0.0
        self.records.append(ProcessRecord(svc.name, str(svc.binary.path), popen.pid, create_time,
                                          str(svc.log)))
        self._popens[popen.pid] = popen
        return popen

    def _wait_ready(self, svc: binaries.Service, popen: subprocess.Popen[bytes]) -> None:
        for attempt in range(1, PORT_ATTEMPTS + 1):
            deadline = time.monotonic() + self.start_timeout_s
            while time.monotonic() < deadline:
                if popen.poll() is not None:
                    break
                if svc.ready():
                    return
                time.sleep(_POLL_S)
            else:
                raise LaunchError(
                    f"{svc.binary.name} ({svc.binary.path}) not ready after {self.start_timeout_s:.0f} s; "
                    f"log {svc.log}:\n{_log_tail(svc.log)}", member=svc.name)
            # The process exited: most likely its port was taken between probe and bind. Retry.
            self.records = [r for r in self.records if r.pid != popen.pid]
            self._popens.pop(popen.pid, None)
            if attempt == PORT_ATTEMPTS:
                raise LaunchError(
                    f"{svc.binary.name} ({svc.binary.path}) exited with code {popen.returncode}; "
                    f"log {svc.log}:\n{_log_tail(svc.log)}", member=svc.name)
            popen = self._spawn(svc)

    def _write_infra_file(self) -> None:
        assert self.settings is not None
        payload = {
            "settings": self.settings.model_dump(),
            "processes": [asdict(r) for r in self.records],
            "started_at": time.time(),
        }
        binaries.write_private(self.run_dir / INFRA_FILE, json.dumps(payload, indent=2))

    @staticmethod
    def _live_process(record: ProcessRecord) -> psutil.Process | None:
        """The process if ``record.pid`` still names the process we started (pids get reused;
        its start is judged by ``robustrl.procs``, which no clock step moves)."""
        try:
            proc = psutil.Process(record.pid)  # before the check: it names the process checked, or an older one
        except psutil.Error:
            return None
        return proc if is_running(record.pid, record.create_time or None) else None

    def _terminate(self, record: ProcessRecord) -> None:
        popen = self._popens.get(record.pid)
        if popen is not None and popen.poll() is not None:
            return
        if popen is None and self._live_process(record) is None:
            return
        # Each server leads its own process group (start_new_session), so killpg reaches any
        # helpers it forked and nothing of ours.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(record.pid, signal.SIGTERM)
        if self._wait_exit(record, popen, STOP_GRACE_S):
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(record.pid, signal.SIGKILL)
        self._wait_exit(record, popen, STOP_GRACE_S)

    def _wait_exit(self, record: ProcessRecord, popen: subprocess.Popen[bytes] | None,
                   timeout: float) -> bool:
        if popen is not None:
            try:
                popen.wait(timeout)
                return True
            except subprocess.TimeoutExpired:
                return False
        proc = self._live_process(record)
        if proc is None:
            return True
        try:
            proc.wait(timeout)
            return True
        except psutil.TimeoutExpired:
            return False
        except psutil.Error:
            return True
