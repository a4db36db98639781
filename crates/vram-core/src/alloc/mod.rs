//! The client's caching allocator, as pure single-threaded algorithms. The client crate wraps it
//! (locks, thread-local caches) and implements [`Backing`] with real handles and mappings.
//!
//! Model: one virtual reservation of `va_bytes` (virtual address space is free), seen here as
//! offsets. Physical memory comes from a [`Backing`] as handles, each a multiple of the 2 MiB
//! granularity and mapped whole. Handles are mapped side by side into one of the heaps of the
//! reservation ("stitching"): handles that were never adjacent form one contiguous range, so a large
//! block may span several, and free ranges merge across them. Small requests (below `small_limit`)
//! live in their own heap of 2 MiB pages so that they do not pin holes among large blocks, except
//! when that heap is full and growing it would pass the cap (below): then they may go where the
//! large heap has room (`small_fallback`), rather than holding more while memory lies free. With
//! `mid_limit` set, requests from `small_limit` up to it get a third heap (a KV cache's blocks,
//! kept out of the holes of larger short-lived ones); a large block that finds no room in its heap
//! takes the mid heap's before growing.
//!
//! - Allocation: the request is rounded up to `align` (512 B size classes) and served best fit from
//!   the free regions the stream may use. When none fits, the heap grows next to the usable free
//!   region that needs the least new memory. While held memory stays within `grow_slack` of the
//!   peak allocated, by a grant sized to the need (at least `min_grow`, doubled through a burst
//!   of growths with nothing freed between them up to `burst_growth` of what is held, and through
//!   a climb of growths at the cap close together up to `climb_growth`; above
//!   `max_handle`, split into handles that are small at both ends and large in the middle, so
//!   that the part of a large block's region that a later, smaller block leaves free lies in
//!   handles of its own; all of a growth's handles in one request); above it, wholly free handles elsewhere are returned first
//!   and the need granted (a moved handle would bring its whole size, and small ones stay small),
//!   except that one free handle of just the size needed is moved (unmapped and mapped again);
//!   `move_handles` moves them all instead.
//! - Streams: a block freed on stream `S` is reusable at once by `S`, and by other streams once a
//!   fence recorded on `S` at or after the free completes (see `stream.rs`). Deferred frees are
//!   fenced together: before growing, on `trim`, on a `tick` after a tick period without
//!   allocations or frees (a background thread ticks, maybe while another thread captures a graph:
//!   only an idle program is fenced from there), and — while allocations change streams (within
//!   the last `MIXED_WINDOW` allocations) — every `seal_every` frees of a stream. A program on one
//!   stream (most training loops) thus records no fence in its steady state: no other stream could
//!   use one. Fences are polled every `poll_every` allocations, and by any allocation that finds no
//!   room.
//! - Returning memory: [`Allocator::tick`] returns wholly free handles beyond the peak allocated over
//!   the last one to two `release_delay_us` (plus `keep_fraction`), so a training loop's per-step
//!   pattern keeps its memory; [`Allocator::trim`] returns every wholly free handle at once.
//!
//! Invariants (checked by the property tests): live blocks never overlap; every byte of a live block
//! is mapped; a block is never handed to another stream before the fence of its free completed;
//! memory that work may still use (a free whose fence is pending) is never unmapped or returned;
//! after every block is freed, its fences completed and `trim` ran, every handle is returned.

mod backing;
mod freelist;
mod heap;
mod layout;
mod stats;
mod stream;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashMap};

pub use backing::{Backing, BackingCounts, GrantId, ModelBacking, Refused};
pub use layout::{BlockState, Segment, SegmentBlock};
pub use stats::AllocStats;
pub use stream::{AlwaysComplete, Fence, Fences, StreamId};

use freelist::Owner;
use heap::{Heap, Mapped, Site};
use stream::{PendingFences, Seq};

use crate::Bytes;

