"""The controller's recovery decisions, every branch including escalations, with a fake clock."""

from __future__ import annotations

from robustrl.config import RecoverySpec
from robustrl.messages import FaultReport
from robustrl.services.controller.decide import (
    Decision, FailJob, Ignore, JobView, RecoveryView, RedispatchEpisodes, ReplaceReplica, ReportOnly,
    RestartTrainerGang, RestartWholeJob, ResumeService, SERVICE_RESUMES_PER_STEP, WARM_START_SILENT, check_recovery,
    decide, recovery_failed,
)

LOCAL = RecoverySpec(policy="role_local", deadline_s=60.0, max_restarts=5)
WHOLE = RecoverySpec(policy="whole_job", deadline_s=60.0, max_restarts=5)
NOW = 5000.0


def fault(role: str = "rollout", member: str = "r1", kind: str = "crash") -> FaultReport:
    return FaultReport(job_id="j", fault_id="f1", role=role, member_id=member, kind=kind,
                       evidence="test", detected_at=NOW, step=4)


def job(**kw: object) -> JobView:
    base: dict[str, object] = dict(job_id="j", step=5, committed_step=4, durable_step=3, rollout_replicas=3,
                                   live_members=frozenset({"t0", "t1", "r0", "r1", "r2"}))
    base.update(kw)
    return JobView(**base)  # type: ignore[arg-type]


def kinds(d: Decision) -> list[type]:
    return [type(a) for a in d.actions]


def test_trainer_fault_restarts_the_gang_from_the_durable_checkpoint() -> None:
    d = decide(NOW, job(), fault("trainer", "t0", "hang"), LOCAL)
    assert d.actions == [RestartTrainerGang(resume_from=3)]
    assert "t0" in d.reason and d.restarts == 1


def test_rollout_fault_redispatches_then_replaces() -> None:
    for kind in ("crash", "hang", "unresponsive", "fail_slow", "bad_output"):
        d = decide(NOW, job(), fault("rollout", "r1", kind), LOCAL)
        assert d.actions == [RedispatchEpisodes("r1"), ReplaceReplica("r1")], kind
    assert d.describe() == ["redispatch_episodes(r1)", "replace_replica(r1)"]


def test_tool_outage_is_report_only_in_both_policies() -> None:
    for spec in (LOCAL, WHOLE):
        d = decide(NOW, job(committed_step=-1), fault("request_manager", "request_manager", "tool_outage"), spec)
        assert kinds(d) == [ReportOnly]


def test_whole_job_policy_restarts_everything_for_any_member_fault() -> None:
    for role, member in (("trainer", "t0"), ("rollout", "r2")):
        d = decide(NOW, job(), fault(role, member), WHOLE)
        assert d.actions == [RestartWholeJob(d.reason, resume_from=3)]


def test_fault_in_first_step_escalates() -> None:
    d = decide(NOW, job(step=0, committed_step=-1, durable_step=-1), fault("rollout", "r0"), LOCAL)
    assert kinds(d) == [RestartWholeJob] and "first committed step" in d.reason


def test_same_step_failing_again_on_the_trainer_escalates() -> None:
    d = decide(NOW, job(faults_per_step={("trainer", 5): 1}), fault("trainer", "t1"), LOCAL)
    assert kinds(d) == [RestartWholeJob] and "again" in d.reason
    # an earlier step's fault does not count
    d = decide(NOW, job(faults_per_step={("trainer", 4): 1}), fault("trainer", "t1"), LOCAL)
    assert kinds(d) == [RestartTrainerGang]


def test_trainer_dies_again_while_recovering_at_the_same_step() -> None:
    rec = RecoveryView("trainer", step=5, started_at=NOW - 5, member_ids=frozenset({"t0", "t1"}))
    view = job(recovering=(rec,), live_members=frozenset({"t2", "t3", "r0", "r1", "r2"}))
    d = decide(NOW, view, fault("trainer", "t2", "crash"), LOCAL)
    assert kinds(d) == [RestartWholeJob]


def test_a_warm_rank_never_heard_from_restarts_the_gang_again_and_does_not_escalate() -> None:
    """Its start failed (a frozen spare), not the step: the rank starts again. Any other second
    trainer fault at the step still escalates (above)."""
    rec = RecoveryView("trainer", step=5, started_at=NOW - 5, member_ids=frozenset({"t0", "t1"}))
    view = job(recovering=(rec,), faults_per_step={("trainer", 5): 1},
               live_members=frozenset({"t2", "t3", "r0", "r1", "r2"}))
    silent = fault("trainer", "t2", "hang").model_copy(update={"cause": WARM_START_SILENT})
    d = decide(NOW, view, silent, LOCAL)
    assert kinds(d) == [RestartTrainerGang], d.reason


def test_rollout_dies_while_trainer_recovers_is_replaced_too() -> None:
    rec = RecoveryView("trainer", step=5, started_at=NOW - 5, member_ids=frozenset({"t0", "t1"}))
    d = decide(NOW, job(recovering=(rec,)), fault("rollout", "r2"), LOCAL)
    assert d.actions == [RedispatchEpisodes("r2"), ReplaceReplica("r2")]


