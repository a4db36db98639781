//! vram-device: physical memory, shareable between processes, and the virtual ranges it is mapped
//! into.
//!
//! A [`Device`] creates physical memory as [`Handle`]s (the smallest unit that can be granted,
//! mapped or returned), exports a handle as a file descriptor that another process can import,
//! reserves virtual address ranges ([`Reservation`]) and maps handles into them read-write or
//! read-only. A device that can also reach the bytes of mapped memory (copies, fills, checksums) is
//! a [`ByteAccess`]; one that cannot (a CUDA device opened without a context) is only a `Device`,
//! so a copy through it does not compile.
//!
//! Backends: [`host`] (one memfd per handle; the default where no GPU is found, and real
//! cross-process shared memory) and [`cuda`] (the driver's virtual-memory API, loaded at run time).
//! [`backend`] is their registry: [`BackendKind`] names them, [`devices`] lists a backend's
//! devices, [`open`] and [`open_for_handles`] open one from its [`DeviceInfo`].
//!
//! Both backends follow the same rules, checked before anything reaches the OS or the driver, so a
//! bad call is an error, never a fault: sizes and mapping offsets are multiples of the granularity;
//! a range lies inside its reservation; a handle is mapped whole, never over another mapping;
//! `set_access` and `unmap` act on whole mappings; copies reach only mapped memory, and writes only
//! memory mapped read-write.
//!
//! All unsafe code of vramd's device layer lives in this crate, each block with a `// SAFETY:`
//! comment.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use vram_core::shared::Checksummer;
use vram_core::Bytes;

pub mod backend;
pub mod cuda;
pub mod host;
mod mappings;

pub use backend::{devices, open, open_for_handles, BackendKind, BackendSelection, UnknownBackend};
pub use cuda::{CudaDevice, CudaHandles};
pub use host::HostDevice;
use mappings::Mappings;

/// What a device is and what it can hold: the description [`open`] opens a device from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub kind: BackendKind,
    /// Stable name: a GPU's UUID (`GPU-xxxxxxxx-...`), or `host-<n>` for the host backend.
    pub uuid: String,
    /// Human-readable name, e.g. `NVIDIA H200` or `host memfd device`.
    pub name: String,
    /// Physical memory the device may create in all (configured for host, total memory for cuda).
    pub capacity: Bytes,
    /// Every handle size and every mapping offset is a multiple of this.
    pub granularity: Bytes,
}

/// How a mapping may be accessed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    ReadWrite,
    ReadOnly,
}

