"""Warm spare containers on the Docker launcher, on a real Docker engine (issue 13: "preference
spare first, borrow second, cold last ... works with the local, Docker and Ray launchers").

A private ``dockerd`` (``docker_engine``) runs the RobustRL image that
``tests/test_compose_stack.py`` builds offline (``robustrl:compose-test``) with one layer on top:
this working tree's code, and as the trainer's entry point a stand-in (``docker_spare_probe``) that
imports what the real one imports and then reports, from inside its container, what it runs as
(the real trainer would need the bus and the stores inside the Docker network).

Judged from the engine: the spare is a container of its own (labelled a spare of this launcher,
no member label), its process waits with the member code imported and without the job's
credentials; a trainer started then runs in that very container and process (no container is
created), with the spec's environment and the container's own host name as its bind and
rendezvous address; it is tracked, found and adopted under its member id; a new spare is
restocked; the member's exit is reported under its id, a spare's never; ``close`` removes the
spares. A restarted controller's launcher takes the waiting spare over instead of starting one.

The last test is the whole path: a job on the Docker launcher (this commit's code in every
container) whose trainer container is killed; the new rank runs in the waiting spare container,
the pool is restocked, the job finishes and the auditor passes.

Skips, with the reason, without dockerd, root, the docker SDK or the built image.
"""

from __future__ import annotations

import io
import re
import subprocess
import tarfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest
from docker_engine import Engine, Unavailable
from support import eventually

from robustrl.launcher.base import TRAINER_MODULE, MemberSpec, MemberState, Resources
from robustrl.launcher.docker import LABEL_LAUNCHER, LABEL_MEMBER, LABEL_SPARE, DockerLauncher, container_name
from robustrl.launcher.docker_spares import MEMBER_MARK

pytestmark = pytest.mark.timeout(600)
BASE = "robustrl:compose-test"
IMAGE = "robustrl:spares-test"
SITE = "/opt/venv/lib/python3.11/site-packages"
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
_PID = "set -- $(cat /proc/1/task/1/children); echo $1"
"""Shell run in a container: the pid of tini's (PID 1's) child, the member's process."""


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
    """The RobustRL image with this working tree's code (tracked and new files of ``robustrl/``
    and ``services/``, laid out as the installed package is) and the stand-in trainer entry point."""
    try:
        engine.client.images.get(BASE)
    except Exception:  # noqa: BLE001 - absent: the compose test builds it
        pytest.skip(f"image {BASE} not built here (tests/test_compose_stack.py builds it offline)")
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", "robustrl",
                             "services"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    files: dict[str, bytes] = {"Dockerfile": f"FROM {BASE}\nCOPY code/ {SITE}/\n".encode()}
    for rel in listed:
        path = ROOT / rel
        if not path.is_file() or "__pycache__" in rel:
            continue
        name = rel
        if name.startswith("services/"):
            name = "robustrl/" + name.replace("services/request-manager/", "services/request_manager/", 1)
        files[f"code/{name}"] = path.read_bytes()
    files["code/robustrl/services/trainer/__main__.py"] = (HERE / "docker_spare_probe.py").read_bytes()
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
    return str(container.logs().decode(errors="replace"))


def _spares(engine: Engine, instance: str, but: str = "") -> list[Any]:
    """Running containers made as spares by the launcher ``instance``, as the engine lists them,
    but the container ``but`` (a spare's container keeps its labels once it runs a member)."""
    return [c for c in engine.client.containers.list(ignore_removed=True, filters={"label": [f"{LABEL_LAUNCHER}={instance}", LABEL_SPARE]})
            if c.status == "running" and c.id != but]


def _leftovers(engine: Engine, instance: str) -> list[Any]:
    """The containers of the launcher ``instance`` still there (one whose removal is under way
    counts as removed), each then removed."""
    left = [c for c in engine.client.containers.list(all=True, filters={"label": f"{LABEL_LAUNCHER}={instance}"},
                                                      ignore_removed=True) if c.status != "removing"]
    for c in left:
        try:
            c.remove(force=True)
        except docker.errors.APIError as exc:
            if exc.status_code not in (404, 409):  # gone, or its removal already under way
                raise
    return left


