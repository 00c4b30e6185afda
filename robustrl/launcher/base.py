"""The launcher interface: how the controller starts, stops, kills and replaces role members.

Two implementations share it: the local process launcher (``robustrl.launcher.local``) and the
Docker launcher (``robustrl.launcher.docker``). Recovery code only sees this interface.
"""

from __future__ import annotations

import abc
import enum
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from robustrl.errors import LaunchError
from robustrl.ports import free_port

log = logging.getLogger(__name__)

TRAINER_MODULE = "robustrl.services.trainer"
ROLLOUT_MODULE = "robustrl.services.rollout"
"""What a trainer worker / rollout replica runs (``python -m``): the launchers and the controller
spell the member modules only here."""

_ROLLOUT_MEMBER = re.compile(r"(?:^|--)rollout-(\d+)-i(\d+)$")
"""A rollout member id, ``rollout-<slot>-i<incarnation>`` (services.controller.launching), bare or as
a launcher key (``<job>--<member>``)."""


def rollout_slot(member_id: str) -> tuple[int, int] | None:
    """(slot, incarnation) of a rollout member id or launcher key; None for any other member."""
    m = _ROLLOUT_MEMBER.search(member_id)
    return (int(m.group(1)), int(m.group(2))) if m else None


class RestockRetries:
    """Restocks of a launcher's warm spare pool, one at a time, and the back-off after a failed one:
    ``retry_later(delay)`` is asked for once however many restocks fail meanwhile (one retry
    chain), ``first_s`` after the first failure, doubled per failure in a row up to ``max_s``.
    Used by the Docker and Ray launchers (timer threads and ``keep_spares`` call it)."""

    def __init__(self, first_s: float, max_s: float) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self.lock = threading.Lock()
        self.failures = 0  # restocks failed in a row
        self.retry_pending = False  # the retry after a failed restock is scheduled

    def run(self, restock_locked: Callable[[], bool], retry_later: Callable[[float], None]) -> None:
        """``restock_locked()`` (True: the pool is whole) under the lock; never raises."""
        with self.lock:
            try:
                done = restock_locked()
            except Exception:  # a timer thread would die with it, and the restock be lost
                log.exception("restocking the warm spares failed")
                done = False
            if done:
                self.failures = 0
                return
            self.failures += 1
            delay = min(self.first_s * 2 ** (self.failures - 1), self.max_s)
            log.warning("warm spare pool short (restock failure %d in a row): trying again in %.0f s",
                        self.failures, delay)
            if self.retry_pending:
                return
            self.retry_pending = True
        retry_later(delay)

    def retrying(self) -> None:
        """The scheduled retry runs now (the next failure may schedule one again)."""
        with self.lock:
            self.retry_pending = False


class MemberState(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    SUSPENDED = "suspended"
    EXITED = "exited"
    STOPPED = "stopped"


GANG_STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")
"""How a trainer gang's ranks are laid on nodes (Ray placement-group strategies; Kubernetes
renders PACK as pod affinity and STRICT_SPREAD as pod anti-affinity on the hostname)."""
SOFT_STRATEGIES = ("PACK", "SPREAD")
"""Gang strategies a rank from outside the gang's placement (a warm spare, a borrowed replica) may
follow as a preference; the others (STRICT_*) only a placement of the whole gang holds."""
ANTI_AFFINITY = ("none", "preferred", "required")
"""Between members of one ``PlacementHint.group``: none, on distinct nodes when possible, or
only on distinct nodes (a start that cannot honour it fails)."""
MAX_CPUS = 1024.0
MAX_GPUS = 64.0
_LABEL = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_./-]{0,251}[A-Za-z0-9])?$")


@dataclass(frozen=True)
class Resources:
    """What one member reserves. ``cpus`` None: the launcher's default; ``memory_mb`` None: no
    memory reservation. Launchers that cannot reserve say so in their log (``ignored``)."""

    cpus: float | None = None
    gpus: float = 0.0
    memory_mb: int | None = None


