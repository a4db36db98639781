"""Ten PyTorch tenants that together fill the daemon's capacity C: each under
`vramd run --guarantee G --limit G`, G = C/10 rounded down to 2 MiB, allocating and writing tensors
up to G minus a margin (its CUDA context and slack). While all hold their memory: each tenant's
held and outside from status, NVML's figure for each process, the device's free/outside_use/at_risk;
then all ten are SIGKILLed together and the reclaim is timed.

  ten_tenants.py run --out ten.json [--n 10] [--margin-gib 1] [--capacity BYTES] [--flag=...]
  ten_tenants.py worker --bytes B [--chunk-mib 512] [--wait]     (what each tenant runs)

The daemon's socket and binary as for harness.py (--socket/ACCT_SOCKET, --vramd/ACCT_VRAMD).
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import harness as H  # noqa: E402

MiB, GiB = C.MiB, C.GiB


def worker(a):
    t0 = time.perf_counter()
    import torch
    res = {"prog": "ten_worker", "pid": os.getpid(), "want": a.bytes, "oom": False}
    ts, taken = [], 0
    step = a.chunk_mib * MiB
    while taken < a.bytes:
        n = min(step, a.bytes - taken)
        try:
            t = torch.empty(n, dtype=torch.uint8, device="cuda")
            t.fill_((len(ts) + 1) & 0xFF)
            torch.cuda.synchronize()
        except torch.OutOfMemoryError as e:
            res["oom"] = True
            res.update(C.error_info(e))
            break
        except Exception as e:
            res["oom"] = None  # not an OOM: recorded as an error
            res.update(C.error_info(e))
            break
        ts.append(t)
        taken += n
    res["allocated_bytes"] = taken
    try:
        res["verified"] = all(int(t[:4096].sum().item()) == 4096 * ((i + 1) & 0xFF)
                              for i, t in enumerate(ts))
    except Exception as e:
        res["verified"] = False
        res["verify_error"] = C.error_info(e)
    try:
        res["mem_get_info"] = list(torch.cuda.mem_get_info())
    except Exception as e:
        res["mem_get_info"] = C.error_info(e)
    res["seconds"] = round(time.perf_counter() - t0, 2)
    C.emit(res)
    C.ready_and_wait(a.wait)


def run(a):
    rec = {"n": a.n, "margin": int(a.margin_gib * GiB)}
    st = H.status()
    cap = a.capacity or H.num(H.dev0(st).get("capacity"))
    rec["capacity"] = cap
    # What the daemon can promise now: its capacity less what is in use outside its books (the
    # driver's own few MiB that come and go, any process that is not a tenant).
    outside = H.num(H.dev0(st).get("outside_use")) or 0
    rec["outside_use_at_start"] = outside
    if cap and not a.capacity:
        cap -= outside
    if not cap:
        rec["error"] = f"no capacity: {st.get('error')}"
        H.write(a.out, rec)
        return
    g = cap // a.n // (2 * MiB) * (2 * MiB)
    b = g - int(a.margin_gib * GiB)
    rec.update(guarantee=g, bytes_each=b)
    base_adj = H.adjusted_used(H.nvml(), st)
    progs = []
    for i in range(a.n):
        name = f"ten-{i}"
        cmd = ["python3", os.path.abspath(__file__), "worker", "--bytes", b,
               "--chunk-mib", a.chunk_mib, "--wait"]
        progs.append((name, H.Prog(H.vramd_run(name, g, g, a.flag, cmd),
                                   H.logpath(a.out, f"_{i}"))))
    end = time.monotonic() + a.ready_timeout
    while time.monotonic() < end:
        states = [p.poll_ready() or p.p.poll() is not None for _, p in progs]
        if all(states):
            break
        time.sleep(0.1)
    rec["all_ready"] = all(p.pid is not None for _, p in progs)
    rec["ready_s"] = round(max((p.t_ready or time.monotonic()) - p.t_start for _, p in progs), 2)
    time.sleep(0.3)
    st, nv = H.status(), H.nvml()
    rec["status_error"] = st.get("error")
    rec["schema"] = H.schema(st)
    d = H.dev0(st)
    rec["device"] = H.pick(d, ("capacity", "held", "pooled", "reserved", "free", "device_used",
                               "driver_used", "outside_use", "unattributed", "deficit", "at_risk",
                               "outside_processes"))
    rec["nvml_used"] = nv.get("used")
    per, ooms = [], 0
    for name, p in progs:
        t = H.tenant_of(st, name) or {}
        r = p.result or {}
        ooms += bool(r.get("oom"))
        row = {"name": name, "pid": p.pid, "ready": p.pid is not None,
               "held": t.get("held"), "outside": t.get("outside", "missing" if t else None),
               "guarantee": t.get("guarantee"), "limit": t.get("limit"),
               "charged": t.get("charged"), "in_use": t.get("in_use"),
               "nvml_used": nv["procs"].get(p.pid), "allocated": r.get("allocated_bytes"),
               "oom": r.get("oom"), "error": r.get("error"), "verified": r.get("verified")}
        if H.num(row["held"]) is not None and H.num(row["nvml_used"]) is not None:
            row["nvml_minus_held"] = row["nvml_used"] - row["held"] - (H.num(row["charged"]) or 0)
        if p.pid is None:
            row["log_tail"] = p.tail(1200)
        per.append(row)
    rec["per_tenant"] = per
    rec["ooms"] = ooms
    rec["all_present"] = all(H.tenant_of(st, n) is not None for n, _ in progs)
    helds = [r["held"] for r in per if H.num(r["held"]) is not None]
    outs = [r["outside"] for r in per if H.num(r["outside"]) is not None]
    rec["sum_held"] = sum(helds) if helds else None
    rec["sum_outside"] = sum(outs) if outs else None
    rec["held_le_guarantee"] = all(H.num(r["held"]) is not None and r["held"] <= g for r in per)
    # All ten killed together; the reclaim timed until none shows and NVML is back.
    t0 = time.monotonic()
    for _, p in progs:
        p.kill_program()
    gone, back, polls = None, None, 0
    while time.monotonic() - t0 < a.reclaim_s:
        st2, nv2 = H.status(), H.nvml()
        polls += 1
        ms = round((time.monotonic() - t0) * 1000, 1)
        if gone is None and "error" not in st2 and \
                not any(H.tenant_of(st2, n) for n, _ in progs):
            gone = ms
        adj = H.adjusted_used(nv2, st2) if "error" not in st2 else None
        if back is None and adj is not None and base_adj is not None \
                and adj <= base_adj + 256 * MiB:
            back = ms
        if gone is not None and back is not None:
            break
        time.sleep(0.02)
    rec["reclaim"] = {"all_gone_ms": gone, "nvml_back_ms": back, "polls": polls}
    for _, p in progs:
        p.finish()
    rec["ok"] = bool(rec["all_ready"] and rec["all_present"] and ooms == 0
                     and rec["held_le_guarantee"])
    H.write(a.out, rec)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vramd", default=H.VRAMD)
    p.add_argument("--socket", default=H.SOCKET)
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--n", type=int, default=10)
    r.add_argument("--margin-gib", type=float, default=1.0,
                   help="each tenant allocates its guarantee minus this")
    r.add_argument("--capacity", type=C.size, default=None, help="default: the daemon's")
    r.add_argument("--chunk-mib", type=int, default=512)
    r.add_argument("--ready-timeout", type=float, default=150)
    r.add_argument("--reclaim-s", type=float, default=5.0)
    r.add_argument("--flag", action="append", default=[], help="extra `vramd run` argument")
    r.set_defaults(fn=run)
    w = sub.add_parser("worker")
    w.add_argument("--bytes", type=C.size, required=True)
    w.add_argument("--chunk-mib", type=int, default=512)
    w.add_argument("--wait", action="store_true")
    w.set_defaults(fn=worker)
    a = p.parse_args()
    H.VRAMD, H.SOCKET = a.vramd, a.socket
    if a.what == "run" and not H.SOCKET:
        p.error("no socket: --socket or ACCT_SOCKET")
    a.fn(a)


if __name__ == "__main__":
    main()
