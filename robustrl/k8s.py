"""Kubernetes manifests rendered from the same member specs the launchers start.

    robustrl k8s render job.yaml --image registry/robustrl:0.1 --namespace rl > job-manifests.yaml

What is rendered, for one job (``render_job``):
  * the trainer gang of the first epoch: one **Pod per rank** (``restartPolicy: Never``: like the Ray
    actors' ``max_restarts=0``, Kubernetes never restarts a rank behind RobustRL's back), and a
    headless **Service** selecting rank 0, whose DNS name is the gang's ``MASTER_ADDR``; the gang
    strategy becomes pod (anti-)affinity on ``kubernetes.io/hostname`` (STRICT_SPREAD: required
    anti-affinity, SPREAD: preferred anti-affinity, STRICT_PACK: required affinity, PACK:
    preferred affinity);
  * the rollout pool: one **Deployment** with ``rollout.replicas`` pods and a headless Service;
    replica anti-affinity (``rollout.placement``) becomes pod anti-affinity on the hostname;
  * every member: resources as requests = limits (``cpu``, ``memory``, ``nvidia.com/gpu``), node
    labels as ``nodeSelector``, liveness and readiness probes on ``GET /healthz`` (the member's
    ``robustrl.health`` endpoint, bound to the pod IP), the same environment the controller gives
    members (``MemberStarter.member_env``: infrastructure settings, job id, member id, rank), and
    the role's credentials from a Secret named ``<job>-<role>-credentials`` (referenced, never
    rendered: no secret value is written into a manifest);
  * least privilege for every pod: a non-root user (the images' ``robustrl``, uid/gid 10001), no
    privilege escalation, every capability dropped, the runtime's default seccomp profile, a
    read-only root filesystem with emptyDirs only where a member writes (``/tmp`` and ``HOME``),
    no service account token;
  * NetworkPolicies (``network_policies``, unless turned off): the job's pods deny all traffic but
    what the job needs: TCP among the gang's ranks, the weight transfers (rollout replicas pull
    from the trainer and from each other), NATS, Redis and S3, and DNS.

Each start of a rollout container gets its own member id (``rollout-<pod suffix>-<random>``, made
by a shell wrapper): a Deployment restarts a crashed container in the same pod, and a member id
that the request manager declared dead is never dispatched to again.

The manifests are checked against the Kubernetes OpenAPI schema in tests (``kubernetes-validate``,
strict: unknown fields are errors). No Kubernetes cluster runs here: nothing rendered has been
applied to one, and RobustRL has no Kubernetes launcher yet (the controller does not start, watch
or replace these pods; see docs/kubernetes.md).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any
from urllib.parse import urlsplit

from robustrl.config import JobSpec, Settings
from robustrl.errors import ConfigError
from robustrl.member import trainer_id
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
NAMESPACE_LABEL = "kubernetes.io/metadata.name"
"""The label the API server gives every namespace (its name; Kubernetes >= 1.22)."""
RUN_AS = 10001
"""uid and gid of the ``robustrl`` user of the project's images (Dockerfile, Dockerfile.vllm)."""
HOME = "/home/robustrl"
WRITABLE = {"tmp": "/tmp", "home": HOME}
"""The only writable paths of a member (emptyDir name -> mount path; the root filesystem is
read-only): ``/tmp`` (``tempfile``, torch's compile caches) and ``HOME`` (``~/.cache``: Hugging
Face, Triton, vLLM). A member writes nothing else to disk: checkpoints and weights go to S3 or over
the network, and ``ROBUSTRL_RUN_DIR`` is the control plane's (only the supervisor and the embedded
infrastructure write there)."""
WEIGHTS_PORT = 29600
"""Every member's weight server listens on this port of its pod (``ROBUSTRL_WEIGHTS_PORT``; each pod
has an address of its own), so the NetworkPolicies admit weight pulls on this one port. (Until
2026-12-02 the servers took port 0 and the policies had to admit the pod's whole ephemeral range,
pinned by a sysctl, which is also where a rank's Gloo / NCCL listeners are.)"""
_DNS = re.compile(r"[^a-z0-9-]+")
# The member's address for its peers and its health endpoint's bind address: the pod IP.
_POD_IP = {"fieldRef": {"fieldPath": "status.podIP"}}
_POD_NAME = {"fieldRef": {"fieldPath": "metadata.name"}}
_SECRET_KEYS = ("ROBUSTRL_S3_ACCESS_KEY", "ROBUSTRL_S3_SECRET_KEY", "ROBUSTRL_CREDENTIALS_FILE")
"""Never rendered as values: the role's Secret provides them."""
_NOT_FOR_PODS = ("ROBUSTRL_API_TOKEN", "ROBUSTRL_API_HOST", "ROBUSTRL_API_PORT", "ROBUSTRL_BIND_HOST", *_SECRET_KEYS)
"""Settings a member pod does not get as values: the API's (members never call it), the bind
host (the pod IP, from the downward API) and the secrets."""
_INCARNATION = ('set -eu; read -r uuid < /proc/sys/kernel/random/uuid; '
                'ROBUSTRL_MEMBER_ID="rollout-${ROBUSTRL_POD_NAME##*-}-${uuid%%-*}"; '
                'export ROBUSTRL_MEMBER_ID; exec python -m "$0" "$@"')
