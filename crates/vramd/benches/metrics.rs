//! What metrics add to one grant: a clock read before and after `Slot::grant_many` and one
//! histogram observation (session.rs), against the grant itself (tens of microseconds on the host
//! backend).

use std::time::Instant;

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use vramd::metrics::{tenant_labels, Instruments};

fn grant_hook(c: &mut Criterion) {
    let instruments = Instruments::default();
    let histogram = instruments.grant_histogram(&tenant_labels("trainer", "high", 0));
    c.bench_function("grant hook: time and observe", |b| {
        b.iter(|| {
            let started = Instant::now();
            black_box(&histogram).observe(started.elapsed().as_secs_f64());
        })
    });
    c.bench_function("grant hook: metrics off (clock read only)", |b| {
        b.iter(|| black_box(Instant::now()))
    });
    c.bench_function("reclaim counter", |b| {
        b.iter(|| instruments.reclaim_asked())
    });
}

criterion_group!(benches, grant_hook);
criterion_main!(benches);
