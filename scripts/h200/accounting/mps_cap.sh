#!/usr/bin/env bash
# mps_cap.sh OUTDIR: does memory a tenant imports from vramd count against an MPS client's pinned
# device memory limit? Starts an MPS control daemon with private pipe and log folders under /tmp,
# then, as MPS clients with CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2G:
#   mps_vramd      drv_alloc under `vramd run --limit 4GiB` (its memory is the daemon's, imported):
#                  does it get past 2 GiB, and who refused it (vramd's refusals in status, or not)?
#   mps_plain_drv  drv_alloc plainly (cuMemAlloc), at most 4 GiB: refused near 2 GiB?
#   mps_plain_cupy cupy_prog.py plainly (cudaMalloc through CuPy's pool), at most 4 GiB: likewise.
# Then MPS is stopped (`echo quit | nvidia-cuda-mps-control`), on failure too (trap), and
# OUTDIR/mps_cap.json says what was seen. Needs a running daemon: ACCT_SOCKET (and ACCT_VRAMD,
# default .gpu/bin/vramd), and DRV, the compiled drv_alloc. Run from the repository root.
set -u
OD=${1:?usage: mps_cap.sh OUTDIR}
mkdir -p "$OD"
A=$(dirname "$0")
DRV=${DRV:?DRV: the compiled drv_alloc}
PLAIN_ONLY=${MPS_PLAIN_ONLY:-0} # 1: the plain clients only (selftest.sh, no daemon)
[ "$PLAIN_ONLY" = 1 ] || : "${ACCT_SOCKET:?ACCT_SOCKET: the socket of a running daemon}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
CAP=${MPS_CAP:-2G}

PIPE=$(mktemp -d /tmp/vramd-mps-pipe.XXXXXX)
LOGD=$(mktemp -d /tmp/vramd-mps-log.XXXXXX)
mps() { CUDA_MPS_PIPE_DIRECTORY=$PIPE CUDA_MPS_LOG_DIRECTORY=$LOGD "$@"; }
SERVERS=""
CONTROL=""

