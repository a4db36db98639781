#!/usr/bin/env bash
# One device call: what the ready pool's `[pool] max` costs and buys. The Hugging Face trainings
# (NVML peak) under this build's default pool and without a pool, beside expandable segments;
# then the tenant's real path through a daemon of the default configuration (`vramd replay
# --through-daemon --realtime`) for this build and each other build bundled as .gpu/bin/vramd-*,
# one after another (`vramd bench` would not do: its daemon's pool is sized for the bench).
# ROUNDS (2), STEPS (24), MODES (expandable full full-nopool), HF_LIMIT (330 s).
set -u
. "$(dirname "$0")/lib.sh"
step hf "${HF_LIMIT:-330}" python3 scripts/h200/hf_training.py --vramd .gpu/bin/vramd \
  --out "$R/hf" --rounds "${ROUNDS:-2}" --steps "${STEPS:-24}" --warmup 6 --models gpt2 llama \
  --modes ${MODES:-expandable full full-nopool}
bundled_builds
T=(replay --backend cuda --through-daemon --realtime --json .gpu/traces/*.gz)
for b in "${BUILDS[@]}"; do step "daemon_realtime_$b" 75 ".gpu/bin/$b" "${T[@]}"; done
cat "$R/hf/summary.md" 2>/dev/null
tar czf "$OUT/r.tgz" -C "$OUT" r
