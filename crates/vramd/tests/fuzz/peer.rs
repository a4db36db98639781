//! A fuzzing peer: plays a script on its connections, reads every reply, and checks what it sees
//! against its own view of its tenant: what it was granted less what it gave back, and at least
//! what it charged less what it uncharged.

use std::collections::HashMap;
use std::fs::File;
use std::io::{IoSlice, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
use vram_core::shared::{BufferId, Version};
use vram_core::Bytes;
use vram_proto::{
    Conn, Envelope, ErrorCode, FrameHeader, GrantId, Hello, ProtoError, Received, Reply, Request,
    Role, SharedReply, SharedRequest, MAX_FDS,
};

use super::gen::{BadHeader, Edit, FdKind, GrantPick, Op, Pick, Req, Script, SharedOp};
use super::rules::check_report;

/// How long the daemon may take to answer one request before the test calls it stalled.
const PATIENCE: Duration = Duration::from_secs(10);

/// Ids seen by any peer in a round, for requests that name another's (the newest few of each).
#[derive(Default)]
pub struct World(Mutex<Seen>);

#[derive(Default)]
struct Seen {
    grants: Vec<GrantId>,
    tokens: Vec<String>,
    buffers: Vec<BufferId>,
    /// The newest published version seen of each buffer, and the newest draft.
    versions: HashMap<BufferId, Version>,
    drafts: HashMap<BufferId, Version>,
}

const KEEP: usize = 32;

fn remember<T>(list: &mut Vec<T>, x: T) {
    if list.len() == KEEP {
        list.remove(0);
    }
    list.push(x);
}

fn choose<T: Clone>(list: &[T], i: usize) -> Option<T> {
    (!list.is_empty()).then(|| list[i % list.len()].clone())
}

impl World {
    fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn buffer(&self, p: Pick) -> BufferId {
        match p {
            Pick::Known(i) => choose(&self.seen().buffers, i).unwrap_or(BufferId(i as u64 % 8)),
            Pick::Made(x) => BufferId(x),
        }
    }

    fn version(&self, b: BufferId) -> Version {
        self.seen().versions.get(&b).copied().unwrap_or(Version(1))
    }

    fn draft(&self, b: BufferId) -> Version {
        let s = self.seen();
        s.drafts
            .get(&b)
            .or(s.versions.get(&b))
            .copied()
            .unwrap_or(Version(1))
    }
}

/// What a request in flight was, for reading its reply.
enum Pending {
    /// A tenant's `Hello` without a `Resume`.
    FreshHello,
    Return(Vec<GrantId>),
    Charge(Bytes),
    Uncharge(Bytes),
    BeginWrite(BufferId),
    Publish(BufferId),
    Other,
}

/// One connection and this peer's view of the tenant on it.
struct Live {
    conn: Conn,
    /// Grants received and not given back by a `Return` of this peer's, with their descriptors.
    /// Granted and not yet given back: id, size, and the descriptor, closed once a return of it
    /// is sent (a tenant that still reaches what it returns keeps it booked).
    grants: Vec<(GrantId, Bytes, Option<OwnedFd>)>,
    /// Granted less returned, by the replies (exact whatever requests they answer).
    held: u128,
    /// Charged less uncharged, by the replies known to answer a `Charge` or `Uncharge`: at most
    /// what the daemon books (an unattributed `Ack` may have been an `Uncharge`, and resets it).
    charged_floor: u128,
    limit: Option<Bytes>,
    /// Whether the daemon's figure of what the tenant holds must equal `held`: not once another
    /// connection may share the tenant (an invitation) or shared buffers charge it.
    exact: bool,
    /// Whether another connection may share the tenant (a join, an invitation): its returns and
    /// uncharges then take from what this peer counts, which is no floor of the tenant's books.
    shared: bool,
    pending: HashMap<u64, Pending>,
    /// Sent a frame the daemon may close the connection for (bad header, fds that do not match).
    bad: bool,
    /// Told by the daemon that it closes the connection.
    closing: bool,
    reclaim: Option<u64>,
    /// Descriptors of shared-buffer replies, kept until the connection closes.
    other_fds: Vec<OwnedFd>,
}

impl Live {
    fn new(stream: UnixStream) -> Live {
        Live {
            conn: Conn::new(stream),
            grants: Vec::new(),
            held: 0,
            charged_floor: 0,
            limit: None,
            exact: true,
            shared: false,
            pending: HashMap::new(),
            bad: false,
            closing: false,
            reclaim: None,
            other_fds: Vec::new(),
        }
    }
}

/// What a peer sent: inputs (the script's frames, well-formed or not, and connections opened
/// to stay silent) and the pings it sent to know the daemon had read them.
#[derive(Debug, Default, Clone, Copy)]
pub struct Counts {
    pub inputs: u64,
    pub syncs: u64,
}

pub struct Peer<'a> {
    socket: &'a Path,
    world: &'a World,
    conn: Option<Live>,
    /// Connections left silent or with a frame unfinished, closed at the end of the round.
    lingering: Vec<UnixStream>,
    next_hello: Option<Hello>,
    /// Request ids: a hash of a counter, so that a changed byte in one request's id does not
    /// make another request's.
    counter: u64,
    salt: u64,
    file: File,
    sockets: (UnixStream, UnixStream),
    /// The last frames sent and received, for the message of a failure.
    trace: std::collections::VecDeque<String>,
    pub counts: Counts,
}

