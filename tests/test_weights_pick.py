"""Chunk picking at real model sizes (issue 12): the incremental index picks exactly what the
rarest-first rule says (checked against a brute-force oracle over random source states, after
random sequences of HAVE answers, deaths and corrupt chunks), costs well under 1 ms per pick at
8,000 chunks x 8 sources, and a real relayed pull over loopback sends few HAVE requests per chunk.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from robustrl.weights import WeightServer, pull
from robustrl.weights.manifest import Manifest, TensorEntry, build_manifest
from robustrl.weights.puller import PullStats, _Pull, _Source, owners
from robustrl.weights.transport import encode_have_reply


def _manifest(chunks: int, chunk_bytes: int = 64) -> tuple[np.ndarray, Manifest]:
    n = chunks * chunk_bytes
    data = np.random.default_rng(chunks).integers(0, 256, n, dtype=np.uint8)
    return data, build_manifest(1, [TensorEntry(name="flat", dtype="uint8", shape=[n], offset=0, nbytes=n)],
                                data, chunk_bytes)


def _state(manifest: Manifest, seed: int) -> _Pull:
    return _Pull(manifest, [], "tcp", None, None, stall_timeout_s=1.0, connect_timeout_s=1.0, max_inflight=4,
                 per_source_inflight=1, have_interval_s=0.01, unavailable_grace_s=1.0, seed=seed)


def _bits(n: int, chunks: set[int]) -> np.ndarray:
    flags = np.zeros(n, dtype=bool)
    flags[list(chunks)] = True
    return flags


def _answer(p: _Pull, source: _Source, have: set[int], pending: set[int]) -> None:
    """A HAVE answer as the wire carries it (bitmaps), through the same path a real reply takes."""
    n = p.m.num_chunks
    p.index.answer(source, encode_have_reply(_bits(n, have), _bits(n, pending), 0))
    source.asked = True


def _oracle(p: _Pull) -> tuple[int, int] | None:
    """Rarest-first by brute force: the rule the pre-index puller applied by scanning every chunk."""
    busy = set(p.inflight.values())
    everyone = [s for s in p.sources.values() if not s.dead]
    free = [s for s in everyone if s.inflight < p.per_source_inflight]
    best = None
    for c in p.pending - busy:
        holders = [s for s in free if c in s.have and c not in s.bad]
        if not holders:
            continue
        partial = [s for s in holders if len(s.have) < p.m.num_chunks]
        relay_has_it = any(c in s.pending or (c in s.have and c not in s.bad)
                           for s in everyone if len(s.have) < p.m.num_chunks)
        if not partial and relay_has_it:
            continue  # the trainer waits for the relay
        key = (sum(c in s.have for s in everyone) + sum(c in s.pending for s in everyone), p.rank[c])
        if best is None or key < best:
            best = key
    return best


source_state = st.tuples(st.booleans(), st.sets(st.integers(0, 23)), st.sets(st.integers(0, 23)),
                         st.sets(st.integers(0, 23)), st.integers(0, 1))


@settings(max_examples=300, deadline=None)
@given(rounds=st.lists(st.lists(source_state, min_size=1, max_size=5), min_size=1, max_size=3),
       done=st.sets(st.integers(0, 23)), dead=st.sets(st.integers(0, 4)), seed=st.integers(0, 3))
def test_index_picks_what_brute_force_rarest_first_picks(rounds, done, dead, seed) -> None:
    n = 24
    _, manifest = _manifest(n)
    p = _state(manifest, seed)
    for states in rounds:  # successive HAVE answers: the index must follow the differences
        for i, (complete, have, pending, bad, inflight) in enumerate(states):
            source = p.sources.setdefault(f"s{i}", _Source(f"s{i}", tiebreak=i / 10))
            if source.dead:
                continue
            _answer(p, source, set(range(n)) if complete else have, pending)
            for c in bad - source.bad:
                p.index.mark_bad(source, c)
            source.inflight = inflight
    for i in dead:
        if f"s{i}" in p.sources:
            p.index.drop(p.sources[f"s{i}"])
    p.pending -= done
    for c in range(n):
        p.index.requeue(c)  # what a failed fetch does; must not change what is picked
    picked = p._pick()
    best = _oracle(p)
    if best is None:
        assert picked is None
        return
    assert picked is not None
    chunk, source = picked
    assert (p.index.key(chunk), p.rank[chunk]) == best
    assert chunk in source.have and chunk not in source.bad and source.inflight < 1 and not source.dead
    partial_holders = [s for s in p.sources.values() if not s.dead and s.inflight < 1 and chunk in s.have
                       and chunk not in s.bad and len(s.have) < n]
    assert not partial_holders or source in partial_holders  # relays first


def test_the_trainer_waits_for_a_busy_relay_and_takes_over_when_it_dies() -> None:
    _, manifest = _manifest(6)
    p = _state(manifest, seed=0)
    trainer = p.sources.setdefault("trainer", _Source("trainer"))
    relay = p.sources.setdefault("relay", _Source("relay"))
    other = p.sources.setdefault("other", _Source("other"))
    _answer(p, trainer, set(range(6)), set())
    _answer(p, relay, {0, 1, 2}, set())
    _answer(p, other, set(), {3})  # another replica is fetching chunk 3 (from the trainer)
    p.pending = {0, 1, 2, 3}
    relay.inflight = 1  # busy: its chunks are not taken from the trainer meanwhile
    assert p._pick() is None
    relay.inflight = 0
    chunk, source = p._pick()  # type: ignore[misc]
    assert source is relay and chunk in {0, 1, 2}
    relay.inflight = 1
    p.index.drop(relay)  # it died: the trainer is the only holder left
    p.sources.pop("relay")
    got = p._pick()
    assert got is not None and got[1] is trainer and got[0] in {0, 1, 2}
    _answer(p, other, set(), set())  # the other replica gave chunk 3 up: the trainer offers it again
    p.pending = {3}
    got = p._pick()
    assert got is not None and got == (3, trainer)


def test_pick_costs_well_under_a_millisecond_at_8000_chunks_and_8_sources() -> None:
    n = 8000
    _, manifest = _manifest(n, chunk_bytes=16)
    p = _state(manifest, seed=1)
    rng = np.random.default_rng(0)
    trainer = p.sources.setdefault("trainer", _Source("trainer"))
    _answer(p, trainer, set(range(n)), set())
    relays = [p.sources.setdefault(f"r{i}", _Source(f"r{i}", tiebreak=rng.random())) for i in range(7)]
    for r in relays:
        _answer(p, r, set(rng.choice(n, n // 3, replace=False).tolist()), set(rng.choice(n, 50).tolist()))
    picks = []
    while p.pending:
        t0 = time.perf_counter()
        got = p._pick()
        picks.append(time.perf_counter() - t0)
        assert got is not None
        chunk, _source = got
        p.pending.discard(chunk)  # fetched
        if len(picks) % 200 == 0:  # relays progress meanwhile: HAVE answers keep changing
            for r in relays:
                _answer(p, r, r.have | set(rng.choice(n, 100).tolist()), set(rng.choice(n, 50).tolist()))
    assert len(picks) == n
    p50 = statistics.median(picks) * 1e3
    assert p50 <= 1.0, f"pick p50 {p50:.3f} ms"
    # the brute-force scan this replaces took ~69 ms per pick here


async def _relayed_pulls(data: np.ndarray, manifest: Manifest, m: int, name_origins: bool = False
                         ) -> tuple[WeightServer, list[WeightServer], list[tuple[np.ndarray, PullStats]]]:
    """``m`` relayed pullers of one version from one trainer (named as the publisher when
    ``name_origins``), every buffer checked; the servers are closed (byte counts stay readable)."""
    trainer = WeightServer("tcp")
    await trainer.start()
    trainer.add_version(manifest, data)
    relays = [WeightServer("tcp") for _ in range(m)]
    for r in relays:
        await r.start()
    sources = [trainer.address, *(r.address for r in relays)]
    try:
        results = await asyncio.wait_for(asyncio.gather(*(
            pull(manifest, sources, relay=relays[i], seed=i, origins=[trainer.address] if name_origins else None)
            for i in range(m))), 120)
    finally:
        for server in [trainer, *relays]:
            await server.close()
    for buf, _stats in results:
        assert np.array_equal(buf, data)
    return trainer, relays, list(results)


async def test_relayed_pull_sends_few_control_messages_per_chunk() -> None:
    data, manifest = _manifest(2000, chunk_bytes=8 << 10)
    trainer, _relays, results = await _relayed_pulls(data, manifest, 4)
    received = sum(sum(s.chunks_from.values()) for _, s in results)
    control = sum(s.control_msgs for _, s in results)
    assert received == 4 * manifest.num_chunks
    assert control / received <= 3.0, f"{control / received:.2f} HAVE requests per chunk"
    assert trainer.bytes_sent <= 1.5 * manifest.total_bytes  # relays carried the rest


def test_chunk_owners_are_balanced_and_move_only_with_the_member_that_left() -> None:
    members = [f"tcp://10.0.0.{i}:7000" for i in range(8)]
    n = 8000
    owner = owners(members, n)
    counts = np.bincount(owner, minlength=len(members))
    assert counts.min() >= 0.8 * n / 8 and counts.max() <= 1.2 * n / 8, counts
    assert np.array_equal(owners(list(members), n), owner)  # every puller computes the same split
    gone = 3
    rest = [m for i, m in enumerate(members) if i != gone]
    after = np.array([members.index(rest[k]) for k in owners(rest, n)])
    moved = np.flatnonzero(after != owner)
    assert set(owner[moved].tolist()) == {gone}  # only the chunks of the member that left moved


async def test_relays_split_the_publisher_so_each_chunk_leaves_it_about_once() -> None:
    """8 relayed pullers of one version: the trainer offers each chunk once (to pullers taking
    turns), and the relays carry the rest. Before any split the trainer sent 1.1 copies here (and
    3.75 at 16 replicas on the testbed), each puller racing the others for the rarest chunks."""
    data, manifest = _manifest(1600, chunk_bytes=8 << 10)
    trainer, relays, _results = await _relayed_pulls(data, manifest, 8, name_origins=True)
    copies = trainer.bytes_sent / manifest.total_bytes
    assert copies <= 1.03, f"the trainer sent {copies:.2f} copies"
    uplinks = [r.bytes_sent / manifest.total_bytes for r in relays]
    assert max(uplinks) <= 2.5, f"relay uplinks carried {uplinks} copies"


async def test_two_publishers_split_the_fresh_chunks_so_each_leaves_the_gang_once() -> None:
    """Two trainer ranks publish the same version: each offers only chunks it never sent, so
    without a split every chunk could leave the gang twice (the testbed job measured 40 of 22);
    relaying pullers that know the ranks (``origins``) ask each rank for its own share only."""
    data, manifest = _manifest(800, chunk_bytes=8 << 10)
    ranks = [WeightServer("tcp") for _ in range(2)]
    for r in ranks:
        await r.start()
        r.add_version(manifest, data)
    relays = [WeightServer("tcp") for _ in range(4)]
    for r in relays:
        await r.start()
    origins = [r.address for r in ranks]
    sources = [*origins, *(r.address for r in relays)]
    try:
        results = await asyncio.wait_for(asyncio.gather(*(
            pull(manifest, sources, relay=relays[i], seed=i, origins=origins) for i in range(4))), 120)
    finally:
        for server in [*ranks, *relays]:
            await server.close()
    for buf, _stats in results:
        assert np.array_equal(buf, data)
    copies = [r.bytes_sent / manifest.total_bytes for r in ranks]
    assert sum(copies) <= 1.03, f"the gang sent {copies} copies"
    assert min(copies) >= 0.3, f"one rank did (nearly) all the work: {copies}"
