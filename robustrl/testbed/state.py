"""What a testbed is made of, named and written down before anything is created.

The state file (``STATE_DIR/<tag>.json``) is written first and removed last, so every namespace,
veth and bridge on the machine either belongs to a state file or is a leftover of a crash; a sweep
can tell which testbeds are stale by their owner pid and its start time (a recycled pid has
another). Every name carries the testbed's tag: several testbeds coexist, and a stray object's tag
says which testbed it came from.

Layout: the bridge lives in a namespace of its own, the switch ``rrl-<tag>-sw``: there the kernel's
bridge netfilter hook meets a fresh, empty firewall, not the machine's (Docker's FORWARD policy is
DROP, and a per-bridge ``nf_call_iptables 0`` cannot override the global sysctl). Host i is the
namespace ``rrl-<tag>-h<i>``; its link is a veth, ``eth0`` in the host and port ``p<i>`` on the
switch's bridge ``br0``. The root namespace joins the bridge through the veth ``rrl<tag>gw``
(the gateway address), so servers outside the hosts are reachable from them. Only the gateway
veth and the namespace names are visible in the root namespace; deleting a namespace deletes the
devices in it.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import secrets
from dataclasses import asdict, dataclass, field
from pathlib import Path

from robustrl.errors import ConfigError
from robustrl.procs import is_running

STATE_DIR = Path("/run/robustrl-testbed")
PREFIX = "rrl"
HOST_DEV = "eth0"
TAG_HEX = 6
MAX_HOSTS = 250
START_TIME_TOLERANCE_S = 0.05
GATEWAY_OCTET = 254
"""The bridge's own address in the subnet: the root namespace reaches every host through it."""

_TAG_RE = re.compile(rf"[0-9a-f]{{{TAG_HEX}}}")
NETNS_RE = re.compile(rf"{PREFIX}-([0-9a-f]{{{TAG_HEX}}})-(?:h\d+|sw)")
LINK_RE = re.compile(rf"{PREFIX}([0-9a-f]{{{TAG_HEX}}})gw")
BRIDGE = "br0"
SWITCH_GATEWAY_PORT = "gw"


