"""Trainer gang worker: GRPO over N ranks in one torch.distributed group, per-step checkpoint,
weight publishing.

Step k trains on batch k and produces weights version k+1. After the optimizer step the
state is snapshotted into host memory (blocking, a memory copy), uploaded in the background
(manifest last), and the new version is flattened and served by every rank's weight server;
rank 0 announces it. On start a gang resumes from the newest complete checkpoint D and
redoes steps D+1.. from their batches, which the request manager keeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import errno
import gc
import logging
import math
import os
import signal
import socket
import sys
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from robustrl.services.trainer.lineage import LoopFence, RecordGate, read_history, resume_step
from robustrl.services.trainer.survivor import SURVIVOR_WAIT_S, SurvivorHook
from torch.nn.parallel import DistributedDataParallel as DDP

from robustrl.aio import wait_event, within
from robustrl.batch_digest import batch_digest
from robustrl.bus import DURABLE_DRAIN_S, EVENT_PUBLISH_RETRY_S, Bus, event_msg_id
from robustrl.checkpoint import (
    UPLOAD_WAIT_S,
    Checkpointer,
    CheckpointState,
    capture_rng,
    restore_rng,
    seed_rng,
)
from robustrl.checkpoint_catalog import MANIFEST
from robustrl.config import JobSpec, Settings
from robustrl.event_outbox import stored_of
from robustrl.errors import (
    EXIT_CHECKPOINT_LOST, EXIT_CHECKPOINT_STALLED, EXIT_DIVERGED, CheckpointLost, CheckpointStalled, ConfigError, RequestTimeout, StaleEpoch,
    StorageError, SubjectError, TransportError)
from robustrl.gpu import GpuProbe
from robustrl.member import Identity, Member, failpoint_armed
from robustrl.messages import BatchGet, BatchReady, Event, StepCommitted, WeightsAnnounce
from robustrl.model.hf import load_tokenizer
from robustrl.model.policy import build_policy, weights_checksum
from robustrl.rl import grpo, tasks
from robustrl.storage.control_stores import OutboxEntry, TrainerOutbox
from robustrl.storage.fencing import GangFence
from robustrl.storage.objects import open_object_store
from robustrl.storage.redis_stores import EpisodeRecord, EpisodeStore, connect
from robustrl.subjects import Verb, subject
from robustrl.weights.flat import flatten_state_dict
from robustrl.weights.server import WeightServer

log = logging.getLogger(__name__)
T = TypeVar("T")
BATCH_POLL_S = 2.0
BATCH_GET_TIMEOUT_S = 1.0
DIST_TIMEOUT_S = 60.0
EXIT_STALE = 75
"""Exit status (EX_TEMPFAIL) of a trainer whose gang a newer gang replaced before it started."""
LEAVE_UPLOAD_WAIT_S = 2.0
"""How long a rank kept for the next gang waits for its broken gang's running checkpoint upload."""
BRIEF_DRAIN_S = 2.0
"""How long a brief close (the gang broke, or the rank is kept) waits for events still being stored."""


OUTBOX_LOG_READ_S = 5.0
"""How long the next gang's rank 0 reads the log for the trainer outbox's entries JetStream already
stored (``event_outbox.stored_of``); past it, or refused, it appends every entry as before."""
FINAL_UPLOAD_RETRIES_S = (2.0, 4.0, 8.0)
"""Pauses before each new upload of the job's last checkpoint whose upload failed (then rank 0
stops, named, and the next gang redoes the step)."""
OUTBOX_SAVE_S = 5.0
"""Bound on saving one of a rank's events in the trainer outbox (Redis answers in milliseconds)."""

GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
"""Torch's setting of the network interface Gloo uses (an operator's own value is kept)."""


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface that holds ``address`` (None: none does)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            return name
    return None


def rendezvous_listener(address: str, port: int) -> int | None:
    """A listening socket on ``address:port`` for the gang's rendezvous store (rank 0), as a file
    descriptor the store takes over. Torch's own TCPStore listens on every interface (``::``):
    bound here to the address the other ranks dial (MASTER_ADDR), nothing beyond it reaches it.

    Returns:
        The descriptor; or None, and the store listens on every interface as torch does, where
        binding one address could leave a peer unable to connect: ``address`` does not resolve
        (yet: a Service's DNS record may lag; torch's own connect retries), resolves to several
        addresses (peers may pick another), is not an address of this machine (a Service or NAT
        address in front of rank 0), or cannot be bound for another reason than the port being
        taken (an IPv6 address not yet usable).
    Raises:
        OSError: the port is taken (torch's own listen raises DistNetworkError).
    """
    try:
        found = {info[4][:2] for info in socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)}
    except socket.gaierror as exc:
        why = f"does not resolve ({exc})"
    else:
        import ipaddress

        if len(found) != 1:
            why = f"resolves to {len(found)} addresses ({sorted(a for a, _ in found)})"
        # (all of 127.0.0.0/8 is this machine's, though an interface lists only 127.0.0.1)
        elif not ipaddress.ip_address(next(iter(found))[0]).is_loopback and interface_of(next(iter(found))[0]) is None:
            why = "is not an address of this machine"
        else:
            ((ip, _),) = found
            family = socket.AF_INET6 if ":" in ip else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((ip, port))
                sock.listen(1024)
                return sock.detach()
            except OSError as exc:
                sock.close()
                if exc.errno == errno.EADDRINUSE:
                    raise
                # Not bindable (yet): an IPv6 address still tentative in a fresh namespace or pod
                # answers EADDRNOTAVAIL. Torch's listen on every interface works there; failing
                # rank 0 at each start would fail the job.
                why = f"cannot be bound ({exc})"
            except BaseException:
                sock.close()
                raise
    log.warning("MASTER_ADDR %s %s: the rendezvous store listens on every interface", address, why)
    return None


