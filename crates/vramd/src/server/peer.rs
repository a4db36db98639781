//! One connected peer as the rest of the daemon sees it: its connection, who it is, and what
//! bounds it. Other threads reach a tenant only through here (reclaim requests), and never wait
//! on it: a request to a peer whose socket is full is skipped, and a peer whose socket has stayed
//! full too long is disconnected.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vram_proto::{Conn, ProtoError};

pub struct Peer {
    pub conn: Arc<Conn>,
    pub uid: u32,
    pub pid: u32,
    /// Its groups, primary first (see [`groups_of`]).
    pub gids: Vec<u32>,
    /// While frames offered to this peer could not be written without waiting (its socket full,
    /// or its connection busy sending): since when, and the latest such offer. `None` once one
    /// went through.
    unwritable: Mutex<Option<Unwritable>>,
    /// Set when the connection ends; waits on its behalf stop.
    closed: AtomicBool,
    /// Requests of this peer served on threads of their own, in progress.
    slow: AtomicUsize,
    /// The reclaim asks sent to it and not answered yet, oldest first (at most [`MAX_ASKS`]):
    /// an answer counts only for one of these, once.
    asks: Mutex<std::collections::VecDeque<u64>>,
}

/// The most unanswered reclaim asks a peer's record keeps (the oldest forgotten first).
const MAX_ASKS: usize = 64;

#[derive(Debug, Clone, Copy)]
struct Unwritable {
    since: Instant,
    last: Instant,
}

/// What became of a frame offered to a peer without waiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Offer {
    Sent,
    /// Not sent: the peer's socket had no room (or its connection was busy) for `for_`.
    Skipped {
        for_: Duration,
        first: bool,
    },
    /// Not sent: the connection is gone.
    Gone,
}