/// Errors of the device layer; each carries the numbers a user needs.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    #[error("device is out of memory: asked for {asked}, {used} of {capacity} in use")]
    OutOfMemory {
        asked: Bytes,
        used: Bytes,
        capacity: Bytes,
    },
    #[error("{what} {value} is not a multiple of the device granularity {granularity}")]
    Unaligned {
        what: &'static str,
        value: Bytes,
        granularity: Bytes,
    },
    #[error("{what} must not be zero")]
    Empty { what: &'static str },
    #[error("range {offset}+{len} lies outside the reservation of {size}")]
    OutOfRange {
        offset: Bytes,
        len: Bytes,
        size: Bytes,
    },
    #[error("handle of {handle} does not fit at {offset} in a reservation of {size}")]
    HandleDoesNotFit {
        handle: Bytes,
        offset: Bytes,
        size: Bytes,
    },
    #[error("range {offset}+{len} overlaps the mapping at {mapped_offset}+{mapped_len}")]
    AlreadyMapped {
        offset: Bytes,
        len: Bytes,
        mapped_offset: Bytes,
        mapped_len: Bytes,
    },
    #[error("range {offset}+{len} is not mapped at {gap}")]
    NotMapped {
        offset: Bytes,
        len: Bytes,
        gap: Bytes,
    },
    #[error("range {offset}+{len} cuts the mapping at {mapped_offset}+{mapped_len}; act on whole mappings")]
    SplitsMapping {
        offset: Bytes,
        len: Bytes,
        mapped_offset: Bytes,
        mapped_len: Bytes,
    },
    #[error("range {offset}+{len} is mapped read-only at {mapped_offset}")]
    ReadOnly {
        offset: Bytes,
        len: Bytes,
        mapped_offset: Bytes,
    },
    #[error("a {found} {what} was given to a {expected} device")]
    WrongBackend {
        what: &'static str,
        expected: BackendKind,
        found: BackendKind,
    },
    #[error("imported fd is not a handle of {expected}: {reason}")]
    BadImport { expected: Bytes, reason: String },
    #[error("no CUDA device `{which}`; found: {found:?}")]
    NoSuchDevice { which: String, found: Vec<String> },
    #[error("driver unavailable: {0}")]
    DriverUnavailable(String),
    #[error("{call} failed: {detail}")]
    Driver { call: &'static str, detail: String },
    #[error("{op}: {source}")]
    Os {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
}

impl DeviceError {
    fn os(op: &'static str, e: rustix::io::Errno) -> Self {
        DeviceError::Os {
            op,
            source: e.into(),
        }
    }
}

pub type Result<T, E = DeviceError> = std::result::Result<T, E>;

/// What every device does with memory handles (create, export, import, reserve, map); reaching
/// the bytes is [`ByteAccess`]'s. Object-safe, so the daemon and the client hold a `dyn Device`
/// chosen at run time; adaptors (accounting, fault injection) wrap any implementation.
pub trait Device: Send + Sync + std::fmt::Debug {
    fn info(&self) -> &DeviceInfo;

    /// Physical memory created through this device object and not yet released (imports excluded).
    fn used(&self) -> Bytes;

    /// Creates physical memory of `size` (a multiple of the granularity), exportable to other
    /// processes.
    fn create(&self, size: Bytes) -> Result<Handle>;

    /// Refuses every later write access to `handle`'s memory by anyone (new writable mappings,
    /// writes through a descriptor); mappings made before stay as they are. For shared-buffer
    /// versions at publish. The host backend seals the memfd; the cuda backend has no such seal
    /// (an importer chooses its own mapping's access), so there it does nothing.
    fn seal_writes(&self, handle: &Handle) -> Result<()> {
        let _ = handle;
        Ok(())
    }

    /// A file descriptor that another process passes to [`Device::import`] to reach the same
    /// memory.
    fn export(&self, handle: &Handle) -> Result<OwnedFd>;

    /// A file descriptor for a process that may only read `handle`'s memory (a shared-buffer
    /// reader). The host backend opens the memfd read-only, so no writable mapping can be made
    /// of it; on cuda an importer chooses its own mapping's access, so this is [`Device::export`].
    fn export_read_only(&self, handle: &Handle) -> Result<OwnedFd> {
        self.export(handle)
    }

    /// Whether some process still reaches `handle`'s memory through a descriptor this device
    /// exported (kept open, passed on, or mapped): `Some(true)` while one does, `Some(false)` once
    /// none does, `None` where the backend cannot tell. The daemon asks before it counts a
    /// returned handle as free. The host backend answers from the kernel (see `host/mod.rs`); the
    /// cuda backend cannot see another process's imports and answers `None`.
    fn reached_elsewhere(&self, handle: &Handle) -> Option<bool> {
        let _ = handle;
        None
    }

    /// Takes a file descriptor made by [`Device::export`] in any process. `size` is what the
    /// exporter said; it is checked where the backend can.
    fn import(&self, fd: OwnedFd, size: Bytes) -> Result<Handle>;

    /// Reserves `size` bytes of virtual address space, inaccessible until something is mapped.
    fn reserve(&self, size: Bytes) -> Result<Reservation>;

    /// Maps all of `handle` at `offset` into `res` with the given access.
    fn map(&self, res: &Reservation, offset: Bytes, handle: &Handle, access: Access) -> Result<()>;

    /// Changes the access of `[offset, offset+len)`, which must be mapped.
    fn set_access(
        &self,
        res: &Reservation,
        offset: Bytes,
        len: Bytes,
        access: Access,
    ) -> Result<()>;

    /// Unmaps `[offset, offset+len)`; the range becomes inaccessible again but stays reserved.
    fn unmap(&self, res: &Reservation, offset: Bytes, len: Bytes) -> Result<()>;
}

/// Byte access to mapped memory: copies to and from the host, fills and checksums. Only devices
/// that can reach their memory's bytes implement it (a CUDA device opened without a context
/// cannot), so a copy through one that cannot is a type error, not a failure at run time.
pub trait ByteAccess: Device {
    /// Copies `data` into mapped memory at `res + offset`.
    fn write(&self, res: &Reservation, offset: Bytes, data: &[u8]) -> Result<()>;

    /// Copies mapped memory at `res + offset` into `out`.
    fn read(&self, res: &Reservation, offset: Bytes, out: &mut [u8]) -> Result<()>;

    /// Sets `len` bytes of mapped memory at `res + offset` to `byte`.
    fn fill(&self, res: &Reservation, offset: Bytes, len: Bytes, byte: u8) -> Result<()>;

    /// Feeds `len` bytes of mapped memory at `res + offset` to `sum` (the shared-buffer checksum,
    /// `vram_core::shared::checksum`). The default copies them to the host in pieces; the cuda
    /// backend runs a kernel over them on the GPU.
    fn feed_checksum(
        &self,
        res: &Reservation,
        offset: Bytes,
        len: Bytes,
        sum: &mut Checksummer,
    ) -> Result<()> {
        checksum_by_reading(self, res, offset, len, sum)
    }

    /// The shared-buffer checksum of `len` bytes of mapped memory at `res + offset`, as
    /// `vram_core::shared::checksum` computes it over the same bytes.
    fn checksum(&self, res: &Reservation, offset: Bytes, len: Bytes) -> Result<u64> {
        let mut sum = Checksummer::new();
        self.feed_checksum(res, offset, len, &mut sum)?;
        Ok(sum.finish())
    }
}

/// [`ByteAccess::feed_checksum`] by copying the bytes to the host, 8 MiB at a time.
pub fn checksum_by_reading<D: ByteAccess + ?Sized>(
    device: &D,
    res: &Reservation,
    offset: Bytes,
    len: Bytes,
    sum: &mut Checksummer,
) -> Result<()> {
    const PIECE: u64 = 8 << 20;
    let mut buf = vec![0u8; PIECE.min(len.get()) as usize];
    let mut at = 0;
    while at < len.get() {
        let n = (len.get() - at).min(PIECE) as usize;
        device.read(res, Bytes(offset.get() + at), &mut buf[..n])?;
        sum.update(&buf[..n]);
        at += n as u64;
    }
    Ok(())
}

/// Physical device memory. Released when dropped (the memory itself lives on while any other
/// process still holds an import or a mapping of it, as the OS and the driver guarantee).
#[derive(Debug)]
pub struct Handle {
    size: Bytes,
    raw: RawHandle,
    /// Present for handles created (not imported) by a device object: gives their size back to its
    /// usage count on drop. Declared after `raw`, so it drops after it: the memory is released
    /// before the count says it is.
    _usage: Option<Counted>,
}

/// A created handle's place in its device object's usage count, given back on drop.
#[derive(Debug)]
struct Counted {
    usage: Arc<Usage>,
    size: Bytes,
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.usage.sub(self.size);
    }
}

/// A handle as its backend holds it, in a type private to that backend; each releases itself
/// on drop.
#[derive(Debug)]
enum RawHandle {
    Host(host::Memfd),
    Cuda(cuda::Allocation),
}

impl RawHandle {
    fn kind(&self) -> BackendKind {
        match self {
            RawHandle::Host(_) => BackendKind::Host,
            RawHandle::Cuda(_) => BackendKind::Cuda,
        }
    }

    /// The error for this handle given to a device of backend `expected`.
    fn not_of(&self, expected: BackendKind) -> DeviceError {
        DeviceError::WrongBackend {
            what: "handle",
            expected,
            found: self.kind(),
        }
    }
}

impl Handle {
    pub fn size(&self) -> Bytes {
        self.size
    }

    pub fn kind(&self) -> BackendKind {
        self.raw.kind()
    }

    fn imported(size: Bytes, raw: RawHandle) -> Handle {
        Handle {
            size,
            raw,
            _usage: None,
        }
    }
}

/// Bytes created and not yet released through one device object.
#[derive(Debug, Default)]
pub struct Usage(AtomicU64);

impl Usage {
    pub fn get(&self) -> Bytes {
        Bytes(self.0.load(Ordering::Acquire))
    }

    /// Charges `size` against `capacity`, then runs `make`; the handle it makes gives the charge
    /// back on drop, and a failed `make` gives it back at once.
    fn charge(
        self: &Arc<Self>,
        size: Bytes,
        capacity: Bytes,
        make: impl FnOnce() -> Result<RawHandle>,
    ) -> Result<Handle> {
        self.0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(size.get())
                    .filter(|&total| total <= capacity.get())
            })
            .map_err(|used| DeviceError::OutOfMemory {
                asked: size,
                used: Bytes(used),
                capacity,
            })?;
        match make() {
            Ok(raw) => Ok(Handle {
                size,
                raw,
                _usage: Some(Counted {
                    usage: Arc::clone(self),
                    size,
                }),
            }),
            Err(e) => {
                self.sub(size);
                Err(e)
            }
        }
    }

    fn sub(&self, b: Bytes) {
        self.0.fetch_sub(b.get(), Ordering::AcqRel);
    }
}

