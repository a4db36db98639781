#!/usr/bin/env bash
# One device call: where full mode's time goes on the generation workload. A daemon on a private
# socket; torch.empty + del pairs of the sizes a GPT-2 decode step allocates, plain and full; then
# (if perf is installed) a profile of six generation requests in full mode, by shared object.
set -u
. "$(dirname "$0")/lib.sh"
W=$R/gen_profile
mkdir -p "$W"
daemon_up "$W"
PAIRS='
import time, torch, json
x = torch.empty(1, device="cuda"); del x
out = {}
for kib in (4, 32, 128, 256, 512, 1024, 4096):
    for _ in range(2000):
        x = torch.empty(kib << 10, dtype=torch.uint8, device="cuda"); del x
    n = 20000
    t = time.perf_counter()
    for _ in range(n):
        x = torch.empty(kib << 10, dtype=torch.uint8, device="cuda"); del x
    out[f"{kib}KiB"] = round((time.perf_counter() - t) / n * 1e9)
print(json.dumps(out))
'
for i in 1 2; do
  echo "plain $(python3 -c "$PAIRS")" >> "$W/pairs.txt"
  echo "full  $(.gpu/bin/vramd run --socket "$S" --torch-mode full --limit 16GiB -- python3 -c "$PAIRS")" >> "$W/pairs.txt"
done
cat "$W/pairs.txt"
GEN=(python3 scripts/torch_on_vramd.py --worker train --model gpt2gen --steps 6 --seed 1234 --warmup 1)
if command -v perf > /dev/null; then
  .gpu/bin/vramd run --socket "$S" --torch-mode full --limit 64GiB -- \
    perf record -F 499 -o "$W/perf.data" -- "${GEN[@]}" > "$W/gen_full.txt" 2>&1
  perf report -i "$W/perf.data" --stdio --sort dso 2>/dev/null | head -40 > "$W/perf_dso.txt"
  perf report -i "$W/perf.data" --stdio --sort dso,sym 2>/dev/null | head -80 > "$W/perf_sym.txt"
  rm -f "$W/perf.data"
  cat "$W/perf_dso.txt"
else
  echo "perf is not installed" | tee "$W/perf_dso.txt"
fi
daemon_down
