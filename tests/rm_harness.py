"""A request manager in this process against real NATS and Redis, with scripted replicas.

The replicas and the controller here speak the real wire protocol (GenerateTurn / TurnResult,
hello / have / metrics, spec requests, fault reports) on private servers, so a test decides
exactly when a reply arrives, is late or is lost, and then checks the outcome from raw Redis
keys, the requests the replicas received and the job's event log.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from robustrl.services.request_manager.service import RequestManager

from robustrl.bus import Bus
from robustrl.errors import RequestTimeout
from robustrl.messages import (
    BatchReady,
    ControlCommand,
    FaultReport,
    GenerateTurn,
    MemberHello,
    MetricsSample,
    SpecReply,
    SpecRequest,
    StepCommitted,
    TurnResult,
    WeightsHave,
)
from robustrl.model.tokenizer import CharTokenizer
from robustrl.storage.control_stores import JobRegistry, newest_controller_fence
from robustrl.storage.redis_stores import EpisodeStore, Keys, connect
from robustrl.subjects import Verb, subject

METRICS_S = 0.1


def rm_spec(name: str, steps: int = 1, **detector: float) -> dict[str, Any]:
    """2 prompts x 2 samples of a one-turn task, thresholds scaled for tests."""
    det = {"trainer_idle_s": 4.0, "rollout_idle_s": 2.0, "silence_s": 3.0, "probe_timeout_s": 1.0,
           "metrics_interval_s": METRICS_S, "weights_load_s": 30.0, "turn_deadline_s": 30.0,
           "step_deadline_s": 60.0, **detector}
    return {"name": name, "steps": steps, "seed": 5, "detector": det,
            "data": {"tasks": ["reverse"], "prompts_per_step": 2, "group_size": 2}}


class FakeReplica:
    """Answers GenerateTurn at once unless ``hold`` says to keep the request (answer it later
    with ``release``). Publishes hello, have and metrics like a real replica."""

    def __init__(self, bus: Bus, job_id: str, member_id: str, version: int = 0) -> None:
        self.bus, self.job_id, self.member_id, self.version = bus, job_id, member_id, version
        self.received: list[GenerateTurn] = []
        self.held: list[GenerateTurn] = []
        self.hold = lambda msg: False
        self.tok = CharTokenizer.default()
        self._task: asyncio.Task[None] | None = None
        self._sub: Any = None

    async def start(self) -> None:
        self._sub = await self.bus.subscribe(subject(self.job_id, Verb.GENERATE, self.member_id), GenerateTurn,
                                             self._on_request)
        await self.announce()
        self._task = asyncio.create_task(self._metrics())

    async def announce(self) -> None:
        await self.bus.publish(subject(self.job_id, Verb.HELLO, self.member_id),
                               MemberHello(job_id=self.job_id, member_id=self.member_id, role="rollout", pid=1))
        await self.set_version(self.version)

    async def set_version(self, version: int) -> None:
        self.version = version
        await self.bus.publish(subject(self.job_id, Verb.HAVE, self.member_id), WeightsHave(
            job_id=self.job_id, member_id=self.member_id, version=version, address="x:1", checksum=f"c{version}"))

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def _metrics(self) -> None:
        seq = 0
        while True:
            seq += 1
            await self.bus.publish(subject(self.job_id, Verb.METRICS, self.member_id), MetricsSample(
                job_id=self.job_id, member_id=self.member_id, role="rollout", seq=seq, ts=time.time(),
                phase="serving", inflight=len(self.held), weights_version=self.version))
            await asyncio.sleep(METRICS_S)  # paces the fake replica's samples, as a replica's own period

    async def _on_request(self, msg: GenerateTurn, _s: str, _r: str | None) -> None:
        self.received.append(msg)
        if self.hold(msg):
            self.held.append(msg)
            return
        await self.answer(msg)

    async def answer(self, msg: GenerateTurn) -> None:
        ids = self.tok.encode("ab")
        await self.bus.publish(subject(self.job_id, Verb.TURN), TurnResult(
            job_id=self.job_id, request_id=msg.request_id, episode_id=msg.episode_id, member_id=self.member_id,
            token_ids=ids, logprobs=[-1.0] * len(ids), stop_reason="eot", weights_version=self.version))

    async def release(self, lose: bool = False) -> list[GenerateTurn]:
        """Answer every held request (or drop them: ``lose``); returns them."""
        held, self.held = self.held, []
        if not lose:
            for msg in held:
                await self.answer(msg)
        return held


class Harness:
    """Private servers' NATS + Redis, a fake controller, fake replicas and the request manager."""

    def __init__(self, settings: Any, spec: dict[str, Any]) -> None:
        self.settings = settings
        self.spec = spec
        self.job_id = f"{spec['name']}-{uuid.uuid4().hex[:8]}"
        self.faults: list[FaultReport] = []
        self.batches: dict[int, BatchReady] = {}
        self.replicas: dict[str, FakeReplica] = {}
        self.rm: RequestManager | None = None
        self.rm_bus: Bus | None = None
        self.committed = -1
        self.rm_samples: list[MetricsSample] = []  # the request manager's own metrics
        self.answer_spec = True  # False: the controller is busy (its spec does not come)

    async def __aenter__(self) -> Harness:
        self.bus = await Bus.connect(self.settings.nats_url, "harness")
        await self.bus.ensure_event_stream()
        self.redis = connect(self.settings.redis_url)
        self.episodes = EpisodeStore(self.redis, self.job_id)
        await self.bus.subscribe(subject(self.job_id, Verb.SPEC), SpecRequest, self._on_spec)
        await self.bus.subscribe(subject(self.job_id, Verb.FAULT), FaultReport, self._on_fault)
        await self.bus.subscribe(subject(self.job_id, Verb.BATCH), BatchReady, self._on_batch)
        await self.bus.subscribe(subject(self.job_id, Verb.METRICS, "request_manager"), MetricsSample,
                                 self._on_rm_metrics)
        await JobRegistry(self.redis).put(self.job_id, {"spec": self.spec, "status": "running"})
        return self

    async def __aexit__(self, *exc: object) -> None:
        await JobRegistry(self.redis).put(self.job_id, {"spec": self.spec, "status": "finished"})
        for rep in self.replicas.values():
            await rep.stop()
        await self.kill_rm()
        await self.bus.close()
        await self.redis.aclose()

    async def _on_spec(self, msg: SpecRequest, _s: str, reply: str | None) -> None:
        if not self.answer_spec:
            return
        await self.bus.respond(reply, SpecReply(job_id=self.job_id, spec=self.spec, epoch=1,
                                                resume_step=self.committed + 1))

    async def _on_fault(self, msg: FaultReport, _s: str, _r: str | None) -> None:
        self.faults.append(msg)

    async def _on_rm_metrics(self, msg: MetricsSample, _s: str, _r: str | None) -> None:
        self.rm_samples.append(msg)

    async def _on_batch(self, msg: BatchReady, _s: str, _r: str | None) -> None:
        self.batches[msg.step] = msg

    async def replica(self, member_id: str, version: int = 0) -> FakeReplica:
        rep = self.replicas[member_id] = FakeReplica(self.bus, self.job_id, member_id, version)
        await rep.start()
        return rep

    async def start_rm(self, send_resume: bool = True, redis_url: str | None = None) -> RequestManager:
        """A request manager process-equivalent: its own connection; finds the job by itself
        (registry) or is told ``resume``. Told to resume, it is a first start: the replicas say
        hello and have again, as replicas starting after it would. ``redis_url``: another way to
        the Redis server (a proxy of the test's)."""
        # With the request manager's own credentials (NATS user, Redis ACL user), as the stack
        # starts it: a path that needs a key or subject its role may not touch fails here too.
        own = rm_role_settings(self.settings)
        self.rm_bus = await Bus.connect(own.nats_url, "request_manager", role="request_manager")
        self.rm_redis = connect(redis_url or own.redis_url)
        self.rm = RequestManager(self.rm_bus, self.rm_redis)
        await self.rm.start()
        self._rm_stop = asyncio.Event()
        self._rm_metrics = asyncio.create_task(self.rm.metrics_loop(METRICS_S, self._rm_stop))
        await self.rm_bus.client.flush()  # its subscriptions are in place before anyone asks
        if send_resume:
            # (as the leader: under the newest lease term's token, 0 while no controller ever ran)
            cmd = ControlCommand(job_id=self.job_id, target="request_manager", action="resume",
                                 args={"start_step": self.committed + 1, "committed": self.committed},
                                 fence=await newest_controller_fence(self.redis))
            # Acknowledged and retried, like the controller's commands (resume is idempotent).
            for attempt in range(3):
                try:
                    await self.bus.request(subject(self.job_id, Verb.CONTROL, "request_manager"), cmd,
                                           ControlCommand, timeout=5)
                    break
                except RequestTimeout:
                    if attempt == 2:
                        raise
            for rep in self.replicas.values():
                await rep.announce()
        return self.rm

    async def kill_rm(self) -> None:
        """Like SIGKILL for what the outside sees: its connection drops, nothing is cleaned up."""
        if self.rm is None:
            return
        rm, self.rm = self.rm, None
        self._rm_metrics.cancel()
        for job in rm.jobs.values():
            for task in (job._task, job._step_task, getattr(job, "_gc_task", None), job.events.queue._task):
                if task is not None:
                    task.cancel()
        for task in getattr(rm, "_tasks", []):
            task.cancel()
        assert self.rm_bus
        await self.rm_bus.close()
        await self.rm_redis.aclose()

    async def replica_dead_with_jetstream_away(self, fault_id: str, member_id: str) -> Any:
        """JetStream takes nothing from the request manager (its durable publishes never return);
        then the controller's ``replica_dead`` for ``member_id`` is sent and acknowledged: its
        event is in the outbox only. Returns the command (to send it again)."""
        from robustrl.services.controller.runtime import RM_ACK_TIMEOUT_S

        from robustrl.messages import ControlCommand

        assert self.rm_bus is not None
        never = asyncio.Event()

        async def jetstream_away(*args: object, **kw: object) -> None:
            await never.wait()

        self.rm_bus.publish_durable = jetstream_away  # type: ignore[method-assign]
        cmd = ControlCommand(job_id=self.job_id, target="request_manager", action="replica_dead",
                             args={"fault_id": fault_id, "member_id": member_id}, fence=1)
        await self.bus.request(subject(self.job_id, Verb.CONTROL, "request_manager"), cmd, ControlCommand,
                               timeout=RM_ACK_TIMEOUT_S)
        return cmd

    async def commit(self, step: int, durable: int = -1) -> None:
        self.committed = step
        await self.bus.publish(subject(self.job_id, Verb.COMMIT), StepCommitted(
            job_id=self.job_id, step=step, weights_version=step + 1, epoch=1, reward_mean=0.0, checksum="c",
            durable_step=durable))

    def requests(self) -> list[GenerateTurn]:
        return [m for r in self.replicas.values() for m in r.received]

    async def events(self, kind: str) -> list[dict[str, Any]]:
        return [e.data for e in await self.bus.read_events(self.job_id) if e.kind == kind]

    async def raw_keys(self) -> list[str]:
        return sorted(k.decode() for k in await self.redis.keys(f"rrl:{self.job_id}:*"))

    async def episode_keys(self, step: int) -> list[str]:
        return sorted(k.decode() for k in await self.redis.keys(Keys.episode(self.job_id, f"s{step}-*")))


def rm_role_settings(settings: Any) -> Any:
    """``settings`` with the request manager's credentials (its NATS and Redis users: the embedded
    infra generates every role's)."""
    from robustrl.infra.credentials import Credentials, role_settings
    from robustrl.subjects import Principal

    if not getattr(settings, "credentials_file", ""):
        raise AssertionError("the servers have no role credentials: the request manager would run as the admin")
    return role_settings(settings, Credentials.load(settings.credentials_file), Principal.REQUEST_MANAGER)
