//! The driver's own functions, which the hooks call to do the work they do not do themselves and
//! which `cuGetProcAddress` answers are compared against.
//!
//! Found once, through glibc's `dlsym` (never the interposed one) on the driver library the
//! process already loaded (`RTLD_NOLOAD`), else on `libcuda.so.1` loaded here (which finds a
//! stand-in on `LD_LIBRARY_PATH` in the tests). A function the driver lacks is `None`.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

use super::dlsym;
use super::{CuContext, CuDevicePtr, CuResult, CuStream};

pub(crate) type MemAlloc = unsafe extern "C" fn(*mut CuDevicePtr, usize) -> CuResult;
pub(crate) type MemAllocPitch =
    unsafe extern "C" fn(*mut CuDevicePtr, *mut usize, usize, usize, c_uint) -> CuResult;
pub(crate) type MemFree = unsafe extern "C" fn(CuDevicePtr) -> CuResult;
pub(crate) type MemAllocAsync = unsafe extern "C" fn(*mut CuDevicePtr, usize, CuStream) -> CuResult;
pub(crate) type MemFreeAsync = unsafe extern "C" fn(CuDevicePtr, CuStream) -> CuResult;
pub(crate) type StreamDestroy = unsafe extern "C" fn(CuStream) -> CuResult;
pub(crate) type MemAllocFromPoolAsync =
    unsafe extern "C" fn(*mut CuDevicePtr, usize, *mut c_void, CuStream) -> CuResult;
pub(crate) type MemPoolCreate =
    unsafe extern "C" fn(*mut *mut c_void, *const super::pools::PoolProps) -> CuResult;
pub(crate) type MemPoolDestroy = unsafe extern "C" fn(*mut c_void) -> CuResult;
pub(crate) type MemGetPool =
    unsafe extern "C" fn(*mut *mut c_void, *const super::pools::Location, c_uint) -> CuResult;
pub(crate) type MemSetPool =
    unsafe extern "C" fn(*const super::pools::Location, c_uint, *mut c_void) -> CuResult;
pub(crate) type DeviceSetMemPool = unsafe extern "C" fn(c_int, *mut c_void) -> CuResult;
pub(crate) type MemPoolTrimTo = unsafe extern "C" fn(*mut c_void, usize) -> CuResult;
pub(crate) type MemPoolGetAttribute =
    unsafe extern "C" fn(*mut c_void, c_int, *mut c_void) -> CuResult;
pub(crate) type MemCreate =
    unsafe extern "C" fn(*mut u64, usize, *const super::vmm::AllocationProp, u64) -> CuResult;
pub(crate) type MemRelease = unsafe extern "C" fn(u64) -> CuResult;
pub(crate) type MemRetainAllocationHandle = unsafe extern "C" fn(*mut u64, *mut c_void) -> CuResult;
pub(crate) type MemExportToShareableHandle =
    unsafe extern "C" fn(*mut c_void, u64, c_uint, u64) -> CuResult;
pub(crate) type MemMap = unsafe extern "C" fn(CuDevicePtr, usize, usize, u64, u64) -> CuResult;
pub(crate) type MemUnmap = unsafe extern "C" fn(CuDevicePtr, usize) -> CuResult;
pub(crate) type MemAllocManaged = unsafe extern "C" fn(*mut CuDevicePtr, usize, c_uint) -> CuResult;
pub(crate) type MemGetInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> CuResult;
pub(crate) type CtxSynchronize = unsafe extern "C" fn() -> CuResult;
pub(crate) type CtxGetDevice = unsafe extern "C" fn(*mut c_int) -> CuResult;
pub(crate) type CtxGetCurrent = unsafe extern "C" fn(*mut CuContext) -> CuResult;
pub(crate) type CtxPushCurrent = unsafe extern "C" fn(CuContext) -> CuResult;
pub(crate) type CtxPopCurrent = unsafe extern "C" fn(*mut CuContext) -> CuResult;
pub(crate) type StreamGetCtx = unsafe extern "C" fn(CuStream, *mut CuContext) -> CuResult;
pub(crate) type DeviceGet = unsafe extern "C" fn(*mut c_int, c_int) -> CuResult;
pub(crate) type DeviceGetUuid = unsafe extern "C" fn(*mut [u8; 16], c_int) -> CuResult;
pub(crate) type GetProcAddress =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> CuResult;
pub(crate) type GetProcAddressV2 =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> CuResult;

