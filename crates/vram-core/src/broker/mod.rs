//! The broker's state machine: who may connect, who may take how much, and whom to ask when memory
//! is short. Pure accounting; the daemon does the I/O and calls in with what happened.
//!
//! A tenant's memory is what it was granted (`held`), what it made itself and reported
//! (`charged`: a framework's own `cuMemCreate`, managed memory) and what the driver attributes to
//! its process beyond both (`outside`: its CUDA context, anything not intercepted). All three count
//! against its limit and fill its guarantee. Memory the driver shows in use that is nobody's in the
//! books (processes that are not tenants, contexts it cannot attribute) is the device's
//! `outside_use`, which no one may borrow.
//!
//! Memory a tenant gave back while its process still reaches it (a descriptor kept, a mapping
//! left, where the device can tell) is `kept`: it counts as the tenant's until it is really gone,
//! against its limit, its uid's limits and the capacity. When the tenant's connection closes first,
//! the broker keeps that count under its name and uid, and a tenant connecting again with both
//! starts with it.
//!
//! Invariant kept by every method that books memory: `outside_use + Σ over tenants of
//! max(guarantee, total) ≤ capacity` (declared tenants that are not connected count with their
//! guarantee). So a tenant below its guarantee always fits, nobody's borrowing ever eats into
//! another's guarantee, and the total held never exceeds capacity. Outside use and a tenant's
//! outside memory are readings of the driver, not requests: when they grow past what is free, the
//! invariant is broken by the world, not by a grant; [`Broker::deficit`] measures by how much,
//! [`Broker::at_risk`] names the guarantees that cannot all be met, and no borrowing is granted
//! until the deficit is gone.

mod error;
mod policy;

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

pub use error::{AdmissionError, GrantError};
pub use policy::{Class, DeclaredTenant, Policy, PolicyError, UserLimits};

use crate::Bytes;

/// A connected tenant's id, unique for the daemon's lifetime.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct TenantId(pub u64);

/// What a connecting process asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantRequest {
    pub name: String,
    /// `None`: the default class.
    pub class: Option<String>,
    /// `None`: the class's default.
    pub guarantee: Option<Bytes>,
    /// `None`: the class's default, else the whole device.
    pub limit: Option<Bytes>,
    pub pid: u32,
    pub uid: u32,
    /// The process's groups, primary first (the kernel's word, as `uid`).
    #[serde(default)]
    pub gids: Vec<u32>,
}

/// One tenant's state, as the broker accounts it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tenant {
    pub name: String,
    pub class: String,
    pub priority: u32,
    pub guarantee: Bytes,
    pub limit: Bytes,
    /// Memory granted and not yet returned.
    pub held: Bytes,
    /// Memory the tenant created itself and reported (a framework's own `cuMemCreate`).
    pub charged: Bytes,
    /// What the driver attributes to the tenant's process beyond `charged` (its context, memory
    /// taken through a route vramd does not serve), as last reconciled.
    pub outside: Bytes,
    /// Memory it returned that its process still reaches (see the module docs).
    #[serde(default)]
    pub kept: Bytes,
    /// What the tenant's allocator last reported as handed to the application.
    pub in_use: Bytes,
    /// What the tenant's allocator last reported as held but idle (could be returned at once).
    pub cached: Bytes,
    pub pid: u32,
    pub uid: u32,
    /// Its process's groups (primary first), as the kernel gave them when it connected.
    #[serde(default)]
    pub gids: Vec<u32>,
    pub grants: u64,
    pub returns: u64,
    pub refusals: BTreeMap<String, u64>,
}

impl Tenant {
    /// Everything counted against the tenant's limit: granted, charged, outside and kept.
    pub fn total(&self) -> Bytes {
        self.held
            .saturating_add(self.charged)
            .saturating_add(self.outside)
            .saturating_add(self.kept)
    }

    /// This tenant's share of the invariant: what it holds or is guaranteed, whichever is larger.
    fn footprint(&self) -> Bytes {
        self.guarantee.max(self.total())
    }
}

