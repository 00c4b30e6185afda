"""The controller's fences at a recovery's kills and at the request manager's restart_step: a
leader deposed at the worst moment (a standby took the lease in Redis while the recovery awaited
a step) must leave the members, which the new leader adopts, alone, and must not clear the step
of the request manager the new leader runs.

Each test takes the lease over (the fencing counter moved past the leader's token and the lease
key naming another controller, as a standby's takeover leaves them) from inside the one step the
recovery awaits right before the fenced action: the request manager's answer, a gang's
rendezvous, a hand-off, the action's own event. Real servers of this module's own, real member
processes (stand-ins that idle until signalled), controllers from ``test_controller_runtime``'s
rig. What is checked is read from outside the controller: the processes (/proc), the control
subject on NATS (a plain bus client of the test's), the JetStream event log, the raw Redis record.

* A whole-job restart: no ``restart_step`` reaches the request manager once the lease is gone
  (it takes any token not older than the newest it has seen, and cleared the step's episodes
  under the job the new leader runs), and no member is killed.
* A trainer gang restart whose gang start fails after the lease is gone kills neither the kept
  rank nor the drained replica (the new leader adopted them); one whose start raised LeaseLost
  itself kills nothing either.
* A borrowed replica the request manager did not hear is not killed by a deposed leader.
* A borrowed replica whose hand-off failed is not killed by a deposed leader.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from robustrl.services.controller import launching
from robustrl.services.controller.decide import action_name
from robustrl.services.controller.jobs import JobRun
from robustrl.services.controller.lease import LeaseLost
from robustrl.services.controller.runtime import Controller
from support import eventually_async, own_servers, raw_job_record
from test_controller_runtime import (  # idle_members: an autouse fixture, active here once imported
    Rig,
    _ignores_handoff,
    _usurp,
    idle_members,  # noqa: F401
    leading_job_at_step_0,
    of_kind,
    running,
    spec,
)

from robustrl.bus import Bus
from robustrl.config import JobSpec, Settings
from robustrl.errors import LaunchError
from robustrl.launcher.local import LocalLauncher
from robustrl.messages import ControlCommand, ProbeReply, ProbeRequest
from robustrl.subjects import Verb, subject, wildcard

pytestmark = pytest.mark.timeout(120)
ACTION_TIMEOUT_S = 30.0
"""How long a test waits for the recovery's action to end (seconds on an idle machine)."""


