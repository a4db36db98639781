//! `vramd replay`: PyTorch memory snapshots replayed through the real client allocator (thread
//! caches, live table, core algorithms, real mappings) on a host-backend or CUDA device, its
//! handles created in process or taken from a daemon the command starts, with the driver time its
//! calls would cost on an H200 and the time they took here.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use vram_client::alloc::{
    CachingAllocator, CallTimes, DaemonSource, HandleSource, HostEvents, LocalSource, MappedBacking,
};
use vram_client::{Client, TenantOptions};
use vram_core::alloc::{AllocConfig, BackingCounts, StreamId};
use vram_core::replay::{CostModel, HeldAtPeak, ReplayResult};
use vram_core::trace::{parse_devices, Action, DeviceTrace, Trace};
use vram_core::Bytes;
use vram_device::{BackendKind, Device};
use vram_proto::PoolTakes;

use super::pytorch_figures::{self, PytorchFigures};
use super::spread::Spread;
use crate::own_daemon::OwnDaemon;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// PyTorch snapshots (`torch.cuda.memory._snapshot()`, pickled, optionally gzipped).
    #[arg(required = true)]
    pub traces: Vec<PathBuf>,
    /// One JSON object per trace instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Where the replay's memory lives: `host` (sparse memfds; driver time is modelled) or `cuda`
    /// (real maps and unmaps on GPU 0; the time spent in the allocator is measured too).
    #[arg(long, default_value = "host", value_name = "BACKEND")]
    pub backend: BackendKind,
    /// An allocator setting to replay with instead of the default, as NAME=VALUE (repeatable, or
    /// comma-separated: `--set min_grow=16MiB --set max_handle=32MiB` is
    /// `--set min_grow=16MiB,max_handle=32MiB`). Tenants take the same settings from
    /// `VRAMD_ALLOC`.
    #[arg(long = "set", value_name = "NAME=VALUE")]
    pub settings: Vec<String>,
    /// Take the handles from a daemon this command starts on the same backend, as a tenant does
    /// (a request, the handle passed back over the socket, its import), instead of creating them
    /// in process: the time in the backing's calls is then a tenant's.
    #[arg(long)]
    pub through_daemon: bool,
    /// With `--through-daemon`: take the handles from this running daemon, with its own
    /// configuration (pool, capacity, policy), instead of one this command starts. The replay
    /// is then a tenant of it like any other, under the default class's limit.
    #[arg(long, requires = "through_daemon", value_name = "SOCKET")]
    pub socket: Option<PathBuf>,
    /// Also replay each trace with every request scaled by these factors (comma-separated, e.g.
    /// `0.95,1.05`): the same program at other batch or sequence sizes. An allocator's figures can
    /// swing by several points between such neighbours, so judge settings over several scales.
    #[arg(long, value_delimiter = ',', value_name = "FACTOR")]
    pub scale: Vec<f64>,
    /// Replay at the pace the trace was recorded (each event waits for its time since the trace's
    /// first), as the program ran, instead of as fast as possible: with `--through-daemon`, the
    /// daemon's pool then refills between grants as it would for the real program. Takes each
    /// trace's wall span.
    #[arg(long)]
    pub realtime: bool,
    /// Replay only the events the snapshot's history recorded. By default the blocks that were
    /// live when it began (a ring buffer's snapshot of a long run starts in the middle, with a
    /// model's weights allocated; the snapshot shows them as frees without an alloc and as blocks
    /// still allocated that no event names) are allocated first, in address order, since the
    /// process held them; with this flag they are left out and their frees skipped.
    #[arg(long)]
    pub window_only: bool,
    /// Show PyTorch's own fragmentation on the same workload beside vramd's (`expandable`: with
    /// expandable segments; `default`: its default allocator; comma-separated for both), read
    /// from the table in the README.md beside each trace where it gives them. JSON output carries
    /// them whenever they are there.
    #[arg(long, value_enum, value_delimiter = ',', value_name = "ALLOCATOR")]
    pub compare: Vec<Compare>,
}

