"""The controller's side of the JetStream event log: the fault inbox. (Its appends go through its
outbox, :mod:`.outbox`.)

* :class:`FaultInbox` reads every job's ``fault_detected`` events through a durable pull consumer:
  a fault report is delivered at least once, across controller restarts and a lost plain publish,
  and acknowledged only after the controller has handled it. Handling once is the handler's job
  (a dedupe set of fault ids in Redis).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from pydantic import ValidationError

from robustrl import subjects
from robustrl.aio import cancel_and_wait, within
from robustrl.bus import Bus
from robustrl.messages import Event, FaultReport

log = logging.getLogger(__name__)

FAULT_CONSUMER = "controller-faults"
FAULT_FETCH_TIMEOUT_S = 1.0
"""One fetch of the fault inbox (an empty fetch just loops)."""
FAULT_ACK_WAIT_S = 120.0
"""A fault not acknowledged within this long (its handler died with the controller) is redelivered."""
FAULT_RETRY_S = 1.0
"""A fault whose handling failed (a Redis stall, a lease read cut off) is delivered again this
long after, doubling with each delivery up to ``FAULT_RETRY_MAX_S``: left to
``FAULT_ACK_WAIT_S``, a frozen member reported once by the detector stalled the job for two
minutes (an outside review)."""
FAULT_RETRY_MAX_S = 30.0
CLOSE_WAIT_S = 2.0
"""At close: for the pull loop to end once cancelled, and for the unsubscribe."""


def fault_from_event(event: Event) -> FaultReport | None:
    """The FaultReport a ``fault_detected`` event records (None if the event is not one)."""
    fields = {k: v for k, v in event.data.items() if k in FaultReport.model_fields}
    try:
        return FaultReport.model_validate({**fields, "job_id": event.job_id})
    except ValidationError as exc:
        log.warning("fault event of %s not understood: %s", event.job_id, exc.errors()[0]["msg"])
        return None


FaultHandler = Callable[[FaultReport], Awaitable[None]]


class FaultInbox:
    """Every job's fault reports, at least once, from the event log's durable consumer."""

    def __init__(self, bus: Bus, handler: FaultHandler) -> None:
        self.bus = bus
        self.handler = handler
        self._task: asyncio.Task[None] | None = None
        self._sub: Any = None

    async def start(self) -> None:
        """Bind to the durable consumer (created on first use, from new events on) and pull."""
        if self._task is not None:
            return
        js = self.bus.client.jetstream()
        self._sub = await js.pull_subscribe(
            subjects.events_of_kind("fault_detected"), durable=FAULT_CONSUMER, stream=subjects.EVENTS_STREAM,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.NEW, ack_policy=AckPolicy.EXPLICIT,
                                  ack_wait=FAULT_ACK_WAIT_S, max_ack_pending=1024))
        self._task = asyncio.create_task(self._pull())

    async def _pull(self) -> None:
        while True:
            try:
                batch = await self._sub.fetch(16, timeout=FAULT_FETCH_TIMEOUT_S)
            except (TimeoutError, NatsTimeout):
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # NATS reconnecting: the consumer keeps our place
                log.warning("fault inbox: fetch failed: %s", exc)
                await asyncio.sleep(FAULT_FETCH_TIMEOUT_S)
                continue
            for raw in batch:
                try:
                    event = Event.model_validate_json(raw.data)
                except ValidationError:
                    await raw.ack()  # malformed forever: never redeliver
                    continue
                fault = fault_from_event(event)
                if fault is not None:
                    try:
                        await self.handler(fault)
                    except Exception:
                        # Not acknowledged: JetStream delivers it again, FAULT_RETRY_S on (to
                        # whoever leads then: the consumer is shared).
                        try:
                            delivered = int(raw.metadata.num_delivered or 1)
                        except Exception:  # noqa: BLE001 - no metadata: the first delay
                            delivered = 1
                        delay = min(FAULT_RETRY_MAX_S, FAULT_RETRY_S * 2 ** (delivered - 1))
                        log.exception("fault %s: handler failed (delivery %d): delivered again in %g s",
                                      fault.fault_id, delivered, delay)
                        try:
                            await raw.nak(delay=delay)
                        except Exception as exc:  # noqa: BLE001 - the bus away: ack_wait redelivers it
                            log.warning("fault %s: not handed back (%s): delivered again after %g s",
                                        fault.fault_id, exc, FAULT_ACK_WAIT_S)
                        continue
                await raw.ack()

    async def close(self) -> None:
        """Stop pulling (a handler in progress is cancelled; its fault stays unacknowledged, so
        it is delivered again to whoever leads). Bounded."""
        if self._task is not None:
            if not await cancel_and_wait(self._task, CLOSE_WAIT_S):
                log.error("fault inbox: the pull loop did not end after cancellation")
            self._task = None
        if self._sub is not None:
            try:
                await within(self._sub.unsubscribe(), CLOSE_WAIT_S)
            except Exception as exc:  # the connection may be gone already; the consumer is durable
                log.debug("fault inbox: unsubscribe failed: %s", exc)
            self._sub = None
