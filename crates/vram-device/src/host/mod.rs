//! The host backend: one memfd per handle, mapped with `mmap` into `PROT_NONE` reservations.
//!
//! Real shared memory between processes, and sparse: a memfd costs only the pages that were
//! touched, so a "device" of 141 GB runs on a laptop. Each memfd is sealed against shrinking and
//! growing at creation, and an import checks both the seal and the size, so a process that maps an
//! imported handle cannot be made to fault (SIGBUS) by a file shorter than it was told.
//!
//! The daemon's own descriptor of a handle and every export are separate opens of the memfd
//! (through `/proc/self/fd`), never duplicates of one descriptor: the kernel counts open files, so
//! whether any other process still holds an export (a descriptor kept after a return, passed to
//! another process, or only a mapping of one) is one question to it, a write lease on the
//! daemon's own open that is refused while any other open of the file exists
//! ([`Device::reached_elsewhere`]).
//!
//! Read-only here is `PROT_READ` on a memfd opened read-only; a published shared-buffer version
//! is also sealed against writes (`F_SEAL_FUTURE_WRITE`), so that a reader that reopens its
//! descriptor through `/proc` with write access still cannot write it (on a GPU, a process that
//! imports a handle chooses its own mapping's access).
//!
//! Every copy into or out of mapped memory goes through the `volatile` module: other processes map
//! the same memfds and write them while this one reads, so the compiler must not assume it is the
//! memory's only user.

mod volatile;

use std::ffi::c_void;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, RwLock};

use rustix::fs::{FileType, MemfdFlags, OFlags, SealFlags};
use rustix::mm::{MapFlags, MprotectFlags, ProtFlags};
use vram_core::Bytes;

use crate::{
    check_size, Access, BackendKind, Backing, ByteAccess, Device, DeviceError, DeviceInfo, Handle,
    RawHandle, Reservation, Result, Usage,
};

/// Handle size and mapping unit when none is configured: the same as a GPU's.
pub const DEFAULT_GRANULARITY: Bytes = Bytes::mib(2);

/// Seals every handle's memfd carries: its size is fixed for good. `F_SEAL_SEAL` is left off so
/// that a published shared-buffer version can be sealed against writes later
/// ([`Device::seal_writes`]); a process that seals its own memfd further hurts only itself.
const SEALS: SealFlags = SealFlags::SHRINK.union(SealFlags::GROW);

/// A handle's memory as this backend holds it: a memfd of exactly the handle's size, sealed
/// against shrinking and growing ([`SEALS`]). Closed on drop.
#[derive(Debug)]
pub(crate) struct Memfd(OwnedFd);

/// The host device of `capacity` in handles that are multiples of `granularity`, as
/// [`crate::open`] takes it.
pub fn describe(capacity: Bytes, granularity: Bytes) -> DeviceInfo {
    DeviceInfo {
        kind: BackendKind::Host,
        uuid: "host-0".to_owned(),
        name: "host memfd device".to_owned(),
        capacity,
        granularity,
    }
}

/// A device whose memory is memfds. See the module documentation.
#[derive(Debug)]
pub struct HostDevice {
    info: DeviceInfo,
    usage: Arc<Usage>,
}

impl HostDevice {
    /// A device that may create up to `capacity` in handles that are multiples of `granularity`
    /// (a multiple of the page size; [`DEFAULT_GRANULARITY`] unless there is a reason).
    pub fn new(capacity: Bytes, granularity: Bytes) -> Result<Self> {
        check_size(
            "granularity",
            granularity,
            Bytes(rustix::param::page_size() as u64),
        )?;
        Ok(HostDevice {
            info: describe(capacity, granularity),
            usage: Arc::default(),
        })
    }

    /// A device for a process that only imports what another process created: no capacity of
    /// its own. `granularity` must be the creating device's.
    pub fn for_client(granularity: Bytes) -> Result<Self> {
        HostDevice::new(Bytes::ZERO, granularity)
    }

