//! Shared-buffer messages: one request and one reply variant in the main enums, so a session hands
//! them to the daemon's shared-buffer module whole. The books' types come from `vram-core`.

use serde::{Deserialize, Serialize};
use vram_core::shared::{Acl, BufferId, BufferInfo, Version};
use vram_core::Bytes;

/// What to do with a writer lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LeaseOp {
    /// Take it (or renew it, if this tenant holds it) for `ttl_ms`.
    Acquire,
    /// Extend a lease this tenant still holds; one that ran out is lost.
    Renew,
    /// Give it up; an unpublished draft is discarded.
    Release,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum SharedRequest {
    /// A new, empty buffer owned by this tenant; `size` is rounded up to the device granularity.
    Create {
        name: String,
        size: Bytes,
        acl: Acl,
    },
    Open {
        name: String,
    },
    /// The buffers this tenant may read or write, in id order from the first after `after` (from
    /// the first when `None`): as many as one reply carries, `Buffers::next` saying where the
    /// next page starts.
    List {
        after: Option<BufferId>,
    },
    /// Owner only. Pinned versions stay until released.
    Delete {
        buffer: BufferId,
    },
    Lease {
        buffer: BufferId,
        op: LeaseOp,
        ttl_ms: u32,
    },
    /// Fresh memory for the next version, written from `base` (the current version the writer
    /// started from; `None` before the first publish). Answered with `Draft` and a read-write fd.
    BeginWrite {
        buffer: BufferId,
        base: Option<Version>,
    },
    /// Makes the draft current. The daemon computes the checksum; one given here must match it.
    Publish {
        buffer: BufferId,
        version: Version,
        checksum: Option<u64>,
    },
    /// The current version, pinned until `Unpin`. Answered with `Pinned` and a read-only fd.
    Pin {
        buffer: BufferId,
    },
    Unpin {
        buffer: BufferId,
        version: Version,
    },
    /// The daemon re-reads a held version and compares it with its checksum at publish.
    Verify {
        buffer: BufferId,
        version: Version,
    },
    /// Answers once a version newer than `than` is published, or after `timeout_ms`.
    WaitNewer {
        buffer: BufferId,
        than: Option<Version>,
        timeout_ms: u32,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum SharedReply {
    Buffer(Box<BufferInfo>),
    /// A page of `List`: `next` is the `after` of the next page, `None` on the last.
    Buffers {
        buffers: Vec<BufferInfo>,
        next: Option<BufferId>,
    },
    /// The lease is this tenant's for `ttl_ms` more.
    Lease {
        ttl_ms: u64,
    },
    /// Draft memory for `version`; its fd (read-write) travels with this frame.
    Draft {
        version: Version,
        size: Bytes,
    },
    Published {
        version: Version,
        checksum: u64,
    },
    /// A pinned version; its fd travels with this frame (read-only on the host backend).
    Pinned {
        version: Version,
        size: Bytes,
        checksum: u64,
    },
    Verified {
        version: Version,
        expected: u64,
        actual: u64,
    },
    /// The newer version, or `None` if the wait timed out.
    Newer(Option<Version>),
    Done,
    /// Sent unsolicited (envelope id 0) to the buffer's owner and to the readers that pinned the
    /// version, when the daemon finds a published version no longer matching its checksum.
    Corrupted(Corruption),
}

/// A published version found changed since publish.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Corruption {
    pub buffer: BufferId,
    pub name: String,
    pub version: Version,
    /// The checksum at publish, and the one the daemon computed now.
    pub expected: u64,
    pub actual: u64,
    /// What found it: `verify` (a tenant asked) or `scrub` (the daemon's background re-reads).
    pub found_by: String,
}

/// The shared-buffer part of the status report.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedStatus {
    /// Every buffer of every device, deleted ones still holding pinned versions included.
    pub buffers: Vec<SharedBufferStatus>,
    pub scrub: ScrubStatus,
    /// Publishes since start, and the bytes checksummed for them.
    pub publishes: u64,
    pub publish_bytes: u64,
    /// Writer conflicts refused (lease held, lease lost, stale base).
    pub conflicts: u64,
    /// Leases that ran out unrenewed (a writer died or stopped renewing); their drafts were
    /// discarded.
    pub leases_expired: u64,
    /// Buffers left out of `buffers` so that the report fits in one frame.
    #[serde(default)]
    pub buffers_left_out: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedBufferStatus {
    pub gpu: u32,
    pub info: BufferInfo,
    /// Entries of the access list (readers and writers) left out of `info.acl` so that the report
    /// fits in one frame.
    #[serde(default)]
    pub acl_left_out: u32,
}

/// The background scrub's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScrubStatus {
    /// Configured rate in bytes per second (0: off).
    pub rate: u64,
    pub passes: u64,
    pub bytes: u64,
    pub versions: u64,
    /// Published versions whose bytes no longer match their checksum.
    pub mismatches: u64,
}
