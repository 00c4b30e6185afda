"""Raw readers for the auditor: the JetStream event log, the job's Redis keys, the S3 listing
(``robustrl.audit.checkpoint_scan``, re-exported here).

Nothing here asks a RobustRL service anything or uses the services' store classes: the event
log is read from the stream with a consumer of our own, Redis values are read as bytes and
parsed with ``json`` alone, and every checkpoint blob is fetched and hashed. Parsing is
minimal on purpose: a value that does not parse is kept as ``None`` and reported by the checks,
never repaired.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import nats
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from robustrl import subjects
from robustrl.aio import within
from robustrl.audit.checkpoint_scan import RawCheckpoint, job_prefix, scan_checkpoints, scan_origins
from robustrl.bus import redact_url
from robustrl.errors import MessageError, TransportError
from robustrl.messages import loads_bounded
from robustrl.storage.redis_stores import Keys

__all__ = ["RawCheckpoint", "RawEpisode", "RawEvent", "RawRedis", "job_prefix", "observe_batch", "read_event_log",
           "read_redis", "redis_job_bytes", "scan_checkpoints", "scan_origins"]

CONNECT_TIMEOUT_S = 5.0
"""How long to wait for NATS or Redis."""
FETCH_TIMEOUT_S = 10.0
"""How long one fetch of the event log may wait for messages the stream said it holds."""
FETCH_BATCH = 1024


@dataclass(frozen=True)
class RawEvent:
    """One event-log entry, parsed as JSON only. ``seq`` is the stream sequence (log order)."""

    seq: int
    kind: str
    ts: float
    data: dict[str, Any]


@dataclass
class RawEpisode:
    """An episode record as stored (``None`` fields: the value did not parse)."""

    key: str
    value: dict[str, Any] | None


@dataclass
class RawRedis:
    """Everything the auditor needs from Redis, read once."""

    keys: list[str] = field(default_factory=list)
    """Every key of the job (``rrl:<job>:*``)."""
    bytes_by_key: dict[str, int] = field(default_factory=dict)
    batches: dict[int, dict[str, Any] | None] = field(default_factory=dict)
    """step -> batch record (None: the key exists but does not parse)."""
    episodes: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    """episode id -> record, for every episode a batch or a step set names (missing: absent)."""
    prefixes: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    step_sets: dict[int, set[str]] = field(default_factory=dict)
    """step -> the members of its episode set (``Keys.step_episodes``), for steps whose set exists."""
    trained: list[dict[str, Any] | None] = field(default_factory=list)
    """The raw trained log, one entry per list element, in order."""
    trained_in_order: bool = True
    """Whether ``trained`` is in append order (a list; a hash or sorted set is not)."""
    outbox: list[Any] | None = None
    """The request manager's outbox (``Keys.rm_outbox``), each entry parsed as JSON (None: it does
    not parse); None: not read."""
    controller_outbox: list[Any] | None = None
    """The controller's outbox (``Keys.controller_outbox``), read the same way."""
    detector_outbox: list[Any] | None = None
    """The detector's outbox (``Keys.detector_outbox``), read the same way."""
    trainer_outbox: list[Any] | None = None
    """The trainer's outbox (``Keys.trainer_outbox``: rank 0's commit events), read the same way."""
    rollout_outbox: list[Any] | None = None
    """The rollout replicas' outbox (``Keys.rollout_outbox``: their weight load events), read the
    same way."""
    weights_pointer: dict[str, Any] | None = None
    step_keys: dict[int, list[str]] = field(default_factory=dict)
    """step -> keys that belong to that step (batch, fence, episode set, episodes, prefixes)."""
    fences: dict[int, int | None] = field(default_factory=dict)
    """step -> the gang epoch holding the step's batch claim (``Keys.fence``; None: its value does
    not parse), for steps whose fence is still in Redis."""
    fences_collected: int | None = None
    """Newest step whose fence the trainer has deleted (``Keys.fence_gc``; -1: none, or the
    marker does not parse); read after the fences, so a collection in between only moves it on.
    None: not read, or the job's gang record is gone too (then no fence is required of a trained
    step)."""
    fence_marker_damaged: bool = False
    """The trainer's fence collection marker is there and does not parse (``fences_collected`` is
    then None: which claims should still be there cannot be told)."""

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_key.values())


