//! The driver's allocation calls, served by the tenant's caching allocator (as pool mode's
//! `cudaMalloc` is): `cuMemAlloc_v2`, `cuMemAllocPitch_v2`, `cuMemFree_v2`, and the
//! stream-ordered `cuMemAllocAsync`, `cuMemFreeAsync`, `cuMemAllocFromPoolAsync`.
//!
//! The synchronous calls use a stream of their own (`vram_client::alloc::SYNCHRONOUS`), the
//! asynchronous ones the caller's stream: the allocator reuses a block freed on stream S at once
//! on S and on other streams only after a fence recorded on S, which is what stream-ordered
//! allocation promises, and a synchronous allocation, whose memory any stream may use at once,
//! gets a block freed on a stream (the default stream too) only once that stream passed it. The `_ptsz` forms (what a
//! program built for per-thread default streams calls) treat stream 0 as the calling thread's
//! default stream, `CU_STREAM_PER_THREAD`, as the driver does.
//!
//! A stream-ordered allocation is vramd's when its stream is on the tenant's GPU
//! ([`super::stream_gpu`]), whatever context the calling thread has current; a synchronous one
//! when the current context is. `cuMemAllocFromPoolAsync` is served from the tenant's memory
//! too, except from a pool whose memory must be the driver's ([`super::pools`]).
//!
//! `cuMemFree_v2` of vramd's memory synchronises the context first, as the driver's does
//! (callers rely on it); a pointer vramd did not hand out goes to the driver's own function, and
//! managed memory charged by [`super::charged`] is freed there and uncharged. A free of memory
//! vramd handed out that its allocator refuses (a double free) fails with
//! `CUDA_ERROR_INVALID_VALUE`; it is never passed on.

use std::ffi::c_uint;

use vram_client::alloc::SYNCHRONOUS;
use vram_core::alloc::StreamId;
use vram_core::Bytes;

use super::real::{self, MemAllocAsync, MemAllocFromPoolAsync, MemFreeAsync};
use super::stats::{self, Hook};
use super::{
    charged, pools, stream_gpu, tenant_or_log, CuDevicePtr, CuResult, CuStream, Gpu,
    CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_FOUND, CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS,
};
use crate::{current, guarded};

/// Rows of `cuMemAllocPitch` start this many bytes apart at least (the driver's own pitch
/// alignment on current GPUs).
const PITCH_ALIGN: usize = 512;

/// The stream of the synchronous calls: they allocate on the current context's device.
const NO_STREAM: CuStream = std::ptr::null_mut();

/// What vramd did with an allocation request.
enum Outcome {
    Done(CuDevicePtr),
    /// Not vramd's to serve (another GPU): the driver's own function takes it.
    Pass,
    Refused,
}

/// Serves `size` bytes for `stream` from the tenant's allocator, if the driver would make them
/// on the tenant's GPU: the device of `on` (the caller's stream; null for the synchronous calls,
/// which allocate on the current context's device).
fn serve(hook: Hook, what: &str, size: usize, stream: StreamId, on: CuStream) -> Outcome {
    let outcome = guarded(Outcome::Refused, || {
        let t = tenant_or_log()?;
        if stream_gpu(t, on) != Gpu::Tenant {
            return Ok(Outcome::Pass);
        }
        let size = Bytes(size as u64);
        t.alloc
            .alloc(size, stream)
            .map(Outcome::Done)
            .map_err(|e| crate::refusal::alloc_refused(t, what, size, &e))
    });
    match outcome {
        Outcome::Done(_) => stats::served(hook),
        Outcome::Pass => stats::passed(hook),
        Outcome::Refused => stats::refused(hook),
    }
    outcome
}

/// Frees `ptr` into the tenant's allocator if vramd handed it out: `None` if it did not.
fn free_ours(hook: Hook, ptr: CuDevicePtr, stream: StreamId) -> Option<CuResult> {
    let t = match current() {
        Some(t) if ptr != 0 && t.alloc.owns(ptr) => t,
        _ => return None,
    };
    Some(guarded(CUDA_ERROR_INVALID_VALUE, || {
        t.alloc
            .free(ptr, stream)
            .map_err(|e| format!("vramd: {}: {e}", name(hook)))?;
        stats::served(hook);
        Ok(CUDA_SUCCESS)
    }))
}

