"""TCP throughput between two testbed hosts, with the weight transport's socket options (4 MiB
buffers, TCP_NODELAY) and with the kernel's defaults, measured in the same run.

    sudo python bench/testbed_link.py --link 500mbit --bytes 64MiB --rounds 3 --out results/testbed_link.json

Rounds alternate tuned / default so that load from other work hits both alike; each mode reports
every round, its best and its median. ``*_cpu_fraction`` is each probe's CPU time over the
transfer's wall time: well below 1 means the link, not the machine's cores, set the rate.
Needs root (the testbed); prints the reason and exits 2 without it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from robustrl.errors import TestbedUnavailable
from robustrl.testbed import Testbed
from robustrl.testbed.links import parse_rate
from robustrl.testbed.probe import Transfer, transfer

GIB = 1 << 30
_SIZE_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """``"64MiB"`` -> 67108864."""
    t = text.strip().lower()
    digits = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    return int(float(digits) * _SIZE_UNITS[t[len(digits):]])


def _summary(rounds: list[Transfer], link_bps: int | None) -> dict[str, Any]:
    rates = [r.bits_per_s for r in rounds]
    best = max(rates)
    return {
        "rounds_gbps": [round(r / 1e9, 4) for r in rates],
        "best_gbps": round(best / 1e9, 4),
        "median_gbps": round(statistics.median(rates) / 1e9, 4),
        "best_gibps": round(best / 8 / GIB, 4),
        "of_link": round(best / link_bps, 3) if link_bps else None,
        "sink_cpu_fraction": round(max(r.sink_cpu_fraction for r in rounds), 3),
        "source_cpu_fraction": round(max(r.source_cpu_fraction for r in rounds), 3),
    }


def measure(tb: Testbed, nbytes: int, rounds: int, src: str = "h0", dst: str = "h1") -> dict[str, Any]:
    """Tuned and default rounds, alternating, from ``src`` to ``dst`` on a testbed that is up."""
    started = time.time()
    results: dict[bool, list[Transfer]] = {True: [], False: []}
    for _ in range(rounds):
        for tuned in (True, False):
            results[tuned].append(transfer(tb, src, dst, nbytes, tuned=tuned))
    link = tb.link
    link_bps = parse_rate(link) if link else None
    tuned_s, default_s = _summary(results[True], link_bps), _summary(results[False], link_bps)
    return {
        "link": link, "link_gbps": link_bps / 1e9 if link_bps else None, "bytes": nbytes, "rounds": rounds,
        "tuned": tuned_s, "default": default_s,
        "raw_tuned_gibps": tuned_s["best_gibps"], "raw_default_gibps": default_s["best_gibps"],
        "wall_s": round(time.time() - started, 2),
    }


def run(link: str | None, nbytes: int, rounds: int) -> dict[str, Any]:
    with Testbed(hosts=2, link=link) as tb:
        return measure(tb, nbytes, rounds)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--link", default="500mbit", help="each host's link rate; 'none' for unshaped")
    ap.add_argument("--bytes", default="64MiB", help="bytes per transfer (64MiB, 1GiB, ...)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args()
    try:
        report = run(None if args.link == "none" else args.link, parse_size(args.bytes), args.rounds)
    except TestbedUnavailable as exc:
        print(f"testbed unavailable: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
