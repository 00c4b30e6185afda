"""The replica's weight swap against the loader, interleavings placed by hand (pure logic: the
real ``Replica._install`` / ``_apply_pending`` / ``_held`` / ``_withdraw`` and the real
``WeightLoader.offer``; the engine is a stand-in whose load can be held and made to fail, run on
a thread of its own as the engine thread is). Each case is one an outside review found after the
slow-swap fix: the replica must never serve weights that the event log does not show it loaded,
nor stay on weights the newest gang did not announce, nor on none with nothing pulling."""

from __future__ import annotations

import asyncio
import threading
import types
from typing import Any

import pytest
import torch

from robustrl.config import WeightSyncSpec
from robustrl.member import ChaosState
from robustrl.messages import WeightsAnnounce, WeightsHave
from robustrl.model.policy import weights_checksum
from robustrl.services.rollout.loader import WeightLoader
from robustrl.services.rollout.replica import PendingWeights, Replica
from robustrl.weights.flat import flatten_state_dict
from robustrl.weights.puller import PullStats
from support import eventually_async


class Engine:
    name = "stand-in"

    def __init__(self) -> None:
        self.hold: threading.Event | None = None
        self.fail = False

    def load_weights(self, state: dict[str, Any], version: int, checksum: str = "") -> None:
        if self.hold is not None:
            self.hold.wait(10)
        if self.fail:
            raise RuntimeError("the engine failed to load them")


def replica(version: int, checksum: str) -> Any:
    r: Any = Replica.__new__(Replica)
    r._swap_lock, r._pending, r._swapping, r._late, r._owed = threading.Lock(), None, None, set(), set()
    r._said = None
    r.version, r.checksum = version, checksum
    r.events, r.haves, r.said = [], [], []

    async def publish(_subject: str, msg: Any) -> None:
        # The bus: every HAVE this replica sends, in order ("said": what peers heard last is said[-1]).
        if isinstance(msg, WeightsHave):
            r.haves.append((msg.version, msg.checksum))
            r.said.append((msg.version, msg.checksum, msg.complete))
        await asyncio.sleep(0.05)  # the bus's latency (a pace of the stand-in, not a wait for a condition)

    r.member = types.SimpleNamespace(stopping=asyncio.Event(), chaos=ChaosState(), weights_version=version, activity=0,
                                     bus=types.SimpleNamespace(publish=publish))
    r.engine, r.model, r.verify_loads, r.served = Engine(), object(), False, None
    r.ident = types.SimpleNamespace(member_id="rollout-0-i0", job_id="j")
    r.address = "tcp://127.0.0.1:9"
    r.standby = types.SimpleNamespace(handoff=None)
    r.server = types.SimpleNamespace(is_complete=lambda v: True)
    r.loop = asyncio.get_running_loop()
    r._working = r._awaiting = False
    r.loader = types.SimpleNamespace(resync=lambda: None, pulling=lambda: None)

    async def emit(kind: str, data: dict[str, Any]) -> None:
        r.events.append((kind, data))

    async def nothing() -> None:
        return None

    r._emit, r._refresh_phase = emit, nothing
    return r


def loader(r: Any, have: bool = False) -> WeightLoader:
    """The real loader wired to the replica as ``Replica.run`` wires it; ``have``: its pulls
    announce themselves (partial HAVEs) on the replica's bus."""

    async def nothing() -> None:
        return None

    server: Any = types.SimpleNamespace(drop_version=lambda v: None, is_complete=lambda v: True, versions=list,
                                        holds=lambda v, d: False)
    r.loader = WeightLoader(WeightSyncSpec(pull_timeout_s=5.0, pull_attempts=1), "rollout-0-i0", server, {},
                            install=r._install, emit=r._emit, on_change=nothing, held=r._held,
                            withdraw=r._withdraw, have=r._publish_have if have else None, idle=r._pull_ended)
    return r.loader


def ann(version: int, epoch: int, checksum: str) -> WeightsAnnounce:
    return WeightsAnnounce(job_id="j", version=version, epoch=epoch, checksum=checksum,
                           sources=["tcp://127.0.0.1:9"], manifest_digest="0" * 64)


def loaded(r: Any) -> list[int]:
    return [d["version"] for k, d in r.events if k == "weights_loaded"]


async def until(pred: Any, what: str, timeout: float = 5.0) -> None:
    await eventually_async(pred, timeout=timeout, what=what)


