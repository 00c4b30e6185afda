"""Turn dispatch: which replica generates an episode's next turn, and how long it may take.

The one home of the dispatch rules:

* a turn goes to the least-loaded *live* replica holding an allowed weights version (live: not
  declared dead, heard from within ``silence_s + probe_timeout_s``);
* every dispatched turn has a deadline (``detector.turn_deadline_s``); past it the turn is
  re-dispatched from the episode's saved prefix to another live replica, and a replica that lets
  ``TIMEOUTS_BEFORE_FAULT`` turns in a row pass their deadline is reported;
* a reply that parses but names tokens outside the model's vocabulary is refused and its turn is
  dispatched again at once if another replica can take it (else at its deadline); a replica with ``REFUSED_BEFORE_FAULT`` refused replies among its last
  ``REPLY_WINDOW`` is reported (``bad_output``), good replies in between notwithstanding;
* a turn a replica refuses (``TurnResult.refused``: it cannot decode it) is logged
  (``turn_refused``) and dispatched again at once if another replica can take it; the refusal is
  charged to its replica, as a refused reply, only once another replica decodes the turn;
* a replica declared dead, or silent past the liveness window, fails its turns at once;
* work is idempotent by (episode, turn number): a reply is applied only while its request is the
  episode's current one; a late reply for a turn already applied or re-dispatched is dropped
  (``turn_dropped`` event), never applied twice; one that came while its turn was pending
  nowhere (an attempt that failed let its turns go) is kept (``kept_for_adoption``): the retry's
  adoption of that turn applies it, once;
* each dispatch is recorded in Redis until its turn is applied, so a restarted request manager (or
  a retried step) *adopts* a turn whose replica still works on it instead of generating it again,
  and re-dispatches only turns with no live owner (owner gone, or idle with the reply lost);
* the wait for serving replicas to reach a step's weights version is bounded by
  ``detector.weights_load_s``; a replica still below it is reported and not waited for.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import time
import uuid
from collections import Counter, deque
from collections.abc import Collection, Coroutine
from dataclasses import dataclass, field
from typing import Any

from robustrl.services.request_manager.faults import report_deadline

from robustrl.aio import wait_event, within
from robustrl.bus import Bus
from robustrl.config import JobSpec
from robustrl.errors import RobustRLError, TransportError
from robustrl.event_queue import MAX_PENDING_EVENTS
from robustrl.messages import GenerateTurn, MemberHello, MetricsSample, TurnResult, WeightsHave
from robustrl.procs import monotonic_of
from robustrl.rl import tasks
from robustrl.storage.redis_stores import DispatchStore, EpisodeRecord
from robustrl.subjects import Verb, subject

log = logging.getLogger(__name__)

WAKE_S = 1.0
"""Longest sleep of a wait for replicas (liveness changes with time, not only with messages)."""
POLL_S = 0.5
"""How often a turn in flight checks that its owner is still live."""
LOGPROB_MAX = 1e-3
"""Largest behaviour logprob a reply may name (0 plus rounding); larger, or not finite, it is refused."""
ADOPT_WAIT_S = 2.0
"""How long a resumed step waits to hear from the owner of a turn dispatched before it resumed."""
UNCLAIMED_MAX = 4096
"""Replies kept that came for no pending turn (``Dispatcher.unclaimed``), the oldest dropped past it."""
MADE_KEPT = 64
"""Versions whose making time the weights deadline keeps (the newest; ``Dispatcher.made_since``)."""
TIMEOUTS_BEFORE_FAULT = 3
"""Turn deadlines passed in a row, with no reply in between, before a replica is reported."""
REFUSED_BEFORE_FAULT = 3
"""Refused replies among a replica's last ``REPLY_WINDOW`` before it is reported (``bad_output``):
a replica that answers well now and then never lets its turn deadlines pass in a row."""
REPLY_WINDOW = 10
RECONNECT_GRACE_S = 5.0
"""Turns sent within this long after this service's own NATS reconnect do not count against the
replica: it may still be reconnecting, and what was sent to it meanwhile is lost on the bus."""


MAX_EMITTING = 256
"""Events appended in the background at once by the turn handler (``Dispatcher._emit_later``)."""
EMIT_CONCURRENCY = 8
"""Of those, saving to the outbox at the same moment (the rest wait their turn): a flood of late
replies, each its own save, took every connection of the Redis client's pool (100), and the
request manager's own reads and writes failed with 'Too many connections'."""
DIAG_BURST = 128
"""Late and refused replies of a job logged one event each at once (a replica back from a
partition answers every turn it held: a step's turns at most); past it, ``DIAG_PER_S`` a second.
The rest are counted, by replica, and each kind's count logged as one event every
``DIAG_SUMMARY_S`` (``{"suppressed": n, "by_member": {...}}``). One event a reply, a replica
flooding replies while JetStream was away grew the job's Redis outbox without bound."""
DIAG_PER_S = 16.0
DIAG_SUMMARY_S = 5.0
DIAG_MEMBERS = 32
"""Replicas named in one count (ids are checked; a flood naming many is counted past these as
``"others"``)."""
DIAG_QUEUE_ROOM = MAX_PENDING_EVENTS // 2
"""Past this many of the job's events not stored yet, late and refused replies are counted only:
the rest of the writer's queue stays for the events accounting and recovery read."""


class Redispatch(RobustRLError):
    """The turn's replica was declared dead (or went silent): dispatch it again from the prefix."""

    retryable = True


