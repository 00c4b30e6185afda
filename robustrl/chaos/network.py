"""Real network faults on a testbed: ``net_drop`` and ``partition`` act on a host's link with tc
(``robustrl.testbed``), not inside the member's process.

* ``net_drop``: every packet to or from the member's host is dropped (``Testbed.cut``, the
  ``drop`` mode): a dead switch port, peers see only timeouts.
* ``partition``: the member's host is cut from the hosts in ``against`` (default: every other
  host and the gateway, where the infra and the control plane run), each side still reaching
  the rest (``Testbed.partition``).

With ``duration_s`` > 0 the fault is healed after that long (only that fault: others in force
stay); with 0 it lasts until ``heal`` (``robustrl testbed heal TAG``, the testbed's owner).
Without a testbed ``net_drop`` stays what it was (the member closes its NATS connection) and a
``partition`` is refused with the reason.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from robustrl.errors import ConfigError
from robustrl.testbed.testbed import GATEWAY, CutMode, Testbed

NETWORK_KINDS = ("net_drop", "partition")


class NetworkFaults:
    """Carries out network faults on one testbed; thread-safe (timers heal from their threads)."""

    def __init__(self, testbed: Testbed) -> None:
        self.testbed = testbed
        self._lock = threading.Lock()
        self._timers: list[threading.Timer] = []

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
            timer = threading.Timer(duration_s, self.heal, args=(fault,))
            timer.daemon = True
            timer.start()
            self._timers.append(timer)
        return fault

    def heal(self, fault: dict[str, Any] | None = None) -> None:
        """Undo ``fault`` (None: every fault in force)."""
        with self._lock:
            if fault is None:
                self.testbed.heal()
            else:
                self.testbed.heal_fault(fault)

    def close(self) -> None:
        """Stop the pending heal timers (the faults they would heal stay until ``heal``)."""
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()


def for_launcher(launcher: object) -> NetworkFaults | None:
    """Network faults on the testbed a launcher places members on (None: no testbed)."""
    from robustrl.testbed.placement import RolePlacement

    placement = getattr(launcher, "placement", None)
    if isinstance(placement, RolePlacement):
        return NetworkFaults(placement.testbed)
    if isinstance(placement, Testbed):
        return NetworkFaults(placement)
    return None
