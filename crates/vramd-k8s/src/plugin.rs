//! Preparing and unpreparing claims: the kubelet's two calls, independent of gRPC. One claim at
//! a time (a lock over the checkpoint), so a retry racing its original sees what it did. The
//! API server is never waited on under that lock: a slow or stalled one holds up the claim that
//! asked it, not every other claim's prepare and unprepare.

use std::sync::Arc;

use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;
use tokio::sync::Mutex;
use vram_core::Bytes;
use vram_proto::Declaration;

use crate::cdi::{self, Layout};
use crate::checkpoint::{Checkpoint, Prepared};
use crate::claim;
use crate::daemon::DaemonLink;

/// Runs `f`, file I/O on the node's disk, on tokio's blocking threads, so that a slow disk holds
/// up the claim being served, never the runtime's workers.
async fn on_disk<T: Send + 'static>(
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(std::io::Error::other)?
}

/// How long a read from the API server may take: the kubelet's call ends with an error naming
/// it rather than wait on a server that stopped answering (the client sets no limit itself).
const API_PATIENCE: std::time::Duration = std::time::Duration::from_secs(15);

/// The prefix of the tenants this plugin declares: `k8s-` and the claim's uid.
pub const TENANT_PREFIX: &str = "k8s-";

/// The daemon's device of index `i`, as the plugin names it in its ResourceSlice.
pub fn device_name(i: u32) -> String {
    format!("gpu-{i}")
}

/// The daemon's device index a device name of the slice stands for.
pub fn device_index(name: &str) -> Option<u32> {
    name.strip_prefix("gpu-")?.parse().ok()
}

/// The tenant claim `uid` is served as.
pub fn tenant_name(uid: &str) -> String {
    format!("{TENANT_PREFIX}{uid}")
}

/// What the plugin is, on this node.
#[derive(Debug, Clone)]
pub struct Identity {
    pub driver: String,
    pub node: String,
}

/// A claim as the kubelet names it.
#[derive(Debug, Clone)]
pub struct ClaimRef {
    pub namespace: String,
    pub uid: String,
    pub name: String,
}

impl std::fmt::Display for ClaimRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{} (uid {})", self.namespace, self.name, self.uid)
    }
}

/// A device the kubelet must give the claim's containers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedDevice {
    pub requests: Vec<String>,
    pub pool: String,
    pub device: String,
    pub cdi_device_ids: Vec<String>,
}

/// A claim's uid as Kubernetes makes them (a UUID: letters, digits and `-`), which names its
/// tenant and its CDI spec's file: anything else (empty, a path) is refused before either.
fn uid_check(c: &ClaimRef) -> Result<(), String> {
    let ok = !c.uid.is_empty()
        && c.uid.len() <= 64
        && c.uid
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "claim {c}: its uid is not one Kubernetes gives (1 to 64 letters, digits and -)"
        ))
    }
}

pub struct Plugin {
    pub id: Identity,
    pub layout: Layout,
    pub daemon: DaemonLink,
    kube: kube::Client,
    checkpoint: Mutex<Checkpoint>,
    /// The daemon's priority classes a claim's own configuration may name.
    claim_classes: Vec<String>,
}

fn devices_of(p: &Prepared) -> Vec<PreparedDevice> {
    vec![PreparedDevice {
        requests: p.requests.clone(),
        pool: p.pool.clone(),
        device: p.device.clone(),
        cdi_device_ids: p.cdi_device_ids.clone(),
    }]
}

impl Plugin {
    pub fn new(
        id: Identity,
        layout: Layout,
        daemon: DaemonLink,
        kube: kube::Client,
        checkpoint: &std::path::Path,
        claim_classes: Vec<String>,
    ) -> anyhow::Result<Arc<Plugin>> {
        Ok(Arc::new(Plugin {
            id,
            layout,
            daemon,
            kube,
            checkpoint: Mutex::new(Checkpoint::load(checkpoint)?),
            claim_classes,
        }))
    }

