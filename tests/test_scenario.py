"""Chaos scenario files, validation errors, the builder and the seeded plan."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path

import pytest

from support import eventually, eventually_async

from robustrl.chaos.scenario import Faults, PlannedFault, load_scenario, plan
from robustrl.errors import ScenarioError
from robustrl.messages import ChaosRequest

TEXT = """
name: mixed
seed: 7
policy: whole_job
job: {rollout: {replicas: 3}}
faults:
  - {kind: crash, role: rollout, member: 1, at_step: 3}
  - {kind: hang, role: trainer, member: random, every: 4, start: 2, within_step: 0.5}
  - {kind: slow, role: rollout, member: all, at_step: 5, duration_s: 10}
  - {kind: tool_outage, at_step: 6, duration_s: 5}
"""


def test_load_and_plan_is_deterministic_from_the_seed(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(TEXT)
    sc = load_scenario(path)
    assert sc.name == "mixed" and sc.seed == 7 and sc.policy == "whole_job"
    assert sc.job == {"rollout": {"replicas": 3}}
    assert load_scenario(str(path)) == sc == load_scenario(TEXT)
    first = plan(sc, steps=12, step_time_s=2.0)
    assert first == plan(load_scenario(TEXT), steps=12, step_time_s=2.0)
    by_kind: dict[str, list[PlannedFault]] = {}
    for p in first:
        by_kind.setdefault(p.kind, []).append(p)
    crash = by_kind["crash"][0]
    assert (crash.step, crash.role, crash.member_index) == (3, "rollout", 1)
    assert 0.0 <= crash.delay_s < 2.0
    assert [p.step for p in by_kind["hang"]] == [2, 6, 10]
    assert all(p.delay_s == 0.5 and 0 <= p.member_index < 2 for p in by_kind["hang"])
    assert sorted(p.member_index for p in by_kind["slow"]) == [0, 1, 2]  # 3 replicas from job overrides
    assert all(p.factor == 8.0 and p.duration_s == 10.0 for p in by_kind["slow"])
    assert by_kind["tool_outage"][0].role == "request_manager"
    assert len({p.fault_id for p in first}) == len(first)
    assert first == sorted(first, key=lambda p: (p.step, p.delay_s, p.fault_id))


def test_other_seed_draws_other_moments() -> None:
    a = plan(Faults(seed=1).crash("rollout", member="random", every=1).build(), steps=20)
    b = plan(Faults(seed=2).crash("rollout", member="random", every=1, start=0).build(), steps=20)
    assert [p.delay_s for p in a] != [p.delay_s for p in b]
    assert all(0.0 <= p.delay_s < 1.0 for p in a)  # a fraction of a step by default


def test_builder_matches_yaml_and_round_trips() -> None:
    sc = (Faults("b", seed=3).crash("rollout", member=1, at_step=3).hang("trainer", at_step=5)
          .stall("rollout", at_step=2, duration_s=4).net_drop("rollout", member=0, at_step=4)
          .tool_outage(at_step=1, duration_s=2).policy("role_local").job(steps=8).build())
    assert [f.kind for f in sc.faults] == ["crash", "hang", "stall", "net_drop", "tool_outage"]
    assert load_scenario(sc.to_yaml()) == sc
    planned = plan(sc, steps=4)
    assert [p.step for p in planned] == [1, 2, 3]  # hang at 5 and net_drop at 4 are past the end
    armed = Faults("m").crash("rollout", member=0, at_step=1, moment="mid_tool_turn").build()
    assert load_scenario(armed.to_yaml()) == armed and [p.moment for p in plan(armed, steps=4)] == ["mid_tool_turn"]


@pytest.mark.parametrize("text, field", [
    ("faults: [{kind: meltdown, role: rollout, at_step: 1}]", "faults[0].kind"),
    ("faults: [{kind: crash, role: gpu, at_step: 1}]", "faults[0].role"),
    ("faults: [{kind: crash, role: rollout, member: -1, at_step: 1}]", "faults[0].member"),
    ("faults: [{kind: crash, role: rollout, member: some, at_step: 1}]", "faults[0].member"),
    ("faults: [{kind: crash, role: rollout}]", "faults[0].at_step"),
    ("faults: [{kind: crash, role: rollout, at_step: 1, every: 2}]", "faults[0].at_step"),
    ("faults: [{kind: crash, role: rollout, every: 0}]", "faults[0].every"),
    ("faults: [{kind: crash, role: rollout, at_step: 1, start: 2}]", "faults[0].start"),
    ("faults: [{kind: crash, role: rollout, at_step: 1, within_step: soon}]", "faults[0].within_step"),
    ("faults: [{kind: crash, role: trainer, at_step: 1, within_step: decoding}]", "faults[0].within_step"),
    ("faults: [{kind: crash, role: request_manager, at_step: 1, within_step: decoding}]", "faults[0].within_step"),
    ("faults: [{kind: tool_outage, at_step: 1, duration_s: 1, within_step: decoding}]", "faults[0].within_step"),
    ("faults: [{kind: crash, role: rollout, at_step: 1, within_step: Decoding}]", "faults[0].within_step"),
    ("faults: [{kind: crash, role: rollout, at_step: 1, within_step: -1}]", "faults[0].within_step"),
    ("faults: [{kind: slow, role: rollout, at_step: 1, factor: 0.5}]", "faults[0].factor"),
    # Past what injection accepts (ChaosRequest): refused here, not after the job ran unfaulted.
    ("faults: [{kind: slow, role: rollout, at_step: 1, factor: 2000}]", "faults[0].factor"),
    ("faults: [{kind: hang, role: rollout, at_step: 1, duration_s: 3601}]", "faults[0].duration_s"),
    ("faults: [{kind: hang, role: rollout, at_step: 1, duration_s: .inf}]", "faults[0].duration_s"),
    ("faults: [{kind: crash, role: rollout, at_step: 1, within_step: .inf}]", "faults[0].within_step"),
    ("faults: [{kind: crash, role: rollout, at_step: 1, within_step: .nan}]", "faults[0].within_step"),
    ("faults: [{kind: tool_outage, at_step: 1}]", "faults[0].duration_s"),
    ("faults: [{kind: tool_outage, role: rollout, at_step: 1, duration_s: 1}]", "faults[0].role"),
    ("faults: [{kind: crash, role: rollout, at_step: 1, colour: red}]", "faults[0].colour"),
    ("faults: [{kind: crash, role: rollout, at_step: 1}, {kind: crash, at_step: 1}]", "faults[1].role"),
    ("faults: [{kind: infra_restart, role: rollout, at_step: 1}]", "faults[0].role"),
    ("faults: [{kind: crash, role: redis, at_step: 1}]", "faults[0].role"),
    ("faults: [{kind: slow, role: controller, at_step: 1}]", "faults[0].role"),
    ("faults: [{kind: tool_outage, role: detector, at_step: 1, duration_s: 1}]", "faults[0].role"),
    ("faults: [{kind: net_drop, role: request_manager, at_step: 1}]", "faults[0].role"),
    ("faults: [{kind: crash, role: rollout, at_step: 1, moment: later}]", "faults[0].moment"),
    ("faults: [{kind: crash, role: trainer, at_step: 1, moment: mid_tool_turn}]", "faults[0].moment"),
    ("faults: [{kind: stall, role: rollout, at_step: 1, moment: mid_tool_turn}]", "faults[0].moment"),
    ("seed: -3\nfaults: []", "seed"),
    ("policy: yolo\nfaults: []", "policy"),
    ("fautls: []", "fautls"),
    ("faults: {kind: crash}", "faults"),
    ("faults: [kind: crash", "<root>"),
    ("- just a list", "<root>"),
])
def test_bad_scenarios_name_the_field(text: str, field: str) -> None:
    with pytest.raises(ScenarioError) as err:
        load_scenario(text)
    assert err.value.field == field


@pytest.mark.parametrize("name", ["ettr.v2", "x" * 200, "crash trainer/every 10"])
def test_any_scenario_name_plans_fault_ids_the_bus_accepts(name: str) -> None:
    sc = load_scenario(f"name: {json.dumps(name)}\nfaults: [{{kind: crash, role: rollout, member: all, every: 1}}]")
    planned = plan(sc, steps=12)
    assert planned
    for p in planned:  # the request the harness sends for it (it raised at injection time before)
        ChaosRequest(job_id="j", fault_id=p.fault_id, kind=p.kind, role=p.role, member=p.member_index)  # type: ignore[arg-type]


def test_plan_rejects_member_index_beyond_the_job() -> None:
    sc = Faults().crash("trainer", member=5, at_step=0).build()
    with pytest.raises(ScenarioError, match="index 5"):
        plan(sc, steps=3)
    with pytest.raises(ScenarioError):
        plan(Faults().job(rollout={"replicas": 0}).build(), steps=3)


def test_a_scenario_that_does_not_fit_the_job_is_refused_before_the_job_is_submitted(stack, api) -> None:  # type: ignore[no-untyped-def]
    """A crash of trainer rank 5 in a job of 2 ranks: refused naming the index, and no job is
    made (it was checked once the job had been submitted, leaving it running unasked for; an
    outside review). Read from the controller's list of jobs."""
    from jobs import small_job

    from robustrl.chaos.runner import run_job

    before = {j["job_id"] for j in api.jobs()}
    scenario = Faults("misfit", seed=1).crash("trainer", member=5, at_step=1).build()
    with pytest.raises(ScenarioError, match="index 5"):
        asyncio.run(run_job(stack.settings, api, small_job("misfit", steps=3), scenario, timeout_s=60))
    assert {j["job_id"] for j in api.jobs()} == before