def _json(raw: bytes | str | None) -> Any:
    if raw is None:
        return None
    try:  # bounded: garbage in the log (deep nesting) must not blow the auditor's stack
        return loads_bounded(raw, what="stored value")
    except MessageError:
        return None


# -- event log --------------------------------------------------------------------------------------


async def read_event_log(nats_url: str, job_id: str, *, fetch_timeout_s: float = FETCH_TIMEOUT_S) -> list[RawEvent]:
    """Every event of ``job_id`` in the JetStream stream, in stream order, read to its end.

    The consumer is created first and asked how many messages match; the read stops once that
    many have arrived (never on a quiet period), so a long log is never truncated.

    Raises:
        TransportError: NATS unreachable, the stream missing, or a fetch got nothing for
            ``fetch_timeout_s`` while messages were still due.
    """
    async def _quiet(_exc: Exception) -> None:
        return None  # the outcome is the TransportError below, not a traceback per attempt

    try:
        # Bounded: nats-py's initial connect to a refused port retried forever here (the compose
        # test's auditor hung 25 min on a NATS URL it could not reach).
        nc = await within(
            nats.connect(servers=[nats_url], name="auditor", connect_timeout=CONNECT_TIMEOUT_S,
                         allow_reconnect=False, max_reconnect_attempts=0, error_cb=_quiet),
            CONNECT_TIMEOUT_S * 3)
    except Exception as exc:  # nats raises several unrelated types here; TimeoutError from the bound
        raise TransportError(f"auditor cannot connect to NATS at {redact_url(nats_url)}: {exc!r}") from exc
    try:
        js = nc.jetstream()
        try:
            sub = await js.pull_subscribe(
                subjects.events_of(job_id), durable=None, stream=subjects.EVENTS_STREAM,
                config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.EXPLICIT))
        except Exception as exc:
            raise TransportError(f"event stream {subjects.EVENTS_STREAM} unavailable: {exc}") from exc
        try:
            due = (await sub.consumer_info()).num_pending
            out: list[RawEvent] = []
            while len(out) < due:
                try:
                    msgs = await sub.fetch(min(FETCH_BATCH, due - len(out)), timeout=fetch_timeout_s)
                except (TimeoutError, NatsTimeout) as exc:
                    raise TransportError(f"event log of {job_id}: {len(out)} of {due} events after "
                                         f"{fetch_timeout_s:.0f}s") from exc
                for msg in msgs:
                    await msg.ack()
                    body = _json(msg.data)
                    body = body if isinstance(body, dict) else {}
                    ts, data = body.get("ts"), body.get("data")
                    out.append(RawEvent(seq=msg.metadata.sequence.stream, kind=str(body.get("kind", "?")),
                                        ts=float(ts) if isinstance(ts, int | float) and math.isfinite(ts) else 0.0,
                                        data=data if isinstance(data, dict) else {}))
            out.sort(key=lambda e: e.seq)
            return out
        finally:
            await sub.unsubscribe()
    finally:
        await nc.close()


# -- Redis ------------------------------------------------------------------------------------------


