//! What the fuzzing peers send, as proptest strategies: well-formed requests (some naming ids
//! that exist only at run time: own, foreign or unknown grants, invitations, shared buffers and
//! versions), the same requests with their payload bytes changed, random payloads, garbage,
//! headers the daemon must refuse, frames cut off or left unfinished, and descriptors sent along.

use proptest::collection::vec;
use proptest::option;
use proptest::prelude::*;
use proptest::sample::select;
use vram_core::shared::{Acl, BufferId, Principal};
use vram_core::Bytes;
use vram_proto::{ExitStatus, GrantId, Hello, LeaseOp, Request, Resume, Role, SharedRequest};

use super::rules::{CAPACITY, GRANULARITY, USER_MAX_MEMORY};

/// Tenant names: the declared ones, a few free ones (so that names collide), invalid ones.
fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => select(vec!["prod", "locked", "batch", "t0", "t1", "t2", "t3", "t4", "t5", "t6"])
            .prop_map(String::from),
        1 => select(vec!["", "bad name", "é", "../x", "a\0b"]).prop_map(String::from),
        1 => Just("x".repeat(65)),
        1 => "[ -~]{0,12}",
    ]
}

fn class() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => select(vec!["high", "normal", "low"]).prop_map(String::from),
        1 => select(vec!["", "gold", "HIGH"]).prop_map(String::from),
    ]
}

/// Sizes from nothing to absurd, weighted towards those that bind: multiples of the granularity,
/// the rules' own figures and their neighbours.
pub fn size() -> impl Strategy<Value = Bytes> {
    let g = GRANULARITY.get();
    let edges = vec![
        CAPACITY.get(),
        CAPACITY.get() + 1,
        USER_MAX_MEMORY.get(),
        USER_MAX_MEMORY.get() + 1,
        8 << 20,
        16 << 20,
        24 << 20,
        g - 1,
        g + 1,
    ];
    let absurd = vec![
        u64::MAX,
        u64::MAX - 1,
        1 << 63,
        u64::MAX - g + 2,
        u64::MAX / 2 + 1,
    ];
    prop_oneof![
        6 => (1u64..=8).prop_map(move |n| Bytes(n * g)),
        2 => (1u64..=4096).prop_map(Bytes),
        2 => (1u64..=CAPACITY.get()).prop_map(Bytes),
        1 => Just(Bytes::ZERO),
        1 => select(edges).prop_map(Bytes),
        1 => select(absurd).prop_map(Bytes),
        1 => any::<u64>().prop_map(Bytes),
    ]
}

fn gpu() -> impl Strategy<Value = Option<u32>> {
    prop_oneof![
        8 => Just(None),
        4 => Just(Some(0)),
        1 => Just(Some(1)),
        1 => any::<u32>().prop_map(Some),
    ]
}

fn resume() -> impl Strategy<Value = Resume> {
    (vec((any::<u64>().prop_map(GrantId), size()), 0..4), size())
        .prop_map(|(grants, charged)| Resume { grants, charged })
}

/// A tenant's `Hello`: mostly plain, sometimes with odd fields.
pub fn hello_tenant() -> impl Strategy<Value = Hello> {
    (
        name(),
        option::weighted(0.5, class()),
        option::weighted(0.3, size()),
        option::weighted(0.5, size()),
        gpu(),
        prop_oneof![9 => Just("fuzz".to_string()), 1 => ".{0,300}"],
        option::weighted(0.1, resume()),
    )
        .prop_map(
            |(name, class, guarantee, limit, gpu, client, resume)| Hello {
                role: Role::Tenant {
                    name,
                    class,
                    guarantee,
                    limit,
                },
                gpu,
                client,
                resume,
            },
        )
}

fn hello() -> impl Strategy<Value = Hello> {
    prop_oneof![
        8 => hello_tenant(),
        1 => Just(Hello {
            role: Role::Observer,
            gpu: None,
            client: "fuzz".into(),
            resume: None,
        }),
    ]
}