/// Tuning of the allocator. The defaults suit an H200 (see DESIGN.md's device table).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct AllocConfig {
    /// The smallest unit that can be granted, mapped or returned.
    pub granularity: Bytes,
    /// Size of the virtual reservation that offsets are relative to.
    pub va_bytes: Bytes,
    /// Requests below this size are served from the small heap.
    pub small_limit: Bytes,
    /// Block sizes are multiples of this, and blocks start at multiples of it.
    pub align: Bytes,
    /// The least a large-heap grant adds, so that many small growths do not each cost a grant.
    pub min_grow: Bytes,
    /// Grants larger than this are split into several handles, which can be moved or returned
    /// alone (see `edge_handle`).
    pub max_handle: Bytes,
    /// A grant larger than `max_handle` is split into handles that start at this size at both
    /// ends and double toward the middle, up to `large_handle` (0: every handle `max_handle`).
    /// A large block's region is later reused in part, from either end: small handles at its
    /// edges can then be moved or returned, and large ones in its middle keep the count low.
    pub edge_handle: Bytes,
    /// The largest handle of a grant split by `edge_handle`.
    pub large_handle: Bytes,
    /// Held memory may exceed the peak of allocated bytes by this fraction before growth reuses
    /// wholly free handles from elsewhere instead of adding memory.
    pub grow_slack: f64,
    /// How growth at that cap reuses wholly free handles: `false` returns them to the daemon and
    /// grants what the growth needs as one handle (a handle a tenant returned comes back to it
    /// first, so a like-sized grant is a re-import), except that one free handle of just the size
    /// needed is moved; `true` always unmaps them and maps them at the growth site (no daemon
    /// call, but a moved handle brings its whole size, often more than the growth needs, and
    /// the surplus sits free there: gpt2_generate fragments 7.04 % against 4.98 %, mean over
    /// seven scales).
    pub move_handles: bool,
    /// Memory above the recent peak is returned only after this long (allocator time, µs).
    pub release_delay_us: u64,
    /// Headroom kept above the recent peak of allocated bytes, as a fraction of it.
    pub keep_fraction: f64,
    /// While allocations change streams, deferred frees of one stream that one recorded fence
    /// covers at most: fewer driver calls against memory that other streams, moves and returns
    /// must wait longer for. (On one stream, frees are fenced only when memory is needed
    /// elsewhere: before growing, on trim and when idle.)
    pub seal_every: u32,
    /// Allocations that find room without growing ask whether pending fences completed only once
    /// per this many (each asking is a driver call per stream with pending frees); an allocation
    /// that finds no room always asks first.
    pub poll_every: u32,
    /// A small block that finds no room in the small heap, when growing that heap would pass the
    /// growth cap, goes where the large heap has room instead — while the bytes allocated stay
    /// below this fraction of their peak (0: never; 1 or more: always at the cap, a new peak
    /// included). The small heap can only take free handles as small as its need, so otherwise it
    /// grants pages while memory lies free in the large heap (gpt2_generate with `min_grow=16MiB`: 18 MiB more held, with
    /// 890 MiB free, in the decode steps after its largest prefill); but a small block there may
    /// take a hole that a large block needs later. Off by default: always on, it brought the four
    /// traces' fragmentation down by 0.1-0.3 points (mean over seven scales), but took ResNet-50's
    /// PyTorch full-mode peak on an H200 from 3,139,436,544 to 3,187,671,040 B (0.99 too;
    /// docs/benchmarks.md).
    pub small_fallback: f64,
    /// Requests from `small_limit` up to below this size get a heap of their own (0: none, the
    /// default). It keeps blocks such as a KV cache's, which build up while larger short-lived
    /// blocks come and go, from pinning holes among those: gpt2_generate fragments 1.07 % against
    /// 4.98 % at 16 MiB (mean over seven scales). But memory passes between the heaps only as
    /// wholly free handles (returned and granted again), so where sizes mix freely more is held:
    /// bert_train_varlen 5.41 % against 3.00 %, fasterrcnn_varsize 5.17 % against 2.30 %; and a
    /// live GPT-2 medium generation on an H200, whose weights are mid-sized, held 3,368,026,112 B
    /// with it against 3,210,739,712 B without. A setting to try on a snapshot of the workload
    /// (`vramd replay --set mid_limit=16MiB`), not a default; docs/benchmarks.md has the figures.
    pub mid_limit: Bytes,
    /// The least a growth of the mid heap adds: its blocks grow a little at each decode step, and
    /// each growth at the cap is a grant (6 MiB: gpt2_generate 1.89 % at a modelled driver share
    /// of 1.03 %, against 1.07 % and 1.75 % growing by the block).
    pub mid_min_grow: Bytes,
    /// While growths of the large heap follow each other with nothing freed between them (a
    /// program loading its weights and optimiser state), each adds twice what the one before
    /// did, from `min_grow` up to this fraction of what is held (0: every growth adds its need,
    /// at least `min_grow`). A start-up that allocates its tensors one by one then costs a few
    /// grants instead of one each: bert_train_varlen's modelled driver share 1.24 → 0.99 % on
    /// its snapshot (fragmentation 2.91 → 2.44 %), 1.28 → 0.99 % mean over 21 request scales,
    /// at 3.16 % fragmentation there against 3.04 %; PyTorch's full-mode peaks on an H200 are
    /// the same to the byte (docs/benchmarks.md). The first free ends the burst.
    pub burst_growth: f64,
    /// The most a climbing growth of the large heap adds (0: no climbing). A growth at the cap
    /// that finds no wholly free handle to reuse, within `climb_window` allocations of the one
    /// before it, adds twice what that one did, from twice `min_grow` up to this. A footprint
    /// that rises a little at every step (a KV cache growing a token per decode step, while the
    /// blocks of the step before are freed) otherwise costs a grant of `min_grow` every step
    /// or two: gpt2_generate's modelled driver share 1.34 → 0.93 % (mean over 21 request
    /// scales), at fragmentation 2.69 % against 2.35 %; the other traces' means move by less
    /// than their noise between neighbouring scales (docs/benchmarks.md).
    pub climb_growth: Bytes,
    /// See `climb_growth`: growths at the cap this many allocations apart or closer climb
    /// (allocations that reach this allocator: the client's thread caches serve some before).
    pub climb_window: u64,
}

