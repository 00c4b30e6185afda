"""Sources schedule relayed pulls (issue 12): a subscriber tells each source which chunks it wants,
and a source with an upload slot free offers it chunks. These tests drive ``WeightServer``'s side
through its handler API (no sockets), and the puller's answer to an offer, for the rules the
testbed fan-out depends on: a publisher sends each chunk once to patient subscribers taking turns,
relays offer the chunk their subscribers hold least, one upload at a time with the next lined up
at the halfway point, busy subscribers are left alone until the time they name, and a subscriber
takes one chunk at a time unless the extra one is fresh from a publisher.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from support import eventually_async

from robustrl.weights import WeightServer
from robustrl.weights.manifest import Manifest, TensorEntry, build_manifest
from robustrl.weights.puller import NEAR_DONE, QUEUED_START, _Pull
from robustrl.weights.server import _Sub
from robustrl.weights.transport import Offer, Reply, Status, SubMessage

N = 12


def _manifest(chunks: int = N, chunk_bytes: int = 64) -> tuple[np.ndarray, Manifest]:
    n = chunks * chunk_bytes
    data = np.random.default_rng(chunks).integers(0, 256, n, dtype=np.uint8)
    return data, build_manifest(1, [TensorEntry(name="flat", dtype="uint8", shape=[n], offset=0, nbytes=n)],
                                data, chunk_bytes)


def _want(chunks: set[int] | range, n: int = N, patient: bool = True, busy_ms: int = 0, chunk: int = -1) -> SubMessage:
    flags = np.zeros(n, dtype=bool)
    flags[list(chunks)] = True
    return SubMessage(np.packbits(flags, bitorder="little").tobytes(), patient, chunk, busy_ms)


async def _upload(server: WeightServer, sub: _Sub, chunk: int, want: set[int]) -> Reply:
    """Take ``chunk`` from the pending offer and send it whole (the transport's part)."""
    reply = sub.take(_want(want, chunk=chunk))
    assert reply.status is Status.OK and reply.index == chunk
    await server.begin(reply)
    server.halfway(reply)
    server.done(reply, len(reply.payload))
    return reply


async def test_a_publisher_sends_each_chunk_once_to_patient_subscribers_taking_turns() -> None:
    data, manifest = _manifest()
    server = WeightServer()
    server.add_version(manifest, data)
    subs = [server.subscribe(1, _want(range(N))) for _ in range(3)]
    wants = [set(range(N)) for _ in subs]
    sent: list[int] = []
    served: list[int] = []
    for _ in range(N):
        ready = [i for i, s in enumerate(subs) if s.offer.done()]
        assert len(ready) == 1  # one upload slot: one offer out at a time
        i = ready[0]
        offer = subs[i].offer.result()
        assert offer.fresh and offer.chunks[0] not in sent  # never sent before: fresh
        chunk = offer.chunks[0]
        wants[i].discard(chunk)
        await _upload(server, subs[i], chunk, wants[i])
        sent.append(chunk)
        served.append(i)
    assert sorted(sent) == list(range(N))  # each chunk left the publisher once
    assert served[:6] == [0, 1, 2, 0, 1, 2]  # subscribers take turns
    assert not any(s.offer.done() for s in subs)  # patient: no repeats on offer
    subs[0].update(_want(wants[0], patient=False))  # starving: repeats are fine
    assert subs[0].offer.done() and not subs[0].offer.result().fresh
    assert server.bytes_sent == N * manifest.chunk_bytes


async def test_a_relay_offers_the_chunk_its_subscribers_hold_least() -> None:
    data, manifest = _manifest()
    server = WeightServer()
    server.add_version(manifest, data, complete=False)
    for c in (0, 1, 2):
        server.mark_chunk(1, c)
    # two subscribers already hold chunk 0 and one holds chunk 1: chunk 2 is the rarest
    server.subscribe(1, _want(set(range(N)) - {0, 1}))
    server.subscribe(1, _want(set(range(N)) - {0}))
    asker = server.subscribe(1, _want(range(N)))
    offers = [s.offer.result() for s in server._subs if s.offer.done()]
    assert len(offers) == 1
    offer = offers[0]
    assert not offer.fresh
    if asker.offer.done():
        assert offer.chunks == [2, 1, 0]  # rarest first, then the next rarest
    else:
        assert offer.chunks[0] == 2


async def test_the_next_offer_goes_out_at_the_halfway_point_and_its_chunk_waits_for_the_slot() -> None:
    data, manifest = _manifest()
    server = WeightServer()
    server.add_version(manifest, data)
    a = server.subscribe(1, _want(range(N)))
    b = server.subscribe(1, _want(range(N)))
    assert a.offer.done() and not b.offer.done()
    first = a.take(_want(set(range(N)) - {a.offer.result().chunks[0]}, chunk=a.offer.result().chunks[0]))
    await server.begin(first)
    assert not b.offer.done()  # the first upload has not reached its halfway point
    server.halfway(first)
    assert b.offer.done() and b.offer.result().queued  # lined up behind the upload in progress
    chunk = b.offer.result().chunks[0]
    second = b.take(_want(set(range(N)) - {chunk}, chunk=chunk))
    waiting = asyncio.ensure_future(server.begin(second))
    await asyncio.sleep(0.01)  # a window for a wrong start: it must not begin meanwhile
    assert not waiting.done()  # one upload slot: it waits for the first upload to end
    server.done(first, len(first.payload))
    await asyncio.wait_for(waiting, 1)
    server.done(second, len(second.payload))
    assert server.load() == 1  # the next offer (to a) is out


async def test_a_busy_subscriber_is_offered_again_only_when_it_said_it_would_be_free() -> None:
    data, manifest = _manifest()
    server = WeightServer()
    server.add_version(manifest, data)
    sub = server.subscribe(1, _want(range(N)))
    assert sub.offer.done()
    sub.pass_(_want(range(N), busy_ms=80))
    assert not sub.offer.done()
    await asyncio.sleep(0.03)  # a window within the 80 ms busy time: no offer may come in it
    assert not sub.offer.done()
    await eventually_async(sub.offer.done, timeout=5.0, interval=0.005, what="offered again once free")
    assert sub.offer.done()  # a timer offered again once it was free


async def test_waiting_fetches_come_before_offers_and_a_dropped_version_ends_subscriptions() -> None:
    data, manifest = _manifest()
    server = WeightServer()
    server.add_version(manifest, data)
    sub = server.subscribe(1, _want(range(N)))
    offer = sub.offer.result()
    other = 5 if offer.chunks[0] != 5 else 6  # (once sent, the offered chunk is no longer fresh: not re-offered)
    fetch = server.request_chunk(1, other)
    assert not fetch.future.done()  # the offer holds the pipeline
    sub.pass_(_want(set()))  # nothing wanted any more
    assert fetch.future.done() and fetch.future.result().index == other
    assert not sub.offer.done()
    sub.update(_want({offer.chunks[0]}))
    server.done(fetch.future.result(), 0)
    assert sub.offer.done()
    sub.pass_(_want({offer.chunks[0]}, busy_ms=5000))  # busy: no offer meanwhile
    assert not sub.offer.done()
    server.drop_version(1)
    assert sub.offer.result() is None  # the transport answers MISSING and ends it
    assert server.subscribe(1, _want(range(N))) is None


async def test_an_unanswered_offer_gives_its_place_up_after_the_stall_bound_and_stays_valid() -> None:
    """An offer left unanswered (a frozen subscriber) holds the one place in line only for
    ``send_stall_s``: then a waiting FETCH goes. The offer stays valid (the subscription ends only
    at the answer timeout): a late TAKE is served, lined up like a FETCH, and every place taken is
    given back once (the counts below, step by step: a double release would hide at zero)."""
    data, manifest = _manifest()
    server = WeightServer(send_stall_s=0.05)
    server.add_version(manifest, data)
    sub = server.subscribe(1, _want(range(N)))
    offer = sub.offer.result()
    other = 5 if offer.chunks[0] != 5 else 6
    fetch = server.request_chunk(1, other)
    assert not fetch.future.done()  # the offer holds the pipeline, for now
    first = await asyncio.wait_for(fetch.future, 5)  # the hold ran out: the FETCH goes
    assert first.index == other and server._pipeline == 1
    assert sub.offered == offer.chunks and not sub.closed  # still valid
    late = sub.take(_want(set(), chunk=offer.chunks[0]))  # (then it wants nothing more)
    assert late.status is Status.OK and late.index == offer.chunks[0]
    assert server._pipeline == 2  # its own place: the offer had none left to hand it
    for reply in (first, late):
        await server.begin(reply)
        server.halfway(reply)
        server.done(reply, len(reply.payload))
    assert server._pipeline == 0 and server.load() == 0 and not server._slots.locked()


def _puller(manifest: Manifest) -> _Pull:
    return _Pull(manifest, [], "tcp", None, None, stall_timeout_s=1.0, connect_timeout_s=1.0, max_inflight=4,
                 per_source_inflight=1, have_interval_s=0.01, unavailable_grace_s=1.0, seed=0)


class _Progress:
    def __init__(self, received: int) -> None:
        self.payload_received = received


@pytest.mark.parametrize("done_fraction", [0.0, 0.5, 0.9])
def test_a_subscriber_takes_one_chunk_at_a_time_but_fresh_ones_at_once(done_fraction: float) -> None:
    _, manifest = _manifest()
    p = _puller(manifest)
    p.chunk_s = 0.1
    assert p._choose(Offer([3, 4])) == (3, 0)  # nothing on its way: take the first wanted
    assert p._choose(Offer([3, 4]), bad={3}) == (4, 0)  # never what this source sent corrupt
    assert p._choose(Offer([3]), bad={3}) == (-1, 0)
    p.want[3] = False
    assert p._choose(Offer([3, 4])) == (4, 0)
    nbytes = manifest.chunks[0].nbytes
    p.streams["x"] = (0, _Progress(int(done_fraction * nbytes)), 0)  # type: ignore[assignment]
    left = 1 - done_fraction
    immediate = p._choose(Offer([4]))
    queued = p._choose(Offer([4], queued=True))
    assert (immediate[0] == 4) == (left <= NEAR_DONE)
    assert (queued[0] == 4) == (left - QUEUED_START <= NEAR_DONE)
    if immediate[0] < 0:  # busy until the stream would be near done
        assert immediate[1] == pytest.approx((left - NEAR_DONE) * 1000 * p.chunk_s, abs=1)
    assert p._choose(Offer([4], fresh=True)) == (4, 0)  # fresh from a publisher: even while receiving
    p.want[:] = False
    assert p._choose(Offer([4], fresh=True)) == (-1, 0)  # nothing wanted: a plain pass


def test_the_tuned_raw_probe_uses_the_weight_sources_socket_options() -> None:
    from robustrl.testbed import probe
    from robustrl.weights import tcp

    assert probe.TUNED_NOTSENT_LOWAT == tcp.NOTSENT_LOWAT
