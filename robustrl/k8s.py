"""Kubernetes manifests rendered from the same member specs the launchers start.

    robustrl k8s render job.yaml --image registry/robustrl:0.1 --namespace rl > job-manifests.yaml

What is rendered, for one job (``render_job``):
  * the trainer gang of the first epoch: one **Pod per rank** (``restartPolicy: Never``: like the Ray
    actors' ``max_restarts=0``, Kubernetes never restarts a rank behind RobustRL's back), and a
    headless **Service** selecting rank 0, whose DNS name is the gang's ``MASTER_ADDR``; the gang
    strategy becomes pod (anti-)affinity on ``kubernetes.io/hostname`` (STRICT_SPREAD: required
    anti-affinity, SPREAD: preferred anti-affinity, STRICT_PACK: required affinity, PACK:
    preferred affinity);
  * the rollout pool: one **Deployment** with ``rollout.replicas`` pods (each pod's member id is
    its pod name) and a headless Service; replica anti-affinity (``rollout.placement``) becomes pod
    anti-affinity on the hostname;
  * every member: resources as requests = limits (``cpu``, ``memory``, ``nvidia.com/gpu``), node
    labels as ``nodeSelector``, liveness and readiness probes on ``GET /healthz`` (the member's
    ``robustrl.health`` endpoint, bound to the pod IP), the same environment the controller gives
    members (``MemberStarter.member_env``: infrastructure settings, job id, member id, rank), and
    the role's credentials from a Secret named ``<job>-<role>-credentials`` (referenced, never
    rendered: no secret value is written into a manifest).

The manifests are checked against the Kubernetes OpenAPI schema in tests (``kubernetes-validate``,
strict: unknown fields are errors). No Kubernetes cluster runs here: nothing rendered has been
applied to one, and RobustRL has no Kubernetes launcher yet (the controller does not start, watch
or replace these pods; see docs/kubernetes.md).
"""

from __future__ import annotations

import re
from typing import Any

from robustrl.config import JobSpec, Settings
from robustrl.errors import ConfigError
from robustrl.launcher.base import (
    ROLLOUT_MODULE,
    TRAINER_MODULE,
    MemberSpec,
    PlacementHint,
    Resources,
    check_spec,
)

HEALTH_PORT = 8081
MASTER_PORT = 29500
LABEL_JOB = "robustrl.io/job"
LABEL_ROLE = "robustrl.io/role"
LABEL_GANG = "robustrl.io/gang"
LABEL_RANK = "robustrl.io/rank"
GPU_RESOURCE = "nvidia.com/gpu"
_DNS = re.compile(r"[^a-z0-9-]+")
# The member's address for its peers and its health endpoint's bind address: the pod IP.
_POD_IP = {"fieldRef": {"fieldPath": "status.podIP"}}
_POD_NAME = {"fieldRef": {"fieldPath": "metadata.name"}}
_SECRET_KEYS = ("ROBUSTRL_S3_ACCESS_KEY", "ROBUSTRL_S3_SECRET_KEY", "ROBUSTRL_CREDENTIALS_FILE")
"""Never rendered as values: the role's Secret provides them."""
_NOT_FOR_PODS = ("ROBUSTRL_API_TOKEN", "ROBUSTRL_API_HOST", "ROBUSTRL_API_PORT", "ROBUSTRL_BIND_HOST", *_SECRET_KEYS)
"""Settings a member pod does not get as values: the API's (members never call it), the bind
host (the pod IP, from the downward API) and the secrets."""


def dns_name(*parts: str, limit: int = 63) -> str:
    """A DNS-1123 label from ``parts`` (lower case, ``-`` for anything else, at most ``limit``)."""
    name = _DNS.sub("-", "-".join(parts).lower()).strip("-")[:limit].rstrip("-")
    if not name:
        raise ConfigError(f"no valid Kubernetes name can be made of {parts!r}", field="name")
    return name


