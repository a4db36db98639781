//! The accept loop: who may connect and how many, each refusal an error reply the peer can read
//! (then the close), and no spinning when the daemon runs out of file descriptors.
//!
//! Out of descriptors, `accept` fails while the peer waits in the backlog. The loop keeps one
//! descriptor in reserve (`/dev/null` opened): it lets it go, accepts the waiting peer, tells it
//! the daemon is out of descriptors, closes it and takes the reserve back. So every peer gets an
//! answer, and the loop waits in `accept` as usual instead of failing at once again and again.
//! Failures and refusals are logged once per [`crate::logging::LOG_EVERY`], with how many there
//! were since.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use vram_proto::{Conn, ErrorCode, ErrorReply, Reply};

use super::peer::Peer;
use super::{session, Daemon};
use crate::logging::Every;

/// How long the loop sleeps after a failed accept it could not answer.
const BACKOFF: Duration = Duration::from_millis(100);

/// Why a connection is refused at accept.
enum Refusal {
    Uid,
    /// The kernel gave the peer's pid as 0: it has none in the daemon's pid namespace.
    PidNotVisible,
    Total {
        open: usize,
        max: usize,
    },
    PerUid {
        open: usize,
        max: usize,
    },
}

struct Acceptor<'a> {
    daemon: &'a Arc<Daemon>,
    listener: &'a UnixListener,
    reserve: Option<File>,
    sessions: Vec<JoinHandle<()>>,
    failures: Every,
    refusals: HashMap<&'static str, Every>,
}

