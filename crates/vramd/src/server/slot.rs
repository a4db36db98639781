//! One device: its broker, the grants it has handed out, and its pool.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Instant;

use vram_core::broker::{Broker, GrantError, Policy, ReclaimAsk, Tenant, TenantId, TenantRequest};
use vram_core::Bytes;
use vram_device::{BackendKind, Device, Handle};
use vram_proto::{DeviceDesc, DeviceStatus, ErrorCode, ErrorReply, GrantId, TenantStatus};

use super::pool::{Pool, Ready};
use super::shared::Books;

struct State {
    broker: Broker,
    grants: HashMap<GrantId, (TenantId, Handle)>,
    next_grant: u64,
    /// Which connection each tenant speaks on, to reach it with reclaim requests.
    conn_of: HashMap<TenantId, u64>,
    /// Shared buffers, charged to their owners through `broker` (see `shared.rs`).
    shared: Books,
    /// Grants waiting on `Slot::returned`: only then is memory coming back signalled.
    waiting: usize,
}

pub struct Slot {
    index: u32,
    device: Arc<dyn Device>,
    state: Mutex<State>,
    /// Signalled whenever memory comes back, for grants waiting on a reclaim.
    returned: Condvar,
    pool: Arc<Pool>,
    /// A view of the device that can read memory (shared-buffer checksums): on cuda the daemon
    /// has no context of its own, so one is opened the first time a buffer must be read.
    reader: OnceLock<Result<Arc<dyn Device>, String>>,
}

/// What a grant needs from the caller: a way to send reclaim requests to other tenants, and to
/// hear how the wait on them ended.
pub trait ReclaimSender {
    fn ask(&self, conn: u64, bytes: Bytes);
    /// After the asks: whether enough came back (`satisfied`) within the deadline, and the wait.
    fn settled(&self, satisfied: bool, waited: std::time::Duration);
}