def job_members(spec: JobSpec, job_id: str, settings: Settings) -> tuple[list[MemberSpec], MemberSpec]:
    """The first gang's rank specs and one rollout replica's spec, as the controller builds them."""
    base = {k: v for k, v in settings.to_env().items() if k not in _NOT_FOR_PODS}
    t, r = spec.trainer, spec.rollout
    ranks = []
    for rank in range(t.workers):
        mid = f"trainer-e1-r{rank}"
        env = {**base, "ROBUSTRL_JOB_ID": job_id, "ROBUSTRL_MEMBER_ID": mid, "ROBUSTRL_ROLE": "trainer",
               "ROBUSTRL_RANK": str(rank), "ROBUSTRL_WORLD_SIZE": str(t.workers),
               "MASTER_PORT": str(MASTER_PORT)}
        ranks.append(MemberSpec(job_id, mid, "trainer", TRAINER_MODULE, env,
                                resources=Resources(t.resources.cpus, t.resources.gpus, t.resources.memory_mb),
                                placement=PlacementHint(node_labels=dict(t.placement.node_labels), gang="trainer-e1",
                                                        gang_rank=rank, gang_size=t.workers,
                                                        strategy=t.placement.strategy)))
    env = {**base, "ROBUSTRL_JOB_ID": job_id, "ROBUSTRL_ROLE": "rollout"}
    replica = MemberSpec(job_id, "rollout", "rollout", ROLLOUT_MODULE, env,
                         resources=Resources(r.resources.cpus, r.resources.gpus, r.resources.memory_mb),
                         placement=PlacementHint(node_labels=dict(r.placement.node_labels), group="rollout",
                                                 anti_affinity=r.placement.anti_affinity))
    for m in [*ranks, replica]:
        check_spec(m)
    return ranks, replica


def _resources(res: Resources) -> dict[str, Any]:
    amounts: dict[str, str] = {}
    if res.cpus:
        amounts["cpu"] = f"{round(res.cpus * 1000)}m"
    if res.memory_mb:
        amounts["memory"] = f"{res.memory_mb}Mi"
    if res.gpus:
        if res.gpus != int(res.gpus):
            raise ConfigError(f"Kubernetes schedules whole GPUs: gpus={res.gpus}", field="resources.gpus")
        amounts[GPU_RESOURCE] = str(int(res.gpus))
    return {"requests": dict(amounts), "limits": dict(amounts)} if amounts else {}


def _term(selector: dict[str, str]) -> dict[str, Any]:
    return {"labelSelector": {"matchLabels": selector}, "topologyKey": "kubernetes.io/hostname"}


def _affinity(kind: str, required: bool, selector: dict[str, str]) -> dict[str, Any]:
    if required:
        return {kind: {"requiredDuringSchedulingIgnoredDuringExecution": [_term(selector)]}}
    return {kind: {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 100, "podAffinityTerm": _term(selector)}]}}


def _container(spec: MemberSpec, image: str, extra_env: list[dict[str, Any]]) -> dict[str, Any]:
    env = [{"name": k, "value": v} for k, v in sorted(spec.env.items())]
    env += [{"name": "ROBUSTRL_BIND_HOST", "valueFrom": _POD_IP},
            {"name": "ROBUSTRL_HEALTH_HOST", "valueFrom": _POD_IP},
            {"name": "ROBUSTRL_HEALTH_PORT", "value": str(HEALTH_PORT)}, *extra_env]
    probe = {"httpGet": {"path": "/healthz", "port": HEALTH_PORT}, "periodSeconds": 5, "timeoutSeconds": 2,
             "failureThreshold": 3}
    container: dict[str, Any] = {
        "name": spec.role, "image": image, "command": ["python", "-m", spec.module, *spec.args], "env": env,
        "envFrom": [{"secretRef": {"name": dns_name(spec.job_id, spec.role, "credentials")}}],
        "ports": [{"name": "health", "containerPort": HEALTH_PORT}],
        "livenessProbe": {**probe, "initialDelaySeconds": 30}, "readinessProbe": dict(probe)}
    resources = _resources(spec.resources)
    if resources:
        container["resources"] = resources
    if spec.role == "trainer":
        container["ports"].append({"name": "rendezvous", "containerPort": MASTER_PORT})
    return container


def _pod_spec(spec: MemberSpec, image: str, extra_env: list[dict[str, Any]], affinity: dict[str, Any],
              restart: str) -> dict[str, Any]:
    pod: dict[str, Any] = {"restartPolicy": restart, "containers": [_container(spec, image, extra_env)],
                           "terminationGracePeriodSeconds": 15}
    if spec.placement.node_labels:
        pod["nodeSelector"] = dict(spec.placement.node_labels)
    if affinity:
        pod["affinity"] = affinity
    return pod


