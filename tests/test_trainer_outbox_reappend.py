"""A commit event JetStream stored but the trainer outbox still holds is not appended a second time.

Rank 0 saves each ``step_committed`` in the job's trainer outbox (``Keys.trainer_outbox``), appends
it to the event log, then removes it. Killed between the store and the removal (or with the removal
failed through a Redis outage and the gang dead before its next commit), it leaves an entry whose
event the log already holds; the next gang's rank 0 appended every entry under its saved message
id (``TrainerWorker._append_outbox``), which JetStream drops as a duplicate only within its
duplicate window (2 min). A next gang later than that stored the event again: two
``step_committed`` for one (step, epoch) in the log, which the auditor reads as the step committed
twice by that gang. Now the next gang first reads the message ids of the job's events of the
entries' kinds stored since the oldest entry was made, and drops the entries found there.

Real NATS and Redis of this module's own: the event stream's duplicate window is cut to 1 s (a
second append past it is a second entry), and restored after. Judged from the raw log and raw Redis.
The read is JetStream's direct get (``Bus.stored_msg_ids``), the one JetStream request the trainer
role's NATS user may make (``robustrl.subjects.JS_DIRECT_GET``: read-only, no consumer it could
make or change); checked under the operator's and under the trainer's own credentials.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import nats
import pytest
from support import duplicate_window, own_servers

from robustrl.audit.raw import RawEvent, read_event_log
from robustrl.bus import Bus, event_msg_id
from robustrl.config import Settings
from robustrl.infra.credentials import Credentials, role_settings
from robustrl.infra.embedded import EmbeddedInfra
from robustrl.member import Identity
from robustrl.messages import Event
from robustrl.services.trainer.worker import TrainerWorker
from robustrl.storage.control_stores import OutboxEntry
from robustrl.storage.fencing import GangFence
from robustrl.storage.redis_stores import Keys, connect
from robustrl.subjects import EVENTS_STREAM, Principal

pytestmark = pytest.mark.timeout(120)

APPEND_BOUND_S = 10.0
"""The next gang's append, its read of the log included (bounded in the worker), takes less."""


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedInfra]:
    """Servers of this module's own: the event stream's duplicate window is cut here."""
    with own_servers(tmp_path_factory, "trainer-outbox-reappend") as servers:
        yield servers


def _trainer(embedded: EmbeddedInfra) -> Settings:
    assert embedded.settings and embedded.settings.credentials_file
    return role_settings(embedded.settings, Credentials.load(embedded.settings.credentials_file), Principal.TRAINER)



def _commit(job_id: str, step: int, epoch: int) -> OutboxEntry:
    return OutboxEntry(msg_id=event_msg_id(job_id, "step_committed"), event=Event(
        job_id=job_id, kind="step_committed", data={"step": step, "epoch": epoch, "weights_version": step + 1,
                                                    "checksum": f"c{step}"}))


async def _next_gang_appends(embedded: EmbeddedInfra, nats_url: str, job_id: str) -> float:
    """Two commits of gang 1: step 1 stored in the log and left in the outbox (its rank killed
    before the removal), step 2 saved and never stored. Past the (cut) duplicate window, gang 2's
    rank 0 enters the fence and runs its append of the outbox, its bus connected to ``nats_url``;
    returns how long the append took."""
    settings = _trainer(embedded)
    redis = connect(settings.redis_url)  # the trainer role's Redis user, as the worker has it
    first = await Bus.connect(settings.nats_url, "trainer-e1-r0", role="trainer")
    stored, unstored = _commit(job_id, 1, 1), _commit(job_id, 2, 1)
    try:
        gang1 = GangFence(redis, job_id, 1)
        await gang1.enter()
        await gang1.record_trained(1, "c1", stored.model_dump_json())
        await first.emit_event(job_id, "step_committed", stored.event.data, stored.event.ts,
                               msg_id=stored.msg_id, required=True)  # stored; the removal never ran
        await gang1.record_trained(2, "c2", unstored.model_dump_json())  # killed before the append
    finally:
        await first.close()
    await asyncio.sleep(1.5)  # past the (cut) duplicate window: a second append is a second entry
    worker = TrainerWorker(Identity(job_id, "trainer-e2-r0", "trainer"), settings)
    worker.redis = redis
    worker.member.epoch = 2
    worker.member.bus = await Bus.connect(nats_url, "trainer-e2-r0", role="trainer")
    try:
        await GangFence(redis, job_id, 2).enter()
        began = time.monotonic()
        await worker._append_outbox()  # as _resume runs it, right after entering the fence
        return time.monotonic() - began
    finally:
        await worker.member.bus.close()
        await redis.aclose()


