use std::collections::{BTreeMap, HashSet};

use proptest::prelude::*;

use super::*;

const MIB: u64 = Bytes::MIB;

/// Fences whose completion the test controls, completing in order per stream as CUDA events do.
/// The allocator records through the trait (deferred frees); the test through `record_now`.
#[derive(Default)]
struct TestFences {
    inner: std::cell::RefCell<FenceBook>,
}

#[derive(Default)]
struct FenceBook {
    next: u64,
    done: HashSet<u64>,
    /// Per stream: every fence recorded, in order, and how many of them completed.
    recorded: BTreeMap<u64, Vec<u64>>,
    completed: BTreeMap<u64, usize>,
    /// Streams being captured: nothing can be recorded on them.
    capturing: HashSet<u64>,
    /// Times the allocator asked whether a fence completed.
    queries: usize,
    /// Whether `wait` may complete a fence (a device that can be waited for).
    waitable: bool,
}

impl TestFences {
    /// Fences that complete when waited for (and when a test completes them).
    fn waitable() -> TestFences {
        let f = TestFences::default();
        f.inner.borrow_mut().waitable = true;
        f
    }

    fn record_now(&self, stream: u64) -> Fence {
        let mut b = self.inner.borrow_mut();
        b.next += 1;
        let f = b.next;
        b.recorded.entry(stream).or_default().push(f);
        Fence(f)
    }
    /// Fences recorded on `stream` so far.
    fn recorded(&self, stream: u64) -> usize {
        self.inner
            .borrow()
            .recorded
            .get(&stream)
            .map_or(0, Vec::len)
    }
    /// Fences of `stream` completed so far.
    fn completed(&self, stream: u64) -> usize {
        self.inner
            .borrow()
            .completed
            .get(&stream)
            .copied()
            .unwrap_or(0)
    }
    fn complete(&self, stream: u64, n: usize) {
        let mut b = self.inner.borrow_mut();
        let all = b.recorded.get(&stream).cloned().unwrap_or_default();
        let done = b.completed.get(&stream).copied().unwrap_or(0);
        let to = done.saturating_add(n).min(all.len());
        for &f in &all[done..to] {
            b.done.insert(f);
        }
        b.completed.insert(stream, to);
    }
    fn complete_all(&self) {
        let streams: Vec<u64> = self.inner.borrow().recorded.keys().copied().collect();
        for s in streams {
            self.complete(s, usize::MAX);
        }
    }
    fn set_capturing(&self, stream: u64, on: bool) {
        let mut b = self.inner.borrow_mut();
        if on {
            b.capturing.insert(stream);
        } else {
            b.capturing.remove(&stream);
        }
    }
}

impl Fences for TestFences {
    fn is_complete(&self, fence: Fence) -> bool {
        let mut b = self.inner.borrow_mut();
        b.queries += 1;
        b.done.contains(&fence.0)
    }

    fn record(&self, stream: StreamId) -> Option<Fence> {
        if self.inner.borrow().capturing.contains(&stream.0) {
            return None;
        }
        Some(self.record_now(stream.0))
    }

    /// Completes `fence` and its stream's earlier ones, where the test allows waits.
    fn wait(&self, fence: Fence) -> bool {
        let (stream, n) = {
            let b = self.inner.borrow();
            if !b.waitable {
                return false;
            }
            let found = b
                .recorded
                .iter()
                .find_map(|(&s, all)| all.iter().position(|&f| f == fence.0).map(|i| (s, i + 1)));
            let Some((s, upto)) = found else { return true };
            (
                s,
                upto.saturating_sub(b.completed.get(&s).copied().unwrap_or(0)),
            )
        };
        self.complete(stream, n);
        true
    }
}

fn small_config() -> AllocConfig {
    AllocConfig {
        va_bytes: Bytes::gib(64),
        max_handle: Bytes::mib(16),
        min_grow: Bytes::mib(4),
        release_delay_us: 1000,
        ..AllocConfig::default()
    }
}

#[derive(Clone, Debug)]
enum Op {
    Alloc {
        size: u64,
        stream: u64,
    },
    /// Frees a live block on its stream, with a fence recorded at the free or deferred.
    Free {
        pick: usize,
        deferred: bool,
    },
    Complete {
        stream: u64,
        n: usize,
    },
    /// Starts or ends a graph capture on a stream: frees on it then get `Fence::NEVER`, and no
    /// fence can be recorded on it.
    Capture {
        stream: u64,
        on: bool,
    },
    Tick {
        dt: u64,
    },
    Trim,
    /// A use of the private pool begins (a capture into it).
    PoolBegin,
    /// An allocation into the pool (skipped while it is not in use), on stream 0.
    PoolAlloc {
        size: u64,
    },
    /// A use of the pool ends.
    PoolRelease,
    /// The released pools are settled (the device was synchronised).
    Settle,
}

fn op() -> impl Strategy<Value = Op> {
    let size = prop_oneof![Just(0u64), 1u64..4096, 4096u64..MIB, MIB..(40 * MIB),];
    prop_oneof![
        4 => (size.clone(), 0u64..3).prop_map(|(size, stream)| Op::Alloc { size, stream }),
        3 => (any::<usize>(), any::<bool>()).prop_map(|(pick, deferred)| Op::Free { pick, deferred }),
        2 => (0u64..3, 0usize..4).prop_map(|(stream, n)| Op::Complete { stream, n }),
        1 => (0u64..3, proptest::bool::weighted(0.3)).prop_map(|(stream, on)| Op::Capture { stream, on }),
        1 => (0u64..3000).prop_map(|dt| Op::Tick { dt }),
        1 => Just(Op::Trim),
        1 => Just(Op::PoolBegin),
        2 => size.prop_map(|size| Op::PoolAlloc { size }),
        1 => Just(Op::PoolRelease),
        1 => Just(Op::Settle),
    ]
}

/// A freed range that only `stream` may reuse until a fence recorded on it after the free (the
/// `after`-th fence of the stream or a later one) completed; `after: None` is never.
struct Freed {
    start: u64,
    len: u64,
    stream: u64,
    after: Option<usize>,
}

impl Freed {
    fn released(&self, fences: &TestFences) -> bool {
        self.after
            .is_some_and(|i| fences.completed(self.stream) > i)
    }
}

fn overlaps(a: u64, alen: u64, b: u64, blen: u64) -> bool {
    a < b + blen && b < a + alen
}

/// Settings the property test draws, beside the operations.
struct Drawn {
    grow_slack: f64,
    min_grow: Bytes,
    /// Whether the allocator may wait for fences before a growth.
    waitable: bool,
}

