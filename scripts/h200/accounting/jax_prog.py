"""JAX as a tenant: 256 MiB arrays until refused, then proof that the process still computes.

python3 jax_prog.py [--step-mib 256] [--max-bytes 4GiB] [--wait]

Prints one JSON line (bytes held at the refusal, the exception's type and message, JAX's own
memory_stats, the process's view through cuMemGetInfo/NVML), then READY <pid>; with --wait it sleeps
until killed. XLA_PYTHON_CLIENT_PREALLOCATE / _MEM_FRACTION are read by JAX from the environment.
"""

import argparse
import gc
import os
import time

import _common as C


def main():
    args = C.add_alloc_args(argparse.ArgumentParser()).parse_args()
    res = {"prog": "jax", "pid": os.getpid(),
           "preallocate": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "default(true)"),
           "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "default"),
           "step": args.step_mib * C.MiB, "max_bytes": args.max_bytes}
    t0 = time.perf_counter()
    import jax
    import jax.numpy as jnp
    res["jax"] = jax.__version__
    dev = jax.devices()[0]
    res["device"] = str(dev)
    res["platform"] = dev.platform

    def stats():
        try:
            s = dev.memory_stats() or {}
            return {k: s.get(k) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit",
                                          "bytes_reserved", "pool_bytes", "largest_alloc_size")}
        except Exception as e:
            return C.error_info(e)

    res["stats_start"] = stats()
    n = args.step_mib * C.MiB // 4
    fill = jax.jit(lambda v: jnp.full((n,), v, jnp.float32))
    arrs = []
    res["refused"] = False
    while (len(arrs) + 1) * args.step_mib * C.MiB <= args.max_bytes:
        try:
            arrs.append(fill(float(len(arrs) + 1)).block_until_ready())  # no other reference
        except Exception as e:  # XlaRuntimeError / JaxRuntimeError: RESOURCE_EXHAUSTED
            res["refused"] = True
            res.update(C.error_info(e))
            break
    res["arrays"] = len(arrs)
    res["allocated_bytes"] = len(arrs) * args.step_mib * C.MiB
    res["alloc_seconds"] = round(time.perf_counter() - t0, 3)
    msg = (res.get("error", "") + res.get("error_type", "")).lower()
    res["framework_oom"] = res["refused"] and ("resource_exhausted" in msg or "out of memory" in msg)
    res["stats_at_refusal"] = stats()

    def check():
        if not arrs:
            v = float(jnp.sum(jnp.ones(1024)))
            return v == 1024.0, {"fresh_sum": v}
        first = float(jnp.sum(arrs[0][:1024]))
        last = float(jnp.sum(arrs[-1][:1024]))
        return (first == 1024.0 and last == 1024.0 * len(arrs),
                {"first": first, "last": last})

    try:
        ok, res["survival"] = check()
        res["survived"] = ok
    except Exception as e:
        res["survived"] = False
        res["survival_error"] = C.error_info(e)
        try:  # with one array freed
            arrs.pop()
            gc.collect()
            ok, res["survival_after_free"] = check()
            res["survived_after_free"] = ok
        except Exception as e2:
            res["survived_after_free"] = False
            res["survival_after_free_error"] = C.error_info(e2)
    try:  # a small matmul too (needs the BLAS library's workspace)
        res["matmul_ok"] = float(jnp.dot(jnp.ones((64, 64)), jnp.ones((64, 64)))[0, 0]) == 64.0
    except Exception as e:
        res["matmul_ok"] = False
        res["matmul_error"] = C.error_info(e)
    res["stats_end"] = stats()
    res["inside_view"] = C.inside_view()
    C.emit(res)
    C.ready_and_wait(args.wait)


if __name__ == "__main__":
    main()
