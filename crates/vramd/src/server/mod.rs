//! The daemon: a Unix-socket server with one thread per connection. The broker (in `vram-core`)
//! decides; this module creates, passes and releases memory and keeps the books in step.
//!
//! Locking: each device slot has one mutex over its broker and grant table, held only for
//! bookkeeping, never across device calls or socket writes.

pub mod driver;
mod pool;
mod reconcile;
mod scrub;
mod session;
mod shared;
mod slot;
mod state;

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use vram_core::broker::Policy;
use vram_device::Device;
use vram_proto::{Conn, DaemonInfo, StatusReport};

pub use pool::Pool;
pub use slot::Applied;
pub use slot::Slot;

use crate::config::PoolConfig;
use crate::metrics::Instruments;

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

/// State shared by every connection.
pub struct Daemon {
    pub(crate) slots: Vec<Slot>,
    allowed_uids: Vec<u32>,
    socket: PathBuf,
    started: Instant,
    pub(crate) reclaim_timeout: Duration,
    pub(crate) protocol_errors: AtomicU64,
    pub(crate) shutting_down: AtomicBool,
    /// Every open connection, so shutdown can close them and reclaim can reach tenants.
    pub(crate) conns: Mutex<HashMap<u64, Arc<Conn>>>,
    next_conn: AtomicU64,
    pub(crate) next_ask: AtomicU64,
    /// Set when metrics are served; until then the grant path records nothing.
    metrics: OnceLock<Instruments>,
    pub(crate) shared: shared::SharedServer,
}

impl Daemon {
    pub(crate) fn uid_allowed(&self, uid: u32) -> bool {
        self.allowed_uids.contains(&uid)
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

    /// Asks the tenant on connection `conn` to give back up to `bytes` of idle memory.
    pub(crate) fn ask_reclaim(&self, conn: u64, bytes: vram_core::Bytes) {
        let Some(c) = self.conns.lock().expect("conns").get(&conn).cloned() else {
            return;
        };
        let ask = self.next_ask.fetch_add(1, Ordering::Relaxed);
        let deadline_ms = self.reclaim_timeout.as_millis() as u32;
        tracing::info!(ask, conn, %bytes, deadline_ms, "asking a tenant to give back idle memory");
        if let Some(m) = self.metrics() {
            m.reclaim_asked();
        }
        let _ = c.send(
            0,
            &vram_proto::Reply::Reclaim {
                ask,
                bytes,
                deadline_ms,
            },
            &[],
        );
    }

    /// The whole daemon's state, as `vramd status` shows it.
    pub fn status(&self) -> StatusReport {
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
            },
            devices,
            tenants,
            shared: shared::status(self),
        }
    }
}

/// A bound, not yet running server.
pub struct Server {
    daemon: Arc<Daemon>,
    listener: UnixListener,
    pool_threads: Vec<JoinHandle<()>>,
    keeper: Arc<state::Keeper>,
}

/// Stops a running server from another thread (a signal handler's thread, a test).
#[derive(Clone)]
pub struct Shutdown {
    daemon: Arc<Daemon>,
}

impl Shutdown {
    pub fn trigger(&self) {
        if self.daemon.shutting_down.swap(true, Ordering::AcqRel) {
            return;
        }
        // Wake the accept loop.
        let _ = UnixStream::connect(&self.daemon.socket);
    }
}

