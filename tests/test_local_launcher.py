"""The local launcher's warm spares, with real processes: a member handed to a spare runs in it
(same pid and process group the launcher tracks), with its own environment and log, and the
spare is restocked afterwards."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from support import ended, eventually

from robustrl.launcher import local
from robustrl.launcher.base import MemberSpec
from robustrl.launcher.local import LAUNCH_MARK_ENV, LocalLauncher
from robustrl.launcher.zygote import FORK_START_ENV, ZYGOTE_MODULE
from robustrl.procs import proc_stat, start_time

pytestmark = pytest.mark.timeout(90)
TESTS = Path(__file__).resolve().parent


@pytest.mark.parametrize("fork", [False, True], ids=["cold-spare", "forked-spare"])
def test_a_member_started_from_a_warm_spare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fork: bool) -> None:
    monkeypatch.setattr(local, "SPARE_RESTOCK_DELAY_S", 0.1)
    monkeypatch.setattr(local, "SPARE_TARGETS", frozenset({"spare_probe"}))
    # The controller dies right after handing the spare its order: the launcher writes no pid file.
    monkeypatch.setattr(LocalLauncher, "_write_pidfile", lambda *args, **kwargs: None)
    launcher = LocalLauncher(tmp_path, base_env={**os.environ, "PYTHONPATH": str(TESTS),
                                                 FORK_START_ENV: "1" if fork else "0"})
    try:
        launcher.keep_spares(1)
        # (forked: the spare comes once the zygote has done its imports)
        (spare,) = eventually(lambda: list(launcher._spares), timeout=60, what="a spare started")
        eventually(lambda: b"ready" in (tmp_path / "spare-1.log").read_bytes(), timeout=60,
                   what="spare imported the member code")
        launcher.start(MemberSpec(job_id="j", member_id="j--rollout-0-i0", role="rollout",
                                  module="spare_probe", env={"ROBUSTRL_MEMBER_ID": "rollout-0-i0"},
                                  args=("--x", "1")))
        assert launcher.spares_used == 1 and launcher.pid("j--rollout-0-i0") == spare.pid
        # forked: the zygote's child; cold: this process's (a fallback to cold would fail here)
        assert (psutil.Process(spare.pid).ppid() != os.getpid()) == fork
        assert launcher.was_warm("j--rollout-0-i0")
        exits = eventually(launcher.poll, timeout=30, what="probe exited")
        assert [(e.member_id, e.returncode, e.expected) for e in exits] == [("j--rollout-0-i0", 3, False)]
        log = (tmp_path / "j--rollout-0-i0.log").read_text()
        assert f"probe pid={spare.pid} member=rollout-0-i0 argv=['--x', '1']" in log
        # The spare wrote its own handle before it ran the member, for find() after a takeover.
        assert json.loads((tmp_path / "j--rollout-0-i0.pid").read_text())["pid"] == spare.pid
        # restocked after the delay: a new spare process
        eventually(lambda: [p.pid for p in launcher._spares if p.poll() is None and p.pid != spare.pid],
                   timeout=10, what="spare restocked")
        # a module a spare does not preload starts cold
        launcher.start(MemberSpec(job_id="j", member_id="j--other", role="rollout", module="platform"))
        assert launcher.spares_used == 1 and not launcher.was_warm("j--other")
        # and so does a member asked cold (its slot's start from a spare failed), a spare ready
        ready = [p.pid for p in launcher._spares if p.poll() is None]
        launcher.start(MemberSpec(job_id="j", member_id="j--rollout-0-i1", role="rollout", module="spare_probe",
                                  cold=True))
        assert launcher.spares_used == 1 and not launcher.was_warm("j--rollout-0-i1")
        assert launcher.pid("j--rollout-0-i1") not in ready and [p.pid for p in launcher._spares] == ready
        # a new interpreter, this process's child: no fork of the zygote the spares come from
        assert psutil.Process(launcher.pid("j--rollout-0-i1")).ppid() == os.getpid()  # type: ignore[arg-type]
        launcher.keep_spares(0)
        assert launcher._spares == []
    finally:
        launcher.close()


def test_a_new_launcher_adopts_a_running_member_and_only_that_process(tmp_path: Path) -> None:
    """After a controller restart: the member is re-attached by pid and start time (a recycled pid
    has another start time), then stopped, killed and polled like one started here."""
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    first = LocalLauncher(tmp_path, base_env=env)
    first.start(MemberSpec(job_id="j", member_id="j--a", role="rollout", module="idle_member"))
    first.start(MemberSpec(job_id="j", member_id="j--b", role="rollout", module="idle_member"))
    handle_a, handle_b = first.handle("j--a"), first.handle("j--b")
    assert handle_a and handle_b
    second = LocalLauncher(tmp_path, base_env=env)
    try:
        assert second.adopt("j", "j--a", "rollout", {**handle_a, "create_time": handle_a["create_time"] - 30}) is False
        assert second.adopt("j", "j--a", "rollout", {"pid": 2**22 + 7, "create_time": 0.0}) is False
        assert second.adopt("j", "j--a", "rollout", handle_a) is True
        assert second.adopt("j", "j--b", "rollout", handle_b) is True
        assert second.pid("j--a") == handle_a["pid"] and sorted(second.running()) == ["j--a", "j--b"]
        second.kill("j--a", expected=False)  # not our child: no waitpid, the exit is still seen
        second.stop("j--b", grace_s=5.0)
        exits = {e.member_id: (e.returncode, e.expected) for e in eventually(second.poll, timeout=10, what="exits")}
        assert exits["j--a"] == (None, False)
        exits.update({e.member_id: (e.returncode, e.expected) for e in second.poll()})
        assert exits["j--b"] == (None, True)
        assert second.running() == []
    finally:
        second.close()
        first.close()


def test_find_locates_a_member_whose_pid_file_was_never_written(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The controller died between the member's start and the write of its pid file: a new
    launcher still finds that very process (by the mark in its environment), never the member's
    child (it inherits the mark but leads no session), nor a member of another launcher's
    directory; once the member is gone, its orphaned child is not taken for it."""
    env = {**os.environ, "PYTHONPATH": str(TESTS), FORK_START_ENV: "0"}  # a cold start's mark
    monkeypatch.setattr(LocalLauncher, "_write_pidfile", lambda *args, **kwargs: None)
    first = LocalLauncher(tmp_path, base_env=env)
    member = "j--rollout-1-i1"
    first.start(MemberSpec(job_id="j", member_id=member, role="rollout", module="forking_member"))
    pid = first.pid(member)
    assert pid is not None
    try:
        (child,) = eventually(lambda: psutil.Process(pid).children(), timeout=30, what="the member's child")
        assert not (tmp_path / f"{member}.pid").exists()
        second = LocalLauncher(tmp_path, base_env=env)
        handle = second.find(member)
        assert handle == {"pid": pid, "create_time": start_time(pid)}
        assert str(tmp_path / f"{member}.pid") in child.environ().values()  # the child has the mark too
        assert second.find("j--rollout-2-i1") is None  # never started
        assert LocalLauncher(tmp_path / "other", base_env=env).find(member) is None  # another launcher's dir
        assert second.adopt("j", member, "rollout", handle) is True and second.pid(member) == pid
        os.kill(pid, signal.SIGKILL)  # the member alone: its child lives on, with the mark
        eventually(lambda: second.poll(), timeout=10, what="the member's exit")
        assert child.is_running() and second.find(member) is None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)  # the member's group: its child too
        first.close()


