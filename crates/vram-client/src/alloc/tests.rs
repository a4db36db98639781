use std::sync::Arc;

use proptest::prelude::*;
use vram_device::{ByteAccess, HostDevice};

use super::*;

fn host_allocator(capacity: Bytes) -> (Arc<dyn ByteAccess>, CachingAllocator<LocalSource>) {
    allocator_with(capacity, Box::new(HostEvents))
}

/// An allocator on a host device of `capacity`, its fences from `events`.
fn allocator_with(
    capacity: Bytes,
    events: Box<dyn StreamEvents>,
) -> (Arc<dyn ByteAccess>, CachingAllocator<LocalSource>) {
    let dev: Arc<dyn ByteAccess> = Arc::new(HostDevice::new(capacity, Bytes::mib(2)).unwrap());
    let config = AllocConfig::default();
    let backing =
        MappedBacking::new(dev.clone(), config.va_bytes, LocalSource::new(dev.clone())).unwrap();
    (dev, CachingAllocator::new(config, backing, events))
}

fn write(dev: &dyn ByteAccess, a: &CachingAllocator<LocalSource>, ptr: u64, data: &[u8]) {
    a.with_backing(|b| {
        let off = ptr - b.base();
        dev.write(b.reservation(), Bytes(off), data).unwrap()
    })
}

fn read(dev: &dyn ByteAccess, a: &CachingAllocator<LocalSource>, ptr: u64, len: usize) -> Vec<u8> {
    a.with_backing(|b| {
        let off = ptr - b.base();
        let mut out = vec![0; len];
        dev.read(b.reservation(), Bytes(off), &mut out).unwrap();
        out
    })
}

#[test]
fn times_calls_to_the_core_only_when_asked() {
    let s = StreamId(0);
    let round = |a: &CachingAllocator<LocalSource>| {
        let big = a.alloc(Bytes::mib(4), s).unwrap();
        a.free(big, s).unwrap();
        // The second small pair is served by the thread cache: not a call to the core.
        for _ in 0..2 {
            let small = a.alloc(Bytes::kib(4), s).unwrap();
            a.free(small, s).unwrap();
        }
        a.stats()
    };
    let (_, a) = host_allocator(Bytes::gib(1));
    let st = round(&a.with_timing(true));
    assert_eq!(st.core_ops, 3, "{st:?}");
    assert!(st.core_ns > 0);
    let (_, a) = host_allocator(Bytes::gib(1));
    let st = round(&a.with_timing(false));
    assert_eq!((st.core_ops, st.core_ns), (0, 0));
}

#[test]
fn reuses_a_cached_block_on_the_same_stream_only() {
    let (_, a) = host_allocator(Bytes::gib(1));
    let s1 = StreamId(1);
    let p = a.alloc(Bytes(4096), s1).unwrap();
    a.free(p, s1).unwrap();
    assert_eq!(
        a.alloc(Bytes(4096), s1).unwrap(),
        p,
        "same stream: the cached block"
    );
    a.free(p, s1).unwrap();
    let q = a.alloc(Bytes(4096), StreamId(2)).unwrap();
    assert_ne!(
        q, p,
        "another stream does not take it from the thread cache"
    );
    assert_eq!(a.stats().fast_allocs, 1);
}

#[test]
fn bad_frees_are_errors() {
    let (_, a) = host_allocator(Bytes::gib(1));
    let p = a.alloc(Bytes(100), StreamId(0)).unwrap();
    assert_eq!(a.free(p + 8, StreamId(0)), Err(FreeError::Unknown(p + 8)));
    a.free(p, StreamId(0)).unwrap();
    assert_eq!(a.free(p, StreamId(0)), Err(FreeError::DoubleFree(p)));
    assert_eq!(a.free(12345, StreamId(0)), Err(FreeError::Unknown(12345)));
}

#[test]
fn zero_byte_requests_get_distinct_addresses() {
    let (_, a) = host_allocator(Bytes::gib(1));
    let p = a.alloc(Bytes(0), StreamId(0)).unwrap();
    let q = a.alloc(Bytes(0), StreamId(0)).unwrap();
    assert_ne!(p, q);
}

