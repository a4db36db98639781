//! Memory pools a program makes itself (`cuMemPoolCreate`), and which of their allocations are
//! the driver's.
//!
//! [`super::alloc`] serves `cuMemAllocFromPoolAsync` from the tenant's memory, as it serves
//! `cuMemAllocAsync`. A pool made here whose memory vramd's cannot stand in for is the driver's:
//! one located on the host (pinned host memory, which the CPU reads and writes), one whose
//! allocations may be exported to other processes (`cuMemPoolExportPointer` takes only the
//! pool's own memory), one of managed memory or of a location this library does not know, one on
//! another device; and a pool on the tenant's GPU asked for on a stream of another GPU. A pool's
//! properties are read when it is made and kept until it is destroyed.
//!
//! A driver's pool that may hold memory of the tenant's GPU (all but those on the host or on
//! another device) is charged to the tenant by what the pool reserves, not by what is allocated
//! from it: a pool keeps memory beyond its allocations (its release threshold, the driver's own
//! rounding) and after their free. The reservation
//! (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`) is read after each allocation, free and trim, and
//! the charge follows it: up, or refused past the tenant's limit (the allocation is freed again
//! and fails with out-of-memory); down, once the pool gave memory back. Destroying the pool takes
//! back what is left of its charge, or, where allocations from it are still out (the driver
//! frees its memory only once they are freed), keeps that charge until the last of them is.
//!
//! The driver's own pools of other locations than a device, which a program can only get from
//! `cuMemGetDefaultMemPool` or `cuMemGetMemPool`, are placed as a made pool is when those hand
//! them out: a host's default pool is the driver's, uncharged; a managed one the driver's,
//! charged.
//!
//! The device's own pools (`cuDeviceGetDefaultMemPool`, or any pool not seen here) and a pool
//! made on the tenant's GPU with no export, asked for on a stream of the tenant's GPU, are served
//! by vramd; their settings (release threshold, maximum size) do not apply to vramd's memory.
//!
//! `cuMemAllocAsync` takes from the current pool of its stream's device. Where a program made a
//! pool vramd's memory cannot stand in for current on the tenant's GPU (`cuDeviceSetMemPool`,
//! `cuMemSetMemPool`), its allocations there are the driver's and charged as that pool's are;
//! otherwise vramd serves them. Pool mode's `cudaMallocAsync` ([`crate::cudart`]) asks
//! [`current_drivers`] too, and passes such a call on to the runtime, which reaches the driver's
//! `cuMemAllocAsync` here.

use std::collections::HashMap;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{LazyLock, Mutex, MutexGuard};

use vram_core::Bytes;

use super::real;
use super::stats::{self, Hook};
use super::{
    is_tenant_device, stream_gpu, tenant_or_log, CuDevicePtr, CuResult, CuStream, Gpu,
    CUDA_ERROR_NOT_FOUND, CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS,
};
use crate::{guarded, Tenant};

/// `CUmemPoolProps` (cuda.h): only the leading fields are read; the driver reads the rest.
#[repr(C)]
pub struct PoolProps {
    /// `CUmemAllocationType`.
    pub alloc_type: c_uint,
    /// `CUmemAllocationHandleType` flags: non-zero when allocations may be exported.
    pub handle_types: c_uint,
    /// `CUmemLocation.type`.
    pub location_type: c_uint,
    /// `CUmemLocation.id`: the device ordinal for `CU_MEM_LOCATION_TYPE_DEVICE`.
    pub location_id: c_int,
}

/// `CUmemLocation` (cuda.h).
#[repr(C)]
pub struct Location {
    /// `CUmemLocationType`.
    pub location_type: c_uint,
    /// The device ordinal for `CU_MEM_LOCATION_TYPE_DEVICE`, a NUMA node for the host's.
    pub id: c_int,
}

/// `CU_MEM_ALLOCATION_TYPE_PINNED`: device (or pinned host) memory, not managed.
const ALLOCATION_PINNED: c_uint = 1;
/// `CU_MEM_LOCATION_TYPE_DEVICE`.
const LOCATION_DEVICE: c_uint = 1;
/// `CU_MEM_LOCATION_TYPE_HOST`, `_HOST_NUMA`, `_HOST_NUMA_CURRENT`.
const LOCATIONS_HOST: [c_uint; 3] = [2, 3, 4];
/// `CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`: the memory the pool holds from the device now.
const ATTR_RESERVED_MEM_CURRENT: c_int = 5;