fn principal() -> impl Strategy<Value = Principal> {
    prop_oneof![
        3 => name().prop_map(Principal::Tenant),
        1 => class().prop_map(Principal::Class),
        1 => Just(Principal::Anyone),
    ]
}

fn acl() -> impl Strategy<Value = Acl> {
    (vec(principal(), 0..3), vec(principal(), 0..3))
        .prop_map(|(readers, writers)| Acl { readers, writers })
}

fn buffer_name() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => select(vec!["w0", "w1", "w2"]).prop_map(String::from),
        1 => select(vec!["", "a b", "/"]).prop_map(String::from),
        1 => Just("b".repeat(300)),
    ]
}

/// Requests that need nothing from run time.
fn plain() -> impl Strategy<Value = Request> {
    prop_oneof![
        4 => hello().prop_map(Request::Hello),
        8 => size().prop_map(|bytes| Request::Grant { bytes }),
        3 => vec(size(), 0..=18).prop_map(|sizes| Request::GrantMany { sizes }),
        3 => size().prop_map(|bytes| Request::Charge { bytes }),
        2 => size().prop_map(|bytes| Request::Uncharge { bytes }),
        1 => (size(), size()).prop_map(|(in_use, cached)| Request::Usage { in_use, cached }),
        1 => (any::<u64>(), size()).prop_map(|(ask, returned)| Request::ReclaimDone { ask, returned }),
        2 => Just(Request::Status),
        1 => Just(Request::Ping),
        2 => Just(Request::Budget),
        1 => Just(Request::Invite),
        1 => Just(Request::Bye),
        1 => prop_oneof![
            any::<i32>().prop_map(ExitStatus::Code),
            any::<i32>().prop_map(ExitStatus::Signal)
        ]
        .prop_map(Request::Exited),
        1 => (
            size(),
            prop_oneof![select(vec!["over_limit", "device_full"]).prop_map(String::from), ".{0,20}"],
            prop_oneof![4 => ".{0,40}", 1 => Just("m".repeat(4000))],
        )
            .prop_map(|(bytes, reason, message)| Request::Refused { bytes, reason, message }),
        2 => (buffer_name(), size(), acl())
            .prop_map(|(name, size, acl)| Request::Shared(SharedRequest::Create { name, size, acl })),
        1 => buffer_name().prop_map(|name| Request::Shared(SharedRequest::Open { name })),
        1 => option::of(any::<u64>())
            .prop_map(|after| Request::Shared(SharedRequest::List { after: after.map(BufferId) })),
    ]
}

/// One of the ids seen at run time (by index, taken modulo how many there are), or a made-up one.
#[derive(Debug, Clone, Copy)]
pub enum Pick {
    Known(usize),
    Made(u64),
}

fn pick() -> impl Strategy<Value = Pick> {
    prop_oneof![
        4 => any::<usize>().prop_map(Pick::Known),
        1 => prop_oneof![0u64..64, any::<u64>()].prop_map(Pick::Made),
    ]
}

/// Which grants a `Return` names.
#[derive(Debug, Clone, Copy)]
pub enum GrantPick {
    /// One this connection holds.
    Own(usize),
    /// One granted to any connection.
    Foreign(usize),
    Unknown(u64),
}

fn grant_pick() -> impl Strategy<Value = GrantPick> {
    prop_oneof![
        6 => any::<usize>().prop_map(GrantPick::Own),
        2 => any::<usize>().prop_map(GrantPick::Foreign),
        1 => any::<u64>().prop_map(GrantPick::Unknown),
    ]
}

/// A shared-buffer request naming a buffer (and a version) seen at run time.
#[derive(Debug, Clone)]
pub enum SharedOp {
    Delete(Pick),
    Lease(Pick, LeaseOp, u32),
    /// `base`: `None`, the latest version seen of the buffer, or a made-up one.
    BeginWrite(Pick, Option<Pick>),
    Publish(Pick, Option<u64>),
    Pin(Pick),
    Unpin(Pick),
    Verify(Pick),
    WaitNewer(Pick, bool, u32),
}

