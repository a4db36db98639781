//! Memory a library makes itself through the driver, charged to the tenant: `cuMemCreate` (in
//! [`super::vmm`]) and `cuMemAllocManaged` (here).
//!
//! The driver makes the memory; then its size is charged to the tenant (`Client::charge`, one
//! round trip), which counts it against the tenant's limit like a grant. A refused charge frees
//! the memory at once and fails the call with `CUDA_ERROR_OUT_OF_MEMORY`. The charge is taken
//! back (`Client::uncharge`, sent without waiting) when the driver frees the memory.
//!
//! Managed memory is charged in full when it is made, although the driver may keep it on the
//! host until it is touched: the tenant asked for that much memory that can move to its GPU. Its
//! `cuMemFree_v2` takes the charge back.

use std::collections::HashMap;
use std::ffi::c_uint;
use std::sync::{LazyLock, Mutex};

use vram_core::Bytes;

use super::real;
use super::stats::{self, Hook};
use super::{
    tenant_or_log, CuDevicePtr, CuResult, CUDA_ERROR_NOT_FOUND, CUDA_ERROR_OUT_OF_MEMORY,
    CUDA_SUCCESS,
};
use crate::refusal::{refused_by_daemon, refused_here};
use crate::{current, guarded, Tenant};

/// Charged managed pointers, with their sizes.
static MANAGED: LazyLock<Mutex<HashMap<u64, u64>>> = LazyLock::new(Default::default);

fn managed() -> std::sync::MutexGuard<'static, HashMap<u64, u64>> {
    MANAGED.lock().unwrap_or_else(|p| p.into_inner())
}

/// Charges `bytes` made with `what`; on refusal, the message (logged once, and reported to the
/// daemon unless the daemon made the refusal itself and counted it).
pub(crate) fn charge(t: &Tenant, what: &str, bytes: Bytes) -> Result<(), String> {
    let client = t.client()?;
    client.charge(bytes).map_err(|e| {
        let w = client.welcome();
        let message = format!(
            "vramd: tenant `{}` may not keep {bytes} made with {what}: {e} (limit {}, guarantee {})",
            w.name, w.limit, w.guarantee
        );
        if e.is_refusal() {
            refused_by_daemon("charge_refused", &message);
        } else {
            refused_here(t, bytes, "other", &message);
        }
        message
    })
}

/// Takes back a charge (sent without waiting), if the tenant is still there.
pub(crate) fn uncharge(bytes: u64) {
    if let Some(client) = current().and_then(|t| t.client().ok()) {
        let _ = client.uncharge(Bytes(bytes));
    }
}

/// See the module documentation.
///
/// # Safety
/// As for the driver's `cuMemAllocManaged`: `dptr` is valid for one write.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocManaged(
    dptr: *mut CuDevicePtr,
    bytesize: usize,
    flags: c_uint,
) -> CuResult {
    let d = real::driver();
    let (Some(alloc), Some(free)) = (d.mem_alloc_managed, d.mem_free) else {
        return CUDA_ERROR_NOT_FOUND;
    };
    if dptr.is_null() || bytesize == 0 {
        // SAFETY: the driver's own function with the caller's arguments (it reports the error).
        return unsafe { alloc(dptr, bytesize, flags) };
    }
    let t = match guarded(None, || tenant_or_log().map(Some)) {
        Some(t) => t,
        None => {
            stats::refused(Hook::MemAllocManaged);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    };
    // SAFETY: the driver's own function with the caller's arguments.
    let r = unsafe { alloc(dptr, bytesize, flags) };
    if r != CUDA_SUCCESS {
        return r;
    }
    // SAFETY: the driver wrote the pointer through the caller's valid pointer.
    let ptr = unsafe { *dptr };
    let bytes = bytesize as u64;
    let charged = guarded(false, || {
        charge(t, "cuMemAllocManaged", Bytes(bytes)).map(|()| true)
    });
    if !charged {
        // SAFETY: frees the memory the driver just made; nobody else has seen it.
        unsafe { free(ptr) };
        // SAFETY: as above, the caller's valid pointer.
        unsafe { *dptr = 0 };
        stats::refused(Hook::MemAllocManaged);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    managed().insert(ptr, bytes);
    stats::served(Hook::MemAllocManaged);
    CUDA_SUCCESS
}

/// `cuMemFree_v2` of charged managed memory: freed by the driver, then uncharged. `None` if
/// `ptr` is not such memory.
pub(crate) fn free_managed(ptr: CuDevicePtr) -> Option<CuResult> {
    let free = real::driver().mem_free?;
    let bytes = managed().remove(&ptr)?;
    // SAFETY: the driver's own cuMemFree with a pointer its cuMemAllocManaged returned.
    let r = unsafe { free(ptr) };
    if r == CUDA_SUCCESS {
        uncharge(bytes);
        stats::served(Hook::MemFreeManaged);
    } else {
        managed().insert(ptr, bytes);
    }
    Some(r)
}
