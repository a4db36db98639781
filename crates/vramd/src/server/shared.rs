//! Shared buffers in the daemon: the I/O around `vram_core::shared`. The books live in each slot,
//! under the slot's lock with the broker they charge; this module creates and exports each
//! version's memory, checksums it, passes fds, and wakes readers waiting for a newer version.
//!
//! The one exception to "the daemon never maps tenant memory": to checksum a version at publish,
//! to verify it on request and to scrub it, the daemon maps shared-buffer versions read-only and
//! checksums them (`ByteAccess::feed_checksum`: a kernel over device memory on cuda, through the
//! reader device's context; a copy to the host on the host backend). It never maps a tenant's
//! private grants.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use vram_core::broker::{Broker, TenantId};
use vram_core::shared::{
    BufferId, BufferInfo, BufferSpec, Checksummer, Freed, SharedBuffers, SharedError, Version,
};
use vram_core::Bytes;
use vram_device::{Access, ByteAccess, Device, DeviceError, Handle};
use vram_proto::{
    ErrorCode, ErrorReply, LeaseOp, Reply, ScrubStatus, SharedBufferStatus, SharedReply,
    SharedRequest, SharedStatus,
};

use super::peer::Peer;
use super::Daemon;
use crate::config::SharedConfig;

/// One version's memory: the daemon's handle, its export, and the fd readers get. When the last
/// reference goes, the daemon's own descriptors close first; if a process still reaches the
/// memory then (a reader that kept its descriptor or mapping), the handle goes to the slot's
/// [`LetGo`] and stays booked to the buffer's owner, as kept, until it is really gone.
pub struct Memory {
    /// Always `Some` until the memory is dropped.
    parts: Option<Parts>,
    /// The buffer's owner (name, uid), whom a version still reached after it is freed stays
    /// booked to.
    owner: (String, u32),
    let_go: Arc<LetGo>,
}

struct Parts {
    handle: Handle,
    fd: OwnedFd,
    /// `Device::export_read_only`: on the host backend the memfd opened read-only, so a reader
    /// cannot map it writable at all; on cuda an export (read-only access is set by the reader's
    /// mapping).
    reader_fd: OwnedFd,
}

impl Memory {
    pub(super) fn handle(&self) -> &Handle {
        &self.parts().handle
    }

    fn parts(&self) -> &Parts {
        self.parts.as_ref().expect("taken only by drop")
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        let Some(Parts {
            handle,
            fd,
            reader_fd,
        }) = self.parts.take()
        else {
            return;
        };
        // The daemon's own opens go first: whatever still reaches the memory is another process.
        drop((fd, reader_fd));
        if self.let_go.device.reached_elsewhere(&handle) == Some(true) {
            let (name, uid) = std::mem::take(&mut self.owner);
            let mut found = self.let_go.found.lock().unwrap_or_else(|p| p.into_inner());
            found.push((name, uid, handle));
        }
    }
}

/// Shared-buffer versions freed while some process still reached their memory, by the buffer's
/// owner (name, uid): the slot books them as kept ([`super::slot::Slot::book_let_go`]).
pub struct LetGo {
    device: Arc<dyn Device>,
    found: Mutex<Vec<(String, u32, Handle)>>,
}

impl LetGo {
    pub fn new(device: Arc<dyn Device>) -> LetGo {
        LetGo {
            device,
            found: Mutex::new(Vec::new()),
        }
    }

