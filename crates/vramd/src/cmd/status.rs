//! `vramd status`: devices and tenants, as a table or JSON.

use std::fmt::Write as _;

use vram_client::Observer;
use vram_proto::StatusReport;

use super::SocketArg;

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub socket: SocketArg,
    /// Print JSON (the same document as the metrics endpoint's /status).
    #[arg(long)]
    pub json: bool,
    /// Only this device (index).
    #[arg(long)]
    pub gpu: Option<u32>,
}

pub fn run(args: Args) -> anyhow::Result<std::process::ExitCode> {
    let obs = Observer::connect(Some(&args.socket.path()))?;
    let mut report = obs.status()?;
    if let Some(g) = args.gpu {
        if !report.devices.iter().any(|d| d.index == g) {
            anyhow::bail!(
                "gpu {g} does not exist; the daemon serves {} device(s)",
                report.devices.len()
            );
        }
        report.devices.retain(|d| d.index == g);
        report.tenants.retain(|t| t.gpu == g);
    }
    let text = if args.json {
        serde_json::to_string_pretty(&report)? + "\n"
    } else {
        render(&report)
    };
    // A reader that stops early (`vramd status | head`) is no error of ours.
    match std::io::Write::write_all(&mut std::io::stdout().lock(), text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            return Err(anyhow::Error::new(e).context("cannot write the status"));
        }
        _ => {}
    }
    Ok(std::process::ExitCode::SUCCESS)
}

/// What the daemon says about itself beyond its figures: refused connections, dropped log lines,
/// and what it left out of the report to make it fit one frame.
fn render_notes(r: &StatusReport, out: &mut String) {
    let d = &r.daemon;
    if d.connections_refused > 0 {
        let _ = writeln!(
            out,
            "{} connection(s) refused at accept (uids not allowed, [connections] caps, out of \
             file descriptors: see the daemon's log)",
            d.connections_refused
        );
    }
    if d.log_lines_dropped > 0 {
        let _ = writeln!(
            out,
            "{} log line(s) dropped: the daemon's stderr refused them",
            d.log_lines_dropped
        );
    }
    let acl: u64 = r
        .shared
        .buffers
        .iter()
        .map(|b| u64::from(b.acl_left_out))
        .sum();
    let cut_buffers = r
        .shared
        .buffers
        .iter()
        .filter(|b| b.acl_left_out > 0)
        .count();
    if acl > 0 || r.shared.buffers_left_out > 0 || d.tenants_left_out > 0 {
        let _ = writeln!(
            out,
            "this report was cut to fit one frame: {acl} access-list entries of {cut_buffers} \
             shared buffer(s), {} shared buffer(s) and {} tenant(s) left out (the metrics \
             endpoint's /status has everything)",
            r.shared.buffers_left_out, d.tenants_left_out
        );
    }
}

/// The human-readable table.
pub fn render(r: &StatusReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "vramd {} (pid {}), up {:.0} s, {} connection(s), {} protocol error(s)",
        r.daemon.version,
        r.daemon.pid,
        r.daemon.uptime_seconds,
        r.daemon.connections,
        r.daemon.protocol_errors
    );
    render_notes(r, &mut out);
    let _ = writeln!(
        out,
        "\n{:<4} {:<8} {:<28} {:>11} {:>11} {:>11} {:>11} {:>11}",
        "GPU", "BACKEND", "DEVICE", "CAPACITY", "HELD", "POOLED", "RESERVED", "FREE"
    );
    for d in &r.devices {
        let name = format!("{} {}", d.name, short_uuid(&d.uuid));
        let _ = writeln!(
            out,
            "{:<4} {:<8} {:<28} {:>11} {:>11} {:>11} {:>11} {:>11}",
            d.index,
            d.backend,
            truncate(&name, 28),
            d.capacity.to_string(),
            d.held.to_string(),
            d.pooled.to_string(),
            d.reserved.to_string(),
            d.free.to_string()
        );
    }
    for d in &r.devices {
        if let Some(used) = d.driver_used {
            let _ = writeln!(
                out,
                "GPU {}: the driver shows {used} in use: {} created by vramd, {} outside its books \
                 ({} not attributed to any process)",
                d.index, d.device_used, d.outside_use, d.unattributed
            );
        }
        for p in &d.outside_processes {
            let _ = writeln!(
                out,
                "GPU {}: outside use: pid {} `{}` holds {} (not a tenant; not lent to anyone)",
                d.index,
                p.pid,
                p.name.escape_default(),
                p.bytes
            );
        }
        if d.deficit > vram_core::Bytes::ZERO {
            let names: Vec<String> = d.at_risk.iter().map(ToString::to_string).collect();
            let _ = writeln!(
                out,
                "GPU {}: GUARANTEES AT RISK: outside use exceeds what is free by {}; at risk: {}; \
                 borrowing is refused until it is back",
                d.index,
                d.deficit,
                names.join(", ")
            );
        }
    }
    for d in &r.devices {
        let p = d.pool;
        if p.hits + p.recycled + p.misses > 0 {
            let _ = writeln!(
                out,
                "GPU {}: handles for grants: {} from the pool, {} given back earlier by the same \
                 tenant, {} made on the grant's path",
                d.index, p.hits, p.recycled, p.misses
            );
        }
    }
    let _ = writeln!(
        out,
        "\n{:<16} {:>3} {:<7} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8} {:>8}",
        "TENANT",
        "GPU",
        "CLASS",
        "GUARANTEE",
        "LIMIT",
        "HELD",
        "OWN",
        "IN USE",
        "CACHED",
        "PID",
        "GRANTS",
        "REFUSED"
    );
    if r.tenants.is_empty() {
        let _ = writeln!(out, "(no tenants)");
    } else {
        let _ = writeln!(
            out,
            "(HELD: granted by vramd; OWN: memory the tenant made itself or the driver attributes \
             to its process, such as its CUDA context; both count against its limit)"
        );
    }
    for t in &r.tenants {
        let refused: u64 = t.refusals.values().sum();
        let _ = writeln!(
            out,
            "{:<16} {:>3} {:<7} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8} {:>8}",
            truncate(&t.name, 16),
            t.gpu,
            truncate(&t.class, 7),
            t.guarantee.to_string(),
            t.limit.to_string(),
            t.held.to_string(),
            t.charged.saturating_add(t.outside).to_string(),
            t.in_use.to_string(),
            t.cached.to_string(),
            t.pid,
            t.grants,
            refused
        );
    }
    out
}

fn short_uuid(uuid: &str) -> &str {
    &uuid[..uuid.len().min(12)]
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(n - 1).collect();
        t.push('…');
        t
    }
}
