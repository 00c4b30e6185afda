"""``python -m robustrl.services.detector``: run the detector until SIGTERM/SIGINT.

Settings come from the environment (``ROBUSTRL_NATS_URL``...), read once here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from robustrl.bus import Bus
from robustrl.config import Settings
from robustrl.health import serve_health
from robustrl.services.detector.service import MEMBER_NAME, DetectorService


async def serve(settings: Settings) -> None:
    """Connect to NATS and run the detector until a termination signal arrives."""
    bus = await Bus.connect(settings.nats_url, MEMBER_NAME, role="detector")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    health = await serve_health(MEMBER_NAME, {"nats": lambda: bus.connected}, os.environ)
    try:
        await DetectorService(bus).run(stop)
    finally:
        if health:
            await health.close()
        await bus.close()


def main() -> None:
    logging.basicConfig(level=os.environ.get("ROBUSTRL_LOG_LEVEL", "INFO"),
                        format="%(asctime)s detector %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(Settings.from_env(os.environ)))


if __name__ == "__main__":
    main()
