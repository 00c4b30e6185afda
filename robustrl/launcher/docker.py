"""Docker launcher: each role member is one container of the RobustRL image.

The controller uses it in compose mode (``/var/run/docker.sock`` is mounted into the controller
only). Calls map one-to-one onto the Docker Engine API through the ``docker`` SDK:

=================  =============================================
launcher call      Docker API call
=================  =============================================
``start``          ``containers.run(detach=True, ...)``
``stop``           ``container.stop(timeout=grace)`` (SIGTERM, then SIGKILL)
``kill``           ``container.kill()`` (SIGKILL: a machine loss)
``suspend``        ``container.pause()`` (cgroup freezer: a hang)
``resume``         ``container.unpause()``
``poll``           ``containers.list(all=True, filters=label)``
``find``           ``containers.list(all=True, filters=label)``
``relabel``        ``exec_run`` (the member's pid), ``put_archive``
                   (the hand-off file), ``kill(signal=SIGUSR1)``
``keep_spares``    ``containers.run`` of spares, ``containers.list``
``start`` (spare)  as ``relabel``, in a spare's container
=================  =============================================

Borrowing a rollout replica as a trainer rank (``relabel``): the replica's container runs the same
image as a trainer's, so the process already has the trainer's code (and torch, the model, the
weights in memory). The launcher writes the hand-off (``robustrl.launcher.spare``: the rank's
environment) into the container's ``/tmp`` with ``put_archive`` -- owned by the member's user, mode
0600, named after the member's pid inside the container, which one ``exec_run`` reads -- and sends
``SIGUSR1`` through the engine (``docker kill --signal``; tini, PID 1, forwards it to Python). The
process switches role in place (``robustrl.services.rollout.standby``) and the launcher tracks the
container under the rank's id from then on. What stays as the container was created: its name and
host name (``rr-<replica id>``: the rank binds and advertises that name, and a borrowed rank 0 is
the gang's rendezvous there), its labels (``robustrl.member`` still names the replica: ``poll`` and
``adopt`` follow the container id), its resource limits (``decide`` borrows only a replica whose
reservation covers a rank's), and its output (``docker logs`` of the replica's container).
A trainer rank that survived its gang's crash is kept for the next gang the same way
(``can_keep_trainers``, ``recovery.keep_survivors``): its container stays, the process runs on
as its new rank (``services/trainer/survivor.py``).

Warm spares (``keep_spares``): a spare is a container of the image running ``python -m
robustrl.launcher.spare --handoff /tmp`` -- the member code imported (torch, transformers), no
credential in its environment, waiting for a hand-off. ``start`` of a trainer or rollout member
of the launcher's image takes a ready spare (its output says ``spare <pid> ready``) whose limits
cover the member's (``SpareShape.covers``: no tighter a CPU or memory limit, the same GPU access)
and hands it the member the way ``relabel`` hands a replica a rank (``exec_run``, ``put_archive``
of the hand-off, now with module and args, ``SIGUSR1``); the process runs the member in place and
the container is tracked under the member's id. A gang's rank 0 is held in a spare already at
``rendezvous``, so the gang meets at the spare container's real name (``release_unstarted_gang``
puts it back). What stays as created: the name and host name (``rr-spare-<id>``: the member binds
and advertises it), the labels (``robustrl.spare``, the limits it was made with, and no member
or job label: ``find`` and ``adopt`` never take a waiting spare for a member; the hand-off leaves
``robustrl-member.json`` naming the member, which ``find`` and ``adopt`` read), and the health
check (passing while it waits, the member's ``/healthz`` once it runs one). A spare's exit is
never a member exit (``poll`` judges members only; the spare is replaced). Spares are sized after
the newest trainer rank (or ``spare_resources``) and replaced ``spare_restock_delay_s`` after one
is taken; a failed restock backs off up to ``SPARE_RETRY_MAX_S``. A restarted controller's
launcher (same ``instance``) takes over the waiting spares and removes ended ones; ``close``
removes them all. No spare fits: the member starts cold.

Exited containers are kept (not auto-removed) so that ``poll`` can read the exit code and an
operator can still read ``docker logs``; they are removed when the same member is started again
and on ``close``. The ``docker`` package is imported lazily so that the controller image works
without it when the local launcher is used.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import re
import threading
import uuid
from collections.abc import Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tenacity import Retrying, retry_if_result, stop_after_attempt, wait_fixed

from robustrl.errors import LaunchError
from robustrl.infra.credentials import without_credentials
from robustrl.launcher.base import (
    ExitInfo,
    Launcher,
    MemberSpec,
    MemberState,
    Resources,
    RestockRetries,
    check_spec,
    free_port,
    switchable,
)
from robustrl.launcher.docker_spares import (
    LABEL_SPARE,
    MEMBER_MARK,
    SpareShape,
    handoff_tar,
    ready_pid,
    spare_member,
)
from robustrl.launcher.spare import HANDOFF_ENV, HANDOFF_SIGNAL, SPARE_MODULE, handoff_path
from robustrl.launcher.spare import TARGETS as SPARE_TARGETS
from robustrl.model.engines.envs import image as member_image

__all__ = ["LABEL_SPARE", "DockerLauncher", "SpareShape", "container_name"]

log = logging.getLogger(__name__)

DEFAULT_DOCKER_URL = "unix:///var/run/docker.sock"
CONNECT_TIMEOUT_S = 5.0
"""HTTP timeout of every Docker API call that has no longer wait of its own (stop adds its grace)."""
STOP_GRACE_S = 2.0
MEMBER_HEALTH_PORT = "8081"
HANDOFF_DIR = "/tmp"
SPARE_RESTOCK_DELAY_S = 10.0
"""A spare taken is replaced this much later (as the local launcher does): the new spare's imports
do not compete with the recovery for the CPU."""
SPARE_RETRY_MAX_S = 60.0
"""A restock that failed is tried again ``SPARE_RESTOCK_DELAY_S`` later, the wait doubled per
failure in a row up to this."""
"""Where, inside a member's container, a role hand-off is written (``relabel``)."""
EXEC_OUTPUT_TRIES = 3
"""Tries of an ``exec_run`` whose output the engine lost (``DockerLauncher._member_pid``)."""
_MEMBER_PID = "set -- $(cat /proc/1/task/1/children 2>/dev/null); p=${1:-1}; echo $p $(stat -c '%u %g' /proc/$p)"
"""Shell run in a member's container: the member's pid there (tini's child, else PID 1), uid and gid."""

