//! Typed refusals of the shared-buffer books. Each message names the buffer and the numbers (the
//! current version, the lease holder) a caller needs to act on it.

use serde::{Deserialize, Serialize};

use super::Version;
use crate::broker::GrantError;

/// Why a shared-buffer operation was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum SharedError {
    #[error("unknown tenant id {0}")]
    UnknownTenant(u64),
    #[error("invalid shared buffer name `{name}`: {reason}")]
    BadName { name: String, reason: &'static str },
    #[error(
        "shared buffer `{buffer}`: its access list names {kind} `{}` that no name can be: {reason}",
        shown_entry(entry)
    )]
    BadAccessEntry {
        buffer: String,
        kind: &'static str,
        entry: String,
        reason: &'static str,
    },
    #[error("a shared buffer named `{name}` already exists (owner `{owner}`)")]
    NameInUse { name: String, owner: String },
    #[error("no shared buffer `{0}`")]
    NoSuchBuffer(String),
    #[error("tenant `{tenant}` may not {what} shared buffer `{buffer}` (owner `{owner}`){hint}")]
    Forbidden {
        tenant: String,
        buffer: String,
        owner: String,
        what: &'static str,
        /// Why an access-list entry naming the tenant or its class did not admit it, if one did.
        hint: &'static str,
    },
    #[error(
        "shared buffer `{buffer}`: tenant `{holder}` holds the writer lease for {expires_in_ms} ms more; \
         current version {}", show(*current)
    )]
    LeaseHeld {
        buffer: String,
        holder: String,
        expires_in_ms: u64,
        current: Option<Version>,
    },
    #[error(
        "shared buffer `{buffer}`: tenant `{tenant}` does not hold the writer lease (never taken, \
         released, or expired); current version {}", show(*current)
    )]
    NoLease {
        buffer: String,
        tenant: String,
        current: Option<Version>,
    },
    #[error(
        "shared buffer `{buffer}`: the write started from version {} but the current version is {}",
        show(*base), show(*current)
    )]
    StaleBase {
        buffer: String,
        base: Option<Version>,
        current: Option<Version>,
    },
    #[error(
        "shared buffer `{buffer}`: version {version} is not the writer's draft (draft: {}; current \
         version {})", show(*draft), show(*current)
    )]
    NoDraft {
        buffer: String,
        version: Version,
        draft: Option<Version>,
        current: Option<Version>,
    },
    #[error("shared buffer `{0}` has no published version yet")]
    NothingPublished(String),
    #[error(
        "shared buffer `{buffer}`: its current version {version} no longer matches its checksum \
         (found by the scrub or a verify); none is pinned until the writer publishes another"
    )]
    Corrupt { buffer: String, version: Version },
    #[error("shared buffer `{buffer}`: this tenant holds no pin on version {version}")]
    NotPinned { buffer: String, version: Version },
    #[error("shared buffer `{buffer}`: version {version} is not held (freed, or never published)")]
    NoSuchVersion { buffer: String, version: Version },
    #[error("shared buffer `{buffer}`: {what} ({asked}); at most {max}")]
    TooMany {
        buffer: String,
        what: &'static str,
        asked: usize,
        max: usize,
    },
    #[error("shared buffer `{buffer}`: {source}")]
    Memory {
        buffer: String,
        #[source]
        source: GrantError,
    },
}

/// An access-list entry as a message shows it: whole up to twice the longest name, else its start
/// and its length (an entry can be as long as a frame).
fn shown_entry(entry: &str) -> String {
    const SHOWN: usize = 128;
    if entry.len() <= SHOWN {
        return entry.to_string();
    }
    let mut end = SHOWN;
    while !entry.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... ({} bytes)", &entry[..end], entry.len())
}

fn show(v: Option<Version>) -> String {
    v.map_or_else(|| "none".to_string(), |v| v.0.to_string())
}

impl SharedError {
    /// A short, stable name for programs and metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            SharedError::UnknownTenant(_) => "unknown_tenant",
            SharedError::BadName { .. } | SharedError::BadAccessEntry { .. } => "bad_name",
            SharedError::NameInUse { .. } => "name_in_use",
            SharedError::NoSuchBuffer(_) => "no_such_buffer",
            SharedError::Forbidden { .. } => "forbidden",
            SharedError::LeaseHeld { .. } => "lease_held",
            SharedError::NoLease { .. } => "no_lease",
            SharedError::StaleBase { .. } => "stale_base",
            SharedError::NoDraft { .. } => "no_draft",
            SharedError::NothingPublished(_) => "nothing_published",
            SharedError::Corrupt { .. } => "corrupt",
            SharedError::NotPinned { .. } => "not_pinned",
            SharedError::NoSuchVersion { .. } => "no_such_version",
            SharedError::TooMany { .. } => "too_many",
            SharedError::Memory { source, .. } => source.reason(),
        }
    }

    /// Whether this is a writer conflict: another's lease, a lost lease, a stale base.
    pub fn is_conflict(&self) -> bool {
        matches!(
            self,
            SharedError::LeaseHeld { .. }
                | SharedError::NoLease { .. }
                | SharedError::StaleBase { .. }
                | SharedError::NoDraft { .. }
        )
    }
}
