#!/usr/bin/env bash
# A busy program's idle memory goes back (full mode, CUDA): a PyTorch program under `vramd run
# --torch-mode full` frees 2 GiB after a peak, then keeps one stream busy for 25 s with work that
# allocates and frees within what it already holds (no growth, so nothing else fences its frees).
# The timed release (memory above the recent peak plus keep_fraction, after release_delay_us,
# 10 s) must give the 2 GiB back during the loop. Prints the tenant's held bytes every 2 s and a
# JSON summary line. Results in $OUT/r/busy_release.log. Run from the repository root with .gpu
# carried.
set -u
. scripts/h200/lib.sh
W=$(mktemp -d /tmp/vramd-busy.XXXXXX)
daemon_up "$W"
cat > "$W/busy.py" <<'PY'
import json, time, torch
import vramd_torch

def held():
    return vramd_torch.stats()["stats"]["core"]["held"]

work = [torch.randn(2048, 2048, device="cuda") for _ in range(4)]
peak = [torch.empty(256 << 20, dtype=torch.uint8, device="cuda") for _ in range(8)]
torch.cuda.synchronize()
at_peak = held()
del peak
t0 = time.time()
timeline = []
next_print = 0.0
while time.time() - t0 < 25:
    for _ in range(50):
        a = work[0] @ work[1]
        b = a @ work[2]
        work[3].copy_(b)
        del a, b
    now = time.time() - t0
    if now >= next_print:
        timeline.append((round(now, 1), held()))
        print(f"t={now:5.1f}s held={timeline[-1][1] / 2**20:8.1f} MiB", flush=True)
        next_print += 2.0
torch.cuda.synchronize()
end = held()
print("RESULT " + json.dumps({"held_at_peak": at_peak, "held_after_25s": end,
                              "timeline": timeline}), flush=True)
PY
step busy_release 90 .gpu/bin/vramd run --socket "$S" --tenant busy --torch-mode full -- python3 "$W/busy.py"
grep -a -E "held=|RESULT" "$R/busy_release.log" | tail -16
cp "$W/vramd.log" "$R/busy_release_daemon.log"
daemon_down
rm -rf "$W"
