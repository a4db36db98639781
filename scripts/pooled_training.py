#!/usr/bin/env python3
"""Pools the training runs of several `torch_on_vramd.py` results files (one model) and prints,
per allocator, the number of runs, the ratio of its median steps/s to plain PyTorch's over all
runs, and the median of the per-round paired ratios (each run against the plain run of its own
round, so that a drift of the machine between rounds cancels).

Usage: python3 scripts/pooled_training.py [--model bert] [--warmup 20] RESULTS.json...

Steps/s of a run is its number of timed steps over their total time, the steps after the first
`--warmup`, as in the script's own summary (`torch_on_vramd.steps_per_s`)."""

import argparse
import json
import statistics

from torch_on_vramd import steps_per_s


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="results.json files written by torch_on_vramd.py")
    p.add_argument("--model", default="bert")
    p.add_argument("--warmup", type=int, default=20)
    o = p.parse_args()
    runs, pairs = {}, {}
    for path in o.results:
        with open(path) as f:
            per = json.load(f)["training"][o.model]["runs"]
        plain = [steps_per_s(r, o.warmup) if "times" in r else None for r in per.get("plain", [])]
        for mode, rs in per.items():
            thr = [steps_per_s(r, o.warmup) if "times" in r else None for r in rs]
            runs.setdefault(mode, []).extend(x for x in thr if x)
            # Run i of a mode belongs to round i, as does plain's run i.
            pairs.setdefault(mode, []).extend(a / b for a, b in zip(thr, plain) if a and b)
    base = statistics.median(runs["plain"])
    print(f"{'allocator':<12} {'runs':>5} {'steps/s':>9} {'ratio':>7} {'paired':>7}")
    for mode, xs in runs.items():
        med = statistics.median(xs)
        paired = statistics.median(pairs[mode]) if pairs[mode] else float("nan")
        print(f"{mode:<12} {len(xs):>5} {med:>9.2f} {med / base:>7.3f} {paired:>7.3f}")


if __name__ == "__main__":
    main()
