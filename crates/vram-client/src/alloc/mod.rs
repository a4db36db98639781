//! The caching allocator every allocation of a tenant process goes through.
//!
//! The algorithms (stitched heaps, size classes, stream-safe reuse, hysteresis) are
//! `vram_core::alloc`, behind one mutex: the slow path. In front of it, each thread keeps a small
//! cache of blocks it freed, by size class and stream (the fast path): an alloc of a cached size on
//! the same stream takes no global lock and makes no system call. A table of live blocks, sharded
//! by address, checks every free (unknown pointer, double free) before anything is cached.

mod backing;
mod live;
mod thread_cache;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use vram_core::alloc::{
    AllocConfig, AllocError, AllocStats, Allocator, BlockState, Fence, Fences, FreeMemory, Segment,
    StreamId, POOL_STREAMS,
};
use vram_core::Bytes;

pub use vram_core::alloc::PoolId;

pub use backing::{CallTimes, ClientSlot, DaemonSource, HandleSource, LocalSource, MappedBacking};

use live::LiveTable;
use thread_cache::{ThreadCaches, CACHE_LIMIT};

/// Stream events: fences for stream-ordered reuse.
pub trait StreamEvents: Fences + Send + Sync {
    /// Whether `stream` is being captured into a CUDA graph (or cannot be asked): no event may be
    /// recorded or queried for the allocator then, since in the default capture mode touching
    /// another stream would invalidate the capture.
    fn is_capturing(&self, stream: StreamId) -> bool;

    /// Whether no stream can be under capture, known without asking the driver. A free waits in
    /// a thread cache only when this holds or its stream is not under capture: its fencing is
    /// decided when the block reaches the core, and must be that of the moment it was freed.
    fn none_capturing(&self) -> bool {
        false
    }

    /// How a free is fenced when its stream is not under capture.
    fn uncaptured_free(&self) -> AtFree {
        AtFree::Deferred
    }

    /// How a free on `stream` is fenced now.
    fn at_free(&self, stream: StreamId) -> AtFree {
        if self.is_capturing(stream) {
            AtFree::Never
        } else {
            self.uncaptured_free()
        }
    }

    /// Waits until the work queued on the device so far has finished; false if that failed.
    /// Called only where no capture can be underway ([`Self::none_capturing`]): a device
    /// synchronisation would invalidate one.
    fn synchronize(&self) -> bool {
        true
    }
}

/// Graph captures announced by the application, for streams whose capture status would otherwise
/// cost a driver call on every allocation and free: a framework that tells the allocator when a
/// capture begins and ends (PyTorch does, through its allocator's `beginAllocateToPool` and
/// `endAllocateToPool` hooks) lets it ask the driver only while a capture is underway. Until
/// `announce` is called, every question goes to the driver. Shared with [`CudaEvents`] so that
/// notices may come before the allocator exists.
#[derive(Debug, Default)]
pub struct CaptureNotices {
    announced: AtomicBool,
    underway: AtomicU64,
}

impl CaptureNotices {
    /// From now on every capture is announced.
    pub fn announce(&self) {
        self.announced.store(true, Ordering::SeqCst);
    }

    /// A capture is about to begin (before its stream enters capture mode).
    pub fn began(&self) {
        self.underway.fetch_add(1, Ordering::SeqCst);
    }

    /// A capture has ended, or is about to with no allocation or free in between.
    pub fn ended(&self) {
        // An end without a begin (announcements switched on mid-capture) must not wrap around.
        let _ = self
            .underway
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
    }

    /// Whether no capture can be underway, so the driver need not be asked.
    pub fn none_underway(&self) -> bool {
        self.announced.load(Ordering::SeqCst) && self.underway.load(Ordering::SeqCst) == 0
    }

    /// Whether an announced capture is underway on some stream.
    pub fn some_underway(&self) -> bool {
        self.announced.load(Ordering::SeqCst) && self.underway.load(Ordering::SeqCst) > 0
    }
}

/// The fences an allocation made during a capture sees: nothing completes and nothing can be
/// recorded, so the allocator makes no event call (it grows instead, as it would for a stream
/// whose fences are pending).
struct Frozen;

impl Fences for Frozen {
    fn is_complete(&self, _: Fence) -> bool {
        false
    }

    fn record(&self, _: StreamId) -> Option<Fence> {
        None
    }
}

/// `CU_STREAM_PER_THREAD`: CUDA's one handle for every thread's own per-thread default stream.
pub const CU_STREAM_PER_THREAD: u64 = 2;