fn run_ops(ops: Vec<Op>, drawn: Drawn) {
    let config = AllocConfig {
        grow_slack: drawn.grow_slack,
        min_grow: drawn.min_grow,
        ..small_config()
    };
    let mut a = Allocator::new(config, ModelBacking::new());
    let fences = TestFences::default();
    fences.inner.borrow_mut().waitable = drawn.waitable;
    // Live blocks: offset -> (size, stream). Each is freed on its stream, as PyTorch does.
    let mut live: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
    let mut freed: Vec<Freed> = Vec::new();
    // The private pool: its uses, the generation in use (a pool used again after its last
    // release is a new one), the live blocks allocated from it, and what its blocks freed while
    // it was in use, by generation: no one else's until the generation is settled.
    let pool = PoolId(0, 1);
    let mut pool_uses = 0u32;
    let mut pool_gen = 0u64;
    let mut pool_live: BTreeMap<u64, u64> = BTreeMap::new();
    let mut pool_freed: Vec<(u64, u64, u64)> = Vec::new();
    let mut released_gens: Vec<u64> = Vec::new();
    let mut capturing: HashSet<u64> = HashSet::new();
    let mut never = false;
    let mut now = 0;
    for op in ops {
        match op {
            Op::Alloc { size, stream } => {
                let b = a.alloc(Bytes(size), StreamId(stream), &fences).unwrap();
                assert!(b.size.get() >= size.max(1));
                for &(s, l, g) in &pool_freed {
                    assert!(
                        !overlaps(b.offset, b.size.get(), s, l),
                        "block {b:?} for stream {stream} reuses memory of pool generation {g}"
                    );
                }
                if let Some((&s, &(l, _))) = live.range(..b.offset + b.size.get()).next_back() {
                    assert!(
                        s + l <= b.offset,
                        "block {b:?} overlaps live [{s:#x}, +{l})"
                    );
                }
                for f in &freed {
                    if f.stream != stream && !f.released(&fences) {
                        assert!(
                            !overlaps(b.offset, b.size.get(), f.start, f.len),
                            "block {b:?} for stream {stream} reuses memory stream {} freed, fence pending (freed [{:#x}, +{}), after fence {:?}; {} recorded, {} completed)",
                            f.stream,
                            f.start,
                            f.len,
                            f.after,
                            fences.recorded(f.stream),
                            fences.completed(f.stream)
                        );
                    }
                }
                // The stream took the memory back: its earlier frees there are superseded.
                freed.retain(|f| {
                    f.stream != stream || !overlaps(b.offset, b.size.get(), f.start, f.len)
                });
                live.insert(b.offset, (b.size.get(), stream));
            }
            Op::Free { pick, deferred } => {
                if live.is_empty() {
                    continue;
                }
                let (&start, &(len, stream)) = live.iter().nth(pick % live.len()).unwrap();
                live.remove(&start);
                if let Some(g) = pool_live.remove(&start) {
                    if pool_uses > 0 && g == pool_gen {
                        assert!(a.in_active_pool(start));
                        let got = a.free_deferred(start, StreamId(stream), &fences);
                        assert_eq!(got.unwrap().get(), len);
                        pool_freed.push((start, len, g));
                        continue;
                    }
                    assert!(!a.in_active_pool(start));
                }
                let next = fences.recorded(stream);
                let (got, after) = if capturing.contains(&stream) {
                    never = true;
                    let got = a.free(start, StreamId(stream), Fence::NEVER, &fences);
                    (got, None)
                } else if deferred {
                    (
                        a.free_deferred(start, StreamId(stream), &fences),
                        Some(next),
                    )
                } else {
                    let fence = fences.record_now(stream);
                    (a.free(start, StreamId(stream), fence, &fences), Some(next))
                };
                assert_eq!(got.unwrap().get(), len);
                freed.push(Freed {
                    start,
                    len,
                    stream,
                    after,
                });
            }
            Op::Complete { stream, n } => fences.complete(stream, n),
            Op::Capture { stream, on } => {
                fences.set_capturing(stream, on);
                if on {
                    capturing.insert(stream);
                } else {
                    capturing.remove(&stream);
                }
            }
            Op::Tick { dt } => {
                now += dt;
                a.tick(now, &fences);
            }
            Op::Trim => {
                a.trim(&fences);
            }
            Op::PoolBegin => {
                if pool_uses == 0 {
                    pool_gen += 1;
                }
                pool_uses += 1;
                a.pool_begin(pool);
            }
            Op::PoolAlloc { size } => {
                if pool_uses == 0 {
                    assert!(a.alloc_in_pool(Bytes(size), pool, &fences).is_err());
                    continue;
                }
                let b = a.alloc_in_pool(Bytes(size), pool, &fences).unwrap();
                assert!(b.size.get() >= size.max(1));
                if let Some((&s, &(l, _))) = live.range(..b.offset + b.size.get()).next_back() {
                    assert!(
                        s + l <= b.offset,
                        "pool block {b:?} overlaps live [{s:#x}, +{l})"
                    );
                }
                for f in &freed {
                    assert!(
                        f.released(&fences) || !overlaps(b.offset, b.size.get(), f.start, f.len),
                        "pool block {b:?} reuses memory whose fence is pending"
                    );
                }
                for &(s, l, g) in &pool_freed {
                    assert!(
                        g == pool_gen || !overlaps(b.offset, b.size.get(), s, l),
                        "pool block {b:?} reuses memory of pool generation {g}"
                    );
                }
                pool_freed.retain(|&(s, l, _)| !overlaps(b.offset, b.size.get(), s, l));
                live.insert(b.offset, (b.size.get(), 0));
                pool_live.insert(b.offset, pool_gen);
            }
            Op::PoolRelease => {
                let last = a.pool_release(pool);
                assert_eq!(last, pool_uses == 1);
                pool_uses = pool_uses.saturating_sub(1);
                if last {
                    released_gens.push(pool_gen);
                }
            }
            Op::Settle => {
                a.settle_pools(usize::MAX);
                pool_freed.retain(|&(_, _, g)| !released_gens.contains(&g));
                released_gens.clear();
            }
        }
        freed.retain(|f| !f.released(&fences));
        let backing = a.backing();
        for (&s, &(l, _)) in &live {
            assert!(
                backing.is_mapped(s, l),
                "live block [{s:#x}, +{l}) not mapped"
            );
        }
        for f in &freed {
            assert!(
                backing.is_mapped(f.start, f.len),
                "memory in use by pending work unmapped"
            );
        }
        let st = a.stats();
        assert_eq!(st.held, backing.held());
        assert_eq!(st.allocated.get(), live.values().map(|v| v.0).sum::<u64>());
        assert!(st.held >= st.allocated);
        let free = a.free_memory();
        assert_eq!(
            free.whole_handles + free.partly_used_handles + free.small_heap,
            st.held - st.allocated,
            "the free memory by kind does not add up to what is held beyond the live blocks"
        );
        check_segments(&a, &live);
        for (_, heap) in a.heaps.iter() {
            heap.free.check();
        }
    }
    for c in capturing {
        fences.set_capturing(c, false);
    }
    for (start, (_, stream)) in std::mem::take(&mut live) {
        a.free_deferred(start, StreamId(stream), &fences).unwrap();
    }
    // The pool's last uses end and it is settled: its memory goes back with the rest.
    while pool_uses > 0 {
        a.pool_release(pool);
        pool_uses -= 1;
    }
    a.settle_pools(usize::MAX);
    // The trim records the fences of the deferred frees; once they complete, a second trim
    // returns everything (but what was freed during a capture, which no fence releases).
    a.trim(&fences);
    fences.complete_all();
    a.trim(&fences);
    if never {
        return;
    }
    assert_eq!(
        a.backing().outstanding(),
        0,
        "handles still held after trim"
    );
    assert_eq!(a.stats().held, Bytes::ZERO);
    let c = a.backing().counts();
    assert_eq!((c.maps, c.grants), (c.unmaps, c.releases));
}

/// Segments tile the held memory exactly, and their allocated blocks are the live blocks.
fn check_segments(a: &Allocator<ModelBacking>, live: &BTreeMap<u64, (u64, u64)>) {
    let segs = a.segments();
    for s in &segs {
        let mut at = s.offset;
        for b in &s.blocks {
            assert_eq!(b.offset, at, "blocks of {s:?} do not tile it");
            at += b.len;
        }
        assert_eq!(at, s.offset + s.len);
    }
    let held: u64 = segs.iter().map(|s| s.len).sum();
    assert_eq!(held, a.stats().held.get());
    let allocated: Vec<(u64, u64)> = segs
        .iter()
        .flat_map(|s| &s.blocks)
        .filter(|b| b.state == BlockState::Allocated)
        .map(|b| (b.offset, b.len))
        .collect();
    let expected: Vec<(u64, u64)> = live.iter().map(|(&s, &(l, _))| (s, l)).collect();
    assert_eq!(allocated, expected);
}

#[test]
fn reset_peaks_starts_over_from_now() {
    let mut a = Allocator::new(small_config(), ModelBacking::new());
    let fences = TestFences::default();
    let big = a.alloc(Bytes::mib(8), StreamId(1), &fences).unwrap();
    a.alloc(Bytes::mib(1), StreamId(1), &fences).unwrap();
    a.free(big.offset, StreamId(1), Fence(0), &AlwaysComplete)
        .unwrap();
    assert!(a.stats().allocated_peak > a.stats().allocated);
    a.reset_peaks();
    let st = a.stats();
    assert_eq!(
        (st.allocated_peak, st.requested_peak, st.held_peak),
        (st.allocated, st.requested, st.held)
    );
}

/// A handle whose unmap fails stays mapped and held: it is not given back, and its range is
/// never mapped again (the model backing panics on a mapping over another), whether it was being
/// given back or moved.
#[test]
fn a_handle_whose_unmap_fails_keeps_its_range() {
    let mut a = Allocator::new(small_config(), ModelBacking::new());
    let fences = TestFences::default();
    let first = a.alloc(Bytes::mib(8), StreamId(1), &fences).unwrap();
    let held = a.stats().held;
    let stuck: Vec<u64> = a.handles().iter().map(|&(va, _)| va).collect();
    for &va in &stuck {
        a.backing_mut().fail_unmaps_at(va);
    }
    a.free(first.offset, StreamId(1), Fence(0), &AlwaysComplete)
        .unwrap();
    assert_eq!(a.trim(&fences), Bytes::ZERO, "nothing could be given back");
    assert_eq!(a.stats().held, held, "the stuck handles stay held");
    // New blocks go elsewhere, through growth at the cap (a move would try the stuck ones too).
    for _ in 0..4 {
        a.alloc(Bytes::mib(8), StreamId(1), &fences).unwrap();
    }
    assert!(
        a.handles().iter().all(|(va, _)| !stuck.contains(va)),
        "the stuck handles' ranges are never mapped again"
    );
    assert_eq!(a.backing().counts().releases, 0);
}

