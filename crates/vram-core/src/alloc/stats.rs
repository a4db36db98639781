//! Counters the allocator keeps; PyTorch-style `memory_stats` are built from them.

use super::BackingCounts;
use crate::Bytes;

/// A snapshot of the allocator's counters. `allocated` counts rounded block sizes, `requested`
/// the sizes asked for; `held` is memory granted and not yet returned (mapped, used or cached);
/// `cached` is `held - allocated`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct AllocStats {
    pub allocated: Bytes,
    pub allocated_peak: Bytes,
    pub requested: Bytes,
    pub requested_peak: Bytes,
    pub held: Bytes,
    pub held_peak: Bytes,
    pub cached: Bytes,
    pub allocs: u64,
    pub frees: u64,
    /// Handles granted, and the requests that granted them (one per growth).
    pub grants: u64,
    pub grant_requests: u64,
    pub maps: u64,
    pub unmaps: u64,
    pub returns: u64,
    pub granted_bytes: Bytes,
    pub mapped_bytes: Bytes,
    pub refused: u64,
    /// Fences the allocator recorded for deferred frees (one covers a batch of a stream's).
    pub fences: u64,
    /// Times the allocator asked whether a pending fence completed (a driver call each on CUDA).
    /// Neither counts a fence a caller passes to `free`.
    pub fence_queries: u64,
    /// Waits for the pending fences before a growth, so that the memory behind them could serve
    /// it instead (counted where a fence completed in the wait).
    pub fence_waits: u64,
    /// Allocations into private pools (CUDA graphs' captures), counted in `allocs` too.
    pub pool_allocs: u64,
    /// Frees of blocks no pool holds while their stream was being captured (`Fence::NEVER`):
    /// kept for that stream for good. Counted in `frees` too.
    pub frees_in_capture: u64,
}

/// The free memory an allocator holds, by where it lies: the kinds of waste its policy bounds
/// (docs/ARCHITECTURE.md, "The allocator's policy"). The three add up to `held - allocated`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct FreeMemory {
    /// In large-heap handles that hold no live block: cached for reuse, and what goes back when
    /// memory is given back.
    pub whole_handles: Bytes,
    /// In large-heap handles that also hold a live block: a handle goes back only whole, so this
    /// stays until the block is freed.
    pub partly_used_handles: Bytes,
    /// In the small-request heap, whole handles or not: only blocks under 1 MiB use it.
    pub small_heap: Bytes,
}

impl AllocStats {
    /// The calls the allocator made to its backing, counted as a backing counts them.
    pub fn calls(&self) -> BackingCounts {
        BackingCounts {
            grants: self.grants,
            grant_requests: self.grant_requests,
            maps: self.maps,
            unmaps: self.unmaps,
            releases: self.returns,
            granted_bytes: self.granted_bytes.get(),
            mapped_bytes: self.mapped_bytes.get(),
        }
    }

    pub(crate) fn reset_peaks(&mut self) {
        self.allocated_peak = self.allocated;
        self.requested_peak = self.requested;
        self.held_peak = self.held;
    }

    pub(crate) fn on_alloc(&mut self, rounded: u64, requested: u64) {
        self.allocs += 1;
        self.allocated += Bytes(rounded);
        self.requested += Bytes(requested);
        self.allocated_peak = self.allocated_peak.max(self.allocated);
        self.requested_peak = self.requested_peak.max(self.requested);
        self.cached = self.held.saturating_sub(self.allocated);
    }

    pub(crate) fn on_free(&mut self, rounded: u64, requested: u64) {
        self.frees += 1;
        self.allocated -= Bytes(rounded);
        self.requested -= Bytes(requested);
        self.cached = self.held.saturating_sub(self.allocated);
    }

    pub(crate) fn on_grant(&mut self, bytes: u64) {
        self.grants += 1;
        self.granted_bytes += Bytes(bytes);
        self.held += Bytes(bytes);
        self.held_peak = self.held_peak.max(self.held);
        self.cached = self.held.saturating_sub(self.allocated);
    }

    pub(crate) fn on_map(&mut self, bytes: u64) {
        self.maps += 1;
        self.mapped_bytes += Bytes(bytes);
    }

    pub(crate) fn on_return(&mut self, bytes: u64) {
        self.returns += 1;
        self.held -= Bytes(bytes);
        self.cached = self.held.saturating_sub(self.allocated);
    }
}