def test_builder_validates_like_a_file() -> None:
    with pytest.raises(ScenarioError, match="kind"):
        Faults().add("explode", "rollout", at_step=1)


CONTROL_PLANE_TEXT = """
name: cp
seed: 4
faults:
  - {kind: crash, role: controller, at_step: 1}
  - {kind: hang, role: detector, at_step: 2}
  - {kind: hang, role: request_manager, at_step: 3, duration_s: 4}
  - {kind: crash, role: request_manager, at_step: 3}
  - {kind: infra_restart, role: nats, at_step: 4}
  - {kind: infra_restart, role: redis, at_step: 5, within_step: 0.5}
  - {kind: infra_restart, role: s3, at_step: 6}
"""


def test_control_plane_and_infra_faults_plan_and_route() -> None:
    from robustrl.chaos.harness import is_local

    sc = load_scenario(CONTROL_PLANE_TEXT)
    assert load_scenario(sc.to_yaml()) == sc
    planned = plan(sc, steps=8, step_time_s=2.0)
    assert [(p.kind, p.role, p.step) for p in planned if p.step != 3] == [
        ("crash", "controller", 1), ("hang", "detector", 2), ("infra_restart", "nats", 4),
        ("infra_restart", "redis", 5), ("infra_restart", "s3", 6)]
    assert all(p.member_index == 0 for p in planned)  # one of each: index 0
    hangs = {p.role: p.duration_s for p in planned if p.kind == "hang"}
    assert hangs == {"detector": 10.0, "request_manager": 4.0}  # a control-plane hang defaults to 10 s
    # Every one of these is carried out by the stack (the controller cannot kill itself), while
    # a tool outage of the request manager still goes to the controller.
    assert all(is_local(p) for p in planned)
    outage = plan(Faults().tool_outage(at_step=0, duration_s=1).build(), steps=1)[0]
    assert not is_local(outage)
    built = (Faults("cp", seed=4).crash("controller", at_step=1).hang("detector", at_step=2)
             .infra_restart("redis", at_step=5).build())
    assert [f.role for f in built.faults] == ["controller", "detector", "redis"]


