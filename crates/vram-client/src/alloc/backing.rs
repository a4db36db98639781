//! Physical memory behind the caching allocator: handles from a [`HandleSource`] (the daemon, or a
//! device directly for trace replay) mapped into one reservation of this process.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use vram_core::alloc::{Backing, BackingCounts, CallCost, GrantId, Refused};
use vram_core::replay::CostModel;
use vram_core::Bytes;
use vram_device::{Access, Device, Handle, Reservation};

use crate::Client;

/// Where handles come from.
pub trait HandleSource: Send {
    /// Handles of exactly these sizes, each with a ticket to give it back with: all or none.
    fn take(&mut self, sizes: &[Bytes]) -> Result<Vec<(Handle, u64)>, Refused>;
    /// Gives handles back, in one request (they are unmapped and dropped by then). The source
    /// may take them back later; [`HandleSource::settler`]'s wait lasts until it has.
    fn give(&mut self, tickets: &[u64]);
    /// A wait that returns once everything given back so far is back with the source: run by the
    /// allocator after it lets go of its lock, since it may take a round trip to a daemon.
    fn settler(&self) -> Settler {
        Box::new(|| {})
    }
}

/// See [`HandleSource::settler`].
pub type Settler = Box<dyn FnOnce() + Send>;

/// The connection a [`DaemonSource`] takes its handles through. A process that ends its tenant
/// and becomes another one (libvram.so's `vram_disconnect` and `vram_connect`) keeps its
/// allocator and its reservation, and swaps the connection here; between two tenants there is
/// none, and growth is refused.
#[derive(Default)]
pub struct ClientSlot(RwLock<Option<Arc<Client>>>);

impl ClientSlot {
    pub fn new(client: Arc<Client>) -> ClientSlot {
        ClientSlot(RwLock::new(Some(client)))
    }

    /// The connection, if the process is a tenant now.
    pub fn get(&self) -> Option<Arc<Client>> {
        self.0.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Puts `client` in (or empties the slot); returns what was there.
    pub fn replace(&self, client: Option<Arc<Client>>) -> Option<Arc<Client>> {
        std::mem::replace(
            &mut *self.0.write().unwrap_or_else(|p| p.into_inner()),
            client,
        )
    }
}

/// Handles granted by the daemon.
pub struct DaemonSource {
    slot: Arc<ClientSlot>,
}

impl DaemonSource {
    pub fn new(client: Arc<Client>) -> DaemonSource {
        Self::through(Arc::new(ClientSlot::new(client)))
    }

    /// Handles through whichever connection `slot` holds at the time.
    pub fn through(slot: Arc<ClientSlot>) -> DaemonSource {
        DaemonSource { slot }
    }
}

impl HandleSource for DaemonSource {
    /// One round trip for up to 16 handles (the daemon's `GrantMany`).
    fn take(&mut self, sizes: &[Bytes]) -> Result<Vec<(Handle, u64)>, Refused> {
        let bytes = sizes.iter().copied().sum();
        let Some(client) = self.slot.get() else {
            return Err(Refused {
                bytes,
                reason: "this process is no tenant now (its tenant ended)".into(),
            });
        };
        match client.grant_many(sizes) {
            Ok(grants) => Ok(grants.into_iter().map(|g| (g.handle, g.id.0)).collect()),
            Err(e) => Err(Refused {
                bytes,
                reason: e.to_string(),
            }),
        }
    }

    /// Sent without waiting for the answer: waiting would cost the tenant a round trip to a
    /// daemon that may have gone idle (docs/benchmarks.md, "Grant latency"), and nothing the
    /// allocator does next needs the answer. Any later request on the connection finds them back.
    /// With no connection, the daemon has taken everything back already.
    fn give(&mut self, tickets: &[u64]) {
        let Some(client) = self.slot.get() else {
            return;
        };
        let ids = tickets.iter().map(|&t| vram_proto::GrantId(t)).collect();
        if let Err(e) = client.give_back_unanswered(ids) {
            // The daemon takes everything back when the connection ends; nothing is lost.
            tracing::warn!("returning a grant failed: {e}");
        }
    }