@dataclass(frozen=True)
class PlacementHint:
    """Where a member may run, beyond ``MemberSpec.host``.

    ``node_labels``: the node must carry every label (Ray ``--labels``, Kubernetes node labels).
    ``group`` + ``anti_affinity``: members of one group spread over nodes (rollout replicas of a
    job; the ranks of a gang use ``strategy`` instead). ``gang``/``gang_rank``/``gang_size``: the
    member is rank ``gang_rank`` of a gang placed as a whole (one Ray placement group) with
    ``strategy``.
    """

    node_labels: Mapping[str, str] = field(default_factory=dict)
    group: str | None = None
    anti_affinity: str = "none"
    gang: str | None = None
    gang_rank: int = 0
    gang_size: int = 1
    strategy: str = "PACK"


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_spec(spec: MemberSpec) -> None:
    """Validate a spec's resources and placement; raise LaunchError naming the bad field."""
    def bad(fld: str, why: str) -> LaunchError:
        return LaunchError(f"member {spec.member_id}: {fld} {why}", member=spec.member_id, field=fld)

    r, p = spec.resources, spec.placement
    if r.cpus is not None and not (_finite(r.cpus) and 0 <= r.cpus <= MAX_CPUS):
        raise bad("resources.cpus", f"must be a number in [0, {MAX_CPUS:g}], got {r.cpus!r}")
    if not (_finite(r.gpus) and 0 <= r.gpus <= MAX_GPUS):
        raise bad("resources.gpus", f"must be a number in [0, {MAX_GPUS:g}], got {r.gpus!r}")
    if r.memory_mb is not None and not (isinstance(r.memory_mb, int) and not isinstance(r.memory_mb, bool)
                                        and r.memory_mb > 0):
        raise bad("resources.memory_mb", f"must be a positive integer, got {r.memory_mb!r}")
    if p.strategy not in GANG_STRATEGIES:
        raise bad("placement.strategy", f"must be one of {', '.join(GANG_STRATEGIES)}, got {p.strategy!r}")
    if p.anti_affinity not in ANTI_AFFINITY:
        raise bad("placement.anti_affinity", f"must be one of {', '.join(ANTI_AFFINITY)}, got {p.anti_affinity!r}")
    for key, value in dict(p.node_labels).items():
        if not (isinstance(key, str) and _LABEL.match(key) and isinstance(value, str)
                and (value == "" or _LABEL.match(value))):
            raise bad("placement.node_labels", f"has an invalid label {key!r}={value!r}")
    if p.gang is not None and not (isinstance(p.gang_size, int) and p.gang_size >= 1
                                   and isinstance(p.gang_rank, int) and 0 <= p.gang_rank < p.gang_size):
        raise bad("placement.gang_rank", f"must be in [0, gang_size={p.gang_size!r}), got {p.gang_rank!r}")


TAIL_BYTES = 64 * 1024
"""How much of the end of a member's log ``log_tail`` reads."""