fn lease_op() -> impl Strategy<Value = LeaseOp> {
    select(vec![LeaseOp::Acquire, LeaseOp::Renew, LeaseOp::Release])
}

fn shared_op() -> impl Strategy<Value = SharedOp> {
    let ttl = prop_oneof![4 => 0u32..300, 1 => any::<u32>()];
    let wait = prop_oneof![6 => 0u32..30, 1 => any::<u32>()];
    prop_oneof![
        1 => pick().prop_map(SharedOp::Delete),
        3 => (pick(), lease_op(), ttl).prop_map(|(b, op, t)| SharedOp::Lease(b, op, t)),
        3 => (pick(), option::of(pick())).prop_map(|(b, base)| SharedOp::BeginWrite(b, base)),
        3 => (pick(), option::weighted(0.2, any::<u64>())).prop_map(|(b, c)| SharedOp::Publish(b, c)),
        2 => pick().prop_map(SharedOp::Pin),
        1 => pick().prop_map(SharedOp::Unpin),
        1 => pick().prop_map(SharedOp::Verify),
        1 => (pick(), any::<bool>(), wait).prop_map(|(b, than, t)| SharedOp::WaitNewer(b, than, t)),
    ]
}

/// A request, possibly naming what exists only at run time.
#[derive(Debug, Clone)]
pub enum Req {
    Plain(Request),
    Return(Vec<GrantPick>),
    /// An invitation some connection got (`Known`), or a made-up token.
    Join(Pick),
    Shared(SharedOp),
}

pub fn req() -> impl Strategy<Value = Req> {
    prop_oneof![
        12 => plain().prop_map(Req::Plain),
        4 => vec(grant_pick(), 0..=5).prop_map(Req::Return),
        1 => pick().prop_map(Req::Join),
        4 => shared_op().prop_map(Req::Shared),
    ]
}

/// A change to an encoded payload; positions are taken modulo its length.
#[derive(Debug, Clone)]
pub enum Edit {
    Xor { at: usize, with: u8 },
    Set { at: usize, to: u8 },
    Insert { at: usize, byte: u8 },
    Remove { at: usize },
    Truncate { to: usize },
    Append(Vec<u8>),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        4 => (any::<usize>(), 1u8..=255).prop_map(|(at, with)| Edit::Xor { at, with }),
        2 => (any::<usize>(), select(vec![0u8, 1, 0x7f, 0x80, 0xff])).prop_map(|(at, to)| Edit::Set { at, to }),
        1 => (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Edit::Insert { at, byte }),
        1 => any::<usize>().prop_map(|at| Edit::Remove { at }),
        1 => (0usize..16).prop_map(|to| Edit::Truncate { to }),
        1 => vec(any::<u8>(), 1..12).prop_map(Edit::Append),
    ]
}

/// A header the daemon must refuse (it closes the connection).
#[derive(Debug, Clone)]
pub enum BadHeader {
    Magic([u8; 4]),
    Oversized(u32),
    TooManyFds(u16),
    Version(u16),
}

fn bad_header() -> impl Strategy<Value = BadHeader> {
    prop_oneof![
        any::<[u8; 4]>()
            .prop_filter("not the magic", |m| m != b"VRMD")
            .prop_map(BadHeader::Magic),
        ((vram_proto::MAX_PAYLOAD as u32 + 1)..=u32::MAX).prop_map(BadHeader::Oversized),
        ((vram_proto::MAX_FDS as u16 + 1)..=u16::MAX).prop_map(BadHeader::TooManyFds),
        any::<u16>()
            .prop_filter("another version", |v| *v != vram_proto::PROTOCOL_VERSION)
            .prop_map(BadHeader::Version),
    ]
}