stop_mps() {
  [ -n "${STOPPED:-}" ] && return
  STOPPED=1
  [ -z "$CONTROL" ] && [ -f "$PIPE/nvidia-cuda-mps-control.pid" ] &&
    CONTROL=$(cat "$PIPE/nvidia-cuda-mps-control.pid" 2>/dev/null)
  SERVERS="$SERVERS $(echo get_server_list | mps timeout 5 nvidia-cuda-mps-control 2>/dev/null)"
  echo quit | mps timeout 10 nvidia-cuda-mps-control > "$OD/mps_quit.txt" 2>&1
  echo "quit rc $?" >> "$OD/mps_quit.txt"
  # The control daemon and its servers are ours (started above, found by the pid file in our
  # private pipe folder and by get_server_list): killed by pid if quit did not end them.
  for _ in $(seq 50); do
    alive=""
    for p in $CONTROL $SERVERS; do
      case $p in *[!0-9]*|"") continue ;; esac
      kill -0 "$p" 2>/dev/null && alive="$alive $p"
    done
    [ -z "$alive" ] && break
    sleep 0.1
  done
  if [ -n "${alive:-}" ]; then
    echo "still alive after quit:$alive; SIGKILL" >> "$OD/mps_quit.txt"
    for p in $alive; do kill -9 "$p" 2>/dev/null; done
  fi
  mkdir -p "$OD/mps_logs"
  for f in "$LOGD"/*; do [ -f "$f" ] && tail -c 20000 "$f" > "$OD/mps_logs/$(basename "$f")"; done
}
trap stop_mps EXIT
trap 'exit 143' INT TERM

mps timeout 15 nvidia-cuda-mps-control -d > "$OD/mps_start.txt" 2>&1
echo "start rc $?" >> "$OD/mps_start.txt"
for _ in $(seq 50); do [ -f "$PIPE/nvidia-cuda-mps-control.pid" ] && break; sleep 0.1; done
CONTROL=$(cat "$PIPE/nvidia-cuda-mps-control.pid" 2>/dev/null)
echo "control pid ${CONTROL:-none}" >> "$OD/mps_start.txt"

H=(python3 "$A/harness.py" --socket "${ACCT_SOCKET:-none}")
if [ "$PLAIN_ONLY" != 1 ]; then
  mps env CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=$CAP timeout 90 "${H[@]}" tenant --name mps-vramd \
    --limit 4GiB --out "$OD/mps_vramd.json" --ready-timeout 60 -- \
    "$DRV" --step-mib 256 --max-bytes 4GiB --wait > "$OD/mps_vramd.harness.log" 2>&1
  echo "harness rc $?" >> "$OD/mps_vramd.harness.log"
fi
S1=$(echo get_server_list | mps timeout 5 nvidia-cuda-mps-control 2>&1)
SERVERS="$SERVERS $S1"
mps env CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=$CAP timeout 60 "${H[@]}" plain --name mps-plain-drv \
  --out "$OD/mps_plain_drv.json" --timeout 50 -- "$DRV" --step-mib 256 --max-bytes 4GiB \
  > "$OD/mps_plain_drv.harness.log" 2>&1
mps env CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=$CAP timeout 90 "${H[@]}" plain --name mps-plain-cupy \
  --out "$OD/mps_plain_cupy.json" --timeout 80 -- python3 "$A/cupy_prog.py" --step-mib 256 \
  --max-bytes 4GiB > "$OD/mps_plain_cupy.harness.log" 2>&1
S2=$(echo get_server_list | mps timeout 5 nvidia-cuda-mps-control 2>&1)
SERVERS="$SERVERS $S2"
CLIENTS=""
for s in $S2; do
  case $s in *[!0-9]*|"") continue ;; esac
  CLIENTS="$CLIENTS $(echo "get_client_list $s" | mps timeout 5 nvidia-cuda-mps-control 2>&1)"
done
stop_mps

MPS_SERVERS="$S1 | $S2" MPS_CAP_TEXT=$CAP timeout 20 python3 - "$OD" <<'EOF'
import json, os, sys
od = sys.argv[1]
def load(n):
    try:
        return json.load(open(os.path.join(od, n)))
    except Exception as e:
        return {"missing_file": n, "error": repr(e)[:200]}
def cap_bytes(t):
    u = {"G": 1 << 30, "M": 1 << 20}
    return int(float(t[:-1]) * u[t[-1].upper()]) if t[-1].upper() in u else int(t)
cap = cap_bytes(os.environ["MPS_CAP_TEXT"])
step = 256 << 20
v = load("mps_vramd.json")
res = v.get("result") or {}
c = v.get("checks") or {}
got = res.get("allocated_bytes")
servers = os.environ.get("MPS_SERVERS", "").strip()
out = {"cap": cap, "mps_servers": servers,
       "mps_active": any(tok.isdigit() for tok in servers.split()),
       "vramd_tenant": {"ready": v.get("ready"), "allocated_bytes": got,
                        "refused": res.get("refused"), "error_code": res.get("error_code"),
                        "error": res.get("error"), "held": (v.get("tenant") or {}).get("held"),
                        "vramd_refusals": c.get("vramd_refusals"),
                        "nvml_process_used": (v.get("nvml") or {}).get("process_used"),
                        "mem_get_info_start": res.get("mem_get_info_start"),
                        "fatal": res.get("fatal")}}
for n, key in (("mps_plain_drv.json", "plain_cuMemAlloc"), ("mps_plain_cupy.json", "plain_cudaMalloc_cupy")):
    j = load(n)
    r = j.get("result") or {}
    a = r.get("allocated_bytes")
    out[key] = {"allocated_bytes": a, "refused": r.get("refused"),
                "error": r.get("error_type") or r.get("error"), "exit": j.get("exit_code"),
                "refused_at_cap": bool(r.get("refused") and isinstance(a, int) and a <= cap),
                "fatal": r.get("fatal")}
# What a plain client got under the same cap (its context counts against the cap too): a tenant
# that got no more than that plus one step had its imported memory counted by MPS.
plain_got = out["plain_cuMemAlloc"]["allocated_bytes"]
ref = plain_got if isinstance(plain_got, int) and plain_got > 0 else cap
out["plain_reference_bytes"] = ref
if isinstance(got, int) and got > 0:
    if got > ref + step:
        counts = False
    elif c.get("vramd_refusals"):
        counts = None  # vramd itself refused that early: not the cap's doing
    else:
        counts = True
    out["imported_memory_counts_against_mps_cap"] = counts
    out["imported_past_cap"] = got > cap
    out["vramd_tenant"]["refused_by"] = ("vramd" if c.get("vramd_refusals") else
                                         "MPS or the driver (vramd refused nothing)"
                                         if res.get("refused") else "nobody (reached --max-bytes)")
else:
    out["imported_memory_counts_against_mps_cap"] = None
    out["note"] = "the tenant got nothing through vramd under MPS (or did not run): see mps_vramd.json"
json.dump(out, open(os.path.join(od, "mps_cap.json"), "w"), indent=1)
print(json.dumps(out))
EOF
echo "clients: $CLIENTS" >> "$OD/mps_quit.txt"