/// Accepts until the daemon shuts down; the session threads still running then.
pub fn run(daemon: &Arc<Daemon>, listener: &UnixListener) -> Vec<JoinHandle<()>> {
    let mut a = Acceptor {
        daemon,
        listener,
        reserve: File::open("/dev/null").ok(),
        sessions: Vec::new(),
        failures: Every::default(),
        refusals: HashMap::new(),
    };
    while !daemon.is_shutting_down() {
        match listener.accept() {
            Ok((stream, _)) if !daemon.is_shutting_down() => a.admit(stream),
            Ok(_) => break,
            Err(_) if daemon.is_shutting_down() => break,
            Err(e) if e.raw_os_error().is_some_and(is_out_of_fds) => a.out_of_fds(&e),
            Err(e) => {
                if let Some(more) = a.failures.due() {
                    tracing::warn!(more, "accept failed: {e}");
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
    a.sessions
}

/// EMFILE (the process's limit) or ENFILE (the system's).
fn is_out_of_fds(errno: i32) -> bool {
    errno == rustix::io::Errno::MFILE.raw_os_error()
        || errno == rustix::io::Errno::NFILE.raw_os_error()
}

impl Acceptor<'_> {
    fn out_of_fds(&mut self, e: &std::io::Error) {
        let open = self.daemon.conns.lock().map(|c| c.len()).unwrap_or(0);
        if let Some(more) = self.failures.due() {
            tracing::warn!(
                more,
                connections = open,
                "accept failed: {e}; new peers are told the daemon is out of file descriptors \
                 until some close (raise LimitNOFILE / ulimit -n)"
            );
        }
        // Let the reserve go, answer the waiting peer, take the reserve back.
        let Some(reserve) = self.reserve.take() else {
            std::thread::sleep(BACKOFF);
            self.reserve = File::open("/dev/null").ok();
            return;
        };
        drop(reserve);
        if let Ok((stream, _)) = self.listener.accept() {
            self.daemon
                .connections_refused
                .fetch_add(1, Ordering::Relaxed);
            refuse(
                &Conn::new(stream),
                ErrorCode::Refused,
                "out_of_fds",
                format!(
                    "the daemon is out of file descriptors ({open} connections open); try again \
                     later"
                ),
            );
        }
        self.reserve = File::open("/dev/null").ok();
        if self.reserve.is_none() {
            std::thread::sleep(BACKOFF);
        }
    }

    fn admit(&mut self, stream: UnixStream) {
        self.sessions.retain(|h| !h.is_finished());
        use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
        let creds = match getsockopt(&stream, PeerCredentials) {
            Ok(c) => c,
            Err(e) => {
                if let Some(more) = self.failures.due() {
                    tracing::warn!(more, "cannot read a peer's credentials: {e}; closed");
                }
                return;
            }
        };
        let (uid, gid) = (creds.uid(), creds.gid());
        // The kernel says 0 for a peer whose pid has no number in the daemon's pid namespace:
        // such a peer cannot be told from another, nor its memory found in the driver's list.
        let Some(pid) = u32::try_from(creds.pid()).ok().filter(|&p| p > 0) else {
            self.refuse(&Conn::new(stream), uid, 0, Refusal::PidNotVisible);
            return;
        };
        let settings = self.daemon.settings();
        let limits = settings.connections;
        let conn = Conn::new(stream).with_frame_timeout(limits.frame_timeout());
        let conn = match conn.with_send_timeout(limits.send_timeout()) {
            Ok(c) => Arc::new(c),
            Err(e) => {
                tracing::warn!(uid, pid, "cannot set a send timeout: {e}; closed");
                return;
            }
        };
        let id = self.daemon.next_conn.fetch_add(1, Ordering::Relaxed);
        let refusal = {
            let mut conns = self.daemon.conns.lock().expect("conns");
            let of_uid = conns.values().filter(|p| p.uid == uid).count();
            let refusal = if !settings.allowed_uids.contains(&uid) {
                Some(Refusal::Uid)
            } else if conns.len() >= limits.max_total {
                Some(Refusal::Total {
                    open: conns.len(),
                    max: limits.max_total,
                })
            } else if of_uid >= limits.max_per_uid {
                Some(Refusal::PerUid {
                    open: of_uid,
                    max: limits.max_per_uid,
                })
            } else {
                None
            };
            if refusal.is_none() {
                let gids = super::peer::groups_of(pid, Some(gid));
                conns.insert(id, Arc::new(Peer::new(conn.clone(), uid, pid, gids)));
            }
            refusal
        };
        match refusal {
            None => self.start_session(id),
            Some(r) => self.refuse(&conn, uid, pid, r),
        }
    }

    fn start_session(&mut self, id: u64) {
        let Some(peer) = self.daemon.conns.lock().expect("conns").get(&id).cloned() else {
            return;
        };
        let daemon = self.daemon.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("vramd-conn-{id}"))
            .spawn(move || session::run(daemon, id, peer));
        match spawned {
            Ok(h) => self.sessions.push(h),
            Err(e) => {
                tracing::error!("cannot start a connection thread: {e}");
                self.daemon.conns.lock().expect("conns").remove(&id);
            }
        }
    }

    fn refuse(&mut self, conn: &Conn, uid: u32, pid: u32, why: Refusal) {
        self.daemon
            .connections_refused
            .fetch_add(1, Ordering::Relaxed);
        let (key, code, reason, message) = match why {
            Refusal::Uid => (
                "uid",
                ErrorCode::PermissionDenied,
                None,
                format!(
                    "uid {uid} is not allowed to use this vramd (add it to allowed_uids in the \
                     daemon's config)"
                ),
            ),
            Refusal::PidNotVisible => (
                "pid",
                ErrorCode::Refused,
                Some("pid_not_visible"),
                "your process has no pid in the daemon's pid namespace, so the daemon cannot tell \
                 it from another (run the daemon in the host's pid namespace: hostPID in \
                 Kubernetes)"
                    .to_string(),
            ),
            Refusal::Total { open, max } => (
                "total",
                ErrorCode::Refused,
                Some("too_many_connections"),
                format!(
                    "the daemon has {open} connections open, the most it takes ([connections] \
                     max_total = {max}); try again later"
                ),
            ),
            Refusal::PerUid { open, max } => (
                "per_uid",
                ErrorCode::Refused,
                Some("too_many_connections"),
                format!(
                    "uid {uid} has {open} connections open, the most one uid may have \
                     ([connections] max_per_uid = {max}); close some or raise it"
                ),
            ),
        };
        if let Some(more) = self.refusals.entry(key).or_default().due() {
            tracing::warn!(uid, pid, more, "connection refused: {message}");
        }
        refuse(conn, code, reason.unwrap_or_default(), message);
    }
}

/// Tells a peer why it is refused and closes the connection, without waiting for it: a fresh
/// socket has room for one small frame.
fn refuse(conn: &Conn, code: ErrorCode, reason: &str, message: String) {
    let reply = Reply::Error(ErrorReply {
        code,
        reason: (!reason.is_empty()).then(|| reason.to_string()),
        message,
    });
    let _ = conn.try_send(0, &reply, &[]);
    let _ = conn.stream().shutdown(std::net::Shutdown::Both);
}
