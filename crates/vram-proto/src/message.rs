//! The messages. Requests go from a client (tenant or tool) to the daemon; replies come back with
//! the request's id. The daemon's own requests to a tenant (`Reply::Reclaim`) carry id 0.

use serde::{Deserialize, Serialize};
use vram_core::Bytes;

use crate::BackendKind;

/// One frame's payload: a correlation id and a message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope<T> {
    pub id: u64,
    pub msg: T,
}

/// A grant's id, unique within the daemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct GrantId(pub u64);

/// What a connecting process is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Role {
    /// A process that takes memory. Unset fields take the class's or the configuration's defaults.
    Tenant {
        name: String,
        class: Option<String>,
        guarantee: Option<Bytes>,
        limit: Option<Bytes>,
    },
    /// A tool that only reads (`vramd status`, `vramd top`).
    Observer,
    /// A process taking over a tenant registered for it (`vramd run` registers the tenant, then
    /// starts the program with the invitation's token): the same uid only, once per invitation.
    Join { token: String },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    pub role: Role,
    /// Which of the daemon's devices, by index; `None`: the first.
    pub gpu: Option<u32>,
    /// The client's name and version, for logs.
    pub client: String,
    /// A tenant coming back after its connection was lost (the daemon restarted): what it still
    /// holds, so that a daemon that adopted it books exactly that.
    pub resume: Option<Resume>,
}

/// What a reconnecting tenant still holds: the grants it has not given back (ids from any earlier
/// daemon) and the memory it charged.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resume {
    pub grants: Vec<(GrantId, Bytes)>,
    pub charged: Bytes,
}

/// Requests, client to daemon.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// Must come first on a connection (except `Status` and `Ping`, which need none, and the
    /// `ResumeMore` parts of its own `resume`).
    Hello(Hello),
    /// Asks for one handle of `bytes` (rounded up to the device granularity).
    Grant {
        bytes: Bytes,
    },
    /// Gives handles back.
    Return {
        grants: Vec<GrantId>,
    },
    /// The allocator's own figures, sent when they change noticeably. Answered with `Ack`.
    Usage {
        in_use: Bytes,
        cached: Bytes,
    },
    /// Answer to a `Reclaim`: how much was returned (with `Return`) because of it.
    ReclaimDone {
        ask: u64,
        returned: Bytes,
    },
    Status,
    Ping,
    /// Shared buffers: see [`crate::SharedRequest`].
    Shared(crate::SharedRequest),
    /// Asks for handles of these sizes (each rounded up to the device granularity) in one round
    /// trip: all of them or none. At most [`crate::MAX_FDS`] at a time.
    GrantMany {
        sizes: Vec<Bytes>,
    },
    /// Books memory the tenant created itself (a framework's own `cuMemCreate`, managed memory)
    /// against its limit, before it keeps it. Answered with `Ack` or a refusal.
    Charge {
        bytes: Bytes,
    },
    /// Takes back a charge: the tenant released that memory. Answered with `Ack`.
    Uncharge {
        bytes: Bytes,
    },
    /// The tenant's library refused an allocation itself (its limit, known without asking), so
    /// that the refusal is counted and logged. Answered with `Ack`.
    Refused {
        bytes: Bytes,
        /// The broker's rule, as in [`ErrorReply::reason`] (`over_limit`, ...).
        reason: String,
        message: String,
    },
    /// The tenant's view of its memory. Answered with `Budget`.
    Budget,
    /// Lets one process of the same uid join this tenant (`Role::Join`): it takes the memory
    /// side (grants, reclaim requests) while this connection keeps the registration; when the
    /// member's connection closes, its memory is reclaimed and the tenant stays registered until
    /// this connection closes. Answered with `Invitation`.
    Invite,
    /// The member process ended as `vramd run` saw it: sent by the registering connection before
    /// it closes, so that the end is logged as what it was. Answered with `Ack`.
    Exited(ExitStatus),
    /// The tenant is about to close its connection on purpose (its process ends normally, or it
    /// is done with vramd): what it still holds then is released as at any close, but the end is
    /// logged as finished, not as a crash. Answered with `Ack`; the client need not wait for it.
    Bye,
    /// Admin: declares a tenant at run time, as a `[tenants.NAME]` of the configuration would:
    /// its guarantee is reserved on its device from now on, refused if it does not fit. Declaring
    /// the same again changes nothing. Only uids named in the daemon's `admin_uids`. Answered
    /// with `Declared`.
    Declare(Declaration),
    /// Admin: takes back a tenant declared with `Declare`: its guarantee is released and its
    /// connections are closed, their memory reclaimed as on a crash. Answered with `Withdrawn`.
    Withdraw {
        name: String,
    },
    /// Admin: the tenants declared with `Declare` and not withdrawn. Answered with
    /// `Declarations`.
    Declarations,
    /// Part of a reconnecting tenant's account (`Hello::resume`) too long for one frame: sent
    /// before the `Hello`, as many as needed (at most [`RESUME_PART`] grants each); the `Hello`'s
    /// own `resume` carries the rest and the charges. Answered with `Ack`.
    ResumeMore {
        grants: Vec<(GrantId, Bytes)>,
    },
}