/// Settings as large as `set` takes (any finite fraction) saturate: no overflow, and growth
/// grows rather than treating every step as past the cap.
#[test]
fn huge_fractions_saturate() {
    let mut config = small_config();
    config.set("grow_slack=1e20").unwrap();
    config.set("keep_fraction=1e20").unwrap();
    let mut a = Allocator::new(config, ModelBacking::new());
    let fences = TestFences::default();
    let first = a.alloc(Bytes::mib(64), StreamId(1), &fences).unwrap();
    a.alloc(Bytes::mib(64), StreamId(1), &fences).unwrap();
    a.free(first.offset, StreamId(1), Fence(0), &AlwaysComplete)
        .unwrap();
    // Larger than the hole: new memory below the cap, where a wrapped cap would move the hole's.
    a.alloc(Bytes::mib(96), StreamId(1), &fences).unwrap();
    a.tick(u64::MAX / 2, &fences);
    let st = a.stats();
    assert!(st.held >= Bytes::mib(224), "{st:?}");
    let counts = a.backing().counts();
    assert_eq!(
        (counts.unmaps, counts.releases),
        (0, 0),
        "nothing moved or given back"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn allocator_invariants_hold(
        ops in proptest::collection::vec(op(), 1..300),
        grow_slack in prop_oneof![Just(0.0), Just(0.01), Just(0.5)],
        min_grow in prop_oneof![Just(Bytes::mib(2)), Just(Bytes::mib(4)), Just(Bytes::mib(16))],
        waitable in any::<bool>(),
    ) {
        let drawn = Drawn { grow_slack, min_grow, waitable };
        run_ops(ops, drawn);
    }
}

#[test]
fn freed_block_is_reused_at_once_on_its_stream_only() {
    let mut a = Allocator::new(small_config(), ModelBacking::new());
    let fences = TestFences::default();
    let b = a.alloc(Bytes::mib(8), StreamId(1), &fences).unwrap();
    let fence = fences.record_now(1);
    a.free(b.offset, StreamId(1), fence, &fences).unwrap();
    let other = a.alloc(Bytes::mib(8), StreamId(2), &fences).unwrap();
    assert!(!overlaps(
        b.offset,
        b.size.get(),
        other.offset,
        other.size.get()
    ));
    let same = a.alloc(Bytes::mib(8), StreamId(1), &fences).unwrap();
    assert_eq!(same.offset, b.offset);
    a.free(same.offset, StreamId(1), fences.record_now(1), &fences)
        .unwrap();
    fences.complete(1, 2);
    let later = a.alloc(Bytes::mib(8), StreamId(2), &fences).unwrap();
    assert_eq!(
        later.offset, b.offset,
        "reusable by all once the fence completed"
    );
}

#[test]
fn blocks_span_handles_that_were_granted_apart() {
    let config = AllocConfig {
        max_handle: Bytes::mib(2),
        min_grow: Bytes::mib(2),
        ..small_config()
    };
    let mut a = Allocator::new(config, ModelBacking::new());
    let b = a
        .alloc(Bytes::mib(10), StreamId(0), &AlwaysComplete)
        .unwrap();
    let c = a.backing().counts();
    assert_eq!(
        (c.grants, c.grant_requests),
        (5, 1),
        "five handles, one request"
    );
    assert_eq!(a.stats().grant_requests, 1);
    assert!(a.backing().is_mapped(b.offset, b.size.get()));
}

#[test]
fn a_growth_refused_in_part_holds_none_of_it() {
    let config = AllocConfig {
        max_handle: Bytes::mib(2),
        ..small_config()
    };
    let mut a = Allocator::new(config, ModelBacking::with_capacity(Bytes::mib(8)));
    let f = AlwaysComplete;
    let err = a.alloc(Bytes::mib(10), StreamId(0), &f).unwrap_err();
    assert!(matches!(err, AllocError::OutOfMemory { .. }), "{err}");
    assert_eq!(a.backing().held(), Bytes::ZERO);
    assert_eq!(a.backing().outstanding(), 0);
    assert_eq!(a.stats().held, Bytes::ZERO);
    let x = a.alloc(Bytes::mib(8), StreamId(0), &f).unwrap();
    assert!(a.backing().is_mapped(x.offset, x.size.get()));
}

#[test]
fn a_growth_refused_at_its_usual_step_is_granted_what_the_block_needs() {
    // Steps of 16 MiB (and climbs above it) against 10 MiB of room: each block still gets its
    // memory, as long as the block itself fits.
    for grow_slack in [0.0, 1.0] {
        let config = AllocConfig {
            min_grow: Bytes::mib(16),
            grow_slack,
            ..small_config()
        };
        let mut a = Allocator::new(config, ModelBacking::with_capacity(Bytes::mib(10)));
        let f = AlwaysComplete;
        let x = a.alloc(Bytes::mib(4), StreamId(0), &f).unwrap();
        let y = a.alloc(Bytes::mib(6), StreamId(0), &f).unwrap();
        assert!(a.backing().is_mapped(x.offset, x.size.get()));
        assert!(a.backing().is_mapped(y.offset, y.size.get()));
        assert_eq!(a.stats().held, Bytes::mib(10));
        // A block beyond the room is still refused, with nothing held for it.
        let err = a.alloc(Bytes::mib(2), StreamId(0), &f).unwrap_err();
        assert!(matches!(err, AllocError::OutOfMemory { .. }), "{err}");
        assert_eq!((a.stats().held, a.stats().refused), (Bytes::mib(10), 1));
    }
}

#[test]
fn growth_at_the_cap_reuses_free_handles_instead_of_adding_memory() {
    let mut a = Allocator::new(small_config(), ModelBacking::new());
    let f = AlwaysComplete;
    let x = a.alloc(Bytes::mib(8), StreamId(0), &f).unwrap();
    let _pin = a.alloc(Bytes::mib(2), StreamId(0), &f).unwrap();
    a.free(x.offset, StreamId(0), Fence(0), &f).unwrap();
    let held = a.stats().held;
    let before = a.backing().counts();
    let big = a.alloc(Bytes::mib(12), StreamId(0), &f).unwrap();
    assert!(a.backing().is_mapped(big.offset, big.size.get()));
    assert!(
        a.stats().held <= held + Bytes::mib(4),
        "reused the free 8 MiB instead of granting 12"
    );
    // x's free handles (within twice the need) were moved to the growth site, and the growth was
    // granted only the rest; nothing went back to the daemon.
    let c = a.backing().counts();
    let (releases, unmaps, granted) = (
        c.releases - before.releases,
        c.unmaps - before.unmaps,
        c.granted_bytes - before.granted_bytes,
    );
    assert_eq!(releases, 0);
    assert!(unmaps >= 1, "{c:?}");
    assert!((4 << 20..=12 << 20).contains(&granted), "{granted}");
}

/// The same at the cap with the frees deferred and their fence pending, as on a device running
/// behind the program: the freed handles can be moved only once the device has passed the
/// fence, so the growth waits for it where it can, and takes new memory where it cannot.
#[test]
fn a_growth_waits_for_fenced_frees_that_can_serve_it_instead_of_taking_new_memory() {
    for waitable in [false, true] {
        let mut a = Allocator::new(small_config(), ModelBacking::new());
        let f = TestFences::default();
        f.inner.borrow_mut().waitable = waitable;
        let s = StreamId(0);
        let x = a.alloc(Bytes::mib(8), s, &f).unwrap();
        let _pin = a.alloc(Bytes::mib(2), s, &f).unwrap();
        a.free_deferred(x.offset, s, &f).unwrap();
        let held = a.stats().held;
        let big = a.alloc(Bytes::mib(12), s, &f).unwrap();
        assert!(a.backing().is_mapped(big.offset, big.size.get()));
        if waitable {
            assert_eq!(a.stats().fence_waits, 1);
            assert!(
                a.stats().held <= held + Bytes::mib(4),
                "reused the fenced 8 MiB"
            );
            assert_eq!(
                f.completed(0),
                f.recorded(0),
                "waited for the growth's fence"
            );
        } else {
            assert_eq!(a.stats().fence_waits, 0);
            let now = a.stats().held;
            assert!(
                now > held + Bytes::mib(4),
                "the fenced 8 MiB cannot move: {now}"
            );
            assert_eq!(f.completed(0), 0);
        }
    }
}

/// Draws from `[lo, hi)` with an xorshift generator seeded with `seed`: the same sizes every run.
fn xorshift(mut seed: u64) -> impl FnMut(u64, u64) -> u64 {
    move |lo, hi| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        lo + seed % (hi - lo)
    }
}

