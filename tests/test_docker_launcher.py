"""Docker launcher: launcher calls map onto Docker API calls, and a missing engine fails fast.

The mapping is pure bookkeeping, so a small hand-written fake of the SDK's client stands in for
the engine (no dockerd runs here). The fail-fast tests use real unix sockets and the real SDK.
"""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from robustrl.errors import LaunchError
from robustrl.launcher.base import MemberSpec, MemberState
from robustrl.launcher.docker import LABEL_LAUNCHER, LABEL_MEMBER, DockerLauncher, container_name


class FakeAPIError(Exception):
    def __init__(self, status_code: int) -> None:
        super().__init__(f"HTTP {status_code}")
        self.status_code = status_code


class FakeContainer:
    def __init__(self, client: FakeClient, cid: str, name: str, labels: dict[str, str]) -> None:
        self.client, self.id, self.name, self.labels = client, cid, name, labels
        self.status = "running"
        self.attrs: dict[str, Any] = {"State": {"Pid": 4242, "ExitCode": 0}}

    def _call(self, what: str, **kwargs: Any) -> None:
        self.client.calls.append((what, self.name, kwargs))
        if self.name not in self.client.by_name:
            raise FakeAPIError(404)

    def stop(self, timeout: int) -> None:
        self._call("stop", timeout=timeout)
        self.exit(143)

    def kill(self) -> None:
        self._call("kill")
        if self.status != "running":
            raise FakeAPIError(409)
        self.exit(137)

    def pause(self) -> None:
        self._call("pause")
        self.status = "paused"

    def unpause(self) -> None:
        self._call("unpause")
        self.status = "running"

    def reload(self) -> None:
        self._call("reload")

    def remove(self, force: bool = False) -> None:
        self._call("remove", force=force)
        del self.client.by_name[self.name]

    def logs(self, tail: int) -> bytes:
        return b"hello\n"

    def exit(self, code: int) -> None:
        """What the engine does when the process ends (crash or signal)."""
        self.status = "exited"
        self.attrs["State"] = {"Pid": 0, "ExitCode": code}


class FakeContainers:
    def __init__(self, client: FakeClient) -> None:
        self.client = client

    def run(self, image: str, **kwargs: Any) -> FakeContainer:
        self.client.calls.append(("run", image, kwargs))
        if image == "missing:latest":
            raise FakeAPIError(404)
        container = FakeContainer(self.client, f"c{len(self.client.calls)}", kwargs["name"], kwargs["labels"])
        self.client.by_name[kwargs["name"]] = container
        return container

    def get(self, name: str) -> FakeContainer:
        self.client.calls.append(("get", name, {}))
        if name not in self.client.by_name:
            raise FakeAPIError(404)
        return self.client.by_name[name]

    def list(self, all: bool, filters: dict[str, Any], ignore_removed: bool = False) -> list[FakeContainer]:
        """As the engine filters: every label given (``key=value``, or ``key`` present)."""
        wanted = filters["label"] if isinstance(filters["label"], list) else [filters["label"]]
        pairs = [(w.split("=", 1) + [None])[:2] for w in wanted]
        return [c for c in self.client.by_name.values()
                if not any(k not in c.labels or (v is not None and c.labels[k] != v) for k, v in pairs)]


class FakeClient:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, Any]]] = []
        self.by_name: dict[str, FakeContainer] = {}
        self.containers = FakeContainers(self)


def _spec(member: str = "rollout-0", role: str = "rollout") -> MemberSpec:
    return MemberSpec(job_id="job1", member_id=member, role=role, module=f"robustrl.services.{role}",
                      env={"ROBUSTRL_MEMBER_ID": member, "ROBUSTRL_ROLE": role}, args=("--x", "1"))


@pytest.fixture
def fake() -> FakeClient:
    return FakeClient()


@pytest.fixture
def launcher(fake: FakeClient) -> DockerLauncher:
    return DockerLauncher("robustrl:test", "robustrl", client=fake, labels={"com.example": "yes"},
                          base_env={"ROBUSTRL_NATS_URL": "nats://nats:4222", "ROBUSTRL_ROLE": "base"})


