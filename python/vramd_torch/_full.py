"""Full mode: vramd's allocator serves every tensor; PyTorch's statistics answer from vramd's."""

import ctypes
import hashlib
import os
import subprocess
import tempfile

from . import _lib

_allocator = None

# PyTorch does not check what a pluggable allocator returns: a NULL would become a tensor at
# address 0. This shim turns vramd's refusal into c10::OutOfMemoryError, which reaches Python as
# torch.OutOfMemoryError with vramd's message (tenant, limit, what it holds).
_SHIM = r"""
#include <atomic>
#include <functional>
#include <mutex>
#include <utility>
#include <vector>
#include <sys/types.h>
#include <c10/util/Exception.h>
struct CUstream_st;
extern "C" void *vram_alloc(ssize_t size, int device, void *stream);
extern "C" void vram_free(void *ptr, ssize_t size, int device, void *stream);
extern "C" const char *vram_last_error(void);
extern "C" void vram_capture_begin(int device);
extern "C" void vram_capture_end(int device);
extern "C" int vram_pool_begin(int device, unsigned long long a, unsigned long long b);
extern "C" void *vram_pool_alloc(ssize_t size, int device, void *stream, unsigned long long a,
                                 unsigned long long b);
extern "C" int vram_pool_release(int device, unsigned long long a, unsigned long long b);

// PyTorch's types: MempoolId_t is a pair of unsigned long long, cudaStream_t a CUstream_st
// pointer.
using vramd_pool_id = std::pair<unsigned long long, unsigned long long>;
using vramd_filter = std::function<bool(CUstream_st *)>;

namespace {
// Whether PyTorch tells when a pool is released (set_release_pool): only then are a graph's
// allocations put in a private pool, which would otherwise never be given back.
std::atomic<bool> pools_on{false};
// The pools PyTorch allocates to now (between its begin and end hooks), each with its filter:
// which streams' allocations go to it (a capture's stream, or a thread's for a MemPool).
struct Allocating {
  int device;
  vramd_pool_id pool;
  vramd_filter filter;
};
std::mutex allocating_mu;
std::vector<Allocating> allocating;
std::atomic<int> n_allocating{0};

// The pool an allocation on `device` and `stream` goes to, if any. The filters are called
// outside the lock (they ask the driver about the stream).
bool pool_for(int device, void *stream, vramd_pool_id *out) {
  std::vector<Allocating> now;
  {
    std::lock_guard<std::mutex> g(allocating_mu);
    now = allocating;
  }
  for (auto &a : now) {
    if (a.device == device && a.filter(static_cast<CUstream_st *>(stream))) {
      *out = a.pool;
      return true;
    }
  }
  return false;
}
}  // namespace

extern "C" void *vramd_torch_alloc(ssize_t size, int device, void *stream) {
  void *p;
  vramd_pool_id pool;
  if (n_allocating.load(std::memory_order_acquire) > 0 && pool_for(device, stream, &pool)) {
    p = vram_pool_alloc(size, device, stream, pool.first, pool.second);
  } else {
    p = vram_alloc(size, device, stream);
  }
  if (p == nullptr) {
    const char *e = vram_last_error();
    TORCH_CHECK_WITH(OutOfMemoryError, false, e ? e : "vramd refused the allocation");
  }
  return p;
}
extern "C" void vramd_torch_free(void *ptr, ssize_t size, int device, void *stream) {
  vram_free(ptr, size, device, stream);
}
extern "C" void vramd_torch_use_pools(void) { pools_on.store(true); }
// The graph-pool hooks of a pluggable allocator: torch.cuda.graph calls the first before a stream
// enters capture, the second when the capture ends, and the third when the graph is released.
extern "C" void vramd_torch_capture_begin(int device, vramd_pool_id pool, vramd_filter filter) {
  if (pools_on.load() && vram_pool_begin(device, pool.first, pool.second) == 0) {
    {
      std::lock_guard<std::mutex> g(allocating_mu);
      allocating.push_back(Allocating{device, pool, std::move(filter)});
    }
    n_allocating.fetch_add(1, std::memory_order_release);
  }
  vram_capture_begin(device);
}
extern "C" void vramd_torch_capture_end(int device, vramd_pool_id pool) {
  vram_capture_end(device);
  std::lock_guard<std::mutex> g(allocating_mu);
  for (auto it = allocating.begin(); it != allocating.end(); ++it) {
    if (it->device == device && it->pool == pool) {
      allocating.erase(it);
      n_allocating.fetch_sub(1, std::memory_order_release);
      break;
    }
  }
}
extern "C" void vramd_torch_release_pool(int device, vramd_pool_id pool) {
  if (pools_on.load()) {
    vram_pool_release(device, pool.first, pool.second);
  }
}
"""