/// Set in the [`StreamId`] of a thread's per-thread default stream ([`per_thread_stream`]); no
/// stream handle the driver gives has it (they are addresses or small constants).
const PER_THREAD_TAG: u64 = 1 << 63;

/// The calling thread's per-thread default stream as a stream of its own. CUDA names every
/// thread's by one handle, but they are different streams: a block freed on thread A's must not
/// go at once to thread B's, whose work is not ordered after A's.
pub fn per_thread_stream() -> StreamId {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    thread_local! {
        static MINE: u64 = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    StreamId(PER_THREAD_TAG | MINE.with(|m| *m))
}

/// The stream of the synchronous allocation and free calls (`cudaMalloc`, `cuMemAlloc`,
/// `cudaFree`, `cuMemFree`): one of its own, which no stream handle names. A synchronous
/// allocation promises memory every stream may use at once, so it takes a block freed on another
/// stream (the default stream included) only once that stream has passed the free, as any
/// stream does. A synchronous free comes after the device synchronised; its fences are recorded
/// on the legacy default stream.
pub const SYNCHRONOUS: StreamId = StreamId(PER_THREAD_TAG - 1);

/// The stream a program's stream handle names on the calling thread: its per-thread default
/// stream for `CU_STREAM_PER_THREAD`, and for the null handle where the call is a per-thread one
/// (`_ptsz`); the handle itself otherwise.
pub fn stream_of(handle: u64, null_is_per_thread: bool) -> StreamId {
    match handle {
        CU_STREAM_PER_THREAD => per_thread_stream(),
        0 if null_is_per_thread => per_thread_stream(),
        h => StreamId(h),
    }
}

/// Whether `stream` is a thread's per-thread default stream ([`per_thread_stream`]).
fn is_per_thread(stream: StreamId) -> bool {
    stream.0 & PER_THREAD_TAG != 0
}

/// The handle the driver knows `stream` by on the calling thread (the legacy default stream for
/// [`SYNCHRONOUS`]); `None` for another thread's per-thread default stream, which no handle names
/// from here.
fn cuda_handle(stream: StreamId) -> Option<u64> {
    if stream == SYNCHRONOUS {
        return Some(0);
    }
    // A private pool's stream (the core's own name for it) is no stream of the driver's.
    if POOL_STREAMS.contains(&stream.0) {
        return None;
    }
    if !is_per_thread(stream) {
        return Some(stream.0);
    }
    (per_thread_stream() == stream).then_some(CU_STREAM_PER_THREAD)
}

/// How a free is fenced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtFree {
    /// The work on the block has finished: every stream may reuse it at once.
    Done,
    /// Later: the allocator records one fence for a batch of frees of the stream when it needs to.
    Deferred,
    /// Never: the stream is being captured into a graph whose replays may use the block.
    Never,
    /// Now: a fence recorded on the stream at the free (a per-thread default stream, whose
    /// fences only its own thread can record; later, from another thread, none could be).
    Now,
}

/// Host backend: there is no asynchronous device work, so a free is complete when it returns.
#[derive(Debug, Default, Clone, Copy)]
pub struct HostEvents;

impl Fences for HostEvents {
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

impl StreamEvents for HostEvents {
    fn is_capturing(&self, _: StreamId) -> bool {
        false
    }

    fn none_capturing(&self) -> bool {
        true
    }

    fn uncaptured_free(&self) -> AtFree {
        AtFree::Done
    }
}

/// The longest the allocator waits for one stream's fence before a growth (`Fences::wait`); past
/// it, it grows as if it could not wait. Long enough for a device some steps behind the program;
/// bounded so that work that cannot finish while the allocating thread waits (a collective whose
/// peer that thread launches later) delays the allocation instead of hanging it.
pub const FENCE_WAIT_LIMIT: std::time::Duration = std::time::Duration::from_millis(500);

/// CUDA: a fence is an event recorded on the freeing stream.
pub struct CudaEvents {
    pool: vram_device::cuda::EventPool,
    notices: Arc<CaptureNotices>,
}

impl CudaEvents {
    pub fn new(device: &vram_device::CudaDevice) -> CudaEvents {
        Self::with_notices(device, Arc::default())
    }

