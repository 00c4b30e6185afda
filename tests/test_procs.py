"""A process is named by its pid and its start, and no clock step may change which one that is.

/proc/stat's boot time is "now minus uptime" rounded to a second, recomputed on every read: when
NTP slews or steps the wall clock, it moves by a second, and so does every wall-clock process
start derived from it (psutil's ``create_time``). The CI run of stop 27 lost this way: the
detached supervisor read its live services as exited and started second copies, ``down`` left
the first ones running, and a live infra read as all dead. Here the step is made where the
wall-clock start comes from (psutil's boot-time read); every identity check must still hold.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
import pytest
from psutil import _pslinux

from robustrl.config import Settings
from robustrl.infra.embedded import EmbeddedInfra
from robustrl.launcher.local import LocalLauncher
from robustrl.launcher.spare import pid_handle
from robustrl import procs
from robustrl.procs import is_running, start_time
from robustrl.stack import STACK_FILE, stop_detached
from robustrl.supervisor import ServiceSpec, Supervisor
from robustrl.testbed.state import process_alive

from support import eventually


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _step_the_clock(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """What an NTP step does to /proc/stat's btime, as psutil reads it."""
    real = _pslinux.boot_time
    monkeypatch.setattr(_pslinux, "boot_time", lambda: real() + seconds)


@pytest.mark.parametrize("step_s", [1.0, -1.0])
def test_a_clock_step_leaves_every_live_process_alive(infra: Settings, sleeper, tmp_path,
                                                       monkeypatch: pytest.MonkeyPatch, step_s: float) -> None:
    handle = pid_handle(sleeper.pid)
    assert handle is not None
    started = start_time(sleeper.pid)
    sup = Supervisor(tmp_path, [ServiceSpec("svc", "robustrl.no_such_module")], os.environ)
    sup.adopt("svc", sleeper.pid)  # as a detached supervisor adopts what ``up`` started
    assert sup.exited() == {}
    wall_start = psutil.Process(sleeper.pid).create_time()
    _step_the_clock(monkeypatch, step_s)
    assert psutil.Process(sleeper.pid).create_time() - wall_start == pytest.approx(step_s)  # the step took
    # The servers of this session, attached from their infra.json as ``robustrl down`` does.
    assert EmbeddedInfra.load(infra.run_dir).alive() == {"nats": True, "redis": True, "s3": True}
    assert sup.exited() == {}, "a live service read as exited: a second copy would be started"
    assert LocalLauncher(tmp_path / "members").adopt("j", "j--rollout-0-i0", "rollout", handle) is True
    assert process_alive(sleeper.pid, started)
    assert is_running(sleeper.pid, started)


def test_a_recycled_ended_or_zombie_pid_is_not_the_process(sleeper) -> None:
    started = start_time(sleeper.pid)
    assert started is not None and is_running(sleeper.pid, started)
    assert not is_running(sleeper.pid, started + 0.5)  # another start: a recycled pid
    assert not process_alive(sleeper.pid, started - 0.5)
    os.kill(sleeper.pid, signal.SIGKILL)
    eventually(lambda: psutil.Process(sleeper.pid).status() == psutil.STATUS_ZOMBIE, timeout=10,
               what="the unreaped child is a zombie")
    assert not is_running(sleeper.pid, started) and not is_running(sleeper.pid, None)
    assert start_time(sleeper.pid) == started  # a zombie keeps its start; it is still not running
    sleeper.wait()
    assert start_time(sleeper.pid) is None and not is_running(sleeper.pid, None)


