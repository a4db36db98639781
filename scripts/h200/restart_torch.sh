#!/usr/bin/env bash
# A daemon restart under a real PyTorch tenant (full mode): the tenant allocates, writes and checks
# tensors throughout while the daemon is SIGKILLed, started again, stopped with SIGTERM and started
# again. Results in $OUT/r/restart_torch.{log,json}. Run from the repository root with .gpu carried.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
R=${OUT:?run on the device machine}/r
mkdir -p "$R"
W=$(mktemp -d /tmp/vramd-restart.XXXXXX)
S=$W/vramd.sock
V=.gpu/bin/vramd
up() { "$V" serve --backend cuda --socket "$S" --metrics off >> "$R/restart_torch_daemon.log" 2>&1 & D=$!
  for _ in $(seq 200); do [ -S "$S" ] && break; sleep 0.05; done; }
up
cat > "$W/tenant.py" <<'PY'
import json, sys, time
import torch
t0 = time.time(); kept = []; n = 0; bad = 0; errors = []
while time.time() - t0 < 25:
    try:
        x = torch.full((16 << 20,), float(n % 1000), device="cuda")  # 64 MiB
        kept.append((n % 1000, x)); n += 1
        if len(kept) > 24:
            kept.pop(0)
        for v, t in kept[::6]:
            if not bool((t == v).all()):
                bad += 1
    except Exception as e:  # an allocation refused or failed: the test's failure
        errors.append(repr(e)[:300])
        time.sleep(0.05)
    time.sleep(0.01)
torch.cuda.synchronize()
print(json.dumps({"allocations": n, "bad_patterns": bad, "errors": len(errors),
                  "first_error": errors[0] if errors else None}))
PY
"$V" run --socket "$S" --tenant rt --limit 8GiB -- python3 "$W/tenant.py" > "$R/restart_torch.json" 2> "$R/restart_torch.log" &
T=$!
# `vramd run` registers the tenant at once; the program joins it at its first allocation, after
# torch's import: restart only once it holds memory.
for _ in $(seq 300); do
  "$V" status --socket "$S" --json 2>/dev/null | python3 -c 'import json, sys
s = json.load(sys.stdin)
sys.exit(0 if any(t["name"] == "rt" and t["held"] > 0 for t in s["tenants"]) else 1)' && break
  sleep 0.1
done
sleep 2; kill -9 "$D"; wait "$D" 2>/dev/null; echo "SIGKILL at $(date +%T.%N)" >> "$R/restart_torch.log"; up
sleep 2; timeout 5 "$V" status --socket "$S" --json > "$R/restart_torch_status_after_kill.json" 2>&1
sleep 3; kill -TERM "$D"; wait "$D" 2>/dev/null; echo "SIGTERM at $(date +%T.%N)" >> "$R/restart_torch.log"; up
sleep 2; timeout 5 "$V" status --socket "$S" --json > "$R/restart_torch_status_after_term.json" 2>&1
wait "$T"; echo "tenant exit $?" >> "$R/restart_torch.log"
sleep 1; timeout 5 "$V" status --socket "$S" --json > "$R/restart_torch_status_end.json" 2>&1
kill -TERM "$D"; wait "$D" 2>/dev/null
