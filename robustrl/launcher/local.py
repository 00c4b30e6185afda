"""Local process launcher: each member is ``python -m module`` in its own process group.

Re-attaching (``adopt``): members run in their own sessions, so they outlive a controller that is
killed. A restarted controller hands back each member's ``handle`` (pid and the process's start
time since boot, persisted in Redis); the launcher checks both against ``/proc`` (a recycled pid
has another start time; ``robustrl.procs``) and then tracks, signals and polls the process like
one it started, through :class:`_Adopted`. Its exit code is unknown (it is not our child):
``poll`` reports None.

Warm spares (``keep_spares``): processes of ``robustrl.launcher.spare`` that have already imported
the member code. ``start`` hands a trainer or rollout member to a ready spare instead of starting
a cold process, which saves the imports (about 4 s here) on every restart; the spare is restocked
``SPARE_RESTOCK_DELAY_S`` later, so its imports do not compete with the recovery for the CPU.

Finding a member whose handle was never persisted (``find``): the controller may die right
after ``start``, before it records the member's handle. The launcher writes the handle to a pid
file next to the member's log right after the start, but the controller can die between the
process's start and that write; so every cold-started member also carries its pid file's path in
its environment (``LAUNCH_MARK_ENV``), set before the process exists, and ``find`` falls back to
looking for the session leader whose environment names it (``/proc/<pid>/environ``: the
environment the process was started with). A warm spare took its environment after its start
(not visible there): it writes the pid file itself, from the order, before it runs the member.

Placement (``placement``, e.g. a ``robustrl.testbed.Testbed``): a member whose spec names a
``host`` starts as ``<placement.exec_prefix(host)> python -m module`` -- for a testbed,
``ip netns exec <ns> python ...``, which enters the namespace and execs Python in the same process,
so the pid, the process group and the signals are those of the member itself. Placed members always
start cold (the spares run outside every host).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil

from robustrl.errors import LaunchError, RobustRLError
from robustrl.infra.credentials import without_credentials
from robustrl.launcher.base import (
    ExitInfo,
    Launcher,
    MemberSpec,
    MemberState,
    Placement,
    Resources,
    check_spec,
    free_port,
    log_tail,
    switchable,
)
from robustrl.launcher.spare import (
    HANDOFF_ENV,
    HANDOFF_SIGNAL,
    SPARE_MODULE,
    pid_handle,
    write_handoff,
    write_pidfile,
)
from robustrl.launcher.spare import TARGETS as SPARE_TARGETS
from robustrl.launcher.zygote import READY_WAIT_S, ForkedProc, Zygote, fork_start_enabled
from robustrl.model.engines.envs import interpreter
from robustrl.procs import is_running, same_start, start_time

_log = logging.getLogger(__name__)

STOP_GRACE_S = 2.0
SPARE_RESTOCK_DELAY_S = 10.0
SPARE_ZYGOTE_WAIT_S = 1.0
"""A restock while the zygote still imports is tried again this much later (not started cold)."""
ZYGOTE_MAX_REFUSALS = 3
"""Forks refused in a row (fork or pidfd failing in the zygote) before the zygote is given up."""
ZYGOTE_RETRY_S = 30.0
ZYGOTE_RETRY_MAX_S = 600.0
"""After a zygote is given up, members start cold for ``ZYGOTE_RETRY_S`` before another is
started, doubling per zygote given up in a row up to this."""
SPARE_RETRY_MAX_S = 60.0
"""A restock whose spare could not be started is tried again ``SPARE_RESTOCK_DELAY_S`` later, the
wait doubled per failure in a row up to this (a lost restock leaves the pool short for good)."""
ADOPTED_WAIT_POLL_S = 0.02
"""Polling period while waiting for an adopted process to end (it is not our child: no waitpid)."""
START_TIME_TOLERANCE_S = 0.05
LAUNCH_MARK_ENV = "ROBUSTRL_LAUNCH_MARK"
"""Set on every member this launcher starts: the path of the member's pid file (``find``)."""
LAUNCH_HOST_ENV = "ROBUSTRL_LAUNCH_HOST"
"""Set on a member placed on a host (``MemberSpec.host``): the host, for its handle (``find``)."""
_GONE = -1  # what _Adopted.poll() returns once the process is gone (its real code is unknown)


