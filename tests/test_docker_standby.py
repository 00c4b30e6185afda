"""Borrowing a rollout replica's container as a trainer rank, on a real Docker engine (issue 13).

A private ``dockerd`` (``docker_engine``: own socket, data root and exec root) runs the RobustRL
image that ``tests/test_compose_stack.py`` builds offline (``robustrl:compose-test``), with one
layer on top: the rollout entry point is a stand-in (``docker_standby_probe``) that installs the
real ``StandbyHook`` instead of starting a replica (which would need the bus and the stores inside
the Docker network). The launcher under test is the real ``DockerLauncher``: ``relabel`` reads the
member's pid with ``exec_run``, writes the hand-off with ``put_archive`` and signals ``SIGUSR1``
through the engine; tini forwards it. Checked from inside the container (what the process was
handed, that the trainer's code and torch import there, the hand-off file consumed) and from the
engine (same container, same process, tracked, adopted and reported under the rank's id).

The second test is the whole path: the servers listen on the Docker network's gateway, the
control plane runs here with the Docker launcher (``ROBUSTRL_DOCKER_URL``: the private engine),
every member is a container of the image with this commit's code (``git archive HEAD``); a trainer
container is killed, two replica containers become the new gang's ranks in place (no container is
created for them), replacements restock the pool and load weights, the job finishes and the
auditor passes.

Skips, with the reason, without dockerd, root, the docker SDK or the built image.
"""

from __future__ import annotations

import asyncio
import io
import re
import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from docker_engine import Engine, Unavailable
from support import audit_sampled, eventually, sample_batches

from robustrl.launcher.base import ROLLOUT_MODULE, TRAINER_MODULE, MemberSpec, MemberState
from robustrl.launcher.docker import LABEL_MEMBER, DockerLauncher, container_name

pytestmark = pytest.mark.timeout(600)
BASE = "robustrl:compose-test"
IMAGE = "robustrl:standby-test"
SITE = "/opt/venv/lib/python3.11/site-packages"
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    eng = Engine()
    try:
        eng.start()
    except Unavailable as exc:
        pytest.skip(f"no Docker engine: {exc}")
    try:
        yield eng
    finally:
        eng.stop()


def _image(engine: Engine) -> str:
    """The RobustRL image with the stand-in replica entry point on top (one small layer)."""
    try:
        engine.client.images.get(BASE)
    except Exception:  # noqa: BLE001 - absent: the compose test builds it
        pytest.skip(f"image {BASE} not built here (tests/test_compose_stack.py builds it offline)")
    files = {"Dockerfile": (f"FROM {BASE}\n"
                            f"COPY probe.py {SITE}/robustrl/services/rollout/__main__.py\n").encode(),
             "probe.py": (HERE / "docker_standby_probe.py").read_bytes()}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    buf.seek(0)
    engine.client.images.build(fileobj=buf, custom_context=True, tag=IMAGE, rm=True)
    return IMAGE


def _logs(container: Any) -> str:
    container.reload()
    return str(container.logs().decode(errors="replace"))


