"""Pure kernel pieces: subjects, wire-message parsing, job-spec validation, Redis key layout."""

from __future__ import annotations

import pytest

from robustrl import subjects
from robustrl.config import JobSpec, Settings, reference_job
from robustrl.errors import ConfigError, MessageError, SubjectError
from robustrl.messages import ChaosCommand, ChaosRequest, GenerateTurn, MetricsSample, decode
from robustrl.subjects import Verb


def test_subjects_are_built_and_parsed_with_validated_tokens():
    s = subjects.subject("job-1", Verb.GENERATE, "rollout-0-i1")
    assert s == "rrl.job-1.gen.rollout-0-i1"
    assert subjects.parse(s) == ("job-1", Verb.GENERATE, ["rollout-0-i1"])
    assert subjects.wildcard("job-1", Verb.METRICS) == "rrl.job-1.metrics.>"
    assert subjects.all_jobs_exact(Verb.PROBE, "request_manager") == "rrl.*.probe.request_manager"
    for bad in ("a.b", "*", ">", "", "x" * 65, "sp ace"):
        with pytest.raises(SubjectError):
            subjects.subject(bad, Verb.METRICS)
        with pytest.raises(SubjectError):
            subjects.subject("job", Verb.METRICS, bad)
    with pytest.raises(SubjectError):
        subjects.parse("other.job.metrics")
    with pytest.raises(SubjectError):
        subjects.parse("rrl.job.nope")


@pytest.mark.parametrize("raw", [b"\xff\xfe", b"not json", b"[1,2]", b"null", b"{}",
                                 b'{"job_id": "a.b", "member_id": "m", "role": "rollout", "seq": 1, "ts": 0, "phase": "x"}',
                                 b'{"job_id": "j", "member_id": "m", "role": "wizard", "seq": 1, "ts": 0, "phase": "x"}',
                                 b'{"job_id": "j", "member_id": "m", "role": "rollout", "seq": -1, "ts": 0, "phase": "x"}',
                                 b'{"job_id": "j", "member_id": "m", "role": "rollout", "seq": 1, "ts": 0, "phase": "x", "extra": 1}'])
def test_garbage_messages_raise_a_message_error_naming_the_subject(raw):
    with pytest.raises(MessageError) as err:
        decode(MetricsSample, raw, "rrl.j.metrics.m")
    assert "rrl.j.metrics.m" in str(err.value)


@pytest.mark.parametrize("rate", ["1e308", "1e10", "-1", "Infinity", "NaN", "1e999"])
def test_a_rate_no_engine_reaches_is_refused_on_the_bus(rate: str) -> None:
    """One replica's absurd ``tokens_per_s`` (1e308) made its peers' median in the detector's
    fail-slow rule as large, and every healthy peer a fault (an outside review): refused, the
    field named, before any rule sees it. Non-finite numbers never parse. A real rate passes."""
    base = '{"job_id": "j", "member_id": "m", "role": "rollout", "seq": 1, "ts": 0, "phase": "serving", "tokens_per_s": %s}'
    assert decode(MetricsSample, (base % "1234.5").encode()).tokens_per_s == 1234.5
    with pytest.raises(MessageError) as err:
        decode(MetricsSample, (base % rate).encode(), "rrl.j.metrics.m")
    assert err.value.field == "tokens_per_s" or "non-finite" in str(err.value), err.value


