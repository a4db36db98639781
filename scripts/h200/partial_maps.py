#!/usr/bin/env python3
"""What mapping a part of a physical handle costs and allows, on the device (CUDA driver API
through ctypes, no vramd involved).

A handle is granted and given back whole, but `cuMemMap` takes an offset into it: each granule of
a handle may be mapped at an address of its own. This script checks that the driver honours such
mappings (the bytes written through one mapping are read through another of the same granule),
which unmaps it accepts (a part of one mapping; several mappings in one call), and times, per
handle size, mapping a handle whole against granule by granule, with one set-access over the range
or one per mapping, and a single granule of a large handle against a handle of one granule.

Usage: python3 scripts/h200/partial_maps.py [--reps N] [--json FILE]
"""

import argparse
import ctypes
import json
import statistics
import sys
import time

MIB = 1 << 20


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class AllocProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", AllocFlags),
    ]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


# The driver and the allocation properties, set by main() (so that --help needs no driver).
cu = PROP = GRAN = None
U64 = ctypes.c_uint64


def check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what}: CUresult {rc}")


def setup():
    check(cu.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    check(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    prop = AllocProp()
    prop.type = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location = Location(1, 0)  # CU_MEM_LOCATION_TYPE_DEVICE, device 0
    gran = ctypes.c_size_t()
    check(cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 0), "granularity")
    return prop, gran.value


ACCESS = AccessDesc(Location(1, 0), 3)  # READWRITE


def create(size):
    h = U64()
    check(cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(size), ctypes.byref(PROP), U64(0)), "cuMemCreate")
    return h.value


def release(h):
    check(cu.cuMemRelease(U64(h)), "cuMemRelease")


def reserve(size):
    p = U64()
    check(cu.cuMemAddressReserve(ctypes.byref(p), ctypes.c_size_t(size), ctypes.c_size_t(0), U64(0), U64(0)), "reserve")
    return p.value


def free_va(p, size):
    check(cu.cuMemAddressFree(U64(p), ctypes.c_size_t(size)), "cuMemAddressFree")


def cmap(va, size, offset, h):
    return cu.cuMemMap(U64(va), ctypes.c_size_t(size), ctypes.c_size_t(offset), U64(h), U64(0))


def access(va, size):
    return cu.cuMemSetAccess(U64(va), ctypes.c_size_t(size), ctypes.byref(ACCESS), ctypes.c_size_t(1))


def unmap(va, size):
    return cu.cuMemUnmap(U64(va), ctypes.c_size_t(size))


def now():
    return time.perf_counter_ns() / 1000.0


