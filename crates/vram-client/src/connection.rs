//! The tenant's and the tools' API over a [`Transport`]: registering, grants, returns, status, and
//! the worker that answers the daemon's reclaim requests.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use vram_core::Bytes;
use vram_device::{ByteAccess, DeviceInfo, Handle};
use vram_proto::{GrantId, ProtoError, Reply, Request, StatusReport, Welcome};

use crate::link::{Books, Link, Lost};
use crate::transport::{Transport, ANSWER_WITHIN};
use crate::ClientError;

/// How a process asks to be admitted. Unset fields take the daemon's defaults for the class.
#[derive(Debug, Clone, Default)]
pub struct TenantOptions {
    pub name: String,
    pub class: Option<String>,
    pub guarantee: Option<Bytes>,
    pub limit: Option<Bytes>,
    /// Which of the daemon's devices; `None`: the first.
    pub gpu: Option<u32>,
    /// Join a tenant registered for this process (`vramd run`'s invitation) instead of
    /// registering one; the fields above are then the registration's.
    pub join: Option<String>,
}

impl TenantOptions {
    pub fn named(name: impl Into<String>) -> TenantOptions {
        TenantOptions {
            name: name.into(),
            ..TenantOptions::default()
        }
    }
}

/// Memory granted to this tenant: one handle, imported and ready to map. Give it back with
/// [`Client::give_back`]; dropping it without doing so keeps it counted against the tenant until
/// the process exits.
#[derive(Debug)]
pub struct Grant {
    pub id: GrantId,
    pub handle: Handle,
}

impl Grant {
    pub fn size(&self) -> Bytes {
        self.handle.size()
    }
}

/// Answers the daemon's request for `Bytes` of idle memory; returns how much it gave back.
pub type ReclaimHandler = Box<dyn Fn(&Client, Bytes) -> Bytes + Send + Sync>;

/// A registered tenant's connection to vramd. Cheap to share across threads (`&Client`). When
/// the daemon restarts, the client reconnects by itself and carries on (see `link.rs`).
pub struct Client {
    link: Arc<Link>,
    welcome: Welcome,
    device: Arc<dyn ByteAccess>,
    reclaim: Arc<Mutex<Option<ReclaimHandler>>>,
    /// Nanoseconds spent importing granted handles, in all.
    import_ns: Arc<AtomicU64>,
    /// The application's handle (not the reclaim worker's view): closes the connection on drop.
    owner: bool,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("welcome", &self.welcome)
            .finish()
    }
}

fn connect_stream(path: &Path) -> Result<UnixStream, ClientError> {
    UnixStream::connect(path).map_err(|source| ClientError::Connect {
        path: path.display().to_string(),
        source,
    })
}

impl Client {
    /// Connects to the daemon at `socket` (or [`crate::default_socket`]) and registers as a tenant.
    pub fn connect(socket: Option<&Path>, opts: &TenantOptions) -> Result<Client, ClientError> {
        let path: PathBuf = socket.map_or_else(crate::default_socket, Path::to_path_buf);
        let (reclaim_tx, reclaim_rx) = mpsc::sync_channel(1);
        let (link, welcome) = Link::connect(path, opts.clone(), reclaim_tx)?;
        let device = match open_device(&welcome) {
            Ok(d) => d,
            Err(e) => {
                link.close();
                return Err(e);
            }
        };
        let client = Client {
            link,
            welcome,
            device,
            reclaim: Arc::new(Mutex::new(None)),
            import_ns: Arc::default(),
            owner: true,
        };
        client.start_reclaim_worker(reclaim_rx);
        Ok(client)
    }

    /// Tells the daemon this tenant is finishing on purpose, without waiting: a process that
    /// exits holding memory (its allocations never freed) is then logged as finished, not as a
    /// crash. Dropping the client says it too.
    pub fn bye(&self) {
        self.link.bye();
    }

    /// Ends the registration now, whoever else shares this client: says `Bye` and closes the
    /// connection, so the daemon takes back everything the tenant held, and returns once it has
    /// (or after 5 s of a daemon that does not answer); calls made through the client afterwards
    /// fail. Dropping the last handle does the same.
    pub fn close(&self) {
        self.link.close();
    }

    /// How long the client keeps trying to reconnect when the daemon is gone, before its calls
    /// fail (two minutes unless set): a job that would rather fail soon than wait for a restarted
    /// daemon sets less. Once a window has passed, each later call tries once, at once.
    pub fn set_reconnect_for(&self, window: Duration) {
        self.link.set_reconnect_for(window);
    }

    /// How many times this client has reconnected to a restarted daemon.
    pub fn reconnects(&self) -> u64 {
        self.link.reconnects()
    }

