"""Request manager + agent worker: owns each step's episodes (DESIGN section 2).

This module is the bus routing: the service, its subscriptions and the controller's commands. The
work itself lives in one module per concept: ``dispatch`` (turns to replicas, deadlines,
re-dispatch), ``episodes`` (tool calls and durable prefixes), ``batching`` (step assembly,
batch hand-off, step deadline, garbage collection). Never imports torch.

After its own restart the service resumes, not restarts: it finds the jobs that are running in the
job registry (Redis), asks the controller for each one's spec and committed step, and continues the
current step from Redis, keeping finished episodes and re-dispatching only turns with no live owner.
Then it appends what every job's event outbox still holds (``append_left_outboxes``), the jobs it
does not run included: a job that ended while no request manager ran it has nobody else to
append the events its killed request manager acknowledged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from robustrl.services.request_manager.batching import JobRunner
from robustrl.services.request_manager.eventlog import STOP_DRAIN_S, EventWriter

from robustrl.aio import wait_event, within
from robustrl.bus import Bus
from robustrl.config import JobSpec
from robustrl.errors import RequestTimeout, TransportError
from robustrl.event_outbox import outbox_keys
from robustrl.messages import (
    BatchGet,
    BatchReady,
    ControlCommand,
    MemberHello,
    MetricsSample,
    ProbeReply,
    ProbeRequest,
    SpecReply,
    SpecRequest,
    StepCommitted,
    TurnResult,
    WeightsHave,
)
from robustrl.storage.control_stores import JobRegistry, fence_floor
from robustrl.storage.fencing import read_gang
from robustrl.storage.redis_stores import BatchStore, Keys, RolloutGC
from robustrl.subjects import Verb, all_jobs, all_jobs_exact, subject

log = logging.getLogger(__name__)

RUNNING = ("running", "recovering", "pending")
SPEC_TIMEOUT_S = 2.0
"""One request for a job's spec; the controller answers at once when it is up."""
SPEC_ATTEMPTS = 5
EVENTS_DRAIN_S = 5.0
"""At close, how long a job's queued events are given to reach the log."""
RESUME_RETRY_S = 1.0
RESUME_RETRY_MAX_S = 30.0
"""A job whose resume after a restart failed is tried again after these pauses (doubling)."""
OUTBOX_SCAN_BATCH = 500
"""Keys asked for per SCAN of the jobs' event outboxes at the start."""

__all__ = ["JobRunner", "RequestManager"]


