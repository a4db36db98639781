//! `vramd serve`: the daemon.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use vram_core::Bytes;
use vram_device::{BackendKind, BackendSelection, Device};

use crate::config::{CheckedDevice, Config, ConfigError};
use crate::logging::Chain;
use crate::metrics::{Exporter, MetricsAddr};
use crate::server::driver::{DriverProbe, NvmlProbe};
use crate::server::{ServeOptions, Server};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Where to listen [default: the config's `socket`, else VRAMD_SOCKET, else
    /// /run/vramd/vramd.sock]
    #[arg(long, short = 's')]
    pub socket: Option<PathBuf>,
    /// A TOML configuration file (classes, declared tenants, socket mode, allowed uids, pool).
    #[arg(long, short = 'c')]
    pub config: Option<PathBuf>,
    /// Which memory to serve: `auto` (cuda where a GPU is found, else host), `host` or `cuda`.
    #[arg(long, value_name = "BACKEND")]
    pub backend: Option<BackendSelection>,
    /// Capacity of the host backend's device (e.g. `16GiB`); on cuda, a cap below the GPU's memory.
    #[arg(long)]
    pub capacity: Option<Bytes>,
    /// Serve Prometheus metrics, /healthz and /status over HTTP at this address (port 0: any free
    /// port, logged), or `off` [default: the config's `metrics`, else 127.0.0.1:9464]
    #[arg(long)]
    pub metrics: Option<MetricsAddr>,
    /// Say whether FILE is a configuration the daemon can start with (and why not), then exit:
    /// 0 valid, 1 invalid. Nothing is started; --backend and --capacity are taken into account.
    #[arg(long, value_name = "FILE", conflicts_with = "config")]
    pub check_config: Option<PathBuf>,
    /// Stop cleanly, as on SIGTERM, once standard input reaches its end: for a daemon that
    /// another program starts with a pipe as its standard input, so that it stops when that
    /// program ends, however it ends (vramd's own tools start their daemons so). Not for a
    /// service: a standard input of /dev/null ends at once.
    #[arg(long)]
    pub stop_on_stdin_close: bool,
}

/// The host backend's capacity when none is configured.
pub const DEFAULT_HOST_CAPACITY: Bytes = Bytes::gib(16);

/// How often the books are checked against the driver's figures.
const PROBE_PERIOD: Duration = Duration::from_millis(500);