    fn start_reclaim_worker(&self, rx: Receiver<(u64, Bytes)>) {
        // The worker holds its own Client view (same connection), so a handler can give back.
        let view = Client {
            link: self.link.clone(),
            welcome: self.welcome.clone(),
            device: self.device.clone(),
            reclaim: self.reclaim.clone(),
            import_ns: self.import_ns.clone(),
            owner: false,
        };
        thread::Builder::new()
            .name("vram-client-reclaim".into())
            .spawn(move || {
                for (ask, bytes) in rx {
                    let returned = match view.reclaim.lock().expect("reclaim").as_ref() {
                        Some(handler) => handler(&view, bytes),
                        None => Bytes::ZERO,
                    };
                    let done = Request::ReclaimDone { ask, returned };
                    // After a reconnect the ask is the old daemon's: nothing to answer. A daemon
                    // away for longer than the link waits is no reason to stop: the link comes
                    // back with the daemon, and the worker must be there for its asks.
                    if let Err(e) = view.link.call(&done, Lost::Done) {
                        tracing::warn!("vramd: cannot answer a reclaim request: {e}");
                    }
                }
            })
            .expect("spawn reclaim thread");
    }

    /// What the daemon admitted this tenant as (name, class, guarantee, limit, device).
    pub fn welcome(&self) -> &Welcome {
        &self.welcome
    }

    /// This process's view of the device: import, reserve and map granted handles with it, and
    /// copy into and out of what it mapped.
    pub fn device(&self) -> &Arc<dyn ByteAccess> {
        &self.device
    }

    /// Takes one handle of at least `bytes` (rounded up to the device's granularity).
    pub fn grant(&self, bytes: Bytes) -> Result<Grant, ClientError> {
        let mut one = self.grant_many(&[bytes])?;
        Ok(one.pop().expect("one grant asked, one granted"))
    }

    /// Takes handles of at least these sizes, in order: all of them or none. Up to
    /// [`vram_proto::MAX_FDS`] come in one round trip; more take one round trip per that many
    /// (and what earlier ones brought goes back if a later one is refused).
    pub fn grant_many(&self, sizes: &[Bytes]) -> Result<Vec<Grant>, ClientError> {
        let mut out = Vec::with_capacity(sizes.len());
        for chunk in sizes.chunks(vram_proto::MAX_FDS) {
            match self.grant_round_trip(chunk) {
                Ok(grants) => out.extend(grants),
                Err(e) => {
                    if !out.is_empty() {
                        if let Err(back) = self.give_back(out) {
                            tracing::warn!("giving back a partial grant failed: {back}");
                        }
                    }
                    return Err(e);
                }
            }
        }
        Ok(out)
    }

    /// One `Grant` (one size) or `GrantMany` round trip, and the imports.
    fn grant_round_trip(&self, sizes: &[Bytes]) -> Result<Vec<Grant>, ClientError> {
        let granted = self.request_grants(sizes)?;
        let started = Instant::now();
        let mut out = Vec::with_capacity(granted.len());
        let mut ids = Vec::with_capacity(granted.len());
        let mut failed = None;
        for (id, size, fd) in granted {
            ids.push(id);
            if failed.is_none() {
                match self.device.import(fd, size) {
                    Ok(handle) => out.push(Grant { id, handle }),
                    Err(e) => failed = Some(e),
                }
            }
        }
        let spent = started.elapsed().as_nanos() as u64;
        self.import_ns.fetch_add(spent, Ordering::Relaxed);
        if let Some(e) = failed {
            // The daemon holds every one of them for us: give them all back (imports first).
            drop(out);
            if let Err(back) = self.give_back_ids(ids) {
                tracing::warn!("giving back a grant that could not be imported failed: {back}");
            }
            return Err(e.into());
        }
        Ok(out)
    }

    /// Time spent importing the handles [`Client::grant`] and [`Client::grant_many`] brought, in
    /// all (the rest of a grant's time is its round trip).
    pub fn import_time(&self) -> Duration {
        Duration::from_nanos(self.import_ns.load(Ordering::Relaxed))
    }

    /// Takes one handle of at least `bytes` and leaves the import to the caller: the round trip
    /// alone, as `vramd bench` times it. The handle is this tenant's until given back by id.
    pub fn grant_fd(&self, bytes: Bytes) -> Result<(GrantId, Bytes, OwnedFd), ClientError> {
        let mut one = self.request_grants(&[bytes])?;
        Ok(one.pop().expect("one grant asked, one granted"))
    }

