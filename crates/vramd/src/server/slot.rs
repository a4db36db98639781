//! One device: its broker, the grants it has handed out, and its pool.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Instant;

use vram_core::broker::{Broker, GrantError, Policy, ReclaimAsk, Tenant, TenantId, TenantRequest};
use vram_core::Bytes;
use vram_device::{ByteAccess, Device, Handle};
use vram_proto::{DeviceDesc, DeviceStatus, ErrorCode, ErrorReply, GrantId, Resume, TenantStatus};

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
    /// The tenants with a grant waiting on a reclaim (see [`Slot::reserve`]).
    waiters: HashMap<TenantId, Waiter>,
    /// When each tenant last gave memory back.
    returned_at: HashMap<TenantId, Instant>,
    /// Tenants asked for idle memory that gave none back before the asker's deadline, and when:
    /// left out of plans for [`UNFRUITFUL_PAUSE`] or until they give something back. The idle
    /// memory a tenant reports is its word; one that is stopped, or says it has memory it does
    /// not give, would otherwise be asked first by every grant and make each wait in vain.
    unfruitful: HashMap<TenantId, Instant>,
    /// The driver's figures as last reconciled (`None`: never read).
    driver: Option<DriverView>,
    /// Grants booked without a handle here: a tenant adopted after a daemon restart holds them
    /// from the daemon before (the memory lives in its imports).
    adopted: HashMap<GrantId, (TenantId, Bytes)>,
    /// Adopted tenants that have not reconnected yet: the process that must come back.
    pending: HashMap<TenantId, Process>,
    /// Each tenant's process, for the state file.
    processes: HashMap<TenantId, Process>,
    /// The books changed since the state file was last written.
    dirty: bool,
    /// Invitations to join a tenant not yet taken: token → (tenant, the uid that may take it).
    invitations: HashMap<String, (TenantId, u32)>,
    /// Tenants whose memory a joined process holds: the registering connection (none for a
    /// tenant adopted after a restart) and process, which the tenant falls back to when the
    /// member ends.
    members: HashMap<TenantId, (Option<u64>, Process)>,
    /// Handles given back while a process still reached them, by a number of their own: booked
    /// to the tenant that had them (the broker's `kept`) until [`Slot::sweep_kept`] finds them
    /// gone.
    kept: HashMap<u64, Kept>,
    next_kept: u64,
    /// Returns of memory still reached, logged at most once per `LOG_EVERY` (a tenant can repeat
    /// them at will).
    kept_warnings: crate::logging::Every,
}

/// A grant's handle, with its id.
type Granted = (GrantId, Handle);

/// A handle given back that some process still reaches (see [`Device::reached_elsewhere`]).
struct Kept {
    name: String,
    uid: u32,
    /// The grant the handle was, if it was one: a tenant that reconnects and says it still holds
    /// that grant takes the handle back as held (`settle`), not booked a second time.
    grant: Option<GrantId>,
    handle: Arc<Handle>,
}

impl State {
    /// Whom to ask for idle memory so that `tenant` could take `size` (see [`Slot::reserve`]):
    /// the asks waited on, and those sent without waiting (to tenants that gave nothing back
    /// lately: still asked, so that one that does not read its socket is disconnected in time).
    /// A tenant waiting on a reclaim itself, of the asker's priority or above, is in neither.
    fn reclaim_asks(&self, tenant: TenantId, size: Bytes) -> (Vec<ReclaimAsk>, Vec<ReclaimAsk>) {
        let mine = self.broker.tenant(tenant).map_or(0, |t| t.priority);
        let waiting = |other: TenantId| {
            self.waiters.contains_key(&other)
                && self.broker.tenant(other).is_none_or(|t| t.priority >= mine)
        };
        let silent = |other: TenantId| {
            self.unfruitful
                .get(&other)
                .is_some_and(|since| since.elapsed() < UNFRUITFUL_PAUSE)
        };
        let plan = self
            .broker
            .reclaim_plan(tenant, size, &|o| waiting(o) || silent(o));
        let mut unwaited = self.broker.reclaim_plan(tenant, size, &waiting);
        unwaited.retain(|ask| silent(ask.tenant));
        (plan, unwaited)
    }

    /// The name and uid of tenant `id`, under which handles it gives back and still reaches are
    /// kept: taken with the grants, while the tenant is surely in the books, since another
    /// connection of the tenant may disconnect it before the handles are found reached.
    fn keeper(&self, id: TenantId) -> Option<(String, u32)> {
        self.broker.tenant(id).map(|t| (t.name.clone(), t.uid))
    }

    /// Books the grants' `handles`, which the tenant `who` (its [`State::keeper`]) gave back and
    /// still reaches, as kept by it, whether it is still connected or not.
    fn keep(&mut self, who: &Option<(String, u32)>, handles: Vec<Granted>) -> Bytes {
        if handles.is_empty() {
            return Bytes::ZERO;
        }
        let Some((name, uid)) = who else {
            // The grants were taken from a tenant the books did not have: a handle dropped here
            // lives on in the process that reaches it, booked to nobody.
            let bytes: Bytes = handles.iter().map(|(_, h)| h.size()).sum();
            tracing::error!(
                %bytes,
                "handles still reached by another process belong to no tenant: not booked"
            );
            return Bytes::ZERO;
        };
        let handles = handles.into_iter().map(|(g, h)| (Some(g), h)).collect();
        self.keep_for(name, *uid, handles)
    }

    /// Whether grant `g`, which tenant `id` says it holds, is one of its kept handles (dropped
    /// with its connection while its process still reached it). If so it is the tenant's grant
    /// again, held instead of kept: the same memory is never booked twice. A handle that a sweep
    /// is looking at just then stays kept, counted once all the same.
    fn take_back_kept(&mut self, id: TenantId, g: GrantId) -> bool {
        let Some((name, uid)) = self.broker.tenant(id).map(|t| (t.name.clone(), t.uid)) else {
            return false;
        };
        let Some(n) = self
            .kept
            .iter()
            .find(|(_, k)| k.grant == Some(g) && k.name == name && k.uid == uid)
            .map(|(n, _)| *n)
        else {
            return false;
        };
        let kept = self.kept.remove(&n).expect("found above");
        match Arc::try_unwrap(kept.handle) {
            Ok(handle) => {
                self.broker.rehold(id, handle.size());
                self.grants.insert(g, (id, handle));
                self.dirty = true;
            }
            Err(handle) => {
                self.kept.insert(n, Kept { handle, ..kept });
            }
        }
        true
    }

    /// Books `handles` as kept by the tenant `name` of `uid`, connected or not.
    fn keep_for(&mut self, name: &str, uid: u32, handles: Vec<(Option<GrantId>, Handle)>) -> Bytes {
        let mut bytes = Bytes::ZERO;
        for (grant, handle) in handles {
            bytes += handle.size();
            let n = self.next_kept;
            self.next_kept += 1;
            let kept = Kept {
                name: name.to_owned(),
                uid,
                grant,
                handle: Arc::new(handle),
            };
            self.kept.insert(n, kept);
        }
        self.broker.add_kept(name, uid, bytes);
        bytes
    }
}

impl State {
    /// What the last reading of the driver showed of process `pid` as outside use.
    fn outside_of(&self, pid: u32) -> Bytes {
        self.driver.as_ref().map_or(Bytes::ZERO, |d| {
            d.outside_processes
                .iter()
                .filter(|p| p.pid == pid)
                .map(|p| p.bytes)
                .sum()
        })
    }

