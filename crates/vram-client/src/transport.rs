//! One connection to the daemon, shared by every thread of the process.
//!
//! A thread waiting for its reply reads the socket itself and delivers whatever else it reads on
//! the way (other threads' replies, the daemon's reclaim requests): a call costs one wake-up in
//! this process, where handing each reply over from a reader thread would cost two, and a
//! wake-up is a large part of a round trip. Only one thread reads at a time; the others wait for
//! their mail or their turn. An idle reader thread steps in once no call has been in flight for a
//! moment, so that requests the daemon sends unasked, and its closing the connection, are heard.

use std::collections::HashMap;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use rustix::net::RecvFlags;
use vram_core::Bytes;
use vram_proto::{Conn, ErrorReply, ProtoError, Received, Reply, Request};

use crate::ClientError;

/// How long calls must have been quiet before the idle reader reads.
const QUIET: Duration = Duration::from_millis(1);

/// How long a caller polls for its reply before it sleeps in `recv`. A thread that sleeps must be
/// woken, and on a VM whose CPU went idle that costs tens of microseconds (a grant's round trip
/// with pauses between grants is several times one back to back: docs/benchmarks.md, "Grant
/// latency"). Replies come within this in the common case; a slow one (a handle the daemon must
/// create) costs at most this much CPU before the caller sleeps. The poll yields the CPU between
/// looks, so that on a crowded machine (many tenants on few cores) it gives way to the daemon,
/// which a pure spin would starve.
const SPIN: Duration = Duration::from_micros(200);

/// How long a request the daemon answers at once (a registration, a status report) may go
/// unanswered before the call gives up: far beyond any answer of a running daemon, even a busy
/// one adopting its tenants after a restart.
pub(crate) const ANSWER_WITHIN: Duration = Duration::from_secs(30);

/// A reply, or why the connection is gone.
type Mail = Result<Received<Reply>, String>;

struct Mailroom {
    /// One box per call in flight, filled by whichever thread reads its reply.
    boxes: HashMap<u64, Option<Mail>>,
    /// A thread is reading the socket.
    reading: bool,
    /// Threads waiting on `Transport::mail_cv` for their mail or their turn to read.
    waiting: usize,
}

