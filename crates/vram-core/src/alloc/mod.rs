//! The client's caching allocator, as pure single-threaded algorithms. The client crate wraps it
//! (locks, thread-local caches) and implements [`Backing`] with real handles and mappings.
//!
//! Model: one virtual reservation of `va_bytes` (virtual address space is free), seen here as
//! offsets. Physical memory comes from a [`Backing`] as handles, each a multiple of the device's
//! granularity and mapped whole. Handles are mapped side by side into a heap of the reservation
//! ("stitching"): handles that were never adjacent form one contiguous range, so a block may span
//! several, and free ranges merge across them. docs/ARCHITECTURE.md ("The allocator's policy")
//! says why the policy is what it is and what bounds each kind of waste it can create.
//!
//! - Placement (`placement.rs`): a request is rounded up to `align` and served best fit from the
//!   free regions its stream may use, in the small heap below [`SMALL_LIMIT`], else the large heap.
//! - Growth (`growth.rs`): when nothing fits, memory is mapped where it needs the least new memory,
//!   in a step that is the block's need except while memory in use climbs to a new peak; at the
//!   growth cap, wholly free handles are reused before more is taken.
//! - Release (`release.rs`): [`Allocator::tick`] gives back wholly free handles above the recent
//!   peak in use once they stayed there for `release_delay_us`; [`Allocator::trim`] all of them.
//! - Streams and fences (`stream.rs`, `fences.rs`): a block freed on stream `S` is reusable at
//!   once by `S`, and by other streams once a fence recorded on `S` at or after the free completes.
//! - Private pools (`pools.rs`): a block allocated into a pool (a CUDA graph's capture) goes back
//!   to that pool when freed, until the pool is released and settled.
//!
//! Invariants (checked by the property tests): live blocks never overlap; every byte of a live
//! block is mapped; a block is never handed to another stream before the fence of its free
//! completed; memory that work may still use (a free whose fence is pending) is never unmapped or
//! returned; after every block is freed, its fences completed and `trim` ran, every handle is
//! returned (but one whose unmap failed, which stays held and mapped where it was).

mod backing;
mod budget;
mod config;
mod fences;
mod freelist;
mod growth;
mod heap;
mod layout;
mod placement;
mod pools;
mod release;
mod stats;
mod stream;
#[cfg(test)]
mod tests;

use rustc_hash::FxHashMap;

pub use backing::{Backing, BackingCounts, CallCost, GrantId, ModelBacking, Refused};
pub use config::AllocConfig;
pub use fences::{MIXED_WINDOW, POLL_EVERY, RETIRED_STREAMS, SEAL_EVERY};
pub use layout::{BlockState, Segment, SegmentBlock};
pub use placement::SMALL_LIMIT;
pub use pools::{PoolId, POOL_STREAMS};
pub use stats::{AllocStats, FreeMemory};
pub use stream::{AlwaysComplete, Fence, Fences, StreamId};

use budget::Clock;
use fences::Fencing;
use freelist::Owner;
use growth::Climb;
use placement::{HeapKind, Heaps};
use pools::Pools;
use release::Release;
use stream::Seq;

use crate::Bytes;

/// A block handed out: `size` bytes (the request rounded up) at `offset` into the reservation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    pub offset: u64,
    pub size: Bytes,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    #[error("out of memory: asked for {requested} while holding {held} ({allocated} of it allocated): {source}")]
    OutOfMemory {
        requested: Bytes,
        held: Bytes,
        allocated: Bytes,
        source: Refused,
    },
    #[error("{requested} does not fit in the {va} virtual reservation")]
    TooLarge { requested: Bytes, va: Bytes },
    #[error("{offset:#x} is not the start of a live block")]
    UnknownBlock { offset: u64 },
    #[error("no private pool {pool:?} is in use (allocations into a pool come between its begin and its last release)")]
    UnknownPool { pool: (u64, u64) },
}

/// A live block's books.
#[derive(Clone, Copy, Debug)]
struct Live {
    len: u64,
    requested: u64,
    heap: HeapKind,
    /// The stream of the private pool it was allocated from (`pools.rs`).
    pool: Option<StreamId>,
}

/// The caching allocator. See the module documentation for the model and its invariants.
#[derive(Debug)]
pub struct Allocator<B> {
    config: AllocConfig,
    backing: B,
    heaps: Heaps,
    /// The live blocks by offset, looked up at every allocation and free past the thread caches:
    /// a fast hash without flood resistance, since the offsets are the allocator's own placements
    /// and it runs in the process whose allocations it places.
    live: FxHashMap<u64, Live>,
    /// The sequence number of the latest free.
    seq: Seq,
    stats: AllocStats,
    fencing: Fencing,
    pools: Pools,
    release: Release,
    climb: Climb,
    clock: Clock,
}

