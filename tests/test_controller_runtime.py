"""The controller runtime against real servers and real member processes, fed real messages.

Members are stand-in processes (``idle_member``: they run until signalled) so that each test
takes seconds, and a stand-in request manager answers control commands and publishes metrics
while it is "alive". What is checked comes from outside the controller: the JetStream event log,
the processes themselves (pids, /proc), and Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from support import eventually_async

from robustrl.bus import Bus
from robustrl.config import JobSpec, Settings
from robustrl.errors import RequestTimeout
from robustrl.infra.embedded import EmbeddedInfra
from robustrl.launcher.local import LocalLauncher
from robustrl.messages import ControlCommand, MemberHello, MetricsSample, StepCommitted
from robustrl.services.controller import launching
from robustrl.services.controller.runtime import Controller
from robustrl.services.controller.supervision import STARTUP_FAILURES_MAX
from robustrl.services.controller.view import job_view
from robustrl.storage.fencing import GangFence
from robustrl.storage.redis_stores import Keys, connect
from robustrl.subjects import Verb, all_jobs_exact, subject

pytestmark = pytest.mark.timeout(120)
TESTS = Path(__file__).resolve().parent
LEASE_TTL_S = 1.0


@pytest.fixture(scope="module")
def cp_infra(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """Servers of this module's own: the controllers here hold the one lease and registry."""
    embedded = EmbeddedInfra(tmp_path_factory.mktemp("cp-infra"))
    try:
        yield embedded.start()
    finally:
        embedded.stop()


@pytest.fixture(autouse=True)
def idle_members(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launching, "TRAINER_MODULE", "idle_member")
    monkeypatch.setattr(launching, "ROLLOUT_MODULE", "idle_member")


class StandInRM:
    """Answers the controller's request-manager commands and sends RM metrics while ``alive``."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.alive = True
        self.commands: list[ControlCommand] = []
        self.jobs: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.bus.subscribe(all_jobs_exact(Verb.CONTROL, "request_manager"), ControlCommand, self._on_control)
        self._task = asyncio.create_task(self._metrics())

    async def _on_control(self, msg: ControlCommand, _s: str, reply: str | None) -> None:
        if not self.alive:
            return
        self.commands.append(msg)
        self.jobs.add(msg.job_id)
        await self.bus.respond(reply, msg)

    async def _metrics(self) -> None:
        seq = 0
        while True:
            await asyncio.sleep(0.1)
            for job_id in list(self.jobs) if self.alive else []:
                seq += 1
                await self.bus.publish(subject(job_id, Verb.METRICS, "request_manager"), MetricsSample(
                    job_id=job_id, member_id="request_manager", role="request_manager", seq=seq, ts=time.time(),
                    phase="generating"))

    async def close(self) -> None:
        if self._task:
            self._task.cancel()


class Rig:
    """Controllers, a stand-in RM and a bus for the test's own messages, torn down in order."""

    def __init__(self, settings: Settings, log_dir: Path) -> None:
        self.settings = settings
        self.log_dir = log_dir
        self.controllers: list[Controller] = []
        self.buses: list[Bus] = []
        self.redis = connect(settings.redis_url)
        self.rm: StandInRM | None = None
        self.bus: Bus | None = None

    async def start(self) -> None:
        self.bus = await self.connect("test", "controller")
        await self.bus.ensure_event_stream()
        self.rm = StandInRM(await self.connect("stand-in-rm"))
        await self.rm.start()
        await self.redis.delete(Keys.controller_lease(), Keys.jobs())

    async def connect(self, name: str, role: str | None = None) -> Bus:
        bus = await Bus.connect(self.settings.nats_url, name, role=role)
        self.buses.append(bus)
        return bus

    async def controller(self) -> Controller:
        launcher = LocalLauncher(self.log_dir, base_env={**os.environ, "PYTHONPATH": str(TESTS)})
        c = Controller(await self.connect("controller", "controller"), self.redis, launcher, self.settings,
                       lease_ttl_s=LEASE_TTL_S)
        await c.start()
        self.controllers.append(c)
        return c

    async def hello_all(self, c: Controller, job_id: str) -> None:
        assert self.bus
        job = c.get(job_id)
        for m in list(job.members.values()):
            if m.state == "starting":
                await self.bus.publish(subject(job_id, Verb.HELLO, m.member_id), MemberHello(
                    job_id=job_id, member_id=m.member_id, role=m.role, pid=m.pid or 1, epoch=m.epoch))  # type: ignore[arg-type]
        await eventually_async(lambda: all(m.state != "starting" for m in job.live()), what="members said hello")

    async def commit(self, job_id: str, step: int, epoch: int = 1) -> None:
        assert self.bus
        await self.bus.publish(subject(job_id, Verb.COMMIT), StepCommitted(
            job_id=job_id, step=step, weights_version=step + 1, epoch=epoch, reward_mean=0.5, checksum="x",
            durable_step=step))

    async def events(self, job_id: str) -> list[object]:
        assert self.bus
        return list(await self.bus.read_events(job_id))

    async def close(self) -> None:
        for c in self.controllers:
            with contextlib.suppress(Exception):
                await c.close(stop_members=True)
        if self.rm:
            await self.rm.close()
        for b in self.buses:
            with contextlib.suppress(Exception):
                await b.close()
        await self.redis.aclose()


