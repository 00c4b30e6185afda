"""A fork server for member processes: the trainer and rollout imports done once, each member a fork.

A cold member start is ``python -m module``: about 5.5 s of imports here (torch, transformers, the
member code), all CPU. Several members starting at once on a 2-core machine take ~10 s to reach
their first line of work, and every restart pays it again. With ``ROBUSTRL_FORK_START=1`` the
local launcher starts one zygote (``python -m robustrl.launcher.zygote``) that does those imports
once and then forks, on request, a process that is exactly a warm spare after its imports
(``robustrl.launcher.spare.become_member``): it reads its order on stdin and runs the member in
place. Starting a member then costs a fork (milliseconds), and a warm spare no longer costs its
own imports.

What a forked member shares with a cold one: it leads its own session and process group (the
launcher signals the group), its stdin, stdout and stderr are what the launcher passed
(``SCM_RIGHTS`` over the control socket), it takes its environment from the order, writes its own
pid file (its ``/proc/<pid>/environ`` is the zygote's: ``LocalLauncher.find`` reads the pid file),
and it exits through the interpreter's normal shutdown (atexit handlers, flushed output), with
Python's own exit status. Python re-seeds ``random`` in a forked child; the zygote starts no
thread of its own and creates no event loop, socket or file a member could inherit, beyond the
control socket, which the child closes.

What differs: the member is the zygote's child, not the launcher's. The zygote watches it (a pidfd
per child) and reports ``{"exit": pid, "rc": status}`` on the control socket, ``rc`` as
``Popen.returncode`` has it (negative: the signal), but reaps it only when the launcher answers
``{"reap": pid}``, after it has recorded the exit: until then the ended member is a zombie that
holds its pid and process group, so a signal the launcher sends its group meanwhile (a stop, a
kill) can never reach a process that took the pid over. A zygote that dies leaves its members running
(reparented to init, as a dead controller's members are); their exits are then seen by polling,
with the exit code unknown (as for an adopted member), and the launcher starts members cold until
it starts a new zygote. A launcher that dies closes the control socket: the zygote exits and leaves
the members to the launcher that adopts them.

Protocol (``SOCK_SEQPACKET``, one JSON object per message): launcher -> zygote ``{"fork": n}`` with
two file descriptors (the child's stdin, its log); zygote -> launcher ``{"ready": pid}`` once the
imports are done, ``{"forked": n, "pid": pid}`` in request order, ``{"exit": pid, "rc": rc}``;
launcher -> zygote ``{"reap": pid}`` (no fds) once it has taken that exit.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from robustrl.launcher.spare import become_member, import_targets
from robustrl.procs import proc_stat

_log = logging.getLogger(__name__)

ZYGOTE_MODULE = "robustrl.launcher.zygote"
FORK_START_ENV = "ROBUSTRL_FORK_START"
"""``1``: the local launcher starts trainer and rollout members (and warm spares) as forks of one
zygote instead of cold ``python -m`` processes. Off by default: a cold start is what a member
restarted on a machine of its own pays, and the benchmarks measure that."""
READY_WAIT_S = 60.0
"""How long a start waits for a zygote that is still importing before it starts the member cold."""
FORK_REPLY_S = 5.0
"""A fork request not answered within this: the zygote counts as broken (members start cold)."""
CLOSE_WAIT_S = 5.0
GONE_POLL_S = 0.02
"""Polling period for a member seen ended whose exit report has not come (or cannot: no zygote)."""
WAIT_POLL_S = 0.5
"""``ForkedProc.wait`` looks at the process itself this often while no report came."""
EXIT_REPORT_GRACE_S = 2.0
"""A member seen ended whose exit the zygote has not reported within this counts as ended, its
code unknown (a stopped or stuck zygote)."""
UNKNOWN_EXIT = -1
"""What ``poll`` returns for an ended member whose exit code is unknown (``returncode`` stays
None), as for an adopted member."""
_MSG_MAX = 4096


def fork_start_enabled(env: dict[str, str]) -> bool:
    value = env.get(FORK_START_ENV, "").strip().lower()
    return value in ("1", "true", "yes", "on")


# --- the zygote process ----------------------------------------------------------------------

def _send(sock: socket.socket, msg: dict[str, Any]) -> bool:
    try:
        sock.send(json.dumps(msg).encode())
        return True
    except OSError:
        return False


def _returncode(info: Any) -> int | None:
    """``os.waitid``'s result as ``Popen.returncode`` has it (negative: the signal)."""
    if info.si_code == os.CLD_EXITED:
        return int(info.si_status)
    if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
        return -int(info.si_status)
    return None


