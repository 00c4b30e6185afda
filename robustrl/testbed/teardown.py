"""Removing testbeds: one from its state file, the stale ones (owner dead), orphans, or all.

Order matters: processes inside a namespace keep it (and its devices) alive after the name is
deleted, so they are killed first; then the namespaces (hosts and switch: their veths, bridge and
qdiscs go with them), the gateway veth, and last the state file, so an interrupted teardown is
found again by the next sweep. Every step is idempotent.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from robustrl.testbed import commands
from robustrl.testbed.state import STATE_DIR, TestbedState, process_alive, read_states, state_path, tag_of

PROCESS_EXIT_TIMEOUT_S = 5.0


@dataclass
class SweepReport:
    """What a sweep removed: testbed tags, and orphan objects that had no state file."""

    testbeds: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)


def _kill_and_wait(pids: list[int], timeout: float) -> None:
    """SIGKILL ``pids`` and wait until each has ended, without reaping any: a caller that started
    one (a launcher's Popen) still gets its exit status."""
    fds = []
    for pid in pids:
        try:
            fds.append(os.pidfd_open(pid))  # before the signal: it refers to this very process
        except OSError:
            continue
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(fds[-1], signal.SIGKILL)
    deadline = time.monotonic() + timeout
    try:
        for fd in fds:
            poller = select.poll()
            poller.register(fd, select.POLLIN)  # readable once the process has exited
            poller.poll(max(0.0, deadline - time.monotonic()) * 1000)
    finally:
        for fd in fds:
            os.close(fd)


def kill_netns_processes(netns: str, timeout: float = PROCESS_EXIT_TIMEOUT_S) -> list[int]:
    """SIGKILL every process in ``netns`` and wait until they are gone; returns their pids."""
    pids = [p for p in commands.netns_pids(netns) if p != os.getpid()]
    _kill_and_wait(pids, timeout)
    return pids


def kill_processes(processes: tuple[tuple[int, float], ...], timeout: float = PROCESS_EXIT_TIMEOUT_S) -> None:
    """SIGKILL each (pid, start time) that still runs (not a recycled pid), and wait for them."""
    _kill_and_wait([pid for pid, start in processes if process_alive(pid, start)], timeout)


def teardown(state: TestbedState, state_dir: Path = STATE_DIR) -> None:
    """Remove everything ``state`` lists (processes in its namespaces, veths, qdiscs, namespaces,
    bridge) and its state file; stop its reaper unless that is the caller."""
    namespaces = [*(h.netns for h in state.hosts), state.switch_netns]
    kill_processes(state.processes)
    for ns in namespaces:
        kill_netns_processes(ns)
    commands.run(["ip", "link", "del", state.gateway_dev], missing_ok=True)
    for ns in namespaces:
        commands.run(["ip", "netns", "del", ns], missing_ok=True)
    state_path(state.tag, state_dir).unlink(missing_ok=True)
    reaper = state.reaper_pid
    if reaper and reaper != os.getpid() and process_alive(reaper, state.reaper_start):  # not a recycled pid
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(reaper, signal.SIGKILL)


def _remove_orphans(state_dir: Path, everything: bool) -> list[str]:
    """Delete our namespaces and links that belong to no state file (all of them with
    ``everything``); returns what was removed. The state file is looked up when each object is
    considered, not before: a testbed being built right now wrote its file before its first
    object, so it is never taken for an orphan."""

    def orphan(name: str) -> bool:
        tag = tag_of(name)
        return tag is not None and (everything or not state_path(tag, state_dir).exists())

    removed = []
    for ns in commands.netns_list():
        if orphan(ns):
            kill_netns_processes(ns)
            commands.run(["ip", "netns", "del", ns], missing_ok=True)
            removed.append(ns)
    for name in commands.link_names():
        if orphan(name):
            commands.run(["ip", "link", "del", name], missing_ok=True)
            removed.append(name)
    return removed


def sweep(*, detached: bool = False, everything: bool = False, state_dir: Path = STATE_DIR) -> SweepReport:
    """Remove stale testbeds (their owner process died) and objects of ours that belong to no
    state file (left by a teardown that was itself interrupted, or a state file removed by hand).

    Args:
        detached: also remove detached testbeds (``robustrl testbed up``).
        everything: remove every testbed, even one whose owner still runs.
    """
    report = SweepReport()
    for state in read_states(state_dir):
        stale = state.owner_pid is not None and not process_alive(state.owner_pid, state.owner_start)
        if everything or stale or (detached and state.owner_pid is None):
            teardown(state, state_dir)
            report.testbeds.append(state.tag)
    report.orphans = _remove_orphans(state_dir, everything)
    return report


def leftovers(tag: str | None = None) -> list[str]:
    """Namespaces and links of ours still on the machine (of testbed ``tag``, or of any)."""
    return [n for n in commands.netns_list() + commands.link_names()
            if (t := tag_of(n)) and (tag is None or t == tag)]