pub fn run(args: Args) -> anyhow::Result<std::process::ExitCode> {
    if let Some(path) = &args.check_config {
        return Ok(check_config(&args, path));
    }
    let signals = signals::install()?;
    let config_path = args.config.as_deref().unwrap_or(Path::new(""));
    let config = match &args.config {
        Some(p) => Config::load(p).inspect_err(|e| config_error(p, e))?,
        None => Config::default(),
    };
    // A capacity of 0 would fail the device's opening with a less clear message; every other
    // problem is said at once below, with the devices known.
    if config.capacity == Some(Bytes::ZERO) {
        refuse_problems(config_path, config.problems(&[]))?;
    }
    let socket = args
        .socket
        .clone()
        .or_else(|| config.socket.clone())
        .unwrap_or_else(vram_client::default_socket);
    let capacity = args.capacity.or(config.capacity);
    let backend = args.backend.or(config.backend).unwrap_or_default();
    let devices = open_devices(backend, capacity)?;
    raise_fd_limit();
    let probe = open_probe(&devices);
    let uuids: Vec<String> = devices.iter().map(|d| d.info().uuid.clone()).collect();
    let held = crate::server::held_by_live_tenants(&socket, &uuids);
    let measured: Vec<Option<Bytes>> = devices
        .iter()
        .zip(held)
        .map(|(d, held)| {
            let info = d.info();
            measured_memory(probe.as_deref(), info.kind, &info.uuid, held, capacity)
        })
        .collect::<anyhow::Result<_>>()?;
    let caps: Vec<Bytes> = devices
        .iter()
        .zip(&measured)
        .map(|(d, m)| effective_capacity(d.as_ref(), *m, capacity))
        .collect();
    let facts: Vec<CheckedDevice> = devices
        .iter()
        .zip(&caps)
        .map(|(d, c)| CheckedDevice {
            capacity: Some(*c),
            granularity: Some(d.info().granularity),
        })
        .collect();
    refuse_problems(config_path, config.problems(&facts))?;
    for (name, t) in config.tenants.iter().filter(|(_, t)| !t.has_owners()) {
        tracing::warn!(
            tenant = name,
            class = t.class,
            "declared tenant has no owners: any allowed uid may connect as it and take its \
             guarantee (set tenants.{name}.owners or tenants.{name}.groups)"
        );
    }
    let policy_config = config.clone();
    let by_uuid: Vec<(String, Bytes)> = devices
        .iter()
        .zip(&caps)
        .map(|(d, c)| (d.info().uuid.clone(), *c))
        .collect();
    let policy = Box::new(move |d: &dyn Device| {
        let cap = by_uuid
            .iter()
            .find(|(u, _)| *u == d.info().uuid)
            .map_or(d.info().capacity, |(_, c)| *c);
        policy_config.policy(cap)
    });
    let opts = ServeOptions {
        socket: socket.clone(),
        socket_mode: config.socket_mode()?,
        allowed_uids: config.allowed_uids.clone(),
        devices: devices.clone(),
        policy,
        pool: config.pool.clone(),
        reclaim_timeout: config.reclaim_timeout(),
        probe,
        probe_period: PROBE_PERIOD,
    };
    let server = Server::bind(opts).inspect_err(|e| {
        tracing::error!(error = %Chain(e), "cannot start the daemon");
    })?;
    server.configure_shared(&config.shared);
    server.configure_connections(config.connections);
    server.configure_admins(config.admin_uids.clone());
    // From here a failed start drops `server`, which removes the socket it made.
    let detail = crate::metrics::Detail {
        tenants: config.metrics_tenants,
        status: config.http_status,
    };
    let exporter =
        start_metrics(&server, args.metrics.or(config.metrics), detail).inspect_err(|e| {
            tracing::error!(error = %Chain(e), "cannot start the daemon");
        })?;
    let reloader = Reloader {
        path: args.config.clone(),
        started: config,
        devices: facts,
        daemon: server.daemon().clone(),
    };
    signals::start(signals, server.shutdown_handle(), reloader)?;
    if args.stop_on_stdin_close {
        stop_on_stdin_close(server.shutdown_handle())?;
    }
    for (d, cap) in devices.iter().zip(&caps) {
        let info = d.info();
        tracing::info!(
            backend = %info.kind, uuid = info.uuid, name = info.name, capacity = %cap,
            granularity = %info.granularity, "serving device"
        );
    }
    tracing::info!(socket = %socket.display(), pid = std::process::id(), "vramd ready");
    crate::notify::notify("READY=1\nSTATUS=serving");
    server.run()?;
    drop(exporter);
    Ok(std::process::ExitCode::SUCCESS)
}

