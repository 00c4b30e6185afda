"""Least privilege: each role's NATS, Redis and S3 credentials allow what it owns and nothing else.

The policy checks (first half) are pure: they read the permission table the servers are
configured from and assert the rules of issue 11 on it. The server checks (second half) try every
publish, subscribe and Redis command with each role's real credentials against the session's
embedded servers, and count what the server let through, seen from an unrestricted subscriber.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import typing
import uuid
from pathlib import Path
from urllib.parse import urlparse

import httpx
import nats
import psutil
import pytest
import redis
from minio import Minio
from minio.error import InvalidResponseError, S3Error
from support import eventually, wide_listeners

from robustrl import subjects
from robustrl.config import Settings
from robustrl.infra.credentials import CREDENTIAL_VARS, REDIS_ACCESS, S3_ROLES, Credentials, role_settings
from robustrl.launcher.zygote import fork_start_enabled
from robustrl.messages import EventKind
from robustrl.storage.redis_stores import Keys
from robustrl.subjects import EVENT_OWNERS, Principal, Verb, permissions

ROLES = list(Principal)
JOB = "permjob-" + uuid.uuid4().hex[:6]
MEMBER = "m1"
SUBSCRIBE_ROUNDS = 8


def _matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` one token, ``>`` one or more trailing tokens."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


def _allowed(patterns: list[str], subject: str) -> bool:
    return any(_matches(p, subject) for p in patterns)


def probe_subjects() -> list[str]:
    out = []
    for verb in Verb:
        out += [subjects.subject(JOB, verb), subjects.subject(JOB, verb, MEMBER)]
    for kind in EVENT_OWNERS:
        out += [f"rrl.events.{JOB}.{role.value}.{kind}" for role in Principal]
        out.append(f"rrl.events.{JOB}.{kind}")  # the old shape, without the writer's role
    out += ["$JS.API.STREAM.INFO.RRL_EVENTS", "_INBOX.someone-elses-reply", "other.subject"]
    return out


# --- the policy, on the table itself ----------------------------------------------------------


def test_every_verb_and_event_kind_has_owners():
    assert set(subjects.VERB_ACCESS) == set(Verb)
    assert set(EVENT_OWNERS) == set(typing.get_args(EventKind))
    for verb, (pubs, subs) in subjects.VERB_ACCESS.items():
        assert pubs and subs, f"{verb} has no publisher or no subscriber"


@pytest.mark.parametrize("role", ROLES)
def test_only_the_controller_publishes_control_exit_and_member_chaos(role):
    publish, _ = permissions(role)
    for subj in (subjects.subject(JOB, Verb.CONTROL), subjects.subject(JOB, Verb.CONTROL, "request_manager"),
                 subjects.subject(JOB, Verb.EXIT, MEMBER)):
        assert _allowed(publish, subj) == (role is Principal.CONTROLLER), (role, subj)
    assert not _allowed(publish, subjects.subject(JOB, Verb.EXIT))
    # A member's chaos subject: the controller only. The harness asks the controller.
    assert _allowed(publish, subjects.subject(JOB, Verb.CHAOS, MEMBER)) == (role is Principal.CONTROLLER)
    assert _allowed(publish, subjects.subject(JOB, Verb.CHAOS)) == (role is Principal.HARNESS)
    # Fault reports: the detector, and the request manager when a step's deadline passes.
    assert _allowed(publish, subjects.subject(JOB, Verb.FAULT)) == (
        role in (Principal.DETECTOR, Principal.REQUEST_MANAGER))
    assert _allowed(publish, "$JS.API.STREAM.DELETE.RRL_EVENTS") == (role is Principal.CONTROLLER)


@pytest.mark.parametrize("role", ROLES)
def test_a_role_writes_only_the_event_kinds_it_owns_under_its_own_name(role):
    publish, _ = permissions(role)
    for kind, owners in EVENT_OWNERS.items():
        for writer in Principal:
            allowed = _allowed(publish, f"rrl.events.{JOB}.{writer.value}.{kind}")
            assert allowed == (writer is role and role in owners), (role, writer, kind)
        assert not _allowed(publish, f"rrl.events.{JOB}.{kind}")


def test_the_rollout_role_in_particular():
    publish, subscribe = permissions(Principal.ROLLOUT)
    for forbidden in (Verb.CONTROL, Verb.FAULT, Verb.EXIT, Verb.CHAOS, Verb.GENERATE, Verb.BATCH,
                      Verb.COMMIT, Verb.WEIGHTS, Verb.PROBE):
        assert not _allowed(publish, subjects.subject(JOB, forbidden, MEMBER))
        assert not _allowed(publish, subjects.subject(JOB, forbidden))
    assert not _allowed(subscribe, f"rrl.events.{JOB}.controller.decision")
    assert not _allowed(subscribe, subjects.subject(JOB, Verb.FAULT))
    # No trainer event: the auditor reads each gang's resume step from ``member_ready``, which a
    # replica could write (an outside review; only trainer ranks send it, borrowed ones too).
    for kind in ("member_ready", "step_committed", "weights_published", "role_switched"):
        assert not _allowed(publish, f"rrl.events.{JOB}.rollout.{kind}"), kind
    assert REDIS_ACCESS[Principal.ROLLOUT] is not None and "%R~" in REDIS_ACCESS[Principal.ROLLOUT]
    assert Principal.ROLLOUT not in S3_ROLES and Principal.DETECTOR not in S3_ROLES


# --- the servers enforce it -------------------------------------------------------------------


@pytest.fixture(scope="module")
def creds(infra: Settings) -> Credentials:
    assert infra.credentials_file, "the embedded infra must generate role credentials"
    return Credentials.load(infra.credentials_file)


async def _publish_sweep(infra: Settings, role_url: str, probes: list[str], sentinel: str
                         ) -> tuple[set[str], str | None]:
    """Publish every probe with the role's credentials; return the probes an unrestricted
    subscriber received (the sentinel, allowed, is published last: order is kept per connection),
    and why the sweep is incomplete (None: the sentinel came back)."""
    admin_events: list[str] = []

    async def admin_error(exc: Exception) -> None:
        admin_events.append(f"admin error: {exc!r}")

    async def admin_gone() -> None:
        admin_events.append("admin disconnected")

    admin = await nats.connect(infra.nats_url, connect_timeout=2, max_reconnect_attempts=0,
                               error_cb=admin_error, disconnected_cb=admin_gone)
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    role = await nats.connect(role_url, connect_timeout=2, max_reconnect_attempts=0, error_cb=on_error)
    got: set[str] = set()
    done = asyncio.Event()

    async def on_msg(msg: typing.Any) -> None:
        if msg.data == b"sentinel":
            done.set()
        elif msg.data.startswith(b"probe:"):
            got.add(msg.data[len(b"probe:"):].decode())

    incomplete = None
    try:
        for pattern in ("rrl.>", "$JS.API.>", "_INBOX.someone-elses-reply", "other.subject"):
            await admin.subscribe(pattern, cb=on_msg)
        await admin.flush()
        for subj in probes:
            await role.publish(subj, b"probe:" + subj.encode())
        await role.publish(sentinel, b"sentinel")
        await role.flush()
        try:
            await asyncio.wait_for(done.wait(), 30.0)
        except TimeoutError:
            incomplete = (f"the sentinel did not come back in 30 s ({len(got)} probes had); admin closed: "
                          f"{admin.is_closed}, role closed: {role.is_closed}; {admin_events[-3:]}; "
                          f"role errors: {len(errors)}, last {errors[-1:]}")
        # Each of the admin's subscriptions runs its callbacks in a task of its own: the sentinel's
        # can come before probes another subscription still holds, which drain (not close) delivers.
        if not admin.is_closed:
            await admin.drain()
    finally:
        await role.close()
        if not admin.is_closed:
            await admin.close()
    refused = {p for p in probes if p not in got}
    if refused and incomplete is None:
        assert any("ermission" in e for e in errors), "refused publishes were not reported to the client"
    return got, incomplete


@pytest.mark.parametrize("role", ROLES)
def test_nats_refuses_every_publish_outside_the_role(infra, creds, role):
    url = role_settings(infra, creds, role).nats_url
    publish, _ = permissions(role)
    probes = probe_subjects()
    sentinel = next(p for p in probes if _allowed(publish, p) and p.startswith("rrl.") and "events" not in p)
    # A sweep whose sentinel never came back (seen once on CI: 30 s without it) is done again,
    # twice at most; what it delivered still counts, so a forbidden subject it let through fails.
    got: set[str] = set()
    why: list[str] = []
    for _ in range(3):
        more, incomplete = asyncio.run(_publish_sweep(infra, url, probes, sentinel))
        got |= more
        if incomplete is None:
            break
        why.append(incomplete)
    else:
        pytest.fail(f"no complete publish sweep in 3: {why}")
    # An allowed publish missing from the sweep is published again (twice at most): a refusal is
    # the same every time, while a message dropped on its way (seen once in a full suite: 19
    # allowed subjects missing, the sentinel after them delivered) is not.
    for _ in range(2):
        missing = [p for p in probes if _allowed(publish, p) and p not in got and not p.startswith("$JS")]
        if not missing:
            break
        more, _incomplete = asyncio.run(_publish_sweep(infra, url, missing, sentinel))
        got |= more
    accepted_forbidden = sorted(p for p in got if not _allowed(publish, p))
    refused_allowed = sorted(p for p in probes if _allowed(publish, p) and p not in got
                             and not p.startswith("$JS"))
    assert not accepted_forbidden, f"{role.value} could publish {accepted_forbidden}"
    assert not refused_allowed, f"{role.value} could not publish {refused_allowed}"
    assert len(got) < len(probes) // 4  # every role is refused most of the protocol


async def _subscribe_sweep(infra: Settings, role_url: str, probes: list[str], expected: set[str]) -> set[str]:
    admin = await nats.connect(infra.nats_url, connect_timeout=2, max_reconnect_attempts=0)
    async def quiet(exc: Exception) -> None:  # the refused subscriptions are reported here
        pass

    role = await nats.connect(role_url, connect_timeout=2, max_reconnect_attempts=0, error_cb=quiet)
    got: set[str] = set()
    done = asyncio.Event()
    sentinel = "_INBOX.sentinel-" + uuid.uuid4().hex

    async def on_msg(msg: typing.Any) -> None:
        if msg.subject == sentinel:
            done.set()
        else:
            got.add(msg.subject)

    try:
        for subj in [*probes, sentinel]:
            await role.subscribe(subj, cb=on_msg)
        await role.flush()
        # nats-server 2.15 sometimes leaves a fresh connection's subscriptions out of the routing
        # of messages published within moments of its SUBs (after its PONG; seen in 1 of ~4 runs
        # right after another test: the server's own out_msgs count stops short, and the same
        # publish a moment later is delivered). So the probes go out again, in rounds, until the
        # sentinel arrives and every subscription the role may hold (``expected``) has had one
        # (the sentinel's own routing says nothing of the others': in one full run the sentinel
        # came in the first round with some allowed probes still undelivered). A forbidden
        # subscription never receives one in any round.
        for _ in range(SUBSCRIBE_ROUNDS):
            done.clear()
            for subj in probes:
                await admin.publish(subj, b"x")
            await admin.publish(sentinel, b"x")
            await admin.flush()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(done.wait(), 1.0)
            if done.is_set() and expected <= got:
                break
        assert done.is_set(), f"the sentinel was not delivered in {SUBSCRIBE_ROUNDS} rounds"
        # Every subscription hands its messages to a callback task of its own, so the sentinel's
        # callback can run while other subscriptions still hold the probes that came before it:
        # drain (not close) processes every delivered message before the connection goes.
        await role.drain()
    finally:
        if not role.is_closed:
            await role.close()
        await admin.close()
    return got


@pytest.mark.parametrize("role", ROLES)
def test_nats_delivers_only_the_subjects_a_role_may_subscribe_to(infra, creds, role):
    url = role_settings(infra, creds, role).nats_url
    _, subscribe = permissions(role)
    probes = [p for p in probe_subjects() if p.startswith("rrl.")]
    got = asyncio.run(_subscribe_sweep(infra, url, probes, {p for p in probes if _allowed(subscribe, p)}))
    assert not sorted(p for p in got if not _allowed(subscribe, p)), f"{role.value} received forbidden subjects"
    assert got == {p for p in probes if _allowed(subscribe, p)}


# --- Redis ------------------------------------------------------------------------------------


def _redis(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=2)


async def _trainer_collects(url: str, job: str) -> None:
    from robustrl.storage.fencing import GangFence
    from robustrl.storage.redis_stores import connect

    r = connect(url)
    try:
        fence = GangFence(r, job, 1)
        assert await fence.claim(0, -1) == "new"
        await fence.durable(0)
        await fence.durable(2)
        assert await fence.collect() == 0
    finally:
        await r.aclose()


def test_redis_acl_per_role(infra, creds):
    job = "acl-" + uuid.uuid4().hex[:6]
    admin = _redis(infra.redis_url)
    admin.set(f"rrl:{job}:weights:latest", b"{}")
    admin.hset("rrl:jobs", "acl-probe", "{}")

    trainer = _redis(role_settings(infra, creds, Principal.TRAINER).redis_url)
    admin.set(f"rrl:{job}:batch:3", b"b")
    admin.set(f"rrl:{job}:prefix:e1", b"p")
    assert trainer.get(f"rrl:{job}:batch:3") == b"b" and trainer.get(f"rrl:{job}:prefix:e1") == b"p"
    assert trainer.eval("return redis.call('incr', KEYS[1])", 1, f"rrl:{job}:fence:3") == 1
    trainer.set(f"rrl:{job}:weights:latest", b"{}")
    # What the request manager makes, the trainer only reads: it could delete the prefixes rollout
    # recovery resumes from, or the batches (an outside review).
    for forbidden in (lambda: trainer.set(f"rrl:{job}:batch:3", b"x"), lambda: trainer.delete(f"rrl:{job}:prefix:e1"),
                      lambda: trainer.set(f"rrl:{job}:ep:e1", b"x"), lambda: trainer.sadd(f"rrl:{job}:step:3:episodes", "e"),
                      lambda: trainer.hset(Keys.dispatches(job), "e1", "{}"), lambda: trainer.rpush(Keys.rm_outbox(job), b"x"),
                      lambda: trainer.sadd(Keys.faults_handled(job), "x")):
        with pytest.raises(redis.exceptions.ResponseError):
            forbidden()
    assert admin.get(f"rrl:{job}:batch:3") == b"b" and admin.get(f"rrl:{job}:prefix:e1") == b"p"
    for forbidden in (lambda: trainer.hset("rrl:jobs", "x", "1"), lambda: trainer.get("rrl:controller:lease"),
                      lambda: trainer.flushall(), lambda: trainer.config_get("*"), lambda: trainer.keys("*"),
                      lambda: trainer.eval("return redis.call('get', 'rrl:jobs')", 0)):
        with pytest.raises(redis.exceptions.ResponseError):  # NoPermissionError is a ResponseError
            forbidden()

    rollout = _redis(role_settings(infra, creds, Principal.ROLLOUT).redis_url)
    assert rollout.get(f"rrl:{job}:weights:latest") == b"{}"
    # A replica's events until JetStream stored them: its job's rollout outbox, written (RPUSH),
    # read (LRANGE) and emptied (LREM); nothing else is new.
    outbox = Keys.rollout_outbox(job)
    assert rollout.rpush(outbox, b"e1", b"e2") == 2 and rollout.lrange(outbox, 0, -1) == [b"e1", b"e2"]
    assert rollout.lrem(outbox, 1, b"e1") == 1 and rollout.lrem(outbox, 1, b"e1") == 0
    for forbidden in (lambda: rollout.set(f"rrl:{job}:weights:latest", b"x"),
                      lambda: rollout.get(f"rrl:{job}:ep:e1"), lambda: rollout.delete(f"rrl:{job}:weights:latest"),
                      lambda: rollout.hgetall("rrl:jobs"), lambda: rollout.flushdb(),
                      lambda: rollout.rpush(f"rrl:{job}:weights:latest", b"x"),
                      lambda: rollout.rpush(Keys.rm_outbox(job), b"x"), lambda: rollout.rpush(Keys.trainer_outbox(job), b"x"),
                      lambda: rollout.rpush(Keys.detector_outbox(job), b"x"),
                      lambda: rollout.lrange(Keys.controller_outbox(job), 0, -1),
                      lambda: rollout.lrem(Keys.trainer_outbox(job), 1, b"x"),
                      lambda: rollout.delete(outbox), lambda: rollout.set(outbox, b"x"),
                      lambda: rollout.lpush(outbox, b"x"), lambda: rollout.ltrim(outbox, 0, 0),
                      lambda: rollout.rename(outbox, f"{outbox}:x"), lambda: rollout.expire(outbox, 1),
                      lambda: rollout.eval("return 1", 0), lambda: rollout.config_get("*")):
        with pytest.raises(redis.exceptions.ResponseError):
            forbidden()
    assert rollout.lrange(outbox, 0, -1) == [b"e2"]
    assert rollout.lrem(outbox, 1, b"e2") == 1 and not admin.exists(outbox)

    # The request manager: its own keys (episodes, prefixes, step lists, batches, dispatch records,
    # its outbox, restart count and GC marker); the job registry, the gang record and the pointer
    # read only; nothing of the controller's, nor the trainer's batch fences and trained log. With
    # ``~rrl:*`` it could mark a fault handled (the controller then never acted on it), raise the
    # controller fencing counter or rewrite a job's record (an outside review); with the fences
    # and the trained log, delete a gang's claim or forge a trained step.
    rm = _redis(role_settings(infra, creds, Principal.REQUEST_MANAGER).redis_url)
    for key in (Keys.episode(job, "e2"), Keys.prefix(job, "e2"), Keys.batch(job, 4), Keys.step_restarts(job),
                Keys.rollout_gc(job)):
        assert rm.set(key, b"1") and rm.get(key) == b"1" and rm.delete(key) == 1
    assert rm.sadd(Keys.step_episodes(job, 4), "e2") == 1 and rm.delete(Keys.step_episodes(job, 4)) == 1
    assert rm.hset(Keys.dispatches(job), "e2", "{}") == 1 and rm.rpush(Keys.rm_outbox(job), b"x") == 1
    assert rm.delete(Keys.dispatches(job), Keys.rm_outbox(job)) == 2
    admin.hset(Keys.gang(job), mapping={"epoch": 1, "durable": 0})
    assert rm.hmget(Keys.gang(job), ["epoch", "durable"]) == [b"1", b"0"]
    admin.rpush(Keys.trained_log(job), b'{"step": 0, "epoch": 1, "checksum": "c"}')
    # (the trained log it reads: a commit message lost on the bus is recovered from it)
    assert rm.lrange(Keys.trained_log(job), 0, -1) == [b'{"step": 0, "epoch": 1, "checksum": "c"}']
    for forbidden in (lambda: rm.delete(f"rrl:{job}:fence:3"), lambda: rm.set(Keys.fence(job, 5), b"9"),
                      lambda: rm.eval("return redis.call('ltrim', KEYS[1], 1, -1)", 1, Keys.trained_log(job)),
                      lambda: rm.rpush(Keys.trained_log(job), b'{"step": 9, "epoch": 1, "checksum": "c"}'),
                      lambda: rm.lpop(Keys.trained_log(job)), lambda: rm.set(Keys.fence_gc(job), b"99")):
        with pytest.raises(redis.exceptions.NoPermissionError):  # (not any error: refused for its ACL)
            forbidden()
    assert admin.get(f"rrl:{job}:fence:3") == b"1" and admin.llen(Keys.trained_log(job)) == 1
    assert not admin.exists(Keys.fence(job, 5)) and not admin.exists(Keys.fence_gc(job))
    # ... which the trainer collects itself, with its own credentials, once the checkpoint after
    # a step is durable too (GangFence.collect, the script the trainer runs)
    asyncio.run(_trainer_collects(role_settings(infra, creds, Principal.TRAINER).redis_url, job))
    assert not admin.exists(f"rrl:{job}:fence:0") and admin.exists(f"rrl:{job}:fence:3")
    assert admin.get(Keys.fence_gc(job)) == b"0" and admin.llen(Keys.trained_log(job)) == 0
    assert rm.get(f"rrl:{job}:weights:latest") == b"{}"
    for forbidden in (lambda: rm.sadd(Keys.faults_handled(job), "exit-trainer-e1-r0"),
                      lambda: rm.set(Keys.controller_fence(), 999999), lambda: rm.set(Keys.controller_lease(), "x"),
                      lambda: rm.hset("rrl:jobs", "acl-probe", "{forged}"), lambda: rm.hset(Keys.gang(job), "durable", "7.0"),
                      lambda: rm.set(f"rrl:{job}:weights:latest", b"x"),
                      lambda: rm.rpush(Keys.trainer_outbox(job), b"x"), lambda: rm.rpush(Keys.controller_outbox(job), b"x"),
                      lambda: rm.get(Keys.controller_lease())):
        with pytest.raises(redis.exceptions.ResponseError):
            forbidden()
    assert admin.hget("rrl:jobs", "acl-probe") == b"{}" and not admin.sismember(Keys.faults_handled(job), "exit-trainer-e1-r0")

    for role in (Principal.CONTROLLER, Principal.REQUEST_MANAGER):
        client = _redis(role_settings(infra, creds, role).redis_url)
        assert client.hget("rrl:jobs", "acl-probe") == b"{}"
        for forbidden in (lambda c=client: c.flushall(), lambda c=client: c.config_set("appendonly", "no"),
                          lambda c=client: c.set("other:key", "1"), lambda c=client: c.acl_list(),
                          lambda c=client: c.shutdown()):
            with pytest.raises(redis.exceptions.ResponseError):
                forbidden()

    # The detector: its own outbox of each job (Keys.detector_outbox) and its marks of each job's
    # members (Keys.detector_marks), and nothing else.
    detector = _redis(role_settings(infra, creds, Principal.DETECTOR).redis_url)
    outbox = Keys.detector_outbox(job)
    assert detector.rpush(outbox, b"e1") == 1 and detector.lrange(outbox, 0, -1) == [b"e1"]
    assert detector.lrem(outbox, 1, b"e1") == 1 and detector.llen(outbox) == 0
    marks = Keys.detector_marks(job)
    assert detector.hset(marks, mapping={"r0": 3}) == 1 and detector.hgetall(marks) == {b"r0": b"3"}
    assert detector.delete(marks) == 1
    assert outbox.encode() not in detector.scan(0, match=Keys.detector_outbox_pattern(), count=1000)[1]
    for forbidden in (lambda: detector.rpush(Keys.rm_outbox(job), b"x"), lambda: detector.hgetall("rrl:jobs"),
                      lambda: detector.get(f"rrl:{job}:weights:latest"), lambda: detector.get(f"rrl:{job}:ep:e1"),
                      lambda: detector.lrange(Keys.controller_outbox(job), 0, -1), lambda: detector.flushall(),
                      lambda: detector.config_get("*"), lambda: detector.keys("*"),
                      lambda: detector.hset(f"rrl:{job}:gang", "r0", 1), lambda: detector.hset(f"{marks}:x", "r0", 1),
                      lambda: detector.eval("return 1", 0)):
        with pytest.raises(redis.exceptions.ResponseError):
            forbidden()

    harness = Principal.HARNESS  # no Redis user at all
    assert role_settings(infra, creds, harness).redis_url == ""
    with pytest.raises((redis.exceptions.AuthenticationError, redis.exceptions.ResponseError)):
        redis.Redis(host="127.0.0.1", port=urlparse(infra.redis_url).port, username=harness.value,
                    password=creds.of(harness).nats_password, socket_timeout=2).ping()
    admin.hdel("rrl:jobs", "acl-probe")


# --- S3 ---------------------------------------------------------------------------------------


def test_only_trainer_and_controller_hold_s3_keys(infra, creds):
    for role in Principal:
        s = role_settings(infra, creds, role)
        assert bool(s.s3_access_key) == (role in S3_ROLES)
        if role not in S3_ROLES:
            continue
        client = Minio(s.s3_endpoint, access_key=s.s3_access_key, secret_key=s.s3_secret_key, secure=False,
                       region="us-east-1")
        assert client.bucket_exists(infra.s3_bucket)
    anonymous = Minio(infra.s3_endpoint, secure=False, region="us-east-1")
    with pytest.raises((S3Error, InvalidResponseError)):  # rclone answers an unsigned request oddly
        list(anonymous.list_objects(infra.s3_bucket))


# --- a real job under per-role credentials ----------------------------------------------------


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def _assert_holds_none(env: dict[str, str]) -> None:
    """The start environment of a process that got its member's credentials afterwards (forked
    from the zygote, or a warm spare): no credential of anyone's, the controller's least of all."""
    held = sorted(k for k, v in env.items() if v and (k in CREDENTIAL_VARS or k.startswith(
        tuple(f"ROBUSTRL_{r.value.upper()}_" for r in Principal))))
    assert held == [], f"a process started for a member holds {held}"


def _nats_users(infra: Settings) -> dict[str, set[str]]:
    """Client name -> the users its live NATS connections authenticated as, from the server's own
    monitoring endpoint (loopback; its port is in the server's config)."""
    conf = (Path(infra.credentials_file or "").parent / "nats.conf").read_text()
    port = re.search(r'^http: "127\.0\.0\.1:(\d+)"', conf, re.M)
    assert port, "the embedded NATS server has no monitoring port"
    connz = httpx.get(f"http://127.0.0.1:{port.group(1)}/connz?auth=true&limit=4096", timeout=10).json()
    users: dict[str, set[str]] = {}
    for c in connz.get("connections", []):
        users.setdefault(c.get("name", ""), set()).add(c.get("authorized_user", ""))
    return users


def _assert_holds_only(env: dict[str, str], role: Principal, creds: Credentials) -> None:
    nats_user = urlparse(env["ROBUSTRL_NATS_URL"]).username
    assert nats_user == role.value, f"{role.value} connects to NATS as {nats_user}"
    redis_url = env.get("ROBUSTRL_REDIS_URL", "")
    assert (urlparse(redis_url).username if redis_url else None) == creds.of(role).redis_user
    assert bool(env.get("ROBUSTRL_S3_SECRET_KEY")) == (role in S3_ROLES)
    assert not env.get("ROBUSTRL_CREDENTIALS_FILE")
    others = [k for k in env if k.startswith(("ROBUSTRL_TRAINER_", "ROBUSTRL_ROLLOUT_"))]
    assert not others or role is Principal.CONTROLLER, f"{role.value} holds {others}"


async def _raw_event_subjects(infra: Settings, job_id: str) -> list[str]:
    nc = await nats.connect(infra.nats_url, connect_timeout=2, max_reconnect_attempts=0)
    try:
        js = nc.jetstream()
        sub = await js.pull_subscribe(subjects.events_of(job_id), durable=None, stream=subjects.EVENTS_STREAM)
        out: list[str] = []
        while True:
            try:
                batch = await sub.fetch(256, timeout=1.0)
            except (TimeoutError, nats.errors.TimeoutError):
                return out
            out += [m.subject for m in batch]
    finally:
        await nc.close()


def test_a_job_runs_with_each_process_holding_only_its_roles_credentials(stack, api, infra, creds):
    from jobs import wait_done, wait_step

    jid = api.submit({"name": "roles", "steps": 3, "seed": 3, "data": {"prompts_per_step": 4, "group_size": 4},
                      "rollout": {"replicas": 2}})["job_id"]
    wait_step(api, jid, 0)
    for name, pid in stack.pids().items():
        _assert_holds_only(_environ(pid), Principal(name), creds)
    members = [m for m in api.job(jid)["members"] if m.get("pid") and m.get("alive", True)]
    assert {m["role"] for m in members} == {"trainer", "rollout"}
    forked = 0
    for m in members:
        # What the process was started with: its role's credentials (a cold start), or none at all
        # (forked from the zygote, as in this suite, or a warm spare: it took them from its order).
        env = _environ(m["pid"])
        if "ROBUSTRL_NATS_URL" in env:
            _assert_holds_only(env, Principal(m["role"]), creds)
        else:
            _assert_holds_none(env)
            forked += 1
    if fork_start_enabled(dict(os.environ)):  # the stack's launcher forks: the zygote's env is judged
        assert forked == len(members), f"{len(members) - forked} of {len(members)} members started cold"
    # What each member holds now, seen by the NATS server: every connection named after a member
    # authenticated as that member's role.
    def connected() -> dict[str, set[str]] | None:
        users = _nats_users(infra)
        return users if all(m["member_id"] in users for m in members) else None

    users = eventually(connected, timeout=30, what="every member connected to NATS")
    # Nothing of the running job listens beyond loopback (least privilege, by default): the
    # servers, the services, the zygote, and the members once the gang has formed (the trainer's
    # rendezvous store, Gloo, the weight servers), read from the kernel's socket tables.
    assert wide_listeners([c.pid for c in psutil.Process().children()] + [m["pid"] for m in members]) == []
    for m in members:
        assert users[m["member_id"]] == {m["role"]}, (m["member_id"], users[m["member_id"]])
    status = wait_done(api, jid)
    assert status["committed_step"] == 2
    # From the raw log: every event sits under a writer that owns its kind.
    written = asyncio.run(_raw_event_subjects(infra, jid))
    writers = {(s.split(".")[3], s.split(".")[4]) for s in written}
    assert {("request_manager", "step_started"), ("trainer", "step_committed"),
            ("controller", "job_finished")} <= writers
    for role, kind in writers:
        assert Principal(role) in EVENT_OWNERS[kind], (role, kind)
    assert api.report(jid)["events_skipped"] == 0


def test_compose_servers_get_the_same_rules():
    """compose/nats.conf and the compose redis command carry exactly the generated rules."""
    from robustrl.infra.credentials import render_compose_nats_users, render_compose_redis_acl

    compose = Path(__file__).resolve().parents[1] / "compose"
    nats_conf = (compose / "nats.conf").read_text()
    block = nats_conf.split("# BEGIN generated users\n")[1].split("# END generated users")[0]
    assert block == render_compose_nats_users(), "run python -m robustrl.infra.credentials --write"
    text = (compose / "docker-compose.yml").read_text()
    for line in render_compose_redis_acl():
        assert line in text, line
    for role in Principal:
        assert f"${'NATS_' + role.name}_PASSWORD" in nats_conf
