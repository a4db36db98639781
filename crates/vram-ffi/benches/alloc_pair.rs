//! An alloc+free pair of a cached size through the C ABI (`vram_alloc` / `vram_free`), on one
//! thread and on each of eight threads at once, and of a size the core allocator serves. Runs
//! against an in-process daemon on the host backend; the pair itself never reaches the daemon once
//! the size is cached.

use std::ffi::c_void;
use std::time::Instant;

use criterion::{criterion_group, criterion_main, Criterion};
use vram_core::Bytes;

#[path = "../tests/common/mod.rs"]
mod common;

fn pair(size: isize) {
    let p = vram::vram_alloc(size, 0, std::ptr::null_mut());
    assert!(!p.is_null(), "{:?}", vram::last_error());
    vram::vram_free(
        std::hint::black_box(p),
        size,
        0,
        std::ptr::null_mut::<c_void>(),
    );
}

fn bench(c: &mut Criterion) {
    let daemon = common::Daemon::start(Bytes::gib(16));
    std::env::set_var("VRAMD_SOCKET", &daemon.socket);
    std::env::set_var("VRAMD_TENANT", "bench");
    pair(4096);
    c.bench_function("vram_alloc+vram_free 4 KiB, 1 thread", |b| {
        b.iter(|| pair(4096))
    });
    // Above the thread caches' limit: every pair takes the core allocator's lock, finds the
    // block in its free lists and gives it back (no daemon call once the heap holds it).
    pair(4 << 20);
    c.bench_function(
        "vram_alloc+vram_free 4 MiB (core allocator), 1 thread",
        |b| b.iter(|| pair(4 << 20)),
    );
    c.bench_function("vram_alloc+vram_free 4 KiB, each of 8 threads", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            std::thread::scope(|s| {
                for _ in 0..8 {
                    s.spawn(|| {
                        pair(4096);
                        for _ in 0..iters {
                            pair(4096);
                        }
                    });
                }
            });
            // The threads ran side by side: elapsed / iters is the time per pair on each thread.
            start.elapsed()
        })
    });
    drop(daemon);
}

criterion_group!(benches, bench);
criterion_main!(benches);
