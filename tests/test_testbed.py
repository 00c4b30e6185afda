"""The multi-host testbed with real namespaces, links, tc and processes (no mocks): hosts reach
each other through the bridge, a shaped link really limits throughput, cut and partition stop
traffic and heal restores it, the local launcher places a member in its host's namespace, and
nothing is left afterwards, also when the owning process is killed with SIGKILL.

Skipped, with the reason, where the testbed cannot run (not root, no ip/tc)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from support import eventually

from robustrl.errors import ConfigError, LaunchError, TestbedUnavailable
from robustrl.launcher.base import MemberSpec
from robustrl.launcher.local import LocalLauncher
from robustrl.testbed import CutMode, Testbed, leftovers, links, sweep
from robustrl.testbed import commands as tb_commands
from robustrl.testbed.probe import MODULE as PROBE
from robustrl.testbed.probe import transfer
from robustrl.testbed.state import STATE_DIR, TestbedState, read_states, tag_of
from robustrl.testbed.teardown import teardown

pytestmark = pytest.mark.timeout(60)
TESTS = Path(__file__).resolve().parent
LINK = "200mbit"
LINK_BPS = 200e6
TRANSFER_BYTES = 20 * 1024 * 1024


def _unavailable() -> str | None:
    return tb_commands.unavailable_reason()


needs_testbed = pytest.mark.skipif(_unavailable() is not None, reason=f"testbed unavailable: {_unavailable()}")


@pytest.fixture(scope="module")
def testbed() -> Iterator[Testbed]:
    """Three hosts on 200 Mbit/s links, for the whole module."""
    tb = Testbed(hosts=3, link=LINK)
    try:
        tb.up()
    except TestbedUnavailable as exc:
        pytest.skip(f"testbed unavailable: {exc}")
    try:
        yield tb
    finally:
        tb.down()
        assert leftovers(tb._state.tag if tb._state else None) == []


@pytest.fixture
def healed(testbed: Testbed) -> Iterator[Testbed]:
    """The module's testbed, with every fault healed after the test."""
    try:
        yield testbed
    finally:
        testbed.heal()


def _probe(tb: Testbed, host: str, *args: str) -> subprocess.Popen[str]:
    return tb.popen(host, [sys.executable, "-m", PROBE, *args], stdout=subprocess.PIPE, text=True)


def _first_json(proc: subprocess.Popen[str]) -> dict[str, float]:
    assert proc.stdout is not None
    return json.loads(proc.stdout.readline())


@pytest.fixture
def listener(healed: Testbed) -> Iterator[tuple[str, int]]:
    """A TCP listener on h1 (accepts and closes); yields its address and port."""
    proc = _probe(healed, "h1", "listen")
    try:
        yield healed.address("h1"), int(_first_json(proc)["port"])
    finally:
        proc.kill()
        proc.wait()


def _reach(tb: Testbed, src: str, addr: str, port: int, timeout: float = 0.5) -> bool:
    done = tb.run(src, [sys.executable, "-m", PROBE, "reach", addr, str(port), "--timeout", str(timeout)],
                  capture_output=True, timeout=30)
    return done.returncode == 0


# --- pure parts (no root needed) -------------------------------------------------------------

def test_link_units_and_tc_trees() -> None:
    assert links.parse_rate("2gbit") == 2_000_000_000 and links.parse_rate("200mbit") == 200_000_000
    assert links.parse_delay("0.2ms") == pytest.approx(0.0002) and links.parse_delay("50us") == pytest.approx(5e-5)
    for bad in ("fast", "2 gigabit", "-1mbit", "0mbit"):
        with pytest.raises(ConfigError):
            links.parse_rate(bad)
    with pytest.raises(ConfigError):
        links.parse_delay("soon")
    end = links.LinkEnd("eth0", "ns1")
    shaped = links.shape_commands(end, links.LinkShape.parse("2gbit", None))
    assert shaped[0][:3] == ["tc", "-n", "ns1"] and "htb" in shaped[0]
    assert any("2000000000bit" in cmd for cmd in shaped) and not any("netem" in cmd for cmd in shaped)
    assert any("netem" in cmd for cmd in links.shape_commands(end, links.LinkShape.parse(None, "1ms")))
    # faults only classify into the drop class, whose pfifo holds nothing
    assert shaped[-1][-3:] == ["pfifo", "limit", "0"]
    assert all(links.DROP_CLASS in cmd for cmd in links.cut_commands(end) + links.drop_to_commands(end, ["1.2.3.4"]))


