//! The broker's configuration: capacity, classes and pre-declared tenants.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::Bytes;

/// A priority class. Higher `priority` wins under pressure.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Class {
    pub priority: u32,
    /// Guarantee given to a tenant of this class that does not ask for one.
    #[serde(default)]
    pub default_guarantee: Bytes,
    /// Limit given to a tenant of this class that does not ask for one (`None`: the whole device).
    #[serde(default)]
    pub default_limit: Option<Bytes>,
    /// The uids that may ask for this class when it ranks above the default class (any uid may
    /// take the default class or one below it). Declared tenants get their declared class.
    #[serde(default)]
    pub users: Vec<u32>,
    /// The groups (gids, primary or supplementary) whose members may ask for it, as `users`.
    #[serde(default)]
    pub groups: Vec<u32>,
}

/// A tenant the operator declared ahead: its guarantee is reserved from start-up, whether or not it
/// is connected, and its settings override what the connecting process asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeclaredTenant {
    /// [`Policy::DEFAULT_CLASS`] when the configuration names none, as for a tenant that
    /// connects without one.
    #[serde(default = "default_class")]
    pub class: String,
    #[serde(default)]
    pub guarantee: Bytes,
    pub limit: Option<Bytes>,
    /// The uids that may connect as this tenant. With `groups` both empty, any uid the daemon
    /// allows may (which the daemon warns about at start).
    #[serde(default)]
    pub owners: Vec<u32>,
    /// The groups (gids, primary or supplementary) whose members may connect as this tenant.
    #[serde(default)]
    pub groups: Vec<u32>,
}

/// A limit as a configuration writes it: a size, or `none` (for a class the whole device, for
/// a declared tenant its class's `default_limit`).
fn limit_text(limit: Option<Bytes>) -> String {
    limit.map_or_else(|| "none".to_owned(), |l| l.to_string())
}

/// As the keys of `[classes.NAME]` read.
impl std::fmt::Display for Class {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "priority {}, default_guarantee {}, default_limit {}, users {:?}, groups {:?}",
            self.priority,
            self.default_guarantee,
            limit_text(self.default_limit),
            self.users,
            self.groups
        )
    }
}

/// As the keys of `[tenants.NAME]` read.
impl std::fmt::Display for DeclaredTenant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "class `{}`, guarantee {}, limit {}, owners {:?}, groups {:?}",
            self.class,
            self.guarantee,
            limit_text(self.limit),
            self.owners,
            self.groups
        )
    }
}

fn default_class() -> String {
    Policy::DEFAULT_CLASS.to_owned()
}

impl DeclaredTenant {
    /// Whether anyone at all is named as owner.
    pub fn has_owners(&self) -> bool {
        !self.owners.is_empty() || !self.groups.is_empty()
    }
}

/// What the processes of one uid may hold together, over all their tenants on a device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UserLimits {
    /// The most memory the uid's tenants may hold together (grants, charges, their contexts).
    #[serde(default)]
    pub max_memory: Option<Bytes>,
    /// The most tenants the uid may have connected at once.
    #[serde(default)]
    pub max_tenants: Option<usize>,
}

impl std::fmt::Display for UserLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "max_memory {}, max_tenants {}",
            limit_text(self.max_memory),
            self.max_tenants
                .map_or_else(|| "none".to_owned(), |n| n.to_string())
        )
    }
}

/// Everything the broker needs to decide.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    pub capacity: Bytes,
    pub classes: BTreeMap<String, Class>,
    pub tenants: BTreeMap<String, DeclaredTenant>,
    /// Free memory that only the highest-priority class present may borrow into.
    pub priority_reserve: Bytes,
    /// Per-uid limits; `default_user` applies to every uid not listed.
    pub users: BTreeMap<u32, UserLimits>,
    pub default_user: UserLimits,
}

impl Policy {
    /// A declared tenant's limit: its own, else its class's `default_limit`, else the whole
    /// device.
    pub fn declared_limit(&self, d: &DeclaredTenant) -> Bytes {
        d.limit
            .or_else(|| self.classes.get(&d.class).and_then(|c| c.default_limit))
            .unwrap_or(self.capacity)
    }

