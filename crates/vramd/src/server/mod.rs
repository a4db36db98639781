//! The daemon: a Unix-socket server with one thread per connection. The broker (in `vram-core`)
//! decides; this module creates, passes and releases memory and keeps the books in step.
//!
//! Locking: each device slot has one mutex over its broker and grant table, held only for
//! bookkeeping, never across device calls or socket writes.
//!
//! No peer waits on another: a connection's own replies wait at most `[connections]
//! send_timeout_ms` for it to read, and requests the daemon sends a tenant on another's behalf
//! (reclaim) are never waited for (`peer::Peer::offer`).

mod accept;
mod admin;
pub mod driver;
mod exit;
mod fit;
mod peer;
mod pool;
mod reconcile;
mod reload;
mod scrub;
mod session;
mod shared;
mod slot;
#[cfg(test)]
mod slot_tests;
mod socket;
mod state;

use std::collections::HashMap;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::bail;
use vram_core::broker::Policy;
use vram_device::Device;
use vram_proto::{DaemonInfo, StatusReport};

pub use pool::Pool;
pub use reload::{Reload, ReloadError};
pub use slot::Applied;
pub use slot::Slot;
pub use socket::SocketError;
pub use state::held_by_live_tenants;

use crate::config::{ConnectionsConfig, PoolConfig};
use crate::metrics::Instruments;
use peer::{Offer, Peer};

/// Builds each device's policy from its capacity.
pub type PolicyFn = Box<dyn Fn(&dyn Device) -> Policy>;

/// Everything `serve` needs, resolved from flags and the config file.
pub struct ServeOptions {
    pub socket: PathBuf,
    pub socket_mode: u32,
    /// Uids allowed to connect; `None`: root and the daemon's own uid.
    pub allowed_uids: Option<Vec<u32>>,
    pub devices: Vec<Arc<dyn Device>>,
    pub policy: PolicyFn,
    pub pool: PoolConfig,
    pub reclaim_timeout: Duration,
    /// Where the driver's own figures come from (NVML on a GPU); `None`: the books are not
    /// checked (the host backend has no driver to ask).
    pub probe: Option<Arc<dyn driver::DriverProbe>>,
    /// How often the books are checked against the probe.
    pub probe_period: Duration,
}

/// What may change while serving (`vramd serve` reloads it on SIGHUP), read by each request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// Uids allowed to connect.
    pub allowed_uids: Vec<u32>,
    /// How long a grant waits for other tenants to give back idle memory.
    pub reclaim_timeout: Duration,
    pub connections: ConnectionsConfig,
    /// Uids allowed to make admin calls (declare and withdraw tenants).
    pub admin_uids: Vec<u32>,
}

/// State shared by every connection.
pub struct Daemon {
    pub(crate) slots: Vec<Slot>,
    settings: RwLock<Arc<Settings>>,
    socket: PathBuf,
    started: Instant,
    pub(crate) protocol_errors: AtomicU64,
    /// Connections refused at accept (caps, uids, out of descriptors).
    pub(crate) connections_refused: AtomicU64,
    pub(crate) shutting_down: AtomicBool,
    /// Every open connection, so shutdown can close them and reclaim can reach tenants.
    pub(crate) conns: Mutex<HashMap<u64, Arc<Peer>>>,
    next_conn: AtomicU64,
    pub(crate) next_ask: AtomicU64,
    /// Set when metrics are served; until then the grant path records nothing.
    metrics: OnceLock<Instruments>,
    /// The driver's figures, where there is a driver to ask, and each device's last reading.
    pub(crate) driver_check: Option<reconcile::DriverCheck>,
    pub(crate) shared: shared::SharedServer,
    /// Tenants declared at run time by admin calls.
    pub(crate) declared: admin::Declarations,
}

