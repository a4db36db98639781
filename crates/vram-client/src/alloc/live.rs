//! Live blocks by offset, so that every free is checked (unknown pointer, double free) before
//! anything is cached.
//!
//! Blocks of the small-request heap, the only ones thread caches keep, have one atomic slot each in
//! a table indexed by address: the fast path changes a block's state with one atomic operation and
//! takes no lock. Larger blocks are in a hash map sharded by address, so that frees on different
//! threads rarely meet on a lock.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::ops::Range;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};

use rustc_hash::FxHasher;

use super::FreeError;

const SHARDS: usize = 64;

#[derive(Clone, Copy, Debug)]
struct Entry {
    len: u64,
    cached: bool,
    pooled: bool,
}

type Shard = Mutex<HashMap<u64, Entry, BuildHasherDefault<FxHasher>>>;

/// Slot states, in the two low bits; the rest is the block's length in units of the alignment.
const LIVE: u32 = 1;
const CACHED: u32 = 2;
/// Live, allocated from a private pool: its free goes to the core, never to a thread cache.
const POOLED: u32 = 3;
const STATE: u32 = 3;
/// Slots per page of the small table.
const PAGE_SLOTS: usize = 4096;
/// Slots per cache line (64 bytes of `AtomicU32`).
const LINE_SLOTS: usize = 16;
/// Cache lines per page.
const PAGE_LINES: usize = PAGE_SLOTS / LINE_SLOTS;

/// One slot per possible block start of the small heap, in pages made on first use.
struct SmallTable {
    range: Range<u64>,
    shift: u32,
    pages: Box<[OnceLock<Box<[AtomicU32]>>]>,
}

impl SmallTable {
    /// A table for blocks starting in `range` at multiples of `align`; `None` where the alignment
    /// is too fine for a table of reasonable size (the map serves every block then).
    fn new(range: Range<u64>, align: u64) -> Option<SmallTable> {
        if align < 512 || !align.is_power_of_two() {
            return None;
        }
        let shift = align.trailing_zeros();
        let page_bytes = (PAGE_SLOTS as u64) << shift;
        let pages = (range.end - range.start).div_ceil(page_bytes) as usize;
        Some(SmallTable {
            range,
            shift,
            pages: (0..pages).map(|_| OnceLock::new()).collect(),
        })
    }

    /// The slot of a block at `offset`, if `offset` is a block start of this table's range; makes
    /// its page when `create`.
    fn slot(&self, offset: u64, create: bool) -> Option<&AtomicU32> {
        if !self.range.contains(&offset) || offset & ((1 << self.shift) - 1) != 0 {
            return None;
        }
        let index = ((offset - self.range.start) >> self.shift) as usize;
        let page = &self.pages[index / PAGE_SLOTS];
        // Neighbouring block starts go to different cache lines (a line holds starts one
        // `PAGE_LINES` units apart): blocks that threads allocated one after another are each
        // used by their own thread, whose atomic operations must not pull one line back and forth.
        let within = index % PAGE_SLOTS;
        let spread = within % PAGE_LINES * LINE_SLOTS + within / PAGE_LINES;
        let slots = if create {
            page.get_or_init(|| (0..PAGE_SLOTS).map(|_| AtomicU32::new(0)).collect())
        } else {
            page.get()?
        };
        Some(&slots[spread])
    }

    fn encode(&self, len: u64, state: u32) -> Option<u32> {
        let units = u32::try_from(len >> self.shift)
            .ok()
            .filter(|&u| u < 1 << 30)?;
        Some(units << 2 | state)
    }

    fn len(&self, word: u32) -> u64 {
        u64::from(word >> 2) << self.shift
    }
}

pub(super) struct LiveTable {
    small: Option<SmallTable>,
    shards: Box<[Shard]>,
}

impl LiveTable {
    /// A table for an allocator whose small-request heap covers `small_heap` and whose blocks start
    /// at multiples of `align`.
    pub(super) fn new(small_heap: Range<u64>, align: u64) -> LiveTable {
        LiveTable {
            small: SmallTable::new(small_heap, align),
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
        }
    }