/// Which of PyTorch's allocators `--compare` shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Compare {
    Default,
    Expandable,
}

/// One trace's figures (sizes in bytes, times in microseconds): the core replay's, plus what the
/// real client path measured.
#[derive(Debug, Serialize)]
pub struct Outcome {
    #[serde(flatten)]
    pub result: ReplayResult,
    /// Allocations served from a thread cache without the core.
    pub fast_allocs: u64,
    pub backend: BackendKind,
    /// Wall time spent inside the allocator's calls (driver calls included), measured.
    pub measured_allocator_us: f64,
    /// Its share of the trace's wall time (none for a trace whose events carry no times).
    pub measured_allocator_time_share: Option<f64>,
    /// Of that, the wall time spent in the backing's calls (creating, mapping with access,
    /// unmapping and releasing handles: on `--backend cuda` the driver calls), measured.
    pub measured_driver_us: f64,
    pub measured_driver_time_share: Option<f64>,
    /// That time by kind of call.
    pub measured_calls_us: CallsUs,
    /// How long one take of a handle lasted (from a daemon: the round trip and the import;
    /// in process: the creation).
    pub take_us: Spread,
    /// With `--through-daemon`: where the daemon found the handles it granted during this trace
    /// (a miss is a create and an export on the grant's path; what that costs on an H200:
    /// docs/benchmarks.md, "Grant latency").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool_takes: Option<PoolTakes>,
    /// With `--through-daemon`: of the takes' time, the part spent importing the handles (the
    /// rest is the grant requests' round trips).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub take_import_us: Option<f64>,
    /// PyTorch's fragmentation on the same workload, from the README beside the trace (the
    /// recorded run's, at scale 1 only).
    #[serde(skip_serializing_if = "is_unknown")]
    pub pytorch_fragmentation: PytorchFigures,
}

fn is_unknown(f: &PytorchFigures) -> bool {
    f.default.is_none() && f.expandable.is_none()
}

/// Microseconds spent in each kind of backing call (see [`CallTimes`]).
#[derive(Debug, Serialize)]
pub struct CallsUs {
    pub take: f64,
    pub map: f64,
    pub unmap: f64,
    pub release: f64,
}

impl From<CallTimes> for CallsUs {
    fn from(t: CallTimes) -> Self {
        let us = |d: std::time::Duration| d.as_secs_f64() * 1e6;
        CallsUs {
            take: us(t.take),
            map: us(t.map),
            unmap: us(t.unmap),
            release: us(t.release),
        }
    }
}

pub fn run(args: Args) -> anyhow::Result<std::process::ExitCode> {
    let mut config = AllocConfig::default();
    for setting in &args.settings {
        config
            .set_all(setting)
            .map_err(|e| anyhow::anyhow!("--set {e}"))?;
    }
    if let Some(bad) = args
        .scale
        .iter()
        .find(|f| !(f.is_finite() && **f > 0.0 && **f <= 16.0))
    {
        anyhow::bail!("--scale {bad}: a factor must be above 0 and at most 16");
    }
    let own = if args.through_daemon && args.socket.is_none() {
        Some(start_daemon(args.backend)?)
    } else {
        None
    };
    let socket = args
        .socket
        .clone()
        .or_else(|| own.as_ref().map(|d| d.socket().to_path_buf()));
    let mut outcomes = Vec::new();
    for path in &args.traces {
        let bytes =
            std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
        let devices =
            parse_devices(&bytes).with_context(|| format!("cannot replay {}", path.display()))?;
        let file_name = path
            .file_name()
            .map(|n| {
                n.to_string_lossy()
                    .trim_end_matches(".gz")
                    .trim_end_matches(".pickle")
                    .to_string()
            })
            .unwrap_or_default();
        // PyTorch's figures beside a trace are the recorded process's: one device's.
        let pytorch = match devices.len() {
            1 => path
                .parent()
                .map(|dir| pytorch_figures::for_trace(dir, &file_name))
                .unwrap_or_default(),
            _ => PytorchFigures::default(),
        };
        let several = devices.len() > 1;
        for DeviceTrace { device, trace } in devices {
            let trace = if args.window_only {
                trace.window_only()
            } else {
                trace
            };
            if trace.wall_us() == 0 {
                tracing::warn!(
                    trace = %path.display(),
                    device,
                    "the snapshot records no event times: shares of its time are not known"
                );
            }
            let name = if several {
                format!("{file_name}:cuda{device}")
            } else {
                file_name.clone()
            };
            replay_scales(
                &args,
                &name,
                &trace,
                pytorch,
                socket.as_deref(),
                &config,
                &mut outcomes,
            )?;
        }
    }
    if let Some(d) = own {
        d.stop()?;
    }
    if !args.json {
        print!("{}", table(&outcomes, &args.compare));
        if !args.scale.is_empty() {
            print!("{}", scale_summary(&outcomes));
        }
    }
    Ok(std::process::ExitCode::SUCCESS)
}