async def read_redis(redis_url: str, job_id: str, steps: int) -> RawRedis:
    """Read the job's keys raw: every batch, episode set, episode and prefix of steps < ``steps``,
    the trained log, the weights pointer, and the size of every key of the job.

    Raises:
        TransportError: Redis unreachable.
    """
    import redis.asyncio as aioredis
    from redis.exceptions import RedisError

    r = aioredis.from_url(redis_url, decode_responses=False, socket_connect_timeout=CONNECT_TIMEOUT_S,
                          socket_timeout=CONNECT_TIMEOUT_S)
    out = RawRedis()
    try:
        keys = sorted([k.decode() async for k in r.scan_iter(match=Keys.job_pattern(job_id), count=1000)])
        out.keys = keys
        pipe = r.pipeline(transaction=False)
        for k in keys:
            pipe.memory_usage(k)
        out.bytes_by_key = {k: int(v or 0) for k, v in zip(keys, await pipe.execute(), strict=True)}

        # The trained log before the fences, and the trainer's collection marker after them: a step
        # trained (claimed first) while this reads has its fence in the read, or the marker past it.
        trained_key = Keys.trained_log(job_id)
        kind = (await r.type(trained_key)).decode()
        if kind == "list":
            out.trained = [_json(x) for x in await r.lrange(trained_key, 0, -1)]
        elif kind == "hash":  # one record per field (a fenced log keyed by step)
            out.trained = [_json(v) for _f, v in sorted((await r.hgetall(trained_key)).items())]
            out.trained_in_order = False
        elif kind == "zset":
            out.trained = [_json(m) for m in await r.zrange(trained_key, 0, -1)]
            out.trained_in_order = False

        pipe = r.pipeline(transaction=False)
        for k in range(steps):
            pipe.get(Keys.batch(job_id, k))
            pipe.smembers(Keys.step_episodes(job_id, k))
            pipe.get(Keys.fence(job_id, k))
        res = _unreadable_as_garbage(await pipe.execute(raise_on_error=False))
        ids_by_step: dict[int, set[str]] = {}
        for k in range(steps):
            raw_batch, members, fence = res[3 * k], res[3 * k + 1], res[3 * k + 2]
            ids = {m.decode() for m in members} if isinstance(members, set) else set()
            if ids:
                out.step_sets[k] = set(ids)
            step_keys = []
            if raw_batch is not None:
                batch = _json(raw_batch)
                out.batches[k] = batch if isinstance(batch, dict) else None
                step_keys.append(Keys.batch(job_id, k))
                if isinstance(batch, dict) and isinstance(batch.get("episode_ids"), list):
                    ids |= {str(e) for e in batch["episode_ids"]}
            if members:
                step_keys.append(Keys.step_episodes(job_id, k))
            if fence is not None:
                step_keys.append(Keys.fence(job_id, k))
                out.fences[k] = _epoch(fence)
            ids_by_step[k] = ids
            out.step_keys[k] = step_keys

        every = sorted({e for ids in ids_by_step.values() for e in ids})
        pipe = r.pipeline(transaction=False)
        for eid in every:
            pipe.get(Keys.episode(job_id, eid))
            pipe.get(Keys.prefix(job_id, eid))
        res = _unreadable_as_garbage(await pipe.execute(raise_on_error=False))
        present = set()
        for i, eid in enumerate(every):
            ep, prefix = res[2 * i], res[2 * i + 1]
            if ep is not None:
                value = _json(ep)
                out.episodes[eid] = value if isinstance(value, dict) else None
                present.add(Keys.episode(job_id, eid))
            if prefix is not None:
                value = _json(prefix)
                out.prefixes[eid] = value if isinstance(value, dict) else None
                present.add(Keys.prefix(job_id, eid))
        for k, ids in ids_by_step.items():
            out.step_keys[k].extend(key for eid in sorted(ids)
                                    for key in (Keys.episode(job_id, eid), Keys.prefix(job_id, eid))
                                    if key in present)

        marker, gang = _unreadable_as_garbage(await r.pipeline(transaction=False).get(
            Keys.fence_gc(job_id)).exists(Keys.gang(job_id)).execute(raise_on_error=False))
        if marker is None:
            # none collected yet; no gang record either: the job's Redis state is gone (deleted
            # with its log kept, or Redis lost), and nothing can be said of its claims
            out.fences_collected = -1 if gang else None
        else:
            out.fences_collected = _epoch(marker) if marker else None
            out.fence_marker_damaged = out.fences_collected is None

        out.outbox = await _read_outbox(r, Keys.rm_outbox(job_id))
        out.controller_outbox = await _read_outbox(r, Keys.controller_outbox(job_id))
        out.detector_outbox = await _read_outbox(r, Keys.detector_outbox(job_id))
        out.trainer_outbox = await _read_outbox(r, Keys.trainer_outbox(job_id))
        out.rollout_outbox = await _read_outbox(r, Keys.rollout_outbox(job_id))
        [pointer] = _unreadable_as_garbage(await r.pipeline(transaction=False).get(
            Keys.weights_latest(job_id)).execute(raise_on_error=False))
        out.weights_pointer = _json(pointer) if pointer is not None else None
    except RedisError as exc:
        raise TransportError(f"auditor: redis read failed: {exc}") from exc
    finally:
        await r.aclose()
    return out