def test_no_wire_message_holds_a_number_that_is_not_finite_though_built_in_process() -> None:
    """The parser refuses NaN and infinities on the bus; a message built in process (a member's
    own arithmetic: a rate over a zero interval) is refused as it is built, not sent."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="tokens_per_s"):
        MetricsSample(job_id="j", member_id="m", role="rollout", seq=1, ts=0.0, phase="x", tokens_per_s=float("inf"))
    with pytest.raises(ValidationError, match="temperature"):
        GenerateTurn(job_id="j", request_id="r", episode_id="e", step=3, prefix_ids=[1], max_new_tokens=4,
                     temperature=float("nan"), top_p=0.9, seed=7)


def test_message_round_trip_and_field_named():
    msg = GenerateTurn(job_id="j", request_id="r", episode_id="e", step=3, prefix_ids=[1, 2], max_new_tokens=4,
                       temperature=1.0, top_p=0.9, seed=7)
    assert decode(GenerateTurn, msg.encode()) == msg
    with pytest.raises(MessageError) as err:
        decode(GenerateTurn, msg.encode().replace(b'"prefix_ids":[1,2]', b'"prefix_ids":[]'))
    assert err.value.field == "prefix_ids"
    with pytest.raises(MessageError):
        decode(ChaosRequest, b'{"job_id": "j", "fault_id": "f", "kind": "meteor", "role": "trainer"}')


@pytest.mark.parametrize("model,extra", [(ChaosCommand, '"member_id": "m"'), (ChaosRequest, '"role": "rollout"')])
def test_a_crash_moment_on_another_fault_is_refused_on_the_bus_naming_the_field(model, extra):
    """``moment`` arms a crash; on a stall the member would drop it silently (the controller
    checks its own REST and bus requests, a message on the member's subject is checked here)."""
    ok = decode(model, f'{{"job_id": "j", "fault_id": "f", "kind": "crash", {extra}, "moment": "mid_tool_turn"}}'.encode())
    assert ok.moment == "mid_tool_turn"
    with pytest.raises(MessageError) as err:
        decode(model, f'{{"job_id": "j", "fault_id": "f", "kind": "stall", {extra}, "moment": "mid_tool_turn"}}'.encode())
    assert err.value.field == "moment" and "for a crash only" in str(err.value), err.value


def test_job_spec_validation_names_every_bad_field():
    assert reference_job().steps == 30 and reference_job().detector.trainer_idle_s < 300
    assert JobSpec().detector.trainer_idle_s < 300  # jobs default to the scaled-down profile
    from robustrl.config import DetectorSpec

    production = DetectorSpec(profile="production")
    assert (production.trainer_idle_s, production.rollout_idle_s) == (300.0, 60.0)
    with pytest.raises(ConfigError) as err:
        JobSpec.parse({"steps": 0, "mode": "warp", "model": {"hidden_size": 30, "num_heads": 4}, "x": 1})
    text = str(err.value)
    for field in ("steps", "mode", "x"):
        assert field in text
    with pytest.raises(ConfigError, match="staleness"):
        JobSpec.parse({"mode": "sync", "staleness": 1})
    with pytest.raises(ConfigError, match="hidden_size"):
        JobSpec.parse({"model": {"hidden_size": 30, "num_heads": 4}})
    assert JobSpec.parse({"mode": "async", "staleness": 3}).staleness == 3
    with pytest.raises(ConfigError):
        JobSpec.parse({"name": "n" * 56})  # the job id must still fit a subject token


def test_settings_round_trip_through_the_environment():
    s = Settings(nats_url="nats://u:p@127.0.0.1:1", api_port=1234, s3_secure=True)
    assert Settings.from_env(s.to_env()) == s
    with pytest.raises(ConfigError, match="ROBUSTRL_API_PORT"):
        Settings.from_env({"ROBUSTRL_API_PORT": "not-a-port"})


# --- bounded parsing (issue 11: a deep array raised RecursionError in the controller) ----------


@pytest.mark.parametrize("raw", [b"[" * 100_000 + b"]" * 100_000,
                                 b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
                                 b'{"job_id": "j", "kind": "note", "data": {"x": ' + b"[" * 5000 + b"]" * 5000 + b"}}"])
def test_deeply_nested_json_is_a_message_error_not_a_recursion_error(raw):
    from robustrl.messages import Event

    with pytest.raises(MessageError, match="deep"):
        decode(Event, raw, "rrl.events.j.controller.note")


def test_oversized_payload_is_refused_before_parsing():
    from robustrl.messages import MAX_MESSAGE_BYTES, Event

    raw = b'{"job_id": "j", "kind": "note", "data": {"x": "' + b"a" * MAX_MESSAGE_BYTES + b'"}}'
    with pytest.raises(MessageError, match="bytes"):
        decode(Event, raw, "rrl.events.j.controller.note")


def test_brackets_inside_strings_do_not_count_as_nesting():
    from robustrl.messages import Event

    text = "[" * 10_000 + "{" * 10_000
    raw = b'{"job_id": "j", "kind": "note", "data": {"text": "' + text.encode() + b'"}}'
    assert decode(Event, raw, "s").data["text"] == text


def test_event_subjects_name_an_owner_and_readers_check_it():
    from robustrl.messages import Event, decode_event

    assert subjects.events("j", "decision") == "rrl.events.j.controller.decision"
    assert subjects.events("j", "work_lost", "request_manager") == "rrl.events.j.request_manager.work_lost"
    with pytest.raises(SubjectError):
        subjects.events("j", "work_lost")  # two owners: the writer must say which it is
    with pytest.raises(SubjectError):
        subjects.events("j", "decision", "rollout")  # a rollout does not decide
    with pytest.raises(SubjectError):
        subjects.events("j", "no_such_kind")
    raw = Event(job_id="j", kind="decision", data={"fault_id": "f", "actions": [], "reason": "r"}).encode()
    assert decode_event(raw, "rrl.events.j.controller.decision").kind == "decision"
    for forged in ("rrl.events.j.rollout.decision", "rrl.events.other.controller.decision",
                   "rrl.events.j.controller.note", "rrl.events.j.decision.x.y"):
        with pytest.raises(MessageError):
            decode_event(raw, forged)


def test_event_data_is_typed_where_it_is_written():
    from robustrl.messages import Event

    with pytest.raises(ValueError, match="data.tokens"):
        Event(job_id="j", kind="work_lost", data={"tokens": "many"})
    with pytest.raises(ValueError):
        Event(job_id="j", kind="step_committed", data={"step": 1})  # weights_version missing
    with pytest.raises(ValueError):
        Event(job_id="j", kind="note", ts=float("inf"))
    assert Event(job_id="j", kind="note", data={"anything": [1, {"x": None}]}).data["anything"][0] == 1