async def test_harness_without_a_stack_reports_local_faults_as_not_injected() -> None:
    """No Stack handle (a detached ``robustrl up``): the fault is refused with a reason, never
    silently sent to a controller that would misroute it."""
    from robustrl.chaos.harness import Harness

    class NoBus:
        async def emit_event(self, *a: object, **k: object) -> None:
            raise AssertionError("nothing may be logged for a fault that was not injected")

    pf = plan(Faults().crash("controller", at_step=0).build(), steps=1)[0]
    rec = await Harness(NoBus(), "job", [pf]).inject(pf)  # type: ignore[arg-type]
    assert rec["ok"] is False and "needs the stack" in rec["error"]


# --- within_step: decoding ------------------------------------------------------------------


def test_decoding_is_refused_on_a_role_that_does_not_decode_with_a_reason() -> None:
    with pytest.raises(ScenarioError, match=r"faults\[0\]\.within_step: 'decoding'.*only rollout.*not trainer"):
        Faults().crash("trainer", at_step=1, within_step="decoding")
    with pytest.raises(ScenarioError, match=r"'random', 'decoding' or seconds"):
        load_scenario("faults: [{kind: crash, role: rollout, at_step: 1, within_step: mid-decode}]")


def test_decoding_faults_plan_a_seeded_delay_and_wait_for_decoding() -> None:
    sc = (Faults("dec", seed=5).crash("rollout", member=1, at_step=2, within_step="decoding")
          .crash("rollout", member=0, at_step=3, within_step="random")
          .hang("rollout", member="all", at_step=4, within_step="decoding").build())
    assert load_scenario(sc.to_yaml()) == sc  # round trips through the file format
    planned = plan(sc, steps=6, step_time_s=3.0)
    assert planned == plan(sc, steps=6, step_time_s=3.0)  # deterministic from the seed
    assert [(p.step, p.member_index, p.until) for p in planned] == [
        (2, 1, "decoding"), (3, 0, None), (4, 0, "decoding"), (4, 1, "decoding")]
    assert all(0.0 <= p.delay_s < 3.0 for p in planned)
    other = plan(Faults("dec", seed=6).crash("rollout", member=1, at_step=2, within_step="decoding").build(),
                 steps=6, step_time_s=3.0)
    assert other[0].delay_s != planned[0].delay_s  # the delay is drawn, so crashes land at other moments


