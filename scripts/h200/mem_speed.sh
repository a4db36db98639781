#!/usr/bin/env bash
# One device call: does memory from vramd run kernels as fast as PyTorch's own? Copy bandwidth of
# 256 MiB tensors, a launch-bound loop without and with allocations, and GPT-2-sized matmuls, under
# plain PyTorch, expandable segments and vramd's full mode (two rounds each, interleaved).
set -u
. "$(dirname "$0")/lib.sh"
W=$R/mem_speed
mkdir -p "$W"
daemon_up "$W"
BENCH='
import time, torch, json
dev = "cuda"
def timed(f, n):
    f(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter(); s.record()
    for _ in range(n): f()
    e.record(); torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6, s.elapsed_time(e) / n * 1e3
out = {}
x = torch.randn(64 << 20, device=dev); y = torch.empty_like(x)
wall, gpu = timed(lambda: y.copy_(x), 50)
out["copy_256MiB_GBps"] = round(2 * x.numel() * 4 / (gpu * 1e-6) / 1e9, 1)
a = torch.randn(16, 1024, device=dev); b = torch.empty_like(a)
out["add_out_us"] = [round(v, 2) for v in timed(lambda: torch.add(a, a, out=b), 20000)]
out["add_alloc_us"] = [round(v, 2) for v in timed(lambda: a + a, 20000)]
h = torch.randn(16, 1, 1024, device=dev); w = torch.randn(1024, 4096, device=dev)
out["matmul_16x1024x4096_us"] = [round(v, 2) for v in timed(lambda: h @ w, 5000)]
k = torch.randn(16, 16, 400, 64, device=dev)
def cat():
    global k
    k = torch.cat([k[:, :, :400], torch.randn(16, 16, 1, 64, device=dev)], dim=2)
out["kv_cat_us"] = [round(v, 2) for v in timed(cat, 2000)]
print(json.dumps(out))
'
for i in 1 2; do
  echo "plain      $(python3 -c "$BENCH")" >> "$W/speed.txt"
  echo "expandable $(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 -c "$BENCH")" >> "$W/speed.txt"
  echo "full       $(.gpu/bin/vramd run --socket "$S" --torch-mode full --limit 16GiB -- python3 -c "$BENCH")" >> "$W/speed.txt"
done
cat "$W/speed.txt"
daemon_down
