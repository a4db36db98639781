//! Pool mode's segment source: `cudaMalloc` and `cudaFree` (and the stream-ordered
//! `cudaMallocAsync` / `cudaFreeAsync`) as a process that preloads libvram.so sees them (`vramd
//! run` sets `LD_PRELOAD`). With `VRAMD_TORCH_MODE=pool`, PyTorch's own caching allocator, and
//! any other library that takes device memory through the CUDA runtime, gets its segments from
//! vramd here: PyTorch's own allocator stays in charge (its statistics, snapshots, graphs,
//! `record_stream`, `torch.compile`), while the tenant's limit, priority, crash reclaim and
//! elastic sharing apply to every byte. The memory is the driver's virtual memory (handles mapped
//! into a reserved range), which CUDA's legacy IPC calls (`cudaIpcGetMemHandle`) do not take:
//! they are documented for memory made by `cudaMalloc` itself.
//!
//! Calls not served here go on to the CUDA runtime's own functions: a free of memory vramd did
//! not hand out, `cudaFree(NULL)` (which programs use to create the context), an allocation on
//! another GPU than the tenant's, a `cudaMallocAsync` whose stream's device has a pool current
//! that vramd's memory cannot stand in for ([`crate::interpose::pools`]), and everything outside
//! pool mode (full mode loads the same
//! library; its frees are `vram_free`'s). The runtime then calls the driver, whose allocation
//! calls libvram.so interposes as well ([`crate::interpose`]): an allocation that passes through
//! here is served there, by the same allocator, and one served here never reaches the driver.
//! Either way a block is served once, and freed by whichever entry point sees it.
//!
//! `cudaFree` synchronises the device, as the runtime's does: callers rely on it (PyTorch frees a
//! segment only when its own events say the GPU is done with it, but other libraries do not).
//! `cudaFreeAsync` does not: the allocator's stream fences keep the block from another stream
//! until the free's stream has passed it.

use std::ffi::{c_int, c_void, CStr, CString};
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::OnceLock;

use vram_client::alloc::SYNCHRONOUS;
use vram_core::alloc::StreamId;
use vram_core::Bytes;

use crate::interpose::stats::{self, Hook};
use crate::interpose::tenant_or_log;
use crate::{current, guarded, refusal, tenant};

const CUDA_SUCCESS: c_int = 0;
const CUDA_ERROR_INVALID_VALUE: c_int = 1;
const CUDA_ERROR_MEMORY_ALLOCATION: c_int = 2;
/// `cudaErrorSymbolNotFound`: the answer when the runtime's own function cannot be found.
const CUDA_ERROR_NO_RUNTIME: c_int = 500;

type MallocFn = unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int;
type FreeFn = unsafe extern "C" fn(*mut c_void) -> c_int;
type MallocAsyncFn = unsafe extern "C" fn(*mut *mut c_void, usize, *mut c_void) -> c_int;
type FreeAsyncFn = unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int;
type SyncFn = unsafe extern "C" fn() -> c_int;
type GetDeviceFn = unsafe extern "C" fn(*mut c_int) -> c_int;
type StreamGetDeviceFn = unsafe extern "C" fn(*mut c_void, *mut c_int) -> c_int;

/// One of the CUDA runtime's own functions, found the first time it can be: after libvram.so in
/// the lookup order (a runtime the program or a library loaded globally links), else in a runtime
/// the process loaded with `RTLD_LOCAL` (a Python extension's dependency, a library's `dlopen`),
/// which `RTLD_NEXT` does not search. A program that calls the runtime through libvram.so's
/// `cudaMalloc` has loaded it somewhere, so one of the two finds it. A name not found is looked
/// for again at the next call while no runtime function has been found (the runtime may be loaded
/// later); once one has, a name still missing is taken to be absent from that runtime (an older
/// one), and not looked for again.
struct RuntimeFn {
    name: &'static CStr,
    /// The function; null while not found.
    found: AtomicPtr<c_void>,
    /// Known to be missing from the loaded runtime.
    absent: AtomicBool,
}