    /// A round trip: the daemon answers it only after the returns sent before it.
    fn settler(&self) -> Settler {
        let client = self.slot.get();
        Box::new(move || {
            let Some(client) = client else {
                return;
            };
            if let Err(e) = client.ping() {
                tracing::warn!("waiting for returns to land failed: {e}");
            }
        })
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
    fn take(&mut self, sizes: &[Bytes]) -> Result<Vec<(Handle, u64)>, Refused> {
        sizes
            .iter()
            .map(|&bytes| {
                self.device
                    .create(bytes)
                    .map(|h| (h, 0))
                    .map_err(|e| Refused {
                        bytes,
                        reason: e.to_string(),
                    })
            })
            .collect()
    }

    fn give(&mut self, _tickets: &[u64]) {}
}

/// Wall time a [`MappedBacking`] spent in each kind of call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallTimes {
    /// Taking handles from the source (from the daemon: the round trip and the import; locally:
    /// the creation).
    pub take: Duration,
    /// Mapping with read-write access.
    pub map: Duration,
    pub unmap: Duration,
    /// Dropping handles and giving them back to the source.
    pub release: Duration,
}

impl CallTimes {
    pub fn total(&self) -> Duration {
        self.take + self.map + self.unmap + self.release
    }

    /// The time spent since `earlier`, a reading of the same backing.
    pub fn since(&self, earlier: &CallTimes) -> CallTimes {
        CallTimes {
            take: self.take.saturating_sub(earlier.take),
            map: self.map.saturating_sub(earlier.map),
            unmap: self.unmap.saturating_sub(earlier.unmap),
            release: self.release.saturating_sub(earlier.release),
        }
    }
}

#[derive(Clone, Copy)]
enum Call {
    Take,
    Map,
    Unmap,
    Release,
}

/// Maps handles from `S` into one reservation, as the core allocator directs.
pub struct MappedBacking<S> {
    device: Arc<dyn Device>,
    res: Reservation,
    source: S,
    handles: HashMap<GrantId, (Handle, u64)>,
    /// Handles whose unmap failed: still mapped here, so never given back (their source could
    /// hand memory this process still reaches to another tenant); they stay the tenant's, in
    /// the daemon's books, until the process ends.
    stuck: Vec<(Handle, u64)>,
    next: u64,
    /// Wall time spent in the source and the device, by kind of call.
    spent: CallTimes,
    /// How long each take lasted, in order.
    takes: Vec<Duration>,
    /// The last take's time per handle it brought.
    last_take_per_handle: Duration,
    /// A cost model that prices the calls in place of their measured time (a replay on a
    /// device that is not the one it stands for).
    pricing: Option<CostModel>,
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
            stuck: Vec::new(),
            next: 1,
            spent: CallTimes::default(),
            takes: Vec::new(),
            last_take_per_handle: Duration::ZERO,
            pricing: None,
        })
    }

    /// The same backing with its calls priced by `costs` for the allocator's driver-time budget
    /// ([`Backing::cost`]) instead of measured: a replay on the host backend stands for a GPU.
    pub fn priced(self, costs: CostModel) -> Self {
        MappedBacking {
            pricing: Some(costs),
            ..self
        }
    }

    /// A wait until every handle given back is back with the source (see
    /// [`HandleSource::settler`]).
    pub fn settler(&self) -> Settler {
        self.source.settler()
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

    /// Wall time this backing has spent in its source and device calls, by kind of call (on
    /// CUDA: the daemon round trip and import, or the creation, and every map, set-access, unmap
    /// and release).
    pub fn call_times(&self) -> CallTimes {
        self.spent
    }

    /// How long each take from the source lasted (one request, for one or more handles), in the
    /// order they were made.
    pub fn take_times(&self) -> &[Duration] {
        &self.takes
    }

    fn timed<R>(&mut self, call: Call, f: impl FnOnce(&mut Self) -> R) -> R {
        let started = Instant::now();
        let r = f(self);
        let took = started.elapsed();
        let slot = match call {
            Call::Take => {
                self.takes.push(took);
                &mut self.spent.take
            }
            Call::Map => &mut self.spent.map,
            Call::Unmap => &mut self.spent.unmap,
            Call::Release => &mut self.spent.release,
        };
        *slot += took;
        r
    }
}