    /// Events that take the application's capture notices from `notices`.
    pub fn with_notices(
        device: &vram_device::CudaDevice,
        notices: Arc<CaptureNotices>,
    ) -> CudaEvents {
        CudaEvents {
            pool: vram_device::cuda::EventPool::new(device),
            notices,
        }
    }
}

impl Fences for CudaEvents {
    fn is_complete(&self, fence: Fence) -> bool {
        // Querying an event while a graph is captured (in the default, global mode: on any
        // thread) invalidates the capture. While an announced capture is underway, fences wait,
        // as PyTorch's own allocator defers its event queries then.
        if fence == Fence::NEVER || self.notices.some_underway() {
            return false;
        }
        self.pool.is_complete(fence.0)
    }

    fn record(&self, stream: StreamId) -> Option<Fence> {
        // No event may be recorded into a capture, and none is recorded anywhere while an
        // announced capture is underway: the allocator tries again later.
        if self.notices.some_underway() || self.is_capturing(stream) {
            return None;
        }
        // Another thread's per-thread stream: recorded later, on its own thread.
        let handle = cuda_handle(stream)?;
        self.pool.record(handle).ok().map(Fence)
    }

    fn wait(&self, fence: Fence) -> bool {
        // Querying an event during a capture would invalidate it.
        if fence == Fence::NEVER || self.notices.some_underway() {
            return false;
        }
        self.pool.wait(fence.0, FENCE_WAIT_LIMIT)
    }
}

impl StreamEvents for CudaEvents {
    fn is_capturing(&self, stream: StreamId) -> bool {
        if self.notices.none_underway() {
            return false;
        }
        // A failed query counts as a capture: nothing is recorded, a freed block stays with its
        // stream. So does another thread's per-thread stream, which cannot be asked about here.
        let Some(handle) = cuda_handle(stream) else {
            return true;
        };
        !matches!(self.pool.is_capturing(handle), Ok(false))
    }

    fn none_capturing(&self) -> bool {
        self.notices.none_underway()
    }

    fn synchronize(&self) -> bool {
        match self.pool.synchronize() {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!("vramd: cannot wait for the device to settle released pools: {e}");
                false
            }
        }
    }

    fn at_free(&self, stream: StreamId) -> AtFree {
        if self.is_capturing(stream) {
            AtFree::Never
        } else if is_per_thread(stream) {
            AtFree::Now
        } else {
            AtFree::Deferred
        }
    }
}

/// Why a free was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FreeError {
    #[error("{0:#x} was not allocated by vramd's allocator (or was already freed)")]
    Unknown(u64),
    #[error("{0:#x} was freed twice")]
    DoubleFree(u64),
}

/// Figures of the allocator, the thread caches included.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct CachingStats {
    /// The core allocator's counters (blocks in thread caches count as allocated there).
    pub core: AllocStats,
    /// Bytes handed to the application now.
    pub in_use: Bytes,
    /// Bytes held but idle: free in the core, or waiting in a thread cache.
    pub cached: Bytes,
    /// Allocations served from a thread cache.
    pub fast_allocs: u64,
    /// Allocations and frees that went to the core (past the thread caches), and the time spent
    /// in them, lock waits included — timed only with `VRAMD_TIME_CORE=1` in the environment at
    /// start (two clock reads per call), else 0.
    pub core_ops: u64,
    pub core_ns: u64,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A thread-safe caching allocator over a [`HandleSource`].
pub struct CachingAllocator<S: HandleSource> {
    id: u64,
    core: Mutex<Allocator<MappedBacking<S>>>,
    base: u64,
    va: u64,
    align: u64,
    live: LiveTable,
    caches: ThreadCaches,
    events: Box<dyn StreamEvents>,
    /// The tenant's limit, if known: a request that cannot fit under it however well the heap were
    /// packed is refused at once, without taking (and giving back) memory in pieces. `u64::MAX`:
    /// not known. Changes when the process becomes another tenant ([`Self::set_limit`]).
    limit: AtomicU64,
    /// Whether calls to the core are timed (`VRAMD_TIME_CORE=1`), and what they took.
    timed: bool,
    core_ops: AtomicU64,
    core_ns: AtomicU64,
}

impl<S: HandleSource> CachingAllocator<S> {
    pub fn new(
        config: AllocConfig,
        backing: MappedBacking<S>,
        events: Box<dyn StreamEvents>,
    ) -> Self {
        let base = backing.base();
        let va = config.va_bytes.get();
        let align = config.align.get();
        let core = Allocator::new(config, backing);
        CachingAllocator {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            live: LiveTable::new(core.small_heap(), align),
            core: Mutex::new(core),
            base,
            va,
            align,
            caches: ThreadCaches::default(),
            events,
            limit: AtomicU64::new(u64::MAX),
            timed: std::env::var_os(vram_proto::env::TIME_CORE).is_some_and(|v| v == "1"),
            core_ops: AtomicU64::new(0),
            core_ns: AtomicU64::new(0),
        }
    }

