//! The CUDA driver, loaded at run time, and the few objects that must give something back to it
//! when dropped: the primary context, an allocation, a reserved address range.
//!
//! cudarc loads `libcuda` on first use and panics if the library or a symbol is missing, so
//! [`load`] checks both first and every call here comes after it.

use std::ffi::{c_char, c_void, CStr};
use std::marker::PhantomData;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys::{self, CUresult};
use vram_core::Bytes;

use crate::mappings::Mappings;
use crate::{DeviceError, Result};

/// Every driver symbol this backend calls. Checked once by [`load`], so that no later call can
/// panic on a symbol an old driver lacks.
const SYMBOLS: &[&str] = &[
    "cuInit",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceGetUuid_v2",
    "cuDeviceTotalMem_v2",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuCtxGetCurrent",
    "cuCtxSynchronize",
    "cuMemGetInfo_v2",
    "cuMemGetAllocationGranularity",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuMemsetD8_v2",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventDestroy_v2",
    "cuStreamIsCapturing",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuLaunchKernel",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
];

/// Loads and initialises the driver once per process; every later call gets the same answer.
pub(crate) fn load() -> Result<()> {
    static LOADED: OnceLock<Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            // SAFETY: only tries to dlopen the candidate names of libcuda and closes them again;
            // loading the NVIDIA driver library runs no initialisation with preconditions.
            if !unsafe { sys::is_culib_present() } {
                return Err("libcuda.so could not be loaded (no NVIDIA driver here)".to_owned());
            }
            // SAFETY: the library is present (checked just above), so this cannot panic.
            let lib = unsafe { sys::culib() };
            for name in SYMBOLS {
                // SAFETY: only looks the symbol up; the pointer is not called here, so its type
                // does not matter.
                unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) }
                    .map_err(|e| format!("the driver lacks {name}: {e}"))?;
            }
            // SAFETY: cuInit has no preconditions; all symbols are present.
            check("cuInit", unsafe { sys::cuInit(0) }).map_err(|e| e.to_string())
        })
        .clone()
        .map_err(DeviceError::DriverUnavailable)
}

/// Turns a driver result into this crate's error.
pub(crate) fn check(call: &'static str, r: CUresult) -> Result<()> {
    if r == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    Err(DeviceError::Driver {
        call,
        detail: describe(r),
    })
}

fn describe(r: CUresult) -> String {
    let mut text: *const c_char = std::ptr::null();
    // SAFETY: the driver is loaded (no result exists otherwise); it writes a pointer to a static
    // string, or fails and leaves `text` null.
    let described = unsafe { sys::cuGetErrorString(r, &mut text) } == CUresult::CUDA_SUCCESS;
    if !described || text.is_null() {
        return format!("{r:?} ({})", r as u32);
    }
    // SAFETY: the driver returned a pointer to a static, NUL-terminated string.
    let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
    format!("{r:?} ({}): {text}", r as u32)
}

/// A device's primary context, retained for as long as anything made through it lives — or no
/// context at all, for a process (the daemon) that only creates, exports and releases memory: the
/// driver allows those without one, and a context costs device memory of its own.
#[derive(Debug)]
pub(crate) struct Context {
    pub device: sys::CUdevice,
    /// `None`: context-free (a `CudaHandles`, whose type offers no call that needs a context).
    ctx: Option<sys::CUcontext>,
}

// SAFETY: a CUcontext is an opaque driver handle that the driver lets any thread make current and
// use; this type only passes it to driver calls.
unsafe impl Send for Context {}
// SAFETY: as for Send; no method mutates anything on the Rust side.
unsafe impl Sync for Context {}

