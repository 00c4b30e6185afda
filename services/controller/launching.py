"""Starting a job's members through the launcher: their environment, trainer gangs, replicas,
and re-attaching to members a previous controller started (after a restart or a failover)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from robustrl.member import trainer_id
from robustrl.bus import Bus
from robustrl.config import Settings
from robustrl.errors import LaunchError
from robustrl.launcher.base import (
    ROLLOUT_MODULE,
    TRAINER_MODULE,
    Launcher,
    MemberSpec,
    MemberState,
    PlacementHint,
    Resources,
)
from robustrl.model.engines.envs import ENGINE_ENV
from robustrl.services.controller.jobs import JobRun, MemberInfo
from robustrl.services.controller.lease import LeaseLost

log = logging.getLogger(__name__)

LID_SEP = "--"
STDERR_TAIL_LINES = 20
"""Lines of a member's log quoted in a start-up failure."""


class StartSuperseded(LaunchError):
    """A start overtaken by a recovery: while it ran, a newer gang or a newer incarnation of the
    slot was planned (a whole-job restart during the job's first start), so what it started is
    not the job's any more and was stopped. The recovery's own start stands: not a failure of
    the job."""


class JobStopping(LaunchError):
    """A member not started, or stopped right after its start, because its job is being stopped
    (or has ended): a stop that listed the job's live members before the start returned would
    otherwise leave it running, untracked."""


def _failed_start(exc: BaseException) -> bool:
    """A launcher's failure to start (not a superseded or stopped start, not a lost lease)."""
    return isinstance(exc, LaunchError) and not isinstance(exc, StartSuperseded | JobStopping)


def lid(job: JobRun | str, member_id: str) -> str:
    """The launcher's key for a member: unique across jobs (member ids are unique per job)."""
    job_id = job if isinstance(job, str) else job.job_id
    return f"{job_id}{LID_SEP}{member_id}"


def gang_id(job: JobRun, epoch: int | None = None) -> str:
    """The launcher's key for the job's trainer gang of ``epoch`` (default: its current one; a
    Ray placement group's name)."""
    return lid(job, f"trainer-e{job.epoch if epoch is None else epoch}")


def replica_id(slot: int, incarnation: int) -> str:
    """The member id of incarnation ``incarnation`` of rollout slot ``slot``."""
    return f"rollout-{slot}-i{incarnation}"


def split_lid(launcher_id: str) -> tuple[str, str]:
    """(job id, member id) of a launcher key."""
    job_id, _, member_id = launcher_id.partition(LID_SEP)
    return job_id, member_id