    /// What was found since the last call.
    pub fn take(&self) -> Vec<(String, u32, Handle)> {
        std::mem::take(&mut *self.found.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// A slot's shared-buffer books and the memory of every version they hold.
#[derive(Default)]
pub struct Books {
    pub core: SharedBuffers,
    pub(super) memory: HashMap<(BufferId, Version), Arc<Memory>>,
}

impl Books {
    /// Takes the memory of freed versions out (those a lease's expiry freed as well), to be
    /// dropped once the slot's lock is released.
    pub fn take(&mut self, freed: Vec<Freed>) -> Vec<Arc<Memory>> {
        let expired = self.core.take_expired();
        freed
            .into_iter()
            .chain(expired)
            .filter_map(|f| self.memory.remove(&(f.buffer, f.version)))
            .collect()
    }

    /// `tenant` is gone: its pins, lease, draft and owned buffers go. Call before the broker
    /// forgets it.
    pub fn disconnect(&mut self, broker: &mut Broker, tenant: TenantId) -> Vec<Arc<Memory>> {
        let freed = self.core.disconnect(broker, tenant);
        self.take(freed)
    }
}

/// Readers waiting for a newer version (`WaitNewer`), by device slot and buffer: a publish wakes
/// only the waits on its own buffer.
#[derive(Default)]
struct Waits {
    by_buffer: Mutex<HashMap<(usize, BufferId), Arc<Wait>>>,
}

/// The waits on one buffer: its publishes counted under the lock the waits sleep on, so that a
/// publish between a wait's look at the books and its sleep is not missed.
#[derive(Default)]
struct Wait {
    publishes: Mutex<u64>,
    wake: Condvar,
}

impl Waits {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(usize, BufferId), Arc<Wait>>> {
        self.by_buffer.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The waits on `key`'s buffer, which a wait joins before it looks at the books and leaves
    /// when the guard drops (the last one takes the buffer's entry away).
    fn join(&self, key: (usize, BufferId)) -> Joined<'_> {
        let wait = Arc::clone(self.lock().entry(key).or_default());
        Joined {
            waits: self,
            key,
            wait,
        }
    }

    /// A version of `key`'s buffer was published: its waits wake, no other. The registry's lock
    /// is held throughout (before a `Wait`'s, the one order both are taken in), so the only
    /// references to a `Wait` are the registry's and its joined waits'.
    fn published(&self, key: (usize, BufferId)) {
        if let Some(wait) = self.lock().get(&key) {
            *wait.publishes.lock().unwrap_or_else(|p| p.into_inner()) += 1;
            wait.wake.notify_all();
        }
    }

    fn wake_all(&self) {
        for wait in self.lock().values() {
            let _guard = wait.publishes.lock().unwrap_or_else(|p| p.into_inner());
            wait.wake.notify_all();
        }
    }
}

/// One wait's place among the waits on its buffer (see [`Waits::join`]).
struct Joined<'a> {
    waits: &'a Waits,
    key: (usize, BufferId),
    wait: Arc<Wait>,
}

impl std::ops::Deref for Joined<'_> {
    type Target = Wait;
    fn deref(&self) -> &Wait {
        &self.wait
    }
}

impl Drop for Joined<'_> {
    fn drop(&mut self) {
        let mut by_buffer = self.waits.lock();
        // This wait's reference and the registry's: it is the last.
        if Arc::strong_count(&self.wait) == 2 {
            by_buffer.remove(&self.key);
        }
    }
}

/// Daemon-wide shared-buffer state: settings, counters, and the wake-up for waiting readers.
pub struct SharedServer {
    epoch: Instant,
    scrub_rate: AtomicU64,
    max_lease_ms: AtomicU64,
    /// Readers waiting for a newer version, by buffer.
    waits: Waits,
    publishes: AtomicU64,
    publish_bytes: AtomicU64,
    conflicts: AtomicU64,
    pub(super) scrub: ScrubCounters,
}

#[derive(Default)]
pub(super) struct ScrubCounters {
    pub passes: AtomicU64,
    pub bytes: AtomicU64,
    pub versions: AtomicU64,
    pub mismatches: AtomicU64,
}

impl Default for SharedServer {
    fn default() -> Self {
        let cfg = SharedConfig::default();
        SharedServer {
            epoch: Instant::now(),
            scrub_rate: AtomicU64::new(cfg.scrub_rate.get()),
            max_lease_ms: AtomicU64::new(cfg.max_lease_ms),
            waits: Waits::default(),
            publishes: AtomicU64::new(0),
            publish_bytes: AtomicU64::new(0),
            conflicts: AtomicU64::new(0),
            scrub: ScrubCounters::default(),
        }
    }
}

impl SharedServer {
    /// The books' clock: milliseconds since the daemon started.
    pub(super) fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    pub(super) fn scrub_rate(&self) -> u64 {
        self.scrub_rate.load(Ordering::Relaxed)
    }

    /// Wakes every wait for a newer version without a publish, so that waits of a connection
    /// that ended see it at once.
    pub(super) fn wake_waiters(&self) {
        self.waits.wake_all();
    }

