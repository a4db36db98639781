//! The allocator's core algorithm on one thread, against `ModelBacking` (no driver, no locks):
//! an alloc+free pair of a size already cached, a program's deferred frees on one stream, and the
//! replays of two real traces: a ResNet-50 training and a Llama-style transformers training, whose
//! heap holds many more free regions.
//!
//! `cargo bench -p vram-core --bench alloc`. The ResNet-50 trace is read from `VRAMD_TRACES`, else
//! `shared/traces` beside the checkout, and its benchmark is skipped with a message when neither
//! holds it; the Llama-style trace is in the repository (`docs/results/`).

use std::hint::black_box;
use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use vram_core::alloc::{AllocConfig, Allocator, AlwaysComplete, Fence, ModelBacking, StreamId};
use vram_core::replay::{replay, CostModel};
use vram_core::trace::parse_snapshot;
use vram_core::Bytes;

const TRACE: &str = "resnet50_train";
/// A Llama-style training recorded with transformers (`scripts/h200/record_traces.py`).
const HF_TRACE: &str = "docs/results/2026-12-07-h100-hf-traces/hf_llama_train.pickle.gz";

fn alloc_free_cached(c: &mut Criterion) {
    let mut group = c.benchmark_group("alloc_free_cached");
    for size in [Bytes(4096), Bytes::mib(64)] {
        let mut a = Allocator::new(AllocConfig::default(), ModelBacking::new());
        let s = StreamId(0);
        // Warm the cache: the first pair grants and maps; every later pair reuses that memory.
        let b = a.alloc(size, s, &AlwaysComplete).unwrap();
        a.free(b.offset, s, Fence(0), &AlwaysComplete).unwrap();
        group.bench_with_input(BenchmarkId::from_parameter(size), &size, |bench, &size| {
            bench.iter(|| {
                let b = a.alloc(black_box(size), s, &AlwaysComplete).unwrap();
                a.free(b.offset, s, Fence(0), &AlwaysComplete).unwrap();
            })
        });
    }
    group.finish();
}

/// A program on one stream whose frees are deferred (fenced only when the allocator needs it, so
/// no fence is recorded here): 64 blocks of 1-7 MiB, each freed and allocated again in turn.
fn deferred_one_stream(c: &mut Criterion) {
    let mut a = Allocator::new(AllocConfig::default(), ModelBacking::new());
    let s = StreamId(7);
    let sizes: Vec<Bytes> = (0..64u64)
        .map(|i| Bytes::mib(1 + i % 7) + Bytes(i * 4096))
        .collect();
    let mut blocks: Vec<_> = sizes
        .iter()
        .map(|&size| a.alloc(size, s, &AlwaysComplete).unwrap())
        .collect();
    let mut i = 0u64;
    c.bench_function("deferred_free_alloc/one_stream", |bench| {
        bench.iter(|| {
            let k = (i * 7919 % 64) as usize;
            i += 1;
            a.free_deferred(blocks[k].offset, s, &AlwaysComplete)
                .unwrap();
            blocks[k] = a.alloc(black_box(sizes[k]), s, &AlwaysComplete).unwrap();
        })
    });
}

fn traces_dir() -> Option<PathBuf> {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    std::env::var_os("VRAMD_TRACES")
        .map(PathBuf::from)
        .into_iter()
        .chain([
            manifest.join("../../shared/traces"),
            manifest.join("../../../shared/traces"),
        ])
        .find(|d| d.join(format!("{TRACE}.pickle.gz")).is_file())
}

fn replay_trace(c: &mut Criterion) {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut traces = vec![("hf_llama_train", manifest.join("../..").join(HF_TRACE))];
    match traces_dir() {
        Some(dir) => traces.insert(0, (TRACE, dir.join(format!("{TRACE}.pickle.gz")))),
        None => eprintln!("replay/{TRACE} skipped: no traces (set VRAMD_TRACES)"),
    }
    let config = AllocConfig::default();
    let mut group = c.benchmark_group("replay");
    group.sample_size(10);
    for (name, path) in traces {
        let bytes =
            std::fs::read(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        let trace = parse_snapshot(&bytes).unwrap();
        group.bench_function(name, |bench| {
            bench.iter(|| {
                replay(
                    name,
                    &trace,
                    &config,
                    &CostModel::H200_MEASURED,
                    &mut |_, _| {},
                )
                .unwrap()
            })
        });
    }
    group.finish();
}

criterion_group!(
    benches,
    alloc_free_cached,
    deferred_one_stream,
    replay_trace
);
criterion_main!(benches);
