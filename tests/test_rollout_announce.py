"""Which weight announcement a replica follows (pure): a newer gang epoch always wins, an older
one is ignored whatever version it claims; within one epoch the higher version wins."""

from __future__ import annotations

from robustrl.messages import WeightsAnnounce
from robustrl.services.rollout.announce import Announcements, Offer


def ann(version: int, epoch: int, checksum: str = "", sources: tuple[str, ...] = ("t0:1",)) -> WeightsAnnounce:
    return WeightsAnnounce(job_id="j", version=version, epoch=epoch, checksum=checksum or f"c{version}e{epoch}",
                           sources=list(sources), manifest={})


def test_a_stale_gang_announcing_a_higher_version_is_ignored() -> None:
    a = Announcements()
    assert a.offer(ann(5, epoch=2)) is Offer.NEW
    # the old gang (epoch 1), partitioned away, still publishes and is ahead in versions
    assert a.offer(ann(9, epoch=1)) is Offer.STALE_EPOCH
    assert a.target is not None and (a.target.version, a.target.epoch) == (5, 2)


def test_a_new_gang_redoing_from_an_older_checkpoint_wins_with_a_lower_version() -> None:
    a = Announcements()
    a.offer(ann(9, epoch=1))
    assert a.offer(ann(6, epoch=2)) is Offer.NEW  # resumed from checkpoint 5, redoes step 6
    assert a.newest_epoch == 2
    assert a.offer(ann(9, epoch=1)) is Offer.STALE_EPOCH  # a late copy of the old announcement


def test_within_an_epoch_versions_only_move_forward_and_repeats_are_recognised() -> None:
    a = Announcements()
    a.offer(ann(3, epoch=1))
    assert a.offer(ann(2, epoch=1)) is Offer.OLDER
    assert a.offer(ann(3, epoch=1, sources=("t0:1", "t1:1"))) is Offer.REPEAT
    assert a.target is not None and a.target.sources == ["t0:1", "t1:1"]  # newer sources are kept
    assert a.offer(ann(4, epoch=1)) is Offer.NEW


def test_the_newest_epoch_is_remembered_even_when_nothing_is_pulled() -> None:
    a = Announcements()
    a.offer(ann(3, epoch=4))
    assert a.offer(ann(100, epoch=3)) is Offer.STALE_EPOCH
    assert a.offer(ann(1, epoch=0)) is Offer.STALE_EPOCH
