//! Admin calls: tenants declared and withdrawn at run time (`Declare`, `Withdraw`,
//! `Declarations`), for a node agent such as the Kubernetes plugin. Only uids named in
//! `admin_uids` may make them.
//!
//! A runtime declaration is a declared tenant of its device's policy, exactly as a
//! `[tenants.NAME]` of the configuration: its guarantee is reserved whether or not it is
//! connected, its settings override what a connecting process asks for, and only its owners may
//! connect as it. A reload keeps every runtime declaration (the configuration's policy plus
//! these), and so does a restart: they are saved in the state file (`state.rs`) and put in force
//! again before any tenant is adopted, so that a tenant connected under one keeps its class and
//! a claim not yet connected its reservation while the daemon was away.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vram_core::broker::{DeclaredTenant, Policy};
use vram_proto::{Declaration, ErrorCode, ErrorReply, Reply};

use super::Daemon;

/// How long a withdraw waits for the tenant's closed connections to be reclaimed.
const WITHDRAW_WAIT: Duration = Duration::from_secs(5);

/// The tenants declared at run time, by name. Its lock is taken before any slot's (a reload
/// holds it across the whole reload, so that no declaration comes or goes in between).
pub(crate) struct Declarations {
    runtime: Mutex<BTreeMap<String, Declaration>>,
    /// Per device, the tenants the configuration in force declares: a runtime declaration that
    /// took the place of one of them (declared first, then the configuration named it too) gives
    /// way to it when withdrawn. Written with `runtime`'s lock held.
    configured: Mutex<Vec<BTreeMap<String, DeclaredTenant>>>,
}