class RequestManager:
    """The service: one JobRunner per job, created on ``resume`` or found again after a restart."""

    def __init__(self, bus: Bus, redis: object) -> None:
        self.bus = bus
        self.redis = redis
        self.jobs: dict[str, JobRunner] = {}
        # One event writer per job for this service's life, its runner's or (a job it does not
        # run) the one that appended its outbox at the start: a runner created later takes that
        # one over, and a stopped job's keeps storing what it holds, so nothing in an outbox is
        # queued by two writers.
        self._writers: dict[str, EventWriter] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._creating: dict[str, asyncio.Lock] = {}
        self._stopped: set[str] = set()  # jobs the controller stopped: no runner is made for them again
        self._stopping: dict[str, asyncio.Task[None]] = {}  # a stopped job's runner, still ending (``_stop_job``)
        self._ending: list[JobRunner] = []  # those runners (``close`` stops them, cancelling their stops)
        self._fence: dict[str, int] = {}  # job -> largest controller fencing token seen
        # Sequence numbers only grow, across restarts too (the detector drops older samples).
        self._seq = int(time.time() * 1000)

    async def start(self, resume: bool = True) -> None:
        b = self.bus
        await b.subscribe(all_jobs_exact(Verb.CONTROL, "request_manager"), ControlCommand, self._on_control)
        await b.subscribe(all_jobs_exact(Verb.TURN), TurnResult, self._on_turn)
        await b.subscribe(all_jobs(Verb.HAVE), WeightsHave, self._route(lambda j, m: j.dispatcher.on_have(m)))
        await b.subscribe(all_jobs(Verb.HELLO), MemberHello, self._route(lambda j, m: j.on_hello(m)))
        await b.subscribe(all_jobs(Verb.METRICS), MetricsSample, self._route(lambda j, m: j.on_metrics(m)))
        await b.subscribe(all_jobs_exact(Verb.COMMIT), StepCommitted, self._route(lambda j, m: j.on_commit(m)))
        await b.subscribe(all_jobs_exact(Verb.BATCH_GET), BatchGet, self._on_batch_get)
        await b.subscribe(all_jobs_exact(Verb.PROBE, "request_manager"), ProbeRequest, self._on_probe)
        if resume:
            self._tasks.append(asyncio.create_task(self._after_restart()))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for job in [*self.jobs.values(), *self._ending]:  # (a background stop cancelled above: again here)
            await job.stop()
        # Every writer's queued events: running jobs', stopped jobs' and the outboxes' of the start.
        await asyncio.gather(*(writer.drain(EVENTS_DRAIN_S) for writer in list(self._writers.values())))

    async def _after_restart(self) -> None:
        try:
            await self.resume_running_jobs()
        except Exception as exc:  # (the scan below must still run: it owes other jobs' events)
            log.error("running jobs not resumed: the job registry not read: %s", exc)
        # After the resume: a job resumed has its runner, whose writer reads its outbox first.
        try:
            await self.append_left_outboxes()
        except Exception as exc:
            log.error("event outboxes not scanned (%s): what they hold stays for the next start", exc)

    async def resume_running_jobs(self) -> list[str]:
        """After a restart: continue every job the registry says is running (its current step from
        Redis), without waiting for the controller to say ``resume``. Each job on its own: one
        whose resume fails (Redis past its retries, a model directory it cannot read) is tried
        again (``_resume_one``) and holds up no other. Before, one failure ended the loop that
        starts the runners: another job's runner, made, was never started while the service's
        samples for it went on, so the controller never saw the request manager lost and the
        job stalled for good (an outside review)."""
        registry = await JobRegistry(self.redis).all()  # type: ignore[arg-type]
        candidates = [j for j, rec in registry.items() if rec.get("status") in RUNNING and j not in self.jobs]
        resumed = await asyncio.gather(*(self._resume_one(j) for j in candidates))
        return [j for j in resumed if j is not None]

    async def _resume_one(self, job_id: str) -> str | None:
        """Resume ``job_id`` after a restart; return it, or None when the controller does not run
        it (any more) or the first try failed: then it is tried again in the background
        (``_resume_again``), so the outbox scan that follows the resumes waits for no job that
        keeps failing (a model directory it cannot read would hold every other job's left events
        back for good: an outside review)."""
        try:
            job = await self._ensure_job(job_id, resumed=True)
        except Exception as exc:
            log.error("job %s: not resumed after the restart (%s): tried again in %.0f s", job_id, exc,
                      RESUME_RETRY_S)
            self._tasks.append(asyncio.create_task(self._resume_again(job_id)))
            return None
        return self._start_resumed(job_id, job)

    async def _resume_again(self, job_id: str) -> None:
        """Try a failed resume again, ``RESUME_RETRY_S`` doubling to ``RESUME_RETRY_MAX_S``, while
        the registry still says the job runs and it was not stopped; a runner a ``resume`` command
        made meanwhile is the one started."""
        delay = RESUME_RETRY_S
        while True:
            await asyncio.sleep(delay)
            delay = min(RESUME_RETRY_MAX_S, 2 * delay)
            if job_id in self._stopped:
                return
            try:
                record = (await JobRegistry(self.redis).all()).get(job_id)  # type: ignore[arg-type]
            except Exception as exc:
                log.warning("job %s: the job registry not read (%s): its resume tried again", job_id, exc)
                continue
            if record is None or record.get("status") not in RUNNING:
                log.warning("job %s: no longer running: not resumed", job_id)
                return
            try:
                job = await self._ensure_job(job_id, resumed=True)
            except Exception as exc:
                log.error("job %s: not resumed after the restart (%s): tried again in %.0f s", job_id, exc, delay)
                continue
            self._start_resumed(job_id, job)
            return

    def _start_resumed(self, job_id: str, job: JobRunner | None) -> str | None:
        if job is None or job_id in self._stopped:
            return None  # the controller does not run it (any more)
        if job._task is None:
            job.start()
        log.warning("job %s: resumed at step %d after a request-manager restart", job.job_id, job.step)
        return job.job_id

    async def append_left_outboxes(self) -> int:
        """Queue what every job's event outbox still holds, under its message ids, each entry
        removed once stored; return how many events. A job this service runs is its runner's
        writer's (read once, not again); any other job, ended ones included, gets a writer here.
        Keys are found with SCAN in bounded batches; one that names no job, or whose outbox
        cannot be read, is logged and left, and the scan goes on.

        Raises:
            TransportError: a SCAN failed (the outboxes not reached stay for the next start).
        """
        found = 0
        async for key in outbox_keys(self.redis, Keys.rm_outbox_pattern(), batch=OUTBOX_SCAN_BATCH):
            found += await self._append_outbox(key)
        return found

    async def _append_outbox(self, key: bytes | str) -> int:
        job_id = Keys.job_of_rm_outbox(key)
        if job_id is None:
            log.error("key %r matches the outbox pattern but names no job: left as it is", key[:200])
            return 0
        if job_id in self._writers and self._writers[job_id].outbox_read:
            return 0  # its runner's writer has it queued already
        writer = self._writer_of(job_id)  # (new: a job this service does not run, an ended one)
        try:
            return await writer.recover()
        except TransportError as exc:
            log.error("job %s: the event outbox not read (%s): its events stay for the next start", job_id,
                      exc)
            return 0

    async def _on_probe(self, msg: ProbeRequest, _subject: str, reply: str | None) -> None:
        job = self.jobs.get(msg.job_id)
        phase = "generating" if job and job.generating else "idle"
        await self.bus.respond(reply, ProbeReply(member_id="request_manager", nonce=msg.nonce, phase=phase))

    def _route(self, fn: Any):  # type: ignore[no-untyped-def]
        async def handler(msg, _subject, _reply):  # type: ignore[no-untyped-def]
            job = self.jobs.get(msg.job_id)
            if job:
                fn(job, msg)
        return handler

    async def _on_turn(self, msg: TurnResult, _subject: str, _reply: str | None) -> None:
        job = self.jobs.get(msg.job_id)
        if job:
            await job.dispatcher.on_turn(msg)

    async def _on_batch_get(self, msg: BatchGet, _subject: str, reply: str | None) -> None:
        job = self.jobs.get(msg.job_id)
        batch = await (job.batches if job else BatchStore(self.redis, msg.job_id)).get(msg.step)  # type: ignore[arg-type]
        if not reply:
            return
        if batch is None:
            # Not ready: an empty answer at once, so the trainer goes back to waiting for the
            # BatchReady broadcast instead of sitting in a request timeout.
            await self.bus.respond(reply, BatchReady(job_id=msg.job_id, step=msg.step, episode_ids=[],
                                                     reward_mean=0.0))
            return
        await self.bus.respond(reply, BatchReady(job_id=batch.job_id, step=batch.step,
                                                 episode_ids=batch.episode_ids, reward_mean=batch.reward_mean,
                                                 timings=batch.timings))

    async def _ensure_job(self, job_id: str, start_step: int | None = None, resumed: bool = False) -> JobRunner | None:
        """The job's runner, made if there is none (its spec asked of the controller); None when the
        controller sends no spec, or the job was stopped (also while this ran: a stop landing
        during the restart scan left a runner made after it, its events after the final one)."""
        lock = self._creating.setdefault(job_id, asyncio.Lock())
        async with lock:  # a resume command and the restart scan must not create two runners
            job = self.jobs.get(job_id)
            if job:
                return job
            if job_id in self._stopped:
                return None
            if job_id in self._stopping:
                # Stopped and run again (a job id reused) while its old runner still ends: none
                # made now (never two runners of one job), and the resume not acknowledged (the
                # controller sends it again). Waited for here, it held every job's commands.
                log.warning("job %s: its runner is still stopping: no new one yet", job_id)
                return None
            reply = None
            for _ in range(SPEC_ATTEMPTS if resumed else 1):
                try:
                    reply = await self.bus.request(subject(job_id, Verb.SPEC),
                                                   SpecRequest(job_id=job_id, member_id="request_manager"),
                                                   SpecReply, timeout=SPEC_TIMEOUT_S)
                    break
                except RequestTimeout:
                    continue
            if reply is None:
                log.warning("job %s: controller did not send the spec (not running there)", job_id)
                return None
            spec = JobSpec.parse(reply.spec)
            step = start_step if start_step is not None else (reply.resume_step or 0)
            floor = await self._resume_floor(job_id)
            if step < floor:
                # The controller's view lags (a commit it did not hear): a step at or before the
                # rollout GC's marker or the lineage's durable checkpoint was trained for good, and
                # generating it again left the job waiting for a commit that never came.
                log.warning("job %s: told to start at step %d, but steps before %d are trained and durable: "
                            "starting at %d", job_id, step, floor, floor)
                step = floor
            if job_id in self._stopped:
                log.warning("job %s: stopped while its runner was being made: none made", job_id)
                return None
            job = self.jobs[job_id] = JobRunner(self.bus, self.redis, job_id, spec, step)
            job.events = self._writers.setdefault(job_id, job.events)  # (``self._writers``)
            job.gang_epoch = reply.epoch
            return job

    async def _resume_floor(self, job_id: str) -> int:
        """The first step of ``job_id`` that may still need generating: after the newest one whose
        rollout state was collected and after the newest durable checkpoint (raw Redis).

        Raises:
            TransportError: Redis failed.
        """
        collected = await RolloutGC(self.redis, job_id).collected()  # type: ignore[arg-type]
        gang = await read_gang(self.redis, job_id)  # type: ignore[arg-type]
        return max(collected, gang.durable) + 1

    async def _on_control(self, msg: ControlCommand, _subject: str, reply: str | None) -> None:
        floor = await fence_floor(self.redis, self._fence.get(msg.job_id, 0), "request manager")
        if msg.fence < floor:
            # From a deposed controller (one leader at a time, under a lease): not acted on, not
            # acknowledged. The floor is the newest lease term's token, read from Redis: a request
            # manager restarted since the leader's last command has seen no token of its own.
            log.warning("job %s: %s refused: fencing token %d is older than %d", msg.job_id, msg.action,
                        msg.fence, floor)
            return
        self._fence[msg.job_id] = msg.fence
        job = self.jobs.get(msg.job_id)
        if msg.action == "resume":
            self._stopped.discard(msg.job_id)  # (the controller runs it again: a job id reused)
            job = await self._ensure_job(msg.job_id, msg.args.get("start_step"))
            if job is None:
                # The controller's spec did not come (it is busy reading the job's log, or the bus
                # is slow): not acknowledged, so the controller sends the resume again; an
                # acknowledgement here would end what it owes with nothing resumed.
                log.warning("job %s: resume not carried out (no spec, or its old runner still stopping): not acknowledged",
                            msg.job_id)
                return
            if job:
                job.paused = False
                job.restarted_for = None
                job.committed = max(job.committed, int(msg.args.get("committed", job.committed)))
                for mid in msg.args.get("replicas_dead", []):
                    job.dispatcher.replica_dead(mid)
                if job._task is None:
                    job.start()
                job.changed.set()
        elif msg.action == "stop":
            self._stopped.add(msg.job_id)
            if job is not None:
                self.jobs.pop(msg.job_id, None)
                self._ending.append(job)  # (here: ``close`` may cancel the stop before it runs)
            # Off this handler: the runner's tasks end within up to STOP_ATTEMPTS x STOP_WAIT_S
            # each (45 s for one that swallows its cancellations), and every job's commands come
            # through this one subscription, one at a time: another job's restart or replica_dead
            # waited for this stop (an outside review).
            self._stopping[msg.job_id] = self._spawn(
                self._stop_job(msg, reply, job, self._stopping.get(msg.job_id)))
            return
        elif job is None:
            # No runner (a restarted request manager whose spec has not come yet): the command is
            # carried out on a runner made now, or not acknowledged, so the controller sends it
            # again. Acknowledged with nothing done, a restart_step restarted nothing and a
            # replica_dead re-dispatched nothing, with no work_lost (an outside review found it).
            job = await self._ensure_job(msg.job_id)
            if job is None:
                log.warning("job %s: %s not carried out (no spec, or its old runner still stopping): not acknowledged",
                            msg.job_id, msg.action)
                return
            await self._carry_out(job, msg)
            if job._task is None:
                job.start()  # the registry runs it (the controller sends commands for running jobs)
        else:
            await self._carry_out(job, msg)
        if reply:
            await self.bus.respond(reply, msg)

    async def _carry_out(self, job: JobRunner, msg: ControlCommand) -> None:
        """A command other than ``resume`` for a job this service runs."""
        if msg.action == "replica_dead":
            fault_id, member_id = msg.args.get("fault_id"), str(msg.args["member_id"])
            done = job.dead_for.get(member_id)
            if done is not None and done[0] == fault_id and done[2]:
                log.info("job %s: replica %s dead for %s again (a retry): already done", msg.job_id, member_id,
                         fault_id)
            else:
                # (a retry whose first try re-dispatched the turns but could not record its event
                # re-dispatches nothing more and records the first try's count)
                n = done[1] if done is not None and done[0] == fault_id else job.dispatcher.replica_dead(member_id,
                                                                                                     fault_id)
                job.dead_for[member_id] = (fault_id, n, False)
                # The tokens regenerated are counted when the turns are generated again
                # (turn_regenerated events carry this fault id and the real token counts). In the
                # outbox before the acknowledgement, in the log after it: the controller waits for
                # the acknowledgement, not for the event log.
                # (one per replica: a fault can declare several dead, a gang recovery borrowing two)
                await job.events.emit("work_lost", {"fault_id": fault_id, "turns": n, "tokens": 0,
                                                    "steps_redone": 0}, per=member_id)
                job.dead_for[member_id] = (fault_id, n, True)
                log.warning("job %s: replica %s dead, %d turns re-dispatched", msg.job_id, member_id, n)
        elif msg.action == "restart_step":
            await job.restart_step(msg.args.get("fault_id"))
        elif msg.action == "pause":
            job.paused = True
        elif msg.action == "tool_outage":
            job.tools.set_outage(time.monotonic() + float(msg.args.get("duration_s", 5.0)))

    async def _stop_job(self, msg: ControlCommand, reply: str | None, job: JobRunner | None,
                        before: asyncio.Task[None] | None = None) -> None:
        """End a stopped job's runner, then (asked with a reply) acknowledge the stop once the
        job's events are in its log (bounded): the controller appends the final event next. A
        stop sent again waits for the one ``before`` it (``_stopping`` names the last one only)."""
        try:
            if before is not None:
                await asyncio.wait([before])
            if job is not None:
                await job.stop()
                if job in self._ending:
                    self._ending.remove(job)
            if reply:
                await self._ack_when_drained(msg, reply, job)
        finally:
            if self._stopping.get(msg.job_id) is asyncio.current_task():
                del self._stopping[msg.job_id]

    async def _ack_when_drained(self, msg: ControlCommand, reply: str, job: JobRunner | None = None) -> None:
        """Acknowledge a stop once the job's events are stored, within ``STOP_DRAIN_S``: what this
        life queued and what a previous life left in the outbox (a restarted request manager
        whose runner never read it: an outside review found the stop acknowledged at once, the
        killed life's events appended after the final one)."""
        began = time.monotonic()

        def left() -> float:  # (the whole of it within STOP_DRAIN_S: the controller waits that + 2 s)
            return max(0.0, STOP_DRAIN_S - (time.monotonic() - began))

        writer = self._writer_of(msg.job_id)
        try:
            if job is not None:  # late and refused replies counted or still being saved: to the writer first
                await job.dispatcher.settle_events(STOP_DRAIN_S / 2)
            try:
                await within(writer.recover(), left())
            except (TransportError, TimeoutError) as exc:
                log.error("job %s: the event outbox not read at the stop (%s): what it holds follows the final event",
                          msg.job_id, exc)
            if not await writer.drain(left()):
                log.error("job %s: stopped with %d events not in its log yet (JetStream away): acknowledged all "
                          "the same, they follow the final event", msg.job_id, writer.pending)
        finally:  # (cancelled at the service's close too: the controller is not left to its timeout)
            try:
                await self.bus.respond(reply, msg)
            except Exception as exc:  # noqa: BLE001 - unacknowledged, the controller goes on after its timeout
                log.warning("job %s: stop not acknowledged: %s", msg.job_id, exc)

    def _writer_of(self, job_id: str) -> EventWriter:
        """The job's one event writer for this service's life (made on first use)."""
        writer = self._writers.get(job_id)
        if writer is None:
            writer = self._writers[job_id] = EventWriter(self.bus, job_id, self.redis)
        return writer

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        self._tasks = [t for t in self._tasks if not t.done()]
        self._tasks.append(task := asyncio.create_task(coro))
        return task

    async def metrics_loop(self, interval: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            for job in list(self.jobs.values()):
                self._seq += 1
                try:
                    await self.bus.publish(subject(job.job_id, Verb.METRICS, "request_manager"),
                                           job.sample(self._seq))
                except Exception as exc:
                    log.debug("metrics: %s", exc)
            await wait_event(stop, interval)