/// Replays `trace` as recorded, then at each of `--scale`'s factors (one scaled copy at a time),
/// adding an outcome for each (printed at once with `--json`).
fn replay_scales(
    args: &Args,
    name: &str,
    trace: &Trace,
    pytorch: PytorchFigures,
    socket: Option<&Path>,
    config: &AllocConfig,
    outcomes: &mut Vec<Outcome>,
) -> anyhow::Result<()> {
    for factor in std::iter::once(None).chain(args.scale.iter().copied().map(Some)) {
        let scaled;
        let (name, trace) = match factor {
            None => (name.to_string(), trace),
            Some(f) => {
                scaled = trace.scaled(f);
                (format!("{name}@{f}"), &scaled)
            }
        };
        let pace = Pace(args.realtime);
        let mut o = match socket {
            Some(socket) => replay_through(&name, trace, socket, config, pace)?,
            None => replay(&name, trace, args.backend, config, pace)?,
        };
        if factor.is_none() {
            o.pytorch_fragmentation = pytorch;
        }
        if args.json {
            println!("{}", serde_json::to_string(&o)?);
        }
        outcomes.push(o);
    }
    Ok(())
}

/// Starts a daemon serving the replay's backend from a temporary directory.
fn start_daemon(backend: BackendKind) -> anyhow::Result<OwnDaemon> {
    let dir = tempfile::Builder::new().prefix("vramd-replay-").tempdir()?;
    let mut flags = vec!["--metrics", "off", "--backend", backend.name()];
    match backend {
        // Sparse memfds: the four shared traces peak at 16 GiB, none of it touched.
        BackendKind::Host => flags.extend(["--capacity", "1TiB"]),
        BackendKind::Cuda => {}
    }
    OwnDaemon::spawn_this(dir, &flags)
}

fn progress_bar(name: &str, total: usize) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total as u64);
    bar.set_style(
        ProgressStyle::with_template("{prefix:>24} [{bar:40}] {pos}/{len} events ({eta})")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_prefix(name.to_string());
    bar
}

/// Whether a replay keeps the trace's own pace (`--realtime`) or runs as fast as it can.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pace(pub bool);

/// Replays one trace through a fresh allocator on a device of `backend` (host: sparse memfds;
/// cuda: GPU 0), its handles created in process.
pub fn replay(
    name: &str,
    trace: &Trace,
    backend: BackendKind,
    config: &AllocConfig,
    pace: Pace,
) -> anyhow::Result<Outcome> {
    // On host a sparse device: only the pages the replay writes would cost memory, and it writes
    // none. On cuda the driver's first GPU.
    let info = vram_device::devices(backend, Bytes(Bytes::TIB))
        .with_context(|| format!("--backend {backend}"))?
        .into_iter()
        .next()
        .with_context(|| format!("--backend {backend}: the backend reports no device"))?;
    let device: Arc<dyn Device> =
        vram_device::open(&info).with_context(|| format!("--backend {backend}"))?;
    let source = LocalSource::new(device.clone());
    run_trace(
        name,
        trace,
        device,
        source,
        backend,
        config,
        pace,
        &mut || {},
    )
}