    /// Puts the `[shared]` settings (scrub rate, longest lease) in force; what changed.
    pub(super) fn apply(&self, cfg: &SharedConfig) -> Vec<String> {
        let mut changes = Vec::new();
        let rate = self
            .scrub_rate
            .swap(cfg.scrub_rate.get(), Ordering::Relaxed);
        if rate != cfg.scrub_rate.get() {
            changes.push(format!(
                "[shared] scrub_rate {}/s → {}/s",
                Bytes(rate),
                cfg.scrub_rate
            ));
        }
        let lease = self.max_lease_ms.swap(cfg.max_lease_ms, Ordering::Relaxed);
        if lease != cfg.max_lease_ms {
            changes.push(format!(
                "[shared] max_lease_ms {lease} → {}",
                cfg.max_lease_ms
            ));
        }
        changes
    }
}

impl super::Server {
    /// Applies the `[shared]` settings (scrub rate, longest lease).
    pub fn configure_shared(&self, cfg: &SharedConfig) {
        self.daemon.shared.apply(cfg);
    }
}

/// The most access-list entries a status report copies, over every buffer of a device: more
/// than one reply frame carries (`fit` cuts the report to one), and a bound on the copy made
/// under the device's lock whatever the number of buffers and lists.
pub const STATUS_ACL_ENTRIES: usize = 16 * 1024;

/// The shared-buffer section of the status report, with at most `acl_entries` access-list
/// entries per device (the rest counted as left out).
pub fn status(daemon: &Daemon, acl_entries: usize) -> SharedStatus {
    let s = &daemon.shared;
    let buffers = daemon
        .slots
        .iter()
        .enumerate()
        .flat_map(|(gpu, slot)| {
            slot.with_shared(|_, books| books.core.all_capped(acl_entries))
                .into_iter()
                .map(move |(info, acl_left_out)| SharedBufferStatus {
                    gpu: gpu as u32,
                    info,
                    acl_left_out,
                })
        })
        .collect();
    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
    SharedStatus {
        buffers,
        scrub: ScrubStatus {
            rate: s.scrub_rate(),
            passes: load(&s.scrub.passes),
            bytes: load(&s.scrub.bytes),
            versions: load(&s.scrub.versions),
            mismatches: load(&s.scrub.mismatches),
        },
        publishes: load(&s.publishes),
        publish_bytes: load(&s.publish_bytes),
        conflicts: load(&s.conflicts),
        leases_expired: daemon
            .slots
            .iter()
            .map(|slot| slot.with_shared(|_, books| books.core.totals().leases_expired))
            .sum(),
        buffers_left_out: 0,
    }
}

/// Serves one shared-buffer request; `false` if the connection is gone.
pub fn serve(
    daemon: &Arc<Daemon>,
    peer: &Arc<Peer>,
    who: Result<(usize, TenantId), ErrorReply>,
    id: u64,
    request: SharedRequest,
) -> bool {
    let conn = &peer.conn;
    let (slot, tenant) = match who {
        Ok(w) => w,
        Err(e) => return conn.send(id, &Reply::Error(e), &[]).is_ok(),
    };
    // Waits and reads of a whole version run on their own thread, so the connection's other
    // requests (the writer's lease renewals) go on meanwhile; at most `[connections] max_waits`
    // of them per connection, and waits end with their connection.
    let slow = matches!(
        request,
        SharedRequest::WaitNewer { .. }
            | SharedRequest::Publish { .. }
            | SharedRequest::Verify { .. }
    );
    if !slow {
        return answer(daemon, peer, slot, tenant, id, request);
    }
    let max = daemon.settings().connections.max_waits;
    let Some(place) = peer.slow_slot(max) else {
        let e = ErrorReply {
            code: ErrorCode::BadRequest,
            reason: Some("too_many_waits".into()),
            message: format!(
                "this connection already has {max} shared-buffer waits, publishes or verifies in \
                 progress, at most {max} at a time ([connections] max_waits); wait for one to end"
            ),
        };
        return conn.send(id, &Reply::Error(e), &[]).is_ok();
    };
    let (daemon, peer) = (daemon.clone(), peer.clone());
    let spawned = std::thread::Builder::new()
        .name("vramd-shared".into())
        .spawn(move || {
            answer(&daemon, &peer, slot, tenant, id, request);
            drop(place);
        });
    match spawned {
        Ok(_) => true,
        Err(e) => {
            let e = device_error(format!("cannot start a thread for this request: {e}"));
            conn.send(id, &Reply::Error(e), &[]).is_ok()
        }
    }
}

