"""The control-plane supervisor: lost services come back, hung ones are replaced, crash loops stop.

Real processes (``python -m http.server`` stands in for a service: it answers HTTP on its port,
so the hang probe sees it) — no infra needed, so these run in a second or two.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from support import eventually

from robustrl.ports import free_port
from robustrl.procs import start_time
from robustrl.supervisor import RestartPolicy, ServiceSpec, Supervisor, read_restarts


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.fixture
def supervised(tmp_path: Path) -> Iterator[tuple[Supervisor, threading.Event]]:
    (tmp_path / "logs").mkdir()
    port = free_port()
    spec = ServiceSpec(name="svc", module="http.server", args=["--bind", "127.0.0.1", str(port)],
                       health_url=f"http://127.0.0.1:{port}/")
    sup = Supervisor(tmp_path, [spec], os.environ,
                     RestartPolicy(backoff_s=0.05, backoff_max_s=0.2, max_restarts=3, window_s=60,
                                   hang_timeout_s=2.0))
    sup.spawn("svc")
    stop = threading.Event()
    thread = threading.Thread(target=sup.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield sup, stop
    finally:
        stop.set()
        thread.join()
        sup.stop_all(grace_s=2)


def test_backoff_doubles_up_to_the_cap_and_budget_is_per_window() -> None:
    policy = RestartPolicy(backoff_s=0.5, backoff_max_s=3.0, max_restarts=2, window_s=10)
    assert [policy.delay(n) for n in range(4)] == [0.5, 1.0, 2.0, 3.0]
    assert policy.allows([], now=100)
    assert policy.allows([95.0], now=100)
    assert not policy.allows([95.0, 99.0], now=100)
    assert policy.allows([85.0, 99.0], now=100)  # the older restart left the window


def test_killed_service_is_restarted_and_logged(supervised: tuple[Supervisor, threading.Event],
                                                tmp_path: Path) -> None:
    sup, _ = supervised
    first = sup.pids()["svc"]
    os.killpg(first, signal.SIGKILL)
    eventually(lambda: sup.pids()["svc"] != first and _alive(sup.pids()["svc"]), timeout=30,
               what="svc restarted")
    logged = read_restarts(tmp_path)
    assert [(r["service"], r["reason"], r["old_pid"], r["returncode"]) for r in logged] == [
        ("svc", "exit", first, -signal.SIGKILL)]
    assert logged[0]["new_pid"] == sup.pids()["svc"]


def test_stopped_service_is_judged_hung_and_replaced(supervised: tuple[Supervisor, threading.Event],
                                                     tmp_path: Path) -> None:
    sup, _ = supervised
    first = sup.pids()["svc"]
    # Wait until a probe has answered: before that a starting service gets the startup grace.
    eventually(lambda: sup.answered("svc"), timeout=30, what="first health answer")
    os.killpg(first, signal.SIGSTOP)
    eventually(lambda: sup.pids()["svc"] != first, timeout=40, what="hung svc replaced")
    assert not _alive(first), "the hung process was left behind"
    assert [r["reason"] for r in read_restarts(tmp_path)] == ["hang"]


def test_crash_loop_gives_up_after_the_budget(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    # A module that exits at once: every restart fails again.
    spec = ServiceSpec(name="bad", module="robustrl.no_such_module")
    sup = Supervisor(tmp_path, [spec], os.environ,
                     RestartPolicy(backoff_s=0.01, backoff_max_s=0.05, max_restarts=3, window_s=60,
                                   hang_timeout_s=0))
    sup.spawn("bad")
    stop = threading.Event()
    thread = threading.Thread(target=sup.run, args=(stop,), daemon=True)
    thread.start()
    try:
        eventually(lambda: "bad" in sup.given_up, timeout=60, what="supervisor gave up")
        logged = read_restarts(tmp_path)
        assert sum(1 for r in logged if not r.get("gave_up")) == 3
        assert logged[-1]["gave_up"] is True
    finally:
        stop.set()
        thread.join()


def test_paused_service_is_not_restarted(supervised: tuple[Supervisor, threading.Event], tmp_path: Path) -> None:
    sup, _ = supervised
    pid = sup.pids()["svc"]
    sup.pause("svc")
    os.killpg(pid, signal.SIGKILL)
    sup.procs["svc"].popen.wait(5)  # type: ignore[union-attr]
    # Several supervision rounds pass (each polls every 0.1 s); nothing may be restarted.
    for _ in range(5):
        sup.poll_once()
    assert sup.pids()["svc"] == pid and read_restarts(tmp_path) == []


def _copies(sup: Supervisor) -> list[int]:
    """Live processes running the service's command line (its port makes it unique)."""
    port = sup.specs["svc"].args[-1]
    return [p.pid for p in psutil.process_iter(["cmdline", "status"])
            if p.info["cmdline"] and "http.server" in p.info["cmdline"] and port in p.info["cmdline"]
            and p.info["status"] != psutil.STATUS_ZOMBIE]


