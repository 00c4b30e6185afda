"""Which process a recorded pid names, judged in a way no clock step can fool.

A pid is recycled, so a process is named by its pid *and* its start. psutil's ``create_time()``
is that start as wall-clock time: the start in clock ticks since boot (``/proc/<pid>/stat``
field 22, fixed for the life of the process) plus the boot time from ``/proc/stat``, which the
kernel recomputes on every read as "now minus uptime", rounded to a whole second. When the wall
clock is slewed or stepped (NTP), that boot time moves by a second, and a process recorded a
minute earlier no longer matches its own start: a live server read as dead, a supervisor that
restarts a service still running, a ``down`` that leaves it running. So every identity check of
this project records and compares the start in seconds since boot, read here.
"""

from __future__ import annotations

import os
import time

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
WALL_CLOCK_TOLERANCE_S = 1.5
"""How far a wall-clock start recorded before this module may be from the process's own: the
boot time under it is rounded to a second and moves with clock steps."""


def proc_stat(pid: int) -> tuple[bytes, int] | None:
    """The process's state letter and its start in clock ticks since boot (``/proc/<pid>/stat``
    fields 3 and 22); None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # the name in (...) may hold spaces
        return fields[0], int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def start_time(pid: int) -> float | None:
    """When ``pid`` started, in seconds since boot (no clock adjustment moves it); None if it
    is gone."""
    stat = proc_stat(pid)
    return None if stat is None else stat[1] / _CLOCK_TICKS


def same_start(a: float, b: float, tolerance_s: float = 0.0) -> bool:
    """Whether two recorded starts name the same start.

    A start later than the machine's uptime is a wall-clock one, as records written before this
    module hold (psutil's ``create_time``: a controller taking over members, or a ``down`` reading
    an ``infra.json``, across an upgrade). One of each is compared as wall-clock time, as are two
    wall-clock ones, within ``WALL_CLOCK_TOLERANCE_S``: a clock step between the two may have
    moved them by that much."""
    uptime = time.clock_gettime(time.CLOCK_BOOTTIME)
    a_wall, b_wall = a > uptime + 1.0, b > uptime + 1.0
    if not (a_wall or b_wall):
        return abs(a - b) <= tolerance_s + 1e-9
    boot = time.time() - uptime
    a, b = (a if a_wall else a + boot), (b if b_wall else b + boot)
    return abs(a - b) <= max(tolerance_s, WALL_CLOCK_TOLERANCE_S)


def is_running(pid: int, started: float | None, tolerance_s: float = 0.0) -> bool:
    """True if ``pid`` runs (not a zombie) and, when ``started`` is given, is the process that
    started then (``start_time``, or a wall-clock start: ``same_start``; a recycled pid started
    later)."""
    stat = proc_stat(pid)
    if stat is None or stat[0] == b"Z":
        return False
    return started is None or same_start(stat[1] / _CLOCK_TICKS, started, tolerance_s)


def monotonic_of(wall: float) -> float:
    """A wall time read from a record (another process's, or this one's before a clock step) as a
    time on this process's monotonic clock, which deadlines are judged by: as long ago as the
    wall clock says, never in the future (a record from a clock ahead of this one is taken as
    now, not as a deadline moved on)."""
    return time.monotonic() - max(0.0, time.time() - wall)
