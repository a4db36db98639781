#!/usr/bin/env bash
# One device call (or a run on any machine: the pair runs against an in-process daemon on the host
# backend, so only the CPU matters): the C ABI alloc+free pair of this build
# (.gpu/bench/alloc_pair) against another bundled as .gpu/bench/alloc_pair_prev, ROUNDS rounds
# (4 unless set), the order turned each round; then criterion's estimate per benchmark and build,
# the median over the rounds and the range, in $R/fast_path.md. About 40 s a round.
# Bundle the other build's bench binary by building it in a worktree of the older commit:
#   cargo bench -p vram-ffi --bench alloc_pair --no-run   (its path is printed; strip it)
set -u
. "$(dirname "$0")/lib.sh"
for b in alloc_pair alloc_pair_prev; do
  [ -x ".gpu/bench/$b" ] || { echo "bundle the bench binary as .gpu/bench/$b" >&2; exit 2; }
done
rounds=${ROUNDS:-4}
for i in $(seq "$rounds"); do
  order="alloc_pair alloc_pair_prev"
  [ $((i % 2)) = 0 ] && order="alloc_pair_prev alloc_pair"
  for b in $order; do
    step "${b}_$i" 90 ".gpu/bench/$b" --bench --warm-up-time 1 --measurement-time 4
  done
done
python3 - "$R" "$rounds" > "$R/fast_path.md" <<'EOF'
import re, statistics, sys
from pathlib import Path
r, rounds = Path(sys.argv[1]), int(sys.argv[2])
est = {}  # (bench, build) -> [ns per round]
unit = {"ps": 1e-3, "ns": 1.0, "µs": 1e3, "us": 1e3, "ms": 1e6}
for b in ("alloc_pair", "alloc_pair_prev"):
    for i in range(1, rounds + 1):
        log = r / f"{b}_{i}.log"
        if not log.exists():
            continue
        name = None
        for line in log.read_text().splitlines():
            m = re.match(r"\s+time:\s+\[\S+ \S+ (\S+) (\S+) ", line)
            if m and name:
                est.setdefault((name, b), []).append(float(m[1]) * unit[m[2]])
                name = None
            elif line.startswith("vram_alloc+vram_free"):
                name = line.strip()
names = sorted({n for n, _ in est})
print("| pair | this build, median (range) | other build, median (range) | rounds |")
print("|---|---|---|---|")
for n in names:
    cells = []
    for b in ("alloc_pair", "alloc_pair_prev"):
        v = est.get((n, b), [])
        cells.append(f"{statistics.median(v):.1f} ns ({min(v):.1f}-{max(v):.1f})" if v else "none")
    k = min(len(est.get((n, b), [])) for b in ("alloc_pair", "alloc_pair_prev"))
    print(f"| {n.removeprefix('vram_alloc+vram_free ')} | {cells[0]} | {cells[1]} | {k} |")
EOF
cat "$R/fast_path.md"
tar czf "$OUT/r.tgz" -C "$OUT" r