class NoShim(RuntimeError):
    """The shim cannot be built here (no C++ compiler, PyTorch's headers missing, ...)."""


def _shim():
    """Builds (once per torch version) the shim; NoShim, with the compiler's words, if it
    cannot."""
    import torch
    import torch.utils.cpp_extension as ext

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    key = hashlib.sha256(f"{torch.__version__}{abi}{_SHIM}".encode()).hexdigest()[:16]
    cache = os.environ.get("VRAMD_TORCH_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "vramd_torch"
    )
    out = os.path.join(cache, f"vramd_oom_{key}.so")
    if os.path.exists(out):
        return out
    try:
        return _build_shim(ext, abi, cache, out)
    except OSError as e:
        # No compiler (`c++` not found), an unwritable cache, ...
        raise NoShim(f"cannot build the OOM shim: {e}") from None


def _build_shim(ext, abi, cache, out):
    os.makedirs(cache, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "shim.cpp")
        with open(src, "w") as f:
            f.write(_SHIM)
        libdir = ext.library_paths()[0]
        cmd = [os.environ.get("CXX", "c++"), "-O2", "-std=c++17", "-shared", "-fPIC",
               f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
        cmd += [f"-I{p}" for p in ext.include_paths()]
        cmd += [src, "-o", os.path.join(d, "shim.so"), f"-L{libdir}", "-lc10",
                f"-Wl,-rpath,{libdir}"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise NoShim(f"cannot build the OOM shim: {r.stderr.strip()[-400:]}")
        os.replace(os.path.join(d, "shim.so"), out)
    return out


def install():
    global _allocator
    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError(
            "vramd: full mode must be installed before CUDA is initialised; use pool mode "
            "(vramd_torch.install(mode='pool')) in a process that already uses CUDA"
        )
    # Without the shim a refusal would be a tensor at address 0: NoShim, nothing changed.
    shim = _shim()
    lib = ctypes.CDLL(shim, mode=ctypes.RTLD_GLOBAL)
    alloc = torch.cuda.memory.CUDAPluggableAllocator(shim, "vramd_torch_alloc", "vramd_torch_free")
    _announce_captures(alloc, lib)
    torch.cuda.memory.change_current_allocator(alloc)
    _allocator = alloc
    _patch_stats(torch)
    _patch_unsupported(torch)


def _announce_captures(alloc, shim):
    """Has PyTorch tell vramd when a graph capture begins and ends, so that vramd asks the driver
    whether a stream is being captured only during captures, not on every allocation and free;
    and, where PyTorch also says when a graph is released, gives each graph's pool its private
    memory (include/vram.h, "Private pools"). Without the hooks (an older PyTorch), vramd keeps
    asking: slower, as safe for one graph; without the release hook, a graph's memory is not
    private to its pool."""
    hooks = alloc.allocator()
    if not (hasattr(hooks, "set_begin_allocate_to_pool")
            and hasattr(hooks, "set_end_allocate_to_pool_fn")):
        return
    address = lambda name: ctypes.cast(getattr(shim, name), ctypes.c_void_p).value
    if hasattr(hooks, "set_release_pool"):
        hooks.set_release_pool(address("vramd_torch_release_pool"))
        shim.vramd_torch_use_pools()
    hooks.set_begin_allocate_to_pool(address("vramd_torch_capture_begin"))
    hooks.set_end_allocate_to_pool_fn(address("vramd_torch_capture_end"))
    _lib.lib().vram_announce_captures()


def _stats_dict():
    s = _lib.stats()
    core = s["stats"]["core"]
    in_use = s["stats"]["in_use"]
    d = {}

    def stat(name, current, peak, allocated=None, freed=None):
        for pool in ("all", "large_pool"):
            d[f"{name}.{pool}.current"] = current
            d[f"{name}.{pool}.peak"] = peak
            if allocated is not None:
                d[f"{name}.{pool}.allocated"] = allocated
                d[f"{name}.{pool}.freed"] = freed
        for k in ("current", "peak", "allocated", "freed"):
            d.setdefault(f"{name}.small_pool.{k}", 0)

    live = core["allocs"] - core["frees"]
    stat("allocated_bytes", in_use, core["allocated_peak"])
    stat("active_bytes", in_use, core["allocated_peak"])
    stat("requested_bytes", core["requested"], core["requested_peak"])
    stat("reserved_bytes", core["held"], core["held_peak"],
         core["granted_bytes"], core["granted_bytes"] - core["held"])
    stat("inactive_split_bytes", s["stats"]["cached"], s["stats"]["cached"])
    stat("allocation", live, live, core["allocs"], core["frees"])
    stat("active", live, live, core["allocs"], core["frees"])
    segments = core["grants"] - core["returns"]
    stat("segment", segments, segments, core["grants"], core["returns"])
    d.update({
        "num_alloc_retries": 0,
        "num_ooms": core["refused"],
        "num_sync_all_streams": 0,
        "num_device_alloc": core["grants"],
        "num_device_free": core["returns"],
        "oversize_allocations.current": 0,
        "oversize_allocations.peak": 0,
        "oversize_segments.current": 0,
        "oversize_segments.peak": 0,
        "max_split_size": -1,
    })
    return dict(sorted(d.items()))


def _snapshot(device=None, *args, **kwargs):
    snap = _lib.snapshot()
    states = {"allocated": "active_allocated", "pending_free": "active_pending_free",
              "free": "inactive"}
    segments = []
    for seg in snap["segments"]:
        blocks = [{"address": b["address"], "size": b["size"],
                   "requested_size": b["requested_size"], "state": states[b["state"]],
                   "frames": []} for b in seg["blocks"]]
        allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
        active = sum(b["size"] for b in blocks if b["state"] != "inactive")
        segments.append({
            "device": snap["gpu"], "address": seg["address"], "total_size": seg["size"],
            "allocated_size": allocated, "active_size": active,
            "requested_size": sum(b["requested_size"] for b in blocks),
            "stream": 0, "segment_type": "small" if seg["small"] else "large",
            "segment_pool_id": (0, 0), "is_expandable": True, "frames": [], "blocks": blocks,
        })
    return {"segments": segments, "device_traces": [[]], "allocator_settings": {}}


def _summary(device=None, abbreviated=False):
    s = _lib.stats()
    core = s["stats"]["core"]
    g = _lib.gib
    rows = [
        ("tenant", s["tenant"]), ("gpu", s["gpu"]), ("limit", g(s["limit"])),
        ("guarantee", g(s["guarantee"])), ("in use", g(s["stats"]["in_use"])),
        ("in use, peak", g(core["allocated_peak"])), ("held (reserved)", g(core["held"])),
        ("held, peak", g(core["held_peak"])), ("cached", g(s["stats"]["cached"])),
        ("allocations", core["allocs"]), ("frees", core["frees"]),
        ("grants from vramd", core["grants"]), ("returned to vramd", core["returns"]),
        ("refused", core["refused"]),
    ]
    lines = ["|" + "=" * 60 + "|", "| vramd memory summary (full mode)".ljust(61) + "|",
             "|" + "-" * 60 + "|"]
    lines += [f"| {k:<28}{v!s:>30} |" for k, v in rows]
    lines.append("|" + "=" * 60 + "|")
    return "\n".join(lines) + "\n"


def _patch_stats(torch):
    mem = torch.cuda.memory

    def memory_stats(device=None):
        return _stats_dict()

    def key(k):
        return lambda device=None: _stats_dict()[k]

    def reset_peak(device=None):
        _lib.reset_peak()

    def memory_snapshot(*args, **kwargs):
        return _snapshot()["segments"]

    patches = {
        "memory_stats": memory_stats,
        "memory_stats_as_nested_dict": memory_stats,
        "memory_allocated": key("allocated_bytes.all.current"),
        "max_memory_allocated": key("allocated_bytes.all.peak"),
        "memory_reserved": key("reserved_bytes.all.current"),
        "max_memory_reserved": key("reserved_bytes.all.peak"),
        "memory_cached": key("reserved_bytes.all.current"),
        "max_memory_cached": key("reserved_bytes.all.peak"),
        "reset_peak_memory_stats": reset_peak,
        "reset_max_memory_allocated": reset_peak,
        "reset_max_memory_cached": reset_peak,
        "reset_accumulated_memory_stats": lambda device=None: None,
        "memory_summary": _summary,
        "memory_snapshot": memory_snapshot,
        "_snapshot": _snapshot,
    }
    for name, fn in patches.items():
        setattr(mem, name, fn)
        if hasattr(torch.cuda, name):
            setattr(torch.cuda, name, fn)


def _patch_unsupported(torch):
    def unsupported(what):
        def fn(*args, **kwargs):
            raise RuntimeError(
                f"vramd: {what} is not available in full mode (PyTorch's pluggable allocator "
                "cannot do it); run with `vramd run --torch-mode pool` or "
                "vramd_torch.install(mode='pool')"
            )
        return fn

    torch.cuda.memory._record_memory_history = unsupported("_record_memory_history")
    try:
        # cudagraph trees ask the allocator for a pool's live blocks, which a pluggable
        # allocator cannot answer; plain CUDA graphs per compiled graph work.
        import torch._inductor.config as cfg

        cfg.triton.cudagraph_trees = False
    except Exception:
        pass
