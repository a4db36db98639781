//! The CUDA backend: the driver's virtual-memory API (`cuMemCreate` with POSIX file-descriptor
//! handles, `cuMemAddressReserve`, `cuMemMap`, `cuMemSetAccess`), loaded at run time so that vramd
//! builds and runs where there is no GPU: a missing driver is [`DeviceError::DriverUnavailable`].
//!
//! A GPU is opened in one of two modes, fixed in its type ([`Gpu`]): a [`CudaDevice`] retains the
//! device's primary context and can copy ([`ByteAccess`]); a [`CudaHandles`] has no context and
//! only creates, exports, imports, reserves, maps and releases memory (the driver allows all of
//! these without a context: docs/benchmarks.md, "GPU tests on the H200"), which saves the
//! context's device memory. Every call runs with the device's primary context pushed on the calling
//! thread and popped after, so a caller's own current context is left as it was. A device object
//! retains the primary context for as long as it, or any handle or reservation made through it,
//! lives.
//!
//! Copies and fills are synchronous: when `write` or `fill` returns, the bytes are in device
//! memory and visible to every process that maps it.

mod checksum;
mod driver;
mod events;

pub use events::{EventPool, DEFAULT_STREAM};

use std::ffi::{c_char, c_void, CStr};
use std::marker::PhantomData;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, OnceLock, RwLock};

use cudarc::driver::sys::{self, CUresult};
use vram_core::shared::Checksummer;
use vram_core::Bytes;

use crate::{
    check_size, checksum_by_reading, Access, BackendKind, Backing, ByteAccess, Device, DeviceError,
    DeviceInfo, Handle, RawHandle, Reservation, Result, Usage,
};
use driver::{check, log_failure, Context};
pub(crate) use driver::{Allocation, VaRange};

/// Lists the GPUs the driver sees, by UUID. [`DeviceError::DriverUnavailable`] where there is no
/// driver or no GPU.
pub fn probe() -> Result<Vec<DeviceInfo>> {
    driver::load()?;
    let mut count = 0;
    // SAFETY: the driver is loaded; `count` is a valid out pointer.
    check("cuDeviceGetCount", unsafe {
        sys::cuDeviceGetCount(&mut count)
    })?;
    (0..count)
        .map(|ordinal| describe(device(ordinal)?))
        .collect()
}

fn device(ordinal: i32) -> Result<sys::CUdevice> {
    let mut dev = 0;
    // SAFETY: the driver is loaded (callers come after `driver::load`); `dev` is an out pointer.
    check("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&mut dev, ordinal)
    })?;
    Ok(dev)
}

/// Name, UUID, memory and granularity of a device, queried without a context.
fn describe(dev: sys::CUdevice) -> Result<DeviceInfo> {
    let mut name = [0 as c_char; 256];
    // SAFETY: the buffer holds `len` chars; the driver NUL-terminates what it writes.
    check("cuDeviceGetName", unsafe {
        sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, dev)
    })?;
    // SAFETY: NUL-terminated by the driver within the buffer (zeroed beforehand as well).
    let name = unsafe { CStr::from_ptr(name.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    let mut uuid = sys::CUuuid { bytes: [0; 16] };
    // SAFETY: `uuid` is a valid out pointer of the driver's type.
    check("cuDeviceGetUuid", unsafe {
        sys::cuDeviceGetUuid_v2(&mut uuid, dev)
    })?;
    let mut total = 0usize;
    // SAFETY: `total` is a valid out pointer.
    check("cuDeviceTotalMem", unsafe {
        sys::cuDeviceTotalMem_v2(&mut total, dev)
    })?;
    let mut granularity = 0usize;
    let prop = allocation_prop(dev);
    // SAFETY: `prop` describes pinned device memory on `dev`; `granularity` is an out pointer.
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut granularity,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    })?;
    Ok(DeviceInfo {
        kind: BackendKind::Cuda,
        uuid: format_uuid(&uuid.bytes.map(|b| b as u8)),
        name,
        capacity: Bytes(total as u64),
        granularity: Bytes(granularity as u64),
    })
}

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as `nvidia-smi -L` and NVML print it.
pub fn format_uuid(b: &[u8; 16]) -> String {
    let hex =
        |r: std::ops::Range<usize>| b[r].iter().map(|x| format!("{x:02x}")).collect::<String>();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        hex(0..4),
        hex(4..6),
        hex(6..8),
        hex(8..10),
        hex(10..16)
    )
}