impl Context {
    pub fn retain(device: sys::CUdevice) -> Result<Arc<Self>> {
        let mut ctx = std::ptr::null_mut();
        // SAFETY: the driver is loaded and `device` came from cuDeviceGet; `ctx` is a valid out
        // pointer. Balanced by the release in Drop.
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, device)
        })?;
        Ok(Arc::new(Context {
            device,
            ctx: Some(ctx),
        }))
    }

    /// No context: [`Context::enter`] does nothing.
    pub fn none(device: sys::CUdevice) -> Arc<Self> {
        Arc::new(Context { device, ctx: None })
    }

    /// Makes this context current on the calling thread until the guard drops, then restores
    /// whatever the thread had (an application's own context stays untouched).
    pub fn enter(&self) -> Result<Entered> {
        let Some(ctx) = self.ctx else {
            return Ok(Entered {
                pushed: false,
                _thread: PhantomData,
            });
        };
        // Already current (a PyTorch thread has the primary context current): nothing to push,
        // which saves two driver calls on every free of the allocator's.
        let mut current = std::ptr::null_mut();
        // SAFETY: `current` is a valid out pointer.
        let r = unsafe { sys::cuCtxGetCurrent(&mut current) };
        if r == CUresult::CUDA_SUCCESS && current == ctx {
            return Ok(Entered {
                pushed: false,
                _thread: PhantomData,
            });
        }
        // SAFETY: `ctx` is retained for as long as `self` lives.
        check("cuCtxPushCurrent", unsafe { sys::cuCtxPushCurrent_v2(ctx) })?;
        Ok(Entered {
            pushed: true,
            _thread: PhantomData,
        })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        if self.ctx.is_none() {
            return;
        }
        // SAFETY: balances the retain in `Context::retain`; nothing made through this context
        // is left, since each of them holds an Arc to it.
        let r = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
        log_failure("cuDevicePrimaryCtxRelease", r);
    }
}

/// The context pushed by [`Context::enter`]; popped on drop, on the same thread (the raw pointer
/// makes the guard neither Send nor Sync).
pub(crate) struct Entered {
    pushed: bool,
    _thread: PhantomData<*const ()>,
}

impl Drop for Entered {
    fn drop(&mut self) {
        if !self.pushed {
            return;
        }
        let mut ctx = std::ptr::null_mut();
        // SAFETY: pops the context that `Context::enter` pushed on this thread; the guard cannot
        // leave the thread, and guards drop in reverse order of their pushes.
        let r = unsafe { sys::cuCtxPopCurrent_v2(&mut ctx) };
        log_failure("cuCtxPopCurrent", r);
    }
}

pub(crate) fn log_failure(call: &'static str, r: CUresult) {
    // At process exit the driver may be torn down before our statics: nothing is left to release.
    if r == CUresult::CUDA_ERROR_DEINITIALIZED {
        return;
    }
    if let Err(e) = check(call, r) {
        tracing::error!(error = %e, "CUDA clean-up failed");
    }
}

/// Physical memory on a GPU: one `cuMemCreate`d or imported allocation handle.
#[derive(Debug)]
pub(crate) struct Allocation {
    pub handle: sys::CUmemGenericAllocationHandle,
    pub ctx: Arc<Context>,
    /// The handle exported once (an export is a costly driver call); later exports are duplicates
    /// of it. Empty for an imported handle until something exports it.
    pub fd: OnceLock<OwnedFd>,
}

impl Allocation {
    /// Exports the handle as a POSIX file descriptor (close-on-exec).
    pub fn export_fd(&self) -> Result<OwnedFd> {
        let mut raw: std::ffi::c_int = -1;
        let _entered = self.ctx.enter()?;
        // SAFETY: `handle` is a live allocation created with the POSIX-fd handle type; for that
        // type the driver writes an int fd through the pointer.
        check("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut raw as *mut std::ffi::c_int).cast::<c_void>(),
                self.handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        // SAFETY: the driver just created this fd for the caller to own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        rustix::io::fcntl_setfd(&fd, rustix::io::FdFlags::CLOEXEC)
            .map_err(|e| DeviceError::os("fcntl(F_SETFD)", e))?;
        Ok(fd)
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        let Ok(_entered) = self.ctx.enter() else {
            return;
        };
        // SAFETY: this is the only owner of `handle`; mappings made from it keep the memory alive
        // on their own, as the driver documents for cuMemRelease.
        log_failure("cuMemRelease", unsafe { sys::cuMemRelease(self.handle) });
    }
}

/// A reserved range of GPU virtual addresses.
#[derive(Debug)]
pub(crate) struct VaRange {
    pub ctx: Arc<Context>,
}

impl VaRange {
    /// Unmaps everything still mapped and frees the range.
    pub fn release(&self, base: usize, size: Bytes, mappings: &Mappings) {
        let Ok(_entered) = self.ctx.enter() else {
            return;
        };
        for (offset, m) in mappings.iter() {
            // SAFETY: each recorded mapping was made by cuMemMap at exactly this address and
            // length, and the dropped reservation owned it alone.
            let r = unsafe { sys::cuMemUnmap(base as u64 + offset, m.len as usize) };
            log_failure("cuMemUnmap", r);
        }
        // SAFETY: `base..base+size` was returned by cuMemAddressReserve and is now unmapped.
        let r = unsafe { sys::cuMemAddressFree(base as u64, size.get() as usize) };
        log_failure("cuMemAddressFree", r);
    }
}