def _reap(pid: int, pidfd: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
    os.close(pidfd)


def serve(sock: socket.socket) -> bool:
    """The zygote's loop. Returns True in a forked child (which then becomes a member), False when
    the launcher is gone (the zygote exits; its children run on, those ended are reaped first)."""
    import_targets()
    zygote = os.getpid()
    print(f"zygote {zygote} ready", flush=True)  # to its log (logs/zygote.log)
    if not _send(sock, {"ready": os.getpid()}):
        return False
    children: dict[int, int] = {}  # pidfd -> pid: running
    held: dict[int, int] = {}  # pid -> pidfd: ended and reported, not reaped until the launcher says
    try:
        return _serve(sock, children, held)
    finally:
        if os.getpid() == zygote:  # leaving: no zombie of ours is left for an init that may not reap
            for pid, pidfd in held.items():
                _reap(pid, pidfd)


def _serve(sock: socket.socket, children: dict[int, int], held: dict[int, int]) -> bool:
    while True:
        readable, _, _ = select.select([sock.fileno(), *children], [], [])
        for fd in readable:
            if fd != sock.fileno():
                pid = children.pop(fd)
                try:  # its status, the child left a zombie (WNOWAIT): its pid stays taken
                    rc: int | None = _returncode(os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT))
                    held[pid] = fd
                except OSError:  # reaped elsewhere, or no waitid here: ended, its code unknown
                    rc = None
                    _reap(pid, fd)
                _send(sock, {"exit": pid, "rc": rc})
                continue
            try:
                data, fds, _, _ = socket.recv_fds(sock, _MSG_MAX, 2)
            except OSError:
                return False
            if not data:
                for fd_ in fds:
                    os.close(fd_)
                return False  # the launcher closed the socket (or died)
            try:
                msg = json.loads(data)
            except ValueError:
                msg = None
            if isinstance(msg, dict) and "reap" in msg:
                for fd_ in fds:
                    os.close(fd_)
                pid = msg["reap"]
                pidfd = held.pop(pid, None) if isinstance(pid, int) else None
                if pidfd is not None:
                    _reap(pid, pidfd)
                continue
            seq = msg.get("fork") if isinstance(msg, dict) else None
            if len(fds) != 2:
                for fd_ in fds:
                    os.close(fd_)
                _send(sock, {"forked": seq, "pid": None, "error": "expected two fds"})
                continue
            try:
                pid, pidfd = _fork_child(sock, fds, [*children, *held.values()])
            except OSError as exc:  # EAGAIN/ENOMEM: the launcher starts this member cold
                _send(sock, {"forked": seq, "pid": None, "error": f"fork failed: {exc}"})
                continue
            if pid == 0:
                return True
            children[pidfd] = pid
            _send(sock, {"forked": seq, "pid": pid})