def agree_on_checkpoint(ckpt: Checkpointer, state: CheckpointState | None, rank: int, world_size: int,
                        device: torch.device | None = None) -> CheckpointState | None:
    """The checkpoint this rank resumes from: the one rank 0 chose (``state`` is this rank's own
    choice; the process group is up). Each rank scans the store on its own, in parallel, and in the
    common case they agree. A manifest landing between two ranks' scans (a stale gang's upload still
    in flight, an S3 put being retried) made them resume from different steps: gradients of
    different batches averaged, optimizer states apart, half of a batch never trained (an outside
    review found it). A rank that chose otherwise loads exactly rank 0's choice; one it cannot load
    fails this rank, and the gang's start with it, rather than train from another."""
    if world_size == 1:
        return state
    mine = None if state is None else (state.step, state.epoch)
    chosen: list[tuple[int, int] | None] = [mine]
    # (``device``: NCCL's object tensors go to this rank's GPU; set_device does not reach this thread)
    dist.broadcast_object_list(chosen, src=0, device=device)
    theirs = chosen[0]
    if theirs == mine:
        return state
    log.warning("rank %d chose checkpoint %s, rank 0 chose %s: loading rank 0's", rank, mine, theirs)
    return None if theirs is None else ckpt.load(theirs[0], theirs[1])


def checkpoint_prefix(job_id: str) -> str:
    return f"jobs/{job_id}/checkpoints"


def _trained_record(eps: list[EpisodeRecord]) -> dict[str, object]:
    """``step_committed``'s ``trained``: the episodes a step trained and a digest of what was read
    of them, which the auditor recomputes from the raw records (``robustrl.audit.trained``)."""
    return {"episodes": sorted(e.episode_id for e in eps), "digest": batch_digest(e.model_dump(mode="json") for e in eps)}


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "host CPU"


