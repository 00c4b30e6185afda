"""The local stack: embedded infrastructure plus the control-plane services as processes.

``robustrl up`` / ``robustrl demo``, the tests and the benchmarks all start RobustRL through
:class:`Stack`, so they exercise the same processes a user runs.

On a testbed (``Stack(run_dir, testbed=tb, placement={"trainer": ["h0"], "rollout": ["h1", "h2"]})``)
the infra and the control plane run in the root namespace, the embedded servers listening on the
testbed's gateway address (the only address the hosts reach them at; loopback otherwise), and
the controller's launcher starts each member inside its role's hosts
(``robustrl.testbed.placement``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import psutil

from robustrl.config import Settings
from robustrl.errors import ConfigError, LaunchError
from robustrl.health import ENV_PORT
from robustrl.infra import binaries
from robustrl.infra.credentials import service_env
from robustrl.infra.embedded import EmbeddedInfra
from robustrl.ports import free_port
from robustrl.procs import is_running, start_time
from robustrl.supervisor import (
    STOP_GRACE_S,
    RestartPolicy,
    ServiceSpec,
    Supervisor,
    read_restarts,
    write_handover,
)

if TYPE_CHECKING:
    from robustrl.testbed.placement import RolePlacement
    from robustrl.testbed.testbed import Testbed

SERVICES = ("controller", "detector", "request_manager")
READY_TIMEOUT_S = 60.0
STACK_FILE = "stack.json"
RESTART_READY_TIMEOUT_S = 30.0
"""How long ``wait_restarted`` waits for a supervised service to be back."""


class Stack:
    """Infra (embedded unless ``external`` settings are given) + controller, detector, request manager.

    The services run under a :class:`~robustrl.supervisor.Supervisor`: one that exits or stops
    answering its health endpoint is started again (``supervise=False`` turns that off).
    """

    def __init__(self, run_dir: Path | str, external: Settings | None = None, api_port: int = 0,
                 extra_env: dict[str, str] | None = None, services: tuple[str, ...] = SERVICES,
                 supervise: bool = True, policy: RestartPolicy | None = None, controllers: int = 1,
                 testbed: Testbed | None = None, placement: dict[str, list[str]] | None = None,
                 service_extra_env: dict[str, dict[str, str]] | None = None) -> None:
        # A second controller is a hot standby (leader lease): "controller-2", its own API port.
        self.services = services + tuple(f"controller-{i}" for i in range(2, controllers + 1))
        self.run_dir = Path(run_dir).resolve()
        self.external = external
        self.api_port = api_port
        self.extra_env = extra_env or {}
        self.service_extra_env = service_extra_env or {}
        """Environment of one service only (name -> env), over ``extra_env``: e.g. a failpoint armed in
        'controller' and not in its standby 'controller-2', from their first start on."""
        if unknown := sorted(set(self.service_extra_env) - set(self.services)):
            raise ConfigError(f"service_extra_env names services this stack does not run: {unknown}")
        self.testbed = testbed
        self.placement: RolePlacement | None = None
        """Which hosts each role's members run on (``robustrl.testbed.placement``), with a testbed."""
        if testbed is not None:
            from robustrl.testbed.placement import RolePlacement

            # validated now (a bad host name is a ConfigError here, not a member that never starts)
            self.placement = RolePlacement.parse(testbed, placement or {})
            self.extra_env = {**self.placement.to_env(), **self.extra_env}
        elif placement:
            raise LaunchError("a placement needs a testbed (Stack(testbed=...))", member="placement")
        self.supervise = supervise
        self.policy = policy or RestartPolicy()
        self.infra: EmbeddedInfra | None = None
        self.settings: Settings | None = None
        self.supervisor: Supervisor | None = None
        self._stop_supervision = threading.Event()
        self._thread: threading.Thread | None = None
        self._supervisor_pid: int | None = None

    @property
    def api_url(self) -> str:
        assert self.settings
        return f"http://{self.settings.api_host}:{self.settings.api_port}"

    @property
    def procs(self) -> dict[str, subprocess.Popen[bytes]]:
        """The services' current processes (a restart replaces an entry)."""
        if self.supervisor is None:
            return {}
        return {n: p.popen for n, p in self.supervisor.procs.items() if p.popen is not None}

    def pids(self) -> dict[str, int]:
        return self.supervisor.pids() if self.supervisor else {}

    def start(self, detach: bool = False) -> Settings:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        if self.external is None:
            host = self.testbed.gateway if self.testbed is not None else "127.0.0.1"
            self.infra = EmbeddedInfra(self.run_dir / "infra", host=host)
            base = self.infra.start()
        else:
            base = self.external
        token = base.api_token or secrets.token_urlsafe(24)
        self.settings = base.model_copy(update={
            "api_token": token, "api_port": self.api_port or free_port(), "run_dir": str(self.run_dir)})
        env = {**os.environ, **self.settings.to_env(), **self.extra_env}
        self.supervisor = Supervisor(self.run_dir, self._specs(), env, self.policy,
                                     on_change=lambda _pids: self._write_state())
        try:
            # Standby controllers start once the first one leads: started together, any of them
            # may win the lease, and the stack's API (the first one's) would answer 503.
            standbys = [n for n in self.services if n.startswith("controller-")]
            for name in self.services:
                if name not in standbys:
                    self.supervisor.spawn(name)
            self.wait_ready()
            for name in standbys:
                self.supervisor.spawn(name)
                self._wait_serving(name)
        except BaseException:
            self.stop()
            raise
        self._write_state()
        if self.supervise:
            self._thread = threading.Thread(target=self.supervisor.run, args=(self._stop_supervision,),
                                            name="stack-supervisor", daemon=True)
            self._thread.start()
        return self.settings

    def _specs(self) -> list[ServiceSpec]:
        specs = []
        for name in self.services:
            role = role_of(name)
            spec = ServiceSpec(name=name, module=f"robustrl.services.{role}")
            if name == "controller":
                # Its health is its REST API's; a health port in its environment would be
                # inherited by the members it launches.
                spec.health_url = f"{self.api_url}/healthz"
            elif role == "controller":
                port = free_port()
                spec.env = {"ROBUSTRL_API_PORT": str(port)}
                spec.health_url = f"http://{self.settings.api_host if self.settings else '127.0.0.1'}:{port}/healthz"
            else:
                port = free_port()
                spec.env = {ENV_PORT: str(port)}
                spec.health_url = f"http://127.0.0.1:{port}/healthz"
            # Each service holds only its role's credentials (robustrl.infra.credentials).
            assert self.settings is not None
            spec.env = {**service_env(self.settings, role), **spec.env}  # its own port wins
            spec.env.update(self.service_extra_env.get(name, {}))
            specs.append(spec)
        return specs

    def start_service(self, name: str, env: dict[str, str] | None = None) -> None:
        """Start one service now (also one the stack was not started with)."""
        assert self.settings and self.supervisor
        if name not in self.supervisor.specs:
            self.supervisor.specs[name] = ServiceSpec(name=name, module=f"robustrl.services.{name}")
        if env:
            self.supervisor.specs[name].env.update(env)
        # One copy: a supervision round between separate pause/spawn/resume calls could restart
        # the old process's exit as a second copy racing this one for the service's port.
        self.supervisor.start_one(name)
        self._write_state()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        assert self.supervisor
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, rc in self.supervisor.exited().items():
                raise LaunchError(f"{name} exited with {rc}; see {self.run_dir}/logs/{name}.log", member=name)
            try:
                health = httpx.get(f"{self.api_url}/healthz", timeout=1.0)
                # Ready = leading: until it holds the lease (a killed predecessor's lease runs out
                # first) and has restored its jobs, its job routes answer 503. Only the
                # controller's own answer says so (another server on the port is no controller).
                if health.status_code == 200 and health.json().get("leading") is True:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.1)  # polling a process that is starting; bounded by the deadline
        raise LaunchError(f"controller not ready after {timeout_s:.0f}s; see {self.run_dir}/logs/controller.log")

    def _wait_serving(self, name: str, timeout_s: float = READY_TIMEOUT_S) -> None:
        """A standby controller answers its health check (as a standby: not leading)."""
        assert self.supervisor
        url = self.supervisor.specs[name].health_url
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if name in self.supervisor.exited():
                raise LaunchError(f"{name} exited; see {self.run_dir}/logs/{name}.log", member=name)
            try:
                if url and httpx.get(url, timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)  # polling a process that is starting; bounded by the deadline
        raise LaunchError(f"{name} not serving after {timeout_s:.0f}s; see {self.run_dir}/logs/{name}.log")

    def detach(self) -> None:
        """Leave everything running after this process exits (``robustrl up``): the services are
        handed to a detached supervisor process that adopts them by pid."""
        if self.infra:
            atexit.unregister(self.infra.stop)
        if not (self.supervise and self.supervisor and self.settings):
            return
        self._stop_supervision.set()
        if self._thread:
            self._thread.join()
        write_handover(self.run_dir, list(self.supervisor.specs.values()), self.supervisor.pids(), self.policy,
                       self.supervisor.starts())
        env = {**os.environ, **self.settings.to_env(), **self.extra_env}
        with open(self.run_dir / "logs" / "supervisor.log", "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "robustrl.supervisor", str(self.run_dir)], env=env,
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        self._supervisor_pid = proc.pid
        self._write_state()

    # --- faults on the control plane (the chaos harness and the benchmarks use these) ---------

    def kill_service(self, name: str, restart: bool = False) -> None:
        """SIGKILL a service's process group; the supervisor restarts it only when ``restart``."""
        assert self.supervisor
        if not restart:
            self.supervisor.pause(name)
        proc = self.supervisor.procs.get(name)
        if proc and proc.returncode() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            if proc.popen is not None:
                proc.popen.wait(5)

    def crash_service(self, name: str) -> int:
        """Machine loss of a control-plane service: SIGKILL; the supervisor restarts it. Returns the pid hit."""
        pid = self.pids()[name]
        self.kill_service(name, restart=True)
        return pid

    def hang_service(self, name: str, duration_s: float) -> int:
        """SIGSTOP the service for ``duration_s`` then SIGCONT it (in a timer thread). Returns the pid hit.

        If the supervisor meanwhile judged it hung and replaced it, the SIGCONT finds nothing to wake.
        """
        pid = self.pids()[name]
        os.killpg(pid, signal.SIGSTOP)

        def _wake() -> None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGCONT)

        timer = threading.Timer(duration_s, _wake)
        timer.daemon = True
        timer.start()
        return pid

    def restart_infra(self, name: str) -> float:
        """Restart an embedded server (``nats | redis | s3``) on its port and data dir; returns
        how long it was away.

        Raises:
            LaunchError: the stack runs on external servers, which it does not own.
        """
        if self.infra is None:
            raise LaunchError(f"cannot restart {name}: this stack uses external servers", member=name)
        return self.infra.restart(name)

    def restarts(self) -> list[dict[str, object]]:
        """Every supervisor restart so far (from ``logs/supervisor.jsonl``)."""
        return read_restarts(self.run_dir)

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop services (controller first, so it stops its members), then the infra. Idempotent."""
        self._stop_supervision.set()
        if self._thread:
            self._thread.join()
            self._thread = None
        if self.supervisor:
            self.supervisor.stop_all(grace_s=grace_s)
        left = sweep_members(self.run_dir)
        if left:
            print(f"stack {self.run_dir}: killed {len(left)} member process(es) no controller stopped: "
                  f"{left}", file=sys.stderr)
        if self.infra:
            self.infra.stop()
            self.infra = None
        (self.run_dir / STACK_FILE).unlink(missing_ok=True)

    def _write_state(self) -> None:
        assert self.settings
        path = self.run_dir / STACK_FILE
        state = {"api_url": self.api_url, "token": self.settings.api_token, "pids": self.pids(),
                 "starts": self.supervisor.starts() if self.supervisor else {}}
        if self._supervisor_pid:
            state["supervisor_pid"] = self._supervisor_pid
            state["supervisor_start"] = start_time(self._supervisor_pid)
        binaries.write_private(path, json.dumps(state))

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def sweep_members(run_dir: Path | str) -> list[int]:
    """Kill the member processes the local launcher started for this stack that still run after
    its services stopped (a controller killed or frozen before it stopped its members leaves
    them orphaned): each carries ``ROBUSTRL_LAUNCH_MARK``, its pid file under ``run_dir/logs``.
    Returns their pids."""
    from robustrl.launcher.local import LAUNCH_MARK_ENV, marked_processes

    logs = os.path.realpath(Path(run_dir) / "logs") + os.sep
    killed = []
    for proc, env in marked_processes():
        if not os.path.realpath(env[LAUNCH_MARK_ENV]).startswith(logs):
            continue
        try:
            if os.getsid(proc.pid) == proc.pid:
                os.killpg(proc.pid, signal.SIGKILL)  # the member and whatever it started
            else:
                proc.kill()
            killed.append(proc.pid)
        except (psutil.Error, OSError):
            continue
    return killed


def role_of(name: str) -> str:
    """The service a stack entry runs: ``controller-2`` is a second ``controller``."""
    base, _, index = name.rpartition("-")
    return base if base and index.isdigit() else name


def update_pids(run_dir: Path, pids: dict[str, int], starts: dict[str, float | None]) -> None:
    """A detached supervisor records the restarted services' pids for ``robustrl down``, each with
    its start (``Supervisor.starts``): ``down`` signals a recorded pid only while it still names
    that process (the file may be stale: a supervisor that died before it recorded a restart, a
    service given up, a reboot)."""
    path = run_dir / STACK_FILE
    with contextlib.suppress(OSError, ValueError):
        state = json.loads(path.read_text())
        if not isinstance(state, dict):
            state = {}  # damaged: what is running now is what it must say
        state["pids"] = pids
        state["starts"] = starts
        binaries.write_private(path, json.dumps(state))


def stop_detached(run_dir: Path | str) -> list[str]:
    """``robustrl down``: stop services and infra recorded under ``run_dir``."""
    run_dir = Path(run_dir).resolve()
    stopped = []
    path = run_dir / STACK_FILE
    if path.exists():
        state = _read_stack_file(path)
        sup_pid = _pid(state.get("supervisor_pid"))
        # A pid is signalled only while it names the recorded process; a file written before
        # starts were recorded names none, and its pids get SIGTERM but never SIGKILL.
        if sup_pid and _names(sup_pid, state.get("supervisor_start")):
            # The supervisor first, or it would start again what is stopped next.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(sup_pid, signal.SIGTERM)
                _wait_pid_gone(sup_pid, STOP_GRACE_S)
                stopped.append("supervisor")
                if _names(sup_pid, state.get("supervisor_start")):
                    # Past its grace (seen: still alive 20 min after a down whose controller was
                    # frozen, in a full run): killed, as a service past its grace is below.
                    os.kill(sup_pid, signal.SIGKILL)
                    _wait_pid_gone(sup_pid, STOP_GRACE_S)
                    stopped[-1] = "supervisor (killed past its grace)"
        state = _read_stack_file(path)  # the pids of what the supervisor restarted
        starts = state.get("starts")
        signalled: dict[str, tuple[int, float | None]] = {}
        pids = state.get("pids")
        for name, raw_pid in (pids.items() if isinstance(pids, dict) else ()):
            pid = _pid(raw_pid)
            started = starts.get(name) if isinstance(starts, dict) else None
            if pid is None or (isinstance(starts, dict) and started is None):
                continue  # not a pid; or recorded with no start: it was gone when the file was written
            if not _names(pid, started):
                continue  # gone, or the pid is another process's now
            try:
                os.killpg(pid, signal.SIGCONT)  # a frozen service cannot act on SIGTERM
                os.killpg(pid, signal.SIGTERM)
                stopped.append(name)
                signalled[name] = (pid, started)
            except (ProcessLookupError, PermissionError):
                pass
        # The controller stops its members on SIGTERM: give the services their grace, then kill
        # the members no controller stopped (one killed or frozen before ``down`` leaves them).
        deadline = time.monotonic() + STOP_GRACE_S
        for pid, _ in signalled.values():
            _wait_pid_gone(pid, max(0.0, deadline - time.monotonic()))
        for name, (pid, started) in signalled.items():  # past its grace, a service is killed
            if started is not None and _names(pid, started):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                _wait_pid_gone(pid, STOP_GRACE_S)
                stopped.append(f"{name} (killed past its grace)")
        if left := sweep_members(run_dir):
            stopped.append(f"{len(left)} orphaned member(s)")
        path.unlink()
    if (run_dir / "infra").exists():
        try:
            EmbeddedInfra.load(run_dir / "infra").stop()
            stopped.append("infra")
        except Exception:
            pass
    return stopped


def _pid(value: object) -> int | None:
    """A recorded pid, or None: never 0, -1 or 1 (our own group, every process, init)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else None


def _names(pid: int, started: object) -> bool:
    """Whether ``pid`` runs and is the process recorded as started then (None: any); a start that
    is not a number names no process."""
    if started is not None and (not isinstance(started, int | float) or isinstance(started, bool)):
        return False
    return is_running(pid, started)


def _read_stack_file(path: Path) -> dict[str, Any]:
    """``stack.json`` as written by ``up``; a damaged one reads as empty (logged), so that ``down``
    still stops the infra and the members marked as this stack's."""
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        state = exc
    if isinstance(state, dict):
        return state
    print(f"{path} is damaged ({state!r:.200}): its services are not named; stopping the rest", file=sys.stderr)
    return {}


def _wait_pid_gone(pid: int, timeout: float) -> None:
    with contextlib.suppress(psutil.Error):
        psutil.Process(pid).wait(timeout)
