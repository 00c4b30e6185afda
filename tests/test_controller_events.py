"""The controller's events are owed until JetStream stores them, and a takeover's loose ends are
neither left to a deadline nor miscounted.

Real servers of this module's own (one test restarts NATS), real member processes (stand-ins that
idle until signalled: ``idle_member``), controllers built by ``test_controller_runtime``'s rig.
What is checked is read from outside the controller: the JetStream log, the raw Redis keys (the
job record, the controller's outbox), the processes.

* A job's final event that JetStream does not store is owed in Redis (``ControllerOutbox``): the
  job still ends, and the event lands exactly once after the outage, appended by the same leader
  or by the next one (it was dropped after 30 s, and the auditor failed the job for good).
* An event given during a NATS outage returns at once (it held the recovery path for up to 30 s
  per event) and lands once, in order, when NATS is back.
* An interrupted recovery whose restart at a takeover hits a Redis blip is tried again (it was
  left to the recovery deadline).
* A recorded rank of a half-started gang that exited while no controller watched is superseded
  by the restart, not counted as a start-up failure (three of those fail the job).
* A process found under a dead member's id is a recorded member's only if the launcher says it
  is the same process (Ray: node, pid and start time), not whenever the pids match.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.exceptions
from robustrl.services.controller import failpoints
from robustrl.services.controller import outbox as outbox_mod
from robustrl.services.controller.jobs import JobRun, MemberInfo
from robustrl.services.controller.runtime import Controller
from support import eventually_async, own_servers, raw_job_record
from test_controller_runtime import (  # idle_members: an autouse fixture, active here once imported
    Rig,
    _cut_short,
    idle_members,  # noqa: F401
    leading_job_at_step_0,
    of_kind,
    running,
    spec,
)

from robustrl.bus import Bus
from robustrl.config import JobSpec
from robustrl.errors import TransportError
from robustrl.infra.credentials import Credentials, role_settings
from robustrl.infra.embedded import EmbeddedInfra
from robustrl.launcher.base import Launcher, MemberSpec, MemberState
from robustrl.launcher.docker import DockerLauncher
from robustrl.launcher.local import LocalLauncher
from robustrl.launcher.ray import RayLauncher
from robustrl.messages import Event
from robustrl.storage.control_stores import ControllerOutbox, OutboxEntry
from robustrl.storage.redis_stores import Keys, connect
from robustrl.subjects import Principal

pytestmark = pytest.mark.timeout(120)
ENDS = ("job_finished", "job_failed", "job_stopped")


@pytest.fixture(scope="module")
def ev_infra(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedInfra]:
    """Servers of this module alone: one test takes NATS down under the controller."""
    with own_servers(tmp_path_factory, "ev-infra") as embedded:
        yield embedded


@pytest.fixture
async def rig(ev_infra: EmbeddedInfra, tmp_path: Path) -> AsyncIterator[Rig]:
    assert ev_infra.settings is not None
    r = Rig(ev_infra.settings, tmp_path / "logs")
    await r.start()
    try:
        yield r
    finally:
        await r.close()


class PublishOutage:
    """JetStream refuses every append made through ``bus`` while on (as the bus reports a server
    that stays away past its retry budget): the fault, injected at the bus's one durable publish."""

    def __init__(self, bus: Bus, monkeypatch: pytest.MonkeyPatch) -> None:
        self.on = True
        self.refused: list[str] = []
        real = bus.publish_durable

        async def publish_durable(subject: str, data: bytes, **kw: Any) -> None:
            if self.on:
                self.refused.append(subject)
                raise TransportError(f"{subject} not stored by JetStream (test: JetStream away)", subject=subject)
            await real(subject, data, **kw)

        monkeypatch.setattr(bus, "publish_durable", publish_durable)


