#!/usr/bin/env bash
# One device call: GPU tests, replays on the device, C ABI pair, PyTorch compatibility (COMPAT=0
# leaves that out).
set -u
. "$(dirname "$0")/lib.sh"
step gpu_tests 120 bash .gpu/run
step replay_cuda 120 .gpu/bin/vramd replay --backend cuda --json .gpu/traces/*.gz
step replay_cuda_through_daemon 150 .gpu/bin/vramd replay --backend cuda --through-daemon --json .gpu/traces/*.gz
# At the traces' own pace (about 14 s), as a tenant's grants come.
step replay_cuda_through_daemon_realtime 60 .gpu/bin/vramd replay --backend cuda --through-daemon \
  --realtime --json .gpu/traces/*.gz
if [ -x .gpu/bench/alloc_pair ]; then
  step alloc_pair 60 .gpu/bench/alloc_pair --bench --warm-up-time 1 --measurement-time 4
fi
[ "${COMPAT:-1}" = 0 ] || step compat 200 python3 scripts/torch_on_vramd.py --bin .gpu/bin --out "$R/compat" --skip training tenants
rm -f "$R"/*/vramd.sock
tar czf "$OUT/r.tgz" -C "$OUT" r
