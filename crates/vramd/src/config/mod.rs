//! The daemon's configuration file (TOML). Every key is optional; see `docs/operations.md`.
//! `check` says whether a configuration can work, before anything is started with it; `live`
//! what of it a running daemon can put in force.

mod check;
mod live;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use serde::Deserialize;
use vram_core::broker::{Class, DeclaredTenant, Policy};
use vram_core::Bytes;

pub use check::{bare_size_hint, ConfigError, Device as CheckedDevice, MIN_LEASE_MS};

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub socket: Option<PathBuf>,
    /// Octal permission bits of the socket, as a string: `"0660"`.
    pub socket_mode: Option<String>,
    /// Uids allowed to connect. Unset: root and the daemon's own uid.
    pub allowed_uids: Option<Vec<u32>>,
    /// `"auto"` or a backend's name (`vram_device::BackendKind`).
    pub backend: Option<vram_device::BackendSelection>,
    /// The host backend's capacity; on cuda, a cap below the device's own memory.
    pub capacity: Option<Bytes>,
    /// Free memory that only the highest-priority class present may borrow into.
    pub priority_reserve: Option<Bytes>,
    /// How long to wait for tenants to give back cached memory before refusing, in milliseconds.
    pub reclaim_timeout_ms: Option<u64>,
    /// Where to serve metrics: `"127.0.0.1:9464"` (the default) or `"off"`.
    pub metrics: Option<crate::metrics::MetricsAddr>,
    /// Per-tenant series (labelled with tenant names) on `/metrics` and tenants in `/status`:
    /// off unless the operator turns them on, since anyone who reaches the port reads them.
    /// Off, tenants' figures are summed by class.
    #[serde(default)]
    pub metrics_tenants: bool,
    /// Who may read `/status` over HTTP: `"local"` (the default: connections from this host
    /// whose uid, looked up in the kernel's socket table, is in `allowed_uids`), `"any"` or
    /// `"off"`.
    #[serde(default)]
    pub http_status: crate::metrics::HttpStatus,
    #[serde(default)]
    pub pool: PoolConfig,
    #[serde(default)]
    pub shared: SharedConfig,
    #[serde(default)]
    pub connections: ConnectionsConfig,
    #[serde(default)]
    pub classes: BTreeMap<String, Class>,
    #[serde(default)]
    pub tenants: BTreeMap<String, DeclaredTenant>,
    /// Per-uid limits over all of a uid's tenants: `[users.1001]`, and `[users.default]` for
    /// every uid not listed.
    #[serde(default)]
    pub users: BTreeMap<String, vram_core::broker::UserLimits>,
    /// Uids allowed to make admin calls (declare and withdraw tenants at run time). Unset:
    /// root and the daemon's own uid. They must be allowed to connect too (`allowed_uids`).
    #[serde(default)]
    pub admin_uids: Option<Vec<u32>>,
}

/// The handle pool: memory created (and exported) ahead of demand.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// The most memory the pool holds.
    #[serde(default = "PoolConfig::default_max")]
    pub max: Bytes,
    /// Sizes kept ready from the start (more sizes join as tenants ask for them).
    #[serde(default = "PoolConfig::default_sizes")]
    pub sizes: Vec<Bytes>,
    /// Handles of each size kept ready at first; the pool grows with demand, up to `max`.
    #[serde(default = "PoolConfig::default_initial")]
    pub initial: usize,
}

impl PoolConfig {
    /// Room for the initial handles of the default size and no more: a ready handle saves its
    /// grant one create and export (some 50-70 µs on an H200) whatever its size, so small
    /// handles are where the pool pays, while everything it holds stands on the device beside the
    /// tenants' memory and raises their peak as NVML sees it. A 1 GiB pool made the grants of
    /// nine traces' real paths at most about 8 % faster in total, and added its size to a
    /// training's peak (docs/benchmarks.md, "The daemon's pool: settings compared").
    fn default_max() -> Bytes {
        let sizes: u64 = Self::default_sizes().iter().map(|s| s.get()).sum();
        Bytes(sizes * Self::default_initial() as u64)
    }
    fn default_sizes() -> Vec<Bytes> {
        vec![Bytes::mib(2)]
    }
    fn default_initial() -> usize {
        4
    }
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            max: Self::default_max(),
            sizes: Self::default_sizes(),
            initial: Self::default_initial(),
        }
    }
}

