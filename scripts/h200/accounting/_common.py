"""Shared by the accounting programs: the machine's NCCL/NVSHMEM rules, sizes from argv, the one
JSON result line, the "READY <pid>" line and the wait that follows it, and the process's own view
of memory through the CUDA driver (cuMemGetInfo_v2) and NVML -- both of which libvram.so answers
for a tenant, so inside `vramd run` they show the tenant's view, outside it the device's."""

import ctypes
import json
import os
import re
import signal
import sys
import time

# The machine's rules, for every program, set before any framework is imported.
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v

MiB = 1 << 20
GiB = 1 << 30
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": MiB, "mb": 10**6,
          "mib": MiB, "g": GiB, "gb": 10**9, "gib": GiB, "t": 1 << 40, "tib": 1 << 40}


def size(text):
    """'4GiB', '2G', '512 MiB', '1.5GiB' or a plain number of bytes -> int bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def emit(result):
    """The program's one JSON result line."""
    print(json.dumps(result, default=str), flush=True)


def ready_and_wait(wait):
    """Prints READY and, with wait, sleeps until killed (SIGKILL from the harness; SIGTERM ends
    it cleanly)."""
    print(f"READY {os.getpid()}", flush=True)
    if not wait:
        return
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    while True:
        time.sleep(3600)


def error_info(e):
    t = type(e)
    return {"error_type": f"{t.__module__}.{t.__qualname__}", "error": str(e)[:600]}


def add_alloc_args(p, step_mib=256):
    p.add_argument("--step-mib", type=int, default=step_mib, help="allocation size (MiB)")
    p.add_argument("--max-bytes", type=size, default=size("1TiB"),
                   help="stop allocating here even if nothing refused (e.g. 4GiB)")
    p.add_argument("--wait", action="store_true", help="after the result, print READY and sleep")
    return p


_cuda = None


def _libcuda():
    global _cuda
    if _cuda is None:
        _cuda = ctypes.CDLL("libcuda.so.1")
    return _cuda


def cu_mem_get_info():
    """(free, total) from cuMemGetInfo_v2 with the primary context of device 0 pushed (the one
    the frameworks use), or an error string."""
    try:
        cu = _libcuda()
        if cu.cuInit(0) != 0:
            return {"error": "cuInit failed"}
        dev = ctypes.c_int()
        ctx = ctypes.c_void_p()
        r = cu.cuDeviceGet(ctypes.byref(dev), 0)
        r = r or cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
        if r:
            return {"error": f"cuDevicePrimaryCtxRetain: {r}"}
        cu.cuCtxPushCurrent_v2(ctx)
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        r = cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
        cu.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        cu.cuDevicePrimaryCtxRelease_v2(dev)
        if r:
            return {"error": f"cuMemGetInfo_v2: {r}"}
        return {"free": free.value, "total": total.value}
    except Exception as e:  # the view is a bonus; never fail the program for it
        return {"error": repr(e)[:300]}


def nvml_view():
    """What NVML tells this process: nvmlDeviceGetMemoryInfo of device 0, and this process's own
    entry in the compute-process list."""
    try:
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        m = pynvml.nvmlDeviceGetMemoryInfo(h)
        out = {"total": int(m.total), "free": int(m.free), "used": int(m.used)}
        try:
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                if p.pid == os.getpid():
                    out["self_used"] = p.usedGpuMemory
        except Exception as e:
            out["procs_error"] = repr(e)[:200]
        pynvml.nvmlShutdown()
        return out
    except Exception as e:
        return {"error": repr(e)[:300]}


def inside_view():
    return {"cuMemGetInfo": cu_mem_get_info(), "nvml": nvml_view(),
            "under_vramd": bool(os.environ.get("VRAMD_SOCKET")),
            "vramd_limit": os.environ.get("VRAMD_LIMIT")}


def log(*a):
    print(*a, file=sys.stderr, flush=True)
