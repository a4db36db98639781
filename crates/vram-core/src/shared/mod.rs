//! Shared buffers' books: named buffers, one writer lease at a time, versions that readers pin.
//! Pure state; the daemon creates, exports, checksums and releases the memory of each version and
//! calls in with what happened, passing the time in.
//!
//! A buffer's life: the owner creates it (no memory yet). A writer takes the lease (with a
//! time-to-live it renews), begins a write — a draft version in fresh memory, charged to the
//! owner through the [`Broker`] — fills it and publishes it with its checksum. Readers pin the
//! current published version and keep it until they release it, however many versions are
//! published meanwhile.
//!
//! Invariants kept by every method:
//! - a reader only ever pins a published version; a draft is visible to its writer alone;
//! - a version is freed only when it is neither current nor pinned (or its buffer's owner is gone);
//! - the broker holds, against each owner, exactly `size × live versions` of its buffers, so
//!   memory is counted once however many readers map it;
//! - a writer whose lease expired or was released loses its draft, which no one ever sees.

pub mod checksum;
mod error;
mod lease;
mod versions;

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

pub use checksum::{checksum, Checksummer};
pub use error::SharedError;

use crate::broker::{name_problem, Broker, DeclaredTenant, Policy, Tenant, TenantId};
use crate::Bytes;

/// A buffer's id, unique for the daemon's lifetime (a deleted name may be reused by a new buffer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct BufferId(pub u64);

/// A version of a buffer; published versions of one buffer strictly increase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Version(pub u64);

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "v{}", self.0)
    }
}

/// Who an access rule names.
///
/// A tenant's name and class are what its process asked for, so an entry admits a process of
/// another uid than the buffer owner's only where the operator bound the name or class to uids:
/// `Tenant(name)` a tenant declared with owners or groups, `Class(name)` a class above the
/// default class (whose `users` and `groups` alone may ask for it) held by a tenant not declared
/// without owners. An undeclared name is anyone's to take while its tenant is away, and a class
/// at or below the default anyone's to ask for: such entries admit the owner's uid only.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Principal {
    Tenant(String),
    Class(String),
    Anyone,
}

impl Principal {
    /// Whether `t` is who this entry names, on a buffer whose owner runs as `owner_uid`.
    fn matches(&self, t: &Tenant, owner_uid: u32, policy: &Policy) -> bool {
        let declared = policy.tenants.get(&t.name);
        let same_uid = t.uid == owner_uid;
        match self {
            Principal::Tenant(n) => {
                *n == t.name && (same_uid || declared.is_some_and(DeclaredTenant::has_owners))
            }
            Principal::Class(c) => {
                let bound = policy.class_is_restricted(c)
                    && declared.is_none_or(DeclaredTenant::has_owners);
                *c == t.class && (same_uid || bound)
            }
            Principal::Anyone => true,
        }
    }
}

/// Who besides the owner may read and write. Writers may also read.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Acl {
    pub readers: Vec<Principal>,
    pub writers: Vec<Principal>,
}

/// What the owner asks for at create.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferSpec {
    pub name: String,
    /// Bytes of each version (the daemon rounds it up to the device granularity first).
    pub size: Bytes,
    pub acl: Acl,
}

/// The writer lease, as others see it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseInfo {
    pub holder: String,
    /// When it runs out, on the caller's clock (milliseconds).
    pub expires_ms: u64,
}

/// A buffer as `open`, `list` and status show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferInfo {
    pub id: BufferId,
    pub name: String,
    pub size: Bytes,
    pub owner: String,
    pub acl: Acl,
    pub current: Option<Version>,
    pub checksum: Option<u64>,
    pub lease: Option<LeaseInfo>,
    /// Versions holding memory: current, pinned old ones, and a draft.
    pub versions: u32,
    /// Pins held by readers, over all versions.
    pub pins: u64,
    /// Memory held for this buffer (counted against the owner).
    pub bytes: Bytes,
    pub publishes: u64,
    /// Published versions the scrub found changed since publish.
    pub corrupt: Vec<Version>,
    /// Deleted, kept only until its pinned versions are released.
    pub deleted: bool,
}

/// A version whose memory the daemon may now release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Freed {
    pub buffer: BufferId,
    pub version: Version,
}

/// A published version, for the scrub.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PublishedVersion {
    pub buffer: BufferId,
    pub version: Version,
    pub size: Bytes,
    pub checksum: u64,
}