/// A guarantee that the device cannot meet in full while outside use lasts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AtRisk {
    pub tenant: String,
    pub guarantee: Bytes,
    /// The part of the guarantee not yet taken up: what the tenant may still ask for and must get.
    pub unfilled: Bytes,
}

impl std::fmt::Display for AtRisk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({} of {} not taken up)",
            self.tenant, self.unfilled, self.guarantee
        )
    }
}

/// A request to give back idle memory, chosen by [`Broker::reclaim_plan`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReclaimAsk {
    pub tenant: TenantId,
    pub bytes: Bytes,
}

/// A consistent picture of the broker, for status and metrics.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BrokerSnapshot {
    pub capacity: Bytes,
    pub held: Bytes,
    /// Memory in use on the device that is no tenant's (see the module docs).
    pub outside_use: Bytes,
    /// By how much outside use has grown into promised memory (zero when every promise holds).
    pub deficit: Bytes,
    pub at_risk: Vec<AtRisk>,
    /// Guarantees of connected tenants not yet taken up, and of declared tenants not connected.
    pub reserved: Bytes,
    /// What a tenant without a guarantee could borrow now.
    pub free: Bytes,
    pub tenants: Vec<(TenantId, Tenant)>,
    pub offline_declared: Vec<String>,
    /// Memory still reached by processes whose tenant is not connected: (name, uid, bytes).
    pub kept_offline: Vec<(String, u32, Bytes)>,
}

/// The broker. See the module docs for its invariant.
#[derive(Debug)]
pub struct Broker {
    policy: Policy,
    tenants: BTreeMap<TenantId, Tenant>,
    by_name: HashMap<String, TenantId>,
    next_id: u64,
    outside_use: Bytes,
    /// Kept memory of tenants not connected, by name and uid (see the module docs).
    kept_offline: BTreeMap<(String, u32), Bytes>,
}