async def test_a_rollback_to_the_held_version_withdraws_a_dead_gangs_version_not_yet_taken() -> None:
    """Holding v2, the dead gang's v3 handed over but not taken (the engine is mid-batch); the
    new gang resumes at v2. Before: the offer took v2 as held and cancelled the pull, and the
    engine, its batch over, took v3 in the window before the cancellation landed: it served the
    dead gang's v3 for good, unreported."""
    r = replica(2, "c2")
    lo = loader(r)
    lo.announcements.offer(ann(3, 1, "c3"))
    lo._task = asyncio.create_task(r._install(3, "c3", {}, 5.0))
    await until(lambda: r._pending is not None, "v3 handed to the engine")
    lo.offer(ann(2, 2, "c2"))  # the rollback: held already
    engine = threading.Thread(target=r._apply_pending)
    engine.start()  # the engine's batch ends in the window
    engine.join()
    await asyncio.gather(lo._task, return_exceptions=True)
    assert (r.version, r.checksum) == (2, "c2") and 3 not in loaded(r), (r.version, r.events)


async def test_a_swap_counted_as_held_that_fails_is_pulled_again() -> None:
    """The engine is swapping v2 (gang 1) in when gang 2 announces the same v2: held. The swap
    then fails. Before: the replica had no weights and nothing pulled, its phase idle."""
    r = replica(1, "c1")
    lo = loader(r)
    r.engine.hold, r.engine.fail = threading.Event(), True
    lo.announcements.offer(ann(2, 1, "c2"))
    lo._task = asyncio.create_task(r._install(2, "c2", {}, 5.0))
    await until(lambda: r._pending is not None, "v2 handed to the engine")
    engine = threading.Thread(target=r._apply_pending)
    engine.start()
    await until(lambda: r._swapping is not None, "the engine swapping v2 in")
    assert r._phase() == "loading_weights"
    lo.offer(ann(2, 2, "c2"))
    await asyncio.sleep(0)
    assert r._phase() == "loading_weights", "a swap under way stopped showing as loading"
    r.engine.hold.set()
    engine.join()
    await until(lambda: lo._task is not None and not lo._task.done() and lo._task.get_name() == "pull-v2",
                "gang 2's v2 pulled again after the failed swap")
    assert r.version == -1
    lo._task.cancel()
    await asyncio.gather(lo._task, return_exceptions=True)


async def test_a_swap_done_when_its_pull_is_cancelled_is_still_reported_loaded() -> None:
    """The engine finished swapping v2 in; the pull's task is cancelled (a newer announcement)
    while it reports. Before: nothing said v2 was loaded, though turns were served with it."""
    r = replica(1, "c1")
    task = asyncio.create_task(r._install(2, "c2", {}, 5.0))
    await until(lambda: r._pending is not None, "v2 handed to the engine")
    engine = threading.Thread(target=r._apply_pending)
    engine.start()
    engine.join()
    await until(lambda: r.haves, "the install announcing v2 held")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await until(lambda: 2 in loaded(r), "v2 reported loaded")
    assert r.version == 2 and loaded(r) == [2]


async def test_a_late_swap_reported_after_the_next_one_does_not_tell_peers_it_holds_the_older() -> None:
    """v2's pull was superseded while the engine swapped it in; v3 followed, swapped in after it
    and announced held. v2's late report runs only now (its wake-up queued behind busy executor
    threads). Before: it announced v2 held after v3, so peers kept v2 as this replica's one
    announcement and pulled v3 from elsewhere until its next version."""
    r = replica(3, "c3")  # v3 is in: swapped after v2, and announced
    await r._publish_have(3, "c3", True)
    late = PendingWeights(2, "c2", {}, threading.Event(), loaded="c2", taken=True)
    late.swapped.set()
    await r._report_late(late)
    assert r.haves[-1] == (3, "c3"), r.haves
    assert 2 in loaded(r), "the late swap is still in the event log (turns may have been made with it)"