    fn shard(
        &self,
        offset: u64,
    ) -> std::sync::MutexGuard<'_, HashMap<u64, Entry, BuildHasherDefault<FxHasher>>> {
        // Blocks are at least 512-byte aligned: skip the bits that are always zero.
        let i = ((offset >> 9) as usize) % SHARDS;
        self.shards[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    fn small_slot(&self, offset: u64, create: bool) -> Option<(&SmallTable, &AtomicU32)> {
        let t = self.small.as_ref()?;
        Some((t, t.slot(offset, create)?))
    }

    /// A block allocated now; `pooled` when from a private pool.
    pub(super) fn insert(&self, offset: u64, len: u64, pooled: bool) {
        if let Some((t, slot)) = self.small_slot(offset, true) {
            if let Some(word) = t.encode(len, if pooled { POOLED } else { LIVE }) {
                slot.store(word, Ordering::Release);
                return;
            }
        }
        self.shard(offset).insert(
            offset,
            Entry {
                len,
                cached: false,
                pooled,
            },
        );
    }

    /// A block taken from a thread cache is live again.
    pub(super) fn reuse(&self, offset: u64) {
        if let Some((_, slot)) = self.small_slot(offset, false) {
            let word = slot.load(Ordering::Acquire);
            if word & STATE == CACHED {
                slot.store(word & !STATE | LIVE, Ordering::Release);
                return;
            }
        }
        if let Some(e) = self.shard(offset).get_mut(&offset) {
            e.cached = false;
        }
    }

    /// Checks a free and marks the block idle; returns its length and whether it came from a
    /// private pool.
    #[cfg(test)]
    pub(super) fn mark_cached(&self, offset: u64, ptr: u64) -> Result<(u64, bool), FreeError> {
        self.check_free(offset, ptr, u64::MAX)
    }

    /// Checks a free; returns the block's length and whether it came from a private pool. A
    /// block that a thread cache may keep (at most `cache_limit` long, not pooled) is marked
    /// idle; any other leaves the table in the same step (the slot's one compare-and-swap, or
    /// under the map's lock), since its free goes to the core: the caller knows which from the
    /// two figures returned.
    pub(super) fn check_free(
        &self,
        offset: u64,
        ptr: u64,
        cache_limit: u64,
    ) -> Result<(u64, bool), FreeError> {
        let leaves = |len: u64, pooled: bool| pooled || len > cache_limit;
        if let Some((t, slot)) = self.small_slot(offset, false) {
            let mut word = slot.load(Ordering::Acquire);
            loop {
                match word & STATE {
                    LIVE | POOLED => {}
                    CACHED => return Err(FreeError::DoubleFree(ptr)),
                    // Not in the table: a block too long for a slot lives in the map.
                    _ => break,
                }
                let (len, pooled) = (t.len(word), word & STATE == POOLED);
                let next = if leaves(len, pooled) {
                    0
                } else {
                    word & !STATE | CACHED
                };
                // Two threads freeing one block at once: exactly one wins, the other sees CACHED
                // (or no block).
                match slot.compare_exchange_weak(word, next, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => return Ok((len, pooled)),
                    Err(now) => word = now,
                }
            }
        }
        let mut s = self.shard(offset);
        let Some(e) = s.get_mut(&offset) else {
            return Err(FreeError::Unknown(ptr));
        };
        if e.cached {
            return Err(FreeError::DoubleFree(ptr));
        }
        let (len, pooled) = (e.len, e.pooled);
        if leaves(len, pooled) {
            s.remove(&offset);
        } else {
            e.cached = true;
        }
        Ok((len, pooled))
    }

    pub(super) fn remove(&self, offset: u64) {
        if let Some((_, slot)) = self.small_slot(offset, false) {
            if slot.swap(0, Ordering::AcqRel) != 0 {
                return;
            }
        }
        self.shard(offset).remove(&offset);
    }

    /// Whether the block at `offset` waits in a thread cache.
    pub(super) fn is_cached(&self, offset: u64) -> bool {
        if let Some((_, slot)) = self.small_slot(offset, false) {
            match slot.load(Ordering::Acquire) & STATE {
                0 => {}
                state => return state == CACHED,
            }
        }
        self.shard(offset).get(&offset).is_some_and(|e| e.cached)
    }

    pub(super) fn len_of(&self, offset: u64) -> Option<u64> {
        if let Some((t, slot)) = self.small_slot(offset, false) {
            let word = slot.load(Ordering::Acquire);
            match word & STATE {
                0 => {}
                LIVE | POOLED => return Some(t.len(word)),
                _ => return None,
            }
        }
        self.shard(offset)
            .get(&offset)
            .filter(|e| !e.cached)
            .map(|e| e.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> LiveTable {
        LiveTable::new(1 << 30..2 << 30, 512)
    }

    #[test]
    fn small_blocks_go_through_their_states() {
        let t = table();
        let off = (1 << 30) + 4096;
        assert_eq!(t.mark_cached(off, 7), Err(FreeError::Unknown(7)));
        t.insert(off, 1536, false);
        assert_eq!(t.len_of(off), Some(1536));
        assert_eq!(t.mark_cached(off, 7), Ok((1536, false)));
        assert!(t.is_cached(off));
        assert_eq!(t.len_of(off), None);
        assert_eq!(t.mark_cached(off, 7), Err(FreeError::DoubleFree(7)));
        t.reuse(off);
        assert_eq!(t.mark_cached(off, 7), Ok((1536, false)));
        t.remove(off);
        assert_eq!(t.mark_cached(off, 7), Err(FreeError::Unknown(7)));
        // Inside a block, not its start: unknown.
        t.insert(off, 1536, false);
        assert_eq!(t.mark_cached(off + 512, 9), Err(FreeError::Unknown(9)));
        assert_eq!(t.mark_cached(off + 1, 9), Err(FreeError::Unknown(9)));
    }

    #[test]
    fn a_pooled_block_says_so_at_its_free_in_the_table_and_in_the_map() {
        let t = table();
        for (off, len) in [((1 << 30) + 8192, 1024), (4096, 64 << 20)] {
            t.insert(off, len, true);
            assert_eq!(t.len_of(off), Some(len));
            // It goes back to its pool: out of the table at its free.
            assert_eq!(t.mark_cached(off, 3), Ok((len, true)));
            assert_eq!(t.len_of(off), None);
            assert_eq!(t.mark_cached(off, 3), Err(FreeError::Unknown(3)));
        }
    }

    #[test]
    fn a_free_that_skips_the_caches_takes_the_block_out_of_the_table_and_the_map() {
        let t = table();
        for (off, len) in [((1 << 30) + 8192, 1024), (4096, 64 << 20)] {
            t.insert(off, len, false);
            assert_eq!(t.check_free(off, 5, 512), Ok((len, false)));
            assert_eq!(t.len_of(off), None);
            assert!(!t.is_cached(off));
            assert_eq!(t.check_free(off, 5, 512), Err(FreeError::Unknown(5)));
            // The same start allocated again is live again, and a free within the limit marks
            // it idle.
            t.insert(off, len, false);
            assert_eq!(t.len_of(off), Some(len));
            assert_eq!(t.check_free(off, 5, len), Ok((len, false)));
            assert!(t.is_cached(off));
            assert_eq!(t.check_free(off, 5, len), Err(FreeError::DoubleFree(5)));
            t.remove(off);
        }
    }

    #[test]
    fn every_block_start_of_a_page_has_its_own_slot_and_neighbours_other_lines() {
        let t = table();
        let small = t.small.as_ref().unwrap();
        let base = |off: u64| small.slot(off, true).unwrap() as *const AtomicU32 as usize;
        let start = 1u64 << 30;
        let page_start = base(start);
        let mut seen = std::collections::HashSet::new();
        for i in 0..PAGE_SLOTS as u64 {
            let at = base(start + i * 512);
            assert!(at >= page_start && at < page_start + PAGE_SLOTS * 4);
            assert!(seen.insert(at), "two block starts share a slot");
        }
        for i in 0..PAGE_SLOTS as u64 - 1 {
            let (a, b) = (base(start + i * 512), base(start + (i + 1) * 512));
            assert_ne!(a / 64, b / 64, "neighbouring starts share a cache line");
        }
    }

    #[test]
    fn large_blocks_and_blocks_outside_the_small_heap_use_the_map() {
        let t = table();
        for (off, len) in [(4096, 64 << 20), ((1 << 30) + (2 << 20), 1 << 40)] {
            t.insert(off, len, false);
            assert_eq!(t.len_of(off), Some(len));
            assert_eq!(t.mark_cached(off, 1), Ok((len, false)));
            assert_eq!(t.mark_cached(off, 1), Err(FreeError::DoubleFree(1)));
            t.remove(off);
            assert_eq!(t.len_of(off), None);
        }
    }

    #[test]
    fn a_block_freed_by_two_threads_at_once_is_freed_once() {
        let t = table();
        for i in 0..200u64 {
            let off = (1 << 30) + i * 512;
            t.insert(off, 512, false);
            let wins: usize = std::thread::scope(|s| {
                let a = s.spawn(|| t.mark_cached(off, off).is_ok() as usize);
                let b = s.spawn(|| t.mark_cached(off, off).is_ok() as usize);
                a.join().unwrap() + b.join().unwrap()
            });
            assert_eq!(wins, 1);
        }
    }
}