@pytest.fixture(scope="module")
def fence_infra(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """Servers of this module's own: the controllers here hold the one lease and registry."""
    with own_servers(tmp_path_factory, "fence-infra") as embedded:
        yield embedded.settings


@pytest.fixture
async def rig(fence_infra: Settings, tmp_path: Path) -> AsyncIterator[Rig]:
    r = Rig(fence_infra, tmp_path / "logs")
    await r.start()
    try:
        yield r
    finally:
        await r.close()


class ControlWatch:
    """Every command on a job's control subjects, as a plain bus client hears it (not the
    stand-in request manager's own list): what reached the request manager's subject."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.seen: list[ControlCommand] = []
        self.bus: Bus | None = None

    async def start(self, rig: Rig) -> None:
        self.bus = await rig.connect("fence-watch")
        await self.bus.subscribe(wildcard(self.job_id, Verb.CONTROL), ControlCommand, self._on)

    async def _on(self, msg: ControlCommand, _s: str, _r: str | None) -> None:
        self.seen.append(msg)

    async def settled(self) -> list[ControlCommand]:
        """The commands heard up to now: a marker published after them (on a subject of the same
        subscription, which nobody else hears) is heard after every one the server routed
        before it. Returns the commands to the request manager."""
        assert self.bus
        nonce = uuid.uuid4().hex
        await self.bus.publish(subject(self.job_id, Verb.CONTROL, "fence-barrier"), ControlCommand(
            job_id=self.job_id, target="fence-barrier", action="pause", args={"nonce": nonce}))
        await eventually_async(lambda: any(m.args.get("nonce") == nonce for m in self.seen), timeout=10,
                               what="the watcher's marker heard")
        return [m for m in self.seen if m.target == "request_manager"]


class ActionEnd:
    """When the controller's carrying-out of one recovery action (by name) ended, and how (a spy
    on ``RecoveryExecutor.execute``; what it does is unchanged)."""

    def __init__(self, c: Controller, monkeypatch: pytest.MonkeyPatch, action: str) -> None:
        self.action = action
        self.ended = asyncio.Event()
        self.error: BaseException | None = None
        real = c.recovery.execute

        async def execute(job: JobRun, fault: Any, act: Any) -> None:
            mine = action_name(act) == action and not self.ended.is_set()
            try:
                await real(job, fault, act)
            except BaseException as exc:
                if mine:
                    self.error = exc
                    self.ended.set()
                raise
            if mine:
                self.ended.set()

        monkeypatch.setattr(c.recovery, "execute", execute)

    async def wait(self) -> BaseException | None:
        await eventually_async(self.ended.is_set, timeout=ACTION_TIMEOUT_S, interval=0.05,
                               what=f"{self.action} carried out (or given up)")
        return self.error


def pids_of(job: JobRun, but: str) -> dict[str, int]:
    return {m.member_id: m.pid for m in job.live() if m.member_id != but and m.pid}


def not_running(pids: dict[str, int]) -> dict[str, int]:
    return {mid: pid for mid, pid in pids.items() if not running(pid)}


def left_alone(survivors: dict[str, int], error: BaseException | None, events: list[dict[str, Any]],
               why: str = "") -> None:
    """What a deposed leader's recovery must leave: every member it would have killed still runs
    (/proc), its action ended in ``LeaseLost``, and the log has no stop or exit of them."""
    assert not not_running(survivors), f"members killed by a deposed leader: {not_running(survivors)} {why}"
    assert isinstance(error, LeaseLost), repr(error)
    assert not [d for d in of_kind(events, "member_stopped") + of_kind(events, "member_exited")
                if d["member_id"] in survivors]


async def borrowing_job(rig: Rig, monkeypatch: pytest.MonkeyPatch, name: str) -> tuple[Controller, JobRun]:
    """A leading controller with a job past its first step whose trainer crash is repaired by a
    new gang that keeps the other rank in place (rank 0) and borrows a rollout replica (rank 1):
    three replicas that answer probes, members that survive a hand-off signal."""
    from robustrl.launcher import base as launcher_base

    for mod in (launching, launcher_base):  # switchable in place
        monkeypatch.setattr(mod, "TRAINER_MODULE", "handoff_idle_member")
        monkeypatch.setattr(mod, "ROLLOUT_MODULE", "handoff_idle_member")
    c = await rig.controller()
    await c.wait_leading(10)
    job = await c.submit(JobSpec.parse({**spec(name).model_dump(mode="json"), "rollout": {"replicas": 3},
                                        "recovery": {"borrow": "always", "keep_survivors": True}}))
    await rig.hello_all(c, job.job_id)
    await rig.commit(job.job_id, 0)
    await eventually_async(lambda: job.committed_step == 0, what="commit seen")
    await rig.members_start_fine(job)  # the replicas hold the current weights: borrowable
    await eventually_async(lambda: all(m.weights_version >= 0 for m in job.live() if m.role == "rollout"),
                           what="the replicas' weights known")
    assert rig.bus

    bus = rig.bus

    async def answer(msg: ProbeRequest, _s: str, reply: str | None) -> None:  # the replicas are alive
        await bus.respond(reply, ProbeReply(member_id=msg.member_id, nonce=msg.nonce, phase="serving"))

    for m in job.live():
        if m.role == "rollout":
            await bus.subscribe(subject(job.job_id, Verb.PROBE, m.member_id), ProbeRequest, answer)
    await eventually_async(lambda: all(_ignores_handoff(m.pid) for m in job.live()), timeout=20,
                           what="the stand-in members ready for a hand-off")
    return c, job


async def logged(rig: Rig, c: Controller, job: JobRun) -> list[Any]:
    """The job's log once the controller's outbox owes it nothing more (its events are appended
    in the background: read at once, the log missed the last ones)."""
    await eventually_async(lambda: _owes_nothing(c, job), timeout=15, interval=0.05,
                           what="the controller's events for the job appended to its log")
    return await rig.events(job.job_id)


async def _owes_nothing(c: Controller, job: JobRun) -> bool:
    return not await c.events.owed(job.job_id)


def borrowed_replica(events: list[Any]) -> str:
    """The replica the trainer recovery borrowed (from the log: its ``replica_borrowed``)."""
    (borrowed,) = [str(d["member_id"]) for d in of_kind(events, "replica_borrowed")]
    return borrowed


async def test_a_leader_deposed_as_it_begins_a_whole_job_restart_sends_no_restart_step(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer crash before the first commit: a whole-job restart. The lease is taken over
    while the restart's ``action`` event is written, before anything is sent: the deposed leader
    must not send the request manager ``restart_step`` (the request manager takes any token not
    older than the newest it has seen, and cleared the step the new leader runs), nor kill a
    member."""
    c = await rig.controller()
    await c.wait_leading(10)
    job = await c.submit(spec("fencewj"))
    await rig.hello_all(c, job.job_id)
    watch = ControlWatch(job.job_id)
    await watch.start(rig)
    real_event, deposed = c.event, asyncio.Event()

    async def deposed_meanwhile(job_: JobRun, kind: str, data: dict[str, Any] | None = None) -> None:
        await real_event(job_, kind, data)
        if kind == "action" and (data or {}).get("action") == "RestartWholeJob" and not deposed.is_set():
            _usurp(rig.settings)  # a standby took the lease over while the event was written
            deposed.set()

    monkeypatch.setattr(c, "event", deposed_meanwhile)
    end = ActionEnd(c, monkeypatch, "RestartWholeJob")
    survivors = pids_of(job, but="trainer-e1-r0")
    # (no commit yet: a whole-job restart)
    os.killpg(job.members["trainer-e1-r0"].pid, signal.SIGKILL)  # type: ignore[arg-type]
    error = await end.wait()
    assert deposed.is_set()

    to_rm = await watch.settled()
    assert not [m for m in to_rm if m.action == "restart_step"], [(m.action, m.fence) for m in to_rm]
    assert rig.rm
    assert not [m for m in rig.rm.commands if m.job_id == job.job_id and m.action == "restart_step"]
    events = await logged(rig, c, job)
    left_alone(survivors, error, events)
    assert of_kind(events, "action")[-1]["action"] == "RestartWholeJob"
    assert sorted(str(d["member_id"]) for d in of_kind(events, "member_started")) == [
        "rollout-0-i0", "rollout-1-i0", "trainer-e1-r0", "trainer-e1-r1"]
    record = raw_job_record(rig.settings.redis_url, job.job_id)
    assert record["epoch"] == 1 and record["restarts_total"] == 0, (record["epoch"], record["restarts_total"])
    assert all(record["members"][m]["state"] not in ("dead", "exited", "stopped") for m in survivors), {
        m: record["members"][m]["state"] for m in survivors}