fn name(hook: Hook) -> &'static str {
    match hook {
        Hook::MemFree => "cuMemFree",
        Hook::MemFreeAsync => "cuMemFreeAsync",
        _ => "free",
    }
}

/// See [`vram_client::alloc::CachingAllocator::stream_destroyed`]: before the driver destroys an
/// explicit stream, the frees vramd booked on it are fenced and kept from any stream until that
/// fence completes, so that a stream created later with the same handle cannot reuse memory the
/// destroyed one's work may still use. The default streams are never destroyed.
///
/// # Safety
/// As for the driver's `cuStreamDestroy_v2`.
#[no_mangle]
pub unsafe extern "C" fn cuStreamDestroy_v2(stream: CuStream) -> CuResult {
    let Some(destroy) = real::driver().stream_destroy else {
        return CUDA_ERROR_NOT_FOUND;
    };
    if let Some(t) = current().filter(|_| stream as usize > super::LAST_DEFAULT_STREAM) {
        guarded((), || {
            t.alloc.stream_destroyed(stream_id(stream, false));
            Ok(())
        });
    }
    // SAFETY: the driver's own function with the caller's argument.
    unsafe { destroy(stream) }
}

/// The stream an asynchronous call means: stream 0 of a `_ptsz` call, and `CU_STREAM_PER_THREAD`
/// in any call, is the calling thread's per-thread stream.
fn stream_id(stream: CuStream, per_thread: bool) -> StreamId {
    vram_client::alloc::stream_of(stream as u64, per_thread)
}

/// See the module documentation.
///
/// # Safety
/// As for the driver's `cuMemAlloc_v2`: `dptr` is valid for one write.
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CuDevicePtr, bytesize: usize) -> CuResult {
    if dptr.is_null() || bytesize == 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    match serve(
        Hook::MemAlloc,
        "cuMemAlloc",
        bytesize,
        SYNCHRONOUS,
        NO_STREAM,
    ) {
        Outcome::Done(p) => {
            // SAFETY: the caller passes a pointer valid for one write (checked non-null).
            unsafe { *dptr = p };
            CUDA_SUCCESS
        }
        Outcome::Refused => CUDA_ERROR_OUT_OF_MEMORY,
        Outcome::Pass => match real::driver().mem_alloc {
            // SAFETY: the driver's own function with the caller's arguments.
            Some(f) => unsafe { f(dptr, bytesize) },
            None => CUDA_ERROR_NOT_FOUND,
        },
    }
}

/// See the module documentation: rows of `width` bytes rounded up to 512, `pitch * height`
/// bytes in all.
///
/// # Safety
/// As for the driver's `cuMemAllocPitch_v2`: `dptr` and `pitch` are valid for one write each.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut CuDevicePtr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    element_size: c_uint,
) -> CuResult {
    if dptr.is_null() || pitch.is_null() || width == 0 || height == 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if !matches!(element_size, 4 | 8 | 16) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let Some((row, size)) = width
        .checked_next_multiple_of(PITCH_ALIGN)
        .and_then(|row| Some((row, row.checked_mul(height)?)))
    else {
        return CUDA_ERROR_OUT_OF_MEMORY;
    };
    match serve(
        Hook::MemAllocPitch,
        "cuMemAllocPitch",
        size,
        SYNCHRONOUS,
        NO_STREAM,
    ) {
        Outcome::Done(p) => {
            // SAFETY: both out pointers are valid for one write (checked non-null).
            unsafe {
                *dptr = p;
                *pitch = row;
            }
            CUDA_SUCCESS
        }
        Outcome::Refused => CUDA_ERROR_OUT_OF_MEMORY,
        Outcome::Pass => match real::driver().mem_alloc_pitch {
            // SAFETY: the driver's own function with the caller's arguments.
            Some(f) => unsafe { f(dptr, pitch, width, height, element_size) },
            None => CUDA_ERROR_NOT_FOUND,
        },
    }
}

