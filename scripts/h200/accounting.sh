#!/usr/bin/env bash
# One device call: vramd's accounting against what the driver and NVML see, for programs that are
# not PyTorch-in-full-mode (scripts/h200/accounting/). With .gpu carried, from the repository root:
#   bash scripts/h200/accounting.sh
# A daemon (CUDA backend, capacity measured, no config) in a temporary folder, then, each part a
# step with its own time limit (the whole under ACCT_BUDGET, 540 s):
#   t_*      JAX (preallocation on; off; off with MEM_FRACTION=1), CuPy, the driver API from C and
#            from ctypes, PyTorch+NCCL: each under `vramd run --limit 4GiB` until refused, held
#            while status, nvidia-smi and NVML are read, then SIGKILLed and the reclaim timed
#   outside  a plain 20 GiB process beside a tenant guaranteed capacity-10 GiB: outside_use,
#            at_risk, a borrower refused, and both after the hog is killed
#   ten      ten PyTorch tenants of guarantee = limit = capacity/10, all holding at once
#   speed    JAX and CuPy loops, plain against `vramd run --limit 16GiB`, 3 rounds, order turned
#   mps      MPS's pinned-memory cap (2G) against memory imported from vramd
# ACCT_PARTS (space-separated: t_jax_pre t_cupy ... outside ten speed mps) runs only those parts.
# Results: $OUT/summary.json, and everything in $OUT/r.tgz (r/ itself is moved out of $OUT so
# that no more than these two files come back).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
. scripts/h200/lib.sh # R and $R/env.txt
START=$(date +%s)
BUDGET=${ACCT_BUDGET:-540}
A=scripts/h200/accounting
W=$(mktemp -d /tmp/vramd-acct.XXXXXX)
export ACCT_VRAMD=${ACCT_VRAMD:-.gpu/bin/vramd} ACCT_SOCKET=$W/vramd.sock ACCT_PGIDS=$W/pgids
H=(python3 "$A/harness.py")
D=""

bstep() { # bstep NAME LIMIT RESERVE COMMAND...: a step (output in $R/NAME.log, exit status and
  # seconds in $R/steps.txt), its limit cut to what the budget leaves after RESERVE seconds
  local name=$1 limit=$2 reserve=$3 left t0 rc
  shift 3
  left=$((BUDGET - ($(date +%s) - START) - reserve))
  if [ "$left" -lt 15 ]; then
    echo "== $name skipped: ${left}s left after the ${reserve}s kept for later parts" | tee "$R/$name.log"
    printf '%s\tskipped\t0\t0\n' "$name" >> "$R/steps.txt"
    return
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "== $name (limit ${limit}s)"
  t0=$(date +%s.%N)
  timeout -k "${KILL_AFTER:-5}" "$limit" "$@" > "$R/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%.1f\t%s\n' "$name" "$rc" "$(awk "BEGIN { print $(date +%s.%N) - $t0 }")" "$limit" >> "$R/steps.txt"
  echo "   exit $rc"
}

daemon_stop() {
  [ -z "$D" ] && return
  kill -TERM "$D" 2>/dev/null
  for _ in $(seq 100); do kill -0 "$D" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$D" 2>/dev/null && { echo "daemon ignored SIGTERM for 10 s: SIGKILL" >> "$R/vramd.log"; kill -9 "$D"; }
  wait "$D" 2>/dev/null
  D=""
}

finish() {
  [ -n "${FINISHED:-}" ] && return
  FINISHED=1
  # The process groups the harness started (vramd run and its program), should any outlive it.
  [ -f "$ACCT_PGIDS" ] && for g in $(sort -u "$ACCT_PGIDS"); do kill -9 -- "-$g" 2>/dev/null; done
  daemon_stop
  rm -f "$ACCT_SOCKET"
  timeout 30 "${H[@]}" summary --dir "$R" --out "$OUT/summary.json" > "$R/summary.log" 2>&1 ||
    echo '{"error": "summary failed: see r/summary.log"}' > "$OUT/summary.json"
  cp "$OUT/summary.json" "$R/summary.json"
  tar czf "$OUT/r.tgz" -C "$OUT" r && mv "$OUT/r" "$W/r"
}
trap finish EXIT
trap 'exit 143' INT TERM

