//! The daemon on a real GPU (`--backend cuda`), with real tenant processes. Where the driver finds
//! no GPU every test is reported as ignored (`vram_testing`'s runner says why), unless
//! `VRAMD_REQUIRE_GPU=1`, which makes a missing GPU a failure.

mod common;

use std::time::{Duration, Instant};

use common::{wait_until, Daemon};
use serde_json::json;
use vram_core::Bytes;
use vram_device::cuda::{self, CudaDevice};

/// The GPU to test on, or `None` (after saying why) where there is none.
fn gpu() -> Option<CudaDevice> {
    vram_testing::gpu_or_skip("0")
}

fn free_on_gpu(dev: &CudaDevice) -> Bytes {
    dev.memory().expect("cuMemGetInfo").0
}

/// A small pool, so that what the pool holds does not blur the figures.
const CONFIG: &str = "[pool]\nmax = \"64 MiB\"\nsizes = [\"2 MiB\"]\ninitial = 2\n";

fn a_killed_tenants_10_gb_is_free_within_a_second() {
    let Some(dev) = gpu() else { return };
    let d = Daemon::start_on("cuda", CONFIG);
    let mut t = d.tenant("big", &["--limit", "12GiB"]);
    let before = free_on_gpu(&dev);
    let took = t.cmd("take 10GiB 1GiB");
    assert!(took["refused"].is_null(), "{took}");
    assert_eq!(
        took["dirty"], 0,
        "fresh GPU memory held someone's bytes: {took}"
    );
    let holding = free_on_gpu(&dev);
    println!("cuMemGetInfo free: {before} before, {holding} while the tenant holds 10 GiB");
    assert!(
        before.saturating_sub(holding) >= Bytes::gib(10),
        "the tenant's memory is not on the GPU"
    );

    let killed = Instant::now();
    t.kill();
    let daemon_free = wait_until(Duration::from_secs(1), || {
        d.status().devices[0].held == Bytes::ZERO
    });
    let daemon_ms = killed.elapsed().as_secs_f64() * 1e3;
    let driver_free = wait_until(Duration::from_secs(1), || {
        free_on_gpu(&dev) + Bytes::mib(64) >= before
    });
    let driver_ms = killed.elapsed().as_secs_f64() * 1e3;
    println!(
        "MEASURED crash reclaim of 10 GiB: daemon shows it free after {daemon_ms:.1} ms, \
         cuMemGetInfo after {driver_ms:.1} ms (free {} -> {})",
        holding,
        free_on_gpu(&dev)
    );
    assert!(
        daemon_free,
        "the daemon still shows the memory held after 1 s"
    );
    assert!(
        driver_free,
        "cuMemGetInfo still shows the memory in use after 1 s"
    );
    d.stop();
}

fn no_bytes_cross_from_one_tenant_to_the_next() {
    let Some(_dev) = gpu() else { return };
    let d = Daemon::start_on("cuda", CONFIG);
    // The first tenant fills 4 GiB with patterns and gives it all back; the next, and one started
    // after the first is killed holding memory, must see only zeros.
    let mut a = d.tenant("a", &[]);
    let took = a.cmd("take 4GiB 256MiB");
    assert!(took["refused"].is_null(), "{took}");
    assert_eq!(a.cmd("verify")["ok"], true);
    a.exit();
    let mut b = d.tenant("b", &[]);
    let took = b.cmd("take 4GiB 256MiB");
    assert_eq!(took["dirty"], 0, "tenant b saw tenant a's bytes: {took}");
    b.kill();
    let mut c = d.tenant("c", &[]);
    let took = c.cmd("take 6GiB 512MiB");
    assert_eq!(took["dirty"], 0, "tenant c saw tenant b's bytes: {took}");
    assert_eq!(c.cmd("verify")["ok"], true);
    c.exit();
    d.stop();
}