def render_members(ranks: list[MemberSpec], replica: MemberSpec, replicas: int, *, image: str,
                   namespace: str) -> list[dict[str, Any]]:
    """Manifests for a trainer gang (``ranks``, rank 0 first) and a rollout pool of ``replicas``
    pods like ``replica``."""
    job = dns_name(ranks[0].job_id if ranks else replica.job_id)
    meta = {"namespace": namespace}
    out: list[dict[str, Any]] = []
    if ranks:
        gang = dns_name(job, ranks[0].placement.gang or "trainer")
        rdzv = dns_name(gang, "rdzv")
        gang_labels = {LABEL_JOB: job, LABEL_ROLE: "trainer", LABEL_GANG: gang}
        out.append({"apiVersion": "v1", "kind": "Service",
                    "metadata": {**meta, "name": rdzv, "labels": gang_labels},
                    "spec": {"clusterIP": "None", "selector": {**gang_labels, LABEL_RANK: "0"},
                             "ports": [{"name": "rendezvous", "port": MASTER_PORT, "targetPort": MASTER_PORT}],
                             # rank 0's address is needed before it is ready (the gang forms first)
                             "publishNotReadyAddresses": True}})
        strategy = ranks[0].placement.strategy
        kind = "podAntiAffinity" if strategy in ("SPREAD", "STRICT_SPREAD") else "podAffinity"
        affinity = _affinity(kind, strategy.startswith("STRICT"), gang_labels) if len(ranks) > 1 else {}
        master = [{"name": "MASTER_ADDR", "value": f"{rdzv}.{namespace}.svc"}]
        for spec in ranks:
            labels = {**gang_labels, LABEL_RANK: str(spec.placement.gang_rank)}
            out.append({"apiVersion": "v1", "kind": "Pod",
                        "metadata": {**meta, "name": dns_name(job, spec.member_id), "labels": labels},
                        "spec": _pod_spec(spec, image, master, affinity, "Never")})
    pool_labels = {LABEL_JOB: job, LABEL_ROLE: "rollout"}
    anti = replica.placement.anti_affinity
    affinity = _affinity("podAntiAffinity", anti == "required", pool_labels) if anti != "none" else {}
    member_id = [{"name": "ROBUSTRL_MEMBER_ID", "valueFrom": _POD_NAME}]
    pool = dns_name(job, "rollout")
    out.append({"apiVersion": "v1", "kind": "Service", "metadata": {**meta, "name": pool, "labels": pool_labels},
                "spec": {"clusterIP": "None", "selector": pool_labels,
                         "ports": [{"name": "health", "port": HEALTH_PORT, "targetPort": HEALTH_PORT}]}})
    out.append({"apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": {**meta, "name": pool, "labels": pool_labels},
                "spec": {"replicas": replicas, "selector": {"matchLabels": pool_labels},
                         "template": {"metadata": {"labels": pool_labels},
                                      "spec": _pod_spec(replica, image, member_id, affinity, "Always")}}})
    return out


def render_job(spec: JobSpec, *, image: str, namespace: str = "default", settings: Settings | None = None,
               job_id: str | None = None) -> list[dict[str, Any]]:
    """Every manifest of one job (module docstring); ``settings`` say where NATS, Redis and S3 are
    from inside the cluster (default: Services named nats, redis and minio in ``namespace``)."""
    if not image:
        raise ConfigError("an image is needed (--image)", field="image")
    if dns_name(namespace) != namespace:
        raise ConfigError(f"namespace {namespace!r} is not a DNS-1123 label", field="namespace")
    settings = settings or Settings(nats_url=f"nats://nats.{namespace}.svc:4222",
                                    redis_url=f"redis://redis.{namespace}.svc:6379/0",
                                    s3_endpoint=f"minio.{namespace}.svc:9000", run_dir="/var/run/robustrl")
    ranks, replica = job_members(spec, job_id or dns_name(spec.name), settings)
    return render_members(ranks, replica, spec.rollout.replicas, image=image, namespace=namespace)
