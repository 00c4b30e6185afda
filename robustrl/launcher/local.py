"""Local process launcher: each member is ``python -m module`` in its own process group.

Re-attaching (``adopt``): members run in their own sessions, so they outlive a controller that is
killed. A restarted controller hands back each member's ``handle`` (pid and the process's start
time, persisted in Redis); the launcher checks both against ``psutil`` (a recycled pid has another
start time) and then tracks, signals and polls the process like one it started, through
:class:`_Adopted`. Its exit code is unknown (it is not our child): ``poll`` reports None.

Warm spares (``keep_spares``): processes of ``robustrl.launcher.spare`` that have already imported
the member code. ``start`` hands a trainer or rollout member to a ready spare instead of starting
a cold process, which saves the imports (about 4 s here) on every restart; the spare is restocked
``SPARE_RESTOCK_DELAY_S`` later, so its imports do not compete with the recovery for the CPU.

Placement (``placement``, e.g. a ``robustrl.testbed.Testbed``): a member whose spec names a
``host`` starts as ``<placement.exec_prefix(host)> python -m module`` -- for a testbed,
``ip netns exec <ns> python ...``, which enters the namespace and execs Python in the same process,
so the pid, the process group and the signals are those of the member itself. Placed members always
start cold (the spares run outside every host).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil

from robustrl.errors import LaunchError, RobustRLError
from robustrl.launcher.base import (
    ROLLOUT_MODULE,
    ExitInfo,
    Launcher,
    MemberSpec,
    MemberState,
    Placement,
    Resources,
    check_spec,
    log_tail,
)
from robustrl.launcher.spare import HANDOFF_ENV, HANDOFF_SIGNAL, SPARE_MODULE, write_handoff
from robustrl.launcher.spare import TARGETS as SPARE_TARGETS
from robustrl.model.engines.envs import interpreter

_log = logging.getLogger(__name__)

STOP_GRACE_S = 2.0
SPARE_RESTOCK_DELAY_S = 10.0
SPARE_RETRY_MAX_S = 60.0
"""A restock whose spare could not be started is tried again ``SPARE_RESTOCK_DELAY_S`` later, the
wait doubled per failure in a row up to this (a lost restock leaves the pool short for good)."""
ADOPTED_WAIT_POLL_S = 0.02
"""Polling period while waiting for an adopted process to end (it is not our child: no waitpid)."""
START_TIME_TOLERANCE_S = 0.05
_GONE = -1  # what _Adopted.poll() returns once the process is gone (its real code is unknown)


class _Adopted:
    """A member process this launcher did not start, with the part of Popen's interface it uses."""

    def __init__(self, proc: psutil.Process) -> None:
        self._proc = proc
        self.pid = proc.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        try:
            alive = self._proc.is_running() and self._proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            alive = False
        return None if alive else _GONE

    def wait(self, timeout: float | None = None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(ADOPTED_WAIT_POLL_S)  # not our child: nothing to block on
        return None


@dataclass
class _Member:
    spec: MemberSpec
    proc: subprocess.Popen[bytes] | _Adopted
    state: MemberState
    expected_exit: bool = False
    reported: bool = False
    warm: bool = False  # started from a warm spare


class LocalLauncher(Launcher):
    """Starts members as local processes; logs go to ``log_dir/<member>.log``. With a
    ``placement``, members whose spec names a host run on that host (module docstring)."""

    def __init__(self, log_dir: Path, base_env: dict[str, str] | None = None,
                 placement: Placement | None = None,
                 assign: Callable[[MemberSpec], str | None] | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.placement = placement
        self.assign = assign
        """Picks a host for a member whose spec names none (``robustrl.testbed.placement``)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.base_env = dict(base_env if base_env is not None else os.environ)
        self._members: dict[str, _Member] = {}
        self._lock = threading.Lock()
        self._spares: list[subprocess.Popen[bytes]] = []
        self._spares_wanted = 0
        self._spare_seq = 0
        self._restock_failures = 0  # restocks failed in a row (their retries back off)
        self._retry_pending = False  # a retry timer after a failed start is scheduled
        self.spares_used = 0
        """Members started from a warm spare (the rest were cold starts)."""
        self._closed = False

    # --- warm spares -------------------------------------------------------------------------

    def keep_spares(self, n: int) -> None:
        """Keep ``n`` warm spare processes (0 releases them all)."""
        with self._lock:
            self._spares_wanted = max(0, n)
            self._restock()

    def _restock(self) -> None:
        """Forget dead spares, release extra ones, start missing ones (lock held). A spare that
        cannot be started is tried again later, backing off (``SPARE_RETRY_MAX_S``)."""
        self._spares = [p for p in self._spares if p.poll() is None]
        while len(self._spares) > self._spares_wanted:
            self._release(self._spares.pop())
        while not self._closed and len(self._spares) < self._spares_wanted:
            self._spare_seq += 1
            log = None
            try:
                log = open(self.log_dir / f"spare-{self._spare_seq}.log", "ab")  # noqa: SIM115 - owned by the child
                self._spares.append(subprocess.Popen(
                    [sys.executable, "-m", SPARE_MODULE], env=self.base_env, stdin=subprocess.PIPE,
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            except OSError as exc:  # members start cold meanwhile, which always works
                self._restock_failures += 1
                delay = min(SPARE_RESTOCK_DELAY_S * 2 ** (self._restock_failures - 1), SPARE_RETRY_MAX_S)
                _log.warning("cannot start a warm spare (failure %d in a row: %s); trying again in %.0f s",
                             self._restock_failures, exc, delay)
                if not self._retry_pending:  # one retry chain, however many calls failed meanwhile
                    self._retry_pending = True
                    self._restock_later(delay, retry=True)
                return
            finally:
                if log is not None:
                    log.close()
        self._restock_failures = 0

    def _restock_later(self, delay_s: float | None = None, retry: bool = False) -> None:
        """``_restock`` in a timer thread, ``delay_s`` (default ``SPARE_RESTOCK_DELAY_S``) from now
        (``retry``: the one pending retry after a failed start)."""
        def restock() -> None:
            with self._lock:
                if retry:
                    self._retry_pending = False
                self._restock()

        timer = threading.Timer(SPARE_RESTOCK_DELAY_S if delay_s is None else delay_s, restock)
        timer.daemon = True
        timer.start()

    @staticmethod
    def _release(spare: subprocess.Popen[bytes]) -> None:
        try:
            os.killpg(spare.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        spare.wait(timeout=5.0)

    def _take_spare(self, spec: MemberSpec, env: dict[str, str]) -> subprocess.Popen[bytes] | None:
        """Hand ``spec`` to a live spare (lock held); None when there is none for it."""
        if spec.module not in SPARE_TARGETS:
            return None
        while self._spares:
            spare = self._spares.pop(0)
            if spare.poll() is not None or spare.stdin is None:
                continue
            order = {"module": spec.module, "args": list(spec.args), "env": env,
                     "log": str(self.log_dir / f"{spec.member_id}.log")}
            try:
                spare.stdin.write(json.dumps(order).encode() + b"\n")
                spare.stdin.close()
            except OSError:
                self._release(spare)
                continue
            self.spares_used += 1
            self._restock_later()
            return spare
        return None

    # --- members -----------------------------------------------------------------------------

    def _note_ignored(self, spec: MemberSpec) -> None:
        """Resources and node placement mean nothing to processes sharing this machine."""
        if spec.resources != Resources():
            self.ignored(spec, "resources", "local processes share this machine and reserve nothing")
        p = spec.placement
        if p.node_labels or p.anti_affinity != "none" or (p.gang and p.strategy != "PACK"):
            self.ignored(spec, "node placement (labels, anti-affinity, gang strategy)",
                         "every member runs on this machine (or on the host named by spec.host)")

    def start(self, spec: MemberSpec) -> None:
        check_spec(spec)
        self._note_ignored(spec)
        spec = self._placed(spec)
        with self._lock:
            if self._closed:  # a launch racing close() would leave a process nobody stops
                raise LaunchError(f"cannot start {spec.member_id}: the launcher is closed", member=spec.member_id)
            old = self._members.get(spec.member_id)
            if old and old.proc.poll() is None:
                raise LaunchError(f"member {spec.member_id} is already running", member=spec.member_id)
            env = {**self.base_env, **spec.env, HANDOFF_ENV: str(self.log_dir)}
            prefix = self._host_prefix(spec)
            try:
                python = interpreter(spec.env)  # rollout.engine vllm: the vLLM environment's Python
            except RobustRLError as exc:
                raise LaunchError(str(exc), member=spec.member_id) from exc
            # A spare runs the launcher's own interpreter: members of another environment start cold.
            spare = None if spec.host or python != sys.executable else self._take_spare(spec, env)
            if spare is not None:
                self._members[spec.member_id] = _Member(spec, spare, MemberState.RUNNING, warm=True)
                self._write_pidfile(spec.member_id, spare.pid)
                return
            log = open(self.log_dir / f"{spec.member_id}.log", "ab")  # noqa: SIM115 - owned by the child
            try:
                proc = subprocess.Popen(
                    [*prefix, python, "-m", spec.module, *spec.args], env=env, stdout=log,
                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                )
            except OSError as exc:
                raise LaunchError(f"cannot start {spec.member_id}: {exc}", member=spec.member_id) from exc
            finally:
                log.close()
            self._members[spec.member_id] = _Member(spec, proc, MemberState.RUNNING)
            self._write_pidfile(spec.member_id, proc.pid, spec.host)

    def _placed(self, spec: MemberSpec) -> MemberSpec:
        """``spec`` with its host (the one it names, else ``assign``'s choice); a placed member
        binds its servers on its host's address, which members on other hosts reach."""
        host = spec.host if spec.host is not None or self.assign is None else self.assign(spec)
        if host is None or self.placement is None:
            return spec  # not placed, or _host_prefix says why it cannot be
        try:
            address = self.placement.address(host)
        except RobustRLError:
            return replace(spec, host=host)  # _host_prefix names the bad host
        return replace(spec, host=host, env={**spec.env, "ROBUSTRL_BIND_HOST": address})

    def spares_ready(self) -> int:
        with self._lock:
            return sum(1 for p in self._spares if p.poll() is None)

    def can_relabel(self) -> bool:
        return True

    def relabel(self, member_id: str, spec: MemberSpec) -> None:
        """Hand a running rollout replica over to ``spec`` (a trainer rank) in place: write the
        hand-off (``robustrl.launcher.spare``), signal the process, and track it under
        ``spec.member_id`` from now on (same process, pid and group; it stays on its host)."""
        with self._lock:
            m = self._members.get(member_id)
            if m is None or m.proc.poll() is not None:
                raise LaunchError(f"cannot borrow {member_id}: it is not running", member=member_id)
            if m.spec.role != "rollout" or (m.spec.module not in ("", ROLLOUT_MODULE)):
                raise LaunchError(f"cannot borrow {member_id}: only a rollout replica switches role in place",
                                  member=member_id)
            new = self._members.get(spec.member_id)
            if new is not None and new.proc.poll() is None:
                raise LaunchError(f"member {spec.member_id} is already running", member=spec.member_id)
            # The rank stays on the replica's host: it binds there, as a member started on it would.
            placed = self._placed(dataclasses.replace(spec, host=m.spec.host)) if m.spec.host else spec
            env = {**self.base_env, **placed.env, HANDOFF_ENV: str(self.log_dir)}
            try:
                write_handoff(self.log_dir, m.proc.pid, env, str(self.log_dir / f"{spec.member_id}.log"))
            except OSError as exc:
                raise LaunchError(f"cannot hand {member_id} over to {spec.member_id}: {exc}",
                                  member=member_id) from exc
            del self._members[member_id]
            self._members[spec.member_id] = _Member(placed, m.proc, MemberState.RUNNING, warm=True)
            try:
                os.kill(m.proc.pid, HANDOFF_SIGNAL)
            except ProcessLookupError:
                pass  # it died meanwhile: poll() reports the exit under the new id

    def _host_prefix(self, spec: MemberSpec) -> list[str]:
        """The argv prefix that places ``spec`` on its host ([] without one)."""
        if spec.host is None:
            return []
        if self.placement is None:
            raise LaunchError(f"{spec.member_id} is placed on host {spec.host!r} but the launcher has no "
                              "placement (testbed)", member=spec.member_id)
        try:
            return self.placement.exec_prefix(spec.host)
        except RobustRLError as exc:
            raise LaunchError(f"cannot place {spec.member_id} on {spec.host!r}: {exc}",
                              member=spec.member_id) from exc

    def host_for(self, member_id: str) -> str:
        """The member's host address when it is placed on one, else loopback."""
        m = self._members.get(member_id)
        if m is not None and m.spec.host is not None and self.placement is not None:
            return self.placement.address(m.spec.host)
        return super().host_for(member_id)

    def _signal_group(self, member: _Member, sig: int) -> None:
        try:
            os.killpg(member.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, member_id: str, grace_s: float = STOP_GRACE_S) -> None:
        self.stop_many([member_id], grace_s)

    def stop_many(self, member_ids: list[str], grace_s: float = STOP_GRACE_S) -> None:
        members = [m for mid in member_ids if (m := self._members.get(mid)) and m.proc.poll() is None]
        for m in members:
            m.expected_exit = True
            self._signal_group(m, signal.SIGCONT)  # a suspended process cannot handle SIGTERM
            self._signal_group(m, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for m in members:
            try:
                m.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._signal_group(m, signal.SIGKILL)
                m.proc.wait(timeout=5.0)
            m.state = MemberState.STOPPED

    def kill(self, member_id: str, expected: bool = False) -> None:
        m = self._members.get(member_id)
        if m is None or m.proc.poll() is not None:
            return
        m.expected_exit = expected
        self._signal_group(m, signal.SIGKILL)
        try:
            m.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired as exc:
            raise LaunchError(f"{member_id} survived SIGKILL", member=member_id) from exc
        m.state = MemberState.EXITED

    def kill_many(self, member_ids: list[str], expected: bool = True) -> None:
        """Kill several members at once (whole-job restart, gang restart)."""
        members = [m for mid in member_ids if (m := self._members.get(mid)) and m.proc.poll() is None]
        for m in members:
            m.expected_exit = expected
            self._signal_group(m, signal.SIGKILL)
        for m in members:
            m.proc.wait(timeout=5.0)
            m.state = MemberState.EXITED

    def suspend(self, member_id: str) -> None:
        m = self._members.get(member_id)
        if m and m.proc.poll() is None:
            self._signal_group(m, signal.SIGSTOP)
            m.state = MemberState.SUSPENDED

    def resume(self, member_id: str) -> None:
        m = self._members.get(member_id)
        if m and m.proc.poll() is None:
            self._signal_group(m, signal.SIGCONT)
            m.state = MemberState.RUNNING

    def poll(self) -> list[ExitInfo]:
        out = []
        with self._lock:
            for mid, m in self._members.items():
                rc = m.proc.poll()
                if rc is not None and not m.reported:
                    m.reported = True
                    if m.state not in (MemberState.STOPPED,):
                        m.state = MemberState.EXITED
                    out.append(ExitInfo(mid, m.spec.role, m.proc.returncode, m.expected_exit))
        return out

    def state(self, member_id: str) -> MemberState | None:
        m = self._members.get(member_id)
        if m is None:
            return None
        if m.proc.poll() is not None and m.state in (MemberState.RUNNING, MemberState.SUSPENDED):
            m.state = MemberState.EXITED
        return m.state

    def pid(self, member_id: str) -> int | None:
        m = self._members.get(member_id)
        return m.proc.pid if m else None

    def handle(self, member_id: str) -> dict[str, Any] | None:
        m = self._members.get(member_id)
        if m is None:
            return None
        try:
            handle: dict[str, Any] = {"pid": m.proc.pid, "create_time": psutil.Process(m.proc.pid).create_time()}
        except psutil.Error:
            return None
        if m.spec.host is not None:
            handle["host"] = m.spec.host
        return handle

    def _pidfile(self, member_id: str) -> Path:
        return self.log_dir / f"{member_id}.pid"

    def _write_pidfile(self, member_id: str, pid: int, host: str | None = None) -> None:
        """Right after the start: the member's handle on disk, next to its log, for a controller
        that takes over before the one starting it persisted the handle (``find``)."""
        try:
            handle: dict[str, Any] = {"pid": pid, "create_time": psutil.Process(pid).create_time()}
        except psutil.Error:
            return  # ended already: its exit is reported as any other
        if host is not None:
            handle["host"] = host
        tmp = self._pidfile(member_id).with_suffix(".pid.tmp")
        try:
            tmp.write_text(json.dumps(handle))
            os.replace(tmp, self._pidfile(member_id))
        except OSError as exc:  # the member runs: only a takeover in the next instant misses it
            _log.warning("pid file of %s not written: %s", member_id, exc)

    def find(self, member_id: str) -> dict[str, Any] | None:
        """The handle in the member's pid file, if that very process still runs (pid and start
        time checked, as ``adopt`` does)."""
        try:
            handle = json.loads(self._pidfile(member_id).read_text())
            proc = psutil.Process(int(handle["pid"]))
            same = abs(proc.create_time() - float(handle["create_time"])) <= START_TIME_TOLERANCE_S
            alive = proc.status() != psutil.STATUS_ZOMBIE
        except (OSError, ValueError, KeyError, TypeError, psutil.Error):
            return None
        return handle if same and alive and isinstance(handle, dict) else None

    def adopt(self, job_id: str, member_id: str, role: str, handle: dict[str, Any]) -> bool:
        """Track a running member started by an earlier launcher (see the module docstring)."""
        try:
            pid, created = int(handle["pid"]), float(handle["create_time"])
        except (KeyError, TypeError, ValueError):
            return False
        try:
            proc = psutil.Process(pid)
            same = abs(proc.create_time() - created) <= START_TIME_TOLERANCE_S
            alive = proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False
        if not (same and alive):
            return False
        with self._lock:
            current = self._members.get(member_id)
            if current is not None and current.proc.poll() is None:
                return current.proc.pid == pid
            host = handle.get("host")
            spec = MemberSpec(job_id, member_id, role, module="", env={},
                              host=host if isinstance(host, str) else None)
            self._members[member_id] = _Member(spec, _Adopted(proc), MemberState.RUNNING)
        return True

    def log_tail(self, member_id: str, lines: int = 20) -> str:
        return log_tail(str(self.log_dir / f"{member_id}.log"), lines)

    def was_warm(self, member_id: str) -> bool:
        m = self._members.get(member_id)
        return m is not None and m.warm

    def running(self, job_id: str | None = None) -> list[str]:
        return [mid for mid, m in self._members.items()
                if m.proc.poll() is None and (job_id is None or m.spec.job_id == job_id)]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            spares, self._spares = self._spares, []
        for spare in spares:
            self._release(spare)
        self.kill_many(self.running(), expected=True)
