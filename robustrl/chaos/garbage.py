"""A garbage publisher: hypothesis-drawn bad payloads on every subject the services use.

Payload classes (``Garbage.kind``): random bytes, truncated valid-looking messages, messages with a
field of the wrong type (``"many"`` for an int, a list for a string...), deeply nested JSON, JSON of
any other shape, and near-max-size payloads. Every payload is checked, before it is sent, to be
refused by every model a subscriber of its subject decodes with: garbage must be dropped, and a
payload that happened to be a valid command (``stop``) would test nothing but obedience.

Used by ``tests/test_bus_fuzz.py`` (small, fixed seed) and ``bench/fuzz.py`` (>= 10,000 payloads).
``hypothesis`` is imported lazily: it is a test/bench dependency, not a runtime one.
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from robustrl import messages as m
from robustrl.aio import within
from robustrl.errors import MessageError
from robustrl.subjects import EVENT_OWNERS, Verb, events, subject

MODELS: dict[Verb, tuple[type[m.Wire], ...]] = {
    Verb.HELLO: (m.MemberHello,), Verb.SPEC: (m.SpecRequest,), Verb.PHASE: (m.PhaseChange,),
    Verb.METRICS: (m.MetricsSample,), Verb.PROBE: (m.ProbeRequest,), Verb.EXIT: (m.MemberExited,),
    Verb.FAULT: (m.FaultReport,), Verb.GENERATE: (m.GenerateTurn,), Verb.TURN: (m.TurnResult,),
    Verb.BATCH: (m.BatchReady,), Verb.BATCH_GET: (m.BatchGet,), Verb.COMMIT: (m.StepCommitted,),
    Verb.WEIGHTS: (m.WeightsAnnounce,), Verb.HAVE: (m.WeightsHave,), Verb.CONTROL: (m.ControlCommand,),
    Verb.CHAOS: (m.ChaosRequest, m.ChaosCommand),
}
"""What the services decode each verb's messages with (STATE has no subscriber today)."""

NEAR_MAX_BYTES = 1024 * 1024 - 4096
"""Just under the embedded nats-server's default max_payload (1 MiB)."""


def _bases(job: str) -> dict[Verb, dict[str, Any]]:
    """A plausible message per verb, the material for truncation and type mutations."""
    member = {"job_id": job, "member_id": "rollout-0-i0"}
    return {
        Verb.HELLO: {**member, "role": "rollout", "pid": 1, "epoch": 0, "ts": 1.0},
        Verb.SPEC: dict(member),
        Verb.PHASE: {**member, "role": "rollout", "phase": "serving", "step": 1, "ts": 1.0},
        Verb.METRICS: {**member, "role": "rollout", "seq": 1, "ts": 1.0, "phase": "serving", "activity": 3,
                       "tokens_total": 10, "tokens_per_s": 1.5, "queue_depth": 0, "inflight": 0},
        Verb.PROBE: {**member, "nonce": "n"},
        Verb.EXIT: {**member, "role": "rollout", "returncode": 1, "ts": 1.0},
        Verb.FAULT: {"job_id": job, "fault_id": "f1", "role": "rollout", "member_id": "rollout-0-i0",
                     "kind": "crash", "evidence": "x", "detected_at": 1.0},
        Verb.GENERATE: {"job_id": job, "request_id": "r", "episode_id": "e", "step": 0, "prefix_ids": [1, 2],
                        "max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0, "seed": 1},
        Verb.TURN: {**member, "request_id": "r", "episode_id": "e", "token_ids": [1], "logprobs": [-0.1],
                    "stop_reason": "eot", "weights_version": 1},
        Verb.BATCH: {"job_id": job, "step": 0, "episode_ids": ["e"], "reward_mean": 0.5},
        Verb.BATCH_GET: {"job_id": job, "step": 0},
        Verb.COMMIT: {"job_id": job, "step": 0, "weights_version": 1, "epoch": 1, "reward_mean": 0.1,
                      "checksum": "c"},
        Verb.WEIGHTS: {"job_id": job, "version": 1, "epoch": 1, "checksum": "c", "sources": ["a:1"],
                       "manifest": {}},
        Verb.HAVE: {**member, "version": 1, "address": "a:1", "checksum": "c"},
        Verb.CONTROL: {"job_id": job, "target": "members", "action": "stop", "args": {}},
        Verb.CHAOS: {"job_id": job, "fault_id": "f1", "kind": "crash", "role": "rollout", "member": 0},
    }


@dataclass(frozen=True)
class Garbage:
    subject: str
    payload: bytes
    kind: str


def is_refused(subj: str, payload: bytes) -> bool:
    """Whether every subscriber of ``subj`` would drop ``payload`` as malformed."""
    parts = subj.split(".")
    if parts[1] == "events":
        try:
            m.decode_event(payload, subj)
        except MessageError:
            return True
        return False
    models = MODELS.get(Verb(parts[2]), ())
    for model in models:
        try:
            m.decode(model, payload, subj)
        except MessageError:
            continue
        return False
    return True


def subjects_for(job: str, members: list[str]) -> list[str]:
    """Every subject the services subscribe to for ``job``: each verb bare and per member, and
    each event kind under each of its owners."""
    out = []
    for verb in MODELS:
        out.append(subject(job, verb))
        out += [subject(job, verb, t) for t in [*members, "request_manager", "members"]]
    for kind, owners in EVENT_OWNERS.items():
        out += [events(job, kind, owner.value) for owner in owners]
    return out


@functools.cache
def _json_values() -> Any:
    """Any JSON value (built once: hypothesis validates a recursive strategy when it is built)."""
    from hypothesis import strategies as st

    scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | \
        st.text(max_size=40) | st.sampled_from(["many", "", "-1", "1e999", "NaN", "\u00b9", "a.b.>", "*"])
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.text(max_size=10), inner, max_size=4), max_leaves=12)