#[test]
fn trim_returns_everything_including_thread_caches() {
    let (dev, a) = host_allocator(Bytes::gib(4));
    let mut ptrs = Vec::new();
    for i in 0..200u64 {
        ptrs.push(a.alloc(Bytes(1 + i * 9_000), StreamId(i % 3)).unwrap());
    }
    let big = a.alloc(Bytes::mib(300), StreamId(0)).unwrap();
    for (i, p) in ptrs.into_iter().enumerate() {
        a.free(p, StreamId(i as u64 % 3)).unwrap();
    }
    a.free(big, StreamId(0)).unwrap();
    assert!(a.stats().cached > Bytes::ZERO);
    a.trim();
    let s = a.stats();
    assert_eq!(
        (s.core.held, s.in_use, s.cached),
        (Bytes::ZERO, Bytes::ZERO, Bytes::ZERO)
    );
    assert_eq!(dev.used(), Bytes::ZERO);
}

#[test]
fn eight_threads_random_sizes_cross_thread_frees_patterns_hold() {
    use std::sync::mpsc;
    let (dev, a) = host_allocator(Bytes::gib(64));
    let a = Arc::new(a);
    // Each thread allocates, writes a pattern, and sends half its blocks to the next thread to
    // check and free.
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..8).map(|_| mpsc::channel::<(u64, u64, u8)>()).unzip();
    let mut handles = Vec::new();
    for (t, rx) in rxs.into_iter().enumerate() {
        let a = a.clone();
        let dev = dev.clone();
        let next = txs[(t + 1) % 8].clone();
        handles.push(std::thread::spawn(move || {
            let mut seed = 0x9E37_79B9u64 * (t as u64 + 1);
            let mut rand = move || {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed
            };
            let mut mine = Vec::new();
            for i in 0..300 {
                // Mostly small, sometimes up to 512 MiB.
                let size = match rand() % 100 {
                    0..=79 => 1 + rand() % 65_536,
                    80..=97 => 1 + rand() % (16 << 20),
                    _ => 1 + rand() % (512 << 20),
                };
                let p = a.alloc(Bytes(size), StreamId(0)).unwrap();
                let tag = (rand() & 0xff) as u8;
                let edge = size.min(64) as usize;
                write(dev.as_ref(), &a, p, &vec![tag; edge]);
                write(dev.as_ref(), &a, p + size - edge as u64, &vec![tag; edge]);
                if i % 2 == 0 {
                    next.send((p, size, tag)).unwrap();
                } else {
                    mine.push((p, size, tag));
                }
                while let Ok(block) = rx.try_recv() {
                    mine.push(block);
                }
                if mine.len() > 20 {
                    let (p, size, tag) = mine.swap_remove((rand() % mine.len() as u64) as usize);
                    let edge = size.min(64) as usize;
                    assert_eq!(
                        read(dev.as_ref(), &a, p, edge),
                        vec![tag; edge],
                        "head of {p:#x}"
                    );
                    assert_eq!(
                        read(dev.as_ref(), &a, p + size - edge as u64, edge),
                        vec![tag; edge],
                        "tail of {p:#x}"
                    );
                    a.free(p, StreamId(0)).unwrap();
                }
            }
            drop(next);
            (mine, rx)
        }));
    }
    drop(txs);
    let mut rest = Vec::new();
    let mut rxs = Vec::new();
    for h in handles {
        let (mine, rx) = h.join().unwrap();
        rest.extend(mine);
        rxs.push(rx);
    }
    for rx in rxs {
        rest.extend(rx.try_iter());
    }
    for (p, size, tag) in rest {
        let edge = size.min(64) as usize;
        assert_eq!(read(dev.as_ref(), &a, p, edge), vec![tag; edge]);
        a.free(p, StreamId(0)).unwrap();
    }
    a.trim();
    assert_eq!(dev.used(), Bytes::ZERO);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Live blocks never overlap, whatever the sequence, through the thread caches too.
    #[test]
    fn live_blocks_never_overlap(ops in prop::collection::vec((0u64..3, 1u64..3_000_000, any::<bool>()), 1..150)) {
        let (dev, a) = host_allocator(Bytes::gib(8));
        let mut live: Vec<(u64, u64)> = Vec::new();
        for (stream, size, free) in ops {
            if free && !live.is_empty() {
                let (p, _) = live.remove((size as usize) % live.len());
                a.free(p, StreamId(stream)).unwrap();
            } else {
                let p = a.alloc(Bytes(size), StreamId(stream)).unwrap();
                for (q, l) in &live {
                    prop_assert!(p + size <= *q || q + l <= p, "{p:#x}+{size} overlaps {q:#x}+{l}");
                }
                live.push((p, size));
            }
        }
        for (p, _) in live {
            a.free(p, StreamId(0)).unwrap();
        }
        a.trim();
        prop_assert_eq!(dev.used(), Bytes::ZERO);
    }
}

