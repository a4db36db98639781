"""A plain PyTorch process, NOT a tenant: takes N GiB of device memory with torch.empty (1 GiB at a
time, each written), prints one JSON line and READY <pid>, then sleeps until killed (or for
--seconds).

python3 outside_hog.py [--gib 20] [--seconds S]
"""

import argparse
import os
import time

import _common as C


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=20.0)
    p.add_argument("--seconds", type=float, default=None)
    args = p.parse_args()
    t0 = time.perf_counter()
    import torch
    want = int(args.gib * C.GiB)
    ts, taken, err = [], 0, None
    while taken < want:
        n = min(C.GiB, want - taken)
        try:
            t = torch.empty(n, dtype=torch.uint8, device="cuda")
            t.fill_(0x5A)
        except Exception as e:
            err = C.error_info(e)
            break
        ts.append(t)
        taken += n
    torch.cuda.synchronize()
    C.emit({"prog": "outside_hog", "pid": os.getpid(), "bytes": taken, "wanted": want,
            "error": err, "seconds": round(time.perf_counter() - t0, 3),
            "under_vramd": bool(os.environ.get("VRAMD_SOCKET"))})
    print(f"READY {os.getpid()}", flush=True)
    if args.seconds is not None:
        time.sleep(args.seconds)
    else:
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    main()