    fn granularity(&self) -> Bytes {
        self.info.granularity
    }

    fn memfd<'h>(&self, handle: &'h Handle) -> Result<&'h OwnedFd> {
        match &handle.raw {
            RawHandle::Host(Memfd(fd)) => Ok(fd),
            other => Err(other.not_of(BackendKind::Host)),
        }
    }

    fn check_aligned_range(&self, res: &Reservation, offset: Bytes, len: Bytes) -> Result<()> {
        res.check_aligned_range(BackendKind::Host, offset, len, self.granularity())
    }

    fn check_copy(&self, res: &Reservation, offset: Bytes, len: usize) -> Result<usize> {
        res.check_copy(BackendKind::Host, offset, len)
    }
}

/// A new open of the memfd behind `fd`, with its own place in the kernel's count of the file's
/// opens (a duplicate would share `fd`'s).
fn reopen(fd: &OwnedFd, flags: OFlags) -> Result<OwnedFd> {
    use std::os::fd::AsRawFd;
    let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    rustix::fs::open(&path, flags | OFlags::CLOEXEC, rustix::fs::Mode::empty())
        .map_err(|e| DeviceError::os("open(/proc/self/fd/N)", e))
}

/// The kernel's count of a file's opens, asked through a write lease (`fcntl(F_SETLEASE)`): one
/// is granted only while no other open of the file exists, for reading or writing, in any
/// process; a mapping keeps its open alive after its descriptor is closed.
mod lease {
    use std::os::fd::{AsRawFd, OwnedFd};

    /// Takes a write lease on `fd` and gives it up at once: `Ok(true)` if it was granted (no other
    /// open of the file exists), `Ok(false)` if another open refused it.
    ///
    /// An open of the file by anyone while the lease is held breaks it, and the kernel signals
    /// the break to the lease holder with SIGIO, whose default action ends the process: a tenant
    /// reopening a file it reaches in a loop could end the daemon. So the first lease makes this
    /// process ignore SIGIO, unless something in it handles SIGIO already (the break is then
    /// its handler's to take; nothing of vramd's does).
    pub fn try_write_lease(fd: &OwnedFd) -> std::io::Result<bool> {
        static IGNORE_BREAKS: std::sync::Once = std::sync::Once::new();
        IGNORE_BREAKS.call_once(ignore_sigio_unless_handled);
        // SAFETY: `fd` is an open descriptor borrowed for the call; F_SETLEASE takes an integer
        // argument and touches no memory of ours.
        let taken = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETLEASE, libc::F_WRLCK) };
        if taken == -1 {
            let e = std::io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::EAGAIN) => Ok(false),
                _ => Err(e),
            };
        }
        // Held for no longer than this: another open of the file meanwhile would have to break
        // it, and nothing else of the daemon's opens a handle it is asking about.
        // SAFETY: as above.
        let released = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETLEASE, libc::F_UNLCK) };
        if released == -1 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(true)
    }

    /// Sets SIGIO's disposition to ignore where it is the default (ending the process).
    fn ignore_sigio_unless_handled() {
        // SAFETY: an all-zero `sigaction` is a valid value of the plain C struct; it is only
        // written by the call below.
        let mut current: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: a null new action only reads SIGIO's disposition into `current`, which lives
        // for the call.
        let read = unsafe { libc::sigaction(libc::SIGIO, std::ptr::null(), &mut current) };
        if read != 0 || current.sa_sigaction != libc::SIG_DFL {
            return;
        }
        // SAFETY: SIG_IGN installs no handler, so no code of ours runs in a signal's context;
        // a disposition is process-wide, which is meant (every thread may hold a lease).
        unsafe { libc::signal(libc::SIGIO, libc::SIG_IGN) };
    }
}

