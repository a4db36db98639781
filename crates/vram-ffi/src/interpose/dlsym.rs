//! `dlsym` as a process that preloads libvram.so sees it.
//!
//! Libraries that load the driver themselves (XLA's `dlopen("libcuda.so.1")` then
//! `dlsym(handle, "cuMemAlloc_v2")`, the CUDA runtime's `dlsym(handle, "cuGetProcAddress_v2")`,
//! ctypes' lookups in NVML) never see the symbols libvram.so exports: a lookup through a handle
//! searches that library only. So `dlsym` itself is defined here. A name in [`hook_for`]'s table,
//! looked up by code outside libvram.so, gets libvram.so's function, provided the real lookup
//! finds the name at all (a handle to a library without it still gets NULL). Every other lookup
//! goes to glibc's `dlsym` unchanged.
//!
//! libvram.so's own lookups get the real functions: vram-device reaches the driver through
//! cudarc, which resolves each function with `dlsym` the first time it is called (at any time,
//! on any thread), and the allocator's own driver calls must never come back into the hooks.
//! Which code is looking a name up is told by the caller's return address: an address inside
//! libvram.so (or, in a test linking this crate, the executable it is linked into) is ours.
//!
//! The entry point is a small assembly trampoline. It passes the return address to [`decide`],
//! then either returns its answer or jumps into glibc's `dlsym` with the caller's own arguments
//! and return address untouched. The jump matters: glibc resolves `RTLD_NEXT` relative to the
//! object its caller lies in, and a call from here would make that libvram.so for everyone (a
//! library after us asking for the next `malloc` could get its own). On the pass-through path
//! nothing allocates or takes a lock: the loader and Rust's standard library call `dlsym` early
//! in a process's start and while holding their own locks.
//!
//! Only x86-64 and 64-bit Arm have the trampoline; elsewhere `dlsym` is not interposed and the
//! hooks are reached by direct linking alone.

use std::ffi::{c_char, c_void, CStr};
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};

use super::{alloc, charged, info, nvml, pools, procaddr, vmm};

/// glibc's `dlsym`.
pub(crate) type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

static REAL: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

/// Lookups answered with one of libvram.so's functions (for the statistics).
pub(crate) static ANSWERED: AtomicU64 = AtomicU64::new(0);

/// The version glibc gave `dlsym` before 2.34 moved it into libc itself.
#[cfg(target_arch = "aarch64")]
const BASE_VERSION: &CStr = c"GLIBC_2.17";
#[cfg(not(target_arch = "aarch64"))]
const BASE_VERSION: &CStr = c"GLIBC_2.2.5";

/// glibc's own `dlsym`, found by version after libvram.so in the lookup order.
pub(crate) fn real_dlsym() -> Option<DlsymFn> {
    let mut p = REAL.load(Ordering::Acquire);
    if p.is_null() {
        for version in [c"GLIBC_2.34", BASE_VERSION] {
            // SAFETY: dlvsym with RTLD_NEXT and NUL-terminated strings only reads the loader's
            // tables; dlvsym is not interposed, so this cannot come back here.
            p = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) };
            if !p.is_null() {
                break;
            }
        }
        REAL.store(p, Ordering::Release);
    }
    // SAFETY: a non-null pointer is glibc's `dlsym`, whose C signature `DlsymFn` is.
    (!p.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, DlsymFn>(p) })
}

/// Looks `name` up with glibc's `dlsym` (null if it is not found or glibc's is missing).
pub(crate) fn lookup(handle: *mut c_void, name: &CStr) -> *mut c_void {
    match real_dlsym() {
        // SAFETY: glibc's dlsym with a handle from dlopen (or a pseudo-handle) and a C string.
        Some(real) => unsafe { real(handle, name.as_ptr()) },
        None => std::ptr::null_mut(),
    }
}