def test_a_rollout_container_switches_to_a_trainer_rank_in_place(engine: Engine) -> None:
    image = _image(engine)
    tag = uuid.uuid4().hex[:8]
    network = engine.client.networks.create(f"rrl-standby-{tag}", internal=True)
    launcher = DockerLauncher(image, network.name, client=engine.client, instance=f"standby-{tag}",
                              base_env={"ROBUSTRL_BIND_HOST": "0.0.0.0"})
    replica, rank = "j--rollout-0-i0", "j--trainer-e2-r0"
    try:
        launcher.start(MemberSpec("j", replica, "rollout", ROLLOUT_MODULE, {"ROBUSTRL_MEMBER_ID": "rollout-0-i0"}))
        container = engine.client.containers.get(container_name(replica))
        ready = eventually(lambda: re.search(r"replica ready pid=(\d+)", _logs(container)), timeout=120,
                           interval=0.2, what="the replica's hook installed")
        pid = int(ready.group(1))
        assert launcher.state(replica) is MemberState.RUNNING  # (re-reads the container from the engine)
        host_pid = launcher.pid(replica)
        assert host_pid

        master, _port = launcher.rendezvous_on(replica)  # a borrowed rank 0 is the gang's rendezvous
        assert master == container.name
        spec = MemberSpec("j", rank, "trainer", TRAINER_MODULE, {
            "ROBUSTRL_MEMBER_ID": "trainer-e2-r0", "ROBUSTRL_RANK": "0", "MASTER_ADDR": master,
            "ROBUSTRL_TEST_MARKER": tag})
        launcher.relabel(replica, spec)

        switched = eventually(lambda: re.search(r"switched .*", _logs(container)), timeout=120, interval=0.2,
                              what="the process switched role")
        line = switched.group(0)
        # Inside the container: the same process was handed the rank's environment (readable by the
        # member's user: the file is its own, 0600), consumed the file, and has the trainer's code.
        assert f"pid={pid} " in line, line
        assert f"member=trainer-e2-r0 rank=0 bind={container.name} master={container.name} marker={tag}" in line
        assert "handoff_files_left=0" in line, line
        # From the engine: the same container and process, now tracked under the rank's id.
        assert launcher.state(rank) is MemberState.RUNNING and launcher.state(replica) is None
        assert launcher.pid(rank) == host_pid and launcher.handle(rank) == {"container": container.id}
        assert launcher.host_for(rank) == container.name  # the rank is reached at its container's name
        assert container.labels[LABEL_MEMBER] == replica  # labels stay as created (poll follows the id)
        handle = launcher.handle(rank)
        assert handle is not None
        # A restarted controller (same launcher instance) re-attaches to the rank by its recorded id.
        again = DockerLauncher(image, network.name, client=engine.client, instance=f"standby-{tag}")
        assert again.adopt("j", rank, "trainer", handle) is True
        assert again.adopt("j", replica, "rollout", {"container": "another-id"}) is False
        # Its exit is reported under the rank's id, once.
        launcher.kill(rank)
        exits = eventually(launcher.poll, timeout=30, interval=0.2, what="the exit reported")
        assert [(e.member_id, e.role, e.expected) for e in exits] == [(rank, "trainer", False)]
        assert launcher.poll() == []
        # A replica that is not running cannot be borrowed.
        with pytest.raises(Exception, match="not running"):
            launcher.relabel(rank, MemberSpec("j", "j--trainer-e3-r0", "trainer", TRAINER_MODULE, {}))
    finally:
        launcher.close()
        network.remove()


def test_a_container_whose_handle_was_never_persisted_is_found_and_adopted(engine: Engine) -> None:
    """The controller died between ``containers.run`` and persisting the member's handle (a
    restock's intent: the member recorded as starting, no handle). The next leader's launcher
    (same instance) finds the very container by its labels and adopts it through the controller's
    own path (``MemberStarter.adopt``); another instance's launcher finds nothing, nor one for a
    member never started; once the container has ended it is not found either."""
    from robustrl.config import JobSpec, Settings
    from robustrl.services.controller.jobs import JobRun, MemberInfo
    from robustrl.services.controller.launching import MemberStarter, lid

    image = _image(engine)
    tag = uuid.uuid4().hex[:8]
    network = engine.client.networks.create(f"rrl-find-{tag}", internal=True)
    first = DockerLauncher(image, network.name, client=engine.client, instance=f"find-{tag}")
    job = JobRun("j", JobSpec.parse({"rollout": {"replicas": 3}}))
    job.slot_incarnation, job.restock_owed = {0: 0, 1: 1, 2: 1}, {1: 1, 2: 1}
    job.members = {"rollout-1-i1": MemberInfo("rollout-1-i1", "rollout", 1, 1),
                   "rollout-2-i1": MemberInfo("rollout-2-i1", "rollout", 2, 1)}
    member = lid(job, "rollout-1-i1")
    try:
        first.start(MemberSpec("j", member, "rollout", ROLLOUT_MODULE, {"ROBUSTRL_MEMBER_ID": "rollout-1-i1"}))
        container = engine.client.containers.get(container_name(member))
        assert DockerLauncher(image, network.name, client=engine.client, instance="someone-else").find(member) is None
        again = DockerLauncher(image, network.name, client=engine.client, instance=f"find-{tag}")
        adopted, gone = asyncio.run(MemberStarter(None, again, Settings()).adopt(job))  # type: ignore[arg-type]
        assert (adopted, gone) == (["rollout-1-i1"], [])
        assert job.members["rollout-1-i1"].handle == {"container": container.id} == first.handle(member)
        assert job.members["rollout-2-i1"].state == "dead"  # never started: restocked anew
        assert again.state(member) is MemberState.RUNNING
        again.kill(member)  # tracked like a member started there: killed and reported
        exits = eventually(again.poll, timeout=30, interval=0.2, what="the adopted container's exit")
        assert [(e.member_id, e.expected) for e in exits] == [(member, False)]
        assert again.find(member) is None  # ended
    finally:
        first.close()
        network.remove()