impl Daemon {
    /// The settings in force now.
    pub fn settings(&self) -> Arc<Settings> {
        self.settings
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn set_settings(&self, settings: Settings) {
        *self.settings.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(settings);
    }

    pub(crate) fn metrics(&self) -> Option<&Instruments> {
        self.metrics.get()
    }

    pub(crate) fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Acquire)
    }

    /// Sleeps `period`, or less if the daemon starts shutting down meanwhile.
    pub(crate) fn sleep_unless_shutdown(&self, period: Duration) {
        let until = Instant::now() + period;
        while !self.is_shutting_down() {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            std::thread::sleep(left.min(Duration::from_millis(50)));
        }
    }

    /// Asks the tenant on connection `conn` to give back up to `bytes` of idle memory, without
    /// waiting for it: a tenant whose socket is full (it does not read) is skipped, and once it
    /// has stayed so for `[connections] unread_timeout_ms` it is disconnected, its memory
    /// reclaimed as on a crash.
    pub(crate) fn ask_reclaim(&self, conn: u64, bytes: vram_core::Bytes) {
        let Some(peer) = self.conns.lock().expect("conns").get(&conn).cloned() else {
            return;
        };
        let settings = self.settings();
        let ask = self.next_ask.fetch_add(1, Ordering::Relaxed);
        let deadline_ms = u32::try_from(settings.reclaim_timeout.as_millis()).unwrap_or(u32::MAX);
        let request = vram_proto::Reply::Reclaim {
            ask,
            bytes,
            deadline_ms,
        };
        let unread = settings.connections.unread_timeout();
        match peer.offer(&request, unread) {
            Offer::Sent => {
                peer.asked(ask);
                tracing::info!(ask, conn, %bytes, deadline_ms, "asking a tenant to give back idle memory");
                if let Some(m) = self.metrics() {
                    m.reclaim_asked();
                }
            }
            Offer::Skipped { for_, first } => {
                let unread_ms = for_.as_millis() as u64;
                if for_ >= unread {
                    tracing::warn!(
                        conn, pid = peer.pid, unread_ms, limit_ms = unread.as_millis() as u64,
                        "tenant does not read its socket: disconnected; its memory is reclaimed as \
                         on a crash"
                    );
                    peer.disconnect();
                } else if first {
                    tracing::warn!(
                        conn, pid = peer.pid, %bytes, limit_ms = unread.as_millis() as u64,
                        "tenant does not read its socket: reclaim request skipped (it is \
                         disconnected if this lasts)"
                    );
                }
            }
            Offer::Gone => {}
        }
    }

    /// The whole daemon's state, as `vramd status` shows it.
    pub fn status(&self) -> StatusReport {
        self.status_with(shared::STATUS_ACL_ENTRIES)
    }

    /// [`Daemon::status`] with at most `acl_entries` shared-buffer access-list entries per
    /// device (0 for a reader that uses none: the metrics).
    pub fn status_with(&self, acl_entries: usize) -> StatusReport {
        let mut devices = Vec::new();
        let mut tenants = Vec::new();
        for slot in &self.slots {
            let (d, t) = slot.status();
            devices.push(d);
            tenants.extend(t);
        }
        StatusReport {
            daemon: DaemonInfo {
                pid: std::process::id(),
                version: env!("CARGO_PKG_VERSION").to_string(),
                uptime_seconds: self.started.elapsed().as_secs_f64(),
                socket: self.socket.display().to_string(),
                protocol_errors: self.protocol_errors.load(Ordering::Relaxed),
                connections: self.conns.lock().map(|c| c.len()).unwrap_or(0) as u64,
                log_lines_dropped: crate::logging::dropped(),
                connections_refused: self.connections_refused.load(Ordering::Relaxed),
                tenants_left_out: 0,
            },
            devices,
            tenants,
            shared: shared::status(self, acl_entries),
        }
    }

    /// The status report as the reply to request `id` can carry it: cut to fit one frame when
    /// it would not (`fit`), with what was left out counted in it and logged.
    pub(crate) fn status_reply(&self, id: u64) -> StatusReport {
        let (report, cut) = fit::fit(id, self.status());
        if let Some(c) = cut {
            tracing::warn!(
                acl_entries = c.acl_entries,
                buffers = c.buffers,
                tenants = c.tenants,
                limit = vram_proto::MAX_PAYLOAD,
                "status report cut to fit one frame: what was left out is counted in it \
                 (the metrics endpoint's /status has it all)"
            );
        }
        report
    }
}

/// A bound, not yet running server. Dropped without running (a failed start), it removes its
/// socket like a stopped one.
pub struct Server {
    daemon: Arc<Daemon>,
    listener: Arc<UnixListener>,
    /// Removes the socket when dropped, if it is still this daemon's.
    own_socket: socket::OwnSocket,
    pool_threads: Vec<JoinHandle<()>>,
    keeper: Arc<state::Keeper>,
}

/// Stops a running server from another thread (a signal handler's thread, a test).
#[derive(Clone)]
pub struct Shutdown {
    daemon: Arc<Daemon>,
    listener: Arc<UnixListener>,
}

impl Shutdown {
    pub fn trigger(&self) {
        if self.daemon.shutting_down.swap(true, Ordering::AcqRel) {
            return;
        }
        // Wakes the accept loop (`accept` fails at once from now on). Not a connect to the
        // socket's path: that path may no longer lead to this daemon.
        let _ = rustix::net::shutdown(&*self.listener, rustix::net::Shutdown::Both);
    }
}