/// Pinned memory on `dev`, shareable as a POSIX file descriptor.
fn allocation_prop(dev: sys::CUdevice) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes:
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: dev,
        },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// What a [`Gpu`] is opened as: [`WithContext`] or [`WithoutContext`].
pub trait ContextMode: sealed::Sealed + Send + Sync + std::fmt::Debug + 'static {
    /// Whether the device retains the GPU's primary context.
    const RETAINS_CONTEXT: bool;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::WithContext {}
    impl Sealed for super::WithoutContext {}
}

/// The GPU's primary context retained: copies, fills, checksums, events, `memory()`.
#[derive(Debug)]
pub enum WithContext {}

/// No context: handles only.
#[derive(Debug)]
pub enum WithoutContext {}

impl ContextMode for WithContext {
    const RETAINS_CONTEXT: bool = true;
}

impl ContextMode for WithoutContext {
    const RETAINS_CONTEXT: bool = false;
}

/// One GPU, driven through the virtual-memory API, opened as `M` says. See the module
/// documentation.
#[derive(Debug)]
pub struct Gpu<M: ContextMode> {
    info: DeviceInfo,
    ctx: Arc<Context>,
    usage: Arc<Usage>,
    /// The checksum kernel, loaded at its first use (or the reason it could not be); used only
    /// with a context.
    checksum: OnceLock<Result<checksum::Kernel, String>>,
    mode: PhantomData<M>,
}

/// A GPU with its primary context: a tenant's, a replay's, the daemon's shared-buffer reader.
pub type CudaDevice = Gpu<WithContext>;

/// A GPU without a context, for a process (the daemon) that only handles memory and never
/// reaches its bytes.
pub type CudaHandles = Gpu<WithoutContext>;

impl CudaDevice {
    /// Opens the GPU named by `which`: its ordinal (`"0"`) or its UUID (`"GPU-5f0c..."`, the
    /// `GPU-` prefix optional, any case).
    pub fn open(which: &str) -> Result<Self> {
        Self::open_as(which)
    }

    /// Free and total memory of the GPU, as the driver counts them (all processes together).
    pub fn memory(&self) -> Result<(Bytes, Bytes)> {
        self.driver_memory()
    }

    pub(crate) fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Waits until the copies and fills queued on the context are done.
    fn synchronize(&self) -> Result<()> {
        // SAFETY: a context is current (the caller entered it).
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    fn checksum_kernel(&self) -> Result<&checksum::Kernel> {
        self.checksum
            .get_or_init(|| checksum::Kernel::load(&self.ctx).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| DeviceError::Driver {
                call: "loading the checksum kernel",
                detail: e.clone(),
            })
    }
}

impl CudaHandles {
    /// Opens the GPU named by `which` (as [`CudaDevice::open`] does) without a context.
    pub fn open(which: &str) -> Result<Self> {
        Self::open_as(which)
    }
}

impl<M: ContextMode> Gpu<M> {
    fn open_as(which: &str) -> Result<Self> {
        let devices = probe()?;
        let wanted = which.trim().to_ascii_lowercase();
        let wanted = wanted.strip_prefix("gpu-").unwrap_or(&wanted);
        let ordinal = match which.trim().parse::<usize>() {
            Ok(n) if n < devices.len() => Some(n),
            Ok(_) => None,
            Err(_) => devices
                .iter()
                .position(|d| d.uuid.to_ascii_lowercase().strip_prefix("gpu-") == Some(wanted)),
        };
        let Some(ordinal) = ordinal else {
            return Err(DeviceError::NoSuchDevice {
                which: which.to_owned(),
                found: devices.iter().map(|d| d.uuid.clone()).collect(),
            });
        };
        let ctx = if M::RETAINS_CONTEXT {
            Context::retain(device(ordinal as i32)?)?
        } else {
            Context::none(device(ordinal as i32)?)
        };
        Ok(Gpu {
            info: devices[ordinal].clone(),
            ctx,
            usage: Arc::default(),
            checksum: OnceLock::new(),
            mode: PhantomData,
        })
    }