impl Declarations {
    /// No runtime declaration yet; `configured`: each device's tenants from the configuration.
    pub(super) fn new(configured: Vec<BTreeMap<String, DeclaredTenant>>) -> Declarations {
        Declarations {
            runtime: Mutex::new(BTreeMap::new()),
            configured: Mutex::new(configured),
        }
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Declaration>> {
        self.runtime.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records the configuration's tenants of each device (a reload put in force); call with
    /// [`Declarations::lock`] held.
    pub(super) fn set_configured(&self, configured: Vec<BTreeMap<String, DeclaredTenant>>) {
        *self.configured.lock().unwrap_or_else(|p| p.into_inner()) = configured;
    }

    /// The configuration's declaration of `name` on device `gpu`, if it has one.
    fn configured(&self, gpu: usize, name: &str) -> Option<DeclaredTenant> {
        let c = self.configured.lock().unwrap_or_else(|p| p.into_inner());
        c.get(gpu)?.get(name).cloned()
    }
}

/// `policy`, a device's policy from the configuration, with the runtime declarations of device
/// `gpu` added (a name the configuration declares too is the runtime declaration's).
pub(super) fn with_runtime(
    declared: &BTreeMap<String, Declaration>,
    gpu: usize,
    mut policy: Policy,
) -> (Policy, Vec<String>) {
    let mut changes = Vec::new();
    for d in declared.values().filter(|d| d.gpu as usize == gpu) {
        if policy
            .tenants
            .insert(d.name.clone(), declared_tenant(d))
            .is_some()
        {
            changes.push(format!(
                "tenant `{}` is declared at run time: the configuration's [tenants.{}] takes \
                 its place when it is withdrawn",
                d.name, d.name
            ));
        }
    }
    (policy, changes)
}

fn declared_tenant(d: &Declaration) -> DeclaredTenant {
    DeclaredTenant {
        class: d.class.clone(),
        guarantee: d.guarantee,
        limit: d.limit,
        owners: d.owners.clone(),
        // An admin declaration names its owners by uid only.
        groups: Vec::new(),
    }
}

fn error(code: ErrorCode, message: String) -> ErrorReply {
    ErrorReply {
        code,
        reason: None,
        message,
    }
}

fn check_admin(daemon: &Daemon, uid: u32, call: &str) -> Result<(), ErrorReply> {
    let admins = &daemon.settings().admin_uids;
    if admins.contains(&uid) {
        return Ok(());
    }
    Err(error(
        ErrorCode::PermissionDenied,
        format!("{call} is an admin call: uid {uid} is not in the daemon's admin_uids {admins:?}"),
    ))
}

/// `Declare`: the declaration put in force on its device, or refused with nothing changed.
pub(super) fn declare(daemon: &Daemon, uid: u32, d: Declaration) -> Result<Reply, ErrorReply> {
    check_admin(daemon, uid, "Declare")?;
    put_in_force(daemon, Some(uid), d)
}

/// A declaration the daemon before had in force (from its state file), put in force again as
/// its admin call did; one that does not fit now is logged and left out.
pub(super) fn restore(daemon: &Daemon, d: Declaration) {
    let name = d.name.clone();
    match put_in_force(daemon, None, d) {
        Ok(_) => tracing::info!(
            tenant = name,
            "run-time declaration of the daemon before restored"
        ),
        Err(e) => tracing::warn!(
            tenant = name,
            "run-time declaration of the daemon before not restored: {}",
            e.message
        ),
    }
}

/// [`declare`] once the caller may (`admin`, the caller's uid, is only logged; none for a
/// declaration restored from the state file).
fn put_in_force(daemon: &Daemon, admin: Option<u32>, d: Declaration) -> Result<Reply, ErrorReply> {
    let gpu = d.gpu as usize;
    let Some(slot) = daemon.slots.get(gpu) else {
        return Err(error(
            ErrorCode::Admission,
            format!(
                "cannot declare `{}` on gpu {gpu}: this daemon serves {} device(s)",
                d.name,
                daemon.slots.len()
            ),
        ));
    };
    let mut declared = daemon.declared.lock();
    if let Some(other) = declared.get(&d.name).filter(|o| o.gpu != d.gpu) {
        return Err(error(
            ErrorCode::Conflict,
            format!(
                "tenant `{}` is declared on gpu {}; withdraw it before declaring it on gpu {gpu}",
                d.name, other.gpu
            ),
        ));
    }
    let runtime = declared.contains_key(&d.name);
    let changed = slot.with_shared(|broker, _| {
        let mut policy = broker.policy().clone();
        let new = declared_tenant(&d);
        if !runtime && policy.tenants.contains_key(&d.name) {
            return Err(error(
                ErrorCode::Conflict,
                format!(
                    "tenant `{}` is declared in the configuration file; an admin call cannot \
                     change it",
                    d.name
                ),
            ));
        }
        if policy.tenants.get(&d.name) == Some(&new) {
            return Ok(false);
        }
        policy.tenants.insert(d.name.clone(), new);
        broker.replace_policy(policy).map_err(|e| {
            error(
                ErrorCode::Admission,
                format!(
                    "cannot declare `{}` on gpu {gpu} (class `{}`, guarantee {}, limit {}): {e}",
                    d.name,
                    d.class,
                    d.guarantee,
                    d.limit
                        .map_or_else(|| "the whole device".to_string(), |l| l.to_string())
                ),
            )
        })?;
        Ok(true)
    })?;
    if changed {
        tracing::info!(
            tenant = d.name, gpu, class = d.class, guarantee = %d.guarantee,
            limit = ?d.limit.map(|l| l.to_string()), owners = ?d.owners, admin_uid = ?admin,
            "tenant declared at run time"
        );
        // A process already connected under the name that the declaration does not admit (not
        // one of its owners) is disconnected, as at a reload: it never holds the guarantee.
        for line in daemon.disconnect_unadmitted(gpu) {
            tracing::warn!("{line}");
        }
    }
    declared.insert(d.name.clone(), d);
    Ok(Reply::Declared { changed })
}

/// `Withdraw`: the declaration taken out of its device's policy, the tenant's connections
/// closed and their memory reclaimed before the answer.
pub(super) fn withdraw(daemon: &Daemon, uid: u32, name: &str) -> Result<Reply, ErrorReply> {
    check_admin(daemon, uid, "Withdraw")?;
    let mut declared = daemon.declared.lock();
    let Some(d) = declared.get(name).cloned() else {
        let known: Vec<&str> = declared.keys().map(String::as_str).collect();
        return Err(error(
            ErrorCode::NotFound,
            format!("no tenant `{name}` is declared at run time (declared: {known:?})"),
        ));
    };
    let gpu = d.gpu as usize;
    let slot = &daemon.slots[gpu];
    // The configuration's declaration of the name, if it has one, takes its place again.
    let configured = daemon.declared.configured(gpu, name);
    let restored = slot
        .with_shared(|broker, _| {
            let mut policy = broker.policy().clone();
            policy.tenants.remove(name);
            let Some(t) = &configured else {
                return broker.replace_policy(policy).map(|_| None);
            };
            let mut with = policy.clone();
            with.tenants.insert(name.to_string(), t.clone());
            match broker.replace_policy(with) {
                Ok(_) => Ok(Some(Ok(()))),
                Err(e) => broker
                    .replace_policy(policy)
                    .map(|_| Some(Err(e.to_string()))),
            }
        })
        .map_err(|e| {
            error(
                ErrorCode::Admission,
                format!("cannot withdraw `{name}` on gpu {gpu}: {e}"),
            )
        })?;
    match restored {
        Some(Ok(())) => tracing::info!(
            tenant = name,
            gpu,
            "the configuration's declaration of the withdrawn tenant is in force again"
        ),
        Some(Err(e)) => tracing::warn!(
            tenant = name,
            gpu,
            "the configuration's declaration of the withdrawn tenant does not fit now ({e}); \
             the next reload that fits puts it in force"
        ),
        None => {}
    }
    declared.remove(name);
    drop(declared);

    let Some((id, conns, held, pending)) = slot.connections_of(name) else {
        tracing::info!(
            tenant = name,
            gpu,
            admin_uid = uid,
            "tenant withdrawn (not connected)"
        );
        return Ok(Reply::Withdrawn {
            released: vram_core::Bytes::ZERO,
            connections: 0,
        });
    };
    let peers: Vec<_> = {
        let all = daemon.conns.lock().expect("conns");
        conns.iter().filter_map(|c| all.get(c).cloned()).collect()
    };
    for p in &peers {
        p.disconnect();
    }
    // Answered once the tenant is gone from the books (a connection closing just before is
    // waited for too), unless it is an adopted tenant with no connection to close, whose books
    // go when its process does.
    let deadline = Instant::now() + WITHDRAW_WAIT;
    while !pending && slot.connections_of(name).is_some_and(|t| t.0 == id) {
        if Instant::now() > deadline {
            return Err(error(
                ErrorCode::Device,
                format!(
                    "withdrew `{name}`, but its {} connection(s) were not reclaimed within {} s",
                    peers.len(),
                    WITHDRAW_WAIT.as_secs()
                ),
            ));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    tracing::info!(
        tenant = name, gpu, connections = peers.len(), released = %held, admin_uid = uid,
        "tenant withdrawn: its guarantee is released and what its connections held is back"
    );
    Ok(Reply::Withdrawn {
        released: held,
        connections: peers.len() as u32,
    })
}

/// `Declarations`: every runtime declaration in force.
pub(super) fn list(daemon: &Daemon, uid: u32) -> Result<Reply, ErrorReply> {
    check_admin(daemon, uid, "Declarations")?;
    Ok(Reply::Declarations(
        daemon.declared.lock().values().cloned().collect(),
    ))
}