    /// Prepares `c`: the daemon holds its tenant's guarantee and its CDI spec is written when
    /// this returns the devices. A claim prepared before is answered as then (its declaration
    /// made again, should the daemon have restarted since).
    pub async fn prepare(&self, c: &ClaimRef) -> Result<Vec<PreparedDevice>, String> {
        if c.name.is_empty() || c.namespace.is_empty() {
            return Err(format!(
                "the kubelet named claim {c} without a namespace or name"
            ));
        }
        uid_check(c)?;
        {
            let cp = self.checkpoint.lock().await;
            if let Some(p) = cp.get(&c.uid) {
                return self.prepared_again(c, p).await;
            }
        }
        let claims = Api::<ResourceClaim>::namespaced(self.kube.clone(), &c.namespace);
        let rc = tokio::time::timeout(API_PATIENCE, claims.get(&c.name))
            .await
            .map_err(|_| {
                format!(
                    "cannot read claim {c} from the API server: no answer within {} s",
                    API_PATIENCE.as_secs()
                )
            })?
            .map_err(|e| format!("cannot read claim {c} from the API server: {e}"))?;
        let uid = rc.metadata.uid.as_deref().unwrap_or("");
        if uid != c.uid {
            return Err(format!(
                "claim {}/{} in the API server has uid {uid}, not {} as the kubelet asked: it was \
                 deleted and made again",
                c.namespace, c.name, c.uid
            ));
        }
        let a = claim::allocated(&rc, &self.id.driver, &self.id.node)
            .map_err(|e| format!("claim {c}: {e}"))?;
        if let Some(class) = a.config.priority_class.as_ref() {
            if a.config.class_from_claim && !self.claim_classes.contains(class) {
                return Err(format!(
                    "claim {c} names priority class `{class}`, which claims may not name on \
                     this node (the plugin's --claim-classes: {}); a DeviceClass's configuration \
                     may set it",
                    self.claim_classes.join(", ")
                ));
            }
        }
        let gpu = device_index(&a.device).ok_or_else(|| {
            format!(
                "claim {c} is allocated device {}, which is not a device this plugin publishes \
                 (gpu-N)",
                a.device
            )
        })?;
        let status = self
            .daemon
            .status()
            .await
            .map_err(|e| format!("claim {c}: {e}"))?;
        let Some(dev) = status.devices.iter().find(|d| d.index == gpu) else {
            let served: Vec<String> = status
                .devices
                .iter()
                .map(|d| device_name(d.index))
                .collect();
            return Err(format!(
                "claim {c} is allocated {}, which the daemon on this node does not serve (it \
                 serves {served:?})",
                a.device
            ));
        };
        let guarantee = a.consumed.unwrap_or(dev.capacity);
        if guarantee == Bytes::ZERO || guarantee > dev.capacity {
            return Err(format!(
                "claim {c} was given {guarantee} of {}, whose capacity is {}",
                a.device, dev.capacity
            ));
        }
        let limit = a
            .config
            .limit()
            .map_err(|e| format!("claim {c}: {e}"))?
            .unwrap_or(guarantee);
        if limit < guarantee || limit > dev.capacity {
            return Err(format!(
                "claim {c}: its limit {limit} must lie between what it was given ({guarantee}) \
                 and {}'s capacity ({})",
                a.device, dev.capacity
            ));
        }
        let declaration = Declaration {
            name: tenant_name(&c.uid),
            gpu,
            class: a
                .config
                .priority_class
                .clone()
                .unwrap_or_else(|| vram_core::broker::Policy::DEFAULT_CLASS.to_string()),
            guarantee,
            limit: Some(limit),
            owners: a.config.uids.clone(),
        };
        let mut cp = self.checkpoint.lock().await;
        // A retry of this claim may have prepared it while this one read the API server.
        if let Some(p) = cp.get(&c.uid) {
            return self.prepared_again(c, p).await;
        }
        self.daemon
            .declare(&declaration)
            .await
            .map_err(|e| format!("claim {c}: {e}"))?;
        let prepared = Prepared {
            namespace: c.namespace.clone(),
            name: c.name.clone(),
            pool: a.pool,
            device: a.device,
            requests: a.requests,
            declaration: declaration.clone(),
            cdi_device_ids: vec![cdi::device_id(&c.uid)],
        };
        let written = match self.write_spec(&c.uid, &declaration).await {
            Ok(()) => {
                let change = cp.insert(&c.uid, prepared.clone());
                on_disk(move || change.write())
                    .await
                    .map(|written| cp.commit(written))
                    .map_err(|e| format!("claim {c}: cannot write the checkpoint: {e}"))
            }
            Err(e) => Err(e),
        };
        if let Err(e) = written {
            // Nothing stays behind for a claim the kubelet is told failed.
            let (layout, uid) = (self.layout.clone(), c.uid.clone());
            let _ = on_disk(move || cdi::remove(&layout, &uid)).await;
            let _ = self.daemon.withdraw(&declaration.name).await;
            return Err(e);
        }
        tracing::info!(
            claim = %c, tenant = declaration.name, gpu, guarantee = %guarantee, limit = %limit,
            class = declaration.class, "claim prepared"
        );
        Ok(devices_of(&prepared))
    }

