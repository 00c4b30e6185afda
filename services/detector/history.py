"""What the detector knows about one member: a :class:`MemberHistory` fed with messages
stamped with the *receiver's* clock (``rx_time``), never the member's own ``ts``.

Besides the last value of each progress counter and when it last changed, a history keeps
the first sample *after* that change that showed no progress (``*_still_at``): that sample is
the evidence of when a stall began, which a fault report carries as ``fault_at`` so detection
delay can be measured for faults nobody injected.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from robustrl.messages import MemberExited, MetricsSample, PhaseChange

# Samples kept per member for the fail-slow window (a bound on memory, not a tuning knob).
MAX_WINDOW_SAMPLES = 512


@dataclass(frozen=True)
class RateSample:
    rx: float
    per_request_rate: float  # tokens/s divided by requests being generated
    busy: bool
    tokens_total: int


@dataclass
class MemberHistory:
    """What the detector knows about one member, every time on the detector's clock.

    ``busy_since``: requests are being generated (in flight, not waiting on a tool).
    ``work_since``: the replica holds work at all - being generated or queued (including
    turns queued for a weights version it does not hold yet). Zero tokens with work held is
    a stall; queued work must count, or a replica whose engine takes no work looks idle.
    """

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
    activity_still_at: float | None = None
    tokens_total: int = 0
    tokens_at: float = 0.0
    tokens_still_at: float | None = None
    queue_depth: int = 0
    busy_since: float | None = None
    work_since: float | None = None
    gpu_lost_at: float | None = None
    """When a sample first said NVML reports the member's GPU lost (robustrl.gpu)."""
    exited: bool = False
    exit_code: int | None = None
    exit_at: float | None = None
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
            self.activity, self.activity_at, self.activity_still_at = sample.activity, rx_time, None
        elif self.activity_still_at is None:
            self.activity_still_at = rx_time
        if first or sample.tokens_total != self.tokens_total:
            self.tokens_total, self.tokens_at, self.tokens_still_at = sample.tokens_total, rx_time, None
        elif self.tokens_still_at is None:
            self.tokens_still_at = rx_time
        active = sample.inflight - sample.tool_waiting
        busy = active > 0
        self.busy_since = None if not busy else rx_time if self.busy_since is None else self.busy_since
        self.queue_depth = sample.queue_depth
        if sample.gpu_lost and self.gpu_lost_at is None:
            self.gpu_lost_at = rx_time
        has_work = busy or (self.role == "rollout" and sample.queue_depth > 0)
        self.work_since = None if not has_work else rx_time if self.work_since is None else self.work_since
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
        self.exit_at = msg.ts

    def start_probe(self, nonce: str, now: float) -> None:
        self.probe_nonce, self.probe_sent_at = nonce, now

    def observe_probe_reply(self, nonce: str, rx_time: float) -> bool:
        """Record a probe answer; replies to an older probe than the last one sent are ignored."""
        if nonce != self.probe_nonce:
            return False
        self.probe_reply_at = rx_time
        return True

    def rebase(self, now: float, gap_s: float) -> None:
        """The detector was not watching for the ``gap_s`` up to ``now`` (frozen, suspended, its
        loop starved, its bus connection down): that time is no evidence about the member. Every
        clock moves forward by it, never past ``now``: what was measured before the gap still
        counts, the gap does not. (Reset to ``now``, as before, a detector whose ticks came late
        once per rebase window never accumulated a threshold longer than that window: a trainer
        hung in ``training`` for an hour went unreported with ``trainer_idle_s`` 300 s and a
        20 s late tick every 81 s; an outside review.) Probes in flight and the rate window are
        forgotten: their answers and samples may have been lost in the gap."""
        def later(t: float | None) -> float | None:
            return None if t is None else min(now, t + gap_s)

        self.first_seen = min(now, self.first_seen + gap_s)
        self.last_heard = later(self.last_heard)
        self.phase_since = min(now, self.phase_since + gap_s)
        self.activity_at = min(now, self.activity_at + gap_s)
        self.tokens_at = min(now, self.tokens_at + gap_s)
        self.activity_still_at, self.tokens_still_at = later(self.activity_still_at), later(self.tokens_still_at)
        self.busy_since, self.work_since = later(self.busy_since), later(self.work_since)
        self.probe_nonce = self.probe_sent_at = self.probe_reply_at = None
        self.window.clear()

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

    def heard_at(self) -> float:
        """When the member last showed any sign of life (first sight if never)."""
        return self.last_heard if self.last_heard is not None else self.first_seen

    def still_since(self, changed_at: float, still_at: float | None, since: float) -> float:
        """The first sample at or after ``since`` that showed no progress (evidence time)."""
        return max(still_at if still_at is not None else changed_at, since)