def log_tail(path: str | None, lines: int) -> str:
    """The last ``lines`` lines of the log at ``path`` ("" without one, or unreadable)."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - TAIL_BYTES))
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


@dataclass(frozen=True)
class MemberSpec:
    """What to run for one role member.

    ``module`` is a Python module run as ``python -m module``; ``env`` is the complete
    extra environment (infrastructure settings, job id, member id, rank). ``host`` places the
    member on a host of the launcher's :class:`Placement` (a testbed host such as ``"h1"``; a
    node IP or node id for the Ray launcher); None runs it where the launcher runs.
    ``resources`` and ``placement`` are honoured by launchers that place members on several nodes
    (Ray, the Kubernetes renderer); the others log what they ignore and why (``ignored``).
    ``cold``: start a new process, never a warm spare (the slot's last start, from a spare, failed:
    the spares may all be broken the same way, and a cold start is what tells).
    """

    job_id: str
    member_id: str
    role: str
    module: str
    env: dict[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    host: str | None = None
    resources: Resources = field(default_factory=Resources)
    placement: PlacementHint = field(default_factory=PlacementHint)
    cold: bool = False


class Placement(Protocol):
    """Hosts a launcher can place members on (``robustrl.testbed.Testbed`` is one)."""

    def exec_prefix(self, host: str) -> list[str]:
        """The argv prefix that runs a command on ``host``; raises RobustRLError for an unknown host."""
        ...

    def address(self, host: str) -> str:
        """The address other members use to reach ``host``."""
        ...


@dataclass
class ExitInfo:
    """A member that ended. ``returncode`` is None when unknown (a re-attached process, a
    container removed behind the launcher's back); ``exited_at`` is when the launcher saw it end."""

    member_id: str
    role: str
    returncode: int | None
    expected: bool
    exited_at: float = field(default_factory=time.time)


def switchable(spec: MemberSpec) -> bool:
    """Whether the member ``spec`` describes can switch in place to a trainer rank
    (``Launcher.relabel``): a rollout replica of either engine (a torch replica hands over its
    model; a vLLM replica shuts its engine down and builds the policy from the version it served,
    ``services/rollout/standby.py``) or a trainer rank (its process runs the same trainer code
    again under the new rank)."""
    return ((spec.role == "rollout" and spec.module in ("", ROLLOUT_MODULE))
            or (spec.role == "trainer" and spec.module in ("", TRAINER_MODULE)))


class Launcher(abc.ABC):
    """Start/stop/kill role members. Every call is idempotent for an unknown or dead member."""

    @abc.abstractmethod
    def start(self, spec: MemberSpec) -> None:
        """Start a member; raise LaunchError if it cannot be started."""

    @abc.abstractmethod
    def stop(self, member_id: str, grace_s: float = 2.0) -> None:
        """Ask a member to exit (SIGTERM / container stop), then kill it after ``grace_s``."""

    @abc.abstractmethod
    def kill(self, member_id: str, expected: bool = False) -> None:
        """Kill the member's whole process group at once: a machine loss.

        ``expected`` marks a kill the controller ordered (recovery), so its exit is not a fault.
        """

    @abc.abstractmethod
    def suspend(self, member_id: str) -> None:
        """Freeze the member (SIGSTOP / container pause): a hang."""

    @abc.abstractmethod
    def resume(self, member_id: str) -> None:
        """Undo ``suspend``."""

    @abc.abstractmethod
    def poll(self) -> list[ExitInfo]:
        """Members that ended since the last call (each reported once)."""

    @abc.abstractmethod
    def state(self, member_id: str) -> MemberState | None:
        """Current state, or None for a member this launcher never started."""

    @abc.abstractmethod
    def pid(self, member_id: str) -> int | None:
        """OS pid (or container pid) when known."""

    def stop_many(self, member_ids: list[str], grace_s: float = 2.0) -> None:
        """Stop several members in parallel: signal all first, then wait once."""
        for member_id in member_ids:
            self.stop(member_id, grace_s)

    def host_for(self, member_id: str) -> str:
        """The address other members use to reach ``member_id`` (e.g. the gang's MASTER_ADDR)."""
        del member_id
        return "127.0.0.1"

    def rendezvous(self, spec: MemberSpec) -> tuple[str, int]:
        """MASTER_ADDR and MASTER_PORT for the gang whose rank 0 is ``spec`` (not started yet).

        Default: rank 0's host (``host_for``) and a port free on the caller's loopback, which is
        right when every member runs on this machine; launchers that place members on other
        nodes choose both on rank 0's own node."""
        return self.host_for(spec.member_id), free_port()

    def rendezvous_on(self, member_id: str) -> tuple[str, int]:
        """MASTER_ADDR and MASTER_PORT for a gang whose rank 0 is the running member
        ``member_id`` (a rollout replica borrowed as rank 0, ``relabel``).

        Default: the member's host (``host_for``) and a port free on the caller's loopback, right
        when every member runs on this machine; launchers that place members on other nodes pick
        the port on the member's own node (the Ray launcher asks the member's actor)."""
        return self.host_for(member_id), free_port()

    def ignored(self, spec: MemberSpec, what: str, why: str) -> None:
        """Log once per launcher and field that ``spec`` asks for ``what``, which this launcher
        does not honour, and ``why`` (resources on a launcher that cannot reserve them...)."""
        seen: set[str] = self.__dict__.setdefault("_ignored_logged", set())
        if what not in seen:
            seen.add(what)
            log.warning("%s ignores %s of %s (and of later members): %s", type(self).__name__, what,
                        spec.member_id, why)

    def kill_many(self, member_ids: list[str], expected: bool = True) -> None:
        """Kill several members (gang or whole-job restart); implementations may do it in parallel."""
        for member_id in member_ids:
            self.kill(member_id, expected)

    def was_warm(self, member_id: str) -> bool:
        """True when ``member_id`` was started from a warm spare (not a cold start)."""
        del member_id
        return False

    def keep_spares(self, n: int) -> None:
        """Keep ``n`` warm spare member processes ready for restarts (0: none).

        Launchers without spares ignore it (every start is cold)."""
        del n

    def spares_ready(self) -> int:
        """Warm spare processes ready to take a member now (0 for launchers without spares)."""
        return 0

    def preload(self) -> None:
        """Get ready to start members fast (the controller calls it once it leads): the local
        launcher starts its fork server (``robustrl.launcher.zygote``) then. Others: nothing."""

    def release_unstarted_gang(self, gang_id: str | None) -> None:
        """A gang whose start was abandoned before any rank started (its job stopping, the lease
        lost): release what placing it reserved. Launchers that reserve nothing ahead: nothing."""

    def can_relabel(self) -> bool:
        """Whether :meth:`relabel` can switch a running member's role in place."""
        return False

    def holds_strict_layout(self) -> bool:
        """Whether this launcher holds a trainer gang to a ``STRICT_PACK`` / ``STRICT_SPREAD``
        layout across machines (a placement group over the gang's ranks): a process switched in
        place (a borrowed replica) would run outside it, so such a gang borrows none."""
        return False

    def can_keep_trainers(self) -> bool:
        """Whether :meth:`relabel` can also hand a running trainer rank over to a rank of the next
        gang (``recovery.keep_survivors``)."""
        return False

    def relabel(self, member_id: str, spec: MemberSpec) -> None:
        """Switch the running member ``member_id`` in place to the member ``spec`` describes (a
        rollout replica borrowed as a trainer rank, or a surviving rank of a broken gang as a rank
        of the next one where :meth:`can_keep_trainers`): hand the process ``spec``'s environment, and
        from now on track, poll, stop and kill it as ``spec.member_id`` (its exit is reported
        under that id and role). The process keeps its pid, memory and loaded model.

        Raises:
            LaunchError: the member is not running here, or this launcher cannot switch a process
                in place (the default: a container or actor runs one fixed command per member).
        """
        del spec
        raise LaunchError(f"{type(self).__name__} cannot switch member {member_id} to another role in place",
                          member=member_id)

    def handle(self, member_id: str) -> dict[str, Any] | None:
        """What identifies the running member beyond this process's life (persisted by the
        controller, given back to :meth:`adopt` after a restart); None if unknown."""
        del member_id
        return None

    @staticmethod
    def same_process(a: dict[str, Any], b: dict[str, Any]) -> bool:
        """Whether handles ``a`` and ``b`` (as :meth:`handle` and :meth:`find` give them) name the
        same running process, by what identifies one to this launcher (a pid alone does not: it
        is recycled, and repeats across a cluster's nodes). By default, equal non-empty handles."""
        return bool(a) and a == b

    def find(self, member_id: str) -> dict[str, Any] | None:
        """The handle of a member an earlier launcher started under ``member_id`` whose handle was
        never persisted (its controller died between the start and the write), for :meth:`adopt`;
        None if no such member runs here, or this launcher cannot look members up by id."""
        del member_id
        return None

    def adopt(self, job_id: str, member_id: str, role: str, handle: dict[str, Any]) -> bool:
        """Re-attach to a member a previous controller started; True if it is still running and
        is verifiably that member (not a recycled pid). Adopted members are then polled, stopped
        and killed like members started here. Launchers that cannot re-attach return False."""
        del job_id, member_id, role, handle
        return False

    def log_tail(self, member_id: str, lines: int = 20) -> str:
        """The member's last ``lines`` lines of output (stdout and stderr), '' when unknown."""
        del member_id, lines
        return ""

    def close(self) -> None:
        """Stop everything this launcher started."""
