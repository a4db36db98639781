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
- the live sizes that make up the peak, largest share first.

Usage: python3 scripts/trace_bounds.py ../shared/traces/*.pickle.gz [--granule-mib 2] [--top 8]
"""
import argparse
import collections
import gzip
import pickle

MIB = 1 << 20


class PlainOnly(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing pickled class {module}.{name}")


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        return PlainOnly(f).load()


def replayable(snapshot, window_only):
    """The (action, addr, size) pairs to replay: allocs and their completed frees, after the
    allocations of the blocks live when the history began (unless window_only)."""
    events = snapshot["device_traces"][0]
    before = {}
    if not window_only:
        named = {e["addr"] for e in events if e["action"] in ("alloc", "free_requested", "free_completed")}
        for seg in snapshot.get("segments", []):
            if seg.get("device", 0) != 0:
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


def analyse(path, granule, top, window_only):
    events, n_before, before_bytes = replayable(load(path), window_only)
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
    bound = large + -(-small // granule) * granule
    name = path.rsplit("/", 1)[-1]
    if n_before:
        print(f"{name}: {n_before} blocks ({before_bytes / MIB:.1f} MiB) live before the history, allocated first")
    print(f"{name}: peak live {peak[0] / MIB:.1f} MiB at event {peak[1]}; "
          f"own-granules bound {bound / MIB:.1f} MiB, fragmentation {100 * (1 - peak[0] / bound):.2f} %")
    by_size = collections.Counter(sizes)
    for size, count in sorted(by_size.items(), key=lambda kv: -kv[0] * kv[1])[:top]:
        print(f"    {size / MIB:10.3f} MiB x {count:4d} = {size * count / MIB:9.1f} MiB")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+")
    p.add_argument("--granule-mib", type=int, default=2)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--window-only", action="store_true",
                   help="replay the recorded events alone, as vramd replay --window-only")
    a = p.parse_args()
    for t in a.traces:
        analyse(t, a.granule_mib * MIB, a.top, a.window_only)


if __name__ == "__main__":
    main()
