"""The Ray launcher on a Ray cluster on the testbed: each worker node inside a host's network
namespace (``ip netns exec <host> ray start --address <gateway>:<port> --node-ip-address <host>``),
the head, the infra and the control plane in the root namespace on the testbed's gateway address
(``robustrl.launcher.ray_cluster.TestbedRayCluster``).

A job runs across the two worker hosts; the link of the host running trainer rank 0 is cut (every
packet dropped: a real network partition, no process is killed). The GCS's health checks fail the
node, the controller recovers role-locally on the other node, the link is healed while the job
still runs (the cut-off members come back to the network: their node learns it was failed and
takes them down), and the job finishes with the auditor's checks passing. Then a node is killed
with trainer rank 0, a replica and one of two warm spares on it: the new gang's rank 0 is the spare
that waited on the other node (both tests share the cluster and the stack).

Checked from outside: which network namespace each member process is in (``ip netns pids``), the
GCS's node table, the job's event log, the raw stores (auditor). Skipped, with the reason printed,
where the testbed cannot run (not root, no ip/tc) or ray is not installed.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from jobs import TERMINAL, kinds, small_job, wait_done
from support import audit_sampled, ended, eventually, sample_batches, stop_ray_cluster, take_testbed_down, wide_listeners

from robustrl.errors import TestbedUnavailable
from robustrl.testbed import Testbed
from robustrl.testbed import commands as tb_commands

try:
    import ray
except ImportError:  # pragma: no cover - the README's test command installs it
    ray = None

_REASON = "ray is not installed (pip install -e '.[ray]')" if ray is None else tb_commands.unavailable_reason()
if _REASON is not None:
    print(f"tests/test_ray_testbed.py skipped: {_REASON}")
    pytest.skip(_REASON, allow_module_level=True)

from robustrl.launcher.ray_cluster import TestbedRayCluster

# Two jobs on a Ray cluster inside network namespaces, ~120 s: bench/heavy.py, not the default
# suite (the Ray launcher's node loss, standby and placement run there: tests/test_ray_launcher.py).
pytestmark = [pytest.mark.heavy, pytest.mark.timeout(240)]
INSTANCE = "rr-tb"
STEPS = 6


@pytest.fixture(scope="module")
def testbed() -> Iterator[Testbed]:
    tb = Testbed(hosts=2, link="1gbit")
    try:
        tb.up()
    except TestbedUnavailable as exc:
        print(f"tests/test_ray_testbed.py skipped: {exc}")
        pytest.skip(f"testbed unavailable: {exc}")
    try:
        yield tb
    finally:
        take_testbed_down(tb)


@pytest.fixture(scope="module")
def cluster(testbed: Testbed) -> Iterator[TestbedRayCluster]:
    # A short temp dir: Ray's unix socket paths must fit 108 bytes.
    c = TestbedRayCluster(testbed, Path(tempfile.mkdtemp(prefix="rr-rtb-", dir="/tmp")), worker_cpus=2)
    started = time.monotonic()
    c.start()
    print(f"testbed Ray cluster up in {time.monotonic() - started:.1f} s")
    try:
        yield c
    finally:
        stop_ray_cluster(c)


@pytest.fixture(scope="module")
def stack(testbed: Testbed, cluster: TestbedRayCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from robustrl.client import ApiClient
    from robustrl.stack import Stack

    st = Stack(tmp_path_factory.mktemp("raytb") / "stack", testbed=testbed, extra_env={
        "ROBUSTRL_LAUNCHER": "ray", "ROBUSTRL_RAY_ADDRESS": cluster.address, "ROBUSTRL_LAUNCHER_INSTANCE": INSTANCE})
    st.start()
    assert st.settings is not None
    # Long HTTP timeouts: submit returns once the members run on Ray (slow on a loaded machine).
    api = ApiClient(st.api_url, st.settings.api_token, timeout=60)
    try:
        yield st, api
    finally:
        api.close()
        st.stop()
    left = [n["name"] for n in ray.util.list_named_actors(all_namespaces=True) if n["name"].startswith(f"{INSTANCE}:")]
    assert left == [], f"actors left after the stack stopped: {left}"


def _hosts_of(tb: Testbed, pids: dict[str, int]) -> dict[str, str | None]:
    """The testbed host each process is in (its network namespace), None: the root's."""
    inside = {pid: h.name for h in tb.hosts for pid in tb.pids(h.name)}
    return {mid: inside.get(pid) for mid, pid in pids.items()}


def _live(status: dict[str, Any], role: str | None = None) -> dict[str, int]:
    return {m["member_id"]: m["pid"] for m in status["members"] if (role is None or m["role"] == role)
            and m["state"] not in ("exited", "stopped", "dead")}


