//! The daemon's state as `vramd status --json`, `/status` and `vramd top` see it.

use serde::{Deserialize, Serialize};
use vram_core::Bytes;

use crate::BackendKind;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    pub daemon: DaemonInfo,
    pub devices: Vec<DeviceStatus>,
    pub tenants: Vec<TenantStatus>,
    #[serde(default)]
    pub shared: crate::SharedStatus,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DaemonInfo {
    pub pid: u32,
    pub version: String,
    pub uptime_seconds: f64,
    pub socket: String,
    /// Frames refused since start (malformed, oversized, wrong version, bad magic).
    pub protocol_errors: u64,
    pub connections: u64,
    /// Log lines the daemon could not write (its stderr broken or closed) and dropped.
    #[serde(default)]
    pub log_lines_dropped: u64,
    /// Connections refused at accept: over `[connections]` caps, or the daemon out of file
    /// descriptors.
    #[serde(default)]
    pub connections_refused: u64,
    /// Tenants left out of this report so that it fits in one frame (counted, not listed).
    #[serde(default)]
    pub tenants_left_out: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceStatus {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub backend: BackendKind,
    pub capacity: Bytes,
    pub granularity: Bytes,
    /// Granted to tenants.
    pub held: Bytes,
    /// Created ahead of demand and not yet granted (the daemon's own, given up under pressure).
    pub pooled: Bytes,
    /// Guarantees not taken up yet.
    pub reserved: Bytes,
    /// What a tenant without a guarantee could still borrow.
    pub free: Bytes,
    /// Physical memory the daemon has created and not released (held + pooled + in flight).
    pub device_used: Bytes,
    /// How grants found their handle since start.
    #[serde(default)]
    pub pool: PoolTakes,
    /// The driver's figure for the device's used memory, as last read (`None`: no reading, as on
    /// the host backend or where NVML is missing).
    #[serde(default)]
    pub driver_used: Option<Bytes>,
    /// Memory in use that is no tenant's (other processes, what the driver does not attribute):
    /// not lent to anyone.
    #[serde(default)]
    pub outside_use: Bytes,
    /// The part of `outside_use` no process accounts for.
    #[serde(default)]
    pub unattributed: Bytes,
    /// Processes using the device that are not tenants, largest first.
    #[serde(default)]
    pub outside_processes: Vec<OutsideProcess>,
    /// By how much outside use has grown into memory already promised (zero while every promise
    /// holds).
    #[serde(default)]
    pub deficit: Bytes,
    /// Guarantees the device cannot meet in full while the deficit lasts.
    #[serde(default)]
    pub at_risk: Vec<vram_core::broker::AtRisk>,
    /// Memory given back that a process still reaches (a descriptor or a mapping kept), booked
    /// to the tenant that had it until it is gone; included in `device_used`.
    #[serde(default)]
    pub kept: Bytes,
    /// The part of `kept` whose tenant is not connected: (tenant, uid, bytes).
    #[serde(default)]
    pub kept_offline: Vec<KeptOffline>,
}

/// Memory kept by the processes of a tenant that is not connected.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeptOffline {
    pub tenant: String,
    pub uid: u32,
    pub bytes: Bytes,
}

/// A process on the device that is not a tenant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutsideProcess {
    pub pid: u32,
    /// Its command name (`/proc/PID/comm`), empty if unreadable.
    pub name: String,
    pub bytes: Bytes,
}

/// Handles taken for grants since the daemon started, by where they came from. A miss costs the
/// grant a create and an export on its path instead of an fd handed over (docs/benchmarks.md,
/// "Grant latency").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolTakes {
    /// Made ahead of demand and waiting.
    pub hits: u64,
    /// A handle the same tenant gave back, kept for it.
    pub recycled: u64,
    /// Made on the spot.
    pub misses: u64,
}

impl PoolTakes {
    /// The takes since `earlier`, a reading of the same counters.
    pub fn since(self, earlier: PoolTakes) -> PoolTakes {
        PoolTakes {
            hits: self.hits.saturating_sub(earlier.hits),
            recycled: self.recycled.saturating_sub(earlier.recycled),
            misses: self.misses.saturating_sub(earlier.misses),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantStatus {
    pub id: u64,
    pub name: String,
    pub gpu: u32,
    pub class: String,
    pub priority: u32,
    pub guarantee: Bytes,
    pub limit: Bytes,
    /// Granted handles.
    pub held: Bytes,
    /// Memory the tenant created itself and charged (a framework's own `cuMemCreate`).
    #[serde(default)]
    pub charged: Bytes,
    /// What the driver attributes to the tenant's process beyond its charges (its CUDA context,
    /// anything not intercepted); counted against its limit.
    #[serde(default)]
    pub outside: Bytes,
    /// Memory it gave back that its process still reaches; counted against its limit.
    #[serde(default)]
    pub kept: Bytes,
    pub in_use: Bytes,
    pub cached: Bytes,
    pub handles: u64,
    pub pid: u32,
    pub uid: u32,
    pub grants: u64,
    pub returns: u64,
    pub refusals: std::collections::BTreeMap<String, u64>,
}
