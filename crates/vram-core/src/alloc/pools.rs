//! Private pools: the memory a CUDA graph allocates while it is captured stays the graph's until
//! the graph is released, as in PyTorch's own allocator.
//!
//! A graph's replays write the blocks its capture allocated at the addresses they had then, even
//! after the program freed them (a graph's intermediate values are freed during the capture). So a
//! block allocated into a pool goes back to that pool when it is freed, during the capture or
//! after it, and only allocations into the same pool (later captures that share it) may reuse it.
//! A pool takes memory every stream may use (work on it has completed) and never gives its own to
//! anyone else, to the daemon included, until it is released and then settled: its last use ends
//! (each `pool_begin` counts one use, each `pool_release` ends one), and the caller has waited for
//! the device to finish the work queued so far (a replay may still be running), since no fence
//! says when a graph's last replay is done.
//!
//! Inside the free list a pool is a stream of its own whose frees no fence releases (sequence
//! `Seq::MAX`, as a free during a capture). Its stream ids lie in a range of their own
//! ([`POOL_STREAMS`]) that no stream handle a caller passes may use.

use std::collections::HashMap;

use super::backing::Backing;
use super::stream::{Fences, StreamId};
use super::{AllocError, Allocator, Block};
use crate::Bytes;

/// A private pool, named by the caller (PyTorch's `MempoolId_t`: two numbers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PoolId(pub u64, pub u64);

/// The stream ids the allocator gives its pools: `POOL_STREAMS.start + n`. Callers' stream ids
/// must lie outside it (stream handles are addresses or small numbers).
pub const POOL_STREAMS: std::ops::Range<u64> = 1 << 62..(1 << 62) + (1 << 32);

#[derive(Debug)]
struct Pool {
    stream: StreamId,
    uses: u32,
}

/// The pools in use, and those released but not yet settled.
#[derive(Debug, Default)]
pub(super) struct Pools {
    active: HashMap<PoolId, Pool>,
    /// Streams of released pools, oldest first: their memory stays theirs until settled.
    released: Vec<StreamId>,
    next: u64,
}

impl Pools {
    /// Whether `stream` is the stream of a pool in use.
    pub(super) fn is_active(&self, stream: StreamId) -> bool {
        self.active.values().any(|p| p.stream == stream)
    }
}

impl<B: Backing> Allocator<B> {
    /// A use of `pool` begins (a capture into it): a pool not in use is made.
    pub fn pool_begin(&mut self, pool: PoolId) {
        let pools = &mut self.pools;
        let entry = pools.active.entry(pool).or_insert_with(|| {
            let stream = StreamId(POOL_STREAMS.start + pools.next % (1 << 32));
            pools.next += 1;
            Pool { stream, uses: 0 }
        });
        entry.uses = entry.uses.saturating_add(1);
    }

    /// A block of at least `size` bytes from `pool`, which must be in use: the pool's own free
    /// memory, or memory every stream may use. It goes back to the pool when freed.
    pub fn alloc_in_pool<F: Fences + ?Sized>(
        &mut self,
        size: Bytes,
        pool: PoolId,
        fences: &F,
    ) -> Result<Block, AllocError> {
        let stream = self
            .pools
            .active
            .get(&pool)
            .ok_or(AllocError::UnknownPool {
                pool: (pool.0, pool.1),
            })?
            .stream;
        let block = self.alloc(size, stream, fences)?;
        if let Some(b) = self.live.get_mut(&block.offset) {
            b.pool = Some(stream);
        }
        self.stats.pool_allocs += 1;
        Ok(block)
    }

    /// A use of `pool` ends (its graph was released). After the last, the pool's free memory waits
    /// for [`Self::settle_pools`]; its blocks still live are freed as any block from then on.
    /// Returns whether that was the last use. A pool not in use is ignored.
    pub fn pool_release(&mut self, pool: PoolId) -> bool {
        let Some(p) = self.pools.active.get_mut(&pool) else {
            return false;
        };
        p.uses = p.uses.saturating_sub(1);
        if p.uses > 0 {
            return false;
        }
        let stream = p.stream;
        self.pools.active.remove(&pool);
        self.pools.released.push(stream);
        true
    }

    /// Pools released and not yet settled.
    pub fn unsettled_pools(&self) -> usize {
        self.pools.released.len()
    }

    /// Gives the free memory of the `count` pools released first to every stream. The caller has
    /// waited, since they were released, for all work queued on the device to finish.
    pub fn settle_pools(&mut self, count: usize) {
        let count = count.min(self.pools.released.len());
        for stream in self.pools.released.drain(..count) {
            for heap in self.heaps.iter_mut() {
                heap.free.release_never(stream);
            }
        }
    }

    /// Whether the live block at `offset` was allocated from a pool still in use: its free goes
    /// back to the pool, whatever fence the caller has for it.
    pub fn in_active_pool(&self, offset: u64) -> bool {
        self.live
            .get(&offset)
            .and_then(|b| b.pool)
            .is_some_and(|s| self.pools.is_active(s))
    }
}