/// The driver's functions that libvram.so hooks or calls.
pub(crate) struct Driver {
    pub mem_alloc: Option<MemAlloc>,
    pub mem_alloc_pitch: Option<MemAllocPitch>,
    pub mem_free: Option<MemFree>,
    pub mem_alloc_async: Option<MemAllocAsync>,
    pub mem_alloc_async_ptsz: Option<MemAllocAsync>,
    pub mem_free_async: Option<MemFreeAsync>,
    pub mem_free_async_ptsz: Option<MemFreeAsync>,
    pub mem_alloc_from_pool_async: Option<MemAllocFromPoolAsync>,
    pub mem_alloc_from_pool_async_ptsz: Option<MemAllocFromPoolAsync>,
    pub mem_pool_create: Option<MemPoolCreate>,
    pub mem_pool_destroy: Option<MemPoolDestroy>,
    pub mem_pool_trim_to: Option<MemPoolTrimTo>,
    pub mem_pool_get_attribute: Option<MemPoolGetAttribute>,
    pub mem_get_default_mem_pool: Option<MemGetPool>,
    pub mem_get_mem_pool: Option<MemGetPool>,
    pub mem_set_mem_pool: Option<MemSetPool>,
    pub device_set_mem_pool: Option<DeviceSetMemPool>,
    pub mem_create: Option<MemCreate>,
    pub mem_release: Option<MemRelease>,
    pub mem_retain_allocation_handle: Option<MemRetainAllocationHandle>,
    pub mem_export_to_shareable_handle: Option<MemExportToShareableHandle>,
    pub mem_map: Option<MemMap>,
    pub mem_unmap: Option<MemUnmap>,
    pub mem_alloc_managed: Option<MemAllocManaged>,
    pub mem_get_info: Option<MemGetInfo>,
    pub ctx_synchronize: Option<CtxSynchronize>,
    pub ctx_get_device: Option<CtxGetDevice>,
    pub ctx_get_current: Option<CtxGetCurrent>,
    pub ctx_push_current: Option<CtxPushCurrent>,
    pub ctx_pop_current: Option<CtxPopCurrent>,
    pub stream_get_ctx: Option<StreamGetCtx>,
    pub stream_destroy: Option<StreamDestroy>,
    pub device_get: Option<DeviceGet>,
    pub device_get_uuid: Option<DeviceGetUuid>,
    pub get_proc_address: Option<GetProcAddress>,
    pub get_proc_address_v2: Option<GetProcAddressV2>,
}

/// `dlopen` of the driver library: the one the process has, else loaded now.
fn driver_library() -> *mut c_void {
    let name = c"libcuda.so.1";
    // SAFETY: dlopen with a NUL-terminated name; RTLD_NOLOAD only looks for a loaded library.
    let loaded = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    if !loaded.is_null() {
        return loaded;
    }
    // SAFETY: as above; loading the driver library runs no initialiser with preconditions.
    unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW) }
}