/// Whether some runtime function has been found: the runtime is loaded.
static RUNTIME_FOUND: AtomicBool = AtomicBool::new(false);

impl RuntimeFn {
    const fn new(name: &'static CStr) -> RuntimeFn {
        RuntimeFn {
            name,
            found: AtomicPtr::new(std::ptr::null_mut()),
            absent: AtomicBool::new(false),
        }
    }

    fn get(&self) -> Option<*mut c_void> {
        let p = self.found.load(Ordering::Acquire);
        if !p.is_null() {
            return Some(p);
        }
        if self.absent.load(Ordering::Relaxed) {
            return None;
        }
        match find_runtime_symbol(self.name) {
            Some(p) => {
                self.found.store(p, Ordering::Release);
                RUNTIME_FOUND.store(true, Ordering::Release);
                Some(p)
            }
            None => {
                if RUNTIME_FOUND.load(Ordering::Acquire) {
                    self.absent.store(true, Ordering::Relaxed);
                }
                None
            }
        }
    }
}

static MALLOC: RuntimeFn = RuntimeFn::new(c"cudaMalloc");
static FREE: RuntimeFn = RuntimeFn::new(c"cudaFree");
static MALLOC_ASYNC: RuntimeFn = RuntimeFn::new(c"cudaMallocAsync");
static FREE_ASYNC: RuntimeFn = RuntimeFn::new(c"cudaFreeAsync");
static SYNCHRONIZE: RuntimeFn = RuntimeFn::new(c"cudaDeviceSynchronize");
static GET_DEVICE: RuntimeFn = RuntimeFn::new(c"cudaGetDevice");
/// CUDA 12.8 and later; before, a stream's device is taken to be the current one.
static STREAM_GET_DEVICE: RuntimeFn = RuntimeFn::new(c"cudaStreamGetDevice");

// SAFETY (each of the seven below): the pointer is the CUDA runtime's function of that name, whose
// C signature is the one transmuted to (cuda_runtime_api.h).
fn runtime_malloc() -> Option<MallocFn> {
    // SAFETY: see above.
    MALLOC
        .get()
        .map(|p| unsafe { std::mem::transmute::<*mut c_void, MallocFn>(p) })
}
fn runtime_free() -> Option<FreeFn> {
    // SAFETY: see above.
    FREE.get()
        .map(|p| unsafe { std::mem::transmute::<*mut c_void, FreeFn>(p) })
}
fn runtime_malloc_async() -> Option<MallocAsyncFn> {
    // SAFETY: see above.
    MALLOC_ASYNC
        .get()
        .map(|p| unsafe { std::mem::transmute::<*mut c_void, MallocAsyncFn>(p) })
}
fn runtime_free_async() -> Option<FreeAsyncFn> {
    // SAFETY: see above.
    FREE_ASYNC
        .get()
        .map(|p| unsafe { std::mem::transmute::<*mut c_void, FreeAsyncFn>(p) })
}
fn runtime_synchronize() -> Option<SyncFn> {
    // SAFETY: see above.
    SYNCHRONIZE
        .get()
        .map(|p| unsafe { std::mem::transmute::<*mut c_void, SyncFn>(p) })
}
fn runtime_stream_get_device() -> Option<StreamGetDeviceFn> {
    // SAFETY: see above.
    STREAM_GET_DEVICE
        .get()
        .map(|p| unsafe { std::mem::transmute::<*mut c_void, StreamGetDeviceFn>(p) })
}
fn runtime_get_device() -> Option<GetDeviceFn> {
    // SAFETY: see above.
    GET_DEVICE
        .get()
        .map(|p| unsafe { std::mem::transmute::<*mut c_void, GetDeviceFn>(p) })
}