fn tenants_share_nothing_but_see_their_own_writes() {
    let Some(_dev) = gpu() else { return };
    let d = Daemon::start_on("cuda", CONFIG);
    let mut ts: Vec<_> = (0..3).map(|i| d.tenant(&format!("t{i}"), &[])).collect();
    for t in &mut ts {
        let took = t.cmd("take 1GiB 128MiB");
        assert!(took["refused"].is_null() && took["dirty"] == 0, "{took}");
    }
    for t in &mut ts {
        let v = t.cmd("cycles 50 2MiB");
        assert_eq!(v["errors"], 0, "{v}");
        assert_eq!(t.cmd("verify")["ok"], true);
    }
    for t in ts {
        t.exit();
    }
    assert_eq!(d.status().devices[0].held, Bytes::ZERO);
    d.stop();
}

/// Several GPUs behind one daemon, each with its own pool and books. Needs two GPUs: skips with a
/// message on one, unless `VRAMD_REQUIRE_GPUS=2`.
fn each_gpu_has_its_own_books() {
    let Some(_dev) = gpu() else { return };
    let found = cuda::probe().map(|d| d.len()).unwrap_or(0);
    if found < 2 {
        if std::env::var("VRAMD_REQUIRE_GPUS").as_deref() == Ok("2") {
            panic!("{found} GPU(s) found; VRAMD_REQUIRE_GPUS=2");
        }
        println!("skipping: {found} GPU(s); this test needs 2");
        return;
    }
    let d = Daemon::start_on("cuda", CONFIG);
    let s = d.status();
    assert!(s.devices.len() >= 2, "{:?}", s.devices);
    assert_ne!(s.devices[0].uuid, s.devices[1].uuid);
    let mut a = d.tenant("on-gpu0", &["--gpu", "0", "--limit", "8GiB"]);
    let mut b = d.tenant("on-gpu1", &["--gpu", "1", "--limit", "6GiB"]);
    let ta = a.cmd("take 4GiB 512MiB");
    let tb = b.cmd("take 6GiB 512MiB");
    assert!(ta["refused"].is_null() && ta["dirty"] == 0, "{ta}");
    assert!(tb["refused"].is_null() && tb["dirty"] == 0, "{tb}");
    // Each limit applies on its own GPU.
    let over = b.cmd("take 1GiB 512MiB");
    assert_eq!(over["refused"]["reason"], "over_limit", "{over}");
    let s = d.status();
    println!(
        "MEASURED two GPUs: held {} on {} and {} on {}",
        s.devices[0].held, s.devices[0].uuid, s.devices[1].held, s.devices[1].uuid
    );
    assert_eq!(s.devices[0].held, Bytes::gib(4));
    assert_eq!(s.devices[1].held, Bytes::gib(6));
    let on1: Vec<_> = s
        .tenants
        .iter()
        .filter(|t| t.gpu == 1)
        .map(|t| t.name.clone())
        .collect();
    assert_eq!(on1, vec!["on-gpu1".to_string()]);
    assert_eq!(a.cmd("verify")["ok"], true);
    assert_eq!(b.cmd("verify")["ok"], true);
    a.exit();
    b.exit();
    let s = d.status();
    assert_eq!(
        (s.devices[0].held, s.devices[1].held),
        (Bytes::ZERO, Bytes::ZERO)
    );
    d.stop();
}