    /// `own`, what the driver showed of process `pid`, is tenant `id`'s from now on (the caller
    /// took it off the outside use).
    fn claim_outside(&mut self, id: TenantId, pid: u32, own: Bytes) {
        self.broker.set_tenant_outside(id, own);
        if let Some(d) = self.driver.as_mut() {
            d.outside_processes.retain(|p| p.pid != pid);
        }
    }
}

/// A tenant's process as the state file names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Process {
    pid: u32,
    uid: u32,
    start_time: u64,
}

/// What the last reading of the driver showed beyond the books, for status.
struct DriverView {
    used: Bytes,
    unattributed: Bytes,
    outside_processes: Vec<vram_proto::OutsideProcess>,
    at_risk: bool,
}

/// What applying a reading changed, for the caller to report and act on.
pub struct Applied {
    pub deficit: Bytes,
    pub at_risk: Vec<vram_core::broker::AtRisk>,
    /// Whether promises became at risk with this reading (none were before).
    pub newly_at_risk: bool,
    /// Reclaim requests to send: (connection, bytes).
    pub asks: Vec<(u64, Bytes)>,
}

pub struct Slot {
    index: u32,
    device: Arc<dyn Device>,
    state: Mutex<State>,
    /// Signalled whenever memory comes back, for grants waiting on a reclaim.
    returned: Condvar,
    pool: Arc<Pool>,
    /// The device opened again with byte access, to read memory (shared-buffer checksums): the
    /// daemon's own handles memory only (on cuda it has no context), so this one is opened the
    /// first time a buffer must be read.
    reader: OnceLock<Result<Arc<dyn ByteAccess>, String>>,
    /// Shared-buffer versions freed while still reached, waiting to be booked as kept.
    let_go: Arc<super::shared::LetGo>,
}

/// What a grant needs from the caller: a way to send reclaim requests to other tenants, to hear
/// how the wait on them ended, and to tell whether the asking tenant is still there to wait for.
pub trait ReclaimSender {
    fn ask(&self, conn: u64, bytes: Bytes);
    /// After the asks: whether enough came back (`satisfied`) within the deadline, and the wait.
    fn settled(&self, satisfied: bool, waited: std::time::Duration);
    /// Whether the tenant the memory is for has gone (its connection ended) while it waited:
    /// the wait then stops, so that what it held comes back at once rather than at the deadline.
    fn asker_gone(&self) -> bool;
}

/// A tenant with grants waiting on a reclaim: how many, and whether a tenant of higher priority
/// asked it for memory, which it can give back only once its own waits end.
#[derive(Debug, Default)]
struct Waiter {
    waits: usize,
    give_way: bool,
}

/// How long a tenant that gave nothing back when asked is not asked again (unless it gives
/// something back first).
pub const UNFRUITFUL_PAUSE: std::time::Duration = std::time::Duration::from_secs(10);