def _exec(container: Any, script: str) -> str:
    """The output of ``script`` run in ``container``. Every script here prints something: one
    that exits 0 with no output at all lost its stream in the engine (docker-py #2042, moby
    #27289: suite51's empty pid) and is run again (they only read)."""
    def once() -> str:
        code, out = container.exec_run(["sh", "-c", script])
        assert code == 0, (script, out)
        assert out, f"the engine lost the output of {script!r}"
        return str(out.decode(errors="replace"))
    return eventually(once, timeout=10, interval=0.1, what=f"the output of {script!r}")


def test_a_trainer_starts_in_a_warm_spare_container(engine: Engine) -> None:
    image = _image(engine)
    tag = uuid.uuid4().hex[:8]
    instance = f"spares-{tag}"
    network = engine.client.networks.create(f"rrl-spares-{tag}", internal=True)
    launcher = DockerLauncher(image, network.name, client=engine.client, instance=instance,
                              base_env={"ROBUSTRL_BIND_HOST": "0.0.0.0", "ROBUSTRL_API_TOKEN": "base-token"},
                              spare_restock_delay_s=0.0)
    rank, cold_rank = "j--trainer-e1-r0", "j--trainer-e1-r1"
    try:
        assert launcher.spares_ready() == 0
        launcher.keep_spares(1)
        spare = eventually(lambda: (s := _spares(engine, instance)) and len(s) == 1 and s[0], timeout=60,
                           interval=0.2, what="one spare container")
        assert LABEL_MEMBER not in spare.labels  # not a member: find/adopt never take it for one
        eventually(lambda: launcher.spares_ready() == 1, timeout=180, interval=0.5, what="the spare ready")
        # From the engine: the process in it is the spare, imports done, with no credential.
        pid = int(_exec(spare, _PID))
        assert re.search(rf"spare {pid} ready", _logs(spare)), _logs(spare)
        assert "robustrl.launcher.spare" in _exec(spare, f"tr '\\0' ' ' < /proc/{pid}/cmdline")
        spare_env = _exec(spare, f"tr '\\0' '\\n' < /proc/{pid}/environ")
        assert "ROBUSTRL_API_TOKEN" not in spare_env and "ROBUSTRL_MEMBER_ID" not in spare_env, spare_env
        host_pid = spare.attrs["State"]["Pid"]
        containers_before = {c.id for c in engine.client.containers.list(ignore_removed=True, all=True)}

        env = {"ROBUSTRL_MEMBER_ID": "trainer-e1-r0", "ROBUSTRL_RANK": "0", "ROBUSTRL_TEST_MARKER": tag,
               "ROBUSTRL_TEST_SECRET": "rank-0", "ROBUSTRL_NATS_PASSWORD": "secret"}
        master, port = launcher.rendezvous(MemberSpec("j", rank, "trainer", TRAINER_MODULE, env))
        assert master == spare.name  # rank 0 will run in the spare: the gang meets at its real host name
        spec = MemberSpec("j", rank, "trainer", TRAINER_MODULE, {**env, "MASTER_ADDR": master,
                                                                  "MASTER_PORT": str(port)})
        t0 = time.time()
        launcher.start(spec)
        start_call_s = time.time() - t0
        line = eventually(lambda: re.search(r"member pid=.*", _logs(spare)), timeout=60, interval=0.05,
                          what="the member running in the spare's container").group(0)
        warm_s = float(line.rsplit("at=", 1)[1]) - t0
        # Inside the container: the same process runs the trainer module as the member, with the
        # spec's environment; it binds and advertises the container's own host name.
        assert line.startswith(f"member pid={pid} argv={SITE}/robustrl/services/trainer/__main__.py "
                               f"member=trainer-e1-r0 host={spare.name} "
                               f"bind={spare.name} master={spare.name} marker={tag} handoff_dir=/tmp "
                               f"secret=rank-0 "), line
        assert int(_exec(spare, _PID)) == pid
        assert _exec(spare, "ls /tmp | grep -c '^handoff-' || true").strip() == "0"  # consumed
        # From the engine: no container was created; the spare's container is tracked as the member.
        assert {c.id for c in engine.client.containers.list(ignore_removed=True, all=True)} - containers_before <= {
            c.id for c in _spares(engine, instance)}  # (only a restocked spare)
        assert launcher.state(rank) is MemberState.RUNNING and launcher.was_warm(rank)
        assert launcher.spares_used == 1
        assert launcher.handle(rank) == {"container": spare.id} == launcher.find(rank)
        assert launcher.pid(rank) == host_pid and launcher.host_for(rank) == spare.name
        # A new spare is restocked.
        new = eventually(lambda: _spares(engine, instance, but=spare.id), timeout=60,
                         interval=0.2, what="a spare restocked")
        assert len(new) == 1
        eventually(lambda: launcher.spares_ready() == 1, timeout=180, interval=0.5, what="the new spare ready")
        # A restarted controller's launcher (same instance) adopts the member by its handle, finds
        # it by its id, and takes the waiting spare over (no container is started for it).
        again = DockerLauncher(image, network.name, client=engine.client, instance=instance)
        assert again.find(rank) == {"container": spare.id}
        assert again.adopt("j", rank, "trainer", {"container": spare.id}) is True
        assert again.adopt("j", "j--trainer-e1-r5", "trainer", {"container": new[0].id}) is False  # a spare
        # Its handle never persisted (the controller died right after the hand-off): adopted by its mark.
        third = DockerLauncher(image, network.name, client=engine.client, instance=instance)
        assert third.adopt("j", rank, "trainer", {}) is True and third.handle(rank) == {"container": spare.id}
        # A mark whose hand-off is still there (the controller died before the signal): the spare
        # still waits, so it is neither found nor adopted as the member.
        from robustrl.launcher.docker_spares import handoff_tar

        new[0].put_archive("/tmp", handoff_tar("handoff-999999.json", {}, 0, 0, TRAINER_MODULE, [],
                                               "j--trainer-e1-r6"))
        assert third.find("j--trainer-e1-r6") is None
        assert third.adopt("j", "j--trainer-e1-r6", "trainer", {}) is False
        new[0].exec_run(["rm", "-f", "/tmp/handoff-999999.json", "/tmp/robustrl-member.json"], user="root")
        again.keep_spares(1)
        assert again.spares_ready() == 1 and [s.id for s in _spares(engine, instance, but=spare.id)] == [new[0].id]
        again.keep_spares(0)  # (it lets go of the spare: the launcher under test keeps it)
        assert _spares(engine, instance, but=spare.id) == []
        assert spare.id in {s.id for s in _spares(engine, instance)}  # the member runs on
        eventually(lambda: launcher.spares_ready() == 1, timeout=180, interval=0.5, what="a spare again")
        # The member's exit is reported under its id, once; a spare's exit never.
        launcher.kill(rank)
        exits = eventually(launcher.poll, timeout=30, interval=0.2, what="the exit reported")
        assert [(e.member_id, e.role, e.expected) for e in exits] == [(rank, "trainer", False)]
        for s in _spares(engine, instance, but=spare.id):
            s.kill()
        eventually(lambda: launcher.spares_ready() == 0, timeout=30, interval=0.2, what="the dead spare dropped")
        assert launcher.poll() == []
        # A cold start, for the timing: no spare ready.
        launcher.keep_spares(0)
        t0 = time.time()
        launcher.start(MemberSpec("j", cold_rank, "trainer", TRAINER_MODULE, {**env, "ROBUSTRL_MEMBER_ID": "t-r1"}))
        cold = engine.client.containers.get(container_name(cold_rank))
        line = eventually(lambda: re.search(r"member pid=.*", _logs(cold)), timeout=120, interval=0.05,
                          what="the cold member running").group(0)
        cold_s = float(line.rsplit("at=", 1)[1]) - t0
        assert not launcher.was_warm(cold_rank)
        print(f"member running {warm_s:.2f} s after start() from a spare container (start() took "
              f"{start_call_s:.2f} s), {cold_s:.2f} s after a cold container start")
        launcher.keep_spares(1)
        eventually(lambda: len(_spares(engine, instance, but=spare.id)) == 1, timeout=60, interval=0.2, what="a spare")
    finally:
        launcher.close()
        left = _leftovers(engine, instance)
        network.remove()
    assert [c.name for c in left] == []  # close() removed the spares and the members


