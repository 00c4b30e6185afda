"""Ray launcher: members as detached Ray actors placed across the nodes of an existing Ray cluster.

Ray places and runs, RobustRL decides. Each member is a :class:`~robustrl.launcher.ray_member.MemberProcess`
actor, detached, ``max_restarts=0`` and ``max_task_retries=0``, which starts ``python -m module`` on its
node and fate-shares with it (the member gets SIGKILL when its actor dies). Ray never restarts a
member behind the controller, and a driver (controller) that exits leaves its members running for
the next controller to re-attach to (``adopt``, by the actor's name and the member's pid + start
time).

Placement (``MemberSpec.resources`` / ``.placement``):
  * a trainer gang (``placement.gang``) is one placement group, one bundle per rank, with the
    gang's strategy (PACK, STRICT_SPREAD, ...); rank r's actor is pinned to bundle r. The gang's
    rendezvous (``rendezvous``) runs on rank 0's actor before any rank starts: MASTER_ADDR is
    rank 0's node address and MASTER_PORT a port free on that node;
  * ``placement.host`` pins to one node (its IP, node id or node name);
  * ``anti_affinity`` within ``placement.group`` (rollout replicas of a job): this launcher picks a
    fitting node that holds no live member of the group and pins the actor to it; ``required``
    fails the start when there is none, ``preferred`` then lets Ray choose;
  * ``node_labels``: Ray label selectors (``ray start --labels``).

Exits: every member has one pending ``wait()`` call on its actor; ``poll`` checks them without
blocking (``ray.wait(timeout=0)``): a member that ended returns its code, an actor that died (killed,
its worker or its node lost) raises ``RayActorError``. Node loss is also read from the GCS node
table (``ray.nodes()``) so a member on a dead node is reported even before its actor's death is
published. Both become the same :class:`ExitInfo` the other launchers report.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from robustrl.errors import LaunchError
from robustrl.launcher.base import ExitInfo, Launcher, MemberSpec, MemberState, PlacementHint, check_spec
from robustrl.launcher.ray_member import MemberProcess

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
"""Bound on reaching the cluster's GCS before ``ray.init`` (which would retry for a minute)."""
PLACE_TIMEOUT_S = 60.0
"""Bound on Ray placing a member (or a gang's placement group) and the member process starting."""
CALL_TIMEOUT_S = 10.0
"""Bound on one call to a member's actor (signal, info, tail)."""
EXIT_WAIT_S = 5.0
"""After a kill: how long to wait for the member's exit to be seen."""
NODE_CHECK_INTERVAL_S = 0.25
START_TIME_TOLERANCE_S = 0.05
DEFAULT_CPUS = 1.0
MIN_BUNDLE_CPUS = 0.01
"""A placement-group bundle must reserve something: a rank asking for 0 CPUs reserves this much."""


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise LaunchError("the Ray launcher needs the ray package: pip install 'robustrl[ray]'",
                          field="launcher") from exc
    return ray


@dataclass
class _Member:
    spec: MemberSpec
    name: str
    actor: Any
    state: MemberState = MemberState.STARTING
    done: Any = None  # ObjectRef of actor.wait()
    pid: int | None = None
    create_time: float | None = None
    node_id: str | None = None
    node_ip: str | None = None
    expected_exit: bool = False
    reported: bool = False
    tail: str = ""
    cause: str | None = None
    rc: int | None = None
    released: bool = False  # its actor killed and its gang updated (resources free)


@dataclass
class _Gang:
    pg: Any
    members: set[str] = field(default_factory=set)