class _RefusingManifests:
    """Failpoint ``manifest_refused``: an object store that refuses every manifest write after the
    first ``allowed`` (a store that starts refusing them for good: quota, credentials);
    everything else goes through."""

    def __init__(self, store: Any, allowed: int = 2) -> None:
        self._store = store
        self._allowed = allowed

    def put(self, key: str, data: bytes) -> None:
        if key.endswith(f"/{MANIFEST}"):
            if self._allowed <= 0:
                raise StorageError(f"failpoint manifest_refused: {key} not written", key=key)
            self._allowed -= 1
        self._store.put(key, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


FAILPOINT_STEP = 1
"""The step at which a trainer failpoint fires (the second: past the job's first commit, so the
recovery is role-local, not the whole-job restart of a fault before any step committed)."""
FINAL_UPLOAD_SLOW_S = 25.0
"""Test-only (member failpoint ``final_upload_slow``, rank 0): the job's last checkpoint manifest is
written this much later, as behind a slow object store: longer than the other members' stop grace
at the job's end (``FINISH_GRACE_S``, 15 s)."""


class TrainingDiverged(RuntimeError):
    """A step's loss or gradient norm is not finite (the model diverged): no fault a restart cures,
    so the rank exits naming it before anything of the step is kept."""


class TrainerWorker:
    def __init__(self, ident: Identity, settings: Settings) -> None:
        self.ident = ident
        self.settings = settings
        self.member = Member(ident, settings)
        self.batches_seen: dict[int, BatchReady] = {}
        self.lineage: dict[int, str] = {}
        """version -> checksum of the weights this gang holds or made for it (its start version
        and every version it published since): a turn of such a version made with other weights
        is not this lineage's policy (``grpo.build_samples``)."""
        self._batch_event = asyncio.Event()
        self.hook: SurvivorHook | None = None
        """Set by ``run_member``: hands this process to the next gang when the controller keeps it."""
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._unremoved: list[str] = []  # stored commit events whose outbox removal failed

    # --- setup ------------------------------------------------------------------------------

    def _init_dist(self, backend: str) -> None:
        if backend == "gloo" and GLOO_IFNAME_ENV not in os.environ:
            # Gloo advertises the address of the machine's hostname, 127.0.0.1 where /etc/hosts
            # says so (containers, network namespaces): a rank on another node then connects to
            # its own loopback ("Connection refused") and the gang never forms. Its peers reach
            # this member at its bind address: Gloo is told to use the interface holding it.
            ifname = interface_of(self.settings.bind_host)
            if ifname is not None:
                os.environ[GLOO_IFNAME_ENV] = ifname
        # The env:// rendezvous (MASTER_ADDR / MASTER_PORT), with rank 0's store listening on
        # MASTER_ADDR only (``rendezvous_listener``) instead of on every interface.
        address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        timeout = datetime.timedelta(seconds=DIST_TIMEOUT_S)
        master = self.ident.rank == 0
        libuv = os.environ.get("USE_LIBUV", "1") != "0"  # (honoured as env:// does; both stores take a socket)
        store = dist.TCPStore(address, port, self.ident.world_size, is_master=master, timeout=timeout,
                              master_listen_fd=rendezvous_listener(address, port) if master else None,
                              use_libuv=libuv)
        dist.init_process_group(backend, store=store, rank=self.ident.rank, world_size=self.ident.world_size,
                                timeout=timeout)

    def _on_device(self, fn: Callable[..., T]) -> Callable[..., T]:
        """``fn`` run on this rank's CUDA device when called in another thread (``to_thread``):
        ``torch.cuda.set_device`` holds for the thread that called it, and NCCL's object
        collectives (``all_gather_object``) put their tensors on the calling thread's current
        device, which in a fresh thread is cuda:0 (every rank of a machine on one GPU)."""
        device = self.device

        def run(*args: Any, **kwargs: Any) -> T:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            return fn(*args, **kwargs)
        return run

    def _place(self, device: str) -> torch.device:
        """Move the model to ``model.device`` (GPU path: one CUDA device per rank on the machine)."""
        if device != "cuda":
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise ConfigError("model.device is cuda but torch sees no CUDA device", field="model.device")
        # the rank on its machine (LOCAL_RANK where a launcher sets it; ranks are else one per machine
        # or all on one machine, where the rank is the local one)
        local = int(os.environ.get("LOCAL_RANK", self.ident.rank))
        dev = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        self.model.to(dev)
        return dev

    def _count_activity(self, *_args: object) -> None:
        # Bumped from inside forward passes: a hung or stalled process cannot fake it.
        self.member.chaos.gate()
        self.member.activity += 1

    async def run(self, model: torch.nn.Module | None = None, borrowed_from: str | None = None) -> None:
        """Join the gang, resume from the newest complete checkpoint, train until the last step.

        Args:
            model: an already-built policy (a borrowed rollout replica hands over the one it served
                from; its weights are replaced by the checkpoint's at resume). None: build it.
            borrowed_from: the replica member this process was before the switch (for the log).
        """
        began = time.monotonic()
        if self.hook is not None:
            self.hook.attach(asyncio.get_running_loop(), self._leave)
        failed = False
        try:
            spec = await self.member.start()
            await self._run(spec, model, borrowed_from, began)
        except BaseException:
            failed = True
            raise
        finally:
            for handle in self._hooks:
                handle.remove()  # a kept rank's next worker counts activity on the same model
            if self.hook is not None:
                self.hook.detach()
            await self._close(brief=failed or self.leaving)

    def _leave(self) -> None:
        """The controller keeps this rank for the next gang: stop (no new step)."""
        self.member.stopping.set()
        self._batch_event.set()

    @property
    def leaving(self) -> bool:
        return self.hook is not None and self.hook.handoff is not None

    async def _close(self, brief: bool) -> None:
        """Close checkpointer, weight server and bus. ``brief``: the gang broke or this rank is
        kept for the next one, so a checkpoint upload still running is not waited for past
        ``LEAVE_UPLOAD_WAIT_S`` (rank 0's may wait for the shard of a rank that died: up to the
        shard wait, and the rank must be free to rejoin); it goes on in the background, fenced
        like any older gang's write, and the next gang loads what is complete."""
        recorded = getattr(self, "recorded", None)
        if recorded is not None:  # a step not recorded by now never will be: not made durable
            recorded.close()
        ckpt = getattr(self, "ckpt", None)
        if ckpt is not None:
            await self._finish_upload(ckpt, brief)
        server = getattr(self, "server", None)
        if server is not None:
            await server.close()
        redis = getattr(self, "redis", None)
        if redis is not None:  # on this loop (a kept rank's next gang runs on another one)
            with contextlib.suppress(Exception):
                await redis.aclose()
        # A kept rank must unwind within the survivor's UNWIND_S, upload wait and NATS's own
        # drain and close included: its events still in flight get less than a full drain.
        await self.member.close(drain_s=BRIEF_DRAIN_S if brief else DURABLE_DRAIN_S)

    async def _finish_upload(self, ckpt: Checkpointer, brief: bool) -> None:
        """Wait for the running checkpoint upload, in 1 s slices: a hand-off that comes while a
        normal close waits makes the wait brief. A brief wait that runs out abandons the upload:
        the broken gang's step will not become durable through this rank (the next gang owns the
        lineage), no manifest is written after this, not even one the fence would still admit,
        and rank 0 stops waiting for dead ranks' shards."""
        waited = 0.0
        while True:
            short = brief or self.leaving
            limit = LEAVE_UPLOAD_WAIT_S if short else UPLOAD_WAIT_S
            try:
                await asyncio.to_thread(ckpt.close, max(0.0, min(1.0, limit - waited)))
                return
            except TimeoutError as exc:
                waited += 1.0
                if waited < limit:
                    continue
                if not short:
                    raise
                ckpt.abandon()
                log.warning("left the gang with its checkpoint upload abandoned: %s", exc)
                return

    async def _run(self, spec: JobSpec, model: torch.nn.Module | None, borrowed_from: str | None,
                   began: float) -> None:
        self.spec = spec
        torch.set_num_threads(1)
        marks = {"spec": time.monotonic() - began}
        await asyncio.to_thread(self._init_dist, spec.trainer.backend)
        marks["gang"] = time.monotonic() - began
        # The char tokenizer, or a Hugging Face model directory's own tokenizer + chat template.
        self.tok = load_tokenizer(spec.model)
        # Heavy or collective work runs off the event loop, so metrics and probe answers keep
        # flowing while the gang forms (a blocked loop would look like a dead member).
        if model is None:
            self.model = await asyncio.to_thread(build_policy, spec.model, self.tok, spec.seed)
        else:
            self.model = model
            self.model.requires_grad_(True)
            for p in self.model.parameters():
                p.grad = None  # a kept rank's broken step may have left gradients behind
        self._handed_model = model is not None
        for layer in self.model.modules():
            if layer.__class__.__name__.endswith("DecoderLayer"):
                self._hooks.append(layer.register_forward_hook(self._count_activity))
        marks["model"] = time.monotonic() - began
        self.device = self._place(spec.model.device)
        # NVML's first calls (init, a read) off the loop: a failing device can block in the driver.
        self.member.gpu = await asyncio.to_thread(GpuProbe.for_device, self.device)
        marks["placed"] = time.monotonic() - began
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=spec.trainer.lr)
        store = open_object_store(self.settings)
        self.redis = connect(self.settings.redis_url)
        self.episodes = EpisodeStore(self.redis, self.ident.job_id)
        # Every write of this gang to Redis carries its epoch; a newer gang's first write makes
        # ours refused (StaleEpoch), and this gang stops.
        self.gang = GangFence(self.redis, self.ident.job_id, self.member.epoch)
        self.recorded = RecordGate()  # a step's manifest waits for its training record (rank 0)
        fence = (LoopFence(self.gang, asyncio.get_running_loop(), gate=self.recorded) if self.ident.rank == 0
                 else None)
        if fence is not None and failpoint_armed("final_upload_slow", self.ident.job_id, self.ident.member_id):
            fence.hold = {spec.steps - 1: FINAL_UPLOAD_SLOW_S}
        if failpoint_armed("manifest_refused", self.ident.job_id, self.ident.member_id):
            store = _RefusingManifests(store)  # test-only: manifest writes fail after the first two
        self.ckpt = Checkpointer(store, checkpoint_prefix(self.ident.job_id), keep=spec.trainer.checkpoint_keep,
                                 rank=self.ident.rank, world_size=self.ident.world_size, epoch=self.member.epoch,
                                 fence=fence)
        self.server = WeightServer(spec.weights.transport, host=self.settings.bind_host,
                                   port=self.settings.weights_port, max_versions=2)
        self.address = await self.server.start()
        bus = self.member.bus
        assert bus
        await bus.subscribe(subject(self.ident.job_id, Verb.BATCH), BatchReady, self._on_batch)

        await self._resume()
        marks["resumed"] = time.monotonic() - began
        # After the resume, when every rank holds the same state (DDP's start broadcasts rank 0's
        # parameters: before the resume, a kept or borrowed rank 0 would hand its own to the rest).
        ddp_kw = {"device_ids": [self.device.index]} if self.device.type == "cuda" else {}
        self.ddp = (await asyncio.to_thread(lambda: DDP(self.model, **ddp_kw)) if self.ident.world_size > 1
                    else self.model)
        self.member.weights_version = self.version
        addresses = [None] * self.ident.world_size
        await asyncio.to_thread(self._on_device(dist.all_gather_object), addresses, self.address)
        self.sources = [a for a in addresses if a]
        await self._publish(self.version)
        await self.member.hello(self.address, resume_step=self.step)
        # Where a start's seconds went (seconds since this process's worker began, cumulative).
        log.info("ready on %s (%s, %s gang of %d) at %.2fs: spec %.2f, gang %.2f, model %.2f, placed %.2f, "
                 "resumed %.2f", self.device, _device_name(self.device), spec.trainer.backend,
                 self.ident.world_size, time.monotonic() - began, marks["spec"], marks["gang"], marks["model"],
                 marks["placed"], marks["resumed"])
        if self.ident.rank == 0:
            await self._emit_kept("member_ready", {
                "member_id": self.ident.member_id, "role": "trainer", "epoch": self.member.epoch,
                "resume_step": self.step, "weights_version": self.version}, die_at="ready_unsent")
        if borrowed_from is not None:
            await self._emit_kept("role_switched", {
                "member_id": self.ident.member_id, "from_member": borrowed_from, "role": "trainer",
                "rank": self.ident.rank, "epoch": self.member.epoch, "join_s": time.monotonic() - began,
                "handed_model": self._handed_model})
        try:
            await self._loop()
        except StaleEpoch as exc:
            # A newer gang has taken over (we are a zombie of a replaced gang): write nothing more.
            log.error("gang %d is stale, stopping: %s", self.member.epoch, exc)
            self.member.stopping.set()

    async def _resume(self) -> None:
        """Enter the fence, load the newest checkpoint that verifies, and check that the history
        after it can be redone (else ``CheckpointLost``: never train over a committed history)."""
        record = await self.gang.enter()
        if self.ident.rank == 0:
            await self._append_outbox()
        state = await asyncio.to_thread(self.ckpt.load_latest)
        state = await asyncio.to_thread(agree_on_checkpoint, self.ckpt, state, self.ident.rank,
                                        self.ident.world_size, self.device if self.device.type == "cuda" else None)
        loaded = None if state is None else state.step
        history = await read_history(self.redis, self.ident.job_id, record, loaded)
        resume_step(loaded, history)  # raises CheckpointLost: main() exits with its reason
        if self.ident.rank == 0:
            # Before this gang trains or commits anything: a stale gang's manifest above
            # ``loaded`` that lands from now on is off the lineage (checkpoint_catalog).
            await asyncio.to_thread(self.ckpt.start_lineage, state)
        if state is not None:
            self.model.load_state_dict(state.model_state)
            self.opt.load_state_dict(state.optim_state)
            restore_rng(state.rng_for(self.ident.rank) or state.rng)
            self.step, self.version, self.durable = state.step + 1, state.weights_version, state.step
            if self.ident.rank == 0:
                await self.gang.durable(state.step)  # this gang's lineage starts here
            log.info("resumed from checkpoint step %d epoch %d (version %d)", state.step, state.epoch,
                     state.weights_version)
        else:
            if self._handed_model:
                # No checkpoint: the gang starts from the seeded initial weights. A handed-over
                # model holds a replica's served version or a kept rank's trained steps: put back
                # the initial ones (else DDP would broadcast trained weights as version 0 and
                # step 0 would be applied twice).
                fresh = await asyncio.to_thread(build_policy, self.spec.model, self.tok, self.spec.seed)
                self.model.load_state_dict(fresh.state_dict())
            self.step, self.version, self.durable = 0, 0, -1

    # --- batches ----------------------------------------------------------------------------

    async def _on_batch(self, msg: BatchReady, _s: str, _r: str | None) -> None:
        self.batches_seen[msg.step] = msg
        self._batch_event.set()

    async def _wait_batch(self, step: int) -> BatchReady | None:
        bus = self.member.bus
        assert bus
        if step == FAILPOINT_STEP and failpoint_armed("batch_deaf", self.ident.job_id, self.ident.member_id):
            log.warning("failpoint batch_deaf: %s never takes batch %d", self.ident.member_id, step)
            await self.member.stopping.wait()
            return None
        while step not in self.batches_seen and not self.member.stopping.is_set():
            # Ask once (a restarted gang re-fetches a batch handed over before it started),
            # then wait for the broadcast; the request is repeated only as a safety net.
            self._batch_event.clear()
            try:
                got = await bus.request(subject(self.ident.job_id, Verb.BATCH_GET),
                                        BatchGet(job_id=self.ident.job_id, step=step), BatchReady,
                                        timeout=BATCH_GET_TIMEOUT_S)
                if got.episode_ids and got.step == step:
                    self.batches_seen[got.step] = got
                    break
            except RequestTimeout:
                pass  # request manager busy or restarting: the broadcast still reaches us
            if step in self.batches_seen:
                break
            await wait_event(self._batch_event, BATCH_POLL_S)
        return self.batches_seen.get(step)

    # --- the step ---------------------------------------------------------------------------

    def _train(self, samples: list[grpo.TrainSample]) -> dict[str, float]:
        rewards = torch.tensor([s.reward for s in samples])
        adv = grpo.group_advantages(rewards, grpo.group_index([s.group_id for s in samples]))
        mine = list(range(self.ident.rank, len(samples), self.ident.world_size))
        return grpo.train_on_samples(self.ddp, self.opt, [samples[i] for i in mine],
                                     clip_eps=self.spec.trainer.clip_eps, pad_id=self.tok.pad_id,
                                     advantages=adv[mine], vocab=self.tok.vocab_size,
                                     # the distribution the replicas sampled from (behaviour logprobs)
                                     temperature=self.spec.rollout.temperature, top_p=self.spec.rollout.top_p,
                                     micro_batch_tokens=self.spec.trainer.micro_batch_tokens,
                                     # off-policy turns exist only with staleness > 0 (semi-sync, async)
                                     is_cap=self.spec.trainer.is_cap if self.spec.staleness > 0 else None)

    async def _loop(self) -> None:
        bus = self.member.bus
        assert bus
        job = self.ident.job_id
        while self.step < self.spec.steps and not self.member.stopping.is_set():
            step = self.step
            await self.member.set_phase("waiting_batch", step)
            batch = await self._wait_batch(step)
            if batch is None or self.member.stopping.is_set():
                break
            seed_rng(self.spec.seed, step, self.ident.rank)  # a redo of this step draws the same
            if self.ident.rank == 0:
                claim = await self.gang.claim(step, self.durable)
                if claim == "refused":
                    # A newer gang holds this step (we are stale), or the step is already trained
                    # in this durable lineage: training it would apply the batch twice. Stop; the
                    # controller replaces or has replaced this gang (our peers fail the next
                    # collective and exit too).
                    log.error("gang %d may not train batch %d (fence refused): stopping",
                              self.member.epoch, step)
                    self.member.stopping.set()
                    break
            if self.ident.rank == 0:  # the batch claimed, nothing trained
                await self._die_at("claimed", step)
            t0 = time.monotonic()
            # Still "waiting_batch" while the batch is read and a drop is logged: those wait on
            # Redis and JetStream (retried for up to ~30 s in an outage), with no forward pass to
            # bump the activity counter, and the detector's idle rule for "training" (4 s in the
            # scaled profiles) took a healthy gang for hung (an outside review).
            eps = await self.episodes.get_many(batch.episode_ids)
            samples = grpo.build_samples(
                [(tasks.Prompt.from_dict(e.prompt),
                  [tasks.Turn(t.role, t.token_ids, t.logprobs, t.weights_version, t.stop_reason, t.weights_checksum)
                   for t in e.turns],
                  float(e.reward or 0.0)) for e in eps], self.tok, [e.episode_id for e in eps],
                # the request manager honours the bound at dispatch; this holds it at training too
                min_version=self.spec.min_version(step), lineage=self.lineage)
            stale_turns = sum(s.stale_turns for s in samples)
            if stale_turns and self.ident.rank == 0:
                await self._emit_kept("stale_turns_dropped", {
                    "step": step, "epoch": self.member.epoch, "turns": stale_turns,
                    "tokens": sum(s.stale_tokens for s in samples), "min_version": self.spec.min_version(step)})
            # Behaviour versions of the trained turns, as lag behind this step (diagnostics of
            # off-policy training: what a redo after a recovery trains on is visible per step).
            lags: dict[str, int] = {}
            for e in eps:
                for t in e.turns:
                    if t.role == "assistant":
                        key = str(step - t.weights_version)
                        lags[key] = lags.get(key, 0) + 1
            await self.member.set_phase("training", step)
            stats = await asyncio.to_thread(self._train, samples)
            if step == FAILPOINT_STEP and failpoint_armed("diverge", self.ident.job_id, self.ident.member_id):
                log.warning("failpoint diverge: step %d's loss taken for NaN", step)
                stats["loss"] = math.nan
            diverged = {k: v for k, v in stats.items() if not math.isfinite(v)}
            if diverged:
                # Named here, before the step is checkpointed, published or recorded: a commit
                # with a non-finite loss is refused on the bus, and raised there it killed rank 0
                # half-way through the step's commit (an outside review).
                raise TrainingDiverged(f"step {step} (gang {self.member.epoch}): training diverged: "
                                       f"{diverged} not finite; nothing of the step is kept")
            # What was trained, for the auditor (robustrl.batch_digest): which episodes, read how.
            trained = (await asyncio.to_thread(_trained_record, eps)) if self.ident.rank == 0 else None
            train_s = time.monotonic() - t0
            self.version = step + 1
            self.member.weights_version = self.version
            await self.member.set_phase("checkpointing", step)
            # One writer per key: rank 0 writes the replicated model and optimizer, every rank its RNG.
            replicated = ({"model_state": self.model.state_dict(), "optim_state": self.opt.state_dict()}
                          if self.ident.rank == 0 else {})
            snap = await asyncio.to_thread(
                self.ckpt.snapshot, step, rng=capture_rng(), data_cursor=step + 1, weights_version=self.version,
                **replicated)
            if isinstance(self.ckpt.last_error, StaleEpoch):
                raise self.ckpt.last_error  # the previous manifest was refused: a newer gang took over
            durable = self.ckpt.durable_step
            if durable is not None:
                self.durable = max(self.durable, durable)
            if self.ident.rank == 0 and step - self.durable > self.spec.trainer.max_undurable_steps:
                # An upload that failed was only logged: the gang trained on with nothing durable,
                # for good (an outside review). Stopped here, before this step is committed.
                raise CheckpointStalled(
                    f"step {step}: no checkpoint durable since step {self.durable} "
                    f"(trainer.max_undurable_steps={self.spec.trainer.max_undurable_steps}); "
                    f"the last upload's error: {self.ckpt.last_error!r}", name=f"step {step}")
            upload = self.ckpt.upload_stats
            await self.member.set_phase("publishing", step)
            if step == FAILPOINT_STEP and failpoint_armed("publish_wedged", self.ident.job_id, self.ident.member_id):
                # Test-only: a publish that never returns, the member's metrics still flowing.
                log.warning("failpoint publish_wedged: %s never publishes step %d", self.ident.member_id, step)
                await self.member.stopping.wait()
                break
            t1 = time.monotonic()
            checksum = await self._publish(self.version)
            if self.ident.rank == 0:  # its version published, its training not yet recorded
                await self._die_at("published_unrecorded", step, durable=True)
            publish_s = time.monotonic() - t1
            if self.ident.rank == 0:
                timings = {**batch.timings, "training_s": train_s, "checkpoint_blocking_s": snap.blocking_s,
                           "checkpoint_wait_s": snap.wait_s, "upload_s": upload.upload_s if upload else 0.0,
                           "publish_s": publish_s, "loss": stats["loss"], "stale_turns_dropped": float(stale_turns)}
                commit_event = Event(job_id=job, kind="step_committed", data={
                    "step": step, "epoch": self.member.epoch, "weights_version": self.version,
                    "reward_mean": batch.reward_mean, "checksum": checksum, "timings": timings,
                    "checkpoint_bytes": snap.bytes, "durable_step": self.durable,
                    "train": {k: round(v, 6) for k, v in stats.items()}, "turn_lag": lags, "trained": trained})
                saved = OutboxEntry(msg_id=event_msg_id(job, "step_committed"), event=commit_event)
                saved_text = saved.model_dump_json()
                # The record and the event it owes in one fenced script: a rank killed before
                # JetStream stored the event leaves it to the next gang (``_append_outbox``).
                await self.gang.record_trained(step, checksum, saved_text)
                self.recorded.recorded(step)
                # The worst moment for the commit's event: the step trained, recorded and its
                # checkpoint durable (the next gang resumes past it), its event not yet sent.
                await self._die_at("commit_unsent", step, durable=True)
                commit = StepCommitted(job_id=job, step=step, weights_version=self.version,
                                       epoch=self.member.epoch, reward_mean=batch.reward_mean, checksum=checksum,
                                       durable_step=self.durable, timings=timings,
                                       checkpoint_bytes=snap.bytes)
                await bus.publish(subject(job, Verb.COMMIT), commit)
                await self._retry_outbox_removals()
                await bus.emit_event(job, "step_committed", commit_event.data, commit_event.ts,
                                     msg_id=saved.msg_id, settled=self._outbox_removal(saved_text))
            self.step += 1
        await self.member.set_phase("idle")
        if self.step >= self.spec.steps:
            await self._last_checkpoint()
            # Members live until the controller stops them: exiting on our own would look like
            # a machine loss.
            await self.member.stopping.wait()

    async def _last_checkpoint(self) -> None:
        """All steps trained: the last step's checkpoint made durable. No later snapshot replaces
        one whose upload failed, so it is uploaded again (``FINAL_UPLOAD_RETRIES_S`` apart); still
        failing, the rank stops, named (``CheckpointStalled``), and the next gang redoes the step
        from the newest durable checkpoint. Before, the failure was only logged, and the job was
        stopped as finished without its final checkpoint (an outside review). A slow upload is no
        failure: it is waited for as long as the close waits for it."""
        retries = iter(FINAL_UPLOAD_RETRIES_S)
        while True:
            try:
                durable = await asyncio.to_thread(self.ckpt.wait_uploaded, UPLOAD_WAIT_S)
            except TimeoutError as exc:
                log.error("all steps trained; %s", exc)
                return
            error = self.ckpt.last_error
            if error is None or isinstance(error, StaleEpoch) or self.member.stopping.is_set():
                log.info("all steps trained; newest durable checkpoint %s", durable)
                return
            pause = next(retries, None)
            if pause is None:
                break
            log.error("all steps trained; the last checkpoint's upload failed (%r): uploaded again in %.0f s",
                      error, pause)
            if await wait_event(self.member.stopping, pause):
                return
            self.ckpt.upload_again()
        # Every rank: one whose own part keeps failing held rank 0's manifest up for its whole shard
        # wait at each try (past the controller's wait for the last step to become durable).
        raise CheckpointStalled(f"step {self.spec.steps - 1}: the job's last checkpoint not durable after "
                                f"{len(FINAL_UPLOAD_RETRIES_S) + 1} uploads (rank {self.ident.rank}); the last "
                                f"one's error: {error!r}", name=f"step {self.spec.steps - 1}")

    async def _die_at(self, point: str, step: int | None, durable: bool = False) -> None:
        """Test-only: SIGKILL this process at ``point`` when that member failpoint is armed for it
        (``robustrl.member.FAILPOINTS_ENV``) and ``step`` is ``FAILPOINT_STEP`` (None: any step);
        ``durable``: once the step's checkpoint upload ended, or has not ended in 5 s (held: see
        ``RecordGate``), whichever comes first."""
        if (step is not None and step != FAILPOINT_STEP) or not failpoint_armed(point, self.ident.job_id,
                                                                                self.ident.member_id):
            return
        if durable:
            with contextlib.suppress(TimeoutError):
                await asyncio.to_thread(self.ckpt.wait_uploaded, 5.0)
        made = self.ckpt.durable_step
        log.warning("failpoint %s: killed at step %d (durable %s)", point, step, made)
        os.kill(os.getpid(), signal.SIGKILL)

    # --- the trainer outbox (a commit's event kept until JetStream stored it) ------------------

    async def _emit_kept(self, kind: str, data: dict[str, Any], die_at: str | None = None) -> None:
        """Send one of this rank's events, kept in the trainer outbox until JetStream stored it:
        sent with the bus alone, one JetStream did not take within its budget waited in memory,
        and was lost with the rank (a gang's ``member_ready``, which the auditor reads each gang's
        resume step from; an outside review). The next gang's rank 0 appends what is left
        (``_append_outbox``). A save Redis refuses (bounded) leaves the event to the bus alone,
        logged. ``die_at``: a test failpoint between the save and the send."""
        bus = self.member.bus
        assert bus
        job = self.ident.job_id
        event = Event(job_id=job, kind=kind, data=data)  # type: ignore[arg-type]
        entry = OutboxEntry(msg_id=event_msg_id(job, kind), event=event)
        settled = None
        try:
            text = await within(TrainerOutbox(self.redis, job).add(entry), OUTBOX_SAVE_S)
            settled = self._outbox_removal(text)
        except (TransportError, TimeoutError) as exc:
            log.warning("%s not kept in the trainer outbox (sent with the bus alone): %s", kind, exc or "timed out")
        if die_at is not None:
            await self._die_at(die_at, None)
        await bus.emit_event(job, kind, event.data, event.ts, msg_id=entry.msg_id, settled=settled)

    def _outbox_removal(self, text: str) -> Callable[[], Awaitable[None]]:
        """Once JetStream stored the event saved as ``text``: out of the outbox (a failed removal is
        tried again at the next commit; left there, the next gang finds the event in the log and
        drops the entry, see ``_append_outbox``)."""
        async def remove() -> None:
            try:
                await TrainerOutbox(self.redis, self.ident.job_id).remove(text)
            except TransportError as exc:
                log.warning("a stored commit event not removed from the trainer outbox (retried): %s", exc)
                self._unremoved.append(text)
        return remove

    async def _retry_outbox_removals(self) -> None:
        while self._unremoved:
            try:
                await TrainerOutbox(self.redis, self.ident.job_id).remove(self._unremoved[0])
            except TransportError as exc:
                log.warning("%d stored commit events still in the trainer outbox: %s", len(self._unremoved), exc)
                return
            self._unremoved.pop(0)

    async def _append_outbox(self) -> None:
        """Rank 0 of a gang that just entered the fence: append the commit events an older gang
        saved and JetStream never stored (its rank killed first), under their message ids. No
        older gang can save another one now (its record is refused).

        An entry whose event the log already holds (JetStream stored it, and the rank was killed
        before the removal, or the removal failed and the gang died before retrying it) is only
        removed: appended again past JetStream's duplicate window, it would be a second
        ``step_committed`` for its (step, epoch). The log is read for the entries' message ids
        (``event_outbox.stored_of``, bounded); a log that cannot be read leaves every entry appended as
        before (stored once if within the window), with a warning."""
        bus = self.member.bus
        assert bus
        outbox = TrainerOutbox(self.redis, self.ident.job_id)
        entries = await outbox.entries()
        if not entries:
            return
        stored: set[str] = set()
        try:
            stored = await within(stored_of(bus, self.ident.job_id, bus.role, [e for _, e in entries],
                                            request_s=OUTBOX_LOG_READ_S), OUTBOX_LOG_READ_S)
        except (TransportError, TimeoutError) as exc:
            why = f"not read within {OUTBOX_LOG_READ_S:g} s" if isinstance(exc, TimeoutError) else str(exc)
            log.warning("the event log could not be read for the %d trainer outbox entries, all appended "
                        "(one stored longer ago than JetStream's duplicate window is then stored twice): %s", len(entries), why)
        appended = 0
        for raw, entry in entries:
            ev = entry.event
            if entry.msg_id in stored:  # stored already, its removal never ran: out of the outbox only
                log.warning("trainer outbox entry %s (%s) is in the log already: removed, not appended",
                            entry.msg_id, ev.kind)
                await self._outbox_removal(raw.decode())()
                continue
            try:
                await bus.emit_event(ev.job_id, ev.kind, ev.data, ev.ts, msg_id=entry.msg_id,
                                     settled=self._outbox_removal(raw.decode()))
                appended += 1
            except SubjectError as exc:  # not a trainer's event: can never be appended from here
                log.error("trainer outbox entry of kind %s dropped: %s", ev.kind, exc)
                await outbox.remove(raw)
        if appended:
            log.warning("appended %d commit events an older gang left in the trainer outbox", appended)

    async def _publish(self, version: int) -> str:
        """Serve ``version`` from this rank; rank 0 announces it and records it for late joiners."""
        buffer, manifest = await asyncio.to_thread(flatten_state_dict, self.model.state_dict(), version,
                                                   self.spec.weights.chunk_bytes)
        self.server.add_version(manifest, buffer)
        checksum = await asyncio.to_thread(weights_checksum, self.model)
        self.lineage[version] = checksum
        if self.ident.rank == 0:
            # By reference: the manifest (~90 B per chunk) is served by every source on MANIFEST;
            # inline it passed the bus's 1 MB message limit at about 11 GiB of weights.
            encoded = manifest.encode()
            ann = WeightsAnnounce(job_id=self.ident.job_id, version=version, epoch=self.member.epoch,
                                  checksum=checksum, sources=self.sources, manifest_digest=manifest.digest(),
                                  manifest_bytes=len(encoded))
            assert self.member.bus
            await publish_weights(self.member.bus, self.gang, ann, manifest.total_bytes, stopping=self.member.stopping)
        return checksum


