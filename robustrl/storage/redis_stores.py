"""Durable rollout state in Redis: episodes, tool-turn prefixes, batches and the batch fence.

Every key is built in :class:`Keys`; nothing else in the code base writes a Redis key. The
control plane's records (job registry, event outboxes) are in :mod:`.control_stores`.
The tool-turn prefix of an episode is saved *before* its next turn is dispatched, so a
replica that dies mid-turn costs at most that one turn.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from redis.exceptions import RedisError, WatchError

from robustrl.errors import StorageError, Superseded, TransportError
from robustrl.subjects import _TOKEN

log = logging.getLogger(__name__)

EpisodeStatus = Literal["pending", "generating", "tool_wait", "finished"]


class TurnRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["assistant", "tool"]
    token_ids: list[int]
    logprobs: list[float] = Field(default_factory=list)
    weights_version: int = -1
    weights_checksum: str | None = None  # of the weights the turn was made with (the replica's word)
    stop_reason: str | None = None
    member_id: str | None = None
    request_id: str | None = None  # the dispatch that produced an assistant turn (idempotency, audit)


class EpisodeRecord(BaseModel):
    """One episode: its prompt, the turns so far, and (once finished) its reward."""

    model_config = ConfigDict(extra="forbid")
    job_id: str
    episode_id: str
    step: int
    group_id: str
    prompt: dict[str, Any]
    prompt_ids: list[int]
    turns: list[TurnRecord] = Field(default_factory=list)
    status: EpisodeStatus = "pending"
    reward: float | None = None
    redispatches: int = 0
    tokens_discarded: int = 0

    def prefix_ids(self) -> list[int]:
        ids = list(self.prompt_ids)
        for turn in self.turns:
            ids.extend(turn.token_ids)
        return ids


class BatchRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")
    job_id: str
    step: int
    episode_ids: list[str]
    reward_mean: float
    timings: dict[str, float] = Field(default_factory=dict)


class Keys:
    """The one place Redis keys are spelled."""

    @staticmethod
    def episode(job: str, episode_id: str) -> str:
        return f"rrl:{job}:ep:{episode_id}"

    @staticmethod
    def prefix(job: str, episode_id: str) -> str:
        return f"rrl:{job}:prefix:{episode_id}"

    @staticmethod
    def step_episodes(job: str, step: int) -> str:
        return f"rrl:{job}:step:{step}:episodes"

    @staticmethod
    def batch(job: str, step: int) -> str:
        return f"rrl:{job}:batch:{step}"

    @staticmethod
    def step_restarts(job: str) -> str:
        """Counter of the request manager's step restarts and lives (``restart_step`` INCRs it
        before it looks at what the restarted step left, a runner before its first step): a
        step's writes (its episodes, its hand-over) are made only while it holds the value the
        step's attempt began under (``BatchStore.restart_guard``, ``transact``)."""
        return f"rrl:{job}:rm:restarts"

    @staticmethod
    def fence(job: str, step: int) -> str:
        return f"rrl:{job}:fence:{step}"

    @staticmethod
    def trained_log(job: str) -> str:
        return f"rrl:{job}:trained"

    @staticmethod
    def weights_latest(job: str) -> str:
        return f"rrl:{job}:weights:latest"

    @staticmethod
    def gang(job: str) -> str:
        """Hash: newest trainer-gang epoch seen, newest durable checkpoint step (storage.fencing)."""
        return f"rrl:{job}:gang"

    @staticmethod
    def rm_outbox(job: str) -> str:
        """The request manager's events acknowledged and not yet in the job's log (a list)."""
        return f"rrl:{job}:rm:outbox"

    @staticmethod
    def controller_outbox(job: str) -> str:
        """The controller's events not yet in the job's log (a list; ``ControllerOutbox``)."""
        return f"rrl:{job}:controller:outbox"

    @staticmethod
    def detector_outbox(job: str) -> str:
        """The detector's events of a job not yet in its log (a list; ``DetectorOutbox``)."""
        return f"rrl:{job}:detector:outbox"

    @staticmethod
    def trainer_outbox(job: str) -> str:
        """Rank 0's ``step_committed`` events of a job not yet in its log (a list;
        ``TrainerOutbox``), each saved with the training record it announces."""
        return f"rrl:{job}:trainer:outbox"

    @staticmethod
    def rollout_outbox(job: str) -> str:
        """The rollout replicas' events of a job not yet in its log (``weights_loaded``,
        ``weights_rejected``; a list, ``RolloutOutbox``), shared by the job's replicas."""
        return f"rrl:{job}:rollout:outbox"

    @staticmethod
    def rm_outbox_pattern() -> str:
        """SCAN pattern of every job's request-manager outbox (a starting request manager appends
        what any job's outbox still holds)."""
        return Keys.rm_outbox("*")

    @staticmethod
    def detector_marks(job: str) -> str:
        """What the detector must remember of each member across its own restart (a hash:
        member -> ``2 * times re-armed + reported``; ``JobMonitor.mark``)."""
        return f"rrl:{job}:detector:marks"

    @staticmethod
    def detector_outbox_pattern() -> str:
        """SCAN pattern of every job's detector outbox (a starting detector appends what any job's
        outbox still holds: it watches every job)."""
        return Keys.detector_outbox("*")

    @staticmethod
    def job_of_rm_outbox(key: bytes | str) -> str | None:
        """The job whose outbox ``key`` is, or None for a key of the pattern that names no valid
        job id (the pattern's ``*`` matches ``:`` too, and any client may write such a key)."""
        return _job_in(key, Keys.rm_outbox)

    @staticmethod
    def job_of_detector_outbox(key: bytes | str) -> str | None:
        """The job whose detector outbox ``key`` is, or None (as ``job_of_rm_outbox``)."""
        return _job_in(key, Keys.detector_outbox)

    @staticmethod
    def job_pattern(job: str) -> str:
        """SCAN pattern of every key of one job (the auditor sizes and reads them raw)."""
        return f"rrl:{job}:*"

    @staticmethod
    def jobs() -> str:
        return "rrl:jobs"

    @staticmethod
    def controller_lease() -> str:
        """The controller leader lease: ``<owner>:<fencing token>``, with an expiry."""
        return "rrl:controller:lease"

    @staticmethod
    def controller_fence() -> str:
        """Counter of controller fencing tokens (INCR: each lease term gets a larger one)."""
        return "rrl:controller:fence"

    @staticmethod
    def faults_handled(job: str) -> str:
        """Fault ids the controller has handled for a job (at-least-once delivery, handled once)."""
        return f"rrl:{job}:faults:handled"

    @staticmethod
    def dispatches(job: str) -> str:
        """Hash episode id -> the turn dispatched for it and not yet applied (request manager)."""
        return f"rrl:{job}:dispatch"

    @staticmethod
    def rollout_gc(job: str) -> str:
        """Newest step whose rollout state the request manager has deleted (its checkpoint is durable)."""
        return f"rrl:{job}:rm:gc"

    @staticmethod
    def fence_gc(job: str) -> str:
        """Newest step whose batch fence and trained-log entries the trainer has deleted (the
        checkpoint after it is durable too; ``GangFence.collect``)."""
        return f"rrl:{job}:trainer:gc"


