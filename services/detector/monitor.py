"""One job's detector state: every member history and the bookkeeping around the rules
(:mod:`robustrl.services.detector.rules`): probes in flight, faults already reported, members
known to be gone, and the detector's own outages. Pure: no I/O, time comes in as ``now``.

After the detector itself was not running - a restart (new process, empty state) or a
freeze (SIGSTOP, a starved loop) - it judges nothing it did not observe: a restarted detector
builds each history from the member's next message, and a monitor whose ticks stopped for
longer than :func:`gap_bound_s` moves every clock forward by the gap (never past the tick that
found it): the gap's time is left out, what was measured before it still counts.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from robustrl.config import DetectorSpec
from robustrl.messages import Event, FaultReport, MemberExited, MemberHello, MetricsSample, PhaseChange, ProbeRequest
from robustrl.services.detector.history import MemberHistory
from robustrl.services.detector.rules import Cause, Status, Verdict, crash_rule, evaluate_member, fail_slow_rule
from robustrl.subjects import _TOKEN

_FAULT_NS = uuid.UUID("5f0e7a52-3c1d-4b7e-9a61-0d2c5e8b7f31")


def new_fault_id() -> str:
    """A random id: probe nonces, tool outages (one job may have many)."""
    return uuid.uuid4().hex[:12]


def member_fault_id(job_id: str, member_id: str, cause: str | None = None, rearmed: int = 0) -> str:
    """The id of a member incarnation's fault of ``cause`` (a restarted member gets a new member
    id). Derived, not drawn: a detector that restarts and reports the same stuck member again
    sends the same fault id, so the controller handles it once. Per cause: a member kept after one
    fault (say its load failed) and later frozen is a new fault, under a new id, for a restarted
    detector too (one id per member made the controller drop it as handled: an outside review);
    ``rearmed``: the times this detector judged the member again after a report (the same cause
    again in one life is a new fault too)."""
    key = f"{job_id}/{member_id}" + (f"/{cause}" if cause else "") + (f"#{rearmed}" if rearmed else "")
    return uuid.uuid5(_FAULT_NS, key).hex[:12]


def rearm_s(cfg: DetectorSpec) -> float:
    """How long a member reported once must look healthy (every rule OK) before it is judged
    again: the controller kept it (its fault ignored, e.g. a replica's failed load during a
    trainer recovery, loaded since). Reported once for good, such a member that later froze was
    never reported: the pool ran a replica short for the rest of the job (an outside review)."""
    return 2 * (cfg.silence_s + cfg.probe_timeout_s)


def gap_bound_s(cfg: DetectorSpec) -> float:
    """Ticks further apart than this mean the detector itself was not running (frozen,
    suspended, or its loop starved): what it measured across the gap is not evidence."""
    return max(cfg.silence_s / 2, 4 * cfg.metrics_interval_s)


@dataclass
class TickResult:
    probes: list[ProbeRequest] = field(default_factory=list)
    faults: list[FaultReport] = field(default_factory=list)


class JobMonitor:
    """Every member history of one job, and the bookkeeping around the rules: probes in
    flight, faults already reported (once per member incarnation), members known to be gone.

    It performs no I/O: the service turns a :class:`TickResult` into messages.
    """

    def __init__(self, job_id: str, cfg: DetectorSpec | None = None, *,
                 new_id: Callable[[], str] = new_fault_id) -> None:
        self.job_id = job_id
        self.cfg = cfg
        self.members: dict[str, MemberHistory] = {}
        self.gone: set[str] = set()
        self.reported: set[str] = set()
        self._healthy_since: dict[str, float] = {}  # reported member -> since when it looks healthy again
        self._rearmed: dict[str, int] = {}  # member -> times it was judged again after a report
        self.dirty: set[str] = set()  # members whose mark (:meth:`mark`) changed since it was saved
        self._resend: set[str] = set()  # reported by a previous detector, not judged by this one yet
        self._new_id = new_id
        self._tool_faults: dict[tuple[str, str], float] = {}  # (member, tool) -> last seen
        self.last_tick: float | None = None
        self.last_rebase: float | None = None
        self._was_late = False
        self.gaps = 0  # times the monitor found it had not been ticked (its own outage)
        self.fence = 0  # the newest controller fencing token seen in this job's control commands

    def mark(self, member_id: str) -> int:
        """What a restarted detector must know of a member to give its next fault the right id:
        ``2 * rearmed + reported`` (saved in Redis by the service, ``Keys.detector_marks``)."""
        return 2 * self._rearmed.get(member_id, 0) + (member_id in self.reported)

    def restore(self, marks: dict[str, int]) -> None:
        """Take up the marks a previous detector saved (before any rule runs). Without them a
        restarted detector counted from nothing: a member reported before (and kept by the
        controller), healthy again and then faulty the same way, was reported under the first
        report's id, which the controller had handled, so it was not acted on. A member reported
        before and still faulty when this detector first judges it is reported again under the
        same id (handled once: a safety net, as before the marks); once it has looked healthy it
        is judged again only after ``rearm_s`` (as in one life), and its next fault gets the next
        id."""
        for member_id, mark in marks.items():
            if mark < 0:
                continue
            self._rearmed[member_id] = max(self._rearmed.get(member_id, 0), mark // 2)
            if mark % 2:
                self.reported.add(member_id)
                self._resend.add(member_id)

    def configure(self, cfg: DetectorSpec) -> None:
        """Set the thresholds (learned from the job spec); no rule runs before this."""
        self.cfg = cfg
        for h in self.members.values():
            h.keep_s = self._keep_s()

    def _keep_s(self) -> float:
        return 2 * self.cfg.rollout_idle_s + 1.0 if self.cfg else 600.0

    def _history(self, member_id: str, role: str, rx_time: float) -> MemberHistory | None:
        if member_id in self.gone:
            return None
        h = self.members.get(member_id)
        if h is None:
            h = MemberHistory(self.job_id, member_id, role, first_seen=rx_time, keep_s=self._keep_s())
            self.members[member_id] = h
        return h

    def hello(self, msg: MemberHello, rx_time: float) -> None:
        h = self._history(msg.member_id, msg.role, rx_time)
        if h is not None:
            h.last_heard = rx_time

    def sample(self, msg: MetricsSample, rx_time: float) -> bool:
        """Feed a sample; False if it was dropped (gone member, duplicate, out of order)."""
        h = self._history(msg.member_id, msg.role, rx_time)
        return h.observe_sample(msg, rx_time) if h is not None else False

    def phase(self, msg: PhaseChange, rx_time: float) -> None:
        h = self._history(msg.member_id, msg.role, rx_time)
        if h is not None:
            h.observe_phase(msg, rx_time)

    def exited(self, msg: MemberExited, rx_time: float) -> FaultReport | None:
        """An expected exit forgets the member; an unexpected one is a crash, reported now."""
        if msg.expected:
            self.forget(msg.member_id)
            return None
        h = self._history(msg.member_id, msg.role, rx_time)
        if h is None or msg.member_id in self.reported:
            return None
        h.observe_exit(msg)
        verdict = crash_rule(h)
        assert verdict is not None
        return self._report(h, verdict, rx_time)

    def probe_reply(self, member_id: str, nonce: str, rx_time: float) -> bool:
        h = self.members.get(member_id)
        return h.observe_probe_reply(nonce, rx_time) if h is not None else False

    def admit_fence(self, fence: int, floor: int | None = None) -> bool:
        """A control command's fencing token: False if it is older than one already seen, or than
        ``floor`` (the newest lease term's token, read from Redis: a restarted detector has seen
        none), i.e. the command comes from a deposed controller and must not be acted on."""
        if fence < max(self.fence, floor or 0):
            return False
        self.fence = fence
        return True

    def forget(self, member_id: str) -> None:
        """The member was stopped on purpose: drop it and ignore its late messages."""
        self.members.pop(member_id, None)
        self.gone.add(member_id)

    def forget_role(self, role: str) -> None:
        for member_id in [m for m, h in self.members.items() if h.role == role]:
            self.forget(member_id)

    def tool_fault(self, event: Event, rx_time: float) -> FaultReport | None:
        """A tool failure reported by the request manager becomes one tool_outage report per
        outage: repeats for the same tool are folded until it has been quiet for silence_s."""
        member = str(event.data.get("member_id") or "request_manager")
        tool = str(event.data.get("tool") or "tool")
        key = (member, tool)
        last = self._tool_faults.get(key)
        self._tool_faults[key] = rx_time
        quiet_s = self.cfg.silence_s if self.cfg else 30.0
        if last is not None and rx_time - last < quiet_s:
            return None
        step = event.data.get("step", -1)
        evidence = (f"tool {tool!r} failing after {event.data.get('attempts', '?')} attempts: "
                    f"{event.data.get('error', 'unknown error')}")
        return FaultReport(job_id=self.job_id, fault_id=self._new_id(), role="request_manager",
                           member_id=member if _is_token(member) else "request_manager",
                           kind="tool_outage", evidence=evidence, detected_at=rx_time,
                           step=step if isinstance(step, int) else -1, cause=Cause.TOOL_OUTAGE.value,
                           fault_at=rx_time if last is None else min(last, rx_time))

    def own_outage(self, now: float) -> None:
        """The detector's own connection to the bus was down (no tick ran since ``last_tick``):
        members' silence meanwhile is no evidence (their metrics could not reach us, nor our
        probes them). Every clock moves forward by the outage (``MemberHistory.rebase``)."""
        self.gaps += 1
        self.last_rebase = now
        gap = 0.0 if self.last_tick is None else max(0.0, now - self.last_tick)
        for h in self.members.values():
            h.rebase(now, gap)

    def tick(self, now: float) -> TickResult:
        """Evaluate every member at ``now``: the probes to send and the faults to report."""
        out = TickResult()
        if self.cfg is None:
            self.last_tick = now
            return out
        late = self.last_tick is not None and now - self.last_tick > gap_bound_s(self.cfg)
        # A gap after ticking normally, and at most one per two silence-and-probe windows: a
        # detector whose ticks keep coming late (a loaded machine) must still judge eventually,
        # not postpone every rule forever.
        window = 2 * (self.cfg.silence_s + self.cfg.probe_timeout_s)
        if (late and not self._was_late
                and (self.last_rebase is None or now - self.last_rebase >= window)):
            # Our own outage, not the members': its time is left out of every clock.
            self.gaps += 1
            self.last_rebase = now
            for h in self.members.values():
                h.rebase(now, now - self.last_tick)  # type: ignore[operator]  (late: last_tick is set)
        self._was_late = late
        self.last_tick = now
        healthy: list[MemberHistory] = []
        for h in list(self.members.values()):
            resend = h.member_id in self._resend
            if h.member_id in self.reported and not resend and not self._rearm(h, now):
                continue
            verdict = evaluate_member(now, h, self.cfg)
            if resend and verdict.status is Status.OK:
                self._resend.discard(h.member_id)  # healthy since: the re-arm rules from now on
                continue
            if verdict.status is Status.FAULT:
                out.faults.append(self._report(h, verdict, now))
            elif verdict.status is Status.SUSPECT:
                if verdict.probe:
                    nonce = self._new_id()
                    h.start_probe(nonce, now)
                    out.probes.append(ProbeRequest(job_id=self.job_id, member_id=h.member_id, nonce=nonce))
            else:
                healthy.append(h)
        for member_id, verdict in fail_slow_rule(now, healthy, self.cfg).items():
            out.faults.append(self._report(self.members[member_id], verdict, now))
        # Trainer faults first (a stable sort): a host lost silences a gang rank and a replica in
        # one tick, and the controller handles reports in order; the replica's replacement, first,
        # would take the warm spare the new gang -- the critical path -- needs.
        out.faults.sort(key=lambda f: f.role != "trainer")
        return out

    def _rearm(self, h: MemberHistory, now: float) -> bool:
        """Whether a reported member is judged again now: it has looked healthy (every rule OK,
        no probe sent) for ``rearm_s``; its next fault is a new one (its own id)."""
        assert self.cfg is not None
        if h.exited or evaluate_member(now, h, self.cfg).status is not Status.OK:
            self._healthy_since.pop(h.member_id, None)
            return False
        since = self._healthy_since.setdefault(h.member_id, now)
        if now - since < rearm_s(self.cfg):
            return False
        self.reported.discard(h.member_id)
        del self._healthy_since[h.member_id]
        self._rearmed[h.member_id] = self._rearmed.get(h.member_id, 0) + 1
        self.dirty.add(h.member_id)
        return True

    def _report(self, h: MemberHistory, verdict: Verdict, now: float) -> FaultReport:
        self.reported.add(h.member_id)
        self._resend.discard(h.member_id)
        self.dirty.add(h.member_id)
        assert verdict.kind is not None
        fault_id = member_fault_id(self.job_id, h.member_id, verdict.cause.value if verdict.cause else verdict.kind,
                                   self._rearmed.get(h.member_id, 0))
        return FaultReport(job_id=self.job_id, fault_id=fault_id,
                           role=h.role, member_id=h.member_id, kind=verdict.kind,  # type: ignore[arg-type]
                           evidence=verdict.evidence, detected_at=now, step=h.step,
                           last_progress_at=verdict.last_progress_at,
                           cause=verdict.cause.value if verdict.cause else None, fault_at=verdict.fault_at)


def _is_token(text: str) -> bool:
    return bool(_TOKEN.match(text))