"""The rollout container's entry (POSIX sh, builtins only): a member id per container start,
``rollout-<the pod name's random suffix>-<8 random hex digits>`` (at most 22 characters, a valid
subject token). A Deployment restarts a crashed container in the same pod; under the pod's name
it would come back as a replica the request manager declared dead and never dispatches to again.
``exec`` keeps Python as the container's PID 1, so it gets the SIGTERM of a pod's deletion."""


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
        mid = trainer_id(1, rank)
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
            {"name": "ROBUSTRL_HEALTH_PORT", "value": str(HEALTH_PORT)},
            {"name": "ROBUSTRL_WEIGHTS_PORT", "value": str(WEIGHTS_PORT)},
            # the image's user has this home; a uid without a passwd entry would get HOME=/ (read-only)
            {"name": "HOME", "value": HOME}, *extra_env]
    probe = {"httpGet": {"path": "/healthz", "port": HEALTH_PORT}, "periodSeconds": 5, "timeoutSeconds": 2,
             "failureThreshold": 3}
    if spec.role == "rollout":
        command = ["/bin/sh", "-c", _INCARNATION, spec.module, *spec.args]
    else:
        command = ["python", "-m", spec.module, *spec.args]
    container: dict[str, Any] = {
        "name": spec.role, "image": image, "command": command, "env": env,
        "envFrom": [{"secretRef": {"name": dns_name(spec.job_id, spec.role, "credentials")}}],
        "ports": [{"name": "health", "containerPort": HEALTH_PORT},
                  {"name": "weights", "containerPort": WEIGHTS_PORT}],
        "livenessProbe": {**probe, "initialDelaySeconds": 30}, "readinessProbe": dict(probe),
        "securityContext": {"allowPrivilegeEscalation": False, "privileged": False,
                            "readOnlyRootFilesystem": True, "runAsNonRoot": True,
                            "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": name, "mountPath": path} for name, path in WRITABLE.items()]}
    resources = _resources(spec.resources)
    if resources:
        container["resources"] = resources
    if spec.role == "trainer":
        container["ports"].append({"name": "rendezvous", "containerPort": MASTER_PORT})
    return container


def _pod_spec(spec: MemberSpec, image: str, extra_env: list[dict[str, Any]], affinity: dict[str, Any],
              restart: str) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "restartPolicy": restart, "containers": [_container(spec, image, extra_env)],
        "terminationGracePeriodSeconds": 15,
        # members never call the Kubernetes API: no token in the pod to steal
        "automountServiceAccountToken": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS,
                            "fsGroup": RUN_AS, "seccompProfile": {"type": "RuntimeDefault"}},
        "volumes": [{"name": name, "emptyDir": {}} for name in WRITABLE]}
    if spec.placement.node_labels:
        pod["nodeSelector"] = dict(spec.placement.node_labels)
    if affinity:
        pod["affinity"] = affinity
    return pod


