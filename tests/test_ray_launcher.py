"""The Ray launcher on a real three-node Ray cluster (head + 2 workers) started on this machine.

The nodes are ``ray start --block`` processes on loopback addresses (head 127.0.0.1 with 0 CPUs,
workers 127.0.0.2 and 127.0.0.3, 2 CPUs each). The same cluster with each worker node inside a
testbed host, and network partitions between the nodes, is ``tests/test_ray_testbed.py``. What is
checked comes from outside the launcher: the GCS (actors by name, nodes), the member processes
(/proc), the job's event log and the auditor.
"""

from __future__ import annotations

import os
import re
import signal
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from jobs import TERMINAL, kinds, small_job, wait_done
from support import RAY_WORKER_PORTS, audit_sampled, ended, eventually, sample_batches, stop_ray_cluster, wide_listeners

try:
    import ray
except ImportError:  # pragma: no cover - the README's test command installs it
    ray = None

if ray is None:
    print("tests/test_ray_launcher.py skipped: ray is not installed (pip install -e '.[ray]')")
    pytest.skip("ray is not installed (pip install -e '.[ray]')", allow_module_level=True)

from robustrl.config import Settings
from robustrl.errors import ConfigError, LaunchError
from robustrl.launcher.base import MemberSpec, PlacementHint, Resources, free_port
from robustrl.launcher.ray import RayLauncher
from robustrl.launcher.ray_cluster import LocalRayCluster

pytestmark = pytest.mark.timeout(240)
TESTS = Path(__file__).resolve().parent
INSTANCE = "rr-test"
STEPS = 24


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalRayCluster]:
    # A short temp dir: Ray's unix socket paths must fit 108 bytes.
    c = LocalRayCluster(Path(tempfile.mkdtemp(prefix="rr-ray-", dir="/tmp")), workers=2, worker_cpus=2)
    c.start()
    try:
        yield c
    finally:
        stop_ray_cluster(c)


def idle(member: str, **kw: Any) -> MemberSpec:
    return MemberSpec("j", f"j--{member}", kw.pop("role", "rollout"), "idle_member", **kw)


