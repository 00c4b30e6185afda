"""The chaos harness: injects planned faults into a running job over NATS.

It follows the job's progress on the event subjects (``step_started``), waits for each planned
fault's step, sleeps the fault's seeded delay inside that step, and sends a ``ChaosRequest``
to the controller on ``rrl.<job>.chaos``; the controller resolves the member and carries the
fault out (kill the process group, SIGSTOP, or an in-process fault over NATS).

Faults on the controller and detector (the controller cannot kill itself and does not own the
detector's process) and infra restarts go to a :class:`LocalFaults` instead: the local stack,
which started those processes. The harness logs their ``fault_injected`` itself. A request
manager crash or hang goes there too; its tool outage still goes through the controller.

A fault planned ``until: decoding`` (``within_step: decoding``) waits, after its delay, until the
target rollout slot's replica is seen decoding, then injects at once. Two read-only signals of the
replica, either one fires: its phase change to ``serving`` (``rrl.<job>.phase.<member>``, published
as a batch starts after an idle spell: the whole batch is still ahead), and a metrics sample
(``rrl.<job>.metrics.<member>``, every ``detector.metrics_interval_s``) with a batch in flight
(``inflight > 0``: set while a batch decodes, cleared after; a snapshot, possibly near the batch's
end). A signal counts only if it arrived during the wait and comes from the slot's newest
incarnation (``rollout-<slot>-i<n>``). The wait ends at ``decoding_wait_s`` or when the step after the fault's step
commits (a short step may commit before its delay ends: the next step's decoding still counts, and
the ack's ``committed`` says which steps had committed), and the fault is injected then all the
same (ack ``trigger: timeout``), so a scenario never hangs. A crash so timed is sent as ``moment:
mid_batch`` (the replica dies at the first token of its next batch: a kill from outside can land
after the batch ended; the ack's ``moment`` says so). Faults
are carried out in order: one waiting to see decoding holds back the faults planned after it.
Every ack says what fired it: ``trigger`` is ``delay``, ``decoding`` or ``timeout``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

from robustrl.aio import wait_event
from robustrl.bus import Bus
from robustrl.chaos.scenario import CONTROL_PLANE, DECODING, INFRA, PlannedFault
from robustrl.errors import LaunchError, RequestTimeout
from robustrl.launcher.base import rollout_slot
from robustrl.messages import ChaosAck, ChaosRequest, Event, MetricsSample, PhaseChange, StepCommitted
from robustrl.subjects import Verb, events, subject, wildcard

log = logging.getLogger(__name__)
ACK_TIMEOUT_S = 5.0
ACK_ATTEMPTS = 3
"""Requests per fault while no answer comes (the answer of one sent just before a NATS restart is
lost; the controller answers a repeat without carrying the fault out twice)."""
DECODING_WAIT_S = 60.0
"""Longest a ``decoding`` fault waits to see its member decode before it is injected anyway."""
DECODING_POLL_S = 0.1


class LocalFaults(Protocol):
    """Who owns the control-plane and infra processes (``robustrl.stack.Stack``)."""

    def crash_service(self, name: str) -> int: ...

    def hang_service(self, name: str, duration_s: float) -> int: ...

    def restart_infra(self, name: str) -> float: ...


def is_local(pf: PlannedFault) -> bool:
    """Whether the harness carries ``pf`` out itself (through :class:`LocalFaults`)."""
    return pf.role in INFRA or (pf.role in CONTROL_PLANE and pf.kind in ("crash", "hang"))


class Harness:
    def __init__(self, bus: Bus, job_id: str, planned: Sequence[PlannedFault],
                 local: LocalFaults | None = None, *, decoding_wait_s: float = DECODING_WAIT_S) -> None:
        self.bus = bus
        self.local = local
        self.job_id = job_id
        self.planned = sorted(planned, key=lambda p: (p.step, p.delay_s))
        self.step_started: dict[int, float] = {}
        self.committed = -1
        self.acks: list[dict[str, Any]] = []
        self.decoding_wait_s = decoding_wait_s
        self._changed = asyncio.Event()
        self._incarnation: dict[int, int] = {}  # rollout slot -> newest incarnation seen
        self._decoding: dict[int, tuple[float, str, str, int]] = {}  # slot -> (received, signal, member, inflight)
        self.samples: dict[int, int] = {}  # rollout slot -> metrics samples received (diagnostics)

    def _slot(self, member_id: str, role: str) -> int | None:
        """The rollout slot of ``member_id`` if it is the slot's newest incarnation seen."""
        ids = rollout_slot(member_id) if role == "rollout" else None
        if ids is None:
            return None
        slot, inc = ids
        if inc < self._incarnation.get(slot, -1):
            return None  # a replaced replica's last messages: not the slot's member any more
        self._incarnation[slot] = inc
        return slot

    async def _on_metrics(self, msg: MetricsSample, _s: str, _r: str | None) -> None:
        slot = self._slot(msg.member_id, msg.role)
        if slot is None:
            return
        self.samples[slot] = self.samples.get(slot, 0) + 1
        if msg.inflight > 0:
            self._decoding[slot] = (time.monotonic(), "metrics_inflight", msg.member_id, msg.inflight)
            self._changed.set()

    async def _on_phase(self, msg: PhaseChange, _s: str, _r: str | None) -> None:
        slot = self._slot(msg.member_id, msg.role)
        if slot is not None and msg.phase == "serving":
            self._decoding[slot] = (time.monotonic(), "phase_serving", msg.member_id, 0)
            self._changed.set()

    async def _on_step(self, ev: Event, _s: str, _r: str | None) -> None:
        step = int(ev.data.get("step", -1))
        # The first start of a step is the trigger: a restart of the same step is recovery.
        self.step_started.setdefault(step, time.monotonic())
        self._changed.set()

    async def _on_commit(self, msg: StepCommitted, _s: str, _r: str | None) -> None:
        self.committed = max(self.committed, msg.step)
        self._changed.set()

    async def run(self, stop: asyncio.Event) -> list[dict[str, Any]]:
        subs = [await self.bus.subscribe(events(self.job_id, "step_started"), Event, self._on_step),
                await self.bus.subscribe(subject(self.job_id, Verb.COMMIT), StepCommitted, self._on_commit)]
        if any(pf.until == DECODING for pf in self.planned):
            subs.append(await self.bus.subscribe(wildcard(self.job_id, Verb.METRICS), MetricsSample,
                                                 self._on_metrics))
            subs.append(await self.bus.subscribe(wildcard(self.job_id, Verb.PHASE), PhaseChange, self._on_phase))
        try:
            for pf in self.planned:
                while pf.step not in self.step_started and not stop.is_set():
                    self._changed.clear()
                    await wait_event(self._changed, 0.5)
                if stop.is_set():
                    break
                wait = self.step_started[pf.step] + pf.delay_s - time.monotonic()
                if wait > 0 and await wait_event(stop, wait):
                    break
                trigger: dict[str, Any] = {"trigger": "delay"}
                if pf.until == DECODING:
                    trigger = await self.wait_decoding(pf, stop)
                    if stop.is_set():
                        break
                await self.inject(pf, trigger)
        finally:
            for sub in subs:
                await sub.unsubscribe()
        return self.acks

    async def wait_decoding(self, pf: PlannedFault, stop: asyncio.Event) -> dict[str, Any]:
        """Wait until ``pf``'s rollout slot is seen decoding (a sample with ``inflight > 0`` received
        from now on), at most ``decoding_wait_s`` and no longer than the step after its step runs;
        say what ended it."""
        t0 = time.monotonic()
        deadline = t0 + self.decoding_wait_s
        n0 = self.samples.get(pf.member_index, 0)
        while not stop.is_set():
            seen = self._decoding.get(pf.member_index)
            if seen is not None and seen[0] >= t0:
                received, signal, member_id, inflight = seen
                return {"trigger": "decoding", "signal": signal, "waited_s": round(received - t0, 3),
                        "committed": self.committed, "seen_member_id": member_id, "seen_inflight": inflight}
            now = time.monotonic()
            if now >= deadline or self.committed > pf.step:
                why = "wait bound" if now >= deadline else "next step committed"
                log.warning("%s: rollout %d not seen decoding (%s after %.1fs); injecting anyway",
                            pf.fault_id, pf.member_index, why, now - t0)
                return {"trigger": "timeout", "waited_s": round(now - t0, 3), "timeout_reason": why,
                        "committed": self.committed,
                        "samples_seen": self.samples.get(pf.member_index, 0) - n0}
            self._changed.clear()
            await wait_event(self._changed, min(DECODING_POLL_S, deadline - now))
        return {"trigger": "stopped"}

    async def inject(self, pf: PlannedFault, trigger: dict[str, Any] | None = None) -> dict[str, Any]:
        trigger = trigger or {"trigger": "delay"}
        if is_local(pf):
            return await self.inject_local(pf, trigger)
        moment = pf.moment
        if pf.until == DECODING and pf.kind == "crash" and moment == "now":
            # Carried out by the replica at its next batch's first token: a kill sent from here
            # (through the controller) landed after the batch had ended, under load (suite51).
            moment = "mid_batch"
        req = ChaosRequest(job_id=self.job_id, fault_id=pf.fault_id, kind=pf.kind, role=pf.role,  # type: ignore[arg-type]
                           member=pf.member_index, duration_s=pf.duration_s, factor=max(1.0, pf.factor),
                           against=list(pf.against), moment=moment)  # type: ignore[arg-type]
        rec: dict[str, Any] = {"fault_id": pf.fault_id, "kind": pf.kind, "role": pf.role, "step": pf.step,
                               "member_id": None, "ok": False, "error": None, "moment": moment, **trigger}
        for attempt in range(ACK_ATTEMPTS):
            # The controller carries out a fault id once: asking again after a lost answer (a
            # NATS restart between the request and its answer) cannot hit a second member.
            try:
                ack = await self.bus.request(subject(self.job_id, Verb.CHAOS), req, ChaosAck, timeout=ACK_TIMEOUT_S)
            except RequestTimeout as exc:
                rec["error"] = f"{exc} ({attempt + 1} attempts)"
                continue
            rec.update(member_id=ack.member_id, ok=ack.ok, error=ack.error)
            break
        log.info("injected %s", rec)
        self.acks.append(rec)
        return rec

    async def inject_local(self, pf: PlannedFault, trigger: dict[str, Any] | None = None) -> dict[str, Any]:
        """Crash or hang a control-plane process, or restart an infra server, through the stack."""
        rec: dict[str, Any] = {"fault_id": pf.fault_id, "kind": pf.kind, "role": pf.role, "step": pf.step,
                               "member_id": pf.role, "ok": False, "error": None,
                               **(trigger or {"trigger": "delay"})}
        if self.local is None:
            rec["error"] = f"{pf.kind} on {pf.role} needs the stack that started it (run the job with a local Stack)"
            self.acks.append(rec)
            log.warning("not injected: %s", rec["error"])
            return rec
        # Logged before it is carried out, as the controller does: the detection of a crash must
        # not precede its cause in the log. A NATS restart is logged before the server goes away.
        await self.bus.emit_event(self.job_id, "fault_injected", {
            "fault_id": pf.fault_id, "kind": pf.kind, "role": pf.role, "member_id": pf.role, "step": pf.step,
            "duration_s": pf.duration_s})
        try:
            if pf.kind == "infra_restart":
                rec["took_s"] = await asyncio.to_thread(self.local.restart_infra, pf.role)
            elif pf.kind == "crash":
                rec["pid"] = await asyncio.to_thread(self.local.crash_service, pf.role)
            else:
                rec["pid"] = await asyncio.to_thread(self.local.hang_service, pf.role, pf.duration_s)
            rec["ok"] = True
        except (LaunchError, KeyError, ProcessLookupError) as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"
        log.info("injected %s", rec)
        self.acks.append(rec)
        return rec
