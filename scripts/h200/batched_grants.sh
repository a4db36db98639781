#!/usr/bin/env bash
# One device call: every GPU test, grant latency split into the round trip and the import, the
# in-process replay, and the tenant's real path (`--through-daemon --realtime`). Other builds
# bundled as .gpu/bin/vramd-* (e.g. vramd-prev, built from an older commit) run the same benches
# and real-path replays, interleaved with this build's on the same machine. About 5 minutes with
# two other builds (COMPAT=0 leaves out PyTorch's compatibility checks: 1 minute less).
set -u
. "$(dirname "$0")/lib.sh"
step gpu_tests 150 bash .gpu/run
bundled_builds
for b in "${BUILDS[@]}"; do
  B=(".gpu/bin/$b" bench --backend cuda --size 2MiB --map)
  step "bench_recycled_$b" 60 "${B[@]}" --iterations 1000
  step "bench_fresh_$b" 60 "${B[@]}" --iterations 1000 --fresh
  step "bench_fresh_spaced_$b" 60 "${B[@]}" --iterations 300 --fresh --pause-us 3000
done
for i in 1 2; do
  step "replay_cuda_$i" 60 .gpu/bin/vramd replay --backend cuda --json .gpu/traces/*.gz
done
T=(replay --backend cuda --through-daemon --realtime --json .gpu/traces/*.gz)
for i in 1 2; do
  for b in "${BUILDS[@]}"; do step "daemon_realtime_${b}_$i" 45 ".gpu/bin/$b" "${T[@]}"; done
done
[ "${COMPAT:-1}" = 0 ] || step compat 200 python3 scripts/torch_on_vramd.py --bin .gpu/bin --out "$R/compat" --skip training tenants
rm -f "$R"/*/vramd.sock
grep -H -E "usable" "$R"/bench_*.log
grep -h "gpu run:" "$R/gpu_tests.log"
tar czf "$OUT/r.tgz" -C "$OUT" r
