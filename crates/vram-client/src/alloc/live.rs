//! Live blocks by offset, sharded so that frees on different threads rarely meet on a lock.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::sync::Mutex;

use rustc_hash::FxHasher;
use vram_core::alloc::StreamId;

use super::FreeError;

const SHARDS: usize = 64;

#[derive(Clone, Copy, Debug)]
struct Entry {
    len: u64,
    cached: bool,
}

type Shard = Mutex<HashMap<u64, Entry, BuildHasherDefault<FxHasher>>>;

pub(super) struct LiveTable {
    shards: Box<[Shard]>,
}

impl Default for LiveTable {
    fn default() -> Self {
        LiveTable {
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
        }
    }
}

impl LiveTable {
    fn shard(
        &self,
        offset: u64,
    ) -> std::sync::MutexGuard<'_, HashMap<u64, Entry, BuildHasherDefault<FxHasher>>> {
        // Blocks are at least 512-byte aligned: skip the bits that are always zero.
        let i = ((offset >> 9) as usize) % SHARDS;
        self.shards[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn insert(&self, offset: u64, len: u64, _requested: u64, _stream: StreamId) {
        self.shard(offset)
            .insert(offset, Entry { len, cached: false });
    }

    /// A block taken from a thread cache is live again.
    pub(super) fn reuse(&self, offset: u64, _requested: u64) {
        if let Some(e) = self.shard(offset).get_mut(&offset) {
            e.cached = false;
        }
    }

    /// Checks a free and marks the block idle; returns its length.
    pub(super) fn mark_cached(&self, offset: u64, ptr: u64) -> Result<u64, FreeError> {
        let mut s = self.shard(offset);
        match s.get_mut(&offset) {
            None => Err(FreeError::Unknown(ptr)),
            Some(e) if e.cached => Err(FreeError::DoubleFree(ptr)),
            Some(e) => {
                e.cached = true;
                Ok(e.len)
            }
        }
    }

    pub(super) fn remove(&self, offset: u64) {
        self.shard(offset).remove(&offset);
    }

    /// Whether the block at `offset` waits in a thread cache.
    pub(super) fn is_cached(&self, offset: u64) -> bool {
        self.shard(offset).get(&offset).is_some_and(|e| e.cached)
    }

    pub(super) fn len_of(&self, offset: u64) -> Option<u64> {
        self.shard(offset)
            .get(&offset)
            .filter(|e| !e.cached)
            .map(|e| e.len)
    }
}