/// Resolves `name` in `lib` as a function of type `F` (a C function pointer type).
///
/// # Safety
/// `F` must be the C signature of the driver's function `name`.
unsafe fn function<F: Copy>(lib: *mut c_void, name: &CStr) -> Option<F> {
    const { assert!(std::mem::size_of::<F>() == std::mem::size_of::<*mut c_void>()) };
    if lib.is_null() {
        return None;
    }
    let p = dlsym::lookup(lib, name);
    // SAFETY: a non-null pointer is the driver's function `name`, whose signature the caller
    // vouches `F` is; F is a function pointer, of a pointer's size (asserted above).
    (!p.is_null()).then(|| unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
}

/// The driver's functions, found on first use.
pub(crate) fn driver() -> &'static Driver {
    static DRIVER: OnceLock<Driver> = OnceLock::new();
    DRIVER.get_or_init(|| {
        let lib = driver_library();
        // SAFETY: each type is the C signature of the function named (cuda.h, CUDA 12 and 13).
        unsafe {
            Driver {
                mem_alloc: function(lib, c"cuMemAlloc_v2"),
                mem_alloc_pitch: function(lib, c"cuMemAllocPitch_v2"),
                mem_free: function(lib, c"cuMemFree_v2"),
                mem_alloc_async: function(lib, c"cuMemAllocAsync"),
                mem_alloc_async_ptsz: function(lib, c"cuMemAllocAsync_ptsz"),
                mem_free_async: function(lib, c"cuMemFreeAsync"),
                mem_free_async_ptsz: function(lib, c"cuMemFreeAsync_ptsz"),
                mem_alloc_from_pool_async: function(lib, c"cuMemAllocFromPoolAsync"),
                mem_alloc_from_pool_async_ptsz: function(lib, c"cuMemAllocFromPoolAsync_ptsz"),
                mem_pool_create: function(lib, c"cuMemPoolCreate"),
                mem_pool_destroy: function(lib, c"cuMemPoolDestroy"),
                mem_pool_trim_to: function(lib, c"cuMemPoolTrimTo"),
                mem_pool_get_attribute: function(lib, c"cuMemPoolGetAttribute"),
                mem_get_default_mem_pool: function(lib, c"cuMemGetDefaultMemPool"),
                mem_get_mem_pool: function(lib, c"cuMemGetMemPool"),
                mem_set_mem_pool: function(lib, c"cuMemSetMemPool"),
                device_set_mem_pool: function(lib, c"cuDeviceSetMemPool"),
                mem_create: function(lib, c"cuMemCreate"),
                mem_release: function(lib, c"cuMemRelease"),
                mem_retain_allocation_handle: function(lib, c"cuMemRetainAllocationHandle"),
                mem_export_to_shareable_handle: function(lib, c"cuMemExportToShareableHandle"),
                mem_map: function(lib, c"cuMemMap"),
                mem_unmap: function(lib, c"cuMemUnmap"),
                mem_alloc_managed: function(lib, c"cuMemAllocManaged"),
                mem_get_info: function(lib, c"cuMemGetInfo_v2"),
                ctx_synchronize: function(lib, c"cuCtxSynchronize"),
                ctx_get_device: function(lib, c"cuCtxGetDevice"),
                ctx_get_current: function(lib, c"cuCtxGetCurrent"),
                ctx_push_current: function(lib, c"cuCtxPushCurrent_v2"),
                ctx_pop_current: function(lib, c"cuCtxPopCurrent_v2"),
                stream_get_ctx: function(lib, c"cuStreamGetCtx"),
                stream_destroy: function(lib, c"cuStreamDestroy_v2"),
                device_get: function(lib, c"cuDeviceGet"),
                device_get_uuid: function(lib, c"cuDeviceGetUuid_v2")
                    .or_else(|| function(lib, c"cuDeviceGetUuid")),
                get_proc_address: function(lib, c"cuGetProcAddress"),
                get_proc_address_v2: function(lib, c"cuGetProcAddress_v2"),
            }
        }
    })
}

/// The driver entry points libvram.so hooks, by their exported names.
const HOOKED: &[&CStr] = &[
    c"cuGetProcAddress",
    c"cuGetProcAddress_v2",
    c"cuMemAlloc_v2",
    c"cuMemAllocPitch_v2",
    c"cuMemFree_v2",
    c"cuMemAllocAsync",
    c"cuMemAllocAsync_ptsz",
    c"cuMemFreeAsync",
    c"cuMemFreeAsync_ptsz",
    c"cuMemAllocFromPoolAsync",
    c"cuMemAllocFromPoolAsync_ptsz",
    c"cuMemPoolCreate",
    c"cuMemPoolDestroy",
    c"cuMemPoolTrimTo",
    c"cuMemGetDefaultMemPool",
    c"cuMemGetMemPool",
    c"cuMemSetMemPool",
    c"cuDeviceSetMemPool",
    c"cuMemCreate",
    c"cuMemRelease",
    c"cuMemRetainAllocationHandle",
    c"cuMemExportToShareableHandle",
    c"cuMemMap",
    c"cuMemUnmap",
    c"cuMemAllocManaged",
    c"cuMemGetInfo_v2",
    c"cuStreamDestroy_v2",
];

/// The hook for a function pointer the driver handed out, if the pointer is the real address of
/// a function libvram.so hooks.
pub(crate) fn hook_for_pointer(p: *mut c_void) -> Option<*mut c_void> {
    static PAIRS: OnceLock<Vec<(usize, usize)>> = OnceLock::new();
    if p.is_null() {
        return None;
    }
    let pairs = PAIRS.get_or_init(|| {
        let lib = driver_library();
        HOOKED
            .iter()
            .filter_map(|name| {
                let real = if lib.is_null() {
                    std::ptr::null_mut()
                } else {
                    dlsym::lookup(lib, name)
                };
                let hook = dlsym::hook_for(name.to_bytes())?;
                (!real.is_null()).then_some((real as usize, hook as usize))
            })
            .collect()
    });
    pairs
        .iter()
        .find(|(real, _)| *real == p as usize)
        .map(|&(_, hook)| hook as *mut c_void)
}
