"""Finds and loads libvram.so (ctypes), once per process: the same library, and so the same
tenant, that PyTorch's allocator and everything else in the process use.

Where it is looked for, first found wins:
  1. the path given to `vramd.load(path)` (or `lib=` of `vramd.connect`);
  2. `VRAMD_LIB` (what `vramd run` sets);
  3. `libvram.so` next to the `vramd` executable found on PATH (where `cargo build --release`
     puts both; a symbolic link to `vramd` is followed).
"""

import ctypes
import os
import shutil
import threading

_lock = threading.Lock()
_lib = None
_path = None

c_char_p, c_int, c_uint64, c_void_p = ctypes.c_char_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p
_u64p = ctypes.POINTER(ctypes.c_uint64)

# The C ABI this package calls (`vram_abi_version` in include/vram.h): a libvram.so of another
# is refused when loaded, before any call of it.
ABI_VERSION = 2

# Return and argument types of the calls used from Python (include/vram.h).
_SIGNATURES = {
    "vram_alloc": (c_void_p, [ctypes.c_ssize_t, c_int, c_void_p]),
    "vram_free": (None, [c_void_p, ctypes.c_ssize_t, c_int, c_void_p]),
    "vram_last_error": (c_char_p, []),
    "vram_stats_json": (c_void_p, []),
    "vram_snapshot_json": (c_void_p, []),
    "vram_interposer_stats_json": (c_void_p, []),
    "vram_status_json": (c_void_p, [c_char_p]),
    "vram_string_free": (None, [c_void_p]),
    "vram_trim": (ctypes.c_longlong, []),
    "vram_reclaim_requests": (ctypes.c_ulonglong, []),
    "vram_wait_reclaim": (ctypes.c_ulonglong, [ctypes.c_ulonglong, ctypes.c_uint]),
    "vram_reset_peak": (c_int, []),
    "vram_report_in_use": (None, [ctypes.c_ulonglong]),
    "vram_mem_get_info": (c_int, [_u64p, _u64p]),
    "vram_connect": (c_int, [c_char_p, c_char_p, c_char_p, c_char_p, c_char_p, c_int]),
    "vram_disconnect": (c_int, []),
    "vram_shared_create": (c_void_p, [c_char_p, c_uint64, c_char_p, c_char_p]),
    "vram_shared_open": (c_void_p, [c_char_p]),
    "vram_shared_close": (None, [c_void_p]),
    "vram_shared_lease": (c_int, [c_void_p, ctypes.c_uint32]),
    "vram_shared_release_lease": (c_int, [c_void_p]),
    "vram_shared_begin_write": (c_void_p, [c_void_p, c_uint64, _u64p]),
    "vram_shared_publish": (c_int, [c_void_p, _u64p]),
    "vram_shared_pin": (c_void_p, [c_void_p, _u64p, _u64p, _u64p]),
    "vram_shared_release": (c_int, [c_void_p, c_void_p]),
    "vram_shared_verify": (c_int, [c_void_p, c_uint64]),
    "vram_shared_wait": (c_int, [c_void_p, c_uint64, ctypes.c_uint32, _u64p]),
}


def candidates():
    """(where, path) in the order they are tried (see the module docs)."""
    out = []
    env = os.environ.get("VRAMD_LIB")
    if env:
        out.append(("VRAMD_LIB", env))
    exe = shutil.which("vramd")
    if exe:
        out.append(("next to vramd on PATH", os.path.join(os.path.dirname(os.path.realpath(exe)), "libvram.so")))
    return out


def find():
    """The path of libvram.so that `lib()` loads, or an error naming every place tried."""
    if _path is not None:
        return _path
    tried = []
    for where, p in candidates():
        if os.path.isfile(p):
            return p
        tried.append(f"{p} ({where})")
    if not shutil.which("vramd"):
        tried.append("no `vramd` on PATH")
    raise RuntimeError(
        "vramd: libvram.so not found; tried " + ", ".join(tried) + ". Build it with "
        "`cargo build --release -p vram-ffi` and put target/release on PATH, set VRAMD_LIB, or "
        "call vramd.load(PATH)"
    )


def load(path=None):
    """Loads libvram.so (from `path`, else as `find` says); a process loads one."""
    global _lib, _path
    with _lock:
        if _lib is not None:
            if path and os.path.realpath(path) != os.path.realpath(_path):
                raise RuntimeError(f"vramd: {_path} is loaded already; a process uses one libvram.so")
            return _lib
        # Absolute: the path goes to Ray's workers (LD_PRELOAD, VRAMD_LIB), which run elsewhere.
        p = os.path.abspath(path or find())
        if not os.path.isfile(p):
            raise RuntimeError(f"vramd: {p} is not a file")
        # Checked before its symbols are global: a library refused here interposes nothing.
        _check_abi(ctypes.CDLL(p, mode=ctypes.RTLD_LOCAL), p)
        l = ctypes.CDLL(p, mode=ctypes.RTLD_GLOBAL)
        for name, (res, args) in _SIGNATURES.items():
            f = getattr(l, name)
            f.restype = res
            f.argtypes = args
        _lib, _path = l, p
        return l


def _check_abi(l, p):
    """Refuses a libvram.so of another C ABI than this package's, with both versions."""
    advice = "use the libvram.so built with this package (the same vramd release)"
    try:
        abi = l.vram_abi_version
    except AttributeError:
        raise RuntimeError(
            f"vramd: {p} has no vram_abi_version: it is not a libvram.so this package can use "
            f"(it needs C ABI {ABI_VERSION}); {advice}"
        ) from None
    abi.restype, abi.argtypes = ctypes.c_uint32, []
    theirs = abi()
    if theirs != ABI_VERSION:
        raise RuntimeError(
            f"vramd: {p} speaks C ABI {theirs}; this package speaks {ABI_VERSION}; {advice}"
        )


def lib():
    return _lib if _lib is not None else load()


def path():
    """The path of the library this process loads (or has loaded)."""
    return _path if _path is not None else os.path.abspath(find())


def last_error():
    e = lib().vram_last_error()
    return e.decode(errors="replace") if e else None


def check(ok, what):
    """Raises VramdError with libvram's reason where a call failed."""
    if not ok:
        from . import VramdError

        raise VramdError(last_error() or f"vramd: {what} failed")


def take_json(p, what):
    """Reads and frees a JSON string libvram returned."""
    import json

    check(p, what)
    try:
        return json.loads(ctypes.string_at(p).decode())
    finally:
        lib().vram_string_free(p)


def text(s):
    return None if s is None else str(s).encode()