def test_start_maps_to_containers_run(launcher: DockerLauncher, fake: FakeClient) -> None:
    launcher.start(_spec())
    run = [c for c in fake.calls if c[0] == "run"]
    assert len(run) == 1
    _, image, kw = run[0]
    assert image == "robustrl:test"
    assert kw["command"] == ["python", "-m", "robustrl.services.rollout", "--x", "1"]
    assert kw["name"] == kw["hostname"] == container_name("rollout-0") == "rr-rollout-0"
    assert kw["detach"] is True and kw["network"] == "robustrl"
    # spec env wins over the base env, and both reach the container; with no bind host given,
    # the member binds and advertises its container name; its health endpoint is on and the
    # container's health check asks it; a role hand-off (relabel) is written to its /tmp.
    assert kw["environment"] == {"ROBUSTRL_NATS_URL": "nats://nats:4222", "ROBUSTRL_ROLE": "rollout",
                                 "ROBUSTRL_MEMBER_ID": "rollout-0", "ROBUSTRL_BIND_HOST": "rr-rollout-0",
                                 "ROBUSTRL_HEALTH_PORT": "8081", "ROBUSTRL_HANDOFF_DIR": "/tmp"}
    assert "127.0.0.1:8081/healthz" in " ".join(kw["healthcheck"]["test"])
    assert kw["healthcheck"]["interval"] == 5_000_000_000  # nanoseconds, as the Engine API wants
    assert kw["labels"]["robustrl.job"] == "job1" and kw["labels"][LABEL_MEMBER] == "rollout-0"
    assert kw["labels"]["com.example"] == "yes" and LABEL_LAUNCHER in kw["labels"]
    assert "device_requests" not in kw
    assert launcher.state("rollout-0") is MemberState.RUNNING
    assert launcher.pid("rollout-0") == 4242
    assert launcher.state("never-started") is None and launcher.pid("never-started") is None
    with pytest.raises(LaunchError, match="already running"):
        launcher.start(_spec())


def test_restart_removes_stale_container(launcher: DockerLauncher, fake: FakeClient) -> None:
    launcher.start(_spec())
    fake.by_name["rr-rollout-0"].exit(1)
    assert [(e.member_id, e.returncode, e.expected) for e in launcher.poll()] == [("rollout-0", 1, False)]
    launcher.start(_spec())  # same member again: the exited container is removed first
    assert ("remove", "rr-rollout-0", {"force": True}) in fake.calls
    assert launcher.state("rollout-0") is MemberState.RUNNING
    assert launcher.poll() == []


def test_stop_kill_pause_map_to_container_calls(launcher: DockerLauncher, fake: FakeClient) -> None:
    for i in range(3):
        launcher.start(_spec(f"rollout-{i}"))
    launcher.suspend("rollout-0")
    assert launcher.state("rollout-0") is MemberState.SUSPENDED
    launcher.resume("rollout-0")
    assert launcher.state("rollout-0") is MemberState.RUNNING
    launcher.stop("rollout-0", grace_s=1.5)
    launcher.kill("rollout-1")
    ops = [(op, name, kw) for op, name, kw in fake.calls if op in {"pause", "unpause", "stop", "kill"}]
    assert ops == [("pause", "rr-rollout-0", {}), ("unpause", "rr-rollout-0", {}),
                   ("stop", "rr-rollout-0", {"timeout": 2}),  # grace rounded up, never cut
                   ("kill", "rr-rollout-1", {})]
    assert launcher.state("rollout-0") is MemberState.STOPPED
    assert launcher.state("rollout-1") is MemberState.EXITED
    exits = sorted((e.member_id, e.returncode, e.expected) for e in launcher.poll())
    assert exits == [("rollout-0", 143, True), ("rollout-1", 137, False)]
    assert launcher.poll() == []  # each exit reported once
    assert launcher.running() == ["rollout-2"] and launcher.running("other-job") == []
    # Repeat calls on stopped or unknown members are harmless (no API call at all).
    before = len(fake.calls)
    launcher.stop("rollout-0")
    launcher.suspend("nobody")
    launcher.resume("nobody")
    assert len(fake.calls) == before
    # A member believed dead is killed again all the same (it may be running after all);
    # the engine's "not running" answer is not an error and reports nothing new.
    launcher.kill("rollout-1")
    assert [op for op, name, _ in fake.calls[before:]] == ["kill"]
    assert launcher.poll() == []


def test_crash_and_external_removal_are_reported(launcher: DockerLauncher, fake: FakeClient) -> None:
    launcher.start(_spec("trainer-0", "trainer"))
    launcher.start(_spec("trainer-1", "trainer"))
    assert launcher.poll() == []
    fake.by_name["rr-trainer-0"].exit(3)
    del fake.by_name["rr-trainer-1"]  # docker rm -f behind the launcher's back
    exits = sorted((e.member_id, e.role, e.returncode, e.expected) for e in launcher.poll())
    assert exits == [("trainer-0", "trainer", 3, False), ("trainer-1", "trainer", None, False)]
    assert launcher.state("trainer-0") is MemberState.EXITED
    # Killing a container that exited meanwhile (409) or vanished (404) is not an error.
    launcher2 = DockerLauncher("robustrl:test", "robustrl", client=fake)
    launcher2.start(_spec("rollout-9"))
    fake.by_name["rr-rollout-9"].status = "exited"
    launcher2.kill("rollout-9")


