"""The randomized fault campaign (``robustrl chaos campaign``, ``bench/campaign.py``).

One seeded long job per mode, faults drawn by :mod:`robustrl.chaos.campaign_plan` and fired by
:class:`CampaignDriver` at their triggers (random moments, phases, batch hand-off, recovery).
While the job runs, each batch is read raw from Redis at hand-off (so the audit can judge steps
whose keys are collected later) and the job's Redis size is sampled after warm-up. At the end the
independent auditor runs on the raw stores, and the report counts what was lost, from there and
from the event log alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from robustrl.aio import wait_event
from robustrl.audit import AuditOptions, ObservedStep, audit
from robustrl.audit.raw import RawEvent, observe_batch, read_event_log, redis_job_bytes
from robustrl.bus import Bus
from robustrl.chaos.accounting import account
from robustrl.chaos.campaign_plan import CampaignFault, draw
from robustrl.chaos.harness import Harness, LocalFaults, is_local
from robustrl.chaos.scenario import PlannedFault
from robustrl.client import ApiClient
from robustrl.config import JobSpec, Settings
from robustrl.errors import JobError, RequestTimeout, TransportError
from robustrl.messages import ChaosAck, ChaosRequest, Event, PhaseChange
from robustrl.subjects import Verb, events_of, subject, wildcard

log = logging.getLogger(__name__)

MODES = ("sync", "semi_sync", "async")
STALENESS = {"sync": 0, "semi_sync": 1, "async": 2}
ACK_TIMEOUT_S = 5.0
"""How long the controller has to acknowledge one injection."""
RETARGET_S = 45.0
"""How long an injection is retried while its target is down (being replaced), or while the
controller that carries it out is itself down (a campaign crashes and freezes the controller too:
its restart, plus the wait for the dead one's lease to expire, took 10-20 s on 2 cores)."""
TRIGGER_WAIT_S = 3.0
"""How long a phase / hand-off / recovery trigger is awaited before the fault fires anyway (a
fault-free step of the campaign job takes ~0.3-0.6 s: a longer wait lets the job run far past the
fault's step, and faults drawn late in the job found it finished)."""
POLL_S = 0.25
STUCK_LIMIT_S = 420.0
"""A campaign job with no step committed for this long is stopped and reported not completed."""
TERMINAL = ("finished", "failed", "stopped")


CAMPAIGN_DETECTOR = {"trainer_idle_s": 8.0, "rollout_idle_s": 5.0, "silence_s": 8.0, "probe_timeout_s": 3.0,
                     "metrics_interval_s": 0.5}
"""Detector thresholds of the campaign job: the scaled profile's 3 s of silence fires on healthy
members of a shared 2-core machine at load 20-45 (seen: every gang restarted before its first
step); the campaign is about faults it injects, so it tolerates a starved scheduler. Likewise the
recovery deadline: at load ~40 a cold whole-job start takes ~130 s, longer than the default 120 s,
and each timed-out whole-job restart was escalated to another one (seen: a restart loop)."""


def campaign_spec(mode: str, steps: int, seed: int) -> dict[str, Any]:
    """The campaign's job: the reference model with a short step (few, short episodes, fast tools)
    and no cap on restarts (dozens of faults are the point)."""
    return {"name": f"campaign-{mode.replace('_', '-')}", "steps": steps, "seed": seed, "mode": mode,
            "staleness": STALENESS[mode],
            "data": {"prompts_per_step": 2, "group_size": 2},
            "rollout": {"replicas": 2, "max_new_tokens": 8, "max_turns": 2},
            "tools": {"latency_s": 0.3, "timeout_s": 2.0},
            "detector": dict(CAMPAIGN_DETECTOR), "recovery": {"max_restarts": 1000, "warm_spares": 1, "deadline_s": 600.0}}


@dataclass
class Injection:
    fault: CampaignFault
    fired: str
    """The trigger that actually fired (``fallback:<trigger>`` when it never came)."""
    member_id: str | None
    ok: bool
    error: str | None
    ts: float


@dataclass
class CampaignDriver:
    """Follows one job on NATS and fires each planned fault at its trigger, one after another."""

    bus: Bus
    settings: Settings
    job_id: str
    faults: list[CampaignFault]
    local: LocalFaults | None = None
    """The stack that owns control-plane and infra processes (their faults go through it)."""
    warmup_step: int = 2
    step: int = -1
    committed: int = -1
    phases: dict[str, tuple[str, str, int]] = field(default_factory=dict)
    open_recoveries: set[str] = field(default_factory=set)
    injections: list[Injection] = field(default_factory=list)
    observed: dict[int, ObservedStep] = field(default_factory=dict)
    redis_bytes_start: int | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _marks: list[tuple[str, str, int]] = field(default_factory=list)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def _on_event(self, ev: Event, _s: str, _r: str | None) -> None:
        step = ev.data.get("step")
        if ev.kind == "step_started" and isinstance(step, int):
            self.step = max(self.step, step)
        elif ev.kind == "step_committed" and isinstance(step, int):
            self.committed = max(self.committed, step)
            if step >= self.warmup_step and self.redis_bytes_start is None:
                self.redis_bytes_start = -1  # claimed; filled by the task
                self._spawn(self._sample_start())
        elif ev.kind == "batch_ready" and isinstance(step, int):
            self._marks.append(("batch_handoff", "", step))
            self._spawn(self._observe(step))
        elif ev.kind == "decision" and ev.data.get("actions") not in (None, ["Ignore"]):
            self.open_recoveries.add(str(ev.data.get("fault_id")))
            self._marks.append(("recovery", "", self.step))
        elif ev.kind == "recovered":
            self.open_recoveries.discard(str(ev.data.get("fault_id")))
        self._notify()

    async def _on_phase(self, msg: PhaseChange, _s: str, _r: str | None) -> None:
        self.phases[msg.member_id] = (msg.role, msg.phase, msg.step)
        self._marks.append((f"phase:{msg.phase}", msg.member_id, msg.step))
        self._notify()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _observe(self, step: int) -> None:
        """Sample ``step``'s batch raw; the newest sample that found the key is kept. A
        ``batch_ready`` can come late (sent from the request manager's outbox after the hand-off,
        or again by its next life) when the step's keys were already collected: a sample that
        finds nothing is no evidence about the batch and replaces nothing. A step restarted by
        the request manager is handed over again, and its newer batch is the one trained."""
        try:
            seen = await observe_batch(self.settings.redis_url, self.job_id, step)
        except Exception as exc:  # noqa: BLE001 - an observation is a bonus for the audit, never fatal
            log.warning("campaign: could not observe batch %d: %s", step, exc)
            return
        if seen is not None:
            self.observed[step] = ObservedStep(step, *seen)

    async def _sample_start(self) -> None:
        self.redis_bytes_start = (await redis_job_bytes(self.settings.redis_url, self.job_id))[1]

    def _notify(self) -> None:
        """Wake every waiter (each waits on the event current when it looked)."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def _until(self, pred: Any, timeout_s: float, stop: asyncio.Event) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            changed = self._changed
            if pred():
                return True
            if stop.is_set() or time.monotonic() > deadline:
                return False
            await wait_event(changed, POLL_S)

    def _mark_after(self, start: int, trigger: str, role: str) -> tuple[str, str, int] | None:
        for mark in self._marks[start:]:
            name, member, _step = mark
            if name != trigger:
                continue
            if name.startswith("phase:") and self.phases.get(member, ("", "", 0))[0] != role:
                continue
            return mark
        return None

    async def run(self, stop: asyncio.Event) -> list[Injection]:
        """Arm every fault at once: each waits for its step, then its trigger, then fires, so faults
        overlap each other's recoveries as they would in a real cluster."""
        subs = [await self.bus.subscribe(events_of(self.job_id), Event, self._on_event),
                await self.bus.subscribe(wildcard(self.job_id, Verb.PHASE), PhaseChange, self._on_phase)]
        try:
            await asyncio.gather(*(self._one(f, stop) for f in self.faults))
        finally:
            for sub in subs:
                await sub.unsubscribe()
            for task in list(self._tasks):
                await asyncio.gather(task, return_exceptions=True)
        return self.injections

    async def _one(self, f: CampaignFault, stop: asyncio.Event) -> None:
        if not await self._until(lambda: self.step >= f.step, float("inf"), stop):
            return
        fired, member = await self._await_trigger(f, stop)
        if not stop.is_set():
            await self._inject(f, fired, member)

    async def _await_trigger(self, f: CampaignFault, stop: asyncio.Event) -> tuple[str, str | int]:
        if f.trigger == "time":
            started = time.monotonic()
            await self._until(lambda: time.monotonic() - started >= f.delay_s, f.delay_s + 1, stop)
            return "time", f.member
        if f.trigger == "recovery" and self.open_recoveries:
            await asyncio.sleep(f.delay_s)
            return "recovery", f.member
        start = len(self._marks)
        got = await self._until(lambda: self._mark_after(start, f.trigger, f.role) is not None, TRIGGER_WAIT_S, stop)
        if not got:
            return f"fallback:{f.trigger}", f.member
        mark = self._mark_after(start, f.trigger, f.role)
        assert mark is not None
        await asyncio.sleep(f.delay_s)
        # A phase trigger hits the member that entered the phase.
        return f.trigger, mark[1] if mark[1] and f.trigger.startswith("phase:") else f.member

    async def _inject(self, f: CampaignFault, fired: str, member: str | int) -> None:
        pf = PlannedFault(step=f.step, delay_s=f.delay_s, kind=f.kind, role=f.role, member_index=f.member,
                          duration_s=f.duration_s, factor=f.factor, fault_id=f.fault_id)
        if is_local(pf):
            t = time.time()
            rec = await Harness(self.bus, self.job_id, [], local=self.local).inject_local(pf)
            self.injections.append(Injection(f, fired, rec.get("member_id"), bool(rec["ok"]), rec.get("error"), t))
            log.info("campaign: %s %s/%s via %s at step %d (committed %d): %s", f.fault_id, f.kind, f.role, fired,
                     self.step, self.committed, "ok" if rec["ok"] else rec.get("error"))
            return
        deadline = time.monotonic() + RETARGET_S
        while True:
            req = ChaosRequest(job_id=self.job_id, fault_id=f.fault_id, kind=f.kind, role=f.role,  # type: ignore[arg-type]
                               member=member, duration_s=f.duration_s, factor=f.factor)
            try:
                ack = await self.bus.request(subject(self.job_id, Verb.CHAOS), req, ChaosAck, timeout=ACK_TIMEOUT_S)
                ok, mid, err = ack.ok, ack.member_id, ack.error
            except RequestTimeout as exc:
                ok, mid, err = False, None, str(exc)
            # The target may be down being replaced: retry on the same index for a while. A retry
            # after a lost answer (a NATS restart between request and answer) is safe: the
            # controller carries out a fault id once and answers a repeat with the first's member.
            if ok or time.monotonic() > deadline or "not supported" in (err or ""):
                break
            member = f.member
            await asyncio.sleep(0.5)
        self.injections.append(Injection(f, fired, mid, ok, err, time.time()))
        log.info("campaign: %s %s/%s on %s via %s at step %d (committed %d): %s", f.fault_id, f.kind, f.role, mid,
                 fired, self.step, self.committed, "ok" if ok else err)


def _events(raw: list[RawEvent], job_id: str) -> list[Event]:
    out = []
    for e in raw:
        try:
            out.append(Event.model_validate({"job_id": job_id, "kind": e.kind, "ts": e.ts, "data": e.data}))
        except ValueError:  # pydantic's ValidationError: a kind this accounting does not know
            continue
    return out


def _by_kind_role(injections: list[Injection], raw: list[RawEvent], faults: list[Any]) -> dict[str, Any]:
    """Per kind/role: injected (acknowledged), detected, and recovered: a ``recovered`` event for
    its detection, or, for a fault nothing had to repair (timed, ridden through, or absorbed), a
    step committed (or the job finished) after it ended."""
    progress = [e.ts for e in raw if e.kind in ("step_committed", "job_finished")]
    acct = {f.fault_id: f for f in faults if f.injected}
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"injected": 0, "detected": 0, "recovered": 0,
                                                          "refused": 0})
    for inj in injections:
        row = out[f"{inj.fault.kind}/{inj.fault.role}"]
        if not inj.ok:
            row["refused"] += 1
            continue
        row["injected"] += 1
        a = acct.get(inj.fault.fault_id)
        if a is not None and a.detected:
            row["detected"] += 1
        if (a is not None and a.recovery_s is not None) or any(t > inj.ts + inj.fault.duration_s for t in progress):
            row["recovered"] += 1
    return dict(sorted(out.items()))


