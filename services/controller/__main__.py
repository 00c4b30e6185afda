"""``python -m robustrl.services.controller``: the runtime controller + REST API process."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path

import uvicorn

from robustrl.bus import Bus
from robustrl.config import Settings
from robustrl.launcher.local import LocalLauncher
from robustrl.member import configure_logging
from robustrl.services.controller.api import create_app
from robustrl.services.controller.runtime import Controller
from robustrl.storage.redis_stores import connect

log = logging.getLogger("robustrl.controller")


def make_launcher(settings: Settings, env: dict[str, str]):  # type: ignore[no-untyped-def]
    """Local processes by default; Docker containers when ROBUSTRL_LAUNCHER=docker."""
    if env.get("ROBUSTRL_LAUNCHER", "local") == "docker":
        from robustrl.launcher.docker import DockerLauncher

        return DockerLauncher(image=env.get("ROBUSTRL_IMAGE", "robustrl:latest"),
                              network=env.get("ROBUSTRL_DOCKER_NETWORK", "robustrl"))
    return LocalLauncher(Path(settings.run_dir) / "logs", base_env=env)


async def main() -> None:
    env = dict(os.environ)
    settings = Settings.from_env(env)
    bus = await Bus.connect(settings.nats_url, "controller")
    redis = connect(settings.redis_url)
    await redis.ping()
    controller = Controller(bus, redis, make_launcher(settings, env), settings)
    await controller.start()
    app = create_app(controller, settings.api_token)
    config = uvicorn.Config(app, host=settings.api_host, port=settings.api_port, log_level="warning",
                            lifespan="off")
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    print(f"controller listening on http://{settings.api_host}:{settings.api_port}", flush=True)
    try:
        await server.serve()
    finally:
        await controller.close()
        await bus.close()
        await redis.aclose()


if __name__ == "__main__":
    configure_logging("controller")
    asyncio.run(main())
