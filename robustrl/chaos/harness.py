"""The chaos harness: injects planned faults into a running job over NATS.

It follows the job's progress on the event subjects (``step_started``), waits for each planned
fault's step, sleeps the fault's seeded delay inside that step, and sends a ``ChaosRequest``
to the controller on ``rrl.<job>.chaos``; the controller resolves the member and carries the
fault out (kill the process group, SIGSTOP, or an in-process fault over NATS).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from robustrl.bus import Bus
from robustrl.chaos.scenario import PlannedFault
from robustrl.errors import RequestTimeout
from robustrl.messages import ChaosAck, ChaosRequest, Event, StepCommitted
from robustrl.subjects import Verb, events, subject

log = logging.getLogger(__name__)
ACK_TIMEOUT_S = 5.0


class Harness:
    def __init__(self, bus: Bus, job_id: str, planned: Sequence[PlannedFault]) -> None:
        self.bus = bus
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
                    except asyncio.TimeoutError:
                        pass
                if stop.is_set():
                    break
                wait = self.step_started[pf.step] + pf.delay_s - time.monotonic()
                if wait > 0:
                    try:
                        await asyncio.wait_for(stop.wait(), wait)
                        break
                    except asyncio.TimeoutError:
                        pass
                await self.inject(pf)
        finally:
            for sub in subs:
                await sub.unsubscribe()
        return self.acks

    async def inject(self, pf: PlannedFault) -> dict[str, Any]:
        req = ChaosRequest(job_id=self.job_id, fault_id=pf.fault_id, kind=pf.kind, role=pf.role,  # type: ignore[arg-type]
                           member=pf.member_index, duration_s=pf.duration_s, factor=max(1.0, pf.factor))
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