def garbage_strategy(job: str, subjects: list[str]) -> Any:
    """A hypothesis strategy of ``Garbage`` on ``subjects`` (not yet checked by ``is_refused``)."""
    from hypothesis import strategies as st

    bases = _bases(job)
    values = _json_values()
    kinds = st.sampled_from(["bytes", "truncated", "wrong_type", "nested", "json", "near_max"])

    def base_for(subj: str) -> dict[str, Any]:
        parts = subj.split(".")
        if parts[1] == "events":
            kind = parts[4]
            return {"job_id": job, "kind": kind, "ts": 1.0,
                    "data": {"step": 1, "epoch": 0, "fault_id": "f", "tokens": 5, "weights_version": 1}}
        return dict(bases.get(Verb(parts[2]), {"job_id": job}))

    @st.composite
    def one(draw: Any) -> Garbage:
        subj = draw(st.sampled_from(subjects))
        kind = draw(kinds)
        base = base_for(subj)
        if kind == "bytes":
            payload = draw(st.binary(max_size=300))
        elif kind == "truncated":
            text = json.dumps(base).encode()
            payload = text[:draw(st.integers(0, max(0, len(text) - 1)))]
        elif kind == "wrong_type":
            key = draw(st.sampled_from(sorted(base)))
            target = base
            if key == "data" and isinstance(base["data"], dict) and base["data"]:
                target, key = base["data"], draw(st.sampled_from(sorted(base["data"])))
            target[key] = draw(values)
            payload = json.dumps(base).encode()
        elif kind == "nested":
            depth = draw(st.sampled_from([65, 100, 1000, 10_000, 100_000]))
            opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
            inner = opener * depth + b"1" + closer * depth if opener != b"[" else opener * depth + closer * depth
            wrap = draw(st.booleans())
            payload = (b'{"job_id": "' + job.encode() + b'", "data": ' + inner + b"}") if wrap else inner
        elif kind == "json":
            payload = json.dumps(draw(values)).encode()
        else:
            size = draw(st.integers(NEAR_MAX_BYTES - 2048, NEAR_MAX_BYTES))
            filler = draw(st.sampled_from([b"a", b"[", b"\\", b"\x00"]))
            head = json.dumps({**base, "pad": ""}).encode()[:-2]
            payload = head + filler * max(0, size - len(head) - 2) + b'"}'
        return Garbage(subj, payload, kind)

    return one()


