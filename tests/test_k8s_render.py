"""``robustrl k8s render``: manifests from the job's member specs, checked against the Kubernetes
OpenAPI schema (kubernetes-validate, strict: an unknown or misplaced field is an error). No
Kubernetes cluster runs here: these tests check what is rendered, not what a cluster would do. The
security properties are read from the rendered documents (every pod template, every container),
and the NetworkPolicies are judged by a small evaluator of their semantics here (``allowed``), not
by asking the renderer what it meant; no network plugin enforces them here."""

from __future__ import annotations

import ipaddress
import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from robustrl.cli import app
from robustrl.config import Settings, reference_job
from robustrl.errors import ConfigError
from robustrl.k8s import GPU_RESOURCE, HEALTH_PORT, LABEL_GANG, LABEL_JOB, LABEL_RANK, render_job
from robustrl.subjects import token

ROOT = Path(__file__).resolve().parents[1]

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
    # The rollout pool: a Deployment, replicas on distinct nodes, a member id made per container start
    # from the pod name (test_each_start_of_a_rollout_container_gets_a_member_id_of_its_own).
    assert deploy["spec"]["replicas"] == 4
    tmpl = deploy["spec"]["template"]
    assert deploy["spec"]["selector"]["matchLabels"] == tmpl["metadata"]["labels"]
    c = container(tmpl["spec"])
    assert "ROBUSTRL_MEMBER_ID" not in env_of(c)
    assert env_of(c)["ROBUSTRL_POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
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
    assert {d["kind"] for d in docs} == {"Pod", "Service", "Deployment", "NetworkPolicy"}
    assert all(d["metadata"]["namespace"] == "rl" for d in docs)
    assert by_kind(docs, "Deployment")[0]["metadata"]["name"] == "demo-job-rollout"  # a DNS-1123 name
    out = tmp_path / "m.yaml"
    assert runner.invoke(app, ["k8s", "render", str(spec), "--out", str(out)]).exit_code == 0
    assert list(yaml.safe_load_all(out.read_text())) == list(yaml.safe_load_all(
        runner.invoke(app, ["k8s", "render", str(spec)]).output))
    spec.write_text(yaml.safe_dump({"trainer": {"placement": {"strategy": "EVERYWHERE"}}}))
    res = runner.invoke(app, ["k8s", "render", str(spec)])
    assert res.exit_code == 2 and "trainer.placement.strategy" in res.output



# --- least privilege: pod and container security ---------------------------------------------

def pod_specs(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(name, pod spec) of every pod the documents would create: Pods and workload templates."""
    out = [(d["metadata"]["name"], d["spec"]) for d in by_kind(docs, "Pod")]
    out += [(d["metadata"]["name"], d["spec"]["template"]["spec"]) for d in docs
            if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet")]
    return out


def image_user(dockerfile: Path) -> tuple[int, int]:
    """The uid and gid the image's ``useradd`` / ``groupadd`` give its user."""
    text = dockerfile.read_text()
    uid, gid = re.search(r"useradd .*--uid (\d+)", text), re.search(r"groupadd .*--gid (\d+)", text)
    assert uid and gid, f"{dockerfile.name} defines no fixed uid/gid"
    return int(uid.group(1)), int(gid.group(1))


def test_every_member_runs_unprivileged_as_the_images_user_with_a_read_only_root() -> None:
    spec = reference_job(trainer={"workers": 2, "resources": {"gpus": 1}}, rollout={"replicas": 3})
    docs = render_job(spec, image="robustrl:latest", namespace="rl")
    validate(docs)
    users = {image_user(ROOT / name) for name in ("Dockerfile", "Dockerfile.vllm")}
    assert len(users) == 1, f"the images disagree on their user: {users}"
    ((uid, gid),) = users
    specs = pod_specs(docs)
    assert len(specs) == 3  # two ranks and the rollout template: nothing is left unchecked
    for name, pod in specs:
        assert pod["automountServiceAccountToken"] is False, name
        assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), name
        sc = pod["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert (sc["runAsUser"], sc["runAsGroup"], sc["fsGroup"]) == (uid, gid, gid), name
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        assert all(set(v) == {"name", "emptyDir"} for v in volumes.values()), f"{name}: only emptyDirs"
        for c in [*pod["containers"], *pod.get("initContainers", [])]:
            csc = c["securityContext"]
            assert csc["allowPrivilegeEscalation"] is False and csc.get("privileged") is not True, name
            assert csc["capabilities"]["drop"] == ["ALL"] and not csc["capabilities"].get("add"), name
            assert csc["readOnlyRootFilesystem"] is True, name
            assert csc.get("runAsUser", uid) != 0 and csc.get("runAsNonRoot", True) is True, name
            # Writable: /tmp and HOME (caches), each an emptyDir of the pod, and nothing else.
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert set(mounts) == {"/tmp", env_of(c)["HOME"]}, name
            assert all(volumes[v] for v in mounts.values())
            assert not any(m.get("readOnly") for m in c["volumeMounts"])


# --- NetworkPolicies, evaluated from outside the renderer ------------------------------------

NS_NAME = "kubernetes.io/metadata.name"  # the label every namespace carries (Kubernetes >= 1.22)


@dataclass(frozen=True)
class Peer:
    """One end of a connection as a NetworkPolicy sees it: a pod (namespace and labels, and an IP)
    or, with no namespace, an address outside every pod network."""

    namespace: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    ip: str = "10.244.9.9"


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A LabelSelector's verdict (an empty selector selects everything)."""
    assert set(selector) <= {"matchLabels", "matchExpressions"}, selector
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        has, value, values = e["key"] in labels, labels.get(e["key"]), e.get("values", [])
        ok = {"In": has and value in values, "NotIn": not has or value not in values,
              "Exists": has, "DoesNotExist": not has}[e["operator"]]
        if not ok:
            return False
    return True


def peer_matches(rule_peer: Mapping[str, Any], policy_ns: str, other: Peer) -> bool:
    if "ipBlock" in rule_peer:
        block = rule_peer["ipBlock"]
        addr = ipaddress.ip_address(other.ip)
        return (addr in ipaddress.ip_network(block["cidr"])
                and not any(addr in ipaddress.ip_network(x) for x in block.get("except", [])))
    if other.namespace is None:  # pod and namespace selectors name pods only
        return False
    ns_sel = rule_peer.get("namespaceSelector")
    ns_ok = other.namespace == policy_ns if ns_sel is None else selects(ns_sel, {NS_NAME: other.namespace})
    return ns_ok and selects(rule_peer.get("podSelector", {}), other.labels)


def port_matches(ports: list[dict[str, Any]] | None, protocol: str, port: int) -> bool:
    if not ports:
        return True
    for p in ports:
        if p.get("protocol", "TCP") != protocol:
            continue
        if "port" not in p:
            return True
        assert isinstance(p["port"], int), "named ports are not evaluated here"
        if p["port"] <= port <= p.get("endPort", p["port"]):
            return True
    return False


def admitted(policies: list[dict[str, Any]], kind: str, subject: Peer, other: Peer, protocol: str,
             port: int) -> bool:
    """Whether ``subject``'s policies of ``kind`` (Ingress: ``other`` connects to it; Egress: it
    connects to ``other``) let the connection through."""
    if subject.namespace is None:
        return True  # not a pod: no NetworkPolicy governs it
    rules_key, peers_key = ("ingress", "from") if kind == "Ingress" else ("egress", "to")
    isolating = []
    for pol in policies:
        spec = pol["spec"]
        types = spec.get("policyTypes") or ["Ingress", *(["Egress"] if "egress" in spec else [])]
        if (pol["metadata"]["namespace"] == subject.namespace and kind in types
                and selects(spec["podSelector"], subject.labels)):
            isolating.append(pol)
    if not isolating:
        return True  # a pod no policy selects is open (the Kubernetes default)
    return any((not rule.get(peers_key)
                or any(peer_matches(x, pol["metadata"]["namespace"], other) for x in rule[peers_key]))
               and port_matches(rule.get("ports"), protocol, port)
               for pol in isolating for rule in pol["spec"].get(rules_key, []))


def allowed(policies: list[dict[str, Any]], src: Peer, dst: Peer, port: int, protocol: str = "TCP") -> bool:
    """A connection from ``src`` to ``dst:port`` passes when src's egress and dst's ingress allow it."""
    return admitted(policies, "Egress", src, dst, protocol, port) and admitted(policies, "Ingress", dst, src,
                                                                                protocol, port)


def ingress_allows(policies: list[dict[str, Any]], src: Peer, dst: Peer, port: int,
                   protocol: str = "TCP") -> bool:
    """dst's ingress alone: a member must not rely on its clients' egress policies (a pod that
    copies a label of the job, or a policy of the job's that a later one widens)."""
    return admitted(policies, "Ingress", dst, src, protocol, port)


def members(docs: list[dict[str, Any]]) -> dict[str, Peer]:
    """Every pod of the job as a Peer, by pod name (the Deployment's template as ``<name>-0``)."""
    out = {d["metadata"]["name"]: Peer(d["metadata"]["namespace"], d["metadata"]["labels"])
           for d in by_kind(docs, "Pod")}
    for d in by_kind(docs, "Deployment"):
        labels = d["spec"]["template"]["metadata"]["labels"]
        out[f"{d['metadata']['name']}-0"] = Peer(d["metadata"]["namespace"], labels)
    return out


def test_the_policy_evaluator_knows_the_basic_rules() -> None:
    """The evaluator the tests below trust: open without policies, closed by a deny-all, opened by a rule."""
    a, b = Peer("ns", {"app": "a"}), Peer("ns", {"app": "b"})
    assert allowed([], a, b, 80)
    deny = {"metadata": {"namespace": "ns"}, "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}
    assert not allowed([deny], a, b, 80)
    allow = {"metadata": {"namespace": "ns"}, "spec": {
        "podSelector": {"matchLabels": {"app": "b"}},
        "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "a"}}}], "ports": [{"port": 80}]}]}}
    assert allowed([deny, allow], a, b, 80) and not allowed([deny, allow], a, b, 81)
    assert not allowed([deny, allow], Peer("other", {"app": "a"}), b, 80)  # podSelector: same namespace only
    assert not allowed([deny, allow], a, b, 80, "UDP")


def test_network_policies_admit_the_jobs_own_traffic_and_nothing_else() -> None:
    spec = reference_job(trainer={"workers": 3}, rollout={"replicas": 2})
    docs = render_job(spec, image="robustrl:latest", namespace="rl", job_id="ref-1")
    validate(docs)
    policies = by_kind(docs, "NetworkPolicy")
    pods = members(docs)
    r0, r1, r2 = (pods[f"ref-1-trainer-e1-r{k}"] for k in range(3))
    replica, other_replica = pods["ref-1-rollout-0"], Peer("rl", dict(pods["ref-1-rollout-0"].labels))
    master_port = int(env_of(container(by_kind(docs, "Pod")[0]["spec"]))["MASTER_PORT"])
    # Every member's weight server listens on one port, from its own environment.
    (weights_port,) = {int(env_of(c)["ROBUSTRL_WEIGHTS_PORT"]) for _, p in pod_specs(docs) for c in p["containers"]}
    low, high = 32768, 60999  # Linux's ephemeral range: where Gloo / NCCL (and port 0) listen
    # Every pod of the job is isolated both ways: no pod of it is left open by default.
    for name, pod in pods.items():
        for kind in ("Ingress", "Egress"):
            assert any(kind in p["spec"]["policyTypes"] and selects(p["spec"]["podSelector"], pod.labels)
                       for p in policies), f"{name}: no {kind} policy"
    # The gang: the rendezvous and any TCP port (Gloo, NCCL) among its ranks, both ways.
    assert allowed(policies, r1, r0, master_port) and allowed(policies, r0, r2, 5000)
    assert allowed(policies, r2, r1, low + 1234)
    assert not allowed(policies, r1, r0, master_port, "UDP")
    # Outsiders never reach a rank: not another app, not a look-alike in another namespace, not
    # another job, not another gang of this job, not an address outside the cluster.
    outsiders = [Peer("rl", {"app": "x"}), Peer("other", dict(r1.labels)),
                 Peer("rl", {**r1.labels, LABEL_JOB: "ref-2", LABEL_GANG: "ref-2-trainer-e1"}),
                 Peer("rl", {**r1.labels, LABEL_GANG: "ref-1-trainer-e2"}),
                 Peer(None, ip="203.0.113.7")]
    ports = [master_port, HEALTH_PORT, weights_port, low, (low + high) // 2, high, 22, 80, 443]
    for outsider in outsiders:
        for target in (r0, r1, replica):
            for port in ports:
                assert not ingress_allows(policies, outsider, target, port), (outsider, target, port)
    # Rendezvous: from the gang only (a rollout replica cannot join or disturb it), by the ranks'
    # ingress alone.
    for src in (replica, *outsiders):
        assert not ingress_allows(policies, src, r0, master_port), src
    assert not ingress_allows(policies, replica, r0, HEALTH_PORT)
    # Weight pulls: replicas from ranks and from each other, on the weight port only (not on a
    # rank's Gloo / NCCL listeners in the ephemeral range, not on the rendezvous).
    assert allowed(policies, replica, r0, weights_port) and allowed(policies, replica, other_replica, weights_port)
    for port in (weights_port - 1, weights_port + 1, low, (low + high) // 2, high, master_port, HEALTH_PORT):
        assert not ingress_allows(policies, replica, r0, port)
        assert not ingress_allows(policies, replica, other_replica, port)
        assert not allowed(policies, replica, r0, port)
        assert not allowed(policies, replica, other_replica, port)
    # Nothing needs a rank to open a connection to a replica.
    assert not any(allowed(policies, r0, replica, p) for p in ports)
    assert not any(ingress_allows(policies, r0, replica, p) for p in (master_port, HEALTH_PORT))
    # Egress: NATS, Redis, MinIO in the namespace and DNS; not the same ports elsewhere, not the rest.
    infra = Peer("rl", {"app": "nats"})
    for member in (r0, replica):
        assert all(allowed(policies, member, infra, p) for p in (4222, 6379, 9000))
        assert not allowed(policies, member, Peer("other", {"app": "nats"}), 4222)
        assert not allowed(policies, member, Peer(None, ip="203.0.113.7"), 4222)
        assert not allowed(policies, member, infra, 6380)
        assert not allowed(policies, member, Peer(None, ip="203.0.113.7"), 443)
        assert allowed(policies, member, Peer("kube-system", {"k8s-app": "kube-dns"}), 53, "UDP")
        assert allowed(policies, member, Peer("kube-system", {"k8s-app": "kube-dns"}), 53)
    # The policies touch no pod outside the job.
    for p in policies:
        assert not selects(p["spec"]["podSelector"], {"app": "x"})


def test_infrastructure_egress_by_address_host_name_or_none() -> None:
    settings = Settings(nats_url="nats://10.0.0.5:4222", redis_url="redis://cache.example.com/0",
                        s3_endpoint="s3.example.com", s3_secure=True)
    docs = render_job(reference_job(), image="robustrl:latest", namespace="rl", settings=settings)
    validate(docs)
    policies, member = by_kind(docs, "NetworkPolicy"), members(docs)["reference-trainer-e1-r0"]
    assert allowed(policies, member, Peer(None, ip="10.0.0.5"), 4222)
    assert not allowed(policies, member, Peer(None, ip="10.0.0.6"), 4222)  # an address: that address only
    # A host name outside the cluster cannot be a NetworkPolicy peer: its port is open to every
    # destination (documented), and only its port. Default ports: Redis 6379, S3 443 when secure.
    assert allowed(policies, member, Peer(None, ip="198.51.100.1"), 6379)
    assert allowed(policies, member, Peer(None, ip="198.51.100.1"), 443)
    assert not allowed(policies, member, Peer(None, ip="198.51.100.1"), 80)
    # A file:// object store and a unix socket need no egress at all.
    local = Settings(nats_url="nats://[fd00::5]:4222", redis_url="unix:///run/redis.sock",
                     s3_endpoint="minio.rl.svc:9000", object_store_url="file:///data/objects")
    docs = render_job(reference_job(), image="robustrl:latest", namespace="rl", settings=local)
    validate(docs)
    policies = by_kind(docs, "NetworkPolicy")
    assert allowed(policies, member, Peer(None, ip="fd00::5"), 4222)
    assert not allowed(policies, member, Peer(None, ip="fd00::6"), 4222)
    assert not any(allowed(policies, member, Peer("rl", {"app": "x"}), p) for p in (6379, 9000))


def test_an_endpoint_no_policy_can_name_is_refused_with_the_setting_named() -> None:
    for settings, fld in ((Settings(nats_url="nats://nats.rl.svc:99999"), "nats_url"),
                          (Settings(redis_url="redis:///0"), "redis_url"),
                          (Settings(s3_endpoint=":9000"), "s3_endpoint")):
        with pytest.raises(ConfigError) as err:
            render_job(reference_job(), image="robustrl:latest", settings=settings)
        assert err.value.fields["field"] == fld
    # Without policies nothing needs the endpoints parsed, and nothing is rendered for them.
    docs = render_job(reference_job(), image="robustrl:latest", network_policy=False)
    assert not by_kind(docs, "NetworkPolicy") and by_kind(docs, "Deployment")


def test_cli_can_leave_the_network_policies_out(tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({"name": "demo"}))
    res = CliRunner().invoke(app, ["k8s", "render", str(spec), "--no-network-policy"])
    assert res.exit_code == 0, res.output
    docs = list(yaml.safe_load_all(res.output))
    validate(docs)
    assert {d["kind"] for d in docs} == {"Pod", "Service", "Deployment"}


# --- the rollout member id: one per container start ------------------------------------------

def test_each_start_of_a_rollout_container_gets_a_member_id_of_its_own(tmp_path: Path) -> None:
    """Run the rendered rollout command in a real POSIX shell, with a stand-in ``python`` that
    prints what it was given: a container restarted in the same pod must not come back under
    the member id the request manager declared dead."""
    docs = render_job(reference_job(), image="robustrl:latest", namespace="rl")
    (deploy,) = by_kind(docs, "Deployment")
    tmpl = deploy["spec"]["template"]["spec"]
    assert tmpl["restartPolicy"] == "Always"  # a Deployment restarts crashed containers in place
    c = container(tmpl)
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$ROBUSTRL_MEMBER_ID" "$*"\n')
    fake.chmod(0o755)
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    # The longest pod name a Deployment makes is 63 characters, ending in 5 random characters.
    pod = "reference-rollout-" + "a" * 34 + "-5d8f7c9b4-x7k2p"
    env.update(ROBUSTRL_POD_NAME=pod, PATH=f"{tmp_path}{os.pathsep}/usr/bin:/bin")
    starts = []
    for _ in range(3):  # three starts of the container in one pod
        out = subprocess.run(c["command"], env=env, capture_output=True, text=True, timeout=10, check=True)
        member_id, argv = out.stdout.splitlines()
        assert argv == "-m robustrl.services.rollout"
        assert token(member_id) == member_id and member_id.startswith("rollout-x7k2p-")
        starts.append(member_id)
    assert len(set(starts)) == 3, starts
    # A pod name cannot stand in for it: nothing else in the env names the member.
    assert "ROBUSTRL_MEMBER_ID" not in {e["name"] for e in c["env"]}
