"""Detector rules with a fake clock: every fault rule and the benign look-alikes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from pydantic import ValidationError

from robustrl.config import DetectorSpec
from robustrl.messages import Event, FaultReport, MemberExited, MetricsSample, PhaseChange
from robustrl.services.detector.monitor import JobMonitor
from robustrl.services.detector.rules import MemberHistory, Status, evaluate_member, fail_slow_rule

CFG = DetectorSpec(trainer_idle_s=4.0, rollout_idle_s=2.0, silence_s=3.0, probe_timeout_s=1.0,
                   metrics_interval_s=0.25, weights_load_s=8.0)
DT = 0.25
JOB = "job1"


@dataclass
class Member:
    """A fake member: its counters, and what it reports at each sample."""

    member_id: str
    role: str
    phase: str = "serving"
    activity: int = 0
    tokens: int = 0
    rate: float = 0.0
    inflight: int = 0
    tool_waiting: int = 0
    queue: int = 0
    step: int = 3
    seq: int = 0
    skew_s: float = 0.0
    sent: list[MetricsSample] = field(default_factory=list)

    def sample(self, now: float) -> MetricsSample:
        self.seq += 1
        msg = MetricsSample(job_id=JOB, member_id=self.member_id, role=self.role, seq=self.seq,
                            ts=now + self.skew_s, phase=self.phase, step=self.step, activity=self.activity,
                            tokens_total=self.tokens, tokens_per_s=self.rate, inflight=self.inflight,
                            tool_waiting=self.tool_waiting, queue_depth=self.queue)
        self.sent.append(msg)
        return msg


@dataclass
class Run:
    """Drive a monitor with a fake clock: one sample per member per DT, then a tick."""

    mon: JobMonitor
    now: float = 1000.0
    faults: list[tuple[float, FaultReport]] = field(default_factory=list)
    probes: list[tuple[float, str]] = field(default_factory=list)

    def advance(self, seconds: float, members: list[Member], *, send: bool = True,
                step: Callable[[Member, float], None] | None = None,
                answer_probes: bool = False) -> None:
        end = self.now + seconds
        while self.now < end - 1e-9:
            self.now = round(self.now + DT, 6)
            for m in members:
                if step is not None:
                    step(m, self.now)
                if send:
                    self.mon.sample(m.sample(self.now), self.now)
            result = self.mon.tick(self.now)
            self.faults.extend((self.now, f) for f in result.faults)
            for p in result.probes:
                self.probes.append((self.now, p.member_id))
                if answer_probes:
                    assert self.mon.probe_reply(p.member_id, p.nonce, self.now + 0.01)

    def first_fault_at(self) -> float | None:
        return self.faults[0][0] if self.faults else None


def monitor(cfg: DetectorSpec = CFG) -> JobMonitor:
    counter = iter(range(10_000))
    return JobMonitor(JOB, cfg, new_id=lambda: f"id{next(counter)}")


def progressing(m: Member, _now: float) -> None:
    m.activity += 5
    m.tokens += 10
    m.rate = 40.0


# --- trainer ------------------------------------------------------------------------------


def test_trainer_hang_in_training_after_trainer_idle_s() -> None:
    run, t = Run(monitor()), Member("t0", "trainer", phase="training")
    run.advance(2.0, [t], step=progressing)
    start = run.now
    run.advance(6.0, [t])  # samples keep coming, activity frozen
    assert len(run.faults) == 1
    at, fault = run.faults[0]
    assert fault.kind == "hang" and fault.role == "trainer" and fault.member_id == "t0"
    assert fault.step == 3 and "training" in fault.evidence
    assert CFG.trainer_idle_s - DT <= at - start <= CFG.trainer_idle_s + DT
    assert run.probes == []  # a hang in training needs no probe: the samples prove it is alive


def test_trainer_slow_checkpointing_and_waiting_are_not_hangs() -> None:
    for phase in ("checkpointing", "waiting_batch", "publishing", "idle"):
        run, t = Run(monitor()), Member("t0", "trainer", phase="training")
        run.advance(1.0, [t], step=progressing)
        t.phase = phase
        run.advance(5 * CFG.trainer_idle_s, [t])
        assert run.faults == [] and run.probes == [], phase


def test_a_trainer_stuck_checkpointing_or_publishing_is_a_hang_after_trainer_io_s() -> None:
    """Idle while checkpointing or publishing is normal; for ``trainer_io_s`` it is not (a snapshot
    or publish that never returned, the member's samples still coming, stalled the job for good).
    A phase change restarts the clock."""
    cfg = CFG.model_copy(update={"trainer_io_s": 12.0})
    for phase in ("checkpointing", "publishing"):
        run, t = Run(monitor(cfg)), Member("t0", "trainer", phase="training")
        run.advance(1.0, [t], step=progressing)
        t.phase = "checkpointing" if phase == "publishing" else "publishing"
        run.advance(8.0, [t])  # the other I/O phase, within the bound
        t.phase = phase
        start = run.now
        run.advance(cfg.trainer_io_s - 1.0, [t])
        assert run.faults == [], phase
        run.advance(2.0, [t])
        assert len(run.faults) == 1, phase
        at, fault = run.faults[0]
        assert (fault.kind, fault.cause, fault.member_id, fault.step) == ("hang", "trainer_io_stalled", "t0", 3)
        assert phase in fault.evidence and cfg.trainer_io_s - DT <= at - start <= cfg.trainer_io_s + DT
        assert run.probes == []


def test_trainer_idle_clock_restarts_when_training_begins() -> None:
    run, t = Run(monitor()), Member("t0", "trainer", phase="waiting_batch")
    run.advance(10.0, [t])  # long wait for the batch, activity frozen all along
    t.phase = "training"
    run.advance(CFG.trainer_idle_s - 1.0, [t])
    assert run.faults == []
    run.advance(2.0, [t])
    assert [f.kind for _, f in run.faults] == ["hang"]


def test_phase_change_message_sets_training_phase() -> None:
    mon = monitor()
    run, t = Run(mon), Member("t0", "trainer", phase="checkpointing")
    run.advance(1.0, [t])
    mon.phase(PhaseChange(job_id=JOB, member_id="t0", role="trainer", phase="training", step=4, ts=0.0),
              run.now)
    t.phase, t.step = "training", 4
    run.advance(CFG.trainer_idle_s + 0.5, [t])
    assert [f.step for _, f in run.faults] == [4]
    assert run.faults[0][0] - 1001.0 <= CFG.trainer_idle_s + DT  # idle clock from the phase message


# --- rollout ------------------------------------------------------------------------------


def test_rollout_frozen_tokens_probe_unanswered_is_unresponsive() -> None:
    run, r = Run(monitor()), Member("r0", "rollout", inflight=4)
    run.advance(1.0, [r], step=progressing)
    start = run.now
    run.advance(5.0, [r])
    assert run.probes and run.probes[0][1] == "r0"
    assert CFG.rollout_idle_s - DT <= run.probes[0][0] - start <= CFG.rollout_idle_s + DT
    assert len(run.probes) == 1  # one probe per suspicion, not one per tick
    at, fault = run.faults[0]
    assert fault.kind == "unresponsive" and fault.role == "rollout"
    assert at - run.probes[0][0] == CFG.probe_timeout_s
    assert len(run.faults) == 1


def test_rollout_stall_answers_probes_but_no_progress_is_hang() -> None:
    run, r = Run(monitor()), Member("r0", "rollout", inflight=4)
    run.advance(1.0, [r], step=progressing)
    start = run.now
    run.advance(6.0, [r], answer_probes=True)
    assert len(run.probes) == 1
    at, fault = run.faults[0]
    assert fault.kind == "hang" and "answers probes" in fault.evidence
    assert 2 * CFG.rollout_idle_s - DT <= at - start <= 2 * CFG.rollout_idle_s + DT
    assert fault.last_progress_at is not None and fault.last_progress_at <= start


def test_rollout_waiting_on_tools_is_normal() -> None:
    run, r = Run(monitor()), Member("r0", "rollout", inflight=3)
    run.advance(1.0, [r], step=progressing)
    r.tool_waiting = 3  # every request waits on a slow tool, far longer than rollout_idle_s
    run.advance(10 * CFG.rollout_idle_s, [r])
    assert run.faults == [] and run.probes == []


def test_idle_replica_without_requests_is_normal() -> None:
    run, r = Run(monitor()), Member("r0", "rollout", phase="idle")
    run.advance(30.0, [r])
    assert run.faults == [] and run.probes == []


def test_busy_clock_starts_when_work_arrives_not_at_last_token() -> None:
    run, r = Run(monitor()), Member("r0", "rollout")
    run.advance(20.0, [r])  # idle for a long time: tokens unchanged since the start
    r.inflight = 2
    run.advance(CFG.rollout_idle_s - 0.5, [r])
    assert run.probes == []


def test_loading_weights_with_requests_within_weights_load_s_is_not_a_stall() -> None:
    run, r = Run(monitor()), Member("r0", "rollout", phase="loading_weights", inflight=5, queue=3)
    run.advance(CFG.weights_load_s - 1.0, [r])
    assert run.faults == [] and run.probes == []


def test_progress_after_probe_clears_suspicion_and_a_later_stall_is_probed_again() -> None:
    run, r = Run(monitor()), Member("r0", "rollout", inflight=2)
    run.advance(CFG.rollout_idle_s + 0.5, [r], answer_probes=True)
    assert len(run.probes) == 1
    run.advance(3.0, [r], step=progressing)
    run.advance(CFG.rollout_idle_s + 0.5, [r])
    assert len(run.probes) == 2 and run.faults == []


# --- silence ------------------------------------------------------------------------------


def test_silence_probe_timeout_is_unresponsive() -> None:
    run, t = Run(monitor()), Member("t0", "trainer", phase="waiting_batch")
    run.advance(1.0, [t])
    last = run.now
    run.advance(6.0, [t], send=False)
    probe_at = run.probes[0][0]
    assert probe_at - last == CFG.silence_s
    at, fault = run.faults[0]
    assert fault.kind == "unresponsive" and "no metrics" in fault.evidence
    assert at - probe_at == CFG.probe_timeout_s


def test_a_host_gone_silent_reports_its_trainer_rank_before_its_replica() -> None:
    """A host cut off silences a replica and a gang rank in the same tick; the replica is the
    older member here (first in the monitor), yet the trainer's fault comes first: the
    controller handles reports in order, and the gang must get the warm spare before the
    replica's replacement does."""
    run = Run(monitor())
    r, t = Member("r0", "rollout"), Member("t0", "trainer", phase="waiting_batch")
    run.advance(1.0, [r, t])
    run.advance(6.0, [r, t], send=False)
    ticks = {at for at, _ in run.faults}
    assert len(ticks) == 1, run.faults  # both failed in one tick
    assert [f.member_id for _, f in run.faults] == ["t0", "r0"]


def test_samples_delayed_by_load_within_silence_s_are_fine() -> None:
    run, r = Run(monitor()), Member("r0", "rollout", inflight=1)
    for _ in range(10):  # a sample every 2.5 s (< silence_s), progressing each time
        run.advance(2.5, [r], send=False)
        progressing(r, run.now)
        run.mon.sample(r.sample(run.now), run.now)
    assert run.faults == [] and run.probes == []


def test_silent_member_answering_probes_is_alive() -> None:
    run, t = Run(monitor()), Member("t0", "trainer", phase="waiting_batch")
    run.advance(1.0, [t])
    run.advance(20.0, [t], send=False, answer_probes=True)
    assert run.faults == []
    assert len(run.probes) >= 5  # re-probed once every silence_s


def test_duplicate_and_out_of_order_samples_are_dropped() -> None:
    mon = monitor()
    run, r = Run(mon), Member("r0", "rollout", inflight=2)
    run.advance(1.0, [r], step=progressing)
    old = r.sent[0]  # an old sample (seq 1) replayed late, with a different token count
    h = mon.members["r0"]
    tokens = h.tokens_total
    assert not mon.sample(old, run.now)
    assert not mon.sample(r.sent[-1], run.now)  # exact duplicate
    assert h.dropped == 2 and h.tokens_total == tokens
    # a replayed sample is not progress: the stall is still detected on time
    run.advance(5.0, [r], step=lambda m, now: mon.sample(old, now))
    assert [f.kind for _, f in run.faults] == ["unresponsive"]


def test_member_clock_skewed_by_hours_changes_nothing() -> None:
    for skew in (-7200.0, 7200.0):
        run, r = Run(monitor()), Member("r0", "rollout", inflight=2, skew_s=skew)
        run.advance(10.0, [r], step=progressing)
        assert run.faults == [] and run.probes == []
        start = run.now
        run.advance(5.0, [r])
        assert run.probes[0][0] - start == CFG.rollout_idle_s


# --- exits, reporting once ----------------------------------------------------------------


def test_unexpected_exit_is_crash_at_once_and_reported_once() -> None:
    mon = monitor()
    run, r = Run(mon), Member("r0", "rollout", inflight=2)
    run.advance(1.0, [r], step=progressing)
    fault = mon.exited(MemberExited(job_id=JOB, member_id="r0", role="rollout", returncode=-9), run.now)
    assert fault is not None and fault.kind == "crash" and "-9" in fault.evidence
    again = MemberExited(job_id=JOB, member_id="r0", role="rollout", returncode=-9)
    assert mon.exited(again, run.now) is None
    run.advance(10.0, [r], send=False)
    assert run.faults == [] and run.probes == []


def test_expected_exit_forgets_member_and_late_samples_are_ignored() -> None:
    mon = monitor()
    run, r = Run(mon), Member("r0", "rollout", inflight=2)
    run.advance(1.0, [r], step=progressing)
    assert mon.exited(MemberExited(job_id=JOB, member_id="r0", role="rollout", returncode=0,
                                   expected=True), run.now) is None
    assert "r0" not in mon.members
    run.advance(10.0, [r])  # late samples of the stopped member, frozen
    assert "r0" not in mon.members and run.faults == [] and run.probes == []


def test_fault_is_reported_once_while_the_controller_acts() -> None:
    run, t = Run(monitor()), Member("t0", "trainer", phase="training")
    run.advance(30.0, [t])
    assert len(run.faults) == 1


def test_unconfigured_monitor_reports_nothing_until_spec_known() -> None:
    mon = JobMonitor(JOB)
    run, r = Run(mon), Member("r0", "rollout", inflight=2)
    run.advance(10.0, [r])
    assert run.faults == [] and run.probes == []
    mon.configure(CFG)
    run.advance(0.25, [r])
    assert run.probes  # the history collected meanwhile is used at once


# --- fail-slow ----------------------------------------------------------------------------


def _replicas(n: int) -> list[Member]:
    return [Member(f"r{i}", "rollout", inflight=4) for i in range(n)]


def test_fail_slow_replica_is_reported_after_rollout_idle_s() -> None:
    run, members = Run(monitor()), _replicas(3)

    def step(m: Member, _now: float) -> None:
        per_tick = 1 if m.member_id == "r1" else 20  # r1 runs 20x slower
        m.tokens += per_tick
        m.rate = per_tick / DT

    run.advance(6.0, members, step=step)
    assert [(f.member_id, f.kind) for _, f in run.faults] == [("r1", "fail_slow")]
    assert CFG.rollout_idle_s <= run.first_fault_at() - 1000.0 <= CFG.rollout_idle_s + 2 * DT


def test_replica_with_less_work_is_not_fail_slow() -> None:
    run, members = Run(monitor()), _replicas(3)
    members[0].inflight = 1  # one leftover episode: a fraction of its peers' tokens/s

    def step(m: Member, _now: float) -> None:
        per_tick = 3 * m.inflight
        m.tokens += per_tick
        m.rate = per_tick / DT

    run.advance(10.0, members, step=step)
    assert run.faults == []


def test_brief_slowdown_is_not_fail_slow() -> None:
    histories = []
    for i, slow in enumerate((True, False, False)):
        h = MemberHistory(JOB, f"r{i}", "rollout", first_seen=0.0)
        m = Member(f"r{i}", "rollout", inflight=2)
        for k in range(1, 13):
            now = k * DT
            m.rate = 2.0 if slow and k > 6 else 80.0  # slow only for the last 1.5 s
            m.tokens += int(m.rate * DT)
            h.observe_sample(m.sample(now), now)
        histories.append(h)
    assert fail_slow_rule(3.0, histories, CFG) == {}


# --- tools ----------------------------------------------------------------------------------


def test_tool_fault_is_a_request_manager_fault_reported_once_per_outage() -> None:
    mon = monitor()
    event = Event(job_id=JOB, kind="tool_fault",
                  data={"member_id": "rm0", "tool": "calc", "error": "connection refused", "attempts": 3,
                        "step": 7})
    fault = mon.tool_fault(event, 10.0)
    assert fault is not None
    assert (fault.kind, fault.role, fault.member_id) == ("tool_outage", "request_manager", "rm0")
    assert fault.step == 7
    assert mon.tool_fault(event, 11.0) is None  # same outage, still failing
    assert mon.tool_fault(event, 10.5 + CFG.silence_s) is None
    assert mon.tool_fault(event, 12.0 + 3 * CFG.silence_s) is not None  # a new outage later


def test_evaluate_member_is_ok_for_fresh_member() -> None:
    h = MemberHistory(JOB, "r0", "rollout", first_seen=5.0)
    assert evaluate_member(6.0, h, CFG).status is Status.OK


# --- queued work, bounded weight loads (issue 9 item 2) -----------------------------------


def test_queued_work_with_nothing_in_flight_and_no_tokens_is_a_stall() -> None:
    # A replica whose engine takes no work (dead engine thread, or requeueing turns for a
    # version it never obtains) reports inflight=0 but a growing queue.
    run, r = Run(monitor()), Member("r0", "rollout", phase="idle")
    run.advance(1.0, [r], step=progressing)
    r.rate, r.queue = 0.0, 4
    start = run.now
    run.advance(3 * CFG.rollout_idle_s, [r], answer_probes=True)
    assert run.probes and run.probes[0][0] - start <= CFG.rollout_idle_s + DT
    [(at, fault)] = run.faults
    assert (fault.kind, fault.cause) == ("hang", "queue_stalled")
    assert "queued" in fault.evidence
    assert 2 * CFG.rollout_idle_s - DT <= at - start <= 2 * CFG.rollout_idle_s + DT
    # the evidence time is the first sample that showed queued work and no progress
    assert fault.fault_at == start + DT


def test_queue_drained_by_progress_is_normal() -> None:
    run, r = Run(monitor()), Member("r0", "rollout", phase="serving", queue=6, inflight=2)
    run.advance(20.0, [r], step=progressing)
    assert run.faults == [] and run.probes == []


def test_weight_load_longer_than_weights_load_s_is_a_named_fault() -> None:
    run, r = Run(monitor()), Member("r0", "rollout", phase="idle")
    run.advance(1.0, [r])
    r.phase = "loading_weights"
    start = run.now
    run.advance(2 * CFG.weights_load_s, [r], answer_probes=True)
    [(at, fault)] = run.faults
    assert (fault.kind, fault.cause) == ("hang", "weights_load_timeout")
    assert "loading_weights" in fault.evidence
    assert CFG.weights_load_s - DT <= at - start <= CFG.weights_load_s + DT
    assert fault.fault_at == start + DT  # the sample that first showed the load


def test_replica_reporting_weights_failed_is_a_fault_at_once() -> None:
    mon = monitor()
    run, r = Run(mon), Member("r0", "rollout", phase="loading_weights")
    run.advance(1.0, [r])
    mon.phase(PhaseChange(job_id=JOB, member_id="r0", role="rollout", phase="weights_failed", ts=0.0),
              run.now + 0.1)
    r.phase = "weights_failed"
    run.advance(DT, [r])
    [(_, fault)] = run.faults
    assert (fault.kind, fault.cause) == ("hang", "weights_failed")
    assert fault.fault_at == pytest.approx(1001.1)


def test_detector_spec_validates_weights_load_s() -> None:
    with pytest.raises(ValidationError):
        DetectorSpec(weights_load_s=0.0)
    assert DetectorSpec.reference().weights_load_s < DetectorSpec.production().weights_load_s


# --- evidence times (issue 9 item 8) ------------------------------------------------------


def test_silence_fault_at_is_the_last_metric_before_silence() -> None:
    run, t = Run(monitor()), Member("t0", "trainer", phase="waiting_batch")
    run.advance(1.0, [t])
    last = run.now
    run.advance(6.0, [t], send=False)
    [(at, fault)] = run.faults
    assert fault.fault_at == last and fault.cause == "silence"
    assert at - fault.fault_at == CFG.silence_s + CFG.probe_timeout_s


def test_stall_and_hang_fault_at_is_the_first_zero_progress_sample() -> None:
    run, r = Run(monitor()), Member("r0", "rollout", inflight=4)
    run.advance(1.0, [r], step=progressing)
    last_progress = run.now
    run.advance(5.0, [r])
    [(_, fault)] = run.faults
    assert fault.last_progress_at == last_progress and fault.fault_at == last_progress + DT

    run, t = Run(monitor()), Member("t0", "trainer", phase="training")
    run.advance(2.0, [t], step=progressing)
    last_progress = run.now
    run.advance(6.0, [t])
    [(_, fault)] = run.faults
    assert fault.fault_at == last_progress + DT and fault.cause == "training_stalled"


def test_crash_fault_at_is_the_exit_time_the_launcher_stamped() -> None:
    mon = monitor()
    run, r = Run(mon), Member("r0", "rollout", inflight=2)
    run.advance(1.0, [r], step=progressing)
    fault = mon.exited(MemberExited(job_id=JOB, member_id="r0", role="rollout", returncode=-9,
                                    ts=run.now - 0.4), run.now)
    assert fault is not None and fault.fault_at == run.now - 0.4 and fault.cause == "exit"


# --- the detector's own gap (issue 10) ----------------------------------------------------


def _healthy_job() -> list[Member]:
    return [Member("t0", "trainer", phase="training"), Member("r0", "rollout", inflight=3),
            Member("r1", "rollout", phase="idle")]


def test_frozen_detector_raises_nothing_from_its_own_gap() -> None:
    # SIGSTOP of the detector: no ticks and no samples for much longer than every threshold.
    # On SIGCONT its timer fires before the backlog of samples is read.
    run, members = Run(monitor()), _healthy_job()
    run.advance(2.0, members, step=progressing)
    run.now += 3 * (CFG.silence_s + CFG.probe_timeout_s + CFG.trainer_idle_s)
    for _ in range(3):
        result = run.mon.tick(run.now)
        assert result.faults == [] and result.probes == []
        run.now += DT
    run.advance(20.0, members, step=progressing)
    assert run.faults == [] and run.probes == []


def test_after_its_gap_a_silent_member_is_timed_from_the_detector_resuming() -> None:
    run, members = Run(monitor()), _healthy_job()
    run.advance(2.0, members, step=progressing)
    run.now += 30.0
    resumed = run.now
    run.mon.tick(resumed)
    # t0 and r0 speak again; r1 died while the detector was away and stays silent
    run.advance(10.0, members[:2], step=progressing)
    assert [p for _, p in run.probes] == ["r1"]
    assert run.probes[0][0] - resumed == pytest.approx(CFG.silence_s, abs=DT)
    [(_, fault)] = run.faults
    assert (fault.member_id, fault.kind) == ("r1", "unresponsive")


def test_restarted_detector_reports_a_known_fault_under_the_same_fault_id() -> None:
    # The first detector reports a stuck replica, then dies; the new one rebuilds the member
    # from its next samples and reports it again: the controller must see the same fault id.
    ids = []
    for _life in range(2):
        run, r = Run(JobMonitor(JOB, CFG)), Member("r0", "rollout", inflight=4)
        run.advance(5.0, [r])
        [(_, fault)] = run.faults
        ids.append(fault.fault_id)
    assert ids[0] == ids[1]
    other = Run(JobMonitor("job2", CFG))
    other.advance(5.0, [Member("r0", "rollout", inflight=4)])
    assert other.faults[0][1].fault_id != ids[0]  # another job, another fault


def test_a_detector_that_keeps_stalling_still_reports_a_silent_member() -> None:
    # Under heavy load every tick may come late; a rebase per late tick would postpone the
    # silence rule forever. At most one rebase per silence window.
    t = Member("t0", "trainer", phase="waiting_batch")
    for spacing in (2.0, 5.0, 11.0):  # every tick beyond gap_bound_s (1.5 s here), some far beyond
        mon = monitor()
        now = 1000.0
        mon.sample(t.sample(now), now)
        mon.tick(now)
        faults = []
        for _ in range(20):
            now += spacing
            result = mon.tick(now)
            for probe in result.probes:
                assert probe.member_id == "t0"  # never answered
            faults += result.faults
        assert [f.member_id for f in faults] == ["t0"], spacing
    # late and on-time ticks alternating: still at most one rebase per two windows
    mon = monitor()
    now = 1000.0
    mon.sample(t.sample(now), now)
    faults = []
    for i in range(40):
        now += 2.0 if i % 2 else 0.25
        faults += mon.tick(now).faults
    assert [f.member_id for f in faults] == ["t0"]


@pytest.mark.parametrize("phase", ["training", "checkpointing"])
def test_a_hang_longer_than_the_rebase_window_is_reported_though_a_tick_comes_late_in_every_window(
        phase: str) -> None:
    """A trainer hung in ``training`` (or stuck ``checkpointing``), its samples still coming, on a
    loaded detector whose tick comes late (2 s, past ``gap_bound_s``) once in every rebase window
    (8 s here; 80 s with the defaults). The threshold is longer than the window (20 s; 300 s
    ``trainer_idle_s`` by default). Each late tick reset every clock to now, so the hang was never
    reported (an outside review: an hour with the defaults); only the gap's time is left out now."""
    cfg = CFG.model_copy(update={"trainer_idle_s": 20.0, "trainer_io_s": 20.0})
    mon, t = monitor(cfg), Member("t0", "trainer", phase=phase)
    now, faults, last_gap = 1000.0, [], 1000.0
    while now < 1000.0 + 120 and not faults:
        if now - last_gap >= 2 * (cfg.silence_s + cfg.probe_timeout_s) + 0.5:
            now, last_gap = now + 2.0, now + 2.0  # the detector's loop starved: no sample handled, no tick
        else:
            now += DT
        mon.sample(t.sample(now), now)  # activity frozen: the samples prove it is alive, not working
        faults += mon.tick(now).faults
    assert mon.gaps >= 2, mon.gaps
    assert [(f.member_id, f.kind) for f in faults] == [("t0", "hang")], faults
    assert now - 1000.0 <= cfg.trainer_idle_s + mon.gaps * 2.0 + 2 * DT, now - 1000.0


def test_turns_queued_for_a_version_to_come_are_not_a_stall_but_a_silent_replica_still_is() -> None:
    """``awaiting_version``: every queued turn needs a version the replica does not hold yet (after
    a trainer rollback). No tokens for many times ``rollout_idle_s`` is no fault and no probe; the
    same replica, queued turns and idle, is a fault; one that goes silent while awaiting is caught
    by the silence rule all the same."""
    run, r = Run(monitor()), Member("r0", "rollout", phase="awaiting_version", queue=3)
    run.advance(5 * CFG.rollout_idle_s, [r], answer_probes=True)
    assert run.faults == [] and run.probes == []
    idle_run, idle = Run(monitor()), Member("r0", "rollout", phase="idle", queue=3)
    idle_run.advance(5 * CFG.rollout_idle_s, [idle], answer_probes=True)
    assert [f.kind for _, f in idle_run.faults] == ["hang"]
    silent_run, silent = Run(monitor()), Member("r0", "rollout", phase="awaiting_version", queue=3)
    silent_run.advance(1.0, [silent])
    silent_run.advance(CFG.silence_s + CFG.probe_timeout_s + 2.0, [])  # nothing heard from it any more
    assert silent_run.faults and silent_run.faults[0][1].member_id == "r0"


def test_a_reported_member_kept_and_healthy_again_is_judged_again() -> None:
    """A replica reported once (its load failed) that the controller kept (the fault ignored
    during a trainer recovery; the replica loaded since) was never judged again: frozen later, it
    was never reported, and the pool ran a replica short for the rest of the job (an outside
    review). Once it has looked healthy for ``rearm_s`` it is judged again, and its next fault is
    a new one (its own id, so the controller does not take it for the first, handled)."""
    from robustrl.services.detector.monitor import rearm_s

    mon = monitor()
    run, r = Run(mon), Member("r0", "rollout", phase="weights_failed")
    run.advance(1.0, [r])
    [(_, first)] = run.faults
    assert first.cause == "weights_failed"
    r.phase = "serving"
    run.advance(rearm_s(CFG) + 1.0, [r])  # kept, loaded, serving well (idle: no work held)
    assert len(run.faults) == 1
    frozen = run.now
    run.advance(CFG.silence_s + CFG.probe_timeout_s + 1.0, [r], send=False)  # frozen: nothing heard
    assert len(run.faults) == 2, run.faults
    at, second = run.faults[1]
    assert (second.kind, second.member_id) == ("unresponsive", "r0") and second.fault_id != first.fault_id
    assert at - frozen <= CFG.silence_s + CFG.probe_timeout_s + 2 * DT


def test_a_reported_member_that_stays_faulty_is_not_reported_again() -> None:
    """The re-arm needs the member healthy: one still in its failed phase is reported once."""
    run, r = Run(monitor()), Member("r0", "rollout", phase="weights_failed")
    run.advance(10 * CFG.silence_s, [r])
    assert len(run.faults) == 1


def test_a_new_fault_of_a_member_after_a_detector_restart_has_a_new_id() -> None:
    """A replica reported once (its load failed) and kept; the detector restarts; the replica
    freezes later. The new detector's report had the first one's id (one id per member), and the
    controller dropped it as handled (an outside review). A fault of another cause has its own id;
    the same fault reported again by a restarted detector keeps its id (handled once)."""
    run, r = Run(monitor()), Member("r0", "rollout", phase="weights_failed")
    run.advance(1.0, [r])
    [(_, first)] = run.faults
    again, r2 = Run(monitor()), Member("r0", "rollout", phase="weights_failed")  # a restarted detector
    again.advance(1.0, [r2])
    assert [f.fault_id for _, f in again.faults] == [first.fault_id]
    later, r3 = Run(monitor()), Member("r0", "rollout", phase="serving")  # restarted, the replica kept
    later.advance(2.0, [r3])
    later.advance(CFG.silence_s + CFG.probe_timeout_s + 1.0, [r3], send=False)
    [(_, frozen)] = later.faults
    assert frozen.kind == "unresponsive" and frozen.fault_id != first.fault_id