want() { # want PART: whether ACCT_PARTS (space-separated; unset: every part) names it
  [ -z "${ACCT_PARTS:-}" ] || [[ " $ACCT_PARTS " == *" $1 "* ]]
}

bstep compile 60 0 gcc -O1 -o "$W/drv_alloc" "$A/drv_alloc.c" -ldl
DRV=$W/drv_alloc

# The daemon: CUDA, capacity measured (no configuration), no metrics endpoint.
"$ACCT_VRAMD" serve --backend cuda --socket "$ACCT_SOCKET" --metrics off > "$R/vramd.log" 2>&1 &
D=$!
for _ in $(seq 300); do [ -S "$ACCT_SOCKET" ] && break; kill -0 "$D" 2>/dev/null || break; sleep 0.1; done
echo "daemon pid $D, socket $( [ -S "$ACCT_SOCKET" ] && echo up || echo MISSING ) after $(($(date +%s) - START)) s"
timeout 10 "$ACCT_VRAMD" status --socket "$ACCT_SOCKET" --json > "$R/status_start.json" 2> "$R/status_start.err"
nvidia-smi > "$R/nvidia_smi_start.txt" 2>&1

# Each framework as a tenant, limit 4 GiB, in its waiting mode. Reserve: what the later parts need.
tenant() { # tenant NAME LIMIT_S ENV... -- CMD...
  local name=$1 limit=$2
  want "t_$name" || return 0
  shift 2
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  # shellcheck disable=SC2086 # HARGS: extra harness arguments, split on spaces
  bstep "t_$name" "$limit" 330 env ${envs[@]+"${envs[@]}"} "${H[@]}" tenant --name "$name" --limit 4GiB \
    --out "$R/t_$name.json" ${HARGS:-} -- "$@"
}
tenant jax_pre 90 -- python3 "$A/jax_prog.py" --wait
tenant jax_nopre 90 XLA_PYTHON_CLIENT_PREALLOCATE=false -- python3 "$A/jax_prog.py" --wait
tenant jax_nopre_f100 90 XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=1.0 -- \
  python3 "$A/jax_prog.py" --wait
tenant cupy 60 -- python3 "$A/cupy_prog.py" --wait
tenant drv 40 -- "$DRV" --step-mib 256 --wait
tenant ctypes 40 -- python3 "$A/ctypes_alloc.py" --wait
# PyTorch's context with NCCL's is larger (about 1.1 GiB beyond the tensors in a plain run).
HARGS="--ctx-margin-gib 1.5" tenant nccl 90 -- python3 "$A/nccl_prog.py" --wait

# Memory taken outside vramd, beside a large guarantee.
want outside && bstep outside 120 270 "${H[@]}" hog --out "$R/outside.json" --drv "$DRV" --hog-gib 20 --spare-gib 10
timeout 10 "$ACCT_VRAMD" status --socket "$ACCT_SOCKET" --json > "$R/status_after_outside.json" 2>&1

# Ten tenants filling the capacity.
want ten && bstep ten 150 200 python3 "$A/ten_tenants.py" run --out "$R/ten.json" --margin-gib 1

# Speed, plain against vramd run. The harness stops starting runs when its own budget is spent.
left=$((BUDGET - ($(date +%s) - START) - 90))
[ "$left" -gt 200 ] && left=200
want speed && bstep speed "$((left + 10))" 80 "${H[@]}" speed --out "$R/speed.json" --rounds 3 --limit 16GiB \
  --seconds 5 --budget-s "$left"

# MPS last: its daemon is stopped by mps_cap.sh's trap whatever happens.
want mps && KILL_AFTER=30 bstep mps 100 40 env DRV="$DRV" bash "$A/mps_cap.sh" "$R/mps"

timeout 10 "$ACCT_VRAMD" status --socket "$ACCT_SOCKET" --json > "$R/status_end.json" 2>&1
nvidia-smi > "$R/nvidia_smi_end.txt" 2>&1
echo "total $(($(date +%s) - START)) s"
