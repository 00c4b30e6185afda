"""nats's own errors are translated at the bus's edge (``robustrl.errors``): a publish on a
connection nats refuses raised ``nats.errors.ConnectionClosedError`` or
``OutboundBufferLimitError``, which callers handling ``TransportError`` let through (a replica's
load then ended as a failed pull: an outside review). And a member's phase change lost on the bus
is no failure of the work that changed it: the phase is set, every metrics sample carries it.
Real NATS."""

from __future__ import annotations

import uuid

import pytest

from robustrl.bus import Bus
from robustrl.config import Settings
from robustrl.errors import TransportError
from robustrl.member import Identity, Member
from robustrl.messages import HelloAck
from robustrl.subjects import Verb, subject

pytestmark = pytest.mark.timeout(60)


async def test_a_publish_nats_refuses_raises_transport_error_and_a_phase_change_does_not(infra: Settings) -> None:
    job = f"buserr-{uuid.uuid4().hex[:8]}"
    bus = await Bus.connect(infra.nats_url, "bus-errors")
    await bus.client.close()  # closed: nats refuses every publish from now on
    with pytest.raises(TransportError, match="ConnectionClosedError"):
        await bus.publish(subject(job, Verb.HELLO, "m"), HelloAck(job_id=job, member_id="m"))
    with pytest.raises(TransportError):
        await bus.respond("_INBOX.x", HelloAck(job_id=job, member_id="m"))

    member = Member(Identity(job, "rollout-0-i0", "rollout"), infra)
    member.bus = bus
    await member.set_phase("loading_weights")  # not raised
    assert member.phase == "loading_weights" and member.sample().phase == "loading_weights"
