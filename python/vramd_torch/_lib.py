"""libvram.so through ctypes: the same library (and so the same tenant) PyTorch's
CUDAPluggableAllocator loads. Found and loaded by `vramd._lib` (see there for where it looks)."""

from vramd._lib import last_error, lib, path, take_json

__all__ = ["last_error", "lib", "path"]


def stats():
    """{"tenant", "gpu", "limit", "guarantee", "stats": {"core": {...}, "in_use", "cached", ...}}"""
    return take_json(lib().vram_stats_json(), "vram_stats_json")


def refusals():
    """How many allocations vramd refused in this process, over every interposed entry point."""
    hooks = take_json(lib().vram_interposer_stats_json(), "vram_interposer_stats_json")["hooks"]
    return sum(h["refused"] for h in hooks.values())


def snapshot():
    return take_json(lib().vram_snapshot_json(), "vram_snapshot_json")


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
