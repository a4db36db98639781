//! Which heap a block goes in, and where in it: best fit among the free regions its stream may
//! use, growing the heap when none fits.
//!
//! Requests below [`SMALL_LIMIT`] live in a heap of their own, packed into granules of their own,
//! so that they do not pin holes among large blocks; the large heap's free memory then comes in
//! pieces a large block can use. Memory passes between the heaps only as wholly free handles.

use super::backing::Backing;
use super::heap::Heap;
use super::stream::{Fence, Fences, StreamId};
use super::{AllocError, Allocator};
use crate::Bytes;

/// Requests below this size are served from the small heap.
pub const SMALL_LIMIT: Bytes = Bytes::mib(1);

/// One of the allocator's heaps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HeapKind {
    /// Blocks of at least [`SMALL_LIMIT`].
    Large,
    /// Blocks below [`SMALL_LIMIT`].
    Small,
}

impl HeapKind {
    pub(crate) const ALL: [HeapKind; 2] = [HeapKind::Large, HeapKind::Small];

    /// The heap a request of `size` bytes goes in.
    pub(crate) fn for_size(size: Bytes) -> HeapKind {
        if size < SMALL_LIMIT {
            HeapKind::Small
        } else {
            HeapKind::Large
        }
    }
}

/// The heaps of one reservation: the large heap its first 15/16, the small heap the rest.
#[derive(Debug)]
pub(crate) struct Heaps {
    large: Heap,
    small: Heap,
}

impl Heaps {
    pub(crate) fn new(va_bytes: u64, gran: u64) -> Heaps {
        let split = va_bytes / 16 * 15 / gran * gran;
        let end = va_bytes / gran * gran;
        Heaps {
            large: Heap::new(0, split),
            small: Heap::new(split, end),
        }
    }

    pub(crate) fn get(&self, kind: HeapKind) -> &Heap {
        match kind {
            HeapKind::Large => &self.large,
            HeapKind::Small => &self.small,
        }
    }

    pub(crate) fn get_mut(&mut self, kind: HeapKind) -> &mut Heap {
        match kind {
            HeapKind::Large => &mut self.large,
            HeapKind::Small => &mut self.small,
        }
    }

    /// Every heap with its kind, large first.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (HeapKind, &Heap)> {
        HeapKind::ALL.into_iter().map(|k| (k, self.get(k)))
    }

    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = &mut Heap> {
        [&mut self.large, &mut self.small].into_iter()
    }
}

impl<B: Backing> Allocator<B> {
    /// Before a growth: where fences are pending on streams with free memory behind them (frees
    /// whose queued work the device has not yet passed), waits for them and lets every stream use
    /// what they cover. Memory behind a pending fence is usable at once only by its own stream and
    /// only where it lies: it cannot be moved (a handle is unmapped only once no queued work can
    /// touch it), merged with another stream's, or given back, so a growth that could have moved it
    /// would take new memory instead. With the wait, a device running behind the program sees the
    /// growth decisions of one that keeps pace, which is what a replay assumes; without it, every
    /// growth while frees sit fenced takes new memory (several percent of a training's peak,
    /// docs/benchmarks.md, "Frees the device has not passed"). The wait lasts until the device has
    /// passed the work queued so far (or the `Fences`' bound), at most once per growth. True if a
    /// pending fence completed in it.
    fn wait_for_fenced<F: Fences + ?Sized>(&mut self, fences: &F) -> bool {
        if self.fencing.pending.is_empty() {
            return false;
        }
        let mut completed = false;
        for fence in self.fences_behind_free() {
            completed |= fences.wait(fence);
        }
        if completed {
            self.stats.fence_waits += 1;
            self.poll(fences);
        }
        completed
    }

    /// The latest pending fence of each stream that has free memory behind one: waiting for these
    /// lets every stream use, move or give back all the free memory that waits on fences now (a
    /// stream none of whose free memory waits on its fences has nothing to give). A growth waits
    /// for them itself; after a [`Self::trim`], which fences every deferred free, they cover all
    /// the memory it left, and a threaded caller waits for them without holding the allocator.
    pub fn fences_behind_free(&self) -> Vec<Fence> {
        self.fencing
            .pending
            .latest()
            .into_iter()
            .filter(|&(stream, _)| self.heaps.iter().any(|(_, h)| h.free.fenced(stream)))
            .map(|(_, fence)| fence)
            .collect()
    }

    /// The start of a free region of heap `kind` where a block of `len` bytes fits for `stream`,
    /// growing the heap if none does.
    pub(super) fn place<F: Fences + ?Sized>(
        &mut self,
        kind: HeapKind,
        len: u64,
        stream: StreamId,
        fences: &F,
    ) -> Result<u64, AllocError> {
        if let Some(start) = self.heaps.get(kind).free.best_fit(len, stream) {
            return Ok(start);
        }
        // Frees whose fences completed may have made room (their regions merge once every
        // stream may use them).
        self.seal(fences);
        self.poll(fences);
        if let Some(start) = self.heaps.get(kind).free.best_fit(len, stream) {
            return Ok(start);
        }
        if self.wait_for_fenced(fences) {
            if let Some(start) = self.heaps.get(kind).free.best_fit(len, stream) {
                return Ok(start);
            }
        }
        if let Err(e) = self.grow_or_retry(kind, len, stream) {
            if matches!(e, AllocError::OutOfMemory { .. }) {
                self.stats.refused += 1;
            }
            return Err(e);
        }
        Ok(self
            .heaps
            .get(kind)
            .free
            .best_fit(len, stream)
            .expect("growth made room for the block"))
    }
}