def _job_in(key: bytes | str, build: Callable[[str], str]) -> str | None:
    """The job id ``key`` was built from by ``build``, or None if it is not such a key or names no
    valid job id."""
    text = key.decode(errors="replace") if isinstance(key, bytes) else key
    head, _, tail = build("\0").partition("\0")
    if not (text.startswith(head) and text.endswith(tail) and len(text) > len(head) + len(tail)):
        return None
    job = text[len(head):len(text) - len(tail)]
    return job if _TOKEN.fullmatch(job) else None


REDIS_RETRIES = 40
"""Retries of one command on a connection error; with the backoff below about 30 s in all, so a
Redis restart (the embedded server reloads its AOF in well under a second) costs a pause, not a job."""
REDIS_BACKOFF_BASE_S = 0.05
REDIS_BACKOFF_CAP_S = 1.0
REDIS_SOCKET_TIMEOUT_S = 5.0
"""One command's read on a connection that went dead (a host lost, a partition): set here, not
left to redis-py, whose default was no timeout at all before 8.0 (every call not wrapped in a
deadline of its own would then block for good). No command of this project blocks on purpose."""


WRITE_REFUSALS = frozenset({"NOREPLICAS", "MISCONF", "READONLY", "OOM", "MASTERDOWN", "TRYAGAIN"})
"""Error replies of a Redis that refuses writes for a while (too few replicas, a failed
snapshot, a replica promoted or demoted, memory full): the command was not carried out, so it
is retried like a connection error. Not retried, one of them failed the trainer gang's per-step
batch claim, and the rank exited: a whole trainer recovery for a few seconds of refusal (an
outside review)."""