/// See the module documentation.
///
/// # Safety
/// As for the driver's `cuMemFree_v2`.
#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CuDevicePtr) -> CuResult {
    let ours = dptr != 0 && matches!(current(), Some(t) if t.alloc.owns(dptr));
    if ours {
        if let Some(sync) = real::driver().ctx_synchronize {
            // SAFETY: the driver's cuCtxSynchronize takes no arguments.
            let r = unsafe { sync() };
            if r != CUDA_SUCCESS {
                // A failed kernel, a capture underway: nothing is freed, as the driver's own
                // cuMemFree would refuse too.
                return r;
            }
        }
        return free_ours(Hook::MemFree, dptr, SYNCHRONOUS).unwrap_or(CUDA_ERROR_INVALID_VALUE);
    }
    if let Some(r) = charged::free_managed(dptr) {
        return r;
    }
    let free = || match real::driver().mem_free {
        // SAFETY: the driver's own function with the caller's argument.
        Some(f) => unsafe { f(dptr) },
        None => CUDA_ERROR_NOT_FOUND,
    };
    if dptr != 0 {
        stats::passed(Hook::MemFree);
    }
    // A charged pool allocation is uncharged once freed.
    pools::free_charged(dptr, free).unwrap_or_else(free)
}

/// `cuMemAllocAsync` and its `_ptsz` form.
///
/// # Safety
/// `dptr` is valid for one write.
unsafe fn alloc_async(
    dptr: *mut CuDevicePtr,
    bytesize: usize,
    stream: CuStream,
    per_thread: bool,
    real: Option<MemAllocAsync>,
) -> CuResult {
    if dptr.is_null() || bytesize == 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if let Some((pool, charged)) = pools::current_drivers(stream) {
        let make = || match real {
            // SAFETY: the driver's own function with the caller's arguments.
            Some(f) => unsafe { f(dptr, bytesize, stream) },
            None => CUDA_ERROR_NOT_FOUND,
        };
        // SAFETY: `dptr` is the caller's, valid for one write (checked non-null), which the
        // driver's function makes before it is read.
        return unsafe {
            pools::alloc_from_drivers_pool(dptr, pool, charged, make, unmaker(stream, per_thread))
        };
    }
    let sid = stream_id(stream, per_thread);
    match serve(
        Hook::MemAllocAsync,
        "cuMemAllocAsync",
        bytesize,
        sid,
        stream,
    ) {
        Outcome::Done(p) => {
            // SAFETY: valid for one write (checked non-null).
            unsafe { *dptr = p };
            CUDA_SUCCESS
        }
        Outcome::Refused => CUDA_ERROR_OUT_OF_MEMORY,
        Outcome::Pass => match real {
            // SAFETY: the driver's own function with the caller's arguments.
            Some(f) => unsafe { f(dptr, bytesize, stream) },
            None => CUDA_ERROR_NOT_FOUND,
        },
    }
}

/// `cuMemFreeAsync` and its `_ptsz` form.
fn free_async(
    dptr: CuDevicePtr,
    stream: CuStream,
    per_thread: bool,
    real: Option<MemFreeAsync>,
) -> CuResult {
    if let Some(r) = free_ours(Hook::MemFreeAsync, dptr, stream_id(stream, per_thread)) {
        return r;
    }
    stats::passed(Hook::MemFreeAsync);
    let free = || match real {
        // SAFETY: the driver's own function with the caller's arguments.
        Some(f) => unsafe { f(dptr, stream) },
        None => CUDA_ERROR_NOT_FOUND,
    };
    // A charged pool allocation is uncharged once freed.
    pools::free_charged(dptr, free).unwrap_or_else(free)
}

/// The driver's stream-ordered free on `stream`, for memory its pool just made that a refused
/// charge gives back.
fn unmaker(stream: CuStream, per_thread: bool) -> impl FnOnce(CuDevicePtr) {
    let free = if per_thread {
        real::driver().mem_free_async_ptsz
    } else {
        real::driver().mem_free_async
    };
    move |ptr| {
        if let Some(f) = free {
            // SAFETY: the driver's own free, in the order of the caller's stream, of the memory
            // it just made there; nobody else has seen the pointer.
            unsafe { f(ptr, stream) };
        }
    }
}