/// A tenant that gives a grant back but keeps its import: on CUDA the daemon cannot see the
/// import, so the memory must show in the books' check against the driver (NVML) as use that is
/// lent to no one, until the import is released.
fn an_import_kept_after_its_return_is_not_lent_to_anyone() {
    use vram_client::{Client, TenantOptions};
    let Some(_dev) = gpu() else { return };
    let d = Daemon::start_on("cuda", CONFIG);
    let c = Client::connect(Some(&d.socket), &TenantOptions::named("hoarder")).unwrap();
    // The books' check runs every 500 ms: wait for two after each change.
    let settle = || std::thread::sleep(Duration::from_millis(1200));
    settle();
    let before = d.status();
    let outside_before = before
        .tenants
        .iter()
        .find(|t| t.name == "hoarder")
        .map_or(Bytes::ZERO, |t| t.outside);
    let g = c.grant(Bytes::gib(1)).unwrap();
    c.give_back_ids(vec![g.id]).unwrap();
    settle();
    let during = d.status();
    let (b, m) = (&before.devices[0], &during.devices[0]);
    let t = during.tenants.iter().find(|t| t.name == "hoarder").unwrap();
    println!(
        "MEASURED kept import on cuda: driver_used {:?} -> {:?}, outside_use {} -> {}, \
         unattributed {} -> {}, pooled {} -> {}, free {} -> {}, tenant outside {}, tenant kept {}, \
         held {}",
        b.driver_used,
        m.driver_used,
        b.outside_use,
        m.outside_use,
        b.unattributed,
        m.unattributed,
        b.pooled,
        m.pooled,
        b.free,
        m.free,
        t.outside,
        t.kept,
        t.held
    );
    // Where the kept import's memory is in the books:
    // - returned handles the daemon keeps to recycle for the same tenant stay its own (pooled:
    //   given to no other tenant, released when the tenant goes);
    // - the driver's headroom, taken off the capacity at start (never lent), absorbs up to its
    //   size of memory no process accounts for;
    // - the rest is outside use, lent to no one.
    let recycled = m.pooled.saturating_sub(b.pooled);
    let headroom = Bytes(b.capacity.get() / vramd::server::driver::DRIVER_HEADROOM);
    let unbooked = m.outside_use.saturating_sub(b.outside_use)
        + t.outside.saturating_sub(outside_before)
        + t.kept;
    assert!(
        unbooked + recycled + headroom + Bytes::mib(64) >= Bytes::gib(1),
        "a kept 1 GiB import is in nobody's books (headroom {headroom}): {m:?}"
    );
    assert!(
        b.free.saturating_sub(m.free) + Bytes::mib(64) >= unbooked,
        "memory the import keeps is still offered as free: {m:?}"
    );
    drop(g);
    settle();
    let after = d.status();
    println!(
        "MEASURED kept import released: outside_use {}, free {}",
        after.devices[0].outside_use, after.devices[0].free
    );
    assert!(after.devices[0].outside_use < b.outside_use + Bytes::mib(64));
    drop(c);
    d.stop();
}

/// Runs `program` with python3 under `vramd run` as tenant `tenant` (limit 1 GiB, GPU 0) and
/// reads the JSON line it prints.
fn run_python(d: &Daemon, tenant: &str, program: &str) -> serde_json::Value {
    let lib = common::library().expect("libvram.so");
    let out = std::process::Command::new(common::VRAMD)
        .arg("run")
        .arg("--socket")
        .arg(&d.socket)
        .args(["--tenant", tenant, "--limit", "1GiB", "--gpu", "0", "--"])
        .args(["python3", "-c", program])
        .env("VRAMD_LIB", &lib)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}{stderr}");
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}{stderr}"))
}

/// A program of the driver API (through ctypes, as XLA and CuPy reach it) under `vramd run`:
/// 8 MiB allocated with `cuMemAllocAsync` on a stream of device 0's primary context, with that
/// context current, with no context current, and (where there are two GPUs) on a stream of
/// device 1 with device 0's context current. Prints what libvram.so's hooks did with each.
const STREAM_DEVICE_PROGRAM: &str = r#"
import ctypes, json
cu = ctypes.CDLL("libcuda.so.1")
def ok(what, r):
    if r:
        raise SystemExit(f"{what}: CUresult {r}")
for f in ("cuCtxSetCurrent", "cuStreamSynchronize"):
    getattr(cu, f).argtypes = [ctypes.c_void_p]