def correctness():
    """Each granule of one handle mapped at its own address reads what was written through the
    handle's whole mapping; which unmaps the driver accepts."""
    out = {}
    n = 4
    h = create(n * GRAN)
    whole = reserve(n * GRAN)
    check(cmap(whole, n * GRAN, 0, h), "map whole")
    check(access(whole, n * GRAN), "access whole")
    for i in range(n):
        check(cu.cuMemsetD32_v2(U64(whole + i * GRAN), ctypes.c_uint(i + 1), ctypes.c_size_t(GRAN // 4)), "memset")
    check(cu.cuCtxSynchronize(), "sync")
    # Granules 2 and 0 of the handle, in that order, at a second range.
    other = reserve(2 * GRAN)
    out["map_at_offset_rc"] = cmap(other, GRAN, 2 * GRAN, h)
    out["map_at_offset_0_rc"] = cmap(other + GRAN, GRAN, 0, h)
    if out["map_at_offset_rc"] != 0:  # no part of a handle maps alone: nothing more to check
        unmap(other + GRAN, GRAN)
        unmap(whole, n * GRAN)
        release(h)
        free_va(other, 2 * GRAN)
        free_va(whole, n * GRAN)
        return out
    out["access_over_two_mappings_rc"] = access(other, 2 * GRAN)
    buf = (ctypes.c_uint * 1)()
    seen = []
    for i in range(2):
        rc = cu.cuMemcpyDtoH_v2(buf, U64(other + i * GRAN + GRAN // 2), ctypes.c_size_t(4))
        seen.append(buf[0] if rc == 0 else f"rc {rc}")
    out["read_through_pieces"] = seen  # expected [3, 1]
    out["pieces_read_right"] = seen == [3, 1]
    # Writing through a piece is seen through the whole mapping (where the piece was mapped).
    rc = cu.cuMemsetD32_v2(U64(other), ctypes.c_uint(77), ctypes.c_size_t(GRAN // 4))
    out["memset_piece_rc"] = rc
    if rc == 0:
        check(cu.cuCtxSynchronize(), "sync")
        check(cu.cuMemcpyDtoH_v2(buf, U64(whole + 2 * GRAN + 8), ctypes.c_size_t(4)), "read back")
        out["write_through_piece_seen_whole"] = buf[0] == 77
    out["unmap_two_mappings_in_one_call_rc"] = unmap(other, 2 * GRAN)
    # Part of one mapping.
    out["unmap_part_of_a_mapping_rc"] = unmap(whole + GRAN, GRAN)
    out["unmap_whole_after_rc"] = unmap(whole, n * GRAN)
    for i in range(n):  # whatever the two answers above, nothing stays mapped there
        unmap(whole + i * GRAN, GRAN)
    # The handle mapped granule by granule, side by side, then unmapped in one call.
    for i in range(n):
        check(cmap(whole + i * GRAN, GRAN, i * GRAN, h), "map granule")
    out["access_over_granule_mappings_rc"] = access(whole, n * GRAN)
    out["unmap_granule_mappings_in_one_call_rc"] = unmap(whole, n * GRAN)
    # Two adjacent granule mappings unmapped in one call while the others stay.
    for i in range(n):
        check(cmap(whole + i * GRAN, GRAN, i * GRAN, h), "map granule")
    check(access(whole, n * GRAN), "access")
    out["unmap_middle_two_granule_mappings_rc"] = unmap(whole + GRAN, 2 * GRAN)
    check(cu.cuMemcpyDtoH_v2(buf, U64(whole + 8), ctypes.c_size_t(4)), "read after middle unmap")
    out["first_granule_readable_after_middle_unmap"] = buf[0] == 1
    unmap(whole, GRAN)
    unmap(whole + 3 * GRAN, GRAN)
    # Released while a piece is still mapped: the memory lives until the last mapping goes.
    check(cmap(other, GRAN, 3 * GRAN, h), "map last granule")
    check(access(other, GRAN), "access")
    release(h)
    rc = cu.cuMemcpyDtoH_v2(buf, U64(other + 8), ctypes.c_size_t(4))
    out["piece_readable_after_handle_release"] = buf[0] == 4 if rc == 0 else f"rc {rc}"
    unmap(other, GRAN)
    free_va(other, 2 * GRAN)
    free_va(whole, n * GRAN)
    return out


def med(xs):
    return round(statistics.median(xs), 2)


def timings(size, reps, offsets):
    """Microseconds, medians over reps, for one handle of `size`; the mappings of parts of it at
    offsets only where the driver takes them (`offsets`)."""
    g = size // GRAN
    va = reserve(size)
    h = create(size)
    rows = {}

    def run(name, body):
        ts = {}
        for _ in range(reps):
            for k, v in body().items():
                ts.setdefault(k, []).append(v)
        rows[name] = {k: med(v) for k, v in ts.items()}

    def phases(do_map, do_access, do_unmap):
        t0 = now(); do_map()
        t1 = now(); do_access()
        t2 = now(); do_unmap()
        t3 = now()
        return {"map": t1 - t0, "access": t2 - t1, "unmap": t3 - t2, "total": t3 - t0}

    def map_granules():
        for i in range(g):
            check(cmap(va + i * GRAN, GRAN, i * GRAN, h), "map")

    def unmap_granules():
        # One call over the mappings where the driver takes that, else one call each.
        if unmap(va, size) != 0:
            for i in range(g):
                check(unmap(va + i * GRAN, GRAN), "unmap")

    def access_each():
        for i in range(g):
            check(access(va + i * GRAN, GRAN), "access")

    whole = lambda: phases(
        lambda: check(cmap(va, size, 0, h), "map"),
        lambda: check(access(va, size), "access"),
        lambda: check(unmap(va, size), "unmap"),
    )
    granules_one_access = lambda: phases(
        map_granules, lambda: check(access(va, size), "access"), unmap_granules
    )
    granules_access_each = lambda: phases(
        map_granules, access_each, lambda: [check(unmap(va + i * GRAN, GRAN), "unmap") for i in range(g)]
    )
    # Granules 1.. mapped with access; granule 0 mapped, accessed and unmapped alone (what moving
    # one granule of a handle costs while the rest of it is in use).
    one_piece_while_rest_mapped = lambda: phases(
        lambda: check(cmap(va, GRAN, 0, h), "map"),
        lambda: check(access(va, GRAN), "access"),
        lambda: check(unmap(va, GRAN), "unmap"),
    )

    run("whole handle", whole)
    if offsets:
        run("granule mappings, one set-access", granules_one_access)
        run("granule mappings, set-access each", granules_access_each)
    if offsets and g > 1:
        check(cmap(va + GRAN, size - GRAN, GRAN, h), "map rest")
        check(access(va + GRAN, size - GRAN), "access rest")
        run("one granule of it, the rest mapped", one_piece_while_rest_mapped)
        check(unmap(va + GRAN, size - GRAN), "unmap rest")
    release(h)
    # The same bytes as separate handles of one granule each.
    hs = [create(GRAN) for _ in range(g)]

    def map_handles():
        for i, hi in enumerate(hs):
            check(cmap(va + i * GRAN, GRAN, 0, hi), "map")

    separate_handles = lambda: phases(
        map_handles, lambda: check(access(va, size), "access over separate handles"), unmap_granules
    )

    run("separate one-granule handles, one set-access", separate_handles)
    for hi in hs:
        release(hi)
    free_va(va, size)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", help="write the results here as JSON too")
    args = ap.parse_args()
    global cu, PROP, GRAN
    cu = ctypes.CDLL("libcuda.so.1")
    PROP, GRAN = setup()
    result = {"granularity": GRAN, "correctness": correctness(), "timings_us": {}}
    print(json.dumps(result["correctness"], indent=1))
    offsets = result["correctness"]["map_at_offset_rc"] == 0
    if not offsets:
        print("the driver refuses a mapping at an offset into a handle: no part maps timed")
    for mib in (2, 8, 64, 512):
        rows = timings(mib * MIB, args.reps, offsets)
        result["timings_us"][f"{mib} MiB"] = rows
        for name, r in rows.items():
            print(f"{mib:>4} MiB  {name:<46} " + "  ".join(f"{k} {v:>8.1f}" for k, v in r.items()))
        sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
