//! Checksum throughput of shared-buffer versions (the position-keyed word sum over host memory),
//! the daemon's cost per byte at publish, verify and scrub on the host backend (plus the copy out
//! of the mapping).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use vram_core::shared::checksum;

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("checksum");
    for mib in [2usize, 64] {
        let data: Vec<u8> = (0..mib << 20).map(|i| (i * 31 % 251) as u8).collect();
        g.throughput(Throughput::Bytes(data.len() as u64));
        g.bench_with_input(
            BenchmarkId::from_parameter(format!("{mib}MiB")),
            &data,
            |b, d| b.iter(|| checksum(d)),
        );
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
