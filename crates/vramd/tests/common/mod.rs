//! Multi-process test support: a real `vramd serve` on a temporary socket (host backend), and
//! scripted tenant processes (`vramd tenant`) driven line by line.
#![allow(dead_code)] // each test binary uses part of it

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use serde_json::Value;
use vram_client::Observer;
use vram_proto::StatusReport;
use vramd::cmd::tenant::Scripted;
use vramd::own_daemon::OwnDaemon;

pub const VRAMD: &str = env!("CARGO_BIN_EXE_vramd");

/// Runs `vramd ARGS...`, which must succeed (its stderr in the failure message); its stdout.
pub fn vramd_stdout<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> String {
    let out = Command::new(VRAMD).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// A daemon of the test's own (`vramd::own_daemon`, the one starter), failing the test where it
/// does not start or stop as it should. Dropping it kills it, after printing its log if the test
/// is failing; [`Daemon::stop`] checks a clean shutdown.
pub struct Daemon {
    inner: Option<OwnDaemon>,
    pub socket: PathBuf,
}

impl Daemon {
    /// Starts `vramd serve --backend host` with `config` (TOML) and waits until it answers.
    pub fn start(config: &str) -> Daemon {
        Self::start_on("host", config)
    }

    /// Starts `vramd serve --backend BACKEND` with `config` (TOML, in `vramd.toml` beside the
    /// socket) and waits until it answers.
    pub fn start_on(backend: &str, config: &str) -> Daemon {
        let dir = tempfile::Builder::new()
            .prefix("vramd-test-")
            .tempdir()
            .unwrap();
        let config_path = dir.path().join("vramd.toml");
        std::fs::write(&config_path, config).unwrap();
        let args = [
            OsStr::new("--backend"),
            OsStr::new(backend),
            OsStr::new("--config"),
            config_path.as_os_str(),
        ];
        let d = OwnDaemon::spawn(Path::new(VRAMD), dir, &args).unwrap_or_else(|e| panic!("{e:#}"));
        Daemon {
            socket: d.socket().to_path_buf(),
            inner: Some(d),
        }
    }

    fn own(&self) -> &OwnDaemon {
        self.inner.as_ref().expect("running")
    }

    /// The directory of its socket, configuration and log.
    pub fn dir(&self) -> &Path {
        self.own().dir()
    }

    pub fn pid(&self) -> u32 {
        self.own().pid()
    }

    /// Waits up to 5 s for every tenant's connection to be gone; panics if one is still there.
    pub fn wait_for_no_tenants(&self) {
        let gone = wait_until(Duration::from_secs(5), || self.status().tenants.is_empty());
        assert!(gone, "tenants still connected: {:?}", self.status().tenants);
    }

    pub fn status(&self) -> StatusReport {
        Observer::connect(Some(&self.socket))
            .and_then(|o| o.status())
            .unwrap_or_else(|e| panic!("status: {e}\n{}", self.log()))
    }

    /// What the tenant `name` holds, by the daemon's status (nothing if it is not connected).
    pub fn held_by(&self, name: &str) -> vram_core::Bytes {
        self.status()
            .tenants
            .iter()
            .find(|t| t.name == name)
            .map_or(vram_core::Bytes::ZERO, |t| t.held)
    }

    /// Open file descriptors of the daemon process.
    pub fn fd_count(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .unwrap()
            .count()
    }

    pub fn log(&self) -> String {
        self.inner.as_ref().map(OwnDaemon::log).unwrap_or_default()
    }

    /// Writes `config` as its configuration and reloads it (SIGHUP), waiting up to 5 s for the
    /// reload to be logged.
    pub fn reload(&self, config: &str) {
        let reloads = || self.log().matches("configuration reloaded").count();
        let before = reloads();
        std::fs::write(self.dir().join("vramd.toml"), config).unwrap();
        rustix::process::kill_process(
            rustix::process::Pid::from_raw(self.pid() as i32).unwrap(),
            rustix::process::Signal::HUP,
        )
        .unwrap();
        assert!(
            wait_until(Duration::from_secs(5), || reloads() > before),
            "the reload was not logged:\n{}",
            self.log()
        );
    }

    /// Starts a scripted tenant and waits for its welcome.
    pub fn tenant(&self, name: &str, flags: &[&str]) -> Tenant {
        let mut t = Tenant::spawn(&self.socket, name, flags);
        let hello = t.next();
        assert_eq!(hello["event"], "welcome", "{name} not admitted: {hello}");
        t
    }

    /// A tenant that took `bytes` (whole MiB, in 64 MiB handles), keeps all of it cached (idle,
    /// so a reclaim may ask for it) and is then stopped with SIGSTOP: it reads nothing and
    /// answers no reclaim until `Tenant::resume`.
    pub fn stopped_tenant_with_cache(&self, name: &str, bytes: vram_core::Bytes) -> Tenant {
        let mib = bytes.get() / vram_core::Bytes::MIB;
        let mut t = self.tenant(name, &[]);
        let took = t.cmd(&format!("take {mib}MiB 64MiB"));
        assert_eq!(took["taken"], bytes.get(), "{took}");
        let cached = t.cmd(&format!("cache {mib}MiB"));
        assert_eq!(cached["bytes"], bytes.get(), "{cached}");
        t.signal(rustix::process::Signal::STOP);
        t
    }

    /// SIGTERM; the daemon must exit 0 within 10 s and remove its socket.
    pub fn stop(mut self) {
        let d = self.inner.take().expect("running");
        if let Err(e) = d.stop() {
            panic!("{e:#}");
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if self.inner.is_some() && std::thread::panicking() {
            eprintln!("--- daemon log ---\n{}", self.log());
        }
    }
}

/// A `vramd tenant` process: one command per line in, one JSON line out (`Scripted`, with the
/// test's way of failing: a panic that says what went wrong).
pub struct Tenant {
    inner: Scripted,
}

impl Tenant {
    /// Starts the process without waiting for anything.
    pub fn spawn(socket: &Path, name: &str, flags: &[&str]) -> Tenant {
        let inner = Scripted::spawn(Path::new(VRAMD), socket, name, flags).unwrap();
        Tenant { inner }
    }

    pub fn pid(&self) -> u32 {
        self.inner.child.id()
    }

    pub fn child(&mut self) -> &mut Child {
        &mut self.inner.child
    }

    /// The next JSON line (60 s at most).
    pub fn next(&mut self) -> Value {
        self.inner.answer().unwrap()
    }

    /// Sends a command without waiting for its answer.
    pub fn send(&mut self, line: &str) {
        self.inner.send(line).unwrap()
    }

    pub fn cmd(&mut self, line: &str) -> Value {
        self.send(line);
        self.next()
    }

    /// `exit`: gives everything back; the process must exit 0.
    pub fn exit(mut self) {
        let bye = self.cmd("exit");
        assert_eq!(bye["event"], "bye", "{bye}");
        self.inner.close_input();
        let status = self.inner.child.wait().unwrap();
        assert!(
            status.success(),
            "tenant {} exited with {status}",
            self.inner.name
        );
    }

    /// Sends `signal` to the tenant process.
    pub fn signal(&self, signal: rustix::process::Signal) {
        let pid = rustix::process::Pid::from_child(&self.inner.child);
        rustix::process::kill_process(pid, signal).unwrap();
    }

    /// SIGCONT: a tenant stopped by `Daemon::stopped_tenant_with_cache` runs again.
    pub fn resume(&self) {
        self.signal(rustix::process::Signal::CONT);
    }

    /// SIGKILL, and reap.
    pub fn kill(mut self) {
        self.inner.child.kill().unwrap();
        self.inner.child.wait().unwrap();
    }
}

/// A tenant a failed test left running is killed, so that it does not outlive the test (a
/// client whose daemon is gone keeps trying to reconnect for a while).
impl Drop for Tenant {
    fn drop(&mut self) {
        if let Ok(None) = self.inner.child.try_wait() {
            let _ = self.inner.child.kill();
            let _ = self.inner.child.wait();
        }
    }
}

/// Polls `cond` every millisecond until it holds or `limit` passes; whether it held.
pub fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A fresh pseudo-terminal: its master and its slave side, neither this process's controlling
/// terminal.
pub fn pty() -> (std::os::fd::OwnedFd, std::os::fd::OwnedFd) {
    use rustix::fs::{Mode, OFlags};
    use rustix::pty::{grantpt, openpt, ptsname, unlockpt, OpenptFlags};

    let master = openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY).unwrap();
    grantpt(&master).unwrap();
    unlockpt(&master).unwrap();
    let name = ptsname(&master, Vec::new()).unwrap();
    let slave = rustix::fs::open(
        name.as_c_str(),
        OFlags::RDWR | OFlags::NOCTTY,
        Mode::empty(),
    )
    .unwrap();
    (master, slave)
}

/// libvram.so next to the vramd binary, built here if `cargo test` has not built it.
pub fn library() -> Option<PathBuf> {
    static BUILT: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = BUILT.lock().unwrap_or_else(|p| p.into_inner());
    let dir = Path::new(VRAMD).parent()?;
    let lib = dir.join("libvram.so");
    if !lib.is_file() {
        let mut cargo = Command::new(env!("CARGO"));
        cargo.args(["build", "-p", "vram-ffi", "--lib"]);
        if dir.file_name().is_some_and(|n| n == "release") {
            cargo.arg("--release");
        }
        cargo.env("CARGO_TARGET_DIR", dir.parent()?);
        assert!(
            cargo.status().expect("cargo runs").success(),
            "building libvram.so failed"
        );
    }
    lib.is_file().then_some(lib)
}
