//! Trace replay: runs a trace's allocations and frees through the allocator against a counting
//! backing, and reports fragmentation and the driver time the backing calls would cost.
//!
//! Fragmentation is `1 - peak live requested bytes / peak bytes held` (held: granted and not yet
//! returned, whether used, cached or mapped), so the allocator's rounding counts against it.
//! Frees in a snapshot are `free_completed`: the work on them has finished, so every fence is
//! complete at once. Each distinct stream value of the trace is a stream.
//!
//! Blocks live when the trace's history began are allocated first and count in the peaks; the
//! calls that placing them made happened before the history (a program loading its weights), so
//! the driver time counts from the first event of the history on.

mod cost;
#[cfg(test)]
mod tests;

use std::collections::HashMap;

pub use cost::CostModel;

use crate::alloc::{
    AllocConfig, AllocError, AllocStats, Allocator, AlwaysComplete, BackingCounts, Fence,
    FreeMemory, ModelBacking, StreamId,
};
use crate::trace::{Action, Trace};
use crate::Bytes;

/// What one replay measured. Sizes are in bytes, times in microseconds.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ReplayResult {
    pub trace: String,
    pub events: usize,
    pub skipped_frees: usize,
    /// Blocks live when the trace's history began (a ring buffer's snapshot of a long run), and
    /// their requested bytes: allocated first, in address order, and counted in `peak_requested`.
    pub before_history_blocks: usize,
    pub before_history_bytes: u64,
    pub peak_requested: u64,
    pub peak_held: u64,
    pub fragmentation: f64,
    /// Handles granted, and the daemon requests that granted them (one per growth).
    pub grants: u64,
    pub grant_requests: u64,
    pub maps: u64,
    pub unmaps: u64,
    pub returns: u64,
    pub mapped_bytes: u64,
    pub wall_us: u64,
    /// Driver time under `cost_model`, and its share of the trace's wall time (none, `null` in
    /// JSON, for a trace whose events carry no times).
    pub cost_model: &'static str,
    pub modelled_driver_us: f64,
    pub modelled_driver_time_share: Option<f64>,
    /// The same share under docs/design.md's cost table as written (set-access per MiB).
    pub design_table_driver_time_share: Option<f64>,
    /// Where the memory held lay when it was at its highest.
    pub held_at_peak: HeldAtPeak,
}

/// The memory held at its highest, by where it lay, at the moment of that peak when the live
/// blocks' requested bytes were highest (so its free memory is the waste that the fragmentation
/// figure counts): those bytes, what the allocator had handed out beyond them, and its free memory
/// by kind. The four add up to `held`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct HeldAtPeak {
    pub held: u64,
    pub requested: u64,
    /// Allocated beyond the requested bytes: rounding to the block alignment, and blocks waiting
    /// in a caching allocator's thread caches.
    pub allocated_beyond_requested: u64,
    pub free: FreeMemory,
}

impl HeldAtPeak {
    /// Takes the allocator as it is now when `held` and the live blocks' `requested` bytes pass
    /// the peak kept so far (memory held first, then live bytes); `read` gives the allocator's
    /// counters and free memory, and is called only then.
    pub fn observe(
        &mut self,
        held: u64,
        requested: u64,
        read: impl FnOnce() -> (AllocStats, FreeMemory),
    ) {
        if (held, requested) > (self.held, self.requested) {
            let (stats, free) = read();
            *self = HeldAtPeak {
                held: stats.held.get(),
                requested,
                allocated_beyond_requested: stats.allocated.get().saturating_sub(requested),
                free,
            };
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("trace `{trace}`, event {index}: {source}")]
    Alloc {
        trace: String,
        index: usize,
        source: AllocError,
    },
}

/// How often the progress callback is called, in events.
const PROGRESS_EVERY: usize = 4096;

/// Replays `trace` (named `name` in the result) through an allocator built from `config`, on a
/// backing without a capacity, priced with `costs`. `progress(done, total)` is called every few
/// thousand events and once at the end.
pub fn replay(
    name: &str,
    trace: &Trace,
    config: &AllocConfig,
    costs: &CostModel,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<ReplayResult, ReplayError> {
    let mut a = Allocator::new(config.clone(), ModelBacking::priced(*costs));
    let mut blocks: HashMap<u64, u64> = HashMap::new();
    let total = trace.events.len();
    let mut at_history = BackingCounts::default();
    let mut at_peak = HeldAtPeak::default();
    for (index, e) in trace.events.iter().enumerate() {
        if index == trace.before_history {
            at_history = a.backing().counts();
        }
        let err = |source| ReplayError::Alloc {
            trace: name.to_string(),
            index,
            source,
        };
        let stream = StreamId(e.stream);
        match e.action {
            Action::Alloc => {
                let b = a
                    .alloc(Bytes(e.size), stream, &AlwaysComplete)
                    .map_err(err)?;
                blocks.insert(e.addr, b.offset);
            }
            Action::Free => {
                let offset = blocks
                    .remove(&e.addr)
                    .expect("trace frees only what it allocated");
                a.free(offset, stream, Fence(0), &AlwaysComplete)
                    .map_err(err)?;
            }
        }
        a.tick(e.time_us, &AlwaysComplete);
        let st = a.stats();
        at_peak.observe(st.held.get(), st.requested.get(), || (st, a.free_memory()));
        if index % PROGRESS_EVERY == 0 {
            progress(index, total);
        }
    }
    progress(total, total);
    let stats = a.stats();
    if total == trace.before_history {
        at_history = a.backing().counts();
    }
    let counts = a.backing().counts().since(&at_history);
    let peak_held = a.backing().peak_held().get();
    let peak_requested = stats.requested_peak.get();
    Ok(ReplayResult::new(
        name,
        trace,
        peak_requested,
        peak_held,
        &counts,
        costs,
        at_peak,
    ))
}

impl ReplayResult {
    /// The figures of a replay of `trace` whose backing made the calls in `counts`.
    pub fn new(
        name: &str,
        trace: &Trace,
        peak_requested: u64,
        peak_held: u64,
        counts: &BackingCounts,
        costs: &CostModel,
        held_at_peak: HeldAtPeak,
    ) -> ReplayResult {
        let wall_us = trace.wall_us();
        let modelled = costs.driver_us(counts);
        ReplayResult {
            trace: name.to_string(),
            events: trace.events.len(),
            skipped_frees: trace.skipped_frees,
            before_history_blocks: trace.before_history,
            before_history_bytes: trace.before_history_bytes(),
            peak_requested,
            peak_held,
            fragmentation: if peak_held == 0 {
                0.0
            } else {
                1.0 - peak_requested as f64 / peak_held as f64
            },
            grants: counts.grants,
            grant_requests: counts.grant_requests,
            maps: counts.maps,
            unmaps: counts.unmaps,
            returns: counts.releases,
            mapped_bytes: counts.mapped_bytes,
            wall_us,
            cost_model: costs.name,
            modelled_driver_us: modelled,
            modelled_driver_time_share: trace.share_of_wall(modelled),
            design_table_driver_time_share: trace
                .share_of_wall(CostModel::DESIGN_TABLE.driver_us(counts)),
            held_at_peak,
        }
    }
}
