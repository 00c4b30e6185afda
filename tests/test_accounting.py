"""Accounting from synthetic event logs: ETTR, detection/recovery delays, lost work."""

from __future__ import annotations

import json
import random

import pytest

from robustrl.chaos.accounting import account
from robustrl.messages import Event

T0 = 1_700_000_000.0


def ev(event_kind: str, ts: float, /, **data: object) -> Event:
    return Event(job_id="j", kind=event_kind, ts=T0 + ts, data=data)


def clean_log(steps: int, step_s: float = 1.0) -> list[Event]:
    log = [ev("job_started", -0.5)]
    t = 0.0
    for k in range(steps):
        log.append(ev("step_started", t, step=k, epoch=0))
        t += step_s
        log.append(ev("step_committed", t, step=k, epoch=0, weights_version=k + 1))
    log.append(ev("job_finished", t))
    return log


def test_clean_run_has_ettr_one() -> None:
    report = account(clean_log(10))
    assert report.steps == 10 and report.completion_s == pytest.approx(10.0)
    assert report.ettr == pytest.approx(1.0) and report.faults == []


def test_ten_second_outage_costs_ten_seconds_of_ettr() -> None:
    n, outage = 20, 10.0
    log: list[Event] = [ev("job_started", 0.0)]
    t = 0.0
    for k in range(n):
        log.append(ev("step_started", t, step=k, epoch=0))
        if k == 5:
            log += [ev("fault_injected", t + 0.2, fault_id="c1", kind="crash", role="rollout", member_id="r1",
                       step=k),
                    ev("fault_detected", t + 0.5, fault_id="d1", kind="crash", role="rollout", member_id="r1",
                       step=k, detected_at=T0 + t + 0.5),
                    ev("decision", t + 0.6, fault_id="d1", actions=["replace_replica(r1)"], reason="x"),
                    ev("work_lost", t + 1.0, fault_id="d1", tokens=340, steps_redone=0),
                    ev("recovered", t + 4.0, fault_id="d1", role="rollout")]
            t += outage
        t += 1.0
        log.append(ev("step_committed", t, step=k, epoch=0, weights_version=k + 1))
    log.append(ev("job_finished", t))
    random.Random(0).shuffle(log)  # the log order does not matter, the timestamps do
    report = account(log)
    assert report.ettr == pytest.approx(n / (n + outage))
    assert report.completion_s == pytest.approx(n + outage)
    [fault] = report.faults
    assert (fault.kind, fault.role, fault.member_id) == ("crash", "rollout", "r1")
    assert fault.detection_s == pytest.approx(0.3)
    assert fault.recovery_s == pytest.approx(3.5)
    assert (fault.tokens_regenerated, fault.steps_redone) == (340, 0)


def test_whole_job_restart_redo_counts_the_step_once() -> None:
    log = clean_log(3)[:-1]  # 3 clean steps, t = 3
    log += [ev("step_started", 3.0, step=3, epoch=0),
            ev("fault_injected", 3.5, fault_id="c1", kind="hang", role="trainer", member_id="t0", step=3),
            # the gang peer notices first: matched by role
            ev("fault_detected", 7.5, fault_id="d1", kind="hang", role="trainer", member_id="t1", step=3,
               detected_at=T0 + 7.5),
            ev("work_lost", 8.0, fault_id="d1", tokens=1000, steps_redone=1),
            ev("recovered", 12.0, fault_id="d1", role="trainer"),
            ev("step_started", 12.0, step=3, epoch=1),
            ev("step_committed", 13.0, step=3, epoch=1, weights_version=4),
            ev("job_finished", 13.0)]
    report = account(log)
    assert report.steps == 4
    assert report.ettr == pytest.approx(4 / 13)
    [fault] = report.faults
    assert fault.detection_s == pytest.approx(4.0) and fault.recovery_s == pytest.approx(4.5)
    assert fault.steps_redone == 1 and fault.tokens_regenerated == 1000


def test_undetected_fault_and_false_positive_are_both_listed() -> None:
    log = clean_log(4)
    log += [ev("fault_injected", 1.2, fault_id="c1", kind="slow", role="rollout", member_id="r0", step=1,
               duration_s=0.5),
            ev("fault_detected", 2.5, fault_id="d9", kind="unresponsive", role="trainer", member_id="t0",
               step=2, detected_at=T0 + 2.5)]
    report = account(log)
    injected, spurious = report.faults
    assert injected.injected and injected.detection_s is None and injected.recovery_s is None
    assert not spurious.injected and spurious.member_id == "t0" and spurious.detection_s is None


def test_detection_before_injection_is_not_matched() -> None:
    log = clean_log(4)
    log += [ev("fault_detected", 0.5, fault_id="d1", kind="crash", role="rollout", member_id="r0", step=0,
               detected_at=T0 + 0.5),
            ev("fault_injected", 2.0, fault_id="c1", kind="crash", role="rollout", member_id="r0", step=2)]
    report = account(log)
    assert [f.injected for f in report.faults] == [False, True]
    assert report.faults[1].detection_s is None