def _commits(log: list[RawEvent]) -> list[tuple[int, int]]:
    return sorted((e.data["step"], e.data["epoch"]) for e in log if e.kind == "step_committed")


async def _check(embedded: EmbeddedInfra, trainer_nats: bool) -> tuple[float, list[tuple[int, int]], Any]:
    """Run the above on a fresh job; return (the append's time, the log's commits as (step, epoch),
    what the outbox holds). ``trainer_nats``: gang 2's bus under the trainer role's NATS user,
    else the operator's."""
    assert embedded.settings
    operator = await Bus.connect(embedded.settings.nats_url, "test-operator")
    await operator.ensure_event_stream()
    await operator.close()
    job_id = f"tra{uuid.uuid4().hex[:8]}"
    window = await duplicate_window(embedded.settings.nats_url, 1.0)
    try:
        nats_url = _trainer(embedded).nats_url if trainer_nats else embedded.settings.nats_url
        took = await _next_gang_appends(embedded, nats_url, job_id)
    finally:
        await duplicate_window(embedded.settings.nats_url, window)
    admin = connect(embedded.settings.redis_url)  # the operator's: reads the raw keys
    try:
        left = await admin.lrange(Keys.trainer_outbox(job_id), 0, -1)
    finally:
        await admin.aclose()
    return took, _commits(await read_event_log(embedded.settings.nats_url, job_id)), left


async def test_a_commit_the_log_holds_is_not_appended_again_past_theduplicate_window(
        embedded: EmbeddedInfra) -> None:
    """Step 1's commit, stored and left in the outbox, is in the log once after the next gang's
    append (before: twice, ``[(1, 1), (1, 1), (2, 1)]``); step 2's, never stored, is appended once;
    the outbox is empty. The next gang's bus holds the operator's NATS credentials here."""
    took, commits, left = await _check(embedded, trainer_nats=False)
    assert commits == [(1, 1), (2, 1)], commits
    assert left == [], left
    assert took < APPEND_BOUND_S, took


async def test_under_the_trainer_roles_own_credentials(embedded: EmbeddedInfra) -> None:
    """The same with the next gang's bus under the trainer role's own NATS credentials, as a real
    trainer runs: its user may make direct reads of the event stream (``JS_DIRECT_GET``, read-only;
    the first version of this read made a consumer, which the role may not, and under it the
    stored commit was appended a second time)."""
    took, commits, left = await _check(embedded, trainer_nats=True)
    assert took < APPEND_BOUND_S, took
    assert left == [], left
    assert commits == [(1, 1), (2, 1)], commits


async def test_the_event_stream_remembers_message_ids_an_hour_and_keeps_a_window_set_on_purpose(
        embedded: EmbeddedInfra) -> None:
    """JetStream's default duplicate window is 2 min: a sender frozen longer after its first try
    (a rank 0 partitioned with its commit owed, whose kill could not land) stored its event a
    second time when it came back (an outside review). The stream is made, or a default one
    updated, with an hour's window; a window set on purpose (an operator's, this module's other
    tests') is kept. Read from the server's own stream config."""
    from robustrl.bus import EVENT_DUPLICATE_WINDOW_S

    assert embedded.settings
    nats_url = embedded.settings.nats_url

    async def window() -> float:
        nc = await nats.connect(nats_url, connect_timeout=2, max_reconnect_attempts=0)
        try:
            return float((await nc.jetstream().stream_info(EVENTS_STREAM)).config.duplicate_window or 0)
        finally:
            await nc.close()

    async def ensured(name: str, role: str | None = None) -> None:
        bus = await Bus.connect(nats_url, name, **({"role": role} if role else {}))
        try:
            await bus.ensure_event_stream()
        finally:
            await bus.close()

    await ensured("stream-made")  # (made here if no test of the module made it before)
    assert await window() == EVENT_DUPLICATE_WINDOW_S
    before = await duplicate_window(nats_url, 120.0)  # the default, as a stream made before has it
    try:
        for role, expected in ((None, EVENT_DUPLICATE_WINDOW_S), ("trainer", None)):
            if role is not None:
                await duplicate_window(nats_url, 120.0)
            await ensured(f"stream-{role}", role)
            assert await window() == (expected or 120.0), role  # a member's bus changes no stream
        await duplicate_window(nats_url, 7.0)  # on purpose
        await ensured("stream-again")
        assert await window() == 7.0
    finally:
        await duplicate_window(nats_url, before)