/// A descriptor sent along with a frame.
#[derive(Debug, Clone, Copy)]
pub enum FdKind {
    File,
    Socket,
    /// One of the memory handles the daemon granted this connection (the first one it has).
    Grant,
    /// The connection's own socket.
    Itself,
}

fn fd_kind() -> impl Strategy<Value = FdKind> {
    select(vec![
        FdKind::File,
        FdKind::Socket,
        FdKind::Grant,
        FdKind::Itself,
    ])
}

/// One step of a peer.
#[derive(Debug, Clone)]
pub enum Op {
    /// A well-formed request; its reply is awaited.
    Request(Req),
    /// Requests sent back to back; their replies read after.
    Pipeline(Vec<Req>),
    /// A well-formed request's payload with bytes changed, in a frame whose header is right.
    Mutated {
        req: Req,
        edits: Vec<Edit>,
    },
    /// Random payload bytes in a frame whose header is right.
    RandomPayload(Vec<u8>),
    /// Bytes that are no frame (most do not start with the magic).
    Garbage(Vec<u8>),
    BadHeader(BadHeader, Vec<u8>),
    /// A request with `attach` descriptors sent along and `announce` in its header.
    WithFds {
        req: Req,
        attach: Vec<FdKind>,
        announce: u16,
    },
    /// The first `keep` bytes of a request's frame, then the connection closed.
    CutOff {
        req: Req,
        keep: usize,
    },
    /// The first `keep` bytes of a request's frame on a connection of its own, left unfinished
    /// and open until the round ends.
    Stall {
        req: Req,
        keep: usize,
    },
    /// A connection opened and left silent until the round ends.
    Silent,
    /// Closes the connection abruptly; the next one starts with `then` if given.
    Close {
        then: Option<Hello>,
    },
    /// Answers the last reclaim request: gives back up to `give` grants, then `ReclaimDone`.
    AnswerReclaim {
        give: usize,
    },
}

pub fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        40 => req().prop_map(Op::Request),
        4 => vec(req(), 2..8).prop_map(Op::Pipeline),
        10 => (req(), vec(edit(), 1..4)).prop_map(|(req, edits)| Op::Mutated { req, edits }),
        3 => prop_oneof![9 => vec(any::<u8>(), 0..64), 1 => vec(any::<u8>(), 1000..70_000)]
            .prop_map(Op::RandomPayload),
        2 => prop_oneof![
            vec(any::<u8>(), 1..40),
            vec(any::<u8>(), 0..20).prop_map(|mut v| {
                v.splice(0..0, *b"VRMD");
                v
            }),
        ]
        .prop_map(Op::Garbage),
        1 => (bad_header(), vec(any::<u8>(), 0..8)).prop_map(|(h, p)| Op::BadHeader(h, p)),
        3 => (req(), vec(fd_kind(), 0..=20), prop_oneof![4 => Just(u16::MAX), 1 => 0u16..=20])
            .prop_map(|(req, attach, announce)| {
                // `u16::MAX` stands for "as many as attached": the frame is well-formed.
                let announce = if announce == u16::MAX { attach.len() as u16 } else { announce };
                Op::WithFds { req, attach, announce }
            }),
        2 => (req(), 0usize..40).prop_map(|(req, keep)| Op::CutOff { req, keep }),
        1 => (req(), 1usize..40).prop_map(|(req, keep)| Op::Stall { req, keep }),
        1 => Just(Op::Silent),
        3 => option::weighted(0.8, hello_tenant()).prop_map(|then| Op::Close { then }),
        1 => (0usize..4).prop_map(|give| Op::AnswerReclaim { give }),
    ]
}

/// A peer's whole script: a first `Hello` (usually), then its steps.
#[derive(Debug, Clone)]
pub struct Script {
    pub hello: Option<Hello>,
    pub ops: Vec<Op>,
}

pub fn script(ops: std::ops::Range<usize>) -> impl Strategy<Value = Script> {
    (option::weighted(0.9, hello_tenant()), vec(op(), ops))
        .prop_map(|(hello, ops)| Script { hello, ops })
}
