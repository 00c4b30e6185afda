"""The test dockerd's data root is used by one dockerd at a time (``docker_engine.Engine``).

Two dockerds on one data root corrupt it; a test process that crashes leaves its dockerd running
(its own session). Real dockerds here: a child process starts an engine and is SIGKILLed, so its
dockerd is orphaned; the next engine must stop it before it starts its own, and a third engine,
while the second runs, must wait and then give up naming the holder.

Skips, with the reason, without dockerd or root (``Unavailable``).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from docker_engine import CACHE, Engine, Unavailable

pytestmark = pytest.mark.timeout(300)

HERE = Path(__file__).resolve().parent
CHILD = f"""
import sys, time
sys.path.insert(0, {str(HERE)!r})
from docker_engine import Engine, Unavailable
try:
    e = Engine()
    e.start()
except Unavailable as exc:
    print("unavailable", exc, flush=True)
    sys.exit(0)
print("up", e.proc.pid, flush=True)
time.sleep(600)
"""


def _ended(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_dockerd_left_by_a_crashed_test_process_is_stopped_and_a_second_engine_waits() -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        line = (child.stdout.readline() if child.stdout else "").split()
        if not line or line[0] != "up":
            pytest.skip(f"no Docker engine: {' '.join(line[1:])}")
        orphan = int(line[1])
        assert (CACHE / "data.lock").read_text().startswith(f"{orphan}:")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert not _ended(orphan), "its dockerd ended with the test process: nothing to check"

    second = Engine()
    try:
        second.start()
        assert _ended(orphan), f"the dockerd left by the crashed process ({orphan}) still runs beside a new one"
        assert second.client.ping()
        third = Engine()
        try:
            with pytest.raises(Unavailable, match=f"stayed in use .*{second.proc.pid if second.proc else ''}:"):
                third.start(timeout_s=1.0)  # waits 5 s for the lock
        finally:
            third.stop()
        assert second.client.ping(), "the waiting engine disturbed the running one"
    finally:
        second.stop()
    assert (CACHE / "data.lock").read_text() == "", "a stopped engine left its dockerd recorded"