pub(crate) struct Transport {
    conn: Conn,
    next_id: AtomicU64,
    mail: Mutex<Mailroom>,
    mail_cv: Condvar,
    /// Calls between send and reply, and calls ever started: the idle reader waits for both to
    /// stand still.
    in_flight: AtomicUsize,
    calls: AtomicU64,
    /// Where the daemon's reclaim requests go; dropped when the connection is lost, which ends the
    /// worker that answers them.
    reclaims: Mutex<Option<SyncSender<(u64, Bytes)>>>,
    dead: AtomicBool,
    dead_reason: Mutex<String>,
    /// The error the daemon sent unasked (id 0) before it closed the connection: a refused uid, a
    /// frame it could not trust. Calls that fail on the lost connection report it.
    last_word: Mutex<Option<ErrorReply>>,
    /// Shared-buffer versions the daemon said it found corrupted, oldest first (at most
    /// [`MAX_CORRUPTIONS`] kept).
    corruptions: Mutex<Vec<vram_proto::Corruption>>,
    /// Run once, on the thread that finds the connection lost.
    on_lost: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

/// Corruption reports a connection keeps; older ones are in the tenant's log.
const MAX_CORRUPTIONS: usize = 64;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Transport {
    pub(crate) fn new(
        stream: UnixStream,
        reclaims: Option<SyncSender<(u64, Bytes)>>,
    ) -> Arc<Transport> {
        Arc::new(Transport {
            conn: Conn::new(stream),
            next_id: AtomicU64::new(1),
            mail: Mutex::new(Mailroom {
                boxes: HashMap::new(),
                reading: false,
                waiting: 0,
            }),
            mail_cv: Condvar::new(),
            in_flight: AtomicUsize::new(0),
            calls: AtomicU64::new(0),
            reclaims: Mutex::new(reclaims),
            dead: AtomicBool::new(false),
            dead_reason: Mutex::new(String::new()),
            last_word: Mutex::new(None),
            corruptions: Mutex::new(Vec::new()),
            on_lost: Mutex::new(None),
        })
    }

    /// Whether the connection is gone (every later call fails at once).
    pub(crate) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// Closes the connection; the idle reader and every waiting call end.
    pub(crate) fn close(&self) {
        let _ = self.conn.stream().shutdown(std::net::Shutdown::Both);
    }

    /// Ends the connection in order: this side stops sending, then waits, at most `limit`, for
    /// the daemon to close its side, which it does once it has released everything the
    /// connection held; so when this returns in time, a status report from anywhere no longer
    /// lists what the connection held. Closed for good either way.
    pub(crate) fn close_in_order(&self, limit: Duration) {
        // A box no request uses: only the connection's end (`fail`) fills it.
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        lock(&self.mail).boxes.insert(id, None);
        if !self.is_dead()
            && self
                .conn
                .stream()
                .shutdown(std::net::Shutdown::Write)
                .is_ok()
        {
            self.in_flight.fetch_add(1, Ordering::AcqRel);
            let _ = self.wait_reply(id, Some(Instant::now() + limit));
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
        lock(&self.mail).boxes.remove(&id);
        self.close();
    }

    /// Installs what runs when the connection is found lost (once; at once if it already is).
    pub(crate) fn on_lost(&self, f: Box<dyn FnOnce() + Send>) {
        *lock(&self.on_lost) = Some(f);
        if self.is_dead() {
            if let Some(f) = lock(&self.on_lost).take() {
                f();
            }
        }
    }

    pub(crate) fn conn(&self) -> &Conn {
        &self.conn
    }

    /// Starts the thread that reads while no call does (a tenant's connection needs one to hear
    /// reclaim requests; a tool's does not).
    pub(crate) fn start_idle_reader(self: &Arc<Self>) {
        let t = self.clone();
        thread::Builder::new()
            .name("vram-client-reader".into())
            .spawn(move || t.idle_loop())
            .expect("spawn reader thread");
    }

    /// Sends `request` and waits for its reply; an error reply is [`ClientError::Daemon`].
    pub(crate) fn call(&self, request: &Request) -> Result<Received<Reply>, ClientError> {
        self.call_within(request, None)
    }

    /// [`Transport::call`], giving up after `within` ([`ClientError::NoAnswer`]); a reply that
    /// comes later is dropped. For requests the daemon answers at once (a registration, a
    /// status), so that a daemon that is stopped or wedged is reported rather than waited for
    /// forever. A grant may wait on other tenants' returns and is not bounded.
    pub(crate) fn call_within(
        &self,
        request: &Request,
        within: Option<Duration>,
    ) -> Result<Received<Reply>, ClientError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.calls.fetch_add(1, Ordering::AcqRel);
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        lock(&self.mail).boxes.insert(id, None);
        let deadline = within.map(|w| (Instant::now() + w, w));
        let result = self.exchange(id, request, deadline);
        lock(&self.mail).boxes.remove(&id);
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
        result
    }

    /// Sends `request` without waiting for its reply: the daemon answers the requests of a
    /// connection one after another, so every request sent later is answered after this one was
    /// handled. The reply is dropped when it is read; an error reply is logged.
    pub(crate) fn send_only(&self, request: &Request) -> Result<(), ClientError> {
        if self.dead.load(Ordering::Acquire) {
            return Err(self.lost(lock(&self.dead_reason).clone()));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.calls.fetch_add(1, Ordering::AcqRel);
        self.conn.send(id, request, &[])?;
        Ok(())
    }

    /// `deadline`: when to give up waiting for the reply, and the bound it came from.
    fn exchange(
        &self,
        id: u64,
        request: &Request,
        deadline: Option<(Instant, Duration)>,
    ) -> Result<Received<Reply>, ClientError> {
        if self.dead.load(Ordering::Acquire) {
            return Err(self.lost(lock(&self.dead_reason).clone()));
        }
        if let Err(e) = self.conn.send(id, request, &[]) {
            let peer_gone = matches!(&e, ProtoError::Io(io) if matches!(
                io.kind(),
                std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
            ));
            if !peer_gone {
                return Err(e.into());
            }
            // The daemon closed the connection, perhaps after a last word still unread: read on
            // to the close.
            let _ = self.wait_reply(id, deadline.map(|d| d.0));
            return Err(match lock(&self.last_word).clone() {
                Some(last) => ClientError::Daemon(last),
                None => e.into(),
            });
        }
        match self.wait_reply(id, deadline.map(|d| d.0)) {
            Some(Ok(r)) => match r.msg {
                Reply::Error(e) => Err(ClientError::Daemon(e)),
                _ => Ok(r),
            },
            Some(Err(reason)) => Err(self.lost(reason)),
            None => Err(ClientError::NoAnswer {
                waited: deadline.map(|d| d.1).unwrap_or_default(),
            }),
        }
    }

    /// Waits for the reply to `id`, reading the socket whenever no other thread does; `None`
    /// once `deadline` passed without it. A reader whose reply has come reads on while whole
    /// frames are buffered, so none is left unheard.
    fn wait_reply(&self, id: u64, deadline: Option<Instant>) -> Option<Mail> {
        let mut mail = lock(&self.mail);
        loop {
            let mine = matches!(mail.boxes.get(&id), Some(Some(_)));
            if mine && (mail.reading || !self.conn.has_frame()) {
                return mail.boxes.get_mut(&id).and_then(Option::take);
            }
            let left = match deadline {
                Some(d) if !mine => match d.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => Some(left),
                    _ => return None,
                },
                _ => None,
            };
            if mail.reading {
                mail.waiting += 1;
                mail = match left {
                    Some(left) => {
                        let waited = self.mail_cv.wait_timeout(mail, left);
                        waited.unwrap_or_else(PoisonError::into_inner).0
                    }
                    None => self
                        .mail_cv
                        .wait(mail)
                        .unwrap_or_else(PoisonError::into_inner),
                };
                mail.waiting -= 1;
                continue;
            }
            mail = self.read_one(mail, left);
        }
    }

    /// Reads one frame with the mailroom unlocked, then delivers it and wakes whoever waits.
    /// With `within`, waits at most that long for a frame to start, and reads nothing if none
    /// did.
    fn read_one<'a>(
        &'a self,
        mut mail: MutexGuard<'a, Mailroom>,
        within: Option<Duration>,
    ) -> MutexGuard<'a, Mailroom> {
        mail.reading = true;
        drop(mail);
        if !self.conn.has_frame() {
            let started = Instant::now();
            while !readable_now(self.conn.stream()) && started.elapsed() < SPIN {
                std::thread::yield_now();
            }
        }
        let frame = self.conn.recv_within::<Reply>(within);
        let mut mail = lock(&self.mail);
        mail.reading = false;
        match frame {
            // Nothing began within the bound: nothing was read, the stream is as it was.
            Err(ProtoError::Idle(_)) if within.is_some() => {}
            Ok(r) if r.id == 0 => self.unasked(r.msg),
            Ok(r) => match mail.boxes.get_mut(&r.id) {
                Some(b) => *b = Some(Ok(r)),
                // A reply nobody waits for (a request sent with `send_only`, or a call that
                // gave up) is dropped, with its fds; a refusal is worth a line in the log.
                None => {
                    if let Reply::Error(e) = r.msg {
                        tracing::warn!("vramd refused a request sent without waiting: {e}");
                    }
                }
            },
            // A frame this side cannot read leaves every caller waiting forever: give up on all.
            Err(e) => {
                let reason = match e {
                    ProtoError::Closed => "vramd closed the connection".to_string(),
                    e => e.to_string(),
                };
                self.fail(&mut mail, reason);
            }
        }
        if mail.waiting > 0 {
            self.mail_cv.notify_all();
        }
        mail
    }

    /// A message the daemon sent without being asked (envelope id 0).
    fn unasked(&self, msg: Reply) {
        match msg {
            Reply::Reclaim { ask, bytes, .. } => {
                if let Some(tx) = lock(&self.reclaims).as_ref() {
                    // A full queue means a reclaim is already pending; this one can wait for it.
                    let _ = tx.try_send((ask, bytes));
                }
            }
            Reply::Error(e) => *lock(&self.last_word) = Some(e),
            Reply::Shared(vram_proto::SharedReply::Corrupted(c)) => {
                tracing::error!(
                    buffer = c.name,
                    version = c.version.0,
                    expected = format!("{:016x}", c.expected),
                    actual = format!("{:016x}", c.actual),
                    found_by = c.found_by,
                    "vramd: a shared buffer this tenant owns or reads was changed after publish"
                );
                let mut all = lock(&self.corruptions);
                if all.len() == MAX_CORRUPTIONS {
                    all.remove(0);
                }
                all.push(c);
            }
            _ => {}
        }
    }

    /// What the daemon reported of corrupted shared-buffer versions on this connection.
    pub(crate) fn corruptions(&self) -> Vec<vram_proto::Corruption> {
        lock(&self.corruptions).clone()
    }

    fn fail(&self, mail: &mut Mailroom, reason: String) {
        *lock(&self.dead_reason) = reason.clone();
        self.dead.store(true, Ordering::Release);
        // Closed for the daemon too (a reply this side could not read leaves the connection
        // open there): until it is, the daemon keeps the tenant's name, and the reconnect that
        // follows would be refused with it.
        self.close();
        for b in mail.boxes.values_mut().filter(|b| b.is_none()) {
            *b = Some(Err(reason.clone()));
        }
        lock(&self.reclaims).take();
        if let Some(f) = lock(&self.on_lost).take() {
            f();
        }
    }

    /// The connection is gone: the daemon's last word if it sent one, else `reason`.
    fn lost(&self, reason: String) -> ClientError {
        match lock(&self.last_word).clone() {
            Some(e) => ClientError::Daemon(e),
            None => ClientError::Lost(reason),
        }
    }

    fn idle_loop(&self) {
        let mut byte = [0u8; 1];
        while !self.dead.load(Ordering::Acquire) {
            // Wait, without taking anything, until the daemon sends something or closes.
            if let Err(rustix::io::Errno::INTR) =
                rustix::net::recv(self.conn.stream(), &mut byte, RecvFlags::PEEK)
            {
                continue;
            }
            self.wait_until_quiet();
            let mut mail = lock(&self.mail);
            while !mail.reading
                && !self.dead.load(Ordering::Acquire)
                && (self.conn.has_frame() || readable_now(self.conn.stream()))
            {
                mail = self.read_one(mail, None);
            }
        }
    }

    /// Returns once no call has been in flight, or started, for [`QUIET`]: until then callers
    /// read, and the idle reader waking for each of their replies would only cost them time.
    fn wait_until_quiet(&self) {
        loop {
            let seen = self.calls.load(Ordering::Acquire);
            thread::sleep(QUIET);
            if self.in_flight.load(Ordering::Acquire) == 0
                && self.calls.load(Ordering::Acquire) == seen
            {
                return;
            }
        }
    }
}

