#!/usr/bin/env bash
# One device call: every GPU test, grant latency split into the round trip and the import, the
# in-process replay, and the tenant's real path (`--through-daemon --realtime`) with this build's
# batched grants (`GrantMany`) against a build without them, if bundled as .gpu/bin/vramd-prev
# (same machine, runs interleaved). About 5 minutes (COMPAT=0 leaves out PyTorch's compatibility
# checks: about 2 minutes less).
set -u
R=${OUT:?run on the device machine, where OUT is set}/r
mkdir -p "$R"
step() { # step NAME SECONDS COMMAND...: runs it with a limit, its output in $R/NAME.log
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s)"
  ( time timeout "$limit" "$@" ) > "$R/$name.log" 2>&1
  echo "   exit $?"
}
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc
  python3 -c "import torch; print('torch', torch.__version__)"; } > "$R/env.txt" 2>&1
step gpu_tests 150 bash .gpu/run
B=(.gpu/bin/vramd bench --backend cuda --size 2MiB --iterations 300 --map)
step bench_recycled 60 "${B[@]}"
step bench_fresh 60 "${B[@]}" --fresh
step bench_fresh_spaced 60 "${B[@]}" --fresh --pause-us 3000
for i in 1 2; do
  step "replay_cuda_$i" 60 .gpu/bin/vramd replay --backend cuda --json .gpu/traces/*.gz
done
T=(replay --backend cuda --through-daemon --realtime --json .gpu/traces/*.gz)
for i in 1 2; do
  step "daemon_realtime_$i" 45 .gpu/bin/vramd "${T[@]}"
  if [ -x .gpu/bin/vramd-prev ]; then
    step "daemon_realtime_prev_$i" 45 .gpu/bin/vramd-prev "${T[@]}"
  fi
done
[ "${COMPAT:-1}" = 0 ] || step compat 200 python3 scripts/torch_on_vramd.py --bin .gpu/bin --out "$R/compat" --skip training tenants
rm -f "$R"/*/vramd.sock
grep -h -E "phases|usable" "$R"/bench_*.log
grep -h "gpu run:" "$R/gpu_tests.log"
tar czf "$OUT/r.tgz" -C "$OUT" r
