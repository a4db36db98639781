//! A tenant's link to the daemon, which outlives any one connection: when the daemon restarts (a
//! crash, an upgrade), the link connects again with backoff and registers as the same tenant,
//! saying what it still holds (its grants and charges, tracked here), so that the new daemon books
//! exactly that. Calls that were under way when the connection went are answered after the
//! reconnect, or fail with the reason if the link gives up.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::{Duration, Instant};

use vram_core::Bytes;
use vram_proto::{
    ErrorCode, GrantId, Hello, Received, Reply, Request, Resume, Role, Welcome, RESUME_PART,
};

use crate::transport::{Transport, ANSWER_WITHIN};
use crate::{ClientError, TenantOptions};

/// The first pause between reconnect attempts; it doubles up to [`BACKOFF_MAX`].
const BACKOFF_START: Duration = Duration::from_millis(10);
const BACKOFF_MAX: Duration = Duration::from_secs(1);
/// How long a lost link keeps trying before calls fail, unless the owner sets another
/// ([`Link::set_reconnect_for`]): long enough for a service manager to restart the daemon and for
/// it to measure its devices.
pub(crate) const RECONNECT_FOR: Duration = Duration::from_secs(120);

/// How long closing a tenant waits for the daemon to release what it held (a daemon releases
/// thousands of handles in well under a second); a daemon that does not answer costs a closing
/// program no more than this.
const CLOSE_WAIT: Duration = Duration::from_secs(5);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What to do with a call whose connection was lost before its reply came.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lost {
    /// Send it again once reconnected (its effect did not happen, or happening twice is harmless).
    Retry,
    /// Its effect is carried by the reconnect itself (a return: the grant is no longer in what
    /// the link says it holds): answer it as done.
    Done,
    /// Fail it (shared-buffer calls: their state does not survive a daemon restart).
    Fail,
}

pub(crate) struct Link {
    socket: PathBuf,
    opts: TenantOptions,
    transport: RwLock<Arc<Transport>>,
    /// Where the daemon's reclaim requests go; each new transport gets a clone. Dropped when the
    /// owner closes, which ends the reclaim worker.
    reclaim_tx: Mutex<Option<SyncSender<(u64, Bytes)>>>,
    /// Grants held and not given back, by id (ids stay valid across daemon restarts).
    held: Mutex<BTreeMap<GrantId, Bytes>>,
    charged: AtomicU64,
    /// Held (shared) by a call from before it is sent until what it changed in `held` and
    /// `charged` is noted, and (exclusive) by a reconnect from its account of them until the new
    /// transport is in place: so the account a new daemon books is never taken between a
    /// call's effect and its note (a return noted after the account, then lost with the old
    /// connection, would leave the grant booked for good; a grant noted after it, unbooked).
    books: RwLock<()>,
    /// Serialises reconnects: one thread reconnects, the others wait for its outcome. Holds why
    /// the last reconnect gave up, while its transport is still the one in use: later calls then
    /// try once each, not for another window.
    reconnecting: Mutex<Option<String>>,
    reconnects: AtomicU64,
    /// How long a reconnect keeps trying, in milliseconds ([`RECONNECT_FOR`] unless set).
    reconnect_for_ms: AtomicU64,
    closed: AtomicBool,
}

impl Link {
    /// Connects and registers; the first connection's failure is the caller's error (no retry).
    pub(crate) fn connect(
        socket: PathBuf,
        opts: TenantOptions,
        reclaim_tx: SyncSender<(u64, Bytes)>,
    ) -> Result<(Arc<Link>, Welcome), ClientError> {
        let (transport, welcome) = register(&socket, &opts, Some(reclaim_tx.clone()), None)?;
        // A reconnect registers as the tenant it became, whether it joined or registered.
        let opts = TenantOptions {
            name: welcome.name.clone(),
            class: Some(welcome.class.clone()),
            guarantee: Some(welcome.guarantee),
            limit: Some(welcome.limit),
            gpu: Some(welcome.device.index),
            join: None,
        };
        let link = Arc::new(Link {
            socket,
            opts,
            transport: RwLock::new(transport),
            reclaim_tx: Mutex::new(Some(reclaim_tx)),
            held: Mutex::new(BTreeMap::new()),
            charged: AtomicU64::new(0),
            books: RwLock::new(()),
            reconnecting: Mutex::new(None),
            reconnects: AtomicU64::new(0),
            reconnect_for_ms: AtomicU64::new(RECONNECT_FOR.as_millis() as u64),
            closed: AtomicBool::new(false),
        });
        link.watch(&link.transport());
        Ok((link, welcome))
    }

