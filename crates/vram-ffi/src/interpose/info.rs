//! `cuMemGetInfo_v2`: the tenant's view of its memory on its GPU, the figures NVML's hooks
//! answer too ([`super::nvml`]): total is the tenant's limit, free what it could still get now
//! (its limit less what it holds, is charged and uses outside vramd, within what the device has
//! free for it). Frameworks size themselves from it (vLLM's memory profiling, PyTorch's
//! `torch.cuda.mem_get_info`), and the whole GPU's figures would tell them to take memory other
//! tenants are promised.
//!
//! The driver's own function is called first, so that its errors (no context) stay; another GPU
//! than the tenant's gets the driver's figures. When the tenant cannot be set up, the driver's
//! figures are returned too, the reason logged once: the allocations themselves are refused. A
//! process of `vramd run` that has not joined the run's tenant yet gets the driver's figures
//! too: a question does not take the run's invitation, which is for the process that first
//! allocates (a monitor started by the program would otherwise become the run's tenant).
//!
//! The driver's older `cuMemGetInfo` takes `unsigned int` pointers, a different layout, and is
//! not hooked; `cuGetProcAddress("cuMemGetInfo")` for CUDA 3.2 and later is the `_v2` function.

use super::real;
use super::stats::{self, Hook};
use super::{
    current_gpu, tenant_for_query, tenant_view, CuResult, Gpu, CUDA_ERROR_NOT_FOUND, CUDA_SUCCESS,
};
use crate::guarded;

/// The tenant's (total, free), if the calling thread's context is on its GPU.
pub(crate) fn view_here() -> Option<(u64, u64)> {
    guarded(None, || {
        let Some(t) = tenant_for_query() else {
            return Ok(None);
        };
        let t = t?;
        if current_gpu(t) != Gpu::Tenant {
            return Ok(None);
        }
        tenant_view(t).map(Some)
    })
}

/// See the module documentation.
///
/// # Safety
/// As for the driver's `cuMemGetInfo_v2`: `free` and `total` are valid for one write each.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CuResult {
    let Some(real) = real::driver().mem_get_info else {
        return CUDA_ERROR_NOT_FOUND;
    };
    // SAFETY: the driver's own function with the caller's arguments.
    let r = unsafe { real(free, total) };
    if r != CUDA_SUCCESS || free.is_null() || total.is_null() {
        return r;
    }
    match view_here() {
        Some((t, f)) => {
            // SAFETY: both pointers are valid for one write (the driver just wrote them).
            unsafe {
                *total = t as usize;
                *free = f as usize;
            }
            stats::served(Hook::MemGetInfo);
        }
        None => stats::passed(Hook::MemGetInfo),
    }
    r
}