def _code_image(engine: Engine) -> str:
    """The RobustRL image with this commit's code on top (``git archive HEAD``: the committed
    tree, laid out as the installed package is)."""
    import subprocess

    try:
        engine.client.images.get(BASE)
    except Exception:  # noqa: BLE001 - absent: the compose test builds it
        pytest.skip(f"image {BASE} not built here (tests/test_compose_stack.py builds it offline)")
    archive = subprocess.run(["git", "archive", "--format=tar", "HEAD", "robustrl", "services"], cwd=HERE.parent,
                             capture_output=True, check=True).stdout
    buf = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(archive)) as src, tarfile.open(fileobj=buf, mode="w") as out:
        dockerfile = f"FROM {BASE}\nCOPY code/ {SITE}/\n".encode()
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(dockerfile)
        out.addfile(info, io.BytesIO(dockerfile))
        for member in src.getmembers():
            if not member.isfile():
                continue
            name = member.name
            if name.startswith("services/"):
                name = "robustrl/" + name.replace("services/request-manager/", "services/request_manager/", 1)
            data = src.extractfile(member)
            member.name = f"code/{name}"
            out.addfile(member, data)
    buf.seek(0)
    tag = "robustrl:standby-e2e"
    engine.client.images.build(fileobj=buf, custom_context=True, tag=tag, rm=True)
    return tag


