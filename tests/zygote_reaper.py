"""Drive a zygote over a raw control socket as a child subreaper, and print what /proc shows.

Run by ``tests/test_local_launcher.py``: ``python zygote_reaper.py LOG_DIR``. This process is a
child subreaper (``PR_SET_CHILD_SUBREAPER``), so a zombie the zygote leaves when it exits comes
to this process and stays a zombie (an init process would reap it, hiding a zygote that does not).
Prints one JSON object: the zygote's reports and each forked member's state at each moment.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from robustrl.infra.credentials import without_credentials
from robustrl.launcher.zygote import ZYGOTE_MODULE
from robustrl.procs import proc_stat

PR_SET_CHILD_SUBREAPER = 36


def state(pid: int) -> str:
    stat = proc_stat(pid)
    return "gone" if stat is None else stat[0].decode()


def start_zygote(log_dir: Path) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """A zygote on a raw control socket, logging to ``log_dir/zygote.log``, and this end of the
    socket (its first message, ``{"ready": pid}``, comes once its imports are done)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with open(log_dir / "zygote.log", "ab") as log:
        zygote = subprocess.Popen([sys.executable, "-m", ZYGOTE_MODULE, str(theirs.fileno())],
                                  env=without_credentials(dict(os.environ)), pass_fds=[theirs.fileno()],
                                  stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    theirs.close()
    ours.settimeout(120)  # its imports first (torch, transformers)
    return zygote, ours


def main() -> None:
    log_dir = Path(sys.argv[1])
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    zygote, ours = start_zygote(log_dir)

    def recv() -> dict:
        return json.loads(ours.recv(4096))

    def fork(n: int) -> int:
        read_end, write_end = os.pipe()
        log_fd = os.open(log_dir / f"m{n}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        socket.send_fds(ours, [json.dumps({"fork": n}).encode()], [read_end, log_fd])
        os.close(read_end)
        os.close(log_fd)
        answer = recv()
        os.close(write_end)
        return int(answer["pid"])

    out: dict = {"ready": recv()}
    try:
        pid = fork(1)
        os.killpg(pid, signal.SIGKILL)
        out["exit1"] = recv()
        out["after_report"] = state(pid)  # Z: held until the launcher's "reap"
        ours.send(json.dumps({"reap": pid}).encode())
        deadline = time.monotonic() + 10
        while state(pid) == "Z" and time.monotonic() < deadline:
            time.sleep(0.01)  # a bounded poll (deadline above): /proc has no event to wait on
        out["after_reap"] = state(pid)
        pid2 = fork(2)
        os.killpg(pid2, signal.SIGKILL)
        out["exit2"] = recv()
        out["pid1"], out["pid2"] = pid, pid2
        ours.close()  # the launcher gone: the zygote exits
        zygote.wait(30)
        out["after_zygote_exit"] = state(pid2)  # Z here: the zygote left it (to this subreaper)
    finally:
        if zygote.poll() is None:
            zygote.kill()
            zygote.wait(10)
        for _ in range(16):  # reap whatever came to this subreaper
            try:
                if os.waitpid(-1, os.WNOHANG) == (0, 0):
                    break
            except ChildProcessError:
                break
    print(json.dumps(out))


if __name__ == "__main__":
    main()
