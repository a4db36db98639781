//! When the allocator records fences for deferred frees, and when it asks whether they completed.
//!
//! Deferred frees are fenced together: before growing, on `trim`, on a `tick` after a tick period
//! without allocations or frees (a background thread ticks, maybe while another thread captures a
//! graph: only an idle program is fenced from there), and — while allocations change streams
//! (within the last [`MIXED_WINDOW`] allocations) — every [`SEAL_EVERY`] frees of a stream. A
//! program on one stream (most training loops) thus records no fence in its steady state: no other
//! stream could use one. Fences are polled every [`POLL_EVERY`] allocations, and by any
//! allocation that finds no room.

use std::collections::BTreeMap;

use super::backing::Backing;
use super::stream::{Fences, PendingFences, Seq, StreamId};
use super::Allocator;

/// While allocations change streams, the deferred frees of one stream that one recorded fence
/// covers at most: fewer driver calls, against memory that other streams must wait longer for.
pub const SEAL_EVERY: u32 = 8;

/// Allocations that find room without growing ask whether pending fences completed only once per
/// this many (each asking is a driver call per stream with pending frees).
pub const POLL_EVERY: u32 = 8;

/// Allocations after the latest change of stream during which the allocator still counts the
/// program as using several streams (a side stream used once, as for a CUDA graph's warm-up, does
/// not cost a one-stream loop its fence-free steady state for good).
pub const MIXED_WINDOW: u64 = 10_000;

/// A stream's deferred frees that no fence covers yet.
#[derive(Clone, Copy, Debug)]
pub(super) struct Unsealed {
    /// The sequence number of the latest of them.
    pub latest: Seq,
    pub count: u32,
}

/// The fence books: fences pending, frees not yet fenced, and how streams take turns.
#[derive(Debug, Default)]
pub(super) struct Fencing {
    pub pending: PendingFences,
    pub unsealed: BTreeMap<StreamId, Unsealed>,
    /// Whether an allocation or free happened since the last tick.
    pub busy_since_tick: bool,
    /// Whether the next allocation fences the deferred frees: a tick found memory due to go back
    /// behind frees that no fence covers, which a busy program's tick may not fence itself.
    pub seal_soon: bool,
    /// Allocations since pending fences were last polled.
    pub allocs_since_poll: u32,
    /// The stream of the latest allocation, and the count of allocations when it last changed.
    pub last_stream: Option<StreamId>,
    pub switched_at: Option<u64>,
    /// Streams retired so far (see [`RETIRED_STREAMS`]).
    pub retired: u64,
}

/// The stream ids that the frees of destroyed streams are handed to (`Allocator::retire_stream`):
/// `RETIRED_STREAMS.start + n`, beside the pools' ([`super::POOL_STREAMS`]) and, like theirs,
/// outside every stream handle a caller passes.
pub const RETIRED_STREAMS: std::ops::Range<u64> = (1 << 62) + (1 << 32)..(1 << 62) + (1 << 33);

impl<B: Backing> Allocator<B> {
    /// Notes that an allocation is for `stream`, and polls fences if it is time.
    pub(super) fn note_alloc<F: Fences + ?Sized>(&mut self, stream: StreamId, fences: &F) {
        if self.fencing.seal_soon {
            self.seal(fences);
            // A stream under capture takes no fence now: asked again at the next allocation.
            self.fencing.seal_soon = !self.fencing.unsealed.is_empty();
        }
        let f = &mut self.fencing;
        f.busy_since_tick = true;
        if f.last_stream != Some(stream) {
            if f.last_stream.is_some() {
                f.switched_at = Some(self.stats.allocs);
            }
            f.last_stream = Some(stream);
        }
        f.allocs_since_poll += 1;
        if f.allocs_since_poll >= POLL_EVERY {
            self.poll(fences);
        }
    }

    /// Whether allocations changed stream within the last [`MIXED_WINDOW`] allocations.
    fn streams_mixed(&self) -> bool {
        self.fencing
            .switched_at
            .is_some_and(|at| self.stats.allocs - at < MIXED_WINDOW)
    }

    /// Counts a deferred free of `stream` under sequence `seq`, fencing the stream's deferred
    /// frees if streams take turns and it has [`SEAL_EVERY`] of them.
    pub(super) fn note_deferred<F: Fences + ?Sized>(
        &mut self,
        stream: StreamId,
        seq: Seq,
        fences: &F,
    ) {
        let entry = self.fencing.unsealed.entry(stream).or_insert(Unsealed {
            latest: seq,
            count: 0,
        });
        entry.latest = seq;
        entry.count += 1;
        if entry.count >= SEAL_EVERY && self.streams_mixed() {
            self.seal_stream(stream, fences);
        }
    }

    /// Records one fence on each stream with deferred frees, covering them all.
    pub(super) fn seal<F: Fences + ?Sized>(&mut self, fences: &F) {
        let streams: Vec<StreamId> = self.fencing.unsealed.keys().copied().collect();
        for stream in streams {
            self.seal_stream(stream, fences);
        }
    }

    fn seal_stream<F: Fences + ?Sized>(&mut self, stream: StreamId, fences: &F) {
        let Some(&Unsealed { latest, .. }) = self.fencing.unsealed.get(&stream) else {
            return;
        };
        // A stream being captured cannot take a fence now: its frees wait for a later seal.
        if let Some(fence) = fences.record(stream) {
            self.stats.fences += 1;
            self.fencing.unsealed.remove(&stream);
            self.fencing.pending.push(stream, latest, fence);
        }
    }

    /// `stream` is being destroyed (before the driver's call): its frees, reusable at once by
    /// `stream` or once its fences complete, go to a stream id of their own, fenced now. A stream
    /// created later may get the same handle, and must not take them before the work queued on
    /// the destroyed one is done. False, doing nothing, while `stream` is being captured: no
    /// fence can be recorded on it, and its frees stay its own.
    pub fn retire_stream<F: Fences + ?Sized>(&mut self, stream: StreamId, fences: &F) -> bool {
        self.seal_stream(stream, fences);
        if self.fencing.unsealed.contains_key(&stream) {
            return false;
        }
        let span = RETIRED_STREAMS.end - RETIRED_STREAMS.start;
        let retired = StreamId(RETIRED_STREAMS.start + self.fencing.retired % span);
        self.fencing.retired += 1;
        for heap in self.heaps.iter_mut() {
            heap.free.rename(stream, retired);
        }
        self.fencing.pending.rename(stream, retired);
        if self.fencing.last_stream == Some(stream) {
            self.fencing.last_stream = None;
        }
        self.poll(fences);
        true
    }

    /// Asks which pending fences completed, and lets every stream use what they cover.
    pub(super) fn poll<F: Fences + ?Sized>(&mut self, fences: &F) {
        self.fencing.allocs_since_poll = 0;
        if self.fencing.pending.is_empty() {
            return;
        }
        for (stream, seq) in self
            .fencing
            .pending
            .poll(fences, &mut self.stats.fence_queries)
        {
            for heap in self.heaps.iter_mut() {
                heap.free.complete(stream, seq);
            }
        }
    }
}
