#!/usr/bin/env bash
# selftest.sh: the accounting programs run plainly, without vramd or a daemon (no .gpu needed), to
# check them on the GPU machine before a build is there: each framework's own OOM (JAX's
# MEM_FRACTION, CuPy's pool limit, PyTorch's memory fraction) caught and survived, drv_alloc compiled
# and run, NVML's per-process figure for a plain process found by its pid, the speed loops, and the
# MPS part's plain clients. One device call, from the repository root: about 2 minutes.
#   bash scripts/h200/accounting/selftest.sh
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
R=${OUT:?run on the device machine, where OUT is set}/r
mkdir -p "$R"
A=scripts/h200/accounting
W=$(mktemp -d /tmp/vramd-selftest.XXXXXX)
H=(python3 "$A/harness.py" --socket none)
t() { # t NAME LIMIT COMMAND...
  local name=$1 limit=$2
  shift 2
  timeout -k 5 "$limit" "$@" > "$R/$name.log" 2>&1
  echo "$name exit $?"
}
plain() { # plain NAME LIMIT COMMAND...: through the harness, its JSON in $R/NAME.json
  local name=$1 limit=$2
  shift 2
  t "$name" "$limit" "${H[@]}" plain --name "$name" --out "$R/$name.json" --timeout "$((limit - 5))" -- "$@"
}
{ nvidia-smi; python3 -c "import torch, jax, cupy, pynvml; print(torch.__version__, jax.__version__, cupy.__version__)"; } > "$R/env.txt" 2>&1

t compile 60 gcc -O1 -Wall -o "$W/drv_alloc" "$A/drv_alloc.c" -ldl
plain jax_oom 90 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.02 python3 "$A/jax_prog.py" --max-bytes 8GiB
plain jax_nopre 90 env XLA_PYTHON_CLIENT_PREALLOCATE=false python3 "$A/jax_prog.py" --max-bytes 1GiB
plain cupy_oom 60 python3 "$A/cupy_prog.py" --pool-limit 2GiB --max-bytes 4GiB
plain drv 30 "$W/drv_alloc" --max-bytes 1GiB
plain ctypes 30 python3 "$A/ctypes_alloc.py" --max-bytes 1GiB
plain nccl_oom 90 python3 "$A/nccl_prog.py" --torch-fraction 0.02 --max-bytes 8GiB
plain ten_worker 60 python3 "$A/ten_tenants.py" worker --bytes 1GiB
plain speed_jax 60 python3 "$A/speed_jax.py" --seconds 3
plain speed_cupy 60 python3 "$A/speed_cupy.py" --seconds 3
# A plain process holding 2 GiB: NVML's per-process figure for its pid, nvidia-smi's, and the
# time from SIGKILL until NVML no longer lists it.
t nvml_proc 60 python3 - "$A" "$R/nvml_proc.json" <<'EOF'
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
import harness as H
base = H.nvml()
p = H.Prog(["python3", os.path.join(sys.argv[1], "outside_hog.py"), "--gib", "2"],
           sys.argv[2][:-5] + "_hog.log", env=H.plain_env())
rec = {"ready": p.wait_ready(50), "base_used": base.get("used")}
time.sleep(0.2)
nv = H.nvml()
rec.update(pid=p.pid, nvml=nv, smi=H.smi(), process_used=nv["procs"].get(p.pid))
t0 = time.monotonic()
p.kill_program()
gone = None
while time.monotonic() - t0 < 3:
    nv = H.nvml()
    if p.pid not in nv["procs"] and nv.get("used", 1 << 62) <= base.get("used", 0) + (128 << 20):
        gone = round((time.monotonic() - t0) * 1000, 1)
        break
    time.sleep(0.02)
rec["nvml_back_ms"] = gone
p.finish()
H.write(sys.argv[2], rec)
print(json.dumps({k: rec[k] for k in ("ready", "pid", "process_used", "nvml_back_ms")}))
EOF
t mps 100 env MPS_PLAIN_ONLY=1 DRV="$W/drv_alloc" bash "$A/mps_cap.sh" "$R/mps"

timeout 30 python3 - "$R" > "$OUT/summary.json" 2> "$R/summary.err" <<'EOF'
import json, glob, os, sys
R = sys.argv[1]
out = {}
for f in sorted(glob.glob(os.path.join(R, "*.json"))):
    j = json.load(open(f))
    r = j.get("result") if isinstance(j.get("result"), dict) else j
    out[os.path.basename(f)[:-5]] = {k: r.get(k) for k in (
        "refused", "framework_oom", "error_type", "error", "error_code", "allocated_bytes",
        "survived", "survived_after_free", "matmul_ok", "all_reduce_ok", "verified",
        "steps_per_s", "mem_get_info_start", "memGetInfo_start", "fatal", "oom", "ready", "pid",
        "process_used", "nvml_back_ms") if r.get(k) is not None}
    if j.get("exit_code") not in (None, 0):
        out[os.path.basename(f)[:-5]]["exit_code"] = j.get("exit_code")
try:
    out["mps"] = json.load(open(os.path.join(R, "mps", "mps_cap.json")))
except Exception as e:
    out["mps"] = repr(e)
print(json.dumps(out, indent=1))
EOF
cat "$OUT/summary.json"
tar czf "$OUT/r.tgz" -C "$OUT" r && mv "$OUT/r" "$W/r"
