#!/usr/bin/env bash
# One device call: this build against another bundled as .gpu/bin/vramd-prev (built from an older
# commit), interleaved on one machine: the in-process replay three times each and the tenant's
# real path (`--through-daemon --realtime`) once each; then PyTorch full-mode peaks on this build
# (BERT batch 64 deterministic, BERT batch 16, ResNet-50; plain and expandable once each beside
# it). About 6 minutes. PEAKS=0 leaves the training runs out.
set -u
. "$(dirname "$0")/lib.sh"
[ -x .gpu/bin/vramd-prev ] || { echo "bundle the other build as .gpu/bin/vramd-prev" >&2; exit 2; }
for i in 1 2 3; do
  for b in vramd vramd-prev; do
    step "replay_cuda_${b}_$i" 60 ".gpu/bin/$b" replay --backend cuda --json .gpu/traces/*.gz
  done
done
T=(replay --backend cuda --through-daemon --realtime --json .gpu/traces/*.gz)
for b in vramd vramd-prev; do step "daemon_realtime_$b" 45 ".gpu/bin/$b" "${T[@]}"; done
[ "${PEAKS:-1}" = 0 ] || pytorch_peaks
rm -f "$R"/*/vramd.sock
tar czf "$OUT/r.tgz" -C "$OUT" r