/// An address asked for (flag or config) must be served; the default one, when taken (another
/// daemon, a test), is only warned about.
fn start_metrics(
    server: &Server,
    asked: Option<MetricsAddr>,
    detail: crate::metrics::Detail,
) -> anyhow::Result<Option<Exporter>> {
    let MetricsAddr::At(addr) = asked.unwrap_or(MetricsAddr::DEFAULT) else {
        return Ok(None);
    };
    match Exporter::start(addr, server, detail) {
        Ok(e) => {
            tracing::info!(addr = %e.addr(), "serving metrics at http://{}/metrics", e.addr());
            Ok(Some(e))
        }
        Err(e) if asked.is_none() => {
            tracing::warn!(
                "{}; running without metrics (set --metrics ADDR or `off`)",
                Chain(&e)
            );
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

fn config_error(path: &Path, e: &anyhow::Error) {
    tracing::error!(path = %path.display(), error = %Chain(e), "configuration error");
}

/// Refuses to go on with a configuration that cannot work: each problem logged, all of them in
/// the error.
fn refuse_problems(path: &Path, problems: Vec<ConfigError>) -> anyhow::Result<()> {
    if problems.is_empty() {
        return Ok(());
    }
    let text = problems
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ");
    let e = anyhow::anyhow!("invalid configuration: {text}");
    config_error(path, &e);
    Err(e)
}

/// `--check-config FILE`: the file's problems on the devices the flags and the file describe
/// (a GPU's capacity is measured at start, so without `capacity` the guarantees are checked for
/// overflow only). Prints the verdict; 0 valid, 1 invalid.
fn check_config(args: &Args, path: &Path) -> std::process::ExitCode {
    let config = match Config::load(path) {
        Ok(c) => c,
        Err(e) => {
            println!("{}: invalid: {}", path.display(), Chain(&e));
            return std::process::ExitCode::from(1);
        }
    };
    let capacity = args.capacity.or(config.capacity);
    let backend = args.backend.or(config.backend).unwrap_or_default();
    // Auto is the backend a start here would take.
    let (kind, found) = backend.resolve(DEFAULT_HOST_CAPACITY);
    let device = match kind {
        BackendKind::Host => CheckedDevice {
            capacity: Some(capacity.unwrap_or(DEFAULT_HOST_CAPACITY)),
            granularity: Some(vram_device::host::DEFAULT_GRANULARITY),
        },
        // A GPU's memory is measured at start; its granularity is the driver's, where it answers.
        BackendKind::Cuda => CheckedDevice {
            capacity,
            granularity: found.iter().map(|i| i.granularity).max(),
        },
    };
    let problems = config.problems(&[device]);
    if backend == BackendSelection::Auto {
        println!("{}: backend auto is {kind} on this machine", path.display());
    }
    if problems.is_empty() {
        println!("{}: valid", path.display());
        if device.capacity.is_none() {
            println!(
                "  the capacity is measured at start: declared guarantees must fit the GPU's \
                 memory then"
            );
        }
        if device.granularity.is_none() {
            println!("  [pool] sizes are checked against the GPU's granularity at start");
        }
        return std::process::ExitCode::SUCCESS;
    }
    println!("{}: invalid:", path.display());
    for p in &problems {
        println!("  - {p}");
    }
    std::process::ExitCode::from(1)
}

/// Reloads the configuration file (SIGHUP): the live part put in force, or the whole of it
/// refused and the configuration in force kept; keys that only a restart can change are named.
struct Reloader {
    path: Option<PathBuf>,
    /// The file the daemon started with: what the fixed keys stay.
    started: Config,
    devices: Vec<CheckedDevice>,
    daemon: Arc<crate::server::Daemon>,
}

impl Reloader {
    fn reload(&self) {
        let Some(path) = &self.path else {
            tracing::warn!(
                "SIGHUP: there is no configuration file to reload (started without --config)"
            );
            return;
        };
        crate::notify::notify("RELOADING=1");
        match self.try_reload(path) {
            Ok(changes) => {
                tracing::info!(path = %path.display(), changes = changes.len(), "configuration reloaded");
                for c in changes {
                    tracing::info!("configuration change: {c}");
                }
            }
            Err(e) => tracing::error!(
                path = %path.display(), error = %Chain(&e),
                "configuration reload refused; the configuration in force stays"
            ),
        }
        crate::notify::notify("READY=1\nSTATUS=serving");
    }

    fn try_reload(&self, path: &Path) -> anyhow::Result<Vec<String>> {
        let new = Config::load(path)?;
        let problems = new.problems(&self.devices);
        if !problems.is_empty() {
            let text: Vec<String> = problems.iter().map(ToString::to_string).collect();
            bail!("invalid configuration: {}", text.join("; "));
        }
        // A lower `capacity` only applies at the next start: a file that would then be refused
        // is refused now, not left to fail the restart.
        let at_restart: Vec<CheckedDevice> = self
            .devices
            .iter()
            .map(|d| CheckedDevice {
                capacity: d.capacity.map(|c| new.capacity.map_or(c, |n| n.min(c))),
                granularity: d.granularity,
            })
            .collect();
        let later = new.problems(&at_restart);
        if !later.is_empty() {
            let text: Vec<String> = later.iter().map(ToString::to_string).collect();
            bail!(
                "the daemon would not start again with this file (its capacity applies at the \
                 next start): {}",
                text.join("; ")
            );
        }
        let fixed = self.started.fixed_changes(&new);
        if !fixed.is_empty() {
            tracing::warn!(
                keys = fixed.join(", "),
                "configuration: these keys changed in the file but cannot change while serving \
                 (restart the daemon to apply them); the rest is reloaded"
            );
        }
        Ok(self.daemon.reload(new.live(), |cap| new.policy(cap))?)
    }
}

/// A thread that reads standard input to its end (what it reads is ignored), then stops the
/// daemon: the end comes when every holder of a pipe's other end has closed it or exited.
fn stop_on_stdin_close(shutdown: crate::server::Shutdown) -> anyhow::Result<()> {
    std::thread::Builder::new()
        .name("vramd-stdin".into())
        .spawn(move || {
            let mut sink = std::io::sink();
            match std::io::copy(&mut std::io::stdin().lock(), &mut sink) {
                Ok(_) => tracing::info!("standard input closed: stopping"),
                Err(e) => tracing::warn!(error = %e, "standard input unreadable: stopping"),
            }
            crate::notify::notify("STOPPING=1");
            shutdown.trigger();
        })
        .context("cannot start the thread that watches standard input")?;
    Ok(())
}

mod signals {
    //! The signal thread: SIGTERM, SIGINT and SIGQUIT stop the daemon cleanly (every connection
    //! closed, the socket removed); SIGHUP reloads the configuration.

    use signal_hook::consts::{SIGHUP, SIGINT, SIGQUIT, SIGTERM};
    use signal_hook::iterator::Signals;

    use super::Reloader;
    use crate::server::Shutdown;

    /// Catches the signals from now on (so that none kills the daemon while it starts); they are
    /// acted on once [`start`] runs.
    pub(super) fn install() -> anyhow::Result<Signals> {
        Signals::new([SIGTERM, SIGINT, SIGQUIT, SIGHUP])
            .map_err(|e| anyhow::anyhow!("cannot install signal handlers: {e}"))
    }

    pub(super) fn start(
        mut signals: Signals,
        shutdown: Shutdown,
        reloader: Reloader,
    ) -> anyhow::Result<()> {
        std::thread::Builder::new()
            .name("vramd-signals".into())
            .spawn(move || {
                for sig in signals.forever() {
                    tracing::info!(signal = sig, "signal received");
                    if sig == SIGHUP {
                        reloader.reload();
                        continue;
                    }
                    // Signals after the first are logged only: the shutdown is underway.
                    crate::notify::notify("STOPPING=1");
                    shutdown.trigger();
                }
            })?;
        Ok(())
    }
}

/// What vramd may hand out on a device: on the host backend its configured size; on cuda the
/// GPU's memory as the driver measures it (less what the driver reserves, where NVML says), or a
/// configured cap below that. Memory in use outside vramd's books (contexts, other processes) is
/// not set aside here: the books are checked against the driver while serving.
fn effective_capacity(d: &dyn Device, measured: Option<Bytes>, cap: Option<Bytes>) -> Bytes {
    let info = d.info();
    match info.kind {
        BackendKind::Host => info.capacity,
        BackendKind::Cuda => {
            let gpu = measured.map_or(info.capacity, |m| m.min(info.capacity));
            cap.map_or(gpu, |c| c.min(gpu))
        }
    }
}

/// NVML, where some device is a GPU; without it the daemon says what it cannot see.
fn open_probe(devices: &[Arc<dyn Device>]) -> Option<Arc<dyn DriverProbe>> {
    let gpus = devices.iter().any(|d| d.info().kind == BackendKind::Cuda);
    if !gpus {
        return None;
    }
    match NvmlProbe::open() {
        Ok(p) => Some(Arc::new(p)),
        Err(e) => {
            tracing::warn!(
                "NVML is not available ({e}): memory outside vramd's books (CUDA contexts, \
                 processes that are not tenants) cannot be seen, and guarantees count on it being \
                 free"
            );
            None
        }
    }
}

/// How many times the GPU's memory is read at start before the read is taken to fail.
const MEASURE_TRIES: u32 = 5;

/// The memory of GPU `uuid` as tenants can have it, read through `probe` (tried
/// [`MEASURE_TRIES`] times, 200 ms apart); `None` where there is nothing to read (no probe, not
/// a GPU). A GPU whose memory cannot be read is an error unless `capacity` is configured: the
/// device's size would then be taken whole, the memory the driver sets aside for itself lent
/// as if it were there.
fn measured_memory(
    probe: Option<&dyn DriverProbe>,
    kind: BackendKind,
    uuid: &str,
    held: Bytes,
    capacity: Option<Bytes>,
) -> anyhow::Result<Option<Bytes>> {
    let Some(probe) = probe else {
        return Ok(None);
    };
    if kind != BackendKind::Cuda {
        return Ok(None);
    }
    let mut tries = 0;
    let error = loop {
        match probe.total_memory(uuid, held) {
            Ok(m) => return Ok(Some(m)),
            Err(e) if tries + 1 >= MEASURE_TRIES => break e,
            Err(_) => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    };
    match capacity {
        Some(cap) => {
            tracing::warn!(
                uuid, capacity = %cap,
                "cannot read the GPU's memory ({error}): serving the configured capacity"
            );
            Ok(None)
        }
        None => bail!(
            "cannot read GPU {uuid}'s memory through NVML ({error}; {MEASURE_TRIES} tries): \
             without it the whole device would be lent, the memory the driver keeps for itself \
             with it. Start again once NVML answers, or set `capacity` (or --capacity) to what \
             tenants may have"
        ),
    }
}

/// The devices of the backend `selection` names (for `auto`, the first of
/// [`BackendKind::ALL`] that has one), opened for handles only: the daemon never copies through
/// them.
fn open_devices(
    selection: BackendSelection,
    capacity: Option<Bytes>,
) -> anyhow::Result<Vec<Arc<dyn Device>>> {
    let host_capacity = capacity.unwrap_or(DEFAULT_HOST_CAPACITY);
    if let BackendSelection::Only(kind) = selection {
        return open_backend(kind, host_capacity).with_context(|| format!("--backend {kind}"));
    }
    let mut failures = Vec::new();
    for kind in BackendKind::ALL {
        match open_backend(kind, host_capacity) {
            Ok(devices) => return Ok(devices),
            Err(e) => {
                tracing::warn!(
                    "backend auto: no {kind} device ({}); trying the next backend",
                    Chain(&e)
                );
                failures.push(format!("{kind}: {}", Chain(&e)));
            }
        }
    }
    bail!(
        "backend auto: no backend has a device ({})",
        failures.join("; ")
    )
}

/// Every device of `kind`, opened for handles only.
fn open_backend(kind: BackendKind, host_capacity: Bytes) -> anyhow::Result<Vec<Arc<dyn Device>>> {
    let infos = vram_device::devices(kind, host_capacity)?;
    if infos.is_empty() {
        bail!("the {kind} backend reports no device");
    }
    infos
        .iter()
        .map(|i| {
            vram_device::open_for_handles(i)
                .with_context(|| format!("cannot open {kind} device {}", i.uuid))
        })
        .collect()
}

/// One fd per handle is kept by the daemon; lift the soft limit to the hard one.
fn raise_fd_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut lim = getrlimit(Resource::Nofile);
    if lim.current < lim.maximum {
        lim.current = lim.maximum;
        if let Err(e) = setrlimit(Resource::Nofile, lim) {
            tracing::warn!("cannot raise the open-file limit: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::driver::{ProbeError, ScriptedProbe};
    use vram_core::books::DriverReading;

    #[test]
    fn a_gpu_whose_memory_cannot_be_read_is_served_only_with_a_configured_capacity() {
        let probe = ScriptedProbe::new();
        let measure = |capacity| {
            measured_memory(
                Some(&probe),
                BackendKind::Cuda,
                "GPU-1",
                Bytes::ZERO,
                capacity,
            )
        };
        probe.fail(
            "GPU-1",
            ProbeError::NotScripted {
                uuid: "GPU-1".into(),
            },
        );
        let e = measure(None).unwrap_err().to_string();
        assert!(
            e.contains("cannot read GPU GPU-1's memory") && e.contains("capacity"),
            "{e}"
        );
        assert_eq!(probe.reads(), u64::from(MEASURE_TRIES));
        assert_eq!(measure(Some(Bytes::gib(40))).unwrap(), None);
        probe.set(
            "GPU-1",
            DriverReading {
                total: Bytes::gib(80),
                reserved: Bytes::gib(1),
                used: Bytes::ZERO,
                allowance: Bytes::ZERO,
                processes: Vec::new(),
            },
        );
        assert_eq!(measure(None).unwrap(), Some(Bytes::gib(79)));
        // Nothing to read on the host backend, or without NVML.
        let host = measured_memory(Some(&probe), BackendKind::Host, "h", Bytes::ZERO, None);
        assert_eq!(host.unwrap(), None);
        let none = measured_memory(None, BackendKind::Cuda, "GPU-1", Bytes::ZERO, None);
        assert_eq!(none.unwrap(), None);
    }
}
