"""Where a trainer gang resumes, and the gang's fence as its checkpoint upload thread sees it.

A new gang resumes after the newest checkpoint that loads (L) and redoes the steps after it from
their batches. Steps after the newest checkpoint once durable (D, in the gang record) are redone
as usual: the request manager keeps their batches, or regenerates the step it was working on. But
steps up to D have had their batches deleted once D was durable, so resuming below D is sound only
while those batches happen to remain; and with D >= 0 and nothing loading, the gang would train
from random weights over a committed history. In both cases it raises ``CheckpointLost`` and the
job fails loudly.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import redis.asyncio as aioredis

from robustrl.errors import CheckpointLost
from robustrl.storage.fencing import GangFence, GangRecord
from robustrl.storage.redis_stores import BatchStore

FENCE_TIMEOUT_S = 30.0
"""How long the upload thread waits for one fenced Redis call made on the event loop."""


@dataclass(frozen=True)
class History:
    """What Redis says was committed before this gang started."""

    durable: int
    """Newest checkpoint step the gang record says was made durable (-1: none)."""
    trained: frozenset[int]
    """Steps in the trained log (a gang trained and published them)."""
    batches: frozenset[int]
    """Durable steps after the loaded checkpoint whose batch is still in Redis."""

    @property
    def committed(self) -> int:
        return max(self.trained | {self.durable})


def resume_step(loaded: int | None, history: History) -> int:
    """The first step this gang trains, given the newest checkpoint that loaded (None: none).

    Raises:
        CheckpointLost: a checkpoint was durable but none loads, or the loaded one is older than
            the durable one and a batch in between is gone (those steps cannot be redone).
    """
    start = -1 if loaded is None else loaded
    if loaded is None and history.durable >= 0:
        raise CheckpointLost(f"checkpoint {history.durable} was durable but no checkpoint loads: "
                             f"refusing to train from random weights over {history.committed + 1} committed steps",
                             step=history.committed, durable=history.durable)
    missing = [s for s in range(start + 1, history.durable + 1) if s not in history.batches]
    if missing:
        raise CheckpointLost(f"checkpoint {history.durable} was durable but the newest that loads is {start}, "
                             f"and the batches of steps {missing} are gone: they cannot be redone",
                             step=history.committed, durable=history.durable)
    return start + 1


async def read_history(client: aioredis.Redis, job_id: str, record: GangRecord, loaded: int | None) -> History:
    """Read the trained log and the batches of durable steps a redo after ``loaded`` would need."""
    batches = BatchStore(client, job_id)
    trained = frozenset(int(e["step"]) for e in await batches.trained_log())
    start = -1 if loaded is None else loaded
    present = [s for s in range(start + 1, record.durable + 1) if await batches.get(s) is not None]
    return History(durable=record.durable, trained=trained, batches=frozenset(present))


class LoopFence:
    """``checkpoint.ManifestFence`` over a ``GangFence``: blocking calls from the upload thread,
    run on the trainer's event loop (where its Redis client lives)."""

    def __init__(self, fence: GangFence, loop: asyncio.AbstractEventLoop,
                 timeout_s: float = FENCE_TIMEOUT_S) -> None:
        self.fence = fence
        self.loop = loop
        self.timeout_s = timeout_s

    def admit(self, step: int) -> None:
        del step  # the fence is per gang, not per step
        asyncio.run_coroutine_threadsafe(self.fence.admit(), self.loop).result(self.timeout_s)

    def durable(self, step: int) -> None:
        asyncio.run_coroutine_threadsafe(self.fence.durable(step), self.loop).result(self.timeout_s)
