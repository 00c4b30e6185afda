"""The detector's events, appended to the jobs' logs in the background (``robustrl.event_queue``).

The fault report itself goes to the controller on core NATS at once; its ``fault_detected``
event is for the log (the harness, the auditor). Appended inline, one event JetStream did not
acknowledge held the detector for the bus's whole retry budget (``EVENT_PUBLISH_RETRY_S``,
30 s): the next faults of the same tick, every other job's tick and the exit subscription all
waited, and the tick gap then rebased every member history (its probes and stall evidence
thrown away). The queue is in memory: a detector killed while JetStream is away loses what it
held (the fault reports themselves were delivered; a restarted detector reports a fault that is
still there again, under the same fault id).
"""

from __future__ import annotations

from robustrl.bus import Bus
from robustrl.event_queue import MAX_PENDING_EVENTS, EventQueue


class EventWriter(EventQueue):
    """One detector's queue of events, for every job it watches."""

    def __init__(self, bus: Bus, *, max_pending: int = MAX_PENDING_EVENTS) -> None:
        super().__init__(bus, name="detector-events", max_pending=max_pending)
