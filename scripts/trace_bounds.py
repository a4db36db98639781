#!/usr/bin/env python3
"""What no allocator can beat on a PyTorch memory snapshot, and what its peak is made of.

For each trace (a `torch.cuda.memory._snapshot()` pickle, .gz accepted; only plain dicts, lists,
strings and numbers are read), replays the alloc / free_completed pairs of device 0 as
`vramd replay` does — the blocks live when the snapshot's ring-buffer history began (frees without
an alloc, blocks still allocated that no event names) allocated first; with --window-only, their
frees skipped instead — and prints:

- the peak of live requested bytes, and the event index where it is reached;
- the "own granules" bound: at that peak, the memory a placement needs that gives every block of at
  least 1 MiB granules of its own (no two such blocks sharing a 2 MiB granule; smaller blocks
  packed perfectly), and the fragmentation that implies (1 - live / that);
- with --scale, the same bound with every request's size multiplied by each factor (truncated to
  whole bytes, as `vramd replay --scale` scales them), and its mean over the trace as recorded and
  those factors: the bound moves with the sizes (a size a whole number of granules as recorded
  is seldom one scaled), so a goal judged over scales is compared with the bound over the same;
- the live sizes that make up the peak, largest share first;
- the "climb" bound, for each fragmentation F of --climb-frag: an allocator that keeps its
  fragmentation at most F whatever the program does next may hold at most peak-so-far / (1 - F)
  at each new peak of live bytes (the program may never go higher), so it must grow whenever live
  bytes pass that; counted greedily (each growth takes all it may), the fewest growths it needs,
  and the driver time they cost at the least a growth costs in `vramd replay`'s cost model (one
  request, one handle imported and mapped: 87.5 us), as a share of the trace's time. Placement is
  perfect in it (any free byte fits any block) and nothing is ever given back, so no allocator
  that keeps that promise can do with fewer. Where the share is above the driver-time goal, the
  two goals cannot both be promised on that trace.

Usage: python3 scripts/trace_bounds.py ../shared/traces/*.pickle.gz [--granule-mib 2] [--top 8]
       [--climb-frag 3,1] [--scale 0.9,0.95,0.98,1.02,1.05,1.1]
"""
import argparse
import collections
import gzip
import pickle
import sys

MIB = 1 << 20