def _retried(exc: BaseException) -> bool:
    """Whether the client's retry layer repeats a failed command: on a connection error, a
    timeout, a server still loading, or a write refusal (``WRITE_REFUSALS``); never on another
    error reply (a wrong type, a script error: it would fail again)."""
    from redis import exceptions as rexc

    if not isinstance(exc, rexc.ResponseError):
        return True
    if isinstance(exc, (rexc.ReadOnlyError, rexc.OutOfMemoryError, rexc.MasterDownError, rexc.TryAgainError)):
        return True
    return str(exc).split(" ", 1)[0] in WRITE_REFUSALS


def connect(url: str) -> aioredis.Redis:
    """An asyncio Redis client (lazy: the first command connects). Every command and script is
    retried on connection errors, timeouts and write refusals (``_retried``) with exponential
    backoff and full jitter, reconnecting in between: redis-py's own retry layer, the one place a
    call can be repeated on a fresh connection. (A pipeline is retried on connection errors
    only: its error replies are raised after it ran.)"""
    from redis import exceptions as rexc
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialWithJitterBackoff

    retry = Retry(ExponentialWithJitterBackoff(cap=REDIS_BACKOFF_CAP_S, base=REDIS_BACKOFF_BASE_S),
                  REDIS_RETRIES, supported_errors=(rexc.ConnectionError, rexc.TimeoutError, rexc.BusyLoadingError,
                                                   rexc.ResponseError),
                  is_retryable=_retried)
    return aioredis.from_url(url, decode_responses=False, socket_connect_timeout=5.0,
                             socket_timeout=REDIS_SOCKET_TIMEOUT_S, health_check_interval=10, retry=retry)


async def _call(coro: Any, what: str) -> Any:
    try:
        return await coro
    except RedisError as exc:
        raise TransportError(f"redis {what} failed: {exc}", key=what) from exc


def _retried_in_transaction(exc: BaseException) -> bool:
    """``_retried`` for an error of a transaction: a command refused in it is named after
    redis-py's own words ("Command # 1 (SET ...) of pipeline caused error: NOREPLICAS ...")."""
    return _retried(exc) or str(exc).split("caused error: ", 1)[-1].split(" ", 1)[0] in WRITE_REFUSALS


GUARD_TRIES = 5
"""Attempts at a guarded transaction whose watched guard was written meanwhile yet still holds."""


@dataclass(frozen=True)
class Guard:
    """Writes made only while ``key`` holds ``expected`` (as GET returns it: None for no key), from
    before their transaction is sent until it runs (WATCH). A writer that moves the guard on
    (INCR) before it looks at what those writes would leave is sure that a transaction sent
    earlier and run late by the server, after its sender was cancelled, writes nothing."""

    key: str
    expected: bytes | None