def test_member_started_during_a_listing_is_not_reported(launcher: DockerLauncher,
                                                          fake: FakeClient,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The controller polls on one thread while it starts members on another: a container
    created after the engine answered the listing is absent from it, and must not be taken
    for one removed behind the launcher's back (found against a real engine)."""
    launcher.start(_spec("trainer-0", "trainer"))
    real_list = fake.containers.list

    def list_then_start(all: bool, filters: dict[str, str], ignore_removed: bool = False) -> list[Any]:
        answer = real_list(all=all, filters=filters, ignore_removed=ignore_removed)
        launcher.start(_spec("trainer-1", "trainer"))  # lands between the listing and the check
        return answer

    monkeypatch.setattr(fake.containers, "list", list_then_start)
    assert launcher.poll() == []
    monkeypatch.setattr(fake.containers, "list", real_list)
    assert launcher.poll() == []
    assert launcher.state("trainer-1") is MemberState.RUNNING


def test_stop_many_and_close(launcher: DockerLauncher, fake: FakeClient) -> None:
    for i in range(4):
        launcher.start(_spec(f"rollout-{i}"))
    launcher.stop_many(["rollout-0", "rollout-1", "unknown"], grace_s=0)
    assert {name for op, name, _ in fake.calls if op == "stop"} == {"rr-rollout-0", "rr-rollout-1"}
    launcher.close()
    assert fake.by_name == {}
    assert {name for op, name, _ in fake.calls if op == "stop"} == {f"rr-rollout-{i}" for i in range(4)}


def test_host_for_names_the_container_before_and_after_start(launcher: DockerLauncher,
                                                             fake: FakeClient) -> None:
    # The controller's launcher keys are "<job>--<member>"; it asks for rank 0's host first.
    key = "reference-1a2b3c4d--trainer-e1-r0"
    master = launcher.host_for(key)
    assert master == "rr-reference-1a2b3c4d--trainer-e1-r0"
    assert fake.calls == []  # a pure naming function: no engine call, works before start
    launcher.start(MemberSpec("reference-1a2b3c4d", key, "trainer", "robustrl.services.trainer",
                              env={"MASTER_ADDR": master}))
    _, _, kw = fake.calls[-1]
    assert kw["name"] == kw["hostname"] == master  # what the peers dial is what the engine named
    assert launcher.host_for(key) == master  # stable across incarnations and calls
    assert launcher.host_for("reference-1a2b3c4d--trainer-e1-r1") != master


def test_long_member_ids_get_distinct_dns_safe_names() -> None:
    job = "j" * 64 + "-1a2b3c4d"  # the longest job id a spec name allows
    a, b = container_name(f"{job}--trainer-e1-r0"), container_name(f"{job}--trainer-e1-r1")
    assert a != b
    for name in (a, b):
        assert len(name) <= 63 and re.fullmatch(r"[a-zA-Z0-9][a-zA-Z0-9_.-]*[a-zA-Z0-9]", name), name
    assert container_name("odd id/with:chars") == "rr-odd-id-with-chars"


@pytest.mark.parametrize(("given", "expected"), [
    (None, "rr-rollout-0"), ("0.0.0.0", "rr-rollout-0"), ("127.0.0.1", "rr-rollout-0"),
    ("10.1.2.3", "10.1.2.3"),  # an address the operator chose on purpose is kept
])
def test_bind_host_is_routable_from_other_containers(fake: FakeClient, given: str | None,
                                                     expected: str) -> None:
    env = {} if given is None else {"ROBUSTRL_BIND_HOST": given}
    DockerLauncher("robustrl:test", "net", client=fake).start(
        MemberSpec("job1", "rollout-0", "rollout", "robustrl.services.rollout", env=env))
    assert fake.calls[-1][2]["environment"]["ROBUSTRL_BIND_HOST"] == expected


def test_gpu_roles_and_errors(fake: FakeClient) -> None:
    pytest.importorskip("docker")
    launcher = DockerLauncher("robustrl:test", "net", client=fake, gpu_roles={"trainer"},
                              run_kwargs={"shm_size": "1g"})
    launcher.start(_spec("trainer-0", "trainer"))
    _, _, kw = fake.calls[-1]
    assert kw["device_requests"][0]["Count"] == -1 and kw["shm_size"] == "1g"
    missing = DockerLauncher("missing:latest", "net", client=fake)
    with pytest.raises(LaunchError, match="image missing:latest not found"):
        missing.start(_spec())
    assert missing.state("rollout-0") is None


def test_missing_socket_fails_fast_with_guidance(tmp_path: Path) -> None:
    bogus = tmp_path / "no-such-docker.sock"
    started = time.monotonic()
    with pytest.raises(LaunchError) as info:
        DockerLauncher("robustrl:test", "robustrl", docker_url=f"unix://{bogus}")
    assert time.monotonic() - started < 1.0
    message = str(info.value)
    assert str(bogus) in message and "/var/run/docker.sock" in message and "Docker engine" in message


def test_dead_or_silent_engine_fails_within_timeout(tmp_path: Path) -> None:
    pytest.importorskip("docker")
    # A socket file nobody listens on: connection refused at once.
    refused = tmp_path / "refused.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(refused))
    # A socket that accepts but never answers: only the request timeout can end the wait.
    silent_path = tmp_path / "silent.sock"
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.bind(str(silent_path))
    silent.listen(8)
    try:
        for path in (refused, silent_path):
            started = time.monotonic()
            with pytest.raises(LaunchError, match="cannot reach the Docker engine at unix://"):
                DockerLauncher("robustrl:test", "robustrl", docker_url=f"unix://{path}", timeout_s=0.5)
            assert time.monotonic() - started < 5.0, f"{path.name} took too long"
    finally:
        dead.close()
        silent.close()


def test_a_new_launcher_with_the_same_instance_adopts_running_containers(fake: FakeClient) -> None:
    """A restarted controller re-attaches to its containers by label; it never adopts another
    launcher's container, an ended one, or a newer incarnation under the same name."""
    first = DockerLauncher("robustrl:test", "robustrl", client=fake, instance="ctl")
    first.start(_spec("rollout-0"))
    first.start(_spec("rollout-1"))
    first.start(_spec("trainer-0", "trainer"))
    handles = {m: first.handle(m) for m in ("rollout-0", "rollout-1", "trainer-0")}
    fake.by_name["rr-rollout-1"].exit(137)  # died while no controller watched

    second = DockerLauncher("robustrl:test", "robustrl", client=fake, instance="ctl")
    assert second.adopt("job1", "rollout-0", "rollout", handles["rollout-0"]) is True
    assert second.adopt("job1", "rollout-1", "rollout", handles["rollout-1"]) is False
    assert second.adopt("job1", "trainer-0", "trainer", {"container": "some-other-id"}) is False
    assert second.adopt("job2", "rollout-0", "rollout", handles["rollout-0"]) is False  # another job's
    other = DockerLauncher("robustrl:test", "robustrl", client=fake, instance="someone-else")
    assert other.adopt("job1", "rollout-0", "rollout", handles["rollout-0"]) is False
    assert second.running() == ["rollout-0"] and second.log_tail("rollout-0") == "hello"
    # an adopted member is polled, killed and reported like one started here
    second.kill("rollout-0", expected=False)
    assert [(e.member_id, e.returncode, e.expected) for e in second.poll()] == [("rollout-0", 137, False)]


def test_find_returns_the_handle_of_a_container_whose_handle_was_never_persisted(fake: FakeClient) -> None:
    """The controller died between ``containers.run`` and persisting the handle: the next leader's
    launcher (same instance) finds the container by its labels and gets the handle ``handle``
    gives, which ``adopt`` accepts; never another instance's container, nor an ended one."""
    first = DockerLauncher("robustrl:test", "robustrl", client=fake, instance="ctl")
    first.start(_spec("rollout-1-i1"))
    first.start(_spec("rollout-2-i1"))
    fake.by_name["rr-rollout-2-i1"].exit(137)
    DockerLauncher("robustrl:test", "robustrl", client=fake, instance="other").start(_spec("rollout-3-i1"))

    second = DockerLauncher("robustrl:test", "robustrl", client=fake, instance="ctl")
    handle = second.find("rollout-1-i1")
    assert handle == first.handle("rollout-1-i1") == {"container": fake.by_name["rr-rollout-1-i1"].id}
    assert second.adopt("job1", "rollout-1-i1", "rollout", handle) is True
    assert second.find("rollout-2-i1") is None  # ended
    assert second.find("rollout-3-i1") is None  # another launcher instance's
    assert second.find("rollout-9-i0") is None  # never started