def test_plan_names_fit_the_kernel_and_carry_the_tag() -> None:
    state = TestbedState.plan("a1b2c3", "10.213.7.0/24", 120, "1gbit", None, owner_pid=1, owner_start=0.0,
                              created_at=0.0)
    assert all(len(n) <= 15 for n in [state.gateway_dev, state.bridge, *(h.bridge_port for h in state.hosts)])
    assert {tag_of(n) for n in [state.gateway_dev, state.switch_netns, *(h.netns for h in state.hosts)]} == {"a1b2c3"}
    assert state.hosts[0].address == "10.213.7.1" and state.gateway == "10.213.7.254"
    assert TestbedState.from_json(json.loads(json.dumps(state.to_json()))) == state
    with pytest.raises(ConfigError):
        TestbedState.plan("a1b2c3", "10.213.7.0/28", 3, None, None, None, None, 0.0)


# --- real namespaces -------------------------------------------------------------------------

@needs_testbed
def test_hosts_have_their_own_namespace_and_address_and_reach_each_other(listener: tuple[str, int],
                                                                        testbed: Testbed) -> None:
    addr, port = listener
    inodes = {os.stat(f"/run/netns/{h.netns}").st_ino for h in testbed.hosts}
    assert len(inodes) == 3 and os.stat("/proc/self/ns/net").st_ino not in inodes
    shown = testbed.run("h2", ["ip", "-o", "-4", "addr", "show", "dev", "eth0"], capture_output=True, text=True)
    assert f"inet {testbed.address('h2')}/24" in shown.stdout
    assert _reach(testbed, "h0", addr, port) and _reach(testbed, "h2", addr, port)
    # the root namespace reaches the hosts through the bridge's address
    assert tb_commands.run(["ip", "-o", "-4", "addr", "show", "dev", testbed.state.gateway_dev]).count(testbed.gateway) == 1


@needs_testbed
def test_a_shaped_link_limits_throughput(healed: Testbed) -> None:
    got = transfer(healed, "h0", "h1", TRANSFER_BYTES, tuned=True)
    assert got.nbytes == TRANSFER_BYTES
    assert 0.6 * LINK_BPS <= got.bits_per_s <= 1.1 * LINK_BPS, f"{got.bits_per_s / 1e6:.0f} Mbit/s on a {LINK} link"
    assert got.sink_cpu_fraction < 0.5  # the link, not the CPU, set the rate


@needs_testbed
@pytest.mark.parametrize("mode", [CutMode.DROP, CutMode.DOWN])
def test_cut_stops_a_hosts_traffic_and_heal_restores_it(listener: tuple[str, int], healed: Testbed,
                                                        mode: CutMode) -> None:
    addr, port = listener
    assert _reach(healed, "h0", addr, port)
    healed.cut("h1", mode)
    assert healed.faults == [{"kind": "cut", "host": "h1", "mode": mode.value}]
    assert not _reach(healed, "h0", addr, port) and not _reach(healed, "h2", addr, port)
    healed.heal()
    assert healed.faults == []
    assert eventually(lambda: _reach(healed, "h0", addr, port), timeout=10, what="h1 reachable after heal")


@needs_testbed
def test_partition_separates_two_groups_until_healed(listener: tuple[str, int], healed: Testbed) -> None:
    addr, port = listener  # on h1
    healed.partition(["h0"], ["h1"])
    assert not _reach(healed, "h0", addr, port)
    assert _reach(healed, "h2", addr, port)  # h2 is in neither group
    with pytest.raises(ConfigError):
        healed.partition(["h0"], ["h0", "h2"])
    healed.heal()
    assert _reach(healed, "h0", addr, port)


_ECHO_CLIENT = """
import socket, sys
sock = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
sock.settimeout(None)
for line in sys.stdin:
    sock.sendall(line.encode())
    got = b""
    while not got.endswith(b"\\n"):
        got += sock.recv(4096)
    print(got.decode().strip(), flush=True)
"""


def _answered(client: subprocess.Popen[str], msg: str, timeout: float) -> bool:
    """Send ``msg`` over the client's open connection; True if its echo comes back in time."""
    assert client.stdin is not None and client.stdout is not None
    client.stdin.write(msg + "\n")
    client.stdin.flush()
    ready, _, _ = select.select([client.stdout], [], [], timeout)
    return bool(ready) and client.stdout.readline().strip() == msg