impl Server {
    /// Binds the socket and starts the pools. Refuses to replace a socket a live daemon answers on.
    pub fn bind(opts: ServeOptions) -> anyhow::Result<Server> {
        if opts.devices.is_empty() {
            bail!("no device to serve");
        }
        let listener = bind_socket(&opts.socket, opts.socket_mode)?;
        let mut slots = Vec::new();
        let mut pool_threads = Vec::new();
        for (i, device) in opts.devices.iter().enumerate() {
            let policy = (opts.policy)(device.as_ref());
            let pool = Pool::new(device.clone(), opts.pool.clone());
            pool_threads.push(pool.start());
            slots.push(Slot::new(i as u32, device.clone(), policy, pool)?);
        }
        let daemon = Arc::new(Daemon {
            slots,
            allowed_uids: opts
                .allowed_uids
                .unwrap_or_else(|| vec![0, rustix::process::getuid().as_raw()]),
            socket: opts.socket,
            started: Instant::now(),
            reclaim_timeout: opts.reclaim_timeout,
            protocol_errors: AtomicU64::new(0),
            shutting_down: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(1),
            next_ask: AtomicU64::new(1),
            metrics: OnceLock::new(),
            shared: shared::SharedServer::default(),
        });
        // Tenants of a daemon before are adopted before anything else sees the books.
        let keeper = Arc::new(state::Keeper::adopt(&daemon, &daemon.socket));
        pool_threads.push(start_keeper(daemon.clone(), keeper.clone())?);
        pool_threads.push(scrub::start(daemon.clone())?);
        if let Some(probe) = opts.probe {
            // The first reading before any tenant is admitted, so that memory already in use on
            // the device is never promised.
            let mut first = vec![None; daemon.slots.len()];
            reconcile::reconcile_once(&daemon, probe.as_ref(), &mut first);
            pool_threads.push(reconcile::start(
                daemon.clone(),
                probe,
                opts.probe_period,
                first,
            )?);
        }
        Ok(Server {
            daemon,
            listener,
            pool_threads,
            keeper,
        })
    }

    pub fn daemon(&self) -> &Arc<Daemon> {
        &self.daemon
    }

    /// Turns on the grant and reclaim instruments (for tenants that connect from now on).
    pub fn enable_metrics(&self) -> &Instruments {
        self.daemon.metrics.get_or_init(Instruments::default)
    }

    pub fn shutdown_handle(&self) -> Shutdown {
        Shutdown {
            daemon: self.daemon.clone(),
        }
    }

    /// Serves until [`Shutdown::trigger`]; then closes every connection (which returns everything
    /// tenants held), releases the pools and removes the socket.
    pub fn run(self) -> anyhow::Result<()> {
        let mut sessions: Vec<JoinHandle<()>> = Vec::new();
        for stream in self.listener.incoming() {
            if self.daemon.shutting_down.load(Ordering::Acquire) {
                break;
            }
            let stream = match stream {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!("accept failed: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            sessions.retain(|h| !h.is_finished());
            let id = self.daemon.next_conn.fetch_add(1, Ordering::Relaxed);
            let conn = Arc::new(Conn::new(stream));
            self.daemon
                .conns
                .lock()
                .expect("conns")
                .insert(id, conn.clone());
            let daemon = self.daemon.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("vramd-conn-{id}"))
                .spawn(move || session::run(daemon, id, conn));
            match spawned {
                Ok(h) => sessions.push(h),
                Err(e) => {
                    tracing::error!("cannot start a connection thread: {e}");
                    self.daemon.conns.lock().expect("conns").remove(&id);
                }
            }
        }
        // The next daemon adopts the tenants from this: they reconnect to it.
        self.keeper.final_save(&self.daemon);
        tracing::info!("shutting down: closing {} connections", sessions.len());
        for conn in self.daemon.conns.lock().expect("conns").values() {
            let _ = conn.stream().shutdown(std::net::Shutdown::Both);
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
        let _ = std::fs::remove_file(&self.daemon.socket);
        tracing::info!("stopped");
        Ok(())
    }
}

/// The state file's housekeeping, every [`state::SAVE_EVERY`] until shutdown.
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
            }
        })
}

fn bind_socket(path: &Path, mode: u32) -> anyhow::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create socket directory {}", dir.display()))?;
    }
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            bail!(
                "another vramd is already serving on {}; stop it or choose another --socket",
                path.display()
            );
        }
        std::fs::remove_file(path)
            .with_context(|| format!("cannot remove stale socket {}", path.display()))?;
    }
    let listener =
        UnixListener::bind(path).with_context(|| format!("cannot bind {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("cannot set mode {mode:o} on {}", path.display()))?;
    Ok(listener)
}