class MemberStarter:
    """Starts trainer gangs and rollout replicas for jobs and records them on the job.

    Every start is fenced by the controller's lease: leadership is checked (one Redis read) right
    before the launcher starts anything, and the started member's handle is written to the job
    record with the lease token right after. A controller frozen past its lease that resumes in
    between gets that write refused: it kills the member it just started (unless the new leader
    already adopted it), records ``member_stopped`` and raises :class:`LeaseLost`, so no member
    runs that no leader tracks."""

    def __init__(self, bus: Bus, launcher: Launcher, settings: Settings,
                 member_credentials: dict[str, dict[str, str]] | None = None,
                 fence: Callable[[], int] = lambda: 0,
                 newest_epoch: Callable[[JobRun], Awaitable[int]] | None = None,
                 persist: Callable[[JobRun], Awaitable[bool | None]] | None = None,
                 leads: Callable[[], Awaitable[bool]] | None = None,
                 adopted_elsewhere: Callable[[JobRun, str], Awaitable[bool]] | None = None,
                 emit: Callable[[str, str, dict[str, Any]], Awaitable[Any]] | None = None) -> None:
        self.bus = bus
        self.emit = emit or (lambda job_id, kind, data: bus.emit_event(job_id, kind, data))
        """Owes an event (job id, kind, data) to the job's log (the controller's outbox)."""
        self.newest_epoch = newest_epoch
        """The newest gang epoch the job's fence in Redis has seen (a new gang must be above it)."""
        self.persist = persist
        """Makes the job record durable (the new epoch is saved before its gang is launched, each
        member's handle right after its start); returns False when the lease fence refused it."""
        self.leads = leads
        """Whether this controller still holds the newest lease term (checked before each start)."""
        self.adopted_elsewhere = adopted_elsewhere
        """Whether the durable record (written by a newer leader) holds the member with a handle."""
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

    def trainer_spec(self, job: JobRun, rank: int, env: dict[str, str], epoch: int | None = None) -> MemberSpec:
        """Rank ``rank`` of the job's gang of ``epoch`` (default: its current one): its resources
        and its place in the gang (one placement group per gang and epoch, laid out with the
        job's strategy)."""
        t = job.spec.trainer
        epoch = job.epoch if epoch is None else epoch
        return MemberSpec(job.job_id, lid(job, trainer_id(epoch, rank)), "trainer", TRAINER_MODULE, env,
                          resources=Resources(t.resources.cpus, t.resources.gpus, t.resources.memory_mb),
                          placement=PlacementHint(node_labels=dict(t.placement.node_labels),
                                                  gang=gang_id(job, epoch), gang_rank=rank,
                                                  gang_size=t.workers, strategy=t.placement.strategy),
                          cold=job.starts_cold("trainer", rank))

    def replica_spec(self, job: JobRun, member_id: str, env: dict[str, str], slot: int) -> MemberSpec:
        """A rollout replica of ``slot``: its resources, and anti-affinity among the job's replicas."""
        r = job.spec.rollout
        env = {**env, ENGINE_ENV: r.engine}  # the launcher picks the engine's interpreter from it
        return MemberSpec(job.job_id, lid(job, member_id), "rollout", ROLLOUT_MODULE, env,
                          resources=Resources(r.resources.cpus, r.resources.gpus, r.resources.memory_mb),
                          placement=PlacementHint(node_labels=dict(r.placement.node_labels),
                                                  group=lid(job, "rollout"), anti_affinity=r.placement.anti_affinity),
                          cold=job.starts_cold("rollout", slot))

    def _record(self, job: JobRun, info: MemberInfo) -> None:
        key = lid(job, info.member_id)
        info.pid = self.launcher.pid(key)
        info.handle = self.launcher.handle(key) or {}
        job.members[info.member_id] = info

    async def _next_epoch(self, job: JobRun) -> int:
        """Take the next gang epoch and save the job with it (and whatever else was planned in it)
        before anything starts; return it. The caller starts that epoch, not ``job.epoch`` read
        later: a recovery may take a newer one while the save or the caller's next step waits.

        Raises:
            LeaseLost: the fence refused the save (a newer controller lease term has begun).
        """
        floor = await self.newest_epoch(job) if self.newest_epoch else -1
        job.epoch = epoch = max(job.epoch, floor) + 1
        if self.persist and await self.persist(job) is False:
            raise LeaseLost(f"job {job.job_id}: gang epoch {epoch} not saved: a newer controller "
                            f"lease term has begun; nothing started")
        return epoch

    async def start_gang(self, job: JobRun, borrowed: dict[int, str] | None = None,
                         kept: dict[int, str] | None = None, epoch: int | None = None) -> list[str]:
        """Start a new trainer gang (next epoch); return its member ids, rank 0 first.

        ``borrowed`` maps ranks to rollout replicas (already drained) that the launcher switches
        to that rank in place (``Launcher.relabel``) instead of starting a process; ``kept`` maps
        ranks to ranks of the broken gang handed over the same way. A kept rank (or a borrowed
        replica) whose process is gone by then (it gave up waiting, or died) is started as usual
        instead and removed from ``kept`` (or ``borrowed``).

        The epoch is above both the one this controller remembers and the newest the gang fence in
        Redis has seen, and it is saved before any rank starts: a controller restarted (or a
        standby taking over) between the two can neither reuse an epoch nor pick one the fence
        refuses (a crash loop of gangs rejected at their start). ``epoch``: the one the caller took
        and saved (``start_all``); by default the next.
        """
        if epoch is None:  # this start's gang, whatever a recovery plans while it runs
            epoch = await self._next_epoch(job)
        ids = []
        borrowed = borrowed or {}
        kept = {} if kept is None else kept
        for rank, old in list(kept.items()):
            # Gone already (it gave up waiting for the hand-off, or died): its rank starts anew,
            # and the rendezvous is not placed on a host where nothing runs.
            if await asyncio.to_thread(self.launcher.state, lid(job, old)) is not MemberState.RUNNING:
                log.warning("job %s: rank %d of the broken gang (%s) is not running: not kept", job.job_id,
                            rank, kept.pop(rank))

        async def rendezvous() -> tuple[str, int]:
            # On rank 0's own node, chosen by the launcher (the Ray launcher places rank 0 first);
            # a borrowed or kept rank 0 stays where it ran.
            in_place = {**borrowed, **kept}
            if 0 in in_place:
                return await asyncio.to_thread(self.launcher.rendezvous_on, lid(job, in_place[0]))
            return await asyncio.to_thread(self.launcher.rendezvous, self.trainer_spec(job, 0, {}, epoch))

        try:
            return await self._start_ranks(job, epoch, ids, borrowed, kept, rendezvous)
        except BaseException as exc:
            if not ids:  # placed (a Ray placement group, pre-made actors) but no rank started
                await asyncio.to_thread(self.launcher.release_unstarted_gang, gang_id(job, epoch))
            if _failed_start(exc) and job.epoch != epoch:
                # A recovery planned a newer gang meanwhile: this start failing (its placement
                # gone, its ranks killed) is the recovery's doing, and the recovery's start stands.
                raise await self._superseded(job, f"gang e{epoch} superseded by e{job.epoch} (its start then "
                                             f"failed: {exc})", ids) from exc
            raise

    async def _superseded(self, job: JobRun, what: str, started: list[str]) -> StartSuperseded:
        """Stop ``started`` (this start's members, now of a superseded gang or incarnation) and
        return the error that ends the start."""
        await asyncio.to_thread(self.launcher.kill_many, [lid(job, m) for m in started], True)
        for mid in started:
            if mid in job.members:
                job.members[mid].state = "dead"
        log.warning("job %s: %s while it started: stopped %s", job.job_id, what, ", ".join(started) or "nothing")
        return StartSuperseded(f"job {job.job_id}: {what} while it started")

    async def _start_ranks(self, job: JobRun, epoch: int, ids: list[str], borrowed: dict[int, str],
                           kept: dict[int, str], rendezvous: Callable[[], Awaitable[tuple[str, int]]]) -> list[str]:
        master, port = await rendezvous()
        for rank in range(job.spec.trainer.workers):
            if job.epoch != epoch:  # a recovery started a newer gang meanwhile (before: rank r of
                # that gang was started a second time here, and the job failed at its start)
                raise await self._superseded(job, f"gang e{epoch} superseded by e{job.epoch}", ids)
            mid = trainer_id(epoch, rank)

            def spec_for(master: str, port: int, rank: int = rank, mid: str = mid) -> MemberSpec:
                env = self.member_env(job, mid, "trainer") | {
                    "ROBUSTRL_RANK": str(rank), "ROBUSTRL_WORLD_SIZE": str(job.spec.trainer.workers),
                    "MASTER_ADDR": master, "MASTER_PORT": str(port)}
                return self.trainer_spec(job, rank, env, epoch)

            member = spec_for(master, port)
            await self._check_leading(job, mid)
            handed = kept if rank in kept else borrowed if rank in borrowed else None
            if handed is not None:
                try:
                    await asyncio.to_thread(self.launcher.relabel, lid(job, handed[rank]), member)
                    source = "survivor" if handed is kept else "borrowed"
                except LaunchError as exc:
                    # Gone before its hand-off (a borrowed replica that died while the request
                    # manager acknowledged its drain, up to 20 s; before, that failed the recovery
                    # into a whole-job restart: an outside review): its rank starts as any other.
                    # A borrowed one's slot is still owed its replacement (the caller counts what it
                    # drained, not what was handed over).
                    old = handed.pop(rank)
                    log.warning("job %s: rank %d not taken over from %s: %s; starting %s",
                                job.job_id, rank, old, exc, mid)
                    # Whatever is left of it must not run on untracked (it is 'dead' to every stop).
                    await self._check_leading(job, mid)  # (the relabel may have taken a while)
                    await asyncio.to_thread(self.launcher.kill, lid(job, old), True)
                    if rank == 0:  # the rendezvous was to be on its node: choose it anew
                        master, port = await rendezvous()
                        member = spec_for(master, port)
                    await self._start(member)
                    source = "spare" if self.launcher.was_warm(lid(job, mid)) else "cold"
            else:
                await self._start(member)
                source = "spare" if self.launcher.was_warm(lid(job, mid)) else "cold"
            self._record(job, MemberInfo(mid, "trainer", rank, epoch, warm=source == "spare"))
            if job.epoch != epoch:
                raise await self._superseded(job, f"gang e{epoch} superseded by e{job.epoch}", [*ids, mid])
            await self._confirm(job, mid)
            ids.append(mid)
            await self.emit(job.job_id, "member_started", {
                "member_id": mid, "role": "trainer", "epoch": epoch, "warm": source != "cold",
                "source": source, "borrowed_from": borrowed.get(rank) or kept.get(rank), "fence": self.fence()})
        return ids

    async def start_replica(self, job: JobRun, slot: int,
                            intent: Callable[[JobRun], Awaitable[None]] | None = None,
                            incarnation: int | None = None) -> str:
        """Start the next incarnation of rollout slot ``slot``; return its member id.

        ``intent`` (a restock): the planned member is in the job as ``starting``, without a
        handle, and ``intent`` makes that durable before the launcher starts anything, so a
        controller that takes over between the start and the handle's write can find the member
        (``Launcher.find``) instead of leaking it; it returns False when the lease fence refused
        that write (nothing is started then). A start that fails leaves it ``dead``.
        ``incarnation``: the one the caller planned and saved (``start_all``); by default the
        slot's next.

        Raises:
            LeaseLost: a newer controller leads (checked before the start; a member whose handle
                the fence refused after its start is killed first).
        """
        if incarnation is None:
            inc = job.slot_incarnation[slot] = job.slot_incarnation.get(slot, -1) + 1
        else:  # planned and saved by the caller: a newer one a recovery planned since is not undone
            inc = incarnation
        mid = replica_id(slot, inc)
        if job.slot_incarnation.get(slot) != inc:  # (it set it back before: both ran, one untracked)
            raise await self._superseded(
                job, f"{mid} superseded by incarnation {job.slot_incarnation.get(slot)} of its slot", [])
        env = self.member_env(job, mid, "rollout")
        if intent is not None:
            job.members[mid] = MemberInfo(mid, "rollout", slot, inc)
        try:
            if intent is not None and await intent(job) is False:  # inside: no "starting" member left
                raise LeaseLost(f"job {job.job_id}: the intent to start {mid} was refused: a newer "
                                f"controller lease term has begun")
            await self._check_leading(job, mid)
            await self._start(self.replica_spec(job, mid, env, slot))
        except BaseException as exc:
            if intent is not None:
                job.members[mid].state = "dead"
            if _failed_start(exc) and job.slot_incarnation.get(slot) != inc:  # as for a gang, above
                raise await self._superseded(job, f"{mid} superseded by incarnation "
                                             f"{job.slot_incarnation.get(slot)} of its slot (its start then "
                                             f"failed: {exc})", []) from exc
            raise
        self._record(job, MemberInfo(mid, "rollout", slot, inc, warm=self.launcher.was_warm(lid(job, mid))))
        if job.slot_incarnation.get(slot) != inc:  # a recovery planned a newer one meanwhile
            raise await self._superseded(
                job, f"{mid} superseded by incarnation {job.slot_incarnation.get(slot)} of its slot", [mid])
        await self._confirm(job, mid)
        await self.emit(job.job_id, "member_started", {
            "member_id": mid, "role": "rollout", "warm": self.launcher.was_warm(lid(job, mid)),
            "fence": self.fence()})
        return mid

    async def start_all(self, job: JobRun) -> tuple[list[str], list[str]]:
        """A new gang and a new incarnation of every replica slot, in parallel. Every start runs
        to its end (or its fenced kill) before the first error is raised: the caller must not
        act on a job whose members are still being started.

        Every member id this start uses is durable before any member starts: the gang's epoch and
        each slot's next incarnation go in one save. A leader that dies mid-start leaves a record
        from which the next derives every member it may have started, and finds them
        (``takeover.Restorer.relaunch``). Saved only with the gang's epoch, a replica could be running
        before that save carried its slot's number (an outside review found it): the next leader
        did not look for it, and started a second process under the same id.

        Raises:
            LeaseLost: the save was refused (nothing started) or the lease was lost during a start.
        """
        planned = {i: job.slot_incarnation.get(i, -1) + 1 for i in range(job.spec.rollout.replicas)}
        job.slot_incarnation.update(planned)
        epoch = await self._next_epoch(job)
        started: list[Any] = await asyncio.gather(
            self.start_gang(job, epoch=epoch),
            *(self.start_replica(job, i, incarnation=inc) for i, inc in planned.items()),
            return_exceptions=True)
        # A lost lease first: the caller must stop acting, not escalate the other failures. A
        # start that really failed comes before a superseded one: the recovery that superseded a
        # part does not make the rest of this start a success.
        errors = sorted((r for r in started if isinstance(r, BaseException)),
                        key=lambda e: (not isinstance(e, LeaseLost), not isinstance(e, JobStopping),
                                       isinstance(e, StartSuperseded)))
        if errors:
            raise errors[0]
        return started[0], list(started[1:])

    async def _start(self, spec: MemberSpec) -> None:
        """``launcher.start`` in a thread, undone if the caller is cancelled meanwhile (a deposed
        controller closing cancels its tasks; the thread still starts the member, whose handle this
        controller then never writes): the thread kills what it started once it sees the
        cancellation, or the cancelled caller kills it if the start had already finished."""
        guard = threading.Lock()
        state = {"started": False, "cancelled": False}

        def start() -> None:
            self.launcher.start(spec)
            with guard:
                state["started"] = True
                undo = state["cancelled"]
            if undo:
                log.warning("%s started after its start was cancelled: killing it", spec.member_id)
                self.launcher.kill(spec.member_id, True)

        try:
            await asyncio.to_thread(start)
        except asyncio.CancelledError:
            with guard:
                state["cancelled"] = True
                undo = state["started"]
            if undo:  # finished in the moment the caller was cancelled: nothing else will stop it
                log.warning("%s started as its start was cancelled: killing it", spec.member_id)
                self.launcher.kill(spec.member_id, True)
            raise

    async def _check_leading(self, job: JobRun, member_id: str) -> None:
        """Right before a start: refuse it if the job is being stopped (JobStopping) or a newer
        controller leads (LeaseLost; one Redis read)."""
        if job.done:
            raise JobStopping(f"job {job.job_id}: {member_id} not started: the job is being stopped",
                              member=member_id)
        if self.leads is not None and not await self.leads():
            raise LeaseLost(f"job {job.job_id}: {member_id} not started: this controller does not hold "
                            f"the newest lease term")

    async def _confirm(self, job: JobRun, member_id: str) -> None:
        """Make the just-started member's handle durable. A write the lease fence refuses means a
        newer leader acts on a record without this member: kill it (it would run untracked) unless
        that leader adopted it already (found by its id), record it, and raise LeaseLost. A member
        whose job began stopping while it started is stopped here (JobStopping): the stop may have
        listed the live members before it was one."""
        if job.done:
            m = job.members[member_id]
            m.state = "stopped"  # before any await: the stop's final record must not list it live
            log.warning("job %s: %s started as the job was being stopped: stopping it", job.job_id, member_id)
            try:
                await asyncio.to_thread(self.launcher.stop_many, [lid(job, member_id)], 3.0)
            finally:
                if self.persist is not None:
                    await self.persist(job)
            raise JobStopping(f"job {job.job_id}: {member_id} stopped at once: the job is being stopped",
                              member=member_id)
        if self.persist is None or await self.persist(job) is not False:
            return
        m = job.members[member_id]
        if self.adopted_elsewhere is not None and await self.adopted_elsewhere(job, member_id):
            log.error("job %s: handle of %s refused by the lease fence; the new leader tracks it: "
                      "left running", job.job_id, member_id)
        else:
            log.error("job %s: handle of %s refused by the lease fence (a newer controller leads): "
                      "killing it", job.job_id, member_id)
            await asyncio.to_thread(self.launcher.kill, lid(job, member_id), True)
            await self.emit(job.job_id, "member_stopped", {
                "member_id": member_id, "role": m.role, "epoch": m.epoch, "reason": "lease_fenced",
                "pid": m.pid, "fence": self.fence()})
        m.state = "dead"
        raise LeaseLost(f"job {job.job_id}: {member_id} started but its handle was refused by the lease "
                        f"fence: a newer controller leads")

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
