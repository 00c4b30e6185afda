"""A warm spare member process: imports done, waiting to be told which member to become.

``python -m robustrl.launcher.spare`` imports the trainer and rollout code (torch, transformers:
about 4 s of a cold start here), then blocks on one JSON line on stdin:
``{"module": ..., "args": [...], "env": {...}, "log": path, "pidfile": path}``. It writes its own
handle to ``pidfile`` (a controller that dies right after handing it the order has not written it
yet: ``LocalLauncher.find`` reads it), takes that environment, sends its output to the member's
log, and runs ``python -m module`` in place, so the launcher's process handle, pid and process
group stay valid. End of input (the launcher let it go) exits
quietly. See ``LocalLauncher.keep_spares``.

The same module holds the hand-off of a *running* member to another role (a rollout replica
borrowed as a trainer rank, ``LocalLauncher.relabel``): the launcher writes the new member's
environment to ``handoff-<pid>.json`` in the directory the member's ``ROBUSTRL_HANDOFF_DIR``
names (0600: it carries the new role's credentials), then sends ``SIGUSR1``; the member reads and
deletes it (``robustrl.services.rollout.standby``).

A spare in a container (``DockerLauncher.keep_spares``) has no stdin to read: it runs
``python -m robustrl.launcher.spare --handoff DIR`` and takes its order the second way, as a
hand-off (the same file, carrying ``module`` and ``args`` besides ``env``) followed by
``SIGUSR1``. ``SIGUSR1`` is blocked before the imports, so a signal that comes early waits for
the spare instead of ending it. Either way the order is run by one function, :func:`run_order`.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from robustrl.launcher.base import ROLLOUT_MODULE, TRAINER_MODULE

SPARE_MODULE = "robustrl.launcher.spare"
"""This module: what a spare process runs (``python -m``)."""
HANDOFF_ENV = "ROBUSTRL_HANDOFF_DIR"
"""Set by the local launcher on every member: where a role hand-off for the process is written."""
HANDOFF_SIGNAL = signal.SIGUSR1
"""Tells a running member that its hand-off is written (``LocalLauncher.relabel``)."""


def handoff_path(directory: str | os.PathLike[str], pid: int) -> Path:
    """Where the hand-off of process ``pid`` is written."""
    return Path(directory) / f"handoff-{pid}.json"


def handoff_order(env: Mapping[str, str], log: str, module: str | None = None,
                  args: Sequence[str] = ()) -> dict[str, Any]:
    """The content of a hand-off: the new member's environment and log ('': the output stays where
    it goes), and for a waiting spare the member's module and arguments (a running member that
    switches role knows what it becomes)."""
    order: dict[str, Any] = {"env": dict(env), "log": log}
    if module is not None:
        order.update(module=module, args=list(args))
    return order


def write_handoff(directory: str | os.PathLike[str], pid: int, env: dict[str, str], log: str) -> Path:
    """Write the hand-off (the new member's environment and log) readable by its owner only: it
    carries the new role's credentials. Written whole, then renamed, so a reader never sees half."""
    path = handoff_path(directory, pid)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(handoff_order(env, log), f)
    os.replace(tmp, path)
    return path


def pid_handle(pid: int, host: str | None = None) -> dict[str, Any] | None:
    """A member process's handle: its pid and start time (``create_time``: seconds since boot,
    ``robustrl.procs``; a recycled pid has another), and the host it was placed on; None if the
    process is gone."""
    from robustrl.procs import start_time

    started = start_time(pid)
    if started is None:
        return None
    handle: dict[str, Any] = {"pid": pid, "create_time": started}
    if host is not None:
        handle["host"] = host
    return handle


def write_pidfile(path: str | os.PathLike[str], handle: dict[str, Any]) -> None:
    """Write a member's handle to its pid file whole (written, then renamed): a reader never sees
    half of it. Raises OSError."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # launcher and spare may both write it
    tmp.write_text(json.dumps(handle))
    os.replace(tmp, path)


def take_handoff(directory: str | os.PathLike[str], pid: int) -> dict[str, object] | None:
    """Read and delete this process's hand-off; None if there is none (yet)."""
    path = handoff_path(directory, pid)
    try:
        with open(path) as f:
            order = json.load(f)
    except (OSError, ValueError):
        return None
    path.unlink(missing_ok=True)
    return order if isinstance(order, dict) and isinstance(order.get("env"), dict) else None


def redirect_output(log: str) -> None:
    """Send this process's stdout and stderr to ``log`` (the member's log under its new id)."""
    _redirect(log, stdin=False)


TARGETS = frozenset({TRAINER_MODULE, ROLLOUT_MODULE})
"""Member modules a spare can become: it imports their ``__main__`` ahead (not run: the name
is not ``__main__`` then), which pulls in torch, transformers and the member code."""


def _redirect(log: str, stdin: bool = True) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if not stdin:
        return
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)