impl<S: HandleSource> Backing for MappedBacking<S> {
    fn grant(&mut self, sizes: &[Bytes]) -> Result<Vec<GrantId>, Refused> {
        let taken = self.timed(Call::Take, |b| b.source.take(sizes))?;
        if let Some(&took) = self.takes.last() {
            self.last_take_per_handle = took / taken.len().max(1) as u32;
        }
        Ok(taken
            .into_iter()
            .map(|(handle, ticket)| {
                let id = GrantId(self.next);
                self.next += 1;
                self.handles.insert(id, (handle, ticket));
                id
            })
            .collect())
    }

    fn map(&mut self, grant: GrantId, va: u64) -> Result<(), Refused> {
        self.timed(Call::Map, |b| {
            // A handle whose unmap failed stays where it is (see `unmap`): the allocator, told so,
            // never maps it again, and a caller that did is refused rather than obeyed.
            let Some((handle, _)) = b.handles.get(&grant) else {
                return Err(Refused {
                    bytes: Bytes::ZERO,
                    reason: format!("{grant:?} failed to unmap before and stays where it was"),
                });
            };
            b.device
                .map(&b.res, Bytes(va), handle, Access::ReadWrite)
                .map_err(|e| Refused {
                    bytes: handle.size(),
                    reason: e.to_string(),
                })
        })
    }

    fn unmap(&mut self, grant: GrantId, va: u64) -> bool {
        let size = self.handles[&grant].0.size();
        if let Err(e) = self.timed(Call::Unmap, |b| b.device.unmap(&b.res, Bytes(va), size)) {
            tracing::error!(
                "unmapping {size} at offset {va:#x} failed: {e}; the handle stays mapped and is \
                 not given back (it stays the tenant's until the process ends)"
            );
            if let Some(h) = self.handles.remove(&grant) {
                self.stuck.push(h);
            }
            return false;
        }
        true
    }

    fn release(&mut self, grants: &[GrantId]) {
        let taken: Vec<(Handle, u64)> = grants
            .iter()
            .filter_map(|g| self.handles.remove(g))
            .collect();
        if taken.is_empty() {
            return;
        }
        self.timed(Call::Release, |b| {
            let tickets: Vec<u64> = taken.iter().map(|t| t.1).collect();
            drop(taken);
            b.source.give(&tickets);
        });
    }

    /// Priced by the cost model when one is set; else the measured time, a handle's life being
    /// the mean time per handle of each kind of call so far (a take's round trip counted in
    /// its handles; the last take's, when that was dearer: through a daemon, a size its pool
    /// does not keep ready is made on the grant's path), and nothing until the first grant.
    fn cost(&self, calls: &BackingCounts) -> Option<CallCost> {
        if let Some(model) = self.pricing {
            return Some(model.call_cost(calls));
        }
        if calls.grants == 0 {
            return None;
        }
        let per = |d: Duration, n: u64| {
            if n == 0 {
                0.0
            } else {
                d.as_secs_f64() * 1e6 / n as f64
            }
        };
        Some(CallCost {
            spent_us: self.spent.total().as_secs_f64() * 1e6,
            request_us: 0.0,
            handle_us: per(self.spent.take, calls.grants).max(per(self.last_take_per_handle, 1))
                + per(self.spent.map, calls.maps)
                + per(self.spent.unmap, calls.unmaps)
                + per(self.spent.release, calls.releases),
        })
    }
}