async def transact(client: aioredis.Redis, writes: Callable[[Any], None], what: str,
                   guard: Guard | None = None) -> None:
    """``writes`` (added to a pipeline) in one MULTI/EXEC; with ``guard``, only while it holds.

    Guarded, the transaction is retried here, not by the client's retry layer (which turns any
    error while a key is watched into a ``WatchError``): a Redis error the layer would have
    retried (``_retried``: connection lost, timeout, write refused) is retried with its backoff
    and budget, each time with the guard looked at again; another error is raised at once.

    Raises:
        Superseded: the guard had moved on. Nothing was written by this call, unless an earlier
            attempt of it ran and only its reply was lost.
        TransportError: Redis failed.
    """
    if guard is None:
        pipe = client.pipeline(transaction=True)
        writes(pipe)
        await _call(pipe.execute(), what)
        return
    from redis.backoff import ExponentialWithJitterBackoff

    backoff = ExponentialWithJitterBackoff(cap=REDIS_BACKOFF_CAP_S, base=REDIS_BACKOFF_BASE_S)
    changed = failed = 0
    while True:
        try:
            async with client.pipeline(transaction=True) as pipe:
                await pipe.watch(guard.key)
                held = await pipe.get(guard.key)
                if held != guard.expected:
                    raise Superseded(f"{guard.key} is {held!r}, not {guard.expected!r}: {what} not written")
                pipe.multi()
                writes(pipe)
                await pipe.execute()
                return
        except WatchError as exc:
            cause = None if exc.__suppress_context__ else exc.__context__
            if cause is None:  # the guard was written meanwhile: looked at again
                changed += 1
                if changed >= GUARD_TRIES:
                    raise TransportError(f"redis {what}: {guard.key} was written {changed} times during it, "
                                         f"unchanged each time", key=what) from exc
                continue
            if not _retried_in_transaction(cause):
                raise TransportError(f"redis {what} failed: {cause}", key=what) from cause
            failed += 1
            if failed > REDIS_RETRIES:
                raise TransportError(f"redis {what} failed {failed} times, the last: {cause}", key=what) from cause
            await asyncio.sleep(backoff.compute(failed))
        except RedisError as exc:
            raise TransportError(f"redis {what} failed: {exc}", key=what) from exc


def _load(model: type[BaseModel], raw: bytes, key: str) -> Any:
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise StorageError(f"corrupt record at {key}: {exc.errors()[0]['msg']}", key=key) from exc


class EpisodeStore:
    """Episodes and their tool-turn prefixes. ``guard``: what ``put`` and ``save_prefix`` are made
    under (the request manager's step-restart count: ``BatchStore.restart_guard``)."""

    def __init__(self, client: aioredis.Redis, job_id: str) -> None:
        self.r = client
        self.job = job_id
        self.guard: Guard | None = None

    async def put(self, ep: EpisodeRecord) -> None:
        def writes(pipe: Any) -> None:
            pipe.set(Keys.episode(self.job, ep.episode_id), ep.model_dump_json())
            pipe.sadd(Keys.step_episodes(self.job, ep.step), ep.episode_id)

        await transact(self.r, writes, Keys.episode(self.job, ep.episode_id), self.guard)

    async def get(self, episode_id: str) -> EpisodeRecord | None:
        key = Keys.episode(self.job, episode_id)
        raw = await _call(self.r.get(key), key)
        return None if raw is None else _load(EpisodeRecord, raw, key)

    async def get_many(self, episode_ids: list[str]) -> list[EpisodeRecord]:
        if not episode_ids:
            return []
        keys = [Keys.episode(self.job, e) for e in episode_ids]
        raws = await _call(self.r.mget(keys), "mget episodes")
        out = []
        for key, raw in zip(keys, raws, strict=True):
            if raw is None:
                raise StorageError(f"episode missing: {key}", key=key)
            out.append(_load(EpisodeRecord, raw, key))
        return out

    async def assistant_tokens(self, episode_ids: list[str]) -> int:
        """Assistant tokens saved in these episodes' records: what dropping them loses. A record
        missing or corrupt counts nothing (logged): a count must not stop what drops them.

        Raises:
            TransportError: Redis failed.
        """
        if not episode_ids:
            return 0
        keys = [Keys.episode(self.job, e) for e in episode_ids]
        total = 0
        for key, raw in zip(keys, await _call(self.r.mget(keys), "mget episodes"), strict=True):
            try:
                ep = None if raw is None else _load(EpisodeRecord, raw, key)
            except StorageError as exc:
                log.warning("%s: its tokens not counted", exc)
                continue
            total += 0 if ep is None else sum(len(t.token_ids) for t in ep.turns if t.role == "assistant")
        return total

    async def step_episode_ids(self, step: int) -> list[str]:
        key = Keys.step_episodes(self.job, step)
        return sorted(m.decode() for m in await _call(self.r.smembers(key), key))

    async def clear_step(self, step: int) -> int:
        """Forget a step's episodes (whole-job restart regenerates the step from scratch)."""
        ids = await self.step_episode_ids(step)
        keys = [Keys.episode(self.job, e) for e in ids] + [Keys.prefix(self.job, e) for e in ids]
        keys.append(Keys.step_episodes(self.job, step))
        await _call(self.r.delete(*keys), f"clear step {step}")
        return len(ids)

    async def save_prefix(self, ep: EpisodeRecord) -> None:
        """Persist the episode's whole prefix after a tool turn (the unit of rollout recovery)."""
        key = Keys.prefix(self.job, ep.episode_id)
        payload = json.dumps({"n_turns": len(ep.turns), "episode": ep.model_dump(mode="json")})

        def writes(pipe: Any) -> None:
            pipe.set(key, payload)
            pipe.set(Keys.episode(self.job, ep.episode_id), ep.model_dump_json())

        await transact(self.r, writes, key, self.guard)

    async def load_prefix(self, episode_id: str) -> EpisodeRecord | None:
        key = Keys.prefix(self.job, episode_id)
        raw = await _call(self.r.get(key), key)
        if raw is None:
            return None
        try:
            return EpisodeRecord.model_validate(json.loads(raw)["episode"])
        except (ValueError, KeyError, ValidationError) as exc:
            raise StorageError(f"corrupt prefix at {key}", key=key) from exc


