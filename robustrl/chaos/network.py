"""Real network faults on a testbed: ``net_drop`` and ``partition`` act on a host's link with tc
(``robustrl.testbed``), not inside the member's process.

* ``net_drop``: every packet to or from the member's host is dropped (``Testbed.cut``, the
  ``drop`` mode): a dead switch port, peers see only timeouts.
* ``partition``: the member's host is cut from the hosts in ``against`` (default: every other
  host and the gateway, where the infra and the control plane run), each side still reaching
  the rest (``Testbed.partition``).

With ``duration_s`` > 0 the fault is healed after that long (only that fault: others in force
stay); with 0 it lasts until ``heal`` (``robustrl testbed heal TAG``, the testbed's owner). The
timed heal is done by a small process of its own (``heal-at``, started with the fault, in its own
session), not by a timer in the controller: a controller that dies before the deadline would
otherwise leave the host cut for good. ``close`` stops those processes (the faults stay until
``heal``); a healer whose testbed is gone exits at once.
Without a testbed ``net_drop`` stays what it was (the member closes its NATS connection) and a
``partition`` is refused with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from robustrl.errors import ConfigError, TestbedError
from robustrl.testbed.state import read_states
from robustrl.testbed.testbed import GATEWAY, CutMode, Testbed

NETWORK_KINDS = ("net_drop", "partition")
HEALER_POLL_S = 0.2
"""How often a healer waiting for its deadline checks that its testbed still exists."""


class NetworkFaults:
    """Carries out network faults on one testbed; thread-safe."""

    def __init__(self, testbed: Testbed) -> None:
        self.testbed = testbed
        self._lock = threading.Lock()
        self._healers: list[subprocess.Popen[bytes]] = []

    def check_hosts(self, hosts: Sequence[str]) -> list[str]:
        """Host names as the testbed spells them; ConfigError naming a host it does not have."""
        return [GATEWAY if h == GATEWAY else self.testbed.host(h).name for h in hosts]

    def check(self, kind: str, host: str, against: Sequence[str] = ()) -> tuple[str, list[str]]:
        """Validate a fault before anything is done or logged: ``host`` and the hosts it is cut
        from, as the testbed spells them. Raises ConfigError (see ``inject``)."""
        if kind not in NETWORK_KINDS:
            raise ConfigError(f"{kind!r} is not a network fault ({', '.join(NETWORK_KINDS)})", field="kind")
        name = self.testbed.host(host).name
        if kind == "net_drop":
            if against:
                raise ConfigError("net_drop cuts the host from everyone: 'against' is for partition",
                                  field="against")
            return name, []
        other = self.check_hosts(against) if against else \
            [*(h.name for h in self.testbed.hosts if h.name != name), GATEWAY]
        if name in other:
            raise ConfigError(f"{name} cannot be partitioned from itself", field="against")
        return name, other

    def inject(self, kind: str, host: str, duration_s: float = 0.0,
               against: Sequence[str] = ()) -> dict[str, Any]:
        """Cut (``net_drop``) or partition ``host``; returns the fault as the testbed records it.

        Raises:
            ConfigError: an unknown kind or host, or ``host`` also in ``against``.
        """
        name, other = self.check(kind, host, against)
        with self._lock:
            if kind == "net_drop":
                self.testbed.cut(name, CutMode.DROP)
            else:
                self.testbed.partition([name], other)
            fault = dict(self.testbed.faults[-1])
        if duration_s > 0:
            self._healers = [p for p in self._healers if p.poll() is None]
            self._healers.append(spawn_healer(self.testbed, fault, time.time() + duration_s))
        return fault

    def heal(self, fault: dict[str, Any] | None = None) -> None:
        """Undo ``fault`` (None: every fault in force)."""
        with self._lock:
            if fault is None:
                self.testbed.heal()
            else:
                self.testbed.heal_fault(fault)

    def close(self) -> None:
        """Stop the pending heals (the faults they would heal stay until ``heal``)."""
        for proc in self._healers:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._healers:
            proc.wait()
        self._healers.clear()


def spawn_healer(testbed: Testbed, fault: dict[str, Any], at: float) -> subprocess.Popen[bytes]:
    """A process that heals ``fault`` at ``at`` (``time.time()``) through its own handle on the
    testbed, whatever happens to this one meanwhile (see the module docstring)."""
    root = str(Path(__file__).resolve().parents[2])  # this code's checkout, for the child's imports
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    argv = [sys.executable, "-m", "robustrl.chaos.network", "heal-at", testbed.state.tag, json.dumps(fault),
            repr(at), "--state-dir", str(testbed.state_dir)]
    return subprocess.Popen(argv, env=env, start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def heal_at(tag: str, fault: dict[str, Any], at: float, state_dir: Path) -> bool:
    """Wait until ``at``, then heal ``fault`` on testbed ``tag`` if it is still in force; False if
    the testbed went away first."""
    while (left := at - time.time()) > 0:
        if not any(s.tag == tag for s in read_states(state_dir)):
            return False
        time.sleep(min(left, HEALER_POLL_S))
    try:
        Testbed.attach(tag, state_dir).heal_fault(fault)
    except TestbedError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m robustrl.chaos.network")
    sub = ap.add_subparsers(dest="cmd", required=True)
    heal = sub.add_parser("heal-at", help="heal one fault of a testbed at a time (epoch seconds)")
    heal.add_argument("tag")
    heal.add_argument("fault", help="the fault as the testbed records it (JSON)")
    heal.add_argument("at", type=float)
    heal.add_argument("--state-dir", type=Path, required=True)
    args = ap.parse_args(argv)
    heal_at(args.tag, json.loads(args.fault), args.at, args.state_dir)
    return 0


def for_launcher(launcher: object) -> NetworkFaults | None:
    """Network faults on the testbed a launcher places members on (None: no testbed)."""
    from robustrl.testbed.placement import RolePlacement

    placement = getattr(launcher, "placement", None)
    if isinstance(placement, RolePlacement):
        return NetworkFaults(placement.testbed)
    if isinstance(placement, Testbed):
        return NetworkFaults(placement)
    return None


if __name__ == "__main__":
    sys.exit(main())
