"""The chaos harness: injects planned faults into a running job over NATS.

It follows the job's progress on the event subjects (``step_started``), waits for each planned
fault's step, sleeps the fault's seeded delay inside that step, and sends a ``ChaosRequest``
to the controller on ``rrl.<job>.chaos``; the controller resolves the member and carries the
fault out (kill the process group, SIGSTOP, or an in-process fault over NATS).

Faults on the controller and detector (the controller cannot kill itself and does not own the
detector's process) and infra restarts go to a :class:`LocalFaults` instead: the local stack,
which started those processes. The harness logs their ``fault_injected`` itself. A request
manager crash or hang goes there too; its tool outage still goes through the controller.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

from robustrl.bus import Bus
from robustrl.chaos.scenario import CONTROL_PLANE, INFRA, PlannedFault
from robustrl.errors import LaunchError, RequestTimeout
from robustrl.messages import ChaosAck, ChaosRequest, Event, StepCommitted
from robustrl.subjects import Verb, events, subject

log = logging.getLogger(__name__)
ACK_TIMEOUT_S = 5.0


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
                 local: LocalFaults | None = None) -> None:
        self.bus = bus
        self.local = local
        self.job_id = job_id
        self.planned = sorted(planned, key=lambda p: (p.step, p.delay_s))
        self.step_started: dict[int, float] = {}
        self.committed = -1
        self.acks: list[dict[str, Any]] = []
        self._changed = asyncio.Event()

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
        try:
            for pf in self.planned:
                while pf.step not in self.step_started and not stop.is_set():
                    self._changed.clear()
                    try:
                        await asyncio.wait_for(self._changed.wait(), 0.5)
                    except TimeoutError:
                        pass
                if stop.is_set():
                    break
                wait = self.step_started[pf.step] + pf.delay_s - time.monotonic()
                if wait > 0:
                    try:
                        await asyncio.wait_for(stop.wait(), wait)
                        break
                    except TimeoutError:
                        pass
                await self.inject(pf)
        finally:
            for sub in subs:
                await sub.unsubscribe()
        return self.acks

    async def inject(self, pf: PlannedFault) -> dict[str, Any]:
        if is_local(pf):
            return await self.inject_local(pf)
        req = ChaosRequest(job_id=self.job_id, fault_id=pf.fault_id, kind=pf.kind, role=pf.role,  # type: ignore[arg-type]
                           member=pf.member_index, duration_s=pf.duration_s, factor=max(1.0, pf.factor),
                           against=list(pf.against))
        try:
            ack = await self.bus.request(subject(self.job_id, Verb.CHAOS), req, ChaosAck, timeout=ACK_TIMEOUT_S)
            rec = {"fault_id": pf.fault_id, "kind": pf.kind, "role": pf.role, "step": pf.step,
                   "member_id": ack.member_id, "ok": ack.ok, "error": ack.error}
        except RequestTimeout as exc:
            rec = {"fault_id": pf.fault_id, "kind": pf.kind, "role": pf.role, "step": pf.step,
                   "member_id": None, "ok": False, "error": str(exc)}
        log.info("injected %s", rec)
        self.acks.append(rec)
        return rec

    async def inject_local(self, pf: PlannedFault) -> dict[str, Any]:
        """Crash or hang a control-plane process, or restart an infra server, through the stack."""
        rec: dict[str, Any] = {"fault_id": pf.fault_id, "kind": pf.kind, "role": pf.role, "step": pf.step,
                               "member_id": pf.role, "ok": False, "error": None}
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
