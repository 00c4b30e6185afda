"""Batching: assembling each step from its episodes, handing the batch to the trainer, bounding the
step, and deleting rollout state the trainer can no longer need.

The one home of the step rules:

* a step's episodes run under one task group: when one fails, every sibling is cancelled *and
  awaited* before the step is retried, so no episode ever has two runs; the retry continues each
  episode from its saved record (finished ones are kept);
* a step that was handed over before (request-manager restart) is handed over again, not generated;
* a step not handed over within ``detector.step_deadline_s`` is a fault naming what it waits for
  (turns on a replica, a weights version, tools), reported again each further deadline;
* once checkpoint D is durable, every rollout key of the steps up to the durable checkpoint heard
  before D is deleted (episodes, prefixes, dispatches, batch, fence, trained-log entries): Redis
  holds only what recovery can still need, a resume from the checkpoint before D included (D
  failing its verification).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from robustrl.services.request_manager.dispatch import Dispatcher
from robustrl.services.request_manager.episodes import EpisodeRunner
from robustrl.services.request_manager.eventlog import EventWriter
from robustrl.services.request_manager.faults import report_deadline

from robustrl.aio import cancel_and_wait, wait_event
from robustrl.bus import Bus
from robustrl.config import JobSpec
from robustrl.errors import StorageError, Superseded, TransportError
from robustrl.member import trainer_epoch
from robustrl.messages import BatchReady, MemberHello, MetricsSample, StepCommitted, WeightsAnnounce, decode
from robustrl.storage.control_stores import Guarded
from robustrl.storage.fencing import read_gang
from robustrl.storage.redis_stores import (
    BatchRecord,
    BatchStore,
    DispatchStore,
    EpisodeRecord,
    EpisodeStore,
    Guard,
    RolloutGC,
    WeightsPointer,
)
from robustrl.subjects import Verb, subject

log = logging.getLogger(__name__)
STEP_RETRY_S = 1.0
"""Pause before a failed step (Redis or NATS trouble) is tried again from the saved records."""
WAIT_WAKE_S = 1.0
STOP_WAIT_S = 5.0
"""How long a cancelled task of a job is waited for, per cancellation."""
STOP_ATTEMPTS = 3
"""Cancellations of a job's task before it is given up on."""
COMMIT_RECHECK_S = 5.0
"""While waiting for a commit, how often the trained log in Redis is read in case a commit
message was lost."""


def _gang_of(member_id: str) -> int:
    """The gang epoch in a trainer member's id; a large number for an id of another shape (never
    taken for an older gang's)."""
    epoch = trainer_epoch(member_id)
    return epoch if epoch is not None else 1 << 62


def _cancelled(task: asyncio.Task[None] | None) -> None:
    """Cancel ``task`` if there is one (the step watch, which awaits nothing of the caller's)."""
    if task is not None:
        task.cancel()


@dataclass
class _CommitClock:
    """The commit deadline of one wait (``JobRunner._commit_overdue``): since when the gang has
    waited for a batch already handed over with no progress, what its progress was then (the
    newest gang's hello, its newest commit heard), and how many reports were made since."""

    since: float
    progress: tuple[float | None, float | None]
    reports: int = 0


def _announcement(batch: BatchRecord) -> BatchReady:
    """The hand-over message of a stored (or about to be stored) batch."""
    return BatchReady(job_id=batch.job_id, step=batch.step, episode_ids=batch.episode_ids,
                      reward_mean=batch.reward_mean, timings=batch.timings)


