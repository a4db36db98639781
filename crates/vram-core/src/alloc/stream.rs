//! Streams and fences: when a freed block may be handed to another stream.
//!
//! A block freed on stream `S` may be reused at once by `S` (its later work is ordered after the
//! free), but by another stream only once the work queued on `S` at the free has finished. That
//! work is fenced by a [`Fence`] recorded on `S` at or after the free: either the caller records it
//! at the free and passes it in, or the free is deferred and the allocator records one fence later
//! that covers every deferred free of `S` before it (a stream runs its work in order), so most
//! frees cost no driver call at all. Fences of one stream must complete in the order they were
//! recorded (true of CUDA events recorded on one stream), so a completed fence implies every
//! earlier fence of that stream completed too.

use std::collections::{BTreeMap, VecDeque};

/// An opaque stream id (a `cudaStream_t` on CUDA, any number on the host backend).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub struct StreamId(pub u64);

/// An opaque event recorded on the freeing stream at or after a free.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Fence(pub u64);

impl Fence {
    /// A fence that never completes: for a block freed while its stream is captured into a CUDA
    /// graph, whose replays may still use it. Only that stream may ever reuse the block.
    pub const NEVER: Fence = Fence(u64::MAX);
}

/// Records fences and answers whether they have completed. Implemented by the caller (CUDA events,
/// or a test).
pub trait Fences {
    fn is_complete(&self, fence: Fence) -> bool;

    /// Records a fence on `stream` now, after all work queued on it so far; `None` when none can be
    /// recorded now (the stream is being captured into a graph): the allocator tries again later.
    fn record(&self, stream: StreamId) -> Option<Fence>;

    /// Waits until `fence` completes: true if it did. An implementation may bound the wait, or
    /// not wait at all (this default); the allocator then grows as it would have. The allocator
    /// waits only before a growth, for the latest pending fence of each stream that has free
    /// memory behind it; a trim's caller may wait for the same (`Allocator::fences_behind_free`).
    fn wait(&self, _fence: Fence) -> bool {
        false
    }
}

/// A `Fences` for callers whose frees are always already complete (trace replay, synchronous use).
#[derive(Clone, Copy, Debug, Default)]
pub struct AlwaysComplete;

impl Fences for AlwaysComplete {
    fn is_complete(&self, _: Fence) -> bool {
        true
    }

    fn record(&self, _: StreamId) -> Option<Fence> {
        Some(Fence(0))
    }

    fn wait(&self, _: Fence) -> bool {
        true
    }
}

/// Sequence number of a free whose fence has not been seen complete; larger is later.
pub(crate) type Seq = u64;

/// Frees waiting on fences, per stream, oldest first.
#[derive(Debug, Default)]
pub(crate) struct PendingFences {
    queues: BTreeMap<StreamId, VecDeque<(Seq, Fence)>>,
}

impl PendingFences {
    pub(crate) fn push(&mut self, stream: StreamId, seq: Seq, fence: Fence) {
        self.queues
            .entry(stream)
            .or_default()
            .push_back((seq, fence));
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.queues.is_empty()
    }

    /// The latest pending fence of each stream: once it completes, so have the stream's earlier
    /// ones.
    pub(crate) fn latest(&self) -> Vec<(StreamId, Fence)> {
        self.queues
            .iter()
            .filter_map(|(&stream, q)| q.back().map(|&(_, fence)| (stream, fence)))
            .collect()
    }

    /// Moves the fences pending on stream `from` to stream `to`, which has none.
    pub(crate) fn rename(&mut self, from: StreamId, to: StreamId) {
        if let Some(queue) = self.queues.remove(&from) {
            self.queues.insert(to, queue);
        }
    }

    /// For each stream, the latest sequence number whose fence has completed. Stops at a stream's
    /// first incomplete fence: later ones cannot be complete before it. `queries` counts the
    /// fences asked about.
    pub(crate) fn poll<F: Fences + ?Sized>(
        &mut self,
        fences: &F,
        queries: &mut u64,
    ) -> Vec<(StreamId, Seq)> {
        let mut done = Vec::new();
        self.queues.retain(|&stream, queue| {
            let mut last = None;
            while let Some(&(seq, fence)) = queue.front() {
                *queries += 1;
                if !fences.is_complete(fence) {
                    break;
                }
                last = Some(seq);
                queue.pop_front();
            }
            if let Some(seq) = last {
                done.push((stream, seq));
            }
            !queue.is_empty()
        });
        done
    }
}