/// Where a pool made here keeps its memory, as far as vramd is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// Pinned memory of device `ordinal`; `exportable` if its allocations may be shared with
    /// other processes.
    Device { ordinal: c_int, exportable: bool },
    /// Pinned host memory: not GPU memory.
    Host,
    /// Managed memory, or a location this library does not know: the driver's, charged.
    Other,
}

impl Place {
    fn of(p: &PoolProps) -> Place {
        let at = Location {
            location_type: p.location_type,
            id: p.location_id,
        };
        Place::at(p.alloc_type, &at, p.handle_types != 0)
    }

    fn at(alloc_type: c_uint, at: &Location, exportable: bool) -> Place {
        if alloc_type == ALLOCATION_PINNED && at.location_type == LOCATION_DEVICE {
            Place::Device {
                ordinal: at.id,
                exportable,
            }
        } else if alloc_type == ALLOCATION_PINNED && LOCATIONS_HOST.contains(&at.location_type) {
            Place::Host
        } else {
            Place::Other
        }
    }
}

/// A pool made through `cuMemPoolCreate`.
struct Made {
    place: Place,
    /// What of the pool's reservation is charged to the tenant now.
    charged: u64,
}

/// Pools made through `cuMemPoolCreate`, by handle, until `cuMemPoolDestroy`. Its lock is held
/// across the driver's create and destroy, so that a handle the driver gives again is never
/// mistaken for the destroyed pool's.
static MADE: LazyLock<Mutex<HashMap<usize, Made>>> = LazyLock::new(Default::default);
/// Allocations from charged pools, by pointer: their pool.
static FROM: LazyLock<Mutex<HashMap<CuDevicePtr, usize>>> = LazyLock::new(Default::default);
/// Charged pools destroyed while allocations from them were still out, by a number of their own
/// (the pool's handle may be given to another pool): their charge and how many are still out.
static LEFTOVER: LazyLock<Mutex<Leftovers>> = LazyLock::new(Default::default);

#[derive(Default)]
struct Leftovers {
    next: u64,
    /// Number -> (charge, allocations still out).
    pools: HashMap<u64, (u64, usize)>,
    /// An allocation still out -> its destroyed pool's number.
    of: HashMap<CuDevicePtr, u64>,
}

/// Whether `MADE` ever held a pool: until then every pool is a device's own, and an allocation
/// from one takes no lock to find that out.
static ANY_MADE: AtomicBool = AtomicBool::new(false);
/// Pools made current for a device (`cuDeviceSetMemPool`, `cuMemSetMemPool`), by ordinal.
static CURRENT: LazyLock<Mutex<HashMap<c_int, usize>>> = LazyLock::new(Default::default);
/// Whether `CURRENT` ever held a pool: until then `cuMemAllocAsync` takes no lock for it.
static ANY_CURRENT: AtomicBool = AtomicBool::new(false);