/// `name` in the CUDA runtime: after libvram.so in the lookup order, else in any loaded object
/// whose file is a CUDA runtime's ([`is_runtime_file`]; the first that has it).
fn find_runtime_symbol(name: &CStr) -> Option<*mut c_void> {
    // SAFETY: dlsym with RTLD_NEXT and a NUL-terminated name only reads the loader's tables.
    let next = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) };
    if !next.is_null() {
        return Some(next);
    }
    loaded_runtimes().iter().find_map(|path| {
        // SAFETY: dlopen with RTLD_NOLOAD only finds a library the process already loaded (and
        // takes a reference to it, given back below); `path` is a NUL-terminated string.
        let lib = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
        if lib.is_null() {
            return None;
        }
        let p = crate::interpose::dlsym::lookup(lib, name);
        // SAFETY: `lib` came from the dlopen above. The library stays loaded: the reference
        // given back is that dlopen's own, and whoever loaded it first still holds theirs.
        unsafe { libc::dlclose(lib) };
        (!p.is_null()).then_some(p)
    })
}

/// Whether a shared object's file name is a CUDA runtime's: `libcudart.so*` as the toolkit names
/// it, or `libcudart-<hash>.so*` as a wheel renames the runtime it bundles.
fn is_runtime_file(file: &[u8]) -> bool {
    file.starts_with(b"libcudart.so")
        || (file.starts_with(b"libcudart-")
            && (file.ends_with(b".so") || file.windows(4).any(|w| w == b".so.")))
}

/// The paths of the loaded objects whose file is a CUDA runtime's ([`is_runtime_file`]).
fn loaded_runtimes() -> Vec<CString> {
    unsafe extern "C" fn each(
        info: *mut libc::dl_phdr_info,
        _size: usize,
        found: *mut c_void,
    ) -> c_int {
        // SAFETY: dl_iterate_phdr passes a valid `info` for the duration of this call, and
        // `found` is the vector `loaded_runtimes` passed, used by this thread only.
        let (name, found) = unsafe { ((*info).dlpi_name, &mut *found.cast::<Vec<CString>>()) };
        if !name.is_null() {
            // SAFETY: `dlpi_name` is a NUL-terminated path (empty for the executable).
            let path = unsafe { CStr::from_ptr(name) };
            let file = path
                .to_bytes()
                .rsplit(|&b| b == b'/')
                .next()
                .unwrap_or_default();
            if is_runtime_file(file) {
                found.push(path.to_owned());
            }
        }
        0
    }
    let mut found: Vec<CString> = Vec::new();
    // SAFETY: `each` only reads the entries it is given and pushes to `found`, which outlives
    // the call; it returns 0 to go on through every object.
    unsafe { libc::dl_iterate_phdr(Some(each), (&raw mut found).cast()) };
    found
}

fn pool_mode() -> bool {
    static POOL: OnceLock<bool> = OnceLock::new();
    *POOL.get_or_init(|| std::env::var(vram_proto::env::TORCH_MODE).is_ok_and(|m| m == "pool"))
}

/// The calling thread's current CUDA device, if the runtime answers.
fn current_device() -> Option<c_int> {
    let get = runtime_get_device()?;
    let mut device = -1;
    // SAFETY: the runtime's cudaGetDevice with a valid out pointer.
    (unsafe { get(&mut device) } == CUDA_SUCCESS).then_some(device)
}

/// The device of `stream` (the runtime's `cudaStreamGetDevice`), else the current one: a
/// stream-ordered allocation is the stream's device's, whichever device is current.
fn stream_device(stream: *mut c_void) -> Option<c_int> {
    if let Some(get) = runtime_stream_get_device() {
        let mut device = -1;
        // SAFETY: the runtime's cudaStreamGetDevice with the caller's stream and a valid out
        // pointer; a stream the runtime does not know is an error answer, not a fault.
        if unsafe { get(stream, &mut device) } == CUDA_SUCCESS {
            return Some(device);
        }
    }
    current_device()
}

/// What the interposed `cudaMalloc` did with a request.
enum Served {
    Done(u64),
    /// Not vramd's to serve: the runtime's own cudaMalloc takes it.
    Pass,
    Refused,
}