/// Whether reading `stream` now would return at once (data, end of stream, or an error).
fn readable_now(stream: &UnixStream) -> bool {
    let mut byte = [0u8; 1];
    !matches!(
        rustix::net::recv(stream, &mut byte, RecvFlags::PEEK | RecvFlags::DONTWAIT),
        Err(rustix::io::Errno::AGAIN)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A daemon that takes a request and does not answer it (stopped, wedged): the bounded call
    /// gives up with the reason, the connection stays usable, and the late reply is dropped
    /// rather than taken for the next call's.
    #[test]
    fn an_unanswered_call_gives_up_and_its_late_reply_is_not_taken_for_the_next() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let t = Transport::new(ours, None);
        t.start_idle_reader();
        let daemon = Conn::new(theirs);
        let started = Instant::now();
        let err = t
            .call_within(&Request::Ping, Some(Duration::from_millis(200)))
            .unwrap_err();
        let waited = started.elapsed();
        assert!(matches!(err, ClientError::NoAnswer { .. }), "{err}");
        assert!(err.to_string().contains("did not answer"), "{err}");
        assert!(waited >= Duration::from_millis(200), "{waited:?}");
        assert!(waited < Duration::from_secs(5), "{waited:?}");
        assert!(!t.is_dead());

        let first: Received<Request> = daemon.recv().unwrap();
        daemon.send(first.id, &Reply::Pong, &[]).unwrap();
        let second = std::thread::spawn({
            let t = t.clone();
            move || t.call_within(&Request::Budget, Some(Duration::from_secs(10)))
        });
        let asked: Received<Request> = daemon.recv().unwrap();
        assert!(matches!(asked.msg, Request::Budget), "{:?}", asked.msg);
        daemon.send(asked.id, &Reply::Ack, &[]).unwrap();
        let got = second.join().unwrap().unwrap();
        assert!(matches!(got.msg, Reply::Ack), "{:?}", got.msg);
    }
}
