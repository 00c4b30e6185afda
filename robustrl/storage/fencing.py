"""The trainer gang's fence in Redis: every side effect of a gang carries its epoch, and Redis
refuses a write from an epoch older than the newest it has seen, atomically (one Lua script per
write: compare, then write).

The job's gang record (``Keys.gang``) is a hash: ``epoch``, the newest gang epoch seen by any fenced
write, and ``durable``/``durable_epoch``, the newest checkpoint made durable in the current lineage
and the gang that made it. A newer gang raises ``epoch`` with its first fenced write (``enter`` at
start); from then on every write of an older gang is refused with ``StaleEpoch`` and that gang
stops. Fenced here: entering, the checkpoint manifest (asked just before it is written) and its
durable record, batch claims, the trained log, and the weights pointer.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Literal

import redis.asyncio as aioredis

from robustrl.errors import StaleEpoch, StorageError
from robustrl.storage.redis_stores import Keys, _call

log = logging.getLogger(__name__)

# Shared prefix of every fenced script: KEYS[1] is the gang record, ARGV[1] the writer's epoch.
# Returns the newest epoch when the writer is older (refused), nil when it may write; a newer
# writer raises the record's epoch first, so from then on its predecessors are refused.
_GUARD = """
local epoch = tonumber(ARGV[1])
local cur = tonumber(redis.call('HGET', KEYS[1], 'epoch') or '-1')
if epoch < cur then return {0, cur} end
if epoch > cur then redis.call('HSET', KEYS[1], 'epoch', ARGV[1]) end
"""

_ENTER = _GUARD + """
return {1, tonumber(redis.call('HGET', KEYS[1], 'durable') or '-1')}
"""

_ADMIT = _GUARD + "return {1, epoch}"

# ARGV[2]: the step made durable. A newer gang's first record starts its own lineage (it may
# resume below the old durable step when that checkpoint no longer verifies); within one gang
# the durable step only grows.
_DURABLE = _GUARD + """
local step = tonumber(ARGV[2])
local by = tonumber(redis.call('HGET', KEYS[1], 'durable_epoch') or '-1')
local d = tonumber(redis.call('HGET', KEYS[1], 'durable') or '-1')
if epoch > by or step > d then
  redis.call('HSET', KEYS[1], 'durable', ARGV[2], 'durable_epoch', ARGV[1])
end
return {1, epoch}
"""

# KEYS[2]: the step's fence. Free -> take it; same epoch -> idempotent; a newer gang than the
# holder, when the holder's result never became durable (ARGV[2] durable < ARGV[3] step) -> redo;
# otherwise refuse: the batch would be trained twice in one durable lineage.
_CLAIM = _GUARD + """
local holder = redis.call('GET', KEYS[2])
if not holder then redis.call('SET', KEYS[2], ARGV[1]); return {1, epoch} end
if tonumber(holder) == epoch then return {1, epoch} end
if tonumber(holder) > epoch then return {0, tonumber(holder)} end
if tonumber(ARGV[2]) < tonumber(ARGV[3]) then redis.call('SET', KEYS[2], ARGV[1]); return {2, epoch} end
return {3, epoch}
"""

# Idempotent under the client's retry: a command whose reply was lost (a Redis restart) may have
# run, and the retry runs it again. An entry equal to the log's last (same step, gang and weights)
# is such a repeat; within one gang the steps only grow, so nothing else can look like one.
_APPEND = _GUARD + """
if redis.call('LINDEX', KEYS[2], -1) ~= ARGV[2] then redis.call('RPUSH', KEYS[2], ARGV[2]) end
return {1, epoch}
"""

# KEYS[3]: the trainer outbox; ARGV[3]: the step's commit event to save with the record ('' for
# none). Both or neither, once (the repeat check of _APPEND covers both).
_RECORD = _GUARD + """
if redis.call('LINDEX', KEYS[2], -1) ~= ARGV[2] then
  redis.call('RPUSH', KEYS[2], ARGV[2])
  if ARGV[3] ~= '' then redis.call('RPUSH', KEYS[3], ARGV[3]) end