@pytest.mark.parametrize("failure", ["launch error", "lease lost"])
async def test_a_gang_start_that_fails_after_the_leader_was_deposed_kills_nothing_it_drained_or_kept(
        rig: Rig, monkeypatch: pytest.MonkeyPatch, failure: str) -> None:
    """A trainer crash after the first commit: the new gang keeps the other rank (rank 0) and
    borrows a drained replica (rank 1). The lease is taken over while the gang's rendezvous is
    chosen; then the start fails (``launch error``: the rendezvous host went away) or finds the
    lease gone itself (``lease lost``: its own check before the first rank). A failed start kills
    what it drained and kept (else they ran untracked), but not once the lease is gone: the new
    leader adopted them. Seen from /proc, the event log and the raw record."""
    c, job = await borrowing_job(rig, monkeypatch, f"fencegang{failure[:5]}")
    real_on, real_rdv = c.launcher.rendezvous_on, c.launcher.rendezvous
    deposed: list[str] = []

    def deposed_meanwhile(real: Any) -> Any:
        def rendezvous(arg: Any) -> tuple[str, int]:
            _usurp(rig.settings)  # a standby took the lease over while the rendezvous was chosen
            deposed.append(str(getattr(arg, "member_id", arg)))
            if failure == "launch error":
                raise LaunchError("the rendezvous host went away (test)")
            return real(arg)  # type: ignore[no-any-return]
        return rendezvous

    monkeypatch.setattr(c.launcher, "rendezvous_on", deposed_meanwhile(real_on))
    monkeypatch.setattr(c.launcher, "rendezvous", deposed_meanwhile(real_rdv))
    end = ActionEnd(c, monkeypatch, "RestartTrainerGang")
    survivors = pids_of(job, but="trainer-e1-r0")
    os.killpg(job.members["trainer-e1-r0"].pid, signal.SIGKILL)  # type: ignore[arg-type]
    error = await end.wait()
    assert deposed, "the gang start never chose its rendezvous"
    events = await logged(rig, c, job)
    borrowed = borrowed_replica(events)  # (drained before the start: the kill list is not empty)

    left_alone(survivors, error, events, f"(kept trainer-e1-r1, drained {borrowed})")
    assert not [d for d in of_kind(events, "member_started") if d["role"] == "trainer" and d["epoch"] != 1]
    record = raw_job_record(rig.settings.redis_url, job.job_id)
    assert not [m for m in record["members"] if m.startswith("trainer-e2")], sorted(record["members"])
    assert all(record["members"][m].get("handle") for m in survivors)