/// A training-like loop on one stream with every free deferred (as on CUDA), run against `f`:
/// the memory held at its peak and the backing's calls.
fn deferred_loop<F: Fences>(f: &F) -> (Bytes, BackingCounts) {
    let mut a = Allocator::new(AllocConfig::default(), ModelBacking::new());
    let s = StreamId(0);
    let mut draw = xorshift(0x9e37_79b9_7f4a_7c15);
    let weights: Vec<_> = (0..50)
        .map(|_| a.alloc(Bytes(draw(1 << 20, 96 << 20)), s, f).unwrap())
        .collect();
    // Steps of a size drawn each time (a batch or sequence length), their blocks freed in an
    // order of their own: what one step frees, the next, larger or smaller, must place anew.
    for _ in 0..40 {
        let step = draw(1, 9);
        let mut acts: Vec<_> = (0..60)
            .map(|_| {
                a.alloc(Bytes(step * draw(4 << 10, 20 << 20)), s, f)
                    .unwrap()
            })
            .collect();
        while !acts.is_empty() {
            let b = acts.swap_remove(draw(0, acts.len() as u64 + 1) as usize % acts.len());
            a.free_deferred(b.offset, s, f).unwrap();
        }
    }
    for b in weights {
        a.free_deferred(b.offset, s, f).unwrap();
    }
    (a.stats().held_peak, a.backing().counts())
}

/// Waiting for the pending fences before a growth makes a device that runs behind the program
/// (fences that complete only when waited for) decide as one that keeps pace (every fence
/// complete at once), growth for growth; without the waits it holds more.
#[test]
fn growths_that_wait_for_fences_decide_as_if_the_device_kept_pace() {
    let paced = deferred_loop(&AlwaysComplete);
    let behind = TestFences::waitable();
    assert_eq!(deferred_loop(&behind), paced);
    let (held, _) = deferred_loop(&TestFences::default());
    assert!(held > paced.0, "{held} against {}", paced.0);
}

/// A program busy on one stream (no tick finds it idle, no growth fences its frees) still gives
/// back the memory above its recent peak: a release that finds it behind unfenced frees has the
/// next allocation fence them, and a later tick gives back what the fence covered.
#[test]
fn a_busy_programs_memory_above_its_peak_goes_back_once_its_frees_are_fenced() {
    let mut a = Allocator::new(small_config(), ModelBacking::new());
    let f = TestFences::default();
    let s = StreamId(1);
    // The small heap has its granule first, so that the loop below never grows.
    let small = a.alloc(Bytes::kib(512), s, &f).unwrap();
    a.free_deferred(small.offset, s, &f).unwrap();
    let big = a.alloc(Bytes::mib(64), s, &f).unwrap();
    a.free_deferred(big.offset, s, &f).unwrap();
    let held = a.stats().held;
    // Busy: a small block (its own heap) allocated and freed between every two ticks, for many
    // release delays (1 ms here); the device passes each fence soon after it is recorded.
    for t in 1..100u64 {
        let b = a.alloc(Bytes::kib(512), s, &f).unwrap();
        a.free_deferred(b.offset, s, &f).unwrap();
        a.tick(t * 100, &f);
        f.complete_all();
    }
    // The 64 MiB went back; what is held is the small heap's granule.
    let now = a.stats().held;
    assert_eq!(held, Bytes::mib(66));
    assert_eq!(now, Bytes::mib(2), "{now} held");
}

/// A growth waits only for the streams whose free memory waits on their fences: one whose freed
/// block was taken again by its own stream has a fence pending and nothing behind it.
#[test]
fn a_growth_waits_only_for_streams_with_fenced_free_memory() {
    let mut a = Allocator::new(small_config(), ModelBacking::new());
    let f = TestFences::waitable();
    let (one, two) = (StreamId(1), StreamId(2));
    let x = a.alloc(Bytes::mib(8), one, &f).unwrap();
    let _pin = a.alloc(Bytes::mib(2), one, &f).unwrap();
    let y = a.alloc(Bytes::mib(2), two, &f).unwrap();
    a.free_deferred(x.offset, one, &f).unwrap();
    a.free_deferred(y.offset, two, &f).unwrap();
    // Stream 2 takes its freed block again: no free memory of it waits on a fence.
    let y2 = a.alloc(Bytes::mib(2), two, &f).unwrap();
    assert_eq!(y2.offset, y.offset);
    let _big = a.alloc(Bytes::mib(12), one, &f).unwrap();
    assert_eq!(f.recorded(2), 1, "stream 2's free fenced before the growth");
    assert_eq!(f.completed(2), 0, "and not waited for");
    assert_eq!(f.completed(1), f.recorded(1), "stream 1's waited for");
    assert_eq!(a.stats().fence_waits, 1);
}

/// A trim gives back memory freed behind a pending fence once the fences `fences_behind_free`
/// names after a trim (one a stream, only streams with free memory behind one) have completed.
#[test]
fn a_trim_after_the_named_fences_gives_back_memory_freed_behind_them() {
    let mut a = Allocator::new(small_config(), ModelBacking::new());
    let f = TestFences::waitable();
    let (one, two) = (StreamId(1), StreamId(2));
    let x = a.alloc(Bytes::mib(16), one, &f).unwrap();
    let y = a.alloc(Bytes::mib(16), one, &f).unwrap();
    let z = a.alloc(Bytes::mib(2), two, &f).unwrap();
    a.free_deferred(x.offset, one, &f).unwrap();
    a.trim(&f);
    a.free_deferred(y.offset, one, &f).unwrap();
    a.free_deferred(z.offset, two, &f).unwrap();
    let z2 = a.alloc(Bytes::mib(2), two, &f).unwrap();
    assert_eq!(
        z2.offset, z.offset,
        "stream 2 took its free back: none of its memory waits"
    );
    let held = a.stats().held;
    assert_eq!(
        a.trim(&f),
        Bytes::ZERO,
        "every free handle waits on a fence"
    );
    let behind = a.fences_behind_free();
    assert_eq!(behind.len(), 1, "stream 1's latest fence alone: {behind:?}");
    assert_eq!(f.recorded(1), 2);
    assert!(f.wait(behind[0]));
    assert_eq!(f.completed(1), 2, "its earlier fence completes with it");
    let returned = a.trim(&f);
    assert!(returned >= Bytes::mib(32), "{returned} given back");
    assert_eq!(a.stats().held, held - returned);
}

/// An allocator with no growth slack (held may not run above the peak in use while growth takes
/// new memory) holding a 1 GiB block, which gives it 16 MiB handles (`max_handle`), and a 16 MiB
/// block beside it in a handle of its own; returns the allocator and that block.
fn a_gigabyte_and_16_mib_at_the_cap() -> (Allocator<ModelBacking>, Block) {
    let config = AllocConfig {
        grow_slack: 0.0,
        ..small_config()
    };
    let mut a = Allocator::new(config, ModelBacking::new());
    let f = AlwaysComplete;
    a.alloc(Bytes::gib(1), StreamId(0), &f).unwrap();
    let x = a.alloc(Bytes::mib(16), StreamId(0), &f).unwrap();
    (a, x)
}

#[test]
fn free_handles_far_larger_than_the_need_go_back_and_the_need_is_granted() {
    let (mut a, x) = a_gigabyte_and_16_mib_at_the_cap();
    let f = AlwaysComplete;
    // Beside them a 2 MiB block and a 14 MiB one; the 16 MiB block and the 14 MiB one freed.
    let _pin = a.alloc(Bytes::mib(2), StreamId(0), &f).unwrap();
    let y = a.alloc(Bytes::mib(14), StreamId(0), &f).unwrap();
    a.free(x.offset, StreamId(0), Fence(0), &f).unwrap();
    a.free(y.offset, StreamId(0), Fence(0), &f).unwrap();
    assert_eq!(a.stats().held, Bytes::mib(1024 + 32));
    let before = a.backing().counts();
    // Just over 16 MiB fits in neither free region; extending the last one needs 4 MiB, past the
    // cap. x's free 16 MiB handle is more than twice that: it goes back, and 4 MiB are granted.
    let big = a
        .alloc(Bytes(Bytes::mib(16).get() + 512), StreamId(0), &f)
        .unwrap();
    assert!(a.backing().is_mapped(big.offset, big.size.get()));
    let c = a.backing().counts();
    assert_eq!(
        (
            c.releases - before.releases,
            c.granted_bytes - before.granted_bytes
        ),
        (1, 4 << 20),
        "{c:?}"
    );
    assert_eq!(a.stats().held, Bytes::mib(1024 + 32 - 16 + 4));
}