fn answer(
    daemon: &Arc<Daemon>,
    peer: &Peer,
    slot: usize,
    tenant: TenantId,
    id: u64,
    request: SharedRequest,
) -> bool {
    let answered = match request {
        SharedRequest::WaitNewer {
            buffer,
            than,
            timeout_ms,
        } => {
            let timeout = Duration::from_millis(u64::from(timeout_ms));
            wait_newer(daemon, peer, slot, tenant, buffer, than, timeout).map(|r| (r, None))
        }
        request => Op {
            daemon,
            peer,
            slot,
            tenant,
        }
        .run(request)
        .map(|(r, fd)| (Reply::Shared(r), fd)),
    };
    match answered {
        Ok((reply, fd)) => {
            let fds: Vec<_> = fd.iter().map(|m| m.as_fd()).collect();
            peer.reply(id, &reply, &fds).is_ok()
        }
        Err(e) => peer.reply(id, &Reply::Error(e), &[]).is_ok(),
    }
}

/// The fd to send with a reply: a version's export or its read-only reopening.
enum FdOf {
    Writer(Arc<Memory>),
    Reader(Arc<Memory>),
}

impl FdOf {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        match self {
            FdOf::Writer(m) => m.parts().fd.as_fd(),
            FdOf::Reader(m) => m.parts().reader_fd.as_fd(),
        }
    }
}

struct Op<'a> {
    daemon: &'a Arc<Daemon>,
    /// The asking connection: a read of a whole version stops once it is closed.
    peer: &'a Peer,
    slot: usize,
    tenant: TenantId,
}

/// A whole version is read for its checksum on the host backend in pieces of this size, so that
/// the read stops soon after its connection closes instead of reading on for nobody (at a few
/// GiB/s a large version takes seconds). On a GPU the kernel reads a whole version in about a
/// millisecond, and each piece would cost a synchronisation: it is read in one.
const HOST_READ_PIECE: u64 = 64 << 20;

impl Op<'_> {
    /// The piece a version is read in for its checksum (see [`HOST_READ_PIECE`]).
    fn read_piece(&self) -> u64 {
        match self.daemon.slots[self.slot].device().info().kind {
            vram_device::BackendKind::Host => HOST_READ_PIECE,
            vram_device::BackendKind::Cuda => u64::MAX,
        }
    }
}

type Answer = Result<(SharedReply, Option<FdOf>), ErrorReply>;

/// The encoded bytes of buffer descriptions one `List` reply carries at most: half a message, so
/// the reply's framing always fits beside them.
const LIST_PAGE_BYTES: usize = vram_proto::MAX_PAYLOAD / 2;

/// The first buffers of `infos` whose encoded size stays within [`LIST_PAGE_BYTES`] (at least
/// one), and the id after which the next page starts when any are left.
fn list_page(infos: impl Iterator<Item = BufferInfo>) -> (Vec<BufferInfo>, Option<BufferId>) {
    let mut page: Vec<BufferInfo> = Vec::new();
    let mut bytes = 0;
    for info in infos {
        let len = vram_proto::payload_len(0, &info).unwrap_or(LIST_PAGE_BYTES);
        if let Some(last) = page.last().filter(|_| bytes + len > LIST_PAGE_BYTES) {
            let next = last.id;
            return (page, Some(next));
        }
        bytes += len;
        page.push(info);
    }
    (page, None)
}

