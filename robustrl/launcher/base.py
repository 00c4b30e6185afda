"""The launcher interface: how the controller starts, stops, kills and replaces role members.

Two implementations share it: the local process launcher (``robustrl.launcher.local``) and the
Docker launcher (``robustrl.launcher.docker``). Recovery code only sees this interface.
"""

from __future__ import annotations

import abc
import enum
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from robustrl.errors import LaunchError

TRAINER_MODULE = "robustrl.services.trainer"
ROLLOUT_MODULE = "robustrl.services.rollout"
"""What a trainer worker / rollout replica runs (``python -m``): the launchers and the controller
spell the member modules only here."""


class MemberState(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    SUSPENDED = "suspended"
    EXITED = "exited"
    STOPPED = "stopped"


@dataclass(frozen=True)
class MemberSpec:
    """What to run for one role member.

    ``module`` is a Python module run as ``python -m module``; ``env`` is the complete
    extra environment (infrastructure settings, job id, member id, rank). ``host`` places the
    member on a host of the launcher's :class:`Placement` (a testbed host such as ``"h1"``);
    None runs it where the launcher runs.
    """

    job_id: str
    member_id: str
    role: str
    module: str
    env: dict[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    host: str | None = None


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

    def can_relabel(self) -> bool:
        """Whether :meth:`relabel` can switch a running member's role in place."""
        return False

    def relabel(self, member_id: str, spec: MemberSpec) -> None:
        """Switch the running member ``member_id`` in place to the member ``spec`` describes (a
        rollout replica borrowed as a trainer rank): hand the process ``spec``'s environment, and
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