/// The most grants one frame of a reconnecting tenant's account carries (`Request::ResumeMore`,
/// and the `Hello`'s `resume`): a grant's id and size take at most 20 bytes encoded, so a frame
/// of this many stays well within [`crate::MAX_PAYLOAD`].
pub const RESUME_PART: usize = 8192;

/// A tenant declared at run time (`Request::Declare`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Declaration {
    pub name: String,
    /// The device, by index.
    pub gpu: u32,
    /// Its priority class, as named in the daemon's configuration.
    pub class: String,
    /// Memory reserved for it whether or not it is connected.
    pub guarantee: Bytes,
    /// The most it may hold (`None`: the whole device).
    pub limit: Option<Bytes>,
    /// The uids that may connect as it (empty: any uid the daemon allows).
    pub owners: Vec<u32>,
}

/// How a tenant's program ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExitStatus {
    Code(i32),
    Signal(i32),
}

/// A tenant's memory as the daemon books it: what `cuMemGetInfo` and NVML's memory info answer
/// inside a tenant (total = its limit).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Budget {
    pub limit: Bytes,
    pub guarantee: Bytes,
    /// Granted handles.
    pub held: Bytes,
    /// Memory it created itself and charged.
    pub charged: Bytes,
    /// What the driver attributes to its process beyond its charges (its context, ...).
    pub outside: Bytes,
    /// What it could still get now: up to its limit, within its guarantee or what is free.
    pub available: Bytes,
}

/// What a device is, as a tenant needs to know it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceDesc {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    /// Which backend the device is; on the wire its name (`host`, `cuda`), a string as in every
    /// other field, so a name this build does not know is a decode error.
    pub backend: BackendKind,
    pub capacity: Bytes,
    pub granularity: Bytes,
}

/// The daemon's answer to a tenant's `Hello`: what it was admitted as.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    pub tenant: u64,
    pub name: String,
    pub class: String,
    pub priority: u32,
    pub guarantee: Bytes,
    pub limit: Bytes,
    pub device: DeviceDesc,
}

/// Machine-readable kind of an error reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorCode {
    /// A grant refused by policy; `reason` in [`ErrorReply`] says which rule.
    Refused,
    /// A `Hello` refused: bad name, unknown class, guarantee unavailable, name in use.
    Admission,
    /// The peer's uid is not allowed to use the daemon.
    PermissionDenied,
    /// A request that needs `Hello` came first, or `Hello` came twice.
    NotRegistered,
    /// A grant id the tenant does not hold.
    UnknownGrant,
    /// The frame could not be decoded; the connection stays open.
    Malformed,
    /// The frame could not be trusted (bad magic, oversized, version); the connection is closed.
    Protocol,
    /// The device failed (out of physical memory, driver error).
    Device,
    /// The daemon is shutting down.
    ShuttingDown,
    /// A shared buffer's writer conflict: another's lease, a lost lease, a stale base; the message
    /// names the holder and the current version.
    Conflict,
    /// No such shared buffer (or version).
    NotFound,
    /// The buffer's access list does not allow this tenant to do that.
    Forbidden,
    /// A shared-buffer request that cannot be served as asked (bad name, nothing published yet,
    /// a checksum that does not match).
    BadRequest,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorReply {
    pub code: ErrorCode,
    /// For `Refused`: the broker's rule (`over_limit`, `device_full`, `priority_reserve`, ...).
    pub reason: Option<String>,
    /// Human-readable, with the numbers in it.
    pub message: String,
}