fn lock<T>(m: &'static Mutex<T>) -> MutexGuard<'static, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What becomes of an allocation from `pool` on `stream`.
pub(crate) enum Verdict {
    /// vramd's allocator serves it (a pool not made here, or one on the tenant's GPU asked for
    /// on its stream).
    Serve,
    /// The driver makes it; `charged`: the pool's reservation is charged to the tenant.
    Driver { charged: bool },
}

/// See the module documentation. Where the tenant cannot be set up, vramd's path refuses the
/// call with the reason.
pub(crate) fn verdict(pool: *mut c_void, stream: CuStream) -> Verdict {
    if !ANY_MADE.load(Ordering::Acquire) {
        return Verdict::Serve;
    }
    let Some(place) = lock(&MADE).get(&(pool as usize)).map(|m| m.place) else {
        return Verdict::Serve;
    };
    let Some(t) = crate::tenant_or_none() else {
        return Verdict::Serve;
    };
    match place {
        Place::Host => Verdict::Driver { charged: false },
        Place::Other => Verdict::Driver { charged: true },
        Place::Device { ordinal, .. } if !is_tenant_device(t, ordinal) => {
            Verdict::Driver { charged: false }
        }
        Place::Device {
            exportable: true, ..
        } => Verdict::Driver { charged: true },
        Place::Device { .. } if stream_gpu(t, stream) == Gpu::Tenant => Verdict::Serve,
        Place::Device { .. } => Verdict::Driver { charged: true },
    }
}

/// The pool a `cuMemAllocAsync` on `stream` takes from, and whether it is charged, where that
/// is the driver's (see the module documentation); `None` where vramd serves it or the stream is
/// of another GPU (the driver's, as any call there).
pub(crate) fn current_drivers(stream: CuStream) -> Option<(*mut c_void, bool)> {
    if !ANY_CURRENT.load(Ordering::Acquire) {
        return None;
    }
    let t = crate::tenant_or_none()?;
    if stream_gpu(t, stream) != Gpu::Tenant {
        return None;
    }
    let pool = lock(&CURRENT)
        .iter()
        .find(|&(&ordinal, _)| is_tenant_device(t, ordinal))
        .map(|(_, &pool)| pool as *mut c_void)?;
    match verdict(pool, stream) {
        Verdict::Driver { charged } => Some((pool, charged)),
        Verdict::Serve => None,
    }
}

/// An allocation from a driver's pool: made by `make` (the driver's function, which writes
/// `*dptr`); where the pool is `charged`, its reservation is then charged, and a refused charge
/// frees the allocation with `unmake` (the driver's stream-ordered free) and fails with
/// out-of-memory.
///
/// # Safety
/// `dptr` is valid for a read and a write.
pub(crate) unsafe fn alloc_from_drivers_pool(
    dptr: *mut CuDevicePtr,
    pool: *mut c_void,
    charged: bool,
    make: impl FnOnce() -> CuResult,
    unmake: impl FnOnce(CuDevicePtr),
) -> CuResult {
    let t = if charged {
        match guarded(None, || tenant_or_log().map(Some)) {
            Some(t) => Some(t),
            None => {
                stats::refused(Hook::MemAllocFromDriverPool);
                return CUDA_ERROR_OUT_OF_MEMORY;
            }
        }
    } else {
        None
    };
    let r = make();
    let Some(t) = t.filter(|_| r == CUDA_SUCCESS) else {
        if r == CUDA_SUCCESS {
            stats::passed(Hook::MemAllocFromDriverPool);
        }
        return r;
    };
    // SAFETY: the driver succeeded, so it wrote the pointer through the caller's valid pointer.
    let ptr = unsafe { *dptr };
    // A refusal's message is left in `vram_last_error`.
    if !guarded(false, || settle(t, pool).map(|()| true)) {
        unmake(ptr);
        // SAFETY: as above, the caller's valid pointer.
        unsafe { *dptr = 0 };
        stats::refused(Hook::MemAllocFromDriverPool);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    lock(&FROM).insert(ptr, pool as usize);
    stats::served(Hook::MemAllocFromDriverPool);
    CUDA_SUCCESS
}

/// Brings `pool`'s charge in line with what the driver says it reserves: charged up (refused
/// past the tenant's limit: the message), or uncharged down. A pool the driver cannot report on
/// keeps its charge.
fn settle(t: &Tenant, pool: *mut c_void) -> Result<(), String> {
    let mut made = lock(&MADE);
    let Some(m) = made.get_mut(&(pool as usize)) else {
        return Ok(());
    };
    let Some(reserved) = reserved(pool) else {
        return Ok(());
    };
    if reserved > m.charged {
        let more = reserved - m.charged;
        super::charged::charge(t, "cuMemAllocFromPoolAsync", Bytes(more))?;
        m.charged = reserved;
    } else if reserved < m.charged {
        super::charged::uncharge(m.charged - reserved);
        m.charged = reserved;
    }
    Ok(())
}

/// The memory `pool` holds from the device now, as the driver reports it.
fn reserved(pool: *mut c_void) -> Option<u64> {
    let get = real::driver().mem_pool_get_attribute?;
    let mut value = 0u64;
    // SAFETY: the driver's cuMemPoolGetAttribute with a live pool of the caller's and an out
    // pointer to a u64, the attribute's type (cuda.h: cuuint64_t).
    let r = unsafe { get(pool, ATTR_RESERVED_MEM_CURRENT, (&raw mut value).cast()) };
    (r == CUDA_SUCCESS).then_some(value)
}

/// A free of an allocation from a charged pool: done by `free` (the driver's function), then
/// the pool's charge settled. `None` if `ptr` is not such an allocation.
pub(crate) fn free_charged(ptr: CuDevicePtr, free: impl FnOnce() -> CuResult) -> Option<CuResult> {
    if !ANY_MADE.load(Ordering::Acquire) {
        return None;
    }
    let Some(pool) = lock(&FROM).remove(&ptr) else {
        return free_leftover(ptr, free);
    };
    let r = free();
    if r == CUDA_SUCCESS {
        if let Some(t) = crate::current() {
            // Down only (a free never makes a pool reserve more): nothing to refuse.
            guarded((), || settle(t, pool as *mut c_void));
        }
    } else {
        lock(&FROM).insert(ptr, pool);
    }
    Some(r)
}

/// A free of an allocation from a charged pool destroyed while it was out: the pool's charge
/// goes once its last such allocation is freed. `None` if `ptr` is not one.
fn free_leftover(ptr: CuDevicePtr, free: impl FnOnce() -> CuResult) -> Option<CuResult> {
    let mut left = lock(&LEFTOVER);
    let n = left.of.remove(&ptr)?;
    let r = free();
    if r != CUDA_SUCCESS {
        left.of.insert(ptr, n);
        return Some(r);
    }
    if let Some((charged, out)) = left.pools.get_mut(&n) {
        *out -= 1;
        if *out == 0 {
            let charged = *charged;
            left.pools.remove(&n);
            super::charged::uncharge(charged);
        }
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
    let mut made = lock(&MADE);
    // SAFETY: the driver's own function with the caller's arguments.
    let r = unsafe { create(pool, props) };
    if r == CUDA_SUCCESS && !pool.is_null() && !props.is_null() {
        // SAFETY: the driver accepted `props` and wrote the pool through `pool`, both the
        // caller's valid pointers; only the leading fields of the properties are read.
        let (handle, p) = unsafe { (*pool, &*props) };
        let place = Place::of(p);
        made.insert(handle as usize, Made { place, charged: 0 });
        ANY_MADE.store(true, Ordering::Release);
    }
    r
}

/// A pool of the driver's that `get` handed out for `location` and `alloc_type` (the driver's
/// `cuMemGetDefaultMemPool` or `cuMemGetMemPool`, called with the caller's arguments): kept
/// with its place, unless it is known already (a pool made here keeps its own).
///
/// # Safety
/// `pool` is valid for one write and `location` points to a `CUmemLocation`, as `get` needs.
unsafe fn learn(
    pool: *mut *mut c_void,
    location: *const Location,
    alloc_type: c_uint,
    get: unsafe extern "C" fn(*mut *mut c_void, *const Location, c_uint) -> CuResult,
) -> CuResult {
    let mut made = lock(&MADE);
    // SAFETY: the driver's own function with the caller's arguments.
    let r = unsafe { get(pool, location, alloc_type) };
    if r == CUDA_SUCCESS && !pool.is_null() && !location.is_null() {
        // SAFETY: the driver accepted `location` and wrote the pool through `pool`, both the
        // caller's valid pointers.
        let (handle, at) = unsafe { (*pool, &*location) };
        let place = Place::at(alloc_type, at, false);
        // A device's pool is served as any pool not seen here: nothing to keep.
        if !matches!(place, Place::Device { .. }) {
            made.entry(handle as usize)
                .or_insert(Made { place, charged: 0 });
            ANY_MADE.store(true, Ordering::Release);
        }
    }
    r
}

/// See the module documentation: a default pool of the host, or of managed memory, is placed.
///
/// # Safety
/// As for the driver's `cuMemGetDefaultMemPool`.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetDefaultMemPool(
    pool: *mut *mut c_void,
    location: *const Location,
    alloc_type: c_uint,
) -> CuResult {
    match real::driver().mem_get_default_mem_pool {
        // SAFETY: the caller's arguments, as the driver's function takes them.
        Some(get) => unsafe { learn(pool, location, alloc_type, get) },
        None => CUDA_ERROR_NOT_FOUND,
    }
}

/// See the module documentation: the current pool of a location, placed as the default pools.
///
/// # Safety
/// As for the driver's `cuMemGetMemPool`.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetMemPool(
    pool: *mut *mut c_void,
    location: *const Location,
    alloc_type: c_uint,
) -> CuResult {
    match real::driver().mem_get_mem_pool {
        // SAFETY: the caller's arguments, as the driver's function takes them.
        Some(get) => unsafe { learn(pool, location, alloc_type, get) },
        None => CUDA_ERROR_NOT_FOUND,
    }
}

/// Keeps `pool` as device `ordinal`'s current pool once the driver made it so.
fn make_current(ordinal: c_int, pool: *mut c_void) {
    lock(&CURRENT).insert(ordinal, pool as usize);
    ANY_CURRENT.store(true, Ordering::Release);
}

/// See the module documentation: the device's current pool is kept, for `cuMemAllocAsync`.
///
/// # Safety
/// As for the driver's `cuDeviceSetMemPool`.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceSetMemPool(device: c_int, pool: *mut c_void) -> CuResult {
    let Some(set) = real::driver().device_set_mem_pool else {
        return CUDA_ERROR_NOT_FOUND;
    };
    // SAFETY: the driver's own function with the caller's arguments.
    let r = unsafe { set(device, pool) };
    if r == CUDA_SUCCESS {
        make_current(device, pool);
    }
    r
}

