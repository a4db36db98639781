//! Memory pools a program makes itself (`cuMemPoolCreate`), and which of their allocations are
//! the driver's.
//!
//! [`super::alloc`] serves `cuMemAllocFromPoolAsync` from the tenant's memory, as it serves
//! `cuMemAllocAsync`. Some pools ask for memory vramd's is not: a pool located on the host
//! (pinned host memory, which the CPU reads and writes), and a pool whose allocations may be
//! exported to other processes (`cuMemPoolExportPointer` takes only the pool's own memory). Their
//! allocations, and those of a pool on another device than the tenant's, are the driver's: a
//! pool's properties are read when it is made and kept until it is destroyed. An allocation of
//! the driver's on the tenant's GPU is charged to the tenant, as `cuMemAllocManaged` is
//! ([`super::charged`]): refused past its limit, uncharged when freed (`cuMemFreeAsync` or
//! `cuMemFree_v2`). One on the host is not GPU memory and is not charged.
//!
//! The device's own pools (`cuDeviceGetDefaultMemPool`) and pools the program made on the
//! tenant's GPU with no export are served by vramd; their settings (release threshold, maximum
//! size) do not apply to vramd's memory. `cuMemAllocAsync` is served whichever pool is current
//! for the device (`cuDeviceSetMemPool`).

use std::collections::HashMap;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::{LazyLock, Mutex, MutexGuard};

use vram_core::Bytes;

use super::real;
use super::stats::{self, Hook};
use super::{
    is_tenant_device, tenant_or_log, CuDevicePtr, CuResult, CUDA_ERROR_NOT_FOUND,
    CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS,
};
use crate::guarded;

/// `CUmemPoolProps` (cuda.h): only the leading fields are read; the driver reads the rest.
#[repr(C)]
pub struct PoolProps {
    pub alloc_type: c_uint,
    /// `CUmemAllocationHandleType` flags: non-zero when allocations may be exported.
    pub handle_types: c_uint,
    /// `CUmemLocation.type`.
    pub location_type: c_uint,
    /// `CUmemLocation.id`: the device ordinal for `CU_MEM_LOCATION_TYPE_DEVICE`.
    pub location_id: c_int,
}

/// `CU_MEM_LOCATION_TYPE_DEVICE`.
const LOCATION_DEVICE: c_uint = 1;

/// Where a pool the program made keeps its memory, as far as vramd is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// On device `ordinal`; `exportable` if its allocations may be shared with other processes.
    Device { ordinal: c_int, exportable: bool },
    /// Anywhere else: the host, a host NUMA node.
    Host,
}

/// Pools made through `cuMemPoolCreate`, by handle, until `cuMemPoolDestroy`.
static MADE: LazyLock<Mutex<HashMap<usize, Place>>> = LazyLock::new(Default::default);
/// Charged allocations of the driver's from pools, by pointer: their sizes.
static CHARGED: LazyLock<Mutex<HashMap<CuDevicePtr, u64>>> = LazyLock::new(Default::default);