/// How many frames a failure's message shows.
const TRACE: usize = 40;

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn is_async(r: &Request) -> bool {
    matches!(
        r,
        Request::Shared(
            SharedRequest::WaitNewer { .. }
                | SharedRequest::Publish { .. }
                | SharedRequest::Verify { .. }
        )
    )
}

fn frame(header: FrameHeader, payload: &[u8]) -> Vec<u8> {
    let mut f = header.encode().to_vec();
    f.extend_from_slice(payload);
    f
}

fn encode(id: u64, msg: &Request) -> Vec<u8> {
    postcard::to_stdvec(&Envelope { id, msg }).expect("a request encodes")
}

fn edit(payload: &mut Vec<u8>, e: &Edit) {
    let at = |i: usize, len: usize| if len == 0 { 0 } else { i % len };
    match e {
        Edit::Xor { at: i, with } if !payload.is_empty() => {
            let i = at(*i, payload.len());
            payload[i] ^= with;
        }
        Edit::Set { at: i, to } if !payload.is_empty() => {
            let i = at(*i, payload.len());
            payload[i] = *to;
        }
        Edit::Insert { at: i, byte } => {
            let i = at(*i, payload.len() + 1);
            payload.insert(i, *byte);
        }
        Edit::Remove { at: i } if !payload.is_empty() => {
            let i = at(*i, payload.len());
            payload.remove(i);
        }
        Edit::Truncate { to } => payload.truncate(*to),
        Edit::Append(bytes) => payload.extend_from_slice(bytes),
        _ => {}
    }
}