/// See the module documentation: a device's current pool of pinned memory is kept, as
/// `cuDeviceSetMemPool` keeps it.
///
/// # Safety
/// As for the driver's `cuMemSetMemPool`: `location` points to a `CUmemLocation`.
#[no_mangle]
pub unsafe extern "C" fn cuMemSetMemPool(
    location: *const Location,
    alloc_type: c_uint,
    pool: *mut c_void,
) -> CuResult {
    let Some(set) = real::driver().mem_set_mem_pool else {
        return CUDA_ERROR_NOT_FOUND;
    };
    // SAFETY: the driver's own function with the caller's arguments.
    let r = unsafe { set(location, alloc_type, pool) };
    if r == CUDA_SUCCESS && !location.is_null() {
        // SAFETY: the driver accepted `location`, the caller's valid pointer.
        let at = unsafe { &*location };
        if let Place::Device { ordinal, .. } = Place::at(alloc_type, at, false) {
            make_current(ordinal, pool);
        }
    }
    r
}

/// See the module documentation: once the driver destroyed the pool, what is left of its charge
/// is taken back (once its allocations still out are freed) and the pool forgotten (its handle
/// may be given to another pool).
///
/// # Safety
/// As for the driver's `cuMemPoolDestroy`.
#[no_mangle]
pub unsafe extern "C" fn cuMemPoolDestroy(pool: *mut c_void) -> CuResult {
    let Some(destroy) = real::driver().mem_pool_destroy else {
        return CUDA_ERROR_NOT_FOUND;
    };
    let mut made = lock(&MADE);
    // SAFETY: the driver's own function with the caller's argument.
    let r = unsafe { destroy(pool) };
    if r == CUDA_SUCCESS {
        let pool = pool as usize;
        let charged = made.remove(&pool).map_or(0, |m| m.charged);
        let mut from = lock(&FROM);
        let out: Vec<CuDevicePtr> = from
            .iter()
            .filter(|(_, p)| **p == pool)
            .map(|(ptr, _)| *ptr)
            .collect();
        from.retain(|_, p| *p != pool);
        drop(from);
        if out.is_empty() {
            if charged > 0 {
                super::charged::uncharge(charged);
            }
        } else {
            // The driver frees the pool's memory once these are freed: the charge stays until
            // then.
            let mut left = lock(&LEFTOVER);
            let n = left.next;
            left.next += 1;
            left.pools.insert(n, (charged, out.len()));
            left.of.extend(out.into_iter().map(|ptr| (ptr, n)));
        }
        // The driver makes the device's own pool current again, and the handle may be given to
        // another pool.
        lock(&CURRENT).retain(|_, p| *p != pool);
    }
    r
}

/// See the module documentation: the pool gives memory back to the device, and its charge
/// follows.
///
/// # Safety
/// As for the driver's `cuMemPoolTrimTo`.
#[no_mangle]
pub unsafe extern "C" fn cuMemPoolTrimTo(pool: *mut c_void, min_bytes_to_keep: usize) -> CuResult {
    let Some(trim) = real::driver().mem_pool_trim_to else {
        return CUDA_ERROR_NOT_FOUND;
    };
    // SAFETY: the driver's own function with the caller's arguments.
    let r = unsafe { trim(pool, min_bytes_to_keep) };
    if r == CUDA_SUCCESS {
        if let Some(t) = crate::current() {
            guarded((), || settle(t, pool));
        }
    }
    r
}