#[test]
fn segments_show_live_blocks_at_their_addresses_and_thread_cached_ones_as_free() {
    let (_, a) = host_allocator(Bytes::gib(1));
    let big = a.alloc(Bytes::mib(3), StreamId(1)).unwrap();
    let small = a.alloc(Bytes(1000), StreamId(1)).unwrap();
    a.free(small, StreamId(1)).unwrap();
    let segments = a.segments();
    let blocks: Vec<_> = segments.iter().flat_map(|s| &s.blocks).collect();
    let at = |p: u64| blocks.iter().find(|b| b.offset == p).copied().unwrap();
    assert_eq!(at(big).state, BlockState::Allocated);
    assert_eq!(at(big).requested, 3 * Bytes::MIB);
    assert_eq!(at(small).state, BlockState::Free, "waits in a thread cache");
    let held: u64 = segments.iter().map(|s| s.len).sum();
    assert_eq!(held, a.stats().core.held.get());
}

#[test]
fn a_request_over_the_limit_is_refused_without_taking_memory() {
    let (dev, a) = host_allocator(Bytes::gib(8));
    let a = a.with_limit(Bytes::gib(1));
    let p = a.alloc(Bytes::mib(600), StreamId(0)).unwrap();
    let used = dev.used();
    let e = a.alloc(Bytes::mib(500), StreamId(0)).unwrap_err();
    assert!(
        e.to_string()
            .contains("limit is 1 GiB and 600 MiB of it is in use"),
        "{e}"
    );
    assert_eq!(
        dev.used(),
        used,
        "nothing was taken for a request that cannot fit"
    );
    a.free(p, StreamId(0)).unwrap();
    a.alloc(Bytes::mib(900), StreamId(0)).unwrap();
}

#[test]
fn capture_notices_answer_only_once_announced_and_only_between_captures() {
    let n = CaptureNotices::default();
    assert!(!n.none_underway(), "unannounced: the driver must be asked");
    n.began();
    assert!(!n.some_underway(), "unannounced: nothing is known");
    n.ended();
    n.announce();
    assert!(n.none_underway());
    assert!(!n.some_underway());
    n.began();
    n.began();
    n.ended();
    assert!(!n.none_underway(), "one of two captures still underway");
    assert!(n.some_underway());
    n.ended();
    assert!(n.none_underway() && !n.some_underway());
    // An end without its begin does not hide a later capture.
    n.ended();
    n.began();
    assert!(!n.none_underway());
}

/// Stream events whose captures the test starts and ends, announced as a framework's are (so no
/// capture is underway whenever the flag is down).
#[derive(Clone, Default)]
struct Captures(Arc<std::sync::atomic::AtomicBool>);

impl Captures {
    fn set(&self, on: bool) {
        self.0.store(on, Ordering::SeqCst);
    }
}

impl Fences for Captures {
    fn is_complete(&self, fence: Fence) -> bool {
        fence != Fence::NEVER
    }

    fn record(&self, stream: StreamId) -> Option<Fence> {
        (!self.is_capturing(stream)).then_some(Fence(1))
    }
}

impl StreamEvents for Captures {
    fn is_capturing(&self, _: StreamId) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    fn none_capturing(&self) -> bool {
        !self.0.load(Ordering::SeqCst)
    }
}

