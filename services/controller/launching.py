"""Starting a job's members through the launcher: their environment, trainer gangs, replicas,
and re-attaching to members a previous controller started (after a restart or a failover)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from robustrl.bus import Bus
from robustrl.config import Settings
from robustrl.launcher.base import (
    ROLLOUT_MODULE,
    TRAINER_MODULE,
    Launcher,
    MemberSpec,
    PlacementHint,
    Resources,
)
from robustrl.model.engines.envs import ENGINE_ENV
from robustrl.services.controller.jobs import JobRun, MemberInfo

LID_SEP = "--"
STDERR_TAIL_LINES = 20
"""Lines of a member's log quoted in a start-up failure."""


def lid(job: JobRun | str, member_id: str) -> str:
    """The launcher's key for a member: unique across jobs (member ids are unique per job)."""
    job_id = job if isinstance(job, str) else job.job_id
    return f"{job_id}{LID_SEP}{member_id}"


def replica_id(slot: int, incarnation: int) -> str:
    """The member id of incarnation ``incarnation`` of rollout slot ``slot``."""
    return f"rollout-{slot}-i{incarnation}"


def split_lid(launcher_id: str) -> tuple[str, str]:
    """(job id, member id) of a launcher key."""
    job_id, _, member_id = launcher_id.partition(LID_SEP)
    return job_id, member_id


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MemberStarter:
    """Starts trainer gangs and rollout replicas for jobs and records them on the job."""

    def __init__(self, bus: Bus, launcher: Launcher, settings: Settings,
                 member_credentials: dict[str, dict[str, str]] | None = None,
                 fence: Callable[[], int] = lambda: 0,
                 newest_epoch: Callable[[JobRun], Awaitable[int]] | None = None,
                 persist: Callable[[JobRun], Awaitable[None]] | None = None) -> None:
        self.bus = bus
        self.newest_epoch = newest_epoch
        """The newest gang epoch the job's fence in Redis has seen (a new gang must be above it)."""
        self.persist = persist
        """Makes the job record durable (the new epoch is saved before its gang is launched)."""
        self.launcher = launcher
        self.settings = settings
        self.member_credentials = member_credentials or {}
        self.fence = fence
        """The leader's current fencing token, stamped on the events of the members it starts."""

    def member_env(self, job: JobRun, member_id: str, role: str) -> dict[str, str]:
        # Members never call the REST API: they do not get its token. Each role gets its own
        # bus / Redis / S3 credentials when the stack defines them (robustrl.infra.credentials).
        env = {k: v for k, v in self.settings.to_env().items() if k != "ROBUSTRL_API_TOKEN"}
        return {**env, **self.member_credentials.get(role, {}), "ROBUSTRL_API_TOKEN": "",
                "ROBUSTRL_JOB_ID": job.job_id, "ROBUSTRL_MEMBER_ID": member_id, "ROBUSTRL_ROLE": role}

    def trainer_spec(self, job: JobRun, rank: int, env: dict[str, str]) -> MemberSpec:
        """Rank ``rank`` of the job's current gang: its resources and its place in the gang (one
        placement group per gang and epoch, laid out with the job's strategy)."""
        t = job.spec.trainer
        return MemberSpec(job.job_id, lid(job, f"trainer-e{job.epoch}-r{rank}"), "trainer", TRAINER_MODULE, env,
                          resources=Resources(t.resources.cpus, t.resources.gpus, t.resources.memory_mb),
                          placement=PlacementHint(node_labels=dict(t.placement.node_labels),
                                                  gang=lid(job, f"trainer-e{job.epoch}"), gang_rank=rank,
                                                  gang_size=t.workers, strategy=t.placement.strategy))

    def replica_spec(self, job: JobRun, member_id: str, env: dict[str, str]) -> MemberSpec:
        """A rollout replica: its resources, and anti-affinity among the job's replicas."""
        r = job.spec.rollout
        env = {**env, ENGINE_ENV: r.engine}  # the launcher picks the engine's interpreter from it
        return MemberSpec(job.job_id, lid(job, member_id), "rollout", ROLLOUT_MODULE, env,
                          resources=Resources(r.resources.cpus, r.resources.gpus, r.resources.memory_mb),
                          placement=PlacementHint(node_labels=dict(r.placement.node_labels),
                                                  group=lid(job, "rollout"), anti_affinity=r.placement.anti_affinity))

    def _record(self, job: JobRun, info: MemberInfo) -> None:
        key = lid(job, info.member_id)
        info.pid = self.launcher.pid(key)
        info.handle = self.launcher.handle(key) or {}
        job.members[info.member_id] = info

    async def start_gang(self, job: JobRun, borrowed: dict[int, str] | None = None) -> list[str]:
        """Start a new trainer gang (next epoch); return its member ids, rank 0 first.

        ``borrowed`` maps ranks to rollout replicas (already drained) that the launcher switches
        to that rank in place (``Launcher.relabel``) instead of starting a process.

        The epoch is above both the one this controller remembers and the newest the gang fence in
        Redis has seen, and it is saved before any rank starts: a controller restarted (or a
        standby taking over) between the two can neither reuse an epoch nor pick one the fence
        refuses (a crash loop of gangs rejected at their start).
        """
        floor = await self.newest_epoch(job) if self.newest_epoch else -1
        job.epoch = max(job.epoch, floor) + 1
        if self.persist:
            await self.persist(job)
        ids = []
        borrowed = borrowed or {}
        # The gang's rendezvous (MASTER_ADDR/PORT) is on rank 0's own node, chosen by the launcher
        # (the Ray launcher places rank 0 first); a borrowed rank 0 stays where its replica ran.
        if 0 in borrowed:
            master, port = await asyncio.to_thread(self.launcher.rendezvous_on, lid(job, borrowed[0]))
        else:
            master, port = await asyncio.to_thread(self.launcher.rendezvous, self.trainer_spec(job, 0, {}))
        for rank in range(job.spec.trainer.workers):
            mid = f"trainer-e{job.epoch}-r{rank}"
            env = self.member_env(job, mid, "trainer") | {
                "ROBUSTRL_RANK": str(rank), "ROBUSTRL_WORLD_SIZE": str(job.spec.trainer.workers),
                "MASTER_ADDR": master, "MASTER_PORT": str(port)}
            member = self.trainer_spec(job, rank, env)
            if rank in borrowed:
                await asyncio.to_thread(self.launcher.relabel, lid(job, borrowed[rank]), member)
                source = "borrowed"
            else:
                await asyncio.to_thread(self.launcher.start, member)
                source = "spare" if self.launcher.was_warm(lid(job, mid)) else "cold"
            self._record(job, MemberInfo(mid, "trainer", rank, job.epoch))
            ids.append(mid)
            await self.bus.emit_event(job.job_id, "member_started", {
                "member_id": mid, "role": "trainer", "epoch": job.epoch, "warm": source != "cold",
                "source": source, "borrowed_from": borrowed.get(rank), "fence": self.fence()})
        return ids

    async def start_replica(self, job: JobRun, slot: int,
                            intent: Callable[[JobRun], Awaitable[None]] | None = None) -> str:
        """Start the next incarnation of rollout slot ``slot``; return its member id.

        ``intent`` (a restock): the planned member is in the job as ``starting``, without a
        handle, and ``intent`` makes that durable before the launcher starts anything, so a
        controller that takes over between the start and the handle's write can find the member
        (``Launcher.find``) instead of leaking it. A start that fails leaves it ``dead``."""
        inc = job.slot_incarnation.get(slot, -1) + 1
        job.slot_incarnation[slot] = inc
        mid = replica_id(slot, inc)
        env = self.member_env(job, mid, "rollout")
        if intent is not None:
            job.members[mid] = MemberInfo(mid, "rollout", slot, inc)
        try:
            if intent is not None:  # inside: an intent that could not be saved leaves no "starting" member
                await intent(job)
            await asyncio.to_thread(self.launcher.start, self.replica_spec(job, mid, env))
        except BaseException:
            if intent is not None:
                job.members[mid].state = "dead"
            raise
        self._record(job, MemberInfo(mid, "rollout", slot, inc))
        await self.bus.emit_event(job.job_id, "member_started", {
            "member_id": mid, "role": "rollout", "warm": self.launcher.was_warm(lid(job, mid)),
            "fence": self.fence()})
        return mid

    async def start_all(self, job: JobRun) -> tuple[list[str], list[str]]:
        """A new gang and a new incarnation of every replica slot, in parallel."""
        started: list[Any] = await asyncio.gather(
            self.start_gang(job), *(self.start_replica(job, i) for i in range(job.spec.rollout.replicas)))
        return started[0], list(started[1:])

    async def adopt(self, job: JobRun) -> tuple[list[str], list[str]]:
        """Re-attach to the job's recorded live members; return (adopted, gone) member ids.

        A member is adopted only if the launcher verifies it is the very process / container
        that was started (pid and start time, container label), never a recycled pid.
        """
        adopted, gone = [], []
        for m in job.members.values():
            if m.state in ("exited", "stopped", "dead"):
                continue
            if not m.handle and m.role == "rollout" and job.restock_owed.get(m.index) == m.epoch:
                # A restock's intent: its start may have run, its handle was never written.
                found = await asyncio.to_thread(self.launcher.find, lid(job, m.member_id))
                if found is None or not await asyncio.to_thread(
                        self.launcher.adopt, job.job_id, lid(job, m.member_id), m.role, found):
                    m.state = "dead"  # never started (or gone): no fault, its slot is restocked anew
                    continue
                m.handle, m.pid = found, found.get("pid")
                adopted.append(m.member_id)
                continue
            ok = await asyncio.to_thread(self.launcher.adopt, job.job_id, lid(job, m.member_id), m.role,
                                         m.handle)
            (adopted if ok else gone).append(m.member_id)
        return adopted, gone

    def log_tail(self, job: JobRun, member_id: str, lines: int = STDERR_TAIL_LINES) -> str:
        """The member's last output lines (its stderr goes to the same log), '' if none."""
        return self.launcher.log_tail(lid(job, member_id), lines)
