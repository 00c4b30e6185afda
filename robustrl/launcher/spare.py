"""A warm spare member process: imports done, waiting to be told which member to become.

``python -m robustrl.launcher.spare`` imports the trainer and rollout code (torch, transformers:
about 4 s of a cold start here), then blocks on one JSON line on stdin:
``{"module": ..., "args": [...], "env": {...}, "log": path}``. It then takes that environment,
sends its output to the member's log, and runs ``python -m module`` in place, so the launcher's
process handle, pid and process group stay valid. End of input (the launcher let it go) exits
quietly. See ``LocalLauncher.keep_spares``.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys

from robustrl.launcher.base import ROLLOUT_MODULE, TRAINER_MODULE

TARGETS = frozenset({TRAINER_MODULE, ROLLOUT_MODULE})
"""Member modules a spare can become: it imports their ``__main__`` ahead (not run: the name
is not ``__main__`` then), which pulls in torch, transformers and the member code."""


def _redirect(log: str) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)


def main() -> None:
    for module in sorted(TARGETS):
        importlib.import_module(f"{module}.__main__")
    print(f"spare {os.getpid()} ready", flush=True)
    line = sys.stdin.readline()
    if not line.strip():
        return  # released without an assignment
    order = json.loads(line)
    os.environ.clear()
    os.environ.update(order["env"])
    _redirect(order["log"])
    sys.argv = [order["module"], *order["args"]]
    runpy.run_module(order["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