    fn granularity(&self) -> Bytes {
        self.info.granularity
    }

    fn allocation<'h>(&self, handle: &'h Handle) -> Result<&'h Allocation> {
        match &handle.raw {
            RawHandle::Cuda(a) if a.ctx.device == self.ctx.device => Ok(a),
            RawHandle::Cuda(_) => Err(DeviceError::WrongBackend {
                what: "handle of another GPU",
                expected: BackendKind::Cuda,
                found: BackendKind::Cuda,
            }),
            other => Err(other.not_of(BackendKind::Cuda)),
        }
    }

    fn check_aligned_range(&self, res: &Reservation, offset: Bytes, len: Bytes) -> Result<()> {
        res.check_aligned_range(BackendKind::Cuda, offset, len, self.granularity())
    }

    fn check_copy(&self, res: &Reservation, offset: Bytes, len: usize) -> Result<u64> {
        res.check_copy(BackendKind::Cuda, offset, len)
            .map(|a| a as u64)
    }

    fn set_access_raw(&self, ptr: u64, len: u64, access: Access) -> Result<()> {
        let desc = sys::CUmemAccessDesc {
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: self.ctx.device,
            },
            flags: match access {
                Access::ReadWrite => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                Access::ReadOnly => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ,
            },
        };
        // SAFETY: `ptr..ptr+len` is mapped (callers check it under the reservation's write lock);
        // `desc` is one valid descriptor.
        check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(ptr, len as usize, &desc, 1)
        })
    }

    /// Free and total memory as the driver counts them. Needs a context: called only where `M`
    /// retains one.
    fn driver_memory(&self) -> Result<(Bytes, Bytes)> {
        let (mut free, mut total) = (0usize, 0usize);
        let _entered = self.ctx.enter()?;
        // SAFETY: a context is current; both are valid out pointers.
        check("cuMemGetInfo", unsafe {
            sys::cuMemGetInfo_v2(&mut free, &mut total)
        })?;
        Ok((Bytes(free as u64), Bytes(total as u64)))
    }

    /// The error for a `cuMemCreate` of `asked` that ran out of memory. With a context it says
    /// what the driver counts in use on the whole GPU; without one (the driver's figure needs a
    /// context) what this device object created.
    fn out_of_memory(&self, asked: Bytes) -> DeviceError {
        let (used, capacity) = if M::RETAINS_CONTEXT {
            match self.driver_memory() {
                Ok((free, total)) => (total.saturating_sub(free), total),
                Err(e) => return e,
            }
        } else {
            (self.usage.get(), self.info.capacity)
        };
        DeviceError::OutOfMemory {
            asked,
            used,
            capacity,
        }
    }
}

impl<M: ContextMode> Device for Gpu<M> {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn used(&self) -> Bytes {
        self.usage.get()
    }

