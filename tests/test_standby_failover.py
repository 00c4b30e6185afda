"""A controller that fails over in the middle of a borrowed trainer recovery loses no rollout slot.

Real servers, a supervised control plane of this module's own, real member processes. The leading
controller is frozen by a failpoint at the worst moment of a borrow (``gang_borrowed``: the new
gang with borrowed ranks started, not ready; ``restock``: the gang ready, the borrowed slots owed
a replacement, none started), SIGKILLed there, and a hot-standby controller takes over. Verdict
from outside the controllers: the raw job record in Redis at the moment of the kill, the event log
(who restocked which slot under which fencing token), the raw metrics the replicas publish (the
pool back to its size) and the auditor.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest
from jobs import TERMINAL, kinds, small_job
from robustrl.services.controller.failpoints import ENV as FAILPOINTS_ENV
from support import BusObserver, audit_sampled, ended, eventually, raw_job_record, sample_batches

from robustrl.audit.model import AuditOptions
from robustrl.client import ApiClient
from robustrl.errors import JobError, TransportError
from robustrl.messages import MetricsSample, decode
from robustrl.stack import Stack
from robustrl.storage.redis_stores import Keys
from robustrl.subjects import Verb, wildcard
from robustrl.supervisor import RestartPolicy

pytestmark = pytest.mark.timeout(300)
UNREACHABLE = (AssertionError, TransportError, JobError)
AUDIT = AuditOptions(redis_bound=False)
TOLERANT = {"detector": {"trainer_idle_s": 8.0, "rollout_idle_s": 5.0, "silence_s": 8.0, "probe_timeout_s": 3.0,
                         "metrics_interval_s": 0.5}}


POINTS = ("gang_borrowed", "restock")


@pytest.fixture(scope="module", params=POINTS)
def armed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, str]]:
    """Servers of this stack alone (its controllers hold the lease), two controllers: 'controller'
    leads from the start with failpoint ``point`` armed, 'controller-2' stands by unarmed (a
    standby armed at ``restock`` would freeze itself again when it restocks after the takeover).
    Armed at the stack's start, not by killing and restarting a supervised controller, which can
    race the supervisor for the API port."""
    point: str = request.param
    st = Stack(tmp_path_factory.mktemp(f"standby-failover-{point}"), controllers=2,
               policy=RestartPolicy(hang_timeout_s=30.0), service_extra_env={"controller": {FAILPOINTS_ENV: point}})
    st.start()
    try:
        yield st, point
    finally:
        st.stop()


def _raw_record(stack: Stack, job_id: str) -> dict[str, Any]:
    assert stack.settings
    return raw_job_record(stack.settings.redis_url, job_id)


def _log_tail(stack: Stack, name: str, lines: int = 15) -> str:
    path = stack.run_dir / "logs" / f"{name}.log"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else f"(no {path})"


def _armed_leader(stack: Stack, point: str) -> int:
    """The pid of the process that leads and is armed at ``point``, checked from outside: the
    stack's first 'controller', never restarted, its environment armed, the one listening on the
    stack's API port (and that port answering 'leading'); 'controller-2' a standby."""
    assert stack.settings and stack.supervisor
    restarted = [r for r in stack.restarts() if str(r["service"]).startswith("controller")]
    assert not restarted, restarted
    pid = stack.pids()["controller"]
    proc = psutil.Process(pid)
    assert proc.environ().get(FAILPOINTS_ENV) == point, proc.environ().get(FAILPOINTS_ENV)
    assert psutil.Process(stack.pids()["controller-2"]).environ().get(FAILPOINTS_ENV, "") == ""
    listening = {c.laddr.port for c in proc.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
    assert stack.settings.api_port in listening, (stack.settings.api_port, listening)
    assert httpx.get(f"{stack.api_url}/healthz", timeout=10).json()["leading"] is True
    standby = stack.supervisor.specs["controller-2"].health_url
    assert standby
    eventually(lambda: httpx.get(standby, timeout=2).json()["leading"] is False, timeout=60, interval=0.1,
               retry_on=(httpx.HTTPError,), what="controller-2 serving as a standby")
    return pid


def _stopped_at_failpoint(stack: Stack, pid: int, point: str) -> bool:
    """Whether the armed leader is frozen at its failpoint; one that is gone (or a zombie) before
    it got there fails the test, with what the supervisor and its log say."""
    try:
        status = psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        status = "gone"
    if status in ("gone", psutil.STATUS_ZOMBIE):
        pytest.fail(f"the armed leader (pid {pid}) exited before stopping at failpoint {point}; supervisor "
                    f"restarts: {stack.restarts()}; end of its log:\n{_log_tail(stack, 'controller')}")
    return bool(status == psutil.STATUS_STOPPED)


def test_controller_killed_mid_borrow_the_standby_restocks_the_pool(armed: tuple[Stack, str]) -> None:
    stack, point = armed
    assert stack.settings and stack.supervisor
    leader = _armed_leader(stack, point)
    api_a = ApiClient(stack.api_url, stack.settings.api_token)
    port_b = stack.supervisor.specs["controller-2"].env["ROBUSTRL_API_PORT"]
    api_b = ApiClient(f"http://127.0.0.1:{port_b}", stack.settings.api_token)
    replicas = 3
    # Tool calls of 1 s make steps (~1.5 s) long enough for the takeover and the cold replacements
    # (8-10 s on two shared cores) to finish before the job does.
    spec = small_job(f"fo-{point.replace('_', '')}", steps=30, mode="semi_sync", staleness=1,
                     rollout={"replicas": replicas}, recovery={"min_replicas_kept": 1, "keep_survivors": False},
                     tools={"latency_s": 1.0}, data={"tasks": ["lookup"]}, **TOLERANT)
    jid = api_a.submit(spec)["job_id"]
    sampler = sample_batches(stack.settings.redis_url, jid)
    with BusObserver(stack.settings.nats_url, [wildcard(jid, Verb.METRICS)]) as metrics:
        eventually(lambda: api_a.job(jid)["committed_step"] >= 2, timeout=120, interval=0.1, what="step 2")
        api_a.fault(jid, kind="crash", role="trainer", member=0)

        # The leader freezes itself at the failpoint: this is the moment it is killed.
        eventually(lambda: _stopped_at_failpoint(stack, leader, point), timeout=90, interval=0.02,
                   what=f"controller stopped at failpoint {point}")
        record = _raw_record(stack, jid)
        t_kill = time.time()
        assert stack.pids()["controller"] == leader, stack.restarts()
        stack.kill_service("controller")  # SIGKILL, not restarted: the standby must take over
        assert ended(leader)

        borrowed_slots: dict[int, int] = {}
        if point == "restock":
            # the gang was ready; the borrowed slots were durably owed, none started
            borrowed_slots = {int(k): v for k, v in record["restock_owed"].items()}
            assert not record["gang_starts"], record["gang_starts"]
        else:
            gangs = list(record["gang_starts"].values())
            assert len(gangs) == 1 and gangs[0]["sources"] == ["borrowed", "borrowed"], gangs
            borrowed_slots = {int(k): v for k, v in gangs[0]["borrowed_slots"].items()}
            assert not record.get("restock_owed")
        assert len(borrowed_slots) == 2, record
        assert all(inc == 0 for inc in borrowed_slots.values())
        assert {int(k): v for k, v in record["slot_incarnation"].items()} == {i: 0 for i in range(replicas)}

        def pool_back() -> bool:
            events = api_b.events(jid)
            new = {d["member_id"] for d in kinds(events, "replica_restocked")}
            want = {f"rollout-{s}-i1" for s in borrowed_slots}
            loaded = {d["member_id"] for d in kinds(events, "weights_loaded")}
            return new == want and want <= loaded

        eventually(lambda: pool_back() or api_b.job(jid)["status"] in TERMINAL, timeout=150, interval=0.25,
                   retry_on=UNREACHABLE, what="the new leader restocked both borrowed slots")
        assert pool_back(), "the job ended before the pool was back to its size"

        # The pool is back to its size, seen in the replicas' own metrics: every slot has a live
        # rollout member publishing (the borrowed processes publish as trainers now).
        def publishing() -> set[str]:
            since = time.time() - 2.0
            return {m.member_id for t, s, d in list(metrics.seen) if t > since
                    and (m := decode(MetricsSample, d, s)).role == "rollout"}

        want_pool = {f"rollout-{s}-i{1 if s in borrowed_slots else 0}" for s in range(replicas)}
        eventually(lambda: publishing() == want_pool, timeout=30, interval=0.25,
                   what=f"rollout members publishing == {sorted(want_pool)}")
        # The new leader's job goes on: two more steps commit, then it is stopped (a job finishing
        # after a takeover is test_controller_takeover_finish's; the remaining steps only add time).
        after = min(api_b.job(jid)["committed_step"] + 2, spec["steps"] - 1)
        eventually(lambda: api_b.job(jid)["committed_step"] >= after, timeout=120, interval=0.25,
                   retry_on=UNREACHABLE, what=f"step {after} committed under the new leader")
        api_b.stop(jid)
        status = eventually(lambda: (s := api_b.job(jid))["status"] in TERMINAL and s, timeout=120, interval=0.25,
                            retry_on=UNREACHABLE, what="job ended")
    assert status["status"] in ("stopped", "finished"), status.get("error")  # finished: it was the last step
    events = api_b.events(jid)
    api_a.close()
    api_b.close()

    takeover = [d for d in kinds(events, "note") if "took over" in d["text"]]
    assert len(takeover) == 1, takeover
    new_fence = takeover[0]["fence"]
    restocked = [(e["ts"], e["data"]) for e in events if e["kind"] == "replica_restocked"]
    # each borrowed slot restocked exactly once, by the new leader, after the kill
    assert sorted(d["slot"] for _, d in restocked) == sorted(borrowed_slots), restocked
    assert all(ts > t_kill and d["fence"] == new_fence for ts, d in restocked), (t_kill, restocked)
    started = {d["member_id"]: d for d in kinds(events, "member_started")}
    assert not [m for m in started if m.endswith("-i2")], sorted(started)  # no slot started twice
    # the borrowed ranks were the gang's (the recovery was a borrowed one, completed)
    assert {started[f"trainer-e2-r{r}"]["source"] for r in (0, 1)} == {"borrowed"}
    recovered = [d for d in kinds(events, "recovered") if d["kind"] == "trainer"]
    assert recovered, "the trainer recovery never completed"
    if point == "gang_borrowed":  # completed by the new leader, which knows its source from the record
        assert recovered[0]["fence"] == new_fence and recovered[0]["source"] == "borrowed", recovered
    assert len([d for d in kinds(events, "decision") if "RestartTrainerGang" in d["actions"]]) == 1
    # nothing is owed any more in the durable record
    final = _raw_record(stack, jid)
    assert not final["restock_owed"] and not final["gang_starts"], final
    audit_sampled(stack.settings, jid, sampler, AUDIT)


@pytest.mark.parametrize("armed", POINTS[-1:], indirect=True)  # any of the module's stacks
def test_a_job_record_write_with_a_stale_fencing_token_is_refused(armed: tuple[Stack, str]) -> None:
    """The job record (which holds the slots owed a replacement) is written fenced: once a newer
    controller lease term has begun, a write under an older token changes nothing."""
    import asyncio

    from robustrl.storage.control_stores import JobRegistry
    from robustrl.storage.redis_stores import connect

    stack, _ = armed
    assert stack.settings
    url = stack.settings.redis_url
    job_id = f"fenced-{uuid.uuid4().hex[:8]}"

    async def scenario() -> tuple[bool, bool, bool, dict[str, Any]]:
        r = connect(url)
        try:
            newest = int(await r.get(Keys.controller_fence()) or 0)
            assert newest >= 1, "no controller lease term yet"
            reg = JobRegistry(r)
            current = await reg.put(job_id, {"status": "finished", "restock_owed": {"1": 0}}, fence=newest)
            stale = await reg.put(job_id, {"status": "finished", "restock_owed": {}}, fence=newest - 1)
            unfenced = await reg.put(f"{job_id}-plain", {"status": "finished"})
            stored = (await reg.all())[job_id]
            await r.hdel(Keys.jobs(), job_id, f"{job_id}-plain")
            return current, stale, unfenced, stored
        finally:
            await r.aclose()

    current, stale, unfenced, stored = asyncio.run(scenario())
    assert current and unfenced and not stale
    assert stored["restock_owed"] == {"1": 0}  # the stale writer did not clear what is owed
