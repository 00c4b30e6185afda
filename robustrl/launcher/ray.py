"""Ray launcher: members as detached Ray actors placed across the nodes of an existing Ray cluster.

Ray places and runs, RobustRL decides. Each member is a :class:`~robustrl.launcher.ray_member.MemberProcess`
actor, detached, ``max_restarts=0`` and ``max_task_retries=0``, which starts ``python -m module`` on its
node and fate-shares with it (the member gets SIGKILL when its actor dies). Ray never restarts a
member behind the controller, and a driver (controller) that exits leaves its members running for
the next controller to re-attach to (``adopt``, by the actor's name and the member's pid + start
time).

Placement (``MemberSpec.resources`` / ``.placement``):
  * a trainer gang (``placement.gang``) is one placement group with one bundle per rank started
    cold, with the gang's strategy (PACK, STRICT_SPREAD, ...); such a rank's actor is pinned to its
    bundle. The gang's rendezvous (``rendezvous``) runs on rank 0's actor before any rank starts:
    MASTER_ADDR is rank 0's node address and MASTER_PORT a port free on that node;
  * ``placement.host`` pins to one node (its IP, node id or node name);
  * ``anti_affinity`` within ``placement.group`` (rollout replicas of a job): this launcher picks a
    fitting node that holds no live member of the group and pins the actor to it; ``required``
    fails the start when there is none, ``preferred`` then lets Ray choose;
  * ``node_labels``: Ray label selectors (``ray start --labels``).

Warm spares (``keep_spares``): a spare is a member actor started ahead, whose process runs
``python -m robustrl.launcher.spare`` (member code imported, waiting for its order on stdin). A
spare reserves its own resources -- those of the newest trainer rank started (CPUs, GPUs, memory,
node labels), or ``spare_resources`` -- and Ray spreads spares over the nodes. ``start`` (and
``rendezvous``, for rank 0) hands a member to a ready spare when the placement allows it: the
spare reserves at least the member's CPUs and memory and exactly its GPUs, its node carries the
member's labels (and is its ``host``, when one is named), a replica's required anti-affinity holds
on it, and the member is no rank of a ``STRICT_PACK``/``STRICT_SPREAD`` gang (a spare runs outside
the gang's placement group, so it cannot be held to a strict layout; ``PACK``/``SPREAD`` are
preferences, followed when choosing among spares). A gang's placement group then only holds the
ranks started cold. Each spare taken is replaced ``SPARE_RESTOCK_DELAY_S`` later.

Borrowing (``relabel``): a running rollout replica switches in place to a trainer rank; its actor
writes the hand-off and signals its process (``MemberProcess.handoff``), and the launcher tracks the
actor under the trainer rank's id from then on. The rank stays on the replica's node, in the
replica's reservation, outside the gang's placement group.

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
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from robustrl.errors import LaunchError
from robustrl.launcher.base import (
    ROLLOUT_MODULE,
    SOFT_STRATEGIES,
    ExitInfo,
    Launcher,
    MemberSpec,
    MemberState,
    PlacementHint,
    Resources,
    RestockRetries,
    check_spec,
)
from robustrl.launcher.ray_member import MemberProcess
from robustrl.launcher.spare import SPARE_MODULE
from robustrl.launcher.spare import TARGETS as SPARE_TARGETS

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
SPARE_RESTOCK_DELAY_S = 10.0
"""A spare taken is replaced this much later (as the local launcher does): the new spare's imports
would otherwise compete with the recovery that took it for the CPU."""
SPARE_RETRY_MAX_S = 60.0
"""A restock that failed (a spare's actor not created, the GCS unreachable) is tried again
``SPARE_RESTOCK_DELAY_S`` later, the wait doubled per failure in a row up to this: a lost restock
would leave the pool short for good (members then start cold)."""
SPARE_PREFIX = "spare-"
"""Spare actors are named ``<instance>:spare-<id>``; a member started from one keeps that name."""
NODE_SUSPECT_S = 30.0
"""A node where a member was lost without an exit code (its actor, worker or node gone), or whose
spare failed a start, is suspect this long (Ray's default health check fails a dead node within
about 15-25 s): its spares are taken last (a preference only; a lone worker's crash costs its
node's spares their rank for this long). Until the GCS has seen such a node dead, a spare
that died with it still looks ready; taken first, it would fail its start (another spare is then
tried, at the cost of a call's timeout)."""


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise LaunchError("the Ray launcher needs the ray package: pip install 'robustrl[ray]'",
                          field="launcher") from exc
    return ray


@dataclass(frozen=True)
class _Shape:
    """What a spare's actor reserves, and the node labels it was placed by."""

    cpus: float
    gpus: float = 0.0
    memory_mb: int | None = None
    labels: tuple[tuple[str, str], ...] = ()

    def fits(self, spec: MemberSpec, default_cpus: float, node_labels: dict[str, str]) -> bool:
        """The spare may run ``spec``: at least its CPUs and memory, exactly its GPUs (a member
        must not sit on accelerators it did not ask for), on a node carrying its labels."""
        r = spec.resources
        cpus = default_cpus if r.cpus is None else r.cpus
        return (self.cpus >= cpus and self.gpus == r.gpus and (r.memory_mb or 0) <= (self.memory_mb or 0)
                and all(node_labels.get(k) == v for k, v in spec.placement.node_labels.items()))

    def as_dict(self) -> dict[str, Any]:
        return {"cpus": self.cpus, "gpus": self.gpus, "memory_mb": self.memory_mb, "labels": dict(self.labels)}

    @classmethod
    def from_dict(cls, d: Any) -> _Shape | None:
        try:
            return cls(float(d["cpus"]), float(d["gpus"]), None if d["memory_mb"] is None else int(d["memory_mb"]),
                       tuple(sorted((str(k), str(v)) for k, v in dict(d["labels"]).items())))
        except (KeyError, TypeError, ValueError):
            return None


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
    warm: bool = False  # a spare, a member started from one, or a replica switched in place
    shape: _Shape | None = None  # a spare's reservation (None: not a spare)
    ready: Any = None  # a spare's pending start_spare() ObjectRef, until it answered


@dataclass
class _Gang:
    pg: Any = None  # None until a rank is started cold (ranks from spares or borrowed run outside it)
    bundles: dict[int, int] = field(default_factory=dict)  # rank -> bundle index in ``pg``
    outside: set[int] = field(default_factory=set)  # ranks that run (or will run) outside ``pg``
    members: set[str] = field(default_factory=set)


NODE_DIED_RETRIES = 2
"""Placements again of a member whose actor's node died before the actor ran (``start``)."""


def _node_died(exc: BaseException | None) -> bool:
    """Whether ``exc`` is an actor that died because its node died (Ray's message says so)."""
    text = str(exc or "")
    return "node has died" in text or "node was terminated" in text


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
        spare_resources: what each warm spare reserves; None: what the newest trainer rank
            started reserves (and its node labels), or ``default_cpus`` before any.

    Raises:
        LaunchError: ray is not installed, or the address is malformed or unreachable
            (``field="ray_address"``).
    """

    def __init__(self, address: str, log_dir: Path, base_env: dict[str, str] | None = None, *,
                 namespace: str = "robustrl", instance: str = "robustrl-controller",
                 default_cpus: float = DEFAULT_CPUS, bind_node_ip: bool = True,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S, place_timeout_s: float = PLACE_TIMEOUT_S,
                 spare_resources: Resources | None = None) -> None:
        self.ray = _ray()
        self.address = address
        self.log_dir = Path(log_dir)
        self.base_env = dict(base_env or {})
        self.namespace = namespace
        self.instance = instance
        self.default_cpus = default_cpus
        self.bind_node_ip = bind_node_ip
        self.place_timeout_s = place_timeout_s
        self.spare_resources = spare_resources
        self._members: dict[str, _Member] = {}
        self._pending: dict[str, _Member] = {}  # actors of a gang made ahead by rendezvous (by gang rank name)
        self._placing: dict[str, _Member] = {}  # node reservations of members being started
        self._gangs: dict[str, _Gang] = {}
        self._lock = threading.RLock()
        self._nodes_checked = 0.0
        self._closed = False
        self._spares: list[_Member] = []
        self._spares_wanted = 0
        self._spares_found = False  # a predecessor's spares looked up (once)
        self._restocks = RestockRetries(SPARE_RESTOCK_DELAY_S, SPARE_RETRY_MAX_S)
        self._timers: set[threading.Timer] = set()
        self._trainer_shape: _Shape | None = None
        self._suspect: dict[str, float] = {}  # node id -> when a member there was lost (monotonic)
        self.spares_used = 0
        """Members started from a warm spare (the rest were cold starts or borrowed replicas)."""
        self._errors: tuple[type[BaseException], ...] = (self.ray.exceptions.RayError, TimeoutError, ValueError)
        """What a call to Ray raises when an actor, a node or the cluster is gone (or a name unknown)."""
        self._connect(connect_timeout_s)
        self._actor_cls = self.ray.remote(MemberProcess)

    # --- connection ----------------------------------------------------------------------------

    def _connect(self, timeout_s: float) -> None:
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
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
        started, together with its peers. (A member started from a spare keeps the spare's name.)"""
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
            gang = self._gang_pg(spec)
            bundle = gang.bundles.get(p.gang_rank)
            if bundle is None or p.gang_rank >= p.gang_size:
                raise LaunchError(f"{spec.member_id}: gang_rank {p.gang_rank} has no bundle in its gang's placement "
                                  f"group (ranks {sorted(gang.bundles)})", member=spec.member_id,
                                  field="placement.gang_rank")
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                gang.pg, placement_group_bundle_index=bundle)
            opts["num_cpus"] = max(opts["num_cpus"], MIN_BUNDLE_CPUS)
            return opts
        node = self._pick_node(spec)
        if node is not None:
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
        elif p.node_labels:
            opts["label_selector"] = dict(p.node_labels)
        return opts

    def _group_nodes(self, group: str | None) -> dict[str, int]:
        """Live members (and members being placed) of ``group`` per node id (lock held)."""
        taken: dict[str, int] = {}
        if group is None:
            return taken
        for m in [*self._members.values(), *self._placing.values()]:
            if m.spec.placement.group == group and m.node_id and not m.reported:
                taken[m.node_id] = taken.get(m.node_id, 0) + 1
        return taken

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
            taken = self._group_nodes(p.group)
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

    def _gang_record(self, gang_id: str) -> _Gang:
        """The launcher's record of a gang, made on first use (lock held)."""
        gang = self._gangs.get(gang_id)
        if gang is None:
            gang = self._gangs[gang_id] = _Gang()
        return gang

    def _gang_pg(self, spec: MemberSpec) -> _Gang:
        """The gang with its placement group: made (and waited for) on the first rank started
        cold, with one bundle per rank that does not run outside it (spares, borrowed replicas)."""
        ray = self.ray
        p, r = spec.placement, spec.resources
        assert p.gang is not None
        with self._lock:
            gang = self._gang_record(p.gang)
            if gang.pg is not None:
                return gang
            ranks = [q for q in range(p.gang_size) if q not in gang.outside or q == p.gang_rank]
            cpus = max(self.default_cpus if r.cpus is None else r.cpus, MIN_BUNDLE_CPUS)
            bundle: dict[str, float] = {"CPU": cpus}
            if r.gpus:
                bundle["GPU"] = r.gpus
            if r.memory_mb:
                bundle["memory"] = float(r.memory_mb * 1024 * 1024)
            kwargs: dict[str, Any] = {}
            if p.node_labels:
                kwargs["bundle_label_selector"] = [dict(p.node_labels)] * len(ranks)
            pg = ray.util.placement_group([dict(bundle) for _ in ranks], strategy=p.strategy,
                                          name=f"{self.instance}:{p.gang}", lifetime="detached", **kwargs)
            gang.pg, gang.bundles = pg, {q: i for i, q in enumerate(ranks)}
        try:
            ray.get(pg.ready(), timeout=self.place_timeout_s)
        except self._errors as exc:
            self._drop_gang(p.gang)
            raise LaunchError(
                f"gang {p.gang}: Ray could not place {len(ranks)} x {bundle} with strategy {p.strategy}"
                f"{' on nodes labelled ' + str(dict(p.node_labels)) if p.node_labels else ''} within "
                f"{self.place_timeout_s:g} s ({type(exc).__name__})", member=spec.member_id,
                field="placement.strategy") from exc
        return gang

    def _drop_gang(self, gang_id: str) -> None:
        """Remove the gang's placement group (Ray ends the actors in it) and forget its ranks'
        actors that were never started (a spare made ready for one of them is released too)."""
        with self._lock:
            gang = self._gangs.pop(gang_id, None)
            unused = [n for n, m in self._pending.items() if m.spec.placement.gang == gang_id]
            unused_members = [self._pending.pop(n) for n in unused]
        for m in unused_members:
            self._kill_actor(m)
        if gang is not None and gang.pg is not None:
            try:
                self.ray.util.remove_placement_group(gang.pg)
            except self._errors as exc:  # gone already (a restarted cluster): nothing to free
                log.debug("placement group of %s not removed: %s", gang_id, exc)

    # --- warm spares ---------------------------------------------------------------------------

    def _spare_shape(self) -> _Shape:
        """What a new spare reserves (``spare_resources``, else the newest trainer rank's)."""
        if self.spare_resources is not None:
            r = self.spare_resources
            return _Shape(self.default_cpus if r.cpus is None else r.cpus, r.gpus, r.memory_mb)
        return self._trainer_shape or _Shape(self.default_cpus)

    def _note_trainer(self, spec: MemberSpec) -> None:
        """Spares are sized (and labelled) after the newest trainer rank started."""
        if spec.role == "trainer":
            r = spec.resources
            self._trainer_shape = _Shape(self.default_cpus if r.cpus is None else r.cpus, r.gpus, r.memory_mb,
                                         tuple(sorted(spec.placement.node_labels.items())))

    def keep_spares(self, n: int) -> None:
        """Keep ``n`` warm spare actors ready (0 releases them all). The first call also takes
        over the waiting spares a previous controller of this instance left (its actors are
        detached): they are kept when they fit, else released."""
        with self._lock:
            self._spares_wanted = max(0, n)
        self._find_spares()
        self._restock()

    def was_warm(self, member_id: str) -> bool:
        m = self._members.get(member_id)
        return m is not None and m.warm

    def spares_ready(self) -> int:
        self._check_spares()
        with self._lock:
            return sum(1 for s in self._spares if s.pid is not None)

    def _find_spares(self) -> None:
        """Adopt the waiting spares of a previous controller of this instance (once)."""
        with self._lock:
            if self._spares_found:
                return
            self._spares_found = True
            known = {m.name for m in [*self._spares, *self._members.values(), *self._pending.values()]}
        prefix = f"{self.instance}:{SPARE_PREFIX}"
        try:
            names = [a["name"] for a in self.ray.util.list_named_actors(all_namespaces=True)
                     if a.get("namespace") == self.namespace and a["name"].startswith(prefix)]
        except self._errors as exc:
            log.warning("cannot list the spares of an earlier controller: %s", exc)
            return
        for name in names:
            if name in known:
                continue
            try:
                actor = self.ray.get_actor(name, namespace=self.namespace)
                info = self.ray.get(actor.info.remote(), timeout=CALL_TIMEOUT_S)
            except self._errors:
                continue
            shape = _Shape.from_dict(info.get("shape"))
            if info.get("pid") is not None and not info.get("spare"):
                continue  # a member started from a spare: adopted (or not) through its handle
            if not (info.get("spare") and info.get("running")) or shape is None:
                # Made but never started (its controller died in between), or its process ended.
                self._kill_actor(_Member(MemberSpec("", name, "spare", SPARE_MODULE), name, actor))
                continue
            with self._lock:  # before any trainer rank starts here, spares keep their size
                if self._trainer_shape is None:
                    self._trainer_shape = shape
            spare = _Member(MemberSpec("", name, "spare", SPARE_MODULE), name, actor, MemberState.RUNNING,
                            actor.wait.remote(), info["pid"], info["create_time"], info["node_id"], info["node_ip"],
                            warm=True, shape=shape)
            with self._lock:
                self._spares.append(spare)
            log.info("adopted waiting spare %s of an earlier controller", name)

    def _restock(self) -> None:
        """Forget dead spares, release extra (or mis-sized) ones, start missing ones. One that
        fails (or any error of the cluster meanwhile) is tried again later, backing off
        (``SPARE_RETRY_MAX_S``); it never raises: callers are timer threads and ``keep_spares``."""
        self._restocks.run(self._restock_locked, lambda delay: self._restock_later(delay, retry=True))

    def _restock_locked(self) -> bool:
        """``_restock``'s work (restock lock held); False when a missing spare could not be started."""
        self._check_spares()
        shape = self._spare_shape()
        with self._lock:
            wanted = 0 if self._closed else self._spares_wanted
            keep = [s for s in self._spares if s.shape == shape]
            drop = [s for s in self._spares if s.shape != shape] + keep[wanted:]
            self._spares = keep[:wanted]
            missing = wanted - len(self._spares)
        for s in drop:
            self._kill_actor(s)
        for _ in range(missing):
            spare = self._new_spare(shape)
            if spare is None:
                return False  # members start cold meanwhile, which always works
            with self._lock:
                if self._closed:  # close() ran meanwhile: it would never release this one
                    self._kill_actor(spare)
                    return True
                self._spares.append(spare)
        return True

    def _new_spare(self, shape: _Shape) -> _Member | None:
        name = f"{self.instance}:{SPARE_PREFIX}{uuid.uuid4().hex[:12]}"
        opts: dict[str, Any] = {
            "name": name, "namespace": self.namespace, "lifetime": "detached", "max_restarts": 0,
            "max_task_retries": 0, "max_concurrency": 8, "num_cpus": shape.cpus, "num_gpus": shape.gpus}
        if shape.memory_mb:
            opts["memory"] = shape.memory_mb * 1024 * 1024
        if shape.labels:
            opts["label_selector"] = dict(shape.labels)
        else:
            opts["scheduling_strategy"] = "SPREAD"  # a node's loss takes few spares with it
        try:
            actor = self._actor_cls.options(**opts).remote()
        except (TypeError, *self._errors) as exc:
            log.warning("cannot start a warm spare: %s", exc)
            return None
        try:
            ready = actor.start_spare.remote(dict(self.base_env), str(self.log_dir / f"{name.split(':')[-1]}.log"),
                                             shape.as_dict())
        except (TypeError, *self._errors) as exc:  # the actor exists (detached): not left behind
            log.warning("cannot start warm spare %s: %s", name, exc)
            self._kill_actor(_Member(MemberSpec("", name, "spare", SPARE_MODULE), name, actor))
            return None
        return _Member(MemberSpec("", name, "spare", SPARE_MODULE), name, actor, warm=True,
                       shape=shape, ready=ready)

    def _restock_later(self, delay_s: float | None = None, retry: bool = False) -> None:
        """``_restock`` in a timer thread, ``delay_s`` (default ``SPARE_RESTOCK_DELAY_S``) from now
        (``retry``: the one pending retry after a failed restock)."""
        def restock() -> None:
            with self._lock:
                self._timers.discard(timer)
            if retry:
                self._restocks.retrying()
            self._restock()

        timer = threading.Timer(SPARE_RESTOCK_DELAY_S if delay_s is None else delay_s, restock)
        timer.daemon = True
        with self._lock:
            if self._closed:
                return
            self._timers.add(timer)
        timer.start()

    def _check_spares(self, alive: set[str] | None = None) -> None:
        """Note spares whose process started; drop those that ended or whose node is gone (their
        replacement comes ``SPARE_RESTOCK_DELAY_S`` later). ``alive``: live node ids, if known."""
        ray = self.ray
        with self._lock:
            spares = list(self._spares)
        if not spares:
            return
        dead: list[_Member] = []
        starting = {s.ready: s for s in spares if s.ready is not None}
        if starting:
            ready, _ = ray.wait(list(starting), num_returns=len(starting), timeout=0, fetch_local=True)
            for ref in ready:
                s = starting[ref]
                try:
                    info = ray.get(ref, timeout=CALL_TIMEOUT_S)
                except self._errors as exc:
                    log.warning("warm spare %s did not start: %s", s.name, _cause(exc))
                    dead.append(s)
                    continue
                s.pid, s.create_time = int(info["pid"]), info["create_time"]
                s.node_id, s.node_ip = info["node_id"], info["node_ip"]
                s.done, s.ready, s.state = s.actor.wait.remote(), None, MemberState.RUNNING
        running = {s.done: s for s in spares if s.done is not None and s.ready is None}
        if running:
            ended, _ = ray.wait(list(running), num_returns=len(running), timeout=0, fetch_local=False)
            dead.extend(running[ref] for ref in ended)
        if alive is None and any(s.node_id for s in spares):
            alive = {n["NodeID"] for n in self._nodes()}
        if alive is not None:
            dead.extend(s for s in spares if s.node_id and s.node_id not in alive and s not in dead)
        if not dead:
            return
        with self._lock:
            self._spares = [s for s in self._spares if s not in dead]
        for s in dead:
            self._kill_actor(s)
        self._restock_later()

    def _may_use_spare(self, spec: MemberSpec) -> bool:
        p = spec.placement
        return (not spec.cold and spec.module in SPARE_TARGETS
                and not (p.gang is not None and p.strategy not in SOFT_STRATEGIES))

    def _take_spare(self, spec: MemberSpec, avoid: frozenset[str] = frozenset()) -> _Member | None:
        """Take the ready spare that suits ``spec`` best (module docstring), out of the pool; None
        when none may run it. ``avoid``: node ids not to take one from (a spare there just failed).
        Its replacement is started ``SPARE_RESTOCK_DELAY_S`` later."""
        if not self._may_use_spare(spec):
            return None
        with self._lock:
            if not self._spares:
                return None
        self._check_spares()
        nodes = {str(n["NodeID"]): n for n in self._nodes()}
        p = spec.placement
        with self._lock:
            fitting = [s for s in self._spares if s.pid is not None and s.shape is not None and s.node_id in nodes
                       and s.node_id not in avoid
                       and s.shape.fits(spec, self.default_cpus, nodes[s.node_id].get("Labels", {}) or {})
                       and (spec.host is None or spec.host in (s.node_ip, s.node_id,
                                                               nodes[s.node_id].get("NodeName")))]
            taken = self._group_nodes(p.group)
            if p.anti_affinity == "required":
                fitting = [s for s in fitting if s.node_id not in taken]
            peers = set()
            if p.gang is not None:  # nodes of the gang's ranks placed so far
                peers = {m.node_id for m in [*self._members.values(), *self._pending.values()]
                         if m.spec.placement.gang == p.gang and not m.reported}
            if not fitting:
                return None
            now = time.monotonic()
            self._suspect = {n: t for n, t in self._suspect.items() if now - t < NODE_SUSPECT_S}
            suspect = set(self._suspect)

            def cost(s: _Member) -> tuple[int, int, int]:
                lost = int(s.node_id in suspect)  # maybe dead with its node, not yet seen so
                crowded = int(s.node_id in taken)  # anti-affinity: preferred (required filtered above)
                if p.strategy == "PACK":
                    return lost, crowded, int(bool(peers) and s.node_id not in peers)
                return lost, crowded, int(s.node_id in peers)  # SPREAD

            spare = min(fitting, key=cost)
            self._spares.remove(spare)
            if p.group is not None:  # replicas start in parallel: this node is taken from now on
                self._placing[spec.member_id] = _Member(spec, "", None, node_id=spare.node_id)
        self._restock_later()
        return spare

    def _spare_failed(self, spare: _Member, failed: frozenset[str]) -> frozenset[str]:
        """A spare that failed a start: released (``_assign`` did already), its node suspect and,
        for the rest of this start, avoided (each try on a dead node costs a call's timeout)."""
        self._kill_actor(spare)
        if not spare.node_id:
            return failed
        with self._lock:
            self._suspect[spare.node_id] = time.monotonic()
        return failed | {spare.node_id}

    def _spare_tries(self) -> int:
        """How many spares one start may try: those in the pool now (restocked ones come later)."""
        with self._lock:
            return len(self._spares)

    def _assign(self, spec: MemberSpec, spare: _Member) -> None:
        """Hand ``spec`` to ``spare`` (its order on stdin) and track it as ``spec.member_id``."""
        env = {**self.base_env, **spec.env}
        log_path = str(self.log_dir / f"{spec.member_id}.log")
        try:
            info = self.ray.get(spare.actor.assign.remote(spec.module, list(spec.args), env, log_path,
                                                          self.bind_node_ip, spec.member_id), timeout=CALL_TIMEOUT_S)
        except self._errors as exc:
            self._kill_actor(spare)
            raise LaunchError(f"warm spare {spare.name} could not take {spec.member_id}: {_cause(exc)}",
                              member=spec.member_id) from exc
        self._register(spec, spare, info)
        with self._lock:
            self.spares_used += 1

    def _register(self, spec: MemberSpec, m: _Member, info: dict[str, Any]) -> None:
        m.spec = spec
        m.pid, m.create_time = int(info["pid"]), info["create_time"]
        m.node_id, m.node_ip = info["node_id"], info["node_ip"]
        if m.done is None:
            m.done = m.actor.wait.remote()
        m.state, m.shape, m.ready = MemberState.RUNNING, None, None
        with self._lock:
            self._members[spec.member_id] = m
            if spec.placement.gang:
                gang = self._gang_record(spec.placement.gang)
                gang.members.add(spec.member_id)
                if m.warm:
                    gang.outside.add(spec.placement.gang_rank)

    # --- start ---------------------------------------------------------------------------------

    def _create(self, spec: MemberSpec) -> _Member:
        opts = self._options(spec)
        try:
            actor = self._actor_cls.options(**opts).remote()
        except (ValueError, TypeError, *self._errors) as exc:  # a name taken by a live actor, bad options
            raise LaunchError(f"cannot create the actor of {spec.member_id}: {exc}", member=spec.member_id) from exc
        return _Member(spec, opts["name"], actor)

    def _premake(self, spec: MemberSpec, ranks: list[int] | None) -> tuple[list[_Member], list[dict[str, Any]]]:
        """Create the actors of ``ranks`` of ``spec``'s gang at once (or of ``spec`` itself when
        None) and wait until each runs; return them and their ``where`` answers."""
        p = spec.placement
        specs = [spec] if ranks is None else [replace(spec, placement=replace(p, gang_rank=r)) for r in ranks]
        created: list[_Member] = []
        try:
            for r in specs:
                created.append(self._create(r))
            answers = self.ray.get([m.actor.where.remote() for m in created], timeout=self.place_timeout_s)
        except (LaunchError, *self._errors) as exc:
            for m in created:
                self._kill_actor(m)
            self._drop_unstarted_gang(p.gang)
            if isinstance(exc, LaunchError):
                raise
            raise LaunchError(f"cannot place the gang of {spec.member_id} within {self.place_timeout_s:g} s: {exc}",
                              member=spec.member_id, field="resources") from exc
        for m, where in zip(created, answers, strict=True):
            m.node_id, m.node_ip = where["node_id"], where["node_ip"]
        return created, answers

    def release_unstarted_gang(self, gang_id: str | None) -> None:
        if gang_id is None:
            return
        with self._lock:
            known = gang_id in self._gangs
        if not known:  # placed by an earlier controller (detached, named): found by its name
            try:
                pg = self.ray.util.get_placement_group(f"{self.instance}:{gang_id}")
                self.ray.util.remove_placement_group(pg)
            except (KeyError, *self._errors) as exc:  # none by that name: nothing was placed
                log.debug("no placement group of %s to release: %s", gang_id, exc)
            return
        self._drop_unstarted_gang(gang_id)

    def _drop_unstarted_gang(self, gang_id: str | None) -> None:
        """After a failed start: a gang none of whose ranks runs would otherwise hold its placement
        group and the other ranks' pre-made actors for good."""
        if gang_id is None:
            return
        with self._lock:
            gang = self._gangs.get(gang_id)
            started = bool(gang is not None and gang.members)
        if not started:
            self._drop_gang(gang_id)

    def rendezvous(self, spec: MemberSpec) -> tuple[str, int]:
        """Place the gang of rank 0 (``spec``) and pick MASTER_ADDR / MASTER_PORT on rank 0's node.

        Rank 0 is a warm spare when one suits it (module docstring); else every rank's actor is
        created here at once, in its bundle (``start`` then only launches its process): starting a
        gang costs one actor start, not one per rank. That matters because the controller handles
        an exit, and starts the new gang, before it polls again."""
        check_spec(spec)
        p = spec.placement
        self._note_trainer(spec)
        if p.gang is not None:
            with self._lock:
                self._gang_record(p.gang).outside.add(p.gang_rank)  # held for a spare while one is tried
            failed: frozenset[str] = frozenset()
            for _ in range(self._spare_tries()):  # one unreachable spare: one on another node, then cold
                spare = self._take_spare(spec, failed)
                if spare is None:
                    break
                try:
                    where = self.ray.get(spare.actor.where.remote(), timeout=CALL_TIMEOUT_S)
                except self._errors as exc:
                    log.warning("warm spare %s unreachable for rank 0 of %s: %s", spare.name, p.gang, _cause(exc))
                    failed = self._spare_failed(spare, failed)
                    continue
                spare.spec = spec
                with self._lock:
                    self._pending[self._actor_name(spec)] = spare
                return str(where["node_ip"]), int(where["port"])
            with self._lock:
                self._gang_record(p.gang).outside.discard(p.gang_rank)
        ranks = None if p.gang is None else [r for r in range(p.gang_size) if r == p.gang_rank or r not in (
            self._gangs[p.gang].outside if p.gang in self._gangs else set())]
        created, answers = self._premake(spec, ranks)
        with self._lock:
            for m in created:
                self._pending[self._actor_name(m.spec)] = m
        return str(answers[0]["node_ip"]), int(answers[0]["port"])

    def rendezvous_on(self, member_id: str) -> tuple[str, int]:
        """MASTER_ADDR / MASTER_PORT on the node of the running member ``member_id`` (a replica
        borrowed as rank 0): its node's address and a port free there, asked of its actor."""
        m = self._members.get(member_id)
        if m is None or m.reported:
            return super().rendezvous_on(member_id)
        try:
            where = self.ray.get(m.actor.where.remote(), timeout=CALL_TIMEOUT_S)
        except self._errors as exc:
            raise LaunchError(f"cannot reach {member_id} for its gang's rendezvous: {_cause(exc)}",
                              member=member_id) from exc
        return str(where["node_ip"]), int(where["port"])

    def start(self, spec: MemberSpec) -> None:
        check_spec(spec)
        with self._lock:
            if self._closed:
                raise LaunchError(f"cannot start {spec.member_id}: the launcher is closed", member=spec.member_id)
            old = self._members.get(spec.member_id)
            if old is not None and not old.reported and old.state is not MemberState.EXITED:
                raise LaunchError(f"member {spec.member_id} is already running", member=spec.member_id)
            m = self._pending.pop(self._actor_name(spec), None)
        self._note_trainer(spec)
        try:
            if m is None and not self._gang_has_pg(spec):
                failed: frozenset[str] = frozenset()
                for _ in range(self._spare_tries()):  # a spare that fails: one on another node, then cold
                    spare = self._take_spare(spec, failed)
                    if spare is None:
                        break
                    try:
                        self._assign(spec, spare)
                        return
                    except LaunchError as exc:
                        log.warning("%s; trying a spare on another node, else a cold start", exc)
                        failed = self._spare_failed(spare, failed)
            if m is None and spec.placement.gang is not None:
                m = self._premake_from(spec)
            for attempt in range(NODE_DIED_RETRIES + 1):
                try:
                    self._start(spec, m)
                    return
                except LaunchError as exc:
                    # A member not of a gang whose actor was placed on a node that died before it
                    # ran (the GCS had not failed the node yet): placed again, on a node alive.
                    if m is not None or spec.placement.gang is not None or attempt == NODE_DIED_RETRIES \
                            or not _node_died(exc.__cause__):
                        raise
                    log.warning("%s: its node died before it ran; placing it again", spec.member_id)
        finally:
            with self._lock:
                self._placing.pop(spec.member_id, None)

    def _gang_has_pg(self, spec: MemberSpec) -> bool:
        """A rank whose gang already has a placement group starts in it (the group holds its bundle)."""
        gang_id = spec.placement.gang
        with self._lock:
            return gang_id is not None and gang_id in self._gangs and self._gangs[gang_id].pg is not None

    def _premake_from(self, spec: MemberSpec) -> _Member:
        """A gang rank without a pre-made actor: its actor, and those of the later ranks that will
        start cold, made at once (with the gang's placement group, if it has none yet)."""
        p = spec.placement
        assert p.gang is not None
        with self._lock:
            gang = self._gang_record(p.gang)
            later = [] if gang.pg is not None else [
                r for r in range(p.gang_rank + 1, p.gang_size) if r not in gang.outside
                and self._actor_name(replace(spec, placement=replace(p, gang_rank=r))) not in self._pending]
        created, _ = self._premake(spec, [p.gang_rank, *later])
        with self._lock:
            for m in created[1:]:
                self._pending[self._actor_name(m.spec)] = m
        return created[0]

    def _start(self, spec: MemberSpec, m: _Member | None) -> None:
        if m is None:
            m = self._create(spec)
        m.spec = spec
        if m.warm:  # rank 0 of a gang, from the spare ``rendezvous`` took for it
            try:
                self._assign(spec, m)
            except LaunchError:
                self._drop_unstarted_gang(spec.placement.gang)
                raise
            return
        env = {**self.base_env, **spec.env}
        log_path = str(self.log_dir / f"{spec.member_id}.log")
        try:
            info = self.ray.get(m.actor.launch.remote(spec.module, list(spec.args), env, log_path, self.bind_node_ip,
                                                      spec.member_id), timeout=self.place_timeout_s)
        except self._errors as exc:
            self._kill_actor(m)
            self._drop_unstarted_gang(spec.placement.gang)
            r = spec.resources
            raise LaunchError(
                f"cannot start {spec.member_id} on the Ray cluster within {self.place_timeout_s:g} s "
                f"(cpus={self.default_cpus if r.cpus is None else r.cpus}, gpus={r.gpus}, "
                f"memory_mb={r.memory_mb}, labels={dict(spec.placement.node_labels)}): {exc}",
                member=spec.member_id, field="resources") from exc
        self._register(spec, m, info)

    def host_for(self, member_id: str) -> str:
        """The node address of the member (or of a rank 0 placed by ``rendezvous``)."""
        m = self._members.get(member_id) or next(
            (p for p in list(self._pending.values()) if p.spec.member_id == member_id), None)
        if m is not None and m.node_ip:
            return m.node_ip
        return super().host_for(member_id)

    # --- borrowing -----------------------------------------------------------------------------

    def can_relabel(self) -> bool:
        return True

    def holds_strict_layout(self) -> bool:
        return True  # a STRICT_* gang is one placement group (its spares are refused alike)

    def relabel(self, member_id: str, spec: MemberSpec) -> None:
        """Switch the running rollout replica ``member_id`` in place to ``spec`` (a trainer rank):
        its actor writes the hand-off and signals the process (``MemberProcess.handoff``); the
        actor is tracked as ``spec.member_id`` from now on (polled, stopped, killed and re-attached
        under that id; its exit is reported under it). The rank stays on the replica's node and
        in the replica's reservation, outside the gang's placement group."""
        check_spec(spec)
        with self._lock:
            m = self._members.get(member_id)
            if m is None or m.reported or m.state is not MemberState.RUNNING:
                raise LaunchError(f"cannot borrow {member_id}: it is not running", member=member_id)
            if m.spec.role != "rollout" or m.spec.module not in ("", ROLLOUT_MODULE):
                raise LaunchError(f"cannot borrow {member_id}: only a rollout replica switches role in place",
                                  member=member_id)
            new = self._members.get(spec.member_id)
            if new is not None and not new.reported and new.state is not MemberState.EXITED:
                raise LaunchError(f"member {spec.member_id} is already running", member=spec.member_id)
            pre = self._pending.pop(self._actor_name(spec), None) if spec.placement.gang else None
            # Tracked under the new id before the switch: an exit seen from now on is the rank's.
            old_spec, old_warm = m.spec, m.warm
            del self._members[member_id]
            m.spec, m.warm = spec, True
            self._members[spec.member_id] = m
        if pre is not None:
            self._release_premade(pre)
        env = {**self.base_env, **spec.env}
        try:
            info = self.ray.get(m.actor.handoff.remote(env, str(self.log_dir / f"{spec.member_id}.log"),
                                                       self.bind_node_ip, spec.member_id), timeout=CALL_TIMEOUT_S)
        except self._errors as exc:
            with self._lock:
                if self._members.get(spec.member_id) is m:
                    del self._members[spec.member_id]
                m.spec, m.warm = old_spec, old_warm
                self._members[member_id] = m
            raise LaunchError(f"cannot hand {member_id} over to {spec.member_id}: {_cause(exc)}",
                              member=member_id) from exc
        m.node_id, m.node_ip = info["node_id"], info["node_ip"]
        if spec.placement.gang:
            with self._lock:
                gang = self._gang_record(spec.placement.gang)
                gang.members.add(spec.member_id)
                gang.outside.add(spec.placement.gang_rank)

    def _release_premade(self, m: _Member) -> None:
        """A gang rank's actor made ahead, not needed (its rank was borrowed): a spare goes back to
        the pool; an actor in the placement group is killed (its bundle stays reserved, empty,
        until the gang ends: Ray cannot shrink a placement group)."""
        if m.shape is not None and m.pid is not None:
            with self._lock:
                if not self._closed:
                    m.spec = MemberSpec("", m.name, "spare", SPARE_MODULE)
                    self._spares.append(m)
                    return
        if m.spec.placement.gang:
            log.info("rank %d of %s was borrowed: its bundle in the gang's placement group stays empty",
                     m.spec.placement.gang_rank, m.spec.placement.gang)
        self._kill_actor(m)

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
                    if m.node_id and not m.expected_exit:
                        with self._lock:
                            self._suspect[m.node_id] = time.monotonic()
                ended.append(m)
        now = time.monotonic()
        with self._lock:
            spares = bool(self._spares)
        # A member lost without an exit code may have died with its node: the GCS marks a node dead
        # before it publishes the deaths of the actors there, so the node table read now reports
        # its other members in this same poll. Reported a poll apart, a replica's replacement can
        # take the spare left on a live node before the trainer gang's restart (which the
        # controller handles first within a poll) asks for it: the likeliest cause of a CI failure
        # of tests/test_ray_testbed.py's node kill (the new rank 0 started cold).
        lost = any(m.rc is None for m in ended)
        if (watching or spares) and (lost or now - self._nodes_checked >= NODE_CHECK_INTERVAL_S):
            self._nodes_checked = now
            alive = {n["NodeID"] for n in self._nodes()}
            for m in watching.values():
                if m not in ended and m.node_id not in alive:
                    m.rc, m.cause = None, f"its node {m.node_ip} ({m.node_id}) is dead"
                    ended.append(m)
            if spares:  # spares that ended or were lost with their node are replaced
                self._check_spares(alive)
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

    @staticmethod
    def same_process(a: dict[str, Any], b: dict[str, Any]) -> bool:
        """The same node, pid and start time: pids repeat across a cluster's nodes (a handle that
        does not know its node is judged by pid and start time alone). The actor name is not
        compared: a member switched in place (``relabel``) keeps its process."""
        nodes = a.get("node_id"), b.get("node_id")
        if all(nodes) and nodes[0] != nodes[1]:
            return False
        try:
            return (int(a["pid"]) == int(b["pid"])
                    and abs(float(a["create_time"]) - float(b["create_time"])) <= START_TIME_TOLERANCE_S)
        except (KeyError, TypeError, ValueError):
            return False

    def find(self, member_id: str) -> dict[str, Any] | None:
        """The handle of the actor running ``member_id`` (not a gang rank: those are started and
        persisted as a gang): the actor named after it, else a spare's actor that took it, found
        by what each says it runs. Such an actor that runs no process (made but never launched,
        or its member ended) is released: nothing else would."""
        prefix = f"{self.instance}:"
        try:
            names = [a["name"] for a in self.ray.util.list_named_actors(all_namespaces=True)
                     if a.get("namespace") == self.namespace and a["name"].startswith(prefix)]
        except self._errors as exc:
            log.warning("cannot look %s up on the Ray cluster: %s", member_id, exc)
            return None
        own = f"{prefix}{member_id}"
        for name in sorted(n for n in names if n == own or n.startswith(f"{prefix}{SPARE_PREFIX}")):
            try:
                actor = self.ray.get_actor(name, namespace=self.namespace)
                info = self.ray.get(actor.info.remote(), timeout=CALL_TIMEOUT_S)
            except self._errors:
                continue
            if name != own and info.get("member") != member_id:
                continue  # a waiting spare, or another member's
            if not (info.get("running") and info.get("pid") is not None):
                self._kill_actor(_Member(MemberSpec("", member_id, "", ""), name, actor))
                continue
            return {"launcher": "ray", "actor": name, "namespace": self.namespace, "pid": info["pid"],
                    "create_time": info["create_time"], "node_id": info["node_id"],
                    "node_ip": info["node_ip"], "gang": None}
        return None

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
                    pg = ray.util.get_placement_group(f"{self.instance}:{gang}")
                except self._errors:
                    pg = None  # every rank ran outside one (spares, borrowed replicas), or it is gone
                self._gangs[gang] = _Gang(pg)
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
        """Stop every member this launcher runs, free their actors, spares and placement groups
        (a previous controller's waiting spares of this instance too)."""
        self._find_spares()
        with self._lock:
            self._closed = True
            pending = list(self._pending.values()) + self._spares
            self._pending.clear()
            self._spares = []
            timers, self._timers = list(self._timers), set()
        for t in timers:
            t.cancel()
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
