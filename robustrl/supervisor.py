"""Supervision of the control plane in the local stack: a lost service is started again.

The controller, detector and request manager keep their state in Redis and JetStream and
resume after a restart (DESIGN section 4b); something must still start them again. Under
compose Docker does it (``restart: unless-stopped``); in the local stack (``robustrl up``,
``robustrl demo``, the tests and the benchmarks) this module does, the way a process
supervisor would:

* **exit**: a service whose process exited is started again after a backoff that doubles
  with each restart in the window (``RestartPolicy``); past ``max_restarts`` in ``window_s``
  it stays down and the supervisor says so (a crash loop must not spin);
* **hang**: a service whose ``/healthz`` probes all timed out for ``hang_timeout_s`` is killed
  and then restarted like an exit. A frozen process still completes the TCP handshake (the
  kernel does) but never answers; any HTTP answer, even a 503 while NATS is away, means its
  event loop runs, and a refused connection (nothing listening yet) is no evidence either.

Each restart is logged and appended as one JSON line to ``logs/supervisor.jsonl``. The
supervisor runs as a thread of the process that owns the stack, or, after ``robustrl up``
returns, as a detached process (``python -m robustrl.supervisor RUN_DIR``) that adopts the
running services by pid.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from robustrl.procs import is_running, start_time

log = logging.getLogger("robustrl.supervisor")

POLL_INTERVAL_S = 0.1
"""How often the supervisor looks at the processes (an exit is seen within this)."""
PROBE_INTERVAL_S = 1.0
"""How often each service's ``/healthz`` is asked."""
PROBE_TIMEOUT_S = 5.0
"""One health probe; longer than a service's own check timeout (a Redis ping, 2 s). Each service
has its own prober thread, so a frozen service's probes never delay another's."""
STALE_PROBE_SLACK_S = 2.0
"""A run of timed-out probes whose latest ended longer ago than interval + timeout + this is stale:
the prober is not running (its own process is starved), so it proves nothing about the service."""
STARTUP_GRACE_S = 30.0
"""A (re)started service that has not answered yet is judged hung only after this long: a
restarted controller re-adopts its members before its API answers."""
STOP_GRACE_S = 5.0
"""SIGTERM to SIGKILL when the stack stops a service."""
RESTART_LOG = "supervisor.jsonl"
PROBE_LOG = "supervisor-probes.log"
"""Failed health probes, one line each (why a service was judged hung)."""
SUPERVISOR_FILE = "supervisor.json"


@dataclass(frozen=True)
class RestartPolicy:
    """How a lost service is restarted.

    Attributes:
        backoff_s: delay before the first restart in a window; doubles with each further one.
        backoff_max_s: cap on that delay.
        max_restarts: restarts allowed per service within ``window_s``; one more and it stays down.
        window_s: the sliding window for ``max_restarts``.
        hang_timeout_s: no answer from ``/healthz`` for this long = hung (0 disables the probe).
            Longer than a 10 s SIGSTOP (the chaos ``hang``), which a service resumes from by
            itself, and than the event-loop stalls of a loaded 2-core machine.
    """

    backoff_s: float = 0.2
    backoff_max_s: float = 10.0
    max_restarts: int = 10
    window_s: float = 600.0
    hang_timeout_s: float = 20.0

    def delay(self, recent: int) -> float:
        """Backoff before a restart when ``recent`` restarts already happened in the window."""
        return float(min(self.backoff_max_s, self.backoff_s * (2 ** recent)))

    def allows(self, restarts_at: list[float], now: float) -> bool:
        """Whether one more restart fits the budget."""
        return sum(1 for t in restarts_at if now - t < self.window_s) < self.max_restarts


@dataclass
class ServiceSpec:
    """How to (re)start one service: module, log file, extra env and where it answers health."""

    name: str
    module: str
    env: dict[str, str] = field(default_factory=dict)
    health_url: str | None = None
    args: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RestartRecord:
    """One restart, as logged."""

    service: str
    reason: str  # "exit" | "hang"
    returncode: int | None
    old_pid: int
    new_pid: int
    restart: int
    backoff_s: float
    ts: float
    detail: str | None = None  # for a hang: the last probe's error


class _Proc:
    """A supervised process: our child (Popen) or adopted from another process (pid + start time)."""

    def __init__(self, pid: int, popen: subprocess.Popen[bytes] | None = None,
                 create_time: float | None = None) -> None:
        self.pid = pid
        self.popen = popen
        self.create_time = create_time  # seconds since boot (robustrl.procs)
        if create_time is None:  # taken now: our child just spawned, or the process adopted
            self.create_time = start_time(pid)

    def returncode(self) -> int | None:
        """None while running; the exit code (or -1 when unknown) once gone."""
        if self.popen is not None:
            return self.popen.poll()
        return None if is_running(self.pid, self.create_time) else -1