fn lock<T>(m: &'static Mutex<T>) -> MutexGuard<'static, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether an allocation from `pool` is the driver's to make (see the module documentation).
pub(crate) fn drivers(pool: *mut c_void) -> bool {
    let Some(place) = lock(&MADE).get(&(pool as usize)).copied() else {
        return false;
    };
    match place {
        Place::Host
        | Place::Device {
            exportable: true, ..
        } => true,
        // Where the tenant cannot be set up, vramd's path refuses the call with the reason.
        Place::Device { ordinal, .. } => match crate::tenant() {
            Ok(t) => !is_tenant_device(t, ordinal),
            Err(_) => false,
        },
    }
}

/// An allocation from a pool whose memory is the driver's: made by `make` (the driver's
/// function, which writes `*dptr`), then charged if it is on the tenant's GPU; a refused charge
/// frees it with `unmake` (the driver's stream-ordered free) and fails with out-of-memory.
///
/// # Safety
/// `dptr` is valid for a read and a write.
pub(crate) unsafe fn alloc_from_drivers_pool(
    dptr: *mut CuDevicePtr,
    bytesize: usize,
    pool: *mut c_void,
    make: impl FnOnce() -> CuResult,
    unmake: impl FnOnce(CuDevicePtr),
) -> CuResult {
    let place = lock(&MADE).get(&(pool as usize)).copied();
    let on_tenant_gpu = match place {
        Some(Place::Device { ordinal, .. }) => match guarded(None, || tenant_or_log().map(Some)) {
            Some(t) => is_tenant_device(t, ordinal),
            None => {
                stats::refused(Hook::MemAllocFromDriverPool);
                return CUDA_ERROR_OUT_OF_MEMORY;
            }
        },
        _ => false,
    };
    let r = make();
    if r != CUDA_SUCCESS || !on_tenant_gpu {
        if r == CUDA_SUCCESS {
            stats::passed(Hook::MemAllocFromDriverPool);
        }
        return r;
    }
    // SAFETY: the driver succeeded, so it wrote the pointer through the caller's valid pointer.
    let ptr = unsafe { *dptr };
    let bytes = bytesize as u64;
    let charged = guarded(false, || {
        let t = tenant_or_log()?;
        super::charged::charge(t, "cuMemAllocFromPoolAsync", Bytes(bytes)).map(|()| true)
    });
    if !charged {
        unmake(ptr);
        // SAFETY: as above, the caller's valid pointer.
        unsafe { *dptr = 0 };
        stats::refused(Hook::MemAllocFromDriverPool);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    lock(&CHARGED).insert(ptr, bytes);
    stats::served(Hook::MemAllocFromDriverPool);
    CUDA_SUCCESS
}

/// A free of a charged pool allocation: done by `free` (the driver's function), then uncharged.
/// `None` if `ptr` is not such an allocation.
pub(crate) fn free_charged(ptr: CuDevicePtr, free: impl FnOnce() -> CuResult) -> Option<CuResult> {
    let bytes = lock(&CHARGED).remove(&ptr)?;
    let r = free();
    if r == CUDA_SUCCESS {
        super::charged::uncharge(bytes);
    } else {
        lock(&CHARGED).insert(ptr, bytes);
    }
    Some(r)
}

/// See the module documentation: the pool is made by the driver; its place is kept.
///
/// # Safety
/// As for the driver's `cuMemPoolCreate`: `pool` is valid for one write and `props` points to a
/// `CUmemPoolProps`.
#[no_mangle]
pub unsafe extern "C" fn cuMemPoolCreate(
    pool: *mut *mut c_void,
    props: *const PoolProps,
) -> CuResult {
    let Some(create) = real::driver().mem_pool_create else {
        return CUDA_ERROR_NOT_FOUND;
    };
    // SAFETY: the driver's own function with the caller's arguments.
    let r = unsafe { create(pool, props) };
    if r == CUDA_SUCCESS && !pool.is_null() && !props.is_null() {
        // SAFETY: the driver accepted `props` and wrote the pool through `pool`, both the
        // caller's valid pointers; only the leading fields of the properties are read.
        let (made, p) = unsafe { (*pool, &*props) };
        let place = if p.location_type == LOCATION_DEVICE {
            Place::Device {
                ordinal: p.location_id,
                exportable: p.handle_types != 0,
            }
        } else {
            Place::Host
        };
        lock(&MADE).insert(made as usize, place);
    }
    r
}

/// See the module documentation: the pool is forgotten once the driver destroyed it (its
/// handle may be given to another pool).
///
/// # Safety
/// As for the driver's `cuMemPoolDestroy`.
#[no_mangle]
pub unsafe extern "C" fn cuMemPoolDestroy(pool: *mut c_void) -> CuResult {
    let Some(destroy) = real::driver().mem_pool_destroy else {
        return CUDA_ERROR_NOT_FOUND;
    };
    // SAFETY: the driver's own function with the caller's argument.
    let r = unsafe { destroy(pool) };
    if r == CUDA_SUCCESS {
        lock(&MADE).remove(&(pool as usize));
    }
    r
}