    /// A claim prepared before (`p`, its checkpoint entry) answered as then: its declaration
    /// made again, should the daemon have restarted since, and its CDI spec written again if it
    /// is missing. Called with the checkpoint's lock held.
    async fn prepared_again(
        &self,
        c: &ClaimRef,
        p: &Prepared,
    ) -> Result<Vec<PreparedDevice>, String> {
        self.daemon
            .declare(&p.declaration)
            .await
            .map_err(|e| format!("claim {c} was prepared, but declaring it again failed: {e}"))?;
        let (layout, uid) = (self.layout.clone(), c.uid.clone());
        let spec = on_disk(move || Ok(cdi::read(&layout, &uid))).await;
        if !matches!(spec, Ok(Some(_))) {
            self.write_spec(&c.uid, &p.declaration).await?;
        }
        Ok(devices_of(p))
    }

    async fn write_spec(&self, uid: &str, d: &Declaration) -> Result<(), String> {
        let status = self.daemon.status().await.map_err(|e| e.to_string())?;
        let dev = status
            .devices
            .iter()
            .find(|x| x.index == d.gpu)
            .ok_or_else(|| format!("the daemon no longer serves {}", device_name(d.gpu)))?;
        let (backend, gpu_uuid) = (dev.backend, dev.uuid.clone());
        let nodes = on_disk(move || Ok(cdi::device_nodes(backend, &gpu_uuid)))
            .await
            .map_err(|e| e.to_string())??;
        let spec = cdi::spec(&self.layout, uid, &d.name, d.gpu, &nodes);
        let (layout, uid) = (self.layout.clone(), uid.to_string());
        on_disk(move || cdi::write(&layout, &uid, &spec))
            .await
            .map_err(|e| {
                format!(
                    "cannot write the CDI spec in {}: {e}",
                    self.layout.cdi_dir.display()
                )
            })
    }

    /// Unprepares `c`: its tenant withdrawn (what its processes still held reclaimed) and its
    /// CDI spec removed. A claim unprepared lately is done already, and so is one this node
    /// never prepared (its prepare failed, or the plugin stopped before its checkpoint): the
    /// kubelet unprepares a pod's claims whether or not their prepare succeeded, and holds the
    /// pod in Terminating until the unprepare does.
    pub async fn unprepare(&self, c: &ClaimRef) -> Result<(), String> {
        uid_check(c)?;
        let mut cp = self.checkpoint.lock().await;
        let name = match cp.get(&c.uid) {
            Some(p) => p.declaration.name.clone(),
            None if cp.was_unprepared(&c.uid) => return Ok(()),
            None => tenant_name(&c.uid),
        };
        let known = cp.get(&c.uid).is_some();
        match self.daemon.withdraw(&name).await {
            Ok((released, connections)) => tracing::info!(
                claim = %c, tenant = name, released = %released, connections,
                "claim unprepared: its tenant is withdrawn"
            ),
            // The daemon restarted and the declaration was not made again: nothing to take.
            Err(e) if e.is_not_found() && known => {}
            Err(e) if e.is_not_found() => tracing::info!(
                claim = %c, tenant = name,
                "claim unprepared: it was not prepared on this node, nothing to take back"
            ),
            // Never prepared, and the daemon does not answer: the pod need not wait for it. A
            // declaration its failed prepare left in the daemon names no prepared claim, so
            // `reconcile` withdraws it once the daemon answers.
            Err(e) if !known => tracing::warn!(
                claim = %c, tenant = name,
                "claim unprepared: it was not prepared on this node; the daemon does not answer \
                 ({e}), and a declaration it may hold for the claim is withdrawn when it does"
            ),
            Err(e) => return Err(format!("claim {c}: {e}")),
        }
        let (layout, uid) = (self.layout.clone(), c.uid.clone());
        on_disk(move || cdi::remove(&layout, &uid))
            .await
            .map_err(|e| format!("claim {c}: cannot remove its CDI spec: {e}"))?;
        let change = cp.remove(&c.uid);
        let written = on_disk(move || change.write())
            .await
            .map_err(|e| format!("claim {c}: cannot write the checkpoint: {e}"))?;
        cp.commit(written);
        Ok(())
    }

