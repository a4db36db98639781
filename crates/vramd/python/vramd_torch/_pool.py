"""Pool mode: PyTorch's caching allocator on top of segments from vramd.

A MemPool over vramd's allocator, with every allocation of every thread routed to it
(`_cuda_beginAllocateToPool` with a filter that takes every stream). PyTorch picks the first
routing entry whose filter matches, so when PyTorch routes a CUDA-graph capture or cudagraph
trees to their own pools we move our entry behind theirs (begin ours again, end the first).

Reclaim: PyTorch's `empty_cache` never frees a pool that is still routed to, so when the daemon
asks for memory back a thread moves the routing to a fresh pool and drops the old one: its idle
segments go back to vramd at once, the rest as their last tensors are freed.
"""

import sys
import threading
import time

from . import _lib

_state = None
# Set while `_start` runs: it calls into CUDA itself, which re-enters the `_lazy_init` wrapper.
_starting = False


class _State:
    def __init__(self, torch):
        self.torch = torch
        self.c = torch._C
        self.device = torch.cuda.current_device()
        self.allocator = torch.cuda.memory.CUDAPluggableAllocator(
            _lib.path(), "vram_alloc", "vram_free"
        )
        self.lock = threading.RLock()
        self.begin = self.c._cuda_beginAllocateToPool
        end = getattr(self.c, "_cuda_endAllocateToPool", None)
        self.end = end or self.c._cuda_endAllocateCurrentStreamToPool
        self.release = self.c._cuda_releasePool
        self.capturing = 0
        self.pool = self._new_pool()
        self.begin(self.device, self.pool.id)

    def _new_pool(self):
        return self.torch.cuda.MemPool(self.allocator.allocator())

    def requeue(self):
        """Puts our routing entry behind any added since (graph pools first).

        End first: PyTorch refuses to begin routing to a pool that is already routed to. The
        begin adds a use of the pool and the release takes it back, so its count is unchanged.
        """
        with self.lock:
            self.end(self.device, self.pool.id)
            self.begin(self.device, self.pool.id)
            self.release(self.device, self.pool.id)

    def rotate(self):
        """Routes to a fresh pool and frees what the old one holds idle."""
        with self.lock:
            if self.capturing:
                return False
            old, self.pool = self.pool, self._new_pool()
            self.begin(self.device, self.pool.id)
            self.end(self.device, old.id)
            self.release(self.device, old.id)
            del old
        self.torch.cuda.empty_cache()
        return True


def install():
    global _state
    import torch

    if _state is not None:
        return
    if torch.cuda.is_initialized():
        _start(torch)
        return
    # Routing needs CUDA; start it right after PyTorch initialises CUDA, before any allocation.
    original = torch.cuda._lazy_init

    def _lazy_init():
        global _starting
        original()
        if _state is None and not _starting:
            _starting = True
            try:
                _start(torch)
            finally:
                _starting = False

    for name, module in list(sys.modules.items()):
        if (name == "torch.cuda" or name.startswith("torch.cuda.")) and getattr(
            module, "_lazy_init", None
        ) is original:
            module._lazy_init = _lazy_init


def _start(torch):
    global _state
    _state = _State(torch)
    _wrap_routing(torch)
    torch._C._cuda_attach_out_of_memory_observer(_on_oom)
    threading.Thread(target=_reclaim_loop, name="vramd-reclaim", daemon=True).start()


def _on_oom(device, alloc, device_allocated, device_free):
    raise _state.torch.OutOfMemoryError(_lib.refusal_message(alloc))


def _wrap_routing(torch):
    """After PyTorch routes something to another pool, our entry goes behind it."""
    c = torch._C
    for name in (
        "_cuda_beginAllocateToPool",
        "_cuda_beginAllocateCurrentStreamToPool",
        "_cuda_beginAllocateCurrentThreadToPool",
    ):
        inner = getattr(c, name, None)
        if inner is None:
            continue

        def wrapped(device, pool_id, _inner=inner):
            _inner(device, pool_id)
            if _state is not None and tuple(pool_id) != tuple(_state.pool.id):
                _state.requeue()

        setattr(c, name, wrapped)
        if hasattr(torch.cuda.memory, name):
            setattr(torch.cuda.memory, name, wrapped)

    graph = torch.cuda.CUDAGraph
    begin, end = graph.capture_begin, graph.capture_end

    def capture_begin(self, *args, **kwargs):
        with _state.lock:
            _state.capturing += 1
        try:
            begin(self, *args, **kwargs)
        except BaseException:
            with _state.lock:
                _state.capturing -= 1
            raise
        _state.requeue()

    def capture_end(self, *args, **kwargs):
        try:
            end(self, *args, **kwargs)
        finally:
            with _state.lock:
                _state.capturing -= 1

    graph.capture_begin = capture_begin
    graph.capture_end = capture_end


def _reclaim_loop():
    seen = _lib.reclaim_requests()
    while True:
        time.sleep(0.05)
        n = _lib.reclaim_requests()
        if n == seen:
            continue
        seen = n
        try:
            if _state.rotate():
                _lib.trim()
        except Exception as e:
            print(f"vramd: reclaim failed: {e}", file=sys.stderr)