def test_stopping_a_stack_kills_the_members_its_controller_left_and_nothing_else(tmp_path):
    """A controller killed (or frozen) before it stopped its members leaves them orphaned: the
    stack's stop finds them by the launch mark under its own run dir; a process marked under
    another run dir is not touched."""
    import subprocess
    import sys

    from robustrl.launcher.local import LAUNCH_MARK_ENV
    from robustrl.stack import sweep_members

    def marked(run_dir):
        (run_dir / "logs").mkdir(parents=True)
        env = {**os.environ, LAUNCH_MARK_ENV: str(run_dir / "logs" / "j--rollout-0-i0.pid")}
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env,
                                start_new_session=True)

    ours, other = marked(tmp_path / "ours"), marked(tmp_path / "other")
    try:
        eventually(lambda: LAUNCH_MARK_ENV in psutil.Process(ours.pid).environ(), timeout=10, interval=0.05,
                   what="the marked process started")
        assert sweep_members(tmp_path / "ours") == [ours.pid]
        assert ours.wait(timeout=10) == -signal.SIGKILL
        assert other.poll() is None
    finally:
        for p in (ours, other):
            p.kill()
            p.wait()


# --- the fork server (ROBUSTRL_FORK_START=1, robustrl.launcher.zygote) ---------------------------

