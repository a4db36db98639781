//! Driver-level interposition: what makes the device allocations of a process that preloads
//! libvram.so (`vramd run` does, in both torch modes) go through vramd, whichever way the
//! allocating library reaches the driver: the allocation, virtual-memory, pool and managed-memory
//! calls below. CUDA arrays and graph memory nodes are not hooked; the daemon sees them as the
//! tenant's use outside its grants where NVML reports each process.
//!
//! - [`dlsym`] is interposed, so that a library that loads the driver itself and looks its
//!   functions up by name (XLA, ctypes) gets libvram.so's hooks.
//! - [`procaddr`]: `cuGetProcAddress` / `_v2` answer with the hooks wherever the driver's answer
//!   is a function hooked here. The CUDA runtime resolves every driver entry point that way, so a
//!   `cudaMalloc` reaches the hooks even from a runtime loaded privately (CuPy) or linked
//!   statically (XLA).
//! - [`alloc`]: `cuMemAlloc_v2`, `cuMemAllocPitch_v2`, `cuMemFree_v2` and the stream-ordered
//!   `cuMemAllocAsync` / `cuMemFreeAsync` / `cuMemAllocFromPoolAsync` (and their per-thread
//!   default stream `_ptsz` forms) are served by the tenant's caching allocator; [`pools`]
//!   (`cuMemPoolCreate`, `cuMemPoolDestroy`, the default and current pools' getters and setters)
//!   says which pools' allocations are the driver's.
//! - [`vmm`] and [`charged`]: memory a library makes itself through the driver (`cuMemCreate`,
//!   as NCCL, XLA and PyTorch's expandable segments do; `cuMemAllocManaged`) is made by the
//!   driver and charged to the tenant; a refused charge frees it again and fails the call with
//!   out-of-memory. The charge is taken back when the driver frees the memory (for `cuMemCreate`:
//!   its handle released and unmapped, so `cuMemRetainAllocationHandle`, `cuMemMap` and
//!   `cuMemUnmap` are hooked to count references and mappings).
//! - [`info`] and [`nvml`]: `cuMemGetInfo_v2` and NVML's `nvmlDeviceGetMemoryInfo` (`_v2`)
//!   answer the tenant's view (total: its limit; free: what it could still get), the same figures
//!   from both, since frameworks size themselves from either.
//!
//! Every hook is also exported under its own name, so a program that links the driver directly
//! reaches it too when libvram.so is preloaded. Allocations on another GPU than the tenant's go
//! to the driver unchanged (logged once). When the tenant cannot be set up (no daemon), the
//! allocation hooks fail with `CUDA_ERROR_OUT_OF_MEMORY` and the reason in `vram_last_error`,
//! logged once: memory never silently escapes vramd's books.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU8, Ordering};

use vram_device::BackendKind;

use crate::{refusal, tenant, Tenant};

pub(crate) mod alloc;
pub(crate) mod charged;
pub(crate) mod dlsym;
pub(crate) mod info;
pub(crate) mod nvml;
pub(crate) mod pools;
pub(crate) mod procaddr;
pub(crate) mod real;
pub(crate) mod stats;
pub(crate) mod vmm;

/// `CUresult`.
pub(crate) type CuResult = c_int;
/// `CUdeviceptr`.
pub(crate) type CuDevicePtr = u64;
/// `CUstream`.
pub(crate) type CuStream = *mut c_void;
/// `CUcontext`.
pub(crate) type CuContext = *mut c_void;

/// `CU_STREAM_PER_THREAD`, the largest of the default streams' handles (0, `CU_STREAM_LEGACY`,
/// `CU_STREAM_PER_THREAD`).
pub(crate) const LAST_DEFAULT_STREAM: usize = 2;

pub(crate) const CUDA_SUCCESS: CuResult = 0;
pub(crate) const CUDA_ERROR_INVALID_VALUE: CuResult = 1;
pub(crate) const CUDA_ERROR_OUT_OF_MEMORY: CuResult = 2;
/// What a hook answers when the driver lacks the function it would pass the call on to.
pub(crate) const CUDA_ERROR_NOT_FOUND: CuResult = 500;

/// The tenant a hook serves from, connecting on first use. When that fails, the reason is
/// logged once (and, through `guarded`, left in `vram_last_error`).
pub(crate) fn tenant_or_log() -> Result<&'static Tenant, String> {
    tenant().map_err(|e| {
        refusal::log_once(
            "no_daemon",
            &format!(
                "{e}; this process's device allocations are refused (not passed to the driver)"
            ),
        );
        e
    })
}

/// The tenant a question about memory is answered for: the process's, connecting on first use,
/// but `None` (the driver's own figures) where connecting would take the run's invitation, which
/// is for the process that first allocates ([`crate::would_join`]).
pub(crate) fn tenant_for_query() -> Option<Result<&'static Tenant, String>> {
    if crate::would_join() {
        return None;
    }
    Some(tenant_or_log())
}

/// Where the calling thread's current context is, as far as vramd is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Gpu {
    /// The tenant's GPU (always, on the host backend, where there is no GPU to compare).
    Tenant,
    /// Another GPU, or no current context: the driver's own function takes the call.
    Elsewhere,
}