    /// Times calls to the core (`core_ops`, `core_ns` in [`CachingStats`]) or not, whatever
    /// `VRAMD_TIME_CORE` says.
    pub fn with_timing(mut self, on: bool) -> Self {
        self.timed = on;
        self
    }

    /// Runs `f`, a call to the core, timing it if asked to.
    fn timed<R>(&self, f: impl FnOnce() -> R) -> R {
        if !self.timed {
            return f();
        }
        let start = std::time::Instant::now();
        let r = f();
        let ns = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.core_ops.fetch_add(1, Ordering::Relaxed);
        self.core_ns.fetch_add(ns, Ordering::Relaxed);
        r
    }

    /// Knows the tenant's limit (see the `limit` field).
    pub fn with_limit(self, limit: Bytes) -> Self {
        self.set_limit(limit);
        self
    }

    /// The tenant's limit from now on: the allocator serves a new tenant of the same device
    /// once the previous one has ended holding nothing (libvram.so's `vram_connect`).
    pub fn set_limit(&self, limit: Bytes) {
        self.limit.store(limit.get(), Ordering::Relaxed);
    }

    /// Refuses a request larger than the limit minus what the application uses now. `stats` are
    /// the core's, read under the lock the allocation then uses.
    fn check_limit(&self, size: Bytes, len: u64, stats: &AllocStats) -> Result<(), AllocError> {
        let limit = match self.limit.load(Ordering::Relaxed) {
            u64::MAX => return Ok(()),
            l => Bytes(l),
        };
        if len <= limit.get().saturating_sub(stats.allocated.get()) {
            return Ok(());
        }
        // Blocks idle in thread caches count as allocated in the core: they would come back.
        let in_use = stats.allocated.saturating_sub(Bytes(self.caches.bytes()));
        if len <= limit.get().saturating_sub(in_use.get()) {
            return Ok(());
        }
        Err(AllocError::OutOfMemory {
            requested: size,
            held: stats.held,
            allocated: in_use,
            source: vram_core::alloc::Refused {
                bytes: Bytes(len),
                reason: format!("the tenant's limit is {limit} and {in_use} of it is in use"),
            },
        })
    }

    fn core(&self) -> MutexGuard<'_, Allocator<MappedBacking<S>>> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The address of a block of at least `size` bytes for use on `stream`. A zero-byte request
    /// gets a distinct address too.
    pub fn alloc(&self, size: Bytes, stream: StreamId) -> Result<u64, AllocError> {
        let len = self.rounded(size);
        if len <= CACHE_LIMIT {
            if let Some(offset) = self.caches.pop(self.id, len, stream) {
                self.live.reuse(offset);
                return Ok(self.base + offset);
            }
        }
        self.alloc_in_core(size, len, stream, None)
    }

    fn rounded(&self, size: Bytes) -> u64 {
        size.get()
            .max(1)
            .div_ceil(self.align)
            .saturating_mul(self.align)
    }

    /// An allocation past the thread caches, from `pool` if one is named. Kept out of line: the
    /// fast path above stays small.
    #[inline(never)]
    fn alloc_in_core(
        &self,
        size: Bytes,
        len: u64,
        stream: StreamId,
        pool: Option<PoolId>,
    ) -> Result<u64, AllocError> {
        self.timed(|| {
            let events = self.events.as_ref();
            let fences: &dyn Fences = if events.is_capturing(stream) {
                &Frozen
            } else {
                events
            };
            let mut core = self.core();
            self.check_limit(size, len, &core.stats())?;
            let block = match pool {
                None => core.alloc(size, stream, fences)?,
                Some(pool) => core.alloc_in_pool(size, pool, fences)?,
            };
            drop(core);
            self.live
                .insert(block.offset, block.size.get(), pool.is_some());
            Ok(self.base + block.offset)
        })
    }

    /// A use of the private pool `pool` begins: a CUDA graph is about to be captured into it
    /// (`vram_core::alloc::PoolId`). Its memory is the pool's until its last use ends.
    pub fn pool_begin(&self, pool: PoolId) {
        self.core().pool_begin(pool);
    }

