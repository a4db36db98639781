#!/usr/bin/env bash
# One device call: what a grant costs when the daemon's pool has nothing ready (a daemon with
# `[pool] max = "0 B"`, `vramd bench --fresh` at 2, 64 and 256 MiB), then
# this build against .gpu/bin/vramd-prev on the tenant's real path (`--through-daemon
# --realtime`), two rounds interleaved. About 2 minutes.
set -u
. "$(dirname "$0")/lib.sh"
printf '[pool]\nmax = "0 B"\n' > "$R/nopool.toml"
for b in vramd vramd-prev; do
  [ -x ".gpu/bin/$b" ] || continue
  S=/tmp/vramd-nopool-$b.sock
  ".gpu/bin/$b" serve --backend cuda --config "$R/nopool.toml" --socket "$S" --metrics off \
    > "$R/nopool_daemon_$b.log" 2>&1 &
  pid=$!
  for _ in $(seq 100); do [ -S "$S" ] && break; sleep 0.1; done
  for size in 2MiB 64MiB 256MiB; do
    step "nopool_${b}_$size" 60 ".gpu/bin/$b" bench --socket "$S" --size "$size" --iterations 30 \
      --warmup 2 --fresh --map
  done
  kill "$pid"; wait "$pid" 2>/dev/null
done
T=(replay --backend cuda --through-daemon --realtime --json .gpu/traces/*.gz)
for i in 1 2; do
  for b in vramd vramd-prev; do
    [ -x ".gpu/bin/$b" ] && step "daemon_realtime_${b}_$i" 45 ".gpu/bin/$b" "${T[@]}"
  done
done
grep -H "usable\|phases" "$R"/nopool_*.log
tar czf "$OUT/r.tgz" -C "$OUT" r