PUBLISH_RETRY_WAIT_S = 1.0
"""The pause between two tries of a weights publication JetStream did not store."""


async def publish_weights(bus: Bus, gang: GangFence, ann: WeightsAnnounce, total_bytes: int,
                          retry_s: float = EVENT_PUBLISH_RETRY_S, stopping: asyncio.Event | None = None) -> None:
    """Make a version loadable, in this order: the ``weights_published`` event (durable), the
    fenced weights pointer (replicas read it every few seconds), the announcement (core NATS).

    A loadable version is in the event log first: a trainer that dies between two of these
    writes (or whose event JetStream does not store) leaves at most a version recorded that no
    replica loads, never one loaded that the log does not hold -- the auditor's check that every
    loaded checksum was published, and that the pointer names a published one.

    With ``stopping``, an event JetStream did not store within ``retry_s`` is tried again (a pause
    between tries, one message id for all: a try stored whose acknowledgement was lost is stored
    once) until it is stored or ``stopping`` is set: given up, rank 0 exited, and each outage
    longer than the budget cost a trainer fault and a gang restart (an outside review). The event
    alone is tried again, never once it is stored.

    Raises:
        TransportError: the event was not stored within ``retry_s`` (without ``stopping``, or once
            it is set), or the pointer's write failed; nothing was pointed at or announced (the
            trainer exits; its recovery resumes from the newest durable checkpoint).
    """
    msg_id = event_msg_id(ann.job_id, "weights_published")
    data = {"version": ann.version, "epoch": ann.epoch, "checksum": ann.checksum, "bytes": total_bytes}
    while True:
        try:
            await bus.emit_event(ann.job_id, "weights_published", data, required=True, retry_s=retry_s,
                                 msg_id=msg_id)
            break
        except TransportError as exc:
            if stopping is None or stopping.is_set():
                raise
            log.warning("weights v%d not in the event log yet (%s): trying again", ann.version, exc)
            await wait_event(stopping, PUBLISH_RETRY_WAIT_S)
    await gang.set_pointer(ann.encode())  # fenced: a stale gang cannot point late joiners back
    await bus.publish(subject(ann.job_id, Verb.WEIGHTS), ann)