@needs_testbed
@pytest.mark.parametrize("fault", ["cut_drop", "cut_down", "partition"])
def test_a_fault_stalls_an_open_connection_and_heal_resumes_it(healed: Testbed, fault: str) -> None:
    """What a replica sees: the connection is not reset, nothing passes while the fault lasts, and
    after heal the same connection carries what was sent during the fault."""
    server = _probe(healed, "h1", "echo")
    client = None
    try:
        port = int(_first_json(server)["port"])
        client = healed.popen("h0", [sys.executable, "-c", _ECHO_CLIENT, healed.address("h1"), str(port)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert _answered(client, "before", timeout=10)
        if fault == "partition":
            healed.partition(["h0"], ["h1", "h2"])
        else:
            healed.cut("h1", CutMode.DROP if fault == "cut_drop" else CutMode.DOWN)
        assert not _answered(client, "during", timeout=1.0)
        healed.heal()
        assert client.stdout is not None
        ready, _, _ = select.select([client.stdout], [], [], 15)  # a retransmission carries it
        assert ready and client.stdout.readline().strip() == "during"
        assert _answered(client, "after", timeout=5) and client.poll() is None
    finally:
        for proc in (client, server):
            if proc is not None:
                proc.kill()
                proc.wait()


@needs_testbed
def test_the_local_launcher_starts_a_member_inside_its_host(testbed: Testbed, tmp_path: Path) -> None:
    launcher = LocalLauncher(tmp_path, base_env={**os.environ, "PYTHONPATH": str(TESTS)}, placement=testbed)
    try:
        launcher.start(MemberSpec(job_id="j", member_id="j--rollout-0", role="rollout", module="idle_member",
                                  host="h2"))
        pid = launcher.pid("j--rollout-0")
        assert pid is not None
        # the tracked pid is the member itself (ip netns exec execs it), in h2's namespace
        eventually(lambda: psutil.Process(pid).cmdline()[:1] == [sys.executable], timeout=10,
                   what="ip netns exec replaced by the member")
        host_ns = os.stat(f"/run/netns/{testbed.host('h2').netns}").st_ino
        assert os.stat(f"/proc/{pid}/ns/net").st_ino == host_ns != os.stat("/proc/self/ns/net").st_ino
        assert pid in testbed.pids("h2")
        assert launcher.host_for("j--rollout-0") == testbed.address("h2")
        assert launcher.handle("j--rollout-0")["host"] == "h2"  # type: ignore[index]
        launcher.suspend("j--rollout-0")
        assert eventually(lambda: psutil.Process(pid).status() == psutil.STATUS_STOPPED, timeout=5,
                          what="suspended")
        launcher.resume("j--rollout-0")
        launcher.kill("j--rollout-0")
        assert [(e.member_id, e.returncode) for e in launcher.poll()] == [("j--rollout-0", -signal.SIGKILL)]
        assert testbed.pids("h2") == []
        with pytest.raises(LaunchError):
            launcher.start(MemberSpec(job_id="j", member_id="j--x", role="rollout", module="idle_member",
                                      host="h9"))
    finally:
        launcher.close()
    unplaced = LocalLauncher(tmp_path)
    with pytest.raises(LaunchError, match="no placement"):
        unplaced.start(MemberSpec(job_id="j", member_id="j--y", role="rollout", module="idle_member", host="h0"))


@needs_testbed
def test_down_removes_everything_including_processes_in_the_hosts() -> None:
    tb = Testbed(hosts=2, link="1gbit")
    tb.up()
    tag = tb.state.tag
    sleeper = tb.popen("h1", ["sleep", "60"])
    assert sorted(tag_of(n) for n in leftovers(tag)) == [tag] * 4  # 2 hosts, the switch, the gateway veth
    tb.down()
    tb.down()  # harmless twice
    assert leftovers(tag) == [] and not (STATE_DIR / f"{tag}.json").exists()
    assert sleeper.wait(timeout=5) == -signal.SIGKILL


def _owner_process(reaper: bool) -> tuple[subprocess.Popen[str], dict[str, object]]:
    """A process that builds a 2-host testbed with a process inside, prints its state, then waits."""
    code = (
        "import json, subprocess, sys, time\n"
        "from robustrl.testbed import Testbed\n"
        f"tb = Testbed(hosts=2, link='1gbit', reaper={reaper})\n"
        "tb.up()\n"
        "tb.popen('h0', ['sleep', '60'])\n"
        "print(json.dumps(tb.describe()), flush=True)\n"
        "time.sleep(60)\n"  # the owner lives on until the test kills it
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, "the owner process did not build its testbed"
    return proc, json.loads(line)


@needs_testbed
def test_a_sweep_removes_the_testbed_of_an_owner_killed_with_sigkill(testbed: Testbed) -> None:
    proc, state = _owner_process(reaper=False)
    tag = str(state["tag"])
    # popen returns before ``ip netns exec`` has entered the namespace
    inside: list[int] = []
    eventually(lambda: inside.extend(tb_commands.netns_pids(state["hosts"][0]["netns"])) or inside,  # type: ignore[index]
               timeout=15, what="the owner's process inside h0")
    assert leftovers(tag)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert leftovers(tag)  # no reaper: it stays until a sweep
    report = sweep()
    assert tag in report.testbeds
    assert testbed.state.tag not in report.testbeds and leftovers(testbed.state.tag)  # its owner runs
    assert leftovers(tag) == [] and not (STATE_DIR / f"{tag}.json").exists()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in inside)


@needs_testbed
def test_the_reaper_removes_the_testbed_of_an_owner_killed_with_sigkill() -> None:
    proc, state = _owner_process(reaper=True)
    tag = str(state["tag"])
    assert state["reaper_pid"] and psutil.pid_exists(int(state["reaper_pid"]))  # type: ignore[arg-type]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    eventually(lambda: leftovers(tag) == [] and not (STATE_DIR / f"{tag}.json").exists(), timeout=15,
               what="the reaper removed the testbed")
    eventually(lambda: not psutil.pid_exists(int(state["reaper_pid"])), timeout=5,  # type: ignore[arg-type]
               what="reaper exited")


@needs_testbed
def test_delay_is_applied_or_refused_with_the_reason() -> None:
    """Where the kernel has netem, a 2 ms delay per link crossing makes a round trip >= 8 ms; where
    it has not (this machine's kernel), up() says so and leaves nothing behind."""
    tb = Testbed(hosts=2, delay="2ms")
    try:
        tb.up()
    except TestbedUnavailable as exc:
        assert "netem" in str(exc)
        assert tb._state is not None and leftovers(tb._state.tag) == []
        pytest.skip(f"no delay on this kernel: {exc}")
    try:
        listener = _probe(tb, "h1", "listen")
        port = int(_first_json(listener)["port"])
        code = ("import socket, time; t = time.perf_counter(); "
                f"socket.create_connection(({tb.address('h1')!r}, {port}), timeout=5).close(); "
                "print(time.perf_counter() - t)")
        rtt = float(tb.run("h0", [sys.executable, "-c", code], capture_output=True, text=True).stdout)
        listener.kill()
        assert rtt >= 0.008
    finally:
        tb.down()


def test_unavailable_without_ip_says_why(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("not root: the root check answers first")
    monkeypatch.setenv("PATH", str(tmp_path))  # no ip, no tc
    with pytest.raises(TestbedUnavailable, match="`ip`"):
        Testbed(hosts=1).up()


def test_unavailable_without_root_says_why() -> None:
    if os.geteuid() == 0:
        pytest.skip("runs as root: the refusal is exercised where the suite runs unprivileged")
    with pytest.raises(TestbedUnavailable, match="root"):
        Testbed(hosts=1).up()


@needs_testbed
def test_two_testbeds_coexist_on_different_subnets(testbed: Testbed) -> None:
    with Testbed(hosts=1) as other:
        assert other.state.tag != testbed.state.tag and other.state.subnet != testbed.state.subnet
        assert time.time() >= other.state.created_at


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "robustrl.cli", "testbed", *args], capture_output=True, text=True,
                          timeout=60, check=False)


