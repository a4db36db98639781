//! Shared buffers, the tenant's side: [`SharedBuffer`] (create, open), [`WriterLease`] (renewed in
//! the background while it lives) and [`Draft`] for writers, [`Pinned`] for readers. A pinned
//! version is mapped read-only; a draft read-write. Mappings and pins go when the values drop.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use vram_core::shared::{checksum, Acl, BufferId, BufferInfo, Version};
use vram_core::Bytes;
use vram_device::{Access, ByteAccess, Handle, Reservation};
use vram_proto::{LeaseOp, ProtoError, Received, Reply, Request, SharedReply, SharedRequest};

use crate::{Client, ClientError};

type CallFn = dyn Fn(&Request) -> Result<Received<Reply>, ClientError> + Send + Sync;

/// Makes shared-buffer calls on a client's connection; usable from other threads (the renewer).
#[derive(Clone)]
pub(crate) struct Caller(Arc<CallFn>);

impl Caller {
    pub(crate) fn new(
        call: impl Fn(&Request) -> Result<Received<Reply>, ClientError> + Send + Sync + 'static,
    ) -> Caller {
        Caller(Arc::new(call))
    }

    fn shared(&self, request: SharedRequest) -> Result<(SharedReply, Vec<OwnedFd>), ClientError> {
        let r = (self.0)(&Request::Shared(request))?;
        match r.msg {
            Reply::Shared(reply) => Ok((reply, r.fds)),
            other => Err(ClientError::Unexpected {
                request: "Shared",
                reply: format!("{other:?}"),
            }),
        }
    }
}

impl Client {
    /// Creates a shared buffer owned by this tenant; each version is `size` bytes (rounded up).
    pub fn create_shared(
        &self,
        name: &str,
        size: Bytes,
        acl: Acl,
    ) -> Result<SharedBuffer<'_>, ClientError> {
        let request = SharedRequest::Create {
            name: name.to_string(),
            size,
            acl,
        };
        self.buffer_reply(request)
    }

    /// Opens a shared buffer this tenant may read or write.
    pub fn open_shared(&self, name: &str) -> Result<SharedBuffer<'_>, ClientError> {
        self.buffer_reply(SharedRequest::Open {
            name: name.to_string(),
        })
    }

    /// The shared buffers this tenant may read or write, asked a page at a time.
    pub fn list_shared(&self) -> Result<Vec<BufferInfo>, ClientError> {
        let mut all = Vec::new();
        let mut after = None;
        loop {
            match self.caller().shared(SharedRequest::List { after })?.0 {
                SharedReply::Buffers { buffers, next } => {
                    all.extend(buffers);
                    // Pages move forward in id order; a page that does not is the last.
                    match next.filter(|&n| after.is_none_or(|a| n > a)) {
                        Some(n) => after = Some(n),
                        None => return Ok(all),
                    }
                }
                other => return Err(unexpected("List", &other)),
            }
        }
    }

    fn buffer_reply(&self, request: SharedRequest) -> Result<SharedBuffer<'_>, ClientError> {
        match self.caller().shared(request)?.0 {
            SharedReply::Buffer(info) => Ok(SharedBuffer {
                client: self,
                info: *info,
            }),
            other => Err(unexpected("Open", &other)),
        }
    }
}

/// A named shared buffer, as this tenant opened it.
#[derive(Debug)]
pub struct SharedBuffer<'c> {
    client: &'c Client,
    info: BufferInfo,
}

impl<'c> SharedBuffer<'c> {
    /// What the daemon said at open (or at the last [`SharedBuffer::refresh`]).
    pub fn info(&self) -> &BufferInfo {
        &self.info
    }

    pub fn id(&self) -> BufferId {
        self.info.id
    }

    pub fn size(&self) -> Bytes {
        self.info.size
    }

    pub fn refresh(&mut self) -> Result<&BufferInfo, ClientError> {
        self.info = self.client.open_shared(&self.info.name)?.info;
        Ok(&self.info)
    }

