"""What one pull cost: bytes (and bytes fetched again), chunks per source, corrupt chunks, control
messages, and each chunk's transfer (``Transfer``), for the loader's events and the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Transfer:
    """One chunk received: from where, and when (seconds since the pull started)."""

    chunk: int
    source: str
    start_s: float
    end_s: float
    nbytes: int
    ok: bool


@dataclass
class PullStats:
    """What one pull cost. ``bytes_resent`` counts received bytes that had to be fetched again
    (partial chunks from failed sources, corrupt chunks)."""

    bytes_received: int = 0
    bytes_resent: int = 0
    chunks_from: dict[str, int] = field(default_factory=dict)
    corrupt_chunks: int = 0
    failed_sources: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    schedule: list[Transfer] = field(default_factory=list)
    control_msgs: int = 0
    """Messages this puller sent that moved no chunk: HAVE requests, CANCELs, and chunk requests
    answered without one (chunks received: ``sum(chunks_from.values())``)."""
    offers: int = 0
    """Offers sources made to this puller (subscriptions); ``passed_busy`` and ``passed_none`` of
    them it passed (receiving at its limit; nothing in them wanted)."""
    passed_busy: int = 0
    passed_none: int = 0
    have_requests: int = 0
    """HAVE requests sent (part of ``control_msgs``)."""
    sub_messages: int = 0
    """Subscriptions and their updates sent (part of ``control_msgs``)."""
    pick_s: list[float] = field(default_factory=list)
    """Seconds each chunk pick took here (the scheduling cost per chunk; with subscriptions, the
    answer to an offer: the source's pick is ``WeightServer.pick_s``)."""