def import_targets() -> None:
    """Import every member module a spare can become (not run: the name is not ``__main__``)."""
    for module in sorted(TARGETS):
        importlib.import_module(f"{module}.__main__")


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m robustrl.launcher.spare [--handoff DIR]``: the imports, then the order (on stdin,
    or as a hand-off in ``DIR`` and ``SIGUSR1``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    directory = args[1] if len(args) == 2 and args[0] == "--handoff" else None
    if directory is not None:
        # Before the imports: a hand-off signal that comes early is held, not fatal (its default).
        signal.pthread_sigmask(signal.SIG_BLOCK, {HANDOFF_SIGNAL})
    import_targets()
    become_member(directory)


def become_member(handoff_dir: str | None = None) -> None:
    """With the imports done: wait for the order -- one line on stdin, or (``handoff_dir``) a
    hand-off there and the signal -- then run the member it names in this process (also what a
    process forked by ``robustrl.launcher.zygote`` runs)."""
    print(f"spare {os.getpid()} ready", flush=True)
    order = read_order() if handoff_dir is None else wait_for_handoff(handoff_dir)
    if order is None:
        return  # released without an assignment
    run_order(order)


def read_order() -> dict[str, Any] | None:
    """The order on stdin; None at its end (the launcher let the spare go)."""
    line = sys.stdin.readline()
    if not line.strip():
        return None
    order = json.loads(line)
    return order if isinstance(order, dict) else None


def wait_for_handoff(directory: str) -> dict[str, Any] | None:
    """Wait (``HANDOFF_SIGNAL`` blocked, ``main``) for a hand-off naming a module; the signal is
    unblocked again once it is taken, for the member's own hand-off hook. A file read before its
    signal came is taken all the same; a signal without a file (or one naming no module) is
    waited past."""
    while True:
        order = take_handoff(directory, os.getpid())
        if order is not None and isinstance(order.get("module"), str) and isinstance(order.get("args", []), list):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {HANDOFF_SIGNAL})
            return order
        if order is not None:
            print(f"spare {os.getpid()}: a hand-off naming no module: ignored", file=sys.stderr, flush=True)
        signal.sigwait({HANDOFF_SIGNAL})


def run_order(order: Mapping[str, Any]) -> None:
    """Become the member ``order`` names, in this process: its pid file (if named), environment,
    log (if named; else the output stays where it goes, a container's), ``sys.argv``, and
    ``python -m module`` run in place."""
    if order.get("pidfile"):
        handle = pid_handle(os.getpid())
        try:
            if handle is not None:
                write_pidfile(order["pidfile"], handle)
        except OSError as exc:  # the launcher writes it too, unless its controller died meanwhile
            print(f"spare {os.getpid()}: pid file not written: {exc}", file=sys.stderr, flush=True)
    env = {str(k): str(v) for k, v in dict(order["env"]).items()}
    print(f"spare {os.getpid()} becomes {env.get('ROBUSTRL_MEMBER_ID', '?')} ({order['module']})", flush=True)
    os.environ.clear()
    os.environ.update(env)
    if order.get("log"):
        _redirect(order["log"])
    sys.argv = [order["module"], *[str(a) for a in order.get("args", [])]]
    runpy.run_module(order["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
