"""Which starts a passed recovery deadline counts as failed (``RecoveryExecutor._unstartable``).

Pure decision logic on the controller's in-memory job records: no server is involved. The
runtime path (real member processes that never say hello) is
``test_controller_runtime::test_a_slot_whose_start_hangs_every_time_fails_the_job_fast``.
"""

from __future__ import annotations

import time

from robustrl.config import JobSpec
from robustrl.services.controller.decide import Decision, FailJob, RestartWholeJob
from robustrl.services.controller.jobs import STARTUP_FAILURES_MAX, ActiveRecovery, JobRun, MemberInfo
from robustrl.services.controller.recovery import RecoveryExecutor

START_DEADLINE_S = 60.0


def _job(name: str, started_ago_s: float) -> tuple[JobRun, ActiveRecovery]:
    """A job whose trainer recovery (epoch 2) waits for rank 0, started ``started_ago_s`` ago."""
    spec = JobSpec.parse({"name": name, "detector": {"start_deadline_s": START_DEADLINE_S},
                          "recovery": {"deadline_s": 10.0}})
    job = JobRun(job_id=f"{name}-0", spec=spec, epoch=2)
    now = time.time()
    rank0 = MemberInfo("trainer-e2-r0", "trainer", 0, 2, started_at=now - started_ago_s,
                       clock_start=time.monotonic() - started_ago_s)
    job.members[rank0.member_id] = rank0
    late = ActiveRecovery("exit-trainer-e1-r0", "trainer", "trainer", now - 11, 0, now - 1,
                          waiting_for={rank0.member_id}, clock_start=time.monotonic() - 11)
    job.recoveries.append(late)
    return job, late


def _escalation() -> Decision:
    return Decision([RestartWholeJob("recovery deadline passed", resume_from=-1)], "recovery deadline passed")


def test_a_start_slower_than_the_recovery_deadline_but_within_the_start_deadline_is_not_a_failed_start() -> None:
    """A healthy start may outlast a recovery's deadline (here 10 s against 60 s): the restart the
    deadline leads to is the remedy, and the slot's count of failed starts stays where it was."""
    executor = RecoveryExecutor(None)  # type: ignore[arg-type]
    job, late = _job("slow", started_ago_s=START_DEADLINE_S / 2)
    job.startup_failures[("trainer", 0)] = STARTUP_FAILURES_MAX - 1  # one more would fail the job
    decision = executor._unstartable(job, late, _escalation())
    assert decision.names() == ["RestartWholeJob"], decision
    assert job.startup_failures == {("trainer", 0): STARTUP_FAILURES_MAX - 1}


def test_a_hung_start_counts_once_per_recovery_in_every_job() -> None:
    """Fault and member ids repeat from job to job (every job has an ``exit-trainer-e1-r0``):
    a start one job's recovery counted must not hide the same-named start of another job, and an
    escalation tried again (it raised) counts nobody twice."""
    executor = RecoveryExecutor(None)  # type: ignore[arg-type]
    a, late_a = _job("a", started_ago_s=START_DEADLINE_S * 2)
    b, late_b = _job("b", started_ago_s=START_DEADLINE_S * 2)
    executor._unstartable(a, late_a, _escalation())
    executor._unstartable(a, late_a, _escalation())  # the same escalation, tried again
    assert a.startup_failures == {("trainer", 0): 1}
    executor._unstartable(b, late_b, _escalation())
    assert b.startup_failures == {("trainer", 0): 1}, "job b's hung start was not counted"


def test_the_count_of_a_recovery_survives_a_new_leader() -> None:
    """A leader that takes over mid-recovery reads the job record: the start the previous leader
    counted for this recovery is not counted again (twice would fail the job a start early)."""
    job, late = _job("takeover", started_ago_s=START_DEADLINE_S * 2)
    job.startup_failures[("trainer", 0)] = STARTUP_FAILURES_MAX - 2
    RecoveryExecutor(None)._unstartable(job, late, _escalation())  # type: ignore[arg-type]
    assert job.startup_failures == {("trainer", 0): STARTUP_FAILURES_MAX - 1}

    restored = JobRun.from_record(job.job_id, job.to_record())  # what the next leader reads
    [late_restored] = restored.recoveries
    decision = RecoveryExecutor(None)._unstartable(restored, late_restored, _escalation())  # type: ignore[arg-type]
    assert decision.names() == ["RestartWholeJob"], decision
    assert restored.startup_failures == {("trainer", 0): STARTUP_FAILURES_MAX - 1}