    /// The address of a block of at least `size` bytes for `stream` from `pool`, which must be in
    /// use: it goes back to the pool when freed, and only the pool's allocations reuse it.
    pub fn alloc_in_pool(
        &self,
        size: Bytes,
        stream: StreamId,
        pool: PoolId,
    ) -> Result<u64, AllocError> {
        self.alloc_in_core(size, self.rounded(size), stream, Some(pool))
    }

    /// A use of `pool` ends (its graph was released). After its last, its free memory becomes
    /// every stream's once the device has finished the work queued so far: at once, by a device
    /// synchronisation, unless an announced capture is underway (a synchronisation would
    /// invalidate it); then at a later release. Where captures are not announced
    /// ([`CaptureNotices`]) none can be known not to be underway, and a released pool's memory
    /// stays the pool's.
    pub fn pool_release(&self, pool: PoolId) {
        let unsettled = {
            let mut core = self.core();
            core.pool_release(pool);
            core.unsettled_pools()
        };
        if unsettled > 0 && self.events.none_capturing() && self.events.synchronize() {
            self.core().settle_pools(unsettled);
        }
    }

    /// Frees the block at `ptr`, last used on `stream`.
    pub fn free(&self, ptr: u64, stream: StreamId) -> Result<Bytes, FreeError> {
        let offset = ptr.wrapping_sub(self.base);
        if offset >= self.va {
            return Err(FreeError::Unknown(ptr));
        }
        // A block no thread cache keeps leaves the live table as its free is checked (one step,
        // not two): it goes to the core.
        let (len, pooled) = self.live.check_free(offset, ptr, CACHE_LIMIT)?;
        let left_table = pooled || len > CACHE_LIMIT;
        // A block freed while its stream is captured skips the cache: the graph's replays may
        // use it, so it must reach the core fenced as its stream is now. (Where captures are
        // not announced, that costs a driver query per free.) So does a private pool's block,
        // which goes back to its pool.
        if !left_table
            && !is_per_thread(stream)
            && (self.events.none_capturing() || !self.events.is_capturing(stream))
            && self.caches.push(self.id, offset, len, stream)
        {
            return Ok(Bytes(len));
        }
        self.timed(|| {
            if !left_table {
                self.live.remove(offset);
            }
            self.free_to_core(offset, stream, self.events.at_free(stream), pooled);
        });
        Ok(Bytes(len))
    }

    /// Frees to the core; `pooled`: the block came from a private pool.
    fn free_to_core(&self, offset: u64, stream: StreamId, how: AtFree, pooled: bool) {
        let events = self.events.as_ref();
        let mut core = self.core();
        // The core gives a block of a pool in use back to its pool whatever the fencing: no event
        // is recorded at its free.
        let how = match how {
            AtFree::Now if pooled && core.in_active_pool(offset) => AtFree::Deferred,
            how => how,
        };
        let r = match how {
            AtFree::Done => core.free(offset, stream, Fence(0), events),
            AtFree::Deferred => core.free_deferred(offset, stream, events),
            AtFree::Never => core.free(offset, stream, Fence::NEVER, events),
            AtFree::Now => match events.record(stream) {
                Some(fence) => core.free(offset, stream, fence, events),
                None => core.free_deferred(offset, stream, events),
            },
        };
        debug_assert!(r.is_ok(), "live table and core disagree: {r:?}");
    }

    /// `stream` is about to be destroyed (before the driver's call): the blocks freed on it, which
    /// it could reuse at once, are fenced now and kept from any stream until that fence completes,
    /// so that a stream created later with the same handle waits for the destroyed one's work
    /// like any other stream ([`vram_core::alloc::Allocator::retire_stream`]). The thread caches
    /// are emptied into the core first: they hold blocks by stream too.
    pub fn stream_destroyed(&self, stream: StreamId) {
        self.flush_caches();
        self.core().retire_stream(stream, self.events.as_ref());
    }

    /// Returns every idle byte to the daemon now (its reclaim request, or the program's own
    /// empty-cache call): the thread caches are emptied into the core, which gives back every
    /// wholly free handle; then the frees the device has not yet passed are fenced and waited for
    /// (each stream's latest fence, bounded as [`Fences::wait`] is), and what they covered goes
    /// back too. What could go back at once goes first, so that a grant waiting on this reclaim
    /// is not held up by the wait when that memory is enough for it. The wait holds no lock: the
    /// program's other threads allocate and free meanwhile, and what they free after the fences
    /// were taken stays for the next trim. Returns the bytes, once the daemon has them (returns
    /// while allocating are not waited for; see [`HandleSource::give`]).
    pub fn trim(&self) -> Bytes {
        self.flush_caches();
        let events = self.events.as_ref();
        let now = self.trim_core();
        let behind = self.core().fences_behind_free();
        if behind.is_empty() {
            return now;
        }
        for fence in behind {
            events.wait(fence);
        }
        now + self.trim_core()
    }