fn prot(access: Access) -> ProtFlags {
    match access {
        Access::ReadWrite => ProtFlags::READ | ProtFlags::WRITE,
        Access::ReadOnly => ProtFlags::READ,
    }
}

impl Device for HostDevice {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn used(&self) -> Bytes {
        self.usage.get()
    }

    fn create(&self, size: Bytes) -> Result<Handle> {
        check_size("handle size", size, self.granularity())?;
        self.usage.charge(size, self.info.capacity, || {
            let fd = rustix::fs::memfd_create(
                "vramd-handle",
                MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
            )
            .map_err(|e| DeviceError::os("memfd_create", e))?;
            rustix::fs::ftruncate(&fd, size.get()).map_err(|e| DeviceError::os("ftruncate", e))?;
            rustix::fs::fcntl_add_seals(&fd, SEALS)
                .map_err(|e| DeviceError::os("fcntl(F_ADD_SEALS)", e))?;
            // The file `memfd_create` opened is not counted among the file's writers; an open
            // through /proc is, which the lease test in `reached_elsewhere` relies on.
            Ok(RawHandle::Host(Memfd(reopen(&fd, OFlags::RDWR)?)))
        })
    }

    fn seal_writes(&self, handle: &Handle) -> Result<()> {
        rustix::fs::fcntl_add_seals(self.memfd(handle)?, SealFlags::FUTURE_WRITE)
            .map_err(|e| DeviceError::os("fcntl(F_ADD_SEALS, F_SEAL_FUTURE_WRITE)", e))
    }

    fn export(&self, handle: &Handle) -> Result<OwnedFd> {
        reopen(self.memfd(handle)?, OFlags::RDWR)
    }

    fn export_read_only(&self, handle: &Handle) -> Result<OwnedFd> {
        reopen(self.memfd(handle)?, OFlags::RDONLY)
    }

    fn reached_elsewhere(&self, handle: &Handle) -> Option<bool> {
        let fd = self.memfd(handle).ok()?;
        match lease::try_write_lease(fd) {
            Ok(true) => Some(false),
            Ok(false) => Some(true),
            // Leases turned off (`fs.leases-enable = 0`) or not allowed to this process.
            Err(_) => None,
        }
    }

