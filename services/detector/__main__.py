"""``python -m robustrl.services.detector``: run the detector until SIGTERM/SIGINT.

Settings come from the environment (``ROBUSTRL_NATS_URL``, ``ROBUSTRL_REDIS_URL``...), read once here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from robustrl.bus import Bus
from robustrl.config import Settings
from robustrl.health import serve_health, watch_loop
from robustrl.services.detector.service import MEMBER_NAME, DetectorService
from robustrl.storage.redis_stores import connect

log = logging.getLogger(__name__)


async def serve(settings: Settings) -> None:
    """Connect to NATS and run the detector until a termination signal arrives.

    Redis holds the detector's event outboxes. The detector does not wait for it (the client
    connects on its first call): detection goes on while Redis is away, its events then queued in
    memory only. Without a Redis URL at all they are always in memory only (logged)."""
    bus = await Bus.connect(settings.nats_url, MEMBER_NAME, role="detector")
    redis = connect(settings.redis_url) if settings.redis_url else None
    if redis is None:
        log.warning("no Redis URL: fault_detected events are queued in memory only (a detector killed while "
                    "JetStream is away loses them)")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    health = await serve_health(MEMBER_NAME, {"nats": lambda: bus.connected}, os.environ)
    watchdog = watch_loop(MEMBER_NAME, os.environ)
    try:
        await DetectorService(bus, redis=redis).run(stop)
    finally:
        if watchdog:
            watchdog.stop()
        if health:
            await health.close()
        await bus.close()
        if redis is not None:
            await redis.aclose()


def main() -> None:
    logging.basicConfig(level=os.environ.get("ROBUSTRL_LOG_LEVEL", "INFO"),
                        format="%(asctime)s detector %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(Settings.from_env(os.environ)))


if __name__ == "__main__":
    main()