/// Writes `bytes` with `fds` riding on the first byte, as a client would send a frame with
/// descriptors (but with whatever count the bytes' header announces).
fn send_with_fds(stream: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> std::io::Result<()> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(32))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    assert!(
        control.push(SendAncillaryMessage::ScmRights(fds)),
        "room for the fds"
    );
    let sent = rustix::net::sendmsg(
        stream,
        &[IoSlice::new(bytes)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    let mut rest: &UnixStream = stream;
    rest.write_all(&bytes[sent..])
}

fn gone(e: &ProtoError) -> bool {
    match e {
        ProtoError::Closed => true,
        ProtoError::Io(e) => matches!(
            e.kind(),
            std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
        ),
        _ => false,
    }
}

impl<'a> Peer<'a> {
    pub fn new(socket: &'a Path, world: &'a World, salt: u64) -> Peer<'a> {
        Peer {
            socket,
            world,
            conn: None,
            lingering: Vec::new(),
            next_hello: None,
            counter: 0,
            salt,
            file: tempfile::tempfile().expect("a temporary file"),
            sockets: UnixStream::pair().expect("a socket pair"),
            trace: std::collections::VecDeque::new(),
            counts: Counts::default(),
        }
    }

    /// Plays `script`; an error names the step that broke a rule and what it saw. Everything the
    /// peer opened is closed when it returns.
    pub fn play(&mut self, script: &Script) -> Result<(), String> {
        self.next_hello = script.hello.clone();
        for (i, op) in script.ops.iter().enumerate() {
            self.note(format!("step {i}"));
            self.step(op).map_err(|e| {
                let trace: Vec<&str> = self.trace.iter().map(String::as_str).collect();
                format!(
                    "step {i} of {}: {op:?}\n{e}\nthe peer's last frames:\n  {}",
                    script.ops.len(),
                    trace.join("\n  ")
                )
            })?;
        }
        self.conn = None;
        self.lingering.clear();
        Ok(())
    }

    fn note(&mut self, what: String) {
        if self.trace.len() == TRACE {
            self.trace.pop_front();
        }
        let mut what = what;
        if what.len() > 240 {
            let mut end = 240;
            while !what.is_char_boundary(end) {
                end -= 1;
            }
            what.truncate(end);
        }
        self.trace.push_back(what);
    }

    fn id(&mut self) -> u64 {
        self.counter += 1;
        mix(self.salt ^ mix(self.counter)) | 1
    }

    fn open(&self) -> Result<UnixStream, String> {
        let s = UnixStream::connect(self.socket).map_err(|e| format!("connect: {e}"))?;
        s.set_write_timeout(Some(PATIENCE))
            .map_err(|e| e.to_string())?;
        Ok(s)
    }

    /// The connection, opened (and greeted with the pending `Hello`) if there is none.
    fn live(&mut self) -> Result<(), String> {
        if self.conn.is_none() {
            self.note("connect".into());
            self.conn = Some(Live::new(self.open()?));
            if let Some(h) = self.next_hello.take() {
                let p = if h.resume.is_none() {
                    Pending::FreshHello
                } else {
                    Pending::Other
                };
                self.request(Request::Hello(h), p)?;
            }
        }
        Ok(())
    }

    fn step(&mut self, op: &Op) -> Result<(), String> {
        match op {
            Op::Request(req) => {
                self.live()?;
                let (r, p) = self.resolve(req);
                self.request(r, p)
            }
            Op::Pipeline(reqs) => {
                self.live()?;
                let mut last = None;
                for req in reqs {
                    let (r, p) = self.resolve(req);
                    let answered_now = !is_async(&r);
                    let id = self.send(&r, p)?;
                    last = answered_now.then_some(id);
                }
                match last {
                    Some(id) => self.pump(id),
                    None => self.sync(),
                }
            }
            Op::Mutated { req, edits } => {
                self.live()?;
                let (r, _) = self.resolve(req);
                // Mutated or not, a return the daemon may read goes out with its grants let go.
                self.let_go(&r);
                let mut payload = encode(self.id(), &r);
                for e in edits {
                    edit(&mut payload, e);
                }
                self.raw(&frame(FrameHeader::new(0, payload.len()), &payload), false)?;
                self.sync()
            }
            Op::RandomPayload(payload) => {
                self.live()?;
                self.raw(&frame(FrameHeader::new(0, payload.len()), payload), false)?;
                self.sync()
            }
            Op::Garbage(bytes) => {
                self.live()?;
                self.raw(bytes, true)?;
                self.sync()
            }
            Op::BadHeader(h, payload) => {
                self.live()?;
                let mut header = FrameHeader::new(0, payload.len()).encode();
                match h {
                    BadHeader::Magic(m) => header[..4].copy_from_slice(m),
                    BadHeader::Oversized(len) => header[8..12].copy_from_slice(&len.to_le_bytes()),
                    BadHeader::TooManyFds(n) => header[6..8].copy_from_slice(&n.to_le_bytes()),
                    BadHeader::Version(v) => header[4..6].copy_from_slice(&v.to_le_bytes()),
                }
                self.raw(&[&header[..], payload].concat(), true)?;
                self.sync()?;
                if self.conn.is_some() {
                    return Err(format!("the daemon kept the connection open after {h:?}"));
                }
                Ok(())
            }
            Op::WithFds {
                req,
                attach,
                announce,
            } => self.with_fds(req, attach, *announce),
            Op::CutOff { req, keep } => {
                self.live()?;
                let (r, _) = self.resolve(req);
                let payload = encode(self.id(), &r);
                let f = frame(FrameHeader::new(0, payload.len()), &payload);
                self.raw(&f[..(*keep).min(f.len() - 1)], true)?;
                self.conn = None;
                Ok(())
            }
            Op::Stall { req, keep } => {
                let (r, _) = self.resolve(req);
                let payload = encode(self.id(), &r);
                let f = frame(FrameHeader::new(0, payload.len()), &payload);
                let mut s = self.open()?;
                self.counts.inputs += 1;
                // The daemon may have cut it off already; either way it stays ours until the end.
                let _ = s.write_all(&f[..(*keep).clamp(1, f.len() - 1)]);
                self.lingering.push(s);
                Ok(())
            }
            Op::Silent => {
                let s = self.open()?;
                self.counts.inputs += 1;
                self.lingering.push(s);
                Ok(())
            }
            Op::Close { then } => {
                self.conn = None;
                self.next_hello = then.clone();
                Ok(())
            }
            Op::AnswerReclaim { give } => {
                let Some(ask) = self.conn.as_mut().and_then(|l| l.reclaim.take()) else {
                    return Ok(());
                };
                let live = self.conn.as_ref().expect("connected");
                let n = (*give).min(live.grants.len());
                let ids: Vec<GrantId> = live.grants[..n].iter().map(|g| g.0).collect();
                let returned = Bytes(live.grants[..n].iter().map(|g| g.1.get()).sum());
                if !ids.is_empty() {
                    self.request(
                        Request::Return {
                            grants: ids.clone(),
                        },
                        Pending::Return(ids),
                    )?;
                }
                self.request(Request::ReclaimDone { ask, returned }, Pending::Other)
            }
        }
    }

    fn with_fds(&mut self, req: &Req, attach: &[FdKind], announce: u16) -> Result<(), String> {
        self.live()?;
        let (r, p) = self.resolve(req);
        self.let_go(&r);
        let id = self.id();
        let payload = encode(id, &r);
        let mut header = FrameHeader::new(0, payload.len());
        header.fds = announce;
        let bytes = frame(header, &payload);
        let bad = announce as usize != attach.len() || attach.len() > MAX_FDS;
        let live = self.conn.as_mut().expect("connected");
        live.bad |= bad;
        let fds: Vec<BorrowedFd<'_>> = attach
            .iter()
            .map(|k| match k {
                FdKind::File => self.file.as_fd(),
                FdKind::Socket => self.sockets.0.as_fd(),
                FdKind::Grant => live
                    .grants
                    .iter()
                    .find_map(|g| g.2.as_ref())
                    .map_or(self.file.as_fd(), |fd| fd.as_fd()),
                FdKind::Itself => live.conn.stream().as_fd(),
            })
            .collect();
        self.counts.inputs += 1;
        let sent = send_with_fds(live.conn.stream(), &bytes, &fds);
        drop(fds);
        if let Err(e) = sent {
            return self.sent_to_closed(&e.into());
        }
        if !bad && !is_async(&r) {
            live.pending.insert(id, p);
            self.pump(id)
        } else {
            self.sync()
        }
    }

    /// The request a step means, with what names run-time ids resolved.
    fn resolve(&mut self, req: &Req) -> (Request, Pending) {
        let world = self.world;
        match req {
            Req::Plain(r) => {
                let p = match r {
                    Request::Hello(h) if h.resume.is_none() => Pending::FreshHello,
                    Request::Charge { bytes } => Pending::Charge(*bytes),
                    Request::Uncharge { bytes } => Pending::Uncharge(*bytes),
                    _ => Pending::Other,
                };
                (r.clone(), p)
            }
            Req::Return(picks) => {
                let own: Vec<GrantId> = self
                    .conn
                    .as_ref()
                    .map(|l| l.grants.iter().map(|g| g.0).collect())
                    .unwrap_or_default();
                let ids: Vec<GrantId> = picks
                    .iter()
                    .map(|p| match p {
                        GrantPick::Own(i) => choose(&own, *i).unwrap_or(GrantId(*i as u64 % 64)),
                        GrantPick::Foreign(i) => {
                            choose(&world.seen().grants, *i).unwrap_or(GrantId(*i as u64))
                        }
                        GrantPick::Unknown(x) => GrantId(*x),
                    })
                    .collect();
                (
                    Request::Return {
                        grants: ids.clone(),
                    },
                    Pending::Return(ids),
                )
            }
            Req::Join(p) => {
                // Joined, this connection shares the tenant with the one that invited it.
                if let Some(live) = self.conn.as_mut() {
                    live.exact = false;
                    live.shared = true;
                }
                let token = match p {
                    Pick::Known(i) => choose(&world.seen().tokens, *i).unwrap_or_default(),
                    Pick::Made(x) => format!("{x:032x}"),
                };
                let hello = Hello {
                    role: Role::Join { token },
                    gpu: None,
                    client: "fuzz".into(),
                    resume: None,
                };
                (Request::Hello(hello), Pending::Other)
            }
            Req::Shared(op) => {
                let (r, p) = match *op {
                    SharedOp::Delete(b) => (
                        SharedRequest::Delete {
                            buffer: world.buffer(b),
                        },
                        Pending::Other,
                    ),
                    SharedOp::Lease(b, op, ttl_ms) => (
                        SharedRequest::Lease {
                            buffer: world.buffer(b),
                            op,
                            ttl_ms,
                        },
                        Pending::Other,
                    ),
                    SharedOp::BeginWrite(b, base) => {
                        let buffer = world.buffer(b);
                        let base = base.map(|p| match p {
                            Pick::Known(_) => world.version(buffer),
                            Pick::Made(x) => Version(x),
                        });
                        (
                            SharedRequest::BeginWrite { buffer, base },
                            Pending::BeginWrite(buffer),
                        )
                    }
                    SharedOp::Publish(b, checksum) => {
                        let buffer = world.buffer(b);
                        let version = world.draft(buffer);
                        (
                            SharedRequest::Publish {
                                buffer,
                                version,
                                checksum,
                            },
                            Pending::Publish(buffer),
                        )
                    }
                    SharedOp::Pin(b) => (
                        SharedRequest::Pin {
                            buffer: world.buffer(b),
                        },
                        Pending::Other,
                    ),
                    SharedOp::Unpin(b) => {
                        let buffer = world.buffer(b);
                        let version = world.version(buffer);
                        (SharedRequest::Unpin { buffer, version }, Pending::Other)
                    }
                    SharedOp::Verify(b) => {
                        let buffer = world.buffer(b);
                        let version = world.version(buffer);
                        (SharedRequest::Verify { buffer, version }, Pending::Other)
                    }
                    SharedOp::WaitNewer(b, than, timeout_ms) => {
                        let buffer = world.buffer(b);
                        let than = than.then(|| world.version(buffer));
                        (
                            SharedRequest::WaitNewer {
                                buffer,
                                than,
                                timeout_ms,
                            },
                            Pending::Other,
                        )
                    }
                };
                (Request::Shared(r), p)
            }
        }
    }

    /// Sends a well-formed request; its id.
    /// Closes the descriptors of the grants `r` returns, as a tenant does before it returns them.
    fn let_go(&mut self, r: &Request) {
        if let (Request::Return { grants }, Some(live)) = (r, self.conn.as_mut()) {
            for g in live.grants.iter_mut().filter(|g| grants.contains(&g.0)) {
                g.2 = None;
            }
        }
    }

    fn send(&mut self, r: &Request, p: Pending) -> Result<u64, String> {
        self.let_go(r);
        let id = self.id();
        self.note(format!("> {id:x} {r:?}"));
        let live = self.conn.as_mut().expect("connected");
        self.counts.inputs += 1;
        match live.conn.send(id, r, &[]) {
            Ok(()) => {
                live.pending.insert(id, p);
                Ok(id)
            }
            Err(e) => self.sent_to_closed(&e).map(|()| id),
        }
    }

    /// Sends a request and reads up to its reply (up to a ping after it, for one answered later).
    fn request(&mut self, r: Request, p: Pending) -> Result<(), String> {
        let later = is_async(&r);
        let id = self.send(&r, p)?;
        if later {
            self.sync()
        } else {
            self.pump(id)
        }
    }

    /// Writes bytes as they are (`bad`: bytes the daemon may close the connection for).
    fn raw(&mut self, bytes: &[u8], bad: bool) -> Result<(), String> {
        let Some(live) = self.conn.as_mut() else {
            return Ok(());
        };
        if bytes.is_empty() {
            return Ok(());
        }
        live.bad |= bad;
        self.counts.inputs += 1;
        match live.conn.send_bytes(bytes) {
            Ok(()) => Ok(()),
            Err(e) => self.sent_to_closed(&e),
        }
    }

    /// A send failed: the daemon had closed the connection, which it may only have done for a
    /// frame it had to refuse.
    fn sent_to_closed(&mut self, e: &ProtoError) -> Result<(), String> {
        let live = self.conn.take().expect("connected");
        if gone(e) && (live.bad || live.closing) {
            return Ok(());
        }
        Err(format!(
            "sending to the daemon: {e} (the connection sent nothing to close it for)"
        ))
    }

    /// A ping, read up to its pong: every frame sent before it has been read by the daemon.
    fn sync(&mut self) -> Result<(), String> {
        if self.conn.is_none() {
            return Ok(());
        }
        self.counts.syncs += 1;
        let id = self.id();
        let live = self.conn.as_mut().expect("connected");
        match live.conn.send(id, &Request::Ping, &[]) {
            Ok(()) => self.pump(id),
            Err(e) => self.sent_to_closed(&e),
        }
    }

    /// Reads replies until the one to `id`, or until the daemon closes the connection.
    fn pump(&mut self, id: u64) -> Result<(), String> {
        let deadline = Instant::now() + PATIENCE;
        while let Some(live) = self.conn.as_mut() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!("no answer within {PATIENCE:?}: the daemon stalls"));
            }
            match live.conn.recv_within::<Reply>(Some(left)) {
                Ok(r) => {
                    let answered = r.id == id;
                    self.take(r)?;
                    if answered {
                        return Ok(());
                    }
                }
                Err(ProtoError::Idle(_)) => {
                    return Err(format!("no answer within {PATIENCE:?}: the daemon stalls"))
                }
                Err(e) if gone(&e) => {
                    let live = self.conn.take().expect("connected");
                    if !(live.bad || live.closing) {
                        return Err("the daemon closed a connection that sent nothing to close \
                                    it for"
                            .into());
                    }
                }
                Err(e) => return Err(format!("reading the daemon's reply: {e}")),
            }
        }
        Ok(())
    }

    /// One reply: what it changes in this peer's view, and what it must not show.
    fn take(&mut self, r: Received<Reply>) -> Result<(), String> {
        self.note(format!("< {:x} {:?}", r.id, r.msg));
        let world = self.world;
        let live = self.conn.as_mut().expect("connected");
        let pending = live.pending.remove(&r.id);
        let fds_due = match &r.msg {
            Reply::Granted { .. }
            | Reply::Shared(SharedReply::Draft { .. } | SharedReply::Pinned { .. }) => 1,
            Reply::GrantedMany { grants } => grants.len(),
            _ => 0,
        };
        if r.fds.len() != fds_due {
            return Err(format!(
                "{:?} came with {} descriptors; it carries {fds_due}",
                r.msg,
                r.fds.len()
            ));
        }
        let mut fds = r.fds.into_iter();
        match r.msg {
            Reply::Welcome(w) => {
                super::rules::check_welcome(&w)?;
                live.limit = Some(w.limit);
                // A tenant that says it resumes is booked what it claims (within its rules),
                // beyond what this peer was granted.
                if !matches!(pending, Some(Pending::FreshHello)) {
                    live.exact = false;
                }
            }
            Reply::Granted { grant, size } => {
                live.held += size.get() as u128;
                live.grants
                    .push((grant, size, Some(fds.next().expect("one fd"))));
                remember(&mut world.seen().grants, grant);
            }
            Reply::GrantedMany { grants } => {
                for ((grant, size), fd) in grants.into_iter().zip(fds) {
                    live.held += size.get() as u128;
                    live.grants.push((grant, size, Some(fd)));
                    remember(&mut world.seen().grants, grant);
                }
            }
            Reply::Returned { bytes, held } => {
                if let Some(Pending::Return(ids)) = pending {
                    let all_ours = ids.iter().all(|id| live.grants.iter().any(|g| g.0 == *id));
                    let mut ours = Bytes::ZERO;
                    live.grants.retain(|g| {
                        let gone = ids.contains(&g.0);
                        if gone {
                            ours = ours.saturating_add(g.1);
                        }
                        !gone
                    });
                    if live.exact && all_ours && bytes > ours {
                        return Err(format!(
                            "a return of {ids:?} (granted {ours} to this peer) gave back {bytes}"
                        ));
                    }
                    // Less than it named: the daemon books a returned handle that some process
                    // still reaches as kept (neither held nor free) until that reference is
                    // gone, and a descriptor the peer closed can outlive the close for a moment
                    // (a copy in a message not yet read, or in a child of this process between
                    // its fork and its exec). The tenant's figures are no longer this peer's
                    // count; the round's end still checks that everything comes back.
                    if all_ours && bytes < ours {
                        live.exact = false;
                    }
                }
                if (bytes.get() as u128) > live.held && live.exact {
                    return Err(format!("{bytes} returned; this peer held {}", live.held));
                }
                live.held = live.held.saturating_sub(bytes.get() as u128);
                if live.exact && held.get() as u128 > live.held {
                    return Err(format!(
                        "the daemon says the tenant holds {held} after a return; this peer was \
                         granted {} it has not given back",
                        live.held
                    ));
                }
                if (held.get() as u128) < live.held {
                    live.exact = false; // kept, as above
                }
            }
            Reply::Ack => match pending {
                Some(Pending::Charge(b)) => live.charged_floor += b.get() as u128,
                Some(Pending::Uncharge(b)) => {
                    live.charged_floor = live.charged_floor.saturating_sub(b.get() as u128)
                }
                Some(_) => {}
                None => live.charged_floor = 0,
            },
            Reply::Status(report) => check_report(&report)?,
            Reply::Budget(b) => {
                let total =
                    b.held.get() as u128 + b.charged.get() as u128 + b.outside.get() as u128;
                if total > b.limit.get() as u128 || b.available > b.limit.saturating_sub(b.held) {
                    return Err(format!("budget over its limit: {b:?}"));
                }
                if live.exact
                    && (b.held.get() as u128 != live.held
                        || (b.charged.get() as u128) < live.charged_floor)
                {
                    return Err(format!(
                        "budget {b:?}; this peer holds {} granted and charged at least {}",
                        live.held, live.charged_floor
                    ));
                }
            }
            Reply::Invitation { token } => {
                live.exact = false;
                live.shared = true;
                remember(&mut world.seen().tokens, token);
            }
            Reply::Reclaim { ask, .. } => live.reclaim = Some(ask),
            Reply::Shared(s) => {
                live.exact = false;
                live.other_fds.extend(fds);
                let mut seen = world.seen();
                match s {
                    SharedReply::Buffer(info) => {
                        remember(&mut seen.buffers, info.id);
                        if let Some(v) = info.current {
                            seen.versions.insert(info.id, v);
                        }
                    }
                    SharedReply::Buffers { buffers, .. } => {
                        for info in buffers {
                            remember(&mut seen.buffers, info.id);
                        }
                    }
                    SharedReply::Draft { version, .. } => {
                        if let Some(Pending::BeginWrite(b)) = pending {
                            seen.drafts.insert(b, version);
                        }
                    }
                    SharedReply::Published { version, .. } => {
                        if let Some(Pending::Publish(b)) = pending {
                            seen.versions.insert(b, version);
                        }
                    }
                    _ => {}
                }
            }
            Reply::Error(e) => {
                if e.message.is_empty() || (e.code == ErrorCode::Refused && e.reason.is_none()) {
                    return Err(format!("an error reply that does not say why: {e:?}"));
                }
                // Id 0 is also the id of a random payload that decodes as a request: only the
                // accept's own reasons say the connection was refused.
                let at_accept = matches!(
                    e.reason.as_deref(),
                    Some("too_many_connections" | "out_of_fds")
                );
                if e.code == ErrorCode::Refused && r.id == 0 && at_accept {
                    return Err(format!("refused at accept: {e:?}"));
                }
                if matches!(e.code, ErrorCode::Protocol | ErrorCode::PermissionDenied) {
                    live.closing = true;
                }
            }
            Reply::Pong => {}
            // The scripts make no admin calls; a reply to one would be a reply to nothing asked.
            Reply::Declared { .. } | Reply::Withdrawn { .. } | Reply::Declarations(_) => {
                return Err(format!("an admin reply nobody asked for: {:?}", r.msg));
            }
        }
        // Shared, the tenant's books are checked on the daemon's own figures (budgets, status).
        if let Some(limit) = live.limit.filter(|_| !live.shared) {
            if live.held + live.charged_floor > limit.get() as u128 {
                return Err(format!(
                    "this peer was granted {} and charged at least {}; its limit is {limit}",
                    live.held, live.charged_floor
                ));
            }
        }
        Ok(())
    }
}