def draw_garbage(job: str, subjects: list[str], n: int, seed: int = 0) -> Iterator[Garbage]:
    """``n`` refused payloads drawn by hypothesis with a fixed ``seed`` (deterministic per seed).

    Near-max payloads are kept to about 1 in 100 so a large run does not only move megabytes.
    """
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    produced = 0
    round_seed = seed
    rng = random.Random(seed)
    while produced < n:
        batch: list[Garbage] = []

        @hseed(round_seed)
        @settings(max_examples=min(n - produced, 2000) * 2, database=None, deadline=None,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @given(garbage_strategy(job, subjects))
        def collect(item: Garbage) -> None:
            batch.append(item)  # noqa: B023 - called right below, within this iteration

        collect()
        for item in batch:
            if produced >= n:
                break
            if item.kind == "near_max" and rng.random() > 0.01:
                continue
            if is_refused(item.subject, item.payload):
                produced += 1
                yield item
        round_seed += 1


@dataclass
class SprayStats:
    payloads: int = 0
    bytes: int = 0
    by_kind: dict[str, int] | None = None
    subjects: set[str] | None = None
    events_payloads: int = 0
    """Payloads sent on event-log subjects (stored by JetStream; readers must skip each one)."""


async def spray(nats_url: str, items: Iterator[Garbage] | list[Garbage], *, flush_every: int = 200) -> SprayStats:
    """Publish every item (with the credentials in ``nats_url``); flush every ``flush_every``
    so the services see the garbage interleaved with their own traffic, not as one burst."""
    from robustrl.bus import Bus

    stats = SprayStats(by_kind={}, subjects=set())
    bus = await Bus.connect(nats_url, "garbage-publisher")
    try:
        for item in items:
            await bus.publish_raw(item.subject, item.payload)
            stats.payloads += 1
            stats.bytes += len(item.payload)
            stats.by_kind[item.kind] = stats.by_kind.get(item.kind, 0) + 1  # type: ignore[index]
            stats.subjects.add(item.subject)  # type: ignore[union-attr]
            stats.events_payloads += item.subject.startswith("rrl.events.")
            if stats.payloads % flush_every == 0:
                await bus.client.flush()
        await bus.client.flush()
    finally:
        await bus.close()
    return stats


# --- forbidden publishes: each role's credentials against the whole protocol ------------------


def _nats_match(pattern: str, subj: str) -> bool:
    p, s = pattern.split("."), subj.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


def probe_subjects(job: str, member: str = "m1") -> list[str]:
    """One subject per verb and shape, each event kind under every role and the old shape, and a
    few outside the protocol (JetStream API, another client's inbox)."""
    from robustrl.subjects import Principal

    out = []
    for verb in Verb:
        out += [subject(job, verb), subject(job, verb, member)]
    for kind in EVENT_OWNERS:
        # Spelled by hand on purpose: most of these name a role that does not own the kind (or the
        # old 4-level shape), which subjects.events refuses to build; the servers must refuse them.
        out += [f"rrl.events.{job}.{role.value}.{kind}" for role in Principal]
        out.append(f"rrl.events.{job}.{kind}")
    out += ["$JS.API.STREAM.INFO.RRL_EVENTS", "_INBOX.someone-elses-reply", "other.subject"]
    return out


@dataclass
class ProbeResult:
    tried: int
    accepted: list[str]


async def probe_forbidden_publishes(admin_url: str, role_url: str, role: str, job: str,
                                    timeout_s: float = 10.0) -> ProbeResult:
    """Publish, with ``role``'s credentials, on every probe subject its permissions forbid, then on
    one it may use (a sentinel: a connection's messages arrive in order); return how many were
    tried and which an unrestricted subscriber received (should be none)."""
    import asyncio

    import nats

    from robustrl.subjects import permissions

    publish, _ = permissions(role)
    probes = probe_subjects(job)
    forbidden = [p for p in probes if not any(_nats_match(a, p) for a in publish)]
    sentinel = next(p for p in probes if p.startswith("rrl.") and "events" not in p
                    and any(_nats_match(a, p) for a in publish))
    admin = await nats.connect(admin_url, connect_timeout=2, max_reconnect_attempts=0)

    async def quiet(exc: Exception) -> None:  # the server's permission errors land here
        pass

    client = await nats.connect(role_url, connect_timeout=2, max_reconnect_attempts=0, error_cb=quiet)
    got: set[str] = set()
    done = asyncio.Event()

    async def on_msg(msg: Any) -> None:
        if msg.data == b"sentinel":
            done.set()
        elif msg.data.startswith(b"probe:"):
            got.add(msg.data[6:].decode())

    try:
        for pattern in ("rrl.>", "$JS.API.>", "_INBOX.someone-elses-reply", "other.subject"):
            await admin.subscribe(pattern, cb=on_msg)
        await admin.flush()
        for subj in forbidden:
            await client.publish(subj, b"probe:" + subj.encode())
        await client.publish(sentinel, b"sentinel")
        await client.flush()
        await within(done.wait(), timeout_s)
    finally:
        await client.close()
        await admin.close()
    return ProbeResult(tried=len(forbidden), accepted=sorted(got))