class FakeBus:
    """Records the harness's subscriptions and chaos requests; the test plays the members."""

    def __init__(self) -> None:
        self.handlers: dict[str, object] = {}
        self.requests: list[tuple[float, object]] = []

    async def subscribe(self, subject: str, model: object, handler: object, queue: str | None = None) -> object:
        self.handlers[subject] = handler

        class Sub:
            async def unsubscribe(self) -> None:
                pass
        return Sub()

    async def request(self, subject: str, msg: object, reply_model: object, timeout: float = 0) -> object:
        from robustrl.messages import ChaosAck

        self.requests.append((time.monotonic(), msg))
        return ChaosAck(fault_id=msg.fault_id, member_id=f"rollout-{msg.member}-i1", ok=True)  # type: ignore[attr-defined]


def _sample(member_id: str, inflight: int, seq: int) -> object:
    from robustrl.messages import MetricsSample

    return MetricsSample(job_id="job", member_id=member_id, role="rollout", seq=seq, ts=time.time(),
                         phase="serving", inflight=inflight)


async def test_harness_fires_on_the_slots_newest_replica_decoding_and_times_out_otherwise() -> None:
    """Samples of another slot, of a replaced incarnation, or idle ones do not fire a ``decoding``
    fault; a sample of the slot's replica with a batch in flight does, at once. A fault that never
    sees decoding is injected at the bound all the same, its ack saying ``timeout``."""
    from robustrl.chaos.harness import Harness
    from robustrl.messages import Event, PhaseChange

    bus = FakeBus()
    planned = plan(Faults("dec").crash("rollout", member=1, at_step=0, within_step=0.0)
                   .crash("rollout", member=0, at_step=1, within_step=0.0)
                   .crash("rollout", member=0, at_step=2, within_step=0.0).build(), steps=3)
    planned = [dataclasses.replace(p, until="decoding") for p in planned]
    harness = Harness(bus, "job", planned, decoding_wait_s=1.0)  # type: ignore[arg-type]
    waiting_for: list[int] = []  # the steps whose decoding wait the harness has begun
    wait_decoding = harness.wait_decoding

    async def spy_wait_decoding(pf: object, stop_: asyncio.Event) -> dict[str, object]:
        waiting_for.append(pf.step)  # type: ignore[attr-defined]
        return await wait_decoding(pf, stop_)  # type: ignore[arg-type]

    harness.wait_decoding = spy_wait_decoding  # type: ignore[method-assign]
    stop = asyncio.Event()
    task = asyncio.create_task(harness.run(stop))
    await eventually_async(lambda: {"rrl.events.job.request_manager.step_started", "rrl.job.metrics.>",
                                    "rrl.job.phase.>"} <= bus.handlers.keys(), timeout=5.0, interval=0.005,
                           what="the harness subscribed")
    on_step, on_metrics = bus.handlers["rrl.events.job.request_manager.step_started"], bus.handlers["rrl.job.metrics.>"]
    on_phase = bus.handlers["rrl.job.phase.>"]
    await on_metrics(_sample("rollout-1-i1", 2, 1), "", None)  # decoding, but before its step: too early
    await on_step(Event(job_id="job", kind="step_started", ts=time.time(), data={"step": 0}), "", None)
    await asyncio.sleep(0.3)  # a window for a wrong firing (nothing is awaited: it must not happen)
    assert bus.requests == [], "fired on a sample that came before the wait"
    await on_metrics(_sample("rollout-0-i0", 3, 2), "", None)  # another slot
    await on_metrics(_sample("rollout-1-i1", 0, 3), "", None)  # the slot, idle
    await on_metrics(_sample("rollout-1-i0", 4, 4), "", None)  # the slot's replaced replica
    await asyncio.sleep(0.3)  # a window for a wrong firing
    assert bus.requests == []
    t_seen = time.monotonic()
    await on_metrics(_sample("rollout-1-i1", 2, 5), "", None)
    await eventually_async(lambda: bus.requests, timeout=5.0, interval=0.005, what="the decoding sample fired it")
    assert len(bus.requests) == 1 and bus.requests[0][0] - t_seen < 0.2
    assert bus.requests[0][1].member == 1  # type: ignore[attr-defined]
    # Step 1: member 0's phase change to serving (a batch starting) fires it; idle does not.
    await on_step(Event(job_id="job", kind="step_started", ts=time.time(), data={"step": 1}), "", None)
    await eventually_async(lambda: 1 in waiting_for, timeout=5.0, interval=0.005,
                           what="the harness began its decoding wait for step 1")
    await on_phase(PhaseChange(job_id="job", member_id="rollout-0-i0", role="rollout", phase="idle"), "", None)
    await asyncio.sleep(0.3)  # a window for a wrong firing (idle must not fire it)
    assert len(bus.requests) == 1
    await on_phase(PhaseChange(job_id="job", member_id="rollout-0-i0", role="rollout", phase="serving"), "", None)
    await eventually_async(lambda: len(bus.requests) >= 2, timeout=5.0, interval=0.005,
                           what="the phase change to serving fired it")
    assert len(bus.requests) == 2
    # Step 2: member 0 never decodes; injected at the 1 s bound.
    await on_step(Event(job_id="job", kind="step_started", ts=time.time(), data={"step": 2}), "", None)
    acks = await asyncio.wait_for(task, 5.0)
    assert [a["trigger"] for a in acks] == ["decoding", "decoding", "timeout"], acks
    assert acks[0]["seen_member_id"] == "rollout-1-i1" and acks[0]["seen_inflight"] == 2
    assert acks[0]["signal"] == "metrics_inflight" and acks[1]["signal"] == "phase_serving", acks
    assert acks[2]["timeout_reason"] == "wait bound" and 0.9 <= acks[2]["waited_s"] < 2.0, acks[2]


