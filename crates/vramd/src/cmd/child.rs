//! A `vramd serve` child that a tool starts for itself (`demo`, `bench`, `replay --through-daemon`)
//! on a private socket.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use vram_client::Observer;

/// Starts `exe serve --socket SOCKET ARGS...` with its output in `log`, and waits until it answers.
pub fn start_daemon<S: AsRef<OsStr>>(
    exe: &Path,
    socket: &Path,
    log: &Path,
    args: &[S],
) -> anyhow::Result<Child> {
    let log = std::fs::File::create(log)?;
    let mut child = Command::new(exe)
        .arg("serve")
        .arg("--socket")
        .arg(socket)
        .args(args)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("cannot start the daemon")?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if Observer::connect(Some(socket))
            .and_then(|o| o.status())
            .is_ok()
        {
            return Ok(child);
        }
        if let Some(status) = child.try_wait()? {
            bail!("the daemon exited at start ({status})");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    bail!("the daemon did not come up within 10 s")
}

/// Sends SIGTERM and waits up to 10 s; the exit code, or `None` if it had to be killed.
pub fn stop_daemon(child: &mut Child) -> anyhow::Result<Option<i32>> {
    let _ = rustix::process::kill_process(
        rustix::process::Pid::from_child(child),
        rustix::process::Signal::TERM,
    );
    wait_timeout(child, Duration::from_secs(10))
}

/// Waits up to `limit` for `child`; kills it after that. Its exit code, `None` if killed.
pub fn wait_timeout(child: &mut Child, limit: Duration) -> anyhow::Result<Option<i32>> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(s) = child.try_wait()? {
            return Ok(s.code());
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A daemon of this executable's on a private socket in `dir` (its log there too), stopped on
/// [`OwnDaemon::stop`] — which checks that it stopped cleanly — or, if the tool fails first, on drop.
pub struct OwnDaemon {
    child: Child,
    dir: tempfile::TempDir,
    socket: PathBuf,
}

impl OwnDaemon {
    /// Starts `vramd serve` with `args` (files it names may already lie in `dir`).
    pub fn start<S: AsRef<OsStr>>(dir: tempfile::TempDir, args: &[S]) -> anyhow::Result<OwnDaemon> {
        let socket = dir.path().join("vramd.sock");
        let exe = std::env::current_exe().context("cannot find the vramd executable")?;
        let child = start_daemon(&exe, &socket, &dir.path().join("vramd.log"), args)?;
        Ok(OwnDaemon { child, dir, socket })
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Stops it; an error with its log if it did not stop cleanly.
    pub fn stop(mut self) -> anyhow::Result<()> {
        let code = stop_daemon(&mut self.child)?;
        if code != Some(0) {
            let log =
                std::fs::read_to_string(self.dir.path().join("vramd.log")).unwrap_or_default();
            bail!("our daemon did not stop cleanly ({code:?}); its log:\n{log}");
        }
        Ok(())
    }
}

impl Drop for OwnDaemon {
    /// A tool that failed part-way leaves no daemon behind.
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = stop_daemon(&mut self.child);
        }
    }
}