impl Op<'_> {
    fn shared(&self) -> &SharedServer {
        &self.daemon.shared
    }

    /// Runs `f` on the books; the memory of versions it frees is released after the lock.
    fn books<R>(
        &self,
        f: impl FnOnce(&mut Broker, &mut SharedBuffers, u64) -> Result<(R, Vec<Freed>), SharedError>,
    ) -> Result<R, ErrorReply> {
        let now = self.shared().now_ms();
        let result = self.daemon.slots[self.slot].with_shared_freeing(|broker, books| {
            match f(broker, &mut books.core, now) {
                Ok((r, freed)) => (Ok(r), books.take(freed)),
                // A lease found expired on the way may have freed a draft all the same.
                Err(e) => (Err(e), books.take(Vec::new())),
            }
        });
        self.daemon.slots[self.slot].book_let_go();
        result.map_err(|e| self.refused(e))
    }

    fn refused(&self, e: SharedError) -> ErrorReply {
        if e.is_conflict() {
            self.shared().conflicts.fetch_add(1, Ordering::Relaxed);
        }
        shared_error(&e)
    }

    fn run(&self, request: SharedRequest) -> Answer {
        let t = self.tenant;
        let plain = |r: SharedReply| Ok((r, None));
        match request {
            SharedRequest::Create { name, size, acl } => {
                let granularity = self.daemon.slots[self.slot].device().info().granularity;
                let Some(size) = size.round_up(granularity) else {
                    return Err(ErrorReply {
                        code: ErrorCode::BadRequest,
                        reason: Some("bad_size".into()),
                        message: format!(
                            "shared buffer `{name}`: {size} is more bytes than any device has"
                        ),
                    });
                };
                let spec = BufferSpec { name, size, acl };
                let info = self.books(|b, c, _| Ok((c.create(b, t, spec)?, Vec::new())))?;
                tracing::info!(buffer = info.name, owner = info.owner, size = %info.size, "shared buffer created");
                plain(SharedReply::Buffer(Box::new(info)))
            }
            SharedRequest::Open { name } => plain(SharedReply::Buffer(Box::new(
                self.books(|b, c, now| c.open(b, t, &name, now))?,
            ))),
            SharedRequest::List { after } => {
                let (buffers, next) =
                    self.books(|b, c, _| Ok((list_page(c.list(b, t, after)), Vec::new())))?;
                plain(SharedReply::Buffers { buffers, next })
            }
            SharedRequest::Delete { buffer } => {
                self.books(|b, c, _| Ok(((), c.delete(b, t, buffer)?)))?;
                plain(SharedReply::Done)
            }
            SharedRequest::Lease { buffer, op, ttl_ms } => {
                let max = self.shared().max_lease_ms.load(Ordering::Relaxed);
                let least = crate::config::MIN_LEASE_MS;
                let ttl = u64::from(ttl_ms).clamp(least, max.max(least));
                let until = self.books(|b, c, now| match op {
                    LeaseOp::Acquire => c
                        .acquire(b, t, buffer, ttl, now)
                        .map(|(l, f)| (l.expires_ms - now, f)),
                    LeaseOp::Renew => c
                        .renew(b, t, buffer, ttl, now)
                        .map(|(l, f)| (l.expires_ms - now, f)),
                    LeaseOp::Release => Ok((0, c.release_lease(b, t, buffer, now)?)),
                })?;
                plain(SharedReply::Lease { ttl_ms: until })
            }
            SharedRequest::BeginWrite { buffer, base } => self.begin_write(buffer, base),
            SharedRequest::Publish {
                buffer,
                version,
                checksum,
            } => self.publish(buffer, version, checksum),
            SharedRequest::Pin { buffer } => {
                let (version, checksum, memory) = self
                    .books(|b, c, _| {
                        let (v, sum) = c.pin(b, t, buffer)?;
                        Ok(((v, sum), Vec::new()))
                    })
                    .and_then(|(v, sum)| Ok((v, sum, self.memory(buffer, v)?)))?;
                let size = memory.handle().size();
                Ok((
                    SharedReply::Pinned {
                        version,
                        size,
                        checksum,
                    },
                    Some(FdOf::Reader(memory)),
                ))
            }
            SharedRequest::Unpin { buffer, version } => {
                self.books(|b, c, _| Ok(((), c.unpin(b, t, buffer, version)?)))?;
                plain(SharedReply::Done)
            }
            SharedRequest::Verify { buffer, version } => self.verify(buffer, version),
            SharedRequest::WaitNewer { .. } => unreachable!("answered by wait_newer"),
        }
    }

    fn memory(&self, buffer: BufferId, version: Version) -> Result<Arc<Memory>, ErrorReply> {
        self.daemon.slots[self.slot]
            .with_shared(|_, books| books.memory.get(&(buffer, version)).cloned())
            .ok_or_else(|| {
                shared_error(&SharedError::NoSuchVersion {
                    buffer: format!("#{}", buffer.0),
                    version,
                })
            })
    }

    fn begin_write(&self, buffer: BufferId, base: Option<Version>) -> Answer {
        let t = self.tenant;
        let version = self.books(|b, c, now| c.begin_write(b, t, buffer, base, now))?;
        let slot = &self.daemon.slots[self.slot];
        let made = slot
            .with_shared(|broker, books| {
                let size = books.core.info(buffer)?.size;
                let owner = broker.tenant(books.core.owner(buffer)?)?;
                Some((size, (owner.name.clone(), owner.uid)))
            })
            .ok_or_else(|| device_error(format!("buffer #{} vanished", buffer.0)))
            .and_then(|(size, owner)| {
                // Never recycled memory: readers will see every byte of it.
                let ready = slot
                    .pool()
                    .take(super::pool::FRESH_ONLY, size)
                    .map_err(|e| {
                        device_error(format!("the device could not create {size}: {e}"))
                    })?;
                let reader_fd = slot
                    .device()
                    .export_read_only(&ready.handle)
                    .map_err(|e| device_error(format!("cannot export {size} read-only: {e}")))?;
                Ok(Arc::new(Memory {
                    parts: Some(Parts {
                        handle: ready.handle,
                        fd: ready.fd,
                        reader_fd,
                    }),
                    owner,
                    let_go: slot.let_go().clone(),
                }))
            });
        let memory = match made {
            Ok(m) => m,
            Err(e) => {
                self.books(|b, c, _| Ok(((), c.discard_draft(b, t, buffer, version))))?;
                return Err(e);
            }
        };
        let size = memory.handle().size();
        let kept = slot.with_shared(|_, books| {
            let held = books.core.holds(buffer, version);
            if held {
                books.memory.insert((buffer, version), memory.clone());
            }
            held
        });
        if !kept {
            return Err(shared_error(&SharedError::NoSuchVersion {
                buffer: format!("#{}", buffer.0),
                version,
            }));
        }
        Ok((
            SharedReply::Draft { version, size },
            Some(FdOf::Writer(memory)),
        ))
    }

    fn publish(&self, buffer: BufferId, version: Version, given: Option<u64>) -> Answer {
        let t = self.tenant;
        let started = Instant::now();
        let size =
            self.books(|b, c, now| Ok((c.check_draft(b, t, buffer, version, now)?, Vec::new())))?;
        let memory = self.memory(buffer, version)?;
        // From here on nobody gains write access to the version, whatever descriptor it holds.
        self.daemon.slots[self.slot]
            .device()
            .seal_writes(memory.handle())
            .map_err(|e| {
                device_error(format!("cannot seal version {version} against writes: {e}"))
            })?;
        let device = self.daemon.slots[self.slot]
            .reader()
            .map_err(|e| device_error(format!("cannot read shared memory: {e}")))?;
        let checksum = checksum_memory(device.as_ref(), memory.handle(), self.read_piece(), |_| {
            self.still_wanted(buffer, version)
        })
        .map_err(|e| device_error(format!("cannot read version {version} to checksum it: {e}")))?
        .ok_or_else(|| self.stopped(buffer, version))?;
        if let Some(given) = given.filter(|g| *g != checksum) {
            return Err(ErrorReply {
                code: ErrorCode::BadRequest,
                reason: Some("checksum_mismatch".into()),
                message: format!(
                    "version {version}: the writer's checksum {given:016x} does not match the daemon's \
                     {checksum:016x}: the memory differs from what the writer meant to publish"
                ),
            });
        }
        self.books(|b, c, now| Ok(((), c.publish(b, t, buffer, version, checksum, now)?)))?;
        let s = self.shared();
        s.publishes.fetch_add(1, Ordering::Relaxed);
        s.publish_bytes.fetch_add(size.get(), Ordering::Relaxed);
        s.waits.published((self.slot, buffer));
        tracing::debug!(buffer = buffer.0, %version, checksum = format!("{checksum:016x}"),
            micros = started.elapsed().as_micros() as u64, "published");
        Ok((SharedReply::Published { version, checksum }, None))
    }

    /// Whether a read of `version` (to checksum it) goes on: its connection is open and the books
    /// still keep it. A version the books let go (a new draft in its place, its buffer deleted)
    /// counts as free memory there: the read lets go of it too, not only once it is done.
    fn still_wanted(&self, buffer: BufferId, version: Version) -> bool {
        !self.peer.is_closed() && self.daemon.slots[self.slot].keeps_version(buffer, version)
    }

    /// The answer to a read of `version` that [`Self::still_wanted`] stopped.
    fn stopped(&self, buffer: BufferId, version: Version) -> ErrorReply {
        if self.peer.is_closed() {
            return gone(version);
        }
        shared_error(&SharedError::NoSuchVersion {
            buffer: format!("#{}", buffer.0),
            version,
        })
    }

    fn verify(&self, buffer: BufferId, version: Version) -> Answer {
        let t = self.tenant;
        let expected = self.books(|b, c, _| {
            c.may_read(b, t, buffer)?;
            Ok((c.checksum_of(buffer, version)?, Vec::new()))
        })?;
        let memory = self.memory(buffer, version)?;
        let device = self.daemon.slots[self.slot]
            .reader()
            .map_err(|e| device_error(format!("cannot read shared memory: {e}")))?;
        let actual = checksum_memory(device.as_ref(), memory.handle(), self.read_piece(), |_| {
            self.still_wanted(buffer, version)
        })
        .map_err(|e| device_error(format!("cannot read version {version}: {e}")))?
        .ok_or_else(|| self.stopped(buffer, version))?;
        if actual != expected {
            report_mismatch(
                self.daemon,
                self.slot,
                buffer,
                version,
                expected,
                actual,
                "verify",
            );
        }
        Ok((
            SharedReply::Verified {
                version,
                expected,
                actual,
            },
            None,
        ))
    }
}

