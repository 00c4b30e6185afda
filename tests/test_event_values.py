"""Events whose envelope parses but whose values or subject lie (an audit of stop 27's code).

A value that a lax check reads as an int (``"5.0"``) but a reader then feeds to ``int()`` used to
reach the controller's catch-up (a takeover that raised and gave the lease up, for every standby
in turn) and the job report (a 500, for good: the event is durable). An envelope naming another
job or kind than its subject reached the detector, whose subscription did not check the subject:
a replica could end any job there. Here each is published raw on the real NATS, as a faulty or
hostile member would, and judged where it is read. A turn result whose logprobs do not match
its tokens used to be stored and fail the trainer at every redo of its step.
"""

from __future__ import annotations

import json
import uuid

import pytest
from support import eventually_async

from robustrl.bus import Bus
from robustrl.chaos.accounting import account
from robustrl.config import Settings
from robustrl.errors import MessageError
from robustrl.messages import Event, TurnResult, decode
from robustrl.subjects import EVENTS_ALL, events


def _raw(job_id: str, kind: str, data: dict[str, object]) -> bytes:
    return json.dumps({"job_id": job_id, "kind": kind, "ts": 1.0, "data": data}).encode()


async def test_an_event_whose_envelope_is_not_its_subjects_is_dropped_by_a_subscriber(infra: Settings) -> None:
    bus = await Bus.connect(infra.nats_url, "test-events")
    try:
        await bus.ensure_event_stream()
        got: list[Event] = []

        async def on_event(e: Event, _s: str, _r: str | None) -> None:
            got.append(e)

        await bus.subscribe(EVENTS_ALL, Event, on_event)
        await bus.client.flush()
        mine, other = f"eva{uuid.uuid4().hex[:8]}", f"evb{uuid.uuid4().hex[:8]}"
        dropped = bus.dropped
        # A replica's subject, another job's end in the envelope; then its own kind, another job.
        await bus.publish_raw(events(mine, "weights_loaded"), _raw(other, "job_finished", {}))
        await bus.publish_raw(events(mine, "weights_loaded"), _raw(mine, "job_finished", {}))
        await bus.publish_raw(events(mine, "weights_loaded"), _raw(mine, "weights_loaded", {"version": 1}))
        await eventually_async(lambda: got, timeout=10, what="the well-formed event delivered")
        assert [(e.job_id, e.kind) for e in got] == [(mine, "weights_loaded")]
        assert bus.dropped == dropped + 2
    finally:
        await bus.close()


async def test_values_a_reader_cannot_use_are_refused_where_the_log_is_read_and_the_report_stands(
        infra: Settings) -> None:
    bus = await Bus.connect(infra.nats_url, "test-events")
    try:
        await bus.ensure_event_stream()
        job = f"evv{uuid.uuid4().hex[:8]}"
        bad = [("step_committed", {"step": "5.0", "epoch": 1, "weights_version": 6}),
               ("step_committed", {"step": 5, "epoch": 1, "weights_version": 6, "durable_step": "x"}),
               ("step_committed", {"step": 5, "epoch": 1, "weights_version": 6, "durable_step": None}),
               ("work_lost", {"fault_id": "f1", "tokens": "3.0"}),
               ("work_lost", {"fault_id": "f1", "turns": "2"}),
               ("turn_regenerated", {"fault_id": "f1", "tokens": "x", "episode_id": "e"})]
        good = [("step_started", {"step": 0, "epoch": 1}),
                ("step_committed", {"step": 0, "epoch": 1, "weights_version": 1, "durable_step": 0,
                                    "reward_mean": 0.5, "checksum": "c"}),
                ("work_lost", {"fault_id": "f1", "tokens": 3, "turns": 2})]
        for kind, data in [*bad, *good]:
            role = "request_manager" if kind == "work_lost" else None  # (its writer: it has two owners)
            await bus.publish_raw(events(job, kind, role), _raw(job, kind, data))
        await bus.client.flush()
        log = await eventually_async(lambda: _read_all(bus, job, len(good)), timeout=10, what="the log read")
        assert log.skipped == len(bad), [(e.kind, e.data) for e in log]
        assert [e.kind for e in log] == [k for k, _ in good]
        report = account(log, log.skipped)  # what GET /v1/jobs/{id}/report answers from
        assert report.to_dict()["events_skipped"] == len(bad)
    finally:
        await bus.close()


async def _read_all(bus: Bus, job: str, n: int):  # type: ignore[no-untyped-def]
    log = await bus.read_events(job)
    return log if len(log) >= n else None


@pytest.mark.parametrize(("token_ids", "logprobs", "field"), [
    ([5, 6], [-0.1], "logprobs"),  # the trainer's build_samples raised on this, at every redo of the step
    ([5, 6], [-0.1, -0.2, -0.3], "logprobs"),
    ([-1, 6], [-0.1, -0.2], "token_ids.0"),  # an index the embedding refuses
])
def test_a_turn_result_the_trainer_could_not_train_on_is_refused_naming_the_field(
        token_ids: list[int], logprobs: list[float], field: str) -> None:
    body = {"job_id": "j", "request_id": "r", "episode_id": "e", "member_id": "rollout-0-i0",
            "token_ids": token_ids, "logprobs": logprobs, "stop_reason": "eot", "weights_version": 0}
    with pytest.raises(MessageError) as err:
        decode(TurnResult, json.dumps(body).encode(), "rrl.j.turn")
    assert err.value.field == field
    ok = decode(TurnResult, json.dumps({**body, "token_ids": [5, 6], "logprobs": [-0.1, -0.2]}).encode(), "s")
    assert ok.token_ids == [5, 6]


@pytest.mark.parametrize("stalls", [1, 99])
async def test_a_log_read_that_stalls_mid_log_returns_all_of_it_or_an_error(
        infra: Settings, monkeypatch: pytest.MonkeyPatch, stalls: int) -> None:
    """A fetch of the event log that gets nothing within its bound while JetStream still counts
    events pending (a loaded host) ended the read: a prefix of the log came back as the whole of
    it (a takeover's catch-up missed commits; a report, an ETTR computed short). Now the read
    goes on while events are pending, and one that stalls past its bound is an error, never a
    shortened log. 700 events stored in the real JetStream; the stall is a fetch that times out
    after the first 512."""
    from nats.js.client import JetStreamContext

    from robustrl import bus as bus_mod
    from robustrl.errors import TransportError

    bus = await Bus.connect(infra.nats_url, "test-log-stall")
    job = f"stall-{uuid.uuid4().hex[:8]}"
    try:
        await bus.ensure_event_stream()
        subj = events(job, "note", "controller")
        for first in range(0, 700, 100):
            acks = [bus._js.publish(subj, _raw(job, "note", {"n": n})) for n in range(first, first + 100)]
            for ack in acks:
                await ack
        real = JetStreamContext.PullSubscription.fetch
        calls: list[int] = []

        async def stalling(self, batch: int = 1, timeout: float | None = 5, heartbeat: float | None = None):  # type: ignore[no-untyped-def]
            calls.append(batch)
            if 1 < len(calls) <= 1 + stalls:
                raise TimeoutError("test: nothing within the fetch's bound")
            return await real(self, batch, timeout)

        monkeypatch.setattr(JetStreamContext.PullSubscription, "fetch", stalling)
        monkeypatch.setattr(bus_mod, "EVENT_FETCH_STALLS", 3)
        if stalls > 3:
            with pytest.raises(TransportError, match="still pending"):
                await bus.read_events(job)
        else:
            log = await bus.read_events(job)
            assert [e.data["n"] for e in log] == list(range(700)), len(log)
    finally:
        await bus.close()