def main() -> None:
    from robustrl.member import configure_logging

    ident = Identity.from_env(os.environ)
    configure_logging(ident.member_id)
    settings = Settings.from_env(os.environ)
    run_member(ident, settings)


def run_member(ident: Identity, settings: Settings, model: torch.nn.Module | None = None,
               borrowed_from: str | None = None, hook: SurvivorHook | None = None) -> None:
    """Run one trainer worker to its end; exit with the status the controller reads on a start
    that cannot succeed (``EXIT_CHECKPOINT_LOST``, ``EXIT_STALE``) or diverged (``EXIT_DIVERGED``).

    A rank the controller keeps for the next gang (``services/trainer/survivor.py``) runs on in
    this process as its new rank instead of exiting; so does a rank whose gang broke under it, if
    the hand-off comes within ``recovery.survivor_wait_s``. ``hook``: one installed already."""
    if hook is None:  # (a borrowed replica installed its own as soon as its loop closed)
        hook = SurvivorHook(os.environ)
        hook.install()
    worker = TrainerWorker(ident, settings)
    worker.hook = hook
    broke = False
    try:
        asyncio.run(worker.run(model, borrowed_from))
    except CheckpointLost as exc:
        # The last lines of a member's log become the fault evidence and the job's error.
        log.critical("trainer cannot start: %s", exc)
        _exit_now(EXIT_CHECKPOINT_LOST)
    except CheckpointStalled as exc:
        log.critical("trainer stopped: %s", exc)
        _exit_now(EXIT_CHECKPOINT_STALLED)
    except TrainingDiverged as exc:
        # Before the gang-broke handling below (a RuntimeError): the controller keeps no rank of a
        # diverged gang (``decide.may_keep``); its next gang loads the newest checkpoint.
        log.critical("trainer stopped: %s", exc)
        _exit_now(EXIT_DIVERGED)
    except StaleEpoch as exc:
        if hook.handoff is None:
            log.error("trainer gang replaced before it started, exiting: %s", exc)
            _exit_now(EXIT_STALE)
    except Exception as exc:  # noqa: BLE001 - a collective with a lost rank fails with whatever the backend raises
        # A collective with a lost rank fails with a RuntimeError (torch.distributed's errors,
        # gloo's and NCCL's, are all RuntimeErrors). Anything else (this rank's own NATS
        # connection closed, its Redis gone) is this rank's fault: it exits at once, so the
        # launcher sees the exit instead of the detector a silent rank 8 s later.
        if hook.handoff is None and (ident.world_size < 2 or not isinstance(exc, RuntimeError)):
            # Without the interpreter's teardown of a torch process (seconds): the exit is the
            # fault the launcher reports.
            log.critical("trainer failed: %r", exc, exc_info=exc)
            _exit_now(1)
        # The whole traceback in the log (the fault evidence if this rank is not kept); the
        # exception itself is not kept: its frames hold the worker, which must be freed.
        log.error("the gang broke", exc_info=exc)
        broke = True
    spec = getattr(worker, "spec", None)
    wait_s = float(spec.recovery.survivor_wait_s) if spec is not None else SURVIVOR_WAIT_S
    if broke and hook.handoff is None:
        log.error("waiting up to %.0f s to be kept for the next gang", wait_s)
    handoff = hook.wait(wait_s if broke else 0.0)
    if handoff is None:
        if broke:
            log.error("not kept for a next gang: exiting")
            _exit_now(1)
        # Stopped after its run: the last checkpoint upload was awaited, the weight server and
        # the bus are closed. Exit now: the interpreter's teardown of a torch process (module
        # finalizers, the gloo group, every object freed) took 4-10 s per member on this shared
        # machine at a job's end, and the controller waits for every member's exit before the
        # job is finished.
        log.info("trainer stopped; exiting")
        _exit_now(0)
        return
    kept_model = _release(worker)
    del worker
    if dist.is_initialized():
        dist.destroy_process_group()
    hook.unwound()
    from robustrl.services.rollout.standby import become_trainer

    become_trainer(handoff, kept_model, None, ident.member_id)