def test_the_third_hung_start_of_a_slot_fails_the_job_naming_it() -> None:
    executor = RecoveryExecutor(None)  # type: ignore[arg-type]
    job, late = _job("third", started_ago_s=START_DEADLINE_S * 2)
    job.startup_failures[("trainer", 0)] = STARTUP_FAILURES_MAX - 1
    decision = executor._unstartable(job, late, _escalation())
    assert [type(a) for a in decision.actions] == [FailJob], decision
    assert "trainer slot 0 did not finish starting 3 times in a row" in decision.reason
    assert "trainer-e2-r0" in decision.reason


def test_a_failed_start_from_a_spare_is_not_counted_and_its_next_starts_are_cold_across_a_takeover() -> None:
    """A start from a warm spare that fails counts nothing against its slot; its role's next
    starts and its slot's are cold, also for a leader that takes over from the job's record; a
    start of another slot of the role ends the role's cold starts but not the failed slot's."""
    job, _ = _job("coldspare", started_ago_s=1.0)
    rank0 = job.members["trainer-e2-r0"]
    rank0.warm = True
    assert job.failed_start(rank0) == 0 and job.startup_failures == {}
    restored = JobRun.from_record(job.job_id, job.to_record())  # what the next leader reads
    assert restored.members["trainer-e2-r0"].warm
    assert restored.starts_cold("trainer", 0) and restored.starts_cold("trainer", 1)
    assert not restored.starts_cold("rollout", 0)
    rank1 = MemberInfo("trainer-e3-r1", "trainer", 1, 3)  # started cold, says hello first
    restored.started(rank1)
    assert restored.starts_cold("trainer", 0) and not restored.starts_cold("trainer", 1)
    restored.started(MemberInfo("trainer-e3-r0", "trainer", 0, 3))
    assert not restored.starts_cold("trainer", 0)
    assert restored.failed_start(MemberInfo("trainer-e4-r0", "trainer", 0, 4)) == 1  # a cold one counts


def test_a_whole_job_restart_begun_by_a_replica_fault_counts_every_rank_still_starting() -> None:
    """A whole-job restart begun by a rollout (or request-manager) fault starts a gang too: a rank
    other than 0 still starting at the deadline holds the gang's rendezvous, and its start counts
    as failed. Chosen by the fault's role ("trainer") only, it never counted (an outside review),
    and a rank hung in every incarnation went through ``max_restarts``, a deadline each."""
    job, _ = _job("wjrollout", started_ago_s=START_DEADLINE_S * 2)
    job.members["trainer-e2-r0"].state = "ready"
    now = time.time()
    job.members["trainer-e2-r1"] = MemberInfo("trainer-e2-r1", "trainer", 1, 2, started_at=now - START_DEADLINE_S * 2,
                                              clock_start=time.monotonic() - START_DEADLINE_S * 2)
    late = ActiveRecovery("exit-rollout-0-i0", "rollout", "whole_job", now - 11, 0, now - 1,
                          waiting_for={"trainer-e2-r0"}, clock_start=time.monotonic() - 11)
    job.recoveries = [late]
    RecoveryExecutor(None)._unstartable(job, late, _escalation())  # type: ignore[arg-type]
    assert job.startup_failures == {("trainer", 1): 1}, job.startup_failures


def test_a_record_a_new_leader_reads_back_is_written_again_unchanged() -> None:
    """What a new leader reads (``from_record``) and saves again (``to_record``) is what the last
    leader saved: a field left out of the read was overwritten with its default at the next save
    (a failed job's ``error`` became null: an outside review)."""
    job, late = _job("roundtrip", started_ago_s=1.0)
    job.status, job.error, job.finished_at, job.ettr = "failed", "trainer slot 0 cannot start", time.time(), 0.9
    job.committed_step, job.durable_step, job.weights_version, job.restarts_total = 7, 6, 8, 3
    job.failures_by_step[("trainer", 7)] = 2
    job.startup_failures[("trainer", 0)] = 1
    job.cold_roles, job.cold_slots = {"trainer"}, {("trainer", 0)}
    job.slot_incarnation, job.restock_owed, job.reward_by_step = {0: 2, 1: 1}, {1: 1}, {6: 0.25}
    job.faults.append({"fault_id": late.fault_id, "recovery_s": None})
    job.members["trainer-e2-r0"].warm = True
    saved = job.to_record()
    again = JobRun.from_record(job.job_id, saved).to_record()
    assert again == saved, {k: (saved[k], again[k]) for k in saved if saved[k] != again.get(k)}
