"""What every role member (trainer worker, rollout replica) shares: identity, finding the job
through NATS, phase and metrics publishing, heartbeat probes, and in-process chaos faults.

The activity counter is bumped only by real work (decoded tokens, forward/backward passes),
never by a timer, so a hung or stalled member cannot fake progress.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import psutil

from robustrl.aio import wait_event
from robustrl.bus import DURABLE_DRAIN_S, Bus
from robustrl.config import JobSpec, Settings
from robustrl.errors import ConfigError, RequestTimeout, StaleEpoch, TransportError
from robustrl.gpu import GpuProbe
from robustrl.health import HealthServer, serve_health
from robustrl.messages import (
    CHAOS_UNTIMED_S, ChaosCommand, ControlCommand, HelloAck, MemberHello, MetricsSample, PhaseChange, ProbeReply, ProbeRequest,
    SpecReply, SpecRequest,
)
from robustrl.subjects import Verb, subject

log = logging.getLogger(__name__)
SPEC_TIMEOUT_S = 3.0
SPEC_ATTEMPTS = 20
MEMBERS_TARGET = "members"  # control subject every member of a job listens on
FAILPOINTS_ENV = "ROBUSTRL_MEMBER_FAILPOINTS"
"""Test-only (unset in production): ``point``, ``point@member_id`` or ``point@job_name/member_id``,
comma-separated.
``start_hang``: the member's start stops once it has the spec (before its model, engine or gang),
while its event loop, metrics and probe answers go on, as when a model load blocks in a thread.
The controller's start deadline (``detector.start_deadline_s``) is what ends it.
``hello_lost``: the member's hello is never published (a publish lost on the bus); the member runs
on.
``hello_lost_first``: the member's first hello is not published; the ones it sends again are.
Trainer rank 0, each SIGKILLs the member at step 1 (``worker.FAILPOINT_STEP``): ``claimed`` (the step's batch claimed
in the fence, nothing trained), ``published_unrecorded`` (trained, checkpointed, its version
published; not yet recorded trained), ``commit_unsent`` (recorded trained and the step's checkpoint
durable; its ``step_committed`` not yet sent). Trainer rank 0, ``ready_unsent``: SIGKILLs the member
as its gang is ready (at any step), its ``member_ready`` kept in the trainer outbox and not yet sent.
A trainer, ``batch_deaf``: never takes step 1's batch (its broadcast and its requests lost alike)
and waits for it in phase ``waiting_batch``, the trainer's normal idleness, until it is stopped.
The request manager's commit deadline (``detector.commit_deadline_s``) is what ends it.
A trainer, ``publish_wedged``: trains step 1, then stays in phase ``publishing`` (its metrics going
on) until it is stopped. The detector's trainer I/O rule (``detector.trainer_io_s``) ends it.
A trainer, ``diverge``: step 1's loss is taken for NaN once trained (``TrainingDiverged``).
Trainer rank 0, ``final_upload_slow``: the job's last checkpoint manifest is written
``worker.FINAL_UPLOAD_SLOW_S`` (25 s) late, as behind a slow object store."""
HELLO_RESEND_S = (0.5, 5.0)
"""First and longest pause between sends of a hello the controller has not acknowledged."""
HELLO_RESEND_FOR_S = 600.0
"""How long a member sends its hello again while no controller acknowledges it. Past this a
controller that takes the job over finds the member by its metrics (an adopted member)."""


def failpoint_armed(point: str, job_id: str, member_id: str, env: Mapping[str, str] = os.environ) -> bool:
    """Whether ``point`` is armed for this member: as ``point``, ``point@member_id`` or
    ``point@name/member_id`` (only in jobs submitted as ``name``: ids are ``name-<hash>``)."""
    for entry in (e.strip() for e in env.get(FAILPOINTS_ENV, "").split(",")):
        name, _, target = entry.partition("@")
        job_name, _, member = target.rpartition("/")
        if name == point and (not target or (member == member_id and (
                not job_name or job_id.rsplit("-", 1)[0] == job_name))):
            return True
    return False


_TRAINER_ID = re.compile(r"trainer-e(\d+)-r(\d+)")


def trainer_id(epoch: int, rank: int) -> str:
    """The member id of rank ``rank`` of the trainer gang of epoch ``epoch``."""
    return f"trainer-e{epoch}-r{rank}"


def trainer_epoch(member_id: str) -> int | None:
    """The gang epoch in a trainer member id (``trainer_id``'s shape); None for another shape."""
    m = _TRAINER_ID.fullmatch(member_id)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Identity:
    job_id: str
    member_id: str
    role: str
    rank: int = 0
    world_size: int = 1

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Identity:
        try:
            return cls(env["ROBUSTRL_JOB_ID"], env["ROBUSTRL_MEMBER_ID"], env["ROBUSTRL_ROLE"],
                       int(env.get("ROBUSTRL_RANK", "0")), int(env.get("ROBUSTRL_WORLD_SIZE", "1")))
        except KeyError as exc:
            raise ConfigError(f"member environment lacks {exc.args[0]}", field=exc.args[0]) from exc


class ChaosState:
    """In-process faults the harness can switch on: stall, slow (fail-slow)."""

    def __init__(self) -> None:
        self.stall_until = 0.0
        self.slow_until = 0.0
        self.slow_factor = 1.0
        self.crash_armed_until = 0.0
        """Armed by a ``mid_tool_turn`` or ``mid_batch`` crash, until then (its ``duration_s``, else
        an hour): the replica calls :meth:`crash` once it generates a turn that follows a tool
        result (``mid_tool_turn``) or any turn (``mid_batch``). An arming no such turn reaches
        expires (a job without tool calls would carry it for good)."""
        self.crash_moment = "mid_tool_turn"
        """The moment of the newest arming (``messages.ChaosMoment``)."""
        self.crash_fault_id = ""
        """The injection's ``fault_id`` of the newest arming: named in ``fault_struck`` when it strikes."""
        self._wake = threading.Event()

    @staticmethod
    def crash() -> None:
        """Die now, with every process of the member's group, as a machine loss would."""
        for h in logging.getLogger().handlers:
            h.flush()
        os.killpg(os.getpgid(0), signal.SIGKILL)

    def crash_armed(self) -> bool:
        return time.monotonic() < self.crash_armed_until

    def gate(self) -> None:
        """Called by worker threads between units of work: blocks while stalled, adds delay
        while slow. The member stays alive and answers probes meanwhile."""
        while time.monotonic() < self.stall_until:
            self._wake.wait(0.05)

    def slow_delay(self, base_s: float) -> float:
        if time.monotonic() < self.slow_until:
            return base_s * (self.slow_factor - 1.0)
        return 0.0


class Member:
    """The NATS-facing side of one role member."""

    def __init__(self, ident: Identity, settings: Settings) -> None:
        self.ident = ident
        self.settings = settings
        self.bus: Bus | None = None
        self.spec: JobSpec | None = None
        self.epoch = 0
        self.resume_step: int | None = None
        self.phase = "starting"
        self.step = -1
        self.activity = 0
        self.tokens_total = 0
        self.queue_depth = 0
        self.inflight = 0
        self.tool_waiting = 0
        self.weights_version = -1
        self.chaos = ChaosState()
        self.gpu: GpuProbe | None = None
        """NVML readings of the member's GPU (set by a role that placed its model on cuda)."""
        self.stopping = asyncio.Event()
        self._seq = 0
        self._last_tokens = (time.monotonic(), 0)
        self._proc = psutil.Process()
        self._tasks: list[asyncio.Task[None]] = []
        self._health: HealthServer | None = None

    async def start(self) -> JobSpec:
        """Connect, find the job through NATS (ask the controller for the spec), say hello."""
        self.bus = await Bus.connect(self.settings.nats_url, self.ident.member_id, role=self.ident.role)
        # Optional (ROBUSTRL_HEALTH_PORT): what a container health check asks.
        self._health = await serve_health(
            f"{self.ident.role}/{self.ident.member_id}",
            {"nats": lambda: self.bus is not None and self.bus.connected,
             "running": lambda: not self.stopping.is_set()}, os.environ)
        reply = None
        for attempt in range(SPEC_ATTEMPTS):
            try:
                reply = await self.bus.request(
                    subject(self.ident.job_id, Verb.SPEC),
                    SpecRequest(job_id=self.ident.job_id, member_id=self.ident.member_id),
                    SpecReply, timeout=SPEC_TIMEOUT_S)
                break
            except RequestTimeout:
                log.warning("no job spec yet (attempt %d)", attempt + 1)
        if reply is None:
            raise ConfigError(f"controller never answered for job {self.ident.job_id}", field="job_id")
        self.spec = JobSpec.parse(reply.spec)
        self.epoch = reply.epoch
        own = trainer_epoch(self.ident.member_id) if self.ident.role == "trainer" else None
        if own is not None:
            # A rank is of the gang its id names, whatever the job's gang is now: the reply tells
            # the job's current epoch, and a rank of a replaced gang that asked late (a start
            # overtaken by a recovery, a kill that did not land) took it for its own, so its
            # fenced writes passed as the new gang's (an outside review).
            if reply.epoch > own:
                raise StaleEpoch(f"{self.ident.member_id} is of gang {own}, replaced: the job's gang is "
                                 f"{reply.epoch} now")
            self.epoch = own
        self.resume_step = reply.resume_step
        await self.bus.subscribe(subject(self.ident.job_id, Verb.PROBE, self.ident.member_id),
                                 ProbeRequest, self._on_probe)
        await self.bus.subscribe(subject(self.ident.job_id, Verb.CHAOS, self.ident.member_id),
                                 ChaosCommand, self._on_chaos)
        await self.bus.subscribe(subject(self.ident.job_id, Verb.CONTROL, MEMBERS_TARGET), ControlCommand,
                                 self._on_control)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        self._tasks.append(asyncio.create_task(self._metrics_loop()))
        if failpoint_armed("start_hang", self.ident.job_id, self.ident.member_id):
            log.warning("failpoint start_hang: %s holds its start until it is stopped", self.ident.member_id)
            await self.stopping.wait()
            raise RuntimeError("stopped while held at failpoint start_hang")
        return self.spec

    async def hello(self, address: str | None = None, resume_step: int | None = None) -> None:
        """Say this member is up, until the leading controller acknowledges it.

        The hello is one core-NATS publish: one sent while the controller's subscription is not
        back on a restarted server reaches no one, and a recovery waiting for this member would
        wait out its whole deadline (``recovery.deadline_s``) and then restart more than it must.
        So it carries a reply inbox, and is sent again (backing off ``HELLO_RESEND_S``, for at
        most ``HELLO_RESEND_FOR_S``) until the controller answers. The first send is awaited here,
        in order with what the member publishes next; the rest run in the background. Receivers
        take a hello again as the same news (the controller acts only on a member still starting).
        """
        assert self.bus
        if failpoint_armed("hello_lost", self.ident.job_id, self.ident.member_id):
            log.warning("failpoint hello_lost: %s does not publish its hello", self.ident.member_id)
            return
        msg = MemberHello(job_id=self.ident.job_id, member_id=self.ident.member_id,
                          role=self.ident.role,  # type: ignore[arg-type]
                          pid=os.getpid(), epoch=self.epoch, address=address, resume_step=resume_step)
        subj = subject(self.ident.job_id, Verb.HELLO, self.ident.member_id)
        inbox = self.bus.client.new_inbox()
        heard = asyncio.Event()

        async def _ack(ack: HelloAck, _s: str, _r: str | None) -> None:
            if ack.member_id == self.ident.member_id:
                heard.set()

        sub = await self.bus.subscribe(inbox, HelloAck, _ack)
        sent = 0
        if failpoint_armed("hello_lost_first", self.ident.job_id, self.ident.member_id):
            log.warning("failpoint hello_lost_first: %s does not publish its first hello", self.ident.member_id)
        else:
            await self.bus.publish(subj, msg, reply=inbox)
            sent = 1
        self._tasks.append(asyncio.create_task(self._hello_until_heard(subj, msg, inbox, heard, sub, sent)))

    async def _hello_until_heard(self, subj: str, msg: MemberHello, inbox: str, heard: asyncio.Event,
                                 sub: Any, sent: int) -> None:
        assert self.bus
        pause, give_up = HELLO_RESEND_S[0], time.monotonic() + HELLO_RESEND_FOR_S
        try:
            while not await wait_event(heard, pause):
                if self.stopping.is_set():
                    return
                if time.monotonic() > give_up:
                    log.warning("no controller acknowledged the hello of %s in %.0fs (%d sends): left to a "
                                "controller's takeover", self.ident.member_id, HELLO_RESEND_FOR_S, sent)
                    return
                try:
                    await self.bus.publish(subj, msg, reply=inbox)
                    sent += 1
                except Exception as exc:  # noqa: BLE001 - the bus away: the next round sends it again
                    log.debug("hello not sent again: %s", exc)
                pause = min(pause * 2, HELLO_RESEND_S[1])
            if sent != 1:
                log.warning("hello of %s acknowledged after %d sends", self.ident.member_id, sent)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def set_phase(self, phase: str, step: int | None = None) -> None:
        if step is not None:
            self.step = step
        if phase == self.phase:
            return
        self.phase = phase
        if self.bus:
            try:
                await self.bus.publish(
                    subject(self.ident.job_id, Verb.PHASE, self.ident.member_id),
                    PhaseChange(job_id=self.ident.job_id, member_id=self.ident.member_id,
                                role=self.ident.role, phase=phase, step=self.step))  # type: ignore[arg-type]
            except TransportError as exc:
                # The phase is set: every metrics sample carries it. A lost change message is no
                # failure of the work that changed it (a rank's step, a replica's load).
                log.warning("phase %s not published: %s", phase, exc)

    def sample(self) -> MetricsSample:
        now_m = time.monotonic()
        t0, n0 = self._last_tokens
        rate = (self.tokens_total - n0) / max(1e-6, now_m - t0)
        self._last_tokens = (now_m, self.tokens_total)
        self._seq += 1
        gpu = self.gpu.reading() if self.gpu is not None else None
        return MetricsSample(
            job_id=self.ident.job_id, member_id=self.ident.member_id, role=self.ident.role,  # type: ignore[arg-type]
            seq=self._seq, ts=time.time(), phase=self.phase, step=self.step, activity=self.activity,
            tokens_total=self.tokens_total, tokens_per_s=max(0.0, rate), queue_depth=self.queue_depth,
            inflight=self.inflight, tool_waiting=self.tool_waiting, weights_version=self.weights_version,
            rss_bytes=self._proc.memory_info().rss,
            gpu_util_pct=gpu.util_pct if gpu else None, gpu_mem_bytes=gpu.mem_bytes if gpu else None,
            gpu_lost=bool(gpu and gpu.lost))

    async def _metrics_loop(self) -> None:
        assert self.bus and self.spec
        interval = self.spec.detector.metrics_interval_s
        subj = subject(self.ident.job_id, Verb.METRICS, self.ident.member_id)
        while not self.stopping.is_set():
            try:
                await self.bus.publish(subj, self.sample())
            except Exception as exc:  # a dropped connection is the detector's business
                log.debug("metrics publish failed: %s", exc)
            await wait_event(self.stopping, interval)

    async def _on_control(self, msg: ControlCommand, _subject: str, _reply: str | None) -> None:
        # A restarted controller retires every member of the job's previous incarnation.
        if msg.action == "stop":
            log.warning("stopped by the controller: %s", msg.args.get("reason", ""))
            self.stopping.set()

    async def _on_probe(self, msg: ProbeRequest, _subject: str, reply: str | None) -> None:
        assert self.bus
        await self.bus.respond(reply, ProbeReply(member_id=self.ident.member_id, nonce=msg.nonce,
                                                 phase=self.phase))

    async def _on_chaos(self, msg: ChaosCommand, _subject: str, _reply: str | None) -> None:
        log.warning("chaos: %s for %.1fs (factor %.1f, moment %s)", msg.kind, msg.duration_s, msg.factor, msg.moment)
        until = time.monotonic() + (msg.duration_s or CHAOS_UNTIMED_S)
        if msg.kind == "stall":
            self.chaos.stall_until = until
        elif msg.kind == "slow":
            self.chaos.slow_until, self.chaos.slow_factor = until, msg.factor
        elif msg.kind == "net_drop":
            assert self.bus
            # Cut the NATS connection for good: the member goes silent, as on a network partition.
            await self.bus.client.close()
        elif msg.kind == "crash" and msg.moment != "now":
            if self.ident.role != "rollout":  # only a replica's generation loop carries it out
                log.error("chaos: %s refused: moment %s arms a rollout replica, this is a %s", msg.fault_id,
                          msg.moment, self.ident.role)
                return
            self.chaos.crash_moment, self.chaos.crash_fault_id = msg.moment, msg.fault_id
            self.chaos.crash_armed_until = until  # carried out by the generation loop
        elif msg.kind == "crash":
            self.chaos.crash()
        elif msg.kind == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)

    async def close(self, drain_s: float = DURABLE_DRAIN_S) -> None:
        """Stop; the bus waits up to ``drain_s`` for events still being stored (``Bus.close``)."""
        self.stopping.set()
        if self.gpu is not None:  # its reader thread (a role switch starts the next member's own)
            self.gpu.close()
        for task in self._tasks:
            task.cancel()
        if self._health:
            await self._health.close()
        if self.bus:
            await self.bus.close(drain_s=drain_s)


def configure_logging(member_id: str) -> None:
    logging.basicConfig(level=os.environ.get("ROBUSTRL_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s {member_id} %(levelname)s %(name)s: %(message)s")