/// Replays one trace through a fresh allocator whose handles come from `daemon`, as a tenant of
/// its own (so that every trace starts from nothing held).
pub fn replay_through(
    name: &str,
    trace: &Trace,
    socket: &Path,
    config: &AllocConfig,
    pace: Pace,
) -> anyhow::Result<Outcome> {
    let opts = TenantOptions::named(tenant_name(std::process::id(), name));
    let client = Arc::new(
        Client::connect(Some(socket), &opts)
            .with_context(|| format!("cannot connect to {}", socket.display()))?,
    );
    let backend = client.welcome().device.backend;
    let device = client.device().clone();
    let index = client.welcome().device.index;
    let takes = |c: &Client| -> anyhow::Result<PoolTakes> {
        let status = c
            .status()
            .context("the replay's daemon did not report its status")?;
        Ok(status
            .devices
            .iter()
            .find(|d| d.index == index)
            .map(|d| d.pool)
            .unwrap_or_default())
    };
    // Counted from the start of the history: the blocks live before it were placed before.
    let mut at_history = None;
    let mut outcome = run_trace(
        name,
        trace,
        device,
        DaemonSource::new(client.clone()),
        backend,
        config,
        pace,
        &mut || {
            at_history = Some((takes(&client), client.import_time()));
        },
    )?;
    let (before, imported) = at_history.expect("run_trace marks the start of the history");
    outcome.pool_takes = Some(takes(&client)?.since(before?));
    outcome.take_import_us = Some((client.import_time() - imported).as_secs_f64() * 1e6);
    Ok(outcome)
}

/// What a replay's allocator had done when the trace's history began; its figures count from
/// there.
struct Baseline {
    counts: BackingCounts,
    calls: CallTimes,
    /// Takes made (an index into the backing's take times).
    takes: usize,
}

impl Baseline {
    fn read<S: HandleSource>(alloc: &CachingAllocator<S>) -> Baseline {
        let (calls, takes) = alloc.with_backing(|b| (b.call_times(), b.take_times().len()));
        Baseline {
            counts: alloc.stats().core.calls(),
            calls,
            takes,
        }
    }
}

