//! libvram.so: the caching allocator of `vram-client` behind a C ABI (`include/vram.h`), for
//! PyTorch's `CUDAPluggableAllocator` and any C program. The process-wide tenant is set up by
//! `vram_init` (`init`: the options in a struct, the environment for those left unset), or on
//! first use from the environment (`VRAMD_SOCKET`, `VRAMD_TENANT`, `VRAMD_LIMIT`,
//! `VRAMD_GUARANTEE`, `VRAMD_CLASS`, `VRAMD_GPU`: `TenantOptions::from_env`), and `VRAMD_ALLOC`
//! for allocator settings such as `min_grow=16MiB,max_handle=32MiB`.
//!
//! Preloaded (`vramd run` does it), the library also interposes the CUDA runtime's allocation
//! calls in pool mode (`cudart`) and, always, the driver's and NVML's memory calls and `dlsym`
//! (`interpose`): every device allocation the process makes through them goes through vramd.
//! Memory the driver gives by other calls (CUDA arrays, graph memory nodes) is not hooked; the
//! daemon counts it as the tenant's use outside its grants where NVML reports each process.
//!
//! Nothing here aborts or unwinds into C: every entry point catches panics, and errors go to the
//! calling thread's `vram_last_error`. Refusals made here are reported to the daemon (`refusal`).

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, LazyLock, Mutex, OnceLock};
use std::time::{Duration, Instant};

use vram_client::alloc::{
    CachingAllocator, CaptureNotices, ClientSlot, CudaEvents, DaemonSource, HostEvents,
    MappedBacking, StreamEvents,
};
use vram_client::{Client, TenantOptions};
use vram_core::alloc::{AllocConfig, PoolId};
use vram_core::Bytes;
use vram_device::BackendKind;
use vram_proto::DeviceDesc;

mod cudart;
mod init;
mod interpose;
mod refusal;
mod shared;
pub use cudart::{vram_interposed_calls, vram_interposing};
pub use init::{vram_init, VramOptions, VRAM_ERR_CONNECTED, VRAM_OPTION_GPU};
pub use interpose::stats::vram_interposer_stats_json;
pub use shared::VramShared;

/// The process's tenant: its connection and its allocator. The allocator (and its address
/// reservation) is made at the first connect and lives as long as the process; the connection
/// may end (`vram_disconnect`) and another tenant of the same device take its place
/// (`vram_connect`, or the next call that needs memory), so a process that runs one job after
/// another (a Ray worker) is a new tenant for each.
pub struct Tenant {
    slot: Arc<ClientSlot>,
    /// Whether `slot` holds a connection: read on every call, so kept apart from the slot's lock.
    connected: AtomicBool,
    pub alloc: CachingAllocator<DaemonSource>,
    pub gpu: u32,
    /// The device the allocator maps; every tenant this process becomes is on it.
    pub device: DeviceDesc,
}

impl Tenant {
    /// The connection of the tenant this process is now.
    pub fn client(&self) -> Result<Arc<Client>, String> {
        self.slot
            .get()
            .ok_or_else(|| "vramd: this process is no tenant now (its tenant ended)".to_string())
    }
}

static TENANT: OnceLock<Tenant> = OnceLock::new();

/// Set in a child forked from a tenant process (`pthread_atfork`). The child has a copy of the
/// parent's connection and allocator books, which are the parent's, not its own: it is no tenant,
/// and nothing of the parent's is used or sent from it.
pub(crate) static FORKED: AtomicBool = AtomicBool::new(false);

extern "C" fn forked_child() {
    FORKED.store(true, Ordering::Relaxed);
}

/// The process's tenant as it stands, without connecting; none in a forked child.
pub(crate) fn current() -> Option<&'static Tenant> {
    if FORKED.load(Ordering::Relaxed) {
        return None;
    }
    TENANT.get()
}

/// Why a forked child of a tenant process gets no memory from vramd.
pub(crate) fn forked_error() -> String {
    format!(
        "vramd: this process (pid {}) was forked from a tenant process: the connection it \
         inherited is its parent's, so it is not a tenant",
        std::process::id()
    )
}

/// The last failed attempt to set the tenant up, and when: attempts are spaced by
/// [`CONNECT_RETRY`], so a program allocating in a loop while the daemon is away (or its name
/// still held by a predecessor the daemon has not reaped) does not hammer the socket, and gets
/// memory once the daemon admits it.
static LAST_FAILURE: Mutex<Option<(Instant, String)>> = Mutex::new(None);
const CONNECT_RETRY: Duration = Duration::from_millis(100);