class JobRunner:
    """Drives one job's steps on the request-manager side."""

    def __init__(self, bus: Bus, redis: object, job_id: str, spec: JobSpec, start_step: int) -> None:
        self.bus = bus
        self.redis = redis
        self.job_id = job_id
        self.spec = spec
        self.store = EpisodeStore(redis, job_id)  # type: ignore[arg-type]
        self.dispatches = DispatchStore(redis, job_id)  # type: ignore[arg-type]
        self.batches = BatchStore(redis, job_id)  # type: ignore[arg-type]
        self.gc = RolloutGC(redis, job_id)  # type: ignore[arg-type]
        self.dispatcher = Dispatcher(bus, job_id, spec, self.dispatches)
        self._events = EventWriter(bus, job_id, redis)  # the control handler's events: it never waits on the log
        self.dispatcher.events = self._events
        self.episodes = EpisodeRunner(bus, job_id, spec, self.store, self.dispatches, self.dispatcher)
        self.dispatcher.vocab_size = self.episodes.tok.vocab_size
        self.step = start_step
        self.committed = start_step - 1
        self.durable = -1
        self.durable_before = -1
        """The durable checkpoint heard before ``durable`` (-1: none): the rollout GC's bound."""
        self.trainer_version = -1
        self.gang_epoch = 0  # newest trainer gang heard from: commits of older gangs are stale
        self.step_epoch = 0  # bumped by restart_step: in-flight work of older epochs is discarded
        self.first_of_life = True  # this runner's first step: found started in Redis = a resume
        self._move_restart_count = True
        """The next step attempt moves the step-restart count on first: this runner's first (a new
        life), and the retry of a failed attempt."""
        self.paused = False
        self.dead_for: dict[str, tuple[str | None, int, bool]] = {}
        """replica -> (fault of the replica_dead handled, turns re-dispatched, its event in the outbox)"""
        self.restarted_for: str | None = None  # fault of the restart_step not yet followed by a resume
        self._restart_unlogged: dict[str, object] | None = None  # its work_lost, until in the outbox
        self.changed = self.dispatcher.changed
        self._task: asyncio.Task[None] | None = None
        self._step_task: asyncio.Task[BatchReady] | None = None
        self._gc_task: asyncio.Task[None] | None = None
        self._current: list[EpisodeRecord] = []
        self._started_once = start_step > 0
        self._step_failures = 0  # attempts at the current step that failed (``run``)
        self._step_error = ""  # the last one's error, for the step deadline's report
        self._step_failed_at = 0.0  # when (monotonic)
        self._first_failed_at = 0.0  # the first of them (monotonic)
        self._startup_ended: float | None = None  # when the job's first step began (monotonic), if
        # no attempt at it had failed before: the step deadline of that step counts from there
        self._trainers: dict[str, tuple[float, str, int]] = {}
        """trainer member -> (when heard (monotonic), its phase, its step), from its metrics"""
        self._gang_heard_at: float | None = None  # the newest gang's first hello (monotonic)
        self._commit_heard_at: float | None = None  # the current gang's newest commit, of any step
        # (a recovered gang redoing steps already committed makes progress too) (monotonic)
        self._commit_report: asyncio.Task[None] | None = None  # the commit deadline's report

    @property
    def events(self) -> EventWriter:
        """The job's event writer (its outbox), shared by the control handler, the steps and the
        dispatcher."""
        return self._events

    @events.setter
    def events(self, writer: EventWriter) -> None:
        self._events = self.dispatcher.events = writer

    @property
    def tools(self):  # type: ignore[no-untyped-def]
        return self.episodes.tools

    @property
    def generating(self) -> int:
        return self.episodes.generating

    # --- what the trainer and members say --------------------------------------------------

    def on_hello(self, msg: MemberHello) -> None:
        if msg.role == "trainer" and msg.epoch >= self.gang_epoch:
            newer = msg.epoch > self.gang_epoch or self._gang_heard_at is None
            if newer:
                self._gang_heard_at = time.monotonic()  # a new gang: the commit deadline runs anew
            self.gang_epoch = msg.epoch
            if msg.resume_step is not None:  # a gang resumes after its newest durable checkpoint
                # ... holding (and having announced) version resume_step: what it made so far
                self.dispatcher.trainer_made(msg.resume_step, msg.epoch)
                self._durable(msg.resume_step - 1)
                # ... so every step before it was committed, whether or not its commit message
                # came (a rank killed between recording a step and announcing it): else the wait
                # for that commit never ended (the trained-log recheck reads this gang's entries
                # only), and the new gang waited for a batch never generated.
                if msg.resume_step - 1 > self.committed:
                    log.warning("job %s: gang %d resumed at step %d: steps up to %d committed (%d heard)",
                                self.job_id, msg.epoch, msg.resume_step, msg.resume_step - 1, self.committed)
                    self.committed = msg.resume_step - 1
                    self.changed.set()
        self.dispatcher.on_hello(msg)

    def on_metrics(self, msg: MetricsSample) -> None:
        if msg.role == "trainer":
            # what each trainer member last said (the commit deadline names one, with its phase)
            self._trainers[msg.member_id] = (time.monotonic(), msg.phase, msg.step)
        self.dispatcher.on_metrics(msg)

    def on_commit(self, msg: StepCommitted) -> None:
        if msg.epoch < self.gang_epoch:
            # An old gang still running after its replacement said hello (it is being stopped):
            # its steps are not this lineage's and must not move the job on.
            log.warning("ignoring step %d committed by stale gang %d (current gang %d)",
                        msg.step, msg.epoch, self.gang_epoch)
            return
        self.gang_epoch = msg.epoch
        self._commit_heard_at = time.monotonic()
        self.committed = max(self.committed, msg.step)
        self.trainer_version = max(self.trainer_version, msg.weights_version)
        self.dispatcher.trainer_made(msg.weights_version, msg.epoch)
        self._durable(msg.durable_step)
        self.changed.set()

    # --- garbage collection ----------------------------------------------------------------

    def _durable(self, step: int) -> None:
        if step > self.durable:
            self.durable_before, self.durable = self.durable, step
            if self._task is not None and (self._gc_task is None or self._gc_task.done()):
                self._gc_task = asyncio.get_running_loop().create_task(self._collect())

    async def _collect(self) -> None:
        """Delete rollout state of every step the checkpoint before the newest durable one has
        consumed. One checkpoint's steps more are kept: the newest checkpoint may fail its
        verification when a new gang loads it (a rotted blob), and the gang then resumes from the
        one before it and redoes the steps in between from their batches. Collected up to the
        newest, those batches were gone: ``CheckpointLost`` at every resume, and the job failed."""
        try:
            done = await self.gc.collected()
            while done < min(self.durable_before, self.committed, self.step - 1):
                done += 1
                n = await self.gc.collect(done)
                log.debug("job %s: step %d collected (%d episodes)", self.job_id, done, n)
        except Exception as exc:  # the next durable step tries again
            log.warning("job %s: rollout GC failed: %s", self.job_id, exc)

    # --- steps -----------------------------------------------------------------------------

    async def run_step(self, step: int, epoch: int | None = None) -> BatchReady:
        """Generate every episode of ``step``; hand the batch over (stored first, then announced).
        ``epoch``: the ``step_epoch`` the attempt was begun under (``run``)."""
        if self._move_restart_count:
            # A new life moves the restart count on too: a write of an earlier life's that the
            # server runs after this writes nothing (the look at what the step holds comes next).
            # So does the retry of a failed attempt: a write of the attempt's (a cancelled
            # sibling's, on its way) that the server ran after the retry finished its episode put
            # the episode back to what the attempt had left, unscored, under a handed batch.
            await self.batches.restarted()
            self._move_restart_count = False
        # The restart count the step begins under: its episodes and its hand-over are written
        # only while it holds (one sent before a restart_step and run late by the server, after
        # the restart cleared the step, writes nothing).
        guard = self.store.guard = self.dispatches.guard = await self.batches.restart_guard()
        if epoch is not None and epoch != self.step_epoch:
            # a restart_step came before the count was read (it may be the restart's own count):
            # nothing of this attempt may be written
            raise Superseded(f"step {step}'s attempt of epoch {epoch} overtaken by a restart ({self.step_epoch})")
        handed = await self.batches.get(step)
        if handed is not None:
            # Handed over before this life (or before a retry): announce it again, generate nothing;
            # its event again too, under the same message id (the life that handed it over may have
            # died before the event reached the outbox).
            ready = _announcement(handed)
            await self.bus.publish(subject(self.job_id, Verb.BATCH), ready)
            await self._batch_event(ready)
            return ready
        return await self._generate_step(step, time.monotonic(), guard)

    async def _generate_step(self, step: int, t0: float, guard: Guard) -> BatchReady:
        timing = {"tool_wait_s": 0.0}
        started = bool(await self.store.step_episode_ids(step))
        # The job's very first step starts once its members are up: start-up is the same for
        # every recovery policy and is reported apart (job_ready), not as lost training time.
        first = step == 0 and self.step_epoch == 0 and not self._started_once and not started
        if not first and not started:
            await self.events.emit("step_started", {"step": step, "epoch": self.step_epoch})
        # Sync/semi-sync: serving replicas must hold an allowed version before the turns go out.
        await self.dispatcher.wait_version(step)
        weight_sync_s = time.monotonic() - t0
        if first:
            await self.events.emit("job_ready", {"startup_s": weight_sync_s})
            await self.events.emit("step_started", {"step": step, "epoch": self.step_epoch})
            t0, weight_sync_s = time.monotonic(), 0.0
        if not self._started_once:
            self._started_once = True
            self._startup_ended = time.monotonic()
        eps, resumed = await self.episodes.make_episodes(step)
        self._current = eps
        todo = [ep for ep in eps if ep.status != "finished"]
        self.dispatcher.load_adoptable(await self.dispatches.all(), {ep.episode_id for ep in todo})
        if resumed and self.first_of_life:
            # A new life of the request manager found the step under way: it continues it.
            await self.events.emit("rm_resumed", {
                "step": step, "finished": len(eps) - len(todo), "unfinished": len(todo),
                "dispatched": len(self.dispatcher.adoptable)})
        self.first_of_life = False
        # One task group: a failing episode cancels and awaits its siblings before the step fails.
        async with asyncio.TaskGroup() as group:
            for ep in todo:
                group.create_task(self.episodes.run(ep, step, timing))
        self.episodes.finished.clear()
        return await self._hand_over(step, eps, t0, weight_sync_s, timing, guard)

    async def _hand_over(self, step: int, eps: list[EpisodeRecord], t0: float, weight_sync_s: float,
                         timing: dict[str, float], guard: Guard) -> BatchReady:
        rewards = [ep.reward or 0.0 for ep in eps]
        wall = time.monotonic() - t0
        n = max(1, len(eps))
        # Episodes overlap, so per-episode tool wait is averaged to give the step's share.
        rollout_s = wall - weight_sync_s
        timings = {"rollout_s": rollout_s, "tool_wait_s": timing["tool_wait_s"] / n,
                   "generation_s": max(0.0, rollout_s - timing["tool_wait_s"] / n), "weight_sync_s": weight_sync_s}
        batch = BatchRecord(job_id=self.job_id, step=step, episode_ids=[e.episode_id for e in eps],
                            reward_mean=statistics.fmean(rewards), timings=timings)
        ready = _announcement(batch)
        # The batch and its event in one transaction: killed between two writes, a request
        # manager left the batch stored without its event, and a next life resuming after the
        # step (trained meanwhile) never said it (an outside review). Guarded by the restart
        # count: a restart_step that came meanwhile has decided the step (``restart_step``).
        await self._batch_event(ready, Guarded(guard, lambda pipe: self.batches.put_in(pipe, batch)))
        await self.bus.publish(subject(self.job_id, Verb.BATCH), ready)
        return ready

    async def _batch_event(self, ready: BatchReady, with_writes: Guarded | None = None) -> None:
        """The hand-over's ``batch_ready``, through the outbox (a request manager killed while
        JetStream was away lost it from memory, and its next life, finding the batch handed,
        never said it: an outside review found it), under a message id of the batch's own: the
        same batch announced again is stored once (within the duplicate window), a step restarted
        and handed over anew is a new batch. The episode ids alone do not tell those apart (they
        are the step's, the same in every generation of it): the key also covers the batch
        record's reward and timings, read back as stored by a later announcement. ``with_writes``:
        the batch's own write, in the event's transaction."""
        what = json.dumps([ready.episode_ids, ready.reward_mean, sorted(ready.timings.items())])
        digest = hashlib.sha256(what.encode()).hexdigest()[:16]
        await self.events.emit("batch_ready", {"step": ready.step, "reward_mean": ready.reward_mean,
                                               **ready.timings},
                               msg_id=f"{self.job_id}-batch_ready-{ready.step}-{digest}", with_writes=with_writes)

    async def _watch(self, step: int, first_attempt: float) -> None:
        """Report the step each time ``step_deadline_s`` passes without its batch handed over,
        counted from the step's first attempt (``first_attempt``, monotonic). One watch spans every
        attempt at the step (``run``): an attempt failing faster than the deadline, again and
        again, is reported too (a watch per attempt restarted its clock at each, and such a step
        was retried forever with no fault; an outside review found it).

        The job's start-up (members starting before its first step) is not part of a step: the
        first step's clock starts when it begins. An attempt that fails before then ends the
        start-up: the clock counts from that first failure (the watch waited for the first step to
        begin, so a first step whose attempts all failed before it began was never reported; and
        counted from the first attempt, one blip during a start-up longer than the deadline
        reported a step that had not begun)."""
        bound = self.spec.detector.step_deadline_s
        after_first = self._started_once  # a later step (or a restarted one): no start-up in it
        await self._wait(lambda: self._started_once or self._step_failures > 0)
        if after_first:
            began = first_attempt
        elif self._startup_ended is not None:
            began = self._startup_ended
        else:
            began = self._first_failed_at
        due = began + bound
        while True:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            if not after_first:
                if self._startup_ended is not None and self._startup_ended > began:
                    # An attempt failed during the start-up and a later one began the step: its
                    # clock runs from there (the start-up is still no part of it).
                    began = self._startup_ended
                    due = began + bound
                    continue
                if not self._started_once and time.monotonic() - self._step_failed_at >= bound:
                    # Not begun, and no attempt failed this period: the attempt in flight waits in
                    # the start-up (members loading weights), which is no step time. Counted from
                    # the first attempt, one failure during a start-up longer than the deadline
                    # reported a step that had not begun (an outside review found it).
                    due = time.monotonic() + bound
                    continue
            due = max(due, time.monotonic()) + bound  # a report each further period (none bunched)
            since = time.time() - (time.monotonic() - began)
            role, member, kind, what = self._stuck_on(step)
            if self._step_failures:
                what = f"{self._step_failures} attempts failed, the last with {self._step_error}; {what}"
                if time.monotonic() - self._step_failed_at < bound:
                    # Failing now (an attempt failed within this period): the request manager's
                    # own trouble, whatever the attempt in flight waits for. An older failure only
                    # goes into the evidence: a later attempt stuck on a replica blames it.
                    role, member, kind = "request_manager", "request_manager", "hang"
            await report_deadline(self.bus, self.job_id, role=role, member_id=member, kind=kind,  # type: ignore[arg-type]
                                  cause="step_deadline", step=step, since=since,
                                  evidence=f"step {step} not handed over after {time.monotonic() - began:.1f}s "
                                           f"(step_deadline_s={bound:g}): {what}",
                                  events=self.events)

    def _stuck_on(self, step: int) -> tuple[str, str, str, str]:
        """(role, member, kind, what) of the work a stuck step still waits for."""
        d = self.dispatcher
        open_eps = sum(1 for e in self._current if e.status != "finished")
        owners = Counter(p.member_id for p in d.pending.values())
        if owners:
            member, n = owners.most_common(1)[0]
            what = f"{n} turns outstanding on {member} ({open_eps} episodes open)"
            refused = [p for p in d.pending.values() if p.member_id == member and p.refused]
            if refused:
                what += f"; {len(refused)} of them refused by it ({refused[0].refused[:200]!r})"
                ready = {r.member_id for r in d.ready(step)}
                if len(refused) == n and all(ready <= p.avoid | {p.member_id} for p in refused):
                    # Every ready replica refused these turns: an input no engine takes, not a
                    # replica to replace (blamed, healthy replicas were replaced one by one).
                    return ("request_manager", "request_manager", "hang",
                            f"{what}: every ready replica refused them (an input no engine takes)")
            return "rollout", member, "hang", what
        need = d.min_version(step)
        lagging = sorted(r.member_id for r in d.replicas.values() if d.live(r) and r.version < need)
        if lagging and not d.ready(step):
            return "rollout", lagging[0], "hang", f"no live replica holds v{need}; {lagging} lack it"
        if self.episodes.tool_waiting:
            return ("request_manager", "request_manager", "tool_outage",
                    f"{self.episodes.tool_waiting} episodes waiting for tools")
        what = f"no live replica holds v{need}" if not d.ready(step) else f"{open_eps} episodes open"
        return "request_manager", "request_manager", "hang", what

    async def _wait(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            self.changed.clear()
            await wait_event(self.changed, WAIT_WAKE_S)

    async def _seed_made(self) -> None:
        """A new life has heard nothing of the trainer: the weights deadline learns the version the
        current gang announced last from the fenced weights pointer (only a gang's fenced write
        sets it; a rollback's new gang sets it to its own). Without it nothing would be known made
        until the gang's next commit, and no replica could be reported late meanwhile."""
        try:
            raw = await WeightsPointer(self.redis, self.job_id).get()  # type: ignore[arg-type]
            if raw is not None:
                ann = decode(WeightsAnnounce, raw)
                self.dispatcher.trainer_made(ann.version, ann.epoch)
        except Exception as exc:  # noqa: BLE001 - known again from the next commit
            log.warning("job %s: the weights pointer not read (%s): versions known from the next commit",
                        self.job_id, exc)

    async def _wait_committed(self, needed: int) -> None:
        """Wait until step ``needed`` is committed (and the job not paused). Commit messages travel
        on core NATS, which drops what is published while this process is disconnected: every
        ``COMMIT_RECHECK_S`` of waiting, the trained log in Redis is read instead, so a lost commit
        message costs seconds, not the job (nothing else would notice: the trainer waits for the
        next batch, which is its normal idleness).

        The wait is bounded (``detector.commit_deadline_s``, ``_commit_overdue``): a trainer gang
        that takes no batch and commits nothing (waiting for a batch already handed over is its
        normal idleness to the detector) is reported, and its recovery ends the wait."""
        waited_since = time.monotonic()
        clock = _CommitClock(time.monotonic(), (self._gang_heard_at, self._commit_heard_at))
        while not (self.committed >= needed and not self.paused):
            if self.committed < needed:
                await self._commit_overdue(needed, clock)
            if self.committed < needed and time.monotonic() - waited_since >= COMMIT_RECHECK_S:
                waited_since = time.monotonic()
                # (a step at or before the lineage's durable checkpoint is trained for good,
                # whichever gang's entries the log's tail holds) Each read on its own: one failing
                # must not lose what the other says.
                trained = -1
                for what, read in (("trained log", lambda: self.batches.newest_trained(self.gang_epoch)),
                                   ("gang record", lambda: self._durable_of_gang())):
                    try:
                        trained = max(trained, await read())
                    except (TransportError, StorageError) as exc:
                        log.warning("job %s: %s not read: %s", self.job_id, what, exc)
                if trained > self.committed:
                    log.warning("job %s: commits up to step %d were not heard; the trained log has them",
                                self.job_id, trained)
                    self.committed = trained
                    self.dispatcher.trainer_made(trained + 1, self.gang_epoch)  # (its version exists)
                    continue
            self.changed.clear()
            await wait_event(self.changed, WAIT_WAKE_S)

    async def _durable_of_gang(self) -> int:
        return (await read_gang(self.redis, self.job_id)).durable  # type: ignore[arg-type]

    async def _commit_overdue(self, needed: int, clock: _CommitClock) -> None:
        """Report the trainer gang once it has waited ``commit_deadline_s`` for a batch already
        handed over, with no progress (a commit of any step, a new gang's hello), and again each
        further period. The clock runs only while every trainer member heard within
        ``detector.silence_s`` says ``waiting_batch`` at a step already handed over: not while one
        is starting (a gang being formed: the controller's start and recovery deadlines bound it),
        training (a slow step is the detector's; an outside review found a busy gang reported),
        silent (the detector's silence rule), nor while the job is paused. The report is published
        in the background: this wait never blocks on the bus."""
        now = time.monotonic()
        bound = self.spec.detector.commit_deadline_s
        # Members of an older gang (being stopped, or one whose kill failed) are not this wait's:
        # one still saying ``training`` held the clock, and one named was ignored as stale.
        fresh = [(at, m, phase, s) for m, (at, phase, s) in self._trainers.items()
                 if now - at <= self.spec.detector.silence_s and _gang_of(m) >= self.gang_epoch]
        waiting = bool(fresh) and all(phase == "waiting_batch" and 0 <= s < self.step for _, _, phase, s in fresh)
        progress = (self._gang_heard_at, self._commit_heard_at)
        if self.paused or not waiting or progress != clock.progress:
            clock.since, clock.progress, clock.reports = now, progress, 0
            return
        if now - clock.since < bound * (clock.reports + 1):
            return
        if self._commit_report is not None and not self._commit_report.done():
            return  # the previous report still being published (the bus away): not bunched
        clock.reports += 1  # the next one a further period on
        at, member, phase, s = max(fresh)
        evidence = (f"step {needed} handed over, the gang waiting for batch {s} for {now - clock.since:.1f}s "
                    f"(commit_deadline_s={bound:g}; committed up to {self.committed}, gang {self.gang_epoch}): "
                    f"{member} says {phase} at step {s}")
        self._commit_report = asyncio.create_task(self._report_commit_overdue(
            member, needed, time.time() - (now - clock.since), evidence))

    async def _report_commit_overdue(self, member: str, needed: int, since: float, evidence: str) -> None:
        try:
            await report_deadline(self.bus, self.job_id, role="trainer", member_id=member, kind="hang",
                                  cause="commit_deadline", step=needed, since=since, evidence=evidence,
                                  events=self.events)
        except Exception as exc:  # (the next period reports again)
            log.error("job %s: commit deadline of step %d not reported: %s", self.job_id, needed, exc)

    async def run(self) -> None:
        """Sync/semi-sync/async loop: step k starts once its weights are available (staleness bound)."""
        watch: asyncio.Task[None] | None = None  # the current step's deadline, from its first attempt
        watch_epoch = self.step_epoch  # (the restart count it was started under)
        try:
            try:  # events a previous request manager acknowledged and did not append: first
                await self.events.recover()
            except TransportError as exc:
                log.error("job %s: the event outbox not read (%s): its events stay for the next run", self.job_id, exc)
            await self._seed_made()
            while self.step < self.spec.steps:
                step = self.step
                # The trainer must have committed step k - 1 - staleness (bounded lag between rollout
                # and training); a trainer that stops committing is the detector's to report.
                await self._wait_committed(step - 1 - self.spec.staleness)
                if self.step != step:  # a restart_step moved on from a step handed over meanwhile
                    _cancelled(watch)
                    watch = None
                    continue
                if watch is not None and watch_epoch != self.step_epoch:
                    _cancelled(watch)  # a restart_step during a failed attempt's pause: a new first attempt
                    watch = None
                if watch is None:  # the step's first attempt (or its first since a restart_step)
                    watch, watch_epoch = asyncio.create_task(self._watch(step, time.monotonic())), self.step_epoch
                    self._step_failures, self._step_error, self._first_failed_at = 0, "", 0.0
                epoch = self.step_epoch
                self._step_task = asyncio.create_task(self.run_step(step, epoch))
                try:
                    await self._step_task
                except asyncio.CancelledError:
                    if self._task and self._task.cancelling():
                        raise
                    # restart_step: the same step again from scratch, its deadline too (not while
                    # the restart waits for the new members: that is the controller's recovery)
                    _cancelled(watch)
                    watch = None
                    continue
                except Exception as exc:
                    if self.step_epoch != epoch:
                        # A restart_step came during the attempt (a write of it refused as the
                        # restart count moved on: Superseded): the restart decides the step.
                        log.warning("job %s: step %d's attempt ended by a restart: %s", self.job_id, step, exc,
                                    exc_info=not isinstance(exc, Superseded))
                        _cancelled(watch)
                        watch = None
                        continue
                    # Redis or NATS trouble mid-step: every sibling has stopped; the episodes resume
                    # from their saved records.
                    self._step_failures += 1
                    self._move_restart_count = True  # the retry moves the restart count on first
                    self._step_failed_at = time.monotonic()
                    if self._step_failures == 1:
                        self._first_failed_at = self._step_failed_at
                    self._step_error = f"{type(exc).__name__}: {exc}"[:300]
                    log.exception("job %s: step %d failed (attempt %d); retrying from the saved records",
                                  self.job_id, step, self._step_failures)
                    await asyncio.sleep(STEP_RETRY_S)
                    continue
                # Handed over: the step's deadline ends here, not when the next step begins (the wait
                # for the trainer's commit in between is not this step's, and a trainer recovery
                # there was reported as this step stuck; an outside review found it).
                _cancelled(watch)
                watch = None
                if self.step_epoch != epoch:
                    continue  # a restart_step came as the step ended: it decided the step (handed)
                self.step += 1
        finally:
            _cancelled(watch)
        log.info("job %s: all %d steps generated", self.job_id, self.spec.steps)
        # The last batch's commit is waited for under the same deadline: a gang that never takes
        # it stalled the job's end, reported by nothing.
        await self._wait_committed(self.spec.steps - 1)

    async def restart_step(self, fault_id: str | None = None) -> None:
        """Whole-job restart: drop the current step's in-flight work and generate it from scratch.
        Its state change is in Redis when this returns; its ``work_lost`` event is appended in the
        background (the controller waits for the acknowledgement, not for the event log). The
        controller's retry of the same command (its acknowledgement lost), before the resume that
        follows it, changes nothing."""
        if fault_id is not None and self.paused and self.restarted_for == fault_id:
            log.info("job %s: restart_step for %s again (a retry): already done", self.job_id, fault_id)
            if self._restart_unlogged is not None:  # its event did not reach the outbox: now
                await self.events.emit("work_lost", self._restart_unlogged, per="restart")
                self._restart_unlogged = None
            return
        self.paused = True
        # At once, before any await: a step task that ends now is not counted handed by ``run``
        # (this decides the step), and the step's task is told to stop.
        self.step_epoch += 1
        if self._step_task is not None:
            self._step_task.cancel()
        # Then the restart count, before the look at what the step left: a write of the step
        # that the server runs after this (sent before the cancel took) writes nothing; a
        # hand-over it ran before is found below and kept.
        await self.batches.restarted()
        if not await cancel_and_wait(self._step_task, STOP_WAIT_S, STOP_ATTEMPTS):
            log.error("job %s: step %d's task did not end %d s after its cancellations", self.job_id, self.step,
                      STOP_ATTEMPTS * STOP_WAIT_S)
        self.dispatcher.reset()
        while self.step < self.spec.steps and (handed := await self.batches.get(self.step)) is not None:
            # Handed over before the cancel took (its batch and event stored together), or by an
            # earlier life, ahead of this runner's start (async: several steps ahead of the
            # trainer): the trainer may have taken and trained it. Deleted and generated again,
            # the trained record named episodes whose turns were no longer the ones trained (an
            # outside review). It stays as handed (its event given again under its own message id:
            # a cancel during the hand-over's write left it in the outbox, not queued); the step
            # restarted is the first not handed.
            log.warning("job %s: step %d was handed over as its restart came: kept", self.job_id, self.step)
            await self._batch_event(_announcement(handed))
            self.step += 1
            self._current = []
        ids = await self.store.step_episode_ids(self.step)
        # What is dropped: the assistant tokens saved in the restarted step's episode records (not
        # the episodes in memory: those of a step handed over and kept were charged as lost while
        # the request manager waited for its commit, and a new life that had made none charged
        # nothing; an outside review).
        lost = await self.store.assistant_tokens(ids)
        # The batch first (none is stored now, and none can land later: the restart count has
        # moved on): killed between the two, the episodes cleared first left a stored batch naming
        # episodes that no longer exist, which the next life announced again and the trainer
        # failed on (an outside review; untested: no test kills the request manager between
        # these writes).
        await self.batches.delete(self.step)
        await self.dispatches.forget(ids)
        n = await self.store.clear_step(self.step)
        self._current = []
        self.episodes.finished.clear()
        self.restarted_for = fault_id
        if fault_id:
            self._restart_unlogged = {"fault_id": fault_id, "tokens": lost, "steps_redone": 0, "episodes": n}
            await self.events.emit("work_lost", self._restart_unlogged, per="restart")
            self._restart_unlogged = None
        log.warning("job %s: step %d restarted from scratch (%d episodes dropped)", self.job_id, self.step, n)

    def start(self) -> None:
        self._task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        """Cancel the job's tasks, each waited for a bounded time: the control message that asked
        for the stop is answered, and the ones after it are handled, whatever a task does."""
        for task in (self._task, self._gc_task, self._commit_report):
            if not await cancel_and_wait(task, STOP_WAIT_S, STOP_ATTEMPTS):
                log.error("job %s: a task (%s) did not end %d s after its cancellations: left behind",
                          self.job_id, task.get_name() if task else None, STOP_ATTEMPTS * STOP_WAIT_S)

    def sample(self, seq: int) -> MetricsSample:
        d = self.dispatcher
        return MetricsSample(job_id=self.job_id, member_id="request_manager", role="request_manager", seq=seq,
                             ts=time.time(), phase="generating" if self.generating else "idle", step=self.step,
                             inflight=len(d.pending), queue_depth=d.waiting,
                             tool_waiting=self.episodes.tool_waiting,
                             episodes_outstanding=sum(1 for e in self._current if e.status != "finished"))