def infra_egress(settings: Settings) -> list[dict[str, Any]]:
    """Egress rules to NATS, Redis and S3 (one per endpoint) as ``settings`` name them.

    An IP address becomes an ``ipBlock`` of that address alone. A Service name
    (``name.namespace.svc[.domain]``) becomes the port on the pods of that namespace only (a
    policy sees the Service's pods, after the cluster IP is translated; an ExternalName Service, or
    one whose endpoints are outside the namespace, is not reached). Any other host name cannot be
    expressed (a NetworkPolicy matches addresses, not names): the rule allows the port to every
    destination. A ``unix://`` Redis socket and a ``file://`` object store need no egress.

    Raises:
        ConfigError: an endpoint has no host or a bad port (``field`` names the setting).
    """
    endpoints = [("nats_url", settings.nats_url, 4222), ("redis_url", settings.redis_url, 6379)]
    if not settings.object_store_url:
        endpoints.append(("s3_endpoint", f"//{settings.s3_endpoint}", 443 if settings.s3_secure else 80))
    rules: list[dict[str, Any]] = []
    for field, url, default in endpoints:
        parts = urlsplit(url)
        if parts.scheme == "unix":
            continue
        try:
            host, port = parts.hostname, parts.port or default
        except ValueError as exc:
            raise ConfigError(f"{field} {url!r} has a bad port", field=field) from exc
        if not host:
            raise ConfigError(f"{field} {url!r} names no host", field=field)
        rule: dict[str, Any] = {"ports": [{"protocol": "TCP", "port": port}]}
        try:
            ip = ipaddress.ip_address(host)
            rule["to"] = [{"ipBlock": {"cidr": f"{ip}/{ip.max_prefixlen}"}}]
        except ValueError:
            name = host.rstrip(".").split(".")
            if len(name) >= 3 and name[2] == "svc":  # <service>.<namespace>.svc[.<cluster domain>]
                rule["to"] = [{"namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: name[1]}}}]
        if rule not in rules:
            rules.append(rule)
    return rules


def _pods(labels: dict[str, str]) -> dict[str, Any]:
    return {"podSelector": {"matchLabels": dict(labels)}}


def network_policies(job: str, namespace: str, gang: dict[str, str] | None, pool: dict[str, str],
                     settings: Settings) -> list[dict[str, Any]]:
    """The job's NetworkPolicies: every pod labelled ``robustrl.io/job: <job>`` is denied all
    traffic in and out, then allowed what it needs (policies add up):

    * DNS (UDP and TCP 53, to any destination: the cluster's resolver may be a node-local cache,
      which no pod selector names) and NATS, Redis and S3 (``infra_egress``);
    * the gang (``gang``: its pods' labels): all TCP among its ranks (the rendezvous on
      ``MASTER_PORT``, and Gloo / NCCL, which listen on ephemeral ports), and weight pulls from
      the job's rollout pods on ``WEIGHTS_PORT`` only (not the rendezvous, the health port or a
      rank's Gloo / NCCL listeners);
    * the rollout pool (``pool``): weight pulls to the job's trainers and among its replicas
      (relays), on ``WEIGHTS_PORT``.

    No rule admits the health port: the kubelet's probes come from the pod's own node, which a
    NetworkPolicy does not block (Kubernetes' NetworkPolicy documentation). Nothing outside the job
    reaches a member.
    """
    members = {LABEL_JOB: job}

    def weights() -> list[dict[str, Any]]:  # a new list each time: no YAML aliases in the output
        return [{"protocol": "TCP", "port": WEIGHTS_PORT}]

    def policy(name: str, selector: dict[str, str], ingress: list[dict[str, Any]] | None = None,
               egress: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        spec: dict[str, Any] = {"podSelector": {"matchLabels": dict(selector)}, "policyTypes": []}
        for kind, rules in (("Ingress", ingress), ("Egress", egress)):
            if rules is not None:
                spec["policyTypes"].append(kind)
                if rules:
                    spec[kind.lower()] = rules
        return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                "metadata": {"namespace": namespace, "name": name, "labels": dict(members)}, "spec": spec}

    dns = {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}
    out = [policy(dns_name(job, "deny-all"), members, ingress=[], egress=[]),
           policy(dns_name(job, "egress-infra"), members, egress=[dns, *infra_egress(settings)])]
    if gang is not None:
        out.append(policy(dns_name(gang[LABEL_GANG]), gang,
                          ingress=[{"from": [_pods(gang)], "ports": [{"protocol": "TCP"}]},
                                   {"from": [_pods(pool)], "ports": weights()}],
                          egress=[{"to": [_pods(gang)], "ports": [{"protocol": "TCP"}]}]))
    out.append(policy(dns_name(job, "rollout"), pool, ingress=[{"from": [_pods(pool)], "ports": weights()}],
                      egress=[{"to": [_pods({**members, LABEL_ROLE: "trainer"})], "ports": weights()},
                              {"to": [_pods(pool)], "ports": weights()}]))
    return out


def render_members(ranks: list[MemberSpec], replica: MemberSpec, replicas: int, *, image: str,
                   namespace: str, network_policy: bool = True) -> list[dict[str, Any]]:
    """Manifests for a trainer gang (``ranks``, rank 0 first) and a rollout pool of ``replicas``
    pods like ``replica``, with their NetworkPolicies unless ``network_policy`` is False (a cluster
    whose network plugin does not enforce them)."""
    job = dns_name(ranks[0].job_id if ranks else replica.job_id)
    meta = {"namespace": namespace}
    out: list[dict[str, Any]] = []
    gang_labels: dict[str, str] | None = None
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
    pod_name = [{"name": "ROBUSTRL_POD_NAME", "valueFrom": _POD_NAME}]  # the member id is made per start
    pool = dns_name(job, "rollout")
    out.append({"apiVersion": "v1", "kind": "Service", "metadata": {**meta, "name": pool, "labels": pool_labels},
                "spec": {"clusterIP": "None", "selector": pool_labels,
                         "ports": [{"name": "health", "port": HEALTH_PORT, "targetPort": HEALTH_PORT}]}})
    out.append({"apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": {**meta, "name": pool, "labels": pool_labels},
                "spec": {"replicas": replicas, "selector": {"matchLabels": pool_labels},
                         "template": {"metadata": {"labels": pool_labels},
                                      "spec": _pod_spec(replica, image, pod_name, affinity, "Always")}}})
    if network_policy:
        out += network_policies(job, namespace, gang_labels, pool_labels, Settings.from_env(replica.env))
    return out


def render_job(spec: JobSpec, *, image: str, namespace: str = "default", settings: Settings | None = None,
               job_id: str | None = None, network_policy: bool = True) -> list[dict[str, Any]]:
    """Every manifest of one job (module docstring); ``settings`` say where NATS, Redis and S3 are
    from inside the cluster (default: Services named nats, redis and minio in ``namespace``);
    ``network_policy=False`` leaves the NetworkPolicies out."""
    if not image:
        raise ConfigError("an image is needed (--image)", field="image")
    if dns_name(namespace) != namespace:
        raise ConfigError(f"namespace {namespace!r} is not a DNS-1123 label", field="namespace")
    settings = settings or Settings(nats_url=f"nats://nats.{namespace}.svc:4222",
                                    redis_url=f"redis://redis.{namespace}.svc:6379/0",
                                    s3_endpoint=f"minio.{namespace}.svc:9000", run_dir="/var/run/robustrl")
    ranks, replica = job_members(spec, job_id or dns_name(spec.name), settings)
    return render_members(ranks, replica, spec.rollout.replicas, image=image, namespace=namespace,
                          network_policy=network_policy)