class DispatchStore:
    """Turns dispatched and not yet applied, one per episode, so that a restarted request manager
    adopts a turn whose replica still works on it instead of generating it twice."""

    def __init__(self, client: aioredis.Redis, job_id: str) -> None:
        self.r = client
        self.key = Keys.dispatches(job_id)
        self.job = job_id
        self.guard: Guard | None = None  # what ``applied`` is made under (as ``EpisodeStore.guard``)

    async def record(self, episode_id: str, entry: dict[str, Any]) -> None:
        await _call(self.r.hset(self.key, episode_id, json.dumps(entry)), self.key)

    async def applied(self, ep: EpisodeRecord) -> None:
        """Save the episode with its new turn and forget the dispatch, atomically."""
        def writes(pipe: Any) -> None:
            pipe.set(Keys.episode(self.job, ep.episode_id), ep.model_dump_json())
            pipe.hdel(self.key, ep.episode_id)

        await transact(self.r, writes, self.key, self.guard)

    async def forget(self, episode_ids: list[str]) -> None:
        if episode_ids:
            await _call(self.r.hdel(self.key, *episode_ids), self.key)

    async def all(self) -> dict[str, dict[str, Any]]:
        out = {}
        for k, v in (await _call(self.r.hgetall(self.key), self.key)).items():
            try:
                entry = json.loads(v)
            except ValueError:
                continue  # damaged: the turn is simply dispatched again
            if isinstance(entry, dict):  # (JSON of another shape: damaged too)
                out[k.decode()] = entry
        return out


class RolloutGC:
    """Deletes a step's rollout state once the checkpoint that consumed it is durable: episodes,
    prefixes, the step's episode set, pending dispatches and the batch. Redis then holds only what
    recovery can still need. The trainer's keys of the step (its batch fence, its trained-log
    entries) are the trainer's to delete (``GangFence.collect``): the request manager may not
    write them."""

    def __init__(self, client: aioredis.Redis, job_id: str) -> None:
        self.r = client
        self.job = job_id

    async def collected(self) -> int:
        """Newest step already deleted (-1 if none)."""
        raw = await _call(self.r.get(Keys.rollout_gc(self.job)), Keys.rollout_gc(self.job))
        return -1 if raw is None else int(raw)

    async def collect(self, step: int) -> int:
        """Delete every rollout key of ``step``; returns the number of episodes deleted.
        Idempotent."""
        j = self.job
        ids = [m.decode() for m in await _call(self.r.smembers(Keys.step_episodes(j, step)), f"gc {step}")]
        keys = [Keys.episode(j, e) for e in ids] + [Keys.prefix(j, e) for e in ids]
        keys += [Keys.step_episodes(j, step), Keys.batch(j, step)]
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(*keys)
        if ids:
            pipe.hdel(Keys.dispatches(j), *ids)
        pipe.set(Keys.rollout_gc(j), str(step))
        await _call(pipe.execute(), f"gc step {step}")
        return len(ids)