def test_starts_recorded_as_wall_clock_time_before_an_upgrade_still_name_their_process(
        infra: Settings, sleeper, tmp_path) -> None:
    """Records written by the previous release hold psutil's wall-clock start (an ``infra.json``,
    a member handle in Redis or a pid file): a ``down``, a controller taking over, must still know
    their processes, and still refuse a recycled pid."""
    wall = psutil.Process(sleeper.pid).create_time()
    old_handle = {"pid": sleeper.pid, "create_time": wall}
    assert is_running(sleeper.pid, wall) and not is_running(sleeper.pid, wall + 5.0)
    assert LocalLauncher.same_process(old_handle, pid_handle(sleeper.pid) or {})
    assert not LocalLauncher.same_process({"pid": sleeper.pid, "create_time": wall - 5.0}, pid_handle(sleeper.pid) or {})
    launcher = LocalLauncher(tmp_path / "members")
    assert launcher.adopt("j", "j--rollout-0-i0", "rollout", old_handle) is True
    assert launcher.running() == ["j--rollout-0-i0"]
    old_infra = EmbeddedInfra.load(infra.run_dir)
    old_infra.records = [dataclasses.replace(r, create_time=psutil.Process(r.pid).create_time())
                         for r in old_infra.records]
    assert old_infra.alive() == {"nats": True, "redis": True, "s3": True}


def test_down_kills_a_service_that_ignores_sigterm_and_never_signals_a_pid_that_names_another_process(
        tmp_path) -> None:
    """``robustrl down`` on a ``stack.json``: a service still running past its grace is killed;
    a recorded pid whose start is not the recorded one (a stale file: the pid is another
    process's now) gets no signal at all."""
    stubborn = _stubborn()
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        pids = {"controller": stubborn.pid, "detector": bystander.pid, "request_manager": bystander.pid}
        starts = {"controller": start_time(stubborn.pid), "detector": (start_time(bystander.pid) or 0) - 30.0,
                  "request_manager": None}  # gone when the file was written: its pid names no one
        (tmp_path / STACK_FILE).write_text(json.dumps({"pids": pids, "starts": starts}))
        stopped = stop_detached(tmp_path)
        assert "controller (killed past its grace)" in stopped
        assert "detector" not in stopped and "request_manager" not in stopped
        assert not is_running(stubborn.pid, starts["controller"])  # reaped by down's wait, or a zombie
        assert bystander.poll() is None, "a pid naming another process was signalled"
    finally:
        for proc in (stubborn, bystander):
            proc.kill()
            proc.wait()


def _stubborn() -> subprocess.Popen[bytes]:
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(120)"
    proc = subprocess.Popen([sys.executable, "-c", code],
                            stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    return proc


def test_down_on_a_stack_file_of_the_previous_release_stops_its_services_but_kills_none(
        sleeper, tmp_path) -> None:
    """A ``stack.json`` without starts names its processes by pid alone: they get SIGTERM as
    before, and no SIGKILL (a pid it names may be another process's by now)."""
    stubborn = _stubborn()
    try:
        started = {p.pid: start_time(p.pid) for p in (stubborn, sleeper)}
        (tmp_path / STACK_FILE).write_text(json.dumps({"pids": {"controller": stubborn.pid, "detector": sleeper.pid}}))
        stopped = stop_detached(tmp_path)
        assert stopped == ["controller", "detector"]
        assert not is_running(sleeper.pid, started[sleeper.pid])  # SIGTERM
        assert is_running(stubborn.pid, started[stubborn.pid])  # ignored SIGTERM, never killed
    finally:
        stubborn.kill()
        stubborn.wait()


def test_a_member_adopted_from_an_old_handle_stays_running_across_a_clock_step(
        sleeper, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Adopted from a wall-clock handle (the previous release's), a member is then followed by
    its start since boot: a later step of the wall clock must not end it."""
    wall = psutil.Process(sleeper.pid).create_time()
    launcher = LocalLauncher(tmp_path / "members")
    assert launcher.adopt("j", "j--rollout-0-i0", "rollout", {"pid": sleeper.pid, "create_time": wall}) is True
    real = time.time
    monkeypatch.setattr(procs, "time", SimpleNamespace(time=lambda: real() + 1.3, clock_gettime=time.clock_gettime,
                                                       CLOCK_BOOTTIME=time.CLOCK_BOOTTIME))
    assert launcher.running() == ["j--rollout-0-i0"], "a live member read as ended after a clock step"
    assert launcher.poll() == []
