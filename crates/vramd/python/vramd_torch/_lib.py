"""libvram.so through ctypes: the same library (and so the same tenant) PyTorch's
CUDAPluggableAllocator loads."""

import ctypes
import json
import os

_lib = None


def path():
    p = os.environ.get("VRAMD_LIB")
    if not p:
        raise RuntimeError(
            "vramd: VRAMD_LIB is not set; run the program under `vramd run`, or set it to the "
            "path of libvram.so"
        )
    return p


def lib():
    global _lib
    if _lib is None:
        l = ctypes.CDLL(path(), mode=ctypes.RTLD_GLOBAL)
        l.vram_stats_json.restype = ctypes.c_void_p
        l.vram_snapshot_json.restype = ctypes.c_void_p
        l.vram_string_free.argtypes = [ctypes.c_void_p]
        l.vram_last_error.restype = ctypes.c_char_p
        l.vram_trim.restype = ctypes.c_longlong
        l.vram_reclaim_requests.restype = ctypes.c_ulonglong
        l.vram_wait_reclaim.argtypes = [ctypes.c_ulonglong, ctypes.c_uint]
        l.vram_wait_reclaim.restype = ctypes.c_ulonglong
        l.vram_reset_peak.restype = ctypes.c_int
        l.vram_report_in_use.argtypes = [ctypes.c_ulonglong]
        l.vram_report_in_use.restype = None
        _lib = l
    return _lib


def last_error():
    e = lib().vram_last_error()
    return e.decode(errors="replace") if e else None


def _json(fn):
    p = fn()
    if not p:
        raise RuntimeError(last_error() or "vramd: no answer from libvram")
    try:
        return json.loads(ctypes.string_at(p).decode())
    finally:
        lib().vram_string_free(p)


def stats():
    """{"tenant", "gpu", "limit", "guarantee", "stats": {"core": {...}, "in_use", "cached", ...}}"""
    return _json(lib().vram_stats_json)


def snapshot():
    return _json(lib().vram_snapshot_json)


def trim():
    return lib().vram_trim()


def reclaim_requests():
    return lib().vram_reclaim_requests()


def wait_reclaim(seen, timeout_s):
    """The count of reclaim requests once it differs from `seen`, or after `timeout_s`. Waits in
    C, without the GIL (ctypes lets it go), so the training thread runs on meanwhile."""
    return lib().vram_wait_reclaim(seen, int(timeout_s * 1000))


def reset_peak():
    if lib().vram_reset_peak() != 0:
        raise RuntimeError(last_error() or "vramd: cannot reset peaks")


def gib(n):
    return f"{n / 2**30:.2f} GiB"


def refusal_message(asked=None):
    """What a refused allocation tells the program: the tenant, its limit and what it holds."""
    try:
        s = stats()
    except Exception as e:
        return f"vramd refused the allocation ({e})"
    core = s["stats"]["core"]
    what = f" {gib(asked)}" if asked else ""
    detail = last_error()
    msg = (
        f"vramd: tenant `{s['tenant']}` could not allocate{what}: its limit is {gib(s['limit'])} "
        f"(guarantee {gib(s['guarantee'])}) and it holds {gib(core['held'])} "
        f"({gib(s['stats']['in_use'])} in use)"
    )
    return f"{msg}. {detail}" if detail else msg