@needs_testbed
def test_cli_up_leaves_a_detached_testbed_that_down_removes() -> None:
    up = _cli("up", "--hosts", "2", "--link", "1gbit")
    assert up.returncode == 0, up.stdout + up.stderr
    state = json.loads(up.stdout)
    tag = state["tag"]
    try:
        assert state["owner_pid"] is None and [h["name"] for h in state["hosts"]] == ["h0", "h1"]
        assert len(leftovers(tag)) == 4  # outlives the command that built it
        assert tag in [t["tag"] for t in json.loads(_cli("list").stdout)]
        sweep()  # a plain sweep keeps detached testbeds
        assert len(leftovers(tag)) == 4
        # faults from other processes, through an attached handle
        attached = Testbed.attach(tag)
        server = attached.popen("h1", [sys.executable, "-m", PROBE, "listen"], stdout=subprocess.PIPE, text=True)
        port = int(_first_json(server)["port"])
        assert _reach(attached, "h0", attached.address("h1"), port)
        assert _cli("cut", tag, "h1", "--mode", "down").returncode == 0
        assert not _reach(attached, "h0", attached.address("h1"), port)
        assert _cli("heal", tag).returncode == 0
        assert eventually(lambda: _reach(attached, "h0", attached.address("h1"), port), timeout=10, what="healed")
        assert _cli("partition", tag, "h0", "h1").returncode == 0
        assert not _reach(attached, "h0", attached.address("h1"), port)
        assert _cli("cut", tag, "h7").returncode == 2  # no such host, said so
        attached.down()  # lets go: the testbed stays
        assert len(leftovers(tag)) == 4
        down = _cli("down", tag)
        assert down.returncode == 0 and tag in down.stdout
        assert leftovers(tag) == [] and not (STATE_DIR / f"{tag}.json").exists()
        assert _cli("down", tag).returncode == 2  # unknown now, said so
        assert server.wait(timeout=5) == -signal.SIGKILL  # the process inside went with it
    finally:
        for state in read_states():
            if state.tag == tag:
                teardown(state)  # only ours: another session's detached testbeds stay