/// Replays `trace` through a caching allocator on `source`'s handles. The calls and time counted
/// start with the trace's history: `at_history` is called once, after the blocks live before it
/// were allocated (they count in the peaks only).
#[allow(clippy::too_many_arguments)]
fn run_trace<S: HandleSource>(
    name: &str,
    trace: &Trace,
    device: Arc<dyn Device>,
    source: S,
    backend: BackendKind,
    config: &AllocConfig,
    pace: Pace,
    at_history: &mut dyn FnMut(),
) -> anyhow::Result<Outcome> {
    let config = AllocConfig {
        granularity: device.info().granularity,
        ..config.clone()
    };
    let backing = MappedBacking::new(device, config.va_bytes, source)?;
    // On the host backend the calls stand for a GPU's: the allocator's driver-time budget weighs
    // them at the prices this replay reports them at, not at the host's own speed.
    let backing = match backend {
        BackendKind::Host => backing.priced(CostModel::H200_MEASURED),
        _ => backing,
    };
    let alloc = CachingAllocator::new(config, backing, Box::new(HostEvents));
    let bar = progress_bar(name, trace.events.len());
    let mut ptrs = std::collections::HashMap::new();
    // Live requested bytes, counted here from the trace itself: blocks waiting in a thread cache
    // are still allocated in the core's books, so its `requested` is not the application's.
    let (mut live, mut peak_requested) = (0u64, 0u64);
    let mut at_peak = HeldAtPeak::default();
    let mut spent = std::time::Duration::ZERO;
    let (t0, first_us) = (
        std::time::Instant::now(),
        trace.events.first().map_or(0, |e| e.time_us),
    );
    let mut base = None;
    for (i, e) in trace.events.iter().enumerate() {
        if i == trace.before_history {
            spent = std::time::Duration::ZERO;
            at_history();
            base = Some(Baseline::read(&alloc));
        }
        if pace.0 {
            let due = t0 + std::time::Duration::from_micros(e.time_us.saturating_sub(first_us));
            if let Some(wait) = due.checked_duration_since(std::time::Instant::now()) {
                std::thread::sleep(wait);
            }
        }
        let started = std::time::Instant::now();
        let stream = StreamId(e.stream);
        match e.action {
            Action::Alloc => {
                let p = alloc
                    .alloc(Bytes(e.size), stream)
                    .with_context(|| format!("{name}: event {i}: alloc of {}", Bytes(e.size)))?;
                ptrs.insert(e.addr, (p, e.size));
                live += e.size;
                peak_requested = peak_requested.max(live);
            }
            Action::Free => {
                if let Some((p, size)) = ptrs.remove(&e.addr) {
                    alloc
                        .free(p, stream)
                        .with_context(|| format!("{name}: event {i}: free"))?;
                    live -= size;
                }
            }
        }
        alloc.tick(e.time_us);
        spent += started.elapsed();
        // Where the memory held lies at its peak, read outside the time measured.
        at_peak.observe(alloc.stats().core.held.get(), live, || alloc.free_memory());
        if i % 4096 == 0 {
            bar.set_position(i as u64);
        }
    }
    bar.finish_and_clear();
    let base = base.unwrap_or_else(|| {
        // Every event came before the history: nothing of it is counted.
        spent = std::time::Duration::ZERO;
        at_history();
        Baseline::read(&alloc)
    });
    let s = alloc.stats().core;
    let counts = Baseline::read(&alloc).counts.since(&base.counts);
    let measured_us = spent.as_secs_f64() * 1e6;
    let (calls, take_us) = alloc.with_backing(|b| {
        (
            b.call_times().since(&base.calls),
            Spread::of_durations(&b.take_times()[base.takes..]),
        )
    });
    let driver_us = calls.total().as_secs_f64() * 1e6;
    Ok(Outcome {
        result: ReplayResult::new(
            name,
            trace,
            peak_requested,
            s.held_peak.get(),
            &counts,
            &CostModel::H200_MEASURED,
            at_peak,
        ),
        fast_allocs: alloc.stats().fast_allocs,
        backend,
        measured_allocator_us: measured_us,
        measured_allocator_time_share: trace.share_of_wall(measured_us),
        measured_driver_us: driver_us,
        measured_driver_time_share: trace.share_of_wall(driver_us),
        measured_calls_us: calls.into(),
        take_us,
        pool_takes: None,
        take_import_us: None,
        pytorch_fragmentation: PytorchFigures::default(),
    })
}

