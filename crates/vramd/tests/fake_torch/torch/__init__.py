"""A stand-in `torch` for tests: just what `vramd_torch.install(mode="pool")` touches before CUDA
starts, and what `vramd.ray.end_tenant` calls (no work to wait for, no cache to empty)."""
import types, sys
cuda = types.ModuleType("torch.cuda")
memory = types.ModuleType("torch.cuda.memory")
cuda.memory = memory
cuda.is_initialized = lambda: False
def _lazy_init():
    pass
cuda._lazy_init = _lazy_init
cuda.synchronize = lambda: None
cuda.empty_cache = lambda: None
class CUDAGraph:
    def capture_begin(self):
        pass
    def capture_end(self):
        pass
cuda.CUDAGraph = CUDAGraph
sys.modules["torch.cuda"] = cuda
sys.modules["torch.cuda.memory"] = memory