LABEL_JOB = "robustrl.job"
LABEL_MEMBER = "robustrl.member"
LABEL_ROLE = "robustrl.role"
LABEL_LAUNCHER = "robustrl.launcher"
COMPOSE_SERVICE_LABEL = "com.docker.compose.service"

_NAME_OK = re.compile(r"[^a-zA-Z0-9_.-]")
DNS_LABEL_MAX = 63
# Addresses a member cannot advertise to its peers: the launcher replaces them with the
# container's own name (see ``_member_env``).
_UNROUTABLE = frozenset({"", "0.0.0.0", "::", "127.0.0.1", "localhost", "::1"})

# Docker container status -> launcher state (exited/dead depend on whether we stopped it).
_RUNNING_STATES = {
    "created": MemberState.STARTING,
    "restarting": MemberState.STARTING,
    "running": MemberState.RUNNING,
    "paused": MemberState.SUSPENDED,
}
_ENDED = frozenset({"exited", "dead", "removing"})


def container_name(member_id: str) -> str:
    """Container name (and network host name) of a member: ``rr-<member_id>``.

    A function of the launcher's member id alone (unique per launcher: the controller prefixes it
    with the job id), so :meth:`DockerLauncher.host_for` can name rank 0 before it is started.
    On a user-defined Docker network the name resolves to the container's address. Names are kept
    to one DNS label (63 characters, what glibc's resolver accepts): a longer id is cut and given a
    hash suffix so that two long ids never share a name.
    """
    name = _NAME_OK.sub("-", f"rr-{member_id}")
    if len(name) <= DNS_LABEL_MAX:
        return name
    digest = hashlib.sha256(member_id.encode()).hexdigest()[:10]
    return f"{name[:DNS_LABEL_MAX - len(digest) - 1].rstrip('-.')}-{digest}"


def _status_code(exc: BaseException) -> int | None:
    """HTTP status of a docker SDK APIError (duck-typed so that a fake client can raise it)."""
    code = getattr(exc, "status_code", None)
    return code if isinstance(code, int) else None


def _is_not_found(exc: BaseException) -> bool:
    return _status_code(exc) == 404 or type(exc).__name__ in {"NotFound", "ImageNotFound"}


def _connect(base_url: str, timeout_s: float) -> Any:
    """A DockerClient that has answered a ping, or LaunchError saying what to fix.

    Fails fast instead of hanging: a missing unix socket is checked before any I/O and every
    request carries ``timeout_s``.
    """
    if base_url.startswith("unix://"):
        socket_path = Path(base_url.removeprefix("unix://"))
        if not socket_path.exists():
            raise LaunchError(
                f"Docker engine socket {socket_path} does not exist: start the Docker engine, or "
                f"mount the host's /var/run/docker.sock into the controller container (compose does "
                f"this for the controller service), or pass another docker_url / DOCKER_HOST",
                member="docker",
            )
    try:
        import docker  # local: optional extra robustrl[docker]
    except ImportError as exc:
        raise LaunchError("the Docker launcher needs the docker package: pip install 'robustrl[docker]'",
                          member="docker") from exc
    try:
        # version=None makes the SDK ask the engine for its API version: this is the ping.
        client = docker.DockerClient(base_url=base_url, timeout=timeout_s)
        client.ping()
    except Exception as exc:
        hint = ("check that the controller's user may use the socket (compose: DOCKER_GID is the "
                "socket's group id)" if "ermission" in str(exc) else
                "check that the Docker engine is running and answers at that address")
        raise LaunchError(f"cannot reach the Docker engine at {base_url} within {timeout_s:g} s: "
                          f"{exc}; {hint}", member="docker") from exc
    return client


@dataclass
class _Member:
    spec: MemberSpec
    container: Any
    state: MemberState
    expected_exit: bool = False
    reported: bool = False
    warm: bool = False  # started in a warm spare's container


@dataclass
class _Spare:
    container: Any
    shape: SpareShape
    pid: int | None = None  # inside its container, once its imports are done (ready)
    spec: MemberSpec | None = None  # set while it is held for a gang's rank 0 (``rendezvous``)