/// Graph captures the application announces (`vram_capture_begin`/`_end`); they may come before
/// the first allocation connects the tenant.
static NOTICES: LazyLock<Arc<CaptureNotices>> = LazyLock::new(Arc::default);

thread_local! {
    static LAST_ERROR: RefCell<Option<CString>> = const { RefCell::new(None) };
}

/// Leaves `msg` as the calling thread's last error. Nothing is kept on a thread whose
/// thread-local storage is already gone (a call from a destructor run at its exit).
fn set_error(msg: String) {
    let c = CString::new(msg.replace('\0', " ")).expect("no NUL left");
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = Some(c));
}

/// Whether this process, not a tenant yet, would become one by taking the run's invitation
/// (`VRAMD_JOIN`, no name of its own): the invitation admits one process, the first that needs
/// memory, so a question about memory (a monitor asking NVML, a framework sizing itself) must
/// not take it.
pub(crate) fn would_join() -> bool {
    current().is_none() && options_from_env().is_ok_and(|o| o.join.is_some())
}

fn options_from_env() -> Result<TenantOptions, String> {
    TenantOptions::from_env().map_err(|e| format!("vramd: {e}"))
}

/// Registers with the daemon as `opts` asks, and installs the reclaim handler.
fn register(socket: Option<&Path>, opts: &TenantOptions) -> Result<Arc<Client>, String> {
    let client = Arc::new(Client::connect(socket, opts).map_err(|e| format!("vramd: {e}"))?);
    client.on_reclaim(Box::new(|_, _| {
        *RECLAIM_REQUESTS.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        RECLAIM_ASKED.notify_all();
        match current() {
            Some(t) => t.alloc.trim(),
            None => Bytes::ZERO,
        }
    }));
    Ok(client)
}

/// The process's first tenant: its connection, and the allocator every later tenant shares.
fn first(client: Arc<Client>) -> Result<Tenant, String> {
    let w = client.welcome().clone();
    let events: Box<dyn StreamEvents> = match w.device.backend {
        BackendKind::Host => Box::new(HostEvents),
        BackendKind::Cuda => {
            let dev = vram_device::CudaDevice::open(&w.device.uuid)
                .map_err(|e| format!("vramd: cannot open GPU {}: {e}", w.device.uuid))?;
            Box::new(CudaEvents::with_notices(&dev, NOTICES.clone()))
        }
    };
    let mut config = AllocConfig {
        granularity: w.device.granularity,
        ..AllocConfig::default()
    };
    if let Ok(v) = std::env::var(vram_proto::env::ALLOC) {
        config
            .set_all(&v)
            .map_err(|e| format!("vramd: VRAMD_ALLOC: {e}"))?;
    }
    let device = client.device().clone();
    let slot = Arc::new(ClientSlot::new(client));
    let backing = MappedBacking::new(device, config.va_bytes, DaemonSource::through(slot.clone()))
        .map_err(|e| format!("vramd: cannot reserve address space: {e}"))?;
    let alloc = CachingAllocator::new(config, backing, events).with_limit(w.limit);
    Ok(Tenant {
        slot,
        connected: AtomicBool::new(true),
        alloc,
        gpu: w.device.index,
        device: w.device,
    })
}

/// Makes the process the tenant `opts` asks for: its first, or the next one after an ended one
/// (on the same device, since the allocator's memory is mapped from it). Called with
/// `LAST_FAILURE` held, so that one thread connects at a time.
fn establish(socket: Option<&Path>, opts: &TenantOptions) -> Result<&'static Tenant, String> {
    let client = register(socket, opts)?;
    if let Some(t) = TENANT.get() {
        let w = client.welcome();
        if w.device.uuid != t.device.uuid {
            return Err(format!(
                "vramd: tenant `{}` was admitted on device {} ({}), but this process's memory \
                 is mapped from device {} ({}): a process stays on one device",
                w.name, w.device.index, w.device.uuid, t.device.index, t.device.uuid
            ));
        }
        t.alloc.set_limit(w.limit);
        t.slot.replace(Some(client));
        t.connected.store(true, Ordering::Release);
        return Ok(t);
    }
    let t = first(client)?;
    let t = TENANT.get_or_init(|| t);
    start_housekeeping();
    // SAFETY: `say_bye` is an `extern "C" fn()` that catches panics and only sends a
    // message; registering it has no other precondition.
    if unsafe { libc::atexit(say_bye) } != 0 {
        tracing::debug!("cannot register the exit handler: the end will read as a crash");
    }
    Ok(t)
}