async def test_a_stop_during_a_taken_swap_reports_no_rejected_version() -> None:
    """The engine took verified v2 and is swapping it in (slowly) when the replica stops. Before:
    the install's wait ended on the stop and the loader reported v2 rejected, reason timeout,
    which the detector, the auditor and the report read as a bad version."""
    r = replica(1, "c1")
    lo = loader(r)
    state = {"w": torch.arange(8, dtype=torch.float32)}
    buffer, manifest = flatten_state_dict(state, 2, 16)
    v2 = ann(2, 1, weights_checksum(state))
    lo.announcements.offer(v2)
    r.engine.hold = threading.Event()
    follow = asyncio.create_task(lo._verify_and_install(v2, manifest, buffer.numpy(), PullStats(), 0.0, set()))
    await until(lambda: r._pending is not None, "v2 handed to the engine")
    engine = threading.Thread(target=r._apply_pending)
    engine.start()
    await until(lambda: r._swapping is not None, "the engine swapping v2 in")
    r.member.stopping.set()
    await asyncio.gather(follow, return_exceptions=True)
    r.engine.hold.set()
    engine.join()
    assert [d for k, d in r.events if k == "weights_rejected"] == []


def complete_haves(r: Any, version: int, checksum: str) -> int:
    return r.said.count((version, checksum, True))


async def quiet(r: Any, lo: WeightLoader) -> None:
    """Until the stopped pull and every report the replica started meanwhile have ended."""
    while True:
        tasks = {t for t in (lo._task, *r._late, *r._owed) if t is not None and not t.done()}
        if not tasks:
            return
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.parametrize(("newer", "rollback_during_swap"), [
    ([3], False),  # the review's case: the swap ends (HAVE held back), then the rollback
    ([3, 4], False),  # another pull superseded the first before the rollback
    ([3], True),  # the rollback lands while the swap is still under way
])
async def test_a_rollback_to_a_late_swaps_version_announces_it_held_once(
        newer: list[int], rollback_during_swap: bool) -> None:
    """v2's pull was superseded while the engine swapped v2 in, and the newer pull announced
    itself (partial HAVE): v2's late HAVE was rightly held back. Then a new gang resumes at v2:
    the replica holds the newest announcement's weights and pulls nothing. Before: no HAVE
    followed the held-back one, so the controller waited out a replacement's recovery deadline
    and peers kept this replica as a partial relay of the dead gang's version."""
    r = replica(1, "c1")
    lo = loader(r, have=True)
    r.engine.hold = threading.Event()
    lo.announcements.offer(ann(2, 1, "c2"))
    lo._task = asyncio.create_task(r._install(2, "c2", {}, 5.0))
    await until(lambda: r._pending is not None, "v2 handed to the engine")
    engine = threading.Thread(target=r._apply_pending)
    engine.start()
    await until(lambda: r._swapping is not None, "the engine swapping v2 in")
    for v in newer:  # each supersedes the pull before it; the swap of v2 goes on (late)
        lo.offer(ann(v, 1, f"c{v}"))
        await until(lambda v=v: r.said[-1:] == [(v, f"c{v}", False)], f"v{v}'s pull announced")
    if rollback_during_swap:
        lo.offer(ann(2, 2, "c2"))
    r.engine.hold.set()
    engine.join()
    await until(lambda: 2 in loaded(r), "v2's late swap reported")
    if not rollback_during_swap:
        assert r.said[-1] == (newer[-1], f"c{newer[-1]}", False), "held back: the running pull is the last word"
        lo.offer(ann(2, 2, "c2"))
    await until(lambda: r.said[-1] == (2, "c2", True), "v2 announced held after the rollback to it")
    await quiet(r, lo)
    assert complete_haves(r, 2, "c2") == 1, r.said
    assert r.said[-1] == (2, "c2", True) and (r.version, r.checksum) == (2, "c2")


async def test_a_rollback_during_a_newer_pull_announces_the_held_version_again() -> None:
    """Holding v2 (announced), the replica pulls the gang's v3 (its partial HAVE is now the last
    word peers heard from it); the gang dies and the new one resumes at v2: the pull stops.
    Before: nothing followed the partial HAVE, so peers took this replica for a relay of v3
    only and pulled v2 from the new gang alone."""
    r = replica(2, "c2")
    lo = loader(r, have=True)
    await r._publish_have(2, "c2", True)
    lo.offer(ann(3, 1, "c3"))
    await until(lambda: r.said[-1:] == [(3, "c3", False)], "v3's pull announced")
    lo.offer(ann(2, 2, "c2"))
    await until(lambda: r.said[-1] == (2, "c2", True), "v2 announced held again after the rollback")
    await quiet(r, lo)
    assert complete_haves(r, 2, "c2") == 2, r.said  # the first, and once after the rollback