class DockerLauncher(Launcher):
    """Start role members as containers of ``image`` attached to the Docker network ``network``.

    Args:
        image: the RobustRL image (``robustrl:latest`` under compose).
        network: an existing Docker network where NATS, Redis and the object store resolve.
        client: a ``docker.DockerClient`` (or a fake with the same methods); created from
            ``docker_url`` when omitted.
        labels: extra labels put on every container (e.g. the compose project).
        docker_url: engine address when ``client`` is omitted (``unix://`` or ``tcp://``).
        timeout_s: connect/request timeout; a missing engine fails within about this long.
        base_env: environment every member gets; ``MemberSpec.env`` overrides it.
        gpu_roles: roles whose containers reserve all GPUs of the host (NVIDIA runtime).
        run_kwargs: extra ``containers.run`` keyword arguments (volumes, shm_size, ...).
        instance: this launcher's label value; ``poll`` sees only containers carrying it. Give
            the same value to the next controller's launcher so it can re-attach (``adopt``) to
            the containers this one started (and take over its waiting spares); by default it is
            unique to this object.
        spare_resources: the limits of each warm spare's container; None: those of the newest
            trainer rank started.
        spare_restock_delay_s: how long after a spare is taken its replacement is started.

    Raises:
        LaunchError: the engine cannot be reached (when ``client`` is omitted).
    """

    def __init__(self, image: str, network: str, client: Any = None,
                 labels: Mapping[str, str] | None = None, *, docker_url: str = DEFAULT_DOCKER_URL,
                 timeout_s: float = CONNECT_TIMEOUT_S, base_env: Mapping[str, str] | None = None,
                 gpu_roles: Collection[str] = (), run_kwargs: Mapping[str, Any] | None = None,
                 instance: str | None = None, spare_resources: Resources | None = None,
                 spare_restock_delay_s: float = SPARE_RESTOCK_DELAY_S) -> None:
        self.image = image
        self.network = network
        self.client = client if client is not None else _connect(docker_url, timeout_s)
        # One id per launcher instance so that poll() never reports another controller's containers.
        self.instance = instance or f"{id(self):x}"
        self.labels = {**(labels or {}), LABEL_LAUNCHER: self.instance}
        self.base_env = dict(base_env or {})
        self.gpu_roles = frozenset(gpu_roles)
        self.run_kwargs = dict(run_kwargs or {})
        self._members: dict[str, _Member] = {}
        self._lock = threading.Lock()
        self.spare_resources = spare_resources
        self.spare_restock_delay_s = spare_restock_delay_s
        self._spares: list[_Spare] = []
        self._held: dict[str, _Spare] = {}  # spares held for a gang's rank 0, by its member id
        self._spares_wanted = 0
        self._spares_found = False  # a predecessor's spares looked up (once)
        self._trainer_shape: SpareShape | None = None
        self._restocks = RestockRetries(SPARE_RESTOCK_DELAY_S, SPARE_RETRY_MAX_S)
        self._timers: set[threading.Timer] = set()
        self._closed = False
        self.spares_used = 0
        """Members started in a warm spare's container (the rest were cold starts)."""

    # --- start -------------------------------------------------------------------------------

    def start(self, spec: MemberSpec) -> None:
        """Hand ``spec`` to a ready warm spare that fits it (module docstring), else run
        ``python -m spec.module`` in a new container; LaunchError if that fails."""
        self._resource_kwargs(spec)  # (checks the spec, logs what is ignored)
        self._note_trainer(spec)
        with self._lock:
            if self._closed:
                raise LaunchError(f"cannot start {spec.member_id}: the launcher is closed", member=spec.member_id)
            self._check_not_running(spec.member_id)
            held = self._held.pop(spec.member_id, None)
        spare = held or self._take_spare(spec)
        alias = None
        if spare is not None:
            with self._lock:
                if self._closed:  # close() ran meanwhile: it would never remove this one
                    self._remove(spare.container)
                    raise LaunchError(f"cannot start {spec.member_id}: the launcher is closed", member=spec.member_id)
                try:
                    self._check_not_running(spec.member_id)
                except LaunchError:
                    spare.spec = None
                    self._spares.append(spare)  # untouched: back to the pool
                    raise
                taken = self._hand_over(spare, spec)
            self._restock_later()  # (the spare's replacement, either way)
            if taken:
                return
            # Held for rank 0: the gang meets at the spare's name, which the cold container answers to.
            alias = spare.container.name if held is not None else None
        self._start_cold(spec, alias)

    def _check_not_running(self, member_id: str) -> None:
        old = self._members.get(member_id)
        if old and self._refresh(old) in (MemberState.STARTING, MemberState.RUNNING, MemberState.SUSPENDED):
            raise LaunchError(f"member {member_id} is already running", member=member_id)

    def _start_cold(self, spec: MemberSpec, alias: str | None = None) -> None:
        """A new container for ``spec`` (``alias``: one more name it answers to on the network)."""
        with self._lock:
            if self._closed:  # close() ran meanwhile: it would never stop this one
                raise LaunchError(f"cannot start {spec.member_id}: the launcher is closed", member=spec.member_id)
            self._check_not_running(spec.member_id)
            name = container_name(spec.member_id)
            self._remove_stale(name)
            kwargs: dict[str, Any] = {
                "command": ["python", "-m", spec.module, *spec.args],
                "name": name,
                "hostname": name,
                "environment": {**_member_env(self.base_env, spec.env, name), HANDOFF_ENV: HANDOFF_DIR},
                # An image built by `docker compose build` carries compose's project/service
                # labels and containers inherit them: without this override compose would list
                # every member as one more `controller` container.
                "labels": {**self.labels, LABEL_JOB: spec.job_id, LABEL_MEMBER: spec.member_id,
                           LABEL_ROLE: spec.role, COMPOSE_SERVICE_LABEL: f"member-{spec.role}"},
                "network": self.network,
                "detach": True,
                # tini as PID 1 forwards SIGTERM to python and reaps its children.
                "init": True,
                # The member's GET /healthz (robustrl.health) on the container's loopback.
                "healthcheck": _member_healthcheck(),
                **self.run_kwargs,
            }
            if spec.role in self.gpu_roles:
                kwargs["device_requests"] = [_gpu_request()]
            kwargs.update(self._resource_kwargs(spec))
            if alias is not None:
                kwargs["networking_config"] = {
                    self.network: self.client.api.create_endpoint_config(aliases=[alias])}
            # rollout.engine vllm: the vLLM image (Dockerfile.vllm), as the local launcher picks
            # .venv-vllm's Python (robustrl.model.engines.envs)
            image = member_image(spec.env, self.image)
            try:
                container = self.client.containers.run(image, **kwargs)
            except Exception as exc:
                if _is_not_found(exc):
                    raise LaunchError(f"image {image} not found: build it (docker compose build) "
                                      f"or pull it", member=spec.member_id) from exc
                raise LaunchError(f"cannot start container {name}: {exc}", member=spec.member_id) from exc
            self._members[spec.member_id] = _Member(spec, container, MemberState.RUNNING)

    def _resource_kwargs(self, spec: MemberSpec) -> dict[str, Any]:
        """The spec's resources as container limits; node placement is logged as ignored (one engine
        is one node)."""
        check_spec(spec)
        r, out = spec.resources, {}
        if r.cpus:
            out["nano_cpus"] = int(r.cpus * 1e9)
        if r.memory_mb:
            out["mem_limit"] = f"{r.memory_mb}m"
        if r.gpus and spec.role not in self.gpu_roles:
            out["device_requests"] = [_gpu_request(max(1, math.ceil(r.gpus)))]
        p = spec.placement
        if p.node_labels or p.anti_affinity != "none" or (p.gang and p.strategy != "PACK"):
            self.ignored(spec, "node placement (labels, anti-affinity, gang strategy)",
                         "one Docker engine is one node: every container runs on it")
        return out

    def host_for(self, member_id: str) -> str:
        """The member's container name: what peers (a trainer gang's ``MASTER_ADDR``) dial.

        Valid before the member is started (the controller names rank 0's host first, then
        starts the ranks), and the same name every incarnation of the member gets. A rank that
        runs in a borrowed replica's container is reached at that container's name.
        """
        member = self._members.get(member_id)
        name = getattr(member.container, "name", None) if member is not None else None
        return name if isinstance(name, str) and name else container_name(member_id)

    # --- warm spares -------------------------------------------------------------------------

    def keep_spares(self, n: int) -> None:
        """Keep ``n`` warm spare containers (0 removes them all). The first call also takes over
        the waiting spares an earlier launcher of this instance left (a restarted controller);
        their containers are kept when they fit, else removed."""
        with self._lock:
            self._spares_wanted = max(0, n)
        self._find_spares()
        self._restock()

    def spares_ready(self) -> int:
        """Spare containers whose process has its imports done and waits (its output says so)."""
        self._check_spares()
        with self._lock:
            return sum(1 for s in self._spares if s.pid is not None)

    def was_warm(self, member_id: str) -> bool:
        m = self._members.get(member_id)
        return m is not None and m.warm

    def _spare_shape(self) -> SpareShape:
        """What a new spare's container is limited to (``spare_resources``, else the newest
        trainer rank's)."""
        all_gpus = "trainer" in self.gpu_roles
        if self.spare_resources is not None:
            return SpareShape.of(self.spare_resources, all_gpus)
        return self._trainer_shape or SpareShape(all_gpus=all_gpus)

    def _note_trainer(self, spec: MemberSpec) -> None:
        """Spares are sized after the newest trainer rank; a new size replaces them (later)."""
        if spec.role != "trainer" or self.spare_resources is not None:
            return
        shape = SpareShape.of(spec.resources, spec.role in self.gpu_roles)
        with self._lock:
            changed, self._trainer_shape = self._trainer_shape not in (None, shape), shape
        if changed and self._spares_wanted:
            self._restock_later()

    def _list(self, label: str | list[str]) -> list[Any]:
        """Containers (ended ones too) carrying ``label``. One removed between the engine's listing
        and the SDK's inspection of it (a spare or member being removed meanwhile) is left out,
        as if listed a moment later: without ``ignore_removed`` the SDK raised NotFound for the
        whole listing, and ``poll`` failed (CI, test_docker_spares)."""
        return list(self.client.containers.list(all=True, filters={"label": label}, ignore_removed=True))

    def _spare_containers(self) -> list[Any]:
        """Containers made as spares by this launcher instance, ended ones too (raises LaunchError)."""
        try:
            return self._list([f"{LABEL_LAUNCHER}={self.instance}", LABEL_SPARE])
        except Exception as exc:
            raise LaunchError(f"cannot list containers: {exc}", member="docker") from exc

    def _find_spares(self) -> None:
        """Take over the waiting spares an earlier launcher of this instance left (once): a
        running one never handed a member joins the pool (``_restock`` removes one of another
        size); an ended one is removed; one that runs a member is that member's (``adopt``)."""
        with self._lock:
            if self._spares_found:
                return
            self._spares_found = True
            known = {s.container.id for s in [*self._spares, *self._held.values()]}
            known |= {m.container.id for m in self._members.values()}
        try:
            found = [c for c in self._spare_containers() if c.id not in known]
        except LaunchError as exc:
            log.warning("cannot look for the spares of an earlier launcher: %s", exc)
            return
        for c in found:
            shape = SpareShape.from_label((c.labels or {}).get(LABEL_SPARE))
            try:
                if c.status in _ENDED or shape is None:
                    self._remove(c)
                elif c.status in _RUNNING_STATES and spare_member(c, HANDOFF_DIR) is None:
                    with self._lock:  # (another keep_spares may have pooled it since the listing)
                        taken = {s.container.id for s in [*self._spares, *self._held.values()]}
                        if c.id in taken or any(m.container.id == c.id for m in self._members.values()):
                            continue
                        self._spares.append(_Spare(c, shape))
                    log.info("took over waiting spare %s of an earlier launcher", c.name)
            except Exception as exc:
                log.warning("spare %s of an earlier launcher left alone: %s", c.name, exc)

    def _check_spares(self, listed: list[Any] | None = None) -> None:
        """Note the spares that became ready; drop (and remove) those whose container ended or
        vanished, replaced ``spare_restock_delay_s`` later. ``listed``: the containers of this
        instance, if just listed."""
        with self._lock:
            spares = list(self._spares)
        if not spares:
            return
        if listed is None:
            try:
                listed = self._spare_containers()
            except LaunchError as exc:
                log.warning("cannot check the warm spares: %s", exc)
                return
        status = {c.id: c.status for c in listed}
        dead = [s for s in spares if status.get(s.container.id, "removing") in _ENDED]
        for s in spares:
            if s.pid is None and s not in dead:
                try:
                    s.pid = ready_pid(s.container)
                except Exception as exc:
                    log.warning("cannot read spare %s's output: %s", s.container.name, exc)
        if not dead:
            return
        with self._lock:
            self._spares = [s for s in self._spares if s not in dead]
        for s in dead:
            log.warning("warm spare %s ended", s.container.name)
            self._remove(s.container)
        self._restock_later()

    def _restock(self) -> None:
        """Drop ended spares, remove extra (or mis-sized) ones, start missing ones. One that fails
        is tried again later, backing off (``SPARE_RETRY_MAX_S``); it never raises: callers are
        timer threads and ``keep_spares``. Members start cold meanwhile, which always works."""
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
            self._remove(s.container)
        for _ in range(missing):
            container = self._new_spare(shape)
            if container is None:
                return False
            with self._lock:
                if not self._closed:
                    self._spares.append(_Spare(container, shape))
                    continue
            self._remove(container)  # close() ran meanwhile: it would never remove this one
            return True
        return True

    def _new_spare(self, shape: SpareShape) -> Any:
        """A new spare's container (None, logged, if the engine refused it): the member image, no
        credential in its environment (the member's come with its hand-off), no member label."""
        name = container_name(f"spare-{uuid.uuid4().hex[:12]}")
        kwargs: dict[str, Any] = {
            "command": ["python", "-m", SPARE_MODULE, "--handoff", HANDOFF_DIR],
            "name": name,
            "hostname": name,
            "environment": {**_member_env(without_credentials(self.base_env), {}, name), HANDOFF_ENV: HANDOFF_DIR},
            "labels": {**self.labels, LABEL_SPARE: shape.label(), LABEL_ROLE: "spare",
                       COMPOSE_SERVICE_LABEL: "member-spare"},
            "network": self.network,
            "detach": True,
            "init": True,
            "healthcheck": _member_healthcheck(unless_missing=f"{HANDOFF_DIR}/{MEMBER_MARK}"),
            **self.run_kwargs,
        }
        if shape.cpus:
            kwargs["nano_cpus"] = int(shape.cpus * 1e9)
        if shape.memory_mb:
            kwargs["mem_limit"] = f"{shape.memory_mb}m"
        if shape.all_gpus or shape.gpus:
            kwargs["device_requests"] = [_gpu_request(-1 if shape.all_gpus else shape.gpus)]
        try:
            return self.client.containers.run(self.image, **kwargs)
        except Exception as exc:
            log.warning("cannot start a warm spare container: %s", exc)
            return None

    def _restock_later(self, delay_s: float | None = None, retry: bool = False) -> None:
        """``_restock`` in a timer thread, ``delay_s`` (default ``spare_restock_delay_s``) from now
        (``retry``: the one pending retry after a failed restock)."""
        def restock() -> None:
            with self._lock:
                self._timers.discard(timer)
            if retry:
                self._restocks.retrying()
            self._restock()

        timer = threading.Timer(self.spare_restock_delay_s if delay_s is None else delay_s, restock)
        timer.daemon = True
        with self._lock:
            if self._closed:
                return
            self._timers.add(timer)
        timer.start()

    def _take_spare(self, spec: MemberSpec) -> _Spare | None:
        """A ready spare out of the pool whose limits cover ``spec``'s, for a trainer or rollout
        member of the launcher's own image; None when none fits (the member starts cold)."""
        if spec.cold:
            return None
        with self._lock:
            if not self._spares or self._closed:
                return None
        if spec.module not in SPARE_TARGETS or member_image(spec.env, self.image) != self.image:
            return None
        want = SpareShape.of(spec.resources, spec.role in self.gpu_roles)
        self._check_spares()
        with self._lock:
            for s in self._spares:
                if s.pid is not None and s.shape.covers(want):
                    self._spares.remove(s)
                    return s
        return None

    def _hand_over(self, spare: _Spare, spec: MemberSpec) -> bool:
        """Hand ``spec`` to a ready spare (lock held) and track its container as the member; False
        (logged, the spare's container removed) if it cannot take it."""
        c = spare.container
        env = {**_member_env(self.base_env, spec.env, c.name), HANDOFF_ENV: HANDOFF_DIR}
        try:
            pid, uid, gid = self._member_pid(c)
            if pid != spare.pid:
                raise LaunchError(f"it runs pid {pid}, not the spare's {spare.pid}", member=c.name)
            c.put_archive(HANDOFF_DIR, handoff_tar(handoff_path("", pid).name, env, uid, gid, spec.module,
                                                   spec.args, spec.member_id))
            c.kill(signal=HANDOFF_SIGNAL.name)
        except Exception as exc:
            log.warning("warm spare %s cannot take %s (%s): starting it cold", c.name, spec.member_id, exc)
            self._remove(c)
            if not self._gone(c):  # it may have taken the member (a signal delivered, its reply lost)
                raise LaunchError(f"warm spare {c.name} failed to take {spec.member_id} and could not be "
                                  f"removed: it may run it, so it is not started again", member=spec.member_id) from exc
            return False
        self._members[spec.member_id] = _Member(spec, c, MemberState.RUNNING, warm=True)
        self.spares_used += 1
        log.info("%s started in warm spare %s", spec.member_id, c.name)
        return True

    def rendezvous(self, spec: MemberSpec) -> tuple[str, int]:
        """MASTER_ADDR and MASTER_PORT for the gang of rank 0 (``spec``). When a ready spare fits
        rank 0 it is held for it (``start`` hands it over) and the gang meets at the spare
        container's own name; else at the name rank 0's cold container will get. The port is free
        in any new container's own network namespace."""
        check_spec(spec)
        self._note_trainer(spec)
        with self._lock:
            held = self._held.get(spec.member_id)
        spare = held or self._take_spare(spec)
        if spare is None:
            return super().rendezvous(spec)
        spare.spec = spec
        with self._lock:
            self._held[spec.member_id] = spare
        return spare.container.name, free_port()

    def release_unstarted_gang(self, gang_id: str | None) -> None:
        """Spares held for rank 0 of a gang never started go back to the pool (they are untouched)."""
        with self._lock:
            back = [mid for mid, s in self._held.items() if s.spec is not None and s.spec.placement.gang == gang_id]
            for mid in back:
                spare = self._held.pop(mid)
                spare.spec = None
                self._spares.append(spare)

    def _gone(self, container: Any) -> bool:
        """Whether the engine no longer has ``container`` (unknown, e.g. it did not answer: no)."""
        try:
            self.client.containers.get(container.id)
        except Exception as exc:
            return _is_not_found(exc)
        return False

    def _remove(self, container: Any) -> None:
        """Remove a container (gone already is fine; anything else is logged)."""
        try:
            container.remove(force=True)
        except Exception as exc:
            if not _is_not_found(exc):
                log.warning("cannot remove container %s: %s", getattr(container, "name", "?"), exc)

    # --- borrowing a rollout replica as a trainer rank ----------------------------------------

    def can_relabel(self) -> bool:
        return True

    def can_keep_trainers(self) -> bool:
        return True

    def relabel(self, member_id: str, spec: MemberSpec) -> None:
        """Hand the running rollout replica (or surviving trainer rank) ``member_id`` over to
        ``spec`` (a rank of the next gang) in place, in its container (module docstring); it is
        tracked as ``spec.member_id`` from now on."""
        with self._lock:
            m = self._members.get(member_id)
            if m is None or self._refresh(m) is not MemberState.RUNNING:
                raise LaunchError(f"cannot borrow {member_id}: it is not running", member=member_id)
            if not switchable(m.spec):
                raise LaunchError(f"cannot borrow {member_id}: only a torch rollout replica or a trainer rank "
                                  "switches to a trainer rank in place", member=member_id)
            new = self._members.get(spec.member_id)
            if new is not None and self._refresh(new) in (MemberState.STARTING, MemberState.RUNNING,
                                                          MemberState.SUSPENDED):
                raise LaunchError(f"member {spec.member_id} is already running", member=spec.member_id)
            check_spec(spec)
            name = m.container.name
            # The rank binds and advertises the container's own name (as a member started there would).
            env = _member_env(self.base_env, spec.env, name)
            try:
                pid, uid, gid = self._member_pid(m.container)
                m.container.put_archive(HANDOFF_DIR, handoff_tar(handoff_path("", pid).name, env, uid, gid))
            except Exception as exc:
                raise LaunchError(f"cannot hand {member_id} over to {spec.member_id}: {exc}",
                                  member=member_id) from exc
            del self._members[member_id]
            self._members[spec.member_id] = _Member(spec, m.container, MemberState.RUNNING)
            try:
                m.container.kill(signal=HANDOFF_SIGNAL.name)
            except Exception as exc:
                if not (_is_not_found(exc) or _status_code(exc) == 409):
                    # Not switched: the container stays the replica it was (tracked under its old
                    # id, so the controller's kill of the drained replica reaches it).
                    del self._members[spec.member_id]
                    self._members[member_id] = m
                    raise LaunchError(f"cannot signal {spec.member_id}: {exc}", member=spec.member_id) from exc
                # it ended meanwhile: poll() reports the exit under the new id

    @staticmethod
    def _member_pid(container: Any) -> tuple[int, int, int]:
        """The member process's pid inside its container, its uid and gid (one ``exec_run``; again,
        up to ``EXEC_OUTPUT_TRIES`` in all, when it exits 0 with no output at all: the engine lost
        the exec's stream (docker-py #2042, moby #27289; the script always prints a line), which
        would otherwise throw a warm spare away or fail a borrow)."""
        read = Retrying(stop=stop_after_attempt(EXEC_OUTPUT_TRIES), wait=wait_fixed(0.1),
                        retry=retry_if_result(lambda result: result[0] == 0 and not result[1]),
                        retry_error_callback=lambda state: state.outcome.result())
        code, out = read(container.exec_run, ["sh", "-c", _MEMBER_PID])
        fields = (out or b"").decode(errors="replace").split()
        if code != 0 or len(fields) != 3 or not all(f.isdigit() for f in fields):
            raise LaunchError(f"cannot read the member's pid in {container.name}: exit {code}: {fields}",
                              member=container.name)
        return int(fields[0]), int(fields[1]), int(fields[2])

    def _remove_stale(self, name: str) -> None:
        """Remove a leftover container with this name (a previous incarnation of the member)."""
        try:
            self.client.containers.get(name).remove(force=True)
        except Exception as exc:
            if not _is_not_found(exc):
                raise LaunchError(f"cannot remove stale container {name}: {exc}", member=name) from exc

    # --- stop / kill / pause -----------------------------------------------------------------

    def stop(self, member_id: str, grace_s: float = STOP_GRACE_S) -> None:
        """``docker stop``: SIGTERM, then SIGKILL after ``grace_s``. An expected exit."""
        member = self._members.get(member_id)
        if member is None or member.state in (MemberState.EXITED, MemberState.STOPPED):
            return
        member.expected_exit = True
        try:
            # The engine takes whole seconds; round up so that the grace is never shortened.
            member.container.stop(timeout=max(0, math.ceil(grace_s)))
        except Exception as exc:
            if not _is_not_found(exc):
                raise LaunchError(f"cannot stop {member_id}: {exc}", member=member_id) from exc
        member.state = MemberState.STOPPED

    def stop_many(self, member_ids: list[str], grace_s: float = STOP_GRACE_S) -> None:
        """Stop several members in parallel, so the total wait is one grace period."""
        if len(member_ids) <= 1:
            for member_id in member_ids:
                self.stop(member_id, grace_s)
            return
        with ThreadPoolExecutor(max_workers=min(16, len(member_ids))) as pool:
            list(pool.map(lambda mid: self.stop(mid, grace_s), member_ids))

    def kill(self, member_id: str, expected: bool = False) -> None:
        """``docker kill`` (SIGKILL to the whole container): a machine loss unless ``expected``."""
        member = self._members.get(member_id)
        if member is None or member.state is MemberState.STOPPED:
            return
        # EXITED is not trusted: a kill asks the engine anyway (409/404 = already ended), so a
        # container wrongly believed dead can never outlive its replacement.
        member.expected_exit = member.expected_exit or expected
        try:
            member.container.kill()
        except Exception as exc:
            # 404: already gone; 409: not running (it exited on its own meanwhile).
            if not _is_not_found(exc) and _status_code(exc) != 409:
                raise LaunchError(f"cannot kill {member_id}: {exc}", member=member_id) from exc
        member.state = MemberState.EXITED

    def kill_many(self, member_ids: list[str], expected: bool = True) -> None:
        """Kill several members (whole-job restart, gang restart)."""
        for member_id in member_ids:
            self.kill(member_id, expected)

    def suspend(self, member_id: str) -> None:
        """``docker pause``: freeze every process of the member (a hang)."""
        self._freeze(member_id, pause=True)

    def resume(self, member_id: str) -> None:
        """``docker unpause``."""
        self._freeze(member_id, pause=False)

    def _freeze(self, member_id: str, pause: bool) -> None:
        member = self._members.get(member_id)
        if member is None or member.state in (MemberState.EXITED, MemberState.STOPPED):
            return
        try:
            member.container.pause() if pause else member.container.unpause()
        except Exception as exc:
            if _is_not_found(exc) or _status_code(exc) == 409:
                return  # gone or not running/paused: nothing to freeze; poll() reports the exit
            raise LaunchError(f"cannot {'pause' if pause else 'unpause'} {member_id}: {exc}",
                              member=member_id) from exc
        member.state = MemberState.SUSPENDED if pause else MemberState.RUNNING

    # --- observation -------------------------------------------------------------------------

    def poll(self) -> list[ExitInfo]:
        """Members whose container exited (or vanished) since the last call, each once.

        Only members registered before the listing are judged: a member started while the
        engine was being asked (``start`` runs on another thread) is not in that listing and
        would otherwise look like a container removed behind our back. A waiting spare's
        container is no member: its exit is never reported (the spare is replaced).
        """
        with self._lock:
            candidates = {mid: m for mid, m in self._members.items() if not m.reported}
        try:
            containers = self._list(f"{LABEL_LAUNCHER}={self.instance}")
        except Exception as exc:
            raise LaunchError(f"cannot list containers: {exc}", member="docker") from exc
        # By container id, not by the member label: a borrowed replica's container runs a trainer
        # rank under another member id than its label names (``relabel``), and so does a spare's.
        seen = {c.id: c for c in containers}
        self._check_spares(containers)
        out: list[ExitInfo] = []
        with self._lock:
            for member_id, member in candidates.items():
                if member.reported or self._members.get(member_id) is not member:
                    continue  # reported meanwhile, or replaced by a newer incarnation
                container = seen.get(member.container.id)
                if container is not None and container.status not in _ENDED:
                    continue
                # A container removed behind our back (docker rm -f) has no exit code to read.
                code = None if container is None else container.attrs.get("State", {}).get("ExitCode")
                member.reported = True
                if member.state is not MemberState.STOPPED:
                    member.state = MemberState.EXITED
                out.append(ExitInfo(member_id, member.spec.role, code, member.expected_exit))
        return out

    def _refresh(self, member: _Member) -> MemberState:
        if member.state in (MemberState.EXITED, MemberState.STOPPED):
            return member.state
        try:
            member.container.reload()
        except Exception as exc:
            if not _is_not_found(exc):
                raise LaunchError(f"cannot inspect {member.spec.member_id}: {exc}",
                                  member=member.spec.member_id) from exc
            member.state = MemberState.STOPPED if member.expected_exit else MemberState.EXITED
            return member.state
        status = member.container.status
        if status in _ENDED:
            member.state = MemberState.STOPPED if member.expected_exit else MemberState.EXITED
        else:
            member.state = _RUNNING_STATES.get(status, member.state)
        return member.state

    def state(self, member_id: str) -> MemberState | None:
        """Current state from the engine, or None for a member never started here."""
        member = self._members.get(member_id)
        return None if member is None else self._refresh(member)

    def pid(self, member_id: str) -> int | None:
        """Host pid of the container's init process, when it is running."""
        member = self._members.get(member_id)
        if member is None:
            return None
        pid = member.container.attrs.get("State", {}).get("Pid")
        return pid if isinstance(pid, int) and pid > 0 else None

    def running(self, job_id: str | None = None) -> list[str]:
        """Members not yet known to have ended (optionally of one job)."""
        return [mid for mid, m in self._members.items()
                if m.state not in (MemberState.EXITED, MemberState.STOPPED)
                and (job_id is None or m.spec.job_id == job_id)]

    def logs(self, member_id: str, tail: int = 200) -> str:
        """The member's last ``tail`` log lines ('' when unknown or removed)."""
        member = self._members.get(member_id)
        if member is None:
            return ""
        try:
            return member.container.logs(tail=tail).decode(errors="replace")
        except Exception:  # noqa: BLE001 - logs are best effort diagnostics
            return ""

    def log_tail(self, member_id: str, lines: int = 20) -> str:
        return self.logs(member_id, tail=lines).rstrip("\n")

    def handle(self, member_id: str) -> dict[str, Any] | None:
        member = self._members.get(member_id)
        return None if member is None else {"container": member.container.id}

    @staticmethod
    def same_process(a: dict[str, Any], b: dict[str, Any]) -> bool:
        """The same container (its id: a member's process is its container's)."""
        return bool(a.get("container")) and a.get("container") == b.get("container")

    def find(self, member_id: str) -> dict[str, Any] | None:
        """The handle (``{"container": id}``, as ``handle`` gives) of the container an earlier
        launcher of this instance started for ``member_id`` whose handle was never persisted (its
        controller died between ``containers.run`` and the write): found by its labels (this
        instance, the member id), if it is created, running or paused, as ``adopt`` accepts.
        None if there is none.

        Raises:
            LaunchError: the engine cannot list containers.
        """
        try:
            found = self._list(f"{LABEL_MEMBER}={member_id}")
        except Exception as exc:
            raise LaunchError(f"cannot list containers: {exc}", member="docker") from exc
        for container in found:
            labels = container.labels or {}
            if labels.get(LABEL_LAUNCHER) == self.instance and container.status in _RUNNING_STATES:
                return {"container": container.id}
        # Started in a spare's container: the hand-off left the member's id there (MEMBER_MARK).
        for container in self._spare_containers():
            if container.status in _RUNNING_STATES and self._spare_runs(container, member_id):
                return {"container": container.id}
        return None

    @staticmethod
    def _spare_runs(container: Any, member_id: str) -> bool:
        """Whether the spare's ``container`` was handed ``member_id`` (its mark; unreadable: no)."""
        try:
            return spare_member(container, HANDOFF_DIR) == member_id
        except Exception as exc:
            log.warning("cannot read the member mark of %s: %s", getattr(container, "name", "?"), exc)
            return False

    def adopt(self, job_id: str, member_id: str, role: str, handle: dict[str, Any]) -> bool:
        """Re-attach to the member's container, found by its labels (this launcher's instance and
        the member id); True if it is running or paused. The recorded container id, when given,
        must match: a newer incarnation under the same name is not this member. A trainer rank
        running in a borrowed replica's container (whose member label names the replica) is found
        by that recorded id; so is a member running in a spare's container (no job or member
        label), once its mark names the member (a waiting spare is never adopted as one)."""
        try:
            found = self._list(f"{LABEL_MEMBER}={member_id}")
            cid = handle.get("container")
            if cid and not any(c.id == cid for c in found):
                found = [c for c in self._list(LABEL_LAUNCHER) if c.id == cid]
            elif not cid and not found:
                # Started in a spare's container and its handle never persisted (the controller
                # died right after the hand-off): found by the member mark, as ``find`` does.
                found = self._spare_containers()
        except Exception as exc:
            raise LaunchError(f"cannot list containers: {exc}", member="docker") from exc
        for container in found:
            labels = container.labels or {}
            if labels.get(LABEL_LAUNCHER) != self.instance:
                continue
            if LABEL_SPARE in labels:
                if not self._spare_runs(container, member_id):
                    continue
            elif labels.get(LABEL_JOB) != job_id:
                continue
            if handle.get("container") not in (None, container.id):
                continue
            state = _RUNNING_STATES.get(container.status)
            if state is None:
                return False
            spec = MemberSpec(job_id, member_id, role, module="", env={})
            with self._lock:
                self._members[member_id] = _Member(spec, container, state, warm=LABEL_SPARE in labels)
            return True
        return False

    def close(self) -> None:
        """Stop every member this launcher started and remove their containers and the spares'."""
        with self._lock:
            self._closed = True
            timers, self._timers = self._timers, set()
            spares = [*self._spares, *self._held.values()]
            self._spares, self._held = [], {}
        for timer in timers:
            timer.cancel()
        for spare in spares:
            self._remove(spare.container)
        self.stop_many(self.running())
        for member in list(self._members.values()):
            with contextlib.suppress(Exception):  # already removed is fine on shutdown
                member.container.remove(force=True)
        self._members.clear()