def test_a_crash_timed_to_decoding_catches_turns_in_flight(stack, api) -> None:  # type: ignore[no-untyped-def]
    """A real job: a rollout crash with ``within_step: decoding`` on a tool-heavy job is fired by a
    decoding signal and carried out by the replica at its next batch's first token (``moment:
    mid_batch``: a kill sent from outside landed after the batch had ended, under load, suite51),
    and the request manager re-dispatches the crashed replica's turns (seen in the event log), at
    most one turn regenerated per episode; the job finishes. The turns are judged by the auditor
    from the raw stores (every batch sampled at hand-off): a crashed replica's reply and its
    regenerated reply both in one episode, or a turn under a reused request id, fail it whatever
    the request manager's own events say."""
    from jobs import kinds, small_job
    from support import audit_sampled, sample_batches

    from robustrl.chaos.runner import run_job

    spec = small_job("deccrash", steps=5, tools={"latency_s": 0.6}, data={"tasks": ["lookup"]})
    scenario = Faults("deccrash", seed=2).crash("rollout", member=0, at_step=2, within_step="decoding").build()
    samplers: list = []

    def sample(status: dict) -> None:
        if not samplers:
            samplers.append(sample_batches(stack.settings.redis_url, status["job_id"]))

    report = asyncio.run(run_job(stack.settings, api, spec, scenario, step_time_s=0.3, timeout_s=120,
                                 on_status=sample))
    assert report["status"] == "finished", report.get("error")
    assert samplers, "no status was read while the job ran"
    audit_sampled(stack.settings, report["job_id"], samplers[0])
    [ack] = report["injected"]
    assert ack["ok"] and ack["trigger"] == "decoding", (sorted(ack.items()), report["step_durations"])
    assert ack["moment"] == "mid_batch", ack
    events = api.events(report["job_id"])
    redispatched = kinds(events, "episode_redispatched")
    lost = [d for d in kinds(events, "work_lost") if d.get("turns")]
    assert redispatched and lost, ("the crash found no turn in flight", ack, kinds(events, "work_lost"))
    [crash] = [f for f in api.report(report["job_id"])["faults"] if f["role"] == "rollout" and f["injected"]]
    assert crash["turns_redispatched"] >= 1 and crash["tokens_regenerated"] > 0, crash
    assert crash["turns_regenerated"] <= crash["episodes_regenerated"], crash
    # The replica said when it struck (``fault_struck``, from its outbox: it died at once), so the
    # detection delay is timed from the strike, not unknown (before) nor from the arming.
    [struck] = [e for e in events if e["kind"] == "fault_struck"]
    assert (struck["data"]["fault_id"], struck["data"]["member_id"], struck["data"]["moment"]) == (
        ack["fault_id"], ack["member_id"], "mid_batch"), struck
    detected = min((e for e in events if e["kind"] == "fault_detected" and e["data"]["member_id"] == ack["member_id"]),
                   key=lambda e: e["ts"])  # (the first: the one accounting matches)
    assert struck["ts"] <= detected["ts"], (struck, detected)
    assert crash["moment"] == "mid_batch" and crash["struck_s"] is not None and crash["struck_s"] >= 0, crash
    assert crash["detection_s"] == pytest.approx(detected["ts"] - struck["ts"]), crash