def _zygotes(parent: int | None = None) -> list[psutil.Process]:
    """The zygote processes started by ``parent`` (this process by default), from /proc."""
    return [p for p in psutil.Process(parent).children() if ZYGOTE_MODULE in " ".join(p.cmdline())]


def _forking_launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> LocalLauncher:
    monkeypatch.setattr(local, "SPARE_TARGETS", frozenset({"spare_probe", "idle_member"}))
    return LocalLauncher(tmp_path, base_env={**os.environ, "PYTHONPATH": str(TESTS), FORK_START_ENV: "1"})


def test_a_forked_member_leads_its_own_session_and_its_exit_is_reported_as_a_cold_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Members forked from the zygote: each is the zygote's child (not a new interpreter), leads
    its own session and process group, carries the stack's sweep mark, writes its pid file, gets
    its own environment, arguments and log, and its exit code (or signal) reaches ``poll``."""
    launcher = _forking_launcher(tmp_path, monkeypatch)
    try:
        idle = {mid: MemberSpec(job_id="j", member_id=mid, role="rollout", module="idle_member")
                for mid in ("j--b", "j--c")}
        for spec in idle.values():
            launcher.start(spec)
        (zygote,) = _zygotes()
        for mid in idle:
            pid = launcher.pid(mid)
            assert pid is not None
            proc = psutil.Process(pid)
            assert proc.ppid() == zygote.pid and os.getsid(pid) == pid and os.getpgid(pid) == pid
            assert proc.environ()[LAUNCH_MARK_ENV].startswith(str(tmp_path))  # swept by a stack's stop
            assert json.loads((tmp_path / f"{mid}.pid").read_text())["pid"] == pid
        launcher.start(MemberSpec(job_id="j", member_id="j--a", role="rollout", module="spare_probe",
                                  env={"ROBUSTRL_MEMBER_ID": "a"}, args=("--x", "1")))
        probe = launcher.pid("j--a")
        # its graceful exit (0) is what is checked: stopped only once it waits for SIGTERM
        eventually(lambda: "idle ready" in (tmp_path / "j--b.log").read_text(), timeout=30,
                   what="j--b waits for SIGTERM")
        launcher.stop("j--b", grace_s=30.0)  # (a forked exit under load took over 5 s once)
        launcher.kill("j--c", expected=False)
        exits: dict[str, tuple[int | None, bool]] = {}

        def all_exits() -> bool:
            exits.update({e.member_id: (e.returncode, e.expected) for e in launcher.poll()})
            return len(exits) == 3

        eventually(all_exits, timeout=30, what="three exits reported")
        assert exits == {"j--a": (3, False), "j--b": (0, True), "j--c": (-signal.SIGKILL, False)}
        assert f"probe pid={probe} member=a argv=['--x', '1']" in (tmp_path / "j--a.log").read_text()
        assert not launcher.was_warm("j--a") and launcher.spares_used == 0  # a fork is not a warm spare
        # Their exits recorded, the zygote (still running) has reaped them: no zombie kept.
        pids = {"j--b": launcher.pid("j--b"), "j--c": launcher.pid("j--c"), "j--a": probe}
        assert zygote.is_running() and zygote.status() != psutil.STATUS_ZOMBIE
        eventually(lambda: all(p is not None and proc_stat(p) is None for p in pids.values()), timeout=10,
                   what=f"the zygote reaped {pids} once their exits were recorded")
    finally:
        launcher.close()
    eventually(lambda: not _zygotes(), timeout=10, what="the zygote gone with its launcher")


def test_members_outlive_a_lost_zygote_and_later_members_still_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The zygote SIGKILLed: its member runs on; that member's exit is still seen (its code is
    unknown now, as for an adopted member), and the next member starts (from a new zygote or
    cold)."""
    launcher = _forking_launcher(tmp_path, monkeypatch)
    try:
        launcher.start(MemberSpec(job_id="j", member_id="j--a", role="rollout", module="idle_member"))
        pid = launcher.pid("j--a")
        assert pid is not None
        (zygote,) = _zygotes()
        zygote.kill()
        zygote.wait(10)
        assert psutil.Process(pid).status() != psutil.STATUS_ZOMBIE and launcher.running() == ["j--a"]
        os.killpg(pid, signal.SIGKILL)
        exits = eventually(launcher.poll, timeout=10, what="the exit of the lost zygote's member")
        assert [(e.member_id, e.returncode, e.expected) for e in exits] == [("j--a", None, False)]
        launcher.start(MemberSpec(job_id="j", member_id="j--b", role="rollout", module="idle_member"))
        assert launcher.running() == ["j--b"]
        launcher.stop("j--b", grace_s=30.0)  # (a forked exit under load took over 5 s once)
        assert [(e.member_id, e.expected) for e in eventually(launcher.poll, timeout=10, what="j--b")] == [("j--b", True)]
    finally:
        launcher.close()