fn capturing_allocator() -> (Arc<dyn ByteAccess>, Captures, CachingAllocator<LocalSource>) {
    let captures = Captures::default();
    let (dev, a) = allocator_with(Bytes::gib(1), Box::new(captures.clone()));
    (dev, captures, a)
}

#[test]
fn a_block_freed_during_a_capture_stays_with_its_stream_after_it() {
    let (_, captures, a) = capturing_allocator();
    let (s1, s2) = (StreamId(1), StreamId(2));
    // Sizes the thread cache would keep and one it would not.
    for size in [Bytes::kib(4), Bytes::kib(64), Bytes::kib(128)] {
        captures.set(true);
        let p = a.alloc(size, s1).unwrap();
        a.free(p, s1).unwrap();
        captures.set(false);
        // A reclaim request after the capture empties the thread caches.
        a.trim();
        let q = a.alloc(size, s2).unwrap();
        assert_ne!(p, q, "{size}: freed during s1's capture, then handed to s2");
        a.free(q, s2).unwrap();
    }
}

#[test]
fn a_trim_during_a_capture_fences_cached_blocks_as_they_were_freed() {
    let (dev, captures, a) = capturing_allocator();
    let s1 = StreamId(1);
    let p = a.alloc(Bytes::kib(64), s1).unwrap();
    a.free(p, s1).unwrap();
    // Freed outside a capture: in the thread cache, so still allocated in the core's books.
    assert_eq!(a.stats().core.allocated, Bytes::kib(64));
    captures.set(true);
    a.trim();
    captures.set(false);
    a.trim();
    let s = a.stats();
    assert_eq!((s.core.held, s.in_use), (Bytes::ZERO, Bytes::ZERO), "{s:?}");
    assert_eq!(dev.used(), Bytes::ZERO);
}

#[test]
fn the_caches_of_exited_threads_go_to_the_core_at_the_next_tick() {
    let (dev, a) = host_allocator(Bytes::gib(4));
    std::thread::scope(|scope| {
        let threads: Vec<_> = (0..16)
            .map(|_| {
                scope.spawn(|| {
                    for _ in 0..2 {
                        let ps: Vec<u64> = (0..8)
                            .map(|_| a.alloc(Bytes::kib(64), StreamId(0)).unwrap())
                            .collect();
                        for p in ps {
                            a.free(p, StreamId(0)).unwrap();
                        }
                    }
                })
            })
            .collect();
        // Joined one by one: the scope's own wait ends when each closure returns, which may be
        // before the thread's exit has run its thread-local destructors (and let go its cache).
        for t in threads {
            t.join().unwrap();
        }
    });
    let before = a.stats();
    assert_eq!(before.cached, Bytes::mib(8), "{before:?}");
    assert_eq!(before.fast_allocs, 16 * 8);
    a.tick(1);
    let after = a.stats();
    assert_eq!(
        after.fast_allocs, before.fast_allocs,
        "counts of exited threads kept"
    );
    assert_eq!(after.core.allocated, Bytes::ZERO, "{after:?}");
    // Their memory is the core's again: a new block reuses it rather than growing the heap.
    let held = after.core.held;
    let p = a.alloc(Bytes::kib(64), StreamId(0)).unwrap();
    assert_eq!(a.stats().core.held, held);
    a.free(p, StreamId(0)).unwrap();
    a.trim();
    assert_eq!(dev.used(), Bytes::ZERO);
}

/// Fences that never complete: the freeing stream's work is still running.
struct Busy;

impl Fences for Busy {
    fn is_complete(&self, _: Fence) -> bool {
        false
    }

    fn record(&self, _: StreamId) -> Option<Fence> {
        Some(Fence(1))
    }
}

impl StreamEvents for Busy {
    fn is_capturing(&self, _: StreamId) -> bool {
        false
    }
}

