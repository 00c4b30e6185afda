"""``robustrl k8s render``: manifests from the job's member specs, checked against the Kubernetes
OpenAPI schema (kubernetes-validate, strict: an unknown or misplaced field is an error). No
Kubernetes cluster runs here: these tests check what is rendered, not what a cluster would do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from robustrl.cli import app
from robustrl.config import Settings, reference_job
from robustrl.errors import ConfigError
from robustrl.k8s import GPU_RESOURCE, HEALTH_PORT, LABEL_RANK, render_job

kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed (pip install -e '.[test]')")
pytestmark = pytest.mark.timeout(60)


def validate(docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        kv.validate(doc, kv.latest_version(), strict=True)


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def container(pod_spec: dict[str, Any]) -> dict[str, Any]:
    (c,) = pod_spec["containers"]
    return c


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    names = [e["name"] for e in c["env"]]
    assert len(names) == len(set(names)), f"duplicate env names: {names}"
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def test_a_job_renders_as_schema_valid_pods_deployment_and_services() -> None:
    spec = reference_job(trainer={"workers": 3, "resources": {"cpus": 2.5, "gpus": 1, "memory_mb": 8192},
                                  "placement": {"strategy": "STRICT_SPREAD", "node_labels": {"pool": "train"}}},
                         rollout={"replicas": 4, "resources": {"cpus": 1},
                                  "placement": {"anti_affinity": "required", "node_labels": {"pool": "gen"}}})
    settings = Settings(nats_url="nats://nats.rl.svc:4222", redis_url="redis://redis.rl.svc:6379/0",
                        s3_endpoint="minio.rl.svc:9000", s3_access_key="AKIA-SECRET", s3_secret_key="very-secret",
                        api_token="api-secret")
    docs = render_job(spec, image="registry/robustrl:0.1", namespace="rl", settings=settings, job_id="ref-1")
    validate(docs)
    assert "secret" not in yaml.safe_dump_all(docs).lower().replace("secretref", "")  # no secret value rendered
    pods, services, (deploy,) = by_kind(docs, "Pod"), by_kind(docs, "Service"), by_kind(docs, "Deployment")
    # The gang: one pod per rank, never restarted by Kubernetes; rank r's env names rank r.
    assert [p["metadata"]["name"] for p in pods] == [f"ref-1-trainer-e1-r{r}" for r in range(3)]
    rdzv = next(s for s in services if s["metadata"]["name"] == "ref-1-trainer-e1-rdzv")
    assert rdzv["spec"]["selector"][LABEL_RANK] == "0" and rdzv["spec"]["clusterIP"] == "None"
    for rank, pod in enumerate(pods):
        assert pod["spec"]["restartPolicy"] == "Never"
        c = container(pod["spec"])
        env = env_of(c)
        assert env["ROBUSTRL_RANK"] == str(rank) and env["ROBUSTRL_WORLD_SIZE"] == "3"
        assert env["ROBUSTRL_MEMBER_ID"] == f"trainer-e{1}-r{rank}" and env["ROBUSTRL_JOB_ID"] == "ref-1"
        assert env["MASTER_ADDR"] == "ref-1-trainer-e1-rdzv.rl.svc"  # rank 0's Service
        assert env["ROBUSTRL_BIND_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["ROBUSTRL_NATS_URL"] == "nats://nats.rl.svc:4222"
        assert c["command"] == ["python", "-m", "robustrl.services.trainer"]
        assert c["resources"]["requests"] == c["resources"]["limits"] == {
            "cpu": "2500m", "memory": "8192Mi", GPU_RESOURCE: "1"}
        for probe in ("livenessProbe", "readinessProbe"):
            assert c[probe]["httpGet"] == {"path": "/healthz", "port": HEALTH_PORT}
        assert pod["spec"]["nodeSelector"] == {"pool": "train"}
        # STRICT_SPREAD: no two ranks of the gang on one node.
        anti = pod["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert anti[0]["topologyKey"] == "kubernetes.io/hostname"
    # The rollout pool: a Deployment, replicas on distinct nodes, member id = pod name.
    assert deploy["spec"]["replicas"] == 4
    tmpl = deploy["spec"]["template"]
    assert deploy["spec"]["selector"]["matchLabels"] == tmpl["metadata"]["labels"]
    c = container(tmpl["spec"])
    assert env_of(c)["ROBUSTRL_MEMBER_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert c["resources"]["limits"] == {"cpu": "1000m"}
    assert "requiredDuringSchedulingIgnoredDuringExecution" in tmpl["spec"]["affinity"]["podAntiAffinity"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/healthz"


def test_pack_becomes_preferred_affinity_and_defaults_reserve_nothing() -> None:
    docs = render_job(reference_job(), image="robustrl:latest")
    validate(docs)
    pod = by_kind(docs, "Pod")[0]
    assert "podAffinity" in pod["spec"]["affinity"]
    assert "preferredDuringSchedulingIgnoredDuringExecution" in pod["spec"]["affinity"]["podAffinity"]
    assert "resources" not in container(pod["spec"]) and "nodeSelector" not in pod["spec"]
    assert "affinity" not in by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]


def test_the_schema_check_is_not_vacuous() -> None:
    """A manifest the API server would refuse fails validation (so a passing render means something)."""
    docs = render_job(reference_job(), image="robustrl:latest")
    pod = by_kind(docs, "Pod")[0]
    broken = {**pod, "spec": {**pod["spec"], "containers": [{**container(pod["spec"]), "imagePullPolicy": 3}]}}
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, kv.latest_version(), strict=True)
    misplaced = {**pod, "spec": {**pod["spec"], "replicas": 2}}
    with pytest.raises(kv.ValidationError):
        kv.validate(misplaced, kv.latest_version(), strict=True)


def test_what_kubernetes_cannot_express_is_refused_with_the_field_named() -> None:
    with pytest.raises(ConfigError) as err:
        render_job(reference_job(trainer={"resources": {"gpus": 0.5}}), image="robustrl:latest")
    assert err.value.fields["field"] == "resources.gpus"
    with pytest.raises(ConfigError) as err:
        render_job(reference_job(), image="robustrl:latest", namespace="Not_A_Label")
    assert err.value.fields["field"] == "namespace"
    with pytest.raises(ConfigError) as err:
        render_job(reference_job(), image="")
    assert err.value.fields["field"] == "image"


def test_cli_renders_a_spec_file_and_names_a_bad_field(tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({"name": "Demo_Job", "steps": 3, "rollout": {"replicas": 3}}))
    runner = CliRunner()
    res = runner.invoke(app, ["k8s", "render", str(spec), "--image", "robustrl:0.1", "--namespace", "rl"])
    assert res.exit_code == 0, res.output
    docs = list(yaml.safe_load_all(res.output))
    validate(docs)
    assert {d["kind"] for d in docs} == {"Pod", "Service", "Deployment"}
    assert all(d["metadata"]["namespace"] == "rl" for d in docs)
    assert by_kind(docs, "Deployment")[0]["metadata"]["name"] == "demo-job-rollout"  # a DNS-1123 name
    out = tmp_path / "m.yaml"
    assert runner.invoke(app, ["k8s", "render", str(spec), "--out", str(out)]).exit_code == 0
    assert list(yaml.safe_load_all(out.read_text())) == list(yaml.safe_load_all(
        runner.invoke(app, ["k8s", "render", str(spec)]).output))
    spec.write_text(yaml.safe_dump({"trainer": {"placement": {"strategy": "EVERYWHERE"}}}))
    res = runner.invoke(app, ["k8s", "render", str(spec)])
    assert res.exit_code == 2 and "trainer.placement.strategy" in res.output
