#!/usr/bin/env python3
"""How far the allocator's settings alone can take each trace: replays every trace under every
combination of a grid of settings (`vramd replay --set`, at request scales 0.9-1.1 as in
docs/benchmarks.md) and prints, per trace, the combination that misses the fewest goals.

A goal cell is one of six per trace: fragmentation as recorded, its mean and its worst over the
scales, each at most min(3 %, PyTorch's expandable segments' figure from the trace's README); and
modelled driver time as recorded, mean and worst, each at most 1 %. A trace that misses with every
combination is out of reach of tuning: only another policy can change it.

Usage: python3 scripts/settings_grid.py --vramd target/release/vramd --out DIR TRACE...
Each combination's replay is kept as DIR/<settings>.jsonl and not run again when present. With
the default grid (64 combinations) and the 17 traces of ../shared/traces and
docs/results/2026-12-04-h200-traces, about 17 minutes on 2 cores.
"""
import argparse
import itertools
import json
import statistics
import subprocess
import sys
from pathlib import Path

SCALES = "0.9,0.95,0.98,1.02,1.05,1.1"
GRID = {
    "max_handle": ["32MiB", "64MiB", "128MiB", "256MiB"],
    "grow_slack": ["0.005", "0.01", "0.02", "0.04"],
    "driver_budget": ["0.01", "0"],
    "min_grow": ["2MiB", "16MiB"],
}


def cells(rows):
    """(misses, fragmentation mean, worst, driver mean, worst) of one trace's rows by scale."""
    one = rows["1"]
    goal = min(0.03, one.get("pytorch_fragmentation", {}).get("expandable", 1.0))
    frag = [r["fragmentation"] for r in rows.values()]
    drv = [r["modelled_driver_time_share"] for r in rows.values()]
    if None in drv:
        sys.exit(f"{one['trace']}: its events carry no times, so its driver time cannot be judged")
    f = [one["fragmentation"], statistics.mean(frag), max(frag)]
    d = [one["modelled_driver_time_share"], statistics.mean(drv), max(drv)]
    misses = sum(c > goal + 1e-12 for c in f) + sum(c > 0.01 for c in d)
    return misses, f[1], f[2], d[1], d[2]


def replay(vramd, traces, settings=(), scales=SCALES):
    """`vramd replay --json` of `traces` at `scales`, with the allocator `settings` (NAME=VALUE,
    comma-separated ones allowed): its output, one JSON object per trace and scale."""
    cmd = [vramd, "replay", "--json", "--compare", "expandable", "--scale", scales]
    cmd += [a for s in settings for a in ("--set", s)]
    run = subprocess.run([*cmd, *traces], capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{run.stderr}")
    return run.stdout


def by_trace(text):
    """The rows of `replay`'s output by trace name, then by scale ("1" as recorded)."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            name, _, scale = r["trace"].partition("@")
            rows.setdefault(name, {})[scale or "1"] = r
    return rows


def load(path):
    return {name: cells(rows) for name, rows in by_trace(path.read_text()).items() if "1" in rows}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vramd", default="target/release/vramd")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("traces", nargs="+")
    o = p.parse_args()
    if not Path(o.vramd).is_file():
        p.error(f"{o.vramd} not found: build it first (cargo build --release -p vramd)")
    o.out.mkdir(parents=True, exist_ok=True)
    combos = [",".join(f"{k}={v}" for k, v in zip(GRID, vals))
              for vals in itertools.product(*GRID.values())]
    results = {}
    # The default settings are replayed as they are (no --set), so the row stays the default's
    # whatever the defaults become.
    for i, combo in enumerate(["default", *combos]):
        path = o.out / f"{combo}.jsonl"
        if not path.exists() or path.stat().st_size == 0:
            print(f"[{i}/{len(combos)}] {combo}", file=sys.stderr, flush=True)
            path.write_text(replay(o.vramd, o.traces, [] if combo == "default" else [combo]))
        results[combo] = load(path)
    traces = sorted({t for r in results.values() for t in r})
    print("| trace | default: misses | fewest misses with any settings | those settings "
          "(the first of the best) | fragmentation mean / worst | driver mean / worst |")
    print("|---|---|---|---|---|---|")
    for t in traces:
        best = min(combos, key=lambda c: (results[c][t][0], results[c][t][2] + results[c][t][4]))
        m, fm, fw, dm, dw = results[best][t]
        print(f"| {t} | {results['default'][t][0]} | {m} | `{best}` | "
              f"{fm * 100:.2f} / {fw * 100:.2f} % | {dm * 100:.2f} / {dw * 100:.2f} % |")
    totals = sorted((sum(results[c][t][0] for t in traces), c) for c in combos)
    default = sum(results["default"][t][0] for t in traces)
    print(f"\nDefault settings: {default} misses; "
          f"the best combination of the grid: {totals[0][0]} (`{totals[0][1]}`).")


if __name__ == "__main__":
    main()
