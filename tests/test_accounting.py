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


def uneven_log() -> list[Event]:
    """Six 2-s steps whose first took 1 s: the reference (median of clean steps) and the minimum
    differ, so a fault interval over every step shows in ETTR."""
    log = clean_log(6, step_s=2.0)
    log[2] = ev("step_committed", 1.0, step=0, epoch=0, weights_version=1)  # a quick first step: min < median
    return log


def detected_then_recovered(fault_id: str, at: float, recovered_at: float, *, kind: str = "crash",
                            member_id: str = "r0", step: int = 0) -> list[Event]:
    """A rollout fault of ``member_id`` detected at ``at`` and recovered at ``recovered_at``."""
    return [ev("fault_detected", at, fault_id=fault_id, kind=kind, role="rollout", member_id=member_id, step=step,
               detected_at=T0 + at),
            ev("recovered", recovered_at, fault_id=fault_id, role="rollout")]


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


def test_an_armed_crash_is_timed_from_its_strike_and_reports_when_it_struck() -> None:
    """Armed at 0.5, struck at 2.0 (``fault_struck``, saved by the replica as it died), detected at
    2.5: the detection delay is 0.5 s and the arming-to-strike 1.5 s; its fault opens at the strike,
    so the step it struck in is faulty. A strike of another fault id, or another member, is not its."""
    log = clean_log(4)
    armed = ev("fault_injected", 0.5, fault_id="c1", kind="crash", role="rollout", member_id="r0", step=0,
               moment="mid_batch")
    detected = detected_then_recovered("d1", 2.5, 3.0, step=2)
    struck = ev("fault_struck", 2.0, fault_id="c1", member_id="r0", moment="mid_batch")
    [fault] = account([*log, armed, struck, *detected]).faults
    assert fault.moment == "mid_batch" and fault.struck_s == pytest.approx(1.5)
    assert fault.detection_s == pytest.approx(0.5) and fault.recovery_s == pytest.approx(0.5)
    for other in (ev("fault_struck", 2.0, fault_id="c9", member_id="r0", moment="mid_batch"),
                  ev("fault_struck", 2.0, fault_id="c1", member_id="r1", moment="mid_batch")):
        [fault] = account([*log, armed, other, *detected]).faults
        assert fault.struck_s is None and fault.detection_s is None, other
    # Struck and never detected: a missed detection, open (faulty) from the strike to the end,
    # unlike an arming that never struck (``..._never_struck_opens_no_fault_interval``).
    log = uneven_log()
    armed = ev("fault_injected", 0.2, fault_id="c1", kind="crash", role="rollout", member_id="r0", step=0,
               moment="mid_batch")
    never = account([*log, armed])
    missed = account([*log, armed, ev("fault_struck", 0.5, fault_id="c1", member_id="r0", moment="mid_batch")])
    [fault] = missed.faults
    assert fault.struck_s == pytest.approx(0.3) and fault.detection_s is None
    assert never.ettr == pytest.approx(account(log).ettr) and missed.ettr < never.ettr


def test_an_armed_crash_takes_the_first_detection_after_its_strike_wherever_its_window_ends() -> None:
    """Armed for 2 s at 0.5 and struck at 2.45, detected at 2.7, past the window: the detection is
    the crash's (0.25 s), and its fault closes at the recovery. Before (the window bounded the
    detection), it was left undetected, open to the job's end, and the detection was counted as a
    second fault (ETTR 0.719 for 0.938: an outside review). A detection of the member before the
    strike (a stall's false positive, say) is not the crash's either (it read -1.0 s)."""
    log = clean_log(10)
    armed = ev("fault_injected", 0.5, fault_id="c1", kind="crash", role="rollout", member_id="r0", step=0,
               moment="mid_batch", duration_s=2.0)
    struck = ev("fault_struck", 2.45, fault_id="c1", member_id="r0", moment="mid_batch")
    crash = detected_then_recovered("d1", 2.7, 3.2, step=2)
    report = account([*log, armed, struck, *crash])
    [fault] = report.faults
    assert fault.detected and fault.detection_s == pytest.approx(0.25) and fault.recovery_s == pytest.approx(0.5)
    early = detected_then_recovered("d0", 1.0, 1.2, kind="stall", step=1)
    faults = account([*log, armed, *early, struck, *crash]).faults
    [mine] = [f for f in faults if f.injected]
    assert mine.detection_s == pytest.approx(0.25) and mine.recovery_s == pytest.approx(0.5), faults
    assert [f.kind for f in faults if not f.injected] == ["stall"]


def test_a_strike_is_one_faults_even_when_its_injection_was_retried_or_the_clocks_disagree() -> None:
    """The injection was logged, failed, and was retried under its id (``chaos.py`` forgets the id
    on failure): one strike, credited to the retry alone (both took it before, the first then open
    to the job's end with no detection). A strike stamped 0.2 s before its arming (the replica's
    clock behind the controller's) is still its, with ``struck_s`` 0, never negative."""
    log = clean_log(10)
    first = ev("fault_injected", 0.5, fault_id="c1", kind="crash", role="rollout", member_id="r0", step=0,
               moment="mid_batch", duration_s=5.0)
    retry = ev("fault_injected", 0.9, fault_id="c1", kind="crash", role="rollout", member_id="r0", step=0,
               moment="mid_batch", duration_s=5.0)
    struck = ev("fault_struck", 1.5, fault_id="c1", member_id="r0", moment="mid_batch")
    crash = detected_then_recovered("d1", 1.6, 2.0, step=1)
    faults = account([*log, first, retry, struck, *crash]).faults
    assert [(f.struck_s is not None, f.detected) for f in faults] == [(False, False), (True, True)], faults
    assert faults[1].struck_s == pytest.approx(0.6) and faults[1].detection_s == pytest.approx(0.1)
    skewed = ev("fault_struck", 0.3, fault_id="c1", member_id="r0", moment="mid_batch")
    [fault] = account([*log, first, skewed, *crash]).faults
    assert fault.struck_s == 0.0 and fault.detection_s == pytest.approx(1.3)


def test_a_report_the_controller_only_ignored_opens_no_fault_interval() -> None:
    """A crashed replica's turns time out during the whole-job restart its crash set off, and the
    request manager reports it unresponsive; the controller ignores the report (a member of a past
    incarnation) and nothing ever recovers it. Seen in the rollout-crash ETTR bench: it held a
    fault open to the job's end, so every later step of the baseline counted as faulty. Listed,
    marked ``ignored``, and no interval; a report the controller acted on still opens one."""
    log = uneven_log()
    clean = account(log).ettr
    report = [ev("fault_detected", 0.5, fault_id="d9", kind="unresponsive", role="rollout", member_id="r0", step=0,
                 detected_at=T0 + 0.5)]
    ignored = account([*log, *report, ev("decision", 0.6, fault_id="d9", actions=["Ignore"], reason="stale")])
    [fault] = ignored.faults
    assert fault.ignored and not fault.injected
    assert ignored.ettr == pytest.approx(clean)
    acted = account([*log, *report, ev("decision", 0.6, fault_id="d9", actions=["ReplaceReplica"], reason="x")])
    assert not acted.faults[0].ignored and acted.ettr < clean


def test_an_armed_crash_that_never_struck_opens_no_fault_interval() -> None:
    """Armed at 0.5 and never detected (no turn after a tool result reached the replica): nothing
    happened, so no step is taken out of the reference. Before, its interval ran from the arming
    to the job's end and every later step counted as faulty, skewing ETTR (outside review)."""
    log = uneven_log()
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
