//! `vramd bench`: the take+return round trip through a real daemon — a grant (request, reply with
//! the handle's fd, import), optionally a map and unmap, and the return — as p50/p90/p99/max.
//!
//! Without `--socket` it starts its own daemon in a temporary directory (host backend unless
//! `--backend cuda`), with a pool sized for the benchmark, and stops it afterwards.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::Serialize;
use vram_client::{Client, TenantOptions};
use vram_core::Bytes;
use vram_device::{Access, Reservation};

use super::spread::Spread;
use crate::own_daemon::OwnDaemon;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// A running daemon's socket [default: start a daemon of our own in a temporary directory]
    #[arg(long, short = 's')]
    pub socket: Option<PathBuf>,
    /// Size of each grant; give several (`--size 2MiB --size 64MiB`) for one result per size.
    #[arg(long = "size", default_value = "2MiB")]
    pub sizes: Vec<Bytes>,
    /// Measured round trips per tenant and size.
    #[arg(long, default_value_t = 10_000)]
    pub iterations: u64,
    /// Round trips per tenant and size before measuring.
    #[arg(long, default_value_t = 500)]
    pub warmup: u64,
    /// Tenants taking and returning at once, each on its own connection and thread.
    #[arg(long, default_value_t = 1)]
    pub tenants: usize,
    /// Also map each grant into a reservation (and unmap it) inside the round trip.
    #[arg(long)]
    pub map: bool,
    /// Keep every measured grant until the end instead of giving it back inside the round trip,
    /// so that each take is a handle this tenant never had (the daemon keeps a handle given back
    /// for the same tenant's next grant of its size, and hands that one back first). Each tenant
    /// then holds iterations × size at the end.
    #[arg(long)]
    pub fresh: bool,
    /// Wait this long between round trips (e.g. `--pause-us 3000`), as a program does between its
    /// growths: the daemon's pool refills meanwhile.
    #[arg(long, default_value_t = 0, value_name = "MICROSECONDS")]
    pub pause_us: u64,
    /// Backend of our own daemon (ignored with `--socket`).
    #[arg(long, default_value = "host", value_name = "BACKEND")]
    pub backend: vram_device::BackendSelection,
    /// Capacity of our own daemon's device [default: 16 GiB on host, the GPU's on cuda].
    #[arg(long)]
    pub capacity: Option<Bytes>,
    /// Print one JSON document instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
struct Machine {
    cpu: String,
    cores: usize,
    kernel: String,
}

impl Machine {
    fn probe() -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name")?.split_once(':'))
            .map_or_else(|| "unknown cpu".to_string(), |(_, v)| v.trim().to_string());
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map_or_else(|_| "unknown".to_string(), |k| k.trim().to_string());
        Machine {
            cpu,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            kernel,
        }
    }
}

#[derive(Debug, Serialize)]
struct SizeResult {
    size: Bytes,
    tenants: usize,
    round_trips: usize,
    ops_per_second: f64,
    round_trip: Spread,
    /// Request, reply with the fd, and import.
    grant: Spread,
    /// Of which the request and the reply with the fd.
    grant_reply: Spread,
    /// Of which the import of the fd.
    import: Spread,
    /// Map with read-write access into a reservation made once per tenant (zero without `--map`).
    map: Spread,
    /// Grant, import and map: how long until a tenant can use new memory.
    usable: Spread,
    /// Unmap (zero without `--map`).
    unmap: Spread,
    /// The return request and its reply.
    give_back: Spread,
}

#[derive(Debug, Serialize)]
struct Report {
    machine: Machine,
    backend: String,
    daemon: String,
    map: bool,
    /// A request and reply that do nothing: the transport's share of every round trip.
    ping: Spread,
    results: Vec<SizeResult>,
}

/// One round trip's phases, in nanoseconds.
#[derive(Clone, Copy, Default)]
struct Sample {
    grant_reply: u64,
    import: u64,
    map: u64,
    unmap: u64,
    give_back: u64,
}