/// Waits until `buffer` has a version newer than `than`, `timeout` passes, the daemon shuts down
/// or `peer`'s connection ends.
fn wait_newer(
    daemon: &Daemon,
    peer: &Peer,
    slot: usize,
    tenant: TenantId,
    buffer: BufferId,
    than: Option<Version>,
    timeout: Duration,
) -> Result<Reply, ErrorReply> {
    let deadline = Instant::now() + timeout;
    let wait = daemon.shared.waits.join((slot, buffer));
    let mut generation = wait.publishes.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        let current = daemon.slots[slot]
            .with_shared(|b, books| {
                books.core.may_read(b, tenant, buffer)?;
                Ok(books.core.current(buffer))
            })
            .map_err(|e| shared_error(&e))?;
        if current.is_some() && current > than {
            return Ok(Reply::Shared(SharedReply::Newer(current)));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || daemon.shutting_down.load(Ordering::Acquire) || peer.is_closed() {
            return Ok(Reply::Shared(SharedReply::Newer(None)));
        }
        // Publishes bump the counter under this lock, so none is missed between check and wait.
        let seen = *generation;
        while *generation == seen && !deadline.saturating_duration_since(Instant::now()).is_zero() {
            let left = deadline.saturating_duration_since(Instant::now());
            generation = wait
                .wake
                .wait_timeout(generation, left.min(Duration::from_millis(500)))
                .unwrap_or_else(|p| p.into_inner())
                .0;
            if daemon.shutting_down.load(Ordering::Acquire) || peer.is_closed() {
                break;
            }
        }
    }
}