/// Registers [`forked_child`] once, before the first connect takes any lock: a child forked while
/// another thread sets the tenant up (holding `LAST_FAILURE`) must know it is no tenant before it
/// would wait on its copy of that lock. (A process that reaches here has a CUDA context, which a
/// forked child cannot use either.)
fn mark_forked_children() {
    static REGISTERED: std::sync::Once = std::sync::Once::new();
    REGISTERED.call_once(|| {
        // SAFETY: `forked_child` is an `extern "C" fn()` that only stores an atomic, which is
        // safe in a child between fork and exec; there are no prepare or parent handlers.
        if unsafe { libc::pthread_atfork(None, None, Some(forked_child)) } != 0 {
            tracing::debug!(
                "cannot register the fork handler: a forked child would be taken for us"
            );
        }
    });
}

/// Keeps the daemon informed and lets idle memory go back with hysteresis.
fn start_housekeeping() {
    let _ = std::thread::Builder::new()
        .name("vram-housekeeping".into())
        .spawn(|| {
            let start = Instant::now();
            let mut last = (0, Bytes(u64::MAX), Bytes(u64::MAX));
            loop {
                std::thread::sleep(Duration::from_millis(200));
                let Some(t) = TENANT.get() else { return };
                let Some(client) = t.slot.get() else { continue };
                t.alloc.tick(start.elapsed().as_micros() as u64);
                let s = t.alloc.stats();
                // A caching layer above (PyTorch's, in pool mode) knows what of its segments is
                // in use; the rest of what the tenant holds is cached.
                let (in_use, cached) = match CALLER_IN_USE.load(Ordering::Relaxed) {
                    u64::MAX => (s.in_use, s.cached),
                    n => {
                        let in_use = Bytes(n).min(s.core.held);
                        (in_use, s.core.held.saturating_sub(in_use))
                    }
                };
                let now = (client.welcome().tenant, in_use, cached);
                // A failure is a connection that ended or is being re-established: the next
                // reading is sent again.
                if now != last && client.report_usage(in_use, cached).is_ok() {
                    last = now;
                }
            }
        });
}

/// The process's tenant, connecting on first use (and on the first use after its tenant ended);
/// a failed connect is tried again on a later call, at most every 100 ms (so a program
/// allocating in a loop does not hammer the socket).
pub fn tenant() -> Result<&'static Tenant, String> {
    if let Some(t) = current().filter(|t| t.connected.load(Ordering::Acquire)) {
        return Ok(t);
    }
    if FORKED.load(Ordering::Relaxed) {
        return Err(forked_error());
    }
    mark_forked_children();
    // One thread connects at a time; the others wait for its outcome.
    let mut last = LAST_FAILURE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(t) = TENANT.get().filter(|t| t.connected.load(Ordering::Acquire)) {
        return Ok(t);
    }
    if let Some((at, why)) = last.as_ref() {
        if at.elapsed() < CONNECT_RETRY {
            return Err(why.clone());
        }
    }
    match options_from_env().and_then(|opts| establish(None, &opts)) {
        Ok(t) => {
            *last = None;
            Ok(t)
        }
        Err(e) => {
            *last = Some((Instant::now(), e.clone()));
            Err(e)
        }
    }
}

/// At a normal exit (`exit`, returning from `main`): the daemon hears that the process is
/// finishing, so that its end is logged as a finish, not as a crash. A process killed by a
/// signal never gets here, and its end is a crash as it should be.
extern "C" fn say_bye() {
    let _ = catch_unwind(|| {
        if let Some(c) = current().and_then(|t| t.slot.get()) {
            c.bye();
        }
    });
}

/// A C string argument that may be NULL (then `None`).
///
/// # Safety
///
/// `s` is NULL or points to a NUL-terminated string that stays alive for the call.
unsafe fn optional_text(s: *const c_char, what: &str) -> Result<Option<String>, String> {
    if s.is_null() {
        return Ok(None);
    }
    // SAFETY: not NULL, and NUL-terminated and alive for the call (this function's contract).
    let s = unsafe { CStr::from_ptr(s) }.to_str();
    s.map(|s| Some(s.to_string()).filter(|s| !s.is_empty()))
        .map_err(|_| format!("vramd: {what} is not UTF-8"))
}