/// A reserved range of virtual addresses. Everything still mapped in it is unmapped, and the range
/// freed, when it is dropped.
#[derive(Debug)]
pub struct Reservation {
    base: usize,
    size: Bytes,
    /// What is mapped where. Copies hold the read lock so that nothing is unmapped under them.
    mappings: RwLock<Mappings>,
    backing: Backing,
}

/// How a reservation gives its range back.
#[derive(Debug)]
enum Backing {
    Host,
    Cuda(cuda::VaRange),
}

impl Reservation {
    /// The first address of the range (a device pointer on cuda, a host pointer on host).
    pub fn base(&self) -> usize {
        self.base
    }

    pub fn size(&self) -> Bytes {
        self.size
    }

    pub fn kind(&self) -> BackendKind {
        match self.backing {
            Backing::Host => BackendKind::Host,
            Backing::Cuda(_) => BackendKind::Cuda,
        }
    }

    fn mappings(&self) -> RwLockReadGuard<'_, Mappings> {
        // A panic while the lock was held cannot leave the table half-changed: every change is one
        // insert or remove after the OS call succeeded.
        self.mappings.read().unwrap_or_else(|p| p.into_inner())
    }

    fn mappings_mut(&self) -> RwLockWriteGuard<'_, Mappings> {
        self.mappings.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Checks that this is a `kind` reservation and `[offset, offset+len)` a range of whole
    /// granules inside it (what map, unmap and set_access need).
    fn check_aligned_range(
        &self,
        kind: BackendKind,
        offset: Bytes,
        len: Bytes,
        granularity: Bytes,
    ) -> Result<()> {
        check_kind("reservation", kind, self.kind())?;
        check_aligned("offset", offset, granularity)?;
        check_size("length", len, granularity)?;
        self.check_range(offset, len)
    }

    /// Checks a map of a handle of `size` at `offset` in a `kind` reservation: whole granules,
    /// inside it, and nothing mapped there. Returns the mapping table locked for writing, so
    /// that the caller maps and records the mapping before anyone else can map there.
    fn check_map(
        &self,
        kind: BackendKind,
        offset: Bytes,
        size: Bytes,
        granularity: Bytes,
    ) -> Result<RwLockWriteGuard<'_, Mappings>> {
        check_kind("reservation", kind, self.kind())?;
        check_aligned("offset", offset, granularity)?;
        if self.check_range(offset, size).is_err() {
            return Err(DeviceError::HandleDoesNotFit {
                handle: size,
                offset,
                size: self.size,
            });
        }
        let mappings = self.mappings_mut();
        mappings.check_free(offset.get(), size.get())?;
        Ok(mappings)
    }

    /// Checks a copy of `len` bytes at `offset` into a `kind` reservation; returns its address.
    fn check_copy(&self, kind: BackendKind, offset: Bytes, len: usize) -> Result<usize> {
        check_kind("reservation", kind, self.kind())?;
        self.check_range(offset, Bytes(len as u64))?;
        Ok(self.addr(offset))
    }

    /// Checks that `[offset, offset+len)` lies inside the reservation.
    fn check_range(&self, offset: Bytes, len: Bytes) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(DeviceError::OutOfRange {
                offset,
                len,
                size: self.size,
            }),
        }
    }

    /// The address of `offset`, which [`Reservation::check_range`] has accepted.
    fn addr(&self, offset: Bytes) -> usize {
        self.base + offset.get() as usize
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mappings = self.mappings.get_mut().unwrap_or_else(|p| p.into_inner());
        match &self.backing {
            Backing::Host => host::release_reservation(self.base, self.size),
            Backing::Cuda(va) => va.release(self.base, self.size, mappings),
        }
    }
}

/// Checks that `value` is a non-zero multiple of `granularity`.
fn check_size(what: &'static str, value: Bytes, granularity: Bytes) -> Result<()> {
    if value == Bytes::ZERO {
        return Err(DeviceError::Empty { what });
    }
    check_aligned(what, value, granularity)
}

fn check_aligned(what: &'static str, value: Bytes, granularity: Bytes) -> Result<()> {
    if value.get().checked_rem(granularity.get()) != Some(0) {
        return Err(DeviceError::Unaligned {
            what,
            value,
            granularity,
        });
    }
    Ok(())
}

fn check_kind(what: &'static str, expected: BackendKind, found: BackendKind) -> Result<()> {
    if expected != found {
        return Err(DeviceError::WrongBackend {
            what,
            expected,
            found,
        });
    }
    Ok(())
}