/// Maps a handle read-only in the daemon's own range and checksums it in pieces of `piece` bytes
/// (`ByteAccess::feed_checksum`: a kernel on the GPU for the cuda backend, a copy to the host on
/// the host backend). `pace` is told the bytes done after each piece and may stop (`false`:
/// `Ok(None)`).
pub fn checksum_memory(
    device: &dyn ByteAccess,
    handle: &Handle,
    piece: u64,
    mut pace: impl FnMut(u64) -> bool,
) -> Result<Option<u64>, DeviceError> {
    let size = handle.size();
    let res = device.reserve(size)?;
    device.map(&res, Bytes::ZERO, handle, Access::ReadOnly)?;
    let mut sum = Checksummer::new();
    let mut at = 0u64;
    while at < size.get() {
        let n = piece.max(1).min(size.get() - at);
        device.feed_checksum(&res, Bytes(at), Bytes(n), &mut sum)?;
        at += n;
        if !pace(n) {
            return Ok(None);
        }
    }
    Ok(Some(sum.finish()))
}

/// A mismatch: a counter, the version marked corrupt in the books, and the first time an event
/// and a message to the buffer's owner and the readers that pinned the version (the scrub finds
/// it again at every pass, and a reader may verify it in a loop: those count, unlogged).
pub(super) fn report_mismatch(
    daemon: &Daemon,
    slot: usize,
    buffer: BufferId,
    version: Version,
    expected: u64,
    actual: u64,
    by: &'static str,
) {
    let (name, tell) = daemon.slots[slot].with_shared(|_, books| {
        let tell = books.core.mark_corrupt(buffer, version);
        let name = books.core.info(buffer).map(|i| i.name).unwrap_or_default();
        (name, tell)
    });
    daemon
        .shared
        .scrub
        .mismatches
        .fetch_add(1, Ordering::Relaxed);
    // Found before (the owner is told the first time, so nobody to tell means not the first).
    if tell.is_empty() {
        return;
    }
    let message = vram_proto::Reply::Shared(SharedReply::Corrupted(vram_proto::Corruption {
        buffer,
        name: name.clone(),
        version,
        expected,
        actual,
        found_by: by.to_string(),
    }));
    let unread = daemon.settings().connections.unread_timeout();
    let peers: Vec<_> = {
        let conns = daemon.conns.lock().expect("conns");
        daemon.slots[slot]
            .conns_of_tenants(&tell)
            .into_iter()
            .filter_map(|c| conns.get(&c).cloned())
            .collect()
    };
    // Never waited for: a tenant that does not read misses the message, not the daemon its time.
    let told = peers
        .iter()
        .filter(|p| matches!(p.offer(&message, unread), super::peer::Offer::Sent))
        .count();
    tracing::error!(
        buffer = name,
        gpu = slot,
        version = version.0,
        expected = format!("{expected:016x}"),
        actual = format!("{actual:016x}"),
        by,
        told,
        "shared buffer corrupted: a published version no longer matches its checksum (its \
         owner and readers are told)"
    );
}