    fn import(&self, fd: OwnedFd, size: Bytes) -> Result<Handle> {
        check_size("handle size", size, self.granularity())?;
        let bad = |reason: String| DeviceError::BadImport {
            expected: size,
            reason,
        };
        let stat = rustix::fs::fstat(&fd).map_err(|e| bad(format!("fstat: {e}")))?;
        if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
            return Err(bad("not a regular file".to_owned()));
        }
        let seals =
            rustix::fs::fcntl_get_seals(&fd).map_err(|e| bad(format!("not a memfd: {e}")))?;
        if !seals.contains(SealFlags::SHRINK) {
            return Err(bad("memfd is not sealed against shrinking".to_owned()));
        }
        let actual = Bytes(stat.st_size as u64);
        if actual != size {
            return Err(bad(format!("its size is {actual}")));
        }
        Ok(Handle::imported(size, RawHandle::Host(Memfd(fd))))
    }

    fn reserve(&self, size: Bytes) -> Result<Reservation> {
        check_size("reservation size", size, self.granularity())?;
        // SAFETY: a null hint without MAP_FIXED lets the kernel pick unused addresses; nothing
        // existing is touched.
        let base = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                size.get() as usize,
                ProtFlags::empty(),
                MapFlags::PRIVATE | MapFlags::NORESERVE,
            )
        }
        .map_err(|e| DeviceError::os("mmap(PROT_NONE)", e))?;
        Ok(Reservation {
            base: base as usize,
            size,
            mappings: RwLock::default(),
            backing: Backing::Host,
        })
    }

    fn map(&self, res: &Reservation, offset: Bytes, handle: &Handle, access: Access) -> Result<()> {
        let fd = self.memfd(handle)?;
        let mut mappings =
            res.check_map(BackendKind::Host, offset, handle.size, self.granularity())?;
        // SAFETY: the range lies inside `res`, which this process reserved and still owns, and no
        // mapping is there (checked above under the write lock, which also keeps copies out), so
        // MAP_FIXED replaces only our own PROT_NONE placeholder. The memfd is sealed at exactly
        // `handle.size` bytes, so every mapped page is backed.
        unsafe {
            rustix::mm::mmap(
                res.addr(offset) as *mut c_void,
                handle.size.get() as usize,
                prot(access),
                MapFlags::SHARED | MapFlags::FIXED,
                fd.as_fd(),
                0,
            )
        }
        .map_err(|e| DeviceError::os("mmap(MAP_FIXED | MAP_SHARED)", e))?;
        mappings.insert(offset.get(), handle.size.get(), access)
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
        let flags = match access {
            Access::ReadWrite => MprotectFlags::READ | MprotectFlags::WRITE,
            Access::ReadOnly => MprotectFlags::READ,
        };
        // SAFETY: the range lies inside `res` and is entirely mapped by this device (checked
        // above); the write lock keeps copies out while the protection changes.
        unsafe { rustix::mm::mprotect(res.addr(offset) as *mut c_void, len.get() as usize, flags) }
            .map_err(|e| DeviceError::os("mprotect", e))?;
        mappings.set_access(&changed, access);
        Ok(())
    }

    fn unmap(&self, res: &Reservation, offset: Bytes, len: Bytes) -> Result<()> {
        self.check_aligned_range(res, offset, len)?;
        let mut mappings = res.mappings_mut();
        let removed = mappings.whole(offset.get(), len.get(), false)?;
        // SAFETY: the range lies inside `res`, which this process owns; MAP_FIXED puts a fresh
        // PROT_NONE placeholder over it, so it stays reserved. The write lock keeps copies out.
        unsafe {
            rustix::mm::mmap_anonymous(
                res.addr(offset) as *mut c_void,
                len.get() as usize,
                ProtFlags::empty(),
                MapFlags::PRIVATE | MapFlags::FIXED | MapFlags::NORESERVE,
            )
        }
        .map_err(|e| DeviceError::os("mmap(MAP_FIXED, PROT_NONE)", e))?;
        mappings.remove(&removed);
        Ok(())
    }
}

impl ByteAccess for HostDevice {
    fn write(&self, res: &Reservation, offset: Bytes, data: &[u8]) -> Result<()> {
        let addr = self.check_copy(res, offset, data.len())?;
        let mappings = res.mappings();
        mappings.check_covered(offset.get(), data.len() as u64, true)?;
        // SAFETY: the destination lies inside `res` and is mapped read-write (checked above), and
        // the read lock keeps it mapped during the copy. Other processes may read or write it at
        // the same time; the copy is volatile, so nothing is assumed of its contents, and what
        // they see when is the callers' protocol (bytes cannot be invalid).
        unsafe { volatile::copy_to(addr as *mut u8, data) };
        Ok(())
    }

    fn read(&self, res: &Reservation, offset: Bytes, out: &mut [u8]) -> Result<()> {
        let addr = self.check_copy(res, offset, out.len())?;
        let mappings = res.mappings();
        mappings.check_covered(offset.get(), out.len() as u64, false)?;
        // SAFETY: the source lies inside `res` and is mapped (checked above); the read lock keeps
        // it mapped during the copy, and `out` is a distinct Rust buffer of the same length. Other
        // processes may write the source meanwhile: the copy is volatile, and any bytes are valid.
        unsafe { volatile::copy_from(addr as *const u8, out) };
        Ok(())
    }

