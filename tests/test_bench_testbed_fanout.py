"""The measured fan-out of ``bench/testbed_fanout.py``: its CPU accounting (pure) and a small
relayed and trainer-only run on a real 3-host testbed (skipped, with the reason, without root/ip/tc).
"""

from __future__ import annotations

import sys
from collections import namedtuple
from pathlib import Path

import pytest

from robustrl.testbed import Testbed, leftovers
from robustrl.testbed import commands as tb_commands

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import testbed_fanout

pytestmark = pytest.mark.timeout(120)

Times = namedtuple("Times", "user nice system idle iowait irq softirq")


def test_cpu_busy_counts_idle_and_iowait_as_not_busy():
    before = [Times(0, 0, 0, 0, 0, 0, 0), Times(0, 0, 0, 0, 0, 0, 0)]
    after = [Times(3, 0, 1, 4, 2, 0, 0), Times(8, 0, 0, 0, 0, 0, 2)]  # cpu0 40% busy, cpu1 100%
    cpu = testbed_fanout.cpu_busy(before, after)
    assert cpu == {"busy_fraction": 0.7, "max_cpu_busy_fraction": 1.0, "softirq_fraction": 0.1}


def _unavailable() -> str | None:
    return tb_commands.unavailable_reason()


@pytest.mark.skipif(_unavailable() is not None, reason=f"testbed unavailable: {_unavailable()}")
def test_fanout_on_testbed_verifies_bytes_and_relays_spare_the_trainer(tmp_path):
    nbytes, chunk = 4 << 20, 256 << 10
    link_bps = 200e6
    with Testbed(hosts=3, link="200mbit") as tb:
        tag = tb.state.tag
        relay = testbed_fanout.run_fanout(tb, 2, True, nbytes, chunk, link_bps, 7201, tmp_path)
        only = testbed_fanout.run_fanout(tb, 2, False, nbytes, chunk, link_bps, 7202, tmp_path)
    assert leftovers(tag) == []
    for rec in (relay, only):
        assert rec["verified"] and rec["bytes_resent"] == 0
        assert rec["max_host_tx_host"] == "h0"
        # what left h0 on the wire covers what its server says it sent (headers on top)
        assert rec["host_tx_bytes"]["h0"] >= rec["trainer_bytes_sent"]
    assert only["trainer_copies"] == 2.0
    assert relay["trainer_copies"] < 2.0  # some chunks went replica to replica
    assert only["wall_s"] >= 2 * nbytes * 8 / link_bps  # two copies through one shaped link
