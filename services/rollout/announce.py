"""Which weight announcement a replica follows (pure; no I/O).

Announcements are ordered by the publishing gang's epoch first, version second. A new gang
(higher epoch) always wins, even with a lower version: it resumed from an older checkpoint
and redoes the steps after it. An announcement from an older epoch than the newest one seen
is ignored whatever version it claims: a stale gang (partitioned away, or not yet killed on
another host) must never steer replicas, and ordering by version first would let it win by
being ahead (issue 9 item 3, DESIGN section 4 "Every side effect is fenced").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from robustrl.messages import WeightsAnnounce


class Offer(enum.Enum):
    """What an announcement means to the replica."""

    NEW = "new"  # a version to pull (supersedes any pull under way)
    REPEAT = "repeat"  # the version already followed, maybe with new sources
    OLDER = "older"  # an older version of the newest epoch: ignore
    STALE_EPOCH = "stale_epoch"  # from a gang older than the newest seen: ignore


@dataclass
class Announcements:
    """The newest epoch seen and the announcement the replica follows."""

    newest_epoch: int = -1
    target: WeightsAnnounce | None = None

    def offer(self, msg: WeightsAnnounce) -> Offer:
        """Judge ``msg`` and, when it is NEW or a REPEAT, make it the one followed."""
        if msg.epoch < self.newest_epoch:
            return Offer.STALE_EPOCH
        cur = self.target
        if cur is not None and msg.epoch == cur.epoch:
            if msg.version < cur.version:
                return Offer.OLDER
            if msg.version == cur.version and msg.checksum == cur.checksum:
                self.target = msg  # the same weights; its source list may be newer
                return Offer.REPEAT
        self.newest_epoch = msg.epoch
        self.target = msg
        return Offer.NEW
