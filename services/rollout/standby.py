"""Warm standby from the rollout pool: a replica that switches role in place to a trainer rank.

On a trainer fault the controller may borrow a ready replica (``decide.plan_gang``): it tells the
request manager that the replica is gone (its in-flight turns are re-dispatched from their saved
prefixes), then asks the launcher to ``relabel`` the process, which writes the new member's
environment (``robustrl.launcher.spare.write_handoff``) and sends ``SIGUSR1``.

Here, inside the replica: the signal takes the hand-off and stops the replica (no new turns, the
engine thread finishes its batch, the relay server and the bus connection close, so the process no
longer exists as a replica on the bus). Then, in the same process, with torch initialised, the
model built and the served weights in memory, it becomes the trainer rank the hand-off names: it
joins the new gang, loads model and optimizer state from the newest complete checkpoint (the
trainer's usual resume; the replica's weights may be of a newer, not yet durable version), and
trains. Its output goes to the new member's log.

A vLLM replica holds no model of its own (vLLM's worker process does), but it holds the version
it serves: the buffer it pulled that version into and relayed from. On a hand-off its in-flight
requests are aborted and the ``AsyncLLM`` engine is shut down (its engine-core and worker
processes exit, the KV cache with them); then :func:`policy_from_served` builds the trainer's
policy in this process from that buffer (the architecture from ``model.path``'s config, no weights
read from disk) and the process runs on as the trainer rank like a torch replica. Where it held no
complete version, the trainer builds its policy itself (and resumes from the checkpoint as always).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from robustrl.config import ModelSpec, Settings
from robustrl.launcher.spare import HANDOFF_ENV, HANDOFF_SIGNAL, redirect_output, take_handoff
from robustrl.member import Identity

log = logging.getLogger(__name__)

ENGINE_JOIN_S = 10.0
"""How long the switch waits for the engine thread to finish the batch it is decoding."""


@dataclass(frozen=True)
class Handoff:
    """The member this process is to become."""

    env: dict[str, str]
    log: str

    @property
    def member_id(self) -> str:
        return self.env.get("ROBUSTRL_MEMBER_ID", "?")


class StandbyHook:
    """Listens for the launcher's hand-off signal in a running replica.

    Args:
        env: the replica's start environment (``ROBUSTRL_HANDOFF_DIR`` says where the hand-off
            is written; absent: the launcher cannot hand over, and the hook does nothing).
        stop: stops the replica (it then returns from its run loop).
    """

    def __init__(self, env: Mapping[str, str], stop: Callable[[], None]) -> None:
        self.directory = env.get(HANDOFF_ENV)
        self._stop = stop
        self.handoff: Handoff | None = None

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.directory:
            loop.add_signal_handler(HANDOFF_SIGNAL, self._on_signal)

    def _on_signal(self) -> None:
        if self.handoff is not None or not self.directory:
            return
        self.handoff = read_handoff(self.directory)
        if self.handoff is None:
            return
        log.warning("borrowed as %s: draining and switching role in place", self.handoff.member_id)
        self._stop()


def read_handoff(directory: str) -> Handoff | None:
    """Take this process's hand-off from ``directory`` (None, logged, when the signal came
    without one)."""
    order = take_handoff(directory, os.getpid())
    if order is None:
        log.warning("hand-off signal without a hand-off file in %s: ignored", directory)
        return None
    env = {str(k): str(v) for k, v in dict(order["env"]).items()}  # type: ignore[call-overload]
    return Handoff(env, str(order.get("log", "")))


def keep_listening(handoff: Handoff) -> Any:
    """The trainer rank's hand-off hook (``SurvivorHook``), installed now: the replica's loop has
    just closed, which put the hand-off signal back to its default action (terminate). Until the
    rank installed its own, after the engine thread's join (up to ``ENGINE_JOIN_S``) and, for
    vLLM, the policy's build, a signal that kept this rank for the next gang killed the process
    instead (an outside review). A signal that comes now waits in the hook's pipe."""
    from robustrl.services.trainer.survivor import SurvivorHook

    hook = SurvivorHook(handoff.env)
    hook.install()
    return hook


def become_trainer(handoff: Handoff, model: torch.nn.Module | None, engine_thread: threading.Thread | None,
                   borrowed_from: str, hook: Any = None) -> None:
    """Run the rest of this process as the trainer rank ``handoff`` names (blocks until it ends);
    ``hook``: its hand-off hook, installed already (``keep_listening``)."""
    if engine_thread is not None:
        engine_thread.join(ENGINE_JOIN_S)
        if engine_thread.is_alive():
            # Still decoding on the model (stalled, or deaf to the abort): training on the same
            # module would race it. Exit instead; the controller sees the rank exit and recovers.
            log.error("the engine thread did not stop within %.0f s: not switching role", ENGINE_JOIN_S)
            os._exit(1)
    if handoff.log:
        redirect_output(handoff.log)
    # torch.distributed's env:// rendezvous reads MASTER_ADDR / MASTER_PORT from the environment.
    os.environ.clear()
    os.environ.update(handoff.env)
    from robustrl.services.trainer.worker import run_member

    ident = Identity.from_env(handoff.env)
    settings = Settings.from_env(handoff.env)
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    from robustrl.member import configure_logging

    configure_logging(ident.member_id)
    log.warning("%s continues as %s (rank %d of %d)", borrowed_from, ident.member_id, ident.rank, ident.world_size)
    run_member(ident, settings, model=model, borrowed_from=borrowed_from, hook=hook)


def policy_from_served(spec: ModelSpec, served: Mapping[str, torch.Tensor] | None) -> torch.nn.Module | None:
    """The trainer's policy built from the weights a replica without an in-process model (vLLM)
    served: the causal LM class of ``spec.path``'s config, its tensors copied out of ``served``.

    The copies leave the trainer's parameters in ordinary memory rather than in the replica's
    receive buffer (a shared segment another process mapped; a parameter viewing a slice of it
    would also make ``torch.save`` write the whole buffer with each tensor). Nothing is read from
    the directory but its config: the weights are the served version's.

    Returns:
        The policy (float32, eval mode, like ``build_policy``'s), or None (logged) when nothing was
        served or the served tensors do not match the architecture: the trainer then builds its
        policy itself.
    """
    if not served or not spec.path:
        return None
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from robustrl.weights.flat import dtype_name, expected_layout

    try:
        config = AutoConfig.from_pretrained(spec.path, local_files_only=True)
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        state = {name: t.detach().clone() for name, t in served.items()}
        model = cls.from_pretrained(None, config=config, state_dict=state)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        log.warning("the served weights do not build a policy (%r): the trainer builds it itself", exc)
        return None
    layout = expected_layout(model)
    held = {name: (dtype_name(t.dtype), list(t.shape)) for name, t in served.items()}
    if layout != held:
        # transformers initialises what the state does not name: such a model is not the served one.
        differ = sorted(set(layout) ^ set(held)) or sorted(n for n in layout if layout[n] != held[n])
        log.warning("the served weights do not match %s's layout (first differences: %s): the trainer "
                    "builds the policy itself", type(model).__name__, differ[:3])
        return None
    model.to(torch.float32)
    model.eval()
    return model