#[test]
fn each_threads_per_thread_stream_is_a_stream_of_its_own() {
    let (_, a) = allocator_with(Bytes::gib(1), Box::new(Busy));
    let on_a_thread = |f: &(dyn Fn() -> (u64, StreamId) + Sync)| {
        std::thread::scope(|s| s.spawn(f).join().unwrap())
    };
    // Thread A frees on its per-thread stream (`cuMemFreeAsync_ptsz(p, 0)`), whose work on the
    // block has not finished.
    let (p, sa) = on_a_thread(&|| {
        let s = stream_of(0, true);
        assert_eq!(
            stream_of(CU_STREAM_PER_THREAD, false),
            s,
            "one stream, two spellings"
        );
        let p = a.alloc(Bytes::mib(4), s).unwrap();
        a.free(p, s).unwrap();
        (p, s)
    });
    // Thread B allocates on its own per-thread stream: not A's block.
    let (q, sb) = on_a_thread(&|| {
        let s = stream_of(0, true);
        (a.alloc(Bytes::mib(4), s).unwrap(), s)
    });
    assert_ne!(sa, sb);
    assert_ne!(
        p, q,
        "thread B got the block thread A's stream may still use"
    );
    assert_eq!(
        cuda_handle(sa),
        None,
        "another thread's per-thread stream has no handle here"
    );
    assert_eq!(
        stream_of(0, false),
        StreamId(0),
        "the null stream of a plain call is the legacy one"
    );
    assert_eq!(cuda_handle(stream_of(0, true)), Some(CU_STREAM_PER_THREAD));
}

/// A block freed (or allocated) from another thread-local's destructor at thread exit, after this
/// thread's cache is gone, goes to the core: no panic, nothing left allocated.
#[test]
fn a_free_from_a_thread_local_destructor_goes_to_the_core() {
    struct FreesAtExit(Option<(Arc<CachingAllocator<LocalSource>>, u64)>);
    impl Drop for FreesAtExit {
        fn drop(&mut self) {
            if let Some((a, p)) = self.0.take() {
                a.free(p, StreamId(0)).expect("freed at thread exit");
                let q = a
                    .alloc(Bytes(4096), StreamId(0))
                    .expect("allocated at thread exit");
                a.free(q, StreamId(0)).expect("freed at thread exit");
            }
        }
    }
    thread_local! {
        static GUARD: std::cell::RefCell<FreesAtExit> =
            const { std::cell::RefCell::new(FreesAtExit(None)) };
    }
    let (_dev, a) = host_allocator(Bytes::gib(1));
    let a = Arc::new(a);
    let b = a.clone();
    std::thread::spawn(move || {
        // The guard's destructor is registered first, so it runs after the thread's cache's.
        GUARD.with(|_| {});
        let p = b.alloc(Bytes(4096), StreamId(0)).unwrap();
        let warm = b.alloc(Bytes(4096), StreamId(0)).unwrap();
        b.free(warm, StreamId(0)).unwrap();
        GUARD.with(|g| g.borrow_mut().0 = Some((b.clone(), p)));
    })
    .join()
    .expect("no panic at thread exit");
    a.trim();
    assert_eq!(a.stats().in_use, Bytes::ZERO);
}

/// Fences that never complete: work queued on a stream is never seen done.
struct NeverDone;

impl Fences for NeverDone {
    fn is_complete(&self, _: Fence) -> bool {
        false
    }

    fn record(&self, _: StreamId) -> Option<Fence> {
        Some(Fence(1))
    }
}

impl StreamEvents for NeverDone {
    fn is_capturing(&self, _: StreamId) -> bool {
        false
    }

    fn none_capturing(&self) -> bool {
        true
    }
}

/// A block freed on the default stream, whose work may still be queued there, is not what a
/// synchronous allocation gets: that memory must be usable from any stream at once.
#[test]
fn a_synchronous_allocation_waits_for_the_default_streams_frees() {
    let (_, a) = allocator_with(Bytes::gib(1), Box::new(NeverDone));
    for size in [Bytes::kib(4), Bytes::mib(4)] {
        let p = a.alloc(size, StreamId(0)).unwrap();
        a.free(p, StreamId(0)).unwrap();
        a.trim();
        let q = a.alloc(size, SYNCHRONOUS).unwrap();
        assert_ne!(
            p, q,
            "{size}: handed out while its free was still queued on stream 0"
        );
    }
    assert_eq!(cuda_handle(SYNCHRONOUS), Some(0));
}

