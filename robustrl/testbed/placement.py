"""Placing a job's members on testbed hosts: which role runs on which hosts.

A :class:`RolePlacement` maps a role to hosts, e.g. ``{"trainer": ["h0"], "rollout": ["h1", "h2"]}``.
The local launcher asks it for a host (``assign``) when it starts a member whose spec names none:

* rollout replica ``rollout-<slot>-i<incarnation>`` goes to host ``(slot + incarnation) mod n``
  of the role's hosts, so the slots spread over the hosts whatever order they start in, and a
  replacement lands on the next host rather than on the one its predecessor died on (a member id
  of another shape: round-robin in start order);
* a trainer gang starts at the next of the role's hosts for each new gang of the job. With the
  gang's strategy ``PACK`` / ``STRICT_PACK`` every rank goes there (a gang on one host is one
  multi-GPU node); with ``SPREAD`` / ``STRICT_SPREAD`` rank r goes to the r-th host after it, so
  the ranks are split over the hosts (``STRICT_SPREAD`` with fewer hosts than ranks is refused).
  The ranks meet at ``MASTER_ADDR``: the launcher's ``rendezvous`` asks for rank 0's host before
  the gang starts, and rank 0 then starts there (a member's host is fixed once chosen).

Roles without hosts run where the launcher runs. The stack hands the placement to the controller
process through its environment (``to_env`` / ``from_env``); infra and the control plane stay in
the root namespace, reached from the hosts through the testbed's gateway address.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from robustrl.errors import ConfigError, LaunchError, TestbedError
from robustrl.launcher.base import MemberSpec, rollout_slot
from robustrl.testbed.state import STATE_DIR
from robustrl.testbed.testbed import Testbed

ENV_TESTBED = "ROBUSTRL_TESTBED"
"""The testbed's tag: the controller attaches to it (``Testbed.attach``)."""
ENV_TESTBED_DIR = "ROBUSTRL_TESTBED_DIR"
ENV_PLACEMENT = "ROBUSTRL_PLACEMENT"
"""JSON ``{role: [host, ...]}``."""
ENV_BIND_HOST = "ROBUSTRL_BIND_HOST"
PLACED_ROLES = ("trainer", "rollout")


