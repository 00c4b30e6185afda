"""A real multi-node Ray cluster on one machine, for tests and benchmarks (not for production).

    with LocalRayCluster(Path("/tmp/rr-ray"), workers=2, worker_cpus=2) as cluster:
        launcher = RayLauncher(cluster.address, ...)
        cluster.kill_node(1)          # node loss: its raylet, agents, actors and members at once

Each node is one ``ray start --block`` process in its own session: the head (GCS; 0 CPUs, so no
member is placed on it) and ``workers`` worker nodes on loopback addresses 127.0.0.2,
127.0.0.3, ... (so every node has its own address). Ray's own gRPC servers bind every interface
of the machine (Ray offers no loopback-only bind), which is why the head gets no members and the
fixture tears the whole cluster down (``stop``), then checks that none of its processes is left.
Node loss is detected quickly: the head's GCS health check runs every 500 ms and fails a node after
3 misses (``HEALTH_CHECK``).

:class:`TestbedRayCluster` runs the same cluster on a testbed (``robustrl.testbed``): the head in the
root namespace on the testbed's gateway address, each worker node inside one host's network
namespace (``ip netns exec <host> ray start --address <gateway>:<port> --node-ip-address <host
address>``), so a worker node's servers bind that host's interfaces only and node loss can be a
real network fault (``cut_node``: the host's link drops everything) as well as a kill.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

import psutil

from robustrl.errors import LaunchError
from robustrl.launcher.base import free_port

if TYPE_CHECKING:
    from robustrl.testbed.testbed import CutMode, Testbed

HEALTH_CHECK = {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                "health_check_initial_delay_ms": 0}
TESTBED_HEALTH_CHECK = {**HEALTH_CHECK, "health_check_timeout_ms": 1000}
"""On a testbed a cut link answers nothing: each check then waits its whole timeout (Ray's default
is 10 s, so a partitioned node would be failed after ~30 s; here after ~4.5 s)."""
OBJECT_STORE_BYTES = 80 * 1024 * 1024
READY_TIMEOUT_S = 60.0
START_ATTEMPTS = 2
STOP_TIMEOUT_S = 10.0


def _ray_bin() -> str:
    found = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
    if found is None:
        raise LaunchError("the ray command is not installed (pip install 'robustrl[ray]')", field="launcher")
    return found


class LocalRayCluster:
    """Head + ``workers`` worker nodes as local processes (module docstring)."""

    head_ip = "127.0.0.1"
    """The head's node address (the GCS listens on ``head_ip:port``)."""
    health_check: dict[str, int] = HEALTH_CHECK

    def __init__(self, temp_dir: Path, workers: int = 2, worker_cpus: float = 2,
                 labels: list[dict[str, str]] | None = None) -> None:
        # Ray's unix sockets live under temp_dir: keep the path short (108-byte socket paths).
        self.temp_dir = Path(temp_dir)
        self.workers = workers
        self.worker_cpus = worker_cpus
        self.labels = labels or [{"robustrl.io/node": f"w{i + 1}"} for i in range(workers)]
        self.port = 0
        self.nodes: list[subprocess.Popen[bytes]] = []
        """The ``ray start --block`` process of each node: head first."""
        self.node_ips: list[str] = []

    @property
    def address(self) -> str:
        return f"{self.head_ip}:{self.port}"

    def _env(self) -> dict[str, str]:
        return {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_DISABLE_DOCKER_CPU_WARNING": "1"}

    def _worker_ip(self, i: int) -> str:
        """The node address of worker ``i`` (0-based)."""
        return f"127.0.0.{i + 2}"

    def _popen(self, argv: list[str], worker: int | None, **kwargs: Any) -> subprocess.Popen[bytes]:
        """Start one node's ``ray start`` (``worker``: its 0-based index; None: the head)."""
        return subprocess.Popen(argv, **kwargs)

    def _spawn(self, args: list[str], name: str, worker: int | None = None) -> subprocess.Popen[bytes]:
        log = open(self.temp_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        try:
            return self._popen([_ray_bin(), "start", "--block", "--disable-usage-stats",
                                "--include-log-monitor=false", f"--temp-dir={self.temp_dir}",
                                f"--object-store-memory={OBJECT_STORE_BYTES}", *args], worker,
                               env=self._env(), stdout=log, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()

    def start(self) -> Self:
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        try:
            self.nodes.append(self._spawn(
                ["--head", f"--node-ip-address={self.head_ip}", f"--port={self.port}", "--num-cpus=0",
                 "--include-dashboard=false", f"--system-config={json.dumps(self.health_check)}",
                 '--labels={"robustrl.io/node": "head"}'], "head"))
            self._wait_port()
            self.wait_nodes(1)
            # One worker at a time, each retried once: on a loaded machine a raylet can miss the
            # 30 s registration deadline of `ray start` (seen with 2 cores and a load of 10).
            for i in range(self.workers):
                self.node_ips.append(self._worker_ip(i))
                self.nodes.append(self._start_worker(i, i + 2))
        except BaseException:
            self.stop()
            raise
        return self

    def _start_worker(self, i: int, live_after: int) -> subprocess.Popen[bytes]:
        """``ray start`` worker ``i`` (0-based) and wait until the GCS counts ``live_after`` nodes."""
        ip = self.node_ips[i]
        for attempt in range(START_ATTEMPTS):
            node = self._spawn([f"--address={self.address}", f"--node-ip-address={ip}",
                                f"--num-cpus={self.worker_cpus}", f"--labels={json.dumps(self.labels[i])}"],
                               f"worker-{i + 1}", worker=i)
            try:
                self.wait_nodes(live_after, watch=node)
                return node
            except LaunchError:
                self._kill_strays(ip)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(node.pid, signal.SIGKILL)
                node.wait(timeout=STOP_TIMEOUT_S)
                if attempt == START_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    def restore(self) -> list[int]:
        """Start again every worker node killed (``kill_node``) or failed by the GCS (its raylet
        missed the health checks; what is left of it is killed first): a new Ray node on the same
        address with the same labels and CPUs. Returns the indexes restarted."""
        alive = {n["NodeManagerAddress"] for n in self.alive_nodes()}
        dead = [i for i in range(1, len(self.nodes))
                if self.nodes[i].poll() is not None or self.node_ips[i - 1] not in alive]
        for i in dead:
            self._before_restart(i)
            if self.nodes[i].poll() is None or self._tree(self.nodes[i]):
                self.kill_node(i)
            self._kill_strays(self.node_ips[i - 1])
            live = len(self.alive_nodes())
            self.nodes[i] = self._start_worker(i - 1, live + 1)
        return dead

    def _before_restart(self, index: int) -> None:
        """Hook: what node ``index`` needs before it is started again (a testbed heals its link)."""

    def _wait_port(self) -> None:
        import socket

        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.nodes[0].poll() is not None:
                raise LaunchError(f"the Ray head exited: see {self.temp_dir / 'head.log'}")
            with contextlib.suppress(OSError):
                socket.create_connection((self.head_ip, self.port), timeout=0.5).close()
                return
            time.sleep(0.05)
        raise LaunchError(f"the Ray head did not listen on {self.port} within {READY_TIMEOUT_S:g} s")

    def alive_nodes(self) -> list[dict[str, Any]]:
        """The GCS's live nodes (through a short-lived ``ray`` driver of its own if none is up)."""
        import ray

        if not ray.is_initialized():
            ray.init(address=self.address, namespace="robustrl", log_to_driver=False, configure_logging=False)
        return [n for n in ray.nodes() if n.get("Alive")]

    def wait_nodes(self, n: int, timeout_s: float = READY_TIMEOUT_S,
                   watch: subprocess.Popen[bytes] | None = None) -> None:
        """Wait until the GCS counts ``n`` live nodes; fail early if the head (or ``watch``) exits."""
        deadline = time.monotonic() + timeout_s
        while len(self.alive_nodes()) != n:
            if self.nodes[0].poll() is not None:
                raise LaunchError(f"the Ray head exited: see {self.temp_dir / 'head.log'}")
            if watch is not None and watch.poll() is not None:
                raise LaunchError(f"a Ray worker's `ray start` exited ({watch.returncode}) before its node registered")
            if time.monotonic() > deadline:
                raise LaunchError(f"{len(self.alive_nodes())} of {n} Ray nodes up after {timeout_s:g} s")
            time.sleep(0.1)

    def _kill_strays(self, ip: str) -> None:
        """Kill what a failed ``ray start`` of node ``ip`` left running (its raylet, agents)."""
        for p in psutil.process_iter(["cmdline"]):
            cmd = " ".join(p.info["cmdline"] or [])
            if str(self.temp_dir) in cmd and any(a.endswith(f"={ip}") for a in cmd.split()):
                with contextlib.suppress(psutil.Error):
                    p.kill()

    def node_id(self, index: int) -> str:
        """The Ray node id of node ``index`` (0 = head) by its address."""
        ip = self.head_ip if index == 0 else self.node_ips[index - 1]
        for n in self.alive_nodes():
            if n["NodeManagerAddress"] == ip or (index == 0 and n.get("Labels", {}).get("robustrl.io/node") == "head"):
                return str(n["NodeID"])
        raise LaunchError(f"no live Ray node {index} ({ip})")

    def _tree(self, proc: subprocess.Popen[bytes]) -> list[psutil.Process]:
        try:
            root = psutil.Process(proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    def kill_node(self, index: int) -> list[int]:
        """A machine loss: SIGKILL node ``index``'s whole process tree at once (raylet, agents, the
        actors' workers and the members they started). Returns the pids killed."""
        procs = self._tree(self.nodes[index])
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.nodes[index].pid, signal.SIGKILL)
        self.nodes[index].wait(timeout=STOP_TIMEOUT_S)
        psutil.wait_procs(procs, timeout=STOP_TIMEOUT_S)
        return [p.pid for p in procs]

    def leftovers(self) -> list[str]:
        """Processes of this cluster still running (its temp dir in their command line)."""
        out = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            cmd = " ".join(p.info["cmdline"] or [])
            if str(self.temp_dir) in cmd:
                out.append(f"{p.info['pid']} {cmd[:120]}")
        return out

    def stop(self) -> None:
        """Disconnect this process's driver, kill every node's tree, and check nothing is left."""
        with contextlib.suppress(Exception):
            import ray

            if ray.is_initialized():
                ray.shutdown()
        # Workers first (their raylets would otherwise log the head's loss), head last.
        for i in reversed(range(len(self.nodes))):
            if self.nodes[i].poll() is None or self._tree(self.nodes[i]):
                self.kill_node(i)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while (left := self.leftovers()) and time.monotonic() < deadline:
            for line in left:
                with contextlib.suppress(psutil.Error, ValueError):
                    psutil.Process(int(line.split()[0])).kill()
            time.sleep(0.1)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class TestbedRayCluster(LocalRayCluster):
    """The cluster on a testbed (module docstring): the head in the root namespace on the
    testbed's gateway address (0 CPUs; the controller, in the root namespace, joins it as a
    driver through the head's raylet), worker node ``i`` inside host ``hosts[i]`` on that host's
    address. A worker's ``ray start`` is started through ``Testbed.popen``, so the testbed's
    teardown kills it too if this cluster's ``stop`` never runs.

    Args:
        testbed: a testbed that is up.
        hosts: the hosts that get a worker node each (names or indexes); default: every host.
    """

    __test__ = False
    health_check = TESTBED_HEALTH_CHECK

    def __init__(self, testbed: Testbed, temp_dir: Path, hosts: list[str | int] | None = None,
                 worker_cpus: float = 2, labels: list[dict[str, str]] | None = None) -> None:
        self.testbed = testbed
        self.hosts = [testbed.host(h).name for h in (hosts if hosts is not None else range(len(testbed.hosts)))]
        super().__init__(temp_dir, workers=len(self.hosts), worker_cpus=worker_cpus,
                         labels=labels or [{"robustrl.io/node": h} for h in self.hosts])
        self.head_ip = testbed.gateway

    def _worker_ip(self, i: int) -> str:
        return self.testbed.address(self.hosts[i])

    def _popen(self, argv: list[str], worker: int | None, **kwargs: Any) -> subprocess.Popen[bytes]:
        if worker is None:
            return subprocess.Popen(argv, **kwargs)
        return self.testbed.popen(self.hosts[worker], argv, **kwargs)

    def host_of(self, index: int) -> str:
        """The testbed host of worker node ``index`` (1-based, as ``kill_node``)."""
        return self.hosts[index - 1]

    def cut_node(self, index: int, mode: CutMode | None = None) -> str:
        """Take worker node ``index``'s host off the network (``Testbed.cut``): its processes run
        on, unreachable; the GCS fails the node after its health checks time out. Returns the host."""
        from robustrl.testbed.testbed import CutMode

        host = self.host_of(index)
        self.testbed.cut(host, mode or CutMode.DROP)
        return host

    def _before_restart(self, index: int) -> None:
        host = self.host_of(index)
        for fault in self.testbed.faults:
            if fault.get("kind") == "cut" and fault.get("host") == host:
                self.testbed.heal_fault(fault)