@pytest.fixture
async def rig(cp_infra: Settings, tmp_path: Path) -> AsyncIterator[Rig]:
    r = Rig(cp_infra, tmp_path / "logs")
    await r.start()
    try:
        yield r
    finally:
        await r.close()


def spec(name: str, steps: int = 5, silence_s: float = 1.0) -> JobSpec:
    return JobSpec.parse({"name": name, "steps": steps, "rollout": {"replicas": 2},
                          "detector": {"trainer_idle_s": 4.0, "rollout_idle_s": 2.0, "silence_s": silence_s,
                                       "probe_timeout_s": 1.0, "metrics_interval_s": 0.25}})


def of_kind(events: list[object], kind: str) -> list[dict[str, object]]:
    return [e.data for e in events if e.kind == kind]  # type: ignore[attr-defined]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_view_of_the_real_runtime_sees_a_lost_request_manager_and_resumes_it(rig: Rig) -> None:
    c = await rig.controller()
    await c.wait_leading(10)
    job = await c.submit(spec("cpview"))
    await rig.hello_all(c, job.job_id)
    view = job_view(job)
    # trainers and replicas only: the request manager is not an incarnation member
    assert view.live_members == {"trainer-e1-r0", "trainer-e1-r1", "rollout-0-i0", "rollout-1-i0"}
    assert view.control_plane_ok
    pids = {m.member_id: m.pid for m in job.members.values()}

    assert rig.rm
    rig.rm.alive = False  # silent and deaf, as if killed
    await eventually_async(lambda: "request_manager" in job_view(job).control_plane_lost, timeout=10,
                           what="controller saw the request manager lost")
    events = await eventually_async(
        lambda: _with_decision(rig, job.job_id, "ResumeService"), timeout=10, what="ResumeService decided")
    fault = next(f for f in of_kind(events, "fault_detected") if f["role"] == "request_manager")
    assert fault["fault_at"] is not None and fault["detected_at"] > fault["fault_at"]

    rig.rm.alive = True  # restarted by its supervisor: it acknowledges the resume
    await eventually_async(lambda: not job.recoveries and job_view(job).control_plane_ok, timeout=10,
                           what="request manager resumed")
    events = await rig.events(job.job_id)
    recovered = of_kind(events, "recovered")
    assert [r["kind"] for r in recovered] == ["service"]
    # no member restarted, and every member process is the one started first
    assert len(of_kind(events, "member_started")) == 4
    assert {m.member_id: m.pid for m in job.members.values()} == pids
    assert all(alive(p) for p in pids.values() if p)


async def _with_decision(rig: Rig, job_id: str, action: str) -> list[object] | None:
    events = await rig.events(job_id)
    return events if any(d["actions"] == [action] for d in of_kind(events, "decision")) else None