/// Serves `size` bytes for `stream` in pool mode, on `device` (where the runtime says); `Pass`
/// outside pool mode and for another GPU.
fn serve(
    hook: Hook,
    what: &str,
    size: usize,
    stream: StreamId,
    device: impl FnOnce() -> Option<c_int>,
) -> Served {
    if !pool_mode() {
        return Served::Pass;
    }
    let served = guarded(Served::Refused, || {
        let t = tenant_or_log()?;
        if let Some(device) = device() {
            if !crate::is_tenant_ordinal(t, device) {
                warn_other_gpu(device, t.gpu);
                return Ok(Served::Pass);
            }
        }
        let size = Bytes(size as u64);
        let ptr = t
            .alloc
            .alloc(size, stream)
            .map_err(|e| refusal::alloc_refused(t, what, size, &e))?;
        Ok(Served::Done(ptr))
    });
    match served {
        Served::Done(_) => stats::served(hook),
        Served::Pass => stats::passed(hook),
        Served::Refused => stats::refused(hook),
    }
    served
}

/// Whether pool mode serves the free of `ptr` (memory vramd's allocator handed out).
fn frees_here(ptr: *mut c_void) -> bool {
    pool_mode() && !ptr.is_null() && matches!(current(), Some(t) if t.alloc.owns(ptr as u64))
}

/// Frees `ptr`, which [`frees_here`], into the tenant's allocator.
fn free_here(hook: Hook, what: &str, ptr: *mut c_void, stream: StreamId) -> c_int {
    guarded(CUDA_ERROR_INVALID_VALUE, || {
        let t = tenant()?;
        t.alloc
            .free(ptr as u64, stream)
            .map_err(|e| format!("vramd: {what}: {e}"))?;
        stats::served(hook);
        Ok(CUDA_SUCCESS)
    })
}

/// See the module documentation.
///
/// # Safety
/// `dev_ptr` must be valid for one pointer write, as for the runtime's `cudaMalloc`.
#[no_mangle]
pub unsafe extern "C" fn cudaMalloc(dev_ptr: *mut *mut c_void, size: usize) -> c_int {
    if dev_ptr.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    match serve(
        Hook::CudaMalloc,
        "cudaMalloc",
        size,
        SYNCHRONOUS,
        current_device,
    ) {
        Served::Done(ptr) => {
            // SAFETY: the caller passes a pointer valid for one write (checked non-null).
            unsafe { *dev_ptr = ptr as *mut c_void };
            CUDA_SUCCESS
        }
        Served::Refused => CUDA_ERROR_MEMORY_ALLOCATION,
        Served::Pass => match runtime_malloc() {
            // SAFETY: the runtime's own cudaMalloc with the caller's arguments.
            Some(malloc) => unsafe { malloc(dev_ptr, size) },
            None => CUDA_ERROR_NO_RUNTIME,
        },
    }
}

/// See the module documentation: served on the caller's stream.
///
/// # Safety
/// `dev_ptr` must be valid for one pointer write, as for the runtime's `cudaMallocAsync`.
#[no_mangle]
pub unsafe extern "C" fn cudaMallocAsync(
    dev_ptr: *mut *mut c_void,
    size: usize,
    stream: *mut c_void,
) -> c_int {
    if dev_ptr.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // The runtime takes from its stream's device's current pool, as `cuMemAllocAsync` does: a
    // pool vramd cannot stand in for made current there is the driver's, so the call goes on to
    // the runtime, whose `cuMemAllocAsync` libvram.so charges for that pool.
    let served = if pool_mode() && crate::interpose::pools::current_drivers(stream).is_some() {
        stats::passed(Hook::CudaMallocAsync);
        Served::Pass
    } else {
        let sid = vram_client::alloc::stream_of(stream as u64, false);
        serve(Hook::CudaMallocAsync, "cudaMallocAsync", size, sid, || {
            stream_device(stream)
        })
    };
    match served {
        Served::Done(ptr) => {
            // SAFETY: the caller passes a pointer valid for one write (checked non-null).
            unsafe { *dev_ptr = ptr as *mut c_void };
            CUDA_SUCCESS
        }
        Served::Refused => CUDA_ERROR_MEMORY_ALLOCATION,
        Served::Pass => match runtime_malloc_async() {
            // SAFETY: the runtime's own cudaMallocAsync with the caller's arguments.
            Some(malloc) => unsafe { malloc(dev_ptr, size, stream) },
            None => CUDA_ERROR_NO_RUNTIME,
        },
    }
}