end
return {1, epoch}
"""

_SET = _GUARD + "redis.call('SET', KEYS[2], ARGV[2]); return {1, epoch}"

# The trainer's own garbage: KEYS[2] the trained log, KEYS[3] the GC marker, KEYS[4..] the batch
# fences of steps through ARGV[2]. The fences go; the log is popped from its head while the step
# is <= ARGV[2] (appended in step order; a redo appends an older step later and goes once the
# head reaches it; a damaged head entry goes too, counted: stopping at it left the log untrimmed
# for the rest of the job); the marker moves on. Returns {1, epoch, damaged entries dropped}.
_COLLECT = _GUARD + """
for i = 4, #KEYS do redis.call('DEL', KEYS[i]) end
local bad = 0
while true do
  local head = redis.call('LINDEX', KEYS[2], 0)
  if not head then break end
  local ok, e = pcall(cjson.decode, head)
  if not ok or type(e) ~= 'table' or tonumber(e['step']) == nil then
    bad = bad + 1
  elseif tonumber(e['step']) > tonumber(ARGV[2]) then
    break
  end
  redis.call('LPOP', KEYS[2])
end
local done = tonumber(redis.call('GET', KEYS[3]) or '-1') or -1
if tonumber(ARGV[2]) > done then redis.call('SET', KEYS[3], ARGV[2]) end
return {1, epoch, bad}
"""

# Fences deleted per script call (a marker far behind, e.g. lost, is caught up in slices).
_COLLECT_SLICE = 256

Claim = Literal["new", "redo", "refused"]


@dataclass(frozen=True)
class GangRecord:
    """The job's gang record as stored."""

    epoch: int
    """Newest gang epoch any fenced write has carried (-1: none yet)."""
    durable: int
    """Newest durable checkpoint step of the current lineage (-1: none)."""


