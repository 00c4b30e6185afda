"""Phase-aware fault rules (DESIGN section 3, "Detect"): pure functions of (now, history, config).

Nothing here touches NATS, a clock or torch. The detector service feeds each member's
messages into a :class:`MemberHistory` stamped with the *receiver's* clock (``rx_time``), never
the member's own ``ts``: clocks of different machines may disagree by hours, and only the
detector's clock is comparable with itself. :class:`JobMonitor` holds every history of one job
and turns a tick into the probes to send and the faults to report; tests drive it with a fake
``now``.

Rules, in the order they are applied to one member:

* exit: ``MemberExited(expected=False)`` -> FAULT crash at once.
* silence: nothing heard for ``silence_s`` -> SUSPECT (probe); probe unanswered within
  ``probe_timeout_s`` -> FAULT unresponsive. A probe answer counts as being heard, so a member
  that answers probes is never called unresponsive. Only this rule runs while a member is
  silent: the other rules would judge stale data.
* trainer hang: only in phase ``training``, ``activity`` unchanged for ``trainer_idle_s`` ->
  FAULT hang. Every other trainer phase (waiting for a batch, checkpointing...) may be idle.
* rollout stall: ``tokens_total`` unchanged for ``rollout_idle_s`` while requests are being
  generated (``inflight - tool_waiting > 0``) -> SUSPECT (probe); probe unanswered -> FAULT
  unresponsive; probe answered but still no progress at ``2 x rollout_idle_s`` -> FAULT hang.
  No requests, or every request waiting on a tool, is normal idleness.
* fail-slow (across replicas, :func:`fail_slow_rule`): a busy replica whose per-request token
  rate stays below a quarter of its peers' median for ``rollout_idle_s`` -> FAULT fail_slow.
* tool fault (``tool_fault`` event from the request manager) -> FAULT tool_outage with role
  ``request_manager``; never a rollout fault.

Event contract consumed here: ``tool_fault {tool, error, attempts, step, episode_id, member_id?}``
emitted by the request manager (``member_id``, its own member id, defaults to
``request_manager``).
"""

from __future__ import annotations

import statistics
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum

from robustrl.config import DetectorSpec
from robustrl.messages import (
    Event, FaultKind, FaultReport, MemberExited, MemberHello, MetricsSample, PhaseChange, ProbeRequest,
)
from robustrl.subjects import _TOKEN

# Rollout phases in which zero throughput is expected even with requests assigned: a replica
# that is starting or swapping weights holds its requests without decoding. A process that
# hangs there still goes silent and is caught by the silence rule.
ROLLOUT_EXEMPT_PHASES = frozenset({"starting", "loading_weights"})
# The fail-slow comparison: slower than this fraction of the peer median is a fault.
FAIL_SLOW_FRACTION = 0.25
# Samples kept per member for the fail-slow window (a bound on memory, not a tuning knob).
MAX_WINDOW_SAMPLES = 512


class Status(str, Enum):
    OK = "ok"
    SUSPECT = "suspect"
    FAULT = "fault"


@dataclass(frozen=True)
class Verdict:
    """A rule's conclusion about one member. ``probe`` asks the service to send a probe now."""

    status: Status
    kind: FaultKind | None = None
    evidence: str = ""
    probe: bool = False
    last_progress_at: float | None = None


OK = Verdict(Status.OK)


@dataclass(frozen=True)
class RateSample:
    rx: float
    per_request_rate: float  # tokens/s divided by requests being generated
    busy: bool
    tokens_total: int