LAUNCHER_THAT_DIES = """
import json, os, signal, sys
from pathlib import Path
from robustrl.launcher import local
from robustrl.launcher.base import MemberSpec
local.SPARE_TARGETS = frozenset({"idle_member"})
launcher = local.LocalLauncher(Path(sys.argv[1]), base_env=dict(os.environ))
launcher.start(MemberSpec(job_id="j", member_id="j--a", role="rollout", module="idle_member"))
print(json.dumps({"member": launcher.pid("j--a")}), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_launcher_killed_leaves_its_forked_members_running_and_its_zygote_exits(tmp_path: Path) -> None:
    """A controller SIGKILLed: its zygote sees the control socket close and exits; the member it
    forked runs on, and a new launcher finds it (pid file) and adopts it, as a cold member."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(TESTS), FORK_START_ENV: "1"}
    run = subprocess.run([sys.executable, "-c", LAUNCHER_THAT_DIES, str(tmp_path)], env=env, capture_output=True,
                         timeout=120)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    pid = json.loads(run.stdout)["member"]
    try:
        # (a forked member shows the zygote's command line and environment: only the pid tells)
        def zygotes() -> list[int]:
            found = []
            for p in psutil.process_iter(["cmdline"]):
                try:
                    if (ZYGOTE_MODULE in " ".join(p.info["cmdline"] or []) and p.pid != pid
                            and str(tmp_path) in p.environ().get(LAUNCH_MARK_ENV, "")):
                        found.append(p.pid)
                except (psutil.Error, ProcessLookupError):  # gone between the listing and the read
                    continue
            return found
        eventually(lambda: not zygotes(), timeout=10, what="the orphaned zygote exited")
        assert psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        second = LocalLauncher(tmp_path, base_env={**os.environ, "PYTHONPATH": str(TESTS)})
        handle = second.find("j--a")
        assert handle is not None and handle["pid"] == pid
        assert second.adopt("j", "j--a", "rollout", handle) and second.running() == ["j--a"]
        second.kill("j--a", expected=True)
        assert ended(pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def test_a_zygote_whose_launcher_is_gone_exits_without_an_interpreter_teardown(tmp_path: Path) -> None:
    """The zygote's exit once its control socket closes costs next to no CPU: the CPU time it used
    from the close to its end (its rusage at the reap against its CPU time before the close) is
    under 0.2 s. A full interpreter teardown of torch and transformers took about 1.3 s of CPU,
    which a loaded machine stretched past the 10 s the test above gives the orphan (CI). Measured
    in CPU time, not wall time: the load on the machine does not decide it."""
    from zygote_reaper import start_zygote

    zygote, ours = start_zygote(tmp_path)
    try:
        assert json.loads(ours.recv(4096)) == {"ready": zygote.pid}
        before = psutil.Process(zygote.pid).cpu_times()
        ours.close()
        _, status, usage = os.wait4(zygote.pid, 0)
        zygote.returncode = os.waitstatus_to_exitcode(status)
        spent = usage.ru_utime + usage.ru_stime - (before.user + before.system)
        assert zygote.returncode == 0, (tmp_path / "zygote.log").read_text()[-2000:]
        assert spent < 0.2, f"the zygote's exit took {spent:.2f} s of CPU"
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            zygote.kill()
            zygote.wait(10)


def test_a_kill_right_after_a_forked_start_is_not_lost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher signals a member's process group: a start is answered only once the fork
    leads its own group, so a SIGKILL sent the moment ``start`` returns ends the member (it used
    to find no group yet, and the member ran on: "survived SIGKILL")."""
    launcher = _forking_launcher(tmp_path, monkeypatch)
    try:
        for i in range(5):
            mid = f"j--k{i}"
            launcher.start(MemberSpec(job_id="j", member_id=mid, role="rollout", module="idle_member"))
            pid = launcher.pid(mid)
            assert pid is not None and psutil.Process(pid).ppid() != os.getpid()  # forked
            launcher.kill(mid, expected=True)
            stat = proc_stat(pid)  # gone, or a zombie until the zygote has the launcher's "reap"
            assert stat is None or stat[0] == b"Z", stat
        exits: dict[str, int | None] = {}

        def five() -> bool:
            exits.update({e.member_id: e.returncode for e in launcher.poll()})
            return len(exits) == 5

        eventually(five, timeout=10, what="five exits")
        assert exits == {f"j--k{i}": -signal.SIGKILL for i in range(5)}
    finally:
        launcher.close()


def test_a_stopped_zygote_does_not_keep_an_ended_member_running(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The zygote frozen (SIGSTOP) cannot reap or report: a member killed meanwhile still counts
    as ended within the report grace (code unknown), a kill of another returns, and the next start
    does not hang on the frozen zygote (it starts cold within the fork-reply bound)."""
    from robustrl.launcher.zygote import EXIT_REPORT_GRACE_S, FORK_REPLY_S

    launcher = _forking_launcher(tmp_path, monkeypatch)
    zygote = None
    try:
        for mid in ("j--a", "j--b"):
            launcher.start(MemberSpec(job_id="j", member_id=mid, role="rollout", module="idle_member"))
        (zygote,) = _zygotes()
        zygote.suspend()
        pid_a = launcher.pid("j--a")
        assert pid_a is not None
        os.killpg(pid_a, signal.SIGKILL)  # a crash the zygote cannot report
        exits = eventually(launcher.poll, timeout=EXIT_REPORT_GRACE_S + 5, what="the crash seen")
        assert [(e.member_id, e.returncode) for e in exits] == [("j--a", None)]
        launcher.kill("j--b", expected=True)  # returns: no "survived SIGKILL"
        began = time.monotonic()
        launcher.start(MemberSpec(job_id="j", member_id="j--c", role="rollout", module="idle_member"))
        assert time.monotonic() - began < FORK_REPLY_S + 5
        assert launcher.running() == ["j--c"]
    finally:
        if zygote is not None:
            with contextlib.suppress(psutil.Error):
                zygote.resume()
        launcher.close()


def test_a_zygote_given_up_still_reports_the_exits_of_the_members_it_forked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A zygote given up (here: counted as refusing forks) while a member it forked runs forks no
    more (the next member starts cold) but goes on reaping that member: its exit code reaches
    ``poll`` (closing the zygote at once turned every such exit into an unknown code)."""
    launcher = _forking_launcher(tmp_path, monkeypatch)
    try:
        launcher.start(MemberSpec(job_id="j", member_id="j--a", role="rollout", module="idle_member"))
        (zygote,) = _zygotes()
        launcher._zygote.failures = local.ZYGOTE_MAX_REFUSALS  # as after three refused forks
        launcher.start(MemberSpec(job_id="j", member_id="j--b", role="rollout", module="idle_member"))
        pid_b = launcher.pid("j--b")
        assert pid_b is not None and psutil.Process(pid_b).ppid() == os.getpid()  # cold now
        assert zygote.is_running()  # kept: it still has a member to reap
        launcher.kill("j--a", expected=False)
        exits = eventually(launcher.poll, timeout=10, what="j--a's exit")
        assert [(e.member_id, e.returncode) for e in exits] == [("j--a", -signal.SIGKILL)]
        # No call into the launcher from here: the zygote stops on its last member's exit, not on
        # the launcher's next start (which looked once, could look between the exit being recorded
        # and the member leaving the zygote's books, and kept it for good: CI's failure).
        eventually(lambda: not zygote.is_running() or zygote.status() == psutil.STATUS_ZOMBIE, timeout=15,
                   what="the given-up zygote stopped once its last member ended")
        launcher.start(MemberSpec(job_id="j", member_id="j--c", role="rollout", module="idle_member"))
        assert sorted(launcher.running()) == ["j--b", "j--c"]
    finally:
        launcher.close()


def test_a_given_up_zygote_that_stopped_answering_is_stopped_once_its_members_ended(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A given-up zygote frozen (SIGSTOP) while a member it forked runs: the member killed counts
    as ended within the report grace (code unknown), and the zygote, which will never report it,
    is stopped at the launcher's next polls, not kept with its zombie until the launcher closes
    (it waited for a report that could not come; an outside review found it)."""
    from robustrl.launcher.zygote import CLOSE_WAIT_S, EXIT_REPORT_GRACE_S

    launcher = _forking_launcher(tmp_path, monkeypatch)
    zygote = None
    try:
        launcher.start(MemberSpec(job_id="j", member_id="j--a", role="rollout", module="idle_member"))
        (zygote,) = _zygotes()
        launcher._zygote.failures = local.ZYGOTE_MAX_REFUSALS  # as after three refused forks
        launcher.start(MemberSpec(job_id="j", member_id="j--b", role="rollout", module="idle_member"))
        zygote.suspend()
        pid_a = launcher.pid("j--a")
        assert pid_a is not None
        os.killpg(pid_a, signal.SIGKILL)  # a crash the frozen zygote cannot report
        exits = eventually(launcher.poll, timeout=EXIT_REPORT_GRACE_S + 5, what="the crash seen")
        assert [(e.member_id, e.returncode) for e in exits] == [("j--a", None)]
        eventually(lambda: launcher.poll() == [] and (not zygote.is_running()
                                                      or zygote.status() == psutil.STATUS_ZOMBIE),
                   timeout=3 * CLOSE_WAIT_S + 5, what="the frozen given-up zygote stopped")
        assert launcher.running() == ["j--b"]
    finally:
        if zygote is not None:
            with contextlib.suppress(psutil.Error):
                zygote.resume()
        launcher.close()


def test_the_zygote_frees_an_ended_members_pid_only_once_the_launcher_has_its_exit(tmp_path: Path) -> None:
    """The zygote's protocol from outside (``tests/zygote_reaper.py``: a raw control socket, /proc,
    run as a child subreaper so a zombie the zygote leaves is not reaped by init behind it): a
    member killed is reported with its signal but stays a zombie, its pid and process group still
    its own, until the launcher answers ``reap``; a zygote leaving reaps the members whose exit it
    reported. (Reaped at once, the pid was free while the launcher could still signal the
    member's group: a stop or kill crossing the exit could reach a process that took the pid over.)"""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, str(Path(__file__).parent / "zygote_reaper.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=180, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["exit1"] == {"exit": out["pid1"], "rc": -signal.SIGKILL}, out
    # a zygote that reaps first has freed the pid before its report is sent
    assert out["after_report"] == "Z", out
    assert out["after_reap"] == "gone", out
    assert out["exit2"] == {"exit": out["pid2"], "rc": -signal.SIGKILL}, out
    assert out["after_zygote_exit"] == "gone", f"the zygote left a zombie behind: {out}"