    fn create(&self, size: Bytes) -> Result<Handle> {
        check_size("handle size", size, self.granularity())?;
        self.usage.charge(size, self.info.capacity, || {
            let prop = allocation_prop(self.ctx.device);
            let mut handle = 0;
            let r = {
                let _entered = self.ctx.enter()?;
                // SAFETY: a context is current; `prop` describes shareable pinned memory on this
                // device and `size` is a non-zero multiple of its granularity.
                unsafe { sys::cuMemCreate(&mut handle, size.get() as usize, &prop, 0) }
            };
            if r == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                return Err(self.out_of_memory(size));
            }
            check("cuMemCreate", r)?;
            Ok(RawHandle::Cuda(Allocation {
                handle,
                ctx: Arc::clone(&self.ctx),
                fd: OnceLock::new(),
            }))
        })
    }

    fn export(&self, handle: &Handle) -> Result<OwnedFd> {
        let a = self.allocation(handle)?;
        let fd = match a.fd.get() {
            Some(fd) => fd,
            None => {
                let fd = a.export_fd()?;
                // Two threads may both export the first time; one fd is kept, the other closed.
                a.fd.get_or_init(|| fd)
            }
        };
        rustix::io::fcntl_dupfd_cloexec(fd, 0)
            .map_err(|e| DeviceError::os("fcntl(F_DUPFD_CLOEXEC)", e))
    }

    fn import(&self, fd: OwnedFd, size: Bytes) -> Result<Handle> {
        check_size("handle size", size, self.granularity())?;
        let mut handle = 0;
        let r = {
            let _entered = self.ctx.enter()?;
            // SAFETY: for the POSIX-fd handle type the driver takes the fd's value in the pointer
            // argument and only reads it; `fd` stays open (and owned here) during the call.
            unsafe {
                sys::cuMemImportFromShareableHandle(
                    &mut handle,
                    fd.as_raw_fd() as usize as *mut c_void,
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                )
            }
        };
        check("cuMemImportFromShareableHandle", r).map_err(|e| DeviceError::BadImport {
            expected: size,
            reason: e.to_string(),
        })?;
        // The import holds the memory; the descriptor is closed here rather than kept, so a
        // tenant holding thousands of handles holds no descriptor for them (its open-file limit
        // is the program's own). An export of an imported handle, if ever asked, makes a new one.
        drop(fd);
        Ok(Handle::imported(
            size,
            RawHandle::Cuda(Allocation {
                handle,
                ctx: Arc::clone(&self.ctx),
                fd: OnceLock::new(),
            }),
        ))
    }

    fn reserve(&self, size: Bytes) -> Result<Reservation> {
        check_size("reservation size", size, self.granularity())?;
        let mut base = 0;
        let _entered = self.ctx.enter()?;
        // SAFETY: a context is current; the driver picks a free range aligned to the granularity.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(
                &mut base,
                size.get() as usize,
                self.granularity().get() as usize,
                0,
                0,
            )
        })?;
        Ok(Reservation {
            base: base as usize,
            size,
            mappings: RwLock::default(),
            backing: Backing::Cuda(VaRange {
                ctx: Arc::clone(&self.ctx),
            }),
        })
    }

    fn map(&self, res: &Reservation, offset: Bytes, handle: &Handle, access: Access) -> Result<()> {
        let a = self.allocation(handle)?;
        let mut mappings =
            res.check_map(BackendKind::Cuda, offset, handle.size, self.granularity())?;
        let ptr = res.addr(offset) as u64;
        let len = handle.size.get();
        let _entered = self.ctx.enter()?;
        // SAFETY: `ptr..ptr+len` lies inside a range this device reserved and nothing is mapped
        // there (checked above under the write lock); `a.handle` is a live allocation.
        check("cuMemMap", unsafe {
            sys::cuMemMap(ptr, len as usize, 0, a.handle, 0)
        })?;
        if let Err(e) = self.set_access_raw(ptr, len, access) {
            // SAFETY: undoes the mapping made just above.
            log_failure("cuMemUnmap", unsafe { sys::cuMemUnmap(ptr, len as usize) });
            return Err(e);
        }
        mappings.insert(offset.get(), len, access)
    }

    fn set_access(
        &self,
        res: &Reservation,
        offset: Bytes,
        len: Bytes,
        access: Access,
    ) -> Result<()> {
        self.check_aligned_range(res, offset, len)?;
        let mut mappings = res.mappings_mut();
        let changed = mappings.whole(offset.get(), len.get(), true)?;
        let _entered = self.ctx.enter()?;
        for &(o, m) in &changed {
            self.set_access_raw(res.base as u64 + o, m.len, access)?;
            mappings.set_access(&[(o, m)], access);
        }
        Ok(())
    }

    fn unmap(&self, res: &Reservation, offset: Bytes, len: Bytes) -> Result<()> {
        self.check_aligned_range(res, offset, len)?;
        let mut mappings = res.mappings_mut();
        let removed = mappings.whole(offset.get(), len.get(), false)?;
        let _entered = self.ctx.enter()?;
        for &(o, m) in &removed {
            // SAFETY: exactly one whole mapping made by `map`; the write lock keeps copies out.
            check("cuMemUnmap", unsafe {
                sys::cuMemUnmap(res.base as u64 + o, m.len as usize)
            })?;
            mappings.remove(&[(o, m)]);
        }
        Ok(())
    }
}