async def _owed(rig: Rig, job_id: str) -> list[str]:
    """The kinds the controller's outbox holds for ``job_id``, read raw from Redis."""
    return [json.loads(x)["event"]["kind"] for x in await rig.redis.lrange(Keys.controller_outbox(job_id), 0, -1)]


async def _ends(rig: Rig, job_id: str) -> list[Any]:
    return [e for e in await rig.events(job_id) if e.kind in ENDS]  # type: ignore[attr-defined]


async def test_a_final_event_jetstream_refuses_is_owed_and_lands_once_after_the_outage(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """JetStream refuses every append as the job is stopped. The job still ends (its raw record
    final within a bound), its ``job_stopped`` owed in the raw outbox and absent from the log;
    once JetStream takes appends again the event is in the log exactly once, with the leader's
    fence, and the outbox is empty. (It was dropped: the log never ended.)"""
    monkeypatch.setattr(outbox_mod, "FINAL_EVENT_WAIT_S", 1.0)
    c, job = await leading_job_at_step_0(rig, "owedfinal")
    outage = PublishOutage(c.bus, monkeypatch)
    began = time.monotonic()
    await asyncio.wait_for(c.stop_job(job.job_id), 30)
    assert time.monotonic() - began < 20, "the stop waited on JetStream past its bound"
    assert raw_job_record(rig.settings.redis_url, job.job_id)["status"] == "stopped"
    assert not await _ends(rig, job.job_id), "a final event in the log while JetStream refused every append"
    owed_during = await _owed(rig, job.job_id)
    assert outage.refused, "no append was tried during the outage"
    outage.on = False

    async def landed() -> list[Any]:
        return await _ends(rig, job.job_id) if not await _owed(rig, job.job_id) else []

    ends = await eventually_async(landed, timeout=30, what="the owed job_stopped in the log, the outbox empty")
    assert [e.kind for e in ends] == ["job_stopped"] and ends[0].data["fence"] == c.lease.token, ends
    assert owed_during.count("job_stopped") == 1, owed_during  # owed in Redis while JetStream refused it


async def test_a_final_event_a_dead_leader_owed_is_appended_once_by_the_next(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """JetStream refuses the leader's appends as it stops a job, and the leader goes away with the
    final event owed. The next leader appends it: once in the log, carrying the fence of the
    leader that gave it (not the flusher's)."""
    monkeypatch.setattr(outbox_mod, "FINAL_EVENT_WAIT_S", 0.5)
    a, job = await leading_job_at_step_0(rig, "owedtakeover")
    PublishOutage(a.bus, monkeypatch)  # never over for this leader
    await asyncio.wait_for(a.stop_job(job.job_id), 30)
    fence_a = a.lease.token
    await a.close(stop_members=False)
    assert not await _ends(rig, job.job_id)
    b = await rig.controller()
    await b.wait_leading(20)
    ends = await eventually_async(lambda: _ends(rig, job.job_id), timeout=30, what="the owed job_stopped in the log")
    await eventually_async(lambda: _nothing_owed(rig, job.job_id), timeout=10, what="the outbox empty")
    ends = await _ends(rig, job.job_id)
    assert [e.kind for e in ends] == ["job_stopped"] and ends[0].data["fence"] == fence_a, ends
    assert b.lease.token > fence_a


async def _nothing_owed(rig: Rig, job_id: str) -> bool:
    return not await _owed(rig, job_id)


async def test_events_given_during_a_nats_outage_do_not_hold_the_caller_and_land_once_in_order(
        rig: Rig, ev_infra: EmbeddedInfra) -> None:
    """NATS goes down for 4 s under a leading controller. Five events given meanwhile return at
    once (each held its caller until NATS was back, up to 30 s); once it is back, each is in the
    log exactly once, in the order given."""
    c, job = await leading_job_at_step_0(rig, "natsdown")
    took: list[float] = []
    thread = threading.Thread(target=lambda: took.append(ev_infra.restart("nats", down_s=4.0)), daemon=True)
    thread.start()
    try:
        await eventually_async(lambda: not c.bus.client.is_connected, timeout=10, what="the controller cut off")
        began = time.monotonic()
        for n in range(5):
            await c.event(job, "note", {"text": f"during the outage {n}"})
        given_s = time.monotonic() - began
    finally:
        await asyncio.to_thread(thread.join, 60)
    assert took, "NATS did not come back"
    assert given_s < 2.0, f"five events held their caller {given_s:.1f} s through the outage"

    async def notes() -> list[str]:
        texts = [str(d["text"]) for d in of_kind(await rig.events(job.job_id), "note")]
        return [t for t in texts if t.startswith("during the outage")]

    seen = await eventually_async(lambda: _five(notes), timeout=40, what="the five notes in the log")
    assert seen == [f"during the outage {n}" for n in range(5)], seen
    await eventually_async(lambda: _nothing_owed(rig, job.job_id), timeout=10, what="the outbox empty")
    assert await notes() == seen


async def _five(notes: Any) -> list[str] | None:
    got = await notes()
    return got if len(got) >= 5 else None


async def _interrupted_gang_restart(rig: Rig, monkeypatch: pytest.MonkeyPatch, name: str,
                                    victim: str) -> tuple[Controller, JobRun, threading.Event]:
    """A leader whose gang restart (after rank 0's crash) is cut short right after ``victim``'s
    process started (its start thread never returns while the test looks), then closed as if
    killed: its members run on. Returns (the dead leader, its job, the gate to let the thread go)."""
    a = await rig.controller()
    await a.wait_leading(10)
    job = await a.submit(JobSpec.parse({**spec(name).model_dump(mode="json"),
                                        "recovery": {"borrow": "never", "keep_survivors": False}}))
    await rig.hello_all(a, job.job_id)
    await rig.commit(job.job_id, 0)
    await eventually_async(lambda: job.committed_step == 0, what="commit seen")
    started, gate = _cut_short(monkeypatch, a, victim)
    os.killpg(job.members["trainer-e1-r0"].pid, signal.SIGKILL)  # type: ignore[arg-type]
    await eventually_async(started.is_set, timeout=20, what=f"{victim}'s process started")
    return a, job, gate


def _restarted(events: list[Any]) -> list[dict[str, Any]]:
    """Decisions that restart the interrupted recovery (under the crash's own fault id)."""
    return [d for d in of_kind(events, "decision")
            if d["fault_id"] == "exit-trainer-e1-r0" and "interrupted by a change of controller" in str(d["reason"])]


async def test_an_interrupted_recovery_is_restarted_after_a_redis_blip_at_the_takeover(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The new leader's restart of a recovery cut short by the change of leader meets a Redis
    blip (its lease read fails once). It is tried again: the restart's decision is in the log
    within 20 s, where it waited for the recovery deadline (120 s)."""
    a, job, gate = await _interrupted_gang_restart(rig, monkeypatch, "blipresume", "trainer-e2-r0")
    blips: list[str] = []
    real_leads = Controller.leads

    async def leads(self: Controller) -> bool:
        import inspect

        callers = {f.function for f in inspect.stack()[1:4]}
        if not blips and "resume_interrupted" in callers:
            blips.append(self.owner)
            raise redis.exceptions.ConnectionError("Connection reset by peer (test: a Redis blip at the takeover)")
        return await real_leads(self)

    monkeypatch.setattr(Controller, "leads", leads)
    try:
        await a.close(stop_members=False)
        b = await rig.controller()
        await b.wait_leading(20)
        await eventually_async(lambda: blips, timeout=20, what="the blip met by the restart of the recovery")
        restarts = await eventually_async(lambda: _restarted_in_log(rig, job.job_id), timeout=20,
                                          what="the interrupted recovery restarted after the blip")
        assert len(restarts) == 1, restarts
    finally:
        gate.set()


async def _restarted_in_log(rig: Rig, job_id: str) -> list[dict[str, Any]]:
    return _restarted(await rig.events(job_id))


@pytest.mark.parametrize("dies", ["unwatched", "after_reattach"])
async def test_a_half_started_gangs_rank_that_exited_unseen_is_no_start_up_failure(
        rig: Rig, monkeypatch: pytest.MonkeyPatch, dies: str) -> None:
    """The leader's gang restart recorded rank 0 (started, no hello yet) and was cut short at rank
    1; it dies. Rank 0 exits either while no controller watches (``unwatched``: the new leader
    finds it gone) or just after the new leader re-attached it, before that leader acts
    (``after_reattach``: at the ``takeover_resumed`` point; a process killed just before the
    takeover can also still look alive to it). Either way the new leader's restart of the
    interrupted recovery supersedes rank 0: its exit is logged as expected, no crash fault, not
    a start-up failure of the job (three in a row fail it)."""
    a, job, gate = await _interrupted_gang_restart(rig, monkeypatch, f"halfgang-{dies}", "trainer-e2-r1")
    try:
        rank0 = job.members["trainer-e2-r0"]
        assert rank0.handle and rank0.state == "starting", rank0
        assert raw_job_record(rig.settings.redis_url, job.job_id)["members"]["trainer-e2-r0"]["handle"]
        await a.close(stop_members=False)
        pid = rank0.pid
        assert pid
        if dies == "unwatched":
            os.killpg(pid, signal.SIGKILL)
        else:
            real_hit = failpoints.hit
            killed: list[int] = []

            async def hit(name: str) -> None:
                if name == "takeover_resumed" and not killed:
                    os.killpg(pid, signal.SIGKILL)  # re-attached (alive then), gone before the leader acts
                    killed.append(pid)
                    await eventually_async(lambda: not running(pid), timeout=10, what="rank 0 gone")
                await real_hit(name)

            monkeypatch.setattr(failpoints, "hit", hit)
        b = await rig.controller()
        await b.wait_leading(20)
        exits = await eventually_async(lambda: _exits_of(rig, job.job_id, "trainer-e2-r0"), timeout=20,
                                       what="rank 0's exit logged")
        if dies == "after_reattach":
            assert killed, "rank 0 was not re-attached alive (the takeover found it gone)"
            note = next(d for d in of_kind(await rig.events(job.job_id), "note") if d.get("owner") == b.owner)
            assert "trainer-e2-r0" in note["adopted"], note
        crashes = [d for d in of_kind(await rig.events(job.job_id), "fault_detected")
                   if d["member_id"] == "trainer-e2-r0"]
        assert not crashes, f"rank 0 of the half-started gang judged a crash: {crashes}"
        assert [d["expected"] for d in exits] == [True], exits
        assert ("trainer", 0) not in b.get(job.job_id).startup_failures
        await eventually_async(lambda: _restarted_in_log(rig, job.job_id), timeout=30,
                               what="the interrupted recovery restarted")
    finally:
        gate.set()


async def _exits_of(rig: Rig, job_id: str, member_id: str) -> list[dict[str, Any]]:
    return [d for d in of_kind(await rig.events(job_id), "member_exited") if d["member_id"] == member_id]


# --- the same process, as each launcher identifies it (pure) -----------------------------------

def test_each_launcher_says_two_handles_are_the_same_process_by_its_own_identity() -> None:
    """Local: pid and start time; Docker: the container id; Ray: node, pid and start time (a pid
    repeats across nodes). A handle missing what identifies a process matches nothing (not even
    an equal one: the actor name alone is no process)."""
    local = {"pid": 4242, "create_time": 1000.0}
    assert LocalLauncher.same_process(local, {**local, "host": "h1"})
    assert LocalLauncher.same_process(local, {"pid": 4242, "create_time": 1000.01})  # the clock's rounding
    assert not LocalLauncher.same_process(local, {"pid": 4242, "create_time": 1003.0})  # a recycled pid
    assert not LocalLauncher.same_process(local, {"pid": 4243, "create_time": 1000.0})
    assert not LocalLauncher.same_process({"pid": 4242}, {"pid": 4242})

    assert DockerLauncher.same_process({"container": "abc"}, {"container": "abc"})
    assert not DockerLauncher.same_process({"container": "abc"}, {"container": "abd"})
    assert not DockerLauncher.same_process({}, {})

    ray = {"launcher": "ray", "actor": "i:job--rollout-0-i0", "pid": 4242, "create_time": 1000.0, "node_id": "n1",
           "node_ip": "10.0.0.1", "gang": None}
    kept = {**ray, "actor": "i:job--trainer-e2-r1", "gang": "job--trainer-e2"}  # the same process, relabelled
    assert RayLauncher.same_process(ray, kept)
    assert not RayLauncher.same_process(ray, {**ray, "node_id": "n2", "node_ip": "10.0.0.2"})  # another node
    assert not RayLauncher.same_process(ray, {**ray, "create_time": 1009.0})
    assert RayLauncher.same_process({**ray, "node_id": None}, ray)  # a node not known: pid and start time
    assert not RayLauncher.same_process({**ray, "node_id": None}, {**ray, "create_time": 1009.0})
    assert not RayLauncher.same_process({"launcher": "ray", "actor": "x"}, {"launcher": "ray", "actor": "x"})


class HandleLauncher(Launcher):
    """A launcher that knows only handles (pure): ``found`` is what ``find`` gives per member id,
    ``adopted`` what it was asked to adopt; processes are identified as Ray identifies them."""

    @staticmethod
    def same_process(a: dict[str, Any], b: dict[str, Any]) -> bool:
        return RayLauncher.same_process(a, b)

    def __init__(self, found: dict[str, dict[str, Any]]) -> None:
        self.found = found
        self.adopted: list[str] = []

    def start(self, spec: MemberSpec) -> None:
        del spec

    def stop(self, member_id: str, grace_s: float = 2.0) -> None:
        del member_id, grace_s

    def kill(self, member_id: str, expected: bool = False) -> None:
        del member_id, expected

    def suspend(self, member_id: str) -> None:
        del member_id

    def resume(self, member_id: str) -> None:
        del member_id

    def pid(self, member_id: str) -> int | None:
        del member_id
        return None

    def poll(self) -> list[Any]:
        return []

    def state(self, member_id: str) -> MemberState | None:
        del member_id
        return None

    def find(self, member_id: str) -> dict[str, Any] | None:
        return self.found.get(member_id)

    def adopt(self, job_id: str, member_id: str, role: str, handle: dict[str, Any]) -> bool:
        del job_id, role, handle
        self.adopted.append(member_id)
        return True


async def test_a_process_on_another_node_with_a_recorded_members_pid_is_not_taken_for_it() -> None:
    """An interrupted gang start kept rank 1 in place (relabelled: recorded live as the new rank
    with its handle). Under the old rank 0's id (recorded dead) a process still runs, on another
    node, with the same pid as the kept rank: it is no recorded member's, so the takeover adopts
    it to stop it. Under the old rank 1's id the kept process itself is found: left alone."""
    from robustrl.services.controller.takeover import find_handed_over

    job = JobRun(job_id="j", spec=spec("samepid"))
    job.epoch = 2
    node_a = {"launcher": "ray", "pid": 777, "create_time": 50.0, "node_id": "node-a", "node_ip": "10.0.0.1"}
    node_b = {**node_a, "node_id": "node-b", "node_ip": "10.0.0.2", "create_time": 61.0}
    for rank in (0, 1):
        job.members[f"trainer-e1-r{rank}"] = MemberInfo(f"trainer-e1-r{rank}", "trainer", rank, 1, state="dead")
    kept = MemberInfo("trainer-e2-r1", "trainer", 1, 2, state="starting", pid=777,
                      handle={**node_a, "actor": "i:j--trainer-e1-r1", "gang": "j--trainer-e2"})
    job.members[kept.member_id] = kept
    launcher = HandleLauncher({"j--trainer-e1-r0": {**node_b, "actor": "i:j--trainer-e1-r0", "gang": None},
                               "j--trainer-e1-r1": {**node_a, "actor": "i:j--trainer-e1-r1", "gang": None}})
    found = await find_handed_over(launcher, job, {"trainer-e1-r0", "trainer-e1-r1"})
    assert found == ["trainer-e1-r0"], found
    assert launcher.adopted == ["j--trainer-e1-r0"]


async def test_the_controller_outbox_is_the_controllers_alone(ev_infra: EmbeddedInfra) -> None:
    """Redis (the real server, each role's own credentials): the controller saves, reads and
    removes its outbox's entries; the trainer and the rollout may neither read nor write it."""
    assert ev_infra.settings is not None and ev_infra.settings.credentials_file
    base = ev_infra.settings
    creds = Credentials.load(base.credentials_file)
    job_id = "acl-outbox"
    entry = OutboxEntry(msg_id=f"{job_id}-note-1", event=Event(job_id=job_id, kind="note", data={"text": "acl"}))
    controller = connect(role_settings(base, creds, Principal.CONTROLLER).redis_url)
    try:
        box = ControllerOutbox(controller, job_id)
        text = await box.add(entry)
        assert [e for _, e in await box.entries()] == [entry]
        key = Keys.controller_outbox(job_id)
        for role in (Principal.TRAINER, Principal.ROLLOUT):
            other = redis.Redis.from_url(role_settings(base, creds, role).redis_url, socket_timeout=5)
            try:
                for forbidden in (lambda o=other: o.lrange(key, 0, -1), lambda o=other: o.rpush(key, "x"),
                                  lambda o=other: o.delete(key)):
                    with pytest.raises(redis.exceptions.ResponseError):  # (NoPermissionError is one)
                        forbidden()
            finally:
                other.close()
        await box.remove(text)
        assert await box.size() == 0
    finally:
        await controller.delete(Keys.controller_outbox(job_id))
        await controller.aclose()


async def test_an_owed_event_already_in_the_log_is_not_appended_again_though_its_time_lies_ahead(
        rig: Rig) -> None:
    """A leader appended an event and died before it removed the entry from its outbox; the
    event's time lies an hour ahead of this controller's wall clock (the clock stepped back since,
    or that leader's ran ahead), and JetStream's duplicate window is over for the first copy.
    Before, an owed entry younger than a minute by the wall clock was appended without a look in
    the log, and one from the future always was: the log held the event twice. The window is 1 s
    here (2 min by default). Judged from the log."""
    from robustrl import subjects
    from robustrl.services.controller.outbox import ControllerEvents
    from support import duplicate_window

    assert rig.bus
    window = await duplicate_window(rig.settings.nats_url, 1.0)
    job_id = "aheadofclock"
    try:
        event = Event(job_id=job_id, kind="note", data={"text": "owed"}, ts=time.time() + 3600)
        entry = OutboxEntry(msg_id=f"{job_id}-note-1", event=event)
        await rig.bus.publish_durable(subjects.events(job_id, "note", "controller"), event.encode(),
                                      msg_id=entry.msg_id)
        await ControllerOutbox(rig.redis, job_id).add(entry)  # (its removal never happened)
        await asyncio.sleep(1.5)  # the duplicate window (1 s here) over for the first copy
        await ControllerEvents(rig.bus, rig.redis).flush(job_id, 15)  # the next leader's flusher
        assert not await _owed(rig, job_id)
        notes = [e for e in await rig.events(job_id) if e.kind == "note"]  # type: ignore[attr-defined]
        assert len(notes) == 1, notes
    finally:
        await duplicate_window(rig.settings.nats_url, window)
