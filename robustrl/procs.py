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

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


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


def is_running(pid: int, started: float | None, tolerance_s: float = 0.0) -> bool:
    """True if ``pid`` runs (not a zombie) and, when ``started`` is given, is the process that
    started then (``start_time``; a recycled pid started later)."""
    stat = proc_stat(pid)
    if stat is None or stat[0] == b"Z":
        return False
    return started is None or abs(stat[1] / _CLOCK_TICKS - started) <= tolerance_s + 1e-9