def test_a_job_survives_a_worker_host_cut_off_the_network(testbed: Testbed, cluster: TestbedRayCluster,
                                                           stack: tuple[Any, Any]) -> None:

    t0 = time.monotonic()
    gw = testbed.gateway
    # The nodes as the GCS has them: the head on the gateway address, a worker on each host's.
    assert {n["NodeManagerAddress"] for n in cluster.alive_nodes()} == {gw, *(h.address for h in testbed.hosts)}
    # Each worker's raylet runs inside its host; the head's in the root namespace.
    for i, host in enumerate(cluster.hosts):
        raylets = [p for p in testbed.pids(host) if "raylet" in " ".join(psutil.Process(p).cmdline()[:1])]
        assert raylets, f"no raylet inside {host}"
        assert cluster.nodes[i + 1].pid in testbed.pids(host)
    assert cluster.nodes[0].pid not in {p for h in testbed.hosts for p in testbed.pids(h.name)}

    st, api = stack
    # Half a CPU per member: the gang and both replicas fit one 2-CPU worker after the cut. The
    # gang spread (SPREAD: a preference, so the new gang may pack on the host left): its ranks
    # meet across the testbed, not over one host's loopback.
    spec = small_job("raytb", steps=STEPS, trainer={"resources": {"cpus": 0.5}, "placement": {"strategy": "SPREAD"}},
                     rollout={"replicas": 2, "resources": {"cpus": 0.5},
                              "placement": {"anti_affinity": "preferred"}})
    job_id = api.submit(spec)["job_id"]
    sampler = sample_batches(st.settings.redis_url, job_id)
    status = api.wait(job_id, lambda s: s["committed_step"] >= 1, timeout_s=120)
    print(f"first step committed at {time.monotonic() - t0:.1f} s")
    # Every member runs inside a host (none in the root namespace); one replica per host.
    where = _hosts_of(testbed, _live(status))
    assert None not in where.values(), where
    replicas = [where[m] for m in _live(status, "rollout")]
    assert sorted(replicas) == sorted(cluster.hosts), where
    # No member listens on a wildcard address, only on its host's (read in each process's own
    # network namespace). Ray's own servers do (Ray 2.60: '::'; printed).
    hosts = tuple(h.address for h in testbed.hosts)
    assert wide_listeners(list(_live(status).values()), allow=hosts) == []
    print("Ray's own listeners on other addresses:", wide_listeners([n.pid for n in cluster.nodes]))
    assert sorted(where[m] for m in _live(status, "trainer")) == sorted(cluster.hosts), where
    rank0 = next(m for m in status["members"] if m["role"] == "trainer" and m["index"] == 0)
    lost = where[rank0["member_id"]]
    assert lost is not None
    kept = next(h for h in cluster.hosts if h != lost)
    on_lost = {mid: pid for mid, pid in _live(status).items() if where[mid] == lost}
    at, epoch = status["committed_step"], rank0["epoch"]
    trainers = _live(status, "trainer")

    # The partition: the host's link drops every packet; nothing is killed.
    cut_at = time.monotonic()
    cluster.cut_node(1 + cluster.hosts.index(lost))
    eventually(lambda: testbed.address(lost) not in {n["NodeManagerAddress"] for n in cluster.alive_nodes()},
               timeout=30, interval=0.1, what=f"the GCS failed the node of {lost}")
    print(f"node of {lost} failed by the GCS {time.monotonic() - cut_at:.1f} s after the cut")
    assert all(not ended(pid) for pid in on_lost.values())  # cut off, still running
    eventually(lambda: [r for r in kinds(api.events(job_id), "recovered") if r["kind"] == "trainer"], timeout=120,
               interval=0.25, what="the trainer recovered")
    print(f"trainer recovered {time.monotonic() - cut_at:.1f} s after the cut")
    status = api.wait(job_id, lambda s: s["committed_step"] > at and all(
        m["epoch"] > epoch for m in s["members"] if m["role"] == "trainer"
        and m["state"] not in ("exited", "stopped", "dead")) and len(_live(s, "trainer")) == len(trainers)
        and len(_live(s, "rollout")) == 2, timeout_s=60)
    assert wide_listeners(list(_live(status).values()), allow=hosts) == []  # the new gang's too
    # The new gang and the replacement replica run inside the host still on the network.
    survivors = _hosts_of(testbed, _live(status))
    assert set(survivors.values()) == {kept}, survivors
    faults = {f["member_id"] for f in kinds(api.events(job_id), "fault_detected")}
    assert set(on_lost) & faults, (on_lost, faults)
    assert status["status"] not in TERMINAL and status["committed_step"] < STEPS - 1, \
        f"the job ended before the heal: nothing left to attack ({status['status']})"

    # The link back while the job runs: the cut-off members reach the bus and the stores
    # again, with their old epoch; their raylet learns the GCS failed it and exits, taking
    # its actors' workers and their members with it.
    healed_at = time.monotonic()
    testbed.heal()
    eventually(lambda: all(ended(pid) for pid in on_lost.values()), timeout=90, interval=0.25,
               what=f"the members cut off on {lost} ended after the heal")
    print(f"cut-off members ended {time.monotonic() - healed_at:.1f} s after the heal")
    status = wait_done(api, job_id, timeout=150)
    print(f"job finished at {time.monotonic() - t0:.1f} s")
    assert status["committed_step"] == STEPS - 1
    report = audit_sampled(st.settings, job_id, sampler)
    assert report.episodes_lost == 0 and report.steps_trained_twice == 0
    # The lost node stays failed (no member was placed on it again); restore brings it back.
    assert cluster.restore() == [1 + cluster.hosts.index(lost)]
    cluster.wait_nodes(1 + len(cluster.hosts))


