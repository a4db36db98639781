#!/usr/bin/env python3
"""What a Ray worker runs before a task of `vramd.ray.options`, without Ray: `vramd.ray.become_tenant`
in a plain process with real PyTorch on a GPU. Checks that the daemon shows the tenant with the
asked guarantee and limit, that PyTorch's allocations go through vramd (full mode) and stop at
the limit with an out-of-memory error naming the tenant, and that everything is back with the
daemon after `end_tenant`. Prints `ok: ...` lines and exits non-zero on the first failure.

    PATH=.gpu/bin:$PATH python3 scripts/h200/become_tenant.py SOCKET   # vramd installed (pip)
"""
import sys
import time

import vramd
import vramd.ray

GIB = 1 << 30


def tenant_of(socket, name):
    return next((t for t in vramd.status(socket)["tenants"] if t["name"] == name), None)


def main():
    socket = sys.argv[1]
    t = vramd.ray.become_tenant("ray-check", memory="2GiB", limit="4GiB", torch_mode="full",
                                socket=socket)
    import torch
    import vramd_torch

    seen = tenant_of(socket, "ray-check")
    assert seen is not None, vramd.status(socket)["tenants"]
    assert (seen["guarantee"], seen["limit"]) == (2 * GIB, 4 * GIB), seen
    print(f"ok: tenant ray-check guarantee {seen['guarantee']} limit {seen['limit']}")
    assert vramd_torch.installed() == "full", vramd_torch.installed()
    x = torch.ones(GIB // 4, dtype=torch.float32, device="cuda")  # 1 GiB
    held = tenant_of(socket, "ray-check")["held"]
    assert held >= GIB, f"1 GiB tensor but the daemon shows {held} held"
    print(f"ok: PyTorch's 1 GiB tensor is held from vramd ({held} bytes)")
    try:
        torch.empty(4 * GIB, dtype=torch.uint8, device="cuda")
        raise AssertionError("4 GiB more past a 4 GiB limit was allowed")
    except torch.OutOfMemoryError as e:
        assert "ray-check" in str(e), str(e)[:300]
        print(f"ok: past the limit: {str(e).splitlines()[0][:200]}")
    assert float(x.sum()) == GIB // 4
    del x
    t0 = time.monotonic()
    vramd.ray.end_tenant(t)
    for _ in range(100):
        if tenant_of(socket, "ray-check") is None:
            break
        time.sleep(0.01)
    assert tenant_of(socket, "ray-check") is None, vramd.status(socket)["tenants"]
    held = vramd.status(socket)["devices"][0]["held"]
    assert held == 0, f"the daemon still holds {held} after end_tenant"
    print(f"ok: ended, the daemon holds nothing ({time.monotonic() - t0:.3f} s)")


if __name__ == "__main__":
    main()