def test_an_armed_crash_has_no_detection_delay_and_its_fault_opens_at_detection() -> None:
    """``moment: mid_tool_turn``: injected (armed) at 0.5, it struck at a moment the log does not
    hold and was detected at 2.5. Timed from the arming, detection would read 2.0 s."""
    log = clean_log(4)
    log += [ev("fault_injected", 0.5, fault_id="c1", kind="crash", role="rollout", member_id="r0", step=0,
               moment="mid_tool_turn"),
            ev("fault_detected", 2.5, fault_id="d1", kind="crash", role="rollout", member_id="r0", step=2,
               detected_at=T0 + 2.5),
            ev("recovered", 3.0, fault_id="d1", role="rollout")]
    [fault] = account(log).faults
    assert fault.injected and fault.detection_s is None and fault.recovery_s == pytest.approx(0.5)
    # The same crash carried out at once: timed from its injection.
    log[-3] = ev("fault_injected", 0.5, fault_id="c1", kind="crash", role="rollout", member_id="r0", step=0)
    assert account(log).faults[0].detection_s == pytest.approx(2.0)


def test_an_armed_crash_that_never_struck_opens_no_fault_interval() -> None:
    """Armed at 0.5 and never detected (no turn after a tool result reached the replica): nothing
    happened, so no step is taken out of the reference. Before, its interval ran from the arming
    to the job's end and every later step counted as faulty, skewing ETTR (outside review)."""
    log = clean_log(6, step_s=2.0)
    log[2] = ev("step_committed", 1.0, step=0, epoch=0, weights_version=1)  # a quick first step: min < median
    fault_free = account(log).ettr
    log += [ev("fault_injected", 0.5, fault_id="c1", kind="crash", role="rollout", member_id="r0", step=0,
               moment="mid_tool_turn")]
    [fault] = account(log).faults
    assert fault.injected and fault.detection_s is None and fault.recovery_s is None
    assert account(log).ettr == pytest.approx(fault_free)


def test_an_armed_crash_never_takes_another_members_detection() -> None:
    """Armed on r1 and never struck, then r0 crashes for real: r0's detection and recovery are
    r0's. Before, the armed fault took them by the role fallback, r0's crash was left undetected
    and its interval ran to the job's end (ETTR 0.79 instead of the same as with r0's crash alone:
    an outside review ran this). An armed fault is matched only to its own member's detection,
    within its arming window."""
    log = clean_log(8)
    crash = [ev("fault_injected", 4.6, fault_id="c0", kind="crash", role="rollout", member_id="r0", step=4),
             ev("fault_detected", 4.8, fault_id="d0", kind="crash", role="rollout", member_id="r0", step=4,
                detected_at=T0 + 4.8),
             ev("recovered", 5.2, fault_id="d0", role="rollout")]
    alone = account(log + crash)
    armed = ev("fault_injected", 0.2, fault_id="c1", kind="crash", role="rollout", member_id="r1", step=0,
               moment="mid_tool_turn", duration_s=3.0)
    both = account(log + [armed] + crash)
    assert both.ettr == pytest.approx(alone.ettr)
    by_member = {f.member_id: f for f in both.faults}
    assert by_member["r0"].recovery_s == pytest.approx(0.4) and by_member["r0"].detection_s == pytest.approx(0.2)
    assert by_member["r1"].recovery_s is None
    # Its own member's detection, but after its arming window: not its either.
    late = ev("fault_detected", 6.0, fault_id="d1", kind="crash", role="rollout", member_id="r1", step=6,
              detected_at=T0 + 6.0)
    assert {f.member_id: f for f in account(log + [armed, late]).faults if f.injected}["r1"].recovery_s is None
    assert len([f for f in account(log + [armed, late]).faults if not f.injected]) == 1


def test_to_json_has_exactly_the_report_keys() -> None:
    data = json.loads(account(clean_log(2)).to_json())
    assert set(data) == {"ettr", "completion_s", "steps", "faults", "events_skipped"}
    log = clean_log(2) + [ev("fault_injected", 0.5, fault_id="c", kind="crash", role="rollout",
                             member_id="r0", step=0)]
    [fault] = json.loads(account(log).to_json())["faults"]
    assert {"kind", "role", "detection_s", "recovery_s", "tokens_regenerated", "steps_redone"} <= set(fault)


def test_empty_and_unfinished_logs() -> None:
    assert account([]).ettr == 0.0
    report = account(clean_log(3)[:-1])  # no job_finished: wall time runs to the last event
    assert report.completion_s == pytest.approx(3.0) and report.ettr == pytest.approx(1.0)


def test_envelopes_with_wrong_inner_types_are_skipped_and_counted() -> None:
    """Issue 11: ``{"tokens": "many"}`` in a work_lost event made the report raise ValueError."""
    log = clean_log(3)
    bad = [Event.model_construct(job_id="j", kind="work_lost", ts=T0 + 1.5,
                                 data={"fault_id": "d1", "tokens": "many", "steps_redone": 0}),
           Event.model_construct(job_id="j", kind="step_committed", ts=T0 + 1.6, data={"step": "two"}),
           Event.model_construct(job_id="j", kind="fault_detected", ts="soon", data={})]
    log += [ev("fault_detected", 1.0, fault_id="d1", kind="crash", role="rollout", member_id="r0", step=1,
               detected_at=T0 + 1.0), *bad]
    report = account(log)
    assert report.events_skipped == len(bad)
    assert report.steps == 3
    [fault] = report.faults
    assert fault.tokens_regenerated == 0
    assert report.to_dict()["events_skipped"] == len(bad)