/// # Safety
///
/// As [`optional_text`].
unsafe fn optional_bytes(s: *const c_char, what: &str) -> Result<Option<Bytes>, String> {
    // SAFETY: this function's contract is `optional_text`'s.
    unsafe { optional_text(s, what) }?
        .map(|v| v.parse().map_err(|e| format!("vramd: {what} `{v}`: {e}")))
        .transpose()
}

/// See `include/vram.h`.
///
/// # Safety
///
/// Each string argument is NULL or a NUL-terminated string alive for the call.
#[no_mangle]
pub unsafe extern "C" fn vram_connect(
    socket: *const c_char,
    name: *const c_char,
    tenant_class: *const c_char,
    guarantee: *const c_char,
    limit: *const c_char,
    gpu: c_int,
) -> c_int {
    guarded(-1, || {
        let mut opts = options_from_env()?;
        // With nothing asked, the tenant is first use's: under `vramd run`, the run's (its
        // invitation). Anything asked is a tenant of its own, which the invitation is not for.
        let asked = !(socket.is_null()
            && name.is_null()
            && tenant_class.is_null()
            && guarantee.is_null()
            && limit.is_null()
            && gpu < 0);
        if asked {
            opts.join = None;
        }
        // SAFETY: the arguments are NULL or NUL-terminated strings alive for this call (this
        // function's contract).
        if let Some(n) = unsafe { optional_text(name, "name") }? {
            opts.name = n;
        }
        // SAFETY: as above.
        if let Some(c) = unsafe { optional_text(tenant_class, "class") }? {
            opts.class = Some(c);
        }
        // SAFETY: as above.
        if let Some(g) = unsafe { optional_bytes(guarantee, "guarantee") }? {
            opts.guarantee = Some(g);
        }
        // SAFETY: as above.
        if let Some(l) = unsafe { optional_bytes(limit, "limit") }? {
            opts.limit = Some(l);
        }
        if gpu >= 0 {
            opts.gpu = Some(gpu as u32);
        }
        // SAFETY: as above.
        let socket = unsafe { optional_text(socket, "socket") }?.map(std::path::PathBuf::from);
        match connect_now(socket.as_deref(), &opts)? {
            Connected::Now => Ok(0),
            Connected::Already(name) => Err(format!(
                "vramd: this process is tenant `{name}` already; end it first (vram_disconnect)"
            )),
        }
    })
}

/// What [`connect_now`] found.
enum Connected {
    /// The process is the tenant asked for now.
    Now,
    /// The process was a tenant already (this one, by name); nothing was asked of the daemon.
    Already(String),
}

/// Makes the process the tenant `opts` asks for, unless it is a tenant now.
fn connect_now(socket: Option<&Path>, opts: &TenantOptions) -> Result<Connected, String> {
    if FORKED.load(Ordering::Relaxed) {
        return Err(forked_error());
    }
    let mut last = LAST_FAILURE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(t) = TENANT.get().filter(|t| t.connected.load(Ordering::Acquire)) {
        let name = t
            .client()
            .map(|c| c.welcome().name.clone())
            .unwrap_or_default();
        return Ok(Connected::Already(name));
    }
    establish(socket, opts)?;
    *last = None;
    Ok(Connected::Now)
}

/// See `include/vram.h`.
///
/// # Safety
///
/// `socket` is NULL or a NUL-terminated string alive for the call.
#[no_mangle]
pub unsafe extern "C" fn vram_status_json(socket: *const c_char) -> *mut c_char {
    guarded(std::ptr::null_mut(), || {
        // SAFETY: NULL or NUL-terminated and alive for the call (this function's contract).
        let socket = unsafe { optional_text(socket, "socket") }?.map(std::path::PathBuf::from);
        let report = vram_client::Observer::connect(socket.as_deref())
            .and_then(|o| o.status())
            .map_err(|e| format!("vramd: {e}"))?;
        let s = serde_json::to_string(&report).map_err(|e| e.to_string())?;
        Ok(CString::new(s).map_err(|e| e.to_string())?.into_raw())
    })
}

