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

Skips, with the reason, without dockerd, root, the docker SDK or the built image.
"""

from __future__ import annotations

import io
import re
import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from docker_engine import Engine, Unavailable
from support import eventually

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