/// The calling thread's current device, compared with the tenant's.
pub(crate) fn current_gpu(t: &Tenant) -> Gpu {
    if t.device.backend != BackendKind::Cuda {
        return Gpu::Tenant;
    }
    let Some(get) = real::driver().ctx_get_device else {
        return Gpu::Tenant;
    };
    let mut device = -1;
    // SAFETY: the driver's cuCtxGetDevice with a valid out pointer.
    if unsafe { get(&mut device) } != CUDA_SUCCESS {
        return Gpu::Elsewhere;
    }
    gpu_of(t, device)
}

/// The GPU a stream-ordered allocation on `stream` is made on: the device of the stream's own
/// context, which need not be the calling thread's current one. The default streams (0,
/// `CU_STREAM_LEGACY`, `CU_STREAM_PER_THREAD`) are the current context's. Where the driver cannot
/// name the stream's context (a green context's stream on some drivers), the current context
/// decides. (`cuStreamGetDevice` is not asked: some drivers refuse it during a graph capture,
/// which ends the capture; the context calls here are allowed then.)
pub(crate) fn stream_gpu(t: &Tenant, stream: CuStream) -> Gpu {
    if t.device.backend != BackendKind::Cuda || stream as usize <= LAST_DEFAULT_STREAM {
        return current_gpu(t);
    }
    let d = real::driver();
    let (Some(stream_ctx), Some(get_current), Some(push), Some(pop), Some(get_device)) = (
        d.stream_get_ctx,
        d.ctx_get_current,
        d.ctx_push_current,
        d.ctx_pop_current,
        d.ctx_get_device,
    ) else {
        return current_gpu(t);
    };
    let mut ctx: CuContext = std::ptr::null_mut();
    let mut current: CuContext = std::ptr::null_mut();
    // SAFETY: the driver's cuStreamGetCtx and cuCtxGetCurrent with valid out pointers; the
    // stream is the caller's, which the driver checks.
    let (named, current_known) = unsafe {
        (
            stream_ctx(stream, &mut ctx) == CUDA_SUCCESS && !ctx.is_null(),
            get_current(&mut current) == CUDA_SUCCESS,
        )
    };
    if !named || (current_known && current == ctx) {
        return current_gpu(t);
    }
    // SAFETY: `ctx` is a live context (the driver named it for a live stream); it is made
    // current only for cuCtxGetDevice (valid out pointer) and popped again at once.
    let device = unsafe {
        if push(ctx) != CUDA_SUCCESS {
            return current_gpu(t);
        }
        let mut device = -1;
        let asked = get_device(&mut device);
        let mut popped: CuContext = std::ptr::null_mut();
        pop(&mut popped);
        if asked != CUDA_SUCCESS {
            return Gpu::Elsewhere;
        }
        device
    };
    gpu_of(t, device)
}

/// [`Gpu`] of the driver's device `ordinal`.
fn gpu_of(t: &Tenant, ordinal: c_int) -> Gpu {
    if is_tenant_device(t, ordinal) {
        Gpu::Tenant
    } else {
        Gpu::Elsewhere
    }
}

/// Whether the driver's device `ordinal` is the tenant's GPU (compared by UUID, so that
/// `CUDA_VISIBLE_DEVICES` and the daemon's numbering do not matter). Always true on the host
/// backend. Answers are kept per ordinal.
pub(crate) fn is_tenant_device(t: &Tenant, ordinal: c_int) -> bool {
    const UNKNOWN: u8 = 0;
    const OURS: u8 = 1;
    const OTHER: u8 = 2;
    static VERDICTS: [AtomicU8; 64] = [const { AtomicU8::new(UNKNOWN) }; 64];
    if t.device.backend != BackendKind::Cuda {
        return true;
    }
    let slot = usize::try_from(ordinal).ok().and_then(|i| VERDICTS.get(i));
    if let Some(v) = slot.map(|s| s.load(Ordering::Relaxed)) {
        if v != UNKNOWN {
            return v == OURS;
        }
    }
    let d = real::driver();
    let (Some(get), Some(uuid_of)) = (d.device_get, d.device_get_uuid) else {
        return true;
    };
    let mut device = 0;
    let mut uuid = [0u8; 16];
    // SAFETY: the driver's cuDeviceGet and cuDeviceGetUuid with valid out pointers.
    let known = unsafe { get(&mut device, ordinal) } == CUDA_SUCCESS
        && unsafe { uuid_of(&mut uuid, device) } == CUDA_SUCCESS;
    if !known {
        return false;
    }
    let ours = same_uuid(&vram_device::cuda::format_uuid(&uuid), &t.device.uuid);
    if let Some(s) = slot {
        s.store(if ours { OURS } else { OTHER }, Ordering::Relaxed);
    }
    if !ours {
        refusal::log_once(
            "other_gpu",
            &format!(
                "vramd: device memory asked for on CUDA device {ordinal}, but this process is a \
                 tenant of {}: that memory is the driver's own, outside vramd's books",
                t.device.uuid
            ),
        );
    }
    ours
}

pub(crate) fn same_uuid(a: &str, b: &str) -> bool {
    a.eq_ignore_ascii_case(b)
}

/// The tenant's view of its memory, as both `cuMemGetInfo` and NVML answer it: (total, free),
/// total its limit, free what it could still get now.
pub(crate) fn tenant_view(t: &Tenant) -> Result<(u64, u64), String> {
    let b = t.client()?.budget().map_err(|e| format!("vramd: {e}"))?;
    Ok((b.limit.get(), b.available.min(b.limit).get()))
}