#[test]
fn at_the_cap_the_small_heap_moves_in_a_larger_free_handle_rather_than_grow() {
    let (mut a, x) = a_gigabyte_and_16_mib_at_the_cap();
    let f = AlwaysComplete;
    // The 16 MiB block freed: 1040 MiB held at a peak of 1040 MiB in use, the growth cap, and one
    // wholly free 16 MiB handle in the large heap.
    a.free(x.offset, StreamId(0), Fence(0), &f).unwrap();
    let before = a.backing().counts();
    // The first small block needs a granule, and no free handle is that small: the large heap's
    // free handle is moved into the small heap instead of a granule granted past the cap.
    let small = a.alloc(Bytes::kib(512), StreamId(0), &f).unwrap();
    assert!(a.small_heap().contains(&small.offset));
    let c = a.backing().counts();
    assert_eq!(
        (c.grants, c.releases, c.unmaps, c.maps),
        (before.grants, 0, before.unmaps + 1, before.maps + 1),
        "{c:?}"
    );
    assert_eq!(a.stats().held, Bytes::mib(1040));
}

#[test]
fn free_handles_within_twice_the_need_are_moved_not_returned() {
    let mut a = Allocator::new(small_config(), ModelBacking::new());
    let f = AlwaysComplete;
    // Three 8 MiB blocks side by side, each of its own growth; the outer two freed.
    let blocks: Vec<Block> = (0..3)
        .map(|_| a.alloc(Bytes::mib(8), StreamId(0), &f).unwrap())
        .collect();
    assert_eq!(a.backing().counts().grant_requests, 3);
    let first: Vec<(u64, u64)> = a
        .handles()
        .into_iter()
        .filter(|&(va, len)| va >= blocks[0].offset && va + len <= blocks[0].offset + (8 << 20))
        .collect();
    a.free(blocks[0].offset, StreamId(0), Fence(0), &f).unwrap();
    a.free(blocks[2].offset, StreamId(0), Fence(0), &f).unwrap();
    let before = a.backing().counts();
    // 16 MiB fit nowhere; growing the last free region by 8 MiB would pass the cap (24 MiB held,
    // 24 MiB peak), so the first block's handles, wholly free and just the size needed, are
    // moved there: unmapped and mapped again, nothing granted or returned.
    let big = a.alloc(Bytes::mib(16), StreamId(0), &f).unwrap();
    assert!(a.backing().is_mapped(big.offset, big.size.get()));
    let c = a.backing().counts();
    let moved = first.len() as u64;
    assert!(moved >= 1);
    assert_eq!(
        (c.grants, c.releases, c.unmaps, c.maps),
        (before.grants, 0, moved, before.maps + moved),
        "{c:?}"
    );
    assert_eq!(a.stats().held, Bytes::mib(24));
}

#[test]
fn the_large_heap_at_the_cap_leaves_the_small_heaps_free_granules_alone() {
    let mut a = Allocator::new(small_config(), ModelBacking::new());
    let f = AlwaysComplete;
    // Three granules of the small heap, wholly free once their blocks are.
    let small: Vec<Block> = (0..12)
        .map(|_| a.alloc(Bytes::kib(512), StreamId(0), &f).unwrap())
        .collect();
    for b in &small {
        a.free(b.offset, StreamId(0), Fence(0), &f).unwrap();
    }
    // 8 MiB in the large heap is past the cap already (6 + 8 held against 8 in use).
    let _large = a.alloc(Bytes::mib(8), StreamId(0), &f).unwrap();
    assert_eq!(a.stats().held, Bytes::mib(14));
    let before = a.backing().counts();
    // 12 MiB more is past the cap (14 + 12 held against a peak of 20 in use): the small heap's
    // granules are not the size needed, so the growth is granted without giving them back.
    let big = a.alloc(Bytes::mib(12), StreamId(0), &f).unwrap();
    assert!(a.backing().is_mapped(big.offset, big.size.get()));
    let c = a.backing().counts();
    assert_eq!(
        (c.releases, c.unmaps),
        (before.releases, before.unmaps),
        "{c:?}"
    );
    let small_heap = a.small_heap();
    let small_mapped: u64 = a
        .handles()
        .iter()
        .filter(|(va, _)| small_heap.contains(va))
        .map(|(_, len)| len)
        .sum();
    assert_eq!(small_mapped, 6 << 20);
}

#[test]
fn growths_at_a_new_peak_double_their_step_within_the_cap_and_others_add_their_need() {
    let f = AlwaysComplete;
    let s = StreamId(0);
    // A footprint that climbs 3 MiB at a time, as a program builds its activations; then a free
    // below the peak and a block that fits nowhere.
    let climb = |grow_slack: f64| {
        let config = AllocConfig {
            min_grow: Bytes::mib(2),
            grow_slack,
            ..small_config()
        };
        let mut a = Allocator::new(config, ModelBacking::new());
        let blocks: Vec<Block> = (0..60)
            .map(|_| a.alloc(Bytes::mib(3), s, &f).unwrap())
            .collect();
        let requests = a.backing().counts().grant_requests;
        let peak = a.stats().held_peak;
        a.free(blocks[0].offset, s, Fence(0), &f).unwrap();
        a.free(blocks[1].offset, s, Fence(0), &f).unwrap();
        // Below the peak now; a 7 MiB block fits in no hole and grows by its need alone.
        let before = a.stats().held;
        a.alloc(Bytes::mib(7), s, &f).unwrap();
        (requests, peak, a.stats().held - before)
    };
    let (plain, plain_peak, _) = climb(0.0);
    let (stepped, peak, after_free) = climb(0.25);
    // Without room under the cap every block but those that fit in a previous step's rest grows
    // the heap; with it, steps of 2, 4, 8, ... MiB take far fewer requests.
    assert!(plain >= 30, "{plain}");
    assert!(
        stepped * 3 <= plain,
        "{stepped} grant requests against {plain}"
    );
    // What the steps add ahead of need stays under the cap: a quarter above the peak in use.
    assert_eq!(plain_peak, Bytes::mib(180));
    assert!(peak.get() <= Bytes::mib(180).get() * 5 / 4, "{peak}");
    assert!(after_free <= Bytes::mib(8), "{after_free}");
}

#[test]
fn a_repeated_step_does_not_thrash_and_idle_memory_goes_back_after_the_delay() {
    let config = AllocConfig {
        release_delay_us: 1_000_000,
        ..small_config()
    };
    let mut a = Allocator::new(config, ModelBacking::new());
    let f = AlwaysComplete;
    let step = |a: &mut Allocator<ModelBacking>, now: u64| {
        let blocks: Vec<Block> = (1..20u64)
            .map(|i| a.alloc(Bytes(i * 3 * MIB + 100), StreamId(0), &f).unwrap())
            .collect();
        for b in blocks {
            a.free(b.offset, StreamId(0), Fence(0), &f).unwrap();
        }
        a.tick(now, &f);
    };
    step(&mut a, 0);
    let grants = a.backing().counts().grants;
    for i in 1..50 {
        step(&mut a, i * 100_000);
    }
    assert_eq!(
        a.backing().counts().grants,
        grants,
        "steady state grants nothing"
    );
    assert_eq!(a.backing().counts().releases, 0);
    a.tick(8_000_000, &f);
    a.tick(9_000_000, &f);
    assert_eq!(
        a.stats().held,
        Bytes::ZERO,
        "idle memory returned after the delay"
    );
}

#[test]
fn refusal_is_an_error_and_cached_memory_is_returned_first() {
    let mut a = Allocator::new(small_config(), ModelBacking::with_capacity(Bytes::mib(32)));
    let f = AlwaysComplete;
    let x = a.alloc(Bytes::mib(20), StreamId(0), &f).unwrap();
    let err = a.alloc(Bytes::mib(20), StreamId(0), &f).unwrap_err();
    assert!(matches!(err, AllocError::OutOfMemory { .. }), "{err}");
    a.free(x.offset, StreamId(0), Fence(0), &f).unwrap();
    let _small = a.alloc(Bytes(100), StreamId(0), &f).unwrap();
    let y = a.alloc(Bytes::mib(28), StreamId(0), &f).unwrap();
    assert!(a.backing().is_mapped(y.offset, y.size.get()));
    assert_eq!(a.stats().refused, 1);
}

