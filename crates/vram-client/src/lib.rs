//! vram-client: what a tenant process links to talk to vramd.
//!
//! [`Client::connect`] registers the process as a tenant; [`Client::grant`] takes a handle of
//! device memory, imported into this process and ready to map; [`Client::give_back`] returns
//! handles. The daemon may ask for idle memory back at any time: [`Client::on_reclaim`] installs
//! what answers it (the caching allocator's trim). [`Client::create_shared`] and
//! [`Client::open_shared`] reach shared buffers: one writer at a time under a lease, readers
//! pinning published versions read-only.

#![forbid(unsafe_code)]

pub mod alloc;
mod connection;
mod env;
mod error;
mod link;
mod shared;
mod transport;

pub use connection::{Client, Grant, Observer, ReclaimHandler, TenantOptions};
pub use error::ClientError;
pub use shared::{Draft, Pinned, SharedBuffer, WriterLease};
pub use vram_core::shared::{checksum, Acl, BufferId, BufferInfo, Principal, Version};

use std::path::PathBuf;

/// The daemon's socket: `VRAMD_SOCKET` if set, else the default path.
pub fn default_socket() -> PathBuf {
    std::env::var_os(vram_proto::SOCKET_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(vram_proto::DEFAULT_SOCKET))
}