cu.cuMemAllocAsync.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_size_t, ctypes.c_void_p]
cu.cuMemFreeAsync.argtypes = [ctypes.c_ulonglong, ctypes.c_void_p]
lib = ctypes.CDLL(None)
lib.vram_interposer_stats_json.restype = ctypes.c_void_p
lib.vram_string_free.argtypes = [ctypes.c_void_p]
def hook():
    p = lib.vram_interposer_stats_json()
    h = json.loads(ctypes.string_at(p))["hooks"]["cuMemAllocAsync"]
    lib.vram_string_free(p)
    return h["served"], h["passed"]
def primary(i):
    d, c = ctypes.c_int(), ctypes.c_void_p()
    ok("cuDeviceGet", cu.cuDeviceGet(ctypes.byref(d), i))
    ok("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(ctypes.byref(c), d))
    return c
def stream_in(ctx):
    ok("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx))
    s = ctypes.c_void_p()
    ok("cuStreamCreate", cu.cuStreamCreate(ctypes.byref(s), 1))
    return s
def alloc(stream, current, home):
    ok("cuCtxSetCurrent", cu.cuCtxSetCurrent(current))
    before = hook()
    p = ctypes.c_ulonglong()
    ok("cuMemAllocAsync", cu.cuMemAllocAsync(ctypes.byref(p), 8 << 20, stream))
    after = hook()
    ok("cuCtxSetCurrent", cu.cuCtxSetCurrent(home))
    ok("cuMemFreeAsync", cu.cuMemFreeAsync(p, stream))
    ok("cuStreamSynchronize", cu.cuStreamSynchronize(stream))
    return {"served": after[0] - before[0], "passed": after[1] - before[1]}
ok("cuInit", cu.cuInit(0))
n = ctypes.c_int()
ok("cuDeviceGetCount", cu.cuDeviceGetCount(ctypes.byref(n)))
c0 = primary(0)
s0 = stream_in(c0)
out = {"devices": n.value, "current": alloc(s0, c0, c0), "no_current": alloc(s0, None, c0)}
if n.value > 1:
    c1 = primary(1)
    s1 = stream_in(c1)
    out["other_gpu_stream"] = alloc(s1, c0, c1)
print(json.dumps(out), flush=True)
"#;

/// A stream-ordered allocation is made on its stream's GPU, whichever context the calling
/// thread has current (none, on a thread that never chose a device): on the tenant's GPU vramd
/// serves it, on another GPU's stream the driver does.
fn a_stream_ordered_allocation_goes_where_its_stream_is() {
    let Some(_dev) = gpu() else { return };
    let d = Daemon::start_on("cuda", CONFIG);
    let got = run_python(&d, "streams", STREAM_DEVICE_PROGRAM);
    println!("MEASURED stream-ordered allocations by stream: {got}");
    let served = json!({"served": 1, "passed": 0});
    assert_eq!(got["current"], served, "{got}");
    assert_eq!(got["no_current"], served, "{got}");
    if got["devices"].as_u64() > Some(1) {
        assert_eq!(got["other_gpu_stream"], json!({"served": 0, "passed": 1}));
    } else {
        println!("(one GPU: a stream of another GPU was not tried)");
    }
    d.stop();
}

/// A program of the driver API (through ctypes) under `vramd run`, allocating 8 MiB from each
/// of three pools it makes on device 0's primary context: one on the device (vramd's memory), one
/// on the host (the driver's; the CPU writes it), one whose allocations may be exported (the
/// driver's, charged by what the pool reserves, until it gives it back). Prints what the hooks
/// did with each, how the free memory moved (the tenant's view under vramd, the device's
/// without) and what the driver said.
const POOL_PROGRAM: &str = r#"
import ctypes, json
cu = ctypes.CDLL("libcuda.so.1")
def ok(what, r):
    if r:
        raise SystemExit(f"{what}: CUresult {r}")
class Props(ctypes.Structure):
    _fields_ = [("alloc_type", ctypes.c_int), ("handle_types", ctypes.c_int),
                ("location_type", ctypes.c_int), ("location_id", ctypes.c_int),
                ("win32", ctypes.c_void_p), ("max_size", ctypes.c_size_t),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 54)]
P, S = ctypes.POINTER, ctypes.c_size_t
cu.cuMemPoolCreate.argtypes = [P(ctypes.c_void_p), P(Props)]
cu.cuMemPoolDestroy.argtypes = [ctypes.c_void_p]
cu.cuMemAllocFromPoolAsync.argtypes = [P(ctypes.c_ulonglong), S, ctypes.c_void_p, ctypes.c_void_p]
cu.cuMemFreeAsync.argtypes = [ctypes.c_ulonglong, ctypes.c_void_p]
cu.cuMemPoolExportPointer.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong]
cu.cuMemGetInfo_v2.argtypes = [P(S), P(S)]
for f in ("cuCtxSetCurrent", "cuStreamSynchronize"):
    getattr(cu, f).argtypes = [ctypes.c_void_p]
