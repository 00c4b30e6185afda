"""A JetStream outage at a job's end loses none of the members' last events.

Only a role's own members may append its events (NATS permissions name the writer's role), and a
trainer's or a replica's events wait in its job's outbox (Redis) until JetStream stores them. The
controller finished a job on the last commit message (core NATS) and stopped the members after the
request manager's bounded drain: with JetStream away for longer, the trainer's last
``step_committed`` (and a replica's last ``weights_loaded``) stayed in the outboxes for good, no
member left to append them, and the log lacked them (an outside review). Now the stop waits,
bounded (``EVENTS_SETTLE_S``), for the job's event outboxes to be empty before it stops the
members. A real stack; JetStream is made to refuse ``step_committed`` from just after the step before the last one
until 20 s after the last one's commit message; judged from the raw log, raw Redis and the auditor.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import nats
import pytest
from jobs import kinds, small_job, wait_done
from support import audit_sampled, sample_batches

from robustrl.audit.model import AuditOptions
from robustrl.client import ApiClient
from robustrl.stack import Stack
from robustrl.storage.redis_stores import Keys, connect
from robustrl.subjects import EVENT_OWNERS, EVENTS_ALL, EVENTS_STREAM, Verb, events, subject

pytestmark = pytest.mark.timeout(240)

STEPS = 4
MEMBER_KINDS = frozenset({"step_committed", "weights_published", "weights_loaded", "member_ready", "batch_ready",
                          "step_started", "work_lost", "turn_regenerated"})
OUTAGE_AFTER_LAST_COMMIT_S = 20.0
"""Longer than the request manager's stop drain (10 s) plus a member's own close drain (4 s): the
members were stopped before JetStream came back."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    st = Stack(tmp_path_factory.mktemp("end-of-job-events"))
    st.start()
    try:
        yield st
    finally:
        st.stop()


def _all_but_the_trainers(refused: str) -> list[str]:
    """The event stream's subjects without the trainer's ``refused`` kind: JetStream then refuses
    that event alone (for ``step_committed``: a trainer publishes a step's weights, a required
    event, before its commit: an outage of the whole stream holds the commit back; this is the
    state an outage that begins between the two leaves)."""
    return sorted(f"rrl.events.*.{owner.value}.{kind}" for kind, owners in EVENT_OWNERS.items()
                  for owner in owners if (owner.value, kind) != ("trainer", refused))


@contextlib.asynccontextmanager
async def _trainers_refused(js: Any, kind: str, parked: threading.Event) -> AsyncIterator[None]:
    """JetStream refuses the trainer's ``kind`` events inside (``parked`` set once it does)."""
    config = (await js.stream_info(EVENTS_STREAM)).config
    config.subjects = _all_but_the_trainers(kind)
    await js.update_stream(config)
    parked.set()
    try:
        yield
    finally:
        config.subjects = [EVENTS_ALL]
        await js.update_stream(config)


def _job_through(stack: Stack, spec: dict, outage: Callable[[str, str, threading.Event], Awaitable[None]],
                 ) -> tuple[str, Any, dict, list[dict]]:
    """Run ``spec`` to its end with ``outage`` (NATS url, job id, set once begun) beside it; return
    the job id, its batch sampler, its final status and its events."""
    api = ApiClient(stack.api_url, stack.settings.api_token)
    jid = api.submit(spec)["job_id"]
    sampler = sample_batches(stack.settings.redis_url, jid)
    parked = threading.Event()
    beside = threading.Thread(target=lambda: asyncio.run(outage(stack.settings.nats_url, jid, parked)))
    beside.start()
    try:
        status = wait_done(api, jid, timeout=200)
    finally:
        beside.join(150)
    assert parked.is_set(), "the outage never began"
    return jid, sampler, status, api.events(jid)


async def _outage_over_the_last_step(nats_url: str, job_id: str, parked: threading.Event) -> None:
    """Refuse ``step_committed`` events once step ``STEPS - 2``'s is stored (seen on its event
    subject), and take them again ``OUTAGE_AFTER_LAST_COMMIT_S`` after the last step's commit
    message (core NATS). (An earlier step's refused event would hold the last step's weights
    back: a required event waits for those owed before it.)"""
    nc = await nats.connect(nats_url, connect_timeout=5)
    js = nc.jetstream()
    stored: asyncio.Queue[int] = asyncio.Queue()
    committed: asyncio.Queue[int] = asyncio.Queue()

    async def on_event(msg: nats.aio.msg.Msg) -> None:
        stored.put_nowait(int(json.loads(msg.data)["data"]["step"]))

    async def on_commit(msg: nats.aio.msg.Msg) -> None:
        committed.put_nowait(int(json.loads(msg.data)["step"]))

    await nc.subscribe(events(job_id, "step_committed", "trainer"), cb=on_event)
    await nc.subscribe(subject(job_id, Verb.COMMIT), cb=on_commit)
    try:
        while await asyncio.wait_for(stored.get(), 120) < STEPS - 2:
            pass
        async with _trainers_refused(js, "step_committed", parked):
            while await asyncio.wait_for(committed.get(), 120) < STEPS - 1:
                pass
            await asyncio.sleep(OUTAGE_AFTER_LAST_COMMIT_S)  # the outage's length, not a wait for a state
    finally:
        await nc.close()


