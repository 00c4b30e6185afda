"""Which interpreter or image runs a rollout member (robustrl.model.engines.envs): the local
launcher picks .venv-vllm's Python for ``rollout.engine: vllm`` members, the Docker launcher the
vLLM image; every other member runs from the launcher's own interpreter or image."""

from __future__ import annotations

import sys

import pytest
from test_docker_launcher import FakeClient

from robustrl.errors import ConfigError
from robustrl.launcher.base import MemberSpec
from robustrl.launcher.docker import DockerLauncher
from robustrl.model.engines.envs import DEFAULT_VLLM_IMAGE, ENGINE_ENV, VLLM_IMAGE_ENV, image, interpreter


def _spec(member: str, role: str, engine: str | None) -> MemberSpec:
    env = {"ROBUSTRL_MEMBER_ID": member, "ROBUSTRL_ROLE": role} | ({ENGINE_ENV: engine} if engine else {})
    return MemberSpec(job_id="job1", member_id=member, role=role, module=f"robustrl.services.{role}", env=env)


def test_image_and_interpreter_follow_the_engine(tmp_path) -> None:
    assert image({ENGINE_ENV: "vllm"}, "robustrl:x", environ={}) == DEFAULT_VLLM_IMAGE == "robustrl-vllm:latest"
    assert image({ENGINE_ENV: "vllm"}, "robustrl:x", environ={VLLM_IMAGE_ENV: "reg/rr-vllm:1"}) == "reg/rr-vllm:1"
    assert image({ENGINE_ENV: "torch"}, "robustrl:x", environ={VLLM_IMAGE_ENV: "reg/rr-vllm:1"}) == "robustrl:x"
    assert image({}, "robustrl:x") == "robustrl:x"
    py = tmp_path / "python"
    py.write_text("")
    assert interpreter({ENGINE_ENV: "vllm"}, environ={"ROBUSTRL_VLLM_PYTHON": str(py)}) == str(py)
    assert interpreter({ENGINE_ENV: "torch"}, environ={"ROBUSTRL_VLLM_PYTHON": str(py)}) == sys.executable
    with pytest.raises(ConfigError):
        interpreter({ENGINE_ENV: "vllm"}, environ={"ROBUSTRL_VLLM_PYTHON": str(tmp_path / "none")})


def test_docker_launcher_runs_vllm_replicas_from_the_vllm_image(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VLLM_IMAGE_ENV, "robustrl-vllm:test")
    fake = FakeClient()
    launcher = DockerLauncher("robustrl:test", "net", client=fake)
    launcher.start(_spec("rollout-0", "rollout", "vllm"))
    launcher.start(_spec("rollout-1", "rollout", "torch"))
    launcher.start(_spec("trainer-0", "trainer", None))
    images = {kw["name"]: img for op, img, kw in fake.calls if op == "run"}
    assert images == {"rr-rollout-0": "robustrl-vllm:test", "rr-rollout-1": "robustrl:test",
                      "rr-trainer-0": "robustrl:test"}
    # the engine travels in the member's environment too (the replica builds its engine from the spec)
    run0 = next(kw for op, _, kw in fake.calls if op == "run" and kw["name"] == "rr-rollout-0")
    assert run0["environment"][ENGINE_ENV] == "vllm"