cu.cuMemPoolExportToShareableHandle.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                                ctypes.c_ulonglong]
lib = ctypes.CDLL(None)
# Without libvram.so (the driver alone, for comparison) there are no hooks to count.
vramd = hasattr(lib, "vram_interposer_stats_json")
if vramd:
    lib.vram_interposer_stats_json.restype = ctypes.c_void_p
    lib.vram_string_free.argtypes = [ctypes.c_void_p]
class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]
cu.cuMemAllocAsync.argtypes = [P(ctypes.c_ulonglong), S, ctypes.c_void_p]
cu.cuDeviceSetMemPool.argtypes = [ctypes.c_int, ctypes.c_void_p]
cu.cuDeviceGetDefaultMemPool.argtypes = [P(ctypes.c_void_p), ctypes.c_int]
def hooks(first="cuMemAllocFromPoolAsync"):
    if not vramd:
        return [0, 0, 0]
    p = lib.vram_interposer_stats_json()
    h = json.loads(ctypes.string_at(p))["hooks"]
    lib.vram_string_free(p)
    a, b = h[first], h["cuMemAllocFromPoolAsync_driver_pool"]
    return [a["served"], b["served"], b["passed"]]
def free_memory():
    f, t = S(), S()
    ok("cuMemGetInfo", cu.cuMemGetInfo_v2(ctypes.byref(f), ctypes.byref(t)))
    return f.value