/// See `include/vram.h`.
#[no_mangle]
pub extern "C" fn vram_disconnect() -> c_int {
    guarded(-1, || {
        // Before the lock, which a forked child may have inherited held.
        let Some(t) = current() else {
            return Ok(0);
        };
        let _one_at_a_time = LAST_FAILURE.lock().unwrap_or_else(|p| p.into_inner());
        let Some(client) = t.slot.get() else {
            return Ok(0);
        };
        let name = client.welcome().name.clone();
        let open = shared::OPEN.load(Ordering::Relaxed);
        if open > 0 {
            return Err(format!(
                "vramd: tenant `{name}` cannot end with {open} shared buffer handle(s) open; \
                 close them first (vram_shared_close)"
            ));
        }
        t.alloc.trim();
        let b = client.budget().map_err(|e| format!("vramd: {e}"))?;
        // What the daemon holds for the tenant beyond the allocator's handles is its shared
        // buffers' versions, mapped nowhere in this process (no handle is open): they end with it.
        // So do the charges of exported handles this process let go (an importer's now).
        let let_go = Bytes(interpose::vmm::exported_let_go());
        let charged = b.charged.saturating_sub(let_go);
        // Checked with the allocator's core held, and the connection taken out of use before it
        // is let go: another thread's growth meanwhile would otherwise map handles of a
        // connection about to close (the daemon then takes them back as at a crash).
        t.alloc.with_stats_held(|s| {
            if s.in_use > Bytes::ZERO || s.core.held > Bytes::ZERO || charged > Bytes::ZERO {
                return Err(format!(
                    "vramd: tenant `{name}` cannot end while its memory is in use: {} allocated \
                     and not freed ({} mapped), {charged} charged; free it first",
                    s.in_use, s.core.held
                ));
            }
            t.connected.store(false, Ordering::Release);
            t.slot.replace(None);
            Ok(())
        })?;
        client.close();
        interpose::vmm::forget_exported_let_go();
        Ok(0)
    })
}

/// [`tenant`] where its failure only means "not vramd's": none where it cannot be set up, and a
/// panic on the way caught here, since the callers are inside the program's CUDA calls.
fn tenant_or_none() -> Option<&'static Tenant> {
    catch_unwind(tenant).ok().and_then(Result::ok)
}

fn guarded<R>(fallback: R, f: impl FnOnce() -> Result<R, String>) -> R {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(r)) => r,
        Ok(Err(msg)) => {
            set_error(msg);
            fallback
        }
        Err(_) => {
            set_error("vramd: internal error (a panic was caught at the C boundary)".into());
            fallback
        }
    }
}

fn check_device(t: &Tenant, device: c_int) -> Result<(), String> {
    // The tenant's own GPU, whatever its ordinal in this process (`VRAM_TENANT_DEVICE`).
    if device == -1 {
        return Ok(());
    }
    if !is_tenant_ordinal(t, device) {
        return Err(format!(
            "vramd: device {device} asked for, but this process is a tenant of the daemon's gpu \
             {} ({})",
            t.gpu, t.device.uuid
        ));
    }
    Ok(())
}

/// Whether the program's device `ordinal` (CUDA's numbering, after `CUDA_VISIBLE_DEVICES`) is
/// the tenant's GPU: by UUID on CUDA, where the daemon numbers the node's GPUs its own way; on the
/// host backend, which has no UUIDs, by the daemon's number.
pub(crate) fn is_tenant_ordinal(t: &Tenant, ordinal: c_int) -> bool {
    match t.device.backend {
        BackendKind::Cuda => ordinal >= 0 && interpose::is_tenant_device(t, ordinal),
        BackendKind::Host => u32::try_from(ordinal) == Ok(t.gpu),
    }
}

/// See `include/vram.h`.
#[no_mangle]
pub extern "C" fn vram_alloc(size: isize, device: c_int, stream: *mut c_void) -> *mut c_void {
    guarded(std::ptr::null_mut(), || {
        let t = tenant()?;
        let refused = |reason: &str, message: String| {
            refusal::refused_here(t, Bytes(size.max(0) as u64), reason, &message);
            message
        };
        check_device(t, device).map_err(|m| refused("other", m))?;
        let size = u64::try_from(size)
            .map_err(|_| refused("bad_size", format!("vramd: negative size {size}")))?;
        let stream = vram_client::alloc::stream_of(stream as u64, false);
        let ptr = t
            .alloc
            .alloc(Bytes(size), stream)
            .map_err(|e| refusal::alloc_refused(t, "vram_alloc", Bytes(size), &e))?;
        Ok(ptr as *mut c_void)
    })
}

