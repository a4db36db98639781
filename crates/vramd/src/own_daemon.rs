//! A daemon of a program's own, on a private socket (`vramd.sock`) in a directory it is given:
//! the one starter of the tools that need a daemon (`vramd demo`, `bench`, `replay
//! --through-daemon`), of the tests' daemons and of the example's. Either a `vramd serve` child
//! process ([`OwnDaemon::spawn`]: its log in the directory, stopped by a signal as an operator
//! would), or, for a program that has no vramd executable at hand (the example, libvram.so's
//! tests), the same server on a thread of the calling process ([`OwnDaemon::in_process`]).
//! Dropped, it is gone: a child is killed and reaped, a thread shut down and joined. A child also
//! stops when this process ends without dropping it (killed, say): its standard input is a pipe
//! only this process holds, and it runs with `--stop-on-stdin-close`.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use vram_client::{ClientError, Observer};
use vram_device::Device;

use crate::config::Config;
use crate::server::{ServeOptions, Server, Shutdown};

/// How long a daemon may take to answer after it was started, and to exit after SIGTERM.
const PATIENCE: Duration = Duration::from_secs(10);

pub struct OwnDaemon {
    runs: Runs,
    socket: PathBuf,
    dir: Option<tempfile::TempDir>,
}

enum Runs {
    Child {
        child: Option<Child>,
        exe: PathBuf,
        args: Vec<OsString>,
        /// How many times it was started: the log of the Nth start is `vramd.N.log` (the
        /// first's `vramd.log`).
        starts: u32,
    },
    Thread {
        shutdown: Shutdown,
        thread: Option<JoinHandle<anyhow::Result<()>>>,
    },
}

impl OwnDaemon {
    /// Starts `EXE serve --socket DIR/vramd.sock ARGS...` (output to `DIR/vramd.log`) and waits
    /// until it answers, if only to refuse the caller (a configuration whose `allowed_uids`
    /// leaves it out). A daemon that exits first, or stays silent for 10 s, is an error with its
    /// log.
    pub fn spawn<S: AsRef<OsStr>>(
        exe: &Path,
        dir: tempfile::TempDir,
        args: &[S],
    ) -> anyhow::Result<OwnDaemon> {
        let mut d = OwnDaemon {
            socket: dir.path().join("vramd.sock"),
            dir: Some(dir),
            runs: Runs::Child {
                child: None,
                exe: exe.to_path_buf(),
                args: args.iter().map(|a| a.as_ref().to_owned()).collect(),
                starts: 0,
            },
        };
        d.start_again()?;
        Ok(d)
    }

    /// [`OwnDaemon::spawn`] of this executable (a tool of vramd's own).
    pub fn spawn_this<S: AsRef<OsStr>>(
        dir: tempfile::TempDir,
        args: &[S],
    ) -> anyhow::Result<OwnDaemon> {
        let exe = std::env::current_exe().context("cannot find the vramd executable")?;
        Self::spawn(&exe, dir, args)
    }

