//! Replays PyTorch snapshots as a device running behind the program would see them: every free
//! deferred, as on CUDA, and every fence complete only `LAG` microseconds of the trace's time
//! after it was recorded. `vramd replay` lets each free complete at once, as if the device kept
//! pace with the host; this shows what the lag costs, with the allocator allowed to wait for
//! pending fences before a growth (as on CUDA) and not allowed to.
//!
//! ```text
//! cargo run --release -p vram-core --example fence_lag -- LAGS TRACE...
//! cargo run --release -p vram-core --example fence_lag -- 0,5000 ../shared/traces/*.pickle.gz
//! ```

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use vram_core::alloc::{AllocConfig, Allocator, Fence, Fences, ModelBacking, StreamId};
use vram_core::replay::CostModel;
use vram_core::trace::{parse_snapshot, Action, Trace};
use vram_core::Bytes;

/// Fences that complete `lag` µs of trace time after they are recorded, or when waited for if
/// `waits`; the device runs its work in the order it was queued, so a fence waited for completes
/// every fence recorded before it too.
struct Lagged {
    now: Cell<u64>,
    lag: u64,
    /// When each fence was recorded (its index is its id); 0 once complete by a wait.
    recorded: RefCell<Vec<u64>>,
    waits: bool,
}

impl Fences for Lagged {
    fn is_complete(&self, f: Fence) -> bool {
        self.recorded.borrow()[f.0 as usize] + self.lag <= self.now.get()
    }

    fn record(&self, _: StreamId) -> Option<Fence> {
        let mut r = self.recorded.borrow_mut();
        r.push(self.now.get());
        Some(Fence(r.len() as u64 - 1))
    }

    fn wait(&self, f: Fence) -> bool {
        if self.waits {
            for t in &mut self.recorded.borrow_mut()[..=f.0 as usize] {
                *t = 0;
            }
        }
        self.waits
    }
}

/// A snapshot, gzipped or not (`parse_snapshot` tells them apart).
fn read(path: &str) -> Result<Trace, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{path}: {e}"))?;
    parse_snapshot(&bytes).map_err(|e| format!("{path}: {e}"))
}

fn replay(trace: &Trace, lag: u64, waits: bool) -> String {
    let f = Lagged {
        now: Cell::new(0),
        lag,
        recorded: RefCell::new(Vec::new()),
        waits,
    };
    let backing = ModelBacking::priced(CostModel::H200_MEASURED);
    let mut a = Allocator::new(AllocConfig::default(), backing);
    let mut blocks = HashMap::new();
    for e in &trace.events {
        f.now.set(e.time_us);
        let s = StreamId(e.stream);
        match e.action {
            Action::Alloc => {
                let b = a
                    .alloc(Bytes(e.size), s, &f)
                    .expect("no capacity to refuse");
                blocks.insert(e.addr, b.offset);
            }
            Action::Free => {
                let o = blocks
                    .remove(&e.addr)
                    .expect("frees only what it allocated");
                a.free_deferred(o, s, &f).expect("a live block");
            }
        }
        a.tick(e.time_us, &f);
    }
    let (st, held) = (a.stats(), a.backing().peak_held().get());
    let requested = st.requested_peak.get();
    format!(
        "{:.2} % ({} MiB held at most), {} waits, {} grant requests, {} unmaps",
        100.0 * (1.0 - requested as f64 / held as f64),
        held >> 20,
        st.fence_waits,
        a.backing().counts().grant_requests,
        a.backing().counts().unmaps,
    )
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((lags, paths)) = args.split_first() else {
        eprintln!("usage: fence_lag LAG_US[,LAG_US...] TRACE...");
        std::process::exit(2);
    };
    let lags: Vec<u64> = lags
        .split(',')
        .map(|s| s.parse().expect("a lag in microseconds"))
        .collect();
    println!("| trace | lag | fragmentation, no waits | fragmentation, waits |");
    println!("|---|---|---|---|");
    for path in paths {
        let trace = match read(path) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("{e}");
                std::process::exit(1);
            }
        };
        let name = std::path::Path::new(path)
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.split('.').next())
            .unwrap_or(path);
        for &lag in &lags {
            println!(
                "| {name} | {lag} µs | {} | {} |",
                replay(&trace, lag, false),
                replay(&trace, lag, true)
            );
        }
    }
}