    /// The round trip of a grant request: `(id, size, fd)` per size, in order. On a reply that
    /// does not match the request, whatever it granted goes back.
    fn request_grants(
        &self,
        sizes: &[Bytes],
    ) -> Result<Vec<(GrantId, Bytes, OwnedFd)>, ClientError> {
        let request = match sizes {
            [bytes] => Request::Grant { bytes: *bytes },
            _ => Request::GrantMany {
                sizes: sizes.to_vec(),
            },
        };
        let (r, books) = self.link.call_booked(&request, Lost::Retry, |_| {})?;
        let granted = match r.msg {
            Reply::Granted { grant, size } => vec![(grant, size)],
            Reply::GrantedMany { grants } => grants,
            other => return Err(unexpected("Grant", &other)),
        };
        let bad = if granted.len() != sizes.len() {
            Some(ClientError::Unexpected {
                request: "GrantMany",
                reply: format!("{} grants for {} sizes asked", granted.len(), sizes.len()),
            })
        } else if r.fds.len() != granted.len() {
            Some(ClientError::Proto(ProtoError::MissingFds {
                announced: granted.len(),
                received: r.fds.len(),
            }))
        } else {
            granted
                .iter()
                .zip(sizes)
                .find(|((_, got), want)| got < want)
                .map(|(&(_, got), &want)| ClientError::Short { got, want })
        };
        if let Some(e) = bad {
            drop(r.fds);
            // Never noted as held: a reconnect meanwhile has the new daemon unbook them.
            drop(books);
            if let Err(back) = self.give_back_ids(granted.iter().map(|g| g.0).collect()) {
                tracing::warn!(
                    "giving back a grant that does not match the request failed: {back}"
                );
            }
            return Err(e);
        }
        books.granted(granted.iter().copied());
        drop(books);
        Ok(granted
            .into_iter()
            .zip(r.fds)
            .map(|((id, size), fd)| (id, size, fd))
            .collect())
    }

    /// Returns grants to the daemon; answers what this tenant holds afterwards.
    pub fn give_back(&self, grants: Vec<Grant>) -> Result<Bytes, ClientError> {
        let ids = grants.iter().map(|g| g.id).collect();
        // Our imports go before the daemon reuses anything; it never hands the same memory to
        // another tenant anyway (see the broker's freshness rule).
        drop(grants);
        self.give_back_ids(ids)
    }

    /// Returns grants by id (their handles already dropped by the caller).
    pub fn give_back_ids(&self, grants: Vec<GrantId>) -> Result<Bytes, ClientError> {
        let returned = |books: &Books<'_>| books.returned(&grants);
        let request = Request::Return {
            grants: grants.clone(),
        };
        match self.link.call_booked(&request, Lost::Done, returned)?.0.msg {
            Reply::Returned { held, .. } => Ok(held),
            // Reconnected: the new daemon books only what this client still holds.
            Reply::Ack => Ok(Bytes::ZERO),
            other => Err(unexpected("Return", &other)),
        }
    }

    /// Returns grants by id without waiting for the daemon's answer: the return costs this
    /// process a send, not a round trip. The daemon handles a connection's requests in order, so
    /// every later request of this client (a grant, a status, [`Client::ping`]) finds them back;
    /// a refusal (an id it does not know) is logged when its reply is read.
    pub fn give_back_unanswered(&self, grants: Vec<GrantId>) -> Result<(), ClientError> {
        let request = Request::Return {
            grants: grants.clone(),
        };
        self.link
            .send_only(&request, |books| books.returned(&grants))
    }

    /// Tells the daemon what the allocator uses and caches, for status, metrics and reclaim.
    pub fn report_usage(&self, in_use: Bytes, cached: Bytes) -> Result<(), ClientError> {
        self.link
            .call(&Request::Usage { in_use, cached }, Lost::Retry)
            .map(drop)
    }

    /// Books memory the tenant created itself (a framework's own `cuMemCreate`, managed memory)
    /// against its limit. One round trip; a refusal is an error with
    /// [`ClientError::is_refusal`], and the caller must then release that memory.
    pub fn charge(&self, bytes: Bytes) -> Result<(), ClientError> {
        let (r, books) = self
            .link
            .call_booked(&Request::Charge { bytes }, Lost::Retry, |_| {})?;
        match r.msg {
            Reply::Ack => {
                books.charged(bytes);
                Ok(())
            }
            other => Err(unexpected("Charge", &other)),
        }
    }

    /// Takes back a charge (the memory was released), without waiting for the answer.
    pub fn uncharge(&self, bytes: Bytes) -> Result<(), ClientError> {
        self.link
            .send_only(&Request::Uncharge { bytes }, |books| books.uncharged(bytes))
    }

    /// Tells the daemon that this process refused an allocation of `bytes` itself (`reason`: the
    /// broker's rule, such as `over_limit`), so that the refusal is counted and logged where the
    /// operator looks. Sent without waiting.
    pub fn report_refusal(
        &self,
        bytes: Bytes,
        reason: &str,
        message: &str,
    ) -> Result<(), ClientError> {
        let request = Request::Refused {
            bytes,
            reason: reason.to_string(),
            message: message.to_string(),
        };
        self.link.send_only(&request, |_| {})
    }

