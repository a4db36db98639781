"""The CUDA driver API through Python ctypes as a tenant: libcuda.so.1, cuInit, device 0's
primary context retained and made current, cuMemGetInfo_v2, then cuMemAlloc_v2 in steps until
refused (CUDA_ERROR_OUT_OF_MEMORY = 2 expected) or --max-bytes; each block written with
cuMemsetD8_v2 and 1 MiB read back at its start and end with cuMemcpyDtoH_v2; after the refusal
one block is written and read again and a 2 MiB block allocated in place of a freed one.

python3 ctypes_alloc.py [--step-mib 256] [--max-bytes 4GiB] [--wait]
"""

import argparse
import ctypes
import os
import time

import _common as C

SAMPLE = C.MiB


def main():
    args = C.add_alloc_args(argparse.ArgumentParser()).parse_args()
    step = args.step_mib * C.MiB
    res = {"prog": "ctypes_alloc", "pid": os.getpid(), "step": step, "max_bytes": args.max_bytes}
    t0 = time.perf_counter()
    cu = ctypes.CDLL("libcuda.so.1")
    ptr = ctypes.c_ulonglong
    cu.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ptr), ctypes.c_size_t]
    cu.cuMemFree_v2.argtypes = [ptr]
    cu.cuMemsetD8_v2.argtypes = [ptr, ctypes.c_ubyte, ctypes.c_size_t]
    cu.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ptr, ctypes.c_size_t]
    cu.cuMemGetInfo_v2.argtypes = [ctypes.POINTER(ctypes.c_size_t)] * 2

    def name(r):
        s = ctypes.c_char_p()
        cu.cuGetErrorName(r, ctypes.byref(s))
        return (s.value or b"?").decode()

    def check(what, r):
        if r:
            raise RuntimeError(f"{what}: {r} {name(r)}")

    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    check("cuInit", cu.cuInit(0))
    check("cuDeviceGet", cu.cuDeviceGet(ctypes.byref(dev), 0))
    check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
    check("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx))

    def mem_info():
        f, t = ctypes.c_size_t(), ctypes.c_size_t()
        r = cu.cuMemGetInfo_v2(ctypes.byref(f), ctypes.byref(t))
        return {"rc": r, "free": f.value, "total": t.value}

    host = (ctypes.c_ubyte * SAMPLE)()

    def write_verify(p, nbytes, pat):
        if cu.cuMemsetD8_v2(p, pat, nbytes) or cu.cuCtxSynchronize():
            return False
        n = min(nbytes, SAMPLE)
        for off in (0, nbytes - n):
            ctypes.memset(host, pat ^ 0xFF, n)
            if cu.cuMemcpyDtoH_v2(host, ptr(p.value + off), n):
                return False
            if bytes(host)[:n].count(pat) != n:
                return False
        return True

    res["mem_get_info_start"] = mem_info()
    blocks, verified, res["refused"] = [], True, False
    while (len(blocks) + 1) * step <= args.max_bytes:
        p = ptr()
        r = cu.cuMemAlloc_v2(ctypes.byref(p), step)
        if r:
            res.update(refused=True, error_code=r, error=name(r))
            break
        blocks.append(p)
        verified &= write_verify(p, step, (0x11 + len(blocks)) & 0xFF)
    res["blocks"] = len(blocks)
    res["allocated_bytes"] = len(blocks) * step
    res["verified"] = verified
    res["framework_oom"] = res["refused"] and res.get("error_code") == 2
    res["alloc_seconds"] = round(time.perf_counter() - t0, 3)
    res["mem_get_info_at_refusal"] = mem_info()
    res["survived"] = write_verify(blocks[0], step, 0xA5) if blocks else True
    if blocks and cu.cuMemFree_v2(blocks.pop()) == 0:
        p = ptr()
        res["realloc_after_free_ok"] = (cu.cuMemAlloc_v2(ctypes.byref(p), 2 * C.MiB) == 0
                                        and write_verify(p, 2 * C.MiB, 0x3C))
    res["mem_get_info_end"] = mem_info()
    res["nvml_view"] = C.nvml_view()
    C.emit(res)
    C.ready_and_wait(args.wait)


if __name__ == "__main__":
    main()