@dataclass
class RolePlacement:
    """Hosts per role on one testbed; also a launcher ``Placement`` (``exec_prefix``, ``address``)."""

    testbed: Testbed
    roles: dict[str, tuple[str, ...]]
    _next: dict[tuple[str, str], int] = field(default_factory=dict)  # (job, role) -> members placed
    _gang_host: dict[str, str] = field(default_factory=dict)  # job -> its current gang's host
    _gang_base: dict[tuple[str, str], int] = field(default_factory=dict)  # (job, gang) -> rank 0's host index
    _assigned: dict[str, str] = field(default_factory=dict)  # gang member -> its host, once chosen
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def parse(cls, testbed: Testbed, raw: Mapping[str, Sequence[str]]) -> RolePlacement:
        """Validate ``{role: [host, ...]}`` against the testbed.

        Raises:
            ConfigError: not a mapping of lists, an unknown role, an empty list, or a host the
                testbed does not have (the message lists the hosts it has).
        """
        if not isinstance(raw, Mapping):
            raise ConfigError(f"placement must map roles to host lists, got {raw!r}", field="placement")
        roles: dict[str, tuple[str, ...]] = {}
        for role, hosts in raw.items():
            if role not in PLACED_ROLES:
                raise ConfigError(f"placement: unknown role {role!r} (placed roles: {', '.join(PLACED_ROLES)})",
                                  field=f"placement.{role}")
            if isinstance(hosts, str) or not isinstance(hosts, Sequence) or not hosts:
                raise ConfigError(f"placement.{role} must be a non-empty list of hosts, got {hosts!r}",
                                  field=f"placement.{role}")
            try:
                roles[role] = tuple(testbed.host(h).name for h in hosts)
            except ConfigError as exc:
                raise ConfigError(f"placement.{role}: {exc.message}", field=f"placement.{role}") from exc
        return cls(testbed, roles)

    # --- the launcher's Placement --------------------------------------------------------------

    def exec_prefix(self, host: str) -> list[str]:
        return self.testbed.exec_prefix(host)

    def address(self, host: str) -> str:
        return self.testbed.address(host)

    def assign(self, spec: MemberSpec) -> str | None:
        """The host for a member about to start (None: not placed); see the module docstring."""
        hosts = self.roles.get(spec.role)
        if not hosts:
            return None
        if spec.role == "trainer" and spec.placement.gang:
            return self._assign_rank(spec, hosts)
        with self._lock:
            gang = self._gang_host.get(spec.job_id)
            if spec.role == "trainer" and spec.env.get("ROBUSTRL_RANK", "0") != "0" and gang:
                return gang  # the rest of the gang joins rank 0's host
            n = self._next.get((spec.job_id, spec.role), 0)
            self._next[(spec.job_id, spec.role)] = n + 1
            if spec.role == "rollout" and (slot := rollout_slot(spec.member_id)):
                # By slot and incarnation, not by start order: a job's replicas start concurrently
                # (each after a lease check), so the order of the calls here is not the slots'.
                n = sum(slot)
            host = hosts[n % len(hosts)]
            if spec.role == "trainer":
                self._gang_host[spec.job_id] = host
            return host

    def _assign_rank(self, spec: MemberSpec, hosts: tuple[str, ...]) -> str:
        """A rank of a gang the controller named (``PlacementHint.gang``): see the module docstring.

        Raises:
            LaunchError: ``STRICT_SPREAD`` over fewer hosts than the gang has ranks.
        """
        p = spec.placement
        assert p.gang is not None
        spread = p.strategy in ("SPREAD", "STRICT_SPREAD")
        if p.strategy == "STRICT_SPREAD" and p.gang_size > len(hosts):
            raise LaunchError(f"placement.strategy STRICT_SPREAD needs a host per rank: {p.gang_size} ranks, "
                              f"trainer hosts {', '.join(hosts)}", field="placement.strategy", member=spec.member_id)
        with self._lock:
            if spec.member_id in self._assigned:  # rank 0: chosen at the rendezvous, then started
                return self._assigned[spec.member_id]
            base = self._gang_base.get((spec.job_id, p.gang))
            if base is None:
                # A gang whose rank 0 is already running (kept from the broken gang, or a borrowed
                # replica) meets at that rank's address: the other ranks are laid out from its host.
                master = spec.env.get("MASTER_ADDR")
                base = next((i for i, h in enumerate(hosts) if master and self.address(h) == master), None)
                if base is None:
                    n = self._next.get((spec.job_id, "trainer"), 0)
                    self._next[(spec.job_id, "trainer")] = n + 1
                    base = n % len(hosts)
                self._gang_base[(spec.job_id, p.gang)] = base
            host = hosts[(base + p.gang_rank) % len(hosts)] if spread else hosts[base]
            self._assigned[spec.member_id] = host
            return host

    def member_env(self, host: str) -> dict[str, str]:
        """What a member placed on ``host`` needs: its servers bind on the host's address, which
        members on other hosts reach (the host's loopback is its own)."""
        return {ENV_BIND_HOST: self.address(host)}

    # --- through the environment ---------------------------------------------------------------

    def to_env(self) -> dict[str, str]:
        return {ENV_TESTBED: self.testbed.state.tag, ENV_TESTBED_DIR: str(self.testbed.state_dir),
                ENV_PLACEMENT: json.dumps({r: list(h) for r, h in self.roles.items()})}

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> RolePlacement | None:
        """The placement the stack put in ``env`` (None when there is no testbed).

        Raises:
            ConfigError: the testbed named is not up, or the placement is malformed.
        """
        tag = env.get(ENV_TESTBED)
        if not tag:
            return None
        try:
            tb = Testbed.attach(tag, Path(env.get(ENV_TESTBED_DIR) or STATE_DIR))
        except TestbedError as exc:  # the testbed is gone
            raise ConfigError(f"{ENV_TESTBED}={tag}: {exc}", field=ENV_TESTBED) from exc
        try:
            raw = json.loads(env.get(ENV_PLACEMENT) or "{}")
        except ValueError as exc:
            raise ConfigError(f"{ENV_PLACEMENT} is not JSON: {exc}", field=ENV_PLACEMENT) from exc
        return cls.parse(tb, raw)