    /// Reconnects in the background as soon as `t` is found lost, so that an idle tenant is back
    /// (and hears the new daemon's reclaim requests) without waiting for its next call.
    fn watch(self: &Arc<Self>, t: &Arc<Transport>) {
        let link = Arc::downgrade(self);
        t.on_lost(Box::new(move || {
            let spawned = std::thread::Builder::new()
                .name("vram-client-reconnect".into())
                .spawn(move || {
                    let Some(link) = link.upgrade() else { return };
                    let t = link.transport();
                    if t.is_dead() && !link.closed.load(Ordering::Acquire) {
                        let why = ClientError::Lost("the daemon closed the connection".into());
                        if let Err(e) = link.reconnect(&t, &why) {
                            tracing::warn!("vramd: could not reconnect: {e}");
                        }
                    }
                });
            if let Err(e) = spawned {
                tracing::warn!("vramd: cannot start the reconnect thread: {e}");
            }
        }));
    }

    pub(crate) fn transport(&self) -> Arc<Transport> {
        self.transport
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Sends `request` and waits for its reply; a lost connection is reconnected and the request
    /// handled as `lost` says, as many times as the daemon restarts meanwhile.
    pub(crate) fn call(
        self: &Arc<Self>,
        request: &Request,
        lost: Lost,
    ) -> Result<Received<Reply>, ClientError> {
        self.call_booked(request, lost, |_| {}).map(|(r, _)| r)
    }

    /// [`Link::call`] for a request that changes what the link says it holds: `before` notes
    /// a change made before the request is sent (a return), and the reply comes with the books
    /// still held, for the caller to note what the reply made (a grant, a charge) before a
    /// reconnect can take its account of them.
    pub(crate) fn call_booked(
        self: &Arc<Self>,
        request: &Request,
        lost: Lost,
        before: impl FnOnce(&Books<'_>),
    ) -> Result<(Received<Reply>, Books<'_>), ClientError> {
        let started = Instant::now();
        let mut before = Some(before);
        loop {
            let books = self.books();
            if let Some(f) = before.take() {
                f(&books);
            }
            let t = self.transport();
            match t.call(request) {
                Err(e)
                    if t.is_dead()
                        && lost != Lost::Fail
                        && !self.closed.load(Ordering::Acquire) =>
                {
                    // A reconnect takes the books exclusively.
                    drop(books);
                    if started.elapsed() > self.reconnect_for() {
                        return Err(e);
                    }
                    self.reconnect(&t, &e)?;
                    if lost == Lost::Done {
                        let reply = Received {
                            id: 0,
                            msg: Reply::Ack,
                            fds: Vec::new(),
                        };
                        return Ok((reply, self.books()));
                    }
                }
                r => return r.map(|r| (r, books)),
            }
        }
    }

    /// Sends `request` without waiting for its reply, after `before` notes what it changes. On
    /// a lost connection the request is dropped: what it would have told the daemon travels
    /// with the reconnect (the note is made before the reconnect's account of the books), which
    /// the watcher (or the next call that waits for an answer) makes. The sender does not wait
    /// for it: a return made under the allocator's lock must not hold every allocation back for
    /// as long as the daemon stays away.
    pub(crate) fn send_only(
        self: &Arc<Self>,
        request: &Request,
        before: impl FnOnce(&Books<'_>),
    ) -> Result<(), ClientError> {
        let books = self.books();
        before(&books);
        let t = self.transport();
        let sent = t.send_only(request);
        drop(books);
        match sent {
            Err(_) if t.is_dead() && !self.closed.load(Ordering::Acquire) => Ok(()),
            r => r,
        }
    }

    fn books(&self) -> Books<'_> {
        Books {
            link: self,
            _held: self.books.read().unwrap_or_else(PoisonError::into_inner),
        }
    }

    /// How long a lost link keeps trying to reconnect before calls fail.
    pub(crate) fn set_reconnect_for(&self, window: Duration) {
        let ms = u64::try_from(window.as_millis()).unwrap_or(u64::MAX);
        self.reconnect_for_ms.store(ms, Ordering::Relaxed);
    }

    fn reconnect_for(&self) -> Duration {
        Duration::from_millis(self.reconnect_for_ms.load(Ordering::Relaxed))
    }

    /// How many times the link has reconnected.
    pub(crate) fn reconnects(&self) -> u64 {
        self.reconnects.load(Ordering::Relaxed)
    }

    /// Tells the daemon this tenant is finishing on purpose (what it still holds is released
    /// as at any close, but the end is logged as a finish, not a crash). Sent without waiting.
    pub(crate) fn bye(&self) {
        let _ = self.transport().send_only(&Request::Bye);
    }

    /// The owner is done: no more reconnects; the reclaim worker ends with the connection.
    /// Returns once the daemon has released what the tenant held (at most [`CLOSE_WAIT`]
    /// later), so that a tenant started next (a Ray worker's next task) finds the memory back
    /// and the name free.
    pub(crate) fn close(&self) {
        self.bye();
        self.closed.store(true, Ordering::Release);
        lock(&self.reclaim_tx).take();
        self.transport().close_in_order(CLOSE_WAIT);
    }

    /// Replaces the dead transport `dead` with a new registration, retrying with backoff for
    /// [`Link::set_reconnect_for`]'s window. Another thread's reconnect, finished or under way, counts: once one has
    /// given up on `dead`, a later call tries once, so that a call fails at once while the daemon
    /// stays away and the link comes back when it returns.
    fn reconnect(
        self: &Arc<Self>,
        dead: &Arc<Transport>,
        why: &ClientError,
    ) -> Result<(), ClientError> {
        let mut gave_up = lock(&self.reconnecting);
        if !Arc::ptr_eq(&self.transport(), dead) {
            return Ok(());
        }
        let closing = || ClientError::Lost("the client is closing".into());
        if self.closed.load(Ordering::Acquire) {
            return Err(closing());
        }
        let started = Instant::now();
        if let Some(reason) = gave_up.as_ref() {
            return match self.register_again() {
                Ok(()) => {
                    *gave_up = None;
                    Ok(())
                }
                Err(e) if !worth_retrying(&e) => Err(e),
                Err(e) => Err(ClientError::Lost(format!(
                    "{reason}; still unreachable: {e}"
                ))),
            };
        }
        tracing::warn!("vramd: connection to the daemon lost ({why}); reconnecting");
        let mut pause = BACKOFF_START;
        loop {
            if self.closed.load(Ordering::Acquire) {
                return Err(closing());
            }
            match self.register_again() {
                Ok(()) => {
                    tracing::warn!(
                        "vramd: reconnected after {:.0} ms",
                        started.elapsed().as_secs_f64() * 1e3
                    );
                    return Ok(());
                }
                Err(e) if !worth_retrying(&e) => return Err(e),
                Err(e) => {
                    let window = self.reconnect_for();
                    if started.elapsed() > window {
                        let reason = format!(
                            "the daemon did not come back within {:.1} s",
                            window.as_secs_f64()
                        );
                        let err = ClientError::Lost(format!("{reason}: {e}"));
                        *gave_up = Some(reason);
                        return Err(err);
                    }
                }
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(BACKOFF_MAX);
        }
    }

    /// One attempt to register again as this tenant, saying what it holds; on success the new
    /// transport replaces the old. The books are held exclusively throughout (see `books`).
    fn register_again(self: &Arc<Self>) -> Result<(), ClientError> {
        let _books = self.books.write().unwrap_or_else(PoisonError::into_inner);
        let resume = Resume {
            grants: lock(&self.held).iter().map(|(id, b)| (*id, *b)).collect(),
            charged: Bytes(self.charged.load(Ordering::Relaxed)),
        };
        let tx = lock(&self.reclaim_tx).clone();
        let (transport, welcome) = register(&self.socket, &self.opts, tx, Some(resume))?;
        self.watch(&transport);
        *self
            .transport
            .write()
            .unwrap_or_else(PoisonError::into_inner) = transport.clone();
        // Checked after the swap: an owner that closed before it found the old transport to
        // close, so the new registration ends here, as the old one did.
        if self.closed.load(Ordering::Acquire) {
            transport.close();
            return Err(ClientError::Lost("the client is closing".into()));
        }
        self.reconnects.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(tenant = welcome.name, "vramd: registered again");
        Ok(())
    }
}

/// A refusal that another try can cure: the daemon not listening yet, or still holding the name
/// of this tenant's previous connection. A rule of the configuration that refuses the tenant
/// (its owners, its class) is final.
fn worth_retrying(e: &ClientError) -> bool {
    match e {
        ClientError::Daemon(r) if r.code == ErrorCode::Admission => {
            matches!(r.reason.as_deref(), None | Some("name_in_use"))
        }
        ClientError::Daemon(r) => r.code == ErrorCode::ShuttingDown,
        ClientError::Proto(vram_proto::ProtoError::Version { .. }) => false,
        _ => true,
    }
}

/// Opens a connection and registers on it as the tenant `opts` describes.
fn register(
    socket: &std::path::Path,
    opts: &TenantOptions,
    reclaim_tx: Option<SyncSender<(u64, Bytes)>>,
    resume: Option<Resume>,
) -> Result<(Arc<Transport>, Welcome), ClientError> {
    let stream =
        std::os::unix::net::UnixStream::connect(socket).map_err(|source| ClientError::Connect {
            path: socket.display().to_string(),
            source,
        })?;
    let transport = Transport::new(stream, reclaim_tx);
    transport.start_idle_reader();
    let role = match &opts.join {
        Some(token) => Role::Join {
            token: token.clone(),
        },
        None => Role::Tenant {
            name: opts.name.clone(),
            class: opts.class.clone(),
            guarantee: opts.guarantee,
            limit: opts.limit,
        },
    };
    let reply = send_ahead(&transport, resume).and_then(|resume| {
        let hello = Hello {
            role,
            gpu: opts.gpu,
            client: format!("vram-client {}", env!("CARGO_PKG_VERSION")),
            resume,
        };
        transport.call_within(&Request::Hello(hello), Some(ANSWER_WITHIN))
    });
    let welcome = match reply {
        Ok(Received {
            msg: Reply::Welcome(w),
            ..
        }) => w,
        Ok(other) => {
            transport.close();
            return Err(ClientError::Unexpected {
                request: "Hello",
                reply: format!("{:?}", other.msg),
            });
        }
        Err(e) => {
            transport.close();
            return Err(e);
        }
    };
    Ok((transport, welcome))
}

/// Sends ahead of the `Hello` what of a reconnect's account does not fit its frame
/// (`ResumeMore`, [`RESUME_PART`] grants each); returns the rest, for the `Hello`. An account
/// that fits one frame goes whole in the `Hello`, as a daemon without `ResumeMore` takes it.
fn send_ahead(
    transport: &Transport,
    resume: Option<Resume>,
) -> Result<Option<Resume>, ClientError> {
    let Some(mut resume) = resume else {
        return Ok(None);
    };
    // The account's own length, with room for the rest of the `Hello` (its name, class and
    // client string are far shorter than this).
    let len = vram_proto::payload_len(u64::MAX, &resume)?;
    if len + 4096 <= vram_proto::MAX_PAYLOAD {
        return Ok(Some(resume));
    }
    while resume.grants.len() > RESUME_PART {
        let grants = resume.grants.split_off(resume.grants.len() - RESUME_PART);
        let request = Request::ResumeMore { grants };
        match transport.call_within(&request, Some(ANSWER_WITHIN))?.msg {
            Reply::Ack => {}
            other => {
                return Err(ClientError::Unexpected {
                    request: "ResumeMore",
                    reply: format!("{other:?}"),
                })
            }
        }
    }
    Ok(Some(resume))
}

/// What the link says it holds, held for a call (see `Link::books`): the only way to note a
/// change to it.
pub(crate) struct Books<'a> {
    link: &'a Link,
    _held: std::sync::RwLockReadGuard<'a, ()>,
}

impl Books<'_> {
    pub(crate) fn granted(&self, grants: impl IntoIterator<Item = (GrantId, Bytes)>) {
        lock(&self.link.held).extend(grants);
    }

    pub(crate) fn returned(&self, ids: &[GrantId]) {
        let mut held = lock(&self.link.held);
        for id in ids {
            held.remove(id);
        }
    }

    pub(crate) fn charged(&self, bytes: Bytes) {
        self.link.charged.fetch_add(bytes.get(), Ordering::Relaxed);
    }

    pub(crate) fn uncharged(&self, bytes: Bytes) {
        let _ = self
            .link
            .charged
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| {
                Some(c.saturating_sub(bytes.get()))
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;
    use vram_proto::Conn;

    /// An account far too long for one frame goes ahead of the `Hello` in parts that each fit,
    /// and nothing of it is lost or repeated.
    #[test]
    fn a_long_account_goes_ahead_in_parts_that_fit_a_frame() {
        let grants: Vec<(GrantId, Bytes)> = (0..3 * RESUME_PART as u64 + 5)
            .map(|i| (GrantId(u64::MAX - i), Bytes::mib(2 + i)))
            .collect();
        let whole = Request::Hello(Hello {
            role: Role::Observer,
            gpu: None,
            client: String::new(),
            resume: Some(Resume {
                grants: grants.clone(),
                charged: Bytes::ZERO,
            }),
        });
        let len = vram_proto::payload_len(1, &whole).unwrap();
        assert!(
            len > vram_proto::MAX_PAYLOAD,
            "{len}: the test needs a longer account"
        );

        let (ours, theirs) = UnixStream::pair().unwrap();
        let transport = Transport::new(ours, None);
        let daemon = std::thread::spawn(move || {
            let conn = Conn::new(theirs);
            let mut got = Vec::new();
            // Each part is a frame the daemon accepts (within MAX_PAYLOAD), answered in turn.
            for _ in 0..3 {
                let r: Received<Request> = conn.recv().unwrap();
                let Request::ResumeMore { grants } = r.msg else {
                    panic!("{:?}", r.msg);
                };
                assert_eq!(grants.len(), RESUME_PART);
                got.extend(grants);
                conn.send(r.id, &Reply::Ack, &[]).unwrap();
            }
            got
        });
        let resume = Resume {
            grants: grants.clone(),
            charged: Bytes::mib(6),
        };
        let rest = send_ahead(&transport, Some(resume)).unwrap().unwrap();
        let mut all = daemon.join().unwrap();
        assert_eq!(rest.grants.len(), 5);
        assert_eq!(rest.charged, Bytes::mib(6));
        all.extend(rest.grants);
        all.sort();
        let mut want = grants;
        want.sort();
        assert_eq!(all, want);

        // An account that fits the Hello's frame goes whole in it: nothing is sent ahead (the
        // daemon's end is gone, so a part sent would fail).
        let short = Resume {
            grants: want[..RESUME_PART + 1].to_vec(),
            charged: Bytes::ZERO,
        };
        let rest = send_ahead(&transport, Some(short.clone())).unwrap();
        assert_eq!(rest, Some(short));
    }
}