/// A source whose settling waits until the test lets it go, as a round trip to a daemon that is
/// restarting would.
struct SlowToSettle {
    inner: LocalSource,
    go: Arc<std::sync::Mutex<Option<std::sync::mpsc::Receiver<()>>>>,
}

impl HandleSource for SlowToSettle {
    fn take(
        &mut self,
        sizes: &[Bytes],
    ) -> Result<Vec<(vram_device::Handle, u64)>, vram_core::alloc::Refused> {
        self.inner.take(sizes)
    }

    fn give(&mut self, tickets: &[u64]) {
        self.inner.give(tickets)
    }

    fn settler(&self) -> backing::Settler {
        let go = self.go.lock().unwrap().take();
        Box::new(move || {
            if let Some(go) = go {
                let _ = go.recv();
            }
        })
    }
}

/// A trim waiting for its returns to land holds up no other thread's allocations and frees.
#[test]
fn a_trim_waiting_for_its_returns_holds_up_no_allocation() {
    let dev: Arc<dyn ByteAccess> = Arc::new(HostDevice::new(Bytes::gib(1), Bytes::mib(2)).unwrap());
    let (release, go) = std::sync::mpsc::channel();
    let source = SlowToSettle {
        inner: LocalSource::new(dev.clone()),
        go: Arc::new(std::sync::Mutex::new(Some(go))),
    };
    let config = AllocConfig::default();
    let backing = MappedBacking::new(dev.clone(), config.va_bytes, source).unwrap();
    let a = &CachingAllocator::new(config, backing, Box::new(HostEvents));
    let s = StreamId(0);
    let p = a.alloc(Bytes::mib(8), s).unwrap();
    a.free(p, s).unwrap();
    std::thread::scope(|scope| {
        let trimming = scope.spawn(|| a.trim());
        // The trim gives the free handle back, then waits in its settler.
        std::thread::sleep(std::time::Duration::from_millis(100));
        let (done, answered) = std::sync::mpsc::channel();
        scope.spawn(move || {
            let q = a.alloc(Bytes::mib(4), s).unwrap();
            a.free(q, s).unwrap();
            done.send(()).unwrap();
        });
        let answered = answered.recv_timeout(std::time::Duration::from_secs(5));
        release.send(()).unwrap();
        assert!(
            answered.is_ok(),
            "an allocation waited for the trim's settling"
        );
        assert!(trimming.join().unwrap() >= Bytes::mib(8));
    });
}

/// Fences on `at_once` complete when recorded; the device passes the others only once a wait
/// for them is let through, as a device running behind the program on that stream. Each such
/// wait says so on `waiting`, then holds until `gate` lets it go. A fence's id is its stream's.
struct Behind {
    at_once: StreamId,
    done: std::sync::Mutex<bool>,
    waiting: std::sync::Mutex<std::sync::mpsc::Sender<()>>,
    gate: std::sync::Mutex<std::sync::mpsc::Receiver<()>>,
}

impl Fences for Behind {
    fn is_complete(&self, fence: Fence) -> bool {
        fence.0 == self.at_once.0 || *self.done.lock().unwrap()
    }

    fn record(&self, stream: StreamId) -> Option<Fence> {
        Some(Fence(stream.0))
    }

    fn wait(&self, fence: Fence) -> bool {
        if self.is_complete(fence) {
            return true;
        }
        let _ = self.waiting.lock().unwrap().send(());
        let passed = self.gate.lock().unwrap().recv().is_ok();
        *self.done.lock().unwrap() |= passed;
        passed
    }
}

impl StreamEvents for Behind {
    fn is_capturing(&self, _: StreamId) -> bool {
        false
    }
}

