"""Chaos scenario files, validation errors, the builder and the seeded plan."""

from __future__ import annotations

from pathlib import Path

import pytest

from robustrl.chaos.scenario import Faults, PlannedFault, load_scenario, plan
from robustrl.errors import ScenarioError

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
    ("faults: [{kind: slow, role: rollout, at_step: 1, factor: 0.5}]", "faults[0].factor"),
    ("faults: [{kind: tool_outage, at_step: 1}]", "faults[0].duration_s"),
    ("faults: [{kind: tool_outage, role: rollout, at_step: 1, duration_s: 1}]", "faults[0].role"),
    ("faults: [{kind: crash, role: rollout, at_step: 1, colour: red}]", "faults[0].colour"),
    ("faults: [{kind: crash, role: rollout, at_step: 1}, {kind: crash, at_step: 1}]", "faults[1].role"),
    ("faults: [{kind: infra_restart, role: rollout, at_step: 1}]", "faults[0].role"),
    ("faults: [{kind: crash, role: redis, at_step: 1}]", "faults[0].role"),
    ("faults: [{kind: slow, role: controller, at_step: 1}]", "faults[0].role"),
    ("faults: [{kind: tool_outage, role: detector, at_step: 1, duration_s: 1}]", "faults[0].role"),
    ("faults: [{kind: net_drop, role: request_manager, at_step: 1}]", "faults[0].role"),
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


def test_plan_rejects_member_index_beyond_the_job() -> None:
    sc = Faults().crash("trainer", member=5, at_step=0).build()
    with pytest.raises(ScenarioError, match="index 5"):
        plan(sc, steps=3)
    with pytest.raises(ScenarioError):
        plan(Faults().job(rollout={"replicas": 0}).build(), steps=3)


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