/// libvram.so's function for a name the process may look up, if it has one.
pub(crate) fn hook_for(name: &[u8]) -> Option<*mut c_void> {
    let f: *mut c_void = match name {
        b"cuGetProcAddress" => procaddr::cuGetProcAddress as *mut c_void,
        b"cuGetProcAddress_v2" => procaddr::cuGetProcAddress_v2 as *mut c_void,
        b"cuMemAlloc_v2" => alloc::cuMemAlloc_v2 as *mut c_void,
        b"cuMemAllocPitch_v2" => alloc::cuMemAllocPitch_v2 as *mut c_void,
        b"cuMemFree_v2" => alloc::cuMemFree_v2 as *mut c_void,
        b"cuMemAllocAsync" => alloc::cuMemAllocAsync as *mut c_void,
        b"cuMemAllocAsync_ptsz" => alloc::cuMemAllocAsync_ptsz as *mut c_void,
        b"cuMemFreeAsync" => alloc::cuMemFreeAsync as *mut c_void,
        b"cuMemFreeAsync_ptsz" => alloc::cuMemFreeAsync_ptsz as *mut c_void,
        b"cuMemAllocFromPoolAsync" => alloc::cuMemAllocFromPoolAsync as *mut c_void,
        b"cuMemAllocFromPoolAsync_ptsz" => alloc::cuMemAllocFromPoolAsync_ptsz as *mut c_void,
        b"cuMemPoolCreate" => pools::cuMemPoolCreate as *mut c_void,
        b"cuMemPoolDestroy" => pools::cuMemPoolDestroy as *mut c_void,
        b"cuMemPoolTrimTo" => pools::cuMemPoolTrimTo as *mut c_void,
        b"cuMemGetDefaultMemPool" => pools::cuMemGetDefaultMemPool as *mut c_void,
        b"cuMemGetMemPool" => pools::cuMemGetMemPool as *mut c_void,
        b"cuMemSetMemPool" => pools::cuMemSetMemPool as *mut c_void,
        b"cuDeviceSetMemPool" => pools::cuDeviceSetMemPool as *mut c_void,
        b"cuMemCreate" => vmm::cuMemCreate as *mut c_void,
        b"cuMemRelease" => vmm::cuMemRelease as *mut c_void,
        b"cuMemRetainAllocationHandle" => vmm::cuMemRetainAllocationHandle as *mut c_void,
        b"cuMemExportToShareableHandle" => vmm::cuMemExportToShareableHandle as *mut c_void,
        b"cuMemMap" => vmm::cuMemMap as *mut c_void,
        b"cuMemUnmap" => vmm::cuMemUnmap as *mut c_void,
        b"cuMemAllocManaged" => charged::cuMemAllocManaged as *mut c_void,
        b"cuMemGetInfo_v2" => info::cuMemGetInfo_v2 as *mut c_void,
        b"cuStreamDestroy_v2" => alloc::cuStreamDestroy_v2 as *mut c_void,
        b"nvmlDeviceGetMemoryInfo" => nvml::nvmlDeviceGetMemoryInfo as *mut c_void,
        b"nvmlDeviceGetMemoryInfo_v2" => nvml::nvmlDeviceGetMemoryInfo_v2 as *mut c_void,
        _ => return None,
    };
    Some(f)
}

/// Whether `caller` lies in the object this code is in (libvram.so, or the executable a test
/// linked this crate into). Only asked for names in the table, never on the pass-through path.
fn from_vramd(caller: *const c_void) -> bool {
    static OURS: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
    let object = |addr: *const c_void| {
        // SAFETY: Dl_info is plain data; all-zero is a valid value for dladdr to overwrite.
        let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
        // SAFETY: dladdr only reads the loader's tables and writes `info`.
        let found = unsafe { libc::dladdr(addr, &mut info) } != 0;
        if found {
            info.dli_fbase
        } else {
            std::ptr::null_mut()
        }
    };
    let mut ours = OURS.load(Ordering::Relaxed);
    if ours.is_null() {
        ours = object(from_vramd as *const c_void);
        OURS.store(ours, Ordering::Relaxed);
    }
    !ours.is_null() && object(caller) == ours
}