impl<B: Backing> Allocator<B> {
    /// # Panics
    /// If the granularity or alignment is zero or not a power of two, or the reservation is smaller
    /// than 16 granules.
    pub fn new(config: AllocConfig, backing: B) -> Self {
        let gran = config.granularity.get();
        assert!(gran.is_power_of_two() && config.align.get().is_power_of_two());
        assert!(config.va_bytes.get() >= 16 * gran);
        Self {
            heaps: Heaps::new(config.va_bytes.get(), gran),
            backing,
            live: FxHashMap::default(),
            seq: 0,
            stats: AllocStats::default(),
            fencing: Fencing::default(),
            pools: Pools::default(),
            release: Release::default(),
            climb: Climb::default(),
            clock: Clock::default(),
            config,
        }
    }

    /// The offsets of the small-request heap: every block below [`SMALL_LIMIT`] lies in it.
    pub fn small_heap(&self) -> std::ops::Range<u64> {
        self.heaps.get(HeapKind::Small).range()
    }

    pub fn config(&self) -> &AllocConfig {
        &self.config
    }

    pub fn stats(&self) -> AllocStats {
        self.stats
    }

    /// Starts the peaks over from the current values (PyTorch's `reset_peak_memory_stats`).
    pub fn reset_peaks(&mut self) {
        self.stats.reset_peaks();
    }

    /// The free memory held now, by where it lies. It walks every handle: a diagnostic (what a
    /// replay reports at its peak), not a statistic for every call.
    pub fn free_memory(&self) -> FreeMemory {
        let (whole, partly) = self.heaps.get(HeapKind::Large).free_by_handle();
        let small = self.heaps.get(HeapKind::Small).free_by_handle();
        FreeMemory {
            whole_handles: Bytes(whole),
            partly_used_handles: Bytes(partly),
            small_heap: Bytes(small.0 + small.1),
        }
    }

    /// The mapped memory as segments of blocks, large heap first, each in address order.
    pub fn segments(&self) -> Vec<Segment> {
        self.heaps
            .iter()
            .flat_map(|(kind, heap)| layout::segments(heap, &self.live, kind == HeapKind::Small))
            .collect()
    }

    /// The mapped handles as `(offset, len)`, large heap first, each in address order.
    pub fn handles(&self) -> Vec<(u64, u64)> {
        self.heaps
            .iter()
            .flat_map(|(_, h)| h.handles.iter().map(|(&va, m)| (va, m.len)))
            .collect()
    }

    pub fn backing(&self) -> &B {
        &self.backing
    }

    pub fn backing_mut(&mut self) -> &mut B {
        &mut self.backing
    }

    /// The size of the live block at `offset`.
    pub fn block_size(&self, offset: u64) -> Option<Bytes> {
        self.live.get(&offset).map(|b| Bytes(b.len))
    }

    /// A block of at least `size` bytes (a zero-byte request gets a distinct block too) for use on
    /// `stream`.
    pub fn alloc<F: Fences + ?Sized>(
        &mut self,
        size: Bytes,
        stream: StreamId,
        fences: &F,
    ) -> Result<Block, AllocError> {
        self.note_alloc(stream, fences);
        let len = size
            .get()
            .max(1)
            .checked_next_multiple_of(self.config.align.get())
            .filter(|&len| len <= self.config.va_bytes.get())
            .ok_or(AllocError::TooLarge {
                requested: size,
                va: self.config.va_bytes,
            })?;
        let heap = HeapKind::for_size(size);
        let start = self.place(heap, len, stream, fences)?;
        self.heaps.get_mut(heap).free.take(start, len);
        self.live.insert(
            start,
            Live {
                len,
                requested: size.get(),
                heap,
                pool: None,
            },
        );
        self.stats.on_alloc(len, size.get());
        self.release.allocated_since_tick = self
            .release
            .allocated_since_tick
            .max(self.stats.allocated.get());
        Ok(Block {
            offset: start,
            size: Bytes(len),
        })
    }

