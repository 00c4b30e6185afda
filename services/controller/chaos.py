"""Chaos injection: a fault request (NATS or REST) resolved to a member and carried out."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from robustrl.services.controller.jobs import JobRun
from robustrl.services.controller.launching import lid

from robustrl.chaos.network import NETWORK_KINDS, for_launcher
from robustrl.chaos.scenario import LOCAL_ROLES, moment_problem, target_problem
from robustrl.chaos.self_fault import schedule_self_fault
from robustrl.errors import ConfigError, JobError, LaunchError, TestbedError
from robustrl.messages import ChaosAck, ChaosCommand, ChaosRequest
from robustrl.subjects import Verb, subject

if TYPE_CHECKING:
    from robustrl.services.controller.runtime import Controller


class ChaosInjector:
    def __init__(self, controller: Controller) -> None:
        self.c = controller
        self.network = for_launcher(controller.launcher)
        """Real network faults when members run on testbed hosts (``robustrl.chaos.network``)."""

    async def on_request(self, msg: ChaosRequest, _s: str, reply: str | None) -> None:
        if not self.c.leading:
            return  # the leader answers
        try:
            mid = await self.inject(msg)
            ack = ChaosAck(fault_id=msg.fault_id, member_id=mid, ok=True)
        except (JobError, LaunchError) as exc:
            ack = ChaosAck(fault_id=msg.fault_id, member_id=None, ok=False, error=str(exc))
        await self.c.bus.respond(reply, ack)

    @staticmethod
    def resolve(job: JobRun, role: str, member: int | str) -> str:
        pool = (job.current_trainers() if role == "trainer" else job.current_replicas() if role == "rollout"
                else [])
        pool = [m for m in pool if m.state not in ("dead", "exited", "stopped")]
        if isinstance(member, str) and not (member.isascii() and member.isdigit()):  # '²'.isdigit() is True
            if any(m.member_id == member for m in pool):
                return member
            # (one that ended, or an older incarnation: logged as injected, it struck nothing)
            raise JobError(f"no live current {role} member {member!r} in job {job.job_id}", field="member")
        idx = int(member)
        match = [m for m in pool if m.index == idx]
        if not match:
            raise JobError(f"no live {role} with index {idx} in job {job.job_id}", field="member")
        return match[0].member_id

    async def inject(self, req: ChaosRequest) -> str:
        """Carry out one fault once per fault id; return the member it hit.

        A repeated request (same job and fault id) is not carried out again: it gets the first
        one's answer, waiting for it if that one is still under way. A requester whose answer was
        lost (sent across a NATS restart, where the server no longer knows the reply subject) may
        so retry without hitting a second member."""
        job = self.c.get(req.job_id)
        earlier = job.chaos_by_id.get(req.fault_id)
        if earlier is not None:
            return await asyncio.shield(earlier)
        if job.done:
            raise JobError(f"job {job.job_id} is {job.status}", job_id=job.job_id)
        done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        job.chaos_by_id[req.fault_id] = done
        try:
            mid = await self._inject(job, req)
        except BaseException as exc:
            # Not carried out: a retry may try again; a request waiting on this one gets the error.
            job.chaos_by_id.pop(req.fault_id, None)
            done.set_exception(exc)
            done.exception()  # retrieved: no "never retrieved" warning when nobody waited
            raise
        done.set_result(mid)
        return mid

    async def _inject(self, job: JobRun, req: ChaosRequest) -> str:
        problem = target_problem(req.kind, req.role)
        if problem:
            raise JobError(problem, field="role")
        problem = moment_problem(req.kind, req.role, req.moment)
        if problem:
            raise JobError(problem, field="moment")
        if req.role == "controller":  # carried out on itself once the answer has left
            await self.c.event(job, "fault_injected", {
                "fault_id": req.fault_id, "kind": req.kind, "role": "controller", "member_id": "controller",
                "step": job.step, "duration_s": req.duration_s})
            schedule_self_fault(req.kind, req.duration_s)
            return "controller"
        if req.role in LOCAL_ROLES or (req.role == "request_manager" and req.kind != "tool_outage"):
            raise JobError(f"{req.kind} on {req.role} is carried out by the stack that started that process "
                           "(the chaos harness with a local Stack), not by the controller", field="role")
        if req.kind == "tool_outage" or req.role == "request_manager":
            if req.kind != "tool_outage":
                raise JobError(f"fault {req.kind} is not supported on the request manager", field="kind")
            mid = "request_manager"
        else:
            mid = self.resolve(job, req.role, req.member)
        if req.against and req.kind != "partition":
            raise JobError(f"'against' is for partition only, not {req.kind}", field="against")
        host = self._network_host(job, req, mid)
        # The injection is logged before it is carried out: a crash is detected within
        # milliseconds, and the detection must not precede its cause in the log.
        if req.moment == "now":  # an armed fault strikes later: its detection is timed from its exit
            job.injected_at[mid] = time.time()
        await self.c.event(job, "fault_injected", {
            "fault_id": req.fault_id, "kind": req.kind, "role": req.role, "member_id": mid, "step": job.step,
            "duration_s": req.duration_s, **({"host": host, "against": req.against} if host else {}),
            **({"moment": req.moment} if req.moment != "now" else {})})
        if host is not None and self.network is not None:
            try:
                await asyncio.to_thread(self.network.inject, req.kind, host, req.duration_s, req.against)
            except (ConfigError, TestbedError) as exc:
                raise JobError(f"{req.kind} on {host}: {exc}", field="against") from exc
        elif mid == "request_manager":
            await self.c.control_rm(job, "tool_outage", {"duration_s": req.duration_s or 5.0})
        elif req.kind == "crash" and req.moment == "now":
            await asyncio.to_thread(self.c.launcher.kill, lid(job, mid), False)
        elif req.kind == "hang":
            await asyncio.to_thread(self.c.launcher.suspend, lid(job, mid))
        else:
            await self.c.bus.publish(subject(job.job_id, Verb.CHAOS, mid), ChaosCommand(
                job_id=job.job_id, fault_id=req.fault_id, kind=req.kind, member_id=mid,
                duration_s=req.duration_s, factor=req.factor, moment=req.moment))
        return mid

    def _network_host(self, job: JobRun, req: ChaosRequest, mid: str) -> str | None:
        """The testbed host a network fault acts on (None: not a network fault on a testbed)."""
        if req.kind not in NETWORK_KINDS:
            return None
        handle = self.c.launcher.handle(lid(job, mid)) or {}
        host = handle.get("host") if self.network is not None else None
        if host is None:
            if req.kind == "partition":
                raise JobError(f"a partition acts on testbed links, and {mid} runs on no testbed host", field="kind")
            return None  # net_drop without a testbed: the member closes its NATS connection
        try:  # every refusal before the fault is logged as injected
            self.network.check(req.kind, str(host), req.against)  # type: ignore[union-attr]
        except (ConfigError, TestbedError) as exc:
            raise JobError(f"{req.kind} on {host} against {req.against}: {exc}", field="against") from exc
        return str(host)