/// `cuMemAllocFromPoolAsync` and its `_ptsz` form.
///
/// # Safety
/// `dptr` is valid for one write.
unsafe fn alloc_from_pool_async(
    dptr: *mut CuDevicePtr,
    bytesize: usize,
    pool: *mut std::ffi::c_void,
    stream: CuStream,
    per_thread: bool,
    real: Option<MemAllocFromPoolAsync>,
) -> CuResult {
    if dptr.is_null() || bytesize == 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if let pools::Verdict::Driver { charged } = pools::verdict(pool, stream) {
        let make = || match real {
            // SAFETY: the driver's own function with the caller's arguments.
            Some(f) => unsafe { f(dptr, bytesize, pool, stream) },
            None => CUDA_ERROR_NOT_FOUND,
        };
        // SAFETY: `dptr` is the caller's, valid for one write (checked non-null), which the
        // driver's function makes before it is read.
        return unsafe {
            pools::alloc_from_drivers_pool(dptr, pool, charged, make, unmaker(stream, per_thread))
        };
    }
    let sid = stream_id(stream, per_thread);
    match serve(
        Hook::MemAllocFromPoolAsync,
        "cuMemAllocFromPoolAsync",
        bytesize,
        sid,
        stream,
    ) {
        Outcome::Done(p) => {
            // SAFETY: valid for one write (checked non-null).
            unsafe { *dptr = p };
            CUDA_SUCCESS
        }
        Outcome::Refused => CUDA_ERROR_OUT_OF_MEMORY,
        Outcome::Pass => match real {
            // SAFETY: the driver's own function with the caller's arguments.
            Some(f) => unsafe { f(dptr, bytesize, pool, stream) },
            None => CUDA_ERROR_NOT_FOUND,
        },
    }
}

/// See the module documentation.
///
/// # Safety
/// As for the driver's `cuMemAllocAsync`: `dptr` is valid for one write.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(
    dptr: *mut CuDevicePtr,
    bytesize: usize,
    stream: CuStream,
) -> CuResult {
    let real = real::driver().mem_alloc_async;
    // SAFETY: the caller's pointer, valid for one write as this function requires.
    unsafe { alloc_async(dptr, bytesize, stream, false, real) }
}

/// See the module documentation (stream 0 is the per-thread default stream).
///
/// # Safety
/// As for the driver's `cuMemAllocAsync_ptsz`: `dptr` is valid for one write.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync_ptsz(
    dptr: *mut CuDevicePtr,
    bytesize: usize,
    stream: CuStream,
) -> CuResult {
    let real = real::driver().mem_alloc_async_ptsz;
    // SAFETY: the caller's pointer, valid for one write as this function requires.
    unsafe { alloc_async(dptr, bytesize, stream, true, real) }
}

/// See the module documentation.
///
/// # Safety
/// As for the driver's `cuMemFreeAsync`.
#[no_mangle]
pub unsafe extern "C" fn cuMemFreeAsync(dptr: CuDevicePtr, stream: CuStream) -> CuResult {
    free_async(dptr, stream, false, real::driver().mem_free_async)
}

/// See the module documentation (stream 0 is the per-thread default stream).
///
/// # Safety
/// As for the driver's `cuMemFreeAsync_ptsz`.
#[no_mangle]
pub unsafe extern "C" fn cuMemFreeAsync_ptsz(dptr: CuDevicePtr, stream: CuStream) -> CuResult {
    free_async(dptr, stream, true, real::driver().mem_free_async_ptsz)
}

/// See the module documentation: served from the tenant's memory unless the pool's memory is
/// the driver's ([`super::pools`]).
///
/// # Safety
/// As for the driver's `cuMemAllocFromPoolAsync`: `dptr` is valid for one write.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync(
    dptr: *mut CuDevicePtr,
    bytesize: usize,
    pool: *mut std::ffi::c_void,
    stream: CuStream,
) -> CuResult {
    let real = real::driver().mem_alloc_from_pool_async;
    // SAFETY: the caller's pointer, valid for one write as this function requires.
    unsafe { alloc_from_pool_async(dptr, bytesize, pool, stream, false, real) }
}

/// See the module documentation (stream 0 is the per-thread default stream).
///
/// # Safety
/// As for the driver's `cuMemAllocFromPoolAsync_ptsz`: `dptr` is valid for one write.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync_ptsz(
    dptr: *mut CuDevicePtr,
    bytesize: usize,
    pool: *mut std::ffi::c_void,
    stream: CuStream,
) -> CuResult {
    let real = real::driver().mem_alloc_from_pool_async_ptsz;
    // SAFETY: the caller's pointer, valid for one write as this function requires.
    unsafe { alloc_from_pool_async(dptr, bytesize, pool, stream, true, real) }
}
