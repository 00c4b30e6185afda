"""The controller runtime: jobs, launching members, carrying out recovery decisions, chaos.

Workers report, the controller decides: fault reports from the detector go through the pure
``decide`` and the resulting actions are carried out here with the launcher. Every fault,
decision, action and recovery goes to the job's event log.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from typing import Any

from robustrl.bus import Bus
from robustrl.config import JobSpec, Settings
from robustrl.errors import JobError, LaunchError, RequestTimeout
from robustrl.launcher.base import ROLLOUT_MODULE, TRAINER_MODULE, Launcher, MemberSpec
from robustrl.member import MEMBERS_TARGET
from robustrl.messages import (
    ChaosAck, ChaosCommand, ChaosRequest, ControlCommand, FaultReport, MemberExited, MemberHello, PhaseChange,
    SpecReply, SpecRequest, StepCommitted, WeightsHave,
)
from robustrl.services.controller import decide as decide_mod
from robustrl.services.controller.jobs import JobRun, MemberInfo, Recovery
from robustrl.storage.redis_stores import JobRegistry
from robustrl.subjects import Verb, all_jobs, all_jobs_exact, subject

log = logging.getLogger(__name__)
SUPERVISE_INTERVAL_S = 0.05
RM_ACK_TIMEOUT_S = 2.0
RM_ACK_ATTEMPTS = 10
FINISH_GRACE_S = 15.0  # a finished job's trainer uploads its last checkpoint before it exits


LID_SEP = "--"


def lid(job: JobRun, member_id: str) -> str:
    """The launcher's key for a member: unique across jobs (member ids are unique per job)."""
    return f"{job.job_id}{LID_SEP}{member_id}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Controller:
    def __init__(self, bus: Bus, redis: Any, launcher: Launcher, settings: Settings) -> None:
        self.bus = bus
        self.launcher = launcher
        self.settings = settings
        self.registry = JobRegistry(redis)
        self.jobs: dict[str, JobRun] = {}
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._lock = asyncio.Lock()

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        b = self.bus
        await b.ensure_event_stream()
        await b.subscribe(all_jobs_exact(Verb.SPEC), SpecRequest, self._on_spec)
        await b.subscribe(all_jobs_exact(Verb.FAULT), FaultReport, self._on_fault)
        await b.subscribe(all_jobs_exact(Verb.COMMIT), StepCommitted, self._on_commit)
        await b.subscribe(all_jobs(Verb.HELLO), MemberHello, self._on_hello)
        await b.subscribe(all_jobs(Verb.PHASE), PhaseChange, self._on_phase)
        await b.subscribe(all_jobs(Verb.HAVE), WeightsHave, self._on_have)
        await b.subscribe(all_jobs_exact(Verb.CHAOS), ChaosRequest, self._on_chaos_request)
        self._tasks.append(asyncio.create_task(self._supervise()))
        await self._restore_jobs()

    async def close(self) -> None:
        self._stop.set()
        for t in self._tasks:
            t.cancel()
        await asyncio.to_thread(self.launcher.close)

    async def _restore_jobs(self) -> None:
        """After a controller restart, pick up jobs that were running and relaunch them."""
        for job_id, rec in (await self.registry.all()).items():
            if rec.get("status") not in ("running", "recovering", "pending"):
                continue
            try:
                spec = JobSpec.parse(rec["spec"])
            except Exception as exc:
                log.error("job %s: stored spec unusable: %s", job_id, exc)
                continue
            job = JobRun(job_id=job_id, spec=spec, created_at=rec.get("created_at", time.time()))
            job.epoch = int(rec.get("epoch", 0))
            job.slot_incarnation = {int(k): int(v) for k, v in rec.get("slot_incarnation", {}).items()}
            job.committed_step = int(rec.get("committed_step", -1))
            job.reward_by_step = {int(k): v for k, v in rec.get("reward_by_step", {}).items()}
            self.jobs[job_id] = job
            log.warning("job %s: resuming after controller restart at step %d", job_id, job.step)
            await self.bus.emit_event(job_id, "note", {"text": "controller restarted; relaunching job"})
            # Members of the previous incarnation that survived the controller's loss are
            # retired first: the relaunched ones are the job's only members.
            await self.bus.publish(subject(job_id, Verb.CONTROL, MEMBERS_TARGET), ControlCommand(
                job_id=job_id, target=MEMBERS_TARGET, action="stop", args={"reason": "controller restarted"}))
            await self._launch_all(job)

    async def _persist(self, job: JobRun) -> None:
        await self.registry.put(job.job_id, {
            "spec": job.spec.model_dump(mode="json"), "status": job.status, "epoch": job.epoch,
            "committed_step": job.committed_step, "created_at": job.created_at,
            "slot_incarnation": {str(k): v for k, v in job.slot_incarnation.items()},
            "reward_by_step": {str(k): v for k, v in job.reward_by_step.items()}})

    # --- jobs -------------------------------------------------------------------------------

    async def submit(self, spec: JobSpec) -> JobRun:
        job_id = f"{spec.name}-{uuid.uuid4().hex[:8]}"
        job = JobRun(job_id=job_id, spec=spec)
        self.jobs[job_id] = job
        await self.bus.emit_event(job_id, "job_submitted", {"spec": spec.model_dump(mode="json")})
        await self._launch_all(job)
        # after the first members: spares warm up while the job starts, and serve restarts
        await self._update_spares()
        return job

    async def _update_spares(self) -> None:
        """Keep as many warm spares as the running jobs ask for (RecoverySpec.warm_spares)."""
        wanted = sum(j.spec.recovery.warm_spares for j in self.jobs.values() if not j.done)
        await asyncio.to_thread(self.launcher.keep_spares, wanted)

    async def _launch_all(self, job: JobRun) -> None:
        job.status = "running"
        job.started_at = job.started_at or time.time()
        await self._persist(job)
        await self.bus.emit_event(job.job_id, "job_started", {"policy": job.policy, "resume_step": job.step})
        await asyncio.gather(self._start_gang(job), *(self._start_replica(job, i)
                                                      for i in range(job.spec.rollout.replicas)))
        await self._control_rm(job, "resume", {"start_step": job.step, "committed": job.committed_step})

    def _member_env(self, job: JobRun, member_id: str, role: str) -> dict[str, str]:
        # Members never call the REST API: they do not get its token.
        env = {k: v for k, v in self.settings.to_env().items() if k != "ROBUSTRL_API_TOKEN"}
        return {**env, "ROBUSTRL_API_TOKEN": "", "ROBUSTRL_JOB_ID": job.job_id, "ROBUSTRL_MEMBER_ID": member_id,
                "ROBUSTRL_ROLE": role}

    async def _start_gang(self, job: JobRun) -> list[str]:
        job.epoch += 1
        port = free_port()
        ids = []
        master = self.launcher.host_for(lid(job, f"trainer-e{job.epoch}-r0"))
        for rank in range(job.spec.trainer.workers):
            mid = f"trainer-e{job.epoch}-r{rank}"
            env = self._member_env(job, mid, "trainer") | {
                "ROBUSTRL_RANK": str(rank), "ROBUSTRL_WORLD_SIZE": str(job.spec.trainer.workers),
                "MASTER_ADDR": master, "MASTER_PORT": str(port)}
            await asyncio.to_thread(self.launcher.start, MemberSpec(job.job_id, lid(job, mid), "trainer", TRAINER_MODULE, env))
            job.members[mid] = MemberInfo(mid, "trainer", rank, job.epoch, pid=self.launcher.pid(lid(job, mid)))
            ids.append(mid)
            await self.bus.emit_event(job.job_id, "member_started", {
                "member_id": mid, "role": "trainer", "epoch": job.epoch,
                "warm": self.launcher.was_warm(lid(job, mid))})
        await self._persist(job)
        return ids

    async def _start_replica(self, job: JobRun, slot: int) -> str:
        inc = job.slot_incarnation.get(slot, -1) + 1
        job.slot_incarnation[slot] = inc
        mid = f"rollout-{slot}-i{inc}"
        env = self._member_env(job, mid, "rollout")
        await asyncio.to_thread(self.launcher.start, MemberSpec(job.job_id, lid(job, mid), "rollout", ROLLOUT_MODULE, env))
        job.members[mid] = MemberInfo(mid, "rollout", slot, inc, pid=self.launcher.pid(lid(job, mid)))
        await self.bus.emit_event(job.job_id, "member_started", {
            "member_id": mid, "role": "rollout", "warm": self.launcher.was_warm(lid(job, mid))})
        return mid

    async def _control_rm(self, job: JobRun, action: str, args: dict[str, Any] | None = None,
                          attempts: int = RM_ACK_ATTEMPTS) -> bool:
        """Send a command to the request manager and wait for its acknowledgement, retrying:
        a lost resume / restart_step / replica_dead would leave the job waiting forever."""
        cmd = ControlCommand(job_id=job.job_id, target="request_manager", action=action,  # type: ignore[arg-type]
                             args=args or {})
        subj = subject(job.job_id, Verb.CONTROL, "request_manager")
        for attempt in range(attempts):
            try:
                await self.bus.request(subj, cmd, ControlCommand, timeout=RM_ACK_TIMEOUT_S)
                return True
            except RequestTimeout:
                log.warning("job %s: request manager did not acknowledge %s (attempt %d)", job.job_id, action,
                            attempt + 1)
        await self.bus.emit_event(job.job_id, "note", {"text": f"request manager never acknowledged {action}"})
        return False

    async def stop_job(self, job_id: str, status: str = "stopped", reason: str | None = None) -> JobRun:
        job = self.get(job_id)
        if job.done:
            return job
        job.status = status  # type: ignore[assignment]
        job.error = reason
        job.finished_at = time.time()
        await self._persist(job)
        await self._control_rm(job, "stop", attempts=1)
        ids = [m.member_id for m in job.live()]
        for m in job.live():
            m.state = "stopped"
        grace = FINISH_GRACE_S if status == "finished" else 3.0
        await asyncio.to_thread(self.launcher.stop_many, [lid(job, i) for i in ids], grace)
        await self._update_spares()
        await self._persist(job)
        kind = {"finished": "job_finished", "failed": "job_failed"}.get(status, "job_stopped")
        await self.bus.emit_event(job.job_id, kind, {"reason": reason, "steps": job.committed_step + 1})
        return job

    def get(self, job_id: str) -> JobRun:
        job = self.jobs.get(job_id)
        if job is None:
            raise JobError(f"no such job: {job_id}", job_id=job_id)
        return job

    # --- messages from members --------------------------------------------------------------

    async def _on_spec(self, msg: SpecRequest, _s: str, reply: str | None) -> None:
        job = self.jobs.get(msg.job_id)
        if job is None or job.done:
            return
        await self.bus.respond(reply, SpecReply(job_id=job.job_id, spec=job.spec.model_dump(mode="json"),
                                                epoch=job.epoch, resume_step=job.step))

    async def _on_hello(self, msg: MemberHello, _s: str, _r: str | None) -> None:
        job = self.jobs.get(msg.job_id)
        if not job or msg.member_id not in job.members:
            return
        m = job.members[msg.member_id]
        m.state, m.pid = "running", msg.pid
        if m.role == "trainer" and m.epoch == job.epoch:
            m.state = "ready"
            if msg.resume_step is not None:
                job.durable_step = msg.resume_step - 1
            await self._progress_recovery(job, msg.member_id)

    async def _on_phase(self, msg: PhaseChange, _s: str, _r: str | None) -> None:
        job = self.jobs.get(msg.job_id)
        if job and msg.member_id in job.members:
            job.members[msg.member_id].phase = msg.phase

    async def _on_have(self, msg: WeightsHave, _s: str, _r: str | None) -> None:
        job = self.jobs.get(msg.job_id)
        if not job or msg.member_id not in job.members:
            return
        m = job.members[msg.member_id]
        m.weights_version = msg.version
        m.state = "ready"
        if msg.version >= job.weights_version:
            await self._progress_recovery(job, msg.member_id)

    async def _on_commit(self, msg: StepCommitted, _s: str, _r: str | None) -> None:
        job = self.jobs.get(msg.job_id)
        if not job or job.done or msg.epoch != job.epoch:
            return
        job.committed_step = max(job.committed_step, msg.step)
        job.durable_step = max(job.durable_step, msg.durable_step)
        job.weights_version, job.weights_checksum = msg.weights_version, msg.checksum
        job.reward_by_step[msg.step] = msg.reward_mean
        job.last_step_timings = dict(msg.timings)
        await self._persist(job)
        if job.committed_step >= job.spec.steps - 1:
            # Stopping waits for members to exit (the trainer finishes its last upload): do it
            # in a task, so this subscription keeps delivering other jobs' commits meanwhile.
            task = asyncio.create_task(self.stop_job(job.job_id, "finished"))
            self._tasks.append(task)

    # --- supervision: process exits ---------------------------------------------------------

    async def _supervise(self) -> None:
        while not self._stop.is_set():
            try:
                await self._supervise_once()
            except Exception:  # one bad round must not end exit detection and deadlines for good
                log.exception("supervision round failed")
            try:
                await asyncio.wait_for(self._stop.wait(), SUPERVISE_INTERVAL_S)
            except asyncio.TimeoutError:
                pass

    async def _supervise_once(self) -> None:
        for info in await asyncio.to_thread(self.launcher.poll):
            job_id, _, member_id = info.member_id.partition(LID_SEP)
            job = self.jobs.get(job_id)
            if job is None or member_id not in job.members:
                continue
            info.member_id = member_id
            m = job.members[member_id]
            # A member of a replaced incarnation (e.g. the gang peer that died of the crash
            # of its partner) is not a new fault.
            info.expected = info.expected or not job.is_current(member_id) or m.state == "dead"
            if m.state != "stopped":
                m.state = "exited"
            await self.bus.emit_event(job.job_id, "member_exited", {
                "member_id": info.member_id, "role": info.role, "returncode": info.returncode,
                "expected": info.expected})
            await self.bus.publish(subject(job.job_id, Verb.EXIT, info.member_id), MemberExited(
                job_id=job.job_id, member_id=info.member_id, role=info.role,  # type: ignore[arg-type]
                returncode=info.returncode, expected=info.expected or job.done))
        for job in list(self.jobs.values()):
            await self._check_deadlines(job)

    # --- faults and recovery ----------------------------------------------------------------

    async def _on_fault(self, fault: FaultReport, _s: str, _r: str | None) -> None:
        job = self.jobs.get(fault.job_id)
        if job is None or job.done:
            return
        async with self._lock:
            now = time.time()
            current = job.is_current(fault.member_id) or fault.role == "request_manager"
            injected_at = job.injected_at.pop(fault.member_id, None)
            record = {"fault_id": fault.fault_id, "kind": fault.kind, "role": fault.role,
                      "member_id": fault.member_id, "step": job.step, "detected_at": fault.detected_at,
                      "detection_s": None if injected_at is None else fault.detected_at - injected_at,
                      "evidence": fault.evidence, "recovery_s": None, "decision": None}
            if not current:
                await self.bus.emit_event(job.job_id, "decision", {
                    "fault_id": fault.fault_id, "actions": ["Ignore"], "reason": "member already replaced"})
                return
            decision = decide_mod.decide(now, self._view(job), fault, job.spec.recovery)
            names = [type(a).__name__ for a in decision.actions]
            record["decision"] = {"actions": names, "reason": decision.reason}
            job.faults.append(record)
            await self.bus.emit_event(job.job_id, "decision", {"fault_id": fault.fault_id, "actions": names,
                                                               "reason": decision.reason})
            await self._execute_all(job, fault, decision.actions)

    async def _execute_all(self, job: JobRun, fault: FaultReport, actions: list[Any]) -> None:
        for action in actions:
            try:
                await self._execute(job, fault, action)
            except Exception as exc:  # a recovery that fails outright escalates (or fails the job)
                log.exception("job %s: %s failed", job.job_id, type(action).__name__)
                rec = decide_mod.Recovery(role=fault.role, step=job.step, started_at=time.time(),
                                          fault_id=fault.fault_id)
                decision = decide_mod.recovery_failed(time.time(), self._view(job), rec, repr(exc),
                                                      job.spec.recovery)
                await self.bus.emit_event(job.job_id, "decision", {
                    "fault_id": fault.fault_id, "actions": [type(a).__name__ for a in decision.actions],
                    "reason": decision.reason})
                if any(type(a).__name__ == type(action).__name__ for a in decision.actions):
                    await self.stop_job(job.job_id, "failed", decision.reason)
                    return
                await self._execute_all(job, fault, decision.actions)
                return

    def _view(self, job: JobRun) -> decide_mod.JobView:
        live = {m.member_id for m in job.current_trainers() + job.current_replicas()
                if m.state not in ("dead", "exited", "stopped") or job.is_current(m.member_id)}
        return decide_mod.JobView(
            job_id=job.job_id, step=job.step, committed_step=job.committed_step, durable_step=job.durable_step,
            recovering=tuple(decide_mod.Recovery(role="job" if r.kind == "whole_job" else r.role, step=r.step,
                                                 started_at=r.started_at, member_ids=frozenset(r.replacing),
                                                 fault_id=r.fault_id) for r in job.recoveries),
            faults_per_step=dict(job.failures_by_step), restarts_total=job.restarts_total,
            control_plane_ok=True, live_members=frozenset(live), rollout_replicas=job.spec.rollout.replicas)

    async def _execute(self, job: JobRun, fault: FaultReport, action: Any) -> None:
        name = type(action).__name__
        await self.bus.emit_event(job.job_id, "action", {"fault_id": fault.fault_id, "action": name,
                                                         "member_id": getattr(action, "member_id", None)})
        if name == "RestartTrainerGang":
            await self._restart_trainer(job, fault)
        elif name == "RedispatchEpisodes":
            mid = action.member_id
            await asyncio.to_thread(self.launcher.kill, lid(job, mid), True)
            if mid in job.members:
                job.members[mid].state = "dead"
            await self._control_rm(job, "replica_dead", {"member_id": mid, "fault_id": fault.fault_id})
        elif name == "ReplaceReplica":
            await self._replace_replica(job, fault, action.member_id)
        elif name == "RestartWholeJob":
            await self._restart_whole_job(job, fault)
        elif name == "FailJob":
            await self.stop_job(job.job_id, "failed", getattr(action, "reason", "recovery gave up"))
        # ReportOnly / Ignore: recorded in the event log, nothing to carry out.

    def _begin_recovery(self, job: JobRun, fault: FaultReport, kind: str, replacing: set[str]) -> Recovery:
        job.restarts_total += 1
        key = (fault.role, job.step)
        job.failures_by_step[key] = job.failures_by_step.get(key, 0) + 1
        # A recovery waiting for a member that is now itself being replaced is superseded.
        job.recoveries = [r for r in job.recoveries if not (r.waiting_for & replacing)]
        rec = Recovery(fault_id=fault.fault_id, role=fault.role, kind=kind, started_at=time.time(),
                       step=job.step, deadline_at=time.time() + job.spec.recovery.deadline_s,
                       replacing=replacing, committed_at_fault=job.committed_step)
        job.recoveries.append(rec)
        job.status = "recovering"
        return rec

    async def _restart_trainer(self, job: JobRun, fault: FaultReport) -> None:
        old = [m.member_id for m in job.current_trainers()]
        await asyncio.to_thread(self.launcher.kill_many, [lid(job, i) for i in old], True)
        for mid in old:
            job.members[mid].state = "dead"
        rec = self._begin_recovery(job, fault, "trainer", set(old))
        new = await self._start_gang(job)
        rec.waiting_for = {new[0]}

    async def _replace_replica(self, job: JobRun, fault: FaultReport, member_id: str) -> None:
        old = job.members.get(member_id)
        if old is None:
            return
        await asyncio.to_thread(self.launcher.kill, lid(job, member_id), True)
        old.state = "dead"
        rec = self._begin_recovery(job, fault, "replica", {member_id})
        rec.waiting_for = {await self._start_replica(job, old.index)}

    async def _restart_whole_job(self, job: JobRun, fault: FaultReport) -> None:
        """ByteRobust-style in-place restart: stop every role, restart all in parallel from the
        last checkpoint, regenerate the current step from scratch."""
        await self._control_rm(job, "restart_step", {"fault_id": fault.fault_id})
        ids = [m.member_id for m in job.live() if m.role in ("trainer", "rollout")]
        await asyncio.to_thread(self.launcher.kill_many, [lid(job, i) for i in ids], True)
        for mid in ids:
            job.members[mid].state = "dead"
        job.recoveries.clear()  # a whole-job restart supersedes any local recovery in progress
        rec = self._begin_recovery(job, fault, "whole_job", set(ids))
        started = await asyncio.gather(self._start_gang(job), *(self._start_replica(job, i)
                                                                for i in range(job.spec.rollout.replicas)))
        gang, replicas = started[0], started[1:]
        rec.waiting_for = {gang[0], *replicas}
        await self._control_rm(job, "resume", {"start_step": job.step, "committed": job.committed_step})

    async def _progress_recovery(self, job: JobRun, member_id: str) -> None:
        for rec in list(job.recoveries):
            if member_id not in rec.waiting_for:
                continue  # progress of a member this recovery is not waiting for
            rec.waiting_for.discard(member_id)
            if rec.waiting_for:
                continue
            job.recoveries.remove(rec)
            took = time.time() - rec.started_at
            for f in job.faults:
                if f["fault_id"] == rec.fault_id:
                    f["recovery_s"] = time.time() - f["detected_at"]
            await self.bus.emit_event(job.job_id, "recovered", {"fault_id": rec.fault_id, "role": rec.role,
                                                                "kind": rec.kind, "took_s": took})
            if rec.kind in ("trainer", "whole_job"):
                # Steps that were committed but not durable are redone by the new gang.
                redone = max(0, rec.committed_at_fault - job.durable_step)
                await self.bus.emit_event(job.job_id, "work_lost", {"fault_id": rec.fault_id, "tokens": 0,
                                                                    "steps_redone": redone})
            if not job.recoveries and job.status == "recovering":
                job.status = "running"

    async def _check_deadlines(self, job: JobRun) -> None:
        if job.done or not job.recoveries:
            return
        if decide_mod.check_recovery(time.time(), self._view(job), job.spec.recovery) is None:
            return
        async with self._lock:
            # Decide again under the lock: a recovery may have finished or been replaced meanwhile.
            decision = decide_mod.check_recovery(time.time(), self._view(job), job.spec.recovery)
            if decision is None or not job.recoveries or job.done:
                return
            late = min(job.recoveries, key=lambda r: r.started_at)
            fault = FaultReport(job_id=job.job_id, fault_id=f"{late.fault_id}-late", role=late.role,  # type: ignore[arg-type]
                                member_id=next(iter(late.waiting_for), "controller"), kind="unresponsive",
                                evidence=decision.reason, detected_at=time.time(), step=job.step)
            await self.bus.emit_event(job.job_id, "decision", {
                "fault_id": late.fault_id, "actions": [type(a).__name__ for a in decision.actions],
                "reason": decision.reason})
            await self._execute_all(job, fault, decision.actions)

    # --- chaos ------------------------------------------------------------------------------

    async def _on_chaos_request(self, msg: ChaosRequest, _s: str, reply: str | None) -> None:
        try:
            mid = await self.inject(msg)
            ack = ChaosAck(fault_id=msg.fault_id, member_id=mid, ok=True)
        except (JobError, LaunchError) as exc:
            ack = ChaosAck(fault_id=msg.fault_id, member_id=None, ok=False, error=str(exc))
        await self.bus.respond(reply, ack)

    def resolve(self, job: JobRun, role: str, member: int | str) -> str:
        pool = job.current_trainers() if role == "trainer" else job.current_replicas() if role == "rollout" else []
        pool = [m for m in pool if m.state not in ("dead", "exited", "stopped")]
        if isinstance(member, str) and not member.isdigit():
            if member in job.members and job.members[member].role == role:
                return member
            raise JobError(f"no {role} member {member!r} in job {job.job_id}", field="member")
        idx = int(member)
        match = [m for m in pool if m.index == idx]
        if not match:
            raise JobError(f"no live {role} with index {idx} in job {job.job_id}", field="member")
        return match[0].member_id

    async def inject(self, req: ChaosRequest) -> str:
        """Carry out one fault; return the member it hit."""
        job = self.get(req.job_id)
        if job.done:
            raise JobError(f"job {job.job_id} is {job.status}", job_id=job.job_id)
        if req.kind == "tool_outage" or req.role == "request_manager":
            if req.kind != "tool_outage":
                raise JobError(f"fault {req.kind} is not supported on the request manager", field="kind")
            mid = "request_manager"
        else:
            mid = self.resolve(job, req.role, req.member)
        # The injection is logged before it is carried out: a crash is detected within
        # milliseconds, and the detection must not precede its cause in the log.
        job.injected_at[mid] = time.time()
        await self.bus.emit_event(job.job_id, "fault_injected", {
            "fault_id": req.fault_id, "kind": req.kind, "role": req.role, "member_id": mid, "step": job.step,
            "duration_s": req.duration_s})
        if mid == "request_manager":
            await self._control_rm(job, "tool_outage", {"duration_s": req.duration_s or 5.0})
        elif req.kind == "crash":
            await asyncio.to_thread(self.launcher.kill, lid(job, mid), False)
        elif req.kind == "hang":
            await asyncio.to_thread(self.launcher.suspend, lid(job, mid))
        else:
            await self.bus.publish(subject(job.job_id, Verb.CHAOS, mid), ChaosCommand(
                job_id=job.job_id, fault_id=req.fault_id, kind=req.kind, member_id=mid,
                duration_s=req.duration_s, factor=req.factor))
        return mid