class GangFence:
    """The fenced writes of trainer gang ``epoch`` of one job.

    Every method raises ``StaleEpoch`` (and writes nothing) when a newer gang has written.
    """

    def __init__(self, client: aioredis.Redis, job_id: str, epoch: int) -> None:
        if epoch < 0:
            raise ValueError("epoch must be >= 0")
        self.r = client
        self.job = job_id
        self.epoch = epoch
        self.key = Keys.gang(job_id)
        self._recorded: list[int] = []
        """The last two steps this gang recorded durable (its resume step first)."""
        self._resumed_at: int | None = None
        """The first step it recorded durable (its resume step), until a collection reached the
        marker it found: a gang resumed below the marker (checkpoints that failed to verify)
        claims fences again that the marker says are collected, and its collections delete from
        its resume step until then."""
        self._scripts = {name: client.register_script(src) for name, src in (
            ("enter", _ENTER), ("admit", _ADMIT), ("durable", _DURABLE), ("claim", _CLAIM),
            ("append", _APPEND), ("record", _RECORD), ("set", _SET), ("collect", _COLLECT))}

    async def _run(self, name: str, what: str, keys: list[str], *args: Any) -> list[int]:
        res = await _call(self._scripts[name](keys=[self.key, *keys], args=[str(self.epoch), *map(str, args)]),
                          keys[0] if keys else self.key)
        if len(res) < 2:
            # (a Lua nil ends the reply: the record's epoch or durable step is not a number)
            raise StorageError(f"gang record {self.key} is damaged (epoch or durable not a number): "
                               f"gang {self.epoch} cannot {what}", key=self.key)
        out = [int(v) for v in res]
        if out[0] == 0:
            raise StaleEpoch(f"gang {self.epoch} may not {what}: gang {out[1]} has taken over", epoch=self.epoch,
                             newest=out[1], key=keys[0] if keys else self.key)
        return out

    async def enter(self) -> GangRecord:
        """Announce this gang (raising the record's epoch); return the record it found."""
        durable = (await self._run("enter", "start", []))[1]
        return GangRecord(self.epoch, durable)

    async def admit(self) -> None:
        """Check that no newer gang has written (asked just before a checkpoint manifest)."""
        await self._run("admit", "publish a checkpoint", [])

    async def durable(self, step: int) -> None:
        """Record ``step`` as the newest durable checkpoint of this gang's lineage."""
        await self._run("durable", f"record checkpoint {step} durable", [], step)
        if not self._recorded or step > self._recorded[-1]:
            if not self._recorded:
                self._resumed_at = step
            self._recorded = [*self._recorded[-1:], step]

    async def collect(self) -> int:
        """Delete this gang's keys no resume can need any more: the batch fences and trained-log
        entries of every step through the durable checkpoint before the newest one this gang
        recorded (its resume step, at first). One checkpoint's steps more are kept, as the
        request manager keeps their batches (``RolloutGC``): the newest checkpoint may fail its
        verification when a new gang loads it, and that gang redoes the steps after the one before
        it, claiming their fences again. Returns the step collected through (-1: nothing yet).

        Raises:
            StaleEpoch: a newer gang has written (nothing deleted).
            TransportError: Redis failed (the next call catches up: a marker says how far).
        """
        if len(self._recorded) < 2:
            return -1
        through = self._recorded[0]
        marker = Keys.fence_gc(self.job)
        raw = await _call(self.r.get(marker), marker)
        try:
            done = int(raw) if raw is not None else -1
        except ValueError:
            done = -1  # damaged: deleting from the start again deletes nothing twice
        marked = done
        if self._resumed_at is not None:
            done = min(done, self._resumed_at)
        while done < through:
            upto = min(through, done + _COLLECT_SLICE)
            fences = [Keys.fence(self.job, s) for s in range(done + 1, upto + 1)]
            bad = (await self._run("collect", f"collect through step {upto}",
                                   [Keys.trained_log(self.job), marker, *fences], upto))[2]
            if bad:
                log.warning("%s: %d damaged entries dropped with step %d's", Keys.trained_log(self.job), bad, upto)
            done = upto
        if through >= marked:  # past the old marker: every fence claimed again is covered
            self._resumed_at = None
        return through

    async def claim(self, step: int, durable_step: int) -> Claim:
        """May this gang train batch ``step``, given its newest durable checkpoint?

        Returns ``"new"`` (first claim, or ours already), ``"redo"`` (an older gang's result never
        became durable) or ``"refused"`` (trained in this durable lineage already).
        """
        code = (await self._run("claim", f"claim batch {step}", [Keys.fence(self.job, step)], durable_step, step))[0]
        return {1: "new", 2: "redo", 3: "refused"}[code]  # type: ignore[return-value]

    async def record_trained(self, step: int, checksum: str, commit: str = "") -> None:
        """Append to the trained log (the auditor checks no batch is trained twice per lineage),
        and in the same script save ``commit`` (the stored text of the step's ``step_committed``
        outbox entry) in the trainer outbox: a rank killed before JetStream stored the event leaves
        it for the next gang to append."""
        entry = json.dumps({"step": step, "epoch": self.epoch, "checksum": checksum})
        await self._run("record", f"record step {step} trained",
                        [Keys.trained_log(self.job), Keys.trainer_outbox(self.job)], entry, commit)

    async def set_pointer(self, announce_json: bytes | str) -> None:
        """Point late joiners at this gang's newest announced weights."""
        payload = announce_json.decode() if isinstance(announce_json, bytes) else announce_json
        await self._run("set", "set the weights pointer", [Keys.weights_latest(self.job)], payload)


async def read_gang(client: aioredis.Redis, job_id: str) -> GangRecord:
    """The job's gang record (for readers: resume checks, rollout GC, the auditor).

    Raises:
        TransportError: Redis failed.
        StorageError: a field is not an integer (the record is damaged: named, not a ValueError
            that ended the task reading it).
    """
    key = Keys.gang(job_id)
    raw = await _call(client.hmget(key, ["epoch", "durable"]), key)
    try:
        return GangRecord(*(int(v) if v is not None else -1 for v in raw))
    except ValueError as exc:
        raise StorageError(f"corrupt gang record at {key}: {raw!r} ({exc})", key=key) from exc