def test_containers_removed_while_the_launcher_lists_them_are_left_out_not_an_error(engine: Engine) -> None:
    """CI failure (test above): a dead spare was being removed while ``poll`` listed the
    launcher's containers; the SDK lists, then inspects each listed container, and the removed one
    made the whole ``poll`` fail with NotFound. Here 40 containers of the launcher's instance are
    removed one by one while ``poll`` lists them over and over, on the real engine: every poll
    answers (nothing to report: none is a member), none raises."""
    tag = uuid.uuid4().hex[:8]
    instance = f"race-{tag}"
    # An empty image (no registry): containers are only created, never started.
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = b"FROM scratch\nLABEL robustrl.test=empty\n"
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    buf.seek(0)
    image, _ = engine.client.images.build(fileobj=buf, custom_context=True, tag=f"robustrl:empty-{tag}", rm=True)
    launcher = DockerLauncher(image.id, "none", client=engine.client, instance=instance)
    made = [engine.client.containers.create(image.id, command=["/absent"], network_mode="none",
                                            labels={LABEL_LAUNCHER: instance}) for _ in range(40)]
    removed = threading.Event()

    def remove_all() -> None:
        try:
            for c in made:
                c.remove(force=True)
        finally:
            removed.set()

    remover = threading.Thread(target=remove_all, daemon=True)
    polls = 0
    try:
        assert len(launcher._list(f"{LABEL_LAUNCHER}={instance}")) == 40
        remover.start()
        while not removed.is_set():
            assert launcher.poll() == []
            polls += 1
    finally:
        removed.wait(120)
        _leftovers(engine, instance)
        engine.client.images.remove(image.id, force=True)
    assert polls >= 5, f"only {polls} polls while the containers were removed: the race was barely run"