class TurnTimeout(RobustRLError):
    """No reply within ``turn_deadline_s``."""

    retryable = True


@dataclass
class Replica:
    member_id: str
    version: int = -1
    checksum: str = ""
    inflight: set[str] = field(default_factory=set)
    alive: bool = True
    seen_at: float = field(default_factory=time.monotonic)
    busy: bool = True  # its last metrics showed work in flight or queued
    busy_at: float = 0.0  # when that sample was received (monotonic)
    timeouts: int = 0  # turn deadlines passed in a row with no reply in between
    reported: bool = False  # reported for timeouts; dispatched to only if nobody else can serve
    reported_version: int = -1  # reported for not reaching this version in time
    refused: deque[float | None] = field(default_factory=lambda: deque(maxlen=REPLY_WINDOW))
    """Its last replies: when each refused one came (wall clock), None for a good one."""
    reported_bad: bool = False  # reported for refused replies (for good: its replacement is asked for)


def _preferred(rep: Replica, avoid: Collection[str]) -> bool:
    """A replica ``pick`` gives a turn to before any other: not one the turn failed on, not one
    reported (``_another_takes`` asks the same of the replicas a refused turn could go to)."""
    return rep.member_id not in avoid and not rep.reported and not rep.reported_bad


@dataclass
class Pending:
    request_id: str
    episode_id: str
    turn: int
    member_id: str
    sent_at: float  # wall clock: dispatch records outlive the process
    future: asyncio.Future[TurnResult]
    adopted_at: float | None = None  # monotonic; set when taken over from a record in Redis
    clock_sent: float = 0.0
    """``sent_at`` on this process's monotonic clock, which the turn's deadline is judged by (on the
    wall clock, a step back of an hour held a turn with a live, silent owner for an hour)."""
    bus_disconnects: int = 0  # this service's NATS disconnects when it was sent (see _failed)
    sent_while_down: bool = False  # sent while this service's NATS connection was down
    min_version: int = 0  # the weights version the turn needs (its replica waits for it if behind)
    avoid: frozenset[str] = frozenset()  # replicas this turn already failed on (``generate``'s ``avoid``)
    refused: str = ""  # its replica refused it (``TurnResult.refused``: why, and its reason)

    def outlived_a_bus_outage(self, bus: Bus) -> bool:
        """This service's NATS connection went down since the turn was sent, or was down when it
        was sent (the client buffers it and sends it on the reconnect, often before the replica
        has subscribed again on the new server: lost; a NATS restart just as a step began lost
        every turn of the step, and each waited for its whole deadline)."""
        return self.sent_while_down or bus.disconnects != self.bus_disconnects


def _keep(kept: dict[str, Any], key: str, value: Any) -> None:
    """Keep ``value`` under ``key``, the oldest dropped past ``UNCLAIMED_MAX``."""
    kept[key] = value
    while len(kept) > UNCLAIMED_MAX:
        del kept[next(iter(kept))]