def test_replicas_that_cannot_load_the_dead_gangs_weights_while_the_trainer_recovers_are_left_alone() -> None:
    """The trainer died mid-version and its recovery outlasts the replicas' pull attempts (a cold
    start of a large model): every replica reports its pulls failed ("unavailable": no source holds
    the version). Those are healthy replicas waiting for the new gang's announcement; they were
    replaced, and with every replica reporting at one step the job was restarted whole (an outside
    review found it). A weights fault outside a trainer recovery is still acted on."""
    rec = RecoveryView("trainer", step=5, started_at=NOW - 95, member_ids=frozenset({"t0", "t1"}))
    for cause in ("weights_failed", "weights_load_timeout"):
        for n, member in enumerate(("r0", "r1", "r2")):
            f = fault("rollout", member, "hang").model_copy(update={"cause": cause})
            d = decide(NOW, job(recovering=(rec,), faults_per_step={("rollout", 5): n}), f, LOCAL)
            assert d.actions == [Ignore(d.reason, recheck=True)], (cause, member, d)  # looked at again after
            assert "trainer" in d.reason and "announce" in d.reason
        f = fault("rollout", "r1", "hang").model_copy(update={"cause": cause})
        assert kinds(decide(NOW, job(), f, LOCAL)) == [RedispatchEpisodes, ReplaceReplica]


def test_new_replicas_below_the_version_while_a_whole_job_restart_redoes_steps_are_left_alone() -> None:
    """A whole-job restart forms a new gang, which redoes the steps after its checkpoint (each a
    version) while the new replicas hold its first: the request manager's ``weights_deadline`` (a
    replica below the step's version past ``weights_load_s``) or the detector's weights causes
    during it were taken for a new member failing in the restart: another whole-job restart, again,
    until ``max_restarts`` failed the job (an outside review). Looked at again after it; the
    request manager's cause during a trainer recovery too. Outside a recovery it is acted on."""
    # (a recovery's member ids are the members it replaces: r0 here is a new one)
    whole = RecoveryView("job", step=7, started_at=NOW - 40, member_ids=frozenset({"t-old", "r-old"}))
    trainer = RecoveryView("trainer", step=7, started_at=NOW - 40, member_ids=frozenset({"t-old"}))
    for rec in (whole, trainer):
        for cause in ("weights_deadline", "weights_failed", "weights_load_timeout"):
            f = fault("rollout", "r0", "hang").model_copy(update={"cause": cause})
            for policy in (LOCAL, WHOLE):
                d = decide(NOW, job(recovering=(rec,)), f, policy)
                assert d.actions == [Ignore(d.reason, recheck=True)], (rec.role, cause, policy.policy, d)
    f = fault("rollout", "r0", "hang").model_copy(update={"cause": "weights_deadline"})
    assert kinds(decide(NOW, job(), f, LOCAL)) == [RedispatchEpisodes, ReplaceReplica]
    # any other fault of a new member during the whole-job restart still means the restart failed
    assert kinds(decide(NOW, job(recovering=(whole,)), fault("rollout", "r0", "hang"), LOCAL)) == [RestartWholeJob]


def test_two_replicas_lost_at_one_step_are_both_replaced_but_more_than_all_escalates() -> None:
    d = decide(NOW, job(faults_per_step={("rollout", 5): 1}), fault("rollout", "r2"), LOCAL)
    assert kinds(d) == [RedispatchEpisodes, ReplaceReplica]
    d = decide(NOW, job(faults_per_step={("rollout", 5): 3}), fault("rollout", "r2"), LOCAL)
    assert kinds(d) == [RestartWholeJob]


def test_fault_about_member_being_replaced_or_stale_is_ignored() -> None:
    rec = RecoveryView("rollout", step=5, started_at=NOW - 1, member_ids=frozenset({"r1"}))
    d = decide(NOW, job(recovering=(rec,)), fault("rollout", "r1", "unresponsive"), LOCAL)
    assert kinds(d) == [Ignore] and "already being replaced" in d.reason
    d = decide(NOW, job(), fault("rollout", "r-old"), LOCAL)
    assert kinds(d) == [Ignore] and "current incarnation" in d.reason


def test_control_plane_loss_resumes_in_place_in_both_policies() -> None:
    # live_members holds trainers and replicas only (as the runtime builds it): a control-plane
    # fault must not be dismissed as "not a member of the current incarnation".
    for spec in (LOCAL, WHOLE):
        for kind in ("crash", "unresponsive", "hang"):
            d = decide(NOW, job(), fault("request_manager", "request_manager", kind), spec)
            assert d.actions == [ResumeService("request_manager")], (spec.policy, kind, d.reason)
            assert d.restarts == 0
    d = decide(NOW, job(step=0, committed_step=-1), fault("detector", "detector", "crash"), LOCAL)
    assert d.actions == [ResumeService("detector")]


