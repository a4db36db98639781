#!/usr/bin/env python3
"""What no allocator can beat on a PyTorch memory snapshot, and what its peak is made of.

For each trace (a `torch.cuda.memory._snapshot()` pickle, .gz accepted; only plain dicts, lists,
strings and numbers are read), replays the alloc / free_completed pairs of device 0 as
`vramd replay` does (frees of blocks whose alloc the ring buffer lost are skipped) and prints:

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


def analyse(path, granule, top):
    events = load(path)["device_traces"][0]
    live = {}
    requested = 0
    peak = (0, 0)
    n = 0
    for e in events:
        action = e["action"]
        if action == "alloc":
            live[e["addr"]] = e["size"]
            requested += e["size"]
        elif action == "free_completed":
            size = live.pop(e["addr"], None)
            if size is None:
                continue
            requested -= size
        else:
            continue
        n += 1
        if requested > peak[0]:
            peak = (requested, n)
    # Replay again up to the peak to see what is live there.
    live = {}
    n = 0
    for e in events:
        action = e["action"]
        if action == "alloc":
            live[e["addr"]] = e["size"]
        elif action == "free_completed":
            if live.pop(e["addr"], None) is None:
                continue
        else:
            continue
        n += 1
        if n == peak[1]:
            break
    sizes = list(live.values())
    large = sum(-(-s // granule) * granule for s in sizes if s >= MIB)
    small = sum(s for s in sizes if s < MIB)
    bound = large + -(-small // granule) * granule
    name = path.rsplit("/", 1)[-1]
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
    a = p.parse_args()
    for t in a.traces:
        analyse(t, a.granule_mib * MIB, a.top)


if __name__ == "__main__":
    main()