/// What the trampoline does: return `value`, or (when `forward` is not null) jump to `forward`,
/// glibc's `dlsym`, with the caller's arguments.
#[repr(C)]
pub(crate) struct Answer {
    value: *mut c_void,
    forward: *mut c_void,
}

/// The decision for one `dlsym(handle, symbol)` called from `caller`. Called by the trampoline
/// only; must not unwind (it is `extern "C"`, so a panic would abort) and, on the pass-through
/// path, neither allocates nor locks.
///
/// # Safety
/// As for glibc's `dlsym`: `symbol` is null or a NUL-terminated string, `handle` a handle from
/// `dlopen` or a pseudo-handle.
pub(crate) unsafe extern "C" fn decide(
    handle: *mut c_void,
    symbol: *const c_char,
    caller: *const c_void,
) -> Answer {
    let Some(real) = real_dlsym() else {
        return Answer {
            value: std::ptr::null_mut(),
            forward: std::ptr::null_mut(),
        };
    };
    let pass = Answer {
        value: std::ptr::null_mut(),
        forward: real as *mut c_void,
    };
    if symbol.is_null() {
        return pass;
    }
    // SAFETY: dlsym's contract: `symbol` is a NUL-terminated string (checked non-null).
    let name = unsafe { CStr::from_ptr(symbol) };
    let Some(hook) = hook_for(name.to_bytes()) else {
        return pass;
    };
    if from_vramd(caller) {
        return pass;
    }
    // The name must exist where the caller looks: a handle to a library without it gets NULL,
    // and the loader's error, as it would without libvram.so. (`RTLD_NEXT` cannot be asked from
    // here, where it would mean "after libvram.so": the hook is the answer.)
    // SAFETY: glibc's dlsym with the caller's own handle and name.
    if handle != libc::RTLD_NEXT && unsafe { real(handle, symbol) }.is_null() {
        return Answer {
            value: std::ptr::null_mut(),
            forward: std::ptr::null_mut(),
        };
    }
    ANSWERED.fetch_add(1, Ordering::Relaxed);
    Answer {
        value: hook,
        forward: std::ptr::null_mut(),
    }
}

/// See the module documentation: `decide(handle, symbol, return address)`, then return its
/// value or tail-jump into glibc's `dlsym`.
///
/// # Safety
/// As for glibc's `dlsym`: `handle` is a handle from `dlopen` or a pseudo-handle, `symbol` a
/// NUL-terminated string.
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[no_mangle]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    // On entry [rsp] is the return address and rsp is 8 past a 16-byte boundary. The two
    // arguments are saved (two pushes and 8 bytes keep the call aligned), `decide` returns its
    // two-pointer answer in rax:rdx, and the stack is back as it was before the jump.
    core::arch::naked_asm!(
        "push rdi",
        "push rsi",
        "sub rsp, 8",
        "mov rdx, [rsp + 24]",
        "call {decide}",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "test rdx, rdx",
        "jz 2f",
        "jmp rdx",
        "2:",
        "ret",
        decide = sym decide,
    )
}

/// See the x86-64 version.
///
/// # Safety
/// As for glibc's `dlsym`.
#[cfg(target_arch = "aarch64")]
#[unsafe(naked)]
#[no_mangle]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    // x30 holds the return address. A frame keeps x29/x30 and the two arguments; `decide`
    // returns its answer in x0:x1. The jump goes through x16, which a BTI landing pad
    // (`bti c` at glibc's dlsym) accepts for an indirect branch.
    core::arch::naked_asm!(
        "stp x29, x30, [sp, #-32]!",
        "mov x29, sp",
        "stp x0, x1, [sp, #16]",
        "mov x2, x30",
        "bl {decide}",
        "cbz x1, 2f",
        "mov x16, x1",
        "ldp x0, x1, [sp, #16]",
        "ldp x29, x30, [sp], #32",
        "br x16",
        "2:",
        "ldp x29, x30, [sp], #32",
        "ret",
        decide = sym decide,
    )
}