impl std::fmt::Display for ErrorReply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ErrorReply {}

/// Replies, daemon to client.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Reply {
    Welcome(Welcome),
    /// One handle; its exported file descriptor travels with this frame.
    Granted {
        grant: GrantId,
        size: Bytes,
    },
    /// Grants taken back; what the tenant holds now.
    Returned {
        bytes: Bytes,
        held: Bytes,
    },
    Ack,
    Status(Box<crate::StatusReport>),
    Pong,
    Error(ErrorReply),
    /// The daemon asks the tenant to return up to `bytes` of idle memory within `deadline_ms`, then
    /// answer with `ReclaimDone`. Sent unsolicited, with envelope id 0.
    Reclaim {
        ask: u64,
        bytes: Bytes,
        deadline_ms: u32,
    },
    /// Answer to a `Shared` request; some carry one fd.
    Shared(crate::SharedReply),
    /// Answer to `GrantMany`: `(grant, size)` in the order asked; one fd each travels with this
    /// frame, in the same order.
    GrantedMany {
        grants: Vec<(GrantId, Bytes)>,
    },
    Budget(Budget),
    /// Answer to `Invite`: what the joining process sends as `Role::Join { token }`.
    Invitation {
        token: String,
    },
    /// Answer to `Declare`: whether the declaration was new or changed (`false`: it was in force
    /// already, exactly so).
    Declared {
        changed: bool,
    },
    /// Answer to `Withdraw`: what the tenant's closed connections held, now back, and how many
    /// connections were closed.
    Withdrawn {
        released: Bytes,
        connections: u32,
    },
    /// Answer to `Declarations`.
    Declarations(Vec<Declaration>),
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `DeviceDesc` with its backend as a plain string: what the wire carries.
    #[derive(Serialize)]
    struct Named<'a> {
        index: u32,
        uuid: &'a str,
        name: &'a str,
        backend: &'a str,
        capacity: Bytes,
        granularity: Bytes,
    }

    fn named(backend: &str) -> Vec<u8> {
        postcard::to_stdvec(&Named {
            index: 1,
            uuid: "host-0",
            name: "host memfd device",
            backend,
            capacity: Bytes::gib(16),
            granularity: Bytes::mib(2),
        })
        .unwrap()
    }

    #[test]
    fn a_backend_travels_as_its_name() {
        for kind in BackendKind::ALL {
            let desc = DeviceDesc {
                index: 1,
                uuid: "host-0".into(),
                name: "host memfd device".into(),
                backend: kind,
                capacity: Bytes::gib(16),
                granularity: Bytes::mib(2),
            };
            let bytes = postcard::to_stdvec(&desc).unwrap();
            assert_eq!(bytes, named(kind.name()), "{kind}");
            assert_eq!(postcard::from_bytes::<DeviceDesc>(&bytes).unwrap(), desc);
        }
        assert!(postcard::from_bytes::<DeviceDesc>(&named("rocm")).is_err());
    }

    /// The largest part of a reconnect's account, every id and size as long as it can be, fits
    /// a frame: as `ResumeMore`, and as a `Hello` with a long name and client string.
    #[test]
    fn the_largest_part_of_a_resume_fits_a_frame() {
        let grants = vec![(GrantId(u64::MAX), Bytes(u64::MAX)); RESUME_PART];
        let more = Request::ResumeMore {
            grants: grants.clone(),
        };
        let hello = Request::Hello(Hello {
            role: Role::Tenant {
                name: "n".repeat(255),
                class: Some("c".repeat(255)),
                guarantee: Some(Bytes(u64::MAX)),
                limit: Some(Bytes(u64::MAX)),
            },
            gpu: Some(u32::MAX),
            client: "v".repeat(255),
            resume: Some(Resume {
                grants,
                charged: Bytes(u64::MAX),
            }),
        });
        for request in [more, hello] {
            let len = crate::payload_len(u64::MAX, &request).unwrap();
            assert!(len <= crate::MAX_PAYLOAD, "{len} bytes");
        }
    }
}