def test_start_one_leaves_one_copy_even_after_supervision_restarted_the_service(
        supervised: tuple[Supervisor, threading.Event], tmp_path: Path) -> None:
    """Stack.start_service's race: the service crashed and a supervision round restarted it before
    the explicit start; the explicit start must replace that copy, not run beside it."""
    sup, _ = supervised
    first = sup.pids()["svc"]
    os.killpg(first, signal.SIGKILL)  # a crash, not paused: supervision restarts it
    restarted = eventually(lambda: (p := sup.pids()["svc"]) != first and _alive(p) and p, timeout=10,
                           interval=0.05, what="the supervisor's restart")
    pid = sup.start_one("svc")
    assert pid != restarted and not _alive(restarted)
    # (the scan can miss a process that has just started: suite14 once read no copy at all)
    assert sup.pids()["svc"] == pid
    eventually(lambda: _copies(sup) == [pid], timeout=5, interval=0.05, what="one copy, the one started")
    for _ in range(5):  # later rounds see nothing to restart
        sup.poll_once()
    assert sup.pids()["svc"] == pid and _copies(sup) == [pid]


def test_detached_supervisor_adopts_processes_it_did_not_start(tmp_path: Path) -> None:
    """``robustrl up`` hands its services to ``python -m robustrl.supervisor``: it restarts them too."""
    from robustrl.supervisor import write_handover

    (tmp_path / "logs").mkdir()
    port = free_port()
    spec = ServiceSpec(name="svc", module="http.server", args=["--bind", "127.0.0.1", str(port)])
    orphan = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    (tmp_path / "stack.json").write_text('{"pids": {}}')
    write_handover(tmp_path, [spec], {"svc": orphan.pid}, RestartPolicy(backoff_s=0.05, hang_timeout_s=0),
                   {"svc": start_time(orphan.pid)})
    sup = subprocess.Popen([sys.executable, "-m", "robustrl.supervisor", str(tmp_path)], start_new_session=True)
    try:
        os.killpg(orphan.pid, signal.SIGKILL)
        orphan.wait(5)
        restarted = eventually(lambda: read_restarts(tmp_path), timeout=40, what="adopted svc restarted")
        assert restarted[0]["old_pid"] == orphan.pid
        state = json.loads((tmp_path / "stack.json").read_text())
        new_pid = int(restarted[0]["new_pid"])
        assert state["pids"]["svc"] == new_pid
        assert state["starts"]["svc"] == start_time(new_pid)  # what down checks before a signal
    finally:
        sup.terminate()
        sup.wait(60)
    os.killpg(new_pid, signal.SIGKILL)


_SELF_FAULT_CHILD = """
import asyncio, sys, time
from robustrl.chaos.self_fault import schedule_self_fault
async def main():
    schedule_self_fault(sys.argv[1], float(sys.argv[2]))
    t0 = time.monotonic()
    await asyncio.sleep(3.0)  # the child's own life: the scheduled fault must land within it
    print(f"slept {time.monotonic() - t0:.2f}", flush=True)
asyncio.run(main())
"""


def test_self_fault_crash_kills_and_hang_freezes_then_wakes() -> None:
    """The controller's crash / hang through its own API: SIGKILL itself, or SIGSTOP with a waker."""
    crash = subprocess.run([sys.executable, "-c", _SELF_FAULT_CHILD, "crash", "0"], capture_output=True,
                           text=True, timeout=120)
    assert crash.returncode == -signal.SIGKILL and "slept" not in crash.stdout
    hang = subprocess.Popen([sys.executable, "-c", _SELF_FAULT_CHILD, "hang", "2"], stdout=subprocess.PIPE,
                            text=True)
    eventually(lambda: psutil.Process(hang.pid).status() == psutil.STATUS_STOPPED, timeout=60,
               what="child stopped itself")
    out, _ = hang.communicate(timeout=120)  # woken by the waker, it finishes its sleep
    assert hang.returncode == 0 and out.startswith("slept")


def test_a_stop_signal_that_lands_while_the_main_thread_holds_a_lock_still_stops_the_supervisor() -> None:
    """The worst moment for ``robustrl down``'s SIGTERM: a Python signal handler runs in the main
    thread between two bytecodes, which may be inside ``stop.wait`` (holding the event's lock) or
    inside ``Thread.start`` (holding the interpreter's list of threads). ``Event.set`` in the
    handler waited for the first forever (a detached supervisor was once found still running 20
    min after its ``down``). Here a real process takes SIGTERM while its main thread holds both
    locks: once it lets go, the stop must be set."""
    code = (
        "import os, signal, threading\n"
        "from robustrl.supervisor import set_on_signals\n"
        "stop = threading.Event()\n"
        "set_on_signals(stop, (signal.SIGTERM, signal.SIGINT))\n"
        "with stop._cond, threading._active_limbo_lock:\n"  # what Event.wait / Thread.start hold
        "    os.kill(os.getpid(), signal.SIGTERM)\n"  # its handler's moment comes at the next bytecode
        "print('stopped' if stop.wait(10) else 'not stopped', flush=True)\n")
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20, check=False)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError("the process hung: its signal handler waited for a lock its main thread held") from exc
    assert proc.returncode == 0 and proc.stdout.strip() == "stopped", (proc.returncode, proc.stdout, proc.stderr)