class Supervisor:
    """Starts the services, watches them, restarts the lost ones (see the module doc)."""

    def __init__(self, run_dir: Path, specs: list[ServiceSpec], base_env: Mapping[str, str],
                 policy: RestartPolicy | None = None,
                 on_change: Callable[[dict[str, int]], None] | None = None) -> None:
        self.run_dir = run_dir
        self.specs = {s.name: s for s in specs}
        self.base_env = dict(base_env)
        self.policy = policy or RestartPolicy()
        self.on_change = on_change
        self.procs: dict[str, _Proc] = {}
        self.restarts: list[RestartRecord] = []
        self.given_up: set[str] = set()
        self._restart_times: dict[str, list[float]] = {}
        self._pending: dict[str, tuple[float, float, str, int | None, int]] = {}  # (due, delay, reason, rc, pid)
        self._last_answer: dict[str, float] = {}
        self._answered: set[str] = set()  # answered since its last spawn
        # The current run of timed-out probes: (start of the first, end of the latest).
        self._timeouts: dict[str, tuple[float, float]] = {}
        self.last_probe_error: dict[str, str] = {}
        self._lock = threading.RLock()
        self._paused: set[str] = set()

    # --- processes --------------------------------------------------------------------------

    def spawn(self, name: str) -> int:
        spec = self.specs[name]
        env = {**self.base_env, **spec.env}
        with open(self.run_dir / "logs" / f"{name}.log", "ab") as out:
            popen = subprocess.Popen([sys.executable, "-m", spec.module, *spec.args], env=env, stdout=out,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        with self._lock:
            self.procs[name] = _Proc(popen.pid, popen)
            self._last_answer[name] = time.monotonic()
            self._answered.discard(name)
            self._timeouts.pop(name, None)
        return popen.pid

    def adopt(self, name: str, pid: int, started: float | None = None) -> None:
        """Watch a service started by another process (``robustrl up`` hands over to a detached
        supervisor). ``started`` (``robustrl.procs``), taken by the process that started it, names
        the process; without it, the one running under ``pid`` now is taken."""
        with self._lock:
            self.procs[name] = _Proc(pid, create_time=started)
            self._last_answer[name] = time.monotonic()
            self._answered.add(name)  # it was running before: no startup grace
            self._timeouts.pop(name, None)

    def pids(self) -> dict[str, int]:
        with self._lock:
            return {n: p.pid for n, p in self.procs.items()}

    def starts(self) -> dict[str, float | None]:
        """Each service's start as taken when it was spawned or adopted (``robustrl.procs``),
        beside ``pids``: a pid whose process is gone names no one once the file is read."""
        with self._lock:
            return {n: p.create_time for n, p in self.procs.items()}

    def exited(self) -> dict[str, int]:
        """Services whose process is gone right now: name -> exit code."""
        with self._lock:
            return {n: rc for n, p in self.procs.items() if (rc := p.returncode()) is not None}

    def pause(self, name: str) -> None:
        """Stop supervising ``name`` (the stack is stopping it on purpose)."""
        with self._lock:
            self._paused.add(name)
            self._pending.pop(name, None)

    def resume(self, name: str) -> None:
        with self._lock:
            self._paused.discard(name)

    def start_one(self, name: str) -> int:
        """Start ``name`` now as its only copy, whatever supervision did meanwhile: under the lock
        (no supervision round in between) any live process of it is killed first (a round may
        already have restarted it), the new one is spawned and recorded, then supervised again."""
        with self._lock:
            self._paused.add(name)
            self._pending.pop(name, None)
            proc = self.procs.get(name)
            if proc is not None and proc.returncode() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                _wait_gone(proc, STOP_GRACE_S)
            pid = self.spawn(name)
            self._paused.discard(name)
            return pid

    def stop_all(self, names: list[str] | None = None, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM each (in order), SIGKILL after ``grace_s``; they are not restarted."""
        for name in names or list(self.procs):
            self.pause(name)
            proc = self.procs.get(name)
            if proc is None or proc.returncode() is not None:
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
            if not _wait_gone(proc, grace_s):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                _wait_gone(proc, STOP_GRACE_S)

    # --- supervision ------------------------------------------------------------------------

    def poll_once(self, now: float | None = None) -> list[RestartRecord]:
        """One round: notice exits and hangs, start the services whose backoff is over."""
        now = time.monotonic() if now is None else now
        done: list[RestartRecord] = []
        with self._lock:
            for name, proc in list(self.procs.items()):
                if name in self._paused or name in self._pending or name in self.given_up:
                    continue
                rc = proc.returncode()
                if rc is not None:
                    self._schedule(name, now, "exit", rc, proc.pid)
                elif self._hung(name, now):
                    log.warning("supervisor: %s (pid %d): /healthz probes timed out for %.1f s (last: %s): "
                                "killing it", name, proc.pid, now - self._timeouts[name][0],
                                self.last_probe_error.get(name))
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    if proc.popen is not None:
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            proc.popen.wait(STOP_GRACE_S)
                    self._schedule(name, now, "hang", None, proc.pid)
            for name, (due, delay, reason, rc, old_pid) in list(self._pending.items()):
                if due > now:
                    continue
                del self._pending[name]
                new_pid = self.spawn(name)
                if self.on_change:
                    # Recorded (stack.json) before the restart is logged: whoever reads the log's
                    # new pid finds it in the stack file too (a full run read the file in between).
                    self.on_change(self.pids())
                times = self._restart_times.setdefault(name, [])
                times.append(now)
                rec = RestartRecord(service=name, reason=reason, returncode=rc, old_pid=old_pid, new_pid=new_pid,
                                    restart=len(times), backoff_s=round(delay, 3),
                                    ts=time.time(), detail=self.last_probe_error.get(name) if reason == "hang" else None)
                self.restarts.append(rec)
                done.append(rec)
                log.warning("supervisor: restarted %s (%s, rc=%s): pid %d -> %d (restart %d)", name, reason, rc,
                            old_pid, new_pid, rec.restart)
                with open(self.run_dir / "logs" / RESTART_LOG, "a") as fh:
                    fh.write(json.dumps(asdict(rec)) + "\n")
        return done

    def _schedule(self, name: str, now: float, reason: str, rc: int | None, old_pid: int) -> None:
        times = self._restart_times.setdefault(name, [])
        if not self.policy.allows(times, now):
            log.error("supervisor: %s lost (%s, rc=%s) after %d restarts in %.0f s: leaving it down", name, reason,
                      rc, len(times), self.policy.window_s)
            with open(self.run_dir / "logs" / RESTART_LOG, "a") as fh:
                fh.write(json.dumps({"service": name, "reason": reason, "returncode": rc, "gave_up": True,
                                     "ts": time.time()}) + "\n")
            # Recorded first: whoever sees the service given up (status, a test) finds the record.
            self.given_up.add(name)
            return
        recent = sum(1 for t in times if now - t < self.policy.window_s)
        delay = self.policy.delay(recent)
        self._pending[name] = (now + delay, delay, reason, rc, old_pid)

    def _hung(self, name: str, now: float) -> bool:
        if self.policy.hang_timeout_s <= 0 or self.specs[name].health_url is None:
            return False
        run = self._timeouts.get(name)
        if run is None:
            return False
        first, latest = run
        if now - latest > PROBE_INTERVAL_S + PROBE_TIMEOUT_S + STALE_PROBE_SLACK_S:
            # The prober itself has not run lately (this process starved of CPU): no evidence.
            return False
        limit = self.policy.hang_timeout_s if name in self._answered else max(
            STARTUP_GRACE_S, self.policy.hang_timeout_s)
        return latest - first >= limit

    def probe(self, name: str) -> bool:
        """Ask ``name``'s ``/healthz`` once. Any HTTP answer (even a 503 while NATS or Redis is
        away) means its event loop runs. Only a probe that *times out* is evidence of a hang: a
        frozen process still completes the TCP handshake (the kernel does) but never answers.
        A refused connection means nothing listens (starting, or running without its endpoint):
        not a hang, and an exit is seen by the process watch."""
        url = self.specs[name].health_url
        if url is None:
            return False
        started = time.monotonic()
        try:
            httpx.get(url, timeout=PROBE_TIMEOUT_S)
        except httpx.TimeoutException as exc:
            self.last_probe_error[name] = f"{type(exc).__name__}: {exc}"[:200]
            self._log_probe(name)
            with self._lock:
                first = self._timeouts.get(name, (started, started))[0]
                self._timeouts[name] = (first, time.monotonic())
            return False
        except Exception as exc:  # noqa: BLE001 - whatever the probe hits, the prober lives on
            self.last_probe_error[name] = f"{type(exc).__name__}: {exc}"[:200]
            self._log_probe(name)
            with self._lock:
                self._timeouts.pop(name, None)  # no evidence of a hang
            return False
        with self._lock:
            self._last_answer[name] = time.monotonic()
            self._answered.add(name)
            self._timeouts.pop(name, None)
        return True

    def _log_probe(self, name: str) -> None:
        with contextlib.suppress(OSError), open(self.run_dir / "logs" / PROBE_LOG, "a") as fh:
            fh.write(f"{time.time():.3f} {name} {self.last_probe_error.get(name)}\n")

    def answered(self, name: str) -> bool:
        """Whether ``name`` has answered a health probe since it was last (re)started."""
        with self._lock:
            return name in self._answered

    def _probe_loop(self, name: str, stop: threading.Event) -> None:
        while not stop.is_set():
            self.probe(name)
            stop.wait(PROBE_INTERVAL_S)

    def run(self, stop: threading.Event) -> None:
        """Supervise until ``stop`` is set (one prober thread per service with a health URL)."""
        if self.policy.hang_timeout_s > 0:
            for name, spec in self.specs.items():
                if spec.health_url is not None:
                    threading.Thread(target=self._probe_loop, args=(name, stop), name=f"probe-{name}",
                                     daemon=True).start()
        while not stop.is_set():
            try:
                self.poll_once()
            except Exception:  # one bad round must not end supervision
                log.exception("supervision round failed")
            stop.wait(POLL_INTERVAL_S)


def _wait_gone(proc: _Proc, timeout: float) -> bool:
    if proc.popen is not None:
        try:
            proc.popen.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.returncode() is not None:
            return True
        time.sleep(POLL_INTERVAL_S)
    return False


def read_restarts(run_dir: Path | str) -> list[dict[str, object]]:
    """The restarts logged under ``run_dir`` (``logs/supervisor.jsonl``), oldest first."""
    path = Path(run_dir) / "logs" / RESTART_LOG
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# --- detached mode (``robustrl up``) -----------------------------------------------------------


def write_handover(run_dir: Path, specs: list[ServiceSpec], pids: dict[str, int], policy: RestartPolicy,
                   starts: dict[str, float | None]) -> None:
    """What a detached supervisor needs (no secrets: those come in its environment); ``starts``
    as the handing supervisor took them (``Supervisor.starts``)."""
    path = run_dir / SUPERVISOR_FILE
    path.write_text(json.dumps({"specs": [asdict(s) for s in specs], "pids": pids, "starts": starts,
                                "policy": asdict(policy)}))
    path.chmod(0o600)


def set_on_signals(stop: threading.Event, signals: tuple[int, ...]) -> None:
    """Set ``stop`` when one of ``signals`` comes (main thread only; the process's wakeup fd is
    taken). Nothing is done in a Python handler: it runs in the main thread between two
    bytecodes, which may hold a lock the handler needs -- ``stop.wait`` holds the event's, and
    ``Event.set`` there waited for it forever (reproduced; the likely cause of a detached
    supervisor that ignored ``robustrl down``'s SIGTERM). The interpreter's C handler writes the
    signal's number to a pipe instead, and a thread reading it sets ``stop``."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    wanted = set(signals)

    def watch() -> None:
        while not wanted.intersection(os.read(read_fd, 64)):
            pass
        stop.set()

    threading.Thread(target=watch, name="stop-on-signal", daemon=True).start()
    signal.set_wakeup_fd(write_fd)
    for sig in signals:
        signal.signal(sig, lambda *_: None)  # caught (not the default action); the pipe carries it


def main(argv: list[str]) -> None:
    """``python -m robustrl.supervisor RUN_DIR``: adopt the services recorded there and supervise them."""
    from robustrl.stack import update_pids

    run_dir = Path(argv[0]).resolve()
    raw = json.loads((run_dir / SUPERVISOR_FILE).read_text())
    specs = [ServiceSpec(**s) for s in raw["specs"]]
    sup = Supervisor(run_dir, specs, os.environ, RestartPolicy(**raw["policy"]),
                     on_change=lambda pids: update_pids(run_dir, pids, sup.starts()))
    starts = raw.get("starts", {})
    for name, pid in raw["pids"].items():
        sup.adopt(name, int(pid), starts.get(name))
    stop = threading.Event()
    set_on_signals(stop, (signal.SIGTERM, signal.SIGINT))
    sup.run(stop)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s supervisor %(levelname)s: %(message)s")
    main(sys.argv[1:])