async def test_restarted_controller_adopts_running_members_and_restarts_none(rig: Rig) -> None:
    a = await rig.controller()
    await a.wait_leading(10)
    job = await a.submit(spec("cpadopt"))
    await rig.hello_all(a, job.job_id)
    await rig.commit(job.job_id, 0)
    await eventually_async(lambda: job.committed_step == 0, what="commit seen")
    pids = {m.member_id: m.pid for m in job.members.values()}
    await a.close(stop_members=False)  # the controller goes; its members stay

    # A commit while no controller listens: the next one catches up from the event log.
    trainer = await rig.connect("test-trainer", "trainer")
    await trainer.emit_event(job.job_id, "step_committed", {"step": 1, "epoch": 1, "weights_version": 2,
                                                            "checksum": "y", "durable_step": 1})
    b = await rig.controller()
    await b.wait_leading(10)
    restored = b.get(job.job_id)
    assert restored.committed_step == 1 and restored.durable_step == 1
    assert {m.member_id: m.pid for m in restored.members.values()} == pids
    assert sorted(b.launcher.running()) == sorted(launching.lid(job.job_id, m) for m in pids)  # type: ignore[attr-defined]
    assert all(m.adopted for m in restored.members.values())

    # An adopted member that dies is seen by the new controller's launcher (not its child).
    victim = "rollout-1-i0"
    os.killpg(pids[victim], signal.SIGKILL)  # type: ignore[arg-type]
    await eventually_async(lambda: _with_decision_for(rig, job.job_id, f"exit-{victim}"), timeout=15,
                           what="crash of an adopted member decided")
    await eventually_async(lambda: rig.redis.sismember(Keys.faults_handled(job.job_id), f"exit-{victim}"),
                           timeout=15, what="crash of an adopted member handled")
    events = await rig.events(job.job_id)
    started = [d["member_id"] for d in of_kind(events, "member_started")]
    assert started[4:] == ["rollout-1-i1"], started  # only the replacement; no healthy member restarted
    assert all(alive(p) for m, p in pids.items() if m != victim and p)
    fault = next(f for f in of_kind(events, "fault_detected") if f["fault_id"] == f"exit-{victim}")
    assert fault["detected_at"] - fault["fault_at"] < 1.0


