//! A new configuration put in force while serving (SIGHUP): the settings every request reads
//! (allowed uids, the reclaim wait, connection bounds, shared-buffer settings) and each device's
//! policy (classes, the priority reserve, declared tenants). All devices' policies are checked
//! with every device's lock held, then put in force together: a reload is whole or nothing.

use std::time::Duration;

use vram_core::broker::Policy;
use vram_core::Bytes;

use super::{Daemon, Settings, Slot};
use crate::config::{ConnectionsConfig, SharedConfig};

/// What a reload may change.
pub struct Reload {
    /// `None`: root and the daemon's own uid.
    pub allowed_uids: Option<Vec<u32>>,
    pub reclaim_timeout: Duration,
    pub connections: ConnectionsConfig,
    pub shared: SharedConfig,
    /// `None`: root and the daemon's own uid.
    pub admin_uids: Option<Vec<u32>>,
}

/// Why a reload was refused; nothing of it was put in force.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("gpu {gpu}: {source}")]
    Policy {
        gpu: usize,
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl Daemon {
    /// Puts `r` and each device's `policy(capacity)` in force, or refuses the whole of it.
    /// Returns what changed, one line each, for the log.
    pub fn reload(
        &self,
        r: Reload,
        policy: impl Fn(Bytes) -> Policy,
    ) -> Result<Vec<String>, ReloadError> {
        // Held to the end, so that no runtime declaration comes or goes meanwhile.
        let declared = self.declared.lock();
        let mut kept = Vec::new();
        let mut configured = Vec::new();
        let policies: Vec<Policy> = self
            .slots
            .iter()
            .enumerate()
            .map(|(gpu, s)| {
                let from_file = policy(s.desc().capacity);
                configured.push(from_file.tenants.clone());
                let (p, notes) = super::admin::with_runtime(&declared, gpu, from_file);
                kept.extend(notes.into_iter().map(|n| format!("gpu {gpu}: {n}")));
                p
            })
            .collect();
        let per_gpu = replace_all(&self.slots, &policies, 0)?;
        self.declared.set_configured(configured);
        let mut changes: Vec<String> = per_gpu
            .into_iter()
            .enumerate()
            .flat_map(|(gpu, c)| c.into_iter().map(move |line| format!("gpu {gpu}: {line}")))
            .collect();
        let old = self.settings();
        let new = Settings {
            allowed_uids: r
                .allowed_uids
                .unwrap_or_else(|| vec![0, rustix::process::getuid().as_raw()]),
            reclaim_timeout: r.reclaim_timeout,
            connections: r.connections,
            admin_uids: r.admin_uids.unwrap_or_else(super::default_admins),
        };
        changes.extend(kept);
        if old.admin_uids != new.admin_uids {
            changes.push(format!(
                "admin_uids {:?} → {:?}",
                old.admin_uids, new.admin_uids
            ));
        }
        if old.allowed_uids != new.allowed_uids {
            changes.push(format!(
                "allowed_uids {:?} → {:?} (connections open stay)",
                old.allowed_uids, new.allowed_uids
            ));
        }
        if old.reclaim_timeout != new.reclaim_timeout {
            changes.push(format!(
                "reclaim_timeout_ms {} → {}",
                old.reclaim_timeout.as_millis(),
                new.reclaim_timeout.as_millis()
            ));
        }
        if old.connections != new.connections {
            changes.push(format!(
                "[connections] {} → {} (timeouts of connections already open stay)",
                old.connections, new.connections
            ));
        }
        self.set_settings(new);
        changes.extend(self.shared.apply(&r.shared));
        // Who may be which tenant is the configuration's to say at any time: a tenant it no
        // longer admits is disconnected, and its memory comes back as at a crash.
        for gpu in 0..self.slots.len() {
            changes.extend(self.disconnect_unadmitted(gpu));
        }
        Ok(changes)
    }

    /// Disconnects each tenant of GPU `gpu` that the policy in force does not admit (its owners,
    /// its class's rules), its memory back as at a crash; one line each, for the log.
    pub(super) fn disconnect_unadmitted(&self, gpu: usize) -> Vec<String> {
        let Some(slot) = self.slots.get(gpu) else {
            return Vec::new();
        };
        let mut done = Vec::new();
        for (name, rule) in slot.breaking_rules() {
            // Every connection of the tenant: its registration's and a joined program's.
            let conns = slot.connections_of(&name).map(|t| t.1).unwrap_or_default();
            let peers = self.conns.lock().expect("conns");
            for peer in conns.iter().filter_map(|c| peers.get(c)) {
                peer.disconnect();
            }
            drop(peers);
            let what = if conns.is_empty() {
                // Adopted after a restart and not back yet: its reconnect is refused.
                "will be refused when its process reconnects"
            } else {
                "disconnected"
            };
            done.push(format!(
                "gpu {gpu}: tenant `{name}` {what}, the policy in force does not admit it: {rule}"
            ));
        }
        done
    }
}

/// Checks `policies[i]` against slot `i` for every slot, holding each slot's lock from its
/// check until every later one is checked and put in force; then puts its own in force. So
/// either every slot takes its policy or none does.
fn replace_all(
    slots: &[Slot],
    policies: &[Policy],
    first_gpu: usize,
) -> Result<Vec<Vec<String>>, ReloadError> {
    let (Some((slot, rest)), Some((policy, later))) = (slots.split_first(), policies.split_first())
    else {
        return Ok(Vec::new());
    };
    slot.with_shared(|broker, _| {
        broker
            .check_policy(policy)
            .map_err(|e| ReloadError::Policy {
                gpu: first_gpu,
                source: Box::new(e),
            })?;
        let mut after = replace_all(rest, later, first_gpu + 1)?;
        let changes = broker
            .replace_policy(policy.clone())
            .expect("checked under this lock");
        after.insert(0, changes);
        Ok(after)
    })
}
