"""vramd's allocator for PyTorch.

`vramd run` installs it when the program imports torch; a program may also opt in itself:

    import vramd_torch
    vramd_torch.install(mode="pool")   # or "full"

pool: PyTorch's caching allocator stays on top and takes its segments from vramd (libvram.so,
      preloaded by `vramd run`, provides the CUDA runtime's cudaMalloc and cudaFree); every
      PyTorch feature works as without vramd, and when the daemon asks for memory back the
      process releases PyTorch's idle segments. Fragmentation is PyTorch's own.
full: vramd's allocator serves every tensor (its stitched heaps, so less fragmentation); PyTorch's
      statistics functions and `torch.cuda.memory._snapshot()` answer from vramd's books. What
      PyTorch cannot do with a pluggable allocator raises an error naming pool mode.

In both, `torch.cuda.mem_get_info()` answers with the tenant's view (total = its limit, free =
what it may still take), and an allocation vramd refuses raises torch.OutOfMemoryError naming the
tenant, its limit and what it holds.
"""

import os
import threading

from . import _lib

MODES = ("pool", "full")

_lock = threading.Lock()
_installed = None


def installed():
    """The mode installed in this process, or None."""
    return _installed


def install(mode=None):
    """Makes vramd PyTorch's CUDA allocator in this process. Call before the first CUDA
    allocation (in full mode, before CUDA is initialised)."""
    global _installed
    mode = mode or os.environ.get("VRAMD_TORCH_MODE") or "full"
    if mode not in MODES:
        raise ValueError(f"vramd: unknown torch mode `{mode}` (pool or full)")
    with _lock:
        if _installed is not None:
            if _installed != mode:
                raise RuntimeError(
                    f"vramd: {_installed} mode is already installed; a process takes one mode"
                )
            return
        _lib.lib()
        if mode == "full":
            from . import _full

            try:
                _full.install()
            except _full.NoShim as e:
                raise RuntimeError(
                    f"vramd: full mode is not available ({e}; set CXX to a C++ compiler), and "
                    "PyTorch keeps its own allocator: use pool mode (`vramd run --torch-mode "
                    "pool`) to have its memory from vramd without a compiler"
                ) from None
        else:
            from . import _pool

            _pool.install()
        _patch_mem_get_info()
        _installed = mode


def _patch_mem_get_info():
    import ctypes

    import torch

    def mem_get_info(device=None):
        """(free, total) as this tenant sees it: total is its limit, free what it may still take
        (the same figures libvram.so's cuMemGetInfo_v2 and NVML hooks answer)."""
        free, total = ctypes.c_uint64(), ctypes.c_uint64()
        if _lib.lib().vram_mem_get_info(ctypes.byref(free), ctypes.byref(total)) != 0:
            raise RuntimeError(_lib.last_error() or "vramd: vram_mem_get_info failed")
        return (free.value, total.value)

    torch.cuda.mem_get_info = mem_get_info
    torch.cuda.memory.mem_get_info = mem_get_info


def stats():
    """vramd's statistics of this process (the JSON of `vram_stats_json`)."""
    return _lib.stats()


def trim():
    """Gives every idle byte back to the daemon now; returns the bytes. Memory freed on a
    stream whose queued work the GPU has not finished goes back once it is done: the call waits
    for that work, at most 500 ms a stream."""
    return _lib.trim()