impl Slot {
    pub fn new(
        index: u32,
        device: Arc<dyn Device>,
        policy: Policy,
        pool: Arc<Pool>,
    ) -> anyhow::Result<Slot> {
        let broker = Broker::new(policy)?;
        pool.set_room(broker.free());
        Ok(Slot {
            index,
            device,
            state: Mutex::new(State {
                broker,
                grants: HashMap::new(),
                next_grant: 1,
                conn_of: HashMap::new(),
                shared: Books::default(),
                waiting: 0,
            }),
            returned: Condvar::new(),
            pool,
            reader: OnceLock::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    /// The device, able to read memory back (see `reader`).
    pub fn reader(&self) -> Result<Arc<dyn Device>, vram_device::DeviceError> {
        let r = self.reader.get_or_init(|| match self.device.info().kind {
            BackendKind::Host => Ok(self.device.clone()),
            BackendKind::Cuda => {
                tracing::info!(
                    gpu = self.index,
                    "opening a CUDA context to checksum shared buffers"
                );
                vram_device::CudaDevice::open(&self.device.info().uuid)
                    .map(|d| Arc::new(d) as Arc<dyn Device>)
                    .map_err(|e| e.to_string())
            }
        });
        r.clone()
            .map_err(vram_device::DeviceError::DriverUnavailable)
    }

    /// Runs `f` on the shared-buffer books under the slot's lock (bookkeeping only: no device
    /// call, no socket write). Memory they give back wakes grants waiting on a reclaim.
    pub(super) fn with_shared<R>(&self, f: impl FnOnce(&mut Broker, &mut Books) -> R) -> R {
        let mut s = self.lock();
        let s = &mut *s;
        let r = f(&mut s.broker, &mut s.shared);
        self.pool.set_room(s.broker.free());
        if s.waiting > 0 {
            self.returned.notify_all();
        }
        r
    }

    pub fn desc(&self) -> DeviceDesc {
        let info = self.device.info();
        DeviceDesc {
            index: self.index,
            uuid: info.uuid.clone(),
            name: info.name.clone(),
            backend: backend_name(info.kind).to_string(),
            capacity: self.lock().broker.capacity(),
            granularity: info.granularity,
        }
    }

    pub fn connect(&self, req: TenantRequest, conn: u64) -> Result<(TenantId, Tenant), ErrorReply> {
        let mut s = self.lock();
        let id = s.broker.connect(req).map_err(|e| ErrorReply {
            code: ErrorCode::Admission,
            reason: None,
            message: e.to_string(),
        })?;
        s.conn_of.insert(id, conn);
        let tenant = s.broker.tenant(id).expect("just connected").clone();
        self.pool.set_room(s.broker.free());
        Ok((id, tenant))
    }

    /// Grants handles of `sizes` (each rounded up to the granularity), in order: all of them or
    /// none. The books first, size by size: when memory is short, tenants with idle memory are
    /// asked to give it back, and the grant waits up to `timeout` for them. Then the handles, from
    /// the pool ([`super::pool::Pool::take_many`]).
    pub fn grant_many(
        &self,
        tenant: TenantId,
        sizes: &[Bytes],
        timeout: std::time::Duration,
        reclaim: &dyn ReclaimSender,
    ) -> Result<Vec<(GrantId, Bytes, std::os::fd::OwnedFd)>, ErrorReply> {
        let mut booked = Vec::with_capacity(sizes.len());
        for &bytes in sizes {
            match self.book(tenant, bytes, timeout, reclaim) {
                Ok(size) => booked.push(size),
                Err(e) => {
                    self.unbook(tenant, &booked);
                    return Err(e);
                }
            }
        }
        let readies = match self.pool.take_many(tenant.0, &booked) {
            Ok(r) => r,
            Err(e) => {
                self.unbook(tenant, &booked);
                return Err(ErrorReply {
                    code: ErrorCode::Device,
                    reason: None,
                    message: format!(
                        "the device could not create {}: {e}",
                        booked.iter().copied().sum::<Bytes>()
                    ),
                });
            }
        };
        let mut s = self.lock();
        Ok(readies
            .into_iter()
            .zip(booked)
            .map(|(Ready { handle, fd }, size)| {
                let id = GrantId(s.next_grant);
                s.next_grant += 1;
                // The grant table keeps the handle; the caller sends the fd.
                s.grants.insert(id, (tenant, handle));
                (id, size, fd)
            })
            .collect())
    }

    /// Gives back the books of grants that were booked but never handed out.
    fn unbook(&self, tenant: TenantId, sizes: &[Bytes]) {
        if sizes.is_empty() {
            return;
        }
        let mut s = self.lock();
        for &size in sizes {
            s.broker.release(tenant, size);
        }
        self.pool.set_room(s.broker.free());
    }

    /// Books `bytes` (rounded up to the granularity) for `tenant`, asking tenants with idle memory
    /// for it first when it does not fit; returns the rounded size.
    fn book(
        &self,
        tenant: TenantId,
        bytes: Bytes,
        timeout: std::time::Duration,
        reclaim: &dyn ReclaimSender,
    ) -> Result<Bytes, ErrorReply> {
        let granularity = self.device.info().granularity;
        let size = match bytes.round_up(granularity) {
            Some(s) if bytes > Bytes::ZERO => s,
            _ => {
                let name = self.lock().broker.tenant(tenant).map(|t| t.name.clone());
                return Err(refused(&GrantError::BadSize {
                    tenant: name.unwrap_or_default(),
                    asked: bytes,
                    reason: if bytes == Bytes::ZERO {
                        "zero bytes"
                    } else {
                        "too large"
                    },
                }));
            }
        };
        let mut s = self.lock();
        if s.broker.check_grant(tenant, size).is_err() {
            let plan = s.broker.reclaim_plan(tenant, size);
            if !plan.is_empty() {
                let targets: Vec<(u64, Bytes)> = plan
                    .iter()
                    .filter_map(|ReclaimAsk { tenant, bytes }| {
                        Some((*s.conn_of.get(tenant)?, *bytes))
                    })
                    .collect();
                drop(s);
                for (conn, b) in targets {
                    reclaim.ask(conn, b);
                }
                s = self.lock();
                let asked = Instant::now();
                let deadline = asked + timeout;
                s.waiting += 1;
                while s.broker.check_grant(tenant, size).is_err() {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    s = self
                        .returned
                        .wait_timeout(s, left)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
                s.waiting -= 1;
                let satisfied = s.broker.check_grant(tenant, size).is_ok();
                reclaim.settled(satisfied, asked.elapsed());
            }
        }
        s.broker.grant(tenant, size).map_err(|e| refused(&e))?;
        self.pool.set_room(s.broker.free());
        Ok(size)
    }

    /// Takes grants back. Every id must belong to `tenant`; otherwise nothing is taken.
    pub fn give_back(
        &self,
        tenant: TenantId,
        ids: &[GrantId],
    ) -> Result<(Bytes, Bytes), ErrorReply> {
        let mut s = self.lock();
        if let Some(bad) = ids
            .iter()
            .find(|id| !matches!(s.grants.get(id), Some((t, _)) if *t == tenant))
        {
            return Err(ErrorReply {
                code: ErrorCode::UnknownGrant,
                reason: None,
                message: format!("grant {} is not held by this tenant", bad.0),
            });
        }
        let mut handles = Vec::with_capacity(ids.len());
        let mut bytes = Bytes::ZERO;
        for id in ids {
            if let Some((_, h)) = s.grants.remove(id) {
                bytes += h.size();
                handles.push(h);
            }
        }
        // The room the pool will have once these bytes are back in the books.
        let room = s.broker.free() + bytes;
        drop(s);
        // The memory first, the books after: a grant the books allow must find the memory free
        // (or pooled, which gives way), never still on its way back. Each handle is kept for
        // this tenant's own next grants, or released; never given to anyone else, so an import
        // it kept reaches nobody else's data.
        for handle in handles {
            if let Ok(fd) = self.device.export(&handle) {
                drop(self.pool.recycle(tenant.0, Ready { handle, fd }, room));
            }
        }
        let mut s = self.lock();
        s.broker.release(tenant, bytes);
        let held = s.broker.tenant(tenant).map_or(Bytes::ZERO, |t| t.held);
        self.pool.set_room(s.broker.free());
        let wake = s.waiting > 0;
        drop(s);
        if wake {
            self.returned.notify_all();
        }
        Ok((bytes, held))
    }

    pub fn report_usage(&self, tenant: TenantId, in_use: Bytes, cached: Bytes) {
        self.lock().broker.report_usage(tenant, in_use, cached);
    }

    /// The tenant is gone: everything it held goes back at once. Returns its final state and the
    /// number of handles released.
    pub fn disconnect(&self, tenant: TenantId) -> Option<(Tenant, usize)> {
        let handles: Vec<Handle> = {
            let mut s = self.lock();
            let ids: Vec<GrantId> = s
                .grants
                .iter()
                .filter(|(_, (t, _))| *t == tenant)
                .map(|(id, _)| *id)
                .collect();
            s.conn_of.remove(&tenant);
            ids.iter()
                .filter_map(|id| s.grants.remove(id))
                .map(|(_, h)| h)
                .collect()
        };
        // The memory first, the books after (see `give_back`).
        let n = handles.len();
        drop(handles);
        self.pool.forget(tenant.0);
        let mut s = self.lock();
        let st = &mut *s;
        let shared = st.shared.disconnect(&mut st.broker, tenant);
        let state = st.broker.disconnect(tenant);
        self.pool.set_room(s.broker.free());
        let wake = s.waiting > 0;
        drop(s);
        drop(shared);
        if wake {
            self.returned.notify_all();
        }
        state.map(|t| (t, n))
    }

    pub fn status(&self) -> (DeviceStatus, Vec<TenantStatus>) {
        let s = self.lock();
        let snap = s.broker.snapshot();
        let mut handles: BTreeMap<TenantId, u64> = BTreeMap::new();
        for (t, _) in s.grants.values() {
            *handles.entry(*t).or_default() += 1;
        }
        drop(s);
        let info = self.device.info();
        let device = DeviceStatus {
            index: self.index,
            uuid: info.uuid.clone(),
            name: info.name.clone(),
            backend: backend_name(info.kind).to_string(),
            capacity: snap.capacity,
            granularity: info.granularity,
            held: snap.held,
            pooled: self.pool.pooled(),
            reserved: snap.reserved,
            free: snap.free,
            device_used: self.device.used(),
            pool: self.pool.takes(),
        };
        let tenants = snap
            .tenants
            .into_iter()
            .map(|(id, t)| TenantStatus {
                id: id.0,
                name: t.name,
                gpu: self.index,
                class: t.class,
                priority: t.priority,
                guarantee: t.guarantee,
                limit: t.limit,
                held: t.held,
                in_use: t.in_use,
                cached: t.cached,
                handles: handles.get(&id).copied().unwrap_or(0),
                pid: t.pid,
                uid: t.uid,
                grants: t.grants,
                returns: t.returns,
                refusals: t.refusals,
            })
            .collect();
        (device, tenants)
    }
}

fn refused(e: &GrantError) -> ErrorReply {
    ErrorReply {
        code: ErrorCode::Refused,
        reason: Some(e.reason().to_string()),
        message: e.to_string(),
    }
}

pub fn backend_name(kind: BackendKind) -> &'static str {
    match kind {
        BackendKind::Host => "host",
        BackendKind::Cuda => "cuda",
    }
}