def member_env(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(item.split("=", 1) for item in f.read().decode().split("\0") if "=" in item)


def test_bad_input_is_refused_with_the_field_named(cluster: LocalRayCluster, tmp_path: Path) -> None:
    with pytest.raises(LaunchError) as err:
        RayLauncher(f"127.0.0.1:{free_port()}", tmp_path, connect_timeout_s=2)
    assert err.value.fields["field"] == "ray_address" and "unreachable" in str(err.value)
    with pytest.raises(LaunchError) as err:
        RayLauncher("no-port-here", tmp_path)
    assert err.value.fields["field"] == "ray_address"
    from robustrl.services.controller.__main__ import make_launcher

    for env, fld in (({"ROBUSTRL_LAUNCHER": "kubernetes"}, "ROBUSTRL_LAUNCHER"),
                     ({"ROBUSTRL_LAUNCHER": "ray"}, "ROBUSTRL_RAY_ADDRESS")):
        with pytest.raises(ConfigError) as cerr:
            make_launcher(Settings(run_dir=str(tmp_path)), env)
        assert cerr.value.fields["field"] == fld
    launcher = RayLauncher(cluster.address, tmp_path, instance="rr-bad", place_timeout_s=3)
    try:
        for spec, fld in ((idle("a", resources=Resources(cpus=-1)), "resources.cpus"),
                          (idle("b", resources=Resources(gpus=float("nan"))), "resources.gpus"),
                          (idle("c", resources=Resources(memory_mb=0)), "resources.memory_mb"),
                          (idle("d", placement=PlacementHint(strategy="EVERYWHERE")), "placement.strategy"),
                          (idle("e", placement=PlacementHint(anti_affinity="sometimes")), "placement.anti_affinity"),
                          (idle("f", placement=PlacementHint(node_labels={"bad key!": "x"})), "placement.node_labels"),
                          (idle("g", host="10.9.9.9"), "host")):
            with pytest.raises(LaunchError) as err:
                launcher.start(spec)
            assert err.value.fields["field"] == fld, err.value
        # More than the cluster has: refused once Ray cannot place it (bounded), nothing left behind.
        with pytest.raises(LaunchError) as err:
            launcher.start(idle("big", resources=Resources(cpus=64)))
        assert err.value.fields["field"] == "resources" and "cpus=64" in str(err.value)
        assert launcher.running() == []
    finally:
        launcher.close()
    assert not [n for n in ray.util.list_named_actors(all_namespaces=True) if n["name"].startswith("rr-bad:")]


def test_gangs_replicas_and_labels_are_placed_across_nodes(cluster: LocalRayCluster, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    # Placing and starting a member took more than 4 s at load ~80 here (j--labelled, 06:33 UTC):
    # the short bound is only for the gang Ray cannot place, which is refused once it passes.
    launcher = RayLauncher(cluster.address, tmp_path, base_env=env, instance="rr-place", place_timeout_s=60)
    try:
        # A gang of 2 spread over 2 nodes; its rendezvous is on rank 0's node, picked before any rank runs.
        gang = [idle(f"trainer-e1-r{r}", role="trainer", resources=Resources(cpus=0.25),
                     placement=PlacementHint(gang="j--trainer-e1", gang_rank=r, gang_size=2, strategy="STRICT_SPREAD"))
                for r in range(2)]
        master, port = launcher.rendezvous(gang[0])
        started = time.monotonic()
        for spec in gang:
            launcher.start(replace(spec, env={"MASTER_ADDR": master, "MASTER_PORT": str(port)}))
        start_s = (time.monotonic() - started) / 2
        nodes = [launcher.host_for(s.member_id) for s in gang]
        assert sorted(nodes) == sorted(cluster.node_ips), nodes
        assert master == nodes[0]
        rank0 = member_env(launcher.pid(gang[0].member_id) or 0)
        assert (rank0["MASTER_ADDR"], rank0["MASTER_PORT"]) == (master, str(port))
        assert rank0["ROBUSTRL_BIND_HOST"] == master  # it serves on its node's address
        # STRICT_SPREAD of 3 on 2 worker nodes (the head has no CPU) cannot be placed: refused, named.
        launcher.place_timeout_s = 4
        with pytest.raises(LaunchError) as err:
            launcher.rendezvous(idle("trainer-e2-r0", role="trainer", resources=Resources(cpus=0.25),
                                     placement=PlacementHint(gang="j--trainer-e2", gang_size=3,
                                                             strategy="STRICT_SPREAD")))
        assert err.value.fields["field"] == "placement.strategy"
        launcher.place_timeout_s = 60
        # Required anti-affinity: one replica per node, a third is refused with the field named.
        group = PlacementHint(group="j--rollout", anti_affinity="required")
        for i in range(2):
            launcher.start(idle(f"rollout-{i}-i0", resources=Resources(cpus=0.25), placement=group))
        assert {launcher.host_for(f"j--rollout-{i}-i0") for i in range(2)} == set(cluster.node_ips)
        with pytest.raises(LaunchError) as err:
            launcher.start(idle("rollout-2-i0", resources=Resources(cpus=0.25), placement=group))
        assert err.value.fields["field"] == "placement.anti_affinity"
        # Node labels (ray start --labels): only the node labelled w2 (127.0.0.3).
        launcher.start(idle("labelled", resources=Resources(cpus=0.25),
                            placement=PlacementHint(node_labels={"robustrl.io/node": "w2"})))
        assert launcher.host_for("j--labelled") == cluster.node_ips[1]
        # An actor killed behind the launcher (not by it) is an unexpected exit, and its member
        # process dies with it (it never runs on, unowned).
        pid = launcher.pid("j--rollout-0-i0")
        assert pid
        ray.kill(ray.get_actor("rr-place:j--rollout-0-i0", namespace="robustrl"), no_restart=True)
        exits = eventually(launcher.poll, timeout=15, what="killed actor reported")
        # (its code: None when the actor's death is seen first, -9 when its member's SIGKILL is:
        # which comes first is the cluster's timing; a full run saw -9 once)
        assert [(e.member_id, e.expected) for e in exits] == [("j--rollout-0-i0", False)], exits
        assert exits[0].returncode in (None, -signal.SIGKILL), exits
        eventually(lambda: ended(pid), timeout=10, what="member of the killed actor gone")
        # kill / stop map onto the member process; each exit reported once with its code.
        launcher.kill("j--rollout-1-i0", expected=True)
        launcher.stop("j--labelled", grace_s=5)
        got = {e.member_id: (e.returncode, e.expected) for e in eventually(launcher.poll, timeout=10, what="exits")}
        got.update({e.member_id: (e.returncode, e.expected) for e in launcher.poll()})
        # SIGTERM: 0 once the member's handler is installed, -15 if it came first (a loaded machine).
        assert got["j--rollout-1-i0"] == (-signal.SIGKILL, True) and got["j--labelled"] in ((0, True), (-15, True))
        assert set(got) == {"j--rollout-1-i0", "j--labelled"}
        assert launcher.poll() == []
        print(f"ray member start: {start_s:.2f} s per member (idle member, actor + process)")
    finally:
        launcher.close()
    assert launcher.running() == []
    assert not [n for n in ray.util.list_named_actors(all_namespaces=True) if n["name"].startswith("rr-place:")]
    assert not [pg for pg in ray.util.placement_group_table().values()
                if pg["name"].startswith("rr-place:") and pg["state"] != "REMOVED"]


def actor_name(job_id: str, member_id: str) -> str:
    """The Ray launcher's actor of a member: a trainer rank's is named by its gang and rank."""
    actor = re.sub(r"^(trainer-e[0-9]+)-r([0-9]+)$", r"\1/r\2", member_id)
    return f"{INSTANCE}:{job_id}--{actor}"


def _actor_node(job_id: str, member_id: str) -> str:
    actor = ray.get_actor(actor_name(job_id, member_id), namespace="robustrl")
    return str(ray.get(actor.info.remote(), timeout=10)["node_ip"])


def _live(status: dict[str, Any], role: str) -> list[dict[str, Any]]:
    return [m for m in status["members"] if m["role"] == role and m["state"] not in ("exited", "stopped", "dead")]


@pytest.fixture(scope="module")
def ray_stack(cluster: LocalRayCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A stack with the Ray launcher, for this module's jobs (the node-loss job, then the warm
    spare and borrowing jobs). Its own servers: on the session's, the session stack's controller
    (started by earlier tests) holds the controller lease in the same Redis, and this one would
    only stand by. One stack for all three: each stack with its own servers costs ~10 s to start
    and stop on 2 cores."""
    from robustrl.stack import Stack

    stack = Stack(tmp_path_factory.mktemp("ray-stack") / "stack", extra_env={
        "ROBUSTRL_LAUNCHER": "ray", "ROBUSTRL_RAY_ADDRESS": cluster.address, "ROBUSTRL_LAUNCHER_INSTANCE": INSTANCE})
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()
    # The stack's graceful stop releases every actor of its launcher, spares included.
    left = [n["name"] for n in ray.util.list_named_actors(all_namespaces=True) if n["name"].startswith(f"{INSTANCE}:")]
    assert left == [], f"actors left after the stack stopped: {left}"


def test_a_job_across_nodes_survives_an_actor_kill_a_node_loss_and_a_controller_restart(
        cluster: LocalRayCluster, ray_stack: Any) -> None:
    from robustrl.client import ApiClient

    stack = ray_stack
    api = ApiClient(stack.api_url, stack.settings.api_token)  # type: ignore[union-attr]
    try:
        t0 = time.monotonic()
        spec = small_job("ray", steps=STEPS, trainer={"resources": {"cpus": 0.5}},
                         rollout={"replicas": 2, "resources": {"cpus": 0.5}, "placement": {"anti_affinity": "preferred"}})
        job_id = api.submit(spec)["job_id"]
        sampler = sample_batches(stack.settings.redis_url, job_id)
        status = api.wait(job_id, lambda s: s["committed_step"] >= 1, timeout_s=150)
        print(f"first steps committed at {time.monotonic() - t0:.1f} s")
        # Across nodes: the replicas on both workers; the gang's MASTER_ADDR is rank 0's node.
        replicas = {_actor_node(job_id, m["member_id"]) for m in _live(status, "rollout")}
        assert replicas == set(cluster.node_ips), replicas
        rank0 = next(m for m in _live(status, "trainer") if m["index"] == 0)
        assert member_env(rank0["pid"])["MASTER_ADDR"] == _actor_node(job_id, rank0["member_id"])
        # Nothing of RobustRL listens beyond loopback: the stack, and the members (processes the
        # actors start: the rendezvous store, Gloo, the weight servers). Ray's own servers do: in
        # Ray 2.60 the GCS and raylets listen on '::' whatever --node-ip-address says (printed).
        # The controller is a Ray driver: its core worker listens on '::' too, on a port of Ray's
        # worker range; that one is Ray's.
        def robustrl_listeners(status: dict[str, Any]) -> list[tuple[int, str, str, int]]:
            members = [m["pid"] for m in _live(status, "trainer") + _live(status, "rollout")]
            driver = stack.pids()["controller"]
            return [x for x in wide_listeners(list(stack.pids().values()) + members)
                    if not (x[0] == driver and x[3] in RAY_WORKER_PORTS)]

        assert robustrl_listeners(status) == []
        print("Ray's own listeners beyond loopback:", wide_listeners([n.pid for n in cluster.nodes]))

        # 1. A trainer rank's actor killed through Ray: seen, the gang restarted, the job goes on.
        victim = next(m for m in _live(status, "trainer") if m["index"] == 1)
        at = status["committed_step"]
        ray.kill(ray.get_actor(actor_name(job_id, victim["member_id"]), namespace="robustrl"), no_restart=True)
        # (both ranks of the new gang live: 'all' over none held while the gang was replaced)
        status = api.wait(job_id, lambda s: s["committed_step"] > at and len(_live(s, "trainer")) == 2 and all(
            m["epoch"] > victim["epoch"] for m in _live(s, "trainer")), timeout_s=120)
        assert ended(victim["pid"])
        print(f"actor kill recovered at {time.monotonic() - t0:.1f} s")
        events = api.events(job_id)
        assert any(f["member_id"] == victim["member_id"] for f in kinds(events, "fault_detected"))

        # 2. A worker node lost (its raylet and everything on it, SIGKILL): role-local recovery.
        rank0 = next(m for m in _live(status, "trainer") if m["index"] == 0)
        lost_ip = _actor_node(job_id, rank0["member_id"])
        on_lost = [m for m in _live(status, "trainer") + _live(status, "rollout")
                   if _actor_node(job_id, m["member_id"]) == lost_ip]
        at, epoch = status["committed_step"], rank0["epoch"]
        cluster.kill_node(1 + cluster.node_ips.index(lost_ip))
        status = api.wait(job_id, lambda s: s["committed_step"] > at + 1 and len(_live(s, "trainer")) == 2 and all(
            m["epoch"] > epoch for m in _live(s, "trainer")) and len(_live(s, "rollout")) == 2, timeout_s=150)
        print(f"node loss recovered at {time.monotonic() - t0:.1f} s, step {status['committed_step']}")
        assert robustrl_listeners(status) == []  # the gangs formed since, and the replacement replica
        survivors = [m for m in _live(status, "trainer") + _live(status, "rollout")]
        assert {_actor_node(job_id, m["member_id"]) for m in survivors} == set(cluster.node_ips) - {lost_ip}
        faults = {f["member_id"] for f in kinds(api.events(job_id), "fault_detected")}
        assert {m["member_id"] for m in on_lost} & faults, (on_lost, faults)

        # 3. The controller killed: the restarted one re-attaches to the running actors and
        #    restarts none of them.
        live = {m["member_id"]: m["pid"] for m in survivors}
        # Steps left for after the restart, so that it lands mid-job. The steps run on while the
        # test waits for the node loss's replacement replica (a full run reached step 12 of 16
        # by then): 24 steps. A last step committed during the takeover is finished by the new
        # leader (tests/test_controller_takeover_finish.py), so 2 left is enough here.
        assert status["status"] in ("running", "recovering") and status["committed_step"] < STEPS - 2, (
            f"the job is too far along for the controller restart: {status['status']}, step {status['committed_step']}")
        n_started = len(kinds(api.events(job_id), "member_started"))
        old = stack.pids()["controller"]
        os.kill(old, signal.SIGKILL)
        eventually(lambda: stack.pids().get("controller") not in (None, old), timeout=30, what="controller restarted")
        note = eventually(lambda: [d for d in kinds(api.events(job_id), "note") if d.get("adopted")], timeout=60,
                          retry_on=(AssertionError, OSError, Exception), what="controller re-attached")[-1]
        assert set(note["adopted"]) == set(live) and note["gone"] == [], note
        print(f"controller re-attached at {time.monotonic() - t0:.1f} s")
        status = wait_done(api, job_id, timeout=150)
        print(f"job finished at {time.monotonic() - t0:.1f} s")
        assert len(kinds(api.events(job_id), "member_started")) == n_started  # nobody restarted
        assert status["committed_step"] == STEPS - 1
        assert stack.settings is not None
        report = audit_sampled(stack.settings, job_id, sampler)
        assert report.episodes_lost == 0 and report.steps_trained_twice == 0
    finally:
        api.close()


def test_a_spare_whose_actor_creation_fails_is_started_again_later(cluster: LocalRayCluster, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A restock whose spare actor cannot be created (the GCS refuses it) is tried again with
    back-off instead of leaving the pool short for good; checked in the GCS and the actor itself."""
    import robustrl.launcher.ray as ray_launcher

    monkeypatch.setattr(ray_launcher, "SPARE_RESTOCK_DELAY_S", 0.2)
    launcher = RayLauncher(cluster.address, tmp_path, base_env={**os.environ, "PYTHONPATH": str(TESTS)},
                           instance="rr-retry", spare_resources=Resources(cpus=0.25))
    real, refused = launcher._actor_cls, []

    class Refusing:  # the first two spare actors are refused, as by a GCS that is away
        def options(self, **opts: Any) -> Any:
            if opts["name"].startswith("rr-retry:spare-") and len(refused) < 2:
                refused.append(opts["name"])
                raise ray.exceptions.RaySystemError("GCS unavailable (injected)")
            return real.options(**opts)

    launcher._actor_cls = Refusing()
    try:
        launcher.keep_spares(1)  # refused: the retries run in timer threads from here on
        spares = eventually(lambda: waiting_spares("rr-retry"), timeout=90, interval=0.5,
                            what="a spare started after the refusals")
        assert len(refused) == 2 and len(spares) == 1 and not set(spares) & set(refused), (refused, spares)
    finally:
        launcher.close()
    assert not [n for n in ray.util.list_named_actors(all_namespaces=True) if n["name"].startswith("rr-retry:")]


def test_members_whose_handles_were_never_persisted_are_found_by_the_next_launcher(
        cluster: LocalRayCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 13 (b) on Ray: a controller that dies after starting a member and before persisting
    its handle leaves a detached actor. The next controller's launcher (same instance) finds it by
    the member's id -- the actor named after it, or the spare's actor that took it -- and adopts
    that very process; an actor made but never launched is released. Checked in the GCS."""
    import robustrl.launcher.ray as ray_launcher

    monkeypatch.setattr(ray_launcher, "SPARE_TARGETS", frozenset({*ray_launcher.SPARE_TARGETS, "idle_member"}))
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    old = RayLauncher(cluster.address, tmp_path, base_env=env, instance="rr-find", spare_resources=Resources(cpus=0.25))
    new = RayLauncher(cluster.address, tmp_path, base_env=env, instance="rr-find")
    try:
        old.keep_spares(1)
        eventually(lambda: waiting_spares("rr-find"), timeout=90, interval=0.5, what="a spare waiting")
        old.start(idle("rollout-0-i1", resources=Resources(cpus=0.25)))  # from the spare
        old.start(idle("rollout-1-i1", resources=Resources(cpus=0.25)))  # cold: the pool is empty now
        assert old.was_warm("j--rollout-0-i1") and not old.was_warm("j--rollout-1-i1")
        # an actor made for a member whose process was never launched (its controller died between)
        from robustrl.launcher.ray_member import MemberProcess

        made = ray.remote(MemberProcess).options(name="rr-find:j--rollout-2-i1", namespace="robustrl",
                                                 lifetime="detached", num_cpus=0).remote()
        assert ray.get(made.info.remote(), timeout=60)["pid"] is None
        for mid in ("j--rollout-0-i1", "j--rollout-1-i1"):
            handle = new.find(mid)
            assert handle is not None and handle["pid"] == old.pid(mid), (mid, handle)
            assert new.adopt("j", mid, "rollout", handle) and new.pid(mid) == old.pid(mid)
        assert new.find("j--rollout-2-i1") is None
        eventually(lambda: "rr-find:j--rollout-2-i1" not in {n["name"] for n in ray.util.list_named_actors(
            all_namespaces=True)}, timeout=30, what="the never-launched actor released")
    finally:
        old.close()
        new.close()
    assert not [n for n in ray.util.list_named_actors(all_namespaces=True) if n["name"].startswith("rr-find:")]


# --- warm spares and borrowing on Ray (the module's stack, for both jobs) --------------------------

STANDBY_INSTANCE = INSTANCE


@pytest.fixture(scope="module")
def standby_stack(cluster: LocalRayCluster, ray_stack: Any) -> Iterator[tuple[Any, Any]]:
    from robustrl.client import ApiClient

    # Both workers (an earlier test kills one): each job here needs more than one worker's 2 CPUs.
    restarted = cluster.restore()
    if restarted:
        print(f"restarted Ray worker nodes {restarted}")
    stack = ray_stack
    # Long HTTP timeouts: submit and stop return once the members are started or stopped on Ray,
    # which took more than the client's default 10 s at load 18 here.
    api = ApiClient(stack.api_url, stack.settings.api_token, timeout=90)  # type: ignore[union-attr]
    try:
        yield stack, api
    finally:
        api.close()


def _actor_info(name: str) -> dict[str, Any] | None:
    try:
        return dict(ray.get(ray.get_actor(name, namespace="robustrl").info.remote(), timeout=10))
    except (ValueError, ray.exceptions.RayError):
        return None


def waiting_spares(instance: str = STANDBY_INSTANCE) -> dict[str, dict[str, Any]]:
    """The Ray launcher's spares waiting for a member, from the GCS and their actors: name -> info."""
    out = {}
    for n in ray.util.list_named_actors(all_namespaces=True):
        info = _actor_info(n["name"]) if n["name"].startswith(f"{instance}:spare-") else None
        if info and info["spare"] and info["running"]:
            out[n["name"]] = info
    return out


def _member_actor(job_id: str, member_id: str) -> dict[str, Any]:
    """The actor running ``member_id`` now, found in the GCS by its member process's pid."""
    status = next(m for m in _status_members(job_id) if m["member_id"] == member_id)
    for n in ray.util.list_named_actors(all_namespaces=True):
        info = _actor_info(n["name"]) if n["name"].startswith(f"{STANDBY_INSTANCE}:") else None
        if info and info["pid"] == status["pid"] and info["running"]:
            return {"name": n["name"], **info}
    raise AssertionError(f"no live actor runs {member_id} (pid {status['pid']})")


_API: list[Any] = []


def _status_members(job_id: str) -> list[dict[str, Any]]:
    return list(_API[0].job(job_id)["members"])


def test_a_trainer_rank_restarts_from_a_ray_warm_spare(cluster: LocalRayCluster,
                                                       standby_stack: tuple[Any, Any]) -> None:

    stack, api = standby_stack
    _API[:] = [api]
    # The job must still run when the pool is restocked: its end releases its spares, and the pool
    # can never be seen back after it. 40 steps of 0.5 s tool calls outlive the restock on a loaded
    # machine; the job is stopped once the restock and the new gang's progress are seen.
    spec = small_job("rayspare", steps=40, trainer={"resources": {"cpus": 0.5}},
                     rollout={"replicas": 2, "resources": {"cpus": 0.5}}, recovery={"warm_spares": 2},
                     tools={"latency_s": 0.5}, data={"tasks": ["lookup"]})
    job_id = api.submit(spec)["job_id"]
    sampler = sample_batches(stack.settings.redis_url, job_id)
    # Two spare actors, each running `python -m robustrl.launcher.spare` and waiting for a member.
    spares = eventually(lambda: len(s := waiting_spares()) == 2 and s, timeout=90, interval=0.5,
                        what="2 warm spares waiting")
    assert {s["node_ip"] for s in spares.values()} <= set(cluster.node_ips)
    status = api.wait(job_id, lambda s: s["committed_step"] >= 1, timeout_s=150)
    spares = waiting_spares()
    assert len(spares) == 2
    victim = next(m for m in _live(status, "trainer") if m["index"] == 1)
    ray.kill(ray.get_actor(actor_name(job_id, victim["member_id"]).replace(INSTANCE, STANDBY_INSTANCE),
                           namespace="robustrl"), no_restart=True)
    recovered = eventually(lambda: [d for d in kinds(api.events(job_id), "recovered") if d["kind"] == "trainer"],
                           timeout=120, interval=0.25, what="trainer recovery")
    assert recovered[0]["source"] == "spare", recovered
    events = api.events(job_id)
    new = {d["member_id"]: d for d in kinds(events, "member_started") if d["member_id"].startswith("trainer-e2-")}
    assert {d["source"] for d in new.values()} == {"spare"} and len(new) == 2, new
    # The new ranks are the very spare processes (same pids, same actors) that waited before the fault.
    status = api.job(job_id)
    pids = {m["member_id"]: m["pid"] for m in _live(status, "trainer")}
    assert set(pids.values()) <= {s["pid"] for s in spares.values()}, (pids, spares)
    for mid in pids:
        assert _member_actor(job_id, mid)["name"] in spares
    assert ended(victim["pid"])
    # The pool is back to its size while the job runs: SPARE_RESTOCK_DELAY_S (10 s) after the take,
    # plus a Ray actor start per new spare (a new worker process on a loaded 2-core machine).
    taken_at = min(e["ts"] for e in events if e["kind"] == "member_started"
                   and e["data"]["member_id"].startswith("trainer-e2-"))
    seen: dict[str, Any] = {}

    def pool_back() -> dict[str, dict[str, Any]] | bool:
        s = waiting_spares()
        seen.update(spares=sorted(s), job=api.job(job_id)["status"], at=round(time.time() - taken_at, 1))
        if seen["job"] in TERMINAL:  # not retried: the job's end released its spares
            pytest.fail(f"the job ended before the spare pool was restocked (last seen {seen})")
        return len(s) == 2 and s

    try:
        restocked = eventually(pool_back, timeout=120, interval=0.5, what="the spare pool back to 2")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last seen {seen}") from exc
    print(f"spare pool restocked {seen['at']} s after the take")
    assert not set(restocked) & set(spares)
    # The gang made of spares trains on; then the job is stopped (its 40 steps were runway only).
    at = api.job(job_id)["committed_step"]
    api.wait(job_id, lambda s: s["committed_step"] > at, timeout_s=90)
    api.stop(job_id)
    status = eventually(lambda: (s := api.job(job_id))["status"] in TERMINAL and s, timeout=60, interval=0.2,
                        what="the job stopped")
    assert status["status"] == "stopped" and status["committed_step"] > at, status
    audit_sampled(stack.settings, job_id, sampler)
    # The job's end released its spares (no other job asks for any).
    eventually(lambda: waiting_spares() == {}, timeout=30, what="spares released at the job's end")


def test_a_trainer_rank_is_a_borrowed_replica_actor_switched_in_place(cluster: LocalRayCluster,
                                                                     standby_stack: tuple[Any, Any]) -> None:

    stack, api = standby_stack
    _API[:] = [api]
    # semi_sync: borrowing is for overlapped modes; 3 replicas, 1 kept generating: both ranks borrowed.
    spec = small_job("rayborrow", steps=16, mode="semi_sync", staleness=1, trainer={"resources": {"cpus": 0.5}},
                     rollout={"replicas": 3, "resources": {"cpus": 0.5}}, recovery={"min_replicas_kept": 1},
                     tools={"latency_s": 0.5}, data={"tasks": ["lookup"]})
    job_id = api.submit(spec)["job_id"]
    sampler = sample_batches(stack.settings.redis_url, job_id)
    status = api.wait(job_id, lambda s: s["committed_step"] >= 2, timeout_s=150)
    replicas = {m["member_id"]: m for m in _live(status, "rollout")}
    replica_actor = {mid: actor_name(job_id, mid).replace(INSTANCE, STANDBY_INSTANCE) for mid in replicas}
    victim = next(m for m in _live(status, "trainer") if m["index"] == 0)
    ray.kill(ray.get_actor(actor_name(job_id, victim["member_id"]).replace(INSTANCE, STANDBY_INSTANCE),
                           namespace="robustrl"), no_restart=True)
    recovered = eventually(lambda: [d for d in kinds(api.events(job_id), "recovered") if d["kind"] == "trainer"],
                           timeout=120, interval=0.25, what="trainer recovery")
    assert recovered[0]["source"] == "borrowed", recovered
    events = api.events(job_id)
    borrowed = {d["member_id"]: d["rank"] for d in kinds(events, "replica_borrowed")}
    assert len(borrowed) == 2 and set(borrowed) <= set(replicas), borrowed
    started = {d["member_id"]: d for d in kinds(events, "member_started") if d["member_id"].startswith("trainer-e2-")}
    assert {d["source"] for d in started.values()} == {"borrowed"}, started
    switches = eventually(lambda: len(s := kinds(api.events(job_id), "role_switched")) == 2 and s, timeout=60,
                          what="both borrowed replicas switched role")
    switched = {d["from_member"]: d for d in switches}
    assert set(switched) == set(borrowed)
    # In place: each rank is the replica's own process, still owned by the replica's actor (the
    # process's /proc environ is its start environment: the hand-off changed it in memory only).
    status = api.job(job_id)
    ranks = {m["member_id"]: m for m in _live(status, "trainer")}
    for replica, rank in borrowed.items():
        mid = f"trainer-e2-r{rank}"
        assert ranks[mid]["pid"] == replicas[replica]["pid"], (mid, replica)
        actor = _member_actor(job_id, mid)
        assert actor["name"] == replica_actor[replica]
    rank0 = next(mid for mid in ranks if mid.endswith("-r0"))
    # The pool is back to its size: a new incarnation of each borrowed slot.
    eventually(lambda: len(kinds(api.events(job_id), "replica_restocked")) == 2, timeout=90, interval=0.5,
               what="both borrowed slots restocked")
    status = api.wait(job_id, lambda s: len(_live(s, "rollout")) == 3, timeout_s=60)
    # Its exit is the trainer rank's: the borrowed rank's actor killed is a trainer fault under its new id.
    at = status["committed_step"]
    assert at < 13, "the job is too far along for a second fault"
    ray.kill(ray.get_actor(_member_actor(job_id, rank0)["name"], namespace="robustrl"), no_restart=True)
    faults = eventually(lambda: [f for f in kinds(api.events(job_id), "fault_detected") if f["member_id"] == rank0],
                        timeout=60, what="the borrowed rank's exit reported under its trainer id")
    assert faults[0]["role"] == "trainer", faults
    status = wait_done(api, job_id, timeout=180)
    assert status["committed_step"] == 15
    audit_sampled(stack.settings, job_id, sampler)


DIED_WITH_ITS_NODE = ("The actor died unexpectedly before finishing this task.\n\tclass_name: MemberProcess\n"
                      "The actor died because its node has died. Node Id: a186108cc71f\n\tthe actor's node was "
                      "terminated unexpectedly: health check failed due to missing too many heartbeats\n"
                      "The actor never ran - it was cancelled before it started running.")
"""Ray 2.60's message for an actor placed on a node that died before it ran (seen in this module's
node-loss test: a whole-job restart's replica placed on the node just killed)."""


@pytest.mark.parametrize(("cause", "gang", "calls", "started"), [
    (DIED_WITH_ITS_NODE, None, 2, True),  # placed again, on a node alive: started
    ("no node has 8 CPUs free", None, 1, False),  # any other failure: raised at once
    (DIED_WITH_ITS_NODE, "g", 1, False),  # a gang rank is placed with its gang (its placement group)
])
def test_a_member_placed_on_a_node_that_died_before_it_ran_is_placed_again(cause, gang, calls, started) -> None:
    import threading

    from robustrl.errors import LaunchError
    from robustrl.launcher.base import MemberSpec, PlacementHint
    from robustrl.launcher.ray import RayLauncher

    class Probe(RayLauncher):
        def __init__(self) -> None:  # no cluster: only start()'s own logic runs
            self._lock, self._closed, self.instance = threading.RLock(), False, "t"
            self._members, self._pending, self._placing, self._spares, self._gangs = {}, {}, {}, [], {}
            self.calls = 0

        def _note_trainer(self, spec: MemberSpec) -> None:
            pass

        def _premake_from(self, spec: MemberSpec) -> None:  # type: ignore[override]
            return None

        def _start(self, spec: MemberSpec, m: object) -> None:
            self.calls += 1
            if self.calls == 1:
                raise LaunchError(f"cannot start {spec.member_id}") from RuntimeError(cause)

    probe = Probe()
    placement = PlacementHint(gang=gang, gang_rank=0, gang_size=2) if gang else PlacementHint()
    spec = MemberSpec("j", "j--rollout-1-i1", "rollout", "m", placement=placement)
    if started:
        probe.start(spec)
    else:
        with pytest.raises(LaunchError):
            probe.start(spec)
    assert probe.calls == calls
