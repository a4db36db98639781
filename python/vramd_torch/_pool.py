"""Pool mode: PyTorch's own caching allocator, with its segments from vramd.

`vramd run --torch-mode pool` preloads libvram.so, whose `cudaMalloc` and `cudaFree` take the
place of the CUDA runtime's (see vram.h): every segment PyTorch's caching allocator takes, on
every thread and stream, for graphs' private pools too, is vramd's memory under the tenant's limit.
Nothing in PyTorch is replaced or re-routed, so everything in it works as without vramd; the
fragmentation is PyTorch's own.

Here: a check that the runtime's functions really are vramd's, the out-of-memory message,
PyTorch's in-use figure for `vramd status` (what it holds beyond is its cache), and elastic
sharing — when the daemon asks for memory back, a thread empties PyTorch's cache (its idle
segments go back through `cudaFree`) and hands them to the daemon.
"""

import sys
import threading
import time

from . import _lib

_state = None


class _State:
    def __init__(self, torch):
        self.torch = torch
        self.lock = threading.Lock()
        # Graph captures under way: emptying the cache then would synchronise into the capture.
        self.capturing = 0
        # vramd's refusals as the last out-of-memory error saw them: one with none since is
        # PyTorch's own (its memory fraction) or the driver's, and says so in PyTorch's words.
        self.refusals = _lib.refusals()


def install():
    global _state
    import torch

    if _state is not None:
        return
    if not _lib.lib().vram_interposing():
        raise RuntimeError(
            "vramd: pool mode needs libvram.so preloaded, so that the CUDA runtime's cudaMalloc "
            "is vramd's: run the program under `vramd run --torch-mode pool`, or start it with "
            "LD_PRELOAD=<path of libvram.so> VRAMD_TORCH_MODE=pool"
        )
    _state = _State(torch)
    _count_captures(torch)
    if torch.cuda.is_initialized():
        _attach_oom_observer(torch)
    else:
        # The observer needs CUDA: attach it right after PyTorch initialises CUDA.
        original = torch.cuda._lazy_init

        def _lazy_init():
            original()
            if not getattr(_lazy_init, "done", False):
                _lazy_init.done = True
                _attach_oom_observer(torch)

        for name, module in list(sys.modules.items()):
            if (name == "torch.cuda" or name.startswith("torch.cuda.")) and getattr(
                module, "_lazy_init", None
            ) is original:
                module._lazy_init = _lazy_init
    threading.Thread(target=_reclaim_loop, name="vramd-reclaim", daemon=True).start()


def _attach_oom_observer(torch):
    torch._C._cuda_attach_out_of_memory_observer(_on_oom)


def _on_oom(device, alloc, device_allocated, device_free):
    now = _lib.refusals()
    before, _state.refusals = _state.refusals, now
    if now > before:
        raise _state.torch.OutOfMemoryError(_lib.refusal_message(alloc))
    # No refusal of vramd's since the last one: PyTorch raises its own error, in its words.


def _count_captures(torch):
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

    def capture_end(self, *args, **kwargs):
        try:
            end(self, *args, **kwargs)
        finally:
            with _state.lock:
                _state.capturing -= 1

    graph.capture_begin = capture_begin
    graph.capture_end = capture_end


def release_idle():
    """Empties PyTorch's cache into vramd and gives it back to the daemon; False (nothing done)
    while a graph capture is under way."""
    with _state.lock:
        if _state.capturing:
            return False
        _state.torch.cuda.empty_cache()
    _lib.trim()
    return True


def _report_in_use():
    """What of PyTorch's segments its tensors use, for `vramd status` (the rest is its cache)."""
    torch = _state.torch
    if torch.cuda.is_initialized():
        _lib.lib().vram_report_in_use(torch.cuda.memory_allocated())


# How often `vramd status` learns what PyTorch's tensors use.
REPORT_EVERY_S = 1.0


def _reclaim_loop():
    """Waits for the daemon's requests without holding the GIL, and tells vramd what PyTorch's
    tensors use once a second: a thread that woke up to poll would take the GIL from the training
    thread each time."""
    seen = _lib.reclaim_requests()
    reported = 0.0
    while True:
        n = _lib.wait_reclaim(seen, REPORT_EVERY_S)
        if time.monotonic() - reported >= REPORT_EVERY_S:
            reported = time.monotonic()
            try:
                _report_in_use()
            except Exception as e:
                print(f"vramd: cannot read PyTorch's statistics: {e}", file=sys.stderr)
        if n == seen:
            continue
        try:
            if release_idle():
                seen = n
            else:
                # A capture is under way: ask again shortly, not at once.
                time.sleep(0.05)
        except Exception as e:
            seen = n
            print(f"vramd: reclaim failed: {e}", file=sys.stderr)