class Dispatcher:
    """Dispatch of one job's turns to its replicas."""

    def __init__(self, bus: Bus, job_id: str, spec: JobSpec, dispatches: DispatchStore) -> None:
        self.bus = bus
        self.job_id = job_id
        self.spec = spec
        self.records = dispatches
        self.replicas: dict[str, Replica] = {}
        self.dead: set[str] = set()  # member ids are per incarnation: a dead one never comes back
        self.dead_faults: dict[str, str] = {}  # dead member -> the fault it was declared dead for
        self.pending: dict[str, Pending] = {}
        self.adoptable: dict[str, dict[str, Any]] = {}  # episode id -> dispatch record of a past life
        self.unclaimed: dict[str, TurnResult] = {}
        """request id -> a reply that came while its turn was pending nowhere (a step attempt that
        failed had let its turns go; the retry adopts them from their dispatch records): the
        adopting turn takes it instead of waiting for a reply that has come and gone (and then
        generating the turn again once its replica is idle). Only a reply to a turn an attempt let
        go (``_let_go``: request id -> its replica and episode), once. In arrival order, ``UNCLAIMED_MAX``."""
        self._let_go: dict[str, tuple[str, str]] = {}
        self.waiting = 0  # turns waiting for a replica that can take them
        self.stats = {"redispatched": 0, "late_dropped": 0, "tokens_regenerated": 0, "turn_timeouts": 0,
                      "events_unsent": 0, "rejected": 0, "diagnostics_counted": 0, "refused_by_replicas": 0}
        self.vocab_size: int | None = None
        """The job tokenizer's vocabulary: a reply naming a token outside it is refused."""
        self.step = 0
        """The newest step a turn was generated for (a fault report's step)."""
        self.events: Any = None
        """The job's ``EventWriter`` (its Redis outbox): the re-dispatch accounting goes through it
        (set by the job's runner; None: straight to the log, held in memory while JetStream is away)."""
        self.changed = asyncio.Event()
        self._emitting: set[asyncio.Task[None]] = set()  # events the turn handler does not wait for
        self._emit_slots = asyncio.Semaphore(EMIT_CONCURRENCY)
        self._diag_tokens, self._diag_at = float(DIAG_BURST), time.monotonic()
        self._suppressed: dict[str, Counter[str]] = {}  # kind -> replies counted, not logged, by member
        self._summary: asyncio.TimerHandle | None = None
        # When this service last heard any member: silence is judged against it, so a request
        # manager that was itself frozen (SIGSTOP) does not take everyone for silent when it wakes.
        self.heard_any = time.monotonic()
        det = spec.detector
        self.liveness_s = det.silence_s + det.probe_timeout_s
        self.trainer_epoch = -1
        """The trainer gang whose versions ``_made`` holds (-1: none heard in this life)."""
        self._made: dict[int, float] = {}
        """Weights version -> when (monotonic) the current trainer gang was first known to hold it
        (its hello's resume step, its commits, the trained log when a commit message was lost). A
        rollback (a newer gang resuming lower) drops what it no longer has. Not a replica's word:
        after a rollback a replica may still hold the failed gang's higher version."""

    # --- what the trainer says -------------------------------------------------------------

    def trainer_made(self, version: int, epoch: int) -> None:
        """Gang ``epoch`` holds ``version`` (a commit's, the trained log's next, or its resume).
        A strictly newer gang may hold less than the one before (a rollback): the versions above
        its own are not made any more. An older gang's word is ignored, and a gang's own hello
        repeated after its commits (resent until acknowledged) lowers nothing."""
        if epoch < self.trainer_epoch:
            return
        if epoch > self.trainer_epoch:
            self.trainer_epoch = epoch
            self._made = {v: at for v, at in self._made.items() if v <= version}
        self._known(version)

    def _known(self, version: int) -> None:
        if version >= 0 and version not in self._made:
            self._made[version] = time.monotonic()
            self.changed.set()
            if len(self._made) > MADE_KEPT:
                del self._made[min(self._made)]

    def made_since(self, need: int) -> float | None:
        """When a version >= ``need`` was first known to exist (None: not yet)."""
        return min((at for v, at in self._made.items() if v >= need), default=None)

    # --- what the replicas say -------------------------------------------------------------

    def _heard(self, member_id: str) -> Replica | None:
        self.heard_any = time.monotonic()
        if member_id in self.dead:
            return None
        rep = self.replicas.setdefault(member_id, Replica(member_id))
        rep.seen_at = time.monotonic()
        self.changed.set()
        return rep

    def on_hello(self, msg: MemberHello) -> None:
        if msg.role == "rollout":
            self._heard(msg.member_id)

    def on_have(self, msg: WeightsHave) -> None:
        if not msg.complete:
            return  # a pull under way (relay announcement): the replica cannot serve that version
        rep = self._heard(msg.member_id)
        if rep:
            rep.version, rep.checksum = msg.version, msg.checksum  # a redo may load a lower version

    def on_metrics(self, msg: MetricsSample) -> None:
        if msg.role != "rollout":
            self.heard_any = time.monotonic()
            return
        rep = self._heard(msg.member_id)
        if rep:
            rep.version = msg.weights_version
            rep.busy, rep.busy_at = msg.inflight > 0 or msg.queue_depth > 0, time.monotonic()

    def live(self, rep: Replica) -> bool:
        return (rep.alive and rep.member_id not in self.dead
                and self.heard_any - rep.seen_at <= self.liveness_s)

    def replica_dead(self, member_id: str, fault_id: str | None = None) -> int:
        """Fail that replica's in-flight turns so their episodes re-dispatch from the prefix."""
        self.dead.add(member_id)
        if fault_id:
            self.dead_faults[member_id] = fault_id
        rep = self.replicas.setdefault(member_id, Replica(member_id))
        rep.alive = False
        n = 0
        for req_id in list(rep.inflight):
            pend = self.pending.get(req_id)
            if pend and not pend.future.done():
                pend.future.set_exception(Redispatch(f"{member_id} declared dead", member=member_id,
                                                     fault_id=fault_id))
                n += 1
        self.changed.set()
        return n

    def reset(self) -> None:
        """Whole-job restart: every replica is being replaced; every turn in flight is dropped."""
        for pend in self.pending.values():
            if not pend.future.done():
                pend.future.cancel()
        self.pending.clear()
        self.adoptable.clear()
        self.unclaimed.clear()
        self._let_go.clear()
        self.step = 0  # (the restart may go back to an earlier step)
        self.dead.update(self.replicas)
        self.replicas.clear()
        self._made.clear()  # the gang is replaced too: known again from the new gang's hello and commits
        self.changed.set()

    async def on_turn(self, msg: TurnResult) -> None:
        rep = self.replicas.get(msg.member_id)
        if rep is not None and msg.member_id in self.dead:
            rep = None
        if msg.refused:
            self._refused_by(msg, rep)
            return
        bad = next((t for t in msg.token_ids if t >= self.vocab_size), None) if self.vocab_size else None
        if bad is not None:
            self._refuse(msg, rep, f"token_ids: id {bad} outside the vocabulary (size {self.vocab_size})")
            return
        odd = next((x for x in msg.logprobs if not math.isfinite(x) or x > LOGPROB_MAX), None)
        if odd is not None:
            # (applied, one such value made the trainer's loss inf or NaN: the step diverged, its
            # redo on the kept batch again, and the job failed as diverged; an outside review)
            self._refuse(msg, rep, f"logprobs: {odd!r} is not a log-probability (finite, at most 0 "
                                   f"give or take {LOGPROB_MAX:g})")
            return
        if len(msg.token_ids) > self.spec.rollout.max_new_tokens:
            # (applied, the trainer padded the whole batch to its width: out of memory at every
            # redo of the step, whose batch restarts keep, until the job failed)
            self._refuse(msg, rep, f"token_ids: {len(msg.token_ids)} tokens, more than the turn's "
                                   f"max_new_tokens ({self.spec.rollout.max_new_tokens})")
            return
        if rep is not None:
            rep.seen_at, rep.timeouts, rep.reported = time.monotonic(), 0, False
            rep.refused.append(None)
        pend = self.pending.get(msg.request_id)
        if (pend is None or pend.future.done() or pend.episode_id != msg.episode_id
                or pend.member_id != msg.member_id or msg.member_id in self.dead):
            # Late: its turn was applied, or re-dispatched, or the step was restarted. Or not
            # from the replica the turn was sent to, or from one declared dead (its turns were
            # re-dispatched): never applied (an outside review found both were).
            self.stats["late_dropped"] += 1
            # (a turn an attempt let go: a retried attempt may adopt it)
            kept = pend is None and rep is not None and (
                self._let_go.pop(msg.request_id, None) == (msg.member_id, msg.episode_id))
            if kept:
                _keep(self.unclaimed, msg.request_id, msg)
            self._emit_later("turn_dropped", {
                "request_id": msg.request_id, "episode_id": msg.episode_id, "member_id": msg.member_id,
                "tokens": len(msg.token_ids), "kept_for_adoption": kept}, msg.request_id)
            return
        pend.future.set_result(msg)
        self.changed.set()

    def _refuse(self, msg: TurnResult, rep: Replica | None, error: str) -> None:
        """A reply that parses but names tokens the model does not have (a corrupt engine, a
        mismatched tokenizer; decoded, it failed the step's every attempt; trained on, the
        trainer's embedding lookup at every redo), or more tokens than the turn allows. It is never
        applied and is no sign of life.

        Only a refused reply to a turn its replica holds is charged to it (not a late one, nor one
        naming another member): the turn is dispatched again now if another replica can take it
        (else it waits out its deadline, as a turn with no reply does: no round trips with the one
        replica as fast as it answers), and the replica is reported once ``REFUSED_BEFORE_FAULT``
        of its last replies were refused (a good reply in between clears its timeouts, not these)."""
        self.stats["rejected"] += 1
        log.warning("job %s: reply %s of %s refused: %s", self.job_id, msg.request_id, msg.member_id, error)
        self._emit_later("turn_rejected", {
            "request_id": msg.request_id, "episode_id": msg.episode_id, "member_id": msg.member_id, "error": error},
            msg.request_id)
        pend = self.pending.get(msg.request_id)
        if (rep is None or pend is None or pend.future.done() or pend.episode_id != msg.episode_id
                or pend.member_id != msg.member_id):
            return
        if self._another_takes(pend, rep):
            pend.future.set_exception(Redispatch(f"reply of {msg.member_id} refused: {error}",
                                                 member=msg.member_id, cause="reply_rejected"))
            self.changed.set()
        self._charge_refused(rep, error)

    def _another_takes(self, pend: Pending, rep: Replica) -> bool:
        """Whether ``pick`` would give ``pend``'s turn, failed on ``rep``, to another replica: a
        ready one it has not failed on that is not reported. (Not reported as unresponsive either:
        with only such a one left, ``pick`` fell back to the least-loaded replica, the one that had
        just refused the turn, and the turn went back and forth with it as fast as it answered: an
        outside review.)"""
        return any(r is not rep and _preferred(r, pend.avoid) for r in self.ready(self.step))

    def _refused_by(self, msg: TurnResult, rep: Replica | None) -> None:
        """A replica that did not decode a turn says so (``TurnResult.refused``): named in the log
        (``turn_refused``, with its reason), and the turn dispatched again at once if another
        replica can take it (``_another_takes``; else it waits out its deadline, as before: no
        round trips between replicas that all refuse it). Only a refusal to a turn its replica
        holds is acted on, and it is charged to that replica only once another replica has
        decoded the same turn (``generate``: the input was fine, the refusing engine or its
        tokenizer was not), as a refused reply is; a turn every replica refuses charges nobody
        (its input is at fault: named in the log, and the step deadline reports the stuck step).
        Taken on the replica's word, an ``input`` refusal let a replica with the wrong tokenizer
        refuse every turn and never be reported, and an ``engine`` one charged every replica for
        an input no engine takes (an outside review). A refused turn's deadline, if it waits it
        out, is no silence of its replica's."""
        self.stats["refused_by_replicas"] += 1
        self._emit_later("turn_refused", {
            "request_id": msg.request_id, "episode_id": msg.episode_id, "member_id": msg.member_id,
            "refused": msg.refused, "error": msg.error}, msg.request_id)
        pend = self.pending.get(msg.request_id)
        if (rep is None or pend is None or pend.future.done() or pend.episode_id != msg.episode_id
                or pend.member_id != msg.member_id):
            return  # late, or not the turn this replica holds: nothing to act on
        log.warning("job %s: turn %s refused by %s (%s): %r", self.job_id, msg.request_id, msg.member_id,
                    msg.refused, msg.error[:200])
        rep.seen_at = time.monotonic()
        pend.refused = f"{msg.refused}: {msg.error}"
        if self._another_takes(pend, rep):
            pend.future.set_exception(Redispatch(f"{msg.member_id} refused the turn ({msg.refused}): {msg.error}",
                                                 member=msg.member_id, cause="turn_refused"))
            self.changed.set()

    def _charge_refused(self, rep: Replica, error: str) -> None:
        """Count a refused reply against ``rep``; report it once ``REFUSED_BEFORE_FAULT`` of its
        last ``REPLY_WINDOW`` replies were refused."""
        rep.refused.append(time.time())
        refused = [t for t in rep.refused if t is not None]
        if len(refused) >= REFUSED_BEFORE_FAULT and not rep.reported_bad:
            rep.reported_bad = True
            evidence = (f"{len(refused)} of the last {len(rep.refused)} replies of {rep.member_id} refused; "
                        f"the last: {error}")
            self._background(self._report_bad(rep, refused[0], evidence), "fault report", essential=True)

    async def _report_bad(self, rep: Replica, since: float, evidence: str) -> None:
        try:
            await report_deadline(self.bus, self.job_id, role="rollout", member_id=rep.member_id, kind="bad_output",
                                  cause="replies_refused", step=self.step, since=since, evidence=evidence,
                                  events=self.events)
        except BaseException:
            rep.reported_bad = False  # reported again at its next refused reply
            raise

    def _emit_later(self, kind: str, data: dict[str, Any], key: str) -> None:
        """Append an event to the job's log without making the caller wait for it (``_background``),
        through the job's outbox (``record_event``, under the reply's request id ``key`` and a
        fresh suffix: each reply is its own event, a request refused three times is three). Held
        in memory, a late or refused reply's event was lost with a request manager killed while
        JetStream was away. Redis failing, it is appended from memory (as before the outbox; an
        outside review found these dropped during a Redis outage). Within ``DIAG_BURST`` /
        ``DIAG_PER_S``, ``DIAG_QUEUE_ROOM`` and ``MAX_EMITTING``; past them counted, in a summary
        event."""
        if not self._diag_admits(kind, str(data.get("member_id", ""))):
            return
        self._background(self._record_or_emit(kind, data, f"{key}-{uuid.uuid4().hex[:12]}"), kind)

    def _diag_admits(self, kind: str, member_id: str) -> bool:
        now = time.monotonic()
        self._diag_tokens = min(float(DIAG_BURST), self._diag_tokens + (now - self._diag_at) * DIAG_PER_S)
        self._diag_at = now
        queued = self.events.pending if self.events is not None else self.bus.owed
        if self._diag_tokens >= 1.0 and queued < DIAG_QUEUE_ROOM and len(self._emitting) < MAX_EMITTING:
            self._diag_tokens -= 1.0
            return True
        counts = self._suppressed.setdefault(kind, Counter())
        counts[member_id if member_id in counts or len(counts) < DIAG_MEMBERS else "others"] += 1
        self.stats["diagnostics_counted"] += 1
        if self._summary is None:
            self._summary = asyncio.get_running_loop().call_later(DIAG_SUMMARY_S, self._summarize)
        return False

    async def settle_events(self, timeout_s: float) -> None:
        """At the job's stop: log what is counted now, and wait (up to ``timeout_s``) for the
        events given in the background to reach the job's writer (its outbox and queue)."""
        if self._summary is not None:
            self._summary.cancel()
            self._summarize()
        pending = [t for t in self._emitting if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)

    def _summarize(self) -> None:
        """Log each kind's replies counted since the last summary, as one event."""
        self._summary = None
        counted, self._suppressed = self._suppressed, {}
        for kind, counts in counted.items():
            total = sum(counts.values())
            log.warning("job %s: %d %s replies not logged one by one (a flood, or the event log away): counted",
                        self.job_id, total, kind)
            self._background(self._record_or_emit(kind, {"suppressed": total, "by_member": dict(counts),
                                                         "window_s": DIAG_SUMMARY_S},
                                                  f"counted-{uuid.uuid4().hex[:12]}"), kind, essential=True)

    async def _record_or_emit(self, kind: str, data: dict[str, Any], request_id: str) -> None:
        try:
            await self.record_event(kind, data, request_id)
        except TransportError as exc:
            log.warning("job %s: %s not saved in the outbox (%s): appended from memory", self.job_id, kind, exc)
            await self.bus.emit_event(self.job_id, kind, data, msg_id=f"{self.job_id}-{kind}-{request_id}")

    def _background(self, work: Coroutine[Any, Any, object], what: str, essential: bool = False) -> None:
        """Run an append to the job's log (an event, a fault report) without making the turn
        handler wait for it. The handler runs one message at a time (nats.py calls a
        subscription's callback for each in turn): an event awaited there, while JetStream is slow
        (its retries take up to 30 s), held every on-time reply behind one late one, until their
        turns passed their deadlines and healthy replicas were reported (an outside review found
        it). At most ``MAX_EMITTING`` wait at once; beyond that one is counted in
        ``stats['events_unsent']`` and dropped, unless ``essential`` (a fault report)."""
        if len(self._emitting) >= MAX_EMITTING and not essential:
            work.close()
            self.stats["events_unsent"] += 1
            return
        task = asyncio.get_running_loop().create_task(self._settle(work, what, gated=not essential))
        self._emitting.add(task)
        task.add_done_callback(self._emitting.discard)

    async def _settle(self, work: Coroutine[Any, Any, object], what: str, gated: bool = True) -> None:
        try:
            if not gated:  # a fault report: never behind a queue of diagnostics
                await work
                return
            async with self._emit_slots:
                await work
        except Exception as exc:  # the event log is accounting here: the turn is handled already
            self.stats["events_unsent"] += 1
            log.warning("job %s: %s not appended: %s", self.job_id, what, exc)

    # --- choosing a replica ----------------------------------------------------------------

    def min_version(self, step: int) -> int:
        return self.spec.min_version(step)

    def ready(self, step: int) -> list[Replica]:
        need = self.min_version(step)
        return [r for r in self.replicas.values() if self.live(r) and r.version >= need]

    async def _changed_wait(self, timeout: float) -> None:
        self.changed.clear()
        await wait_event(self.changed, timeout)

    async def pick(self, step: int, avoid: set[str]) -> Replica:
        """The least-loaded ready replica, preferring ones not in ``avoid`` and not reported;
        waits (bounded by the step deadline) while none is ready."""
        self.waiting += 1
        try:
            while True:
                ready = self.ready(step)
                if ready:
                    good = [r for r in ready if _preferred(r, avoid)]
                    return min(good or ready, key=lambda r: (len(r.inflight), r.member_id))
                await self._changed_wait(WAKE_S)
        finally:
            self.waiting -= 1

    async def wait_version(self, step: int) -> None:
        """Until every live serving replica holds the step's version (at least one must), or
        ``weights_load_s`` passed since it was known to exist (``made_since``): then the replicas
        still below it are reported and not waited for. Replicas still starting (no version yet)
        are not waited for: they join when loaded."""
        need = self.min_version(step)
        t0 = time.monotonic()
        bound = self.spec.detector.weights_load_s
        while True:
            live = [r for r in self.replicas.values() if self.live(r)]
            lagging = [r for r in live if 0 <= r.version < need and r.reported_version < need]
            if any(r.version >= need for r in live) and not lagging:
                return
            made = self.made_since(need)
            if made is None:
                # Not made yet as far as this life knows (a new gang redoing the steps after its
                # checkpoint: each is a version): no replica can be late for it. The trainer's
                # progress is bounded by the commit deadline, this wait by the step deadline. Before, replicas were
                # reported ``weights_deadline`` from the step's start, and a redo longer than
                # ``weights_load_s`` after a whole-job restart was taken for a replica failing in
                # it: another whole-job restart, again, until the job failed (an outside review).
                await self._changed_wait(WAKE_S)
                continue
            waited = time.monotonic() - max(t0, made)
            since = time.time() - waited
            if waited <= bound:
                await self._changed_wait(min(WAKE_S, max(0.05, bound - waited)))
                continue
            for r in lagging:
                r.reported_version = need
                await report_deadline(
                    self.bus, self.job_id, role="rollout", member_id=r.member_id, kind="hang",
                    cause="weights_deadline", step=step, since=since,
                    evidence=f"{r.member_id} holds v{r.version}, step {step} needs v{need}; "
                             f"waited {waited:.1f}s (weights_load_s={bound:g})", events=self.events)
            if not lagging:
                # Nobody serves the version yet (replicas still starting): the step deadline bounds this.
                await self._changed_wait(WAKE_S)

    # --- one turn --------------------------------------------------------------------------

    def load_adoptable(self, records: dict[str, dict[str, Any]], episode_ids: set[str]) -> None:
        """Dispatch records of a past life (request-manager restart, retried step) for these episodes."""
        self.adoptable = {e: r for e, r in records.items() if e in episode_ids}

    async def generate(self, ep: EpisodeRecord, step: int, stop_on_call: bool) -> tuple[TurnResult, str]:
        """The episode's next turn, from whichever replica answers within the deadline.

        Returns the result and the id of the request it answered.
        """
        turn = len(ep.turns)
        self.step = max(self.step, step)
        avoid: set[str] = set()
        refusers: dict[str, str] = {}  # replicas that refused this turn -> why (``_refused_by``)
        cause: str | None = None
        fault_id: str | None = None
        record = self.adoptable.pop(ep.episode_id, None)
        if record is not None and record.get("turn") != turn:
            record = None
        if record is not None and isinstance(record.get("cause"), str):
            # Dispatched again by a past life (or a failed attempt) because of a fault: what it
            # generates is regenerated work of that fault, whoever finishes it (the cause lived
            # only in that life's memory, and the tokens went uncharged; an outside review).
            cause, fault_id = record["cause"], record.get("fault_id") if isinstance(record.get("fault_id"), str) else None
        while True:
            pend = None
            if record is not None:
                pend = await self._adopt(ep, record)
                if pend is None:
                    await self._owner_lost(ep, step, record)
                    owner = str(record.get("member_id"))
                    avoid.add(owner)
                    if owner in self.dead:
                        cause, fault_id = "replica_dead", self.dead_faults.get(owner, fault_id)
                    elif cause is None:
                        cause = "owner_lost"
            record = None
            if pend is None:
                pend = await self._dispatch(ep, step, stop_on_call, avoid, cause, fault_id)
            try:
                res = await self._await(pend)
            except (Redispatch, TurnTimeout) as exc:
                # Forgotten first: a reply landing while the failure is written (a Redis write)
                # takes the late path and is logged as dropped, not swallowed uncounted.
                self._forget(pend)
                cause = await self._failed(ep, step, pend, exc)
                fault_id = getattr(exc, "fault_id", None) or fault_id
                avoid.add(pend.member_id)
                if pend.refused:
                    refusers[pend.member_id] = pend.refused
                continue
            except asyncio.CancelledError:
                # The step's attempt let the turn go (a failed sibling, a restart): its reply may
                # still come, for a retry that adopts the turn (``unclaimed``).
                _keep(self._let_go, pend.request_id, (pend.member_id, pend.episode_id))
                raise
            finally:
                self._forget(pend)
            for member_id, why in refusers.items():  # decoded here: the input was fine
                refuser = self.replicas.get(member_id)
                if refuser is not None and member_id != res.member_id and member_id not in self.dead:
                    self._charge_refused(refuser, f"refused a turn {res.member_id} decoded ({why})")
            if cause is not None:
                self.stats["tokens_regenerated"] += len(res.token_ids)
                await self.record_event("turn_regenerated", {
                    "fault_id": fault_id, "cause": cause, "episode_id": ep.episode_id, "step": step,
                    "turn": turn, "member_id": res.member_id, "tokens": len(res.token_ids)}, pend.request_id)
            return res, pend.request_id

    def _register(self, request_id: str, ep: EpisodeRecord, member_id: str, sent_at: float,
                  adopted: bool = False, min_version: int = 0) -> Pending:
        fut: asyncio.Future[TurnResult] = asyncio.get_running_loop().create_future()
        pend = Pending(request_id, ep.episode_id, len(ep.turns), member_id, sent_at, fut,
                       time.monotonic() if adopted else None, monotonic_of(sent_at) if adopted else time.monotonic(),
                       self.bus.disconnects, not self.bus.connected, min_version)
        self.pending[request_id] = pend
        self.replicas.setdefault(member_id, Replica(member_id)).inflight.add(request_id)
        came = self.unclaimed.pop(request_id, None) if adopted else None
        if came is not None and came.member_id == member_id and came.episode_id == ep.episode_id \
                and member_id not in self.dead:
            fut.set_result(came)  # its reply came while no attempt waited for it
        return pend

    def _forget(self, pend: Pending) -> None:
        self.pending.pop(pend.request_id, None)
        rep = self.replicas.get(pend.member_id)
        if rep:
            rep.inflight.discard(pend.request_id)

    async def _adopt(self, ep: EpisodeRecord, record: dict[str, Any]) -> Pending | None:
        """Take over a turn dispatched in a past life if its owner is live; None to dispatch anew."""
        member = str(record.get("member_id"))
        deadline = time.monotonic() + ADOPT_WAIT_S
        while member not in self.dead and time.monotonic() < deadline:
            rep = self.replicas.get(member)
            if rep is not None and self.live(rep):
                return self._register(str(record["request_id"]), ep, member, float(record["sent_at"]), True)
            await self._changed_wait(min(WAKE_S, max(0.05, deadline - time.monotonic())))
        return None

    async def _owner_lost(self, ep: EpisodeRecord, step: int, record: dict[str, Any]) -> None:
        """A turn a past life dispatched whose owner is dead or silent: it is dispatched again from
        the prefix, logged as any re-dispatch (it was dispatched again silently)."""
        member = str(record.get("member_id"))
        await self._redispatched(ep, step, member, "replica_dead" if member in self.dead else "owner_lost",
                                 str(record.get("request_id")))

    async def _redispatched(self, ep: EpisodeRecord, step: int, member_id: str, cause: str, request_id: str) -> None:
        """Count a turn dispatched again from the episode's prefix and log it (with the prefix's
        hash, which the auditor checks against the final episode)."""
        self.stats["redispatched"] += 1
        ep.redispatches += 1
        prefix = ep.prefix_ids()
        await self.record_event("episode_redispatched", {
            "episode_id": ep.episode_id, "member_id": member_id, "step": step, "cause": cause,
            "request_id": request_id, "prefix_turns": len(ep.turns), "prefix_len": len(prefix),
            "prefix_sha": hashlib.sha256(json.dumps(prefix).encode()).hexdigest()}, request_id)

    async def _dispatch(self, ep: EpisodeRecord, step: int, stop_on_call: bool, avoid: set[str],
                        cause: str | None = None, fault_id: str | None = None) -> Pending:
        """Send the turn to a replica. ``cause``, ``fault_id``: why it is sent again (None: its
        first dispatch), kept in its dispatch record for whoever adopts it."""
        rep = await self.pick(step, avoid)
        req_id = uuid.uuid4().hex[:16]
        pend = self._register(req_id, ep, rep.member_id, time.time(), min_version=self.min_version(step))
        pend.avoid = frozenset(avoid)
        try:
            # Recorded before it is sent: a restarted request manager knows whom to wait for.
            entry: dict[str, Any] = {"turn": pend.turn, "request_id": req_id, "member_id": rep.member_id,
                                     "sent_at": pend.sent_at, "step": step}
            if cause is not None:
                entry |= {"cause": cause, "fault_id": fault_id}
            await self.records.record(ep.episode_id, entry)
            msg = GenerateTurn(
                job_id=self.job_id, request_id=req_id, episode_id=ep.episode_id, step=step,
                prefix_ids=ep.prefix_ids(), max_new_tokens=self.spec.rollout.max_new_tokens,
                temperature=self.spec.rollout.temperature, top_p=self.spec.rollout.top_p,
                seed=tasks.request_seed(self.spec.seed, ep.episode_id, len(ep.turns)),
                stop_on_call=stop_on_call, min_version=pend.min_version, turn=len(ep.turns))
            await self.bus.publish(subject(self.job_id, Verb.GENERATE, rep.member_id), msg)
        except BaseException:
            # A dispatch that failed (its record refused, the step's attempt cancelled meanwhile)
            # is nobody's turn: left registered, it stayed outstanding on the replica for good,
            # so a later stuck step was blamed on that replica (replaced though healthy; once it
            # was dead, the report was ignored and the step never recovered) and ``pick`` shunned
            # it (an outside review).
            self._forget(pend)
            raise
        return pend

    async def _await(self, pend: Pending) -> TurnResult:
        """The reply, or Redispatch / TurnTimeout once the turn has no live owner or ran past its
        deadline."""
        deadline = pend.clock_sent + self.spec.detector.turn_deadline_s
        interval = self.spec.detector.metrics_interval_s
        while True:
            remaining = deadline - time.monotonic()
            try:
                # Past the deadline, one more short wait: a reply already received but not yet
                # processed (this service was frozen) is applied, not thrown away.
                return await within(asyncio.shield(pend.future), min(max(remaining, 0.0) or POLL_S, POLL_S))
            except TimeoutError:
                if remaining <= 0:
                    raise TurnTimeout(f"no reply within turn_deadline_s={self.spec.detector.turn_deadline_s:g}",
                                      member=pend.member_id) from None
            rep = self.replicas.get(pend.member_id)
            if rep is None or not self.live(rep):
                raise Redispatch(f"{pend.member_id} silent for over {self.liveness_s:g}s", member=pend.member_id)
            if (pend.adopted_at is not None and not rep.busy
                    and rep.busy_at > pend.adopted_at + 2 * interval):
                # Dispatched before this life; its owner is idle now: the reply was lost meanwhile.
                raise Redispatch(f"{pend.member_id} idle: the reply was lost", member=pend.member_id)
            if (pend.outlived_a_bus_outage(self.bus) and self.bus.connected and not rep.busy
                    and self.bus.reconnected_at > pend.clock_sent):  # this outage's reconnect is recorded
                # NATS went away while the turn was out; its owner reports idle since we are back:
                # the request or the reply was lost with the server. Again now, not at the turn's
                # deadline (a NATS restart stalled the job for the whole 10 s deadline).
                if rep.busy_at > self.bus.reconnected_at + 2 * interval:
                    raise Redispatch(f"{pend.member_id} idle after a NATS outage: the turn was lost on the bus",
                                     member=pend.member_id, cause="bus_outage")

    async def _failed(self, ep: EpisodeRecord, step: int, pend: Pending, exc: Exception) -> str:
        """Account a turn that must be dispatched again; returns its cause."""
        if isinstance(exc, TurnTimeout):
            cause = "turn_deadline"
            self.stats["turn_timeouts"] += 1
            rep = self.replicas.get(pend.member_id)
            if (pend.outlived_a_bus_outage(self.bus)
                    or pend.clock_sent < self.bus.reconnected_at + RECONNECT_GRACE_S):
                # NATS went away while the turn was out (a server restart): the request or its reply
                # was lost on the bus, which is no evidence against the replica (seen: both replicas
                # reported unresponsive and replaced after a NATS restart).
                rep = None
            if rep is not None and rep.version < pend.min_version:
                # The replica holds an older version than the turn needs (a trainer rollback: it
                # followed the new gang down, and the turn waits in ``awaiting_version`` until the
                # new gang publishes that version again): waiting is its job, no evidence against
                # it. Struck, healthy replicas were replaced in the middle of a trainer recovery
                # (an outside review); the weights path has its own bound (``wait_version``).
                rep = None
            if pend.refused:
                # Its replica answered, with a refusal (charged once another replica decodes the
                # turn): a turn no replica decodes waits out its deadline here, which is no
                # evidence of an unresponsive replica (each such turn would have been one).
                rep = None
            if pend.adopted_at is not None:
                # Sent by a past life of this service: the reply may have come while no request
                # manager listened (killed, or frozen until its supervisor killed it). Seen: a
                # restarted request manager adopted turns whose deadline had passed while it was
                # down, struck both replicas 3 times within 0.5 s and had them replaced.
                rep = None
            if rep is not None:
                rep.timeouts += 1
                if rep.timeouts >= TIMEOUTS_BEFORE_FAULT and not rep.reported:
                    rep.reported = True
                    await report_deadline(
                        self.bus, self.job_id, role="rollout", member_id=rep.member_id, kind="unresponsive",
                        cause="turn_deadline", step=step, since=pend.sent_at,
                        evidence=f"{rep.timeouts} turns in a row got no reply from {rep.member_id} within "
                                 f"turn_deadline_s={self.spec.detector.turn_deadline_s:g}", events=self.events)
        else:
            cause = "replica_dead" if pend.member_id in self.dead else str(getattr(exc, "cause", "owner_lost"))
        await self._redispatched(ep, step, pend.member_id, cause, pend.request_id)
        return cause

    async def record_event(self, kind: str, data: dict[str, Any], request_id: str) -> None:
        """An event of a turn (what a fault cost, the prefix a re-dispatch resumed from, a late or
        refused reply, a tool that failed): in the job's Redis outbox when this returns, so a
        request manager killed while JetStream is away leaves it for its next life (held in
        memory, it was lost). Its message id is the dispatch's own (``request_id``): the default
        (the fault id) would store one event of the many a fault causes.

        Raises:
            TransportError: Redis failed (the step's attempt fails and is retried from its records).
        """
        if self.events is None:
            await self.bus.emit_event(self.job_id, kind, data)
            return
        await self.events.emit(kind, data, msg_id=f"{self.job_id}-{kind}-{request_id}")