#[derive(Debug)]
struct VersionState {
    /// `None` while a draft.
    checksum: Option<u64>,
    pins: BTreeMap<TenantId, u32>,
    corrupt: bool,
}

#[derive(Debug)]
struct Lease {
    holder: TenantId,
    holder_name: String,
    expires_ms: u64,
    draft: Option<Version>,
}

#[derive(Debug)]
struct Buffer {
    name: String,
    size: Bytes,
    owner: TenantId,
    owner_name: String,
    /// The owner's uid, as the kernel gave it: access-list entries naming unbound names admit it
    /// only ([`Principal`]).
    owner_uid: u32,
    acl: Acl,
    current: Option<Version>,
    versions: BTreeMap<Version, VersionState>,
    lease: Option<Lease>,
    next_version: u64,
    publishes: u64,
    deleted: bool,
}

impl Buffer {
    fn can_read(&self, id: TenantId, t: &Tenant, policy: &Policy) -> bool {
        self.can_write(id, t, policy)
            || (self.acl.readers.iter()).any(|p| p.matches(t, self.owner_uid, policy))
    }

    fn can_write(&self, id: TenantId, t: &Tenant, policy: &Policy) -> bool {
        id == self.owner || (self.acl.writers.iter()).any(|p| p.matches(t, self.owner_uid, policy))
    }

    /// Whether `v` may go: not current, not pinned, not the live draft.
    fn unused(&self, v: Version) -> bool {
        let draft = self.lease.as_ref().and_then(|l| l.draft);
        let pinned = self.versions.get(&v).is_some_and(|s| !s.pins.is_empty());
        self.current != Some(v) && draft != Some(v) && !pinned
    }

    fn info(&self, id: BufferId) -> BufferInfo {
        self.info_with(id, self.acl.clone())
    }

    /// Its description with `acl` for its access list.
    fn info_with(&self, id: BufferId, acl: Acl) -> BufferInfo {
        BufferInfo {
            id,
            name: self.name.clone(),
            size: self.size,
            owner: self.owner_name.clone(),
            acl,
            current: self.current,
            checksum: self
                .current
                .and_then(|v| self.versions.get(&v))
                .and_then(|s| s.checksum),
            lease: self.lease.as_ref().map(|l| LeaseInfo {
                holder: l.holder_name.clone(),
                expires_ms: l.expires_ms,
            }),
            versions: self.versions.len() as u32,
            pins: self
                .versions
                .values()
                .flat_map(|s| s.pins.values())
                .map(|&n| u64::from(n))
                .sum(),
            bytes: Bytes(self.size.get() * self.versions.len() as u64),
            publishes: self.publishes,
            corrupt: self
                .versions
                .iter()
                .filter(|(_, s)| s.corrupt)
                .map(|(v, _)| *v)
                .collect(),
            deleted: self.deleted,
        }
    }
}

/// The most principals (readers and writers together) one buffer's access list may name.
pub const MAX_ACL_ENTRIES: usize = 256;
/// The most buffers one tenant may own on a device at a time (deleted ones still pinned count).
pub const MAX_BUFFERS_PER_TENANT: usize = 1024;

/// Every shared buffer of one device. See the module docs for the invariants.
#[derive(Debug, Default)]
pub struct SharedBuffers {
    buffers: BTreeMap<BufferId, Buffer>,
    by_name: HashMap<String, BufferId>,
    next_id: u64,
    leases_expired: u64,
    /// Versions freed when a lease was found expired, for the caller to take
    /// ([`SharedBuffers::take_expired`]) whatever the call that found it answered: a call that
    /// then fails (a late renew, a reader without the right) must not lose them.
    expired: Vec<Freed>,
}

impl SharedBuffers {
    pub fn new() -> SharedBuffers {
        SharedBuffers::default()
    }

    /// Buffer ids given from now on are above `next`: a client of an earlier daemon still holding
    /// an id of its buffers must not reach one of this daemon's by it.
    pub fn start_ids_at(&mut self, next: u64) {
        self.next_id = self.next_id.max(next.saturating_sub(1));
    }