class PlainOnly(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing pickled class {module}.{name}")


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        return PlainOnly(f).load()


def devices(snapshot):
    """The devices whose history records an allocation or a free, as vramd replay reads them:
    each a trace of its own."""
    return [d for d, events in enumerate(snapshot["device_traces"])
            if any(e["action"] in ("alloc", "free_completed") for e in events)]


def replayable(snapshot, device, window_only):
    """The (action, addr, size) pairs to replay on `device`: allocs and their completed frees,
    after the allocations of the blocks live when the history began (unless window_only)."""
    events = snapshot["device_traces"][device]
    before = {}
    if not window_only:
        named = {e["addr"] for e in events if e["action"] in ("alloc", "free_requested", "free_completed")}
        for seg in snapshot.get("segments", []):
            if seg.get("device", 0) != device:
                continue
            addr = seg["address"]
            for b in seg.get("blocks", []):
                if b["state"].startswith("active") and addr not in named:
                    before[addr] = b.get("requested_size", b["size"])
                addr += b["size"]
        seen = set()
        for e in events:
            if e["action"] == "alloc":
                seen.add(e["addr"])
            elif e["action"] == "free_completed" and e["addr"] not in seen:
                seen.add(e["addr"])
                before[e["addr"]] = e["size"]
    out = [("alloc", addr, before[addr]) for addr in sorted(before)]
    live = dict(before)
    for e in events:
        action = e["action"]
        if action == "alloc":
            live[e["addr"]] = e["size"]
            out.append(("alloc", e["addr"], e["size"]))
        elif action == "free_completed":
            size = live.pop(e["addr"], None)
            if size is not None:
                out.append(("free", e["addr"], size))
    return out, len(before), sum(before.values())


# The least one growth costs in `vramd replay`'s cost model (crates/vram-core/src/replay/cost.rs,
# H200_MEASURED): a grant request (30 us), one handle imported (31 us), mapped (1.5 us) with its
# access set (25 us, plus 0.028 us per MiB, left out here).
GROWTH_US = 30.0 + 31.0 + 1.5 + 25.0


def climb_growths(events, granule, frag):
    """The fewest growths that keep memory held at most peak-so-far / (1 - frag) at every new
    peak of live bytes: each growth takes all it may (rounded down to the granule, never below
    what is live)."""
    live = peak = held = growths = 0
    for action, _, size in events:
        live += size if action == "alloc" else -size
        peak = max(peak, live)
        if live > held:
            need = -(-live // granule) * granule
            allowed = int(peak / (1 - frag)) // granule * granule
            held = max(need, allowed)
            growths += 1
    return growths


def analyse(path, granule, top, window_only, climb_frags, scales):
    snapshot = load(path)
    found = devices(snapshot)
    if not found:
        sys.exit(f"{path}: no device's history records an allocation or a free")
    for device in found:
        name = path.rsplit("/", 1)[-1] + (f":cuda{device}" if len(found) > 1 else "")
        analyse_device(name, snapshot, device, granule, top, window_only, climb_frags, scales)


def own_granules(events, granule):
    """The peak of live requested bytes (bytes, event count), the sizes live there, and the
    own-granules bound at it in bytes."""
    requested = 0
    peak = (0, 0)
    for n, (action, _, size) in enumerate(events, 1):
        requested += size if action == "alloc" else -size
        if requested > peak[0]:
            peak = (requested, n)
    # Replay again up to the peak to see what is live there.
    live = {}
    for action, addr, size in events[:peak[1]]:
        if action == "alloc":
            live[addr] = size
        else:
            del live[addr]
    sizes = list(live.values())
    large = sum(-(-s // granule) * granule for s in sizes if s >= MIB)
    small = sum(s for s in sizes if s < MIB)
    return peak, sizes, large + -(-small // granule) * granule


def analyse_device(name, snapshot, device, granule, top, window_only, climb_frags, scales):
    events, n_before, before_bytes = replayable(snapshot, device, window_only)
    times = [e["time_us"] for e in snapshot["device_traces"][device] if "time_us" in e]
    wall_us = max(times) - min(times) if times else 0
    peak, sizes, bound = own_granules(events, granule)
    if n_before:
        print(f"{name}: {n_before} blocks ({before_bytes / MIB:.1f} MiB) live before the history, allocated first")
    print(f"{name}: peak live {peak[0] / MIB:.1f} MiB at event {peak[1]}; "
          f"own-granules bound {bound / MIB:.1f} MiB, fragmentation {100 * (1 - peak[0] / bound):.2f} %")
    by_size = collections.Counter(sizes)
    for size, count in sorted(by_size.items(), key=lambda kv: -kv[0] * kv[1])[:top]:
        print(f"    {size / MIB:10.3f} MiB x {count:4d} = {size * count / MIB:9.1f} MiB")
    if scales:
        frags = [1 - peak[0] / bound]
        cells = []
        for f in scales:
            scaled = [(action, addr, int(size * f)) for action, addr, size in events]
            p, _, b = own_granules(scaled, granule)
            frags.append(1 - p[0] / b if b else 0.0)
            cells.append(f"{f:g}: {100 * frags[-1]:.2f} %")
        print(f"{name}: own-granules bound at scales {', '.join(cells)}; "
              f"mean with the trace as recorded {100 * sum(frags) / len(frags):.2f} %, "
              f"worst {100 * max(frags):.2f} %")
    for frag in climb_frags:
        n = climb_growths(events, granule, frag / 100)
        share = f"{100 * n * GROWTH_US / wall_us:.2f} % of its {wall_us / 1e6:.1f} s" if wall_us else "-"
        print(f"{name}: climb bound at fragmentation {frag:g} %: {n} growths, "
              f"{n * GROWTH_US / 1000:.1f} ms of driver time, {share}")


def numbers(text, ok, rule):
    """Comma-separated numbers, each of which `ok` accepts (`rule` says which in the error)."""
    try:
        xs = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if any(not ok(x) for x in xs):
        raise argparse.ArgumentTypeError(f"each must be {rule}, got {text!r}")
    return xs


def percents(text):
    """Comma-separated fragmentations in percent, each at least 0 and below 100."""
    return numbers(text, lambda f: 0 <= f < 100, "at least 0 and below 100 %")


def factors(text):
    """Comma-separated request-size factors, each above 0 and at most 16 (as vramd replay's)."""
    return numbers(text, lambda f: 0 < f <= 16, "above 0 and at most 16")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+")
    p.add_argument("--granule-mib", type=int, default=2)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--climb-frag", default="3,1", metavar="PERCENTS", type=percents,
                   help="fragmentations (percent, comma-separated) to give the climb bound for")
    p.add_argument("--scale", default=[], metavar="FACTORS", type=factors,
                   help="also give the own-granules bound with request sizes scaled by these "
                        "(comma-separated, as vramd replay --scale)")
    p.add_argument("--window-only", action="store_true",
                   help="replay the recorded events alone, as vramd replay --window-only")
    a = p.parse_args()
    for t in a.traces:
        analyse(t, a.granule_mib * MIB, a.top, a.window_only, a.climb_frag, a.scale)


if __name__ == "__main__":
    main()