impl Broker {
    /// A broker for `policy`. Fails if the declared tenants' guarantees do not fit the capacity or
    /// name an unknown class.
    pub fn new(policy: Policy) -> Result<Broker, AdmissionError> {
        let mut total = Bytes::ZERO;
        for (name, t) in &policy.tenants {
            if !policy.classes.contains_key(&t.class) {
                return Err(AdmissionError::UnknownClass {
                    class: t.class.clone(),
                    known: known_classes(&policy),
                });
            }
            let limit = policy.declared_limit(t);
            if t.guarantee > limit {
                return Err(AdmissionError::GuaranteeAboveLimit {
                    name: name.clone(),
                    guarantee: t.guarantee,
                    limit,
                });
            }
            let before = total;
            total = total.saturating_add(t.guarantee);
            if total > policy.capacity {
                return Err(AdmissionError::GuaranteeUnavailable {
                    name: name.clone(),
                    guarantee: t.guarantee,
                    free: policy.capacity.saturating_sub(before),
                    capacity: policy.capacity,
                    guaranteed: before,
                    borrowed: Bytes::ZERO,
                    outside: Bytes::ZERO,
                });
            }
        }
        Ok(Broker {
            policy,
            tenants: BTreeMap::new(),
            by_name: HashMap::new(),
            next_id: 1,
            outside_use: Bytes::ZERO,
            kept_offline: BTreeMap::new(),
        })
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    pub fn capacity(&self) -> Bytes {
        self.policy.capacity
    }

    pub fn tenant(&self, id: TenantId) -> Option<&Tenant> {
        self.tenants.get(&id)
    }

    pub fn tenants(&self) -> impl Iterator<Item = (TenantId, &Tenant)> {
        self.tenants.iter().map(|(id, t)| (*id, t))
    }

    /// Total memory granted to tenants.
    pub fn held(&self) -> Bytes {
        self.tenants.values().map(|t| t.held).sum()
    }

    /// Guarantees of declared tenants that are not connected: reserved, held by nobody.
    fn offline_guarantees(&self) -> Bytes {
        self.policy
            .tenants
            .iter()
            .filter(|(name, _)| !self.by_name.contains_key(*name))
            .map(|(_, t)| t.guarantee)
            .sum()
    }

    /// `outside_use + Σ max(guarantee, total)` over everyone, connected or declared, and the
    /// memory kept by tenants not connected.
    fn committed(&self) -> Bytes {
        self.tenants
            .values()
            .map(Tenant::footprint)
            .fold(self.offline_guarantees(), Bytes::saturating_add)
            .saturating_add(self.outside_use)
            .saturating_add(self.kept_offline.values().copied().sum())
    }

    /// Memory kept by `uid`'s processes whose tenants are not connected.
    fn kept_offline_of(&self, uid: u32) -> Bytes {
        self.kept_offline
            .iter()
            .filter(|((_, u), _)| *u == uid)
            .map(|(_, b)| *b)
            .sum()
    }

    /// Books `bytes` more that tenant `name` of `uid` gave back and its processes still reach:
    /// the connected tenant's `kept`, or the count kept for it until it connects again.
    pub fn add_kept(&mut self, name: &str, uid: u32, bytes: Bytes) {
        if let Some(t) = self.tenant_named(name, uid) {
            t.kept = t.kept.saturating_add(bytes);
        } else if bytes > Bytes::ZERO {
            let k = self
                .kept_offline
                .entry((name.to_string(), uid))
                .or_default();
            *k = k.saturating_add(bytes);
        }
    }

    /// Takes back `bytes` of what [`Broker::add_kept`] booked: that memory is gone.
    pub fn take_kept(&mut self, name: &str, uid: u32, bytes: Bytes) {
        if let Some(t) = self.tenant_named(name, uid) {
            t.kept = t.kept.saturating_sub(bytes);
            return;
        }
        let key = (name.to_string(), uid);
        if let Some(k) = self.kept_offline.get_mut(&key) {
            *k = k.saturating_sub(bytes);
            if *k == Bytes::ZERO {
                self.kept_offline.remove(&key);
            }
        }
    }

    fn tenant_named(&mut self, name: &str, uid: u32) -> Option<&mut Tenant> {
        let id = self.by_name.get(name)?;
        self.tenants.get_mut(id).filter(|t| t.uid == uid)
    }

    /// Memory nobody holds or is guaranteed: what can be borrowed.
    pub fn free(&self) -> Bytes {
        self.policy.capacity.saturating_sub(self.committed())
    }

    /// Memory in use on the device that is no tenant's.
    pub fn outside_use(&self) -> Bytes {
        self.outside_use
    }

    /// Records the driver's reading of memory in use that is no tenant's.
    pub fn set_outside_use(&mut self, bytes: Bytes) {
        self.outside_use = bytes;
    }

    /// Records what the driver attributes to a tenant's process beyond what it charged.
    pub fn set_tenant_outside(&mut self, id: TenantId, bytes: Bytes) {
        if let Some(t) = self.tenants.get_mut(&id) {
            t.outside = bytes;
        }
    }

    /// By how much the promises (guarantees, memory held) and outside use exceed the capacity.
    pub fn deficit(&self) -> Bytes {
        self.committed().saturating_sub(self.policy.capacity)
    }

    /// The guarantees not yet taken up, while there is a deficit: each of these tenants may ask
    /// for memory the device no longer has. Empty when every promise holds.
    pub fn at_risk(&self) -> Vec<AtRisk> {
        if self.deficit() == Bytes::ZERO {
            return Vec::new();
        }
        let connected = self.tenants.values().map(|t| AtRisk {
            tenant: t.name.clone(),
            guarantee: t.guarantee,
            unfilled: t.guarantee.saturating_sub(t.total()),
        });
        let offline = self
            .policy
            .tenants
            .iter()
            .filter(|(name, _)| !self.by_name.contains_key(*name))
            .map(|(name, d)| AtRisk {
                tenant: name.clone(),
                guarantee: d.guarantee,
                unfilled: d.guarantee,
            });
        connected
            .chain(offline)
            .filter(|r| r.unfilled > Bytes::ZERO)
            .collect()
    }

    /// Whom to ask for idle memory so that the deficit closes: borrowers' caches (memory held
    /// above a guarantee and idle), lowest priority first, then the largest cache.
    pub fn deficit_plan(&self) -> Vec<ReclaimAsk> {
        self.borrowers_plan(None, self.deficit(), &|_| false)
    }

    /// Asks for at most `short` from the idle memory of borrowers other than `except` and those
    /// `skip` names.
    fn borrowers_plan(
        &self,
        except: Option<TenantId>,
        mut short: Bytes,
        skip: &dyn Fn(TenantId) -> bool,
    ) -> Vec<ReclaimAsk> {
        let mut candidates: Vec<(TenantId, &Tenant, Bytes)> = self
            .tenants
            .iter()
            .filter(|(other, _)| Some(**other) != except && !skip(**other))
            .map(|(other, u)| {
                let above = u.total().saturating_sub(u.guarantee);
                (*other, u, u.cached.min(above))
            })
            .filter(|(_, _, useful)| *useful > Bytes::ZERO)
            .collect();
        candidates.sort_by_key(|(_, u, useful)| (u.priority, std::cmp::Reverse(*useful)));
        let mut plan = Vec::new();
        for (other, _, useful) in candidates {
            if short == Bytes::ZERO {
                break;
            }
            let ask = useful.min(short);
            short -= ask;
            plan.push(ReclaimAsk {
                tenant: other,
                bytes: ask,
            });
        }
        plan
    }

    /// Admits a tenant, or says why not.
    pub fn connect(&mut self, req: TenantRequest) -> Result<TenantId, AdmissionError> {
        validate_name(&req.name)?;
        if let Some(id) = self.by_name.get(&req.name) {
            return Err(AdmissionError::NameInUse {
                name: req.name,
                pid: self.tenants[id].pid,
            });
        }
        let declared = self.policy.tenants.get(&req.name);
        let class_name = match declared {
            Some(d) => d.class.clone(),
            None => req
                .class
                .clone()
                .unwrap_or_else(|| Policy::DEFAULT_CLASS.to_string()),
        };
        let Some(class) = self.policy.classes.get(&class_name) else {
            return Err(AdmissionError::UnknownClass {
                class: class_name,
                known: known_classes(&self.policy),
            });
        };
        self.check_identity(&req, declared, &class_name, class)?;
        let capacity = self.policy.capacity;
        let (guarantee, limit) = match declared {
            // The operator's declaration wins; a process may only ask for a lower limit.
            Some(d) => {
                let limit = self.policy.declared_limit(d);
                let limit = req.limit.map_or(limit, |l| l.min(limit)).max(d.guarantee);
                (d.guarantee, limit)
            }
            None => (
                req.guarantee.unwrap_or(class.default_guarantee),
                req.limit
                    .or(class.default_limit)
                    .unwrap_or(capacity)
                    .min(capacity),
            ),
        };
        if guarantee > capacity {
            return Err(AdmissionError::GuaranteeAboveCapacity {
                name: req.name,
                guarantee,
                capacity,
            });
        }
        if guarantee > limit {
            return Err(AdmissionError::GuaranteeAboveLimit {
                name: req.name,
                guarantee,
                limit,
            });
        }
        let kept = self
            .kept_offline
            .get(&(req.name.clone(), req.uid))
            .copied()
            .unwrap_or(Bytes::ZERO);
        if let Some(max) = self.policy.user(req.uid).max_memory {
            let promised = self
                .tenants
                .values()
                .filter(|t| t.uid == req.uid)
                .map(Tenant::footprint)
                .fold(guarantee, Bytes::saturating_add)
                .saturating_add(self.kept_offline_of(req.uid));
            if promised > max {
                return Err(AdmissionError::UserMemory {
                    name: req.name,
                    uid: req.uid,
                    guarantee,
                    max,
                    held: promised - guarantee,
                });
            }
        }
        // A declared tenant's guarantee is already counted in `committed`.
        if declared.is_none() && guarantee > self.free() {
            let guaranteed = self
                .tenants
                .values()
                .map(|t| t.guarantee)
                .fold(self.offline_guarantees(), Bytes::saturating_add);
            let borrowed = self
                .tenants
                .values()
                .map(|t| t.total().saturating_sub(t.guarantee))
                .fold(Bytes::ZERO, Bytes::saturating_add);
            return Err(AdmissionError::GuaranteeUnavailable {
                name: req.name,
                guarantee,
                free: self.free(),
                capacity,
                guaranteed,
                borrowed,
                outside: self.outside_use,
            });
        }
        Ok(self.insert(req, class_name, class.priority, guarantee, limit, kept))
    }

    /// Books a tenant of the daemon before whose process still holds what it was granted: as
    /// [`Broker::connect`] admits it, else without its guarantee, else whatever the rules in
    /// force say (its class, or the default class where that is gone; no guarantee; its limit),
    /// so that its memory stays in the books until its process ends. With the refusal that
    /// made it so, if any; [`Broker::rule_broken`] then decides whether it may reconnect. Fails
    /// only for a name no tenant can have or one already connected.
    pub fn connect_adopted(
        &mut self,
        req: TenantRequest,
    ) -> Result<(TenantId, Option<AdmissionError>), AdmissionError> {
        let refused = match self.connect(req.clone()) {
            Ok(id) => return Ok((id, None)),
            Err(e @ (AdmissionError::NameInUse { .. } | AdmissionError::BadName { .. })) => {
                return Err(e)
            }
            Err(e) => e,
        };
        let without_guarantee = TenantRequest {
            guarantee: Some(Bytes::ZERO),
            ..req.clone()
        };
        if let Ok(id) = self.connect(without_guarantee) {
            return Ok((id, Some(refused)));
        }
        let class_name = req
            .class
            .clone()
            .filter(|c| self.policy.classes.contains_key(c))
            .unwrap_or_else(|| Policy::DEFAULT_CLASS.to_string());
        let priority = self
            .policy
            .classes
            .get(&class_name)
            .map_or(0, |c| c.priority);
        let limit = req
            .limit
            .unwrap_or(self.policy.capacity)
            .min(self.policy.capacity);
        let kept = self
            .kept_offline
            .get(&(req.name.clone(), req.uid))
            .copied()
            .unwrap_or(Bytes::ZERO);
        let id = self.insert(req, class_name, priority, Bytes::ZERO, limit, kept);
        Ok((id, Some(refused)))
    }

    /// Enters an admitted tenant in the books.
    fn insert(
        &mut self,
        req: TenantRequest,
        class: String,
        priority: u32,
        guarantee: Bytes,
        limit: Bytes,
        kept: Bytes,
    ) -> TenantId {
        let id = TenantId(self.next_id);
        self.next_id += 1;
        let tenant = Tenant {
            name: req.name.clone(),
            class,
            priority,
            guarantee,
            limit,
            held: Bytes::ZERO,
            charged: Bytes::ZERO,
            outside: Bytes::ZERO,
            kept,
            in_use: Bytes::ZERO,
            cached: Bytes::ZERO,
            pid: req.pid,
            uid: req.uid,
            gids: req.gids,
            grants: 0,
            returns: 0,
            refusals: BTreeMap::new(),
        };
        self.kept_offline.remove(&(req.name.clone(), req.uid));
        self.tenants.insert(id, tenant);
        self.by_name.insert(req.name, id);
        id
    }

    /// Who may be this tenant, in this class: a declared tenant's owners, a class above the
    /// default one only for the uids it lists, and the uid's own count of tenants.
    fn check_identity(
        &self,
        req: &TenantRequest,
        declared: Option<&DeclaredTenant>,
        class_name: &str,
        class: &Class,
    ) -> Result<(), AdmissionError> {
        self.check_rules(&req.name, req.uid, &req.gids, declared, class_name, class)?;
        if let Some(max) = self.policy.user(req.uid).max_tenants {
            let n = self.tenants.values().filter(|t| t.uid == req.uid).count();
            if n >= max {
                return Err(AdmissionError::UserTenants {
                    name: req.name.clone(),
                    uid: req.uid,
                    max,
                });
            }
        }
        Ok(())
    }

    /// The operator's rules on who may be which tenant: a declared tenant's owners (uids or
    /// groups), and a class above the default one only for the uids and groups it lists.
    fn check_rules(
        &self,
        name: &str,
        uid: u32,
        gids: &[u32],
        declared: Option<&DeclaredTenant>,
        class_name: &str,
        class: &Class,
    ) -> Result<(), AdmissionError> {
        let in_groups = |groups: &[u32]| gids.iter().any(|g| groups.contains(g));
        if let Some(d) = declared.filter(|d| d.has_owners()) {
            if !d.owners.contains(&uid) && !in_groups(&d.groups) {
                return Err(AdmissionError::NotOwner {
                    name: name.to_string(),
                    uid,
                    gids: gids.to_vec(),
                    owners: d.owners.clone(),
                    groups: d.groups.clone(),
                });
            }
        }
        let default_priority = self
            .policy
            .classes
            .get(Policy::DEFAULT_CLASS)
            .map_or(0, |c| c.priority);
        if declared.is_none()
            && class.priority > default_priority
            && !class.users.contains(&uid)
            && !in_groups(&class.groups)
        {
            return Err(AdmissionError::ClassNotAllowed {
                name: name.to_string(),
                class: class_name.to_string(),
                priority: class.priority,
                uid,
                default_priority,
            });
        }
        Ok(())
    }

    /// The connected tenants that the rules in force would not admit as they are (after a new
    /// configuration), with the rule each breaks.
    pub fn breaking_rules(&self) -> Vec<(TenantId, AdmissionError)> {
        self.tenants
            .keys()
            .filter_map(|&id| self.rule_broken(id).map(|e| (id, e)))
            .collect()
    }

    /// The rule in force that tenant `id`, as it is, breaks (its owners, its class's users).
    pub fn rule_broken(&self, id: TenantId) -> Option<AdmissionError> {
        let t = self.tenants.get(&id)?;
        let declared = self.policy.tenants.get(&t.name);
        let class = self.policy.classes.get(&t.class)?;
        self.check_rules(&t.name, t.uid, &t.gids, declared, &t.class, class)
            .err()
    }

    /// Accounts `bytes` more to `id`, or says why not (and counts the refusal).
    pub fn grant(&mut self, id: TenantId, bytes: Bytes) -> Result<(), GrantError> {
        self.book(id, bytes, |t| &mut t.held)
    }

    /// Accounts `bytes` the tenant created itself (it asks before it keeps them), or says why
    /// not (and counts the refusal). The same rules as [`Broker::grant`].
    pub fn charge(&mut self, id: TenantId, bytes: Bytes) -> Result<(), GrantError> {
        self.book(id, bytes, |t| &mut t.charged)
    }

    /// Takes back a charge; returns what was actually taken back.
    pub fn uncharge(&mut self, id: TenantId, bytes: Bytes) -> Bytes {
        let Some(t) = self.tenants.get_mut(&id) else {
            return Bytes::ZERO;
        };
        let taken = bytes.min(t.charged);
        t.charged -= taken;
        taken
    }

    /// Books memory a tenant already holds, without the rules of [`Broker::grant`]: a tenant
    /// adopted after a daemon restart holds what it was granted before, whatever the books say
    /// now. May break the invariant (then [`Broker::deficit`] says by how much).
    pub fn adopt(&mut self, id: TenantId, held: Bytes, charged: Bytes) {
        if let Some(t) = self.tenants.get_mut(&id) {
            t.held = t.held.saturating_add(held);
            t.charged = t.charged.saturating_add(charged);
        }
    }

    /// Records that the tenant's memory is now held by process `pid` (a process that joined its
    /// registration, or the registering one again when that process ended).
    pub fn set_pid(&mut self, id: TenantId, pid: u32) {
        if let Some(t) = self.tenants.get_mut(&id) {
            t.pid = pid;
        }
    }

    /// Takes back everything the tenant holds (its process ended; the registration stays):
    /// returns what it held, charged and used outside its grants.
    pub fn release_all(&mut self, id: TenantId) -> Bytes {
        let Some(t) = self.tenants.get_mut(&id) else {
            return Bytes::ZERO;
        };
        let total = t.total();
        t.held = Bytes::ZERO;
        t.charged = Bytes::ZERO;
        t.outside = Bytes::ZERO;
        t.in_use = Bytes::ZERO;
        t.cached = Bytes::ZERO;
        total
    }

    /// The connected tenant of that name.
    pub fn id_of(&self, name: &str) -> Option<TenantId> {
        self.by_name.get(name).copied()
    }

    /// Counts a refusal the tenant's own library made (its limit, checked without asking).
    pub fn count_refusal(&mut self, id: TenantId, reason: &str) {
        if let Some(t) = self.tenants.get_mut(&id) {
            *t.refusals.entry(reason.to_string()).or_default() += 1;
        }
    }

    fn book(
        &mut self,
        id: TenantId,
        bytes: Bytes,
        field: impl FnOnce(&mut Tenant) -> &mut Bytes,
    ) -> Result<(), GrantError> {
        let result = self.check_grant(id, bytes);
        let Some(t) = self.tenants.get_mut(&id) else {
            return result;
        };
        match &result {
            Ok(()) => {
                *field(t) += bytes;
                t.grants += 1;
            }
            Err(e) => *t.refusals.entry(e.reason().to_string()).or_default() += 1,
        }
        result
    }

    /// Whether [`Broker::grant`] would succeed now, without changing anything.
    pub fn check_grant(&self, id: TenantId, bytes: Bytes) -> Result<(), GrantError> {
        let t = self
            .tenants
            .get(&id)
            .ok_or(GrantError::UnknownTenant(id.0))?;
        if bytes == Bytes::ZERO {
            return Err(GrantError::BadSize {
                tenant: t.name.clone(),
                asked: bytes,
                reason: "zero bytes",
            });
        }
        let new_total = t.total().checked_add(bytes).filter(|h| *h <= t.limit);
        let Some(new_total) = new_total else {
            return Err(GrantError::OverLimit {
                tenant: t.name.clone(),
                asked: bytes,
                limit: t.limit,
                held: t.total(),
            });
        };
        if let Some(max) = self.policy.user(t.uid).max_memory {
            let uid_total = self
                .tenants
                .values()
                .filter(|u| u.uid == t.uid)
                .map(Tenant::total)
                .fold(self.kept_offline_of(t.uid), Bytes::saturating_add);
            if uid_total.saturating_add(bytes) > max {
                return Err(GrantError::UserLimit {
                    tenant: t.name.clone(),
                    asked: bytes,
                    uid: t.uid,
                    max,
                    held: uid_total,
                });
            }
        }
        let extra = t.guarantee.max(new_total) - t.footprint();
        if extra == Bytes::ZERO {
            return Ok(());
        }
        let free = self.free();
        if extra > free {
            return Err(GrantError::DeviceFull {
                tenant: t.name.clone(),
                asked: bytes,
                held: t.total(),
                guarantee: t.guarantee,
                free,
                capacity: self.policy.capacity,
            });
        }
        let top = self.tenants.values().map(|u| u.priority).max().unwrap_or(0);
        let reserve = self.policy.priority_reserve;
        if t.priority < top && free - extra < reserve {
            return Err(GrantError::PriorityReserve {
                tenant: t.name.clone(),
                class: t.class.clone(),
                priority: t.priority,
                asked: bytes,
                held: t.total(),
                guarantee: t.guarantee,
                reserve,
                free,
            });
        }
        Ok(())
    }

    /// Takes back `bytes` that `id` returned (or that could not be delivered to it).
    /// Returns what was actually taken back: never more than the tenant holds.
    pub fn release(&mut self, id: TenantId, bytes: Bytes) -> Bytes {
        let Some(t) = self.tenants.get_mut(&id) else {
            return Bytes::ZERO;
        };
        let taken = bytes.min(t.held);
        t.held -= taken;
        t.returns += 1;
        taken
    }

    /// Takes `bytes` off what `id` holds without counting a return: memory it gave back but
    /// still reaches, which the caller books as kept ([`Broker::add_kept`]).
    pub fn unhold(&mut self, id: TenantId, bytes: Bytes) {
        if let Some(t) = self.tenants.get_mut(&id) {
            t.held = t.held.saturating_sub(bytes);
        }
    }

    /// Moves `bytes` of what `id` keeps back to what it holds ([`Broker::unhold`] undone): a kept
    /// handle that is its grant again. Its total does not change, so no rule is asked.
    pub fn rehold(&mut self, id: TenantId, bytes: Bytes) {
        if let Some(t) = self.tenants.get_mut(&id) {
            let moved = bytes.min(t.kept);
            t.kept = t.kept.saturating_sub(moved);
            t.held = t.held.saturating_add(moved);
        }
    }

    /// Records what a tenant's allocator says it uses and caches.
    pub fn report_usage(&mut self, id: TenantId, in_use: Bytes, cached: Bytes) {
        if let Some(t) = self.tenants.get_mut(&id) {
            t.in_use = in_use.min(t.held);
            t.cached = cached.min(t.held - t.in_use);
        }
    }

    /// Removes a tenant (its connection closed); returns its state, with what it held. What it
    /// kept stays counted under its name and uid.
    pub fn disconnect(&mut self, id: TenantId) -> Option<Tenant> {
        let t = self.tenants.remove(&id)?;
        self.by_name.remove(&t.name);
        if t.kept > Bytes::ZERO {
            let k = self
                .kept_offline
                .entry((t.name.clone(), t.uid))
                .or_default();
            *k = k.saturating_add(t.kept);
        }
        Some(t)
    }

    /// Whom to ask for idle memory so that `id` could take `bytes`: tenants whose returned cache
    /// would lower the committed total (held above guarantee), lowest priority first, then the
    /// largest cache. Empty when nobody's cache would help or the request is over its limit anyway.
    /// Tenants `skip` names are left out (the daemon's: those that cannot answer now).
    pub fn reclaim_plan(
        &self,
        id: TenantId,
        bytes: Bytes,
        skip: &dyn Fn(TenantId) -> bool,
    ) -> Vec<ReclaimAsk> {
        let Some(t) = self.tenants.get(&id) else {
            return Vec::new();
        };
        if matches!(
            self.check_grant(id, bytes),
            Ok(())
                | Err(GrantError::OverLimit { .. }
                    | GrantError::UserLimit { .. }
                    | GrantError::BadSize { .. })
        ) {
            return Vec::new();
        }
        let new_total = t.total().saturating_add(bytes);
        let extra = t.guarantee.max(new_total) - t.footprint();
        let top = self.tenants.values().map(|u| u.priority).max().unwrap_or(0);
        let need_free = if t.priority < top {
            extra.saturating_add(self.policy.priority_reserve)
        } else {
            extra
        };
        let short = need_free.saturating_sub(self.free());
        self.borrowers_plan(Some(id), short, skip)
    }

    pub fn snapshot(&self) -> BrokerSnapshot {
        let held = self.held();
        let booked = self
            .tenants
            .values()
            .map(Tenant::total)
            .fold(self.outside_use, Bytes::saturating_add)
            .saturating_add(self.kept_offline.values().copied().sum());
        BrokerSnapshot {
            capacity: self.policy.capacity,
            held,
            outside_use: self.outside_use,
            deficit: self.deficit(),
            at_risk: self.at_risk(),
            reserved: self.committed().saturating_sub(booked),
            free: self.free(),
            tenants: self
                .tenants
                .iter()
                .map(|(id, t)| (*id, t.clone()))
                .collect(),
            offline_declared: self
                .policy
                .tenants
                .keys()
                .filter(|n| !self.by_name.contains_key(*n))
                .cloned()
                .collect(),
            kept_offline: self
                .kept_offline
                .iter()
                .map(|((name, uid), b)| (name.clone(), *uid, *b))
                .collect(),
        }
    }
}

fn known_classes(policy: &Policy) -> String {
    policy
        .classes
        .keys()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join(", ")
}

fn validate_name(name: &str) -> Result<(), AdmissionError> {
    match name_problem(name) {
        Some(reason) => Err(AdmissionError::BadName {
            name: name.to_string(),
            reason,
        }),
        None => Ok(()),
    }
}

/// What is wrong with a tenant's or a shared buffer's name, if anything.
pub fn name_problem(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        return Some("empty");
    }
    if name.len() > 64 {
        return Some("longer than 64 bytes");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"-_.@:".contains(&b))
    {
        return Some("only letters, digits and - _ . @ : are allowed");
    }
    None
}

#[cfg(test)]
mod tests;