impl Peer {
    /// Sends `reply` to request `id`. A reply that cannot be sent as one message (larger than a
    /// frame, or not encodable) is answered with an error that says so, and the connection
    /// stays: the request was fine, the answer too large. An error means the connection is done
    /// (closed, or its peer did not read in time).
    pub fn reply(
        &self,
        id: u64,
        reply: &vram_proto::Reply,
        fds: &[std::os::fd::BorrowedFd<'_>],
    ) -> Result<(), ProtoError> {
        match self.conn.send(id, reply, fds) {
            Err(e @ (ProtoError::Oversized { .. } | ProtoError::Decode(_))) => {
                tracing::warn!(pid = self.pid, "cannot send a reply: {e}");
                let (code, reason) = match e {
                    ProtoError::Oversized { .. } => (
                        vram_proto::ErrorCode::Refused,
                        Some("reply_too_large".into()),
                    ),
                    // Not encodable: the daemon's own fault.
                    _ => (vram_proto::ErrorCode::Device, None),
                };
                let e = vram_proto::Reply::Error(vram_proto::ErrorReply {
                    code,
                    reason,
                    message: format!("the daemon could not send its reply: {e}"),
                });
                self.conn.send(id, &e, &[])
            }
            sent => sent,
        }
    }

    pub fn new(conn: Arc<Conn>, uid: u32, pid: u32, gids: Vec<u32>) -> Peer {
        Peer {
            conn,
            uid,
            pid,
            gids,
            unwritable: Mutex::new(None),
            closed: AtomicBool::new(false),
            slow: AtomicUsize::new(0),
            asks: Mutex::new(std::collections::VecDeque::new()),
        }
    }

    /// Reclaim ask `ask` was sent to this peer.
    pub fn asked(&self, ask: u64) {
        let mut asks = self.asks.lock().unwrap_or_else(|p| p.into_inner());
        if asks.len() == MAX_ASKS {
            asks.pop_front();
        }
        asks.push_back(ask);
    }

    /// Whether `ask` was sent to this peer and not answered before (it is answered now).
    pub fn answers(&self, ask: u64) -> bool {
        let mut asks = self.asks.lock().unwrap_or_else(|p| p.into_inner());
        match asks.iter().position(|&a| a == ask) {
            Some(i) => {
                asks.remove(i);
                true
            }
            None => false,
        }
    }

    /// Sends without waiting for the peer ([`Conn::try_send`]), and keeps track of how long it
    /// has not been possible. Offers that failed more than `stale` apart are not taken for one
    /// stretch of not reading: the peer may have read in between, unseen.
    pub fn offer<T: serde::Serialize>(&self, msg: &T, stale: Duration) -> Offer {
        match self.conn.try_send(0, msg, &[]) {
            Ok(()) => {
                self.written();
                Offer::Sent
            }
            Err(ProtoError::WouldBlock) => {
                let now = Instant::now();
                let mut u = self.unwritable.lock().unwrap_or_else(|p| p.into_inner());
                let fresh = u.is_none_or(|u| now.duration_since(u.last) > stale);
                if fresh {
                    *u = Some(Unwritable {
                        since: now,
                        last: now,
                    });
                }
                let u = u.as_mut().expect("set above");
                u.last = now;
                Offer::Skipped {
                    for_: now.duration_since(u.since),
                    first: fresh,
                }
            }
            Err(_) => Offer::Gone,
        }
    }

    /// A frame reached the peer: it reads.
    pub fn written(&self) {
        *self.unwritable.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// Ends the connection from this side: the session sees it closed and cleans up.
    pub fn disconnect(&self) {
        let _ = self.conn.stream().shutdown(std::net::Shutdown::Both);
    }

    /// Marks the connection ended; waits on its behalf stop at their next look.
    pub fn mark_closed(&self) {
        self.closed.store(true, Ordering::Release);
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Whether the connection has ended, seen without reading from it: the peer closed its end
    /// (or died), or this side shut it. For a wait on the peer's behalf on the thread that would
    /// otherwise read the end, so that the wait stops when there is no one left to answer.
    pub fn hung_up(&self) -> bool {
        use rustix::event::{poll, PollFd, PollFlags, Timespec};
        if self.is_closed() {
            return true;
        }
        let ended = PollFlags::HUP | PollFlags::RDHUP | PollFlags::ERR;
        let mut fds = [PollFd::new(self.conn.stream(), PollFlags::RDHUP)];
        let now = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        matches!(poll(&mut fds, Some(&now)), Ok(n) if n > 0 && fds[0].revents().intersects(ended))
    }

    /// A place for one more request on a thread of its own, if fewer than `max` are in progress.
    pub fn slow_slot(self: &Arc<Self>, max: usize) -> Option<SlowSlot> {
        self.slow
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| SlowSlot(self.clone()))
    }
}

/// One request in progress on a thread of its own; gives its place back when dropped.
pub struct SlowSlot(Arc<Peer>);

impl Drop for SlowSlot {
    fn drop(&mut self) {
        self.0.slow.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A process's groups: `primary` (the kernel's word on the socket, `SO_PEERCRED`; `None`: the
/// real gid `/proc/PID/status` gives) first, then its supplementary groups as `/proc/PID/status`
/// lists them (none if it cannot be read; a connected process's pid is its own while this is
/// read).
pub fn groups_of(pid: u32, primary: Option<u32>) -> Vec<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| {
                v.split_whitespace()
                    .filter_map(|g| g.parse::<u32>().ok())
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default()
    };
    let mut gids: Vec<u32> = primary
        .or_else(|| field("Gid:").first().copied())
        .into_iter()
        .collect();
    for g in field("Groups:") {
        if !gids.contains(&g) {
            gids.push(g);
        }
    }
    gids
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixStream;

    use super::*;

    const STALE: Duration = Duration::from_secs(60);

    #[test]
    fn a_peer_that_does_not_read_is_skipped_and_timed() {
        let (a, b) = UnixStream::pair().unwrap();
        let peer = Peer::new(Arc::new(Conn::new(a)), 0, 0, vec![0]);
        let msg = vram_proto::Reply::Pong;
        let mut first_skip = None;
        for i in 0..100_000 {
            match peer.offer(&msg, STALE) {
                Offer::Sent => {}
                Offer::Skipped { first, .. } => {
                    assert!(first, "the first skip says so");
                    first_skip = Some(i);
                    break;
                }
                Offer::Gone => panic!("gone"),
            }
        }
        let sent = first_skip.expect("the socket filled");
        assert!(sent > 0);
        std::thread::sleep(Duration::from_millis(20));
        let Offer::Skipped { for_, first } = peer.offer(&msg, STALE) else {
            panic!("still full")
        };
        assert!(!first && for_ >= Duration::from_millis(20), "{for_:?}");
        // Offers too far apart start a new stretch: the peer may have read in between.
        std::thread::sleep(Duration::from_millis(20));
        let Offer::Skipped { for_, first } = peer.offer(&msg, Duration::from_millis(10)) else {
            panic!("still full")
        };
        assert!(first && for_ < Duration::from_millis(10), "{for_:?}");
        // The peer reads everything: frames go through again, and the clock stops.
        b.set_nonblocking(true).unwrap();
        let mut buf = vec![0u8; 1 << 20];
        while rustix::io::read(&b, &mut buf).is_ok() {}
        assert_eq!(peer.offer(&msg, STALE), Offer::Sent);
        drop(b);
        assert_eq!(peer.offer(&msg, STALE), Offer::Gone);
    }

    #[test]
    fn a_reply_too_large_for_a_frame_is_answered_with_an_error_and_the_connection_stays() {
        let (a, b) = UnixStream::pair().unwrap();
        let peer = Peer::new(Arc::new(Conn::new(a)), 0, 0, vec![0]);
        let client = Conn::new(b);
        let huge = vram_proto::Reply::Error(vram_proto::ErrorReply {
            code: vram_proto::ErrorCode::Device,
            reason: None,
            message: "x".repeat(vram_proto::MAX_PAYLOAD + 1),
        });
        peer.reply(7, &huge, &[]).unwrap();
        let got = client.recv::<vram_proto::Reply>().unwrap();
        let vram_proto::Reply::Error(e) = got.msg else {
            panic!("{:?}", got.msg)
        };
        assert_eq!(got.id, 7);
        assert_eq!(e.code, vram_proto::ErrorCode::Refused);
        assert_eq!(e.reason.as_deref(), Some("reply_too_large"), "{e}");
        assert!(e.message.contains("could not send its reply"), "{e}");
        // The next reply goes through on the same connection.
        peer.reply(8, &vram_proto::Reply::Pong, &[]).unwrap();
        let got = client.recv::<vram_proto::Reply>().unwrap();
        assert!(got.id == 8 && matches!(got.msg, vram_proto::Reply::Pong));
    }

    #[test]
    fn slow_slots_are_bounded_and_given_back() {
        let (a, _b) = UnixStream::pair().unwrap();
        let peer = Arc::new(Peer::new(Arc::new(Conn::new(a)), 0, 0, vec![0]));
        let held: Vec<_> = (0..3).map(|_| peer.slow_slot(3).unwrap()).collect();
        assert!(peer.slow_slot(3).is_none());
        drop(held);
        assert!(peer.slow_slot(3).is_some());
    }
}
