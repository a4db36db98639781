use std::collections::{BTreeMap, HashSet, VecDeque};

use proptest::prelude::*;

use super::*;

const MIB: u64 = Bytes::MIB;

/// Fences whose completion the test controls, completing in order per stream as CUDA events do.
#[derive(Default)]
struct TestFences {
    next: u64,
    done: HashSet<u64>,
    waiting: BTreeMap<u64, VecDeque<u64>>,
}

impl TestFences {
    fn record(&mut self, stream: u64) -> Fence {
        self.next += 1;
        self.waiting.entry(stream).or_default().push_back(self.next);
        Fence(self.next)
    }
    fn complete(&mut self, stream: u64, n: usize) {
        let q = self.waiting.entry(stream).or_default();
        for _ in 0..n.min(q.len()) {
            let f = q.pop_front().expect("checked length");
            self.done.insert(f);
        }
    }
    fn complete_all(&mut self) {
        let streams: Vec<u64> = self.waiting.keys().copied().collect();
        for s in streams {
            self.complete(s, usize::MAX);
        }
    }
}

impl Fences for TestFences {
    fn is_complete(&self, fence: Fence) -> bool {
        self.done.contains(&fence.0)
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
    Alloc { size: u64, stream: u64 },
    Free { pick: usize },
    Complete { stream: u64, n: usize },
    Tick { dt: u64 },
    Trim,
}

fn op() -> impl Strategy<Value = Op> {
    let size = prop_oneof![Just(0u64), 1u64..4096, 4096u64..MIB, MIB..(40 * MIB),];
    prop_oneof![
        4 => (size, 0u64..3).prop_map(|(size, stream)| Op::Alloc { size, stream }),
        3 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        2 => (0u64..3, 0usize..4).prop_map(|(stream, n)| Op::Complete { stream, n }),
        1 => (0u64..3000).prop_map(|dt| Op::Tick { dt }),
        1 => Just(Op::Trim),
    ]
}

/// A freed range whose fence has not completed: only `stream` may reuse it.
struct Freed {
    start: u64,
    len: u64,
    stream: u64,
    fence: Fence,
}

fn overlaps(a: u64, alen: u64, b: u64, blen: u64) -> bool {
    a < b + blen && b < a + alen
}

fn run_ops(ops: Vec<Op>) {
    let mut a = Allocator::new(small_config(), ModelBacking::new());
    let mut fences = TestFences::default();
    // Live blocks: offset -> (size, stream). Each is freed on its stream, as PyTorch does.
    let mut live: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
    let mut freed: Vec<Freed> = Vec::new();
    let mut now = 0;
    for op in ops {
        match op {
            Op::Alloc { size, stream } => {
                let b = a.alloc(Bytes(size), StreamId(stream), &fences).unwrap();
                assert!(b.size.get() >= size.max(1));
                if let Some((&s, &(l, _))) = live.range(..b.offset + b.size.get()).next_back() {
                    assert!(
                        s + l <= b.offset,
                        "block {b:?} overlaps live [{s:#x}, +{l})"
                    );
                }
                for f in &freed {
                    if f.stream != stream && !fences.is_complete(f.fence) {
                        assert!(
                            !overlaps(b.offset, b.size.get(), f.start, f.len),
                            "block {b:?} for stream {stream} reuses memory stream {} freed, fence pending",
                            f.stream
                        );
                    }
                }
                live.insert(b.offset, (b.size.get(), stream));
            }
            Op::Free { pick } => {
                if live.is_empty() {
                    continue;
                }
                let (&start, &(len, stream)) = live.iter().nth(pick % live.len()).unwrap();
                live.remove(&start);
                let fence = fences.record(stream);
                let got = a.free(start, StreamId(stream), fence, &fences).unwrap();
                assert_eq!(got.get(), len);
                freed.push(Freed {
                    start,
                    len,
                    stream,
                    fence,
                });
            }
            Op::Complete { stream, n } => fences.complete(stream, n),
            Op::Tick { dt } => {
                now += dt;
                a.tick(now, &fences);
            }
            Op::Trim => {
                a.trim(&fences);
            }
        }
        freed.retain(|f| !fences.is_complete(f.fence));
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
        check_segments(&a, &live);
    }
    for (start, (_, stream)) in std::mem::take(&mut live) {
        let fence = fences.record(stream);
        a.free(start, StreamId(stream), fence, &fences).unwrap();
    }
    fences.complete_all();
    a.trim(&fences);
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

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn allocator_invariants_hold(ops in proptest::collection::vec(op(), 1..300)) {
        run_ops(ops);
    }
}

#[test]
fn freed_block_is_reused_at_once_on_its_stream_only() {
    let mut a = Allocator::new(small_config(), ModelBacking::new());
    let mut fences = TestFences::default();
    let b = a.alloc(Bytes::mib(8), StreamId(1), &fences).unwrap();
    let fence = fences.record(1);
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
    a.free(same.offset, StreamId(1), fences.record(1), &fences)
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
    assert_eq!(a.backing().counts().grants, 5);
    assert!(a.backing().is_mapped(b.offset, b.size.get()));
}

#[test]
fn growth_moves_free_handles_before_granting() {
    let mut a = Allocator::new(small_config(), ModelBacking::new());
    let f = AlwaysComplete;
    let x = a.alloc(Bytes::mib(8), StreamId(0), &f).unwrap();
    let _pin = a.alloc(Bytes::mib(2), StreamId(0), &f).unwrap();
    a.free(x.offset, StreamId(0), Fence(0), &f).unwrap();
    let held = a.stats().held;
    let big = a.alloc(Bytes::mib(12), StreamId(0), &f).unwrap();
    assert!(a.backing().is_mapped(big.offset, big.size.get()));
    assert!(
        a.stats().held <= held + Bytes::mib(4),
        "moved the free 8 MiB instead of granting 12"
    );
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