impl Default for AllocConfig {
    fn default() -> Self {
        Self {
            granularity: Bytes::mib(2),
            va_bytes: Bytes(Bytes::TIB),
            small_limit: Bytes::mib(1),
            align: Bytes(512),
            min_grow: Bytes::mib(2),
            max_handle: Bytes::mib(64),
            edge_handle: Bytes::mib(24),
            large_handle: Bytes::mib(256),
            grow_slack: 0.01,
            move_handles: false,
            release_delay_us: 10_000_000,
            keep_fraction: 0.0625,
            seal_every: 8,
            poll_every: 8,
            small_fallback: 0.0,
            mid_limit: Bytes::ZERO,
            mid_min_grow: Bytes::mib(6),
            burst_growth: 0.0625,
            climb_growth: Bytes::mib(8),
            climb_window: 1000,
        }
    }
}

impl AllocConfig {
    /// Changes one setting from text, as in `min_grow=16MiB` (a field name of this struct and a
    /// value: sizes with or without a unit, numbers, `true`/`false`). Unknown names and values
    /// that do not parse are errors that say so.
    pub fn set(&mut self, setting: &str) -> Result<(), String> {
        let (key, value) = setting
            .split_once('=')
            .ok_or_else(|| format!("`{setting}`: expected NAME=VALUE, e.g. min_grow=16MiB"))?;
        let (key, value) = (key.trim(), value.trim());
        let mut fields = match serde_json::to_value(&*self) {
            Ok(serde_json::Value::Object(m)) => m,
            _ => unreachable!("AllocConfig serialises as an object"),
        };
        if !fields.contains_key(key) {
            let mut names: Vec<&str> = fields.keys().map(String::as_str).collect();
            names.sort_unstable();
            return Err(format!(
                "`{key}` is not an allocator setting (known: {})",
                names.join(", ")
            ));
        }
        let parsed = serde_json::from_str::<serde_json::Value>(value)
            .unwrap_or_else(|_| serde_json::Value::String(value.to_string()));
        fields.insert(key.to_string(), parsed);
        let changed: AllocConfig = serde_json::from_value(serde_json::Value::Object(fields))
            .map_err(|e| format!("`{setting}`: {e}"))?;
        for (name, n) in [
            ("seal_every", changed.seal_every),
            ("poll_every", changed.poll_every),
        ] {
            if n == 0 {
                return Err(format!("`{setting}`: {name} must be at least 1"));
            }
        }
        *self = changed;
        Ok(())
    }

    /// Applies settings separated by commas (`min_grow=16MiB,max_handle=32MiB`).
    pub fn set_all(&mut self, settings: &str) -> Result<(), String> {
        settings
            .split(',')
            .filter(|s| !s.trim().is_empty())
            .try_for_each(|s| self.set(s))
    }
}

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
}

/// How much a growth adds: its usual step (`min_grow`, bursts, climbs), or only what the block
/// needs (after the usual step was refused).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    Usual,
    NeedOnly,
}

const LARGE: usize = 0;
const SMALL: usize = 1;
const MID: usize = 2;

#[derive(Clone, Copy, Debug)]
struct Live {
    len: u64,
    requested: u64,
    heap: usize,
}

