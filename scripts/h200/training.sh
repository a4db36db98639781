#!/usr/bin/env bash
# One device call: interleaved training rounds of one model (bert by default), against plain
# PyTorch and expandable segments. Usage: training.sh [MODEL] [RUNS] [MODE...]; modes default to
# `full pool`; a mode may carry settings, as in full:VRAMD_ALLOC=min_grow=8MiB,grow_slack=0.03.
# Environment: BATCH (the model's batch size, else the script's default), STEPS (100), LIMIT (480 s),
# TAG (the results' folder under $OUT/r, else the model's name), CPUS (pin every run to these
# CPUs, e.g. 1-8), DETERMINISTIC=1 (torch.use_deterministic_algorithms, for identical losses at
# batch sizes where PyTorch's default kernels differ from run to run).
set -u
R=${OUT:?run on the device machine, where OUT is set}/r
MODEL=${1:-bert}
RUNS=${2:-6}
shift $(( $# < 2 ? $# : 2 ))
MODES=("$@")
[ ${#MODES[@]} -eq 0 ] && MODES=(full pool)
mkdir -p "$R"
# 480 s leaves room for a cold start within a 600 s call; results are saved after every round
# and on SIGTERM, so a round cut short costs only itself.
TAG=${TAG:-$MODEL}
( time timeout "${LIMIT:-480}" python3 scripts/torch_on_vramd.py --bin .gpu/bin --out "$R/$TAG" \
    --skip compat allocbench tenants --models "$MODEL" --runs "$RUNS" --steps "${STEPS:-100}" \
    --warmup 20 ${BATCH:+--batch "$BATCH"} ${CPUS:+--cpus "$CPUS"} \
    ${DETERMINISTIC:+--deterministic} --train-modes "${MODES[@]}" ) > "$R/$TAG.log" 2>&1
rm -f "$R"/*/vramd.sock
tar czf "$OUT/r.tgz" -C "$OUT" r