/// See `include/vram.h`.
#[no_mangle]
pub extern "C" fn vram_free(ptr: *mut c_void, _size: isize, device: c_int, stream: *mut c_void) {
    guarded((), || {
        if ptr.is_null() {
            return Ok(());
        }
        let t = tenant()?;
        check_device(t, device)?;
        t.alloc
            .free(
                ptr as u64,
                vram_client::alloc::stream_of(stream as u64, false),
            )
            .map(drop)
            .map_err(|e| format!("vramd: {e}"))
    })
}

/// See `include/vram.h`.
#[no_mangle]
pub extern "C" fn vram_pool_begin(device: c_int, pool_a: u64, pool_b: u64) -> c_int {
    guarded(-1, || {
        let t = tenant()?;
        check_device(t, device)?;
        t.alloc.pool_begin(PoolId(pool_a, pool_b));
        Ok(0)
    })
}

/// See `include/vram.h`. The steps of `vram_alloc`, written again: `vram_alloc` sharing a helper
/// with it measured slower on the thread-cache fast path (docs/benchmarks.md).
#[no_mangle]
pub extern "C" fn vram_pool_alloc(
    size: isize,
    device: c_int,
    stream: *mut c_void,
    pool_a: u64,
    pool_b: u64,
) -> *mut c_void {
    guarded(std::ptr::null_mut(), || {
        let t = tenant()?;
        let refused = |reason: &str, message: String| {
            refusal::refused_here(t, Bytes(size.max(0) as u64), reason, &message);
            message
        };
        check_device(t, device).map_err(|m| refused("other", m))?;
        let size = u64::try_from(size)
            .map_err(|_| refused("bad_size", format!("vramd: negative size {size}")))?;
        let stream = vram_client::alloc::stream_of(stream as u64, false);
        let ptr = t
            .alloc
            .alloc_in_pool(Bytes(size), stream, PoolId(pool_a, pool_b))
            .map_err(|e| refusal::alloc_refused(t, "vram_pool_alloc", Bytes(size), &e))?;
        Ok(ptr as *mut c_void)
    })
}

/// See `include/vram.h`.
#[no_mangle]
pub extern "C" fn vram_pool_release(device: c_int, pool_a: u64, pool_b: u64) -> c_int {
    guarded(-1, || {
        // A graph released after the tenant ended (at the program's exit) has nothing to give.
        let Some(t) = current() else {
            return Ok(0);
        };
        check_device(t, device)?;
        t.alloc.pool_release(PoolId(pool_a, pool_b));
        Ok(0)
    })
}

/// The C ABI's version: raised whenever a function of `include/vram.h` changes its signature or
/// meaning, goes, or comes (a caller that needs it must not load a library without it), so that
/// a caller built for another (the Python package) can refuse this library with the reason
/// rather than call it wrongly.
pub const ABI_VERSION: u32 = 2;

/// See `include/vram.h`.
#[no_mangle]
pub extern "C" fn vram_abi_version() -> u32 {
    ABI_VERSION
}

/// See `include/vram.h`.
#[no_mangle]
pub extern "C" fn vram_last_error() -> *const c_char {
    LAST_ERROR
        .try_with(|e| e.borrow().as_ref().map_or(std::ptr::null(), |c| c.as_ptr()))
        .unwrap_or(std::ptr::null())
}

/// See `include/vram.h`.
#[no_mangle]
pub extern "C" fn vram_stats_json() -> *mut c_char {
    guarded(std::ptr::null_mut(), || {
        let t = tenant()?;
        let client = t.client()?;
        let w = client.welcome();
        let v = serde_json::json!({
            "tenant": w.name, "gpu": t.gpu, "limit": w.limit.get(), "guarantee": w.guarantee.get(),
            "backend": t.device.backend.name(), "stats": t.alloc.stats(),
        });
        let s = CString::new(v.to_string()).map_err(|e| e.to_string())?;
        Ok(s.into_raw())
    })
}

/// See `include/vram.h`.
#[no_mangle]
pub extern "C" fn vram_trim() -> i64 {
    // A process that is no tenant holds nothing to give back: it does not become one for this.
    guarded(-1, || {
        Ok(current().map_or(0, |t| t.alloc.trim().get() as i64))
    })
}