async def run_mode(settings: Settings, api: ApiClient, mode: str, steps: int, faults: int, seed: int, *,
                   local: LocalFaults | None = None, exclude: tuple[str, ...] = (),
                   timeout_s: float | None = None, stuck_limit_s: float = STUCK_LIMIT_S) -> dict[str, Any]:
    """Run one campaign job in ``mode``; return its line of the campaign report."""
    spec = campaign_spec(mode, steps, seed)
    members = {"trainer": 2, "rollout": spec["rollout"]["replicas"], "request_manager": 1}
    plan = draw(steps, faults, seed, members, exclude=exclude, name=f"c{seed}")
    t0 = time.time()
    job_id = (await asyncio.to_thread(api.submit, spec))["job_id"]
    bus = await Bus.connect(settings.nats_url, "campaign", role="harness")
    stop = asyncio.Event()
    driver = CampaignDriver(bus, settings, job_id, plan, local=local, warmup_step=max(2, steps // 10))
    task = asyncio.create_task(driver.run(stop))
    # The job is given up only when it stops making progress (no step committed for
    # ``stuck_limit_s``), or past ``timeout_s`` if given: a busy machine makes it slow, not stuck.
    deadline = time.monotonic() + timeout_s if timeout_s else float("inf")
    status: dict[str, Any] = {}
    progress = (-2, time.monotonic())
    try:
        while True:
            try:
                status = await asyncio.to_thread(api.job, job_id)
            except (TransportError, JobError) as exc:
                # The controller may be the fault (crashed, frozen, restoring): keep waiting.
                log.info("campaign: job status unavailable (%s)", exc)
                status = {**status, "status": status.get("status", "unknown")}
                if time.monotonic() - progress[1] > stuck_limit_s:
                    break
                await asyncio.sleep(POLL_S * 4)
                continue
            now = time.monotonic()
            if status.get("committed_step") != progress[0]:
                progress = (status.get("committed_step", -2), now)
            if status.get("status") in TERMINAL or now > deadline or now - progress[1] > stuck_limit_s:
                break
            await asyncio.sleep(POLL_S * 4)
        if status.get("status") not in TERMINAL:
            with contextlib.suppress(TransportError, JobError):
                await asyncio.to_thread(api.stop, job_id)
        stop.set()
        injections = await task
    finally:
        stop.set()
        await bus.close()
    raw = await read_event_log(settings.nats_url, job_id)
    report = account(_events(raw, job_id))
    verdict = await audit(settings, job_id, AuditOptions(), driver.observed)
    _keys, redis_end = await redis_job_bytes(settings.redis_url, job_id)
    return {
        "job_id": job_id, "status": status.get("status"), "error": status.get("error"),
        "steps": steps, "steps_committed": verdict.facts.get("final_step", -1) + 1, "wall_s": round(time.time() - t0, 1),
        "faults_planned": len(plan), "faults_injected": sum(1 for i in injections if i.ok),
        "by_kind_role": _by_kind_role(injections, raw, report.faults),
        "by_trigger": _count(i.fired for i in injections if i.ok),
        "job_completed": status.get("status") == "finished", **verdict.counters(),
        "max_stuck_s": verdict.facts.get("max_stuck_s"),
        # Where a job given up was stuck: the controller's last view of it (members, recoveries).
        "last_status": None if status.get("status") in TERMINAL else status,
        "step_deadline_s": getattr(JobSpec.parse(spec).detector, "step_deadline_s", None),
        "redis_bytes_start": driver.redis_bytes_start, "redis_bytes_end": redis_end,
        "ettr": round(report.ettr, 4), "audit_ok": verdict.ok, "violations": verdict.violations()[:30],
        "audit_facts": verdict.facts,
        "injections": [{"fault_id": i.fault.fault_id, "kind": i.fault.kind, "role": i.fault.role, "fired": i.fired,
                        "member_id": i.member_id, "ok": i.ok, "error": i.error} for i in injections],
    }


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for x in items:
        out[x] += 1
    return dict(sorted(out.items()))


async def run_campaign(settings: Settings, api: ApiClient, *, modes: tuple[str, ...] = MODES, steps: int = 100,
                       faults: int = 50, seed: int = 0, local: LocalFaults | None = None,
                       exclude: tuple[str, ...] = (), timeout_s: float | None = None) -> dict[str, Any]:
    """The campaign report: ``{"modes": {mode: {...}}, "config": {...}}``."""
    out: dict[str, Any] = {"config": {"steps": steps, "faults": faults, "seed": seed, "modes": list(modes),
                                      "exclude": list(exclude), "timeout_s": timeout_s}, "modes": {}}
    for mode in modes:
        out["modes"][mode] = await run_mode(settings, api, mode, steps, faults, seed, local=local,
                                             exclude=exclude, timeout_s=timeout_s)
    return out


def run_on_fresh_stack(run_dir: Any, **kwargs: Any) -> dict[str, Any]:
    """Start an embedded stack under ``run_dir``, run the campaign on it, stop it."""
    from robustrl.stack import Stack
    from robustrl.supervisor import RestartPolicy

    # Control-plane faults are part of the campaign (several per service), and a starved
    # scheduler must not read as a hang: more restarts allowed, a longer health timeout.
    with Stack(run_dir, policy=RestartPolicy(max_restarts=50, hang_timeout_s=20.0)) as stack:
        assert stack.settings is not None
        api = ApiClient(stack.api_url, stack.settings.api_token)
        try:
            return asyncio.run(run_campaign(stack.settings, api, local=stack, **kwargs))
        finally:
            api.close()
