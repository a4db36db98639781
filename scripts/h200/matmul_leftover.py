"""What a matmul leaves allocated after its tensors are freed, and what
`torch._C._cuda_clearCublasWorkspaces()` and `torch.cuda.empty_cache()` give back. vramd's
`end_tenant` (python/vramd/ray.py) has to let go of the same memory before a task's tenant ends.

    python3 scripts/h200/matmul_leftover.py                  # PyTorch's own allocator: the live
                                                              # blocks, with the C++ frames that
                                                              # allocated them
    python3 scripts/h200/matmul_leftover.py --socket SOCKET  # as a tenant of the daemon there
                                                              # (vramd's allocator in full mode;
                                                              # run it with libvram.so preloaded
                                                              # or not): what vramd has allocated
"""
import argparse

import torch

MIB = 1 << 20


def live(label):
    torch.cuda.synchronize()
    print(f"{label}: allocated {torch.cuda.memory_allocated() / MIB:.2f} MiB, "
          f"reserved {torch.cuda.memory_reserved() / MIB:.2f} MiB")


def vramd_probe(socket):
    import vramd.ray
    from vramd import _lib

    t = vramd.ray.become_tenant("matmul-probe", memory="1GiB", limit="2GiB", torch_mode="full", socket=socket)
    lib = _lib.lib()

    def live(label):
        torch.cuda.synchronize()
        s = t.stats()["stats"]
        core = s.get("core", {})
        print(f"{label}: vramd allocated {core.get('allocated', 0) / MIB:.2f} MiB, held "
              f"{core.get('held', 0) / MIB:.2f} MiB, cudaMalloc calls taken by libvram.so "
              f"{lib.vram_interposed_calls()}")

    print("torch", torch.__version__, "vramd preloaded:", bool(lib.vram_interposing()))
    live("start")
    a = torch.randn(1024, 1024, device="cuda")
    c = float((a @ a).sum())
    del a
    live(f"after the matmul (sum {c:.1f}), tensors freed")
    torch._C._cuda_clearCublasWorkspaces()
    live("after _cuda_clearCublasWorkspaces")
    torch.cuda.empty_cache()
    live("after empty_cache")
    try:
        vramd.ray.end_tenant(t)
        print("end_tenant: ended")
    except Exception as e:  # noqa: BLE001 - the probe reports whatever refused the end
        print(f"end_tenant: {e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", help="a vramd daemon's socket: probe as its tenant")
    args = ap.parse_args()
    if args.socket:
        vramd_probe(args.socket)
        return
    print("torch", torch.__version__, torch.cuda.get_device_name())
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="all")
    live("start")
    a = torch.randn(1024, 1024, device="cuda")
    c = float((a @ a).sum())
    del a
    live(f"after the matmul (sum {c:.1f}), tensors freed")
    snap = torch.cuda.memory._snapshot()
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b["state"] != "active_allocated":
                continue
            frames = [f["name"] for f in b.get("frames", [])]
            named = [f for f in frames if any(k in f.lower() for k in ("blas", "workspace", "lt"))]
            print(f"  live block {b['size'] / MIB:.2f} MiB on stream {seg['stream']}: "
                  f"{(named or frames)[:4]}")
    torch._C._cuda_clearCublasWorkspaces()
    live("after _cuda_clearCublasWorkspaces")
    torch.cuda.empty_cache()
    live("after empty_cache")


if __name__ == "__main__":
    main()