    /// The tenant's memory as the daemon books it, and what it could still get. One round trip.
    pub fn budget(&self) -> Result<vram_proto::Budget, ClientError> {
        match self.link.call(&Request::Budget, Lost::Retry)?.msg {
            Reply::Budget(b) => Ok(b),
            other => Err(unexpected("Budget", &other)),
        }
    }

    /// Installs what answers the daemon's requests for idle memory.
    /// The shared-buffer versions this tenant owns or pinned that the daemon found changed since
    /// publish (by a `verify` or its scrub), as it reported them on this connection.
    pub fn corruptions(&self) -> Vec<vram_proto::Corruption> {
        self.link.transport().corruptions()
    }

    pub fn on_reclaim(&self, handler: ReclaimHandler) {
        *self.reclaim.lock().expect("reclaim") = Some(handler);
    }

    pub fn status(&self) -> Result<StatusReport, ClientError> {
        match self.link.call(&Request::Status, Lost::Retry)?.msg {
            Reply::Status(s) => Ok(*s),
            other => Err(unexpected("Status", &other)),
        }
    }

    pub fn ping(&self) -> Result<(), ClientError> {
        self.link.call(&Request::Ping, Lost::Retry).map(drop)
    }

    /// A handle on the connection for shared-buffer calls, usable from other threads. Shared
    /// buffers do not survive a daemon restart, so their calls fail on a lost connection.
    pub(crate) fn caller(&self) -> crate::shared::Caller {
        let link = self.link.clone();
        crate::shared::Caller::new(move |request| link.call(request, Lost::Fail))
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        // Closing the socket ends the reader thread, which ends the reclaim worker.
        if self.owner {
            self.link.close();
        }
    }
}

/// A read-only connection for tools: status without registering as a tenant.
pub struct Observer {
    shared: Arc<Transport>,
}

impl Observer {
    pub fn connect(socket: Option<&Path>) -> Result<Observer, ClientError> {
        let path: PathBuf = socket.map_or_else(crate::default_socket, Path::to_path_buf);
        let stream = connect_stream(&path)?;
        // A tool only ever waits for replies to its own calls: it needs no idle reader.
        let shared = Transport::new(stream, None);
        Ok(Observer { shared })
    }

    pub fn status(&self) -> Result<StatusReport, ClientError> {
        match self.ask(&Request::Status)?.msg {
            Reply::Status(s) => Ok(*s),
            other => Err(unexpected("Status", &other)),
        }
    }

    /// Every request of a tool is answered at once by a running daemon: one that does not
    /// answer within [`ANSWER_WITHIN`] is reported, not waited for.
    fn ask(&self, request: &Request) -> Result<vram_proto::Received<Reply>, ClientError> {
        self.shared.call_within(request, Some(ANSWER_WITHIN))
    }

    /// Admin: declares a tenant at run time (see `Request::Declare`); whether anything changed.
    pub fn declare(&self, d: &vram_proto::Declaration) -> Result<bool, ClientError> {
        match self.ask(&Request::Declare(d.clone()))?.msg {
            Reply::Declared { changed } => Ok(changed),
            other => Err(unexpected("Declare", &other)),
        }
    }

    /// Admin: withdraws a tenant declared at run time; what its connections held, now back,
    /// and how many were closed.
    pub fn withdraw(&self, name: &str) -> Result<(Bytes, u32), ClientError> {
        let request = Request::Withdraw {
            name: name.to_string(),
        };
        match self.ask(&request)?.msg {
            Reply::Withdrawn {
                released,
                connections,
            } => Ok((released, connections)),
            other => Err(unexpected("Withdraw", &other)),
        }
    }

    /// Admin: the tenants declared at run time.
    pub fn declarations(&self) -> Result<Vec<vram_proto::Declaration>, ClientError> {
        match self.ask(&Request::Declarations)?.msg {
            Reply::Declarations(d) => Ok(d),
            other => Err(unexpected("Declarations", &other)),
        }
    }
}

impl Drop for Observer {
    fn drop(&mut self) {
        let _ = self
            .shared
            .conn()
            .stream()
            .shutdown(std::net::Shutdown::Both);
    }
}

fn unexpected(request: &'static str, reply: &Reply) -> ClientError {
    ClientError::Unexpected {
        request,
        reply: format!("{reply:?}"),
    }
}

/// The daemon's device as this process opens it: a process that only imports creates nothing,
/// so its host device has no capacity of its own.
fn open_device(w: &Welcome) -> Result<Arc<dyn ByteAccess>, ClientError> {
    Ok(vram_device::open(&DeviceInfo {
        kind: w.device.backend,
        uuid: w.device.uuid.clone(),
        name: w.device.name.clone(),
        capacity: Bytes::ZERO,
        granularity: w.device.granularity,
    })?)
}
