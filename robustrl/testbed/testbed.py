"""A multi-host testbed on one machine: N network namespaces on a Linux bridge, shaped links, and
real network faults between them.

    with Testbed(hosts=3, link="200mbit") as tb:
        server = tb.popen("h1", [sys.executable, "-m", "http.server", "8000"])
        tb.run("h0", ["curl", f"http://{tb.address('h1')}:8000/"])
        tb.partition(["h0"], ["h1", "h2"])
        tb.heal()

Each host has its own address on a private /24 (the root namespace holds .254 on its veth into
the bridge, so it reaches every host), its own loopback, and a link whose two directions are shaped by
``robustrl.testbed.links``. What the testbed creates is written to a state file first; it is
removed by ``down()``, by the reaper process if the owner dies without calling it, or by a sweep
(``robustrl testbed down``), see ``robustrl.testbed.teardown``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import fcntl
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from robustrl.errors import ConfigError, TestbedError
from robustrl.procs import start_time
from robustrl.testbed import commands, links
from robustrl.testbed.reaper import MODULE as REAPER_MODULE
from robustrl.testbed.state import (
    STATE_DIR,
    SWITCH_GATEWAY_PORT,
    HostInfo,
    TestbedState,
    free_subnet,
    new_tag,
    read_states,
    write_state,
)
from robustrl.testbed.teardown import sweep, teardown

LOCK_FILE = ".lock"
REAPER_EXIT_TIMEOUT_S = 5.0
"""Taken while a testbed picks its subnet and writes its state, so two cannot pick the same one."""


class Status(str, enum.Enum):
    NEW = "new"
    UP = "up"
    DOWN = "down"


class CutMode(str, enum.Enum):
    """How ``cut`` takes a host off the network."""

    DROP = "drop"
    """Every packet leaving or reaching the host is dropped silently (a dead switch port, a cable
    that no longer carries anything): peers see only timeouts."""
    DOWN = "down"
    """The link goes down: the host sees no carrier and its sends fail at once."""


HostRef = str | int | HostInfo
"""A host by name (``"h1"``), index (1) or the HostInfo itself."""
GATEWAY = "gw"
"""In a partition's group: the root namespace behind the gateway address (where the stack runs
the infra and the control plane)."""


class Testbed:
    """N hosts as network namespaces on one bridge; a context manager (``up`` / ``down``).

    Args:
        hosts: number of hosts (``h0`` ... ``h{N-1}``).
        link: each host's link rate in both directions, tc units (``"2gbit"``); None: unshaped.
        delay: added per crossing of a link (``"0.2ms"``); needs the kernel's netem qdisc.
        subnet: the hosts' /24 (or larger); default: the first free /24 of 10.213.0.0/16.
        detached: the testbed outlives this process (no owner, no reaper); only ``down()`` or
            ``robustrl testbed down`` remove it.
        reaper: start a reaper process that removes the testbed if this process dies first.
        state_dir: where state files go (every sweep must look in the same place).
    """

    __test__ = False  # not a pytest test class despite the name

    def __init__(self, hosts: int = 3, link: str | None = None, delay: str | None = None,
                 subnet: str | None = None, *, detached: bool = False, reaper: bool = True,
                 state_dir: Path = STATE_DIR) -> None:
        self.shape = links.LinkShape.parse(link, delay)  # validated before anything is created
        self.n_hosts = hosts
        self.link, self.delay, self.subnet = link, delay, subnet
        self.detached = detached
        self.reaper = reaper and not detached
        self.state_dir = Path(state_dir)
        self.status = Status.NEW
        self._state: TestbedState | None = None
        self._reaper: subprocess.Popen[bytes] | None = None
        self._owned = True

    # --- lifecycle ---------------------------------------------------------------------------

    @classmethod
    def attach(cls, tag: str, state_dir: Path = STATE_DIR) -> Testbed:
        """A handle on a running testbed that another process built (``robustrl testbed up``, a
        bench): hosts, placement and faults work through it; its ``down()`` only lets go, the
        testbed stays.

        Raises:
            TestbedError: no testbed ``tag`` in ``state_dir``.
        """
        state = next((s for s in read_states(Path(state_dir)) if s.tag == tag), None)
        if state is None:
            raise TestbedError(f"no testbed {tag!r} in {state_dir}")
        tb = cls(hosts=len(state.hosts), link=state.link, delay=state.delay, subnet=state.subnet, reaper=False,
                 state_dir=state_dir)
        tb._state, tb.status, tb._owned = state, Status.UP, False
        return tb

    @property
    def state(self) -> TestbedState:
        if self._state is None or self.status is not Status.UP:
            raise TestbedError(f"the testbed is {self.status.value}, not up")
        return self._state

    def up(self) -> TestbedState:
        """Create the bridge, hosts and shaped links; a second call returns the same state.

        Raises:
            TestbedUnavailable: not root, no ip/tc, or the kernel lacks a needed qdisc.
            TestbedError: a command failed (everything created so far is removed again).
        """
        if self.status is Status.UP:
            return self.state
        if self.status is Status.DOWN:
            raise TestbedError("a testbed that was taken down cannot be brought up again; make a new one")
        commands.check_available()
        sweep(state_dir=self.state_dir)  # leftovers of crashed owners (their reaper may be gone too)
        state = self._state = self._plan()
        try:
            self._create(state)
            if self.reaper:
                reaper = self._start_reaper(state)
                state = dataclasses.replace(state, reaper_pid=reaper.pid,
                                            reaper_start=start_time(reaper.pid))
                write_state(state, self.state_dir)
        except BaseException:
            teardown(state, self.state_dir)
            if self._reaper is not None:
                self._reaper.kill()
                self._reaper.wait(timeout=REAPER_EXIT_TIMEOUT_S)
            self.status = Status.DOWN
            raise
        self._state, self.status = state, Status.UP
        return state

    def _plan(self) -> TestbedState:
        """Name everything and write the state file before creating anything."""
        owner = None if self.detached else os.getpid()
        owner_start = start_time(owner) if owner else None
        with self._lock():
            subnet = self.subnet or free_subnet({s.subnet for s in read_states(self.state_dir)})
            state = TestbedState.plan(new_tag(), subnet, self.n_hosts, self.link, self.delay,
                                      owner_pid=owner, owner_start=owner_start, created_at=time.time())
            write_state(state, self.state_dir)
        return state

    def _create(self, state: TestbedState) -> None:
        run = commands.run
        sw = ["ip", "-n", state.switch_netns]
        run(["ip", "netns", "add", state.switch_netns])
        # bridged frames skip iptables: cheaper, and nothing there is meant for them
        with contextlib.suppress(TestbedError):
            run(["ip", "netns", "exec", state.switch_netns, "sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=0"])
        run([*sw, "link", "add", state.bridge, "type", "bridge"])
        run([*sw, "link", "set", state.bridge, "up"])
        run(["ip", "link", "add", state.gateway_dev, "type", "veth", "peer", "name", SWITCH_GATEWAY_PORT,
             "netns", state.switch_netns])
        run([*sw, "link", "set", SWITCH_GATEWAY_PORT, "master", state.bridge, "up"])
        run(["ip", "addr", "add", f"{state.gateway}/{state.prefixlen}", "dev", state.gateway_dev])
        run(["ip", "link", "set", state.gateway_dev, "up"])
        for host in state.hosts:
            ns = ["ip", "-n", host.netns]
            run(["ip", "netns", "add", host.netns])
            # both ends are born in their namespaces (names cannot clash with the root's)
            run([*sw, "link", "add", host.bridge_port, "type", "veth", "peer", "name", host.dev,
                 "netns", host.netns])
            run([*ns, "addr", "add", f"{host.address}/{state.prefixlen}", "dev", host.dev])
            run([*ns, "link", "set", "lo", "up"])
            run([*ns, "link", "set", host.dev, "up"])
            run([*sw, "link", "set", host.bridge_port, "master", state.bridge, "up"])
            for end in self._ends(host, state):
                for cmd in links.shape_commands(end, self.shape):
                    run(cmd)

    def _start_reaper(self, state: TestbedState) -> subprocess.Popen[bytes]:
        self._reaper = subprocess.Popen([sys.executable, "-m", REAPER_MODULE, str(self.state_dir), state.tag],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
        return self._reaper

    def down(self) -> None:
        """Remove everything (processes in the hosts, links, qdiscs, namespaces, bridge, state
        file, reaper); an attached handle only lets go. Repeat calls do nothing."""
        if self.status is not Status.UP or self._state is None or not self._owned:
            self.status = Status.DOWN
            return
        teardown(self._state, self.state_dir)  # kills the reaper too
        if self._reaper is not None:
            self._reaper.wait(timeout=REAPER_EXIT_TIMEOUT_S)  # reap it: no zombie for our lifetime
        self.status = Status.DOWN

    def __enter__(self) -> Self:
        self.up()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.down()

    # --- hosts -------------------------------------------------------------------------------

    @property
    def hosts(self) -> tuple[HostInfo, ...]:
        return self.state.hosts

    @property
    def gateway(self) -> str:
        """The bridge's address: where the root namespace's servers are reached from the hosts."""
        return self.state.gateway

    def host(self, ref: HostRef) -> HostInfo:
        """Look a host up by name, index or HostInfo; ConfigError for one that is not here."""
        hosts = self.state.hosts
        if isinstance(ref, HostInfo) and ref in hosts:
            return ref
        if isinstance(ref, int) and 0 <= ref < len(hosts):
            return hosts[ref]
        for h in hosts:
            if ref in (h.name, h.netns):
                return h
        raise ConfigError(f"no host {ref!r} on testbed {self.state.tag} "
                          f"(hosts: {', '.join(h.name for h in hosts)})", field="host")

    def address(self, host: HostRef) -> str:
        return self.host(host).address

    def exec_prefix(self, host: HostRef) -> list[str]:
        """The argv prefix that runs a command inside ``host``'s network namespace."""
        return ["ip", "netns", "exec", self.host(host).netns]

    def popen(self, host: HostRef, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``host`` (keyword arguments go to Popen). The pid is the command's
        own: ``ip netns exec`` enters the namespace and then execs it. The process is recorded in
        the state file, so teardown kills it even if it has not entered the namespace yet."""
        proc = subprocess.Popen([*self.exec_prefix(host), *argv], **kwargs)
        started = start_time(proc.pid)
        if started is not None:
            self._record_process(proc.pid, started)
        return proc

    def _record_process(self, pid: int, start: float) -> None:
        """Add a process to the state file; read again under the lock, since an attached handle
        in another process may write it too."""
        with self._lock():
            current = self._current()
            self._state = dataclasses.replace(current, processes=(*current.processes, (pid, start)))
            write_state(self._state, self.state_dir)

    def _current(self) -> TestbedState:
        """The state as the state file has it now (another handle may have changed it)."""
        return next((s for s in read_states(self.state_dir) if s.tag == self.state.tag), self.state)

    def _set_faults(self, change: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]) -> None:
        with self._lock():
            current = self._current()
            self._state = dataclasses.replace(current, faults=tuple(change([dict(f) for f in current.faults])))
            write_state(self._state, self.state_dir)

    @property
    def faults(self) -> list[dict[str, Any]]:
        """The faults in force (``cut`` / ``partition``), emptied by ``heal``. Kept in the state
        file: every handle on the testbed (``attach`` in another process, the CLI) sees the same."""
        if self._state is None or self.status is not Status.UP:
            return []
        return [dict(f) for f in self._current().faults]

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        """The state directory's lock (subnet choice, state file updates)."""
        self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(self.state_dir / LOCK_FILE, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def run(self, host: HostRef, argv: list[str], *, check: bool = False,
            **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` inside ``host`` to completion (keyword arguments go to subprocess.run)."""
        return subprocess.run([*self.exec_prefix(host), *argv], check=check, **kwargs)

    def pids(self, host: HostRef) -> list[int]:
        """Processes running inside ``host``."""
        return commands.netns_pids(self.host(host).netns)

    def _ends(self, host: HostInfo, state: TestbedState | None = None) -> tuple[links.LinkEnd, links.LinkEnd]:
        """The host's end of its link (its upload) and the switch's (its download)."""
        switch = (state or self.state).switch_netns
        return links.LinkEnd(host.dev, host.netns), links.LinkEnd(host.bridge_port, switch)

    # --- faults ------------------------------------------------------------------------------

    def cut(self, host: HostRef, mode: CutMode = CutMode.DROP) -> None:
        """Take ``host`` off the network (both directions) until ``heal``."""
        h = self.host(host)
        if mode is CutMode.DOWN:
            commands.run(["ip", "-n", self.state.switch_netns, "link", "set", h.bridge_port, "down"])
        else:
            for end in self._ends(h):
                for cmd in links.cut_commands(end):
                    commands.run(cmd)
        fault = {"kind": "cut", "host": h.name, "mode": mode.value}
        self._set_faults(lambda faults: [*faults, fault])

    def partition(self, group_a: Iterable[HostRef], group_b: Iterable[HostRef]) -> None:
        """Drop all traffic between the hosts of ``group_a`` and those of ``group_b``; each group
        still reaches itself, and both reach the hosts in neither group and the gateway. A group
        may hold ``GATEWAY`` (``"gw"``): the root namespace (infra, control plane) is then cut
        from the other group's hosts too."""
        refs_a, refs_b = list(group_a), list(group_b)
        gw_a, gw_b = GATEWAY in refs_a, GATEWAY in refs_b
        a = [self.host(r) for r in refs_a if r != GATEWAY]
        b = [self.host(r) for r in refs_b if r != GATEWAY]
        if (not a and not gw_a) or (not b and not gw_b) or (gw_a and gw_b) or {h.name for h in a} & {h.name for h in b}:
            raise ConfigError("a partition needs two non-empty groups with no host in both", field="group")
        for mine, theirs, gw in ((a, b, gw_b), (b, a, gw_a)):
            for h in mine:
                targets = [t.address for t in theirs] + ([self.gateway] if gw else [])
                for cmd in links.drop_to_commands(links.LinkEnd(h.dev, h.netns), targets):
                    commands.run(cmd)
                if gw:  # what the root namespace sends to h: dropped at the switch's port to h
                    port = links.LinkEnd(h.bridge_port, self.state.switch_netns)
                    for cmd in links.drop_from_commands(port, [self.gateway]):
                        commands.run(cmd)
        fault = {"kind": "partition", "a": [h.name for h in a] + ([GATEWAY] if gw_a else []),
                 "b": [h.name for h in b] + ([GATEWAY] if gw_b else [])}
        self._set_faults(lambda faults: [*faults, fault])

    def isolate(self, hosts: Iterable[HostRef]) -> None:
        """Partition ``hosts`` from every other host and from the gateway (infra, control plane)."""
        group = [self.host(r).name for r in hosts]
        rest = [h.name for h in self.hosts if h.name not in group]
        self.partition(group, [*rest, GATEWAY])

    def heal_fault(self, fault: dict[str, Any]) -> None:
        """Undo one fault of ``faults`` (the others stay): heal all, then apply the rest again."""
        current = self.faults
        rest = [f for f in current if f != fault]
        if len(rest) == len(current):
            return  # not in force (healed already, maybe by another handle)
        self.heal()
        for f in rest:
            if f["kind"] == "cut":
                self.cut(f["host"], CutMode(f["mode"]))
            else:
                self.partition(f["a"], f["b"])

    def heal(self) -> None:
        """Undo every ``cut`` and ``partition``; the shaping stays. Harmless without faults."""
        for h in self.state.hosts:
            for end in self._ends(h):
                for cmd in links.heal_commands(end):
                    commands.run(cmd, missing_ok=True)
            # every port, not only those cut here: a fault may come from another handle (attach)
            commands.run(["ip", "-n", self.state.switch_netns, "link", "set", h.bridge_port, "up"])
        self._set_faults(lambda _faults: [])

    def describe(self) -> dict[str, Any]:
        """The state as JSON-ready data, with the faults in force."""
        return {**self.state.to_json(), "status": self.status.value, "faults": list(self.faults)}