    /// Serves `devices` from a thread of this process on `DIR/vramd.sock`, as `config` says of
    /// its policy, pool, reclaim wait, shared buffers and connections (its log is this process's
    /// `tracing` output). The socket's mode is 0600.
    pub fn in_process(
        dir: tempfile::TempDir,
        devices: Vec<Arc<dyn Device>>,
        config: &Config,
    ) -> anyhow::Result<OwnDaemon> {
        let socket = dir.path().join("vramd.sock");
        let policy = config.clone();
        let server = Server::bind(ServeOptions {
            socket: socket.clone(),
            socket_mode: 0o600,
            allowed_uids: config.allowed_uids.clone(),
            devices,
            policy: Box::new(move |d: &dyn Device| policy.policy(d.info().capacity)),
            pool: config.pool.clone(),
            reclaim_timeout: config.reclaim_timeout(),
            probe: None,
            probe_period: Duration::from_secs(1),
        })?;
        server.configure_shared(&config.shared);
        server.configure_connections(config.connections);
        server.configure_admins(config.admin_uids.clone());
        let shutdown = server.shutdown_handle();
        let thread = std::thread::Builder::new()
            .name("own-vramd".into())
            .spawn(move || server.run())?;
        Ok(OwnDaemon {
            runs: Runs::Thread {
                shutdown,
                thread: Some(thread),
            },
            socket,
            dir: Some(dir),
        })
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Its directory: the socket, the log, whatever the caller put there.
    pub fn dir(&self) -> &Path {
        self.dir.as_ref().expect("kept until dropped").path()
    }

    /// The daemon's process: the child's, or this one for a daemon in process.
    pub fn pid(&self) -> u32 {
        match &self.runs {
            Runs::Child { child, .. } => child.as_ref().map_or(0, Child::id),
            Runs::Thread { .. } => std::process::id(),
        }
    }

    /// What the last start of a child wrote (empty for a daemon in process).
    pub fn log(&self) -> String {
        match &self.runs {
            Runs::Child { starts, .. } => {
                std::fs::read_to_string(self.dir().join(log_name(*starts))).unwrap_or_default()
            }
            Runs::Thread { .. } => String::new(),
        }
    }

    /// Starts a child again, in the same directory with the same arguments, after it was
    /// stopped ([`OwnDaemon::signal`]), and waits until it answers. Its log is a new file.
    pub fn start_again(&mut self) -> anyhow::Result<()> {
        let Runs::Child {
            child,
            exe,
            args,
            starts,
        } = &mut self.runs
        else {
            bail!("a daemon in process cannot be started again");
        };
        if child.is_some() {
            bail!("the daemon is running");
        }
        *starts += 1;
        let dir = self.dir.as_ref().expect("kept until dropped").path();
        let log = std::fs::File::create(dir.join(log_name(*starts)))?;
        *child = Some(
            Command::new(&*exe)
                .arg("serve")
                .arg("--socket")
                .arg(&self.socket)
                // Its standard input is a pipe whose other end only this process holds (the
                // child's `stdin`, kept open until the child is reaped): when this process
                // ends, however it ends, the daemon stops.
                .arg("--stop-on-stdin-close")
                .args(&*args)
                .stdin(Stdio::piped())
                .stdout(log.try_clone()?)
                .stderr(log)
                .spawn()
                .with_context(|| format!("cannot start {}", exe.display()))?,
        );
        let deadline = Instant::now() + PATIENCE;
        loop {
            // Up once it answers, even if only to refuse us.
            if matches!(
                Observer::connect(Some(&self.socket)).and_then(|o| o.status()),
                Ok(_) | Err(ClientError::Daemon(_))
            ) {
                return Ok(());
            }
            let c = child.as_mut().expect("just started");
            if let Some(status) = c.try_wait()? {
                *child = None;
                bail!("the daemon exited at start ({status}):\n{}", self.log());
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                let _ = c.wait();
                *child = None;
                bail!("the daemon did not come up within 10 s:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Sends a child `signal` and waits up to 10 s for it to exit (then kills it): its exit
    /// code, `None` if a signal ended it or it had to be killed.
    pub fn signal(&mut self, signal: rustix::process::Signal) -> anyhow::Result<Option<i32>> {
        let Runs::Child { child, .. } = &mut self.runs else {
            bail!("a daemon in process takes no signal");
        };
        let Some(mut c) = child.take() else {
            bail!("the daemon is not running");
        };
        let _ = rustix::process::kill_process(rustix::process::Pid::from_child(&c), signal);
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(s) = c.try_wait()? {
                return Ok(s.code());
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                let _ = c.wait();
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Stops it as an operator would (SIGTERM; a shutdown in process) and checks that it
    /// stopped cleanly: exit status 0 within 10 s, its socket removed. Otherwise an error with
    /// its log.
    pub fn stop(mut self) -> anyhow::Result<()> {
        match &mut self.runs {
            Runs::Child { .. } => {
                let code = self.signal(rustix::process::Signal::TERM)?;
                if code != Some(0) {
                    bail!(
                        "the daemon did not stop cleanly on SIGTERM ({code:?}); its log:\n{}",
                        self.log()
                    );
                }
            }
            Runs::Thread { shutdown, thread } => {
                shutdown.trigger();
                let ended = thread.take().expect("joined only here").join();
                match ended {
                    Ok(r) => r.context("the daemon in process failed")?,
                    Err(_) => bail!("the daemon in process panicked"),
                }
            }
        }
        if self.socket.exists() {
            bail!("the socket {} outlived the daemon", self.socket.display());
        }
        Ok(())
    }

    /// Its directory, kept after the daemon is gone (stopped first if it still runs).
    pub fn keep(mut self) -> PathBuf {
        self.end();
        self.dir.take().expect("kept until dropped").keep()
    }

    fn end(&mut self) {
        match &mut self.runs {
            Runs::Child { child, .. } => {
                if let Some(mut c) = child.take() {
                    let _ = c.kill();
                    let _ = c.wait();
                }
            }
            Runs::Thread { shutdown, thread } => {
                shutdown.trigger();
                if let Some(t) = thread.take() {
                    let _ = t.join();
                }
            }
        }
    }
}

fn log_name(start: u32) -> String {
    match start {
        0 | 1 => "vramd.log".into(),
        n => format!("vramd.{n}.log"),
    }
}

impl Drop for OwnDaemon {
    /// A program that failed part-way leaves no daemon behind.
    fn drop(&mut self) {
        self.end();
    }
}