def _member_env(base: Mapping[str, str], env: Mapping[str, str], name: str) -> dict[str, str]:
    """The container's environment: ``env`` over ``base``, with a routable bind/advertise host.

    Members bind their weight server to ``ROBUSTRL_BIND_HOST`` and advertise that same address to
    their peers, so a wildcard or loopback value inherited from the controller's own settings
    would be unreachable from other containers. The container name resolves to the container's
    address on the job network: binding to it works and peers can dial it.
    """
    out = {"ROBUSTRL_HEALTH_PORT": MEMBER_HEALTH_PORT, **base, **env}
    if out.get("ROBUSTRL_BIND_HOST", "") in _UNROUTABLE:
        out["ROBUSTRL_BIND_HOST"] = name
    return out


def _member_healthcheck(unless_missing: str | None = None) -> dict[str, Any]:
    """Docker health check of a member container (durations in nanoseconds, as the API wants).
    ``unless_missing``: healthy while that file is missing (a spare waiting: it serves nothing),
    the member's ``/healthz`` once it is there (the spare became a member)."""
    url = f"http://127.0.0.1:{MEMBER_HEALTH_PORT}/healthz"
    probe = f"import urllib.request; urllib.request.urlopen('{url}', timeout=2)"
    second = 1_000_000_000
    test = (["CMD", "python", "-c", probe] if unless_missing is None else
            ["CMD-SHELL", f'test ! -e {unless_missing} || python -c "{probe}"'])
    return {"test": test, "interval": 5 * second, "timeout": 3 * second, "retries": 6, "start_period": 30 * second}


def _gpu_request(count: int = -1) -> Any:
    """``--gpus all`` (or ``--gpus <count>``) as the SDK spells it."""
    from docker.types import DeviceRequest  # local: optional extra

    return DeviceRequest(count=count, capabilities=[["gpu"]])