def test_control_plane_lost_again_and_again_at_one_step_escalates() -> None:
    d = decide(NOW, job(faults_per_step={("request_manager", 5): SERVICE_RESUMES_PER_STEP - 1}),
               fault("request_manager", "request_manager"), LOCAL)
    assert d.actions == [ResumeService("request_manager")]
    d = decide(NOW, job(faults_per_step={("request_manager", 5): SERVICE_RESUMES_PER_STEP}),
               fault("request_manager", "request_manager"), LOCAL)
    assert kinds(d) == [RestartWholeJob] and "times at step 5" in d.reason


def test_control_plane_fault_while_it_is_being_resumed_is_ignored() -> None:
    rec = RecoveryView("request_manager", step=5, started_at=NOW - 1, member_ids=frozenset({"request_manager"}))
    d = decide(NOW, job(recovering=(rec,)), fault("request_manager", "request_manager", "unresponsive"), LOCAL)
    assert kinds(d) == [Ignore]


def test_member_fault_while_a_control_plane_service_is_lost_is_still_local() -> None:
    # the request manager learns of the dead replica from its resume; the controller sees exits itself
    for lost in ("request_manager", "detector"):
        d = decide(NOW, job(control_plane_lost=frozenset({lost})), fault("rollout", "r0"), LOCAL)
        assert kinds(d) == [RedispatchEpisodes, ReplaceReplica], lost
        d = decide(NOW, job(control_plane_lost=frozenset({lost})), fault("trainer", "t0"), LOCAL)
        assert kinds(d) == [RestartTrainerGang], lost


def test_member_fault_during_whole_job_restart_restarts_again() -> None:
    rec = RecoveryView("job", step=5, started_at=NOW - 3, member_ids=frozenset({"t0", "t1", "r0", "r1", "r2"}))
    view = job(recovering=(rec,), live_members=frozenset({"t5", "r5"}))
    assert kinds(decide(NOW, view, fault("rollout", "r0"), LOCAL)) == [Ignore]  # old incarnation
    assert kinds(decide(NOW, view, fault("rollout", "r5"), LOCAL)) == [RestartWholeJob]


def test_max_restarts_fails_the_job_with_a_clear_reason() -> None:
    d = decide(NOW, job(restarts_total=5), fault("trainer", "t0"), LOCAL)
    assert kinds(d) == [FailJob] and "max_restarts=5" in d.reason and "t0" in d.reason
    d = decide(NOW, job(restarts_total=4), fault("rollout", "r0"), LOCAL)  # replace = 1 restart
    assert kinds(d) == [RedispatchEpisodes, ReplaceReplica]
    d = decide(NOW, job(), fault("trainer", "t0"), RecoverySpec(max_restarts=0))
    assert kinds(d) == [FailJob]
    # report-only decisions never fail the job
    d = decide(NOW, job(restarts_total=99), fault("request_manager", "request_manager", "tool_outage"), LOCAL)
    assert kinds(d) == [ReportOnly]


def test_check_recovery_escalates_past_deadline() -> None:
    rec = RecoveryView("trainer", step=5, started_at=NOW)
    view = job(recovering=(rec,))
    assert check_recovery(NOW + LOCAL.deadline_s - 1, view, LOCAL) is None
    d = check_recovery(NOW + LOCAL.deadline_s + 1, view, LOCAL)
    assert d is not None and kinds(d) == [RestartWholeJob] and "deadline_s=60" in d.reason
    assert check_recovery(NOW, job(), LOCAL) is None
    d = check_recovery(NOW + 100, job(recovering=(rec,), restarts_total=5), LOCAL)
    assert d is not None and kinds(d) == [FailJob]


def test_failed_local_recovery_escalates() -> None:
    rec = RecoveryView("rollout", step=5, started_at=NOW, member_ids=frozenset({"r1"}))
    d = recovery_failed(NOW + 2, job(recovering=(rec,)), rec, "replacement exited with 1", LOCAL)
    assert kinds(d) == [RestartWholeJob] and "replacement exited" in d.reason


def test_a_commit_reported_overdue_that_has_come_since_is_ignored() -> None:
    """The request manager's ``commit_deadline`` report of step 5, decided once step 5 committed
    (a slow step at the deadline's edge, a report delivered late): the gang is not stuck, and a
    second trainer fault at the step would have restarted the whole job. Before the commit, the
    gang is restarted."""
    overdue = fault("trainer", "t0", "hang").model_copy(update={"cause": "commit_deadline", "step": 5})
    d = decide(NOW, job(committed_step=5), overdue, LOCAL)
    assert kinds(d) == [Ignore] and "has come" in d.reason, d
    d = decide(NOW, job(committed_step=4), overdue, LOCAL)
    assert kinds(d) == [RestartTrainerGang], d
    # Any other trainer fault naming an older step is still acted on.
    assert kinds(decide(NOW, job(committed_step=5), fault("trainer", "t0", "hang"), LOCAL)) == [RestartTrainerGang]