    /// Whether only the uids and groups a class lists may ask for it: a class above the default
    /// class (the rule `Broker::connect` enforces for tenants not declared).
    pub fn class_is_restricted(&self, class: &str) -> bool {
        let default = self
            .classes
            .get(Self::DEFAULT_CLASS)
            .map_or(0, |c| c.priority);
        self.classes
            .get(class)
            .is_some_and(|c| c.priority > default)
    }

    /// The built-in classes: `high` (priority 100), `normal` (50, the default) and `low` (10).
    pub fn default_classes() -> BTreeMap<String, Class> {
        [("high", 100), ("normal", 50), ("low", 10)]
            .into_iter()
            .map(|(n, p)| {
                let class = Class {
                    priority: p,
                    default_guarantee: Bytes::ZERO,
                    default_limit: None,
                    users: Vec::new(),
                    groups: Vec::new(),
                };
                (n.to_string(), class)
            })
            .collect()
    }

    /// A policy with the default classes and a priority reserve of 1/32 of the capacity.
    pub fn with_capacity(capacity: Bytes) -> Policy {
        Policy {
            capacity,
            classes: Self::default_classes(),
            tenants: BTreeMap::new(),
            priority_reserve: Bytes(capacity.get() / 32),
            users: BTreeMap::new(),
            default_user: UserLimits::default(),
        }
    }

    /// The limits of `uid`'s tenants together.
    pub fn user(&self, uid: u32) -> UserLimits {
        self.users.get(&uid).copied().unwrap_or(self.default_user)
    }

    /// The class a tenant gets when it names none.
    pub const DEFAULT_CLASS: &'static str = "normal";
}

/// Why a policy cannot work, found before any tenant depends on it. Every message names the
/// setting and carries the numbers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error("capacity is 0: there would be nothing to serve")]
    ZeroCapacity,
    #[error(
        "[tenants.\"{name}\"]: `{name}` is not a valid tenant name ({reason}): no process could \
         connect as it"
    )]
    BadTenantName { name: String, reason: &'static str },
    #[error("[tenants.{name}]: unknown class `{class}`; configured classes: {known}")]
    UnknownClass {
        name: String,
        class: String,
        known: String,
    },
    #[error("[tenants.{name}]: guarantee {guarantee} is above its limit {limit}")]
    GuaranteeAboveLimit {
        name: String,
        guarantee: Bytes,
        limit: Bytes,
    },
    #[error(
        "declared guarantees overflow: `{name}`'s {guarantee} on top of the {before} declared \
         before it is more than 64 bits can count"
    )]
    GuaranteesOverflow {
        name: String,
        guarantee: Bytes,
        before: Bytes,
    },
    #[error("declared guarantees sum to {total}, above the capacity {capacity}")]
    GuaranteesAboveCapacity { total: Bytes, capacity: Bytes },
    #[error("priority_reserve {reserve} is above the capacity {capacity}")]
    ReserveAboveCapacity { reserve: Bytes, capacity: Bytes },
    #[error("[classes.{class}]: default_guarantee {guarantee} is above its default_limit {limit}")]
    ClassGuaranteeAboveLimit {
        class: String,
        guarantee: Bytes,
        limit: Bytes,
    },
    #[error("[classes.{class}]: default_guarantee {guarantee} is above the capacity {capacity}")]
    ClassGuaranteeAboveCapacity {
        class: String,
        guarantee: Bytes,
        capacity: Bytes,
    },
    #[error("the capacity cannot change while serving ({serving} now, {asked} asked)")]
    CapacityChanged { serving: Bytes, asked: Bytes },
    #[error(
        "the new guarantees do not fit what is held now: connected tenants' guarantees or \
         holdings ({connected}), declared tenants' guarantees not connected ({offline}) and memory \
         outside the tenants' (other processes', and kept by tenants not connected: {outside}) \
         need more than the capacity {capacity}"
    )]
    DoesNotFitNow {
        connected: Bytes,
        offline: Bytes,
        outside: Bytes,
        capacity: Bytes,
    },
}

