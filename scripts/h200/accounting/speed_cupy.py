"""A short CuPy loop with allocations every step (a fresh random batch, intermediates, and a
scratch buffer whose size cycles), elementwise work and two matmuls; synchronised every step.
Prints one JSON line with steps/s over --seconds after --warmup steps.

python3 speed_cupy.py [--seconds 5] [--warmup 20] [--batch 2048] [--width 4096]
"""

import argparse
import os
import time

import _common as C


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--width", type=int, default=4096)
    a = p.parse_args()
    t0 = time.perf_counter()
    import cupy as cp

    rng = cp.random.default_rng(0)
    w = rng.standard_normal((a.width, a.width), dtype=cp.float32) / a.width ** 0.5
    dev = cp.cuda.Device()

    def step(i):
        nonlocal w
        x = rng.standard_normal((a.batch, a.width), dtype=cp.float32)
        h = cp.tanh(x @ w)
        g = x.T @ (h * (1 - h * h)) / a.batch
        w = w - 1e-3 * g
        scratch = cp.empty(((i % 7) + 1) * 4 * C.MiB, dtype=cp.uint8)
        scratch.fill(i & 0xFF)
        dev.synchronize()
        return h

    i = 0
    tc = time.perf_counter()
    for _ in range(a.warmup):
        step(i)
        i += 1
    warm_s = time.perf_counter() - tc
    n, ts = 0, time.perf_counter()
    while time.perf_counter() - ts < a.seconds:
        h = step(i)
        i += 1
        n += 1
    el = time.perf_counter() - ts
    pool = cp.get_default_memory_pool()
    C.emit({"prog": "speed_cupy", "pid": os.getpid(), "steps": n, "seconds": round(el, 3),
            "steps_per_s": n / el, "warmup_s": round(warm_s, 3), "check": float(h[0, 0]),
            "start_to_end_s": round(time.perf_counter() - t0, 2),
            "pool_total_bytes": int(pool.total_bytes()),
            "under_vramd": bool(os.environ.get("VRAMD_SOCKET"))})


if __name__ == "__main__":
    main()