ok("cuInit", cu.cuInit(0))
d, c, s = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
ok("cuDeviceGet", cu.cuDeviceGet(ctypes.byref(d), 0))
ok("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(ctypes.byref(c), d))
ok("cuCtxSetCurrent", cu.cuCtxSetCurrent(c))
ok("cuStreamCreate", cu.cuStreamCreate(ctypes.byref(s), 1))
N = 8 << 20
def case(handle_types, location_type):
    pool = ctypes.c_void_p()
    r = cu.cuMemPoolCreate(ctypes.byref(pool), ctypes.byref(Props(1, handle_types, location_type, 0)))
    if r:
        return {"pool_refused": r}
    before_hooks, before_free = hooks(), free_memory()
    p = ctypes.c_ulonglong()
    ok("cuMemAllocFromPoolAsync", cu.cuMemAllocFromPoolAsync(ctypes.byref(p), N, pool, s))
    ok("cuStreamSynchronize", cu.cuStreamSynchronize(s))
    out = {"hooks": [a - b for a, b in zip(hooks(), before_hooks)],
           "charged": before_free - free_memory()}
    if location_type == 2:
        ctypes.memset(p.value, 7, N)
        out["cpu_wrote"] = ctypes.string_at(p.value + N - 4, 4) == b"\x07" * 4
    if handle_types:
        fd = ctypes.c_int(-1)
        out["pool_exported"] = cu.cuMemPoolExportToShareableHandle(ctypes.byref(fd), pool, 1, 0)
        data = (ctypes.c_ubyte * 64)()
        out["exported"] = cu.cuMemPoolExportPointer(data, p)
    ok("cuMemFreeAsync", cu.cuMemFreeAsync(p, s))
    ok("cuStreamSynchronize", cu.cuStreamSynchronize(s))
    out["uncharged"] = free_memory() == before_free
    ok("cuMemPoolDestroy", cu.cuMemPoolDestroy(pool))
    out["back_at_destroy"] = free_memory() == before_free
    return out
def host_default():
    """From the host's default pool (CUDA 13's cuMemGetDefaultMemPool)."""
    if not hasattr(cu, "cuMemGetDefaultMemPool"):
        return {"pool_refused": "no cuMemGetDefaultMemPool"}
    cu.cuMemGetDefaultMemPool.argtypes = [P(ctypes.c_void_p), P(Location), ctypes.c_int]
    pool = ctypes.c_void_p()
    r = cu.cuMemGetDefaultMemPool(ctypes.byref(pool), ctypes.byref(Location(2, 0)), 1)
    if r:
        return {"pool_refused": r}
    before_hooks, before_free = hooks(), free_memory()
    p = ctypes.c_ulonglong()
    ok("cuMemAllocFromPoolAsync", cu.cuMemAllocFromPoolAsync(ctypes.byref(p), N, pool, s))
    ok("cuStreamSynchronize", cu.cuStreamSynchronize(s))
    out = {"hooks": [a - b for a, b in zip(hooks(), before_hooks)],
           "charged": before_free - free_memory()}
    ctypes.memset(p.value, 7, N)
    out["cpu_wrote"] = ctypes.string_at(p.value + N - 4, 4) == b"\x07" * 4
    ok("cuMemFreeAsync", cu.cuMemFreeAsync(p, s))
    ok("cuStreamSynchronize", cu.cuStreamSynchronize(s))
    return out
def current_exportable():
    """cuMemAllocAsync with an exportable pool made current for the device."""
    pool, default = ctypes.c_void_p(), ctypes.c_void_p()
    ok("cuMemPoolCreate", cu.cuMemPoolCreate(ctypes.byref(pool), ctypes.byref(Props(1, 1, 1, 0))))
    ok("cuDeviceGetDefaultMemPool", cu.cuDeviceGetDefaultMemPool(ctypes.byref(default), d))
    ok("cuDeviceSetMemPool", cu.cuDeviceSetMemPool(d, pool))
    before_hooks, before_free = hooks("cuMemAllocAsync"), free_memory()
    p = ctypes.c_ulonglong()
    ok("cuMemAllocAsync", cu.cuMemAllocAsync(ctypes.byref(p), N, s))
    ok("cuStreamSynchronize", cu.cuStreamSynchronize(s))
    out = {"hooks": [a - b for a, b in zip(hooks("cuMemAllocAsync"), before_hooks)],
           "charged": before_free - free_memory()}
    data = (ctypes.c_ubyte * 64)()
    out["exported"] = cu.cuMemPoolExportPointer(data, p)
    ok("cuMemFreeAsync", cu.cuMemFreeAsync(p, s))
    ok("cuStreamSynchronize", cu.cuStreamSynchronize(s))
    ok("cuDeviceSetMemPool", cu.cuDeviceSetMemPool(d, default))
    ok("cuMemPoolDestroy", cu.cuMemPoolDestroy(pool))
    out["back_at_destroy"] = free_memory() == before_free
    # The device's own pool current again: vramd serves.
    before_hooks = hooks("cuMemAllocAsync")
    ok("cuMemAllocAsync", cu.cuMemAllocAsync(ctypes.byref(p), N, s))
    ok("cuMemFreeAsync", cu.cuMemFreeAsync(p, s))
    ok("cuStreamSynchronize", cu.cuStreamSynchronize(s))
    out["hooks_after"] = [a - b for a, b in zip(hooks("cuMemAllocAsync"), before_hooks)]
    return out
print(json.dumps({"device": case(0, 1), "host": case(0, 2), "exportable": case(1, 1),
                  "host_default": host_default(), "current": current_exportable()}), flush=True)
"#;

/// Pools a program makes: vramd serves the one on its GPU; the one on the host (which the CPU
/// must be able to write) and the one whose allocations may be exported are the driver's, the
/// latter charged by what it reserves: the tenant's free memory moves as the device's does for
/// the same program run without vramd (down by the pool's reservation, not back at the free),
/// the driver's answers (the CPU's write, the exports) are the same, and the charge goes back
/// when the pool is destroyed. The host's default pool is the driver's as a host pool made here
/// is, and an exportable pool made current for the device makes `cuMemAllocAsync` the driver's.
fn a_pool_on_the_host_or_for_export_is_the_drivers() {
    let Some(_dev) = gpu() else { return };
    let d = Daemon::start_on("cuda", CONFIG);
    let got = run_python(&d, "pools", POOL_PROGRAM);
    println!("MEASURED allocations from pools the program made: {got}");
    let plain = std::process::Command::new("python3")
        .args(["-c", POOL_PROGRAM])
        .output()
        .unwrap();
    let plain: serde_json::Value =
        serde_json::from_slice(&plain.stdout).unwrap_or_else(|e| panic!("{e}: {plain:?}"));
    println!("MEASURED the same without vramd: {plain}");
    for key in ["pool_exported", "exported", "charged", "uncharged"] {
        assert_eq!(got["exportable"][key], plain["exportable"][key], "{key}");
    }
    // The charge goes with the pool (the device may take a moment longer to show the memory
    // free, which the driver's figures then book as the tenant's outside memory meanwhile).
    assert_eq!(got["exportable"]["back_at_destroy"], json!(true), "{got}");
    assert_eq!(got["host"]["cpu_wrote"], plain["host"]["cpu_wrote"]);
    let mib8 = 8u64 << 20;
    // [served by vramd's allocator, charged as the driver's, passed uncharged]
    assert_eq!(got["device"]["hooks"], json!([1, 0, 0]), "{got}");
    assert_eq!(got["exportable"]["hooks"], json!([0, 1, 0]), "{got}");
    assert!(got["exportable"]["charged"].as_u64() >= Some(mib8), "{got}");
    for host in ["host", "host_default"] {
        if got[host].get("pool_refused").is_some() {
            println!("(the driver gives no pool on the host for `{host}`: not tried)");
        } else {
            assert_eq!(got[host]["hooks"], json!([0, 0, 1]), "{host}: {got}");
            assert_eq!(got[host]["charged"], json!(0), "{host}: {got}");
            assert_eq!(got[host]["cpu_wrote"], json!(true), "{host}: {got}");
        }
    }
    // An exportable pool current for the device: cuMemAllocAsync is the driver's, charged as
    // the device's memory moves without vramd, and its pointer exports as without vramd; with
    // the device's own pool current again, vramd serves.
    for key in ["exported", "charged"] {
        assert_eq!(got["current"][key], plain["current"][key], "current: {key}");
    }
    assert_eq!(got["current"]["hooks"], json!([0, 1, 0]), "{got}");
    assert_eq!(got["current"]["hooks_after"], json!([1, 0, 0]), "{got}");
    assert_eq!(got["current"]["back_at_destroy"], json!(true), "{got}");
    d.stop();
}

vram_testing::gpu_main! {
    tests: [
        a_killed_tenants_10_gb_is_free_within_a_second,
        no_bytes_cross_from_one_tenant_to_the_next,
        tenants_share_nothing_but_see_their_own_writes,
        each_gpu_has_its_own_books,
        a_stream_ordered_allocation_goes_where_its_stream_is,
        a_pool_on_the_host_or_for_export_is_the_drivers,
        an_import_kept_after_its_return_is_not_lent_to_anyone,
    ],
}
