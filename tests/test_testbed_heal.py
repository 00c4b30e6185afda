"""A timed network fault heals even if the process that injected it dies first (issue 12): the heal
is a process of its own (``robustrl.chaos.network.spawn_healer``), not a timer in the controller.
Skipped with the reason without root or ``ip``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest
from support import eventually

from robustrl.chaos.network import NetworkFaults
from robustrl.errors import TestbedUnavailable
from robustrl.testbed import Testbed, leftovers
from robustrl.testbed import commands as tb_commands

PROBE = "robustrl.testbed.probe"

pytestmark = pytest.mark.timeout(120)


def _unavailable() -> str | None:
    return tb_commands.unavailable_reason()


@pytest.fixture(scope="module")
def testbed() -> Iterator[Testbed]:
    if (reason := _unavailable()) is not None:
        pytest.skip(f"testbed unavailable: {reason}")
    tb = Testbed(hosts=2)
    try:
        tb.up()
    except TestbedUnavailable as exc:
        pytest.skip(f"testbed unavailable: {exc}")
    tag = tb.state.tag
    try:
        yield tb
    finally:
        tb.heal()
        tb.down()
        assert leftovers(tag) == []


def _reaches(tb: Testbed, port: int) -> bool:
    done = tb.run("h0", [sys.executable, "-m", PROBE, "reach", tb.address("h1"), str(port), "--timeout", "0.5"],
                  capture_output=True, timeout=30)
    return done.returncode == 0


@pytest.fixture
def listener(testbed: Testbed) -> Iterator[int]:
    proc = testbed.popen("h1", [sys.executable, "-m", PROBE, "listen"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield int(json.loads(proc.stdout.readline())["port"])
    finally:
        proc.kill()
        proc.wait()
        testbed.heal()


def _healers() -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"])
            if "robustrl.chaos.network" in " ".join(p.info["cmdline"] or []) and "heal-at" in (p.info["cmdline"] or [])]


INJECTOR = """
import sys, time
from robustrl.chaos.network import NetworkFaults
from robustrl.testbed import Testbed
faults = NetworkFaults(Testbed.attach(sys.argv[1]))
faults.inject("net_drop", "h1", duration_s=float(sys.argv[2]))
print("injected", flush=True)
time.sleep(60)  # the injector lives on until the test kills it
"""


def test_a_timed_fault_heals_after_the_injecting_process_is_killed(testbed: Testbed, listener: int) -> None:
    assert _reaches(testbed, listener)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    injector = subprocess.Popen([sys.executable, "-c", INJECTOR, testbed.state.tag, "2.0"], env=env,
                                stdout=subprocess.PIPE, text=True)
    try:
        assert injector.stdout is not None and injector.stdout.readline().strip() == "injected"
        injector.send_signal(signal.SIGKILL)  # the controller dies with the fault in force
        injector.wait()
        assert [f["kind"] for f in testbed.faults] == ["cut"]
        assert not _reaches(testbed, listener)
        eventually(lambda: testbed.faults == [], timeout=10, what="the fault healed by its own healer")
        assert _reaches(testbed, listener)
        eventually(lambda: _healers() == [], timeout=5, what="the healer exited")
    finally:
        if injector.poll() is None:
            injector.kill()
            injector.wait()


def test_close_cancels_pending_heals_and_the_fault_stays(testbed: Testbed, listener: int) -> None:
    faults = NetworkFaults(testbed)
    faults.inject("net_drop", "h1", duration_s=0.5)
    faults.close()
    assert _healers() == []
    time.sleep(1.5)  # 3x the fault's duration: the window in which a cancelled heal would have run
    assert [f["kind"] for f in testbed.faults] == ["cut"]  # until heal
    faults.heal()
    assert testbed.faults == [] and _reaches(testbed, listener)


def test_a_pending_healer_exits_when_its_testbed_goes_down() -> None:
    if (reason := _unavailable()) is not None:
        pytest.skip(f"testbed unavailable: {reason}")
    tb = Testbed(hosts=2)
    tb.up()
    tag = tb.state.tag
    try:
        NetworkFaults(tb).inject("net_drop", "h1", duration_s=600)
        eventually(lambda: len(_healers()) == 1, timeout=5, what="a healer waiting")
    finally:
        tb.down()
    eventually(lambda: _healers() == [], timeout=5, what="the healer gone with its testbed")
    assert leftovers(tag) == []
