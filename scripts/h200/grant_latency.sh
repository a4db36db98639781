#!/usr/bin/env bash
# One device call: grant latency as a tenant meets it. `vramd bench` with handles given back inside
# the round trip (the daemon hands the same handle back: a re-import), with fresh handles
# (`--fresh`: each take a handle this process never imported), and with fresh handles 3 ms apart
# (`--pause-us 3000`, as a program's growths come); then the same spaced run against a daemon whose
# pool holds 400 handles before it starts, so that no refill runs beside the grants. About 40 s.
set -u
R=${OUT:?run on the device machine, where OUT is set}/r
mkdir -p "$R"
B=(.gpu/bin/vramd bench --backend cuda --size 2MiB --size 64MiB --iterations 300 --map)
"${B[@]}" > "$R/bench_recycled.txt" 2>&1
"${B[@]}" --fresh > "$R/bench_fresh.txt" 2>&1
"${B[@]}" --fresh --pause-us 3000 > "$R/bench_fresh_spaced.txt" 2>&1
for initial in 400 8; do
  sock=/tmp/vramd-bench-$initial.sock
  printf '[pool]\nmax = "2GiB"\nsizes = ["2MiB"]\ninitial = %s\n' "$initial" > "/tmp/pool-$initial.toml"
  .gpu/bin/vramd serve --backend cuda --metrics off --socket "$sock" \
    --config "/tmp/pool-$initial.toml" > "$R/serve_pool$initial.log" 2>&1 &
  pid=$!
  sleep 4 # the pool's 400 creates and exports (an export alone: 1.1 ms, docs/design.md)
  .gpu/bin/vramd bench --socket "$sock" --size 2MiB --iterations 180 --warmup 0 --map --fresh \
    --pause-us 3000 > "$R/bench_fresh_spaced_pool$initial.txt" 2>&1
  kill "$pid"; wait "$pid" 2>/dev/null
done
grep -H -E "phases|usable" "$R"/bench_*.txt