def test_a_spare_is_taken_only_by_a_member_it_covers() -> None:
    """Pure: a spare container's limits must cover the member's (what ``replica_fits_trainer``
    asks of a borrowed replica): no limit covers any; a limit covers a smaller one, never none;
    device access (GPUs) is fixed when the container is created, so it must be the same."""
    from robustrl.launcher.docker import SpareShape

    none, two = SpareShape(), SpareShape(cpus=2.0, memory_mb=2048)
    assert none.covers(SpareShape(cpus=1.0, memory_mb=512)) and none.covers(none)
    assert two.covers(SpareShape(cpus=2.0, memory_mb=1024))
    assert not two.covers(SpareShape(cpus=3.0)) and not two.covers(SpareShape(memory_mb=1024))
    assert not two.covers(none)
    assert not none.covers(SpareShape(gpus=1)) and not SpareShape(gpus=1).covers(none)
    assert not SpareShape(all_gpus=True).covers(SpareShape(gpus=1))
    assert SpareShape.of(Resources(cpus=1.5, memory_mb=300), all_gpus=False) == SpareShape(1.5, 300, 0, False)


@pytest.mark.heavy  # 106-144 s under the suite's load: bench/heavy.py (the suite keeps the spare container's hand-off above)
def test_a_job_on_the_docker_launcher_replaces_a_crashed_trainer_from_a_spare_container(engine: Engine,
                                                                                       tmp_path: Path) -> None:
    """End to end: servers on the Docker network's gateway, the control plane here with the Docker
    launcher (``recovery.warm_spares: 1``, borrowing off), every member a container of this commit's
    code. The trainer's container is killed; the new rank runs in the spare container (no
    container is created for it), the pool gets a new spare, the job finishes and the auditor
    passes. Judged from the engine and the raw stores."""
    from jobs import kinds, small_job, wait_done, wait_step
    from test_docker_standby import _code_image

    from robustrl.audit.model import AuditOptions
    from robustrl.client import ApiClient
    from robustrl.infra.embedded import EmbeddedInfra
    from robustrl.launcher.docker import LABEL_JOB
    from robustrl.stack import Stack
    from support import audit_sampled, sample_batches

    image = _code_image(engine)
    tag = uuid.uuid4().hex[:8]
    network = engine.client.networks.create(f"rrl-spare-{tag}")
    network.reload()
    gateway = network.attrs["IPAM"]["Config"][0]["Gateway"]
    infra = EmbeddedInfra(tmp_path / "infra", host=gateway)
    stack: Stack | None = None
    instance = f"spare-e2e-{tag}"
    try:
        settings = infra.start()
        stack = Stack(tmp_path / "stack", external=settings, extra_env={
            "ROBUSTRL_LAUNCHER": "docker", "ROBUSTRL_IMAGE": image, "ROBUSTRL_DOCKER_NETWORK": network.name,
            "ROBUSTRL_DOCKER_URL": engine.url, "ROBUSTRL_LAUNCHER_INSTANCE": instance})
        stack.start()
        assert stack.settings
        api = ApiClient(stack.api_url, stack.settings.api_token)
        # Tool calls of 1 s: the job outlasts the spare's restock (10 s after it is taken, then its imports).
        spec = small_job("dockspare", steps=30, trainer={"workers": 1},
                         recovery={"warm_spares": 1, "borrow": "never"}, tools={"latency_s": 1.0},
                         data={"tasks": ["lookup"]},
                         detector={"trainer_idle_s": 20.0, "rollout_idle_s": 20.0, "silence_s": 20.0,
                                   "probe_timeout_s": 5.0, "metrics_interval_s": 0.5})
        jid = api.submit(spec)["job_id"]
        sampler = sample_batches(stack.settings.redis_url, jid)

        def spares() -> list[Any]:
            return engine.client.containers.list(ignore_removed=True, filters={"label": [f"{LABEL_LAUNCHER}={instance}", LABEL_SPARE]})

        eventually(lambda: any("ready" in c.logs().decode(errors="replace") for c in spares()), timeout=240,
                   interval=0.5, what="a warm spare container ready")
        waiting = {c.id for c in spares()}
        wait_step(api, jid, 2, timeout=300)
        api.fault(jid, kind="crash", role="trainer", member=0)  # docker kill of the rank's container
        recovered = eventually(lambda: [d for d in kinds(api.events(jid), "recovered") if d["kind"] == "trainer"],
                               timeout=300, interval=0.5, what="the trainer recovery")
        by_name = {c.name for c in engine.client.containers.list(ignore_removed=True, all=True, filters={"label": f"{LABEL_JOB}={jid}"})}
        assert not [n for n in by_name if "trainer-e2" in n], sorted(by_name)  # no container created for it
        # The spare container that was waiting runs the new rank now (its member mark names it).
        runs = {c.id: c.exec_run(["cat", f"/tmp/{MEMBER_MARK}"]).output.decode(errors="replace")
                for c in engine.client.containers.list(ignore_removed=True, filters={"id": list(waiting)})}
        assert any("trainer-e2-r0" in out for out in runs.values()), runs
        # The pool is restocked: a spare waits again, in a container of its own.
        try:
            eventually(lambda: [c for c in spares() if c.id not in waiting
                                and "ready" in c.logs().decode(errors="replace")], timeout=120, interval=0.5,
                       what="a new spare container ready")
        except AssertionError:
            for c in engine.client.containers.list(ignore_removed=True, all=True, filters={"label": f"{LABEL_LAUNCHER}={instance}"}):
                print(c.name, c.status, c.labels, c.logs().decode(errors="replace")[-1500:])
            raise
        wait_done(api, jid, timeout=400)
        events = api.events(jid)
        api.close()
        audit_sampled(stack.settings, jid, sampler, AuditOptions(redis_bound=False))
    finally:
        if stack is not None:
            stack.stop()
        infra.stop()
        _leftovers(engine, instance)  # what the controller's launcher left (it removes its own on close)
        network.remove()
    assert recovered[0]["sources"] == ["spare"], recovered
    started = {d["member_id"]: d for d in kinds(events, "member_started")}
    assert started["trainer-e2-r0"]["source"] == "spare", started["trainer-e2-r0"]