def test_a_fault_asked_for_again_after_its_answer_was_lost_is_carried_out_once(stack, api) -> None:  # type: ignore[no-untyped-def]
    """The campaign's double fault (CI, stop 19): a chaos request reached the controller just
    before a NATS restart, the answer was refused by the restarted server, the harness asked again
    and a second trainer rank was cut off. Here the answer is lost on purpose (a reply subject no
    one listens to), then the same fault id is asked for on another member, and twice at once: the
    event log must hold one injection per fault id, and every answer must name the first member."""
    from jobs import kinds, small_job, wait_step

    from robustrl.bus import Bus
    from robustrl.messages import ChaosAck, ChaosRequest
    from robustrl.subjects import Verb, subject

    job_id = api.submit(small_job("chaosonce", steps=200))["job_id"]
    try:
        wait_step(api, job_id, 0)

        async def drive() -> tuple[ChaosAck, list[ChaosAck]]:
            bus = await Bus.connect(stack.settings.nats_url, "chaos-once", role="harness")
            try:
                subj = subject(job_id, Verb.CHAOS)
                lost = ChaosRequest(job_id=job_id, fault_id="once-a", kind="slow", role="rollout", member=0,
                                    duration_s=1.0, factor=2.0)
                await bus._nc.publish(subj, lost.encode(), reply="_INBOX.nobody-listens")
                again = await bus.request(subj, lost.model_copy(update={"member": 1}), ChaosAck, timeout=10)
                twice = ChaosRequest(job_id=job_id, fault_id="once-b", kind="slow", role="rollout", member=0,
                                     duration_s=1.0, factor=2.0)
                both = await asyncio.gather(
                    bus.request(subj, twice, ChaosAck, timeout=10),
                    bus.request(subj, twice.model_copy(update={"member": 1}), ChaosAck, timeout=10))
                return again, list(both)
            finally:
                await bus.close()

        again, both = asyncio.run(drive())
        # The controller appends its events from an outbox, in order, after it answers: the log is
        # read once a later fault of its own is in it (a barrier), not at once (a full run read it
        # before once-b's event had landed, stop 29).
        api.fault(job_id, kind="slow", role="rollout", member=0, duration_s=1.0, factor=2.0)
        eventually(lambda: any(d["fault_id"].startswith("api-")
                               for d in kinds(api.events(job_id), "fault_injected")),
                   timeout=30, what="the barrier fault in the log")
        injected = [d for d in kinds(api.events(job_id), "fault_injected") if d["fault_id"].startswith("once-")]
        by_id: dict[str, list[str]] = {}
        for d in injected:
            by_id.setdefault(d["fault_id"], []).append(d["member_id"])
        assert {k: len(v) for k, v in by_id.items()} == {"once-a": 1, "once-b": 1}, injected
        assert again.ok and again.member_id == by_id["once-a"][0] and again.member_id.startswith("rollout-0-"), again
        assert all(a.ok for a in both) and {a.member_id for a in both} == set(by_id["once-b"]), both
    finally:
        api.stop(job_id)
