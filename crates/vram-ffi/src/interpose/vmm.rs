//! The driver's virtual-memory calls as a library makes its own memory with them (NCCL's
//! buffers, PyTorch's expandable segments, XLA's allocator): `cuMemCreate` is charged to the
//! tenant ([`super::charged`]), and the charge is taken back when the driver frees the memory.
//!
//! The driver frees an allocation once every reference to its handle is released and every
//! mapping of it is gone, in whichever order: programs release the handle right after mapping
//! it, or unmap before releasing, or take extra references (`cuMemRetainAllocationHandle`, as
//! NCCL does when it frees). So for each charged handle the references (`cuMemCreate`, each
//! retain, less each `cuMemRelease`) and mappings (`cuMemMap`, less `cuMemUnmap`) are counted,
//! and the charge is taken back when both reach zero. Handles made otherwise (vram-device's
//! imports of the daemon's memory, which never come through these hooks, or an import of a
//! shared handle) are passed to the driver untouched.
//!
//! A `cuMemCreate` whose memory lives elsewhere than on the tenant's GPU (the host, another
//! device) is not charged. A charged handle exported (`cuMemExportToShareableHandle`) may be
//! imported by another process or again by this one, references these books cannot see: its
//! charge stays until the tenant ends. Once this process let it go (no reference, no mapping
//! here) it is counted apart ([`exported_let_go`]), so that the tenant may still end
//! (`vram_disconnect`): nothing of this process uses that memory.

use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex, MutexGuard};

use vram_core::Bytes;

use super::charged::{charge, uncharge};
use super::real;
use super::stats::{self, Hook};
use super::{
    is_tenant_device, tenant_or_log, CuDevicePtr, CuResult, CUDA_ERROR_NOT_FOUND,
    CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS,
};
use crate::guarded;

/// Charged bytes of handles exported and since let go here (see the module documentation).
static EXPORTED_LET_GO: AtomicU64 = AtomicU64::new(0);

/// The charge of memory this process let go that another may still hold: taken back when the
/// driver frees it if it was never exported, else counted in [`exported_let_go`].
fn let_go(bytes: u64, exported: bool) {
    if exported {
        EXPORTED_LET_GO.fetch_add(bytes, Ordering::Relaxed);
    } else {
        uncharge(bytes);
    }
}

/// Charged bytes of exported handles this process let go: still the tenant's, used by nothing
/// of this process.
pub(crate) fn exported_let_go() -> u64 {
    EXPORTED_LET_GO.load(Ordering::Relaxed)
}

/// The tenant ended: its charges, these with them, are gone from the daemon's books.
pub(crate) fn forget_exported_let_go() {
    EXPORTED_LET_GO.store(0, Ordering::Relaxed);
}

/// `CUmemAllocationProp` (cuda.h): only `location` is read.
#[repr(C)]
pub struct AllocationProp {
    pub kind: c_uint,
    pub requested_handle_types: c_uint,
    /// `CUmemLocation.type`.
    pub location_type: c_uint,
    /// `CUmemLocation.id`: the device ordinal for `CU_MEM_LOCATION_TYPE_DEVICE`.
    pub location_id: c_int,
    pub win32_handle_meta_data: *mut c_void,
    pub alloc_flags: [u8; 8],
}

/// `CU_MEM_LOCATION_TYPE_DEVICE`.
const LOCATION_DEVICE: c_uint = 1;

/// A charged allocation: its size, the references to its handle, its mappings, and whether it
/// was exported (its memory may then outlive them all).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Charged {
    bytes: u64,
    refs: u32,
    maps: u32,
    exported: bool,
}

impl Charged {
    fn freed(&self) -> bool {
        self.refs == 0 && self.maps == 0
    }
}

/// Charged handles, and the mappings of them by start address (length, handle).
#[derive(Default)]
struct Books {
    handles: HashMap<u64, Charged>,
    mappings: BTreeMap<u64, (u64, u64)>,
}

static BOOKS: LazyLock<Mutex<Books>> = LazyLock::new(Default::default);

fn books() -> MutexGuard<'static, Books> {
    BOOKS.lock().unwrap_or_else(|p| p.into_inner())
}