#[test]
fn sizes_beyond_the_reservation_are_refused_whatever_their_rounding() {
    let mut a = Allocator::new(small_config(), ModelBacking::new());
    let va = small_config().va_bytes.get();
    let mib = 1u64 << 20;
    // Sizes whose rounding to the alignment or the granularity would pass 2^64.
    for n in [u64::MAX, u64::MAX - 511, u64::MAX - mib, 1 << 63, va + 1] {
        let err = a.alloc(Bytes(n), StreamId(0), &AlwaysComplete).unwrap_err();
        assert!(matches!(err, AllocError::TooLarge { .. }), "{n}: {err}");
    }
    assert_eq!(a.stats().held, Bytes::ZERO);
    a.alloc(Bytes::mib(2), StreamId(0), &AlwaysComplete)
        .unwrap();
}

#[test]
fn zero_byte_requests_get_distinct_blocks() {
    let mut a = Allocator::new(small_config(), ModelBacking::new());
    let x = a.alloc(Bytes(0), StreamId(0), &AlwaysComplete).unwrap();
    let y = a.alloc(Bytes(0), StreamId(0), &AlwaysComplete).unwrap();
    assert_ne!(x.offset, y.offset);
    assert!(matches!(
        a.free(x.offset + 1, StreamId(0), Fence(0), &AlwaysComplete),
        Err(AllocError::UnknownBlock { .. })
    ));
}

#[test]
fn deferred_frees_are_fenced_together_when_another_stream_needs_the_memory() {
    let mut a = Allocator::new(small_config(), ModelBacking::new());
    let fences = TestFences::default();
    let x = a.alloc(Bytes::mib(8), StreamId(1), &fences).unwrap();
    let y = a.alloc(Bytes::mib(8), StreamId(1), &fences).unwrap();
    a.free_deferred(x.offset, StreamId(1), &fences).unwrap();
    a.free_deferred(y.offset, StreamId(1), &fences).unwrap();
    assert_eq!(fences.recorded(1), 0, "a deferred free records nothing");
    // The same stream reuses at once.
    let again = a.alloc(Bytes::mib(8), StreamId(1), &fences).unwrap();
    assert!(again.offset == x.offset || again.offset == y.offset);
    a.free_deferred(again.offset, StreamId(1), &fences).unwrap();
    // Another stream finds nothing it may use: one fence is recorded for all three frees, and it
    // grows instead of taking memory stream 1's work may still use.
    let other = a.alloc(Bytes::mib(16), StreamId(2), &fences).unwrap();
    assert_eq!(fences.recorded(1), 1);
    assert!(!overlaps(
        other.offset,
        other.size.get(),
        x.offset,
        2 * x.size.get()
    ));
    fences.complete(1, 1);
    let later = a.alloc(Bytes::mib(16), StreamId(2), &fences).unwrap();
    assert_eq!(
        later.offset,
        x.offset.min(y.offset),
        "once the fence completed, both frees are one region any stream may use"
    );
}

/// A stream destroyed with frees pending: a stream created later with the same handle does not
/// take their memory before the fence recorded at the destroy completes; then every stream may.
#[test]
fn a_destroyed_streams_frees_wait_for_its_work_whoever_gets_its_handle() {
    let mut a = Allocator::new(small_config(), ModelBacking::new());
    let fences = TestFences::default();
    let x = a.alloc(Bytes::mib(8), StreamId(1), &fences).unwrap();
    a.free_deferred(x.offset, StreamId(1), &fences).unwrap();
    assert!(a.retire_stream(StreamId(1), &fences));
    assert_eq!(fences.recorded(1), 1, "the frees are fenced at the destroy");
    let reborn = a.alloc(Bytes::mib(8), StreamId(1), &fences).unwrap();
    assert!(
        !overlaps(reborn.offset, reborn.size.get(), x.offset, x.size.get()),
        "a new stream with the old handle waits like any other"
    );
    fences.complete(1, 1);
    let later = a.alloc(Bytes::mib(8), StreamId(3), &fences).unwrap();
    assert_eq!(
        later.offset, x.offset,
        "once the fence completed, any stream may"
    );
    // A stream being captured cannot be fenced: nothing changes.
    let z = a.alloc(Bytes::mib(8), StreamId(4), &fences).unwrap();
    a.free_deferred(z.offset, StreamId(4), &fences).unwrap();
    fences.set_capturing(4, true);
    assert!(!a.retire_stream(StreamId(4), &fences));
    let same = a.alloc(Bytes::mib(8), StreamId(4), &fences).unwrap();
    assert_eq!(same.offset, z.offset, "its frees are still its own");
}

#[test]
fn one_stream_records_no_fence_until_memory_is_needed_elsewhere() {
    let mut a = Allocator::new(small_config(), ModelBacking::new());
    let fences = TestFences::default();
    // A training loop's steady state on one stream: every free deferred, nothing fenced.
    let keep = a.alloc(Bytes::mib(4), StreamId(1), &fences).unwrap();
    for _ in 0..50 {
        let b: Vec<_> = (1..4)
            .map(|i| a.alloc(Bytes::mib(i), StreamId(1), &fences).unwrap())
            .collect();
        for b in b {
            a.free_deferred(b.offset, StreamId(1), &fences).unwrap();
        }
    }
    assert_eq!(fences.recorded(1), 0, "one stream, no fence");
    assert_eq!(a.stats().fences, 0);
    // Growth fences what is there before taking new memory.
    let big = a.alloc(Bytes::mib(40), StreamId(1), &fences).unwrap();
    assert_eq!(fences.recorded(1), 1, "one fence before growing");
    a.free_deferred(big.offset, StreamId(1), &fences).unwrap();
    // A second stream: now every `SEAL_EVERY` frees of a stream are fenced.
    let other = a.alloc(Bytes::mib(1), StreamId(2), &fences).unwrap();
    assert_eq!(
        fences.recorded(1),
        2,
        "stream 2 found no room: stream 1's frees fenced"
    );
    a.free_deferred(other.offset, StreamId(2), &fences).unwrap();
    let x = a.alloc(Bytes::mib(1), StreamId(1), &fences).unwrap();
    a.free_deferred(x.offset, StreamId(1), &fences).unwrap();
    assert_eq!(fences.recorded(1), 2, "one free since the last fence");
    for _ in 2..SEAL_EVERY {
        let y = a.alloc(Bytes::mib(1), StreamId(1), &fences).unwrap();
        a.free_deferred(y.offset, StreamId(1), &fences).unwrap();
    }
    assert_eq!(
        fences.recorded(1),
        2,
        "{} frees since the last fence",
        SEAL_EVERY - 1
    );
    let y = a.alloc(Bytes::mib(1), StreamId(1), &fences).unwrap();
    a.free_deferred(y.offset, StreamId(1), &fences).unwrap();
    assert_eq!(
        fences.recorded(1),
        3,
        "the SEAL_EVERY-th free since the last fence is fenced"
    );
    // Back to one stream for long enough: no fences again.
    for _ in 0..MIXED_WINDOW {
        let b = a.alloc(Bytes::mib(1), StreamId(1), &fences).unwrap();
        a.free_deferred(b.offset, StreamId(1), &fences).unwrap();
    }
    let recorded = fences.recorded(1);
    for _ in 0..100 {
        let b = a.alloc(Bytes::mib(1), StreamId(1), &fences).unwrap();
        a.free_deferred(b.offset, StreamId(1), &fences).unwrap();
    }
    assert_eq!(
        fences.recorded(1),
        recorded,
        "a side stream used once is forgotten"
    );
    a.free_deferred(keep.offset, StreamId(1), &fences).unwrap();
    assert_eq!(a.stats().fences as usize, recorded);
}

#[test]
fn allocations_that_find_room_ask_about_fences_once_per_poll_every() {
    let mut a = Allocator::new(small_config(), ModelBacking::new());
    let fences = TestFences::default();
    // A fence stays pending on stream 1; stream 2 allocates and frees in memory of its own.
    let x = a.alloc(Bytes::mib(8), StreamId(1), &fences).unwrap();
    let warm = a.alloc(Bytes::mib(1), StreamId(2), &fences).unwrap();
    a.free(x.offset, StreamId(1), fences.record_now(1), &fences)
        .unwrap();
    assert_eq!(fences.recorded(1), 1);
    a.free(warm.offset, StreamId(2), Fence(0), &AlwaysComplete)
        .unwrap();
    let before = fences.inner.borrow().queries;
    for _ in 0..5 * POLL_EVERY {
        let b = a.alloc(Bytes::mib(1), StreamId(2), &fences).unwrap();
        a.free(b.offset, StreamId(2), Fence(0), &AlwaysComplete)
            .unwrap();
    }
    assert_eq!(
        fences.inner.borrow().queries - before,
        5,
        "one poll per POLL_EVERY allocations"
    );
    // Once the fence completed, stream 2 may use the memory stream 1 freed.
    fences.complete(1, 1);
    for _ in 0..POLL_EVERY {
        let b = a.alloc(Bytes::mib(1), StreamId(2), &fences).unwrap();
        a.free(b.offset, StreamId(2), Fence(0), &AlwaysComplete)
            .unwrap();
    }
    let y = a.alloc(Bytes::mib(8), StreamId(2), &fences).unwrap();
    assert!(overlaps(y.offset, y.size.get(), x.offset, x.size.get()));
}