class _Adopted:
    """A member process this launcher did not start, with the part of Popen's interface it uses."""

    def __init__(self, pid: int, started: float) -> None:
        self.pid = pid
        self.started = started  # as in its handle (robustrl.procs): a recycled pid started later
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return None if is_running(self.pid, self.started, START_TIME_TOLERANCE_S) else _GONE

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
    proc: subprocess.Popen[bytes] | _Adopted | ForkedProc
    state: MemberState
    expected_exit: bool = False
    reported: bool = False
    warm: bool = False  # started from a warm spare


def _running(proc: subprocess.Popen[bytes] | _Adopted | ForkedProc) -> bool:
    """Whether a member process still runs: not reaped, and not a zombie either (``poll`` says
    nothing while another thread is reaping the same process, and a zombie takes signals)."""
    if proc.poll() is not None:
        return False
    try:
        return bool(psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def marked_processes() -> Iterator[tuple[psutil.Process, dict[str, str]]]:
    """Every process this user may read that carries ``LAUNCH_MARK_ENV`` (members a local
    launcher started, their children too), with its environment."""
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue  # gone meanwhile, or another user's process
        if env.get(LAUNCH_MARK_ENV):
            yield proc, env


def _signal(proc: Any, sig: int, group: bool = True) -> None:
    """Signal a member's process group (``group``) or its process; one that has ended is left
    alone. A forked member is signalled only while the zygote has not freed its pid."""
    try:
        if isinstance(proc, ForkedProc):
            proc.send_signal(sig, group)
        else:
            (os.killpg if group else os.kill)(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass

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
        self._spares: list[subprocess.Popen[bytes] | ForkedProc] = []
        self._spares_wanted = 0
        self._spare_seq = 0
        self._restock_failures = 0  # restocks failed in a row (their retries back off)
        self._retry_pending = False  # a retry timer after a failed start is scheduled
        self.spares_used = 0
        """Members started from a warm spare (the rest were cold starts)."""
        self._closed = False
        self._zygote: Zygote | None = None
        self._fork_start = fork_start_enabled(self.base_env)
        self._bare_env = without_credentials(self.base_env)
        """What spares and the zygote start with: they take their member's credentials later."""
        self._zygote_failures = 0  # zygotes given up in a row
        self._retired_zygotes: list[Zygote] = []  # given up, still reaping members they forked
        self._zygote_retry_at = 0.0  # no new zygote before this (monotonic)

    # --- the fork server (ROBUSTRL_FORK_START, robustrl.launcher.zygote) ---------------------

    def _new_zygote(self) -> Zygote | None:
        try:
            # Marked like a member (its forks show the zygote's environment in /proc): a stack's
            # stop sweeps what a killed controller left (``robustrl.stack.sweep_members``).
            return Zygote(self.log_dir / "zygote.log",
                          {**self._bare_env, LAUNCH_MARK_ENV: str(self.log_dir / "zygote.pid")})
        except OSError as exc:
            _log.warning("cannot start the zygote (%s): members start cold", exc)
            return None

    def preload(self) -> None:
        """Start the zygote now (a controller that has become the leader), so that its imports are
        done before the members it starts next; without this it starts with the first member."""
        if self.assign is not None:
            return  # a placement puts every member on a host: none forks
        with self._lock:
            self._current_zygote()

    def _current_zygote(self) -> Zygote | None:
        """The zygote (lock held), started if there is none or the last was lost, unless the
        last ones failed and the back-off has not run out; None: start cold."""
        if not self._fork_start or self._closed:
            return None
        if self._retired_zygotes:
            self._stop_idle_retired()
        z = self._zygote
        if z is not None:
            if z.lost:
                self._give_up_zygote(z, "ended (or stopped answering)")
            elif z.failures >= ZYGOTE_MAX_REFUSALS:
                self._give_up_zygote(z, f"refused {z.failures} forks in a row")
            elif not z.ready() and time.monotonic() - z.started_at > READY_WAIT_S:
                self._give_up_zygote(z, f"was not ready {READY_WAIT_S:.0f} s after its start")
        if self._zygote is None:
            if time.monotonic() < self._zygote_retry_at:
                return None
            self._zygote = self._new_zygote()
        return self._zygote

    def _give_up_zygote(self, zygote: Zygote, why: str) -> None:
        """Stop using ``zygote`` (lock held): members start cold until the back-off runs out (it
        doubles while zygotes keep failing, ``ZYGOTE_RETRY_MAX_S`` at most)."""
        self._zygote = None
        self._zygote_failures += 1
        delay = min(ZYGOTE_RETRY_S * 2 ** (self._zygote_failures - 1), ZYGOTE_RETRY_MAX_S)
        self._zygote_retry_at = time.monotonic() + delay
        _log.warning("zygote %d %s: members start cold; a new zygote in %.0f s", zygote.pid, why, delay)
        # One still running with members it forked keeps reaping them (their exit codes are
        # the controller's to read); it forks no more and is stopped once they have all ended.
        zygote.retired = True
        self._retired_zygotes.append(zygote)
        self._stop_idle_retired()

    def _stop_idle_retired(self) -> None:
        """Stop the given-up zygotes that are lost or have no member left (lock held)."""
        keep = []
        for z in self._retired_zygotes:
            if z.lost or not z.has_children():
                z.lost = True
                z.close_later()
            else:
                keep.append(z)
        self._retired_zygotes = keep

    def _usable_zygote(self) -> Zygote | None:
        """The zygote to fork from now (lock held); None: start cold."""
        zygote = self._current_zygote()
        if zygote is not None and zygote.ready():
            self._zygote_failures = 0
            return zygote
        return None

    def _fork(self, log: Path) -> ForkedProc | None:
        """A process forked from the zygote, waiting for its order (lock held); None: start cold."""
        zygote = self._usable_zygote()
        if zygote is None:
            return None
        try:
            return zygote.fork(log)
        except OSError as exc:
            _log.warning("cannot fork from the zygote (%s): starting cold", exc)
            return None

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
        zygote = self._current_zygote() if len(self._spares) < self._spares_wanted else None
        if zygote is not None and not zygote.ready():
            # Importing still: a spare forked in a moment costs nothing, a cold one its imports
            # (a zygote never ready is given up after READY_WAIT_S: the spares then start cold).
            self._restock_later(SPARE_ZYGOTE_WAIT_S)
            return
        while not self._closed and len(self._spares) < self._spares_wanted:
            self._spare_seq += 1
            log = None
            try:
                path = self.log_dir / f"spare-{self._spare_seq}.log"
                forked = self._fork(path)
                if forked is not None:
                    self._spares.append(forked)
                    continue
                log = open(path, "ab")  # noqa: SIM115 - owned by the child
                mark = {LAUNCH_MARK_ENV: str(path.with_suffix(".pid"))}  # swept like a member if left
                self._spares.append(subprocess.Popen(
                    [sys.executable, "-m", SPARE_MODULE], env={**self._bare_env, **mark},
                    stdin=subprocess.PIPE,
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
    def _release(spare: subprocess.Popen[bytes] | ForkedProc) -> None:
        _signal(spare, signal.SIGKILL)
        if spare.stdin is not None:
            with contextlib.suppress(OSError):
                spare.stdin.close()
        spare.wait(timeout=5.0)

    def _take_spare(self, spec: MemberSpec, env: dict[str, str]) -> subprocess.Popen[bytes] | ForkedProc | None:
        """Hand ``spec`` to a live spare (lock held); None when there is none for it."""
        if spec.module not in SPARE_TARGETS:
            return None
        while self._spares:
            spare = self._spares.pop(0)
            if spare.poll() is not None or spare.stdin is None:
                continue
            if not self._order(spare, spec, env):
                self._release(spare)
                continue
            self.spares_used += 1
            self._restock_later()
            return spare
        return None

    def _order(self, spare: subprocess.Popen[bytes] | ForkedProc, spec: MemberSpec, env: dict[str, str]) -> bool:
        """Tell a waiting spare (or a fresh fork) which member to become; False if it cannot hear.
        The spare writes its own pid file before it runs the member: a controller dying right
        after this write still leaves the member findable (``find``)."""
        assert spare.stdin is not None
        order = {"module": spec.module, "args": list(spec.args), "env": env,
                 "log": str(self.log_dir / f"{spec.member_id}.log"),
                 "pidfile": str(self._pidfile(spec.member_id))}
        try:
            spare.stdin.write(json.dumps(order).encode() + b"\n")
            spare.stdin.close()
        except OSError:
            return False
        return True

    # --- members -----------------------------------------------------------------------------

    def _note_ignored(self, spec: MemberSpec) -> None:
        """Resources and node placement mean nothing to processes sharing this machine."""
        if spec.resources != Resources():
            self.ignored(spec, "resources", "local processes share this machine and reserve nothing")
        p = spec.placement
        # (a gang's strategy means something where a testbed placement gives the role hosts)
        if p.node_labels or p.anti_affinity != "none" or (p.gang and p.strategy != "PACK" and self.assign is None):
            self.ignored(spec, "node placement (labels, anti-affinity, gang strategy)",
                         "every member runs on this machine (or on the host named by spec.host)")

    def start(self, spec: MemberSpec) -> None:
        check_spec(spec)
        self._note_ignored(spec)
        spec = self._placed(spec)
        if self._fork_start and self._forkable(spec):
            with self._lock:
                spare_ready = any(p.poll() is None for p in self._spares)
                zygote = None if spare_ready else self._current_zygote()
            if zygote is not None:
                # Outside the lock: a zygote still importing is worth waiting for (one import,
                # where members started cold meanwhile would each pay their own, on the same
                # cores), up to what is left of READY_WAIT_S since its start; one never ready by
                # then is given up (_current_zygote) and this member starts cold.
                zygote.ready(max(0.0, zygote.started_at + READY_WAIT_S - time.monotonic()))
        with self._lock:
            if self._closed:  # a launch racing close() would leave a process nobody stops
                raise LaunchError(f"cannot start {spec.member_id}: the launcher is closed", member=spec.member_id)
            old = self._members.get(spec.member_id)
            if old and old.proc.poll() is None:
                raise LaunchError(f"member {spec.member_id} is already running", member=spec.member_id)
            env = {**self.base_env, **spec.env, HANDOFF_ENV: str(self.log_dir),
                   LAUNCH_MARK_ENV: str(self._pidfile(spec.member_id))}
            if spec.host is not None:
                env[LAUNCH_HOST_ENV] = spec.host
            prefix = self._host_prefix(spec)
            try:
                python = interpreter(spec.env)  # rollout.engine vllm: the vLLM environment's Python
            except RobustRLError as exc:
                raise LaunchError(str(exc), member=spec.member_id) from exc
            # A spare runs the launcher's own interpreter: members of another environment start cold.
            forkable = self._forkable(spec)
            spare = self._take_spare(spec, env) if forkable else None
            if spare is not None:
                self._members[spec.member_id] = _Member(spec, spare, MemberState.RUNNING, warm=True)
                self._write_pidfile(spec.member_id, spare.pid)
                return
            forked = self._fork(self.log_dir / f"{spec.member_id}.log") if forkable else None
            if forked is not None:
                if self._order(forked, spec, env):
                    self._members[spec.member_id] = _Member(spec, forked, MemberState.RUNNING)
                    self._write_pidfile(spec.member_id, forked.pid)
                    return
                self._release(forked)  # died before its order: start it cold
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

    @staticmethod
    def _forkable(spec: MemberSpec) -> bool:
        """Whether a spare (or a fork of the zygote) can become this member: a trainer or rollout
        module, on no host (spares run outside every host), in the launcher's own interpreter, not
        asked cold (a start from a spare failed: the zygote the spares come from is no cold start)."""
        if spec.cold or spec.host or spec.module not in SPARE_TARGETS:
            return False
        try:
            return interpreter(spec.env) == sys.executable
        except RobustRLError:
            return False  # start() reports it

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

    def can_keep_trainers(self) -> bool:
        return True

    def relabel(self, member_id: str, spec: MemberSpec) -> None:
        """Hand a running rollout replica (or a surviving trainer rank) over to ``spec`` (a rank
        of the next gang) in place: write the hand-off (``robustrl.launcher.spare``), signal the process, and track it under
        ``spec.member_id`` from now on (same process, pid and group; it stays on its host)."""
        with self._lock:
            if self._closed:  # close() has taken its list of members to stop: this one would run on
                raise LaunchError(f"cannot hand {member_id} over to {spec.member_id}: the launcher is closed",
                                  member=member_id)
            m = self._members.get(member_id)
            if m is None or not _running(m.proc):
                raise LaunchError(f"cannot borrow {member_id}: it is not running", member=member_id)
            if not switchable(m.spec):
                raise LaunchError(f"cannot borrow {member_id}: only a rollout replica or a trainer rank "
                                  "switches in place", member=member_id)
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
            _signal(m.proc, HANDOFF_SIGNAL, group=False)  # died meanwhile: poll() reports it under the new id

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

    def rendezvous(self, spec: MemberSpec) -> tuple[str, int]:
        """On a testbed placement, rank 0's host is chosen now (its start then gets the same one)
        and the gang meets at that host's address: ranks split over hosts dial it there. (Before,
        ``MASTER_ADDR`` was loopback, so a gang could never leave one host.)"""
        host = spec.host if spec.host is not None or self.assign is None else self.assign(spec)
        if host is None or self.placement is None:
            return super().rendezvous(spec)
        return self.placement.address(host), free_port()

    def host_for(self, member_id: str) -> str:
        """The member's host address when it is placed on one, else loopback."""
        m = self._members.get(member_id)
        if m is not None and m.spec.host is not None and self.placement is not None:
            return self.placement.address(m.spec.host)
        return super().host_for(member_id)

    def _signal_group(self, member: _Member, sig: int) -> None:
        _signal(member.proc, sig)

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
        survivors = self._kill_members(members, expected)
        if survivors:
            raise LaunchError(f"{', '.join(survivors)} survived SIGKILL", member=survivors[0])

    def _kill_members(self, members: list[_Member], expected: bool) -> list[str]:
        """SIGKILL each member's group, then reap each (5 s at most); the ids still running."""
        for m in members:
            m.expected_exit = expected
            self._signal_group(m, signal.SIGKILL)
        survivors = []
        for m in members:
            try:
                m.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                survivors.append(m.spec.member_id)
                continue
            m.state = MemberState.EXITED
        return survivors

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
            if self._retired_zygotes:  # one whose last member ended without its report is stopped here
                self._stop_idle_retired()
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
        return pid_handle(m.proc.pid, m.spec.host)

    @staticmethod
    def same_process(a: dict[str, Any], b: dict[str, Any]) -> bool:
        """The same pid with the same start time (a recycled pid starts later); the host (a
        network namespace of this machine) does not tell processes apart."""
        try:
            return (int(a["pid"]) == int(b["pid"])
                    and same_start(float(a["create_time"]), float(b["create_time"]), START_TIME_TOLERANCE_S))
        except (KeyError, TypeError, ValueError):
            return False

    def _pidfile(self, member_id: str) -> Path:
        return self.log_dir / f"{member_id}.pid"

    def _write_pidfile(self, member_id: str, pid: int, host: str | None = None) -> None:
        """Right after the start: the member's handle on disk, next to its log, for a controller
        that takes over before the one starting it persisted the handle (``find``)."""
        handle = pid_handle(pid, host)
        if handle is None:
            return  # ended already: its exit is reported as any other
        try:
            write_pidfile(self._pidfile(member_id), handle)
        except OSError as exc:  # the member runs: find() still finds it by its environment
            _log.warning("pid file of %s not written: %s", member_id, exc)

    def find(self, member_id: str) -> dict[str, Any] | None:
        """The handle of the member's process if it still runs: the one in its pid file (pid and
        start time checked, as ``adopt`` does), else the session leader whose environment names
        that pid file (a controller that died before it wrote the file; module docstring)."""
        try:
            handle = json.loads(self._pidfile(member_id).read_text())
            if is_running(int(handle["pid"]), float(handle["create_time"]), START_TIME_TOLERANCE_S):
                return handle
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return self._find_by_mark(str(self._pidfile(member_id)))

    @staticmethod
    def _find_by_mark(mark: str) -> dict[str, Any] | None:
        """The handle of the live session leader started with ``LAUNCH_MARK_ENV=mark`` (the
        member: its own children inherit the mark but lead no session), None if there is none."""
        for proc, env in marked_processes():
            try:
                if env[LAUNCH_MARK_ENV] != mark or os.getsid(proc.pid) != proc.pid:
                    continue
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
            except (psutil.Error, OSError):
                continue  # gone meanwhile
            handle = pid_handle(proc.pid, env.get(LAUNCH_HOST_ENV) or None)
            if handle is not None:
                return handle
        return None

    def adopt(self, job_id: str, member_id: str, role: str, handle: dict[str, Any]) -> bool:
        """Track a running member started by an earlier launcher (see the module docstring)."""
        try:
            pid, created = int(handle["pid"]), float(handle["create_time"])
        except (KeyError, TypeError, ValueError):
            return False
        if not is_running(pid, created, START_TIME_TOLERANCE_S):
            return False
        started = start_time(pid)  # the check below holds it, not a wall-clock start of an old handle
        if started is None:
            return False
        with self._lock:
            current = self._members.get(member_id)
            if current is not None and current.proc.poll() is None:
                return current.proc.pid == pid
            host = handle.get("host")
            spec = MemberSpec(job_id, member_id, role, module="", env={},
                              host=host if isinstance(host, str) else None)
            self._members[member_id] = _Member(spec, _Adopted(pid, started), MemberState.RUNNING)
        return True

    def log_tail(self, member_id: str, lines: int = 20) -> str:
        return log_tail(str(self.log_dir / f"{member_id}.log"), lines)

    def was_warm(self, member_id: str) -> bool:
        m = self._members.get(member_id)
        return m is not None and m.warm

    def running(self, job_id: str | None = None) -> list[str]:
        with self._lock:  # a snapshot: relabel moves members between ids under the lock
            members = list(self._members.items())
        return [mid for mid, m in members if m.proc.poll() is None and (job_id is None or m.spec.job_id == job_id)]

    def close(self) -> None:
        """Stop every member and spare. The members are taken as processes, under the lock that
        refuses every later start and hand-over: a member relabelled meanwhile is stopped under its
        new id, never left running untracked (seen: a recovery keeping a rank while the
        controller stopped)."""
        with self._lock:
            self._closed = True
            spares, self._spares = self._spares, []
            members = [m for m in self._members.values() if m.proc.poll() is None]
        for spare in spares:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._release(spare)
        survivors = self._kill_members(members, expected=True)
        if survivors:
            _log.error("closing: %s survived SIGKILL", ", ".join(survivors))
        with self._lock:
            zygotes = [z for z in (self._zygote, *self._retired_zygotes) if z is not None]
            self._zygote, self._retired_zygotes = None, []
        for zygote in zygotes:
            zygote.close()