    fn fill(&self, res: &Reservation, offset: Bytes, len: Bytes, byte: u8) -> Result<()> {
        let addr = self.check_copy(res, offset, len.get() as usize)?;
        let mappings = res.mappings();
        mappings.check_covered(offset.get(), len.get(), true)?;
        // SAFETY: as in `write`: inside `res`, mapped read-write, kept mapped by the read lock,
        // written volatile since other processes share it.
        unsafe { volatile::fill(addr as *mut u8, len.get() as usize, byte) };
        Ok(())
    }
}

/// Gives a host reservation's whole range back to the OS, with everything mapped in it.
pub(crate) fn release_reservation(base: usize, size: Bytes) {
    // SAFETY: `base..base+size` is a range this process reserved with mmap and that the dropped
    // `Reservation` owned alone; nothing of this crate refers to it any more.
    if let Err(e) = unsafe { rustix::mm::munmap(base as *mut c_void, size.get() as usize) } {
        tracing::error!(base, %size, error = %e, "munmap of a reservation failed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: Bytes = DEFAULT_GRANULARITY;

    fn device(capacity: Bytes) -> HostDevice {
        HostDevice::new(capacity, G).unwrap()
    }

    fn mapped(dev: &HostDevice, size: Bytes, access: Access) -> (Handle, Reservation) {
        let h = dev.create(size).unwrap();
        let r = dev.reserve(size).unwrap();
        dev.map(&r, Bytes::ZERO, &h, access).unwrap();
        (h, r)
    }

    #[test]
    fn create_map_write_read() {
        let dev = device(Bytes::gib(1));
        let (_h, r) = mapped(&dev, Bytes::mib(4), Access::ReadWrite);
        let data: Vec<u8> = (0..=255).cycle().take(5000).collect();
        dev.write(&r, Bytes(G.get() - 100), &data).unwrap();
        let mut out = vec![0; data.len()];
        dev.read(&r, Bytes(G.get() - 100), &mut out).unwrap();
        assert_eq!(out, data);
        dev.fill(&r, Bytes(10), Bytes(3), 0xAB).unwrap();
        let mut out = [0; 5];
        dev.read(&r, Bytes(9), &mut out).unwrap();
        assert_eq!(out, [0, 0xAB, 0xAB, 0xAB, 0]);
    }

    #[test]
    fn memory_sealed_against_writes_refuses_every_new_writer() {
        use std::io::Write;
        use std::os::fd::AsRawFd;
        let dev = device(Bytes::gib(1));
        let (h, before) = mapped(&dev, G, Access::ReadWrite);
        dev.write(&before, Bytes::ZERO, b"published").unwrap();
        dev.seal_writes(&h).unwrap();
        // A descriptor reopened for writing through /proc, as a reader holding a read-only one
        // could: neither a write nor a writable mapping gets through.
        let fd = dev.export(&h).unwrap();
        let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let e = f.write_all(b"rewritten").unwrap_err();
        assert_eq!(
            e.raw_os_error(),
            Some(rustix::io::Errno::PERM.raw_os_error()),
            "{e}"
        );
        let reopened = dev.import(OwnedFd::from(f), G).unwrap();
        let r = dev.reserve(G).unwrap();
        assert!(dev
            .map(&r, Bytes::ZERO, &reopened, Access::ReadWrite)
            .is_err());
        dev.map(&r, Bytes::ZERO, &reopened, Access::ReadOnly)
            .unwrap();
        let mut out = [0; 9];
        dev.read(&r, Bytes::ZERO, &mut out).unwrap();
        assert_eq!(&out, b"published");
        // A mapping made before the seal is the writer's own and stays as it was.
        dev.write(&before, Bytes::ZERO, b"P").unwrap();
    }

    #[test]
    fn a_handle_is_reached_elsewhere_while_any_export_or_mapping_of_one_lives() {
        let dev = device(Bytes::gib(1));
        let h = dev.create(G).unwrap();
        assert_eq!(dev.reached_elsewhere(&h), Some(false));
        let fd = dev.export(&h).unwrap();
        assert_eq!(dev.reached_elsewhere(&h), Some(true), "an export held");
        // What an importer does: the descriptor, then a mapping of it that outlives it.
        let client = HostDevice::for_client(G).unwrap();
        let imported = client.import(fd, G).unwrap();
        let r = client.reserve(G).unwrap();
        client
            .map(&r, Bytes::ZERO, &imported, Access::ReadWrite)
            .unwrap();
        drop(imported);
        assert_eq!(dev.reached_elsewhere(&h), Some(true), "a mapping left");
        client.unmap(&r, Bytes::ZERO, G).unwrap();
        assert_eq!(dev.reached_elsewhere(&h), Some(false), "all gone");
        // A reader's read-only export counts too.
        let ro = dev.export_read_only(&h).unwrap();
        assert_eq!(dev.reached_elsewhere(&h), Some(true), "a read-only open");
        drop(ro);
        assert_eq!(dev.reached_elsewhere(&h), Some(false));
    }

    /// Asking whether a handle is reached takes a lease, which another open breaks: the kernel
    /// signals the break to the lease holder (SIGIO, whose default action ends the process). A
    /// tenant that keeps an `O_PATH` reference (which takes no open, so the lease is granted)
    /// and reopens it in a loop must not end the daemon.
    #[test]
    fn a_lease_broken_by_another_open_does_not_end_the_process() {
        use std::os::fd::AsRawFd;
        use std::sync::atomic::{AtomicBool, Ordering};
        let dev = device(Bytes::gib(1));
        let h = dev.create(G).unwrap();
        let fd = dev.export(&h).unwrap();
        let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
        let kept = rustix::fs::open(
            &path,
            OFlags::PATH | OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .unwrap();
        drop(fd);
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let spinner = {
            let stop = stop.clone();
            let path = format!("/proc/self/fd/{}", kept.as_raw_fd());
            std::thread::spawn(move || {
                let flags = OFlags::RDONLY | OFlags::NONBLOCK | OFlags::CLOEXEC;
                while !stop.load(Ordering::Relaxed) {
                    drop(rustix::fs::open(&path, flags, rustix::fs::Mode::empty()));
                }
            })
        };
        let (mut granted, mut refused) = (0, 0);
        let start = std::time::Instant::now();
        while start.elapsed() < std::time::Duration::from_secs(1) {
            match dev.reached_elsewhere(&h) {
                Some(false) => granted += 1,
                _ => refused += 1,
            }
        }
        eprintln!("{granted} leases granted, {refused} refused");
        stop.store(true, Ordering::Relaxed);
        spinner.join().unwrap();
        assert!(granted > 0, "no lease was ever granted");
    }

    #[test]
    fn two_mappings_of_one_handle_share_bytes() {
        let dev = device(Bytes::gib(1));
        let (h, a) = mapped(&dev, G, Access::ReadWrite);
        let imported = dev.import(dev.export(&h).unwrap(), G).unwrap();
        drop(h);
        let b = dev.reserve(Bytes(2 * G.get())).unwrap();
        dev.map(&b, G, &imported, Access::ReadOnly).unwrap();
        drop(imported);
        dev.write(&a, Bytes(7), b"shared").unwrap();
        let mut out = [0; 6];
        dev.read(&b, Bytes(G.get() + 7), &mut out).unwrap();
        assert_eq!(&out, b"shared");
    }

    #[test]
    fn a_read_only_export_cannot_be_mapped_writable() {
        let dev = device(Bytes::gib(1));
        let (h, w) = mapped(&dev, G, Access::ReadWrite);
        dev.write(&w, Bytes(3), b"weights").unwrap();
        let reader = dev.import(dev.export_read_only(&h).unwrap(), G).unwrap();
        let r = dev.reserve(G).unwrap();
        assert!(dev
            .map(&r, Bytes::ZERO, &reader, Access::ReadWrite)
            .is_err());
        dev.map(&r, Bytes::ZERO, &reader, Access::ReadOnly).unwrap();
        let mut out = [0; 7];
        dev.read(&r, Bytes(3), &mut out).unwrap();
        assert_eq!(&out, b"weights");
    }

    #[test]
    fn words_written_whole_by_another_mapping_are_read_whole() {
        // A writer stores whole aligned words through one mapping while a reader copies them out
        // through another: each word read is one the writer wrote, never a mix of two.
        let dev = Arc::new(device(Bytes::gib(1)));
        let (h, w) = mapped(&dev, G, Access::ReadWrite);
        let imported = dev.import(dev.export(&h).unwrap(), G).unwrap();
        let r = dev.reserve(G).unwrap();
        dev.map(&r, Bytes::ZERO, &imported, Access::ReadOnly)
            .unwrap();
        const WORDS: usize = 64;
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = {
            let (dev, stop) = (dev.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut round = 0u8;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    round = round.wrapping_add(1);
                    let word = [u64::from_ne_bytes([round; 8]); WORDS];
                    let bytes: Vec<u8> = word.iter().flat_map(|v| v.to_ne_bytes()).collect();
                    dev.write(&w, Bytes::ZERO, &bytes).unwrap();
                }
            })
        };
        let mut out = vec![0u8; WORDS * 8];
        for _ in 0..20_000 {
            dev.read(&r, Bytes::ZERO, &mut out).unwrap();
            for chunk in out.chunks_exact(8) {
                let v = u64::from_ne_bytes(chunk.try_into().unwrap());
                assert_eq!(v, u64::from_ne_bytes([v as u8; 8]), "a torn word: {v:016x}");
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        writer.join().unwrap();
    }

    #[test]
    fn read_only_mapping_refuses_writes() {
        let dev = device(Bytes::gib(1));
        let (_h, r) = mapped(&dev, G, Access::ReadOnly);
        assert!(matches!(
            dev.write(&r, Bytes::ZERO, b"x"),
            Err(DeviceError::ReadOnly { .. })
        ));
        assert!(matches!(
            dev.fill(&r, Bytes::ZERO, Bytes(1), 1),
            Err(DeviceError::ReadOnly { .. })
        ));
        let mut out = [1; 4];
        dev.read(&r, Bytes::ZERO, &mut out).unwrap();
        assert_eq!(out, [0; 4]);
        dev.set_access(&r, Bytes::ZERO, G, Access::ReadWrite)
            .unwrap();
        dev.write(&r, Bytes::ZERO, b"x").unwrap();
    }

    #[test]
    fn capacity_is_enforced_and_released_on_drop() {
        let dev = device(Bytes::mib(6));
        let a = dev.create(Bytes::mib(4)).unwrap();
        let err = dev.create(Bytes::mib(4)).unwrap_err();
        assert!(matches!(
            err,
            DeviceError::OutOfMemory { asked, used, capacity }
                if asked == Bytes::mib(4) && used == Bytes::mib(4) && capacity == Bytes::mib(6)
        ));
        assert_eq!(
            err.to_string(),
            "device is out of memory: asked for 4 MiB, 4 MiB of 6 MiB in use"
        );
        let imported = dev.import(dev.export(&a).unwrap(), Bytes::mib(4)).unwrap();
        assert_eq!(dev.used(), Bytes::mib(4));
        drop(a);
        assert_eq!(dev.used(), Bytes::ZERO, "imports are not counted");
        let _b = dev.create(Bytes::mib(6)).unwrap();
        drop(imported);
        assert_eq!(dev.used(), Bytes::mib(6));
    }

    #[test]
    fn a_64_gib_handle_is_sparse() {
        let dev = device(Bytes(Bytes::TIB));
        let (_h, r) = mapped(&dev, Bytes::gib(64), Access::ReadWrite);
        let last = Bytes(Bytes::gib(64).get() - 8);
        dev.write(&r, last, b"the end!").unwrap();
        let mut out = [0; 8];
        dev.read(&r, last, &mut out).unwrap();
        assert_eq!(&out, b"the end!");
        assert_eq!(dev.used(), Bytes::gib(64));
    }

    #[test]
    fn import_checks_size_and_seals() {
        let dev = device(Bytes::gib(1));
        let h = dev.create(Bytes::mib(4)).unwrap();
        let err = dev
            .import(dev.export(&h).unwrap(), Bytes::mib(8))
            .unwrap_err();
        assert!(err.to_string().contains("its size is 4 MiB"), "{err}");

        let file = tempfile::tempfile().unwrap();
        file.set_len(G.get()).unwrap();
        let err = dev.import(file.into(), G).unwrap_err();
        assert!(matches!(err, DeviceError::BadImport { .. }), "{err}");

        let (socket, _peer) = std::os::unix::net::UnixStream::pair().unwrap();
        let err = dev.import(socket.into(), G).unwrap_err();
        assert!(err.to_string().contains("not a regular file"), "{err}");
    }

    #[test]
    fn bad_ranges_are_errors() {
        let dev = device(Bytes::gib(1));
        let h = dev.create(Bytes(2 * G.get())).unwrap();
        let r = dev.reserve(Bytes(4 * G.get())).unwrap();
        assert!(matches!(
            dev.create(Bytes(G.get() + 4096)),
            Err(DeviceError::Unaligned { .. })
        ));
        assert!(matches!(
            dev.create(Bytes::ZERO),
            Err(DeviceError::Empty { .. })
        ));
        assert!(matches!(
            dev.map(&r, Bytes(4096), &h, Access::ReadWrite),
            Err(DeviceError::Unaligned { .. })
        ));
        assert!(matches!(
            dev.map(&r, Bytes(3 * G.get()), &h, Access::ReadWrite),
            Err(DeviceError::HandleDoesNotFit { .. })
        ));
        assert!(matches!(
            dev.map(&r, Bytes(u64::MAX - G.get() + 1), &h, Access::ReadWrite),
            Err(DeviceError::HandleDoesNotFit { .. })
        ));
        dev.map(&r, G, &h, Access::ReadWrite).unwrap();
        assert!(matches!(
            dev.map(&r, Bytes::ZERO, &h, Access::ReadWrite),
            Err(DeviceError::AlreadyMapped { .. })
        ));
        assert!(matches!(
            dev.unmap(&r, G, G),
            Err(DeviceError::SplitsMapping { .. })
        ));
        assert!(matches!(
            dev.set_access(&r, Bytes::ZERO, Bytes(3 * G.get()), Access::ReadOnly),
            Err(DeviceError::NotMapped { .. })
        ));
        assert!(matches!(
            dev.write(&r, Bytes(G.get() - 1), b"ab"),
            Err(DeviceError::NotMapped { .. })
        ));
        assert!(matches!(
            dev.read(&r, Bytes(4 * G.get() - 1), &mut [0; 2]),
            Err(DeviceError::OutOfRange { .. })
        ));

        dev.unmap(&r, Bytes::ZERO, Bytes(4 * G.get())).unwrap();
        assert!(matches!(
            dev.read(&r, G, &mut [0; 1]),
            Err(DeviceError::NotMapped { .. })
        ));
        dev.map(&r, Bytes(2 * G.get()), &h, Access::ReadWrite)
            .unwrap();
        dev.fill(&r, Bytes(2 * G.get()), Bytes(2 * G.get()), 9)
            .unwrap();
    }

    #[test]
    fn granularity_must_be_whole_pages() {
        assert!(HostDevice::new(Bytes::gib(1), Bytes(1000)).is_err());
        assert!(HostDevice::new(Bytes::gib(1), Bytes::ZERO).is_err());
        let client = HostDevice::for_client(G).unwrap();
        assert!(matches!(
            client.create(G),
            Err(DeviceError::OutOfMemory { .. })
        ));
    }
}