def _waiting_spares() -> dict[str, dict[str, Any]]:
    """The launcher's spares waiting for a member, from the GCS and their actors: name -> info."""
    out = {}
    for n in ray.util.list_named_actors(all_namespaces=True):
        if not n["name"].startswith(f"{INSTANCE}:spare-"):
            continue
        try:
            info = ray.get(ray.get_actor(n["name"], namespace="robustrl").info.remote(), timeout=10)
        except (ValueError, ray.exceptions.RayError):
            continue
        if info["spare"] and info["running"]:
            out[n["name"]] = info
    return out


def test_a_gang_lost_with_its_node_restarts_from_the_spare_left_on_the_other_node(
        testbed: Testbed, cluster: TestbedRayCluster, stack: tuple[Any, Any]) -> None:
    """A node lost takes trainer rank 0, a replica and a warm spare with it; one poll of the
    launcher reports the rank and the replica together. The new gang's rank 0 is the spare that
    waited on the other node (the controller handles trainer exits first: the replica's
    replacement used to take that spare, and the gang started cold)."""

    st, api = stack
    spec = small_job("raytbspare", steps=30, trainer={"resources": {"cpus": 0.5}},
                     rollout={"replicas": 2, "resources": {"cpus": 0.5}, "placement": {"anti_affinity": "preferred"}},
                     recovery={"warm_spares": 2})
    job_id = api.submit(spec)["job_id"]
    sampler = sample_batches(st.settings.redis_url, job_id)
    status = api.wait(job_id, lambda s: s["committed_step"] >= 1, timeout_s=120)
    rank0 = next(m for m in status["members"] if m["role"] == "trainer" and m["index"] == 0)
    where = _hosts_of(testbed, _live(status))
    lost = where[rank0["member_id"]]
    assert lost is not None
    spares = eventually(lambda: len(s := _waiting_spares()) == 2 and s, timeout=60, interval=0.5,
                        what="2 warm spares waiting")
    left = {name: info for name, info in spares.items() if info["node_ip"] != testbed.address(lost)}
    # Ray spreads the spares (SPREAD): one on each node, so one outlives the node of rank 0.
    assert len(left) == 1, {n: i["node_ip"] for n, i in spares.items()}
    spare = next(iter(left.values()))
    at = status["committed_step"]
    cluster.kill_node(1 + cluster.hosts.index(lost))
    recovered = eventually(lambda: [r for r in kinds(api.events(job_id), "recovered") if r["kind"] == "trainer"],
                           timeout=120, interval=0.25, what="the trainer recovered")
    events = api.events(job_id)
    started = {d["member_id"]: d for d in kinds(events, "member_started")}
    # On failure: the order the controller saw exits and started members in, with their sources.
    story = [(e["kind"], e.get("data", {}).get("member_id"), e.get("data", {}).get("source"),
              e.get("data", {}).get("returncode")) for e in events
             if e["kind"] in ("member_exited", "member_started", "fault_detected", "recovered")]
    assert started["trainer-e2-r0"]["source"] == "spare", (recovered, story)
    # From outside: the new rank 0 is the very process that waited as the spare, on the other host.
    status = api.job(job_id)
    assert _live(status, "trainer")["trainer-e2-r0"] == spare["pid"]
    assert spare["pid"] in testbed.pids(next(h for h in cluster.hosts if h != lost))
    status = api.wait(job_id, lambda s: s["committed_step"] > at + 1, timeout_s=90)
    api.stop(job_id)
    status = eventually(lambda: (s := api.job(job_id))["status"] in TERMINAL and s, timeout=60, interval=0.2,
                        what="the job stopped")
    assert status["status"] == "stopped", status
    audit_sampled(st.settings, job_id, sampler)
    assert cluster.restore() == [1 + cluster.hosts.index(lost)]