impl Server {
    /// Checks each device's policy, binds the socket and starts the pools. Refuses to replace a
    /// socket a live daemon answers on, or anything at the path that is not a socket; a policy
    /// that cannot work is refused before the socket is made.
    pub fn bind(opts: ServeOptions) -> anyhow::Result<Server> {
        if opts.devices.is_empty() {
            bail!("no device to serve");
        }
        let mut slots = Vec::new();
        let mut pools = Vec::new();
        let mut configured = Vec::new();
        for (i, device) in opts.devices.iter().enumerate() {
            let policy = (opts.policy)(device.as_ref());
            policy.check()?;
            configured.push(policy.tenants.clone());
            let pool = Pool::new(device.clone(), opts.pool.clone());
            slots.push(Slot::new(i as u32, device.clone(), policy, pool.clone())?);
            pools.push(pool);
        }
        let (listener, own_socket) = socket::bind(&opts.socket, opts.socket_mode)?;
        let mut pool_threads: Vec<JoinHandle<()>> = pools.iter().map(|p| p.start()).collect();
        let settings = Settings {
            allowed_uids: opts
                .allowed_uids
                .unwrap_or_else(|| vec![0, rustix::process::getuid().as_raw()]),
            reclaim_timeout: opts.reclaim_timeout,
            connections: ConnectionsConfig::default(),
            admin_uids: default_admins(),
        };
        let daemon = Arc::new(Daemon {
            slots,
            settings: RwLock::new(Arc::new(settings)),
            socket: opts.socket,
            started: Instant::now(),
            protocol_errors: AtomicU64::new(0),
            connections_refused: AtomicU64::new(0),
            shutting_down: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(1),
            next_ask: AtomicU64::new(1),
            metrics: OnceLock::new(),
            shared: shared::SharedServer::default(),
            declared: admin::Declarations::new(configured),
            driver_check: opts
                .probe
                .map(|p| reconcile::DriverCheck::new(p, opts.devices.len(), opts.probe_period)),
        });
        // Tenants of a daemon before are adopted before anything else sees the books.
        let keeper = Arc::new(state::Keeper::adopt(&daemon, &daemon.socket));
        pool_threads.push(start_keeper(daemon.clone(), keeper.clone())?);
        pool_threads.push(scrub::start(daemon.clone())?);
        if let Some(check) = &daemon.driver_check {
            // The first reading before any tenant is admitted, so that memory already in use on
            // the device is never promised.
            check.check(&daemon);
            pool_threads.push(reconcile::start(daemon.clone(), check.period())?);
        }
        Ok(Server {
            daemon,
            listener: Arc::new(listener),
            own_socket,
            pool_threads,
            keeper,
        })
    }

    /// Applies the `[connections]` bounds (for connections accepted from now on; defaults until
    /// called).
    pub fn configure_connections(&self, connections: ConnectionsConfig) {
        let mut s = (*self.daemon.settings()).clone();
        s.connections = connections;
        self.daemon.set_settings(s);
    }

    /// Sets the uids allowed to make admin calls (`None`: root and the daemon's own uid).
    pub fn configure_admins(&self, admin_uids: Option<Vec<u32>>) {
        let mut s = (*self.daemon.settings()).clone();
        s.admin_uids = admin_uids.unwrap_or_else(default_admins);
        self.daemon.set_settings(s);
    }

    pub fn daemon(&self) -> &Arc<Daemon> {
        &self.daemon
    }

    /// Turns on the grant and reclaim instruments (for tenants that connect from now on).
    pub fn enable_metrics(&self, per_tenant: bool) -> &Instruments {
        self.daemon
            .metrics
            .get_or_init(|| Instruments::new(per_tenant))
    }

    pub fn shutdown_handle(&self) -> Shutdown {
        Shutdown {
            daemon: self.daemon.clone(),
            listener: self.listener.clone(),
        }
    }

    /// Serves until [`Shutdown::trigger`]; then closes every connection (which returns everything
    /// tenants held), releases the pools and removes the socket.
    pub fn run(self) -> anyhow::Result<()> {
        let sessions = accept::run(&self.daemon, &self.listener);
        // The next daemon adopts the tenants from this: they reconnect to it.
        self.keeper.final_save(&self.daemon);
        tracing::info!("shutting down: closing {} connections", sessions.len());
        for peer in self.daemon.conns.lock().expect("conns").values() {
            peer.disconnect();
        }
        for h in sessions {
            let _ = h.join();
        }
        for slot in &self.daemon.slots {
            slot.pool().stop();
        }
        for t in self.pool_threads {
            let _ = t.join();
        }
        drop(self.own_socket);
        tracing::info!("stopped");
        Ok(())
    }
}

/// Books back the memory tenants gave back while still reaching it, once it is gone.
fn sweep_kept(daemon: &Daemon) {
    for (gpu, slot) in daemon.slots.iter().enumerate() {
        for (tenant, uid, bytes) in slot.sweep_kept() {
            tracing::info!(
                tenant, uid, gpu, %bytes,
                "memory a tenant gave back while still reaching it is gone: back in the books"
            );
        }
    }
}

/// The state file's housekeeping and the sweep of kept memory, every [`state::SAVE_EVERY`]
/// until shutdown.
fn start_keeper(
    daemon: Arc<Daemon>,
    keeper: Arc<state::Keeper>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("vramd-state".into())
        .spawn(move || {
            while !daemon.is_shutting_down() {
                daemon.sleep_unless_shutdown(state::SAVE_EVERY);
                keeper.tick(&daemon);
                sweep_kept(&daemon);
            }
        })
}

/// Who may make admin calls when the configuration names no one: root and the daemon's own uid.
fn default_admins() -> Vec<u32> {
    let me = rustix::process::getuid().as_raw();
    if me == 0 {
        vec![0]
    } else {
        vec![0, me]
    }
}