#[test]
fn frees_during_a_capture_stay_with_their_stream_and_do_not_hold_back_later_ones() {
    let mut a = Allocator::new(small_config(), ModelBacking::new());
    let fences = TestFences::default();
    let before = a.alloc(Bytes::mib(4), StreamId(1), &fences).unwrap();
    let _pin = a.alloc(Bytes::mib(4), StreamId(1), &fences).unwrap();
    let during = a.alloc(Bytes::mib(4), StreamId(1), &fences).unwrap();
    let _pin2 = a.alloc(Bytes::mib(4), StreamId(1), &fences).unwrap();
    let after = a.alloc(Bytes::mib(4), StreamId(1), &fences).unwrap();
    a.free_deferred(before.offset, StreamId(1), &fences)
        .unwrap();
    fences.set_capturing(1, true);
    a.free(during.offset, StreamId(1), Fence::NEVER, &fences)
        .unwrap();
    assert_eq!(a.stats().frees_in_capture, 1);
    // Nothing can be recorded during the capture: the deferred free waits.
    a.trim(&fences);
    assert_eq!(fences.recorded(1), 0);
    fences.set_capturing(1, false);
    a.free_deferred(after.offset, StreamId(1), &fences).unwrap();
    a.trim(&fences);
    assert_eq!(fences.recorded(1), 1);
    fences.complete_all();
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(a.alloc(Bytes::mib(4), StreamId(2), &fences).unwrap().offset);
    }
    assert!(got.contains(&before.offset) && got.contains(&after.offset));
    assert!(
        !got.contains(&during.offset),
        "memory freed during a capture is never another stream's"
    );
}

#[test]
fn a_streams_free_takes_in_neighbouring_memory_every_stream_may_use() {
    let mut a = Allocator::new(small_config(), ModelBacking::new());
    let fences = TestFences::default();
    let x = a.alloc(Bytes::mib(4), StreamId(1), &fences).unwrap();
    let y = a.alloc(Bytes::mib(4), StreamId(1), &fences).unwrap();
    let _pin = a.alloc(Bytes::mib(4), StreamId(1), &fences).unwrap();
    let (lo, hi) = if x.offset < y.offset { (x, y) } else { (y, x) };
    // `lo` is every stream's (its fence completed), then `hi` is freed without a fence yet.
    let f = fences.record_now(1);
    fences.complete(1, 1);
    a.free(lo.offset, StreamId(1), f, &fences).unwrap();
    a.free_deferred(hi.offset, StreamId(1), &fences).unwrap();
    // Stream 1 gets both as one block at once; another stream gets neither.
    let both = a.alloc(Bytes::mib(8), StreamId(1), &fences).unwrap();
    assert_eq!(both.offset, lo.offset);
    a.free_deferred(both.offset, StreamId(1), &fences).unwrap();
    let other = a.alloc(Bytes::mib(4), StreamId(2), &fences).unwrap();
    assert!(!overlaps(
        other.offset,
        other.size.get(),
        lo.offset,
        8 * MIB
    ));
}

#[test]
fn an_idle_programs_last_deferred_frees_are_fenced_by_the_tick_and_go_back() {
    let config = AllocConfig {
        release_delay_us: 1000,
        keep_fraction: 0.0,
        ..small_config()
    };
    let mut a = Allocator::new(config, ModelBacking::new());
    let fences = TestFences::default();
    let x = a.alloc(Bytes::mib(8), StreamId(1), &fences).unwrap();
    a.free_deferred(x.offset, StreamId(1), &fences).unwrap();
    // Busy since the last tick: nothing is recorded from the tick.
    a.tick(0, &fences);
    assert_eq!(fences.recorded(1), 0);
    // Idle for a tick period: the tick fences the free; once the fence completes and the delay
    // passed, the memory goes back.
    a.tick(500, &fences);
    assert_eq!(fences.recorded(1), 1);
    fences.complete_all();
    for now in [1500, 2500, 3500, 4500] {
        a.tick(now, &fences);
    }
    assert_eq!(a.stats().held, Bytes::ZERO, "idle memory went back");
}

#[test]
fn memory_freed_during_a_capture_does_not_take_in_free_neighbours() {
    let mut a = Allocator::new(small_config(), ModelBacking::new());
    let fences = TestFences::default();
    let x = a.alloc(Bytes::mib(4), StreamId(1), &fences).unwrap();
    let y = a.alloc(Bytes::mib(4), StreamId(1), &fences).unwrap();
    let _pin = a.alloc(Bytes::mib(4), StreamId(1), &fences).unwrap();
    assert_eq!(
        a.backing().counts().grant_requests,
        3,
        "one growth per block"
    );
    a.free(x.offset, StreamId(1), Fence(0), &AlwaysComplete)
        .unwrap();
    a.free(y.offset, StreamId(1), Fence::NEVER, &fences)
        .unwrap();
    let held = a.stats().held;
    a.trim(&fences);
    assert_eq!(
        a.stats().held,
        held - Bytes::mib(4),
        "x's handle goes back; y's stays with the graph"
    );
}

#[test]
fn settings_are_set_from_text_and_unknown_ones_and_device_facts_refused() {
    let mut c = AllocConfig::default();
    c.set_all("min_grow=16MiB, max_handle = 33554432,grow_slack=0.02,release_delay_us=5")
        .unwrap();
    assert_eq!(
        (c.min_grow, c.max_handle, c.grow_slack, c.release_delay_us),
        (Bytes::mib(16), Bytes::mib(32), 0.02, 5)
    );
    let e = c.set("min_grwo=1MiB").unwrap_err();
    assert!(
        e.contains("not an allocator setting") && e.contains("min_grow"),
        "{e}"
    );
    for fact in ["granularity=4MiB", "va_bytes=1GiB", "align=4096"] {
        let e = c.set(fact).unwrap_err();
        assert!(e.contains("not an allocator setting"), "{e}");
    }
    let e = c.set("release_delay_us=lots").unwrap_err();
    assert!(e.contains("release_delay_us=lots"), "{e}");
    let e = c.set("grow_slack=-1").unwrap_err();
    assert!(e.contains("at least 0"), "{e}");
    assert_eq!(c.grow_slack, 0.02, "a refused setting changes nothing");
    assert!(c.set("min_grow").is_err());
    assert_eq!(
        c.min_grow,
        Bytes::mib(16),
        "a refused setting changes nothing"
    );
    let facts = AllocConfig {
        granularity: Bytes::mib(4),
        ..AllocConfig::default()
    };
    let mut set = facts.clone();
    set.set("min_grow=8MiB").unwrap();
    assert_eq!(
        set.granularity,
        Bytes::mib(4),
        "setting keeps the device's facts"
    );
}

#[test]
fn large_grants_have_small_handles_at_both_ends_and_large_ones_in_the_middle() {
    let mib = |n: u64| n << 20;
    let c = AllocConfig::default();
    let split = |bytes: u64| {
        super::growth::split_grant(mib(bytes), c.max_handle.get(), c.granularity.get())
    };
    // Up to max_handle (64 MiB): one handle.
    assert_eq!(split(8), vec![mib(8)]);
    assert_eq!(split(64), vec![mib(64)]);
    // Above it: 16 and 32 MiB from each end, the middle in handles of at most 64 MiB.
    assert_eq!(split(66), vec![mib(16), mib(34), mib(16)]);
    assert_eq!(split(96), vec![mib(16), mib(32), mib(32), mib(16)]);
    assert_eq!(
        split(200),
        vec![mib(16), mib(32), mib(64), mib(40), mib(32), mib(16)]
    );
    let big = split(1430);
    assert_eq!(big.iter().sum::<u64>(), mib(1430));
    assert_eq!(&big[..3], &[mib(16), mib(32), mib(64)]);
    assert!(
        big.iter().all(|&h| h % mib(2) == 0 && h <= mib(64)),
        "{big:?}"
    );
    assert_eq!(big.len(), 25, "{big:?}");
}

