"""Test helpers that test modules import (``from support import eventually``).

Tests never sleep to wait for something: they poll a condition with a bounded
``eventually`` (or ``eventually_async``) that fails with the last observed problem.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Self, TypeVar

import nats
import pytest

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_INTERVAL_S = 0.02


SETUP_BESIDE_ENV = "ROBUSTRL_SETUP_BESIDE"
"""Set by ``scripts/test.sh``: the folder where the parts of the setup it runs beside the suite
leave their exit status (``<part>.rc``) and output (``<part>.log``)."""


def wait_for_setup(part: str, timeout_s: float = 600.0) -> str | None:
    """Wait for a part of the machine's setup that ``scripts/test.sh`` runs beside the suite
    (``vllm``: .venv-vllm; ``apt``: the Debian packages some tests need). Returns why it is not
    there (its failure, with the end of its output), or None: set up, or not run beside this
    session (then the caller's own checks say whether what it needs is there). The wait counts
    against the calling test's timeout unless its mark says ``func_only``."""
    where = os.environ.get(SETUP_BESIDE_ENV)
    if not where:
        return None
    rc = os.path.join(where, f"{part}.rc")
    try:  # (written once, renamed into place, when the part's setup has ended)
        eventually(lambda: os.path.exists(rc), timeout=timeout_s, interval=1.0, what=f"the {part} setup ended")
    except AssertionError:
        return f"the {part} setup was still running after {timeout_s:g} s"
    with open(rc) as f:
        code = f.read().strip()
    if code == "0":
        return None
    try:
        with open(os.path.join(where, f"{part}.log"), errors="replace") as f:
            tail = f.read()[-800:]
    except OSError:
        tail = "(no output)"
    return f"the {part} setup failed (exit {code}): {tail}"


class _Waited:
    """What a failed wait says besides the last value: the longest pause between two polls (a
    process that got no CPU, or a blocked event loop, for most of the wait: the condition was
    barely given a chance) and how far the wall clock moved against the monotonic one (a clock
    step during the wait, which code timing on ``time.time`` sees)."""

    def __init__(self) -> None:
        self.mono = self.prev = time.monotonic()
        self.wall = time.time()
        self.longest = 0.0

    def poll(self) -> float:
        now = time.monotonic()
        self.longest, self.prev = max(self.longest, now - self.prev), now
        return now

    def fail(self, what: str, timeout: float, last: object) -> AssertionError:
        step = (time.time() - self.wall) - (time.monotonic() - self.mono)
        return AssertionError(f"{what or 'condition'} not met after {timeout:.2f} s (last: {last!r}; "
                              f"longest pause between polls {self.longest:.2f} s; wall clock moved "
                              f"{step:+.2f} s against the monotonic one)")


def eventually(fn: Callable[[], T], *, timeout: float = DEFAULT_TIMEOUT_S,
               interval: float = DEFAULT_INTERVAL_S,
               retry_on: tuple[type[BaseException], ...] = (AssertionError,), what: str = "") -> T:
    """Call ``fn`` until it returns a truthy value without raising one of ``retry_on``.

    Returns:
        The first truthy value.
    Raises:
        AssertionError: still falsy / failing after ``timeout`` seconds (chained to the last error).
    """
    waited = _Waited()
    deadline = waited.mono + timeout
    last: object = None
    last_exc: BaseException | None = None
    while True:
        try:
            value = fn()
            if value:
                return value
            last, last_exc = value, None
        except retry_on as exc:
            last, last_exc = exc, exc
        if waited.poll() >= deadline:
            raise waited.fail(what, timeout, last) from last_exc
        time.sleep(interval)


async def eventually_async(fn: Callable[[], T | Awaitable[T]], *, timeout: float = DEFAULT_TIMEOUT_S,
                           interval: float = DEFAULT_INTERVAL_S,
                           retry_on: tuple[type[BaseException], ...] = (AssertionError,),
                           what: str = "") -> T:
    """Async ``eventually``: ``fn`` may be a plain or a coroutine function; polls with ``asyncio.sleep``."""
    waited = _Waited()
    deadline = waited.mono + timeout
    last: object = None
    last_exc: BaseException | None = None
    while True:
        try:
            value = fn()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return value  # type: ignore[return-value]
            last, last_exc = value, None
        except retry_on as exc:
            last, last_exc = exc, exc
        if waited.poll() >= deadline:
            raise waited.fail(what, timeout, last) from last_exc
        await asyncio.sleep(interval)


class BusObserver:
    """Records every message on some subjects of a job, with its arrival time, from a thread of
    its own (a raw view of the bus: what was really sent, not what a service says it sent)."""

    def __init__(self, url: str, subjects: list[str]) -> None:
        self.url, self.subjects = url, subjects
        self.seen: list[tuple[float, str, bytes]] = []
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        nc = await nats.connect(self.url)

        async def record(msg: Any) -> None:
            self.seen.append((time.time(), msg.subject, msg.data))

        for s in self.subjects:
            await nc.subscribe(s, cb=record)
        await nc.flush()
        self._ready.set()
        await self._stop.wait()
        await nc.close()

    def __enter__(self) -> Self:
        self._thread.start()
        assert self._ready.wait(10), "observer did not connect"
        return self

    def __exit__(self, *_exc: object) -> None:
        assert self._loop and self._stop
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


def raw_job_ids(redis_url: str) -> set[str]:
    """The job ids the controller's registry holds as it lies in Redis (a refused submission must
    leave none: one written before the refusal would be restored by the next leader)."""
    import redis as redis_sync

    from robustrl.storage.redis_stores import Keys

    r = redis_sync.Redis.from_url(redis_url)
    try:
        return {k.decode() for k in r.hkeys(Keys.jobs())}
    finally:
        r.close()


def raw_job_record(redis_url: str, job_id: str) -> dict[str, Any]:
    """The controller's durable record of ``job_id`` as it lies in Redis (not as any service
    reports it): what an auditor reads."""
    import json

    import redis as redis_sync

    from robustrl.storage.redis_stores import Keys

    r = redis_sync.Redis.from_url(redis_url)
    try:
        raw = r.hget(Keys.jobs(), job_id)
    finally:
        r.close()
    assert raw is not None, f"no record of {job_id} in Redis"
    return dict(json.loads(raw))


def lease_runs_out(redis_url: str) -> None:
    """A SIGKILLed leader's lease ends now rather than at its expiry (the suite waits for
    nothing): its key is deleted in Redis, as expiry deletes it. The fencing counter stays, so
    the next term's token is still larger than every earlier one."""
    import redis as redis_sync

    from robustrl.storage.redis_stores import Keys

    r = redis_sync.Redis.from_url(redis_url)
    try:
        r.delete(Keys.controller_lease())
    finally:
        r.close()


def leader_and_standby(stack: Any) -> str:
    """Check that the two-controller ``stack``'s 'controller' leads and 'controller-2' serves as
    its standby; return the standby's health URL."""
    import httpx

    assert stack.settings and stack.supervisor
    assert httpx.get(f"{stack.api_url}/healthz", timeout=10).json()["leading"] is True
    standby_health = stack.supervisor.specs["controller-2"].health_url
    assert standby_health
    eventually(lambda: httpx.get(standby_health, timeout=2).json()["leading"] is False, timeout=60, interval=0.1,
               retry_on=(httpx.HTTPError,), what="controller-2 serving as a standby")
    return str(standby_health)


def stop_ray_cluster(cluster: Any) -> None:
    """Stop a test Ray cluster and remove its temp dir; fail if a Ray process outlived it."""
    import shutil

    cluster.stop()
    left = cluster.leftovers()
    shutil.rmtree(cluster.temp_dir, ignore_errors=True)
    assert left == [], f"Ray processes left after teardown: {left}"


def take_testbed_down(tb: Any) -> None:
    """Take a test's testbed down; fail if anything of it is left."""
    from robustrl.testbed import leftovers

    tag = tb.state.tag
    tb.down()
    assert leftovers(tag) == [], f"left after down: {leftovers(tag)}"


def ended(pid: int) -> bool:
    """Whether process ``pid`` has ended: gone, or a zombie not reaped yet. Read from /proc in one
    go (``pid_exists`` then ``Process(pid)`` raced with the reaper: NoSuchProcess between them)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


RAY_WORKER_PORTS = range(10002, 20000)
"""Ray's default --min-worker-port / --max-worker-port: each Ray worker process's core worker
server listens on one (on every interface, in Ray 2.60)."""


def _hex_addr(field: str) -> tuple[str, int]:
    """An ``ADDR:PORT`` of /proc/net/tcp{,6} or udp{,6} (the address in host byte order words)."""
    import ipaddress

    addr, port = field.split(":")
    raw = bytes.fromhex(addr)
    # each 32-bit word is in the kernel's (little-endian) order
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(port, 16)


def wide_listeners(pids: list[int], allow: tuple[str, ...] = ()) -> list[tuple[int, str, str, int]]:
    """The sockets of processes ``pids`` and all their descendants that accept from beyond
    loopback: TCP listeners and unconnected UDP sockets whose local address is not a loopback
    one (127.0.0.0/8, ::1) nor in ``allow`` (a wildcard address is never allowed). Read from the
    kernel's socket tables of each process's own network namespace (``/proc/<pid>/net``), not
    from any config.

    Returns:
        (pid, process name, address, port) for each; [] when everything listens on loopback only.
    """
    import ipaddress

    import psutil

    procs: set[int] = set()
    for pid in pids:
        try:
            procs |= {pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))}
        except psutil.NoSuchProcess:
            continue
    out = []
    for pid in sorted(procs):
        try:
            inodes = set()
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        inodes.add(link[8:-1])
            if not inodes:
                continue
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
            for table in ("tcp", "tcp6", "udp", "udp6"):
                try:
                    with open(f"/proc/{pid}/net/{table}") as f:
                        rows = [line.split() for line in f.readlines()[1:]]
                except FileNotFoundError:
                    if table.endswith("6"):  # IPv6 off in this namespace: no such sockets
                        continue
                    raise
                for row in rows:
                    local, remote, state, inode = row[1], row[2], row[3], row[9]
                    if inode not in inodes:
                        continue
                    if table.startswith("tcp") and state != "0A":  # not LISTEN
                        continue
                    if table.startswith("udp") and _hex_addr(remote)[1] != 0:  # connected: its peer only
                        continue
                    ip, port = _hex_addr(local)
                    addr = ipaddress.ip_address(ip)
                    if not addr.is_loopback and (addr.is_unspecified or ip not in allow):
                        out.append((pid, name, ip, port))
        except (FileNotFoundError, ProcessLookupError):
            continue  # ended meanwhile (a process that cannot be read fails the check: PermissionError)
    return sorted(set(out))


@contextlib.contextmanager
def own_servers(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[Any]:
    """NATS, Redis and S3 servers of one test module alone (an ``EmbeddedInfra``, started), for a
    module whose tests restart them or hold what must not be shared (a lease, a detector)."""
    from robustrl.infra.embedded import EmbeddedInfra

    embedded = EmbeddedInfra(tmp_path_factory.mktemp(name))
    embedded.start()
    try:
        yield embedded
    finally:
        embedded.stop()


SAMPLER_FAILING_S = 30.0
"""A sampler whose Redis reads keep failing this long fails its test (shorter gaps are retried)."""
SAMPLED_STEPS = 64
"""More steps than any job of the suite runs: every batch of a job is sampled."""

_SAMPLERS: list[BatchSampler] = []
"""Samplers started by ``sample_batches`` and not stopped yet (the conftest stops them after each test)."""


class BatchSampler:
    """Samples every step's batch raw from Redis while a job runs, as the chaos campaign does at
    hand-off: the auditor judges a step whose keys were collected after its checkpoint became
    durable only from such a sample (otherwise it counts as ``steps_unverified``, and the step a
    fault hit usually goes unchecked). ``observed`` is the map for ``audit_job``.

    A background thread reads all batch keys in one MGET per ``interval_s`` and takes a full
    sample (``observe_batch``: the batch, its episodes and prefixes, the step's episode set) of
    each batch that appeared or changed (a step the request manager restarted is handed over
    again; the newest sample is kept, as in the campaign); ``stop`` takes one more pass."""

    def __init__(self, redis_url: str, job_id: str, steps: int = SAMPLED_STEPS, interval_s: float = 0.02) -> None:
        self.redis_url, self.job_id, self.steps, self.interval_s = redis_url, job_id, steps, interval_s
        self.observed: dict[int, Any] = {}
        self.torn: dict[int, int] = {}
        """Samples of a step that came back torn or empty (its batch gone or changed as it was read)."""
        self._stop = threading.Event()
        self.transient_errors = 0
        """Passes lost to a Redis timeout or connection error (each retried at the next pass)."""
        self._errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name=f"batches-{job_id}", daemon=True)

    def start(self) -> BatchSampler:
        self._thread.start()
        return self

    def stop(self) -> dict[int, Any]:
        """Take the last pass, end the thread; raise if sampling failed. Returns ``observed``."""
        self._stop.set()
        self._thread.join(timeout=10)
        with contextlib.suppress(ValueError):
            _SAMPLERS.remove(self)
        if self._thread.is_alive():  # its map may still change under the audit
            raise AssertionError(f"sampling {self.job_id}'s batches did not stop within 10 s")
        if self._errors:
            raise AssertionError(f"sampling {self.job_id}'s batches failed: {self._errors[0]!r}") \
                from self._errors[0]
        return self.observed

    def _run(self) -> None:
        try:
            asyncio.run(self._sample())
        except BaseException as exc:  # noqa: BLE001 - reported by stop()
            self._errors.append(exc)

    async def _sample(self) -> None:
        import redis.asyncio as aioredis

        from robustrl.audit import ObservedStep
        from robustrl.audit.raw import observe_batch
        from robustrl.storage.redis_stores import Keys

        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeout

        r = aioredis.from_url(self.redis_url, decode_responses=False)
        last: dict[int, bytes] = {}
        failing_since: float | None = None
        try:
            while True:
                final = self._stop.is_set()  # one more pass after the job
                try:
                    raws = await r.mget([Keys.batch(self.job_id, k) for k in range(self.steps)])
                    for step, raw in enumerate(raws):
                        if raw is None or last.get(step) == raw:
                            continue
                        seen = await observe_batch(self.redis_url, self.job_id, step, client=r)
                        if seen is not None:
                            self.observed[step] = ObservedStep(step, *seen)
                            last[step] = raw
                        else:
                            self.torn[step] = self.torn.get(step, 0) + 1
                    failing_since = None
                except (RedisTimeout, RedisConnectionError):
                    # A pass lost to a loaded machine (seen: a read over a testbed bridge timed
                    # out in a full run): the next pass samples what it missed while the batch is
                    # there; a step it never sees is unverified, not passed. Failing for long is an error.
                    self.transient_errors += 1
                    failing_since = failing_since or time.monotonic()
                    if final or time.monotonic() - failing_since > SAMPLER_FAILING_S:
                        raise
                if final:
                    return
                await asyncio.sleep(self.interval_s)  # a sampling period, not a wait for a condition
        finally:
            await r.aclose()


def sample_batches(redis_url: str, job_id: str, steps: int = SAMPLED_STEPS) -> BatchSampler:
    """Start sampling ``job_id``'s batches (right after its submission); ``audit_sampled`` stops
    it and audits. A sampler a failed test left running is stopped after the test."""
    sampler = BatchSampler(redis_url, job_id, steps).start()
    _SAMPLERS.append(sampler)
    return sampler


def stop_samplers() -> None:
    """Stop every sampler still running (the conftest calls this after each test)."""
    while _SAMPLERS:
        with contextlib.suppress(AssertionError):
            _SAMPLERS[-1].stop()  # removes itself, also when it raises


UNJUDGED_STEPS_MAX = 0
"""Steps of one job the audit may leave unjudged. Since the trainer records what it trained at each
commit (``robustrl.audit.trained``), a step whose keys were collected is judged by that record
even if the live sample missed it (a batch lives about 0.4 s between its hand-off and its
collection; sampled every 20 ms, one of 26 audited jobs' batches was missed in one full-suite
run). So none: a step left unjudged means a commit without its record (its event lost)."""


AUDIT_CONTROLLER_SLACK_S = 15.0
"""``AuditOptions.controller_outbox_slack_s`` of the suite's audits (``audit_sampled``)."""


def audit_sampled(settings: Any, job_id: str, sampler: BatchSampler, options: Any = None) -> Any:
    """The auditor over the raw stores with every step judged but at most ``UNJUDGED_STEPS_MAX``:
    those whose keys were collected after their checkpoint became durable from the sample taken
    while the job ran, and from the trainer's record of what it trained. Raises naming every
    violation, or the steps left unjudged past the bound (``steps_unverified``); those within it
    are printed."""
    from robustrl.audit import AuditOptions, audit_job

    observed = sampler.stop()
    if options is None:
        # The controller's events given more than this before the job's final one must be in the
        # log: the product's 60 s is longer than most of the suite's jobs, so no audit here could
        # fail on a controller event stuck in its outbox (an outside review). Its outbox drains
        # in well under a second; 15 s leaves a loaded machine's JetStream its stalls.
        options = AuditOptions(controller_outbox_slack_s=AUDIT_CONTROLLER_SLACK_S)
    report = audit_job(settings, job_id, options, observed=observed)
    if report.facts["steps_unverified"]:
        raw = report._raw  # type: ignore[attr-defined]
        recorded = {e.data.get("step") for e in raw.events if e.kind == "step_committed"
                    and isinstance(e.data.get("trained"), dict)}
        unjudged = [k for k in range(report.facts["final_step"] + 1) if k not in raw.redis.batches
                    and k not in observed and k not in recorded]
        print(f"audit of {job_id}: steps {unjudged} not judged (collected before a live sample, no trainer's "
              f"record; torn: {sampler.torn})")
        if report.facts["steps_unverified"] <= UNJUDGED_STEPS_MAX:
            return report
        raise AssertionError(f"steps {unjudged} of {job_id} were neither in Redis at the audit nor sampled "
                             f"live (samples torn by a collection, by step: {sampler.torn}); {report.facts}")
    return report


async def duplicate_window(nats_url: str, seconds: float) -> float:
    """Set the event stream's JetStream duplicate window (an hour in service; a test cuts it so that a
    second append under one message id is a second entry); return the one it had."""
    from robustrl.subjects import EVENTS_STREAM

    nc = await nats.connect(nats_url, connect_timeout=2, max_reconnect_attempts=0)
    try:
        js = nc.jetstream()
        config = (await js.stream_info(EVENTS_STREAM)).config
        before = float(config.duplicate_window or 120.0)
        config.duplicate_window = seconds
        await js.update_stream(config)
        return before
    finally:
        await nc.close()


@contextlib.contextmanager
def stack_with_failpoints(tmp_path_factory: pytest.TempPathFactory, name: str, armed: str) -> Iterator[Any]:
    """A stack of the module's own whose controller starts members with the member failpoints
    ``armed`` (``robustrl.member.FAILPOINTS_ENV``, e.g. ``point@job_name/member_id``, comma-separated)."""
    from robustrl.member import FAILPOINTS_ENV
    from robustrl.stack import Stack

    st = Stack(tmp_path_factory.mktemp(name), service_extra_env={"controller": {FAILPOINTS_ENV: armed}})
    st.start()
    try:
        yield st
    finally:
        st.stop()
