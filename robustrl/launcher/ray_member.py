"""The Ray actor that owns one member process on its node (``robustrl.launcher.ray``).

A member is ``python -m module`` started by this actor on the node Ray placed the actor on. The
actor is detached with ``max_restarts=0``: Ray never restarts it and no driver's exit takes it
down, so only the RobustRL controller decides what happens after a fault. The member process
fate-shares with its actor the other way round: it is started with ``PR_SET_PDEATHSIG`` = SIGKILL
from the thread that waits on it, so an actor that dies (``ray.kill``, its worker killed, its
raylet lost with the node) takes its member with it; a member never runs on unseen, owned by no one.

A warm spare (``RayLauncher.keep_spares``) is the same actor started ahead: ``start_spare`` runs
``python -m robustrl.launcher.spare`` (it imports the member code, then waits for one JSON order on
stdin), and ``assign`` later writes the member's order to it, so the member skips the actor's start
and the imports. ``handoff`` switches a running rollout replica in place to a trainer rank (the
hand-off file and ``SIGUSR1`` of ``robustrl.launcher.spare``; the replica's side is
``robustrl.services.rollout.standby``); the process keeps its pid, and this actor keeps owning it.

Only the standard library and RobustRL's launcher helpers (themselves standard library only) are
imported here: Ray workers import this module to run the actor.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from robustrl.launcher.base import log_tail
from robustrl.launcher.spare import HANDOFF_ENV, HANDOFF_SIGNAL, SPARE_MODULE, write_handoff
from robustrl.ports import free_port


PR_SET_PDEATHSIG = 1
LAUNCH_TIMEOUT_S = 30.0
"""How long ``launch`` waits for the member process to exist (fork + exec)."""


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the thread that started it ends (Linux only)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def psutil_error() -> type[BaseException]:
    try:
        import psutil
    except ImportError:
        return OSError
    return psutil.Error


def _node() -> tuple[str, str]:
    import ray  # the actor runs in a Ray worker: ray is imported already

    return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()


def _member_env(env: dict[str, str], log_path: str, bind_node_ip: bool, ip: str) -> dict[str, str]:
    """The member's environment on this node: its bind address, the accelerators Ray gave this
    actor, and where a role hand-off for it is written (next to its log, on this node)."""
    env = dict(env)
    if bind_node_ip:
        env["ROBUSTRL_BIND_HOST"] = ip  # peers on other nodes reach it at its node's address
    # Ray decides which accelerators this actor holds; the member gets exactly those.
    for var in ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "NEURON_RT_VISIBLE_CORES"):
        if var in os.environ:
            env[var] = os.environ[var]
    env[HANDOFF_ENV] = os.path.dirname(os.path.abspath(log_path))
    return env


class MemberProcess:
    """Starts, signals and waits on one member process; every method is safe to call again."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._started = threading.Event()
        self._done = threading.Event()
        self._error: str | None = None
        self._log: str | None = None
        self._lock = threading.Lock()
        self._waiting = False  # a spare still waiting for its order on stdin
        self._shape: dict[str, Any] | None = None  # what a spare's actor reserves
        self._member = ""  # the launcher's id of the member this actor runs ('' for a spare)
        self.returncode: int | None = None
        self.create_time: float | None = None

    def where(self) -> dict[str, Any]:
        """This node's address and id, and a port free on that address now (a gang's
        MASTER_PORT is chosen here, on rank 0's own node)."""
        ip, node_id = _node()
        return {"node_ip": ip, "node_id": node_id, "port": free_port(ip)}

    def launch(self, module: str, args: list[str], env: dict[str, str], log_path: str,
               bind_node_ip: bool, member: str = "") -> dict[str, Any]:
        """Start ``python -m module args`` (once); return its pid, start time and node."""
        ip, node_id = _node()
        with self._lock:
            if self._proc is None and self._error is None:
                self._log, self._member = log_path, member
                self._spawn([sys.executable, "-m", module, *args], _member_env(env, log_path, bind_node_ip, ip),
                            log_path, stdin=False)
        return self._info_or_raise(ip, node_id)

    def start_spare(self, env: dict[str, str], log_path: str, shape: dict[str, Any]) -> dict[str, Any]:
        """Start a warm spare (``python -m robustrl.launcher.spare``) that waits for ``assign``.
        ``shape`` (what the actor reserves) is kept for a controller that re-attaches to it."""
        ip, node_id = _node()
        with self._lock:
            if self._proc is None and self._error is None:
                self._log, self._waiting, self._shape = log_path, True, dict(shape)
                env = dict(env)
                for var in ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "NEURON_RT_VISIBLE_CORES"):
                    if var in os.environ:
                        env[var] = os.environ[var]
                self._spawn([sys.executable, "-m", SPARE_MODULE], env, log_path, stdin=True)
        return self._info_or_raise(ip, node_id)

    def assign(self, module: str, args: list[str], env: dict[str, str], log_path: str,
               bind_node_ip: bool, member: str = "") -> dict[str, Any]:
        """Hand the member to this waiting spare (its order on stdin); raise if it is no waiting
        spare (taken already, or ended): each spare becomes one member, once."""
        ip, node_id = _node()
        with self._lock:
            proc = self._proc
            if not self._waiting or proc is None or proc.stdin is None or self._done.is_set():
                raise RuntimeError("not a waiting spare (taken already, or its process ended)")
            self._waiting, self._member = False, member
            order = {"module": module, "args": list(args), "env": _member_env(env, log_path, bind_node_ip, ip),
                     "log": log_path}
            try:
                proc.stdin.write(json.dumps(order).encode() + b"\n")
                proc.stdin.close()
            except OSError as exc:
                raise RuntimeError(f"the spare's stdin is closed: {exc}") from exc
            self._log = log_path
        return self._info_or_raise(ip, node_id)

    def handoff(self, env: dict[str, str], log_path: str, bind_node_ip: bool, member: str = "") -> dict[str, Any]:
        """Switch the running member in place to the member ``env`` describes: write its hand-off
        next to the current log and signal it (``robustrl.launcher.spare``). From then on its
        output goes to ``log_path``, which ``tail`` and ``wait`` read."""
        ip, node_id = _node()
        with self._lock:
            proc = self._proc
            if proc is None or self._waiting or self._done.is_set() or self._log is None:
                raise RuntimeError("no running member to hand over")
            directory = os.path.dirname(os.path.abspath(self._log))
            write_handoff(directory, proc.pid, _member_env(env, log_path, bind_node_ip, ip), log_path)
            self._log, self._member = log_path, member
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, HANDOFF_SIGNAL)  # it died meanwhile: wait() reports the exit
        return self._info_or_raise(ip, node_id)

    def _spawn(self, argv: list[str], env: dict[str, str], log_path: str, stdin: bool) -> None:
        threading.Thread(target=self._run, args=(argv, env, log_path, stdin), name="member", daemon=True).start()
        self._started.wait(LAUNCH_TIMEOUT_S)

    def _info_or_raise(self, ip: str, node_id: str) -> dict[str, Any]:
        if self._error is not None:
            raise RuntimeError(self._error)
        if self._proc is None:
            raise RuntimeError(f"the member process did not start within {LAUNCH_TIMEOUT_S:g} s")
        return {"pid": self._proc.pid, "create_time": self.create_time, "node_ip": ip, "node_id": node_id}

    def _run(self, argv: list[str], env: dict[str, str], log_path: str, stdin: bool = False) -> None:
        # This thread starts the member and lives exactly as long as it: the member's parent-death
        # signal is tied to this thread, not to the actor's task threads, which Ray may recycle.
        try:
            os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
            with open(log_path, "ab") as log:
                self._proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                              start_new_session=True,
                                              preexec_fn=_die_with_parent)  # noqa: PLW1509 - prctl only

            try:
                import psutil

                self.create_time = psutil.Process(self._proc.pid).create_time()
            except (ImportError, OSError, psutil_error()):
                self.create_time = time.time()
        except OSError as exc:
            self._error = f"cannot start {argv[2:]}: {exc}"
            self._started.set()
            self._done.set()
            return
        self._started.set()
        self.returncode = self._proc.wait()
        self._done.set()

    def wait(self) -> tuple[int | None, str]:
        """Block until the member exits; its return code and the last lines of its log."""
        self._done.wait()
        return self.returncode, log_tail(self._log, 40)

    def signal(self, sig: int) -> bool:
        """Signal the member's process group; False if it is not running."""
        if self._proc is None or self._done.is_set():
            return False
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)
        return True

    def terminate(self, grace_s: float) -> int | None:
        """SIGTERM (after SIGCONT: a stopped process cannot handle it), SIGKILL after ``grace_s``."""
        if self.signal(signal.SIGCONT):
            self.signal(signal.SIGTERM)
            if not self._done.wait(grace_s):
                self.signal(signal.SIGKILL)
                self._done.wait(5.0)
        return self.returncode

    def info(self) -> dict[str, Any]:
        ip, node_id = _node()
        return {"pid": self._proc.pid if self._proc else None, "create_time": self.create_time,
                "running": self._started.is_set() and not self._done.is_set(), "returncode": self.returncode,
                "node_ip": ip, "node_id": node_id, "spare": self._waiting, "member": self._member,
                "shape": self._shape if self._waiting else None}

    def tail(self, lines: int) -> str:
        return log_tail(self._log, lines)