    /// Deletes the buffer (owner only). Readers keep the versions they pinned.
    pub fn delete(self) -> Result<(), ClientError> {
        let buffer = self.id();
        self.client
            .caller()
            .shared(SharedRequest::Delete { buffer })
            .map(drop)
    }

    /// Takes the writer lease for `ttl` (or the daemon's `max_lease_ms`, if shorter); a
    /// background thread renews it every third of the time granted until the lease is dropped
    /// (which releases it). A second writer gets a `Conflict`.
    pub fn lease(&self, ttl: Duration) -> Result<WriterLease<'c>, ClientError> {
        let asked = ttl.as_millis().min(u128::from(u32::MAX)) as u32;
        let granted = lease_op(self.client, self.id(), LeaseOp::Acquire, asked)?;
        // The daemon may grant less than asked: renew by what it granted.
        let ttl_ms = u32::try_from(granted).unwrap_or(u32::MAX).min(asked);
        let lost = Arc::new(AtomicBool::new(false));
        let (stop, stopped) = mpsc::channel::<()>();
        let (caller, buffer, flag) = (self.client.caller(), self.id(), lost.clone());
        let renewer = std::thread::Builder::new()
            .name("vram-lease-renew".into())
            .spawn(move || {
                let every = Duration::from_millis(u64::from(ttl_ms / 3).max(1));
                while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(every) {
                    let renew = SharedRequest::Lease {
                        buffer,
                        op: LeaseOp::Renew,
                        ttl_ms,
                    };
                    if caller.shared(renew).is_err() {
                        flag.store(true, Ordering::Release);
                        return;
                    }
                }
            })
            .map_err(|e| ClientError::Lost(format!("cannot start the lease renewer: {e}")))?;
        Ok(WriterLease {
            client: self.client,
            buffer: self.id(),
            lost,
            stop: Some(stop),
            renewer: Some(renewer),
        })
    }

    /// Pins the current published version and maps it read-only.
    pub fn pin(&self) -> Result<Pinned<'c>, ClientError> {
        let (reply, fds) = self
            .client
            .caller()
            .shared(SharedRequest::Pin { buffer: self.id() })?;
        let SharedReply::Pinned {
            version,
            size,
            checksum,
        } = reply
        else {
            return Err(unexpected("Pin", &reply));
        };
        // Unpinned on drop, also if mapping it fails.
        let mut pinned = Pinned {
            client: self.client,
            buffer: self.id(),
            version,
            checksum,
            mapped: None,
        };
        let device = self.client.device().as_ref();
        pinned.mapped = Some(Mapped::new(device, fds, size, Access::ReadOnly)?);
        Ok(pinned)
    }

    /// Waits up to `timeout` for a version newer than `than`; `None` if none came.
    pub fn wait_newer(
        &self,
        than: Option<Version>,
        timeout: Duration,
    ) -> Result<Option<Version>, ClientError> {
        let request = SharedRequest::WaitNewer {
            buffer: self.id(),
            than,
            timeout_ms: timeout.as_millis().min(u128::from(u32::MAX)) as u32,
        };
        match self.client.caller().shared(request)?.0 {
            SharedReply::Newer(v) => Ok(v),
            other => Err(unexpected("WaitNewer", &other)),
        }
    }

    /// Has the daemon re-read `version` (which must still be held) and compare it with its
    /// checksum at publish.
    pub fn verify(&self, version: Version) -> Result<bool, ClientError> {
        verify(self.client, self.id(), version)
    }
}

fn verify(client: &Client, buffer: BufferId, version: Version) -> Result<bool, ClientError> {
    match client
        .caller()
        .shared(SharedRequest::Verify { buffer, version })?
        .0
    {
        SharedReply::Verified {
            expected, actual, ..
        } => Ok(expected == actual),
        other => Err(unexpected("Verify", &other)),
    }
}

fn lease_op(
    client: &Client,
    buffer: BufferId,
    op: LeaseOp,
    ttl_ms: u32,
) -> Result<u64, ClientError> {
    let request = SharedRequest::Lease { buffer, op, ttl_ms };
    match client.caller().shared(request)?.0 {
        SharedReply::Lease { ttl_ms } => Ok(ttl_ms),
        other => Err(unexpected("Lease", &other)),
    }
}