impl Policy {
    /// Whether this policy can work: a capacity, declared tenants with valid names and known
    /// classes, each guarantee within its limit, guarantees that sum (without overflow) to no more
    /// than the capacity, a reserve within the capacity. [`Broker::new`](super::Broker::new) checks
    /// less; the daemon checks this first, at start and on reload. The first of
    /// [`Policy::problems`].
    pub fn check(&self) -> Result<(), PolicyError> {
        match self.problems().into_iter().next() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Every reason this policy cannot work (see [`Policy::check`]), so that a configuration
    /// is mended in one pass.
    pub fn problems(&self) -> Vec<PolicyError> {
        if self.capacity == Bytes::ZERO {
            return vec![PolicyError::ZeroCapacity];
        }
        let mut out = Vec::new();
        if self.priority_reserve > self.capacity {
            out.push(PolicyError::ReserveAboveCapacity {
                reserve: self.priority_reserve,
                capacity: self.capacity,
            });
        }
        for (class, c) in &self.classes {
            if let Some(limit) = c.default_limit.filter(|l| c.default_guarantee > *l) {
                out.push(PolicyError::ClassGuaranteeAboveLimit {
                    class: class.clone(),
                    guarantee: c.default_guarantee,
                    limit,
                });
            }
            if c.default_guarantee > self.capacity {
                out.push(PolicyError::ClassGuaranteeAboveCapacity {
                    class: class.clone(),
                    guarantee: c.default_guarantee,
                    capacity: self.capacity,
                });
            }
        }
        // `None` once the sum overflowed: the overflow is said, not a total.
        let mut total = Some(Bytes::ZERO);
        for (name, t) in &self.tenants {
            if let Some(reason) = super::name_problem(name) {
                out.push(PolicyError::BadTenantName {
                    name: name.clone(),
                    reason,
                });
            }
            if !self.classes.contains_key(&t.class) {
                out.push(PolicyError::UnknownClass {
                    name: name.clone(),
                    class: t.class.clone(),
                    known: self.classes.keys().cloned().collect::<Vec<_>>().join(", "),
                });
            }
            let limit = self.declared_limit(t);
            if t.guarantee > limit {
                out.push(PolicyError::GuaranteeAboveLimit {
                    name: name.clone(),
                    guarantee: t.guarantee,
                    limit,
                });
            }
            if let Some(before) = total {
                total = before.checked_add(t.guarantee);
                if total.is_none() {
                    out.push(PolicyError::GuaranteesOverflow {
                        name: name.clone(),
                        guarantee: t.guarantee,
                        before,
                    });
                }
            }
        }
        if let Some(total) = total.filter(|t| *t > self.capacity) {
            out.push(PolicyError::GuaranteesAboveCapacity {
                total,
                capacity: self.capacity,
            });
        }
        out
    }
}

/// One connected tenant's settings under a new policy.
struct Revised {
    id: super::TenantId,
    class: String,
    priority: u32,
    guarantee: Bytes,
    limit: Bytes,
}

impl super::Broker {
    /// Puts `new` in force while serving: classes, the priority reserve, declared tenants. A
    /// connected tenant gets its class's new priority; a declared one its new declaration's
    /// guarantee, and a limit no higher than the declaration's (nor than a lower one its process
    /// asked for). A limit below what a tenant holds takes nothing back: it only stops growth.
    /// Class defaults apply to tenants that connect from now on. Refused, with nothing changed:
    /// a policy [`Policy::check`] refuses, another capacity, or guarantees that the memory held
    /// now leaves no room for. Returns what changed, one line each, for the log.
    pub fn replace_policy(&mut self, new: Policy) -> Result<Vec<String>, PolicyError> {
        let revised = self.revised(&new)?;
        let mut changes = describe_classes(&self.policy, &new);
        changes.extend(describe_declared(&self.policy, &new));
        for r in revised {
            let t = self.tenants.get_mut(&r.id).expect("revised from the map");
            let mut said = Vec::new();
            if t.class != r.class {
                said.push(format!("class `{}` → `{}`", t.class, r.class));
            }
            if t.priority != r.priority {
                said.push(format!("priority {} → {}", t.priority, r.priority));
            }
            if t.guarantee != r.guarantee {
                said.push(format!("guarantee {} → {}", t.guarantee, r.guarantee));
            }
            if t.limit != r.limit {
                said.push(format!("limit {} → {}", t.limit, r.limit));
                if t.total() > r.limit {
                    said.push(format!(
                        "it holds {}, above the new limit: nothing is taken back, it cannot grow",
                        t.total()
                    ));
                }
            }
            if !said.is_empty() {
                changes.push(format!("tenant `{}`: {}", t.name, said.join(", ")));
            }
            t.class = r.class;
            t.priority = r.priority;
            t.guarantee = r.guarantee;
            t.limit = r.limit;
        }
        if self.policy.priority_reserve != new.priority_reserve {
            changes.push(format!(
                "priority_reserve {} → {}",
                self.policy.priority_reserve, new.priority_reserve
            ));
        }
        changes.extend(self.describe_users(&new));
        self.policy = new;
        Ok(changes)
    }