/// Memory freed on a stream whose work the device has not yet passed goes back on a trim: the
/// trim waits for the stream's fence, holding no lock of the allocator while it waits, and what
/// could go back at once (freed on a stream the device has passed) has gone back before the wait.
#[test]
fn a_trim_waits_for_frees_the_device_has_not_passed_holding_up_no_other_call() {
    let (fast, slow) = (StreamId(1), StreamId(7));
    let (waiting, waited) = std::sync::mpsc::channel();
    let (open, gate) = std::sync::mpsc::channel();
    let events = Behind {
        at_once: fast,
        done: std::sync::Mutex::new(false),
        waiting: std::sync::Mutex::new(waiting),
        gate: std::sync::Mutex::new(gate),
    };
    let (_, a) = allocator_with(Bytes::gib(1), Box::new(events));
    let a = &a;
    let p = a.alloc(Bytes::mib(8), slow).unwrap();
    let q = a.alloc(Bytes::mib(8), fast).unwrap();
    a.free(p, slow).unwrap();
    a.free(q, fast).unwrap();
    let held = a.stats().core.held;
    std::thread::scope(|scope| {
        let trimming = scope.spawn(|| a.trim());
        let five = std::time::Duration::from_secs(5);
        let asked = waited.recv_timeout(five);
        let (done, answered) = std::sync::mpsc::channel();
        scope.spawn(move || done.send(a.stats().core.held).unwrap());
        let answered = answered.recv_timeout(five);
        open.send(()).unwrap();
        assert!(asked.is_ok(), "the trim did not wait for the free's fence");
        let during = answered.expect("the allocator was held while the trim waited");
        assert!(
            during <= held - Bytes::mib(8) && during >= Bytes::mib(8),
            "held {during} during the wait, of {held}: the free stream's memory goes back first, \
             the other's after the wait"
        );
        assert!(trimming.join().unwrap() >= Bytes::mib(16));
    });
    assert_eq!(a.stats().core.held, Bytes::ZERO);
}

/// `Captures` that count the device synchronisations asked of them.
#[derive(Clone, Default)]
struct SyncCounting(Captures, Arc<AtomicU64>);

impl Fences for SyncCounting {
    fn is_complete(&self, fence: Fence) -> bool {
        self.0.is_complete(fence)
    }

    fn record(&self, stream: StreamId) -> Option<Fence> {
        self.0.record(stream)
    }
}

impl StreamEvents for SyncCounting {
    fn is_capturing(&self, stream: StreamId) -> bool {
        self.0.is_capturing(stream)
    }

    fn none_capturing(&self) -> bool {
        self.0.none_capturing()
    }

    fn synchronize(&self) -> bool {
        self.1.fetch_add(1, Ordering::SeqCst);
        true
    }
}

#[test]
fn a_graphs_pool_keeps_its_blocks_from_the_thread_cache_and_every_stream_until_released() {
    let events = SyncCounting::default();
    let (captures, syncs) = (events.0.clone(), events.1.clone());
    let (_, a) = allocator_with(Bytes::gib(1), Box::new(events));
    let (s1, s2) = (StreamId(1), StreamId(2));
    let pool = PoolId(0, 1);
    // Sizes the thread cache would keep and one it would not.
    for size in [Bytes::kib(4), Bytes::kib(64), Bytes::mib(4)] {
        a.pool_begin(pool);
        captures.set(true);
        let p = a.alloc_in_pool(size, s1, pool).unwrap();
        let out = a.alloc_in_pool(size, s1, pool).unwrap();
        // An intermediate value, freed during the capture.
        a.free(p, s1).unwrap();
        captures.set(false);
        // Eager work on the capture's stream and on another, and a reclaim, after the capture:
        // the graph's replays still write `p`.
        for s in [s1, s2, s1] {
            let q = a.alloc(size, s).unwrap();
            assert_ne!(q, p, "{size}: the graph's memory went to stream {s:?}");
            a.free(q, s).unwrap();
        }
        a.trim();
        // The graph's output, freed after the capture, goes back to the pool as well.
        a.free(out, s1).unwrap();
        let q = a.alloc(size, s1).unwrap();
        assert!(
            q != p && q != out,
            "{size}: the graph's output went to eager work"
        );
        a.free(q, s1).unwrap();
        // A second capture into the same pool reuses its memory.
        a.pool_begin(pool);
        captures.set(true);
        let again = a.alloc_in_pool(size, s1, pool).unwrap();
        assert!(
            again == p || again == out,
            "{size}: the pool's memory not reused"
        );
        a.free(again, s1).unwrap();
        captures.set(false);
        // Both graphs released: the device is waited for once, and the memory is everyone's.
        let before = syncs.load(Ordering::SeqCst);
        a.pool_release(pool);
        assert_eq!(
            syncs.load(Ordering::SeqCst),
            before,
            "one graph still uses the pool"
        );
        a.pool_release(pool);
        assert_eq!(syncs.load(Ordering::SeqCst), before + 1);
        a.trim();
        let s = a.stats();
        assert_eq!(
            (s.core.held, s.in_use),
            (Bytes::ZERO, Bytes::ZERO),
            "{size}: {s:?}"
        );
    }
}

