#!/usr/bin/env bash
# A stopped PyTorch tenant holding idle memory while eight others need it (the daemon must ask it
# for memory back and cannot be answered): every other tenant's allocation is answered, granted
# or refused, without hanging. Results in $OUT/r/stalled_torch.{log,json}. Run from the
# repository root with .gpu carried.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
R=${OUT:?run on the device machine}/r
mkdir -p "$R"
W=$(mktemp -d /tmp/vramd-stalled.XXXXXX)
S=$W/vramd.sock
V=.gpu/bin/vramd
printf 'capacity = "24 GiB"\n' > "$W/vramd.toml"
"$V" serve --backend cuda --socket "$S" --config "$W/vramd.toml" --metrics off > "$R/stalled_torch_daemon.log" 2>&1 &
D=$!
for _ in $(seq 200); do [ -S "$S" ] && break; sleep 0.05; done
cat > "$W/holder.py" <<'PY'
import time, torch
xs = [torch.empty(1 << 30, dtype=torch.uint8, device="cuda") for _ in range(16)]
del xs  # 16 GiB idle in PyTorch's cache, reported as cached to vramd
torch.cuda.synchronize()
print("ready", flush=True)
time.sleep(120)
PY
cat > "$W/needer.py" <<'PY'
import json, sys, time, torch
torch.zeros(1, device="cuda")  # context first, so that only the allocation is timed
t0 = time.time()
try:
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    out = "granted"
except torch.OutOfMemoryError as e:
    out = "refused: " + str(e).splitlines()[0][:200]
print(json.dumps({"name": sys.argv[1], "seconds": round(time.time() - t0, 3), "outcome": out}), flush=True)
PY
"$V" run --socket "$S" --tenant holder --limit 20GiB --torch-mode pool -- python3 "$W/holder.py" > "$W/holder.out" 2>> "$R/stalled_torch.log" &
H=$!
for _ in $(seq 600); do grep -q ready "$W/holder.out" 2>/dev/null && break; sleep 0.1; done
sleep 1
HP=$(pgrep -P "$H" | head -1) # the program, the child of `vramd run`
kill -STOP "$HP"; echo "holder pid $HP stopped" >> "$R/stalled_torch.log"
timeout 5 "$V" status --socket "$S" --json > "$R/stalled_torch_status_before.json" 2>&1
pids=()
for i in $(seq 8); do
  timeout 60 "$V" run --socket "$S" --tenant "n$i" --limit 4GiB -- python3 "$W/needer.py" "n$i" > "$W/n$i.out" 2>> "$R/stalled_torch.log" &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; echo "needer exit $?" >> "$R/stalled_torch.log"; done
cat "$W"/n*.out > "$R/stalled_torch.json"
timeout 5 "$V" status --socket "$S" --json > "$R/stalled_torch_status_after.json" 2>&1
kill -CONT "$HP"; kill "$H" 2>/dev/null; kill -9 "$HP" 2>/dev/null; wait "$H" 2>/dev/null
kill -TERM "$D"; wait "$D" 2>/dev/null