    /// Frees the block at `offset` on `stream`. `fence` was recorded on `stream` at the free and
    /// must complete only after all work that used the block: normally `stream` is the block's
    /// allocation stream and other users were made to wait on it (as PyTorch's `record_stream`).
    pub fn free<F: Fences + ?Sized>(
        &mut self,
        offset: u64,
        stream: StreamId,
        fence: Fence,
        fences: &F,
    ) -> Result<Bytes, AllocError> {
        let b = self.take_live(offset)?;
        if let Some(pool) = b.pool.filter(|&p| self.pools.is_active(p)) {
            return Ok(self.add_free(offset, b, Owner::Stream(pool), Seq::MAX));
        }
        let (owner, seq) = if fence == Fence::NEVER {
            // No fence will ever release it: a sequence number no completed fence reaches.
            self.stats.frees_in_capture += 1;
            (Owner::Stream(stream), Seq::MAX)
        } else if fences.is_complete(fence) {
            // Recorded at this free and passed: the stream's earlier deferred frees are done too.
            if let Some(u) = self.fencing.unsealed.remove(&stream) {
                for heap in self.heaps.iter_mut() {
                    heap.free.complete(stream, u.latest);
                }
            }
            (Owner::Any, 0)
        } else {
            // Recorded now, so it covers the stream's earlier deferred frees too.
            self.fencing.unsealed.remove(&stream);
            self.fencing.pending.push(stream, self.seq, fence);
            (Owner::Stream(stream), self.seq)
        };
        Ok(self.add_free(offset, b, owner, seq))
    }

    /// Frees the block at `offset` on `stream` without a fence of its own: `stream` may reuse it at
    /// once, other streams once a fence that the allocator records on `stream` later (with those of
    /// other deferred frees) completes. The caller records nothing, so a free costs no driver call.
    pub fn free_deferred<F: Fences + ?Sized>(
        &mut self,
        offset: u64,
        stream: StreamId,
        fences: &F,
    ) -> Result<Bytes, AllocError> {
        let b = self.take_live(offset)?;
        if let Some(pool) = b.pool.filter(|&p| self.pools.is_active(p)) {
            return Ok(self.add_free(offset, b, Owner::Stream(pool), Seq::MAX));
        }
        let freed = self.add_free(offset, b, Owner::Stream(stream), self.seq);
        self.note_deferred(stream, self.seq, fences);
        Ok(freed)
    }

    /// Takes the live block at `offset` out of the books for a free, under a new sequence number.
    fn take_live(&mut self, offset: u64) -> Result<Live, AllocError> {
        let b = self
            .live
            .remove(&offset)
            .ok_or(AllocError::UnknownBlock { offset })?;
        self.fencing.busy_since_tick = true;
        self.seq += 1;
        Ok(b)
    }

    /// Puts a freed block's memory into its heap's free regions; returns its length.
    fn add_free(&mut self, offset: u64, b: Live, owner: Owner, seq: Seq) -> Bytes {
        self.heaps
            .get_mut(b.heap)
            .free
            .insert(offset, b.len, owner, seq);
        self.stats.on_free(b.len, b.requested);
        Bytes(b.len)
    }

    /// Lets time pass (`now_us`, allocator time): returns wholly free memory above the recent peak
    /// of allocated bytes plus headroom, once it has stayed above it for `release_delay_us`.
    /// Returns the bytes given back. The time since the first tick is what the driver-time
    /// budget is a share of.
    pub fn tick<F: Fences + ?Sized>(&mut self, now_us: u64, fences: &F) -> Bytes {
        self.clock.observe(now_us);
        // A program that stopped allocating leaves its last deferred frees unfenced: fence them
        // now, so that their memory can go back. Only when idle since the last tick: a tick runs
        // on a background thread, and a busy program may be capturing a graph on another.
        if !std::mem::take(&mut self.fencing.busy_since_tick) {
            self.seal(fences);
        }
        self.poll(fences);
        match self.release_due(now_us) {
            0 => Bytes::ZERO,
            due => {
                let released = self.release_free(due);
                // What is due may lie behind frees no fence covers yet (a busy program on one
                // stream fences only before a growth): the program's next allocation fences
                // them, and a later tick gives back what they covered.
                if released < due && !self.fencing.unsealed.is_empty() {
                    self.fencing.seal_soon = true;
                }
                Bytes(released)
            }
        }
    }

    /// Fences every stream's deferred frees and returns every wholly free handle now (the
    /// daemon's reclaim request). Memory whose fence is still pending stays: a caller that would
    /// give it back too waits for the fences [`Self::fences_behind_free`] names after this, then
    /// trims again. Returns the bytes given back.
    pub fn trim<F: Fences + ?Sized>(&mut self, fences: &F) -> Bytes {
        self.seal(fences);
        self.poll(fences);
        Bytes(self.release_free(u64::MAX))
    }
}