/// The handle sizes, in address order, that a grant of `bytes` (a multiple of `gran`) is split
/// into: one handle up to `max_handle`; above it, handles of `edge_handle`, twice that, and so on
/// from both ends toward the middle, and the middle in handles of at most `large_handle`.
fn split_grant(bytes: u64, gran: u64, config: &AllocConfig) -> Vec<u64> {
    let down = |b: Bytes| b.get() / gran * gran;
    let max = down(config.max_handle).max(gran);
    let edge = down(config.edge_handle);
    let large = down(config.large_handle).max(max);
    let mut ends = Vec::new();
    let mut left = bytes;
    if edge > 0 && bytes > max {
        let mut rung = edge.min(large);
        while left >= 2 * rung {
            ends.push(rung);
            left -= 2 * rung;
            rung = (rung * 2).min(large);
        }
    }
    let middle = if ends.is_empty() { max } else { large };
    let mut out = ends.clone();
    while left > 0 {
        out.push(left.min(middle));
        left -= left.min(middle);
    }
    out.extend(ends.iter().rev());
    out
}

/// The peak of a value over the last one to two windows of `width`.
#[derive(Debug, Default)]
struct PeakWindow {
    start: u64,
    current: u64,
    previous: u64,
}

impl PeakWindow {
    fn observe(&mut self, now: u64, value: u64, width: u64) -> u64 {
        if now >= self.start.saturating_add(width) {
            let adjacent = now < self.start.saturating_add(width.saturating_mul(2));
            self.previous = if adjacent { self.current } else { 0 };
            self.start = now;
            self.current = 0;
        }
        self.current = self.current.max(value);
        self.previous.max(self.current)
    }
}

/// The caching allocator. See the module documentation for the model and its invariants.
#[derive(Debug)]
pub struct Allocator<B> {
    config: AllocConfig,
    backing: B,
    heaps: [Heap; 3],
    live: HashMap<u64, Live>,
    pending: PendingFences,
    /// Streams with deferred frees not yet covered by a fence: their latest such free's sequence
    /// number, and how many there are.
    unsealed: BTreeMap<StreamId, (Seq, u32)>,
    seq: Seq,
    stats: AllocStats,
    window: PeakWindow,
    allocated_since_tick: u64,
    /// The growth step of a burst of growths with nothing freed between them, and the count of
    /// frees at the latest growth.
    burst: u64,
    frees_at_growth: u64,
    /// The step of the latest climbing growth (0: not climbing), and the count of allocations at
    /// the latest growth at the cap that found nothing to reuse.
    climb: u64,
    allocs_at_climb: Option<u64>,
    /// Whether an allocation or free happened since the last tick.
    busy_since_tick: bool,
    /// Allocations since pending fences were last polled.
    allocs_since_poll: u32,
    next_scan: u64,
    /// The stream of the latest allocation, and the count of allocations when it last changed:
    /// frees are fenced every `seal_every` only while streams took turns within the last
    /// `MIXED_WINDOW` allocations.
    last_stream: Option<StreamId>,
    switched_at: Option<u64>,
}

/// Allocations after the latest change of stream during which the allocator still counts the
/// program as using several streams (a side stream used once, as for a CUDA graph's warm-up, does
/// not cost a one-stream loop its fence-free steady state for good).
const MIXED_WINDOW: u64 = 10_000;

impl<B: Backing> Allocator<B> {
    /// # Panics
    /// If the granularity or alignment is zero or not a power of two, or the reservation is smaller
    /// than 16 granules.
    pub fn new(config: AllocConfig, backing: B) -> Self {
        let gran = config.granularity.get();
        assert!(gran.is_power_of_two() && config.align.get().is_power_of_two());
        assert!(config.va_bytes.get() >= 16 * gran);
        let mid = config.va_bytes.get() / 16 * 12 / gran * gran;
        let split = config.va_bytes.get() / 16 * 15 / gran * gran;
        let end = config.va_bytes.get() / gran * gran;
        Self {
            heaps: [
                Heap::new(0, mid),
                Heap::new(split, end),
                Heap::new(mid, split),
            ],
            backing,
            live: HashMap::new(),
            pending: PendingFences::default(),
            unsealed: BTreeMap::new(),
            seq: 0,
            stats: AllocStats::default(),
            window: PeakWindow::default(),
            allocated_since_tick: 0,
            burst: 0,
            frees_at_growth: u64::MAX,
            climb: 0,
            allocs_at_climb: None,
            busy_since_tick: false,
            allocs_since_poll: 0,
            next_scan: 0,
            last_stream: None,
            switched_at: None,
            config,
        }
    }

    /// The offsets of the small-request heap: every block below `small_limit` lies in it.
    pub fn small_heap(&self) -> std::ops::Range<u64> {
        self.heaps[SMALL].range()
    }