    /// The core's trim, its returns settled with the daemon outside the core's lock.
    fn trim_core(&self) -> Bytes {
        let (trimmed, settle) = {
            let mut core = self.core();
            let trimmed = core.trim(self.events.as_ref());
            (trimmed, core.backing().settler())
        };
        // Outside the lock: the round trip may wait on a daemon that is restarting, while the
        // program's other threads allocate and free.
        settle();
        trimmed
    }

    fn flush_caches(&self) {
        self.free_cached(self.caches.drain_all());
    }

    /// Frees blocks taken from thread caches to the core. Each was freed while no capture was
    /// underway, and is fenced as such whatever is being captured now.
    fn free_cached(&self, blocks: Vec<(u64, StreamId)>) {
        let how = self.events.uncaptured_free();
        for (offset, stream) in blocks {
            self.live.remove(offset);
            self.free_to_core(offset, stream, how, false);
        }
    }

    /// Lets allocator time pass: the blocks cached by threads that have exited go to the core,
    /// and idle memory above the recent peak goes back with hysteresis.
    pub fn tick(&self, now_us: u64) -> Bytes {
        self.free_cached(self.caches.drain_exited());
        self.core().tick(now_us, self.events.as_ref())
    }

    pub fn stats(&self) -> CachingStats {
        self.stats_of(self.core().stats())
    }

    /// Runs `f` on the figures as they stand, with the core's lock held: no allocation that needs
    /// the core (a growth above all), no free reaching it and no trim runs until `f` returns. For
    /// a caller that acts on "holds nothing" before anything can change it (a tenant ending its
    /// connection while other threads may allocate).
    pub fn with_stats_held<R>(&self, f: impl FnOnce(CachingStats) -> R) -> R {
        let core = self.core();
        f(self.stats_of(core.stats()))
    }

    fn stats_of(&self, core: AllocStats) -> CachingStats {
        let in_caches = self.caches.bytes();
        CachingStats {
            core,
            in_use: core.allocated.saturating_sub(Bytes(in_caches)),
            cached: core.cached + Bytes(in_caches),
            fast_allocs: self.caches.hits(),
            core_ops: self.core_ops.load(Ordering::Relaxed),
            core_ns: self.core_ns.load(Ordering::Relaxed),
        }
    }

    /// The core's counters and its free memory by kind, read together. It walks every handle: a
    /// diagnostic, not a statistic for every call. A block waiting in a thread cache is
    /// allocated in the core's books, so it counts in neither.
    pub fn free_memory(&self) -> (AllocStats, FreeMemory) {
        let core = self.core();
        (core.stats(), core.free_memory())
    }

    /// Starts the peaks over from the current values (PyTorch's `reset_peak_memory_stats`).
    pub fn reset_peaks(&self) {
        self.core().reset_peaks();
    }

    /// The mapped memory as segments of blocks, at their addresses in this process. A block
    /// waiting in a thread cache shows as free.
    pub fn segments(&self) -> Vec<Segment> {
        let mut segments = self.core().segments();
        for s in &mut segments {
            for b in &mut s.blocks {
                if b.state == BlockState::Allocated && self.live.is_cached(b.offset) {
                    b.state = BlockState::Free;
                    b.requested = 0;
                }
                b.offset += self.base;
            }
            s.offset += self.base;
        }
        segments
    }

    /// Whether `ptr` lies in this allocator's address range (live, cached or free).
    pub fn owns(&self, ptr: u64) -> bool {
        ptr.wrapping_sub(self.base) < self.va
    }

    /// Size of the live block at `ptr` (rounded), if there is one.
    pub fn block_size(&self, ptr: u64) -> Option<Bytes> {
        self.live.len_of(ptr.wrapping_sub(self.base)).map(Bytes)
    }

    /// Runs `f` with the core allocator's backing (its device and reservation).
    pub fn with_backing<R>(&self, f: impl FnOnce(&MappedBacking<S>) -> R) -> R {
        f(self.core().backing())
    }
}

impl<S: HandleSource> Drop for CachingAllocator<S> {
    fn drop(&mut self) {
        self.caches.forget(self.id);
    }
}

#[cfg(test)]
mod tests;
