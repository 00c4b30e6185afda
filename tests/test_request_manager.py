"""Request-manager bookkeeping that needs no servers: which trainer commits move the job on."""

from __future__ import annotations

from robustrl.config import JobSpec
from robustrl.messages import MemberHello, StepCommitted
from robustrl.services.request_manager.batching import JobRunner
from robustrl.storage.redis_stores import connect


def _commit(step: int, epoch: int) -> StepCommitted:
    return StepCommitted(job_id="j", step=step, weights_version=step + 1, epoch=epoch, reward_mean=0.0,
                         checksum="c", durable_step=step - 1)


def test_commits_of_a_stale_gang_are_ignored() -> None:
    # A lazy client that is never used: on_hello / on_commit touch no store.
    runner = JobRunner(bus=None, redis=connect("redis://127.0.0.1:9/0"), job_id="j",  # type: ignore[arg-type]
                       spec=JobSpec.parse({"name": "j", "steps": 10}), start_step=0)
    runner.on_commit(_commit(0, epoch=1))
    runner.on_commit(_commit(1, epoch=1))
    assert runner.committed == 1
    # gang 1 dies; gang 2 says hello and resumes at step 1 (step 1 was not durable)
    runner.on_hello(MemberHello(job_id="j", member_id="trainer-e2-r0", role="trainer", pid=1, epoch=2,
                                resume_step=1))
    # a zombie of gang 1 still commits step 2: it must not move the job on
    runner.on_commit(_commit(2, epoch=1))
    assert runner.committed == 1 and runner.trainer_version == 2
    runner.on_commit(_commit(1, epoch=2))
    runner.on_commit(_commit(2, epoch=2))
    assert runner.committed == 2 and runner.trainer_version == 3