def _fork_child(sock: socket.socket, fds: list[int], inherited: list[int]) -> tuple[int, int]:
    """Fork one child: (0, -1) in the child, its pid and a pidfd on it in the zygote. Answered once
    the child leads its session: a signal to its group sent right after the start (a kill, a stop)
    must not find no group and be lost. ``inherited``: the zygote's pidfds, which the child closes.
    Raises OSError (no child left behind)."""
    sys.stdout.flush()
    sys.stderr.flush()
    settled_r, settled_w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        for fd_ in (settled_r, settled_w, *fds):
            os.close(fd_)
        raise
    if pid == 0:
        os.close(settled_r)
        _become_child(sock, fds, inherited)
        os.close(settled_w)  # its own session now: the launcher may signal its group
        return 0, -1
    os.close(settled_w)
    for fd_ in fds:
        os.close(fd_)
    try:
        os.read(settled_r, 1)
    finally:
        os.close(settled_r)
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:  # no pidfd (an old kernel, a seccomp profile): an untracked child is not kept
        os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    return pid, pidfd


def _become_child(sock: socket.socket, fds: list[int], inherited: list[int]) -> None:
    """In the fork: its own session, the passed stdin and log, nothing of the zygote's open."""
    os.setsid()
    sock.close()
    for pidfd in inherited:
        os.close(pidfd)
    stdin_fd, log_fd = fds
    os.dup2(stdin_fd, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(stdin_fd)
    os.close(log_fd)
    # what a cold Python process starts with
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    # Python re-seeds ``random`` itself; NumPy's global generator would be the same in every fork
    # (a cold process seeds it from the OS). torch's default generator starts from a fixed seed in
    # a cold process too, so it is left as it is.
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    # The zygote ignores the signals a terminal or a stopping stack sends its group: it is
    # stopped by closing its socket (or SIGKILL); a child restores the defaults.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if serve(sock):
        become_member()  # a member's own exit is a normal interpreter shutdown
        return
    # The launcher is gone and the zygote owns nothing a shutdown would finish (its zombies are
    # reaped in ``serve``; its log lines are flushed here): the interpreter's teardown of torch and
    # transformers cost 1.3 s of CPU, which a loaded machine stretched past 10 s (the CI failure
    # of test_a_launcher_killed_leaves_its_forked_members_running_and_its_zygote_exits).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --- the launcher's side ---------------------------------------------------------------------

class ForkedProc:
    """A member (or spare) process forked by the zygote, with the part of ``Popen``'s interface
    the local launcher uses: ``pid``, ``stdin``, ``returncode``, ``poll``, ``wait``.

    Its exit is known from the zygote's report. A process seen ended (a zombie the zygote has not
    reaped, or gone) whose report does not come within ``EXIT_REPORT_GRACE_S`` counts as ended
    with its code unknown: a zygote that is stopped, stuck or dead must not keep an ended member
    "running" (a kill would fail, a restart would be refused)."""

    def __init__(self, zygote: Zygote, pid: int, stdin: Any) -> None:
        self._zygote = zygote
        self.pid = pid
        self.stdin = stdin
        self.returncode: int | None = None
        self._ended = threading.Event()
        self._signal_lock = threading.Lock()  # a signal is never sent once the exit is recorded
        self._seen_gone_at: float | None = None
        stat = proc_stat(pid)
        self._started = stat[1] if stat else None  # None: already reaped, its report is on the way
        try:  # pinned now (alive, or a zombie the zygote holds): this fd names this very process
            self._pidfd: int | None = os.pidfd_open(pid)
        except OSError:
            self._pidfd = None

    @property
    def ended(self) -> bool:
        """Whether its end is known (reported by the zygote, or counted by ``poll`` without a report)."""
        return self._ended.is_set()

    def _exited(self, rc: int | None) -> None:
        with self._signal_lock:
            if not self._ended.is_set():
                self.returncode = rc
            self._ended.set()
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None

    def _has_exited(self) -> bool:
        """Whether the process has exited, from its pidfd (no pid lookup). ``_signal_lock`` held."""
        if self._pidfd is None:
            return False
        readable, _, _ = select.select([self._pidfd], [], [], 0)
        return bool(readable)

    def send_signal(self, sig: int, group: bool = True) -> None:
        """Signal its process group (``group``) or the process, unless it has exited. While the
        zygote lives, an exited member stays a zombie until its exit is recorded here (under the
        same lock), so its pid and group cannot be another's; a member of a zygote lost or closed
        is reaped by init instead, so one seen exited through its pidfd is not signalled (what is
        left is the moment between that look and the signal). Raises ProcessLookupError /
        PermissionError as ``os.killpg`` does."""
        with self._signal_lock:
            if self._ended.is_set() or self._has_exited():
                return
            if not group and self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, sig)
            else:
                (os.killpg if group else os.kill)(self.pid, sig)

    def _gone(self) -> bool:
        """Whether the process has ended, judged from /proc (a zombie, gone, or a recycled pid:
        another start time: ``robustrl.procs``)."""
        with self._signal_lock:  # _exited closes the pidfd
            if self._ended.is_set() or self._has_exited():
                return True
        stat = proc_stat(self.pid)
        if stat is None or (self._started is not None and stat[1] != self._started):
            return True
        return stat[0] == b"Z"

    def poll(self) -> int | None:
        if self._ended.is_set():
            return self.returncode if self.returncode is not None else UNKNOWN_EXIT
        if not self._gone():
            self._seen_gone_at = None
            return None
        now = time.monotonic()
        if self._seen_gone_at is None:
            self._seen_gone_at = now
        if self._zygote.lost or now - self._seen_gone_at >= EXIT_REPORT_GRACE_S:
            self._exited(None)  # its exit code went with the zygote (or never came)
            return UNKNOWN_EXIT
        return None  # ended: the zygote's report is on its way

    def wait(self, timeout: float | None = None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            # the zygote's report sets the event; a process seen ended is polled for its grace
            self._ended.wait(GONE_POLL_S if self._seen_gone_at is not None or self._zygote.lost
                             else min(left if left is not None else WAIT_POLL_S, WAIT_POLL_S))
        return self.returncode


class Zygote:
    """The launcher's handle on its zygote process: start it, fork from it, hear its reports.

    Args:
        log: where the zygote's own output goes.
        env: its environment (no credentials: see ``LocalLauncher._new_zygote``).
    """

    def __init__(self, log: Path, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self._lock = threading.Lock()  # one fork request at a time
        self._replies: list[ForkedProc | None] = []
        self._reply = threading.Condition()
        self._procs: dict[int, ForkedProc] = {}
        self._ready = threading.Event()
        self.lost = False
        """The zygote is gone (or broken): its members' exits are polled, new members start cold."""
        self.started_at = time.monotonic()
        self.retired = False
        """Given up for new forks while members it forked still run: it goes on reaping and
        reporting their exits (``LocalLauncher._give_up_zygote``)."""
        self.failures = 0
        """Fork requests refused in a row (fork or pidfd failed in the zygote)."""
        self._seq = 0
        try:
            with open(log, "ab") as out:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", ZYGOTE_MODULE, str(theirs.fileno())], env=env,
                    pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=out,
                    stderr=subprocess.STDOUT, start_new_session=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def has_children(self) -> bool:
        """Whether a process it forked has not ended yet: neither reported by it nor counted as
        ended without its report (``ForkedProc.poll``: a stopped or stuck zygote reports nothing,
        and would otherwise be kept, with its zombies, until the launcher closes)."""
        return any(not p.ended for p in list(self._procs.values()))

    def ready(self, wait_s: float = 0.0) -> bool:
        """Whether the zygote has done its imports (waiting up to ``wait_s``) and is not lost."""
        return not (self.lost or self.retired) and self._ready.wait(wait_s) and not self.lost

    def _read(self) -> None:
        try:
            while True:
                try:
                    data = self._sock.recv(_MSG_MAX)
                except OSError:
                    return
                if not data:
                    return
                try:
                    msg = json.loads(data)
                except ValueError:
                    _log.error("zygote %d sent %r: not JSON; it is no longer used", self.pid, data[:200])
                    return
                self._on_message(msg)
        except Exception:
            _log.exception("zygote %d: reading its reports failed; it is no longer used", self.pid)
        finally:
            closing = self.lost
            self._lose()
            if not closing:  # reports no longer read: stop it, so it reaps the zombies it holds
                self.close_later()

    def _on_message(self, msg: dict[str, Any]) -> None:
        if "ready" in msg:
            self._ready.set()
        elif "forked" in msg:
            pid = msg.get("pid")
            proc = ForkedProc(self, pid, None) if isinstance(pid, int) else None
            if proc is None:
                _log.warning("zygote %d could not fork: %s", self.pid, msg.get("error"))
            else:
                self._procs[pid] = proc
            with self._reply:
                self._replies.append(proc)
                self._reply.notify_all()
        elif "exit" in msg:
            pid = msg["exit"]
            proc = self._procs.get(pid)
            if proc is not None:  # recorded before it stops counting as a child (a retired zygote
                rc = msg.get("rc")  # with no child left is closed, and reaps what it holds)
                proc._exited(rc if isinstance(rc, int) else None)
                self._procs.pop(pid, None)
            if isinstance(pid, int):  # recorded: the zygote may free its pid now
                _send(self._sock, {"reap": pid})
            if proc is not None and self.retired and not self._procs:
                # Given up and its last member reported: stopped here, not only at the launcher's
                # next start (which may never come, or may look between the exit being recorded
                # and the member leaving ``_procs``, and keep it).
                self.close_later()

    def _lose(self) -> None:
        self.lost = True
        self._ready.set()  # a waiting start goes on, cold
        with self._reply:
            self._reply.notify_all()

    def fork(self, log: Path) -> ForkedProc | None:
        """A new spare process (its output to ``log``) waiting for its order on ``stdin``; None if
        the zygote is not ready, refused (``failures`` counts it) or broken (start the member
        cold). Waits ``FORK_REPLY_S`` at most; a zygote that does not answer is closed."""
        if not self.ready():
            return None
        with self._lock:
            read_end, write_end = os.pipe()
            try:
                log_fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            except OSError:
                os.close(read_end)
                os.close(write_end)
                raise
            self._seq += 1
            with self._reply:
                self._replies.clear()  # a late answer to an earlier request is never taken for this one
            try:
                socket.send_fds(self._sock, [json.dumps({"fork": self._seq}).encode()], [read_end, log_fd])
            except OSError as exc:
                os.close(write_end)
                _log.warning("zygote %d: fork request failed (%s); members start cold", self.pid, exc)
                self._lose()
                return None
            finally:
                os.close(read_end)
                os.close(log_fd)
            deadline = time.monotonic() + FORK_REPLY_S
            answered = False
            with self._reply:
                while not self._replies and not self.lost and time.monotonic() < deadline:
                    self._reply.wait(deadline - time.monotonic())
                if self._replies:
                    answered, proc = True, self._replies.pop(0)
                else:
                    proc = None
            if proc is None:
                os.close(write_end)
                if answered:  # refused (fork or pidfd failed there): this member starts cold
                    self.failures += 1
                elif not self.lost:
                    _log.warning("zygote %d: no answer to a fork in %.0f s; members start cold", self.pid,
                                 FORK_REPLY_S)
                    self._lose()
                    self.close_later()
                return None
            self.failures = 0
            proc.stdin = open(write_end, "wb")  # noqa: SIM115 - the launcher writes the order, then closes it
            return proc

    def close_later(self) -> None:
        """``close`` in a thread of its own (the caller may hold the launcher's lock)."""
        threading.Thread(target=self.close, name="zygote-close", daemon=True).start()

    def close(self) -> None:
        """Stop the zygote (its forked members run on: the launcher stops those itself). Never
        raises; bounded (about ``3 * CLOSE_WAIT_S``)."""
        self.lost = True
        # Its end of the socket sees end of input and it exits; exit reports already sent are
        # still read (only the writing side is shut).
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)
        try:
            self._proc.wait(CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(CLOSE_WAIT_S)
        self._reader.join(CLOSE_WAIT_S)
        with contextlib.suppress(OSError):
            self._sock.close()


if __name__ == "__main__":
    main()