@dataclass
class MemberHistory:
    """What the detector knows about one member, every time on the detector's clock."""

    job_id: str
    member_id: str
    role: str
    first_seen: float
    keep_s: float = 600.0
    phase: str = "starting"
    phase_since: float = 0.0
    step: int = -1
    last_seq: int = -1
    last_heard: float | None = None
    samples: int = 0
    dropped: int = 0
    activity: int = 0
    activity_at: float = 0.0
    tokens_total: int = 0
    tokens_at: float = 0.0
    busy_since: float | None = None
    exited: bool = False
    exit_code: int | None = None
    probe_nonce: str | None = None
    probe_sent_at: float | None = None
    probe_reply_at: float | None = None
    window: deque[RateSample] = field(default_factory=lambda: deque(maxlen=MAX_WINDOW_SAMPLES))

    def __post_init__(self) -> None:
        self.phase_since = self.first_seen
        self.activity_at = self.first_seen
        self.tokens_at = self.first_seen

    def observe_sample(self, sample: MetricsSample, rx_time: float) -> bool:
        """Record one metrics sample; return False (and count it) if duplicated or out of order.

        A restarted member gets a new member id, so within one history ``seq`` only grows.
        """
        if sample.seq <= self.last_seq:
            self.dropped += 1
            return False
        first = self.samples == 0
        self.last_seq = sample.seq
        self.samples += 1
        self.last_heard = rx_time
        self._set_phase(sample.phase, rx_time)
        if sample.step >= 0:
            self.step = sample.step
        if first or sample.activity != self.activity:
            self.activity, self.activity_at = sample.activity, rx_time
        if first or sample.tokens_total != self.tokens_total:
            self.tokens_total, self.tokens_at = sample.tokens_total, rx_time
        active = sample.inflight - sample.tool_waiting
        busy = active > 0
        if not busy:
            self.busy_since = None
        elif self.busy_since is None:
            self.busy_since = rx_time
        rate = sample.tokens_per_s / active if busy else 0.0
        self.window.append(RateSample(rx_time, rate, busy, sample.tokens_total))
        while self.window and self.window[0].rx < rx_time - self.keep_s:
            self.window.popleft()
        return True

    def observe_phase(self, msg: PhaseChange, rx_time: float) -> None:
        """Record a phase change (also a sign of life)."""
        self.last_heard = rx_time
        self._set_phase(msg.phase, rx_time)
        if msg.step >= 0:
            self.step = msg.step

    def observe_exit(self, msg: MemberExited) -> None:
        self.exited = True
        self.exit_code = msg.returncode

    def start_probe(self, nonce: str, now: float) -> None:
        self.probe_nonce, self.probe_sent_at = nonce, now

    def observe_probe_reply(self, nonce: str, rx_time: float) -> bool:
        """Record a probe answer; replies to an older probe than the last one sent are ignored."""
        if nonce != self.probe_nonce:
            return False
        self.probe_reply_at = rx_time
        return True

    def _set_phase(self, phase: str, rx_time: float) -> None:
        if phase != self.phase:
            self.phase, self.phase_since = phase, rx_time

    def probe_pending(self, since: float) -> bool:
        """A probe was sent at or after ``since`` and has not been answered."""
        sent = self.probe_sent_at
        return sent is not None and sent >= since and not self.probe_answered(since)

    def probe_answered(self, since: float) -> bool:
        """A probe sent at or after ``since`` was answered."""
        sent, reply = self.probe_sent_at, self.probe_reply_at
        return sent is not None and sent >= since and reply is not None and reply >= sent


# --- per-member rules ---------------------------------------------------------------------


def crash_rule(h: MemberHistory) -> Verdict | None:
    """An unexpected process exit is a crash, no probe needed."""
    if not h.exited:
        return None
    return Verdict(Status.FAULT, "crash", f"process exited unexpectedly (returncode {h.exit_code})",
                   last_progress_at=h.last_heard)


def silence_rule(now: float, h: MemberHistory, cfg: DetectorSpec) -> Verdict | None:
    """Nothing heard (samples, phases or probe answers) for ``silence_s``: probe, then fail."""
    heard = h.last_heard if h.last_heard is not None else h.first_seen
    if h.probe_reply_at is not None:
        heard = max(heard, h.probe_reply_at)
    quiet = now - heard
    if quiet < cfg.silence_s:
        return None
    evidence = f"no metrics for {quiet:.1f}s (silence_s={cfg.silence_s:g})"
    if h.probe_pending(heard):
        assert h.probe_sent_at is not None
        waited = now - h.probe_sent_at
        if waited >= cfg.probe_timeout_s:
            return Verdict(Status.FAULT, "unresponsive", f"{evidence}; probe unanswered for {waited:.1f}s",
                           last_progress_at=h.last_heard)
        return Verdict(Status.SUSPECT, "unresponsive", evidence)
    return Verdict(Status.SUSPECT, "unresponsive", evidence, probe=True)


def trainer_hang_rule(now: float, h: MemberHistory, cfg: DetectorSpec) -> Verdict | None:
    """In phase ``training`` only: no compute activity for ``trainer_idle_s`` is a hang."""
    if h.role != "trainer" or h.phase != "training":
        return None
    since = max(h.activity_at, h.phase_since)
    idle = _evidence_until(now, h) - since
    if idle < cfg.trainer_idle_s:
        return None
    return Verdict(Status.FAULT, "hang",
                   f"training at step {h.step} with no compute activity for {idle:.1f}s "
                   f"(trainer_idle_s={cfg.trainer_idle_s:g})", last_progress_at=h.activity_at)