@pytest.mark.heavy  # 123-164 s under the suite's load, with its image build: bench/heavy.py (the suite keeps the switch in place above)
def test_a_job_on_the_docker_launcher_borrows_replica_containers_as_trainer_ranks(engine: Engine,
                                                                                 tmp_path: Path) -> None:
    """End to end: servers on the Docker network's gateway, the control plane on this machine with
    the Docker launcher, every member a container. Rank 0's container is killed; the new gang's
    ranks are the surviving rank's container (kept in place as rank 0: ``keep_survivors``) and a
    rollout container switched in place (rank 1); a replacement restocks the pool. No container is
    created for the new gang."""
    from jobs import kinds, small_job, wait_done, wait_step

    from robustrl.audit.model import AuditOptions
    from robustrl.client import ApiClient
    from robustrl.infra.embedded import EmbeddedInfra
    from robustrl.launcher.docker import LABEL_JOB, LABEL_LAUNCHER
    from robustrl.stack import Stack

    image = _code_image(engine)
    tag = uuid.uuid4().hex[:8]
    network = engine.client.networks.create(f"rrl-e2e-{tag}")
    network.reload()
    gateway = network.attrs["IPAM"]["Config"][0]["Gateway"]
    infra = EmbeddedInfra(tmp_path / "infra", host=gateway)
    stack: Stack | None = None
    try:
        settings = infra.start()
        stack = Stack(tmp_path / "stack", external=settings, extra_env={
            "ROBUSTRL_LAUNCHER": "docker", "ROBUSTRL_IMAGE": image, "ROBUSTRL_DOCKER_NETWORK": network.name,
            "ROBUSTRL_DOCKER_URL": engine.url, "ROBUSTRL_LAUNCHER_INSTANCE": f"e2e-{tag}"})
        stack.start()
        assert stack.settings
        api = ApiClient(stack.api_url, stack.settings.api_token)
        # Tool calls of 1 s: the job outlasts the cold start of the replacement containers.
        spec = small_job("dockborrow", steps=30, mode="semi_sync", staleness=1, rollout={"replicas": 3},
                         recovery={"min_replicas_kept": 1}, tools={"latency_s": 1.0}, data={"tasks": ["lookup"]},
                         detector={"trainer_idle_s": 20.0, "rollout_idle_s": 20.0, "silence_s": 20.0,
                                   "probe_timeout_s": 5.0, "metrics_interval_s": 0.5})
        jid = api.submit(spec)["job_id"]
        sampler = sample_batches(stack.settings.redis_url, jid)
        wait_step(api, jid, 2, timeout=300)
        api.fault(jid, kind="crash", role="trainer", member=0)  # docker kill of rank 0's container
        eventually(lambda: [d for d in kinds(api.events(jid), "recovered") if d["kind"] == "trainer"], timeout=300,
                   interval=0.5, what="the trainer recovery")
        # From the engine: no container was created for the new gang's ranks; they run in the
        # borrowed replicas' containers, which are still up.
        borrowed_now = [d["member_id"] for d in kinds(api.events(jid), "replica_borrowed")]
        by_name = {c.name: c for c in engine.client.containers.list(ignore_removed=True, all=True, filters={"label": f"{LABEL_JOB}={jid}"})}
        assert not [n for n in by_name if "trainer-e2" in n], sorted(by_name)
        in_place = [*borrowed_now, "trainer-e1-r1"]  # the survivor's container is its own still
        assert all(by_name[container_name(f"{jid}--{m}")].status == "running" for m in in_place), (
            in_place, {n: c.status for n, c in by_name.items()})
        wait_done(api, jid, timeout=400)
        events = api.events(jid)
        api.close()
        audit_sampled(stack.settings, jid, sampler, AuditOptions(redis_bound=False))
    finally:
        if stack is not None:
            stack.stop()
        infra.stop()
        for c in engine.client.containers.list(ignore_removed=True, all=True, filters={"label": f"{LABEL_LAUNCHER}=e2e-{tag}"}):
            c.remove(force=True)  # what the controller's launcher left (it removes its own on close)
        network.remove()
    borrowed = {d["member_id"]: d["rank"] for d in kinds(events, "replica_borrowed")}
    assert list(borrowed.values()) == [1], borrowed  # rank 0 is the survivor: one replica borrowed
    switched = {d["from_member"]: d["member_id"] for d in kinds(events, "role_switched")}
    assert switched == {"trainer-e1-r1": "trainer-e2-r0", **{m: "trainer-e2-r1" for m in borrowed}}, switched
    started = {d["member_id"]: d for d in kinds(events, "member_started")}
    assert (started["trainer-e2-r0"]["source"], started["trainer-e2-r0"]["borrowed_from"]) == (
        "survivor", "trainer-e1-r1"), started["trainer-e2-r0"]
    assert started["trainer-e2-r1"]["source"] == "borrowed", started["trainer-e2-r1"]
    recovered = [d for d in kinds(events, "recovered") if d["kind"] == "trainer"]
    assert recovered and recovered[0]["sources"] == ["survivor", "borrowed"], recovered
    loaded = {d["member_id"] for d in kinds(events, "weights_loaded")}
    restocked = {d["member_id"] for d in kinds(events, "replica_restocked")}
    assert restocked == {f"rollout-{m.split('-')[1]}-i1" for m in borrowed} and restocked <= loaded