pub fn run(args: Args) -> anyhow::Result<std::process::ExitCode> {
    if args.sizes.is_empty() || args.iterations == 0 || args.tenants == 0 {
        bail!("--size, --iterations and --tenants must be non-zero");
    }
    if args.socket.is_none() {
        check_sizes(args.backend, &args.sizes)?;
    }
    let machine = Machine::probe();
    let mut own = None;
    let socket: PathBuf = match &args.socket {
        Some(s) => s.clone(),
        None => own.insert(start_own_daemon(&args)?).socket().to_path_buf(),
    };
    let measured = measure_all(&args, &socket);
    if let Some(d) = own {
        d.stop()?;
    }
    let (backend, ping, results) = measured?;
    let report = Report {
        ping,
        machine,
        backend,
        daemon: match &args.socket {
            Some(s) => s.display().to_string(),
            None => "own".to_string(),
        },
        map: args.map,
        results,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&report));
    }
    Ok(std::process::ExitCode::SUCCESS)
}

/// Every size a whole number of granules of the device our own daemon would serve (a daemon's
/// pool takes no other), said before it starts.
fn check_sizes(backend: vram_device::BackendSelection, sizes: &[Bytes]) -> anyhow::Result<()> {
    // Only the devices' granularity is read: the host capacity does not matter here.
    let (kind, devices) = backend.resolve(Bytes::ZERO);
    let Some(gran) = devices.iter().map(|d| d.granularity).max() else {
        return Ok(());
    };
    for size in sizes {
        if size.get() == 0 || size.get() % gran.get() != 0 {
            bail!(
                "--size {size}: a grant is a whole number of the {kind} device's granules \
                 ({gran}){}",
                crate::config::bare_size_hint(*size)
            );
        }
    }
    Ok(())
}

fn start_own_daemon(args: &Args) -> anyhow::Result<OwnDaemon> {
    let dir = tempfile::Builder::new().prefix("vramd-bench-").tempdir()?;
    // A pool that keeps every benchmarked size ready for every tenant.
    let per_round: u64 = args.sizes.iter().map(|s| s.get()).sum();
    let pool_max = Bytes((per_round * args.tenants as u64 * 4).max(Bytes::GIB));
    let sizes: Vec<String> = args.sizes.iter().map(|s| format!("\"{s}\"")).collect();
    // Metrics on, as a daemon in service has them (the grant path's instruments are measured
    // too), on a free port rather than the one a daemon in service may need.
    let config = format!(
        "metrics = \"127.0.0.1:0\"\n[pool]\nmax = \"{pool_max}\"\nsizes = [{}]\ninitial = {}\n",
        sizes.join(", "),
        (4 * args.tenants).max(8)
    );
    let config_path = dir.path().join("bench.toml");
    std::fs::write(&config_path, config)?;
    let mut flags: Vec<String> = vec![
        "--backend".into(),
        args.backend.to_string(),
        "--config".into(),
        config_path.display().to_string(),
    ];
    if let Some(c) = args.capacity {
        flags.push("--capacity".into());
        flags.push(c.to_string().replace(' ', ""));
    }
    OwnDaemon::spawn_this(dir, &flags)
}

fn measure_all(args: &Args, socket: &Path) -> anyhow::Result<(String, Spread, Vec<SizeResult>)> {
    let ping = measure_ping(args, socket)?;
    let mut backend = String::new();
    let mut results = Vec::new();
    for &size in &args.sizes {
        let (b, r) = measure(args, socket, size)?;
        backend = b;
        results.push(r);
    }
    Ok((backend, ping, results))
}

/// Pings from one tenant: the floor under every round trip.
fn measure_ping(args: &Args, socket: &Path) -> anyhow::Result<Spread> {
    let name = format!("bench-{}-ping", std::process::id());
    let client = Client::connect(Some(socket), &TenantOptions::named(name))
        .with_context(|| format!("cannot connect to {}", socket.display()))?;
    for _ in 0..args.warmup {
        client.ping()?;
    }
    let mut nanos = Vec::with_capacity(args.iterations as usize);
    for _ in 0..args.iterations {
        let t = Instant::now();
        client.ping()?;
        nanos.push(t.elapsed().as_nanos() as u64);
    }
    Ok(Spread::of(&mut nanos))
}

