//! A `vramd serve` child that a tool starts for itself (`demo`, `bench`) on a private socket.

use std::ffi::OsStr;
use std::path::Path;
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