fn warn_other_gpu(device: c_int, gpu: u32) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    if !WARNED.swap(true, Ordering::Relaxed) {
        refusal::to_stderr(format_args!(
            "vramd: cudaMalloc on device {device}, but this process is a tenant of the daemon's \
             gpu {gpu}, another device: that memory is the CUDA runtime's own, outside vramd's \
             books"
        ));
    }
}

/// See the module documentation.
///
/// # Safety
/// As for the runtime's `cudaFree`: `ptr` is null or a pointer `cudaMalloc` returned.
#[no_mangle]
pub unsafe extern "C" fn cudaFree(ptr: *mut c_void) -> c_int {
    if !frees_here(ptr) {
        stats::passed(Hook::CudaFree);
        return match runtime_free() {
            // SAFETY: the runtime's own cudaFree with the caller's argument.
            Some(free) => unsafe { free(ptr) },
            None => CUDA_ERROR_NO_RUNTIME,
        };
    }
    if let Some(sync) = runtime_synchronize() {
        // SAFETY: the runtime's cudaDeviceSynchronize takes no arguments.
        let r = unsafe { sync() };
        if r != CUDA_SUCCESS {
            // During a graph capture, or after a failed kernel: nothing is freed, as the runtime's
            // own cudaFree would refuse too.
            return r;
        }
    }
    free_here(Hook::CudaFree, "cudaFree", ptr, SYNCHRONOUS)
}

/// See the module documentation: no synchronisation, the block stays with `stream` until the
/// stream has passed the free.
///
/// # Safety
/// As for the runtime's `cudaFreeAsync`: `ptr` is a pointer an allocation call returned.
#[no_mangle]
pub unsafe extern "C" fn cudaFreeAsync(ptr: *mut c_void, stream: *mut c_void) -> c_int {
    if !frees_here(ptr) {
        stats::passed(Hook::CudaFreeAsync);
        return match runtime_free_async() {
            // SAFETY: the runtime's own cudaFreeAsync with the caller's arguments.
            Some(free) => unsafe { free(ptr, stream) },
            None => CUDA_ERROR_NO_RUNTIME,
        };
    }
    free_here(
        Hook::CudaFreeAsync,
        "cudaFreeAsync",
        ptr,
        vram_client::alloc::stream_of(stream as u64, false),
    )
}

/// How many allocations and frees vramd served through interposed entry points in this process:
/// the runtime's here (pool mode) and the driver's (`interpose`). Zero where libvram.so
/// was not preloaded (or nothing allocated through those entry points).
#[no_mangle]
pub extern "C" fn vram_interposed_calls() -> u64 {
    stats::allocator_calls()
}

/// Whether this process's `cudaMalloc` is libvram.so's: 1 if it is (the library was preloaded and
/// pool mode is on), 0 if not.
#[no_mangle]
pub extern "C" fn vram_interposing() -> c_int {
    // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name only reads the loader's tables.
    let found = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"cudaMalloc".as_ptr()) };
    c_int::from(pool_mode() && found == cudaMalloc as *mut c_void)
}

#[cfg(test)]
mod runtime_file_tests {
    use super::is_runtime_file;

    #[test]
    fn the_toolkits_and_wheels_runtime_names_are_runtimes() {
        for name in [
            "libcudart.so",
            "libcudart.so.12",
            "libcudart.so.13.0.48",
            "libcudart-3c0a7d1f.so.12",
            "libcudart-3c0a7d1f.so",
        ] {
            assert!(is_runtime_file(name.as_bytes()), "{name}");
        }
        for name in [
            "libcudart_static.a",
            "libcudnn.so.9",
            "libcudart-notes.txt",
            "",
        ] {
            assert!(!is_runtime_file(name.as_bytes()), "{name}");
        }
    }
}