/// How often a grant waiting on a reclaim looks whether its tenant is still there.
const LOOK_EVERY: std::time::Duration = std::time::Duration::from_millis(20);

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
            device: device.clone(),
            state: Mutex::new(State {
                broker,
                grants: HashMap::new(),
                next_grant: 1,
                conn_of: HashMap::new(),
                shared: Books::default(),
                waiting: 0,
                waiters: HashMap::new(),
                returned_at: HashMap::new(),
                unfruitful: HashMap::new(),
                driver: None,
                adopted: HashMap::new(),
                pending: HashMap::new(),
                processes: HashMap::new(),
                dirty: false,
                invitations: HashMap::new(),
                members: HashMap::new(),
                kept: HashMap::new(),
                next_kept: 1,
                kept_warnings: crate::logging::Every::default(),
            }),
            returned: Condvar::new(),
            pool,
            reader: OnceLock::new(),
            let_go: Arc::new(super::shared::LetGo::new(device.clone())),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Releases the lock of books that memory came back to, and wakes the grants waiting on a
    /// reclaim, if any were.
    fn unlock_and_wake(&self, s: MutexGuard<'_, State>) {
        self.unlock_then_wake(s, || ());
    }

    /// [`Slot::unlock_and_wake`], with `then` run between the two (memory dropped outside the
    /// lock, which a woken grant must find gone).
    fn unlock_then_wake(&self, s: MutexGuard<'_, State>, then: impl FnOnce()) {
        let wake = s.waiting > 0;
        drop(s);
        then();
        if wake {
            self.returned.notify_all();
        }
    }

    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    pub fn let_go(&self) -> &Arc<super::shared::LetGo> {
        &self.let_go
    }

    /// Books the shared-buffer versions freed while some process still reached them as kept by
    /// their buffer's owner (see `shared::Memory`); [`Slot::sweep_kept`] books them back
    /// once they are gone.
    pub fn book_let_go(&self) {
        let found = self.let_go.take();
        if found.is_empty() {
            return;
        }
        let mut s = self.lock();
        for (name, uid, handle) in found {
            let bytes = s.keep_for(&name, uid, vec![(None, handle)]);
            tracing::info!(
                gpu = self.index,
                owner = %name,
                %bytes,
                "a freed shared-buffer version is still reached by some process: it stays \
                 booked to the buffer's owner until it is gone"
            );
        }
        self.pool.set_room(s.broker.free());
    }

    /// The device, able to read memory back (see `reader`).
    pub fn reader(&self) -> Result<Arc<dyn ByteAccess>, vram_device::DeviceError> {
        let r = self.reader.get_or_init(|| {
            let info = self.device.info();
            tracing::info!(
                gpu = self.index,
                backend = %info.kind,
                "opening the device with byte access to checksum shared buffers"
            );
            vram_device::open(info).map_err(|e| e.to_string())
        });
        r.clone()
            .map_err(vram_device::DeviceError::DriverUnavailable)
    }

    /// The memory of a shared buffer's version, while the books keep it.
    pub(super) fn version_memory(
        &self,
        buffer: vram_core::shared::BufferId,
        version: vram_core::shared::Version,
    ) -> Option<Arc<super::shared::Memory>> {
        self.lock().shared.memory.get(&(buffer, version)).cloned()
    }

    /// Whether the books still keep a shared buffer's version.
    pub(super) fn keeps_version(
        &self,
        buffer: vram_core::shared::BufferId,
        version: vram_core::shared::Version,
    ) -> bool {
        self.lock().shared.memory.contains_key(&(buffer, version))
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

    /// [`Slot::with_shared`] for a change that frees versions: `f` returns their memory, which
    /// is dropped once the lock is released and before waiting grants are woken (a woken grant
    /// must find the memory gone from the device, not only from the books).
    pub(super) fn with_shared_freeing<R>(
        &self,
        f: impl FnOnce(&mut Broker, &mut Books) -> (R, Vec<Arc<super::shared::Memory>>),
    ) -> R {
        let mut s = self.lock();
        let st = &mut *s;
        let (r, memory) = f(&mut st.broker, &mut st.shared);
        self.pool.set_room(st.broker.free());
        self.unlock_then_wake(s, || drop(memory));
        r
    }

    /// Whether the tenant `name` was adopted here from the daemon before and waits for its process
    /// `pid` (of `uid`) to reconnect.
    pub fn awaits(&self, name: &str, pid: u32, uid: u32) -> bool {
        let s = self.lock();
        s.broker
            .id_of(name)
            .and_then(|id| s.pending.get(&id))
            .is_some_and(|p| p.pid == pid && p.uid == uid)
    }

    /// The device's UUID (no lock taken).
    pub fn uuid(&self) -> String {
        self.device.info().uuid.clone()
    }

    pub fn desc(&self) -> DeviceDesc {
        let info = self.device.info();
        DeviceDesc {
            index: self.index,
            uuid: info.uuid.clone(),
            name: info.name.clone(),
            backend: info.kind,
            capacity: self.lock().broker.capacity(),
            granularity: info.granularity,
        }
    }

    /// Admits a tenant on connection `conn`. A tenant adopted after a daemon restart comes back
    /// here: the same name from the same process takes its books over, settled against what it
    /// says it holds (`resume`); the name from another process is refused while the adopted one
    /// lives.
    pub fn connect(
        &self,
        req: TenantRequest,
        conn: u64,
        resume: Option<&Resume>,
    ) -> Result<(TenantId, Tenant), ErrorReply> {
        let admission = |reason: &str, message: String| ErrorReply {
            code: ErrorCode::Admission,
            reason: Some(reason.to_string()),
            message,
        };
        // Every grant and charge is a whole number of granules.
        let granularity = self.device.info().granularity;
        if let Some(limit) = req.limit.filter(|l| *l < granularity) {
            return Err(admission(
                "limit_below_granularity",
                format!(
                    "tenant `{}` asks for a limit of {limit}, below the device's granularity \
                     ({granularity}): it could hold nothing{}",
                    req.name,
                    crate::config::bare_size_hint(limit)
                ),
            ));
        }
        let mut s = self.lock();
        let st = &mut *s;
        let adopted = st
            .broker
            .id_of(&req.name)
            .and_then(|id| Some((id, *st.pending.get(&id)?)));
        // The same process, not a later one that reuses its pid: the start time says which.
        let same_process = |p: &Process| {
            p.pid == req.pid
                && p.uid == req.uid
                && (p.start_time == 0
                    || super::state::process_start_time(req.pid) == Some(p.start_time))
        };
        let id = match adopted {
            Some((id, p)) if same_process(&p) => {
                // The configuration may have changed since the adoption (a reload, a declared
                // tenant): the process comes back only as the rules in force admit it. Refused,
                // it stays adopted, its memory booked, until it ends.
                if let Some(e) = st.broker.rule_broken(id) {
                    return Err(admission(e.reason(), e.to_string()));
                }
                st.pending.remove(&id);
                if let Some(r) = resume {
                    settle(st, id, r, granularity);
                }
                id
            }
            Some((_, p)) => {
                return Err(admission(
                    "name_in_use",
                    format!(
                    "tenant name `{}` is held by pid {}, adopted after a daemon restart and not \
                     reconnected yet",
                    req.name, p.pid
                ),
                ))
            }
            None => {
                let process = Process {
                    pid: req.pid,
                    uid: req.uid,
                    start_time: super::state::process_start_time(req.pid).unwrap_or(0),
                };
                // What the driver showed of this process before it was a tenant (its context,
                // made before its first allocation) is its own from now on, not outside use
                // standing in the way of its own guarantee.
                let own = st.outside_of(req.pid);
                let outside = st.broker.outside_use();
                st.broker.set_outside_use(outside.saturating_sub(own));
                let id = match st.broker.connect(req) {
                    Ok(id) => id,
                    Err(e) => {
                        st.broker.set_outside_use(outside);
                        return Err(admission(e.reason(), e.to_string()));
                    }
                };
                st.claim_outside(id, process.pid, own);
                st.processes.insert(id, process);
                if let Some(r) = resume {
                    settle(st, id, r, granularity);
                }
                id
            }
        };
        st.conn_of.insert(id, conn);
        st.dirty = true;
        let tenant = st.broker.tenant(id).expect("just connected").clone();
        self.pool.set_room(st.broker.free());
        Ok((id, tenant))
    }

    /// An invitation for one process of `uid` to join `tenant` (see [`Slot::join`]). Only for a
    /// tenant that holds nothing and has no program joined: what a joined program's tenant holds
    /// goes back when the program's connection closes, so it must all be the program's.
    pub fn invite(&self, tenant: TenantId, uid: u32) -> Result<String, ErrorReply> {
        let token = random_token().map_err(|e| ErrorReply {
            code: ErrorCode::Device,
            reason: None,
            message: format!("cannot make an invitation token: {e}"),
        })?;
        let mut s = self.lock();
        let refuse = |message: String| ErrorReply {
            code: ErrorCode::Admission,
            reason: None,
            message,
        };
        if let Some(p) = s
            .processes
            .get(&tenant)
            .filter(|_| s.members.contains_key(&tenant))
        {
            return Err(refuse(format!(
                "no invitation: a program (pid {}) has joined this tenant already",
                p.pid
            )));
        }
        let Some(t) = s.broker.tenant(tenant) else {
            // Its registration ended (a joined program's connection outlives it): an invitation
            // to a tenant that no longer exists would never be taken or removed.
            return Err(refuse("no invitation: the tenant has ended".into()));
        };
        if t.held > Bytes::ZERO || t.charged > Bytes::ZERO {
            return Err(refuse(format!(
                "no invitation: the tenant holds {} and has charged {}; invitations are for a \
                 tenant that holds nothing yet",
                t.held, t.charged
            )));
        }
        if s.shared.core.holds_anything(tenant) {
            return Err(refuse(
                "no invitation: the tenant owns a shared buffer, pins a version or holds a \
                 writer lease; invitations are for a tenant that holds nothing yet"
                    .into(),
            ));
        }
        s.invitations.retain(|_, (t, _)| *t != tenant);
        s.invitations.insert(token.clone(), (tenant, uid));
        Ok(token)
    }

    /// Whether connection `conn` of `tenant` may take memory: not while a program it invited is
    /// joined, whose memory side the tenant is then (and whose connection's close takes back all
    /// the tenant holds).
    pub fn memory_side(&self, tenant: TenantId, conn: u64) -> Result<(), ErrorReply> {
        memory_side(&self.lock(), tenant, conn)
    }

    /// Whether an invitation with this token waits here.
    pub fn has_invitation(&self, token: &str) -> bool {
        self.lock().invitations.contains_key(token)
    }

    /// The process on connection `conn` takes the memory side of the tenant it was invited to:
    /// its grants, reclaim requests and driver figures are that process's from now on.
    pub fn join(
        &self,
        token: &str,
        pid: u32,
        uid: u32,
        conn: u64,
    ) -> Result<(TenantId, Tenant), ErrorReply> {
        let refuse = |message: String| ErrorReply {
            code: ErrorCode::Admission,
            reason: None,
            message,
        };
        let mut s = self.lock();
        let st = &mut *s;
        let Some(&(id, invited_uid)) = st.invitations.get(token) else {
            return Err(refuse(
                "no such invitation (already taken, or its tenant is gone)".into(),
            ));
        };
        if invited_uid != uid {
            return Err(refuse(format!(
                "the invitation is for uid {invited_uid}; this process runs as uid {uid}"
            )));
        }
        let Some(holder) = st.processes.get(&id).copied() else {
            st.invitations.remove(token);
            return Err(refuse("the invited tenant is gone".into()));
        };
        // A tenant adopted after a restart has no registering connection any more; its process
        // (`vramd run`) is still what the tenant falls back to.
        let holder_conn = st.conn_of.get(&id).copied();
        // What the tenant holds goes back when the program's connection closes: it must all be
        // the program's, none its registering connection's (an adopted tenant's is the program's
        // from before the restart).
        if let (Some(_), Some(t)) = (holder_conn, st.broker.tenant(id)) {
            if t.held > Bytes::ZERO || t.charged > Bytes::ZERO {
                // The invitation stays: the program may join once the tenant holds nothing.
                return Err(refuse(format!(
                    "the invited tenant holds {} and has charged {}: a program joins a tenant \
                     that holds nothing",
                    t.held, t.charged
                )));
            }
            if st.shared.core.holds_anything(id) {
                return Err(refuse(
                    "the invited tenant owns a shared buffer, pins a version or holds a writer \
                     lease: a program joins a tenant that holds nothing"
                        .into(),
                ));
            }
        }
        st.invitations.remove(token);
        st.pending.remove(&id);
        let member = Process {
            pid,
            uid,
            start_time: super::state::process_start_time(pid).unwrap_or(0),
        };
        // What the driver showed of the process so far (its context) is the tenant's now.
        let own = st.outside_of(pid);
        let outside = st.broker.outside_use();
        st.broker.set_outside_use(outside.saturating_sub(own));
        st.claim_outside(id, pid, own);
        st.members.insert(id, (holder_conn, holder));
        st.conn_of.insert(id, conn);
        st.processes.insert(id, member);
        st.broker.set_pid(id, pid);
        st.dirty = true;
        let tenant = st
            .broker
            .tenant(id)
            .expect("invited tenant is connected")
            .clone();
        Ok((id, tenant))
    }

    /// The joined process of `tenant` ended: everything it held goes back, as at a crash, and the
    /// tenant is the registering process's again. Returns what it held and the handles released.
    pub fn member_gone(&self, tenant: TenantId) -> (Bytes, usize) {
        let (handles, who) = {
            let mut s = self.lock();
            (take_grants(&mut s, tenant), s.keeper(tenant))
        };
        let n = handles.len();
        let (handles, reached) = self.split_reached(handles, EXIT_PATIENCE);
        // The memory first, the books after (see `give_back`).
        drop(handles);
        drop(self.pool.forget(tenant.0));
        let mut s = self.lock();
        let st = &mut *s;
        st.keep(&who, reached);
        let held = st.broker.tenant(tenant).map_or(Bytes::ZERO, Tenant::total);
        // Its shared buffers with every version, its pins and its lease: all the program's.
        let shared = st.shared.disconnect(&mut st.broker, tenant);
        st.broker.release_all(tenant);
        if let Some((conn, holder)) = st.members.remove(&tenant) {
            match conn {
                Some(conn) => {
                    st.conn_of.insert(tenant, conn);
                }
                // Nobody speaks for the tenant now: it waits, adopted, for its process to end.
                None => {
                    st.conn_of.remove(&tenant);
                    st.pending.insert(tenant, holder);
                }
            }
            st.processes.insert(tenant, holder);
            st.broker.set_pid(tenant, holder.pid);
        }
        st.dirty = true;
        self.pool.set_room(st.broker.free());
        // The versions' memory goes outside the lock, before the grants waiting for it wake.
        self.unlock_then_wake(s, || {
            drop(shared);
            self.book_let_go();
        });
        (held, n)
    }

    /// Takes over a tenant of the daemon before from the state it left: its books as they were,
    /// awaiting its reconnect. A process that is gone is not adopted (its memory went with it).
    pub fn adopt(&self, t: &super::state::SavedTenant) -> Result<TenantId, String> {
        if !super::state::still_running(t.pid, t.start_time) {
            return Err(format!("pid {} is gone, its memory with it", t.pid));
        }
        let req = TenantRequest {
            name: t.name.clone(),
            class: Some(t.class.clone()),
            guarantee: Some(t.guarantee),
            limit: Some(t.limit),
            pid: t.pid,
            uid: t.uid,
            gids: super::peer::groups_of(t.pid, None),
        };
        let mut s = self.lock();
        let st = &mut *s;
        // The configuration may have changed meanwhile: what it no longer allows is said, and the
        // process keeps what it holds, booked, without a guarantee. Whether it may reconnect is
        // decided when it does (`Broker::rule_broken`); refused, its memory stays booked until
        // it ends.
        let id = match st.broker.connect_adopted(req).map_err(|e| e.to_string())? {
            (id, None) => id,
            (id, Some(e)) => {
                tracing::warn!(
                    tenant = t.name,
                    "adopted without its guarantee, its memory booked until it ends: {e}"
                );
                id
            }
        };
        let held = t.grants.iter().map(|g| g.1).sum();
        st.broker.adopt(id, held, t.charged);
        for &(grant, size) in &t.grants {
            st.adopted.insert(grant, (id, size));
        }
        if let Some(token) = &t.invitation {
            st.invitations.insert(token.clone(), (id, t.uid));
        }
        let p = Process {
            pid: t.pid,
            uid: t.uid,
            start_time: t.start_time,
        };
        st.pending.insert(id, p);
        st.processes.insert(id, p);
        st.dirty = true;
        self.pool.set_room(st.broker.free());
        Ok(id)
    }

    /// Drops adopted tenants whose process is gone without reconnecting; their names and what
    /// was booked to them.
    pub fn reap_pending(&self) -> Vec<(String, Bytes)> {
        let gone: Vec<TenantId> = {
            let s = self.lock();
            s.pending
                .iter()
                .filter(|(_, p)| !super::state::still_running(p.pid, p.start_time))
                .map(|(id, _)| *id)
                .collect()
        };
        gone.into_iter()
            .filter_map(|id| self.disconnect(id))
            .map(|(t, _)| {
                let total = t.total();
                (t.name, total)
            })
            .collect()
    }

    /// The slot's part of the state file, and whether it changed since the last call.
    pub fn saved(&self) -> (u64, Vec<super::state::SavedTenant>, bool) {
        let mut s = self.lock();
        let dirty = std::mem::take(&mut s.dirty);
        let mut grants: HashMap<TenantId, Vec<(GrantId, Bytes)>> = HashMap::new();
        for (id, (t, h)) in &s.grants {
            grants.entry(*t).or_default().push((*id, h.size()));
        }
        for (id, (t, size)) in &s.adopted {
            grants.entry(*t).or_default().push((*id, *size));
        }
        let tenants = s
            .broker
            .tenants()
            .filter_map(|(id, t)| {
                let p = s.processes.get(&id)?;
                let mut g = grants.remove(&id).unwrap_or_default();
                g.sort();
                Some(super::state::SavedTenant {
                    gpu: self.index,
                    uuid: self.device.info().uuid.clone(),
                    name: t.name.clone(),
                    class: t.class.clone(),
                    guarantee: t.guarantee,
                    limit: t.limit,
                    pid: p.pid,
                    uid: p.uid,
                    start_time: p.start_time,
                    grants: g,
                    charged: t.charged,
                    invitation: s
                        .invitations
                        .iter()
                        .find(|(_, (tenant, _))| *tenant == id)
                        .map(|(token, _)| token.clone()),
                })
            })
            .collect();
        (s.next_grant, tenants, dirty)
    }

    /// Grant ids and shared-buffer ids start at `next` (above any a daemon before gave).
    pub fn start_ids_at(&self, next: u64) {
        let mut s = self.lock();
        s.next_grant = s.next_grant.max(next);
        s.shared.core.start_ids_at(next);
    }

    /// Grants handles of `sizes` (each rounded up to the granularity) to `tenant`'s connection
    /// `conn`, in order: all of them or none. The books first, size by size: when memory is
    /// short, tenants with idle memory are asked to give it back, and the request waits up to
    /// `timeout` in all for them. Then the handles, from the pool
    /// ([`super::pool::Pool::take_many`]).
    pub fn grant_many(
        &self,
        tenant: TenantId,
        conn: u64,
        sizes: &[Bytes],
        timeout: std::time::Duration,
        reclaim: &dyn ReclaimSender,
    ) -> Result<Vec<(GrantId, Bytes, std::os::fd::OwnedFd)>, ErrorReply> {
        let deadline = Instant::now() + timeout;
        let mut booked = Vec::with_capacity(sizes.len());
        for (i, &bytes) in sizes.iter().enumerate() {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.book(tenant, conn, bytes, left, reclaim) {
                Ok(size) => booked.push(size),
                Err(mut e) => {
                    self.unbook(tenant, &booked);
                    if sizes.len() > 1 {
                        // The refusal's figures are this handle's, with the request's handles
                        // before it counted as held: say which part of the request it was.
                        let total = sizes.iter().fold(Bytes::ZERO, |a, b| a.saturating_add(*b));
                        e.message = format!(
                            "{} (handle {} of a request for {total} in {} handles; none of it \
                             is granted)",
                            e.message,
                            i + 1,
                            sizes.len()
                        );
                    }
                    return Err(e);
                }
            }
        }
        let total: Bytes = booked.iter().copied().sum();
        let readies = match self.pool.take_many(tenant.0, &booked) {
            Ok(r) => r,
            Err(e) => {
                self.unbook(tenant, &booked);
                return Err(ErrorReply {
                    code: ErrorCode::Device,
                    reason: None,
                    message: format!("the device could not create {total}: {e}"),
                });
            }
        };
        let mut s = self.lock();
        if s.broker.tenant(tenant).is_none() || !s.conn_of.contains_key(&tenant) {
            // The tenant ended while the handles were made (withdrawn, or the connection that
            // registered it closed; `disconnect` takes it out of `conn_of` first and out of the
            // broker after its handles are let go): its books go with it, and so does this
            // memory.
            drop(s);
            drop(readies);
            return Err(ErrorReply {
                code: ErrorCode::NotRegistered,
                reason: None,
                message: format!(
                    "the tenant ended while {total} was being granted; nothing is granted"
                ),
            });
        }
        Ok(readies
            .into_iter()
            .zip(booked)
            .map(|(Ready { handle, fd }, size)| {
                // An id a resuming tenant claims (`settle`) is never given to a new grant: a
                // return of the claim would take that grant's handle.
                let mut id = GrantId(s.next_grant);
                while s.adopted.contains_key(&id) {
                    id.0 += 1;
                }
                s.next_grant = id.0 + 1;
                // The grant table keeps the handle; the caller sends the fd.
                s.grants.insert(id, (tenant, handle));
                s.dirty = true;
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
        self.unlock_and_wake(s);
    }

    /// Books `bytes` (rounded up to the granularity) for `tenant`, asking tenants with idle memory
    /// for it first when it does not fit; returns the rounded size.
    fn book(
        &self,
        tenant: TenantId,
        conn: u64,
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
        self.reserve(tenant, conn, size, Booking::Grant, timeout, reclaim)?;
        Ok(size)
    }

    /// Books memory the tenant created itself, as [`Slot::grant_many`] books a grant (asking
    /// tenants with idle memory first when it does not fit), without a handle.
    pub fn charge(
        &self,
        tenant: TenantId,
        conn: u64,
        bytes: Bytes,
        timeout: std::time::Duration,
        reclaim: &dyn ReclaimSender,
    ) -> Result<(), ErrorReply> {
        self.reserve(tenant, conn, bytes, Booking::Charge, timeout, reclaim)
    }

    /// Takes back a charge; memory coming back wakes grants waiting on a reclaim.
    pub fn uncharge(&self, tenant: TenantId, bytes: Bytes) {
        let mut s = self.lock();
        s.broker.uncharge(tenant, bytes);
        s.dirty = true;
        self.pool.set_room(s.broker.free());
        if s.waiting > 0 {
            self.returned.notify_all();
        }
    }

    /// Counts a refusal the tenant's library made itself.
    pub fn count_refusal(&self, tenant: TenantId, reason: &str) {
        self.lock().broker.count_refusal(tenant, reason);
    }

    /// The tenant's memory as booked, and what it could still get now.
    pub fn budget(&self, tenant: TenantId) -> Option<vram_proto::Budget> {
        let s = self.lock();
        let t = s.broker.tenant(tenant)?;
        let total = t.total();
        let room = t.limit.saturating_sub(total);
        let within_guarantee = t.guarantee.saturating_sub(total);
        Some(vram_proto::Budget {
            limit: t.limit,
            guarantee: t.guarantee,
            held: t.held,
            charged: t.charged,
            outside: t.outside,
            available: room.min(within_guarantee.saturating_add(s.broker.free())),
        })
    }

    /// Books `size` for `tenant`'s connection `conn` as `how` says, asking tenants with idle
    /// memory for it first when it does not fit. Refused if a program has joined the tenant
    /// meanwhile (the tenant's memory is then the program's: [`Slot::memory_side`]).
    ///
    /// A tenant whose own grant waits on a reclaim cannot answer an ask until that wait ends: its
    /// connection's requests are served one at a time, and its allocator is busy growing. Two
    /// such tenants asking each other would both wait out the timeout, and one be refused although
    /// the memory was there. So a waiting tenant of the asker's priority or above is not asked
    /// (the asker is refused at once where no one else can help, and the waiting one's ask is
    /// then answered), and one of lower priority is told to give way: its wait ends at once,
    /// refused with reason `gave_way`, and it answers the ask.
    fn reserve(
        &self,
        tenant: TenantId,
        conn: u64,
        size: Bytes,
        how: Booking,
        timeout: std::time::Duration,
        reclaim: &dyn ReclaimSender,
    ) -> Result<(), ErrorReply> {
        let mut s = self.lock();
        if s.broker.check_grant(tenant, size).is_err() {
            let (plan, unwaited) = s.reclaim_asks(tenant, size);
            let unwaited = conns_of(&s, &unwaited);
            if plan.is_empty() && !unwaited.is_empty() {
                drop(s);
                for (conn, b) in unwaited {
                    reclaim.ask(conn, b);
                }
                s = self.lock();
            } else if !plan.is_empty() {
                let mut gave_way = false;
                for ask in &plan {
                    if let Some(w) = s.waiters.get_mut(&ask.tenant) {
                        w.give_way = true;
                        gave_way = true;
                    }
                }
                if gave_way {
                    self.returned.notify_all();
                }
                let targets = conns_of(&s, &plan);
                // Waiting from before the asks go out, so that no one's plan counts on this
                // tenant's answer in the meantime.
                s.waiters.entry(tenant).or_default().waits += 1;
                let asking = Instant::now();
                drop(s);
                for (conn, b) in targets.into_iter().chain(unwaited) {
                    reclaim.ask(conn, b);
                }
                s = self.lock();
                let asked = Instant::now();
                let deadline = asked + timeout;
                s.waiting += 1;
                let (mut gone, mut yielded) = (false, false);
                while s.broker.check_grant(tenant, size).is_err() {
                    let left = deadline.saturating_duration_since(Instant::now());
                    yielded = s.waiters.get(&tenant).is_some_and(|w| w.give_way);
                    if left.is_zero() || yielded {
                        break;
                    }
                    s = self
                        .returned
                        .wait_timeout(s, left.min(LOOK_EVERY))
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                    gone = reclaim.asker_gone();
                    if gone {
                        break;
                    }
                }
                s.waiting -= 1;
                if let Some(w) = s.waiters.get_mut(&tenant) {
                    w.waits -= 1;
                    if w.waits == 0 {
                        s.waiters.remove(&tenant);
                    }
                }
                if yielded && s.broker.check_grant(tenant, size).is_err() {
                    reclaim.settled(false, asked.elapsed());
                    return Err(ErrorReply {
                        code: ErrorCode::Refused,
                        reason: Some("gave_way".into()),
                        message: format!(
                            "{size} could not wait for idle memory to come back: a tenant of \
                             higher priority asked this one for its own idle memory, which it \
                             gives back only once this request ends; nothing is booked"
                        ),
                    });
                }
                if gone {
                    return Err(ErrorReply {
                        code: ErrorCode::NotRegistered,
                        reason: None,
                        message: format!(
                            "the tenant's connection ended while {size} waited for memory to \
                             come back; nothing is booked"
                        ),
                    });
                }
                let satisfied = s.broker.check_grant(tenant, size).is_ok();
                if !satisfied {
                    for ask in &plan {
                        let gave = s.returned_at.get(&ask.tenant).is_some_and(|t| *t >= asking);
                        if !gave {
                            s.unfruitful.insert(ask.tenant, Instant::now());
                        }
                    }
                }
                reclaim.settled(satisfied, asked.elapsed());
            }
        }
        memory_side(&s, tenant, conn)?;
        match how {
            Booking::Grant => s.broker.grant(tenant, size),
            Booking::Charge => s.broker.charge(tenant, size),
        }
        .map_err(|e| refused(&e))?;
        if matches!(how, Booking::Charge) {
            s.dirty = true;
        }
        self.pool.set_room(s.broker.free());
        Ok(())
    }

    /// Takes grants back. Every id must belong to `tenant`; otherwise nothing is taken.
    pub fn give_back(
        &self,
        tenant: TenantId,
        ids: &[GrantId],
    ) -> Result<(Bytes, Bytes), ErrorReply> {
        let mut s = self.lock();
        let ours = |s: &State, id: &GrantId| {
            matches!(s.grants.get(id), Some((t, _)) if *t == tenant)
                || matches!(s.adopted.get(id), Some((t, _)) if *t == tenant)
        };
        if let Some(bad) = ids.iter().find(|id| !ours(&s, id)) {
            return Err(ErrorReply {
                code: ErrorCode::UnknownGrant,
                reason: None,
                message: format!("grant {} is not held by this tenant", bad.0),
            });
        }
        let mut handles = Vec::with_capacity(ids.len());
        let mut bytes = Bytes::ZERO;
        let mut adopted = Bytes::ZERO;
        for id in ids {
            if let Some((_, h)) = s.grants.remove(id) {
                bytes += h.size();
                handles.push((*id, h));
            } else if let Some((_, size)) = s.adopted.remove(id) {
                // Its memory was the daemon before's: it is gone with the tenant's import.
                adopted += size;
            }
        }
        s.dirty = true;
        if adopted > Bytes::ZERO {
            s.broker.release(tenant, adopted);
        }
        let who = s.keeper(tenant);
        drop(s);
        let (handles, reached) = self.split_reached(handles, std::time::Duration::ZERO);
        let mut s = self.lock();
        let kept_bytes: Bytes = reached.iter().map(|(_, h)| h.size()).sum();
        if !reached.is_empty() {
            // From held to kept; the return itself is counted with the rest of it below.
            s.broker.unhold(tenant, kept_bytes);
            bytes -= kept_bytes;
            let name = s.broker.tenant(tenant).map(|t| t.name.clone());
            let n = reached.len();
            s.keep(&who, reached);
            if let Some(more) = s.kept_warnings.due() {
                tracing::warn!(
                    tenant = name.as_deref().unwrap_or(""), gpu = self.index, handles = n,
                    kept = %kept_bytes, more,
                    "tenant gave back memory its process still reaches (a descriptor or a \
                     mapping kept): it stays booked to the tenant until it is really gone"
                );
            }
        }
        // The room the pool will have once these bytes are back in the books.
        let room = s.broker.free() + bytes;
        drop(s);
        // The memory first, the books after: a grant the books allow must find the memory free
        // (or pooled, which gives way), never still on its way back. Each handle is kept for
        // this tenant's own next grants, or released; never given to anyone else, so an import
        // it kept reaches nobody else's data.
        let exported: Vec<Ready> = handles
            .into_iter()
            .filter_map(|(_, handle)| {
                Some(Ready {
                    fd: self.device.export(&handle).ok()?,
                    handle,
                })
            })
            .collect();
        // Kept only while the tenant is connected, checked under the lock its disconnect forgets
        // its recycled handles under: kept for a tenant gone, they would wait for nobody.
        let unkept: Vec<Ready> = {
            let s = self.lock();
            match s.broker.tenant(tenant) {
                Some(_) => exported
                    .into_iter()
                    .filter_map(|r| self.pool.recycle(tenant.0, r, room))
                    .collect(),
                None => exported,
            }
        };
        drop(unkept);
        let mut s = self.lock();
        s.broker.release(tenant, bytes);
        if bytes > Bytes::ZERO || adopted > Bytes::ZERO || kept_bytes > Bytes::ZERO {
            s.returned_at.insert(tenant, Instant::now());
            s.unfruitful.remove(&tenant);
        }
        let held = s.broker.tenant(tenant).map_or(Bytes::ZERO, |t| t.held);
        self.pool.set_room(s.broker.free());
        self.unlock_and_wake(s);
        Ok((bytes, held))
    }

    pub fn report_usage(&self, tenant: TenantId, in_use: Bytes, cached: Bytes) {
        self.lock().broker.report_usage(tenant, in_use, cached);
    }

    /// The tenant is gone: everything it held goes back at once. Returns its final state and the
    /// number of handles released.
    pub fn disconnect(&self, tenant: TenantId) -> Option<(Tenant, usize)> {
        let handles = {
            let mut s = self.lock();
            s.conn_of.remove(&tenant);
            s.pending.remove(&tenant);
            s.returned_at.remove(&tenant);
            s.unfruitful.remove(&tenant);
            s.processes.remove(&tenant);
            s.members.remove(&tenant);
            s.invitations.retain(|_, (t, _)| *t != tenant);
            (take_grants(&mut s, tenant), s.keeper(tenant))
        };
        let (handles, who) = handles;
        let n = handles.len();
        let (handles, reached) = self.split_reached(handles, EXIT_PATIENCE);
        // The memory first, the books after (see `give_back`).
        drop(handles);
        let mut s = self.lock();
        let st = &mut *s;
        // Counted under its name and uid once the broker lets the tenant go.
        st.keep(&who, reached);
        let shared = st.shared.disconnect(&mut st.broker, tenant);
        let state = st.broker.disconnect(tenant);
        // Under the lock with the broker's disconnect, so that a return racing this one either
        // recycled before (and is forgotten here) or finds the tenant gone (see `give_back`).
        let recycled = self.pool.forget(tenant.0);
        self.pool.set_room(s.broker.free());
        // The versions' memory goes outside the lock, before the grants waiting for it wake.
        self.unlock_then_wake(s, || {
            drop(recycled);
            drop(shared);
            self.book_let_go();
        });
        state.map(|t| (t, n))
    }

    /// The connections the given tenants speak on (those still connected).
    pub fn conns_of_tenants(&self, tenants: &[TenantId]) -> Vec<u64> {
        let s = self.lock();
        tenants
            .iter()
            .filter_map(|t| s.conn_of.get(t).copied())
            .collect()
    }

    /// The tenants that the rules in force no longer admit (a new configuration changed who may
    /// be which tenant), by name, with the rule each breaks.
    pub fn breaking_rules(&self) -> Vec<(String, String)> {
        let s = self.lock();
        s.broker
            .breaking_rules()
            .into_iter()
            .filter_map(|(id, e)| Some((s.broker.tenant(id)?.name.clone(), e.to_string())))
            .collect()
    }

    /// Splits `handles` into those no other process reaches (or the device cannot tell) and
    /// those some process still reaches. Where some are reached, asks again for up to `patience`
    /// (a process that is exiting closes its descriptors after its socket).
    fn split_reached(
        &self,
        handles: Vec<Granted>,
        patience: std::time::Duration,
    ) -> (Vec<Granted>, Vec<Granted>) {
        let reached = |(_, h): &(GrantId, Handle)| self.device.reached_elsewhere(h) == Some(true);
        let (mut free, mut kept): (Vec<_>, Vec<_>) = handles.into_iter().partition(|h| !reached(h));
        let until = Instant::now() + patience;
        let mut pause = std::time::Duration::from_millis(1);
        while !kept.is_empty() && Instant::now() < until {
            std::thread::sleep(pause.min(until.saturating_duration_since(Instant::now())));
            pause *= 2;
            let (gone, still): (Vec<_>, Vec<_>) = kept.into_iter().partition(|h| !reached(h));
            free.extend(gone);
            kept = still;
        }
        (free, kept)
    }

    /// Releases the kept handles no process reaches any more, and books them back; returns
    /// (tenant, uid, bytes) for each tenant whose kept memory came back.
    pub fn sweep_kept(&self) -> Vec<(String, u32, Bytes)> {
        self.book_let_go();
        let candidates: Vec<(u64, Arc<Handle>)> = {
            let s = self.lock();
            s.kept.iter().map(|(n, k)| (*n, k.handle.clone())).collect()
        };
        let gone: Vec<u64> = candidates
            .iter()
            .filter(|(_, h)| self.device.reached_elsewhere(h) != Some(true))
            .map(|(n, _)| *n)
            .collect();
        drop(candidates);
        if gone.is_empty() {
            return Vec::new();
        }
        let leaving: Vec<Kept> = {
            let mut s = self.lock();
            gone.iter().filter_map(|n| s.kept.remove(n)).collect()
        };
        let mut back: BTreeMap<(String, u32), Bytes> = BTreeMap::new();
        for k in &leaving {
            *back.entry((k.name.clone(), k.uid)).or_default() += k.handle.size();
        }
        // The memory first, the books after (see `give_back`).
        drop(leaving);
        let mut s = self.lock();
        for ((name, uid), bytes) in &back {
            s.broker.take_kept(name, *uid, *bytes);
        }
        self.pool.set_room(s.broker.free());
        self.unlock_and_wake(s);
        back.into_iter().map(|((n, u), b)| (n, u, b)).collect()
    }

    /// The books as the driver should see them: what the daemon created, and each tenant's pid
    /// with what it holds. Grants adopted after a restart count as created: their memory is on
    /// the device, kept by the tenant's imports, as a grant of this daemon's is by its handle.
    pub fn books(&self) -> vram_core::books::Books {
        let s = self.lock();
        let adopted: Bytes = s.adopted.values().map(|&(_, size)| size).sum();
        vram_core::books::Books {
            daemon_pid: std::process::id(),
            created: self.device.used().saturating_add(adopted),
            tenants: s
                .broker
                .tenants()
                .map(|(id, t)| vram_core::books::BooksTenant {
                    id,
                    pid: t.pid,
                    name: t.name.clone(),
                    held: t.held,
                    charged: t.charged,
                    guarantee: t.guarantee,
                })
                .collect(),
        }
    }

    /// Books a reconciled reading of the driver: each tenant's memory outside its grants, the
    /// outside use nobody may borrow. Pooled memory beyond what is free then is given up, and
    /// borrowers are asked for idle memory while a promise is broken.
    pub fn apply_reading(&self, used: Bytes, r: &vram_core::books::Reconciled) -> Applied {
        let mut s = self.lock();
        for (id, bytes) in &r.tenant_outside {
            s.broker.set_tenant_outside(*id, *bytes);
        }
        s.broker.set_outside_use(r.outside_use);
        let deficit = s.broker.deficit();
        let at_risk = s.broker.at_risk();
        let was_at_risk = s.driver.as_ref().is_some_and(|d| d.at_risk);
        let mut asks = if deficit > Bytes::ZERO {
            conns_of(&s, &s.broker.deficit_plan())
        } else {
            Vec::new()
        };
        // A tenant whose own memory (its context, seen only now) took it past its limit gives
        // back what it has idle, up to the excess.
        let over: Vec<ReclaimAsk> = s
            .broker
            .tenants()
            .filter_map(|(id, t)| {
                let excess = t.total().saturating_sub(t.limit).min(t.cached);
                (excess > Bytes::ZERO).then_some(ReclaimAsk {
                    tenant: id,
                    bytes: excess,
                })
            })
            .collect();
        asks.extend(conns_of(&s, &over));
        s.driver = Some(DriverView {
            used,
            unattributed: r.unattributed,
            outside_processes: r
                .outside_processes
                .iter()
                .map(|p| vram_proto::OutsideProcess {
                    pid: p.pid,
                    name: p.name.clone(),
                    bytes: p.bytes.unwrap_or(Bytes::ZERO),
                })
                .collect(),
            at_risk: !at_risk.is_empty(),
        });
        let free = s.broker.free();
        self.pool.set_room(free);
        // Outside use that went away is room a grant waiting on a reclaim may take.
        self.unlock_and_wake(s);
        self.pool.shrink_to(free);
        Applied {
            deficit,
            newly_at_risk: !at_risk.is_empty() && !was_at_risk,
            at_risk,
            asks,
        }
    }

    /// What the device may lend in all.
    pub fn capacity(&self) -> Bytes {
        self.lock().broker.capacity()
    }

    pub fn status(&self) -> (DeviceStatus, Vec<TenantStatus>) {
        let s = self.lock();
        let snap = s.broker.snapshot();
        let mut handles: BTreeMap<TenantId, u64> = BTreeMap::new();
        for (t, _) in s.grants.values() {
            *handles.entry(*t).or_default() += 1;
        }
        let (driver_used, unattributed, outside_processes) = match &s.driver {
            Some(d) => (Some(d.used), d.unattributed, d.outside_processes.clone()),
            None => (None, Bytes::ZERO, Vec::new()),
        };
        let kept_bytes: Bytes = s.kept.values().map(|k| k.handle.size()).sum();
        drop(s);
        let info = self.device.info();
        let device = DeviceStatus {
            index: self.index,
            uuid: info.uuid.clone(),
            name: info.name.clone(),
            backend: info.kind,
            capacity: snap.capacity,
            granularity: info.granularity,
            held: snap.held,
            pooled: self.pool.pooled(),
            reserved: snap.reserved,
            free: snap.free,
            device_used: self.device.used(),
            pool: self.pool.takes(),
            driver_used,
            outside_use: snap.outside_use,
            unattributed,
            outside_processes,
            deficit: snap.deficit,
            at_risk: snap.at_risk,
            kept: kept_bytes,
            kept_offline: snap
                .kept_offline
                .into_iter()
                .map(|(tenant, uid, bytes)| vram_proto::KeptOffline { tenant, uid, bytes })
                .collect(),
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
                charged: t.charged,
                outside: t.outside,
                kept: t.kept,
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
    /// Tenant `name` as a withdraw needs it: its id, its connections (its own, and the
    /// registering one of a tenant a process joined), what it holds now (grants and charges),
    /// and whether it is an adopted tenant whose process has not reconnected (no connection to
    /// close). `None`: no tenant of that name.
    pub fn connections_of(&self, name: &str) -> Option<(TenantId, Vec<u64>, Bytes, bool)> {
        let s = self.lock();
        let id = s.broker.id_of(name)?;
        let mut conns: Vec<u64> = s.conn_of.get(&id).copied().into_iter().collect();
        conns.extend(s.members.get(&id).and_then(|(c, _)| *c));
        let held = s
            .broker
            .tenant(id)
            .map_or(Bytes::ZERO, |t| t.held.saturating_add(t.charged));
        Some((id, conns, held, s.pending.contains_key(&id)))
    }
}

/// Settles an adopted tenant's books against what it says it holds: grants it no longer holds
/// (given back, or never received, as the daemon before stopped) are unbooked; grants it holds
/// that the books lack (the state file's last moments) are booked by the rules of a grant, as
/// they were then; charges likewise. What it claims beyond its rules is not booked, and said;
/// such a grant is still known as the tenant's, at no size, so that a return naming it is
/// taken. A claim is of whole granules (`granularity`), as every grant is, and a tenant is known
/// to hold at most as many grants as its limit has granules: claims past that are ignored, so
/// that an account cannot grow the daemon's books beyond what a tenant could hold.
fn settle(s: &mut State, id: TenantId, r: &Resume, granularity: Bytes) {
    let claimed: HashMap<GrantId, Bytes> = r.grants.iter().copied().collect();
    let known: Vec<(GrantId, Bytes)> = s
        .adopted
        .iter()
        .filter(|(_, (t, _))| *t == id)
        .map(|(g, (_, b))| (*g, *b))
        .collect();
    for (g, size) in &known {
        if !claimed.contains_key(g) {
            s.adopted.remove(g);
            s.broker.release(id, *size);
        }
    }
    let limit = s.broker.tenant(id).map_or(Bytes::ZERO, |t| t.limit);
    let most = usize::try_from(limit.get() / granularity.get().max(1)).unwrap_or(usize::MAX);
    let mut known = s.adopted.values().filter(|(t, _)| *t == id).count();
    let (mut ignored, mut unbooked, mut first_refusal) = (0usize, 0usize, None);
    for (g, size) in &r.grants {
        if s.grants.get(g).is_some_and(|(owner, _)| *owner != id) {
            // Another tenant's grant: not this one's to claim.
            ignored += 1;
            continue;
        }
        if s.adopted.contains_key(g) || s.grants.contains_key(g) || s.take_back_kept(id, *g) {
            continue;
        }
        let whole = *size > Bytes::ZERO && size.get() % granularity.get().max(1) == 0;
        if !whole || known >= most || unbooked >= MAX_UNBOOKED_CLAIMS {
            ignored += 1;
            continue;
        }
        known += 1;
        match s.broker.grant(id, *size) {
            Ok(()) => {
                s.adopted.insert(*g, (id, *size));
            }
            Err(e) => {
                // Known as the tenant's (a return naming it with others takes them all back),
                // booked at nothing.
                unbooked += 1;
                first_refusal.get_or_insert(e);
                s.adopted.insert(*g, (id, Bytes::ZERO));
            }
        }
    }
    if let Some(e) = first_refusal {
        tracing::warn!(
            grants = unbooked,
            "grants the tenant says it holds are not booked (the first: {e})"
        );
    }
    if ignored > 0 {
        tracing::warn!(
            grants = ignored,
            "grants the tenant claims are ignored: another tenant's, not whole granules, more \
             than its limit could hold, or past {MAX_UNBOOKED_CLAIMS} refused"
        );
    }
    let charged = s.broker.tenant(id).map_or(Bytes::ZERO, |t| t.charged);
    if r.charged < charged {
        s.broker.uncharge(id, charged - r.charged);
    } else if r.charged > charged {
        if let Err(e) = s.broker.charge(id, r.charged - charged) {
            tracing::warn!("memory the tenant says it charged is not booked: {e}");
        }
    }
}

/// The most claims of a reconnecting tenant that are refused (no room for them now) yet kept
/// as its, at nothing: what they cost is the daemon's (entries in its tables and its state
/// file), so a tenant claiming grants it never had cannot make it keep more.
const MAX_UNBOOKED_CLAIMS: usize = 1024;

/// How long a closing connection's handles that another process still reaches are asked about
/// again before they are booked as kept: enough for an exiting process to close its descriptors.
const EXIT_PATIENCE: std::time::Duration = std::time::Duration::from_millis(20);

/// Takes every grant of `tenant` out of the tables (its adopted ones too): the handles, for the
/// caller to drop outside the lock.
fn take_grants(s: &mut State, tenant: TenantId) -> Vec<Granted> {
    let ids: Vec<GrantId> = s
        .grants
        .iter()
        .filter(|(_, (t, _))| *t == tenant)
        .map(|(id, _)| *id)
        .collect();
    s.adopted.retain(|_, (t, _)| *t != tenant);
    s.dirty = true;
    ids.iter()
        .filter_map(|id| Some((*id, s.grants.remove(id)?.1)))
        .collect()
}

/// 128 random bits, in hex: an invitation nobody can guess.
fn random_token() -> std::io::Result<String> {
    use std::io::Read;
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// What a booking is for.
#[derive(Debug, Clone, Copy)]
enum Booking {
    /// A handle from the pool, granted.
    Grant,
    /// Memory the tenant created itself.
    Charge,
}

/// The connections of the tenants a reclaim plan asks.
/// See [`Slot::memory_side`]; under the slot's lock, so that a booking and a program's join
/// exclude each other.
fn memory_side(s: &State, tenant: TenantId, conn: u64) -> Result<(), ErrorReply> {
    if !s.conn_of.contains_key(&tenant) {
        // Being disconnected (its handles are let go before the broker forgets it): nothing
        // more may be booked to it.
        return Err(ErrorReply {
            code: ErrorCode::NotRegistered,
            reason: None,
            message: "the tenant is ending: its registration's connection closed".into(),
        });
    }
    match (
        s.members.get(&tenant),
        s.conn_of.get(&tenant),
        s.processes.get(&tenant),
    ) {
        (Some(_), Some(&member), Some(p)) if member != conn => Err(ErrorReply {
            code: ErrorCode::Refused,
            reason: Some("program_joined".into()),
            message: format!(
                "the tenant's memory is its joined program's (pid {}) while it runs; this \
                     connection keeps the registration only",
                p.pid
            ),
        }),
        _ => Ok(()),
    }
}

fn conns_of(s: &State, plan: &[ReclaimAsk]) -> Vec<(u64, Bytes)> {
    plan.iter()
        .filter_map(|ReclaimAsk { tenant, bytes }| Some((*s.conn_of.get(tenant)?, *bytes)))
        .collect()
}

fn refused(e: &GrantError) -> ErrorReply {
    ErrorReply {
        code: ErrorCode::Refused,
        reason: Some(e.reason().to_string()),
        message: e.to_string(),
    }
}
