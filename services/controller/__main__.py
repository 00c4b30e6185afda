"""``python -m robustrl.services.controller``: the runtime controller + REST API process."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
from pathlib import Path

import uvicorn

from robustrl.bus import Bus
from robustrl.config import Settings
from robustrl.errors import ConfigError
from robustrl.infra.credentials import MEMBER_ROLES, credentials_for, without_role_credentials
from robustrl.launcher.local import LocalLauncher
from robustrl.member import configure_logging
from robustrl.services.controller.api import create_app
from robustrl.services.controller.runtime import Controller
from robustrl.storage.redis_stores import connect

log = logging.getLogger("robustrl.controller")
LAUNCHERS = ("local", "docker", "ray")
LOST_LEASE_EXIT_CODE = 3
"""Exit status of a controller that stepped down because another one took the lease."""


def make_launcher(settings: Settings, env: dict[str, str]):  # type: ignore[no-untyped-def]
    """Local processes by default; Docker containers when ROBUSTRL_LAUNCHER=docker; detached
    actors on the Ray cluster at ROBUSTRL_RAY_ADDRESS when ROBUSTRL_LAUNCHER=ray."""
    kind = env.get("ROBUSTRL_LAUNCHER", "local")
    if kind not in LAUNCHERS:
        raise ConfigError(f"ROBUSTRL_LAUNCHER must be one of {', '.join(LAUNCHERS)}, got {kind!r}",
                          field="ROBUSTRL_LAUNCHER")
    if kind == "ray":
        from robustrl.launcher.ray import RayLauncher

        if not env.get("ROBUSTRL_RAY_ADDRESS"):
            raise ConfigError("ROBUSTRL_LAUNCHER=ray needs ROBUSTRL_RAY_ADDRESS (the cluster's GCS host:port)",
                              field="ROBUSTRL_RAY_ADDRESS")
        # A stable instance name: a restarted controller re-attaches to the actors it started.
        return RayLauncher(env["ROBUSTRL_RAY_ADDRESS"], Path(settings.run_dir) / "logs", base_env=env,
                           namespace=env.get("ROBUSTRL_RAY_NAMESPACE", "robustrl"),
                           instance=env.get("ROBUSTRL_LAUNCHER_INSTANCE", "robustrl-controller"))
    if kind == "docker":
        from robustrl.launcher.docker import DEFAULT_DOCKER_URL, DockerLauncher

        # A stable instance label: a restarted controller re-attaches to the containers it started.
        return DockerLauncher(image=env.get("ROBUSTRL_IMAGE", "robustrl:latest"),
                              network=env.get("ROBUSTRL_DOCKER_NETWORK", "robustrl"),
                              instance=env.get("ROBUSTRL_LAUNCHER_INSTANCE", "robustrl-controller"),
                              docker_url=env.get("ROBUSTRL_DOCKER_URL", DEFAULT_DOCKER_URL))
    from robustrl.testbed.placement import RolePlacement

    # On a testbed (robustrl.testbed.placement): members start inside their role's hosts.
    placement = RolePlacement.from_env(env)
    if placement is not None:
        return LocalLauncher(Path(settings.run_dir) / "logs", base_env=env, placement=placement,
                             assign=placement.assign)
    return LocalLauncher(Path(settings.run_dir) / "logs", base_env=env)


def _env_number(env: dict[str, str], name: str, kind: type[int] | type[float]) -> float | None:
    """An optional positive finite number from the environment; anything else is a ConfigError
    naming it."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value: float | None = kind(raw)
    except ValueError:
        value = None  # not a number: the same refusal as a non-positive one
    if value is None or not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{name}={raw!r}: expected a positive {kind.__name__}", field=name)
    return value


async def main() -> None:
    env = dict(os.environ)
    settings = Settings.from_env(env)
    ttl = _env_number(env, "ROBUSTRL_LEASE_TTL_S", float)  # checked before connecting to anything
    acks = _env_number(env, "ROBUSTRL_RM_ACK_ATTEMPTS", int)
    bus = await Bus.connect(settings.nats_url, "controller", role="controller")
    redis = connect(settings.redis_url)
    await redis.ping()
    # Members get their role's credentials, never the controller's or the other roles'.
    members = {role.value: credentials_for(role, env) for role in MEMBER_ROLES}
    controller = Controller(bus, redis, make_launcher(settings, without_role_credentials(env)), settings,
                            member_credentials=members, lease_ttl_s=ttl,
                            rm_ack_attempts=int(acks) if acks is not None else None)
    await controller.start()
    app = create_app(controller, settings.api_token)
    config = uvicorn.Config(app, host=settings.api_host, port=settings.api_port, log_level="warning",
                            lifespan="off")
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))

    async def step_down() -> None:
        # Another controller holds the lease: exit without touching the members (they are its
        # now); the supervisor starts this process again as a standby.
        await controller.lost_leadership.wait()
        server.should_exit = True

    watcher = asyncio.create_task(step_down())
    print(f"controller listening on http://{settings.api_host}:{settings.api_port}", flush=True)
    try:
        await server.serve()
    finally:
        watcher.cancel()
        deposed = controller.lost_leadership.is_set()
        await controller.close(stop_members=not deposed)
        await bus.close()
        await redis.aclose()
    if deposed:
        raise SystemExit(LOST_LEASE_EXIT_CODE)


if __name__ == "__main__":
    configure_logging("controller")
    asyncio.run(main())