def _release(worker: TrainerWorker) -> torch.nn.Module | None:
    """Free what a worker of a broken gang holds but its model (optimizer state, the DDP wrapper
    whose reducer hooks the model's parameters, the Redis client), and check that the wrapper is
    gone: a leftover reducer would fire on the next gang's backward. Returns the model."""
    model = getattr(worker, "model", None)
    ddp = getattr(worker, "ddp", None)
    gone = None
    if ddp is not None and ddp is not model:
        gone = weakref.ref(ddp)
        with contextlib.suppress(Exception):
            ddp._remove_autograd_hooks()  # the reducer's hooks on the parameters: none may fire again
    del ddp  # (its Redis client was closed on its own loop, in ``_close``)
    for name in ("ddp", "opt", "ckpt", "server", "episodes", "gang", "redis", "model", "batches_seen"):
        if hasattr(worker, name):
            setattr(worker, name, None)
    gc.collect()
    if gone is not None and (left := gone()) is not None:
        holders = [getattr(getattr(r, "f_code", None), "co_name", None) or type(r).__name__
                   for r in gc.get_referrers(left)]
        del left
        log.error("the broken gang's DDP wrapper is still referenced after its worker was released (by %s)",
                  holders)
    else:
        log.info("released the broken gang's worker")
    return model


def _exit_now(code: int) -> None:
    # Not sys.exit: interpreter shutdown can block on the process group's threads, and a member
    # that neither runs nor exits looks like a hang instead of the failure it is.
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
