"""Faults the request manager raises itself: a deadline passed (DESIGN section 4, "every wait is
bounded ... a deadline passed is a fault with a named cause, never silence").

They travel like the detector's reports: a :class:`FaultReport` on ``rrl.<job>.fault`` for the
controller, and a ``fault_detected`` event in the job's log, which the controller's durable fault
inbox delivers at least once (and accounting counts like any detection).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING, Literal

from robustrl.bus import Bus
from robustrl.errors import TransportError
from robustrl.messages import FaultKind, FaultReport, Role
from robustrl.subjects import Verb, subject

if TYPE_CHECKING:
    from robustrl.services.request_manager.eventlog import EventWriter

log = logging.getLogger(__name__)

Cause = Literal["turn_deadline", "weights_deadline", "step_deadline", "replies_refused", "commit_deadline"]


async def report_deadline(bus: Bus, job_id: str, *, role: Role, member_id: str, kind: FaultKind, cause: Cause,
                          evidence: str, step: int, since: float | None = None,
                          events: EventWriter | None = None) -> FaultReport:
    """Publish one fault for a passed deadline (or replies refused) and record it in the event log.

    Args:
        role, member_id: who holds the work that did not finish (a replica, or the request
            manager itself when nobody else does).
        cause: the deadline that passed; ``evidence`` says what was still outstanding.
        since: wall-clock time the wait began (the report's ``fault_at``).
        events: the job's event writer: ``fault_detected`` goes through its Redis outbox (keyed
            by the fault id), so a request manager killed while JetStream is away leaves it for
            its next life (from the bus's in-memory queue it was lost). Redis failing falls back
            to that queue.
    """
    report = FaultReport(job_id=job_id, fault_id=f"rm-{uuid.uuid4().hex[:12]}", role=role, member_id=member_id,
                         kind=kind, evidence=f"{cause}: {evidence}", detected_at=time.time(), step=step,
                         fault_at=since, cause=cause)
    log.warning("job %s: %s of %s %s: %s", job_id, cause, role, member_id, evidence)
    try:
        await bus.publish(subject(job_id, Verb.FAULT), report)
    except Exception as exc:  # the event below still records it
        log.error("could not publish fault %s: %s", report.fault_id, exc)
    data = report.model_dump(mode="json", exclude={"job_id"})
    if events is not None:
        try:
            await events.emit("fault_detected", data)
            return report
        except TransportError as exc:
            log.error("job %s: fault %s not saved in the outbox (%s): appended from memory", job_id,
                      report.fault_id, exc)
    await bus.emit_event(job_id, "fault_detected", data)
    return report
