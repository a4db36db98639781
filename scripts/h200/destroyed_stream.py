#!/usr/bin/env python3
"""A block freed on a stream that is then destroyed with work still queued: a stream created next
(the driver may give it the same handle) must not get the block before that work is done.

Under vramd's allocator (full mode; libvram hooks cuStreamDestroy_v2), with a daemon running:

    vramd run --torch-mode full -- python3 scripts/h200/destroyed_stream.py

and alone, what PyTorch's own caching allocator does:

    python3 scripts/h200/destroyed_stream.py

It prints one JSON line: {"ok": true, "detail": {"same_handle": ...}} or {"ok": false, "error": ...}.

The streams are the driver's own (cuStreamCreate and cuStreamDestroy_v2 through ctypes; under
`vramd run`, libvram's dlsym hook answers the lookup).
"""

import ctypes
import json
import sys

SIZE = 64 * 2**20


def destroyed_stream_frees_wait(torch):
    cu = ctypes.CDLL("libcuda.so.1")
    dev = torch.device("cuda")
    # The runtime makes the device's primary context current on this thread at its first call
    # that needs one; the driver's stream calls below need it current.
    torch.zeros(1, device=dev)

    def create():
        h = ctypes.c_void_p()
        rc = cu.cuStreamCreate(ctypes.byref(h), 1)  # CU_STREAM_NON_BLOCKING
        assert rc == 0, f"cuStreamCreate: {rc}"
        return h

    first = create()
    with torch.cuda.stream(torch.cuda.ExternalStream(first.value)):
        x = torch.empty(SIZE, dtype=torch.uint8, device=dev)
        torch.cuda._sleep(300_000_000)  # some 150 ms of queued work before the write
        x.fill_(1)
        del x  # freed on the stream whose work still writes it
    rc = cu.cuStreamDestroy_v2(first)
    assert rc == 0, f"cuStreamDestroy_v2: {rc}"
    second = create()
    with torch.cuda.stream(torch.cuda.ExternalStream(second.value)):
        y = torch.empty(SIZE, dtype=torch.uint8, device=dev)
        y.fill_(2)
    torch.cuda.synchronize()
    ones = int((y == 1).sum())
    same = second.value == first.value
    del y
    assert cu.cuStreamDestroy_v2(second) == 0
    assert ones == 0, (
        f"{ones} bytes of a new stream's block were written by a destroyed stream's work "
        f"(same handle: {same})")
    return {"same_handle": same}


if __name__ == "__main__":
    import torch

    try:
        print(json.dumps({"ok": True, "detail": destroyed_stream_frees_wait(torch)}))
    except AssertionError as e:
        print(json.dumps({"ok": False, "error": str(e)}))
        sys.exit(1)