    /// The `[users]` limits `new` changes, and each connected uid that holds or has more than
    /// its new limits allow (nothing is taken back; its tenants cannot grow or join).
    fn describe_users(&self, new: &Policy) -> Vec<String> {
        let old = &self.policy;
        let mut out = Vec::new();
        if old.default_user != new.default_user {
            out.push(format!(
                "users.default: {} → {}",
                old.default_user, new.default_user
            ));
        }
        let uids: BTreeSet<u32> = old.users.keys().chain(new.users.keys()).copied().collect();
        for uid in uids {
            let (before, after) = (old.users.get(&uid), new.users.get(&uid));
            if before != after {
                let text =
                    |l: Option<&UserLimits>| l.map_or("users.default".into(), |l| l.to_string());
                out.push(format!("users.{uid}: {} → {}", text(before), text(after)));
            }
        }
        let connected: BTreeSet<u32> = self.tenants.values().map(|t| t.uid).collect();
        for uid in connected {
            let (limits, before) = (new.user(uid), old.user(uid));
            if limits == before {
                continue;
            }
            let holds = self
                .tenants
                .values()
                .filter(|t| t.uid == uid)
                .map(super::Tenant::footprint)
                .fold(self.kept_offline_of(uid), Bytes::saturating_add);
            if let Some(max) = limits.max_memory.filter(|m| holds > *m) {
                out.push(format!(
                    "uid {uid} holds {holds}, above its new max_memory {max}: nothing is taken \
                     back, its tenants cannot grow"
                ));
            }
            let count = self.tenants.values().filter(|t| t.uid == uid).count();
            if let Some(max) = limits.max_tenants.filter(|m| count > *m) {
                out.push(format!(
                    "uid {uid} has {count} tenants connected, above its new max_tenants {max}: \
                     they stay, no more may connect"
                ));
            }
        }
        out
    }

    /// Whether [`Broker::replace_policy`](super::Broker::replace_policy) would put `new` in force
    /// now, without changing anything.
    pub fn check_policy(&self, new: &Policy) -> Result<(), PolicyError> {
        self.revised(new).map(|_| ())
    }

    /// Every connected tenant's settings under `new`, if `new` can be put in force now.
    fn revised(&self, new: &Policy) -> Result<Vec<Revised>, PolicyError> {
        new.check()?;
        if new.capacity != self.policy.capacity {
            return Err(PolicyError::CapacityChanged {
                serving: self.policy.capacity,
                asked: new.capacity,
            });
        }
        let revised: Vec<Revised> = self
            .tenants
            .iter()
            .map(|(id, t)| self.revise(*id, t, new))
            .collect();
        let mut connected = Bytes::ZERO;
        for r in &revised {
            let total = self.tenants[&r.id].total();
            connected = connected.saturating_add(r.guarantee.max(total));
        }
        let offline = new
            .tenants
            .iter()
            .filter(|(name, _)| !self.by_name.contains_key(*name))
            .fold(Bytes::ZERO, |sum, (_, d)| sum.saturating_add(d.guarantee));
        // Memory no declaration can move: other processes' (a driver reading) and what tenants
        // not connected still reach.
        let outside = self
            .outside_use
            .saturating_add(self.kept_offline.values().copied().sum());
        let needed = connected.saturating_add(offline).saturating_add(outside);
        // A revision that needs no more than is committed now is put in force even while outside
        // use breaks the sum (a reload of other settings must not wait for other processes).
        if needed > new.capacity && needed > self.committed() {
            return Err(PolicyError::DoesNotFitNow {
                connected,
                offline,
                outside,
                capacity: new.capacity,
            });
        }
        Ok(revised)
    }