    /// The offsets of the mid heap: every block from `small_limit` up to below `mid_limit` lies
    /// in it, and large blocks that find room there.
    pub fn mid_heap(&self) -> std::ops::Range<u64> {
        self.heaps[MID].range()
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

    /// The mapped memory as segments of blocks, large heap first, each in address order.
    pub fn segments(&self) -> Vec<Segment> {
        let mut out = layout::segments(&self.heaps[LARGE], &self.live, false);
        out.extend(layout::segments(&self.heaps[MID], &self.live, false));
        out.extend(layout::segments(&self.heaps[SMALL], &self.live, true));
        out
    }

    /// The mapped handles as `(offset, len)`, large heap first, each in address order.
    pub fn handles(&self) -> Vec<(u64, u64)> {
        self.heaps
            .iter()
            .flat_map(|h| h.handles.iter().map(|(&va, m)| (va, m.len)))
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
        self.busy_since_tick = true;
        self.note_stream(stream);
        self.allocs_since_poll += 1;
        if self.allocs_since_poll >= self.config.poll_every {
            self.poll(fences);
        }
        let align = self.config.align.get();
        let too_large = AllocError::TooLarge {
            requested: size,
            va: self.config.va_bytes,
        };
        let len = size
            .get()
            .max(1)
            .checked_next_multiple_of(align)
            .ok_or(too_large.clone())?;
        let mut h = if size < self.config.small_limit {
            SMALL
        } else if size < self.config.mid_limit {
            MID
        } else {
            LARGE
        };
        let mut found = self.heaps[h].free.best_fit(len, stream);
        if found.is_none() {
            // Frees whose fences completed may have made room (their regions merge once every
            // stream may use them).
            self.seal(fences);
            self.poll(fences);
            found = self.heaps[h].free.best_fit(len, stream);
        }
        // A small block that finds no room in its heap when growing it would take what the tenant
        // holds past the cap may go where the large heap has room (see `small_fallback`).
        if found.is_none()
            && h == SMALL
            && self.config.small_fallback > 0.0
            && (self.config.small_fallback >= 1.0
                || ((self.stats.allocated.get() + len) as f64)
                    < self.stats.allocated_peak.get() as f64 * self.config.small_fallback)
            && self.at_cap(self.config.granularity.get(), len)
        {
            if let Some(at) = self.heaps[LARGE].free.best_fit(len, stream) {
                (h, found) = (LARGE, Some(at));
            }
        }
        // A large block that finds no room in its heap takes the mid heap's before growing.
        if found.is_none() && h == LARGE && self.config.mid_limit > Bytes::ZERO {
            if let Some(at) = self.heaps[MID].free.best_fit(len, stream) {
                (h, found) = (MID, Some(at));
            }
        }
        let start = match found {
            Some(start) => start,
            None => {
                if let Err(e) = self.grow_or_retry(h, len, stream) {
                    if matches!(e, AllocError::OutOfMemory { .. }) {
                        self.stats.refused += 1;
                    }
                    return Err(e);
                }
                self.heaps[h]
                    .free
                    .best_fit(len, stream)
                    .expect("growth made room for the block")
            }
        };
        self.heaps[h].free.take(start, len);
        self.live.insert(
            start,
            Live {
                len,
                requested: size.get(),
                heap: h,
            },
        );
        self.stats.on_alloc(len, size.get());
        self.allocated_since_tick = self.allocated_since_tick.max(self.stats.allocated.get());
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
        let (owner, seq) = if fence == Fence::NEVER {
            // No fence will ever release it: a sequence number no completed fence reaches.
            (Owner::Stream(stream), Seq::MAX)
        } else if fences.is_complete(fence) {
            // Recorded at this free and passed: the stream's earlier deferred frees are done too.
            if let Some((seq, _)) = self.unsealed.remove(&stream) {
                for heap in &mut self.heaps {
                    heap.free.complete(stream, seq);
                }
            }
            (Owner::Any, 0)
        } else {
            // Recorded now, so it covers the stream's earlier deferred frees too.
            self.unsealed.remove(&stream);
            self.pending.push(stream, self.seq, fence);
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
        let freed = self.add_free(offset, b, Owner::Stream(stream), self.seq);
        let entry = self.unsealed.entry(stream).or_insert((0, 0));
        *entry = (self.seq, entry.1 + 1);
        if entry.1 >= self.config.seal_every && self.streams_mixed() {
            self.seal_stream(stream, fences);
        }
        Ok(freed)
    }

    /// Notes that an allocation is for `stream`.
    fn note_stream(&mut self, stream: StreamId) {
        if self.last_stream != Some(stream) {
            if self.last_stream.is_some() {
                self.switched_at = Some(self.stats.allocs);
            }
            self.last_stream = Some(stream);
        }
    }

    /// Whether allocations changed stream within the last `MIXED_WINDOW` allocations.
    fn streams_mixed(&self) -> bool {
        self.switched_at
            .is_some_and(|at| self.stats.allocs - at < MIXED_WINDOW)
    }

    /// Takes the live block at `offset` out of the books for a free, under a new sequence number.
    fn take_live(&mut self, offset: u64) -> Result<Live, AllocError> {
        let b = self
            .live
            .remove(&offset)
            .ok_or(AllocError::UnknownBlock { offset })?;
        self.busy_since_tick = true;
        self.seq += 1;
        Ok(b)
    }

    /// Puts a freed block's memory into its heap's free regions; returns its length.
    fn add_free(&mut self, offset: u64, b: Live, owner: Owner, seq: Seq) -> Bytes {
        self.heaps[b.heap].free.insert(offset, b.len, owner, seq);
        self.stats.on_free(b.len, b.requested);
        Bytes(b.len)
    }

    /// Records one fence on each stream with deferred frees, covering them all.
    fn seal<F: Fences + ?Sized>(&mut self, fences: &F) {
        let streams: Vec<StreamId> = self.unsealed.keys().copied().collect();
        for stream in streams {
            self.seal_stream(stream, fences);
        }
    }

    fn seal_stream<F: Fences + ?Sized>(&mut self, stream: StreamId, fences: &F) {
        let Some(&(seq, _)) = self.unsealed.get(&stream) else {
            return;
        };
        // A stream being captured cannot take a fence now: its frees wait for a later seal.
        if let Some(fence) = fences.record(stream) {
            self.stats.fences += 1;
            self.unsealed.remove(&stream);
            self.pending.push(stream, seq, fence);
        }
    }

    /// Lets time pass (`now_us`, allocator time): returns wholly free memory above the recent peak
    /// of allocated bytes plus headroom, once it has stayed above it for `release_delay_us`.
    /// Returns the bytes given back.
    pub fn tick<F: Fences + ?Sized>(&mut self, now_us: u64, fences: &F) -> Bytes {
        // A program that stopped allocating leaves its last deferred frees unfenced: fence them
        // now, so that their memory can go back. Only when idle since the last tick: a tick runs
        // on a background thread, and a busy program may be capturing a graph on another.
        if !std::mem::take(&mut self.busy_since_tick) {
            self.seal(fences);
        }
        self.poll(fences);
        let delay = self.config.release_delay_us;
        let recent = self
            .window
            .observe(now_us, self.allocated_since_tick, delay);
        self.allocated_since_tick = self.stats.allocated.get();
        let keep = recent + (recent as f64 * self.config.keep_fraction) as u64;
        let held = self.stats.held.get();
        if held <= keep || now_us < self.next_scan {
            return Bytes::ZERO;
        }
        self.next_scan = now_us.saturating_add(delay / 4);
        Bytes(self.release_free(held - keep))
    }

    /// Returns every wholly free handle now (the daemon's reclaim request). Memory whose fence is
    /// still pending stays. Returns the bytes given back.
    pub fn trim<F: Fences + ?Sized>(&mut self, fences: &F) -> Bytes {
        self.seal(fences);
        self.poll(fences);
        Bytes(self.release_free(u64::MAX))
    }

    fn poll<F: Fences + ?Sized>(&mut self, fences: &F) {
        self.allocs_since_poll = 0;
        if self.pending.is_empty() {
            return;
        }
        for (stream, seq) in self.pending.poll(fences, &mut self.stats.fence_queries) {
            for heap in &mut self.heaps {
                heap.free.complete(stream, seq);
            }
        }
    }

    /// The most the tenant may hold, while growth adds memory, with `len` more bytes allocated:
    /// `grow_slack` above the peak allocated. Past it, growth reuses wholly free handles first.
    fn growth_cap(&self, len: u64) -> u64 {
        let peak = self
            .stats
            .allocated_peak
            .get()
            .max(self.stats.allocated.get() + len);
        peak + (peak as f64 * self.config.grow_slack) as u64
    }

    /// Whether adding `need` bytes for a block of `len` would take what the tenant holds past
    /// [`Self::growth_cap`].
    fn at_cap(&self, need: u64, len: u64) -> bool {
        self.stats.held.get() + need > self.growth_cap(len)
    }

    /// [`Self::grow`] by the usual step; when that is refused (the tenant's limit, or the
    /// device), gives back every wholly free handle and tries again, then once more for the
    /// block's need alone, without the step that growth usually rounds up to.
    fn grow_or_retry(&mut self, h: usize, len: u64, stream: StreamId) -> Result<(), AllocError> {
        let refused = |r: &Result<(), AllocError>| matches!(r, Err(AllocError::OutOfMemory { .. }));
        let first = self.grow(h, len, stream, Step::Usual);
        if !refused(&first) {
            return first;
        }
        self.release_free(u64::MAX);
        let second = self.grow(h, len, stream, Step::Usual);
        if !refused(&second) {
            return second;
        }
        self.grow(h, len, stream, Step::NeedOnly)
    }

    /// Maps more memory into heap `h` so that a block of `len` bytes fits for `stream`.
    fn grow(&mut self, h: usize, len: u64, stream: StreamId, step: Step) -> Result<(), AllocError> {
        let gran = self.config.granularity.get();
        let site = self.heaps[h]
            .growth_site(len, gran, stream)
            .ok_or(AllocError::TooLarge {
                requested: Bytes(len),
                va: self.config.va_bytes,
            })?;
        // Below the cap, grant: the slack lets later blocks wrap around into old holes instead of
        // every growth reusing handles. At the cap, reuse wholly free handles first.
        let at_cap = self.at_cap(site.need, len);
        let mut moves = if at_cap {
            self.pick_moves(h, &site)
        } else {
            Vec::new()
        };
        // One free handle of just the size needed is moved: returned, the daemon would hand the
        // same handle back. Otherwise they go back first (room under the tenant's limit too), and
        // the need is granted below as one handle: a move would bring their whole size, and
        // several small ones in place of one.
        let exact = matches!(moves.as_slice(), [(_, _, l)] if *l == site.need);
        if !self.config.move_handles && !moves.is_empty() && !exact {
            let handles: Vec<(usize, u64)> =
                moves.drain(..).map(|(from, va, _)| (from, va)).collect();
            self.return_handles(&handles);
        }
        let moved: u64 = moves.iter().map(|m| m.2).sum();
        let missing = site.need.saturating_sub(moved);
        let grants = if missing == 0 {
            Vec::new()
        } else {
            let floor = match h {
                _ if step == Step::NeedOnly => gran,
                LARGE if at_cap && moved == 0 => self.large_growth_step().max(self.climb_step()),
                LARGE => self.large_growth_step(),
                MID => self.config.mid_min_grow.get().next_multiple_of(gran),
                _ => gran,
            };
            let room = site.gap.1 - moved;
            self.grant(missing.max(floor).min(room), len)?
        };
        let mut pieces: Vec<Mapped> = moves
            .iter()
            .map(|&(from, va, _)| {
                let m = self.heaps[from].remove(va);
                self.backing.unmap(m.grant, va);
                self.stats.unmaps += 1;
                m
            })
            .collect();
        pieces.extend(grants);
        let total: u64 = pieces.iter().map(|m| m.len).sum();
        let (gap, gap_len) = site.gap;
        let mut va = if site.at_gap_end {
            gap + gap_len - total
        } else {
            gap
        };
        let mut pieces = pieces.into_iter();
        while let Some(m) = pieces.next() {
            if let Err(source) = self.backing.map(m.grant, va) {
                let unmapped: Vec<Mapped> = std::iter::once(m).chain(pieces).collect();
                let grants: Vec<GrantId> = unmapped.iter().map(|m| m.grant).collect();
                self.backing.release(&grants);
                for m in unmapped {
                    self.stats.on_return(m.len);
                }
                return Err(self.out_of_memory(len, source));
            }
            self.stats.on_map(m.len);
            self.heaps[h].place(va, m, site.owner, site.seq);
            va += m.len;
        }
        Ok(())
    }

    /// The least a grant for the large heap adds now: `min_grow`, doubled at each growth that
    /// follows the one before with nothing freed between them, up to `burst_growth` of what is
    /// held (see that setting).
    fn large_growth_step(&mut self) -> u64 {
        let gran = self.config.granularity.get();
        let min = self.config.min_grow.get().next_multiple_of(gran);
        let cap = (self.stats.held.get() as f64 * self.config.burst_growth) as u64 / gran * gran;
        self.burst = if self.stats.frees == self.frees_at_growth {
            (self.burst * 2).min(cap).max(min)
        } else {
            min
        };
        self.frees_at_growth = self.stats.frees;
        self.burst
    }

    /// The least a growth of the large heap at the cap that found nothing to reuse adds: twice
    /// what the one before added if that came within `climb_window` allocations, from twice
    /// `min_grow` up to `climb_growth`; else nothing beyond the usual step.
    fn climb_step(&mut self) -> u64 {
        let gran = self.config.granularity.get();
        let top = self.config.climb_growth.get() / gran * gran;
        let allocs = self.stats.allocs;
        let near = self
            .allocs_at_climb
            .replace(allocs)
            .is_some_and(|at| allocs - at <= self.config.climb_window);
        self.climb = if near && top > 0 {
            (self.climb.max(self.config.min_grow.get()) * 2).min(top)
        } else {
            0
        };
        self.climb
    }

    /// Wholly free handles to reuse for the growth site instead of adding memory (returned, or
    /// moved there), as `(heap, va, len)`: the smallest one that covers the need, else the
    /// largest ones first.
    fn pick_moves(&self, h: usize, site: &Site) -> Vec<(usize, u64, u64)> {
        let gran = self.config.granularity.get();
        let room = site.gap.1;
        let mut candidates: Vec<(usize, u64, u64)> = Vec::new();
        for (from, heap) in self.heaps.iter().enumerate() {
            let skip = if from == h { site.extends } else { None };
            for (va, l) in heap.free_handles(gran, skip) {
                // The small heap takes only what it needs: what it holds serves small blocks only.
                if l <= room && (h != SMALL || l <= site.need) {
                    candidates.push((from, va, l));
                }
            }
        }
        if let Some(&one) = candidates
            .iter()
            .filter(|c| c.2 >= site.need)
            .min_by_key(|c| c.2)
        {
            return vec![one];
        }
        candidates.sort_by_key(|c| std::cmp::Reverse(c.2));
        let mut total = 0;
        let mut out = Vec::new();
        for c in candidates {
            if total >= site.need {
                break;
            }
            if total + c.2 <= room {
                total += c.2;
                out.push(c);
            }
        }
        out
    }

    /// Grants `bytes` as the handles of [`split_grant`], in one request.
    fn grant(&mut self, bytes: u64, wanted: u64) -> Result<Vec<Mapped>, AllocError> {
        let gran = self.config.granularity.get();
        let sizes: Vec<Bytes> = split_grant(bytes, gran, &self.config)
            .into_iter()
            .map(Bytes)
            .collect();
        let grants = self
            .backing
            .grant(&sizes)
            .map_err(|source| self.out_of_memory(wanted, source))?;
        assert_eq!(
            grants.len(),
            sizes.len(),
            "the backing granted another count"
        );
        self.stats.grant_requests += 1;
        Ok(grants
            .into_iter()
            .zip(sizes)
            .map(|(grant, len)| {
                self.stats.on_grant(len.get());
                Mapped {
                    grant,
                    len: len.get(),
                }
            })
            .collect())
    }

    fn out_of_memory(&self, wanted: u64, source: Refused) -> AllocError {
        AllocError::OutOfMemory {
            requested: Bytes(wanted),
            held: self.stats.held,
            allocated: self.stats.allocated,
            source,
        }
    }

    /// Unmaps and returns wholly free handles, the largest first, up to about `budget` bytes.
    fn release_free(&mut self, budget: u64) -> u64 {
        let gran = self.config.granularity.get();
        let mut handles: Vec<(usize, u64, u64)> = Vec::new();
        for (h, heap) in self.heaps.iter().enumerate() {
            handles.extend(
                heap.free_handles(gran, None)
                    .into_iter()
                    .map(|(va, l)| (h, va, l)),
            );
        }
        handles.sort_by_key(|c| std::cmp::Reverse(c.2));
        let mut released = 0;
        let mut chosen = Vec::new();
        for (h, va, l) in handles {
            if released + l > budget {
                continue;
            }
            chosen.push((h, va));
            released += l;
        }
        self.return_handles(&chosen);
        released
    }

    /// Unmaps the wholly free handles at `(heap, va)` and gives them back in one request.
    fn return_handles(&mut self, handles: &[(usize, u64)]) {
        if handles.is_empty() {
            return;
        }
        let mut grants = Vec::with_capacity(handles.len());
        for &(h, va) in handles {
            let m = self.heaps[h].remove(va);
            self.backing.unmap(m.grant, va);
            self.stats.unmaps += 1;
            self.stats.on_return(m.len);
            grants.push(m.grant);
        }
        self.backing.release(&grants);
    }
}