/// The writer lease of one buffer, renewed in the background; released on drop.
pub struct WriterLease<'c> {
    client: &'c Client,
    buffer: BufferId,
    lost: Arc<AtomicBool>,
    stop: Option<mpsc::Sender<()>>,
    renewer: Option<JoinHandle<()>>,
}

impl<'c> WriterLease<'c> {
    /// Whether a background renewal failed (the lease ran out or was taken over).
    pub fn lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }

    /// Starts the next version from `base` (the version this writer read; `None` before the
    /// first publish), in fresh memory mapped read-write into this process.
    pub fn begin_write(&self, base: Option<Version>) -> Result<Draft<'c>, ClientError> {
        let (buffer, client) = (self.buffer, self.client);
        let (reply, fds) = client
            .caller()
            .shared(SharedRequest::BeginWrite { buffer, base })?;
        let SharedReply::Draft { version, size } = reply else {
            return Err(unexpected("BeginWrite", &reply));
        };
        let mapped = Mapped::new(client.device().as_ref(), fds, size, Access::ReadWrite)?;
        Ok(Draft {
            client,
            buffer,
            version,
            mapped,
        })
    }

    /// Gives the lease up now (an unpublished draft is discarded).
    pub fn release(mut self) -> Result<(), ClientError> {
        self.stop_renewer();
        lease_op(self.client, self.buffer, LeaseOp::Release, 0).map(drop)
    }

    fn stop_renewer(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.renewer.take() {
            let _ = t.join();
        }
    }
}

impl Drop for WriterLease<'_> {
    fn drop(&mut self) {
        if self.renewer.is_some() {
            self.stop_renewer();
            let _ = lease_op(self.client, self.buffer, LeaseOp::Release, 0);
        }
    }
}

/// A handle of a version, imported and mapped into this process.
#[derive(Debug)]
struct Mapped {
    // Unmapped (the reservation dropped) before the handle goes.
    res: Reservation,
    handle: Handle,
}

impl Mapped {
    fn new(
        device: &dyn ByteAccess,
        fds: Vec<OwnedFd>,
        size: Bytes,
        access: Access,
    ) -> Result<Mapped, ClientError> {
        let fd = fds
            .into_iter()
            .next()
            .ok_or(ClientError::Proto(ProtoError::MissingFds {
                announced: 1,
                received: 0,
            }))?;
        let handle = device.import(fd, size)?;
        let res = device.reserve(size)?;
        device.map(&res, Bytes::ZERO, &handle, access)?;
        Ok(Mapped { res, handle })
    }

    fn read_all(&self, device: &dyn ByteAccess) -> Result<Vec<u8>, ClientError> {
        let mut out = vec![0u8; self.handle.size().get() as usize];
        device.read(&self.res, Bytes::ZERO, &mut out)?;
        Ok(out)
    }
}

/// The next version, being written; [`Draft::publish`] makes it current. Dropped unpublished, it
/// stays the writer's draft until the next `begin_write` or the lease's end discards it.
pub struct Draft<'l> {
    client: &'l Client,
    buffer: BufferId,
    version: Version,
    mapped: Mapped,
}