#[test]
fn a_pool_released_during_a_capture_is_settled_at_a_later_release() {
    let events = SyncCounting::default();
    let (captures, syncs) = (events.0.clone(), events.1.clone());
    let (_, a) = allocator_with(Bytes::gib(1), Box::new(events));
    let s1 = StreamId(1);
    let (first, second) = (PoolId(0, 1), PoolId(0, 2));
    a.pool_begin(first);
    let p = a.alloc_in_pool(Bytes::mib(4), s1, first).unwrap();
    a.free(p, s1).unwrap();
    a.pool_begin(second);
    captures.set(true);
    // Released while the second graph is captured: no synchronisation, the memory stays.
    a.pool_release(first);
    assert_eq!(syncs.load(Ordering::SeqCst), 0);
    captures.set(false);
    a.trim();
    assert_eq!(a.stats().core.held, Bytes::mib(4));
    a.pool_release(second);
    assert_eq!(syncs.load(Ordering::SeqCst), 1);
    a.trim();
    assert_eq!(a.stats().core.held, Bytes::ZERO);
    assert!(
        a.alloc_in_pool(Bytes::mib(1), s1, first).is_err(),
        "a released pool takes no allocation"
    );
}

/// A source of host handles that records the tickets given back.
struct Recording {
    dev: Arc<HostDevice>,
    given: Arc<std::sync::Mutex<Vec<u64>>>,
    next: u64,
}

impl HandleSource for Recording {
    fn take(
        &mut self,
        sizes: &[Bytes],
    ) -> Result<Vec<(vram_device::Handle, u64)>, vram_core::alloc::Refused> {
        sizes
            .iter()
            .map(|&bytes| {
                self.next += 1;
                let h = vram_device::Device::create(self.dev.as_ref(), bytes).unwrap();
                Ok((h, self.next))
            })
            .collect()
    }

    fn give(&mut self, tickets: &[u64]) {
        self.given.lock().unwrap().extend_from_slice(tickets);
    }
}

#[test]
fn a_handle_whose_unmap_failed_is_not_given_back() {
    use vram_core::alloc::Backing;
    let dev = Arc::new(HostDevice::new(Bytes::gib(1), Bytes::mib(2)).unwrap());
    let given = Arc::new(std::sync::Mutex::new(Vec::new()));
    let source = Recording {
        dev: dev.clone(),
        given: given.clone(),
        next: 0,
    };
    let mut b = MappedBacking::new(dev.clone(), Bytes::gib(1), source).unwrap();
    let grants = b.grant(&[Bytes::mib(2), Bytes::mib(2)]).unwrap();
    b.map(grants[0], 0).unwrap();
    b.map(grants[1], 4 << 20).unwrap();
    // The first's unmap fails (an offset past the reservation stands for a failing driver): it
    // stays mapped, so it must not go back; the second's succeeds and goes back.
    b.unmap(grants[0], 2 << 30);
    b.unmap(grants[1], 4 << 20);
    // Mapping the first elsewhere (which the allocator, told of the failure, never asks) is
    // refused, not a panic.
    let moved = b.map(grants[0], 8 << 20);
    assert!(
        moved
            .as_ref()
            .is_err_and(|r| r.reason.contains("failed to unmap")),
        "{moved:?}"
    );
    b.release(&grants);
    assert_eq!(
        *given.lock().unwrap(),
        vec![2],
        "only the unmapped handle went back"
    );
    assert_eq!(
        vram_device::Device::used(dev.as_ref()),
        Bytes::mib(2),
        "the stuck handle's memory is still there"
    );
}
