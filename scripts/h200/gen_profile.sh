#!/usr/bin/env bash
# One device call: what one allocation costs on the generation workload's sizes. A daemon on a
# private socket; torch.empty + del pairs of the sizes a GPT-2 decode step allocates, plain and
# full, two rounds. (The H200 machine has no perf to profile with; `VRAMD_TIME_CORE=1` times the
# allocator's slow path from inside instead.)
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
daemon_down