class BatchStore:
    """Finished batches (kept until the checkpoint that consumed them is durable) and the trained
    log. The trainer's writes (batch claims, the trained log) are fenced: ``storage.fencing``."""

    def __init__(self, client: aioredis.Redis, job_id: str) -> None:
        self.r = client
        self.job = job_id

    async def put(self, batch: BatchRecord) -> None:
        key = Keys.batch(self.job, batch.step)
        await _call(self.r.set(key, batch.model_dump_json()), key)

    def put_in(self, pipe: Any, batch: BatchRecord) -> None:
        """``put``, added to a transaction of the caller's (``pipe``: a Redis pipeline)."""
        pipe.set(Keys.batch(self.job, batch.step), batch.model_dump_json())

    async def restart_guard(self) -> Guard:
        """The step-restart counter as it stands (None before the first restart): what a step's
        writes are made under (its episodes, its hand-over)."""
        key = Keys.step_restarts(self.job)
        return Guard(key, await _call(self.r.get(key), key))

    async def restarted(self) -> None:
        """Move the step-restart counter on: every write guarded by an older value is refused from
        the moment this returns, also one already sent and run late by the server."""
        key = Keys.step_restarts(self.job)
        await _call(self.r.incr(key), key)

    async def get(self, step: int) -> BatchRecord | None:
        key = Keys.batch(self.job, step)
        raw = await _call(self.r.get(key), key)
        return None if raw is None else _load(BatchRecord, raw, key)

    async def delete(self, step: int) -> None:
        await _call(self.r.delete(Keys.batch(self.job, step)), Keys.batch(self.job, step))

    async def trained_log(self) -> list[dict[str, Any]]:
        """The trained log's entries that parse (a damaged one is skipped with a warning: it is
        the auditor's to report, and raised it failed every new gang's resume for good)."""
        key = Keys.trained_log(self.job)
        out = []
        for raw in await _call(self.r.lrange(key, 0, -1), key):
            entry = _trained_entry(raw)
            if entry is None:
                log.warning("%s: an entry that does not parse skipped: %r", key, raw[:200])
            else:
                out.append(entry)
        return out

    async def newest_trained(self, min_epoch: int, tail: int = 64) -> int:
        """The newest step a gang of epoch >= ``min_epoch`` recorded trained (-1 if none), from the
        log's last ``tail`` entries: the durable record of what commit messages announce."""
        key = Keys.trained_log(self.job)
        newest = -1
        for raw in await _call(self.r.lrange(key, -tail, -1), key):
            entry = _trained_entry(raw)  # (a damaged one is the auditor's to report, not a reason to stall)
            if entry is not None and entry["epoch"] >= min_epoch:
                newest = max(newest, entry["step"])
        return newest


def _trained_entry(raw: bytes) -> dict[str, Any] | None:
    """A trained-log entry with its step and epoch as ints; None when it does not parse."""
    try:
        entry = json.loads(raw)
        return {**entry, "step": int(entry["step"]), "epoch": int(entry["epoch"])}
    except (ValueError, KeyError, TypeError):
        return None


class WeightsPointer:
    """The latest announced weights version, so a late joiner finds it without the trainer."""

    def __init__(self, client: aioredis.Redis, job_id: str) -> None:
        self.r = client
        self.key = Keys.weights_latest(job_id)

    async def get(self) -> bytes | None:
        """The announcement (set only by a gang's fenced write: ``GangFence.set_pointer``)."""
        return await _call(self.r.get(self.key), self.key)
