"""Lost work is measured: tokens regenerated are the tokens of the turns generated again, as the
request manager logged them."""

from __future__ import annotations

from robustrl.chaos.accounting import account
from robustrl.messages import Event

T0 = 1_700_000_000.0


def ev(event_kind: str, ts: float, /, **data: object) -> Event:
    return Event(job_id="j", kind=event_kind, ts=T0 + ts, data=data)


def _steps(n: int) -> list[Event]:
    log = []
    for k in range(n):
        log += [ev("step_started", float(k), step=k, epoch=0),
                ev("step_committed", k + 1.0, step=k, epoch=0, weights_version=k + 1)]
    return log


def test_tokens_regenerated_are_the_tokens_generated_again() -> None:
    log = [*_steps(4),
           ev("fault_detected", 1.5, fault_id="d1", kind="crash", role="rollout", member_id="r0", step=1,
              detected_at=T0 + 1.5),
           # the request manager re-dispatched 3 turns (max_new_tokens 12 each): the estimate would be 36
           ev("work_lost", 1.6, fault_id="d1", turns=3, tokens=0, steps_redone=0),
           ev("turn_regenerated", 1.8, fault_id="d1", cause="replica_dead", episode_id="e1", tokens=7),
           ev("turn_regenerated", 1.9, fault_id="d1", cause="replica_dead", episode_id="e2", tokens=2),
           ev("turn_regenerated", 1.9, fault_id="d1", cause="replica_dead", episode_id="e3", tokens=12),
           # a turn regenerated after its deadline passed belongs to no detected fault
           ev("turn_regenerated", 2.5, fault_id=None, cause="turn_deadline", episode_id="e4", tokens=5)]
    [fault] = account(log).faults
    assert fault.tokens_regenerated == 21