/// Shared buffers: the scrub and the writer lease.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SharedConfig {
    /// Bytes per second the background scrub re-reads published versions at ("0" turns it off).
    #[serde(default = "SharedConfig::default_scrub_rate")]
    pub scrub_rate: Bytes,
    /// The longest time-to-live a writer lease may be taken or renewed for, in milliseconds.
    #[serde(default = "SharedConfig::default_max_lease_ms")]
    pub max_lease_ms: u64,
}

impl SharedConfig {
    fn default_scrub_rate() -> Bytes {
        Bytes::mib(256)
    }
    fn default_max_lease_ms() -> u64 {
        60_000
    }
}

impl Default for SharedConfig {
    fn default() -> Self {
        SharedConfig {
            scrub_rate: Self::default_scrub_rate(),
            max_lease_ms: Self::default_max_lease_ms(),
        }
    }
}

/// Bounds on every peer: how many connect, how long they may take, how many waits they hold.
/// Every value must be above 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConnectionsConfig {
    /// Connections open at once, tenants and tools together.
    #[serde(default = "ConnectionsConfig::default_max_total")]
    pub max_total: usize,
    /// Connections open at once from one uid.
    #[serde(default = "ConnectionsConfig::default_max_per_uid")]
    pub max_per_uid: usize,
    /// How long a new connection may stay silent before its first request.
    #[serde(default = "ConnectionsConfig::default_hello_timeout_ms")]
    pub hello_timeout_ms: u64,
    /// How long a peer may take to send one whole frame, from its first byte.
    #[serde(default = "ConnectionsConfig::default_frame_timeout_ms")]
    pub frame_timeout_ms: u64,
    /// How long a peer may take to accept one frame the daemon sends it (a reply).
    #[serde(default = "ConnectionsConfig::default_send_timeout_ms")]
    pub send_timeout_ms: u64,
    /// How long a tenant's socket may stay full (it does not read) before it is disconnected and
    /// its memory reclaimed as on a crash; reclaim requests to it are skipped meanwhile.
    #[serde(default = "ConnectionsConfig::default_unread_timeout_ms")]
    pub unread_timeout_ms: u64,
    /// Shared-buffer requests served on threads of their own (`WaitNewer`, `Publish`,
    /// `Verify`) that one connection may have in progress.
    #[serde(default = "ConnectionsConfig::default_max_waits")]
    pub max_waits: usize,
}

/// As the keys of `[connections]` read.
impl std::fmt::Display for ConnectionsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "max_total {}, max_per_uid {}, hello_timeout_ms {}, frame_timeout_ms {}, \
             send_timeout_ms {}, unread_timeout_ms {}, max_waits {}",
            self.max_total,
            self.max_per_uid,
            self.hello_timeout_ms,
            self.frame_timeout_ms,
            self.send_timeout_ms,
            self.unread_timeout_ms,
            self.max_waits
        )
    }
}

impl ConnectionsConfig {
    fn default_max_total() -> usize {
        2048
    }
    fn default_max_per_uid() -> usize {
        256
    }
    fn default_hello_timeout_ms() -> u64 {
        10_000
    }
    fn default_frame_timeout_ms() -> u64 {
        5_000
    }
    fn default_send_timeout_ms() -> u64 {
        5_000
    }
    fn default_unread_timeout_ms() -> u64 {
        10_000
    }
    fn default_max_waits() -> usize {
        16
    }

    pub fn hello_timeout(&self) -> Duration {
        Duration::from_millis(self.hello_timeout_ms)
    }
    pub fn frame_timeout(&self) -> Duration {
        Duration::from_millis(self.frame_timeout_ms)
    }
    pub fn send_timeout(&self) -> Duration {
        Duration::from_millis(self.send_timeout_ms)
    }
    pub fn unread_timeout(&self) -> Duration {
        Duration::from_millis(self.unread_timeout_ms)
    }
}

impl Default for ConnectionsConfig {
    fn default() -> Self {
        ConnectionsConfig {
            max_total: Self::default_max_total(),
            max_per_uid: Self::default_max_per_uid(),
            hello_timeout_ms: Self::default_hello_timeout_ms(),
            frame_timeout_ms: Self::default_frame_timeout_ms(),
            send_timeout_ms: Self::default_send_timeout_ms(),
            unread_timeout_ms: Self::default_unread_timeout_ms(),
            max_waits: Self::default_max_waits(),
        }
    }
}

/// How long a grant waits for reclaim when the file says nothing.
pub const DEFAULT_RECLAIM_TIMEOUT_MS: u64 = 250;

