"""Link shaping and link faults as ``tc`` command lines (pure: building them runs nothing).

Every end of a host's link (the veth inside the host's namespace, whose egress is the host's
upload, and its peer on the bridge, whose egress is the host's download) gets the same tree::

    root 1: htb default 10
      class 1:10  rate LINK ceil LINK      the link; leaf netem delay D when a delay is asked for
      class 1:20  leaf 20: pfifo limit 0   the black hole: whatever is classified here is dropped

Faults are u32 filters on ``1:`` that send packets to ``1:20``: all of them (a cut link) or those
for the other group's addresses (a partition). Healing deletes the filters. HTB is used for the
rate instead of tbf because it is classful: the drop class sits beside the shaped one, so faults
need neither netem loss nor the gact action, which kernels built without them (this machine's)
lack. A link without a rate has no class 1:10; its traffic goes through HTB's unshaped direct
queue.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from robustrl.errors import ConfigError

LINK_CLASS = "1:10"
DROP_CLASS = "1:20"
CUT_PRIO = 1
PARTITION_PRIO = 2
MIN_BURST_BYTES = 128 * 1024
"""HTB's burst must cover a GSO packet (up to 64 KiB on a veth) or the rate comes out low."""
BURST_S = 0.001
"""Above MIN_BURST_BYTES the burst is one millisecond at the link rate."""
QUANTUM_BYTES = 65536
"""Set explicitly: HTB's default (rate / 10) passes its 200,000-byte cap above ~16 Mbit/s."""
NETEM_LIMIT_PACKETS = 10000
UNSHAPED_RATE_BPS = 100 * 10**9
"""The class rate used when a delay but no rate is asked for (netem needs a class to hang from)."""

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_NUMBER = r"(\d+(?:\.\d+)?)"


def parse_rate(text: str) -> int:
    """``"2gbit"`` -> 2_000_000_000 (bits per second); tc's units, decimal prefixes.

    Raises:
        ConfigError: not a number followed by bit, kbit, mbit, gbit or tbit, or not positive.
    """
    m = re.fullmatch(_NUMBER + r"\s*([a-z]+)", text.strip().lower())
    if not m or m.group(2) not in _RATE_UNITS:
        raise ConfigError(f"link rate {text!r} is not like 200mbit or 2gbit", field="link")
    bps = int(float(m.group(1)) * _RATE_UNITS[m.group(2)])
    if bps <= 0:
        raise ConfigError(f"link rate {text!r} must be positive", field="link")
    return bps


def parse_delay(text: str) -> float:
    """``"0.2ms"`` -> 0.0002 (seconds); units us, ms, s.

    Raises:
        ConfigError: not a number followed by one of those units.
    """
    m = re.fullmatch(_NUMBER + r"\s*([a-z]+)", text.strip().lower())
    if not m or m.group(2) not in _DELAY_UNITS:
        raise ConfigError(f"link delay {text!r} is not like 0.2ms or 50us", field="delay")
    return float(m.group(1)) * _DELAY_UNITS[m.group(2)]


@dataclass(frozen=True)
class LinkEnd:
    """One end of a host's link: a device, inside namespace ``netns`` (None: the root namespace)."""

    dev: str
    netns: str | None = None

    def tc(self, *args: str) -> list[str]:
        """``tc [-n NETNS] ARGS...`` with ``dev`` placed after the object's verb by the caller."""
        return ["tc", *(["-n", self.netns] if self.netns else []), *args]


@dataclass(frozen=True)
class LinkShape:
    """What every link of a testbed looks like, in each direction: ``rate_bps`` in bit/s (None:
    unshaped) and ``delay_s`` added per crossing of a link. A packet between two hosts crosses the
    sender's link and the receiver's, so it is delayed 2 x ``delay_s`` (a round trip 4 x), as
    between two machines on one switch."""

    rate_bps: int | None = None
    delay_s: float = 0.0

    @classmethod
    def parse(cls, link: str | None, delay: str | None) -> LinkShape:
        return cls(rate_bps=parse_rate(link) if link else None,
                   delay_s=parse_delay(delay) if delay else 0.0)


def shape_commands(end: LinkEnd, shape: LinkShape) -> list[list[str]]:
    """The commands that give ``end`` its qdisc tree (see the module docstring)."""
    dev = ["dev", end.dev]
    cmds = [end.tc("qdisc", "replace", *dev, "root", "handle", "1:", "htb", "default", "10")]
    rate = shape.rate_bps or (UNSHAPED_RATE_BPS if shape.delay_s > 0 else None)
    if rate is not None:
        burst = max(MIN_BURST_BYTES, int(rate / 8 * BURST_S))
        cmds.append(end.tc("class", "add", *dev, "parent", "1:", "classid", LINK_CLASS, "htb",
                           "rate", f"{rate}bit", "ceil", f"{rate}bit", "burst", str(burst),
                           "cburst", str(burst), "quantum", str(QUANTUM_BYTES)))
    if shape.delay_s > 0:
        cmds.append(end.tc("qdisc", "add", *dev, "parent", LINK_CLASS, "handle", "10:", "netem",
                           "delay", f"{shape.delay_s * 1e6:.0f}us", "limit", str(NETEM_LIMIT_PACKETS)))
    cmds.append(end.tc("class", "add", *dev, "parent", "1:", "classid", DROP_CLASS, "htb", "rate", "8kbit"))
    cmds.append(end.tc("qdisc", "add", *dev, "parent", DROP_CLASS, "handle", "20:", "pfifo", "limit", "0"))
    return cmds


def cut_commands(end: LinkEnd) -> list[list[str]]:
    """Drop every packet (ARP included) leaving through ``end``."""
    return [end.tc("filter", "add", "dev", end.dev, "parent", "1:", "protocol", "all", "prio", str(CUT_PRIO),
                   "u32", "match", "u32", "0", "0", "flowid", DROP_CLASS)]


def drop_to_commands(end: LinkEnd, addresses: list[str]) -> list[list[str]]:
    """Drop IPv4 packets leaving through ``end`` for any of ``addresses`` (ARP still passes)."""
    return [end.tc("filter", "add", "dev", end.dev, "parent", "1:", "protocol", "ip", "prio", str(PARTITION_PRIO),
                   "u32", "match", "ip", "dst", f"{addr}/32", "flowid", DROP_CLASS) for addr in addresses]


def drop_from_commands(end: LinkEnd, addresses: list[str]) -> list[list[str]]:
    """Drop IPv4 packets leaving through ``end`` that come from any of ``addresses``."""
    return [end.tc("filter", "add", "dev", end.dev, "parent", "1:", "protocol", "ip", "prio", str(PARTITION_PRIO),
                   "u32", "match", "ip", "src", f"{addr}/32", "flowid", DROP_CLASS) for addr in addresses]


def heal_commands(end: LinkEnd) -> list[list[str]]:
    """Remove every fault filter of ``end`` (the shaping stays)."""
    return [end.tc("filter", "del", "dev", end.dev, "parent", "1:")]