/// Runs `--tenants` threads of round trips of `size`; progress on stderr when it takes a while.
fn measure(args: &Args, socket: &Path, size: Bytes) -> anyhow::Result<(String, SizeResult)> {
    let done = AtomicU64::new(0);
    let total = args.iterations * args.tenants as u64;
    let started = Instant::now();
    let outcome = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..args.tenants)
            .map(|i| {
                let done = &done;
                scope.spawn(move || tenant_loop(args, socket, size, i, done))
            })
            .collect();
        let mut next_report = started + Duration::from_secs(2);
        while !workers.iter().all(|w| w.is_finished()) {
            std::thread::sleep(Duration::from_millis(20));
            if Instant::now() >= next_report {
                let n = done.load(Ordering::Relaxed);
                eprint!("\rvramd bench: {size}: {n} of {total} round trips");
                let _ = std::io::stderr().flush();
                next_report += Duration::from_secs(1);
            }
        }
        if started.elapsed() >= Duration::from_secs(2) {
            eprintln!("\rvramd bench: {size}: {total} of {total} round trips");
        }
        workers
            .into_iter()
            .map(|w| w.join().expect("bench thread panicked"))
            .collect::<anyhow::Result<Vec<_>>>()
    });
    let mut backend = String::new();
    let mut samples = Vec::new();
    let mut busy = Duration::ZERO;
    for (b, s, elapsed) in outcome? {
        backend = b;
        samples.extend(s);
        busy = busy.max(elapsed);
    }
    let spread = |f: fn(&Sample) -> u64| Spread::of(&mut samples.iter().map(f).collect::<Vec<_>>());
    let result = SizeResult {
        size,
        tenants: args.tenants,
        round_trips: samples.len(),
        ops_per_second: samples.len() as f64 / busy.as_secs_f64(),
        round_trip: spread(|s| s.grant_reply + s.import + s.map + s.unmap + s.give_back),
        grant: spread(|s| s.grant_reply + s.import),
        grant_reply: spread(|s| s.grant_reply),
        import: spread(|s| s.import),
        map: spread(|s| s.map),
        usable: spread(|s| s.grant_reply + s.import + s.map),
        unmap: spread(|s| s.unmap),
        give_back: spread(|s| s.give_back),
    };
    Ok((backend, result))
}

/// One tenant's round trips; its backend, samples and measured wall time.
fn tenant_loop(
    args: &Args,
    socket: &Path,
    size: Bytes,
    index: usize,
    done: &AtomicU64,
) -> anyhow::Result<(String, Vec<Sample>, Duration)> {
    let name = format!("bench-{}-{index}", std::process::id());
    let client = Client::connect(Some(socket), &TenantOptions::named(name))
        .with_context(|| format!("cannot connect to {}", socket.display()))?;
    let backend = client.welcome().device.backend.to_string();
    // One reservation for the whole run, as a tenant's allocator keeps one.
    let res = if args.map {
        let granularity = client.welcome().device.granularity;
        let len = size.round_up(granularity).unwrap_or(size);
        Some(client.device().reserve(len)?)
    } else {
        None
    };
    for _ in 0..args.warmup {
        round_trip(&client, size, res.as_ref(), None)?;
    }
    let mut samples = Vec::with_capacity(args.iterations as usize);
    let mut kept = Vec::new();
    let mut busy = Duration::ZERO;
    for _ in 0..args.iterations {
        if args.pause_us > 0 {
            std::thread::sleep(Duration::from_micros(args.pause_us));
        }
        let started = Instant::now();
        samples.push(round_trip(
            &client,
            size,
            res.as_ref(),
            args.fresh.then_some(&mut kept),
        )?);
        busy += started.elapsed();
        done.fetch_add(1, Ordering::Relaxed);
    }
    if !kept.is_empty() {
        client.give_back(kept).context("give back")?;
    }
    Ok((backend, samples, busy))
}

