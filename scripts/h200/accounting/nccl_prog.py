"""PyTorch with a one-rank NCCL process group as a tenant: an all-reduce checked, then tensors
until torch.OutOfMemoryError, then proof that the process (and its communicator) still works.

python3 nccl_prog.py [--step-mib 256] [--max-bytes 4GiB] [--wait]
"""

import argparse
import os
import tempfile
import time

import _common as C


def main():
    p = C.add_alloc_args(argparse.ArgumentParser())
    p.add_argument("--torch-fraction", type=float, default=None,
                   help="torch.cuda.set_per_process_memory_fraction (selftest.sh: an OOM without vramd)")
    args = p.parse_args()
    step = args.step_mib * C.MiB
    res = {"prog": "nccl", "pid": os.getpid(), "step": step, "max_bytes": args.max_bytes}
    t0 = time.perf_counter()
    import torch
    import torch.distributed as dist
    res["torch"] = torch.__version__
    v = torch.cuda.nccl.version()
    res["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    torch.cuda.set_device(0)
    if args.torch_fraction:
        torch.cuda.set_per_process_memory_fraction(args.torch_fraction, 0)
    init = tempfile.NamedTemporaryFile(prefix="vramd-nccl-", delete=False).name
    os.unlink(init)  # the file store creates it
    kw = dict(backend="nccl", init_method=f"file://{init}", rank=0, world_size=1)
    try:
        dist.init_process_group(**kw, device_id=torch.device("cuda", 0))
    except TypeError:
        dist.init_process_group(**kw)

    def all_reduce_ok(n=1 << 20, v=3.0):
        x = torch.full((n,), v, device="cuda")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        return bool((x == v).all().item()), float(x.sum().item())

    res["all_reduce_ok"], res["all_reduce_sum"] = all_reduce_ok()
    res["mem_get_info_start"] = list(torch.cuda.mem_get_info())
    ts, res["refused"] = [], False
    while (len(ts) + 1) * step <= args.max_bytes:
        try:
            ts.append(torch.empty(step, dtype=torch.uint8, device="cuda"))  # no other reference
            ts[-1].fill_((len(ts)) & 0xFF)
            torch.cuda.synchronize()
        except torch.OutOfMemoryError as e:
            res["refused"] = True
            res.update(C.error_info(e))
            break
        except Exception as e:  # not the framework's OOM: recorded as such
            res["refused"] = True
            res.update(C.error_info(e))
            break
    res["tensors"] = len(ts)
    res["allocated_bytes"] = len(ts) * step
    res["framework_oom"] = res["refused"] and res.get("error_type", "").endswith("OutOfMemoryError")
    res["alloc_seconds"] = round(time.perf_counter() - t0, 3)
    res["torch_allocated"] = torch.cuda.memory_allocated()
    res["torch_reserved"] = torch.cuda.memory_reserved()

    def check():
        ok = all(int(t[:4096].sum().item()) == 4096 * ((i + 1) & 0xFF) for i, t in
                 ((0, ts[0]), (len(ts) - 1, ts[-1]))) if ts else True
        ar_ok, _ = all_reduce_ok(1 << 16, 5.0)
        return ok and ar_ok

    try:
        res["survived"] = check()
    except Exception as e:
        res["survived"] = False
        res["survival_error"] = C.error_info(e)
        try:
            ts.pop()
            torch.cuda.empty_cache()
            res["survived_after_free"] = check()
        except Exception as e2:
            res["survived_after_free"] = False
            res["survival_after_free_error"] = C.error_info(e2)
    try:
        res["mem_get_info_end"] = list(torch.cuda.mem_get_info())
    except Exception as e:
        res["mem_get_info_end"] = C.error_info(e)
    res["inside_view"] = C.inside_view()
    C.emit(res)
    C.ready_and_wait(args.wait)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