def _unreadable_as_garbage(results: list[Any]) -> list[Any]:
    """A key of another type than the services write (WRONGTYPE) is read as a value that does not
    parse: it is reported where it stands, and the rest of the job is still judged (before, one
    such key ended the whole audit with a transport error)."""
    from redis.exceptions import RedisError, ResponseError

    for x in results:  # any other error (NOPERM, OOM, READONLY...) is the store failing, not the job
        if isinstance(x, RedisError) and not (isinstance(x, ResponseError) and str(x).startswith("WRONGTYPE")):
            raise x
    return [b"" if isinstance(x, ResponseError) else x for x in results]


def _epoch(raw: bytes) -> int | None:
    try:
        value = int(raw)
    except ValueError:
        return None
    return value if value >= 0 else None


async def _read_outbox(r: Any, key: str) -> list[Any]:
    """An outbox list's entries parsed as JSON (None for one that does not parse, and one None for
    a key of another type: nothing can be appended from it)."""
    kind = (await r.type(key)).decode()
    entries = [_json(x) for x in await r.lrange(key, 0, -1)] if kind == "list" else []
    if kind not in ("list", "none"):
        entries.append(None)
    return entries


async def observe_batch(redis_url: str, job_id: str, step: int, client: Any = None,
                        ) -> tuple[Any, dict[str, Any], dict[str, Any], set[str] | None] | None:
    """(batch, episodes, prefixes, step set) of ``step`` read raw right now (the campaign samples
    each batch at hand-off, so the audit can still judge steps whose keys were collected later):
    episodes of the batch and of the step's episode set, the set's members (None: no set). None
    when the batch key is absent: nothing was seen (a batch that does not parse is
    ``(None, {}, {}, set)``). ``client``: an open connection to read through (a sampler's own,
    kept open: a batch lives about half a second), else one is opened for this read."""
    import redis.asyncio as aioredis
    from redis.exceptions import RedisError

    r = client or aioredis.from_url(redis_url, decode_responses=False, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                    socket_timeout=CONNECT_TIMEOUT_S)
    try:
        raw = await r.get(Keys.batch(job_id, step))
        if raw is None:
            return None
        batch = _json(raw)
        members = {m.decode() for m in await r.smembers(Keys.step_episodes(job_id, step))}
        named = batch.get("episode_ids") if isinstance(batch, dict) else None
        ids = sorted({str(e) for e in named} | members) if isinstance(named, list) else sorted(members)
        eps: dict[str, Any] = {}
        pre: dict[str, Any] = {}
        if ids:
            raws = await r.mget([Keys.episode(job_id, e) for e in ids])
            eps = {e: _json(v) for e, v in zip(ids, raws, strict=True) if v is not None}
            raws = await r.mget([Keys.prefix(job_id, e) for e in ids])
            pre = {e: _json(v) for e, v in zip(ids, raws, strict=True) if v is not None}
        # The step's keys go in one transaction (RolloutGC.collect): the batch still there, as
        # read first, means none of what was read since was collected. Otherwise the sample is
        # torn (episodes gone between the reads, an outside review found): nothing was seen.
        if await r.get(Keys.batch(job_id, step)) != raw:
            return None
        return batch, eps, pre, members or None
    except RedisError as exc:
        raise TransportError(f"auditor: redis read failed: {exc}") from exc
    finally:
        if client is None:
            await r.aclose()


async def redis_job_bytes(redis_url: str, job_id: str) -> tuple[int, int]:
    """(key count, bytes) of the job's keys right now (MEMORY USAGE summed over SCAN)."""
    import redis.asyncio as aioredis
    from redis.exceptions import RedisError

    r = aioredis.from_url(redis_url, decode_responses=False, socket_connect_timeout=CONNECT_TIMEOUT_S,
                          socket_timeout=CONNECT_TIMEOUT_S)
    try:
        keys = [k async for k in r.scan_iter(match=Keys.job_pattern(job_id), count=1000)]
        pipe = r.pipeline(transaction=False)
        for k in keys:
            pipe.memory_usage(k)
        return len(keys), sum(int(v or 0) for v in await pipe.execute())
    except RedisError as exc:
        raise TransportError(f"auditor: redis read failed: {exc}") from exc
    finally:
        await r.aclose()