def new_tag() -> str:
    return secrets.token_hex(TAG_HEX // 2)


def gateway_dev_name(tag: str) -> str:
    return f"{PREFIX}{tag}gw"


def switch_netns_name(tag: str) -> str:
    return f"{PREFIX}-{tag}-sw"


def netns_name(tag: str, index: int) -> str:
    return f"{PREFIX}-{tag}-h{index}"


def bridge_port_name(index: int) -> str:
    return f"p{index}"


def tag_of(name: str) -> str | None:
    """The tag in one of our namespace or link names; None for anything else."""
    m = NETNS_RE.fullmatch(name) or LINK_RE.fullmatch(name)
    return m.group(1) if m else None


@dataclass(frozen=True)
class HostInfo:
    """One emulated host: its name (``h0``...), namespace, address and the bridge end of its link
    (a port in the switch namespace)."""

    name: str
    netns: str
    address: str
    bridge_port: str
    dev: str = HOST_DEV


@dataclass(frozen=True)
class TestbedState:
    """Everything a testbed created, and who owns it (``owner_pid`` None: detached, kept until
    ``robustrl testbed down``)."""

    __test__ = False  # not a pytest test class despite the name

    tag: str
    subnet: str
    switch_netns: str
    bridge: str
    gateway_dev: str
    gateway: str
    hosts: tuple[HostInfo, ...]
    link: str | None
    delay: str | None
    owner_pid: int | None
    owner_start: float | None
    reaper_pid: int | None = None
    reaper_start: float | None = None
    created_at: float = field(default=0.0)
    processes: tuple[tuple[int, float], ...] = ()
    """(pid, start time) of the processes started through ``Testbed.popen``: killed on teardown
    even if they are still on their way into a namespace (``ip netns exec`` before its setns)."""
    faults: tuple[dict[str, object], ...] = ()
    """The faults in force (``Testbed.cut`` / ``partition``), from any handle or process."""

    @classmethod
    def plan(cls, tag: str, subnet: str, n_hosts: int, link: str | None, delay: str | None,
             owner_pid: int | None, owner_start: float | None, created_at: float) -> TestbedState:
        """Name and address every object of a testbed with ``n_hosts`` hosts on ``subnet`` (a /24
        or larger: hosts get .1..N, the bridge .254)."""
        if not _TAG_RE.fullmatch(tag):
            raise ConfigError(f"testbed tag {tag!r} is not {TAG_HEX} hex digits", field="tag")
        if not 1 <= n_hosts <= MAX_HOSTS:
            raise ConfigError(f"hosts must be 1..{MAX_HOSTS}, got {n_hosts}", field="hosts")
        try:
            net = ipaddress.IPv4Network(subnet)
        except ValueError as exc:
            raise ConfigError(f"subnet {subnet!r}: {exc}", field="subnet") from exc
        if net.prefixlen > 24:
            raise ConfigError(f"subnet {subnet} is smaller than a /24", field="subnet")
        hosts = tuple(HostInfo(f"h{i}", netns_name(tag, i), str(net.network_address + i + 1),
                               bridge_port_name(i)) for i in range(n_hosts))
        return cls(tag=tag, subnet=str(net), switch_netns=switch_netns_name(tag), bridge=BRIDGE,
                   gateway_dev=gateway_dev_name(tag),
                   gateway=str(net.network_address + GATEWAY_OCTET), hosts=hosts, link=link, delay=delay,
                   owner_pid=owner_pid, owner_start=owner_start, created_at=created_at)

    @property
    def prefixlen(self) -> int:
        return ipaddress.IPv4Network(self.subnet).prefixlen

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, object]) -> TestbedState:
        """Parse a state file's content; raises ConfigError naming the field that is wrong."""
        try:
            hosts = tuple(HostInfo(**h) for h in raw["hosts"])  # type: ignore[union-attr, arg-type]
            procs = tuple((int(p), float(t)) for p, t in raw.get("processes", ()))  # type: ignore[union-attr]
            faults = tuple(dict(f) for f in raw.get("faults", ()))  # type: ignore[union-attr]
            return cls(**{**raw, "hosts": hosts, "processes": procs, "faults": faults})  # type: ignore[arg-type]
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"testbed state is malformed: {exc}", field="hosts") from exc

    def owner_alive(self) -> bool:
        """True while the owning process runs (always for a detached testbed)."""
        if self.owner_pid is None:
            return True
        return process_alive(self.owner_pid, self.owner_start)


def process_alive(pid: int, start: float | None) -> bool:
    """True if ``pid`` runs and, when ``start`` is given, is the process that started then."""
    return is_running(pid, start, START_TIME_TOLERANCE_S)


def state_path(tag: str, state_dir: Path = STATE_DIR) -> Path:
    return state_dir / f"{tag}.json"


def write_state(state: TestbedState, state_dir: Path = STATE_DIR) -> Path:
    """Write atomically (a reader never sees half a file)."""
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = state_path(state.tag, state_dir)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(state.to_json(), indent=1))
    os.replace(tmp, path)
    return path


def read_states(state_dir: Path = STATE_DIR) -> list[TestbedState]:
    """Every readable state file; unreadable ones are skipped (their objects are orphans)."""
    out = []
    for path in sorted(state_dir.glob("*.json")) if state_dir.is_dir() else []:
        try:
            out.append(TestbedState.from_json(json.loads(path.read_text())))
        except (OSError, ValueError, ConfigError):
            continue
    return out


def free_subnet(used: set[str], base: str = "10.213.0.0/16") -> str:
    """The first /24 of ``base`` that no live testbed uses."""
    for sub in ipaddress.IPv4Network(base).subnets(new_prefix=24):
        if str(sub) not in used:
            return str(sub)
    raise ConfigError(f"every /24 of {base} is in use by a testbed", field="subnet")
