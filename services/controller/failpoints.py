"""Named points in the controller where a test can freeze it (a failpoint), to kill it at the
worst moment of a multi-step action instead of racing it from outside.

``ROBUSTRL_CONTROLLER_FAILPOINTS=name[,name...]`` (read at import; unset in production) makes the
controller process send itself ``SIGSTOP`` the first time it reaches each named point (a point
named twice: the first two times), after the
writes that precede the point are done (the job record persisted, the events appended). The test
sees the process stopped (state ``T``), checks the raw stores, and SIGKILLs it; a standby
controller then takes over from exactly that state.

Points: ``gang_planned`` (a trainer recovery has killed the ranks it does not keep and hands
nothing over yet: the kept ranks' gang is broken under them), ``gang_borrowed`` (a trainer gang with borrowed ranks started and recorded, not yet
ready, no slot restocked), ``restock`` (the gang is ready, the borrowed slots are recorded as
owed a replacement, none started yet), ``takeover_resumed`` (a new leader has read a job's record
and event log and re-attached its members, and does not act yet: commits it hears now come
before it leads), ``job_purging`` (a job deletion has marked the job's record and unlinked
its first batch of Redis keys), ``stop_members_stopped`` (a stop has stopped the job's members
and recorded their exits; its final event and status are not written yet).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections import Counter

log = logging.getLogger(__name__)

ENV = "ROBUSTRL_CONTROLLER_FAILPOINTS"
POINTS = frozenset({"gang_borrowed", "restock", "takeover_resumed", "gang_planned", "job_purging",
                    "stop_members_stopped"})
_armed: Counter[str] = Counter(p.strip() for p in os.environ.get(ENV, "").split(",") if p.strip())


async def hit(name: str) -> None:
    """Freeze this process at ``name`` if that point is armed (once per time it is named)."""
    if _armed[name] <= 0:
        return
    _armed[name] -= 1
    log.warning("failpoint %s: stopping controller process %d", name, os.getpid())
    for h in logging.getLogger().handlers:
        h.flush()
    await asyncio.sleep(0)  # let writes already handed to the event loop leave
    os.kill(os.getpid(), signal.SIGSTOP)