/// See `include/vram.h`.
///
/// # Safety
/// `s` must be NULL or a string returned by one of this library's `*_json` functions
/// (`vram_stats_json`, `vram_status_json`, `vram_snapshot_json`, `vram_interposer_stats_json`)
/// not yet freed.
#[no_mangle]
pub unsafe extern "C" fn vram_string_free(s: *mut c_char) {
    if s.is_null() {
        return;
    }
    // SAFETY: the caller passes a pointer that one of the `*_json` functions made with
    // `CString::into_raw`, freed once.
    drop(unsafe { CString::from_raw(s) });
}

/// The last error as a Rust string (for tests and benches linking this crate directly).
pub fn last_error() -> Option<String> {
    let p = vram_last_error();
    if p.is_null() {
        return None;
    }
    // SAFETY: `p` points into this thread's LAST_ERROR CString, alive until the next call here.
    Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// Times the daemon asked for memory back; waiters on `RECLAIM_ASKED` learn of each.
static RECLAIM_REQUESTS: Mutex<u64> = Mutex::new(0);
static RECLAIM_ASKED: Condvar = Condvar::new();

/// What the caller says is in use, for `vramd status` (`u64::MAX`: nothing said).
static CALLER_IN_USE: AtomicU64 = AtomicU64::new(u64::MAX);

/// See `include/vram.h`.
#[no_mangle]
pub extern "C" fn vram_report_in_use(bytes: u64) {
    CALLER_IN_USE.store(bytes.min(u64::MAX - 1), Ordering::Relaxed);
}

/// See `include/vram.h`.
#[no_mangle]
pub extern "C" fn vram_announce_captures() -> c_int {
    NOTICES.announce();
    0
}

/// See `include/vram.h`.
#[no_mangle]
pub extern "C" fn vram_capture_begin(_device: c_int) {
    NOTICES.began();
}

/// See `include/vram.h`.
#[no_mangle]
pub extern "C" fn vram_capture_end(_device: c_int) {
    NOTICES.ended();
}

/// See `include/vram.h`.
#[no_mangle]
pub extern "C" fn vram_reclaim_requests() -> u64 {
    *RECLAIM_REQUESTS.lock().unwrap_or_else(|p| p.into_inner())
}

/// See `include/vram.h`.
#[no_mangle]
pub extern "C" fn vram_wait_reclaim(seen: u64, timeout_ms: u32) -> u64 {
    let count = RECLAIM_REQUESTS.lock().unwrap_or_else(|p| p.into_inner());
    let timeout = Duration::from_millis(timeout_ms.into());
    let (count, _) = RECLAIM_ASKED
        .wait_timeout_while(count, timeout, |n| *n == seen)
        .unwrap_or_else(|p| p.into_inner());
    *count
}

/// See `include/vram.h`.
#[no_mangle]
pub extern "C" fn vram_reset_peak() -> c_int {
    guarded(-1, || {
        tenant()?.alloc.reset_peaks();
        Ok(0)
    })
}

/// See `include/vram.h`.
#[no_mangle]
pub extern "C" fn vram_snapshot_json() -> *mut c_char {
    guarded(std::ptr::null_mut(), || {
        let t = tenant()?;
        let segments: Vec<_> = t
            .alloc
            .segments()
            .into_iter()
            .map(|s| {
                let blocks: Vec<_> = s
                    .blocks
                    .iter()
                    .map(|b| {
                        serde_json::json!({
                            "address": b.offset, "size": b.len, "requested_size": b.requested,
                            "state": b.state,
                        })
                    })
                    .collect();
                serde_json::json!({
                    "address": s.offset, "size": s.len, "small": s.small, "blocks": blocks,
                })
            })
            .collect();
        let v = serde_json::json!({ "gpu": t.gpu, "segments": segments });
        let s = CString::new(v.to_string()).map_err(|e| e.to_string())?;
        Ok(s.into_raw())
    })
}

/// See `include/vram.h`.
///
/// # Safety
/// `free` and `total` must each be valid for one write.
#[no_mangle]
pub unsafe extern "C" fn vram_mem_get_info(free: *mut u64, total: *mut u64) -> c_int {
    if free.is_null() || total.is_null() {
        set_error("vramd: vram_mem_get_info needs two out-pointers, not NULL".into());
        return -1;
    }
    guarded(-1, || {
        let (t, f) = interpose::tenant_view(tenant()?)?;
        // SAFETY: the caller passes two pointers valid for one write each (checked non-null).
        unsafe {
            *total = t;
            *free = f;
        }
        Ok(0)
    })
}
