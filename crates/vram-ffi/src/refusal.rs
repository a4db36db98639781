//! Refusals the library makes itself, made visible to the operator.
//!
//! A request the daemon refuses (a grant, a charge) is counted by the daemon when it refuses it.
//! A request refused here never reaches the daemon: the allocator's own limit check (a request
//! that cannot fit under the limit however the heap were packed), a size the allocator cannot
//! serve, a call for another GPU. Those are sent to the daemon with [`Client::report_refusal`]
//! (without waiting), which counts them in `vramd status` and `vramd_tenant_refusals_total` and
//! logs one event. Each reason is also written to this process's stderr once, not on every call:
//! a program that retries a refused allocation in a loop would otherwise flood its log.

use std::collections::HashSet;
use std::sync::{LazyLock, Mutex};

use vram_core::alloc::AllocError;
use vram_core::Bytes;

use crate::Tenant;

/// The start of the reason the allocator's own limit check gives (`CachingAllocator::check_limit`
/// in vram-client): how a refusal made here is told from a grant the daemon refused.
const LIMIT_CHECK: &str = "the tenant's limit is ";

/// Writes `message` to stderr the first time `reason` is seen in this process.
pub(crate) fn log_once(reason: &str, message: &str) {
    static SEEN: LazyLock<Mutex<HashSet<String>>> = LazyLock::new(Default::default);
    let first = SEEN
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(reason.to_owned());
    if first {
        to_stderr(format_args!("{message} (reported once per reason)"));
    }
}

/// Writes a line to stderr and ignores failure: `eprintln!` panics where stderr is closed or
/// full, and this runs inside the program's CUDA calls, where no panic may go.
pub(crate) fn to_stderr(line: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// A refusal made in this library: logged once per reason, and reported to the daemon.
pub(crate) fn refused_here(t: &Tenant, bytes: Bytes, reason: &str, message: &str) {
    log_once(reason, message);
    // Nothing to do if it cannot be sent: the connection is gone, and the next call says so.
    if let Ok(client) = t.client() {
        let _ = client.report_refusal(bytes, reason, message);
    }
}

/// A refusal the daemon made (and counted): only logged once per reason.
pub(crate) fn refused_by_daemon(reason: &str, message: &str) {
    log_once(reason, message);
}

/// The message for an allocation of `size` the tenant's allocator refused, after logging it and,
/// where the refusal was made here, reporting it. `what` names the call (`cudaMalloc`, ...).
pub(crate) fn alloc_refused(t: &Tenant, what: &str, size: Bytes, e: &AllocError) -> String {
    let message = match t.client() {
        Ok(client) => {
            let w = client.welcome();
            format!(
                "vramd: tenant `{}` could not allocate {size}: {e} (limit {}, guarantee {}; \
                 {what})",
                w.name, w.limit, w.guarantee
            )
        }
        Err(ended) => format!("vramd: could not allocate {size}: {e} ({ended}; {what})"),
    };
    match e {
        AllocError::OutOfMemory { source, .. } if source.reason.starts_with(LIMIT_CHECK) => {
            refused_here(t, size, "over_limit", &message);
        }
        // A grant the daemon refused: it counted the refusal.
        AllocError::OutOfMemory { .. } => refused_by_daemon("grant_refused", &message),
        AllocError::TooLarge { .. } => refused_here(t, size, "bad_size", &message),
        AllocError::UnknownBlock { .. } | AllocError::UnknownPool { .. } => {
            refused_here(t, size, "other", &message)
        }
    }
    message
}