    /// Brings the CDI directory and the daemon in line with the checkpoint: a spec of this
    /// plugin's that no prepared claim names (the plugin stopped between writing it and its
    /// checkpoint, or while removing it) is removed; a prepared claim's declaration the daemon
    /// lacks (it restarted) is made again; a declaration of this plugin's that no prepared claim
    /// names (the plugin stopped between declaring and its checkpoint) is withdrawn once no
    /// tenant is connected as it.
    pub async fn reconcile(&self) -> Result<(), crate::daemon::DaemonError> {
        let cp = self.checkpoint.lock().await;
        let layout = self.layout.clone();
        match on_disk(move || cdi::claims_with_specs(&layout)).await {
            Ok(uids) => {
                for uid in uids.into_iter().filter(|u| cp.get(u).is_none()) {
                    let (layout, u) = (self.layout.clone(), uid.clone());
                    match on_disk(move || cdi::remove(&layout, &u)).await {
                        Ok(()) => {
                            tracing::warn!(
                                claim = uid,
                                "removed a CDI spec no prepared claim names"
                            )
                        }
                        Err(e) => {
                            tracing::error!(claim = uid, "cannot remove a stray CDI spec: {e}")
                        }
                    }
                }
            }
            Err(e) => tracing::error!("cannot list the CDI directory: {e}"),
        }
        let declared = self.daemon.declarations().await?;
        for (uid, p) in cp.prepared() {
            if !declared.contains(&p.declaration) {
                match self.daemon.declare(&p.declaration).await {
                    Ok(_) => tracing::info!(
                        claim = uid,
                        tenant = p.declaration.name,
                        "prepared claim declared again (the daemon did not have it)"
                    ),
                    Err(e) => tracing::error!(
                        claim = uid,
                        tenant = p.declaration.name,
                        "prepared claim cannot be declared again: {e}"
                    ),
                }
            }
        }
        // Tenants connected now: a declaration no prepared claim names is not withdrawn under a
        // tenant that uses it (a checkpoint lost while its pod runs); it goes once the tenant
        // has. `None`: the report left tenants out, so none is withdrawn this round.
        let status = self.daemon.status().await?;
        let live: Option<std::collections::HashSet<String>> = (status.daemon.tenants_left_out == 0)
            .then(|| status.tenants.into_iter().map(|t| t.name).collect());
        for d in declared {
            let Some(uid) = d.name.strip_prefix(TENANT_PREFIX) else {
                continue;
            };
            if cp.get(uid).is_some() {
                continue;
            }
            if live.as_ref().is_none_or(|l| l.contains(&d.name)) {
                tracing::warn!(
                    tenant = d.name,
                    "a declaration no prepared claim names has a connected tenant: kept until \
                     the tenant is gone (or its claim is unprepared)"
                );
                continue;
            }
            match self.daemon.withdraw(&d.name).await {
                Ok((released, _)) => tracing::warn!(
                    tenant = d.name, released = %released,
                    "withdrew a declaration no prepared claim names"
                ),
                Err(e) => tracing::error!(tenant = d.name, "cannot withdraw: {e}"),
            }
        }
        Ok(())
    }
}