/// The answer to a read of `version` stopped because its connection closed (sent to nobody).
fn gone(version: Version) -> ErrorReply {
    ErrorReply {
        code: ErrorCode::Refused,
        reason: Some("connection_closed".into()),
        message: format!("the read of version {version} stopped: its connection closed"),
    }
}

fn device_error(message: String) -> ErrorReply {
    ErrorReply {
        code: ErrorCode::Device,
        reason: None,
        message,
    }
}

fn shared_error(e: &SharedError) -> ErrorReply {
    let code = match e {
        _ if e.is_conflict() => ErrorCode::Conflict,
        SharedError::NoSuchBuffer(_) | SharedError::NoSuchVersion { .. } => ErrorCode::NotFound,
        SharedError::Forbidden { .. } => ErrorCode::Forbidden,
        SharedError::Corrupt { .. } => ErrorCode::Refused,
        SharedError::Memory { .. } | SharedError::TooMany { .. } => ErrorCode::Refused,
        _ => ErrorCode::BadRequest,
    };
    ErrorReply {
        code,
        reason: Some(e.reason().to_string()),
        message: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn publishes(w: &Wait) -> u64 {
        *w.publishes.lock().unwrap()
    }

    #[test]
    fn a_publish_wakes_only_the_waits_on_its_buffer() {
        let waits = Waits::default();
        let (a, b) = ((0, BufferId(1)), (0, BufferId(2)));
        let on_a = waits.join(a);
        let also_on_a = waits.join(a);
        let on_b = waits.join(b);
        let other_slot = waits.join((1, BufferId(1)));
        waits.published(b);
        assert_eq!(
            (publishes(&on_a), publishes(&on_b), publishes(&other_slot)),
            (0, 1, 0)
        );
        waits.published(a);
        assert_eq!((publishes(&on_a), publishes(&also_on_a)), (1, 1));
        // A publish with no wait on its buffer makes no entry.
        waits.published((0, BufferId(3)));
        assert_eq!(waits.lock().len(), 3);
        drop(on_a);
        assert_eq!(waits.lock().len(), 3, "another wait is still on it");
        drop((also_on_a, on_b, other_slot));
        assert!(
            waits.lock().is_empty(),
            "the last wait takes its entry away"
        );
    }
}
