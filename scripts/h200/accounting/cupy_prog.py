"""CuPy as a tenant: 256 MiB arrays from CuPy's default memory pool until
cupy.cuda.memory.OutOfMemoryError, then free_all_blocks() and proof that the process still
computes.

python3 cupy_prog.py [--step-mib 256] [--max-bytes 4GiB] [--wait]
"""

import argparse
import os
import time

import _common as C


def main():
    p = C.add_alloc_args(argparse.ArgumentParser())
    p.add_argument("--pool-limit", type=C.size, default=None,
                   help="CuPy's own pool limit (selftest.sh: an OOM without vramd)")
    args = p.parse_args()
    res = {"prog": "cupy", "pid": os.getpid(), "step": args.step_mib * C.MiB,
           "max_bytes": args.max_bytes}
    t0 = time.perf_counter()
    import cupy as cp
    res["cupy"] = cp.__version__
    pool = cp.get_default_memory_pool()
    if args.pool_limit:
        pool.set_limit(size=args.pool_limit)

    def pstats():
        return {"used_bytes": int(pool.used_bytes()), "total_bytes": int(pool.total_bytes())}

    def mem_info():
        try:
            f, t = cp.cuda.runtime.memGetInfo()
            return {"free": int(f), "total": int(t)}
        except Exception as e:
            return C.error_info(e)

    res["memGetInfo_start"] = mem_info()
    n = args.step_mib * C.MiB // 4
    arrs = []
    res["refused"] = False
    while (len(arrs) + 1) * args.step_mib * C.MiB <= args.max_bytes:
        try:
            arrs.append(cp.full((n,), len(arrs) + 1, dtype=cp.float32))  # no other reference
            cp.cuda.Device().synchronize()
        except Exception as e:  # cupy.cuda.memory.OutOfMemoryError expected
            res["refused"] = True
            res.update(C.error_info(e))
            break
    res["arrays"] = len(arrs)
    res["allocated_bytes"] = len(arrs) * args.step_mib * C.MiB
    res["alloc_seconds"] = round(time.perf_counter() - t0, 3)
    res["framework_oom"] = res["refused"] and res.get("error_type", "").endswith("OutOfMemoryError")
    res["pool_at_refusal"] = pstats()
    pool.free_all_blocks()
    res["pool_after_free_all"] = pstats()
    res["memGetInfo_after"] = mem_info()

    def check():
        if not arrs:
            v = float(cp.ones(1024, cp.float32).sum())
            return v == 1024.0, {"fresh_sum": v}
        first = float(arrs[0][:1024].sum())
        last = float(arrs[-1][:1024].sum())
        return (first == 1024.0 and last == 1024.0 * len(arrs),
                {"first": first, "last": last})

    try:
        ok, res["survival"] = check()
        res["survived"] = ok
    except Exception as e:
        res["survived"] = False
        res["survival_error"] = C.error_info(e)
        try:
            arrs.pop()
            pool.free_all_blocks()
            ok, res["survival_after_free"] = check()
            res["survived_after_free"] = ok
        except Exception as e2:
            res["survived_after_free"] = False
            res["survival_after_free_error"] = C.error_info(e2)
    try:  # a small matmul too (needs the BLAS library's workspace)
        res["matmul_ok"] = float((cp.ones((64, 64), cp.float32) @ cp.ones((64, 64), cp.float32))[0, 0]) == 64.0
    except Exception as e:
        res["matmul_ok"] = False
        res["matmul_error"] = C.error_info(e)
    res["pool_end"] = pstats()
    res["inside_view"] = C.inside_view()
    C.emit(res)
    C.ready_and_wait(args.wait)


if __name__ == "__main__":
    main()
