//! The allocator's own host memory stays bounded while a program frees on one stream with no
//! fence recorded: such a program's frees are fenced only when the allocator needs them (before a
//! growth, on a trim, or when memory is due to go back), so a training in its steady state may free millions
//! of times between two fences. Its books must hold one entry per free region, not one per free.
//!
//! Measured as the process's resident memory (`VmRSS` in Linux's `/proc/self/status`); this file
//! has one test, so nothing else runs in the process while it measures.

use vram_core::alloc::{AllocConfig, Allocator, AlwaysComplete, ModelBacking, StreamId};
use vram_core::Bytes;

/// The process's resident memory in bytes, or None where `/proc` does not tell it.
fn resident() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

#[test]
fn deferred_frees_on_one_stream_keep_the_books_bounded() {
    let Some(start) = resident() else {
        eprintln!("skipped: /proc/self/status gives no resident memory here");
        return;
    };
    let mut a = Allocator::new(AllocConfig::default(), ModelBacking::new());
    let stream = StreamId(7);
    let fences = AlwaysComplete;
    let sizes: Vec<Bytes> = (0..64u64)
        .map(|i| Bytes::mib(1 + i % 7) + Bytes(i * 4096))
        .collect();
    let mut blocks: Vec<_> = sizes
        .iter()
        .map(|&s| a.alloc(s, stream, &fences).unwrap())
        .collect();
    // Each block freed (deferred: the stream's own until a fence covers it) and taken again.
    let mut cycle = |a: &mut Allocator<ModelBacking>, n: u64| {
        for i in 0..n {
            let k = (i * 7919 % 64) as usize;
            a.free_deferred(blocks[k].offset, stream, &fences).unwrap();
            blocks[k] = a.alloc(sizes[k], stream, &fences).unwrap();
        }
    };
    // A first pass brings the free list to its working size before the measurement.
    cycle(&mut a, 10_000);
    let grants = a.stats().grant_requests;
    let before = resident().unwrap_or(start);
    cycle(&mut a, 500_000);
    let after = resident().unwrap_or(before);
    assert_eq!(
        a.stats().grant_requests,
        grants,
        "the loop reused its memory: no growth, so no fence was recorded"
    );
    let grown = after.saturating_sub(before);
    assert!(
        grown < 4 << 20,
        "500,000 deferred frees on one stream grew the process's resident memory by {grown} bytes"
    );
}
