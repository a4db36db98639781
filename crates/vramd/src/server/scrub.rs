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
        slot.with_shared_freeing(|broker, books| {
            let freed = books.core.expire(broker, now);
            ((), books.take(freed))
        });
        slot.book_let_go();
    }
}

fn run(daemon: &Daemon) {
    let mut last_expiry = Instant::now();
    // A read that fails (a device fault, a reader context lost) fails again at once: logged at
    // most once a minute, and a pass that read nothing waits a tick before the next.
    let mut failures = crate::logging::Every::default();
    while !stopping(daemon) {
        expire_leases(daemon);
        let rate = daemon.shared.scrub_rate();
        // The versions by name only: a version freed during the pass is not kept alive by it
        // (its memory goes back to the device when the books let it go, not when the scrub
        // reaches it).
        let targets: Vec<_> = daemon
            .slots
            .iter()
            .enumerate()
            .flat_map(|(i, slot)| {
                slot.with_shared(|_, books| {
                    let published = books.core.published().into_iter();
                    published.map(|p| (i, p)).collect::<Vec<_>>()
                })
            })
            .collect();
        if rate == 0 || targets.is_empty() {
            std::thread::sleep(TICK);
            continue;
        }
        let mut schedule = Schedule::new(rate);
        let mut turned_off = false;
        let mut read_any = false;
        for (slot, p) in targets {
            let Some(memory) = daemon.slots[slot].version_memory(p.buffer, p.version) else {
                continue;
            };
            let device = match daemon.slots[slot].reader() {
                Ok(d) => d,
                Err(e) => {
                    if let Some(more) = failures.due() {
                        tracing::warn!(gpu = slot, more, "scrub cannot read shared memory: {e}");
                    }
                    continue;
                }
            };
            // Keeps to the rate: after each piece, sleeps until the bytes so far are on schedule.
            // Stops at once if the version was freed meanwhile (`gone`), so that its memory goes,
            // and ends the pass if a reload turned the scrub off.
            let mut gone = false;
            let pace = |n: u64| {
                if !daemon.slots[slot].keeps_version(p.buffer, p.version) {
                    gone = true;
                    return false;
                }
                schedule.done += n;
                daemon.shared.scrub.bytes.fetch_add(n, Ordering::Relaxed);
                loop {
                    if !schedule.follow(daemon.shared.scrub_rate()) {
                        turned_off = true;
                        return false;
                    }
                    let elapsed = schedule.started.elapsed();
                    let due = schedule.due();
                    if elapsed >= due {
                        break;
                    }
                    if stopping(daemon) {
                        return false;
                    }
                    if !daemon.slots[slot].keeps_version(p.buffer, p.version) {
                        gone = true;
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
            let read = checksum_memory(device.as_ref(), memory.handle(), PIECE, pace);
            drop(memory);
            if gone {
                continue;
            }
            if turned_off {
                break;
            }
            match read {
                Ok(Some(actual)) => {
                    read_any = true;
                    daemon.shared.scrub.versions.fetch_add(1, Ordering::Relaxed);
                    if actual != p.checksum {
                        report_mismatch(
                            daemon, slot, p.buffer, p.version, p.checksum, actual, "scrub",
                        );
                    }
                }
                Ok(None) => return,
                Err(e) => {
                    if let Some(more) = failures.due() {
                        tracing::warn!(
                            buffer = p.buffer.0,
                            version = p.version.0,
                            more,
                            "scrub cannot read a version: {e}"
                        );
                    }
                }
            }
        }
        if !read_any {
            std::thread::sleep(TICK);
        }
        if turned_off {
            continue;
        }
        daemon.shared.scrub.passes.fetch_add(1, Ordering::Relaxed);
    }
}

/// A pass's pace: the bytes read since `started`, due at `rate` bytes a second.
struct Schedule {
    rate: u64,
    started: Instant,
    done: u64,
}

impl Schedule {
    fn new(rate: u64) -> Schedule {
        Schedule {
            rate,
            started: Instant::now(),
            done: 0,
        }
    }

    /// Takes the configured rate, `rate`: a changed one (a reload) applies from now on, a slow
    /// pass does not keep the rate it started with; false where it is 0, the scrub turned off.
    fn follow(&mut self, rate: u64) -> bool {
        if rate != self.rate {
            *self = Schedule::new(rate);
        }
        rate != 0
    }

    /// When the bytes read so far are due, counted from `started`.
    fn due(&self) -> Duration {
        Duration::from_secs_f64(self.done as f64 / self.rate as f64)
    }
}
