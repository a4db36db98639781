#!/usr/bin/env bash
# One device call: the build's default allocator settings against `--set SETTING` (e.g.
# max_handle=32MiB), interleaved on one machine: the in-process replay three times each, the
# tenant's real path (`--through-daemon --realtime`) once each, then PyTorch full-mode peaks on the
# default (BERT batch 64 deterministic, BERT batch 16, ResNet-50; plain and expandable once each
# beside it). About 6 minutes. PEAKS=0 leaves the training runs out.
set -u
SETTING=${1:?usage: setting_ab.sh NAME=VALUE}
. "$(dirname "$0")/lib.sh"
V=.gpu/bin/vramd
for i in 1 2 3; do
  step "replay_cuda_default_$i" 60 $V replay --backend cuda --json .gpu/traces/*.gz
  step "replay_cuda_setting_$i" 60 $V replay --backend cuda --json --set "$SETTING" .gpu/traces/*.gz
done
T=(replay --backend cuda --through-daemon --realtime --json .gpu/traces/*.gz)
step daemon_realtime_default 45 $V "${T[@]}"
step daemon_realtime_setting 45 $V "${T[@]}" --set "$SETTING"
[ "${PEAKS:-1}" = 0 ] || pytorch_peaks
rm -f "$R"/*/vramd.sock
tar czf "$OUT/r.tgz" -C "$OUT" r