class RayLauncher(Launcher):
    """Starts members as detached actors on a Ray cluster (module docstring).

    Args:
        address: the cluster's GCS address ``host:port`` (what ``ray start --head`` prints).
        log_dir: where members write ``<member>.log`` (on their own node).
        base_env: environment every member gets; ``MemberSpec.env`` overrides it.
        namespace: the Ray namespace of the actors (one per RobustRL installation).
        instance: prefix of the actors' names. A restarted controller must use the same value to
            re-attach to the members its predecessor started.
        default_cpus: CPUs a member reserves when its spec does not say.
        bind_node_ip: members bind and advertise their node's address (not loopback), so peers
            on other nodes reach them.
        place_timeout_s: bound on placing one member or gang (LaunchError past it).

    Raises:
        LaunchError: ray is not installed, or the address is malformed or unreachable
            (``field="ray_address"``).
    """

    def __init__(self, address: str, log_dir: Path, base_env: dict[str, str] | None = None, *,
                 namespace: str = "robustrl", instance: str = "robustrl-controller",
                 default_cpus: float = DEFAULT_CPUS, bind_node_ip: bool = True,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S, place_timeout_s: float = PLACE_TIMEOUT_S) -> None:
        self.ray = _ray()
        self.address = address
        self.log_dir = Path(log_dir)
        self.base_env = dict(base_env or {})
        self.namespace = namespace
        self.instance = instance
        self.default_cpus = default_cpus
        self.bind_node_ip = bind_node_ip
        self.place_timeout_s = place_timeout_s
        self._members: dict[str, _Member] = {}
        self._pending: dict[str, _Member] = {}  # actors of a gang created by rendezvous (by actor name)
        self._placing: dict[str, _Member] = {}  # node reservations of members being started
        self._gangs: dict[str, _Gang] = {}
        self._lock = threading.RLock()
        self._nodes_checked = 0.0
        self._closed = False
        self._errors: tuple[type[BaseException], ...] = (self.ray.exceptions.RayError, TimeoutError, ValueError)
        """What a call to Ray raises when an actor, a node or the cluster is gone (or a name unknown)."""
        self._connect(connect_timeout_s)
        self._actor_cls = self.ray.remote(MemberProcess)

    # --- connection ----------------------------------------------------------------------------

    def _connect(self, timeout_s: float) -> None:
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise LaunchError(f"ray_address must be host:port (the GCS address `ray start --head` prints), "
                              f"got {self.address!r}", field="ray_address")
        try:
            socket.create_connection((host, int(port)), timeout=timeout_s).close()
        except OSError as exc:
            raise LaunchError(f"ray_address {self.address} is unreachable: {exc}", field="ray_address",
                              retryable=True) from exc
        ray = self.ray
        if ray.is_initialized():  # one driver per process: a second launcher shares it
            return
        try:
            ray.init(address=self.address, namespace=self.namespace, log_to_driver=False,
                     logging_level=logging.WARNING, configure_logging=False)
        except (ConnectionError, RuntimeError, *self._errors) as exc:
            raise LaunchError(f"cannot join the Ray cluster at ray_address {self.address}: {exc}",
                              field="ray_address") from exc

    def _actor_name(self, spec: MemberSpec) -> str:
        """``<instance>:<member>``; a gang rank's actor is named by its gang and rank
        (``<instance>:<gang>/r<rank>``): ``rendezvous`` creates it before the rank's member id is
        started, together with its peers."""
        p = spec.placement
        if p.gang is not None:
            return f"{self.instance}:{p.gang}/r{p.gang_rank}"
        return f"{self.instance}:{spec.member_id}"

    # --- placement ---------------------------------------------------------------------------

    def _nodes(self) -> list[dict[str, Any]]:
        return [n for n in self.ray.nodes() if n.get("Alive")]

    def _available(self) -> dict[str, dict[str, float]]:
        """Unreserved resources per node id from the GCS ({} when this Ray cannot say)."""
        try:
            from ray._private.state import state

            return dict(state.available_resources_per_node())
        except (ImportError, AttributeError, *self._errors):
            return {}

    def _fits(self, node: dict[str, Any], spec: MemberSpec, available: dict[str, dict[str, float]]) -> bool:
        res, labels = available.get(node["NodeID"], node.get("Resources", {})), node.get("Labels", {}) or {}
        r = spec.resources
        cpus = self.default_cpus if r.cpus is None else r.cpus
        return (res.get("CPU", 0.0) >= cpus and res.get("GPU", 0.0) >= r.gpus
                and all(labels.get(k) == v for k, v in spec.placement.node_labels.items()))

    def _options(self, spec: MemberSpec) -> dict[str, Any]:
        from ray.util.scheduling_strategies import (
            NodeAffinitySchedulingStrategy,
            PlacementGroupSchedulingStrategy,
        )

        r, p = spec.resources, spec.placement
        opts: dict[str, Any] = {
            "name": self._actor_name(spec), "namespace": self.namespace, "lifetime": "detached",
            "max_restarts": 0, "max_task_retries": 0, "max_concurrency": 8,
            "num_cpus": self.default_cpus if r.cpus is None else r.cpus, "num_gpus": r.gpus}
        if r.memory_mb:
            opts["memory"] = r.memory_mb * 1024 * 1024
        if p.gang is not None:
            gang = self._gang(spec)
            if p.gang_rank >= len(gang.pg.bundle_specs):
                raise LaunchError(f"{spec.member_id}: gang_rank {p.gang_rank} outside its gang of "
                                  f"{len(gang.pg.bundle_specs)}", member=spec.member_id, field="placement.gang_rank")
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                gang.pg, placement_group_bundle_index=p.gang_rank)
            opts["num_cpus"] = max(opts["num_cpus"], MIN_BUNDLE_CPUS)
            return opts
        node = self._pick_node(spec)
        if node is not None:
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
        elif p.node_labels:
            opts["label_selector"] = dict(p.node_labels)
        return opts

    def _pick_node(self, spec: MemberSpec) -> str | None:
        """The node this launcher pins ``spec`` to (host, anti-affinity), None to let Ray choose."""
        p = spec.placement
        if spec.host is not None:
            for n in self._nodes():
                if spec.host in (n.get("NodeManagerAddress"), n.get("NodeID"), n.get("NodeName")):
                    return str(n["NodeID"])
            raise LaunchError(f"{spec.member_id}: host {spec.host!r} is no live node of the Ray cluster",
                              member=spec.member_id, field="host")
        if p.anti_affinity == "none" or p.group is None:
            return None
        available = self._available()
        fitting = [n for n in self._nodes() if self._fits(n, spec, available)]
        with self._lock:  # replicas start in parallel: a node picked is reserved until it runs
            taken: dict[str, int] = {}
            for m in [*self._members.values(), *self._placing.values()]:
                if m.spec.placement.group == p.group and m.node_id and not m.reported:
                    taken[m.node_id] = taken.get(m.node_id, 0) + 1
            free = [n for n in fitting if n["NodeID"] not in taken]
            if free:
                # The node with the most CPUs left over for the job's other members.
                node = str(max(free, key=lambda n: available.get(n["NodeID"], n.get("Resources", {}))
                               .get("CPU", 0.0))["NodeID"])
                self._placing[spec.member_id] = _Member(spec, "", None, node_id=node)
                return node
        if p.anti_affinity == "required":
            raise LaunchError(f"{spec.member_id}: anti_affinity required but every fitting node "
                              f"({len(fitting)}) already runs a member of {p.group}", member=spec.member_id,
                              field="placement.anti_affinity")
        return None

    def _gang(self, spec: MemberSpec) -> _Gang:
        """The gang's placement group, created and waited for on its first member."""
        ray = self.ray
        p, r = spec.placement, spec.resources
        assert p.gang is not None
        with self._lock:
            gang = self._gangs.get(p.gang)
            if gang is not None:
                return gang
            cpus = max(self.default_cpus if r.cpus is None else r.cpus, MIN_BUNDLE_CPUS)
            bundle: dict[str, float] = {"CPU": cpus}
            if r.gpus:
                bundle["GPU"] = r.gpus
            if r.memory_mb:
                bundle["memory"] = float(r.memory_mb * 1024 * 1024)
            kwargs: dict[str, Any] = {}
            if p.node_labels:
                kwargs["bundle_label_selector"] = [dict(p.node_labels)] * p.gang_size
            pg = ray.util.placement_group([dict(bundle) for _ in range(p.gang_size)], strategy=p.strategy,
                                          name=f"{self.instance}:{p.gang}", lifetime="detached", **kwargs)
            gang = _Gang(pg)
            self._gangs[p.gang] = gang
        try:
            ray.get(pg.ready(), timeout=self.place_timeout_s)
        except self._errors as exc:
            self._drop_gang(p.gang)
            raise LaunchError(
                f"gang {p.gang}: Ray could not place {p.gang_size} x {bundle} with strategy {p.strategy}"
                f"{' on nodes labelled ' + str(dict(p.node_labels)) if p.node_labels else ''} within "
                f"{self.place_timeout_s:g} s ({type(exc).__name__})", member=spec.member_id,
                field="placement.strategy") from exc
        return gang

    def _drop_gang(self, gang_id: str) -> None:
        """Remove the gang's placement group (Ray ends the actors in it) and forget its ranks'
        actors that were never started."""
        with self._lock:
            gang = self._gangs.pop(gang_id, None)
            unused = [n for n, m in self._pending.items() if m.spec.placement.gang == gang_id]
            unused_members = [self._pending.pop(n) for n in unused]
        for m in unused_members:
            self._kill_actor(m)
        if gang is not None:
            try:
                self.ray.util.remove_placement_group(gang.pg)
            except self._errors as exc:  # gone already (a restarted cluster): nothing to free
                log.debug("placement group of %s not removed: %s", gang_id, exc)

    # --- start ---------------------------------------------------------------------------------

    def _create(self, spec: MemberSpec) -> _Member:
        opts = self._options(spec)
        try:
            actor = self._actor_cls.options(**opts).remote()
        except (ValueError, TypeError, *self._errors) as exc:  # a name taken by a live actor, bad options
            raise LaunchError(f"cannot create the actor of {spec.member_id}: {exc}", member=spec.member_id) from exc
        return _Member(spec, opts["name"], actor)

    def rendezvous(self, spec: MemberSpec) -> tuple[str, int]:
        """Place the gang of rank 0 (``spec``) and pick MASTER_ADDR / MASTER_PORT on rank 0's node.

        Every rank's actor is created here at once, in its bundle (``start`` then only launches
        its process): starting a gang costs one actor start, not one per rank. That matters
        because the controller handles an exit, and starts the new gang, before it polls again."""
        check_spec(spec)
        p = spec.placement
        ranks = [spec] if p.gang is None else [
            replace(spec, placement=replace(p, gang_rank=r)) for r in range(p.gang_size)]
        created: list[_Member] = []
        try:
            for r in ranks:
                created.append(self._create(r))
            answers = self.ray.get([m.actor.where.remote() for m in created], timeout=self.place_timeout_s)
        except (LaunchError, *self._errors) as exc:
            for m in created:
                self._kill_actor(m)
            if p.gang:
                self._drop_gang(p.gang)
            if isinstance(exc, LaunchError):
                raise
            raise LaunchError(f"cannot place the gang of {spec.member_id} within {self.place_timeout_s:g} s: {exc}",
                              member=spec.member_id, field="resources") from exc
        with self._lock:
            for m, where in zip(created, answers, strict=True):
                m.node_id, m.node_ip = where["node_id"], where["node_ip"]
                self._pending[m.name] = m
        return str(answers[0]["node_ip"]), int(answers[0]["port"])

    def start(self, spec: MemberSpec) -> None:
        check_spec(spec)
        with self._lock:
            if self._closed:
                raise LaunchError(f"cannot start {spec.member_id}: the launcher is closed", member=spec.member_id)
            old = self._members.get(spec.member_id)
            if old is not None and not old.reported and old.state is not MemberState.EXITED:
                raise LaunchError(f"member {spec.member_id} is already running", member=spec.member_id)
            m = self._pending.pop(self._actor_name(spec), None)
        try:
            self._start(spec, m)
        finally:
            with self._lock:
                self._placing.pop(spec.member_id, None)

    def _start(self, spec: MemberSpec, m: _Member | None) -> None:
        if m is None:
            m = self._create(spec)
        m.spec = spec
        env = {**self.base_env, **spec.env}
        log_path = str(self.log_dir / f"{spec.member_id}.log")
        try:
            info = self.ray.get(m.actor.launch.remote(spec.module, list(spec.args), env, log_path, self.bind_node_ip),
                                timeout=self.place_timeout_s)
        except self._errors as exc:
            self._kill_actor(m)
            gang = spec.placement.gang
            with self._lock:
                started = bool(gang and gang in self._gangs and self._gangs[gang].members)
            if gang and not started:
                # No rank of this gang runs: its placement group and the other ranks' actors
                # (made by rendezvous) would otherwise hold the gang's resources for good.
                self._drop_gang(gang)
            r = spec.resources
            raise LaunchError(
                f"cannot start {spec.member_id} on the Ray cluster within {self.place_timeout_s:g} s "
                f"(cpus={self.default_cpus if r.cpus is None else r.cpus}, gpus={r.gpus}, "
                f"memory_mb={r.memory_mb}, labels={dict(spec.placement.node_labels)}): {exc}",
                member=spec.member_id, field="resources") from exc
        m.pid, m.create_time = int(info["pid"]), info["create_time"]
        m.node_id, m.node_ip = info["node_id"], info["node_ip"]
        m.done, m.state = m.actor.wait.remote(), MemberState.RUNNING
        with self._lock:
            self._members[spec.member_id] = m
            if spec.placement.gang and spec.placement.gang in self._gangs:
                self._gangs[spec.placement.gang].members.add(spec.member_id)

    def host_for(self, member_id: str) -> str:
        """The node address of the member (or of a rank 0 placed by ``rendezvous``)."""
        m = self._members.get(member_id) or next(
            (p for p in list(self._pending.values()) if p.spec.member_id == member_id), None)
        if m is not None and m.node_ip:
            return m.node_ip
        return super().host_for(member_id)

    # --- signals -------------------------------------------------------------------------------

    def _live(self, member_ids: list[str]) -> list[_Member]:
        with self._lock:
            return [m for mid in member_ids if (m := self._members.get(mid)) is not None
                    and m.state in (MemberState.RUNNING, MemberState.SUSPENDED, MemberState.STARTING)
                    and not m.reported]

    def _kill_actor(self, m: _Member) -> None:
        try:
            self.ray.kill(m.actor, no_restart=True)
        except self._errors as exc:  # dead already
            log.debug("actor of %s not killed: %s", m.spec.member_id, exc)

    def _wait_done(self, members: list[_Member], timeout_s: float) -> None:
        refs = [m.done for m in members if m.done is not None]
        if refs:
            self.ray.wait(refs, num_returns=len(refs), timeout=timeout_s, fetch_local=False)

    def _signal(self, members: list[_Member], sig: int) -> None:
        calls = [(m, m.actor.signal.remote(int(sig))) for m in members]
        for m, ref in calls:
            try:
                self.ray.get(ref, timeout=CALL_TIMEOUT_S)
            except self._errors as exc:
                # The actor is unreachable (its node is going): kill the actor, which takes the
                # member with it (parent-death signal) wherever it still runs.
                log.warning("signal to %s failed (%s); killing its actor", m.spec.member_id, exc)
                if sig in (signal.SIGKILL, signal.SIGTERM):
                    self._kill_actor(m)

    def stop(self, member_id: str, grace_s: float = 2.0) -> None:
        self.stop_many([member_id], grace_s)

    def stop_many(self, member_ids: list[str], grace_s: float = 2.0) -> None:
        members = self._live(member_ids)
        for m in members:
            m.expected_exit = True
        calls = [(m, m.actor.terminate.remote(float(grace_s))) for m in members]
        for m, ref in calls:
            try:
                self.ray.get(ref, timeout=grace_s + CALL_TIMEOUT_S)
            except self._errors as exc:
                log.warning("stop of %s failed (%s); killing its actor", m.spec.member_id, exc)
                self._kill_actor(m)
            m.state = MemberState.STOPPED
        self._wait_done(members, EXIT_WAIT_S)
        for m in members:
            self._reap(m)

    def kill(self, member_id: str, expected: bool = False) -> None:
        self.kill_many([member_id], expected)

    def kill_many(self, member_ids: list[str], expected: bool = True) -> None:
        members = self._live(member_ids)
        for m in members:
            m.expected_exit = expected
        self._signal(members, signal.SIGKILL)
        self._wait_done(members, EXIT_WAIT_S)
        for m in members:
            m.state = MemberState.EXITED
            self._reap(m)

    def suspend(self, member_id: str) -> None:
        members = self._live([member_id])
        self._signal(members, signal.SIGSTOP)
        for m in members:
            m.state = MemberState.SUSPENDED

    def resume(self, member_id: str) -> None:
        members = self._live([member_id])
        self._signal(members, signal.SIGCONT)
        for m in members:
            m.state = MemberState.RUNNING

    # --- exits ---------------------------------------------------------------------------------

    def poll(self) -> list[ExitInfo]:
        ray = self.ray
        with self._lock:
            watching = {m.done: m for m in self._members.values() if m.done is not None and not m.reported}
        ended: list[_Member] = []
        if watching:
            ready, _ = ray.wait(list(watching), num_returns=len(watching), timeout=0, fetch_local=True)
            for ref in ready:
                m = watching[ref]
                try:
                    m.rc, m.tail = ray.get(ref, timeout=CALL_TIMEOUT_S)
                    m.cause = f"exited with {m.rc}"
                except self._errors as exc:  # RayActorError: actor killed, its worker or node lost
                    m.rc, m.cause = None, _cause(exc)
                ended.append(m)
        now = time.monotonic()
        if watching and now - self._nodes_checked >= NODE_CHECK_INTERVAL_S:
            self._nodes_checked = now
            alive = {n["NodeID"] for n in self._nodes()}
            for m in watching.values():
                if m not in ended and m.node_id not in alive:
                    m.rc, m.cause = None, f"its node {m.node_ip} ({m.node_id}) is dead"
                    ended.append(m)
        out = []
        for m in ended:
            with self._lock:
                if m.reported:
                    continue
                m.reported = True
                if m.state is not MemberState.STOPPED:
                    m.state = MemberState.EXITED
            if not m.expected_exit:
                log.warning("member %s ended on node %s: %s", m.spec.member_id, m.node_ip, m.cause)
            out.append(ExitInfo(m.spec.member_id, m.spec.role, m.rc, m.expected_exit))
            self._reap(m)
        return out

    def _reap(self, m: _Member) -> None:
        """Free an ended member's actor, and its gang's placement group once every rank ended.

        Also called right after a kill or stop, before ``poll`` reports the exit: the controller
        starts replacements before it polls again, and they must find the CPUs free (holding them
        until the next poll made a whole-job restart wait for its own resources)."""
        with self._lock:
            if m.released:
                return
            m.released = True
        self._kill_actor(m)
        gang_id = m.spec.placement.gang
        if gang_id is None:
            return
        with self._lock:
            gang = self._gangs.get(gang_id)
            if gang is None:
                return
            gang.members.discard(m.spec.member_id)
            last = not gang.members
        if last:
            self._drop_gang(gang_id)

    def state(self, member_id: str) -> MemberState | None:
        m = self._members.get(member_id)
        return None if m is None else m.state

    def pid(self, member_id: str) -> int | None:
        m = self._members.get(member_id)
        return None if m is None else m.pid

    def node_of(self, member_id: str) -> str | None:
        """The Ray node id the member runs (ran) on."""
        m = self._members.get(member_id)
        return None if m is None else m.node_id

    def exit_cause(self, member_id: str) -> str | None:
        """Why the member ended, as Ray saw it (its code, actor death, node loss)."""
        m = self._members.get(member_id)
        return None if m is None else m.cause

    def running(self, job_id: str | None = None) -> list[str]:
        with self._lock:
            return [mid for mid, m in self._members.items() if not m.reported
                    and m.state in (MemberState.RUNNING, MemberState.SUSPENDED)
                    and (job_id is None or m.spec.job_id == job_id)]

    # --- re-attach -----------------------------------------------------------------------------

    def handle(self, member_id: str) -> dict[str, Any] | None:
        m = self._members.get(member_id)
        if m is None or m.pid is None:
            return None
        return {"launcher": "ray", "actor": m.name, "namespace": self.namespace, "pid": m.pid,
                "create_time": m.create_time, "node_id": m.node_id, "node_ip": m.node_ip,
                "gang": m.spec.placement.gang}

    def adopt(self, job_id: str, member_id: str, role: str, handle: dict[str, Any]) -> bool:
        """Re-attach to the named actor of a member a previous controller started: True only if
        it still runs the very process recorded (pid and start time)."""
        if handle.get("launcher") != "ray" or not isinstance(handle.get("actor"), str):
            return False
        ray = self.ray
        try:
            actor = ray.get_actor(handle["actor"], namespace=str(handle.get("namespace", self.namespace)))
            info = ray.get(actor.info.remote(), timeout=CALL_TIMEOUT_S)
        except self._errors:
            return False
        try:
            same = (info["pid"] == int(handle["pid"])
                    and abs(float(info["create_time"]) - float(handle["create_time"])) <= START_TIME_TOLERANCE_S)
        except (KeyError, TypeError, ValueError):
            return False
        if not (same and info["running"]):
            return False
        with self._lock:
            current = self._members.get(member_id)
            if current is not None and not current.reported:
                return current.pid == info["pid"]
        gang = handle.get("gang") if isinstance(handle.get("gang"), str) else None
        spec = MemberSpec(job_id, member_id, role, module="", placement=PlacementHint(gang=gang))
        m = _Member(spec, handle["actor"], actor, MemberState.RUNNING, actor.wait.remote(), info["pid"],
                    info["create_time"], info["node_id"], info["node_ip"])
        with self._lock:
            self._members[member_id] = m
            if gang is not None and gang not in self._gangs:
                try:
                    self._gangs[gang] = _Gang(ray.util.get_placement_group(f"{self.instance}:{gang}"))
                except self._errors:
                    gang = None
            if gang is not None:
                self._gangs[gang].members.add(member_id)
        return True

    def log_tail(self, member_id: str, lines: int = 20) -> str:
        m = self._members.get(member_id)
        if m is None:
            return ""
        if m.reported:
            return "\n".join(m.tail.splitlines()[-lines:])
        try:
            return str(self.ray.get(m.actor.tail.remote(lines), timeout=CALL_TIMEOUT_S))
        except self._errors:
            return ""

    def close(self) -> None:
        """Stop every member this launcher runs, free their actors and placement groups."""
        with self._lock:
            self._closed = True
            pending = list(self._pending.values())
            self._pending.clear()
        for m in pending:
            self._kill_actor(m)
        self.kill_many(self.running(), expected=True)
        self.poll()
        for gang_id in list(self._gangs):
            self._drop_gang(gang_id)


def _cause(exc: BaseException) -> str:
    """A one-line reason from Ray's actor-death error (node death named when it is one)."""
    text = str(exc)
    if "node has died" in text or "node was terminated" in text:
        return "its node died"
    for line in text.splitlines():
        if "error_message" in line or "The actor" in line:
            return line.strip()[:300]
    return f"{type(exc).__name__}: {text[:300]}"