def running(pid: int) -> bool:
    """Alive and not a zombie (members of a closed launcher stay this process's children)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def test_a_controller_back_after_the_last_step_adopts_every_member_before_it_stops_them(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The data plane finished the job while no controller ran: the one that takes over must
    re-attach every member before it ends the job, or the ones not yet re-attached keep running,
    unknown to any launcher (the stop raced the adoption, and members leaked, in CI)."""
    slow_adopt = LocalLauncher.adopt

    def adopt(self: LocalLauncher, *args: object) -> bool:
        time.sleep(0.3)  # a loaded machine: reading each process's start time is slow
        return slow_adopt(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(LocalLauncher, "adopt", adopt)
    a = await rig.controller()
    await a.wait_leading(10)
    job = await a.submit(spec("cplate", steps=3))
    await rig.hello_all(a, job.job_id)
    pids = {m.member_id: m.pid for m in job.members.values()}
    await a.close(stop_members=False)

    trainer = await rig.connect("test-trainer", "trainer")
    for step in range(3):  # every step committed while no controller listens
        await trainer.emit_event(job.job_id, "step_committed", {"step": step, "epoch": 1, "weights_version": step + 1,
                                                                "checksum": "y", "durable_step": step})
    b = await rig.controller()
    await b.wait_leading(10)
    events = await eventually_async(lambda: _with_kind(rig, job.job_id, "job_finished"), timeout=30,
                                    what="the job ended by the controller that took over")
    takeover = next(n for n in of_kind(events, "note") if "took over" in str(n["text"]))
    assert sorted(takeover["adopted"]) == sorted(pids) and takeover["gone"] == []  # type: ignore[arg-type]
    await eventually_async(lambda: not any(running(p) for p in pids.values() if p), timeout=30,
                           what="every member of the finished job stopped")


async def _with_kind(rig: Rig, job_id: str, kind: str) -> list[object] | None:
    events = await rig.events(job_id)
    return events if of_kind(events, kind) else None


async def _with_decision_for(rig: Rig, job_id: str, fault_id: str) -> list[object] | None:
    events = await rig.events(job_id)
    return events if any(d["fault_id"] == fault_id for d in of_kind(events, "decision")) else None


async def test_two_controllers_only_the_lease_holder_acts_and_the_standby_takes_over(rig: Rig) -> None:
    a, b = await rig.controller(), await rig.controller()
    await eventually_async(lambda: a.leading or b.leading, timeout=10, what="a leader")
    await asyncio.sleep(LEASE_TTL_S)  # a full lease period: the standby must still not lead
    assert a.leading != b.leading
    leader, standby = (a, b) if a.leading else (b, a)
    job = await leader.submit(spec("cptwo"))
    await rig.hello_all(leader, job.job_id)
    await rig.commit(job.job_id, 0)
    await eventually_async(lambda: job.committed_step == 0, what="commit seen")
    first = leader.lease.token

    victim = job.members["rollout-0-i0"]
    os.killpg(victim.pid, signal.SIGKILL)  # type: ignore[arg-type]
    await eventually_async(lambda: _with_decision_for(rig, job.job_id, "exit-rollout-0-i0"), timeout=10,
                           what="decision")
    # Handled (recorded in Redis once the actions are carried out) before the leader goes: a
    # leader lost in the middle of a recovery leaves the fault to its successor, by design.
    await eventually_async(lambda: rig.redis.sismember(Keys.faults_handled(job.job_id), "exit-rollout-0-i0"),
                           timeout=10, what="fault marked handled")
    t0 = time.monotonic()
    await leader.close(stop_members=False)
    await standby.wait_leading(LEASE_TTL_S + 2.0)
    took = time.monotonic() - t0
    assert took <= LEASE_TTL_S + 2.0
    assert standby.lease.token > first
    taken = standby.get(job.job_id)
    victim2 = next(m for m in taken.current_replicas() if m.index == 1)
    os.killpg(victim2.pid, signal.SIGKILL)  # type: ignore[arg-type]
    events = await eventually_async(lambda: _with_decision_for(rig, job.job_id, f"exit-{victim2.member_id}"),
                                    timeout=10, what="decision by the new leader")
    decisions = of_kind(events, "decision")
    # one decision per fault, each by the leader of its time (its fencing token)
    by_fault: dict[object, list[object]] = {}
    for d in decisions:
        by_fault.setdefault(d["fault_id"], []).append(d["fence"])
    assert by_fault["exit-rollout-0-i0"] == [first]
    assert by_fault[f"exit-{victim2.member_id}"] == [standby.lease.token]


async def _job_whose_member_fails(rig: Rig, monkeypatch: pytest.MonkeyPatch, module_attr: str, module: str,
                                  name: str) -> object:
    """Submit a job whose trainer or rollout members run ``module``; return it once it failed."""
    monkeypatch.setattr(launching, module_attr, module)
    c = await rig.controller()
    await c.wait_leading(10)
    job = await c.submit(spec(name))
    await eventually_async(lambda: job.status == "failed", timeout=60, what="job failed")
    return job


async def test_member_that_cannot_start_fails_the_job_fast_with_its_stderr(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    job = await _job_whose_member_fails(rig, monkeypatch, "ROLLOUT_MODULE", "broken_member", "cpbroken")
    assert "No module named 'transformers'" in (job.error or "")
    assert "before its hello 3 times" in (job.error or "")
    # fails within a few restarts (each slot's third failure), not after max_restarts (20)
    assert job.restarts_total <= 2 * STARTUP_FAILURES_MAX < job.spec.recovery.max_restarts
    events = await rig.events(job.job_id)
    failed = of_kind(events, "job_failed")
    assert failed and "No module named 'transformers'" in str(failed[0]["reason"])
    assert any("No module named 'transformers'" in str(f["evidence"]) for f in job.faults)


async def test_finished_status_only_once_job_finished_is_in_the_log_and_ettr_is_set(rig: Rig) -> None:
    c = await rig.controller()
    await c.wait_leading(10)
    job = await c.submit(spec("cpfinish", steps=2))
    await rig.hello_all(c, job.job_id)
    await rig.commit(job.job_id, 0)
    await rig.commit(job.job_id, 1)
    await eventually_async(lambda: job.status == "finished", timeout=30, what="finished")
    events = await rig.events(job.job_id)  # read at once: the final event must already be there
    assert of_kind(events, "job_finished")
    assert job.ettr is not None


async def test_event_log_is_read_to_its_end_not_to_a_time_budget(rig: Rig) -> None:
    assert rig.bus
    job_id = f"cplong-{os.getpid()}"
    n = 1300
    await asyncio.gather(*(rig.bus.emit_event(job_id, "note", {"i": i}) for i in range(n)))
    # A per-fetch bound far below the time the whole read takes: the read still reaches the end.
    events = await rig.bus.read_events(job_id, timeout=0.2)
    assert sorted(e.data["i"] for e in events) == list(range(n))


async def test_a_fault_reported_while_no_controller_leads_is_handled_once_by_the_next(rig: Rig) -> None:
    a = await rig.controller()
    await a.wait_leading(10)
    job = await a.submit(spec("cpinbox"))
    await rig.hello_all(a, job.job_id)
    await rig.commit(job.job_id, 0)
    await eventually_async(lambda: job.committed_step == 0, what="commit seen")
    await a.close(stop_members=False)

    # The detector reports a hang twice (a retry) while no controller runs: only the event log has it.
    detector = await rig.connect("test-detector", "detector")
    report = {"fault_id": "hang-r0", "kind": "hang", "role": "rollout", "member_id": "rollout-0-i0", "step": 1,
              "detected_at": time.time(), "evidence": "no tokens for 2 s", "fault_at": time.time() - 2}
    await detector.emit_event(job.job_id, "fault_detected", report)
    await detector.emit_event(job.job_id, "fault_detected", report)

    b = await rig.controller()
    await b.wait_leading(10)
    await eventually_async(lambda: rig.redis.sismember(Keys.faults_handled(job.job_id), "hang-r0"), timeout=15,
                           what="fault delivered to the new leader and handled")
    events = await rig.events(job.job_id)
    assert [d["actions"] for d in of_kind(events, "decision") if d["fault_id"] == "hang-r0"] == [
        ["RedispatchEpisodes", "ReplaceReplica"]]
    assert [d["member_id"] for d in of_kind(events, "member_started")][4:] == ["rollout-0-i1"]


async def test_request_manager_refuses_commands_of_a_deposed_controller(rig: Rig,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    from robustrl.services.request_manager.service import RequestManager

    rm = RequestManager(await rig.connect("request_manager", "request_manager"), rig.redis)
    await rm.start(resume=False)
    assert rig.rm and rig.bus
    rig.rm.alive = False  # the stand-in stays out of this
    subj = subject("cpfence", Verb.CONTROL, "request_manager")

    def cmd(fence: int) -> ControlCommand:
        return ControlCommand(job_id="cpfence", target="request_manager", action="pause", fence=fence)

    async def ask(fence: int) -> ControlCommand | None:
        # Attempts, as the controller sends its commands: NATS may drop a message published in
        # the moments after a fresh connection subscribed (seen in CI: no reply to the first).
        for _ in range(3):
            with contextlib.suppress(RequestTimeout):
                return await rig.bus.request(subj, cmd(fence), ControlCommand, timeout=2.0)
        return None

    acked = await ask(5)
    assert acked is not None and acked.fence == 5
    with caplog.at_level(logging.WARNING, logger="robustrl"):
        assert await ask(4) is None  # an older leader's: not acknowledged...
        await eventually_async(lambda: "fencing token 4 is older than 5" in caplog.text, timeout=5,
                               what="the request manager saw and refused the deposed controller's command")
    acked = await ask(6)
    assert acked is not None and acked.fence == 6
    await rm.close()


async def test_commands_to_a_request_manager_that_is_down_span_their_attempts(rig: Rig) -> None:
    """With no request manager at all NATS answers "no responders" at once: the retries must still
    cover attempts x timeout (a restart of the service), not burn out in milliseconds."""
    from robustrl.services.controller.jobs import JobRun

    c = await rig.controller()
    await c.wait_leading(10)
    assert rig.rm
    rig.rm.alive = False
    await rig.rm.close()
    await rig.rm.bus.close()  # nobody listens on the request manager's subject now
    job = JobRun(job_id="cpnorm", spec=spec("cpnorm"))
    t0 = time.monotonic()
    assert await c.control_rm(job, "pause", attempts=3, timeout_s=0.5, quiet=True) is False
    assert time.monotonic() - t0 >= 3 * 0.5 - 0.05


async def test_a_new_gang_takes_an_epoch_above_the_fence_and_saves_it_before_it_starts(rig: Rig) -> None:
    """A gang epoch the controller forgot (a restart, a standby taking over) must not be reused:
    the fence in Redis has seen a newer gang, and would refuse one at or below it at its start."""
    c = await rig.controller()
    await c.wait_leading(10)
    job = await c.submit(spec("cpepoch"))
    await rig.hello_all(c, job.job_id)
    await rig.commit(job.job_id, 0)
    await eventually_async(lambda: job.committed_step == 0, what="commit seen")
    # A gang of epoch 4 entered the fence (started by a controller whose record of it was lost).
    await GangFence(rig.redis, job.job_id, 4).enter()
    old = {m.member_id: m.pid for m in job.members.values() if m.role == "trainer"}
    os.killpg(old["trainer-e1-r0"], signal.SIGKILL)  # type: ignore[arg-type]

    async def new_gang() -> list[dict[str, object]] | None:
        started = [d for d in of_kind(await rig.events(job.job_id), "member_started") if d["role"] == "trainer"]
        return started[2:] or None

    started = await eventually_async(new_gang, timeout=20, what="a new trainer gang started")
    assert {d["epoch"] for d in started} == {5}, started
    raw = json.loads(await rig.redis.hget(Keys.jobs(), job.job_id))
    assert raw["epoch"] == 5


async def test_a_trainer_that_finds_its_checkpoints_lost_fails_the_job_at_once(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    job = await _job_whose_member_fails(rig, monkeypatch, "TRAINER_MODULE", "checkpoint_lost_member", "cplost")
    assert "checkpoint lost" in (job.error or "") and "no checkpoint at or below it verifies" in (job.error or "")
    events = await rig.events(job.job_id)
    # one gang only: a gang that would refuse again is never restarted
    assert [d["epoch"] for d in of_kind(events, "member_started") if d["role"] == "trainer"] == [1, 1]
    assert "checkpoint lost" in str(of_kind(events, "job_failed")[0]["reason"])


async def test_the_same_member_crashing_in_two_jobs_is_two_faults(rig: Rig) -> None:
    """Exit fault ids name the member (``exit-trainer-e1-r0``), and every job has that member: the
    second job's crash must still be decided (it was taken for the first job's, already handled)."""
    c = await rig.controller()
    await c.wait_leading(10)
    for name in ("cptwice-a", "cptwice-b"):
        job = await c.submit(spec(name))
        await rig.hello_all(c, job.job_id)
        await rig.commit(job.job_id, 0)
        await eventually_async(lambda job=job: job.committed_step == 0, what="commit seen")
        os.killpg(job.members["trainer-e1-r0"].pid, signal.SIGKILL)  # type: ignore[arg-type]
        await eventually_async(lambda job=job: _with_decision_for(rig, job.job_id, "exit-trainer-e1-r0"),
                               timeout=20, what=f"crash in {name} decided")


async def test_a_request_manager_resumes_at_the_step_the_event_log_says_not_a_stale_one(rig: Rig) -> None:
    """Commits travel on core NATS, which drops what is published while the controller is
    disconnected or frozen; the event log keeps them. A restarted request manager must be told to
    resume after the newest step the log shows committed, or it regenerates trained steps and the
    job stalls (campaign: told step 40 while step 47 was committed)."""
    from robustrl.messages import SpecReply, SpecRequest

    c = await rig.controller()
    await c.wait_leading(10)
    job = await c.submit(spec("cpmissed", steps=10))
    await rig.hello_all(c, job.job_id)
    await rig.commit(job.job_id, 0)
    await eventually_async(lambda: job.committed_step == 0, what="step 0 committed")
    trainer = await rig.connect("trainer-log", "trainer")
    for step in (1, 2, 3):  # in the durable log only: the controller never saw these commits
        await trainer.emit_event(job.job_id, "step_committed", {
            "step": step, "epoch": job.epoch, "weights_version": step + 1, "reward_mean": 0.5, "checksum": "x",
            "timings": {}, "checkpoint_bytes": 0, "durable_step": step})
    assert rig.bus
    reply = await rig.bus.request(subject(job.job_id, Verb.SPEC), SpecRequest(
        job_id=job.job_id, member_id="request_manager"), SpecReply, timeout=10)
    assert reply.resume_step == 4
    record = json.loads(await rig.redis.hget(Keys.jobs(), job.job_id))
    assert record["committed_step"] == 3  # and the registry a successor reads says so too


async def test_a_new_leader_keeps_the_warm_spares_of_the_jobs_it_resumes(rig: Rig) -> None:
    """A controller that takes over keeps the warm spares its resumed jobs ask for (it kept none:
    every trainer fault after a takeover started cold). Seen from outside: the spare processes,
    children of this test process (each controller's launcher is in it)."""
    import psutil

    from robustrl.launcher.spare import SPARE_MODULE

    def spare_pids() -> set[int]:
        return {p.pid for p in psutil.Process().children() if SPARE_MODULE in " ".join(p.cmdline())
                and p.status() != psutil.STATUS_ZOMBIE}

    mine = spare_pids()
    a = await rig.controller()
    await a.wait_leading(10)
    job = await a.submit(JobSpec.parse({"name": "cpspares", "steps": 5, "rollout": {"replicas": 2},
                                        "recovery": {"warm_spares": 1}}))
    first = spare_pids() - mine
    assert len(first) == 1, first
    await a.close(stop_members=False)  # the controller goes; its members stay
    b = await rig.controller()
    await b.wait_leading(10)
    assert b.get(job.job_id).spec.recovery.warm_spares == 1
    await eventually_async(lambda: len(spare_pids() - mine - first) == 1, timeout=20,
                           what="the new leader's warm spare")