    /// Creates an empty buffer owned by `owner`. No memory is taken until a version is written.
    pub fn create(
        &mut self,
        broker: &Broker,
        owner: TenantId,
        spec: BufferSpec,
    ) -> Result<BufferInfo, SharedError> {
        let t = tenant(broker, owner)?;
        if let Some(reason) = name_problem(&spec.name) {
            return Err(SharedError::BadName {
                name: spec.name,
                reason,
            });
        }
        if spec.size == Bytes::ZERO {
            return Err(SharedError::BadName {
                name: spec.name,
                reason: "a buffer of zero bytes",
            });
        }
        if let Some(other) = self.by_name.get(&spec.name) {
            return Err(SharedError::NameInUse {
                name: spec.name,
                owner: self.buffers[other].owner_name.clone(),
            });
        }
        // A buffer costs the daemon memory of its own before any version does: bounded, so that
        // one tenant cannot grow the daemon's heap without end. An entry names a tenant or class
        // as a name can be (else it could match nothing), once.
        for p in spec.acl.readers.iter().chain(&spec.acl.writers) {
            let (kind, n) = match p {
                Principal::Tenant(n) => ("tenant", n),
                Principal::Class(n) => ("class", n),
                _ => continue,
            };
            if let Some(reason) = name_problem(n) {
                return Err(SharedError::BadAccessEntry {
                    buffer: spec.name,
                    kind,
                    entry: n.clone(),
                    reason,
                });
            }
        }
        let mut spec = spec;
        for list in [&mut spec.acl.readers, &mut spec.acl.writers] {
            let mut seen = std::collections::HashSet::new();
            list.retain(|p| seen.insert(p.clone()));
        }
        let entries = spec.acl.readers.len() + spec.acl.writers.len();
        if entries > MAX_ACL_ENTRIES {
            return Err(SharedError::TooMany {
                buffer: spec.name,
                what: "entries in its access list",
                asked: entries,
                max: MAX_ACL_ENTRIES,
            });
        }
        let owned = self.buffers.values().filter(|b| b.owner == owner).count();
        if owned >= MAX_BUFFERS_PER_TENANT {
            return Err(SharedError::TooMany {
                buffer: spec.name,
                what: "buffers its owner has, with this one",
                asked: owned + 1,
                max: MAX_BUFFERS_PER_TENANT,
            });
        }
        self.next_id += 1;
        let id = BufferId(self.next_id);
        let buffer = Buffer {
            name: spec.name.clone(),
            size: spec.size,
            owner,
            owner_name: t.name.clone(),
            owner_uid: t.uid,
            acl: spec.acl,
            current: None,
            versions: BTreeMap::new(),
            lease: None,
            next_version: 1,
            publishes: 0,
            deleted: false,
        };
        let info = buffer.info(id);
        self.by_name.insert(spec.name, id);
        self.buffers.insert(id, buffer);
        Ok(info)
    }

    /// Finds a buffer by name, for a tenant that may read or write it.
    pub fn open(
        &mut self,
        broker: &mut Broker,
        who: TenantId,
        name: &str,
        now_ms: u64,
    ) -> Result<(BufferInfo, Vec<Freed>), SharedError> {
        let id = *self
            .by_name
            .get(name)
            .ok_or_else(|| SharedError::NoSuchBuffer(name.to_string()))?;
        self.expire_one(broker, id, now_ms);
        self.check(broker, who, id, "read")?;
        Ok((self.buffers[&id].info(id), Vec::new()))
    }