/// Where the memory held lay at its peak, per trace, as shares of it: what the fragmentation
/// figure is made of.
fn held_at_peak_table(outcomes: &[Outcome]) -> String {
    use std::fmt::Write as _;
    let mut out = format!(
        "\n{:<24} {:>12} {:>8} {:>8} {:>12} {:>12} {:>11}\n",
        "AT PEAK HELD", "HELD", "LIVE", "ROUNDING", "PARTLY USED", "WHOLE FREE", "SMALL HEAP"
    );
    for o in outcomes {
        let p = &o.result.held_at_peak;
        let share = |b: u64| {
            if p.held == 0 {
                0.0
            } else {
                b as f64 * 100.0 / p.held as f64
            }
        };
        let _ = writeln!(
            out,
            "{:<24} {:>12} {:>7.2}% {:>7.2}% {:>11.2}% {:>11.2}% {:>10.2}%",
            o.result.trace,
            Bytes(p.held).to_string(),
            share(p.requested),
            share(p.allocated_beyond_requested),
            share(p.free.partly_used_handles.get()),
            share(p.free.whole_handles.get()),
            share(p.free.small_heap.get()),
        );
    }
    let _ = writeln!(
        out,
        "\nAT PEAK HELD: the memory held at its highest, when the most of it was live, as shares of it.\n\
         LIVE: the live blocks' requested bytes. ROUNDING: allocated beyond them (rounding to 512 B,\n\
         blocks waiting in thread caches). Free memory: PARTLY USED, in handles that also hold a live\n\
         block (a handle goes back only whole); WHOLE FREE, in handles holding none (cached for reuse);\n\
         SMALL HEAP, in the heap of blocks under 1 MiB. docs/ARCHITECTURE.md (\"The allocator's\n\
         policy\") says what bounds each."
    );
    out
}

/// Per trace replayed at several scales, the mean and worst fragmentation and driver time share
/// over the trace as recorded and its scaled copies.
fn scale_summary(outcomes: &[Outcome]) -> String {
    use std::fmt::Write as _;
    let mut out = format!(
        "\n{:<24} {:>7} {:>10} {:>11} {:>12} {:>13}\n",
        "OVER SCALES", "REPLAYS", "FRAG MEAN", "FRAG WORST", "DRIVER MEAN", "DRIVER WORST"
    );
    let mut names: Vec<&str> = Vec::new();
    for o in outcomes {
        let base = o.result.trace.split('@').next().unwrap_or_default();
        if !names.contains(&base) {
            names.push(base);
        }
    }
    for name in names {
        let runs: Vec<&ReplayResult> = outcomes
            .iter()
            .map(|o| &o.result)
            .filter(|r| r.trace.split('@').next() == Some(name))
            .collect();
        let n = runs.len() as f64;
        let frag: Vec<f64> = runs.iter().map(|r| r.fragmentation * 100.0).collect();
        // Shares: `percent` writes them as percentages.
        let driver: Option<Vec<f64>> = runs.iter().map(|r| r.modelled_driver_time_share).collect();
        let worst = |v: &[f64]| v.iter().copied().fold(f64::MIN, f64::max);
        let (driver_mean, driver_worst) = match driver {
            Some(d) => (
                percent(Some(d.iter().sum::<f64>() / n), 12),
                percent(Some(worst(&d)), 13),
            ),
            None => (percent(None, 12), percent(None, 13)),
        };
        let _ = writeln!(
            out,
            "{:<24} {:>7} {:>9.2}% {:>10.2}% {driver_mean} {driver_worst}",
            name,
            runs.len(),
            frag.iter().sum::<f64>() / n,
            worst(&frag),
        );
    }
    out
}

/// A share as a percentage right-aligned in `width` columns, `%` included; `-` where unknown.
fn percent(share: Option<f64>, width: usize) -> String {
    match share {
        Some(s) => format!("{:>w$.2}%", s * 100.0, w = width - 1),
        None => format!("{:>width$}", "-"),
    }
}

