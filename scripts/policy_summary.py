#!/usr/bin/env python3
"""The allocator's figures over a set of traces, one line per build and folder of traces: the goal
cells missed and the means over the scales, as the variants table of docs/benchmarks.md ("Allocator
on the traces") gives them. A change to the policy is judged by building it and comparing its line
with the default build's.

Each build replays every trace at the scales (`vramd replay --json --compare expandable --scale`),
two traces at a time. Per trace, six goal cells (`settings_grid.cells`): fragmentation as recorded,
its mean and its worst over the scales, each at most min(3 %, PyTorch's expandable segments' figure
from the trace's README); modelled driver time likewise, at most 1 %. Per folder: the cells missed,
and the mean over its traces of each trace's mean fragmentation and mean driver time over the
scales.

Usage: python3 scripts/policy_summary.py [--vramd BUILD]... [--scales LIST] [--set NAME=VALUE]...
       [--per-trace] TRACE...
e.g.   python3 scripts/policy_summary.py ../shared/traces/*.pickle.gz \\
           docs/results/2026-12-04-h200-traces/*.pickle.gz
About 8 s a build for those 17 traces on 2 cores.
"""
import argparse
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from settings_grid import SCALES, by_trace, cells, replay


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vramd", action="append", metavar="BUILD",
                   help="a vramd binary to replay with (repeatable; target/release/vramd if none)")
    p.add_argument("--scales", default=SCALES, help=f"request scales besides 1 (default {SCALES})")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="an allocator setting for every replay (`vramd replay --set`)")
    p.add_argument("--per-trace", action="store_true", help="a line per trace as well")
    p.add_argument("traces", nargs="+")
    o = p.parse_args()
    builds = o.vramd or ["target/release/vramd"]
    for b in builds:
        if not Path(b).is_file():
            p.error(f"{b} not found: build it first (cargo build --release -p vramd)")
    print("| build | traces | misses | fragmentation, mean | driver, mean |")
    print("|---|---|---|---|---|")
    for b in builds:
        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(lambda t: replay(b, [t], o.set, o.scales), o.traces))
        folders = {}
        for trace, out in zip(o.traces, outs):
            for name, rows in by_trace(out).items():
                folders.setdefault(str(Path(trace).parent), []).append((name, cells(rows)))
        for folder, found in folders.items():
            if o.per_trace:
                for name, (m, fm, fw, dm, dw) in found:
                    print(f"| {b} | {name} | {m} | {fm * 100:.2f} % (worst {fw * 100:.2f} %) "
                          f"| {dm * 100:.2f} % (worst {dw * 100:.2f} %) |")
            misses = sum(c[0] for _, c in found)
            frag = statistics.mean(c[1] for _, c in found)
            drv = statistics.mean(c[3] for _, c in found)
            print(f"| {b} | {folder} ({len(found)}) | {misses} | {frag * 100:.2f} % "
                  f"| {drv * 100:.2f} % |")


if __name__ == "__main__":
    main()