impl Config {
    /// Reads and parses `path`; whether the configuration can work is [`Config::problems`]'s.
    pub fn load(path: &Path) -> anyhow::Result<Config> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read config {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("invalid config {}", path.display()))
    }

    /// The socket's permission bits (default 0660).
    pub fn socket_mode(&self) -> Result<u32, ConfigError> {
        match &self.socket_mode {
            None => Ok(0o660),
            Some(s) => match u32::from_str_radix(s.trim_start_matches("0o"), 8) {
                Ok(m) if m <= 0o777 => Ok(m),
                Ok(_) => Err(ConfigError::SocketMode {
                    mode: s.clone(),
                    reason: "larger than 0777",
                }),
                Err(_) => Err(ConfigError::SocketMode {
                    mode: s.clone(),
                    reason: "not an octal mode like \"0660\"",
                }),
            },
        }
    }

    /// How long a grant waits for other tenants to give back idle memory.
    pub fn reclaim_timeout(&self) -> Duration {
        Duration::from_millis(
            self.reclaim_timeout_ms
                .unwrap_or(DEFAULT_RECLAIM_TIMEOUT_MS),
        )
    }

    /// The broker policy for a device of `capacity`: built-in classes, overridden or extended by
    /// the file's, and the declared tenants.
    pub fn policy(&self, capacity: Bytes) -> Policy {
        let mut policy = Policy::with_capacity(capacity);
        policy.classes.extend(self.classes.clone());
        policy.tenants = self.tenants.clone();
        if let Some(r) = self.priority_reserve {
            policy.priority_reserve = r;
        }
        for (key, limits) in &self.users {
            match key.parse::<u32>() {
                Ok(uid) => {
                    policy.users.insert(uid, *limits);
                }
                // Any other key is refused by `Config::problems`.
                Err(_) => policy.default_user = *limits,
            }
        }
        policy
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_is_auto_or_a_known_name() {
        let c: Config = toml::from_str(r#"backend = "auto""#).unwrap();
        assert_eq!(c.backend, Some(vram_device::BackendSelection::Auto));
        let e = toml::from_str::<Config>(r#"backend = "rocm""#).unwrap_err();
        assert!(
            e.to_string()
                .contains("unknown device backend `rocm`; known: auto, cuda, host"),
            "{e}"
        );
    }

    #[test]
    fn a_full_config_parses() {
        let c: Config = toml::from_str(
            r#"
            socket = "/tmp/v.sock"
            socket_mode = "0600"
            allowed_uids = [1000, 1001]
            backend = "host"
            capacity = "16 GiB"
            priority_reserve = "512 MiB"
            reclaim_timeout_ms = 300
            metrics = "0.0.0.0:9464"
            [pool]
            max = "2 GiB"
            sizes = ["2 MiB", "64 MiB"]
            [classes.batch]
            priority = 5
            default_limit = "4 GiB"
            [tenants.trainer]
            class = "high"
            guarantee = "8 GiB"
            limit = "12 GiB"
            "#,
        )
        .unwrap();
        assert_eq!(c.socket_mode().unwrap(), 0o600);
        assert_eq!(
            c.backend,
            Some(vram_device::BackendSelection::Only(
                vram_device::BackendKind::Host
            ))
        );
        let p = c.policy(Bytes::gib(16));
        assert_eq!(p.classes["batch"].priority, 5);
        assert!(p.classes.contains_key("high"));
        assert_eq!(p.tenants["trainer"].guarantee, Bytes::gib(8));
        assert_eq!(p.priority_reserve, Bytes::mib(512));
        assert_eq!(c.pool.sizes, vec![Bytes::mib(2), Bytes::mib(64)]);
        assert_eq!(c.metrics, "0.0.0.0:9464".parse().ok());
    }

    #[test]
    fn the_default_pool_holds_its_initial_handles_and_no_more() {
        let p = PoolConfig::default();
        assert_eq!(p.max, Bytes::mib(8), "docs/operations.md gives 8 MiB");
        assert_eq!(
            p.max.get(),
            p.sizes.iter().map(|s| s.get()).sum::<u64>() * p.initial as u64
        );
    }

    #[test]
    fn unknown_keys_and_bad_sizes_are_errors() {
        assert!(toml::from_str::<Config>("capacty = \"1 GiB\"").is_err());
        let e = toml::from_str::<Config>("capacity = \"12 parsecs\"").unwrap_err();
        assert!(e.to_string().contains("12 parsecs"), "{e}");
        let c: Config = toml::from_str("socket_mode = \"999\"").unwrap();
        assert!(c.socket_mode().is_err());
    }
}