/// Fragmentation (1 - peak requested / peak held) of a training-like loop whose sizes are
/// multiplied by `scale`: weights kept, then steps of activations of varying size allocated
/// and freed in reverse, with a few temporaries between.
fn training_loop_fragmentation(scale: f64) -> f64 {
    let mut a = Allocator::new(AllocConfig::default(), ModelBacking::new());
    let f = AlwaysComplete;
    let s = StreamId(0);
    let mut draw = xorshift(0x2545_f491_4f6c_dd1d);
    let size = |mib_x16: u64| Bytes(((mib_x16 * Bytes::MIB / 16) as f64 * scale) as u64);
    let (mut live, mut peak) = (0u64, 0u64);
    let mut weights = Vec::new();
    for _ in 0..200 {
        let b = size(draw(16, 16 * 64));
        weights.push(a.alloc(b, s, &f).unwrap());
        live += b.get();
    }
    peak = peak.max(live);
    for step in 0..40u64 {
        let batch = draw(8, 17);
        let mut acts = Vec::new();
        for layer in 0..60 {
            let b = size(batch * (16 + (layer % 7) * 24));
            acts.push((a.alloc(b, s, &f).unwrap(), b));
            live += b.get();
            peak = peak.max(live);
            let tmp = size(draw(1, 16 * 8));
            let t = a.alloc(tmp, s, &f).unwrap();
            peak = peak.max(live + tmp.get());
            a.free(t.offset, s, Fence(0), &f).unwrap();
        }
        while let Some((b, len)) = acts.pop() {
            a.free(b.offset, s, Fence(0), &f).unwrap();
            live -= len.get();
        }
        a.tick(step * 100_000, &f);
    }
    1.0 - peak as f64 / a.stats().held_peak.get() as f64
}

#[test]
fn a_small_tenant_wastes_no_more_than_a_large_one() {
    // The same program at 16 GiB-scale sizes and at 1/32 of them (its peak under 1 GiB): the
    // allocator's waste is a fraction of what the tenant uses, with no fixed part per heap.
    let large = training_loop_fragmentation(1.0);
    let small = training_loop_fragmentation(1.0 / 32.0);
    eprintln!("fragmentation: large {large:.4}, small {small:.4}");
    assert!(large < 0.05, "{large}");
    assert!(small <= large + 0.01, "small {small} against large {large}");
}

#[test]
fn time_left_under_the_driver_budget_buys_smaller_handles() {
    let f = AlwaysComplete;
    let largest_handle = |backing: ModelBacking, elapsed_us: u64| {
        let mut a = Allocator::new(AllocConfig::default(), backing);
        a.tick(0, &f);
        a.tick(elapsed_us, &f);
        // 4 GiB: a program this large gets `max_handle` (the largest handle is at most 1/32 of
        // the peak in use).
        a.alloc(Bytes::gib(4), StreamId(0), &f).unwrap();
        a.handles().iter().map(|&(_, len)| len).max().unwrap()
    };
    let priced = || ModelBacking::priced(crate::replay::CostModel::H200_MEASURED);
    // No time has passed: nothing is left under the budget, so handles are `max_handle`.
    assert_eq!(largest_handle(priced(), 0), Bytes::mib(64).get());
    // 10 s at 1 % pays for about a thousand handles: 4 GiB in the smallest, a quarter of it.
    assert_eq!(largest_handle(priced(), 10_000_000), Bytes::mib(16).get());
    // A backing that cannot tell what its calls cost gets `max_handle`.
    assert_eq!(
        largest_handle(ModelBacking::new(), 10_000_000),
        Bytes::mib(64).get()
    );
}

#[test]
fn a_pools_blocks_go_back_to_the_pool_and_to_no_one_else_until_it_is_settled() {
    let mut a = Allocator::new(small_config(), ModelBacking::new());
    let fences = TestFences::default();
    let pool = PoolId(0, 1);
    a.pool_begin(pool);
    let x = a.alloc_in_pool(Bytes::mib(4), pool, &fences).unwrap();
    let _pin = a.alloc(Bytes::mib(4), StreamId(1), &fences).unwrap();
    // Freed after the capture, on its stream, with a fence that completes: still the pool's.
    let f = fences.record_now(1);
    fences.complete_all();
    a.free(x.offset, StreamId(1), f, &fences).unwrap();
    a.trim(&fences);
    let held = a.stats().held;
    assert_eq!(held, Bytes::mib(8), "the trim kept the pool's memory");
    for stream in [1, 2] {
        let y = a.alloc(Bytes::mib(4), StreamId(stream), &fences).unwrap();
        assert!(
            !overlaps(y.offset, y.size.get(), x.offset, x.size.get()),
            "stream {stream} took the pool's memory"
        );
        a.free(y.offset, StreamId(stream), Fence(0), &AlwaysComplete)
            .unwrap();
    }
    // A later capture into the same pool reuses it.
    let again = a.alloc_in_pool(Bytes::mib(4), pool, &fences).unwrap();
    assert_eq!(again.offset, x.offset);
    assert_eq!(a.stats().pool_allocs, 2);
    a.free_deferred(again.offset, StreamId(1), &fences).unwrap();
    // Released, not settled: still no one's.
    assert!(a.pool_release(pool));
    assert_eq!(a.unsettled_pools(), 1);
    a.trim(&fences);
    assert!(a.stats().held >= Bytes::mib(4) + Bytes::mib(4));
    let z = a.alloc(Bytes::mib(4), StreamId(2), &fences).unwrap();
    assert!(!overlaps(z.offset, z.size.get(), x.offset, x.size.get()));
    a.free(z.offset, StreamId(2), Fence(0), &AlwaysComplete)
        .unwrap();
    // Settled: every stream's, and it goes back at a trim.
    a.settle_pools(1);
    assert_eq!(a.unsettled_pools(), 0);
    let w = a.alloc(Bytes::mib(4), StreamId(2), &fences).unwrap();
    assert!(a.block_size(w.offset).is_some());
    a.free(w.offset, StreamId(2), Fence(0), &AlwaysComplete)
        .unwrap();
    a.trim(&fences);
    assert_eq!(
        a.stats().held,
        Bytes::mib(4),
        "only the pinned block's handle stays"
    );
}

#[test]
fn a_pool_lasts_until_its_last_use_ends_and_its_live_blocks_are_then_freed_as_any() {
    let mut a = Allocator::new(small_config(), ModelBacking::new());
    let fences = TestFences::default();
    let pool = PoolId(7, 0);
    assert!(matches!(
        a.alloc_in_pool(Bytes::mib(1), pool, &fences),
        Err(AllocError::UnknownPool { pool: (7, 0) })
    ));
    // Two graphs share the pool: the first release leaves it in use.
    a.pool_begin(pool);
    a.pool_begin(pool);
    let out = a.alloc_in_pool(Bytes::mib(4), pool, &fences).unwrap();
    assert!(a.in_active_pool(out.offset));
    assert!(!a.pool_release(pool));
    assert!(a.in_active_pool(out.offset));
    assert!(a.pool_release(pool));
    assert!(!a.pool_release(pool), "a pool no longer in use is ignored");
    a.settle_pools(usize::MAX);
    // The graph's output outlived the pool: its free is an ordinary one.
    assert!(!a.in_active_pool(out.offset));
    a.free(out.offset, StreamId(1), Fence(0), &AlwaysComplete)
        .unwrap();
    a.trim(&fences);
    assert_eq!(a.stats().held, Bytes::ZERO);
}

#[test]
fn a_pool_freed_block_does_not_take_in_neighbours_others_may_use() {
    let mut a = Allocator::new(small_config(), ModelBacking::new());
    let fences = TestFences::default();
    let pool = PoolId(0, 2);
    a.pool_begin(pool);
    let x = a.alloc(Bytes::mib(4), StreamId(1), &fences).unwrap();
    let y = a.alloc_in_pool(Bytes::mib(4), pool, &fences).unwrap();
    let _pin = a.alloc(Bytes::mib(4), StreamId(1), &fences).unwrap();
    a.free(x.offset, StreamId(1), Fence(0), &AlwaysComplete)
        .unwrap();
    a.free(y.offset, StreamId(1), Fence(0), &AlwaysComplete)
        .unwrap();
    let held = a.stats().held;
    a.trim(&fences);
    assert_eq!(
        a.stats().held,
        held - Bytes::mib(4),
        "x's handle goes back; y's stays with the pool"
    );
}
