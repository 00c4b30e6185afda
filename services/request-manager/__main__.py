"""``python -m robustrl.services.request_manager``: the request manager + agent worker process."""

from __future__ import annotations

import asyncio
import os
import signal

from robustrl.services.request_manager.service import RequestManager

from robustrl.bus import Bus
from robustrl.config import Settings
from robustrl.health import serve_health, watch_loop
from robustrl.member import configure_logging
from robustrl.storage.redis_stores import connect

METRICS_INTERVAL_S = 0.25


async def main() -> None:
    settings = Settings.from_env(os.environ)
    bus = await Bus.connect(settings.nats_url, "request_manager", role="request_manager")
    await bus.ensure_event_stream()
    redis = connect(settings.redis_url)
    await redis.ping()
    rm = RequestManager(bus, redis)
    await rm.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    health = await serve_health("request_manager", {"nats": lambda: bus.connected, "redis": redis.ping},
                                os.environ)
    watchdog = watch_loop("request_manager", os.environ)
    print("request_manager ready", flush=True)
    await rm.metrics_loop(METRICS_INTERVAL_S, stop)
    if watchdog:
        watchdog.stop()
    await rm.close()
    if health:
        await health.close()
    await bus.close()
    await redis.aclose()


if __name__ == "__main__":
    configure_logging("request_manager")
    asyncio.run(main())
