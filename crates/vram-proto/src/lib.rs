//! vram-proto: how tenants, tools and the daemon talk. Specified in `docs/protocol.md`.
//!
//! A frame is a 12-byte header (magic `VRMD`, protocol version, number of file descriptors that
//! travel with it, payload length) followed by a postcard-encoded [`Envelope`]. File descriptors
//! (exported memory handles) travel as `SCM_RIGHTS` ancillary data and are matched to frames by
//! the header's count, never by where the kernel happened to deliver them.
#![forbid(unsafe_code)]

mod conn;
mod frame;
mod message;
mod shared;
mod status;

pub use conn::{payload_len, Conn, Received, DEFAULT_FRAME_TIMEOUT};
pub use frame::{FrameHeader, HEADER_LEN, MAGIC};
pub use message::{
    Budget, Declaration, DeviceDesc, Envelope, ErrorCode, ErrorReply, ExitStatus, GrantId, Hello,
    Reply, Request, Resume, Role, Welcome, RESUME_PART,
};
pub use shared::{
    Corruption, LeaseOp, ScrubStatus, SharedBufferStatus, SharedReply, SharedRequest, SharedStatus,
};
pub use status::{
    DaemonInfo, DeviceStatus, KeptOffline, OutsideProcess, PoolTakes, StatusReport, TenantStatus,
};
/// Which backend a device is, as messages and the status report carry it.
pub use vram_device::BackendKind;

/// The protocol version this build speaks. A peer speaking another gets an error and is closed.
pub const PROTOCOL_VERSION: u16 = 6;

/// The largest payload accepted, in bytes. Anything larger is refused and the connection closed.
pub const MAX_PAYLOAD: usize = 256 * 1024;

/// The most file descriptors one frame may carry.
pub const MAX_FDS: usize = 16;

/// Where the daemon listens unless told otherwise (`VRAMD_SOCKET` or `--socket`).
pub const DEFAULT_SOCKET: &str = "/run/vramd/vramd.sock";

pub mod env;
pub use env::{GPU as GPU_ENV, JOIN as JOIN_ENV, SOCKET as SOCKET_ENV, TENANT as TENANT_ENV};

/// Errors of the protocol layer.
#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    #[error("connection closed by peer")]
    Closed,
    #[error("peer closed the connection in the middle of a frame ({got} of {want} bytes)")]
    Truncated { got: usize, want: usize },
    #[error("bad magic {0:02x?}: not a vramd peer")]
    BadMagic([u8; 4]),
    #[error("peer speaks protocol version {theirs}; this side speaks {ours}")]
    Version { theirs: u16, ours: u16 },
    #[error("frame of {len} bytes exceeds the limit of {max}")]
    Oversized { len: usize, max: usize },
    #[error("frame announces {count} file descriptors; at most {max} are allowed")]
    TooManyFds { count: usize, max: usize },
    #[error("frame announces {announced} file descriptors but {received} arrived")]
    MissingFds { announced: usize, received: usize },
    #[error("{count} file descriptors arrived that no frame announced")]
    UnannouncedFds { count: usize },
    #[error("malformed message: {0}")]
    Decode(String),
    #[error("peer took more than {0:?} to send one frame")]
    Stalled(std::time::Duration),
    #[error("no frame began within {0:?}")]
    Idle(std::time::Duration),
    #[error("peer did not take a frame within {0:?}: it does not read its socket")]
    SendTimeout(std::time::Duration),
    #[error("nothing sent: the peer's socket is full or another frame is being sent")]
    WouldBlock,
    #[error("socket error: {0}")]
    Io(#[from] std::io::Error),
}

impl ProtoError {
    /// Whether the stream can still be trusted after this error (the frame boundary is known).
    pub fn is_recoverable(&self) -> bool {
        matches!(self, ProtoError::Decode(_))
    }
}