    /// `t`'s class, priority, guarantee and limit under `new`.
    fn revise(&self, id: super::TenantId, t: &super::Tenant, new: &Policy) -> Revised {
        match new.tenants.get(&t.name) {
            Some(d) => {
                let declared_limit = new.declared_limit(d);
                // What the process asked for is not kept; a limit below the old declaration's
                // was its own asking, and stays if still lower.
                let old_declared = self
                    .policy
                    .tenants
                    .get(&t.name)
                    .map(|o| self.policy.declared_limit(o));
                let limit = match old_declared {
                    Some(old) if t.limit >= old => declared_limit,
                    _ => t.limit.min(declared_limit),
                };
                Revised {
                    id,
                    priority: new.classes[&d.class].priority,
                    class: d.class.clone(),
                    guarantee: d.guarantee,
                    limit: limit.max(d.guarantee),
                }
            }
            None => Revised {
                id,
                class: t.class.clone(),
                priority: new.classes.get(&t.class).map_or(t.priority, |c| c.priority),
                guarantee: t.guarantee,
                limit: t.limit,
            },
        }
    }
}

fn describe_classes(old: &Policy, new: &Policy) -> Vec<String> {
    let mut out = Vec::new();
    for (name, c) in &new.classes {
        match old.classes.get(name) {
            None => out.push(format!("class `{name}` added (priority {})", c.priority)),
            Some(o) if o != c => out.push(format!("class `{name}` changed: {o} → {c}")),
            Some(_) => {}
        }
    }
    for name in old.classes.keys().filter(|n| !new.classes.contains_key(*n)) {
        out.push(format!(
            "class `{name}` removed (its connected tenants keep their priority)"
        ));
    }
    out
}

fn describe_declared(old: &Policy, new: &Policy) -> Vec<String> {
    let mut out = Vec::new();
    for (name, d) in &new.tenants {
        match old.tenants.get(name) {
            None => out.push(format!(
                "declared tenant `{name}` added (class `{}`, guarantee {})",
                d.class, d.guarantee
            )),
            Some(o) if o != d => out.push(format!("declared tenant `{name}` changed: {o} → {d}")),
            Some(_) => {}
        }
    }
    for name in old.tenants.keys().filter(|n| !new.tenants.contains_key(*n)) {
        out.push(format!(
            "declared tenant `{name}` removed (a connected one keeps its guarantee until it goes, \
             unless its class is one only listed users may ask for and its uid is not listed: \
             then it is disconnected, named below)"
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::{Broker, TenantRequest};
    use super::*;

    fn declared(class: &str, guarantee: Bytes, limit: Option<Bytes>) -> DeclaredTenant {
        DeclaredTenant {
            class: class.into(),
            guarantee,
            limit,
            owners: Vec::new(),
            groups: Vec::new(),
        }
    }

    fn policy(capacity: Bytes) -> Policy {
        let mut p = Policy::with_capacity(capacity);
        p.priority_reserve = Bytes::ZERO;
        p
    }

    #[test]
    fn check_refuses_what_cannot_work_with_the_numbers() {
        assert_eq!(policy(Bytes::ZERO).check(), Err(PolicyError::ZeroCapacity));

        let mut p = policy(Bytes::gib(8));
        p.tenants
            .insert("a".into(), declared("normal", Bytes::gib(1), None));
        p.tenants.insert(
            "b".into(),
            declared(
                "normal",
                Bytes(u64::MAX - Bytes::mib(512).get() + 1),
                Some(Bytes(u64::MAX)),
            ),
        );
        let e = p.check().unwrap_err();
        assert!(matches!(e, PolicyError::GuaranteesOverflow { .. }), "{e}");

        let mut p = policy(Bytes::gib(8));
        p.tenants
            .insert("a".into(), declared("normal", Bytes::gib(5), None));
        p.tenants
            .insert("b".into(), declared("normal", Bytes::gib(4), None));
        let e = p.check().unwrap_err();
        assert_eq!(
            e.to_string(),
            "declared guarantees sum to 9 GiB, above the capacity 8 GiB"
        );

        let mut p = policy(Bytes::gib(8));
        p.tenants
            .insert("bad name".into(), declared("normal", Bytes::ZERO, None));
        assert!(matches!(p.check(), Err(PolicyError::BadTenantName { .. })));

        let mut p = policy(Bytes::gib(8));
        p.priority_reserve = Bytes::gib(9);
        assert!(matches!(
            p.check(),
            Err(PolicyError::ReserveAboveCapacity { .. })
        ));
    }

    fn req(name: &str, class: &str, limit: Option<Bytes>) -> TenantRequest {
        TenantRequest {
            name: name.into(),
            class: Some(class.into()),
            guarantee: None,
            limit,
            pid: 1,
            uid: 0,
            gids: Vec::new(),
        }
    }

    #[test]
    fn replace_policy_updates_connected_tenants_or_changes_nothing() {
        let cap = Bytes::gib(8);
        let mut p = policy(cap);
        p.tenants.insert(
            "trainer".into(),
            declared("high", Bytes::gib(2), Some(Bytes::gib(4))),
        );
        let mut b = Broker::new(p.clone()).unwrap();
        let trainer = b.connect(req("trainer", "low", None)).unwrap();
        let other = b.connect(req("other", "low", Some(Bytes::gib(3)))).unwrap();
        b.grant(other, Bytes::gib(3)).unwrap();

        // More guarantee for the trainer, a new priority for `low`.
        let mut q = p.clone();
        q.tenants.get_mut("trainer").unwrap().guarantee = Bytes::gib(3);
        q.classes.get_mut("low").unwrap().priority = 5;
        let changes = b.replace_policy(q.clone()).unwrap();
        assert!(
            changes
                .iter()
                .any(|c| c.contains("guarantee 2 GiB → 3 GiB")),
            "{changes:?}"
        );
        assert_eq!(b.tenant(trainer).unwrap().guarantee, Bytes::gib(3));
        assert_eq!(b.tenant(other).unwrap().priority, 5);

        // A declaration the memory held now cannot make room for: refused, nothing changed.
        let mut r = q.clone();
        r.tenants
            .insert("late".into(), declared("normal", Bytes::gib(3), None));
        let e = b.replace_policy(r).unwrap_err();
        assert!(matches!(e, PolicyError::DoesNotFitNow { .. }), "{e}");
        assert_eq!(b.policy(), &q);

        // Another capacity cannot be put in force live.
        let mut c = q.clone();
        c.capacity = Bytes::gib(16);
        assert!(matches!(
            b.replace_policy(c),
            Err(PolicyError::CapacityChanged { .. })
        ));

        // A lower declared limit stops growth without taking anything back.
        let mut l = q.clone();
        l.tenants.get_mut("trainer").unwrap().limit = Some(Bytes::gib(3));
        b.replace_policy(l).unwrap();
        assert_eq!(b.tenant(trainer).unwrap().limit, Bytes::gib(3));
    }

    /// Memory of other processes counts against a new declaration: 3 GiB held by tenants and 4
    /// GiB by another process leave no room on 8 GiB for a 2 GiB guarantee. A revision that
    /// needs no more than before is put in force though outside use breaks the sum.
    #[test]
    fn a_declaration_must_fit_beside_other_processes_memory() {
        let mut b = Broker::new(policy(Bytes::gib(8))).unwrap();
        let t = b.connect(req("worker", "low", None)).unwrap();
        b.grant(t, Bytes::gib(3)).unwrap();
        b.set_outside_use(Bytes::gib(4));
        let mut p = b.policy().clone();
        p.tenants
            .insert("late".into(), declared("normal", Bytes::gib(2), None));
        let e = b.replace_policy(p).unwrap_err();
        assert!(
            matches!(e, PolicyError::DoesNotFitNow { outside, .. } if outside == Bytes::gib(4)),
            "{e}"
        );
        b.set_outside_use(Bytes::gib(6));
        let mut q = b.policy().clone();
        q.classes.get_mut("low").unwrap().priority = 5;
        b.replace_policy(q).unwrap();
        assert_eq!(b.tenant(t).unwrap().priority, 5);
    }
}
