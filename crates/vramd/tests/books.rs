//! The books checked against the driver, end to end: an in-process daemon on the host backend whose
//! driver figures come from a scripted probe (the host backend has no driver to ask; on a GPU the
//! probe is NVML: docs/benchmarks.md, "Accounting against the driver and NVML"), with real tenant
//! processes. What is tested is what the daemon does with a reading: tenants' own memory counted
//! against their limits, outside use lent to no one, guarantees at risk named, borrowing stopped,
//! borrowers asked for their idle memory.

use std::sync::Arc;
use std::time::Duration;

use vram_core::books::{DriverReading, ProcessUse};
use vram_core::Bytes;
use vram_device::{Device, HostDevice};
use vramd::config::{Config, PoolConfig};
use vramd::server::driver::ScriptedProbe;
use vramd::server::{ServeOptions, Server, Shutdown};

mod common;
use common::{wait_until, Tenant};

struct InProcess {
    socket: std::path::PathBuf,
    server: Arc<vramd::server::Daemon>,
    shutdown: Shutdown,
    thread: Option<std::thread::JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl InProcess {
    fn start(capacity: Bytes, probe: Arc<ScriptedProbe>) -> InProcess {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("vramd.sock");
        let dev: Arc<dyn Device> = Arc::new(HostDevice::new(capacity, Bytes::mib(2)).unwrap());
        let config = Config::default();
        let pool = PoolConfig {
            max: Bytes::ZERO,
            ..PoolConfig::default()
        };
        let server = Server::bind(ServeOptions {
            socket: socket.clone(),
            socket_mode: 0o600,
            allowed_uids: None,
            devices: vec![dev],
            policy: Box::new(move |d: &dyn Device| config.policy(d.info().capacity)),
            pool,
            reclaim_timeout: Duration::from_millis(300),
            probe: Some(probe),
            probe_period: Duration::from_millis(20),
        })
        .unwrap();
        let shutdown = server.shutdown_handle();
        let daemon = server.daemon().clone();
        let thread = std::thread::spawn(move || server.run().unwrap());
        InProcess {
            socket,
            server: daemon,
            shutdown,
            thread: Some(thread),
            _dir: dir,
        }
    }

    fn status(&self) -> vram_proto::StatusReport {
        self.server.status()
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        self.shutdown.trigger();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A reading that shows what the daemon created, plus `processes`.
fn reading(created: Bytes, processes: &[(u32, &str, Bytes)]) -> DriverReading {
    let listed: Bytes = processes.iter().map(|p| p.2).sum();
    DriverReading {
        total: Bytes::gib(16),
        reserved: Bytes::ZERO,
        used: created + listed,
        allowance: Bytes::ZERO,
        processes: processes
            .iter()
            .map(|&(pid, name, used)| ProcessUse {
                pid,
                used: Some(used),
                name: name.to_string(),
            })
            .collect(),
    }
}

#[test]
fn a_tenants_context_counts_against_its_limit() {
    let probe = Arc::new(ScriptedProbe::new());
    let d = InProcess::start(Bytes::gib(16), probe.clone());
    let mut t = Tenant::spawn(&d.socket, "ctx", &["--limit", "1GiB"]);
    assert_eq!(t.next()["event"], "welcome");
    // The driver lists the tenant's process with a 512 MiB context.
    probe.set(
        "host-0",
        reading(Bytes::ZERO, &[(t.pid(), "python3", Bytes::mib(512))]),
    );
    assert!(wait_until(Duration::from_secs(5), || {
        d.status().tenants[0].outside == Bytes::mib(512)
    }));
    let took = t.cmd("take 1GiB 64MiB");
    assert_eq!(took["taken"], Bytes::mib(512).get(), "{took}");
    assert_eq!(took["refused"]["reason"], "over_limit", "{took}");
    let msg = took["refused"]["message"].as_str().unwrap();
    assert!(
        msg.contains("its limit is 1 GiB and it holds 1 GiB"),
        "{msg}"
    );
    t.exit();
}

#[test]
fn outside_use_is_lent_to_no_one_and_at_risk_guarantees_are_named() {
    let probe = Arc::new(ScriptedProbe::new());
    let d = InProcess::start(Bytes::gib(16), probe.clone());
    probe.set("host-0", reading(Bytes::ZERO, &[]));
    let mut g = Tenant::spawn(&d.socket, "guaranteed", &["--guarantee", "10GiB"]);
    assert_eq!(g.next()["event"], "welcome");
    let mut b = Tenant::spawn(&d.socket, "borrower", &[]);
    assert_eq!(b.next()["event"], "welcome");
    let took = b.cmd("take 4GiB 1GiB");
    assert_eq!(took["taken"], Bytes::gib(4).get(), "{took}");
    assert_eq!(b.cmd("cache 3GiB")["bytes"], Bytes::gib(3).get());

    // A process vramd did not start takes 5 GiB: 2 GiB was free, so 3 GiB of the guarantee
    // cannot be met now.
    let created = d.status().devices[0].device_used;
    probe.set(
        "host-0",
        reading(created, &[(4_000_000, "hog", Bytes::gib(5))]),
    );
    assert!(wait_until(Duration::from_secs(5), || {
        d.status().devices[0].outside_use == Bytes::gib(5)
    }));
    let dev = &d.status().devices[0];
    assert_eq!(dev.outside_processes.len(), 1, "{dev:?}");
    assert_eq!(dev.outside_processes[0].name, "hog");
    assert_eq!(dev.free, Bytes::ZERO);
    // The borrower was asked for its idle memory and gave it back...
    assert!(wait_until(Duration::from_secs(5), || {
        let s = d.status();
        s.tenants
            .iter()
            .any(|t| t.name == "borrower" && t.held == Bytes::gib(1))
    }));
    // ... which the driver shows, and which closes the deficit.
    let created = d.status().devices[0].device_used;
    probe.set(
        "host-0",
        reading(created, &[(4_000_000, "hog", Bytes::gib(5))]),
    );
    assert!(wait_until(Duration::from_secs(5), || {
        let dev = &d.status().devices[0];
        dev.deficit == Bytes::ZERO && dev.outside_use == Bytes::gib(5)
    }));
    // While the hog holds memory, nobody borrows, and the status names what is at risk when
    // it grows again.
    let took = b.cmd("take 64MiB");
    assert_eq!(took["refused"]["reason"], "device_full", "{took}");
    let created = d.status().devices[0].device_used;
    probe.set(
        "host-0",
        reading(created, &[(4_000_000, "hog", Bytes::gib(8))]),
    );
    assert!(wait_until(Duration::from_secs(5), || {
        let dev = &d.status().devices[0];
        dev.deficit == Bytes::gib(3)
            && dev.outside_processes.first().map(|p| p.bytes) == Some(Bytes::gib(8))
    }));
    let dev = &d.status().devices[0];
    assert_eq!(dev.at_risk.len(), 1, "{dev:?}");
    assert_eq!(dev.at_risk[0].tenant, "guaranteed");
    assert_eq!(dev.at_risk[0].unfilled, Bytes::gib(10));
    let text = vramd::cmd::status::render(&d.status());
    assert!(text.contains("GUARANTEES AT RISK"), "{text}");
    assert!(text.contains("pid 4000000 `hog` holds 8 GiB"), "{text}");
    // The hog goes: everything is lendable again.
    probe.set("host-0", reading(created, &[]));
    assert!(wait_until(Duration::from_secs(5), || {
        let dev = &d.status().devices[0];
        dev.outside_use == Bytes::ZERO && dev.at_risk.is_empty()
    }));
    assert_eq!(b.cmd("take 64MiB")["taken"], Bytes::mib(64).get());
    g.exit();
    b.exit();
}

#[test]
fn memory_the_books_cannot_place_is_outside_use() {
    let probe = Arc::new(ScriptedProbe::new());
    let d = InProcess::start(Bytes::gib(16), probe.clone());
    // 1 GiB in use that no listed process accounts for (another container's process, say).
    let mut r = reading(Bytes::ZERO, &[]);
    r.used = Bytes::gib(1);
    probe.set("host-0", r);
    assert!(wait_until(Duration::from_secs(5), || {
        d.status().devices[0].unattributed == Bytes::gib(1)
    }));
    let dev = &d.status().devices[0];
    assert_eq!(dev.outside_use, Bytes::gib(1));
    assert_eq!(dev.free, Bytes::gib(15));
    // A guarantee that needs that memory is refused at connect, saying why.
    let mut t = Tenant::spawn(&d.socket, "big", &["--guarantee", "16GiB"]);
    let w = t.next();
    assert_eq!(w["event"], "refused_at_connect", "{w}");
    let msg = w["message"].as_str().unwrap();
    assert!(msg.contains("1 GiB in use outside vramd's books"), "{msg}");
}

#[test]
fn a_process_that_made_its_context_before_connecting_is_not_in_its_own_way() {
    use std::io::{BufRead, Write};
    let probe = Arc::new(ScriptedProbe::new());
    let d = InProcess::start(Bytes::gib(16), probe.clone());
    // A tenant process that waits before it connects (exec keeps the shell's pid), so that the
    // driver lists its 512 MiB context first, as outside use.
    let mut child = std::process::Command::new("sh")
        .args(["-c", "read go; exec \"$0\" \"$@\""])
        .arg(common::VRAMD)
        .args([
            "tenant",
            "--name",
            "late",
            "--guarantee",
            "16GiB",
            "--socket",
        ])
        .arg(&d.socket)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    probe.set(
        "host-0",
        reading(Bytes::ZERO, &[(child.id(), "python3", Bytes::mib(512))]),
    );
    assert!(wait_until(Duration::from_secs(5), || {
        d.status().devices[0].outside_use == Bytes::mib(512)
    }));
    // It asks for a guarantee of the whole device: its own context is not in its way.
    let mut stdin = child.stdin.take().unwrap();
    writeln!(stdin, "go").unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.contains("\"welcome\""), "{line}");
    let s = d.status();
    assert_eq!(s.devices[0].outside_use, Bytes::ZERO, "{s:?}");
    assert_eq!(s.tenants[0].outside, Bytes::mib(512));
    drop(stdin);
    child.wait().unwrap();
}
