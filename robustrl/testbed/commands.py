"""Running ``ip`` and ``tc``: the one place their failures become ``TestbedError``."""

from __future__ import annotations

import os
import shutil
import subprocess

from robustrl.errors import TestbedError, TestbedUnavailable

COMMAND_TIMEOUT_S = 10.0
REQUIRED_TOOLS = ("ip", "tc")
_GONE_MARKERS = ("Cannot find device", "No such file or directory", "does not exist",
                 "Cannot open network namespace", "No such process", "Invalid handle")
"""What ``ip``/``tc`` say about an object that is already gone: teardown treats it as done."""


def run(argv: list[str], *, missing_ok: bool = False, timeout: float = COMMAND_TIMEOUT_S) -> str:
    """Run one command; return its stdout.

    Args:
        missing_ok: an error saying the object does not exist counts as success (teardown).

    Raises:
        TestbedError: the command failed (with its stderr) or ran past ``timeout``.
        TestbedUnavailable: the kernel lacks a qdisc the command needs.
    """
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise TestbedError(f"{argv[0]} did not finish in {timeout:.0f} s", command=" ".join(argv)) from exc
    except OSError as exc:
        raise TestbedUnavailable(f"cannot run {argv[0]}: {exc}", command=" ".join(argv)) from exc
    if done.returncode == 0:
        return done.stdout
    err = done.stderr.strip()
    if missing_ok and any(marker in err for marker in _GONE_MARKERS):
        return ""
    if "qdisc kind is unknown" in err:
        kind = next((a for a in argv if a in ("netem", "htb", "pfifo")), "a qdisc")
        raise TestbedUnavailable(f"this kernel has no {kind} qdisc (CONFIG_NET_SCH_{kind.upper()})",
                                 command=" ".join(argv))
    raise TestbedError(f"{argv[0]} failed: {err or 'exit ' + str(done.returncode)}", command=" ".join(argv),
                       stderr=err)


def check_available() -> None:
    """Raise TestbedUnavailable saying why a testbed cannot be built here (not root, no ip/tc)."""
    if os.geteuid() != 0:
        raise TestbedUnavailable("the testbed needs root (network namespaces, veth, bridge, tc)")
    for tool in REQUIRED_TOOLS:
        if shutil.which(tool) is None:
            raise TestbedUnavailable(f"the testbed needs `{tool}` (iproute2) on PATH")


def unavailable_reason() -> str | None:
    """Why a testbed cannot be built here (None if it can): for skips with a printed reason."""
    try:
        check_available()
    except TestbedUnavailable as exc:
        return str(exc)
    return None


def netns_list() -> list[str]:
    """Names from ``ip netns list`` (the first word of each line)."""
    return [line.split()[0] for line in run(["ip", "netns", "list"]).splitlines() if line.strip()]


def link_names() -> list[str]:
    """Interface names of the root namespace (without the ``@peer`` suffix)."""
    names = []
    for line in run(["ip", "-o", "link", "show"]).splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


def netns_pids(netns: str) -> list[int]:
    """Processes whose network namespace is ``netns`` (``ip netns pids``); [] if it is gone."""
    out = run(["ip", "netns", "pids", netns], missing_ok=True)
    return [int(p) for p in out.split() if p.isdigit()]