/// See the module documentation.
///
/// # Safety
/// As for the driver's `cuMemCreate`: `handle` is valid for one write, `prop` points to a
/// `CUmemAllocationProp`.
#[no_mangle]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut u64,
    size: usize,
    prop: *const AllocationProp,
    flags: u64,
) -> CuResult {
    let d = real::driver();
    let (Some(create), Some(release)) = (d.mem_create, d.mem_release) else {
        return CUDA_ERROR_NOT_FOUND;
    };
    let pass = || {
        stats::passed(Hook::MemCreate);
        // SAFETY: the driver's own function with the caller's arguments.
        unsafe { create(handle, size, prop, flags) }
    };
    if handle.is_null() || prop.is_null() {
        return pass();
    }
    // SAFETY: the caller passes a valid CUmemAllocationProp (checked non-null).
    let (location_type, device) = unsafe { ((*prop).location_type, (*prop).location_id) };
    if location_type != LOCATION_DEVICE {
        return pass();
    }
    let Some(t) = guarded(None, || tenant_or_log().map(Some)) else {
        stats::refused(Hook::MemCreate);
        return CUDA_ERROR_OUT_OF_MEMORY;
    };
    if !is_tenant_device(t, device) {
        return pass();
    }
    // SAFETY: the driver's own function with the caller's arguments.
    let r = unsafe { create(handle, size, prop, flags) };
    if r != CUDA_SUCCESS {
        return r;
    }
    // SAFETY: the driver wrote the new handle through the caller's valid pointer.
    let made = unsafe { *handle };
    let bytes = size as u64;
    if !guarded(false, || {
        charge(t, "cuMemCreate", Bytes(bytes)).map(|()| true)
    }) {
        // SAFETY: releases the handle the driver just made, which nobody else has seen, and
        // clears the caller's copy through its valid pointer.
        unsafe {
            release(made);
            *handle = 0;
        }
        stats::refused(Hook::MemCreate);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    let charged = Charged {
        bytes,
        refs: 1,
        maps: 0,
        exported: false,
    };
    books().handles.insert(made, charged);
    stats::served(Hook::MemCreate);
    CUDA_SUCCESS
}

/// See the module documentation: one reference fewer.
///
/// # Safety
/// As for the driver's `cuMemRelease`.
#[no_mangle]
pub unsafe extern "C" fn cuMemRelease(handle: u64) -> CuResult {
    let Some(release) = real::driver().mem_release else {
        return CUDA_ERROR_NOT_FOUND;
    };
    // The books change before the driver frees anything, so that a handle value it hands out
    // again to another thread's cuMemCreate finds them clean; they change back if it refuses.
    let before = {
        let mut b = books();
        let before = b.handles.get(&handle).copied();
        if let Some(mut c) = before {
            c.refs = c.refs.saturating_sub(1);
            if c.freed() {
                b.handles.remove(&handle);
            } else {
                b.handles.insert(handle, c);
            }
        }
        before
    };
    // SAFETY: the driver's own function with the caller's argument.
    let r = unsafe { release(handle) };
    match before {
        None => stats::passed(Hook::MemRelease),
        Some(c) if r != CUDA_SUCCESS => {
            books().handles.insert(handle, c);
        }
        Some(c) => {
            if c.refs <= 1 && c.maps == 0 {
                let_go(c.bytes, c.exported);
            }
            stats::served(Hook::MemRelease);
        }
    }
    r
}

/// See the module documentation: one reference more, to the handle of the memory at `addr`.
///
/// # Safety
/// As for the driver's `cuMemRetainAllocationHandle`: `handle` is valid for one write.
#[no_mangle]
pub unsafe extern "C" fn cuMemRetainAllocationHandle(
    handle: *mut u64,
    addr: *mut c_void,
) -> CuResult {
    let Some(retain) = real::driver().mem_retain_allocation_handle else {
        return CUDA_ERROR_NOT_FOUND;
    };
    // SAFETY: the driver's own function with the caller's arguments.
    let r = unsafe { retain(handle, addr) };
    if r != CUDA_SUCCESS || handle.is_null() {
        return r;
    }
    // SAFETY: the driver wrote the handle through the caller's valid pointer.
    let h = unsafe { *handle };
    match books().handles.get_mut(&h) {
        Some(c) => {
            c.refs += 1;
            stats::served(Hook::MemRetain);
        }
        None => stats::passed(Hook::MemRetain),
    }
    r
}

/// See the module documentation: a charged handle exported keeps its charge.
///
/// # Safety
/// As for the driver's `cuMemExportToShareableHandle`: `shareable` is valid for a write of the
/// handle type's size.
#[no_mangle]
pub unsafe extern "C" fn cuMemExportToShareableHandle(
    shareable: *mut c_void,
    handle: u64,
    handle_type: c_uint,
    flags: u64,
) -> CuResult {
    let Some(export) = real::driver().mem_export_to_shareable_handle else {
        return CUDA_ERROR_NOT_FOUND;
    };
    // SAFETY: the driver's own function with the caller's arguments.
    let r = unsafe { export(shareable, handle, handle_type, flags) };
    if r != CUDA_SUCCESS {
        return r;
    }
    match books().handles.get_mut(&handle) {
        Some(c) => {
            c.exported = true;
            stats::served(Hook::MemExport);
        }
        None => stats::passed(Hook::MemExport),
    }
    r
}

/// See the module documentation: one mapping more.
///
/// # Safety
/// As for the driver's `cuMemMap`.
#[no_mangle]
pub unsafe extern "C" fn cuMemMap(
    ptr: CuDevicePtr,
    size: usize,
    offset: usize,
    handle: u64,
    flags: u64,
) -> CuResult {
    let Some(map) = real::driver().mem_map else {
        return CUDA_ERROR_NOT_FOUND;
    };
    // SAFETY: the driver's own function with the caller's arguments.
    let r = unsafe { map(ptr, size, offset, handle, flags) };
    if r != CUDA_SUCCESS {
        return r;
    }
    let mut b = books();
    match b.handles.get_mut(&handle) {
        Some(c) => {
            c.maps += 1;
            b.mappings.insert(ptr, (size as u64, handle));
            stats::served(Hook::MemMap);
        }
        None => stats::passed(Hook::MemMap),
    }
    r
}

/// See the module documentation: the mappings that start in the range are gone.
///
/// # Safety
/// As for the driver's `cuMemUnmap`.
#[no_mangle]
pub unsafe extern "C" fn cuMemUnmap(ptr: CuDevicePtr, size: usize) -> CuResult {
    let Some(unmap) = real::driver().mem_unmap else {
        return CUDA_ERROR_NOT_FOUND;
    };
    // As in cuMemRelease: the books change first, and change back if the driver refuses.
    let end = ptr.saturating_add(size as u64);
    let (gone, before, freed) = {
        let mut b = books();
        let gone: Vec<(u64, (u64, u64))> =
            b.mappings.range(ptr..end).map(|(&k, &v)| (k, v)).collect();
        let mut before: Vec<(u64, Charged)> = Vec::new();
        let mut freed = Vec::new();
        for &(start, (_, handle)) in &gone {
            b.mappings.remove(&start);
            let Some(c) = b.handles.get(&handle).copied() else {
                continue;
            };
            if !before.iter().any(|&(h, _)| h == handle) {
                before.push((handle, c));
            }
            let after = Charged {
                maps: c.maps.saturating_sub(1),
                ..c
            };
            if after.freed() {
                b.handles.remove(&handle);
                freed.push((c.bytes, c.exported));
            } else {
                b.handles.insert(handle, after);
            }
        }
        (gone, before, freed)
    };
    // SAFETY: the driver's own function with the caller's arguments.
    let r = unsafe { unmap(ptr, size) };
    if gone.is_empty() {
        stats::passed(Hook::MemUnmap);
        return r;
    }
    if r != CUDA_SUCCESS {
        let mut b = books();
        b.mappings.extend(gone);
        b.handles.extend(before);
        return r;
    }
    for (bytes, exported) in freed {
        let_go(bytes, exported);
    }
    stats::served(Hook::MemUnmap);
    r
}
