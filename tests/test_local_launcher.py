"""The local launcher's warm spares, with real processes: a member handed to a spare runs in it
(same pid and process group the launcher tracks), with its own environment and log, and the
spare is restocked afterwards."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support import eventually

from robustrl.launcher import local
from robustrl.launcher.base import MemberSpec
from robustrl.launcher.local import LocalLauncher

pytestmark = pytest.mark.timeout(90)
TESTS = Path(__file__).resolve().parent


def test_a_member_started_from_a_warm_spare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "SPARE_RESTOCK_DELAY_S", 0.1)
    monkeypatch.setattr(local, "SPARE_TARGETS", frozenset({"spare_probe"}))
    launcher = LocalLauncher(tmp_path, base_env={**os.environ, "PYTHONPATH": str(TESTS)})
    try:
        launcher.keep_spares(1)
        (spare,) = launcher._spares
        eventually(lambda: b"ready" in (tmp_path / "spare-1.log").read_bytes(), timeout=60,
                   what="spare imported the member code")
        launcher.start(MemberSpec(job_id="j", member_id="j--rollout-0-i0", role="rollout",
                                  module="spare_probe", env={"ROBUSTRL_MEMBER_ID": "rollout-0-i0"},
                                  args=("--x", "1")))
        assert launcher.spares_used == 1 and launcher.pid("j--rollout-0-i0") == spare.pid
        assert launcher.was_warm("j--rollout-0-i0")
        exits = eventually(launcher.poll, timeout=30, what="probe exited")
        assert [(e.member_id, e.returncode, e.expected) for e in exits] == [("j--rollout-0-i0", 3, False)]
        log = (tmp_path / "j--rollout-0-i0.log").read_text()
        assert f"probe pid={spare.pid} member=rollout-0-i0 argv=['--x', '1']" in log
        # restocked after the delay: a new spare process
        eventually(lambda: [p.pid for p in launcher._spares if p.poll() is None and p.pid != spare.pid],
                   timeout=10, what="spare restocked")
        # a module a spare does not preload starts cold
        launcher.start(MemberSpec(job_id="j", member_id="j--other", role="rollout", module="platform"))
        assert launcher.spares_used == 1 and not launcher.was_warm("j--other")
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
