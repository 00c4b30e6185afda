"""A real rollout replica process (real NATS, real weight servers): after a late swap whose HAVE
was rightly held back, a rollback to that very version must make the replica announce it holds
it, once. The controller ends a replacement's recovery on that HAVE, and peers count the
replica as a relay of the version by it.

Observed from outside, on the raw bus: the replica's own HAVE announcements, in the order its
one connection sent them, and the JetStream event log.
"""

from __future__ import annotations

import pytest
from support import eventually_async
from test_rollout_replica import (  # noqa: F401
    WAIT_S, Replica, _matching, _served, late_swap_then_dying_pull, launcher, make_version, replica,
)

from robustrl.weights import Fault, WeightServer

pytestmark = pytest.mark.timeout(600)


async def test_a_rollback_to_a_late_swaps_version_makes_the_replica_announce_it_held(
        replica: Replica) -> None:  # noqa: F811 - the fixture imported above
    """The engine (stalled) is swapping v2 in when v3 is announced; v3's publisher dies after two
    chunks, so v3's pull goes on when the v2 swap ends, and v2's HAVE is held back (the partial
    HAVE of v3 stays the last word). Then a new gang resumes at v2 (epoch 2, same weights): the
    replica holds it and stops pulling v3. Before: it said nothing more, so peers still heard
    "pulling v3" from it, and the controller, which ends a replacement's recovery on a HAVE,
    waited for its deadline."""
    servers: list[WeightServer] = []

    def own() -> list[tuple[int, str, bool]]:
        return [(h.version, h.checksum, h.complete) for h in replica.haves if h.member_id == replica.member_id]

    try:
        v2, v3, v4 = make_version(2, seed=42), make_version(3, seed=43), make_version(4, seed=44)
        servers.append(await _served(WeightServer(), v2))
        servers.append(await _served(WeightServer(fault=Fault("die", after_chunks=2)), v3))
        servers.append(await _served(WeightServer(), v4))
        await late_swap_then_dying_pull(replica, v2, servers[0], v3, servers[1], stall_s=8.0)
        assert own()[-1] == (3, v3.checksum, False), own()  # held back: v3's pull is the last word

        before = len(own())
        await replica.announce(v2, epoch=2, sources=[servers[0].address or ""])  # the rollback
        await eventually_async(lambda: (2, v2.checksum, True) in own()[before:], timeout=WAIT_S,
                               what="the replica's HAVE of v2 after the rollback to it")
        # Once: the next version's HAVEs come after it on the same connection, nothing between.
        await replica.announce(v4, epoch=2, sources=[servers[2].address or ""])
        await eventually_async(lambda: (4, v4.checksum, True) in own(), timeout=WAIT_S,
                               what="the replica's HAVE of v4")
        assert own()[before:] == [(2, v2.checksum, True), (4, v4.checksum, False), (4, v4.checksum, True)], own()
    finally:
        for s in servers:
            await s.close()
