"""Phase-aware fault rules (DESIGN section 3, "Detect"): pure functions of (now, history, config).

Nothing here touches NATS, a clock or torch. The detector service feeds each member's
messages into a :class:`MemberHistory` stamped with the *receiver's* clock (``rx_time``), never
the member's own ``ts``: clocks of different machines may disagree by hours, and only the
detector's clock is comparable with itself. :class:`~robustrl.services.detector.monitor.JobMonitor`
holds every history of one job and turns a tick into the probes to send and the faults to
report; tests drive it with a fake ``now``.

Rules, in the order they are applied to one member (each verdict names a :class:`Cause` and
the time its evidence says the fault began, ``fault_at``):

* exit: ``MemberExited(expected=False)`` -> FAULT crash at once (``fault_at``: the exit time
  the launcher stamped).
* GPU lost: a sample says NVML reports the member's GPU lost (Xid 79, robustrl.gpu) -> FAULT
  crash at once (``fault_at``: that sample). GPU utilisation is never progress for the rules
  below: a collective stuck in NCCL keeps its GPU 100 % busy.
* silence: nothing heard for ``silence_s`` -> SUSPECT (probe); probe unanswered within
  ``probe_timeout_s`` -> FAULT unresponsive. A probe answer counts as being heard, so a member
  that answers probes is never called unresponsive. Only this rule runs while a member is
  silent: the other rules would judge stale data. ``fault_at``: the last message heard.
* weights failed: a replica that reports phase ``weights_failed`` (its pulls of the announced
  version failed or did not verify, ``pull_attempts`` times) -> FAULT hang at once.
* weights load: a replica in phase ``loading_weights`` for ``weights_load_s`` -> FAULT hang
  (``weights_load_timeout``): a pull that never finishes is a fault, never silence.
* trainer hang: only in phase ``training``, ``activity`` unchanged for ``trainer_idle_s`` ->
  FAULT hang. Every other trainer phase (waiting for a batch, checkpointing...) may be idle.
* trainer I/O: in phase ``checkpointing`` or ``publishing`` for ``trainer_io_s`` -> FAULT hang
  (``trainer_io_stalled``): idle there is normal, forever is not (a snapshot or publish that never
  returns, the member's metrics still flowing, stalled the job for good). Waiting for a batch is
  bounded by the request manager's commit deadline.
* rollout stall: ``tokens_total`` unchanged for ``rollout_idle_s`` while the replica holds work
  - requests being generated (``inflight - tool_waiting > 0``) or turns queued
  (``queue_depth > 0``, which counts turns waiting for a weights version) -> SUSPECT (probe);
  probe unanswered -> FAULT unresponsive; probe answered but still no progress at
  ``2 x rollout_idle_s`` -> FAULT hang. No work, or every request waiting on a tool, is normal
  idleness. ``fault_at``: the first sample that showed work and no progress.
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
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from robustrl.config import DetectorSpec
from robustrl.messages import FaultKind
from robustrl.services.detector.history import MemberHistory

# Rollout phases in which zero throughput is expected even with work assigned: a replica that
# is starting or swapping weights holds its requests without decoding, and one whose queued turns
# all need a version it does not hold yet (``awaiting_version``: after a trainer rollback, until
# the new gang trains up to it again; reported as hung before 2026-12-02, and replaced). A process
# that hangs there still goes silent and is caught by the silence rule; a load that never ends is
# bounded by ``weights_load_s``, a version that never comes by the request manager's step deadline.
ROLLOUT_EXEMPT_PHASES = frozenset({"starting", "loading_weights", "weights_failed", "awaiting_version"})
# The fail-slow comparison: slower than this fraction of the peer median is a fault.
FAIL_SLOW_FRACTION = 0.25


class Status(str, Enum):
    OK = "ok"
    SUSPECT = "suspect"
    FAULT = "fault"


class Cause(str, Enum):
    """The named cause a fault report carries (``FaultReport.cause``)."""

    EXIT = "exit"
    SILENCE = "silence"
    TRAINING_STALLED = "training_stalled"
    ROLLOUT_STALLED = "rollout_stalled"  # requests in flight, no tokens
    QUEUE_STALLED = "queue_stalled"  # turns queued, nothing taken up, no tokens
    WEIGHTS_LOAD_TIMEOUT = "weights_load_timeout"
    TRAINER_IO_STALLED = "trainer_io_stalled"
    WEIGHTS_FAILED = "weights_failed"
    GPU_LOST = "gpu_lost"
    FAIL_SLOW = "fail_slow"
    TOOL_OUTAGE = "tool_outage"


@dataclass(frozen=True)
class Verdict:
    """A rule's conclusion about one member. ``probe`` asks the service to send a probe now;
    ``fault_at`` is when the evidence says the fault began."""

    status: Status
    kind: FaultKind | None = None
    evidence: str = ""
    probe: bool = False
    last_progress_at: float | None = None
    cause: Cause | None = None
    fault_at: float | None = None


OK = Verdict(Status.OK)


# --- per-member rules ---------------------------------------------------------------------


def crash_rule(h: MemberHistory) -> Verdict | None:
    """An unexpected process exit is a crash, no probe needed."""
    if not h.exited:
        return None
    return Verdict(Status.FAULT, "crash", f"process exited unexpectedly (returncode {h.exit_code})",
                   last_progress_at=h.last_heard, cause=Cause.EXIT,
                   fault_at=h.exit_at if h.exit_at is not None else h.last_heard)


def gpu_lost_rule(h: MemberHistory) -> Verdict | None:
    """The driver says the member's GPU is lost: a crash, no probe needed (its process may still
    answer probes and send metrics, but can compute nothing on that device again)."""
    if h.gpu_lost_at is None:
        return None
    return Verdict(Status.FAULT, "crash", "NVML reports the member's GPU lost (fallen off the bus, Xid 79)",
                   last_progress_at=h.activity_at, cause=Cause.GPU_LOST, fault_at=h.gpu_lost_at)


def silence_rule(now: float, h: MemberHistory, cfg: DetectorSpec) -> Verdict | None:
    """Nothing heard (samples, phases or probe answers) for ``silence_s``: probe, then fail."""
    heard = h.heard_at()
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
                           last_progress_at=h.last_heard, cause=Cause.SILENCE, fault_at=heard)
        return Verdict(Status.SUSPECT, "unresponsive", evidence)
    return Verdict(Status.SUSPECT, "unresponsive", evidence, probe=True)


def weights_rule(now: float, h: MemberHistory, cfg: DetectorSpec) -> Verdict | None:
    """A replica that says its weight pulls failed, or that has been loading weights for longer
    than ``weights_load_s``, is faulty: the step waits for its version, so silence would stall
    the job without a fault."""
    if h.role != "rollout":
        return None
    if h.phase == "weights_failed":
        return Verdict(Status.FAULT, "hang", "replica reports its weight pulls failed or did not verify "
                       "(see its weights_rejected events)", last_progress_at=h.tokens_at,
                       cause=Cause.WEIGHTS_FAILED, fault_at=h.phase_since)
    return _phase_bound(now, h, cfg)


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
                   f"(trainer_idle_s={cfg.trainer_idle_s:g})", last_progress_at=h.activity_at,
                   cause=Cause.TRAINING_STALLED,
                   fault_at=h.still_since(h.activity_at, h.activity_still_at, since))


PHASE_BOUNDS: dict[tuple[str, str], tuple[str, Cause]] = {
    ("rollout", "loading_weights"): ("weights_load_s", Cause.WEIGHTS_LOAD_TIMEOUT),
    ("trainer", "checkpointing"): ("trainer_io_s", Cause.TRAINER_IO_STALLED),
    ("trainer", "publishing"): ("trainer_io_s", Cause.TRAINER_IO_STALLED),
}
"""Phases a member may sit in idle, but not for longer than a threshold: (role, phase) ->
(the threshold's name in ``DetectorSpec``, the cause)."""


def trainer_io_rule(now: float, h: MemberHistory, cfg: DetectorSpec) -> Verdict | None:
    """In phase ``checkpointing`` or ``publishing`` for ``trainer_io_s`` is a hang."""
    return _phase_bound(now, h, cfg) if h.role == "trainer" else None


def _phase_bound(now: float, h: MemberHistory, cfg: DetectorSpec) -> Verdict | None:
    """A member in a bounded phase (``PHASE_BOUNDS``) for longer than its threshold: a hang."""
    bound = PHASE_BOUNDS.get((h.role, h.phase))
    if bound is None:
        return None
    name, cause = bound
    limit = float(getattr(cfg, name))
    held = _evidence_until(now, h) - h.phase_since
    if held < limit:
        return None
    return Verdict(Status.FAULT, "hang", f"in phase {h.phase} at step {h.step} for {held:.1f}s ({name}={limit:g})",
                   last_progress_at=h.tokens_at if h.role == "rollout" else h.phase_since, cause=cause,
                   fault_at=h.phase_since)


def rollout_stall_rule(now: float, h: MemberHistory, cfg: DetectorSpec) -> Verdict | None:
    """Work held (in flight or queued) but no new tokens: probe; no answer -> unresponsive;
    answered but still no tokens at twice the threshold -> hang (alive, making no progress)."""
    if h.role != "rollout" or h.phase in ROLLOUT_EXEMPT_PHASES or h.work_since is None:
        return None
    since = max(h.tokens_at, h.work_since)
    stalled = _evidence_until(now, h) - since
    if stalled < cfg.rollout_idle_s:
        return None
    if h.busy_since is not None:
        cause, what = Cause.ROLLOUT_STALLED, "requests in flight"
    else:
        cause, what = Cause.QUEUE_STALLED, f"{h.queue_depth} turns queued, none taken up,"
    evidence = (f"{what} but tokens_total stuck at {h.tokens_total} for {stalled:.1f}s "
                f"(rollout_idle_s={cfg.rollout_idle_s:g})")
    fault_at = h.still_since(h.tokens_at, h.tokens_still_at, h.work_since)
    if h.probe_answered(since):
        if stalled >= 2 * cfg.rollout_idle_s:
            return Verdict(Status.FAULT, "hang", f"{evidence}; answers probes but makes no progress",
                           last_progress_at=h.tokens_at, cause=cause, fault_at=fault_at)
        return Verdict(Status.SUSPECT, "hang", evidence)
    if h.probe_pending(since):
        assert h.probe_sent_at is not None
        waited = now - h.probe_sent_at
        if waited >= cfg.probe_timeout_s:
            return Verdict(Status.FAULT, "unresponsive", f"{evidence}; probe unanswered for {waited:.1f}s",
                           last_progress_at=h.tokens_at, cause=cause, fault_at=fault_at)
        return Verdict(Status.SUSPECT, "hang", evidence)
    return Verdict(Status.SUSPECT, "hang", evidence, probe=True)


def _evidence_until(now: float, h: MemberHistory) -> float:
    """The progress rules judge what the samples show, up to the last one received: a sample
    delayed by load (but within silence_s) is not evidence of a stall; silence is judged
    separately by :func:`silence_rule`."""
    return h.last_heard if h.last_heard is not None else now


def evaluate_member(now: float, h: MemberHistory, cfg: DetectorSpec) -> Verdict:
    """Apply the per-member rules in order; the first that has something to say wins."""
    verdict = crash_rule(h) or gpu_lost_rule(h) or silence_rule(now, h, cfg)
    if verdict is not None:
        return verdict
    return (weights_rule(now, h, cfg) or trainer_hang_rule(now, h, cfg) or trainer_io_rule(now, h, cfg)
            or rollout_stall_rule(now, h, cfg) or OK)


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
                f"{best:.1f} tokens/s per request for {span:g}s vs peer median {peer_median:.1f}",
                cause=Cause.FAIL_SLOW, fault_at=now - span)
    return verdicts