def test_the_last_steps_events_reach_the_log_though_jetstream_was_away_at_the_end(stack: Stack) -> None:
    jid, sampler, status, events = _job_through(
        stack, small_job("eoj", steps=STEPS, rollout={"replicas": 1}, trainer={"workers": 1}),
        _outage_over_the_last_step)
    assert status["status"] == "finished" and status["committed_step"] == STEPS - 1, status
    assert sorted({c["step"] for c in kinds(events, "step_committed")}) == list(range(STEPS))
    final = [i for i, e in enumerate(events) if e["kind"] == "job_finished"]
    assert len(final) == 1, final
    late = [e["kind"] for e in events[final[0]:] if e["kind"] in MEMBER_KINDS]
    assert late == [], f"events of the job's work after its final event: {late}"

    async def outboxes() -> dict[str, int]:
        redis = connect(stack.settings.redis_url)
        try:
            return {k: await redis.llen(k) for k in (Keys.trainer_outbox(jid), Keys.rollout_outbox(jid),
                                                     Keys.rm_outbox(jid), Keys.detector_outbox(jid))}
        finally:
            await redis.aclose()

    assert not any((left := asyncio.run(outboxes())).values()), left
    report = audit_sampled(stack.settings, jid, sampler, AuditOptions(redis_bound=False))
    assert report.facts["trainer_outbox_unappended"] == 0, report.facts


PUBLISH_OUTAGE_S = 40.0
"""Longer than a required event's budget (``EVENT_PUBLISH_RETRY_S``, 30 s)."""


async def _weights_refused_for_a_while(nats_url: str, job_id: str, parked: threading.Event) -> None:
    """Refuse the trainer's ``weights_published`` once step 1's commit is stored, for
    ``PUBLISH_OUTAGE_S``."""
    nc = await nats.connect(nats_url, connect_timeout=5)
    js = nc.jetstream()
    stored: asyncio.Queue[int] = asyncio.Queue()

    async def on_event(msg: nats.aio.msg.Msg) -> None:
        stored.put_nowait(int(json.loads(msg.data)["data"]["step"]))

    await nc.subscribe(events(job_id, "step_committed", "trainer"), cb=on_event)
    try:
        while await asyncio.wait_for(stored.get(), 120) < 1:
            pass
        async with _trainers_refused(js, "weights_published", parked):
            await asyncio.sleep(PUBLISH_OUTAGE_S)  # the outage's length, not a wait for a state
    finally:
        await nc.close()


def test_a_weights_publication_jetstream_refuses_past_its_budget_is_waited_for_not_a_trainer_fault(
        stack: Stack) -> None:
    """JetStream refuses the trainer's ``weights_published`` (a required event: it must be in the
    log before the weights are pointed at) for longer than its 30 s budget. Rank 0 gave up and
    exited, a trainer fault and a gang restart (an outside review; a longer outage then escalated
    to a whole-job restart). Now it tries again until the event is stored: no fault, no restart,
    the version published once, the job finished, the auditor passes."""
    jid, sampler, status, events = _job_through(
        stack, small_job("wpout", steps=4, rollout={"replicas": 1}, trainer={"workers": 1},
                         detector={"weights_load_s": 120.0}),  # (the replicas wait out the outage too)
        _weights_refused_for_a_while)
    assert status["status"] == "finished", status
    assert kinds(events, "fault_detected") == [], kinds(events, "fault_detected")
    assert {d["member_id"] for d in kinds(events, "member_started") if d["role"] == "trainer"} == {"trainer-e1-r0"}
    published = sorted(d["version"] for d in kinds(events, "weights_published"))
    assert published == sorted(set(published)) and published[-1] == 4, published  # each version once
    audit_sampled(stack.settings, jid, sampler, AuditOptions(redis_bound=False))
