//! Physical memory behind the caching allocator: handles from a [`HandleSource`] (the daemon, or a
//! device directly for trace replay) mapped into one reservation of this process.

use std::collections::HashMap;
use std::sync::Arc;

use vram_core::alloc::{Backing, GrantId, Refused};
use vram_core::Bytes;
use vram_device::{Access, Device, Handle, Reservation};

use crate::Client;

/// Where handles come from.
pub trait HandleSource: Send {
    /// A handle of exactly `bytes`, and a ticket to give it back with.
    fn take(&mut self, bytes: Bytes) -> Result<(Handle, u64), Refused>;
    /// Gives a handle back (it is unmapped and dropped by then).
    fn give(&mut self, ticket: u64);
}

/// Handles granted by the daemon.
pub struct DaemonSource {
    client: Arc<Client>,
}

impl DaemonSource {
    pub fn new(client: Arc<Client>) -> DaemonSource {
        DaemonSource { client }
    }
}

impl HandleSource for DaemonSource {
    fn take(&mut self, bytes: Bytes) -> Result<(Handle, u64), Refused> {
        match self.client.grant(bytes) {
            Ok(g) => Ok((g.handle, g.id.0)),
            Err(e) => Err(Refused {
                bytes,
                reason: e.to_string(),
            }),
        }
    }

    fn give(&mut self, ticket: u64) {
        if let Err(e) = self.client.give_back_ids(vec![vram_proto::GrantId(ticket)]) {
            // The daemon takes everything back when the connection ends; nothing is lost.
            tracing::warn!("returning a grant failed: {e}");
        }
    }
}

/// Handles created directly on a device, with no daemon: trace replay and benchmarks.
pub struct LocalSource {
    device: Arc<dyn Device>,
}

impl LocalSource {
    pub fn new(device: Arc<dyn Device>) -> LocalSource {
        LocalSource { device }
    }
}

impl HandleSource for LocalSource {
    fn take(&mut self, bytes: Bytes) -> Result<(Handle, u64), Refused> {
        self.device
            .create(bytes)
            .map(|h| (h, 0))
            .map_err(|e| Refused {
                bytes,
                reason: e.to_string(),
            })
    }

    fn give(&mut self, _ticket: u64) {}
}

/// Maps handles from `S` into one reservation, as the core allocator directs.
pub struct MappedBacking<S> {
    device: Arc<dyn Device>,
    res: Reservation,
    source: S,
    handles: HashMap<GrantId, (Handle, u64)>,
    next: u64,
    /// Wall time spent in the source and the device: taking, mapping, unmapping, giving back.
    spent: std::time::Duration,
}

impl<S: HandleSource> MappedBacking<S> {
    pub fn new(
        device: Arc<dyn Device>,
        va: Bytes,
        source: S,
    ) -> Result<Self, vram_device::DeviceError> {
        let res = device.reserve(va)?;
        Ok(MappedBacking {
            device,
            res,
            source,
            handles: HashMap::new(),
            next: 1,
            spent: std::time::Duration::ZERO,
        })
    }

    /// The first address of the reservation: a block at offset `o` is at `base + o`.
    pub fn base(&self) -> u64 {
        self.res.base() as u64
    }

    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    pub fn reservation(&self) -> &Reservation {
        &self.res
    }

    /// Wall time this backing has spent in its source and device calls (on CUDA: the daemon round
    /// trip and import, or the creation, and every map, set-access, unmap and release).
    pub fn call_time(&self) -> std::time::Duration {
        self.spent
    }

    fn timed<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        let started = std::time::Instant::now();
        let r = f(self);
        self.spent += started.elapsed();
        r
    }
}

impl<S: HandleSource> Backing for MappedBacking<S> {
    fn grant(&mut self, bytes: Bytes) -> Result<GrantId, Refused> {
        let (handle, ticket) = self.timed(|b| b.source.take(bytes))?;
        let id = GrantId(self.next);
        self.next += 1;
        self.handles.insert(id, (handle, ticket));
        Ok(id)
    }

    fn map(&mut self, grant: GrantId, va: u64) -> Result<(), Refused> {
        self.timed(|b| {
            let (handle, _) = &b.handles[&grant];
            b.device
                .map(&b.res, Bytes(va), handle, Access::ReadWrite)
                .map_err(|e| Refused {
                    bytes: handle.size(),
                    reason: e.to_string(),
                })
        })
    }

    fn unmap(&mut self, grant: GrantId, va: u64) {
        let size = self.handles[&grant].0.size();
        if let Err(e) = self.timed(|b| b.device.unmap(&b.res, Bytes(va), size)) {
            tracing::error!("unmapping {size} at offset {va:#x} failed: {e}");
        }
    }

    fn release(&mut self, grant: GrantId) {
        if let Some((handle, ticket)) = self.handles.remove(&grant) {
            self.timed(|b| {
                drop(handle);
                b.source.give(ticket);
            });
        }
    }
}