async def test_a_borrowed_replica_the_request_manager_did_not_hear_is_not_killed_by_a_deposed_leader(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The new gang borrows a replica, drained first: the request manager is told it is gone from
    the pool. It does not acknowledge, and the lease is taken over while the controller waits for
    it (the command's bound is 20 s). A replica the request manager did not hear is killed (it may
    still be sent turns), but not by a deposed leader: the new leader adopted it, and its own
    recovery decides. Seen from /proc, the event log and the raw record."""
    c, job = await borrowing_job(rig, monkeypatch, "fenceunheard")
    real_control, unheard = c.control_rm, []

    async def unheard_and_deposed(job_: JobRun, action: str, args: dict[str, Any] | None = None,
                                  *rest: Any, **kw: Any) -> bool:
        if action == "replica_dead" and (args or {}).get("reason") == "borrowed":
            _usurp(rig.settings)  # a standby took the lease over while the request manager was silent
            unheard.append(str((args or {})["member_id"]))
            return False  # never acknowledged
        return await real_control(job_, action, args, *rest, **kw)

    monkeypatch.setattr(c, "control_rm", unheard_and_deposed)
    end = ActionEnd(c, monkeypatch, "RestartTrainerGang")
    survivors = pids_of(job, but="trainer-e1-r0")
    os.killpg(job.members["trainer-e1-r0"].pid, signal.SIGKILL)  # type: ignore[arg-type]
    error = await end.wait()
    assert unheard, "no replica was borrowed"
    events = await logged(rig, c, job)
    assert unheard == [borrowed_replica(events)]

    left_alone(survivors, error, events, f"(unheard {unheard})")
    assert not [d for d in of_kind(events, "member_started") if d["member_id"] not in survivors
                and d["member_id"] != "trainer-e1-r0"]
    record = raw_job_record(rig.settings.redis_url, job.job_id)
    assert record["epoch"] == 1 and not record.get("restock_owed"), (record["epoch"], record["restock_owed"])
    assert all(record["members"][m].get("handle") for m in survivors)


async def test_a_replica_whose_hand_off_failed_is_not_killed_by_a_deposed_leader(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The new gang keeps the other rank (rank 0, handed over) and borrows a replica for rank 1;
    the lease is taken over while the replica's hand-off runs, and the hand-off fails. Whatever
    is left of a replica whose hand-off failed is killed (it is 'dead' to every stop), but not by
    a deposed leader: the new leader may have adopted it. Nor is a cold rank started in its
    place. Seen from /proc (and a fresh launcher's search of it), the event log, the raw record."""
    c, job = await borrowing_job(rig, monkeypatch, "fencehandoff")
    real_relabel, refused = c.launcher.relabel, []

    def relabel(member_id: str, member: Any) -> None:
        if "rollout" in member_id:
            _usurp(rig.settings)  # a standby took the lease over while the hand-off ran
            refused.append(launching.split_lid(member_id)[1])
            raise LaunchError(f"{member_id}: the hand-off failed (test)", member=member_id)
        real_relabel(member_id, member)

    monkeypatch.setattr(c.launcher, "relabel", relabel)
    end = ActionEnd(c, monkeypatch, "RestartTrainerGang")
    survivors = pids_of(job, but="trainer-e1-r0")
    os.killpg(job.members["trainer-e1-r0"].pid, signal.SIGKILL)  # type: ignore[arg-type]
    error = await end.wait()
    assert refused, "no replica was handed over"
    events = await logged(rig, c, job)
    assert refused == [borrowed_replica(events)]

    left_alone(survivors, error, events, f"(hand-off refused {refused})")
    fresh = LocalLauncher(rig.log_dir, base_env={})
    assert fresh.find(launching.lid(job, "trainer-e2-r1")) is None  # no cold rank in its place
    assert not [d for d in of_kind(events, "member_started") if d["member_id"] == "trainer-e2-r1"]
    record = raw_job_record(rig.settings.redis_url, job.job_id)
    assert "trainer-e2-r1" not in record["members"], sorted(record["members"])
    assert record["members"][refused[0]].get("handle"), record["members"][refused[0]]


async def test_a_deposed_leaders_stop_reaches_no_one(rig: Rig) -> None:
    """A stop asked of a leader a standby has just deposed: its record of the stop is refused
    (fenced by the lease), and the stop must end there. The request manager and the detector admit
    any token not older than the last they saw: the stop sent on (before) ended the runner of a job
    the new leader found running, and the detector stopped watching every member (an outside
    review). Judged from the control subject, /proc and the raw record."""
    c, job = await leading_job_at_step_0(rig, "depstop")
    watch = ControlWatch(job.job_id)
    await watch.start(rig)
    pids = pids_of(job, but="")
    _usurp(rig.settings)  # a standby took the lease over; this leader has not noticed yet
    with pytest.raises(LeaseLost):
        await c.stop_job(job.job_id)
    heard = [(m.target, m.action) for m in await watch.settled()]
    assert ("request_manager", "stop") not in heard, heard
    assert not not_running(pids), f"members stopped by a deposed leader: {not_running(pids)}"
    record = raw_job_record(rig.settings.redis_url, job.job_id)
    assert not record.get("stop_owed") and record.get("status") == "running", record


async def test_a_fault_is_marked_handled_only_with_the_record_of_its_decision(rig: Rig,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The leader is deposed while it decides on a fault: the record of the decision is refused,
    so the fault must stay unhandled in Redis for the new leader (its inbox delivers it again).
    It was marked handled first, in a write of its own: a leader killed or deposed between the two
    left a fault handled whose decision no record held (an ignored weights fault owed a recheck
    after a recovery: the replica stayed stuck; an outside review). Read raw from Redis."""
    import redis as redis_sync

    from robustrl.messages import FaultReport
    from robustrl.storage.redis_stores import Keys

    c, job = await leading_job_at_step_0(rig, "markrec")
    real = c.recovery._handle_locked
    outcome: list[BaseException | None] = []

    async def deposed_while_deciding(j: JobRun, fault: Any) -> None:
        await real(j, fault)
        _usurp(rig.settings)

    async def handle(fault: Any) -> None:  # (this fault's handling only: others may come meanwhile)
        try:
            await real_handle(fault)
        except BaseException as exc:
            if fault.fault_id == "mark-1":
                outcome.append(exc)
            raise
        if fault.fault_id == "mark-1":
            outcome.append(None)

    real_handle = c.recovery.handle
    monkeypatch.setattr(c.recovery, "_handle_locked", deposed_while_deciding)
    monkeypatch.setattr(c.recovery, "handle", handle)
    assert rig.bus
    fault = FaultReport(job_id=job.job_id, fault_id="mark-1", role="rollout", member_id="rollout-0-i0",
                        kind="unresponsive", evidence="test", detected_at=time.time(), step=0,
                        fault_at=time.time() - 1)
    await rig.bus.publish(subject(job.job_id, Verb.FAULT), fault)
    # (its copy on the bus and its inbox copy may both come: one that finds the lease already lost
    # returns at once; the one that decided must give the fault up as the new leader's)
    await eventually_async(lambda: any(isinstance(o, LeaseLost) for o in outcome), timeout=20,
                           what="the fault's decision given up as the new leader's")
    r = redis_sync.Redis.from_url(rig.settings.redis_url)
    try:
        assert not r.sismember(Keys.faults_handled(job.job_id), "mark-1"), "marked handled with its record refused"
    finally:
        r.close()


async def test_a_decision_whose_record_fails_to_write_is_written_again_not_decided_again(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The record that marks a fault handled fails to write (a Redis blip) after the decision
    was carried out: the fault is delivered again, and the retry must write the record, not decide
    again on the state the first decision changed (a second decision event; for a control-plane
    role a second restart). Judged from the event log and the raw handled set."""
    import redis as redis_sync

    from robustrl.errors import TransportError
    from robustrl.messages import FaultReport
    from robustrl.storage.redis_stores import Keys

    c, job = await leading_job_at_step_0(rig, "recagain")
    real = c.persist
    blips: list[str] = []

    async def blip_once(j: JobRun, **kw: Any) -> bool:
        if kw.get("handled") and not blips:
            blips.append(kw["handled"])
            raise TransportError("redis blip at the decision's record (test)", subject=j.job_id)
        return await real(j, **kw)

    monkeypatch.setattr(c, "persist", blip_once)
    assert rig.bus
    fault = FaultReport(job_id=job.job_id, fault_id="again-1", role="rollout", member_id="rollout-0-i0",
                        kind="unresponsive", evidence="test", detected_at=time.time(), step=0,
                        fault_at=time.time() - 1)
    await rig.bus.publish(subject(job.job_id, Verb.FAULT), fault)  # as the detector reports: here and
    await rig.bus.emit_event(job.job_id, "fault_detected", fault.model_dump(mode="json", exclude={"job_id"}))  # logged
    r = redis_sync.Redis.from_url(rig.settings.redis_url)
    try:
        await eventually_async(lambda: r.sismember(Keys.faults_handled(job.job_id), "again-1"), timeout=30,
                               what="the fault marked handled after the blip")
    finally:
        r.close()
    assert blips == ["again-1"]
    decisions = [d for d in of_kind(await logged(rig, c, job), "decision") if d["fault_id"] == "again-1"]
    assert len(decisions) == 1, decisions