impl Draft<'_> {
    pub fn version(&self) -> Version {
        self.version
    }

    pub fn size(&self) -> Bytes {
        self.mapped.handle.size()
    }

    /// The mapping's address (a host pointer on the host backend, a device pointer on cuda).
    pub fn ptr(&self) -> usize {
        self.mapped.res.base()
    }

    pub fn write(&self, offset: Bytes, data: &[u8]) -> Result<(), ClientError> {
        Ok(self.client.device().write(&self.mapped.res, offset, data)?)
    }

    pub fn fill(&self, offset: Bytes, len: Bytes, byte: u8) -> Result<(), ClientError> {
        Ok(self
            .client
            .device()
            .fill(&self.mapped.res, offset, len, byte)?)
    }

    /// Publishes this version; returns the checksum the daemon computed.
    pub fn publish(self) -> Result<u64, ClientError> {
        self.publish_with(None)
    }

    /// Publishes, with the checksum the writer expects: the daemon refuses if the memory differs.
    pub fn publish_checked(self, checksum: u64) -> Result<u64, ClientError> {
        self.publish_with(Some(checksum))
    }

    /// Publishes but keeps this writer's read-write mapping of the now published version: what a
    /// buggy or hostile writer could do, for tests of the scrub. Not for real use.
    #[doc(hidden)]
    pub fn publish_keeping_mapping(&self) -> Result<u64, ClientError> {
        self.publish_with(None)
    }

    fn publish_with(&self, checksum: Option<u64>) -> Result<u64, ClientError> {
        let request = SharedRequest::Publish {
            buffer: self.buffer,
            version: self.version,
            checksum,
        };
        match self.client.caller().shared(request)?.0 {
            SharedReply::Published { checksum, .. } => Ok(checksum),
            other => Err(unexpected("Publish", &other)),
        }
    }
}

/// A published version, pinned and mapped read-only until dropped.
pub struct Pinned<'c> {
    client: &'c Client,
    buffer: BufferId,
    version: Version,
    checksum: u64,
    mapped: Option<Mapped>,
}

impl Pinned<'_> {
    pub fn version(&self) -> Version {
        self.version
    }

    /// The checksum the daemon computed at publish.
    pub fn checksum(&self) -> u64 {
        self.checksum
    }

    fn mapped(&self) -> &Mapped {
        self.mapped.as_ref().expect("mapped until drop")
    }

    /// The mapping's address (a host pointer on the host backend, a device pointer on cuda).
    pub fn ptr(&self) -> usize {
        self.mapped().res.base()
    }

    pub fn size(&self) -> Bytes {
        self.mapped().handle.size()
    }

    pub fn read(&self, offset: Bytes, out: &mut [u8]) -> Result<(), ClientError> {
        Ok(self.client.device().read(&self.mapped().res, offset, out)?)
    }

    /// A copy of the whole version.
    pub fn to_vec(&self) -> Result<Vec<u8>, ClientError> {
        self.mapped().read_all(self.client.device().as_ref())
    }

    /// Reads the version back here and compares it with the checksum at publish.
    pub fn verify_here(&self) -> Result<bool, ClientError> {
        Ok(checksum(&self.to_vec()?) == self.checksum)
    }

    /// Has the daemon verify this version.
    pub fn verify(&self) -> Result<bool, ClientError> {
        verify(self.client, self.buffer, self.version)
    }

    /// Asks the device to make this reader's mapping writable, as a hostile reader could: what
    /// the platform allows is what it enforces (for tests of that rule). The host backend
    /// refuses (the descriptor is read-only and the version sealed); on CUDA an importer sets
    /// its own mapping's access.
    pub fn try_make_writable(&self) -> Result<(), ClientError> {
        let res = &self.mapped().res;
        Ok(self
            .client
            .device()
            .set_access(res, Bytes::ZERO, res.size(), Access::ReadWrite)?)
    }

    /// Writing through a read-only mapping is refused (for tests of that rule).
    pub fn try_write(&self, offset: Bytes, data: &[u8]) -> Result<(), ClientError> {
        Ok(self
            .client
            .device()
            .write(&self.mapped().res, offset, data)?)
    }
}

impl Drop for Pinned<'_> {
    fn drop(&mut self) {
        drop(self.mapped.take());
        let request = SharedRequest::Unpin {
            buffer: self.buffer,
            version: self.version,
        };
        let _ = self.client.caller().shared(request);
    }
}

fn unexpected(request: &'static str, reply: &SharedReply) -> ClientError {
    ClientError::Unexpected {
        request,
        reply: format!("{reply:?}"),
    }
}

impl std::fmt::Debug for Pinned<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pinned")
            .field("version", &self.version)
            .field("checksum", &self.checksum)
            .finish()
    }
}