impl ByteAccess for CudaDevice {
    fn write(&self, res: &Reservation, offset: Bytes, data: &[u8]) -> Result<()> {
        let ptr = self.check_copy(res, offset, data.len())?;
        let mappings = res.mappings();
        mappings.check_covered(offset.get(), data.len() as u64, true)?;
        if data.is_empty() {
            return Ok(());
        }
        let _entered = self.ctx.enter()?;
        // SAFETY: the destination is mapped read-write on this device (checked above; the read
        // lock keeps it mapped) and `data` is a live host buffer of that length.
        check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(ptr, data.as_ptr().cast(), data.len())
        })?;
        self.synchronize()
    }

    fn read(&self, res: &Reservation, offset: Bytes, out: &mut [u8]) -> Result<()> {
        let ptr = self.check_copy(res, offset, out.len())?;
        let mappings = res.mappings();
        mappings.check_covered(offset.get(), out.len() as u64, false)?;
        if out.is_empty() {
            return Ok(());
        }
        let _entered = self.ctx.enter()?;
        // SAFETY: the source is mapped on this device (checked above; the read lock keeps it
        // mapped) and `out` is a live, exclusively borrowed host buffer of that length. The copy
        // is synchronous for pageable host memory.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), ptr, out.len())
        })
    }

    fn fill(&self, res: &Reservation, offset: Bytes, len: Bytes, byte: u8) -> Result<()> {
        let ptr = self.check_copy(res, offset, len.get() as usize)?;
        let mappings = res.mappings();
        mappings.check_covered(offset.get(), len.get(), true)?;
        if len == Bytes::ZERO {
            return Ok(());
        }
        let _entered = self.ctx.enter()?;
        // SAFETY: the range is mapped read-write on this device (checked above; the read lock
        // keeps it mapped).
        check("cuMemsetD8", unsafe {
            sys::cuMemsetD8_v2(ptr, byte, len.get() as usize)
        })?;
        self.synchronize()
    }

    /// Runs the checksum kernel over the whole words of the range, on the GPU; only a partial last
    /// word (at most 7 bytes) is copied to the host.
    fn feed_checksum(
        &self,
        res: &Reservation,
        offset: Bytes,
        len: Bytes,
        sum: &mut Checksummer,
    ) -> Result<()> {
        let ptr = self.check_copy(res, offset, len.get() as usize)?;
        if !sum.at_word_boundary() || ptr % 8 != 0 {
            // The kernel reads aligned words numbered from a word boundary.
            return checksum_by_reading(self, res, offset, len, sum);
        }
        let whole = len.get() / 8 * 8;
        {
            let mappings = res.mappings();
            mappings.check_covered(offset.get(), len.get(), false)?;
            let kernel = self.checksum_kernel()?;
            // SAFETY: the range is mapped on this device (checked above) and the read lock keeps
            // it mapped until the kernel has finished (`sum_words` returns after it).
            let s = unsafe { kernel.sum_words(ptr, whole / 8, sum.next_word())? };
            sum.add_words(s, whole);
        }
        let mut tail = [0u8; 8];
        let tail = &mut tail[..(len.get() - whole) as usize];
        self.read(res, Bytes(offset.get() + whole), tail)?;
        sum.update(tail);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_is_printed_like_nvidia_smi() {
        let b = [
            0x5f, 0x0c, 0x1a, 0x2b, 0x3c, 0x4d, 0x5e, 0x6f, 0x70, 0x81, 0x92, 0xa3, 0xb4, 0xc5,
            0xd6, 0xe7,
        ];
        assert_eq!(format_uuid(&b), "GPU-5f0c1a2b-3c4d-5e6f-7081-92a3b4c5d6e7");
    }

    #[test]
    fn no_driver_is_an_error_not_a_panic() {
        // On a machine without libcuda this is DriverUnavailable; with one, a list (maybe empty).
        match probe() {
            Ok(devices) => eprintln!("probe found {} GPU(s)", devices.len()),
            Err(e) => assert!(matches!(e, DeviceError::DriverUnavailable(_)), "{e}"),
        }
        if let Err(e) = CudaDevice::open("0") {
            eprintln!("open: {e}");
        }
    }
}