def rollout_stall_rule(now: float, h: MemberHistory, cfg: DetectorSpec) -> Verdict | None:
    """Requests being generated but no new tokens: probe; no answer -> unresponsive;
    answered but still no tokens at twice the threshold -> hang (alive, making no progress)."""
    if h.role != "rollout" or h.phase in ROLLOUT_EXEMPT_PHASES or h.busy_since is None:
        return None
    since = max(h.tokens_at, h.busy_since)
    stalled = _evidence_until(now, h) - since
    if stalled < cfg.rollout_idle_s:
        return None
    evidence = (f"requests in flight but tokens_total stuck at {h.tokens_total} for {stalled:.1f}s "
                f"(rollout_idle_s={cfg.rollout_idle_s:g})")
    if h.probe_answered(since):
        if stalled >= 2 * cfg.rollout_idle_s:
            return Verdict(Status.FAULT, "hang", f"{evidence}; answers probes but makes no progress",
                           last_progress_at=h.tokens_at)
        return Verdict(Status.SUSPECT, "hang", evidence)
    if h.probe_pending(since):
        assert h.probe_sent_at is not None
        waited = now - h.probe_sent_at
        if waited >= cfg.probe_timeout_s:
            return Verdict(Status.FAULT, "unresponsive", f"{evidence}; probe unanswered for {waited:.1f}s",
                           last_progress_at=h.tokens_at)
        return Verdict(Status.SUSPECT, "hang", evidence)
    return Verdict(Status.SUSPECT, "hang", evidence, probe=True)


def _evidence_until(now: float, h: MemberHistory) -> float:
    """The progress rules judge what the samples show, up to the last one received: a sample
    delayed by load (but within silence_s) is not evidence of a stall; silence is judged
    separately by :func:`silence_rule`."""
    return h.last_heard if h.last_heard is not None else now


def evaluate_member(now: float, h: MemberHistory, cfg: DetectorSpec) -> Verdict:
    """Apply the per-member rules in order; the first that has something to say wins."""
    verdict = crash_rule(h) or silence_rule(now, h, cfg)
    if verdict is not None:
        return verdict
    return trainer_hang_rule(now, h, cfg) or rollout_stall_rule(now, h, cfg) or OK


# --- cross-member rules -------------------------------------------------------------------


def fail_slow_rule(now: float, histories: Iterable[MemberHistory], cfg: DetectorSpec) -> dict[str, Verdict]:
    """Compare busy rollout replicas over the last ``rollout_idle_s``.

    Rates are per request being generated, because a replica decoding one leftover episode
    legitimately produces fewer tokens/s than one decoding a full batch. A replica is slow when
    its best rate in the window is below ``FAIL_SLOW_FRACTION`` of the median of its peers'
    rates and it still made some progress (zero progress is the stall rule's business).

    Returns:
        member id -> FAULT fail_slow verdict, for the slow replicas only.
    """
    span = cfg.rollout_idle_s
    rates: dict[str, tuple[float, float, bool]] = {}  # member -> (best, median, progressed)
    for h in histories:
        if (h.role != "rollout" or h.exited or h.phase in ROLLOUT_EXEMPT_PHASES
                or h.busy_since is None or h.busy_since > now - span
                or h.last_heard is None or now - h.last_heard >= cfg.silence_s):
            continue
        window = [s for s in h.window if s.rx >= now - span and s.busy]
        if len(window) < 2:
            continue
        values = [s.per_request_rate for s in window]
        progressed = window[-1].tokens_total > window[0].tokens_total
        rates[h.member_id] = (max(values), statistics.median(values), progressed)
    verdicts: dict[str, Verdict] = {}
    for member, (best, _median, progressed) in rates.items():
        peers = [med for other, (_b, med, _p) in rates.items() if other != member]
        if not peers or not progressed:
            continue
        peer_median = statistics.median(peers)
        if peer_median > 0 and best < FAIL_SLOW_FRACTION * peer_median:
            verdicts[member] = Verdict(
                Status.FAULT, "fail_slow",
                f"{best:.1f} tokens/s per request for {span:g}s vs peer median {peer_median:.1f}")
    return verdicts


# --- one job ------------------------------------------------------------------------------


def new_fault_id() -> str:
    return uuid.uuid4().hex[:12]


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
        self._new_id = new_id
        self._tool_faults: dict[tuple[str, str], float] = {}  # (member, tool) -> last seen

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
                           step=step if isinstance(step, int) else -1)

    def tick(self, now: float) -> TickResult:
        """Evaluate every member at ``now``: the probes to send and the faults to report."""
        out = TickResult()
        if self.cfg is None:
            return out
        healthy: list[MemberHistory] = []
        for h in list(self.members.values()):
            if h.member_id in self.reported:
                continue
            verdict = evaluate_member(now, h, self.cfg)
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
        return out

    def _report(self, h: MemberHistory, verdict: Verdict, now: float) -> FaultReport:
        self.reported.add(h.member_id)
        assert verdict.kind is not None
        return FaultReport(job_id=self.job_id, fault_id=self._new_id(), role=h.role,  # type: ignore[arg-type]
                           member_id=h.member_id, kind=verdict.kind, evidence=verdict.evidence,
                           detected_at=now, step=h.step, last_progress_at=verdict.last_progress_at)


def _is_token(text: str) -> bool:
    return bool(_TOKEN.match(text))
