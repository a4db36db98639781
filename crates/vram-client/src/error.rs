use vram_core::Bytes;
use vram_proto::{ErrorCode, ErrorReply, ProtoError};

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot reach vramd at {path}: {source} (is `vramd serve` running? set VRAMD_SOCKET to its socket)")]
    Connect {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The daemon refused (quota, admission, permission, ...). `reply.message` has the numbers.
    #[error("{0}")]
    Daemon(ErrorReply),
    #[error("connection to vramd lost: {0}")]
    Lost(String),
    /// The daemon took the request but did not answer it in time (stopped, or wedged).
    #[error(
        "vramd took the request but did not answer within {} s: is the daemon stopped \
         (`kill -CONT` it) or overloaded?",
        waited.as_secs()
    )]
    NoAnswer { waited: std::time::Duration },
    #[error("protocol error: {0}")]
    Proto(#[from] ProtoError),
    #[error("device error: {0}")]
    Device(#[from] vram_device::DeviceError),
    #[error("the daemon sent an unexpected reply to {request}: {reply}")]
    Unexpected {
        request: &'static str,
        reply: String,
    },
    /// A variable of the tenant's environment that does not parse, or one no longer read.
    #[error("{0}")]
    Environment(String),
    #[error("the daemon granted {got} but {want} was asked for")]
    Short { got: Bytes, want: Bytes },
}

impl ClientError {
    /// Whether this is the daemon refusing memory by policy (the caller's clean out-of-memory).
    pub fn is_refusal(&self) -> bool {
        matches!(self, ClientError::Daemon(r) if r.code == ErrorCode::Refused)
    }
}
