//! Per-thread caches of freed blocks, by size class and stream.
//!
//! Each thread's cache sits behind its own spin lock, which only that thread takes on the fast path
//! (uncontended: one atomic exchange to take it, a plain store to release it, no system call). A
//! trim takes each cache's lock in turn to empty it, so idle memory cached by a sleeping thread can
//! still go back to the daemon; the owner waits for it only while the trim empties its cache.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crossbeam_utils::CachePadded;

use vram_core::alloc::StreamId;

/// Blocks up to this length are cached per thread.
pub(super) const CACHE_LIMIT: u64 = 64 << 10;
const ALIGN_SHIFT: u32 = 9;
/// Blocks kept per size class and thread.
const PER_CLASS: usize = 8;
/// Bytes one thread may keep cached.
const PER_THREAD: u64 = 1 << 20;

#[derive(Default)]
struct Cache {
    /// Index: length / 512 - 1. Each entry: (offset, stream).
    bins: Vec<Vec<(u64, StreamId)>>,
    bytes: u64,
    /// Allocations this thread served from its cache.
    hits: u64,
}

/// One thread's cache, on cache lines of its own: threads' caches allocated one after another
/// must not share a line that each thread writes on every allocation and free.
type Shared = Arc<CachePadded<spin::Mutex<Cache>>>;

thread_local! {
    /// This thread's cache for each allocator (by id) it has used.
    static MINE: RefCell<Vec<(u64, Shared)>> = const { RefCell::new(Vec::new()) };
}

/// The registry of every thread's cache for one allocator.
#[derive(Default)]
pub(super) struct ThreadCaches {
    all: Mutex<Vec<Shared>>,
    /// Allocations served by the caches of threads that have exited.
    retired_hits: AtomicU64,
}

fn class(len: u64) -> usize {
    (len >> ALIGN_SHIFT) as usize - 1
}

impl ThreadCaches {
    /// `f` on this thread's cache; `None` once the thread's locals are being destroyed (a free
    /// from another thread-local's destructor at thread exit), when the caller goes to the core.
    fn with_mine<R>(&self, id: u64, f: impl FnOnce(&mut Cache) -> R) -> Option<R> {
        MINE.try_with(|mine| {
            if let Some((_, shared)) = mine.borrow().iter().find(|(i, _)| *i == id) {
                return f(&mut shared.lock());
            }
            let shared: Shared = Arc::default();
            self.all
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(shared.clone());
            mine.borrow_mut().push((id, shared.clone()));
            let mut cache = shared.lock();
            f(&mut cache)
        })
        .ok()
    }

    /// A cached block of exactly `len` last used on `stream`.
    pub(super) fn pop(&self, id: u64, len: u64, stream: StreamId) -> Option<u64> {
        self.with_mine(id, |c| {
            let bin = c.bins.get_mut(class(len))?;
            let i = bin.iter().rposition(|(_, s)| *s == stream)?;
            let (offset, _) = bin.swap_remove(i);
            c.bytes -= len;
            c.hits += 1;
            Some(offset)
        })
        .flatten()
    }

    /// Keeps a freed block; `false` if this thread's cache is full.
    pub(super) fn push(&self, id: u64, offset: u64, len: u64, stream: StreamId) -> bool {
        self.with_mine(id, |c| {
            if c.bytes + len > PER_THREAD {
                return false;
            }
            let k = class(len);
            if c.bins.len() <= k {
                c.bins.resize_with(k + 1, Vec::new);
            }
            if c.bins[k].len() >= PER_CLASS {
                return false;
            }
            c.bins[k].push((offset, stream));
            c.bytes += len;
            true
        })
        .unwrap_or(false)
    }

    /// Empties every thread's cache.
    pub(super) fn drain_all(&self) -> Vec<(u64, StreamId)> {
        self.drain(true)
    }

    /// Empties the caches of threads that have exited, which no thread can take from again.
    pub(super) fn drain_exited(&self) -> Vec<(u64, StreamId)> {
        self.drain(false)
    }

    /// Empties the caches of threads that have exited, and with `all` every other one too. A
    /// cache held by the registry alone belongs to a thread that has exited (its thread-local
    /// entry is gone, so nothing can push to it again): it is emptied and forgotten in one step,
    /// keeping its count of allocations served.
    fn drain(&self, all: bool) -> Vec<(u64, StreamId)> {
        let mut out = Vec::new();
        self.all
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|shared| {
                let exited = Arc::strong_count(shared) == 1;
                if exited || all {
                    let mut c = shared.lock();
                    for bin in &mut c.bins {
                        out.append(bin);
                    }
                    c.bytes = 0;
                    if exited {
                        self.retired_hits.fetch_add(c.hits, Ordering::Relaxed);
                    }
                }
                !exited
            });
        out
    }

    /// Bytes waiting in all thread caches.
    pub(super) fn bytes(&self) -> u64 {
        self.sum(|c| c.bytes)
    }

    /// Allocations served from thread caches.
    pub(super) fn hits(&self) -> u64 {
        self.retired_hits.load(Ordering::Relaxed) + self.sum(|c| c.hits)
    }

    fn sum(&self, f: impl Fn(&Cache) -> u64) -> u64 {
        let all = self.all.lock().unwrap_or_else(|p| p.into_inner());
        all.iter().map(|s| f(&s.lock())).sum()
    }

    /// The allocator is going away: this thread's entry for it is dropped.
    pub(super) fn forget(&self, id: u64) {
        let _ = MINE.try_with(|mine| mine.borrow_mut().retain(|(i, _)| *i != id));
    }
}