    /// The buffers `who` may read or write whose ids come after `after` (all when `None`), in
    /// id order, each made only when the caller takes it.
    pub fn list<'a>(
        &'a self,
        broker: &'a Broker,
        who: TenantId,
        after: Option<BufferId>,
    ) -> impl Iterator<Item = BufferInfo> + 'a {
        let from = match after {
            Some(id) => std::ops::Bound::Excluded(id),
            None => std::ops::Bound::Unbounded,
        };
        let tenant = broker.tenant(who);
        self.buffers
            .range((from, std::ops::Bound::Unbounded))
            .filter(move |(_, b)| {
                tenant.is_some_and(|t| !b.deleted && b.can_read(who, t, broker.policy()))
            })
            .map(|(id, b)| b.info(*id))
    }

    /// Every buffer, deleted ones still holding memory included (for status).
    pub fn all(&self) -> Vec<BufferInfo> {
        self.buffers.iter().map(|(id, b)| b.info(*id)).collect()
    }

    /// [`SharedBuffers::all`] with at most `acl_budget` access-list entries in all (readers
    /// first, in buffer order), each buffer beside the number of its entries left out: the
    /// status report copies the books under the device's lock, and a report carries only so many
    /// entries, so the copy costs what the report can show rather than every entry of every list.
    pub fn all_capped(&self, mut acl_budget: usize) -> Vec<(BufferInfo, u32)> {
        self.buffers
            .iter()
            .map(|(id, b)| {
                let keep_readers = acl_budget.min(b.acl.readers.len());
                let keep_writers = (acl_budget - keep_readers).min(b.acl.writers.len());
                acl_budget -= keep_readers + keep_writers;
                let left_out =
                    b.acl.readers.len() + b.acl.writers.len() - keep_readers - keep_writers;
                let acl = Acl {
                    readers: b.acl.readers[..keep_readers].to_vec(),
                    writers: b.acl.writers[..keep_writers].to_vec(),
                };
                let info = b.info_with(*id, acl);
                (info, u32::try_from(left_out).unwrap_or(u32::MAX))
            })
            .collect()
    }

    pub fn info(&self, id: BufferId) -> Option<BufferInfo> {
        self.buffers.get(&id).map(|b| b.info(id))
    }

    /// Deletes a buffer (owner only): its name goes at once, the lease and draft are dropped, and
    /// each version goes when its last pin does.
    pub fn delete(
        &mut self,
        broker: &mut Broker,
        who: TenantId,
        id: BufferId,
    ) -> Result<Vec<Freed>, SharedError> {
        let b = self.live(id)?;
        if b.owner != who {
            let t = tenant(broker, who)?;
            return Err(forbidden(b, t, "delete", ""));
        }
        Ok(self.remove(broker, id))
    }

    /// The tenant that owns buffer `id`.
    pub fn owner(&self, id: BufferId) -> Option<TenantId> {
        self.buffers.get(&id).map(|b| b.owner)
    }

    /// Whether `version` of `id` is held (a draft, current, or pinned).
    pub fn holds(&self, id: BufferId, version: Version) -> bool {
        self.buffers
            .get(&id)
            .is_some_and(|b| b.versions.contains_key(&version))
    }

    /// Checks that buffer `id` exists and `who` may read it.
    pub fn may_read(
        &self,
        broker: &Broker,
        who: TenantId,
        id: BufferId,
    ) -> Result<(), SharedError> {
        self.check(broker, who, id, "read")
    }

    /// The current published version of a buffer, for readers waiting for a newer one.
    pub fn current(&self, id: BufferId) -> Option<Version> {
        self.buffers.get(&id).and_then(|b| b.current)
    }

    /// Published versions still held, for the scrub.
    pub fn published(&self) -> Vec<PublishedVersion> {
        let mut out = Vec::new();
        for (id, b) in &self.buffers {
            for (v, s) in &b.versions {
                if let Some(checksum) = s.checksum {
                    out.push(PublishedVersion {
                        buffer: *id,
                        version: *v,
                        size: b.size,
                        checksum,
                    });
                }
            }
        }
        out
    }

    /// Marks `version` of `id` corrupt (the scrub, or a verify, found it changed since its
    /// publish). The first time: whom to tell, the buffer's owner and
    /// then each tenant that pinned the version; after that (the scrub finds it again) nobody.
    pub fn mark_corrupt(&mut self, id: BufferId, version: Version) -> Vec<TenantId> {
        let Some(b) = self.buffers.get_mut(&id) else {
            return Vec::new();
        };
        let owner = b.owner;
        let Some(s) = b.versions.get_mut(&version) else {
            return Vec::new();
        };
        if std::mem::replace(&mut s.corrupt, true) {
            return Vec::new();
        }
        let mut tell = vec![owner];
        tell.extend(s.pins.keys().filter(|t| **t != owner));
        tell
    }

    /// Whether `who` owns a buffer, pins a version or holds a lease: what [`Self::disconnect`]
    /// would take from it.
    pub fn holds_anything(&self, who: TenantId) -> bool {
        self.buffers.values().any(|b| {
            b.owner == who
                || b.lease.as_ref().is_some_and(|l| l.holder == who)
                || b.versions.values().any(|s| s.pins.contains_key(&who))
        })
    }

    /// `who`'s connection is gone: its pins and leases go, and the buffers it owned are deleted
    /// with every version (their memory was counted against it, which the broker forgets now).
    /// Call before [`Broker::disconnect`].
    pub fn disconnect(&mut self, broker: &mut Broker, who: TenantId) -> Vec<Freed> {
        let mut freed = Vec::new();
        let ids: Vec<BufferId> = self.buffers.keys().copied().collect();
        for id in ids {
            let b = self.buffers.get_mut(&id).expect("listed");
            if b.owner == who {
                freed.extend(self.remove(broker, id));
                // Pinned versions go too: nobody is left to count them against.
                if let Some(b) = self.buffers.remove(&id) {
                    for v in b.versions.keys() {
                        broker.release(who, b.size);
                        freed.push(Freed {
                            buffer: id,
                            version: *v,
                        });
                    }
                }
                continue;
            }
            let mut candidates: Vec<Version> = Vec::new();
            for (v, s) in &mut b.versions {
                if s.pins.remove(&who).is_some() {
                    candidates.push(*v);
                }
            }
            if b.lease.as_ref().is_some_and(|l| l.holder == who) {
                candidates.extend(b.lease.take().and_then(|l| l.draft));
            }
            for v in candidates {
                freed.extend(self.free_if_unused(broker, id, v));
            }
        }
        freed
    }

    /// Aggregates for status and metrics.
    pub fn totals(&self) -> SharedTotals {
        let mut t = SharedTotals {
            leases_expired: self.leases_expired,
            ..SharedTotals::default()
        };
        for b in self.buffers.values() {
            t.buffers += u64::from(!b.deleted);
            t.versions += b.versions.len() as u64;
            t.bytes += Bytes(b.size.get() * b.versions.len() as u64);
            t.pins += b
                .versions
                .values()
                .flat_map(|s| s.pins.values())
                .map(|&n| u64::from(n))
                .sum::<u64>();
            t.publishes += b.publishes;
        }
        t
    }

    fn live(&self, id: BufferId) -> Result<&Buffer, SharedError> {
        match self.buffers.get(&id) {
            Some(b) if !b.deleted => Ok(b),
            Some(b) => Err(SharedError::NoSuchBuffer(b.name.clone())),
            None => Err(SharedError::NoSuchBuffer(format!("#{}", id.0))),
        }
    }

    /// Checks that buffer `id` exists and `who` may `what` ("read" or "write") it.
    fn check(
        &self,
        broker: &Broker,
        who: TenantId,
        id: BufferId,
        what: &'static str,
    ) -> Result<(), SharedError> {
        let b = self.live(id)?;
        let t = tenant(broker, who)?;
        let allowed = match what {
            "write" => b.can_write(who, t, broker.policy()),
            _ => b.can_read(who, t, broker.policy()),
        };
        if allowed {
            return Ok(());
        }
        let entries = match what {
            "write" => &b.acl.writers[..],
            _ => &b.acl.readers[..],
        };
        let named = entries.iter().any(|p| match p {
            Principal::Tenant(n) => *n == t.name,
            Principal::Class(c) => *c == t.class,
            Principal::Anyone => false,
        });
        let hint = if named {
            ": its access list names the tenant or its class, which admits another uid than the \
             owner's only where bound to uids (a tenant declared with owners, a class above the \
             default)"
        } else {
            ""
        };
        Err(forbidden(b, t, what, hint))
    }

    /// Marks `id` deleted and frees what nobody uses; the entry goes with its last version.
    fn remove(&mut self, broker: &mut Broker, id: BufferId) -> Vec<Freed> {
        let b = self.buffers.get_mut(&id).expect("caller checked");
        // A buffer deleted before may have left its name to a newer one.
        if self.by_name.get(&b.name) == Some(&id) {
            self.by_name.remove(&b.name);
        }
        b.deleted = true;
        b.lease = None;
        b.current = None;
        let versions: Vec<Version> = b.versions.keys().copied().collect();
        if versions.is_empty() {
            self.buffers.remove(&id);
        }
        versions
            .into_iter()
            .filter_map(|v| self.free_if_unused(broker, id, v))
            .collect()
    }
}

/// Shared-buffer aggregates of one device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SharedTotals {
    pub buffers: u64,
    pub versions: u64,
    pub bytes: Bytes,
    pub pins: u64,
    pub publishes: u64,
    /// Leases that ran out unrenewed (their drafts discarded).
    pub leases_expired: u64,
}

fn tenant(broker: &Broker, id: TenantId) -> Result<&Tenant, SharedError> {
    broker.tenant(id).ok_or(SharedError::UnknownTenant(id.0))
}

fn forbidden(b: &Buffer, t: &Tenant, what: &'static str, hint: &'static str) -> SharedError {
    SharedError::Forbidden {
        tenant: t.name.clone(),
        buffer: b.name.clone(),
        owner: b.owner_name.clone(),
        what,
        hint,
    }
}

#[cfg(test)]
mod tests;
