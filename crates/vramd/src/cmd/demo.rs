//! `vramd demo`: the whole system on a laptop. A daemon on a 16 GiB host-backend device and three
//! real tenant processes — a high-priority trainer with a guarantee and two borrowers — take
//! memory, write and verify patterns, run into their limits; one borrower is SIGKILLed midway and
//! its memory must be back at once. Exits non-zero if any invariant fails.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::Value;
use vram_client::Observer;
use vram_core::Bytes;
use vram_proto::StatusReport;

use super::status::render;
use super::tenant::Scripted;
use crate::own_daemon::OwnDaemon;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Keep the temporary directory (socket, daemon log) for inspection.
    #[arg(long)]
    pub keep: bool,
}

const CAPACITY: Bytes = Bytes::gib(16);
const CHUNK: &str = "512MiB";

/// Starts a scripted tenant and waits until it is admitted.
fn spawn_tenant(exe: &Path, socket: &Path, name: &str, flags: &[&str]) -> anyhow::Result<Scripted> {
    let mut t = Scripted::spawn(exe, socket, name, flags)?;
    let hello = t.answer()?;
    if hello["event"] != "welcome" {
        bail!("tenant {name} was not admitted: {hello}");
    }
    Ok(t)
}

/// One line of the final report.
struct Check {
    what: String,
    ok: bool,
}

struct Report {
    checks: Vec<Check>,
    live: bool,
}

impl Report {
    fn check(&mut self, ok: bool, what: impl Into<String>) {
        let what = what.into();
        if !self.live {
            println!("  [{}] {what}", if ok { "ok" } else { "FAILED" });
        }
        self.checks.push(Check { what, ok });
    }
}

pub fn run(args: Args) -> anyhow::Result<std::process::ExitCode> {
    let dir = tempfile::Builder::new().prefix("vramd-demo-").tempdir()?;
    let exe = std::env::current_exe().context("cannot find the vramd executable")?;
    println!(
        "vramd demo: a daemon on a {CAPACITY} host-backend device (memfd-backed; sparse, so it costs only what is touched)"
    );
    println!(
        "  socket and daemon log in {} ({})",
        dir.path().display(),
        if args.keep {
            "kept at the end"
        } else {
            "removed at the end; --keep keeps them"
        }
    );
    let capacity = CAPACITY.to_string().replace(' ', "");
    // The trainer asks for the `high` class, above the default: this user may.
    let config = dir.path().join("vramd.toml");
    let uid = rustix::process::getuid().as_raw();
    std::fs::write(
        &config,
        format!("metrics = \"off\"\n[classes.high]\npriority = 100\nusers = [{uid}]\n"),
    )
    .context("cannot write the demo's configuration")?;
    let config = config.to_string_lossy().into_owned();
    let mut daemon = OwnDaemon::spawn(
        &exe,
        dir,
        &[
            "--backend",
            "host",
            "--capacity",
            &capacity,
            "--config",
            &config,
        ],
    )?;
    let result = scenario(&exe, daemon.socket());
    // Stop the daemon whatever happened, and check that it stops cleanly.
    let status = daemon.signal(rustix::process::Signal::TERM)?;
    let mut report = result?;
    report.live = false;
    report.check(
        status == Some(0),
        match status {
            Some(code) => format!("the daemon stopped cleanly on SIGTERM (exit status {code})"),
            None => "the daemon stopped cleanly on SIGTERM (it was killed by a signal)".to_owned(),
        },
    );
    let failed = report.checks.iter().filter(|c| !c.ok).count();
    println!("\n== Report");
    for c in &report.checks {
        println!("  [{}] {}", if c.ok { "ok" } else { "FAILED" }, c.what);
    }
    if args.keep {
        let kept: PathBuf = daemon.keep();
        println!("\nkept {}", kept.display());
    }
    if failed == 0 {
        println!("\nall {} invariants held", report.checks.len());
        Ok(std::process::ExitCode::SUCCESS)
    } else {
        println!("\n{failed} of {} invariants FAILED", report.checks.len());
        Ok(std::process::ExitCode::from(1))
    }
}

