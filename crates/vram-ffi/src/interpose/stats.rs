//! Counts of what each interposed entry point did, for `vram_interposed_calls` and
//! `vram_interposer_stats_json`: the proof, in a real program, that its memory went through
//! vramd and how.

use std::ffi::{c_char, c_void, CString};
use std::sync::atomic::{AtomicU64, Ordering};

use super::{dlsym, procaddr};
use crate::guarded;

/// An interposed entry point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hook {
    CudaMalloc,
    CudaFree,
    CudaMallocAsync,
    CudaFreeAsync,
    MemAlloc,
    MemAllocPitch,
    MemFree,
    MemAllocAsync,
    MemFreeAsync,
    MemAllocFromPoolAsync,
    MemAllocFromDriverPool,
    MemCreate,
    MemRelease,
    MemRetain,
    MemExport,
    MemMap,
    MemUnmap,
    MemAllocManaged,
    MemFreeManaged,
    MemGetInfo,
    NvmlMemoryInfo,
    NvmlMemoryInfoV2,
}

const HOOKS: [(Hook, &str); 22] = [
    (Hook::CudaMalloc, "cudaMalloc"),
    (Hook::CudaFree, "cudaFree"),
    (Hook::CudaMallocAsync, "cudaMallocAsync"),
    (Hook::CudaFreeAsync, "cudaFreeAsync"),
    (Hook::MemAlloc, "cuMemAlloc_v2"),
    (Hook::MemAllocPitch, "cuMemAllocPitch_v2"),
    (Hook::MemFree, "cuMemFree_v2"),
    (Hook::MemAllocAsync, "cuMemAllocAsync"),
    (Hook::MemFreeAsync, "cuMemFreeAsync"),
    (Hook::MemAllocFromPoolAsync, "cuMemAllocFromPoolAsync"),
    (
        Hook::MemAllocFromDriverPool,
        "cuMemAllocFromPoolAsync_driver_pool",
    ),
    (Hook::MemCreate, "cuMemCreate"),
    (Hook::MemRelease, "cuMemRelease"),
    (Hook::MemRetain, "cuMemRetainAllocationHandle"),
    (Hook::MemExport, "cuMemExportToShareableHandle"),
    (Hook::MemMap, "cuMemMap"),
    (Hook::MemUnmap, "cuMemUnmap"),
    (Hook::MemAllocManaged, "cuMemAllocManaged"),
    (Hook::MemFreeManaged, "cuMemFree_v2_managed"),
    (Hook::MemGetInfo, "cuMemGetInfo_v2"),
    (Hook::NvmlMemoryInfo, "nvmlDeviceGetMemoryInfo"),
    (Hook::NvmlMemoryInfoV2, "nvmlDeviceGetMemoryInfo_v2"),
];

/// The hooks whose served calls are allocations and frees of vramd's allocator.
const ALLOCATOR: [Hook; 10] = [
    Hook::CudaMalloc,
    Hook::CudaFree,
    Hook::CudaMallocAsync,
    Hook::CudaFreeAsync,
    Hook::MemAlloc,
    Hook::MemAllocPitch,
    Hook::MemFree,
    Hook::MemAllocAsync,
    Hook::MemFreeAsync,
    Hook::MemAllocFromPoolAsync,
];

/// Per hook: served by vramd (allocated or freed by its allocator; charged, or a charged
/// allocation's references and mappings counted; answered with the tenant's view), passed to the
/// function underneath unchanged, refused.
static SERVED: [AtomicU64; HOOKS.len()] = [const { AtomicU64::new(0) }; HOOKS.len()];
static PASSED: [AtomicU64; HOOKS.len()] = [const { AtomicU64::new(0) }; HOOKS.len()];
static REFUSED: [AtomicU64; HOOKS.len()] = [const { AtomicU64::new(0) }; HOOKS.len()];

pub(crate) fn served(h: Hook) {
    SERVED[h as usize].fetch_add(1, Ordering::Relaxed);
}

pub(crate) fn passed(h: Hook) {
    PASSED[h as usize].fetch_add(1, Ordering::Relaxed);
}

pub(crate) fn refused(h: Hook) {
    REFUSED[h as usize].fetch_add(1, Ordering::Relaxed);
}

/// How many allocations and frees vramd's allocator served through the interposed runtime and
/// driver entry points (`cudaMalloc` ... `cuMemFreeAsync`) in this process.
pub(crate) fn allocator_calls() -> u64 {
    ALLOCATOR
        .iter()
        .map(|&h| SERVED[h as usize].load(Ordering::Relaxed))
        .sum()
}

/// Whether a lookup of the driver's `cuMemAlloc_v2` in the process's global scope finds
/// libvram.so's: true when the library was preloaded.
fn preloaded() -> bool {
    let found = dlsym::lookup(libc::RTLD_DEFAULT, c"cuMemAlloc_v2");
    found == super::alloc::cuMemAlloc_v2 as *mut c_void
}

/// See `include/vram.h`.
#[no_mangle]
pub extern "C" fn vram_interposer_stats_json() -> *mut c_char {
    guarded(std::ptr::null_mut(), || {
        let mut hooks = serde_json::Map::new();
        for (h, name) in HOOKS {
            let i = h as usize;
            hooks.insert(
                name.to_owned(),
                serde_json::json!({
                    "served": SERVED[i].load(Ordering::Relaxed),
                    "passed": PASSED[i].load(Ordering::Relaxed),
                    "refused": REFUSED[i].load(Ordering::Relaxed),
                }),
            );
        }
        let (by_pointer, by_name) = procaddr::replaced();
        let v = serde_json::json!({
            "preloaded": preloaded(),
            "allocator_calls": allocator_calls(),
            "dlsym_answered": dlsym::ANSWERED.load(Ordering::Relaxed),
            "proc_address_replaced": { "by_pointer": by_pointer, "by_name": by_name },
            "hooks": hooks,
        });
        let s = CString::new(v.to_string()).map_err(|e| e.to_string())?;
        Ok(s.into_raw())
    })
}
