//! `cuGetProcAddress` and `cuGetProcAddress_v2`: how the CUDA runtime (and PyTorch's driver
//! calls, NCCL, cuBLAS) find every driver entry point. The driver's own function answers first;
//! if its answer is the real address of a function hooked here, the caller gets the hook
//! instead. So `cudaMalloc` → `cuMemAlloc_v2` reaches vramd whether the runtime was loaded by
//! the program, privately (CuPy), or linked into it statically (XLA). A query for
//! `cuGetProcAddress` itself is answered with the hook too, so lookups made through the answer
//! come back here.
//!
//! Should a driver hand out addresses other than its exported symbols', the name and version
//! asked for decide instead: `cuMemAlloc`, `cuMemAllocPitch`, `cuMemFree` and `cuMemGetInfo`
//! are the `_v2` functions from CUDA 3.2 on, `cuStreamDestroy` from CUDA 4.0,
//! `cuGetProcAddress` the `_v2` one from CUDA 12.0;
//! the stream-ordered calls take their `_ptsz` form when the caller asks for per-thread default
//! stream semantics. `vram_interposer_stats_json` counts which of the two ways matched.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicU64, Ordering};

use super::{
    alloc, charged, dlsym, info, pools, real, vmm, CuResult, CUDA_ERROR_NOT_FOUND, CUDA_SUCCESS,
};

/// `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`.
const PER_THREAD_DEFAULT_STREAM: u64 = 1 << 1;

static BY_POINTER: AtomicU64 = AtomicU64::new(0);
static BY_NAME: AtomicU64 = AtomicU64::new(0);

/// Answers replaced so far: (matched by address, matched by name).
pub(crate) fn replaced() -> (u64, u64) {
    (
        BY_POINTER.load(Ordering::Relaxed),
        BY_NAME.load(Ordering::Relaxed),
    )
}

/// The hook for `name` asked for at `version` with `flags`, where the driver's answer is the
/// function hooked here under that name and version.
fn hook_by_name(name: &[u8], version: c_int, flags: u64) -> Option<*mut c_void> {
    let per_thread = flags & PER_THREAD_DEFAULT_STREAM != 0;
    let f: *mut c_void = match name {
        b"cuGetProcAddress" if version >= 12000 => cuGetProcAddress_v2 as _,
        b"cuGetProcAddress" => cuGetProcAddress as _,
        b"cuMemAlloc" if version >= 3020 => alloc::cuMemAlloc_v2 as _,
        b"cuMemAllocPitch" if version >= 3020 => alloc::cuMemAllocPitch_v2 as _,
        b"cuMemFree" if version >= 3020 => alloc::cuMemFree_v2 as _,
        b"cuMemGetInfo" if version >= 3020 => info::cuMemGetInfo_v2 as _,
        b"cuStreamDestroy" if version >= 4000 => alloc::cuStreamDestroy_v2 as _,
        b"cuMemAllocAsync" if per_thread => alloc::cuMemAllocAsync_ptsz as _,
        b"cuMemAllocAsync" => alloc::cuMemAllocAsync as _,
        b"cuMemFreeAsync" if per_thread => alloc::cuMemFreeAsync_ptsz as _,
        b"cuMemFreeAsync" => alloc::cuMemFreeAsync as _,
        b"cuMemAllocFromPoolAsync" if per_thread => alloc::cuMemAllocFromPoolAsync_ptsz as _,
        b"cuMemAllocFromPoolAsync" => alloc::cuMemAllocFromPoolAsync as _,
        b"cuMemPoolCreate" => pools::cuMemPoolCreate as _,
        b"cuMemPoolDestroy" => pools::cuMemPoolDestroy as _,
        b"cuMemPoolTrimTo" => pools::cuMemPoolTrimTo as _,
        b"cuMemGetDefaultMemPool" => pools::cuMemGetDefaultMemPool as _,
        b"cuMemGetMemPool" => pools::cuMemGetMemPool as _,
        b"cuMemSetMemPool" => pools::cuMemSetMemPool as _,
        b"cuDeviceSetMemPool" => pools::cuDeviceSetMemPool as _,
        b"cuMemCreate" => vmm::cuMemCreate as _,
        b"cuMemRelease" => vmm::cuMemRelease as _,
        b"cuMemRetainAllocationHandle" => vmm::cuMemRetainAllocationHandle as _,
        b"cuMemExportToShareableHandle" => vmm::cuMemExportToShareableHandle as _,
        b"cuMemMap" => vmm::cuMemMap as _,
        b"cuMemUnmap" => vmm::cuMemUnmap as _,
        b"cuMemAllocManaged" => charged::cuMemAllocManaged as _,
        // A versioned name asked for as such.
        other => return dlsym::hook_for(other).filter(|_| other.starts_with(b"cu")),
    };
    Some(f)
}

/// Replaces the driver's answer in `*pfn` with the hook, where there is one.
///
/// # Safety
/// `symbol` is a NUL-terminated string and `pfn` valid for a read and a write.
unsafe fn replace(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64) {
    if pfn.is_null() {
        return;
    }
    // SAFETY: the caller's out pointer, which the driver just wrote.
    let found = unsafe { *pfn };
    if found.is_null() {
        return;
    }
    if let Some(hook) = real::hook_for_pointer(found) {
        BY_POINTER.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { *pfn = hook };
        return;
    }
    if symbol.is_null() {
        return;
    }
    // SAFETY: the caller's NUL-terminated symbol name (checked non-null).
    let name = unsafe { CStr::from_ptr(symbol) };
    if let Some(hook) = hook_by_name(name.to_bytes(), version, flags) {
        BY_NAME.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { *pfn = hook };
    }
}

/// See the module documentation.
///
/// # Safety
/// As for the driver's `cuGetProcAddress_v2`: `symbol` is a NUL-terminated string, `pfn` valid
/// for one write, `symbol_status` null or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
    symbol_status: *mut c_int,
) -> CuResult {
    let Some(real) = real::driver().get_proc_address_v2 else {
        return CUDA_ERROR_NOT_FOUND;
    };
    // SAFETY: the driver's own function with the caller's arguments.
    let r = unsafe { real(symbol, pfn, cuda_version, flags, symbol_status) };
    if r == CUDA_SUCCESS {
        // SAFETY: the caller's arguments, as this function requires them.
        unsafe { replace(symbol, pfn, cuda_version, flags) };
    }
    r
}

/// See the module documentation (the form before CUDA 12.0, without the status).
///
/// # Safety
/// As for the driver's `cuGetProcAddress`: `symbol` is a NUL-terminated string, `pfn` valid for
/// one write.
#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
) -> CuResult {
    let Some(real) = real::driver().get_proc_address else {
        return CUDA_ERROR_NOT_FOUND;
    };
    // SAFETY: the driver's own function with the caller's arguments.
    let r = unsafe { real(symbol, pfn, cuda_version, flags) };
    if r == CUDA_SUCCESS {
        // SAFETY: the caller's arguments, as this function requires them.
        unsafe { replace(symbol, pfn, cuda_version, flags) };
    }
    r
}