fn table(outcomes: &[Outcome], compare: &[Compare]) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let mut header = format!(
        "{:<24} {:>8} {:>12} {:>12} {:>7} {:>7} {:>6} {:>7} {:>7} {:>9} {:>9} {:>9} {:>9}",
        "TRACE",
        "EVENTS",
        "PEAK REQ",
        "PEAK HELD",
        "FRAG",
        "GRANTS",
        "MAPS",
        "UNMAPS",
        "RETURNS",
        "DRIVER",
        "(TABLE)",
        "ALLOC",
        "CALLS"
    );
    for c in compare {
        header += match c {
            Compare::Default => "  PT DEFAULT",
            Compare::Expandable => "  PT EXPANDABLE",
        };
    }
    let _ = writeln!(out, "{header}");
    for o in outcomes {
        let r = &o.result;
        let mut line = format!(
            "{:<24} {:>8} {:>12} {:>12} {:>6.2}% {:>7} {:>6} {:>7} {:>7} {} {} {} {}",
            r.trace,
            r.events,
            Bytes(r.peak_requested).to_string(),
            Bytes(r.peak_held).to_string(),
            r.fragmentation * 100.0,
            r.grants,
            r.maps,
            r.unmaps,
            r.returns,
            percent(r.modelled_driver_time_share, 9),
            percent(r.design_table_driver_time_share, 9),
            percent(o.measured_allocator_time_share, 9),
            percent(o.measured_driver_time_share, 9),
        );
        for c in compare {
            let (figure, width) = match c {
                Compare::Default => (o.pytorch_fragmentation.default, 12),
                Compare::Expandable => (o.pytorch_fragmentation.expandable, 15),
            };
            line += &percent(figure, width);
        }
        let _ = writeln!(out, "{line}");
    }
    let _ = writeln!(
        out,
        "\nFRAG = 1 - peak live requested / peak held. DRIVER = modelled H200 driver time of the grants,\n\
         maps, unmaps and returns as a share of the trace's wall time (set-access priced per handle as\n\
         measured on an H200; TABLE: priced per MiB as docs/design.md's table has it). Measured on this\n\
         machine, as shares of the trace's wall time: ALLOC, the time spent inside the allocator's\n\
         calls; CALLS, the part of it spent taking, mapping, unmapping and giving back handles (on\n\
         --backend cuda: driver calls; on host: memfd calls; with --through-daemon, the daemon\n\
         round trips and imports as well). PT DEFAULT / PT EXPANDABLE: PyTorch's own fragmentation\n\
         on the recorded run (1 - peak allocated / peak reserved, its rounded block sizes; from the\n\
         README beside the trace; - where it gives none)."
    );
    let _ = write!(out, "{}", held_at_peak_table(outcomes));
    for o in outcomes.iter().map(|o| &o.result) {
        if o.before_history_blocks > 0 {
            let _ = writeln!(
                out,
                "{}: {} blocks ({}) were live when the snapshot's history began; they were \
                 allocated first and count in the peaks, not in the times above (--window-only leaves \
                 them out).",
                o.trace,
                o.before_history_blocks,
                Bytes(o.before_history_bytes)
            );
        } else if o.skipped_frees > 0 {
            let _ = writeln!(
                out,
                "{}: {} frees of blocks allocated before the snapshot's history were skipped.",
                o.trace, o.skipped_frees
            );
        }
    }
    for o in outcomes {
        if let Some(p) = o.pool_takes {
            let _ = writeln!(
                out,
                "{}: the daemon found {} of its handles ready in its pool, {} among those the \
                 tenant gave back, and made {} on the grant's path.",
                o.result.trace, p.hits, p.recycled, p.misses
            );
        }
    }
    out
}

/// The tenant name of a replay through a daemon: the trace's name with what a tenant name cannot
/// hold made `_`, cut to fit the 64 bytes a name may have.
fn tenant_name(pid: u32, trace: &str) -> String {
    let name = format!("replay-{pid}-");
    let room = 64 - name.len();
    let trace: String = trace
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.@:".contains(c) {
                c
            } else {
                '_'
            }
        })
        .take(room)
        .collect();
    name + &trace
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traces_file_name_makes_a_tenant_name_the_daemon_takes() {
        let long = "x".repeat(100);
        for trace in ["snapshot (1)", "résumé", long.as_str(), "resnet50_train"] {
            let name = tenant_name(4_194_304, trace);
            assert_eq!(vram_core::broker::name_problem(&name), None, "{name}");
        }
        assert_eq!(tenant_name(7, "snapshot (1)"), "replay-7-snapshot__1_");
    }
}
