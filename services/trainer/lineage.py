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
import logging
import threading
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from robustrl.errors import CheckpointLost, StorageError
from robustrl.storage.fencing import GangFence, GangRecord
from robustrl.storage.redis_stores import BatchStore

log = logging.getLogger(__name__)

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
    present = [s for s in range(start + 1, record.durable + 1) if await _readable_batch(batches, s)]
    return History(durable=record.durable, trained=trained, batches=frozenset(present))


async def _readable_batch(batches: BatchStore, step: int) -> bool:
    """Whether batch ``step`` is in Redis and reads. A damaged record is as good as gone: the
    step cannot be redone from it (``resume_step`` names it); raised, it failed every resume with
    a bare traceback. Redis failing (``TransportError``) propagates."""
    try:
        return await batches.get(step) is not None
    except StorageError as exc:
        log.error("batch %d cannot be read: %s", step, exc)
        return False


RECORD_WAIT_S = 120.0
"""How long a checkpoint's manifest waits for its step to be recorded trained (the record comes
after the step's version is published, whose event may wait up to its 30 s budget)."""


class RecordGate:
    """Holds a step's checkpoint manifest until rank 0 has recorded the step trained, with its
    ``step_committed`` saved in the trainer outbox (``GangFence.record_trained``).

    The manifest is what makes a step durable: the next gang resumes after it and never trains
    the step again. Written before the record (the upload runs in the background while the
    version is published), a rank killed in between left a durable step with no training record
    and no ``step_committed`` anywhere (found by the ``published_unrecorded`` failpoint)."""

    def __init__(self, timeout_s: float = RECORD_WAIT_S) -> None:
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._step = -1
        self._closed = False

    def recorded(self, step: int) -> None:
        with self._cond:
            self._step = max(self._step, step)
            self._cond.notify_all()

    def close(self) -> None:
        """The worker stops: no step will be recorded any more; a manifest waiting fails now
        (else a stop or a hand-off waited for the upload for nothing)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wait(self, step: int) -> None:
        """Block until ``step`` is recorded.

        Raises:
            TimeoutError: not recorded within ``timeout_s``, or the gate closed first (the
                checkpoint is then not made durable: its upload fails).
        """
        with self._cond:
            self._cond.wait_for(lambda: self._step >= step or self._closed, self.timeout_s)
            if self._step < step:
                why = "the worker stopped first" if self._closed else f"not within {self.timeout_s:g} s"
                raise TimeoutError(f"step {step} not recorded trained ({why}): its checkpoint is not made durable")


class LoopFence:
    """``checkpoint.ManifestFence`` over a ``GangFence``: blocking calls from the upload thread,
    run on the trainer's event loop (where its Redis client lives). With a ``gate``, a step's
    manifest also waits for the step's training record (``RecordGate``)."""

    def __init__(self, fence: GangFence, loop: asyncio.AbstractEventLoop,
                 timeout_s: float = FENCE_TIMEOUT_S, gate: RecordGate | None = None) -> None:
        self.fence = fence
        self.loop = loop
        self.timeout_s = timeout_s
        self.gate = gate
        self.hold: dict[int, float] = {}
        """Test-only (the member failpoint ``final_upload_slow``): step -> seconds its manifest
        waits, as behind a slow object store."""

    def admit(self, step: int) -> None:
        if step in self.hold:
            time.sleep(self.hold[step])
        if self.gate is not None:
            self.gate.wait(step)
        asyncio.run_coroutine_threadsafe(self.fence.admit(), self.loop).result(self.timeout_s)

    def durable(self, step: int) -> None:
        asyncio.run_coroutine_threadsafe(self.fence.durable(step), self.loop).result(self.timeout_s)
        # The steps a resume can no longer need lose their fences and trained-log entries. Best
        # effort: the checkpoint is durable whatever happens here, and the next one catches up.
        try:
            asyncio.run_coroutine_threadsafe(self.fence.collect(), self.loop).result(self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - garbage left is collected with the next checkpoint
            log.warning("collecting the fences and trained log after checkpoint %d failed: %s", step, exc)