fn status(socket: &Path) -> anyhow::Result<StatusReport> {
    Ok(Observer::connect(Some(socket))?.status()?)
}

/// Redraws the status table in place while the scenario runs (only on a terminal).
struct LiveTable {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LiveTable {
    fn start(socket: &Path) -> LiveTable {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = std::io::stdout().is_terminal().then(|| {
            let stop = stop.clone();
            let socket = socket.to_path_buf();
            std::thread::spawn(move || {
                let mut lines = 0;
                while !stop.load(Ordering::Acquire) {
                    if let Ok(s) = status(&socket) {
                        let table = render(&s);
                        let mut out = std::io::stdout().lock();
                        // Move up over the previous table and clear to the end of the screen.
                        if lines > 0 {
                            let _ = write!(out, "\x1b[{lines}A\x1b[J");
                        }
                        let _ = write!(out, "{table}");
                        let _ = out.flush();
                        lines = table.lines().count();
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            })
        });
        LiveTable { stop, thread }
    }

    fn is_live(&self) -> bool {
        self.thread.is_some()
    }
}

impl Drop for LiveTable {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn step(live: bool, title: &str) {
    if !live {
        println!("\n-- {title}");
    }
}

fn refusal(v: &Value) -> Option<String> {
    v["refused"]["reason"].as_str().map(str::to_string)
}

fn gib(v: &Value, key: &str) -> String {
    Bytes(v[key].as_u64().unwrap_or(0)).to_string()
}

fn scenario(exe: &Path, socket: &Path) -> anyhow::Result<Report> {
    let mut trainer = spawn_tenant(
        exe,
        socket,
        "trainer",
        &["--class", "high", "--guarantee", "6GiB", "--limit", "10GiB"],
    )?;
    let mut a = spawn_tenant(
        exe,
        socket,
        "borrower-a",
        &["--class", "normal", "--limit", "5GiB"],
    )?;
    let mut b = spawn_tenant(
        exe,
        socket,
        "borrower-b",
        &["--class", "low", "--limit", "6GiB"],
    )?;
    let live = LiveTable::start(socket);
    let mut r = Report {
        checks: Vec::new(),
        live: live.is_live(),
    };
    let mut notes = Vec::new();

    step(
        r.live,
        "trainer (high, guarantee 6 GiB, limit 10 GiB) takes its guarantee",
    );
    let t1 = trainer.cmd(&format!("take 6GiB {CHUNK}"))?;
    r.check(
        refusal(&t1).is_none() && t1["taken"] == Bytes::gib(6).get(),
        format!(
            "trainer took {} of its guarantee, never refused",
            gib(&t1, "taken")
        ),
    );

    step(r.live, "borrower-a (normal, limit 5 GiB) asks for 6 GiB");
    let a1 = a.cmd(&format!("take 6GiB {CHUNK}"))?;
    r.check(
        refusal(&a1).as_deref() == Some("over_limit"),
        format!(
            "borrower-a stopped at its limit with {} held: {}",
            gib(&a1, "held"),
            a1["refused"]["message"]
        ),
    );

    step(
        r.live,
        "borrower-b (low, limit 6 GiB) asks for 6 GiB of what is left",
    );
    let b1 = b.cmd(&format!("take 6GiB {CHUNK}"))?;
    let b_reason = refusal(&b1);
    r.check(
        matches!(
            b_reason.as_deref(),
            Some("device_full" | "priority_reserve")
        ),
        format!(
            "borrower-b refused when the device filled, with {} held: {}",
            gib(&b1, "held"),
            b1["refused"]["message"]
        ),
    );

    let dirty: u64 = [&t1, &a1, &b1]
        .iter()
        .map(|v| v["dirty"].as_u64().unwrap_or(0))
        .sum();
    r.check(
        dirty == 0,
        format!("every grant arrived zeroed: no tenant saw another's bytes ({dirty} dirty)"),
    );

    step(r.live, "everyone verifies the patterns they wrote");
    for t in [&mut trainer, &mut a, &mut b] {
        let v = t.cmd("verify")?;
        r.check(
            v["ok"] == true,
            format!("{}: {} grants verified", t.name, v["checked"]),
        );
    }

    step(
        r.live,
        "borrower-a marks 2 GiB idle; the trainer grows 2 GiB above its guarantee",
    );
    a.cmd("cache 2GiB")?;
    let before = Instant::now();
    let t2 = trainer.cmd(&format!("take 2GiB {CHUNK}"))?;
    r.check(
        refusal(&t2).is_none(),
        format!(
            "trainer grew to {} in {:.0} ms: the daemon asked borrower-a for its idle memory",
            gib(&t2, "held"),
            before.elapsed().as_secs_f64() * 1e3
        ),
    );

    step(
        r.live,
        "borrower-b is killed with SIGKILL while holding memory",
    );
    let s0 = status(socket)?;
    let b_held = s0
        .tenants
        .iter()
        .find(|t| t.name == "borrower-b")
        .map_or(Bytes::ZERO, |t| t.held);
    let killed = Instant::now();
    b.child.kill()?;
    let _ = b.child.wait();
    let back = loop {
        let s = status(socket)?;
        if !s.tenants.iter().any(|t| t.name == "borrower-b") {
            break Some((killed.elapsed(), s));
        }
        if killed.elapsed() > Duration::from_secs(5) {
            break None;
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    match back {
        Some((elapsed, s)) => {
            let freed = s0.devices[0].held.saturating_sub(s.devices[0].held);
            r.check(
                elapsed < Duration::from_millis(100) && freed == b_held,
                format!(
                    "borrower-b's {b_held} was back in {:.1} ms (held {} -> {})",
                    elapsed.as_secs_f64() * 1e3,
                    s0.devices[0].held,
                    s.devices[0].held
                ),
            );
        }
        None => r.check(false, "borrower-b's memory did not come back within 5 s"),
    }

    step(r.live, "the trainer grows into the memory borrower-b held");
    let t3 = trainer.cmd(&format!("take 1GiB {CHUNK}"))?;
    r.check(
        refusal(&t3).is_none(),
        format!("trainer now holds {}", gib(&t3, "held")),
    );
    for t in [&mut trainer, &mut a] {
        let v = t.cmd("verify")?;
        r.check(
            v["ok"] == true,
            format!(
                "{}: {} grants verified after the kill",
                t.name, v["checked"]
            ),
        );
    }

    step(r.live, "the survivors exit and give everything back");
    for mut t in [trainer, a] {
        t.cmd("exit")?;
        let code = t.child.wait()?;
        r.check(code.success(), format!("{} exited cleanly", t.name));
    }
    // The daemon sees each exit when the socket closes, and the pool may be refilling (creating
    // ahead) at this moment: give both a moment to settle.
    let settled =
        |s: &StatusReport| s.tenants.is_empty() && s.devices[0].device_used == s.devices[0].pooled;
    let mut s = status(socket)?;
    let settle = Instant::now() + Duration::from_secs(2);
    while !settled(&s) && Instant::now() < settle {
        std::thread::sleep(Duration::from_millis(20));
        s = status(socket)?;
    }
    drop(live);
    if r.live {
        println!();
    }
    r.check(
        s.tenants.is_empty()
            && s.devices[0].held == Bytes::ZERO
            && s.devices[0].device_used == s.devices[0].pooled,
        format!(
            "nothing held at the end ({} tenant(s) left, held {}, device memory in use {} = pooled {})",
            s.tenants.len(), s.devices[0].held, s.devices[0].device_used, s.devices[0].pooled
        ),
    );
    notes.push(format!(
        "grants: trainer {}, borrower-a {}, borrower-b {}",
        t1["grants"].as_u64().unwrap_or(0)
            + t2["grants"].as_u64().unwrap_or(0)
            + t3["grants"].as_u64().unwrap_or(0),
        a1["grants"],
        b1["grants"]
    ));
    for n in notes {
        println!("  {n}");
    }
    Ok(r)
}
