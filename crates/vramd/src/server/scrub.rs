//! The background scrub: re-reads every published version of every shared buffer at the
//! configured rate (bytes per second) and compares it with its checksum at publish. It also takes
//! away leases that ran out, so a dead writer's draft is discarded without waiting for a request.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::shared::{checksum_memory, report_mismatch};
use super::Daemon;

const TICK: Duration = Duration::from_millis(50);
/// The scrub checksums a version in pieces of this size, pacing itself to the rate after each.
const PIECE: u64 = 8 << 20;

pub fn start(daemon: Arc<Daemon>) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("vramd-scrub".into())
        .spawn(move || run(&daemon))
}

fn stopping(daemon: &Daemon) -> bool {
    daemon.shutting_down.load(Ordering::Acquire)
}

fn expire_leases(daemon: &Daemon) {
    let now = daemon.shared.now_ms();
    for slot in &daemon.slots {
        let memory = slot.with_shared(|broker, books| {
            let freed = books.core.expire(broker, now);
            books.take(freed)
        });
        drop(memory);
        slot.book_let_go();
    }
}

fn run(daemon: &Daemon) {
    let mut last_expiry = Instant::now();
    while !stopping(daemon) {
        expire_leases(daemon);
        let rate = daemon.shared.scrub_rate();
        let targets: Vec<_> = daemon
            .slots
            .iter()
            .enumerate()
            .flat_map(|(i, slot)| {
                slot.with_shared(|_, books| {
                    books
                        .core
                        .published()
                        .into_iter()
                        .filter_map(|p| {
                            let m = books.memory.get(&(p.buffer, p.version))?.clone();
                            Some((i, p, m))
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        if rate == 0 || targets.is_empty() {
            std::thread::sleep(TICK);
            continue;
        }
        let started = Instant::now();
        let mut done = 0u64;
        for (slot, p, memory) in targets {
            let device = match daemon.slots[slot].reader() {
                Ok(d) => d,
                Err(e) => {
                    tracing::warn!(gpu = slot, "scrub cannot read shared memory: {e}");
                    continue;
                }
            };
            // Keeps to the rate: after each piece, sleeps until the bytes so far are on schedule.
            let pace = |n: u64| {
                done += n;
                daemon.shared.scrub.bytes.fetch_add(n, Ordering::Relaxed);
                let due = Duration::from_secs_f64(done as f64 / rate as f64);
                loop {
                    let elapsed = started.elapsed();
                    if elapsed >= due {
                        break;
                    }
                    if stopping(daemon) {
                        return false;
                    }
                    if last_expiry.elapsed() >= TICK {
                        expire_leases(daemon);
                        last_expiry = Instant::now();
                    }
                    std::thread::sleep((due - elapsed).min(TICK));
                }
                !stopping(daemon)
            };
            match checksum_memory(device.as_ref(), memory.handle(), PIECE, pace) {
                Ok(Some(actual)) => {
                    daemon.shared.scrub.versions.fetch_add(1, Ordering::Relaxed);
                    if actual != p.checksum {
                        report_mismatch(
                            daemon, slot, p.buffer, p.version, p.checksum, actual, "scrub",
                        );
                    }
                }
                Ok(None) => return,
                Err(e) => tracing::warn!(
                    buffer = p.buffer.0,
                    version = p.version.0,
                    "scrub cannot read a version: {e}"
                ),
            }
        }
        daemon.shared.scrub.passes.fetch_add(1, Ordering::Relaxed);
    }
}