/// One grant, mapped and unmapped if `res`, then given back, or kept in `keep` if given.
fn round_trip(
    client: &Client,
    size: Bytes,
    res: Option<&Reservation>,
    keep: Option<&mut Vec<vram_client::Grant>>,
) -> anyhow::Result<Sample> {
    let t0 = Instant::now();
    let (id, granted, fd) = client
        .grant_fd(size)
        .with_context(|| format!("grant of {size}"))?;
    let t1 = Instant::now();
    let dev = client.device();
    let grant = match dev.import(fd, granted) {
        Ok(handle) => vram_client::Grant { id, handle },
        Err(e) => {
            client.give_back_ids(vec![id])?;
            return Err(e).context("import");
        }
    };
    let t2 = Instant::now();
    if let Some(res) = res {
        dev.map(res, Bytes::ZERO, &grant.handle, Access::ReadWrite)?;
    }
    let t3 = Instant::now();
    if let Some(res) = res {
        dev.unmap(res, Bytes::ZERO, grant.size())?;
    }
    let t4 = Instant::now();
    match keep {
        Some(kept) => kept.push(grant),
        None => {
            client.give_back(vec![grant]).context("give back")?;
        }
    }
    let t5 = Instant::now();
    let ns = |a: Instant, b: Instant| (b - a).as_nanos() as u64;
    Ok(Sample {
        grant_reply: ns(t0, t1),
        import: ns(t1, t2),
        map: ns(t2, t3),
        unmap: ns(t3, t4),
        give_back: ns(t4, t5),
    })
}

fn render(r: &Report) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "vramd bench: take+return round trip{} through a real daemon ({} backend, daemon: {})",
        if r.map { " with map" } else { "" },
        r.backend,
        r.daemon
    );
    let _ = writeln!(
        out,
        "machine: {}, {} cores, Linux {}",
        r.machine.cpu, r.machine.cores, r.machine.kernel
    );
    let _ = writeln!(
        out,
        "transport floor (ping): p50 {:.1} µs, p99 {:.1} µs\n",
        r.ping.p50_us, r.ping.p99_us
    );
    let _ = writeln!(
        out,
        "{:>9} {:>7} {:>11} {:>9} {:>9} {:>9} {:>9} {:>10}",
        "SIZE", "TENANTS", "ROUND TRIPS", "p50 µs", "p90 µs", "p99 µs", "max µs", "ops/s"
    );
    for s in &r.results {
        let t = &s.round_trip;
        let _ = writeln!(
            out,
            "{:>9} {:>7} {:>11} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>10.0}",
            s.size.to_string(),
            s.tenants,
            s.round_trips,
            t.p50_us,
            t.p90_us,
            t.p99_us,
            t.max_us,
            s.ops_per_second
        );
        let _ = writeln!(
            out,
            "{:>9}   phases p50 / p99: grant+import {:.1} / {:.1} µs (reply {:.1} / {:.1}, import {:.1} / {:.1}), map {:.1} / {:.1} µs, unmap {:.1} / {:.1} µs, return {:.1} / {:.1} µs",
            "",
            s.grant.p50_us,
            s.grant.p99_us,
            s.grant_reply.p50_us,
            s.grant_reply.p99_us,
            s.import.p50_us,
            s.import.p99_us,
            s.map.p50_us,
            s.map.p99_us,
            s.unmap.p50_us,
            s.unmap.p99_us,
            s.give_back.p50_us,
            s.give_back.p99_us
        );
        if r.map {
            let _ = writeln!(
                out,
                "{:>9}   usable (grant+import+map) p50 {:.1} µs, p99 {:.1} µs",
                "", s.usable.p50_us, s.usable.p99_us
            );
        }
    }
    out
}
