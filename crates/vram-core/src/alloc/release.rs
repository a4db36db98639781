//! Giving memory back: wholly free handles above the recent peak of memory in use go back once
//! they have stayed above it for `release_delay_us` (a training loop's per-step pattern keeps its
//! memory), and every wholly free handle on `trim`.

use super::backing::{Backing, GrantId};
use super::growth::FreeHandle;
use super::heap::Mapped;
use super::placement::HeapKind;
use super::Allocator;

/// The peak of a value over the last one to two windows of `width`.
#[derive(Debug, Default)]
pub(super) struct PeakWindow {
    start: u64,
    current: u64,
    previous: u64,
}

impl PeakWindow {
    pub(super) fn observe(&mut self, now: u64, value: u64, width: u64) -> u64 {
        if now >= self.start.saturating_add(width) {
            let adjacent = now < self.start.saturating_add(width.saturating_mul(2));
            self.previous = if adjacent { self.current } else { 0 };
            self.start = now;
            self.current = 0;
        }
        self.current = self.current.max(value);
        self.previous.max(self.current)
    }
}

/// What the timed release keeps between ticks.
#[derive(Debug, Default)]
pub(super) struct Release {
    /// The peak of memory in use over the last one to two release delays.
    pub window: PeakWindow,
    /// The most memory in use since the last tick.
    pub allocated_since_tick: u64,
    /// The allocator time before which no tick looks for memory to give back.
    pub next_scan: u64,
}

impl<B: Backing> Allocator<B> {
    /// Bytes to give back at a tick at `now_us`: what is held above the recent peak in use plus
    /// `keep_fraction`, once a quarter of the release delay has passed since the last scan.
    pub(super) fn release_due(&mut self, now_us: u64) -> u64 {
        let delay = self.config.release_delay_us;
        let recent = self
            .release
            .window
            .observe(now_us, self.release.allocated_since_tick, delay);
        self.release.allocated_since_tick = self.stats.allocated.get();
        let keep = recent.saturating_add((recent as f64 * self.config.keep_fraction) as u64);
        let held = self.stats.held.get();
        if held <= keep || now_us < self.release.next_scan {
            return 0;
        }
        self.release.next_scan = now_us.saturating_add(delay / 4);
        held - keep
    }

    /// Unmaps and returns wholly free handles, the largest first, up to about `budget` bytes.
    pub(super) fn release_free(&mut self, budget: u64) -> u64 {
        let gran = self.config.granularity.get();
        let mut handles: Vec<FreeHandle> = self
            .heaps
            .iter()
            .flat_map(|(heap, h)| {
                h.free_handles(gran, [None, None])
                    .into_iter()
                    .map(move |(va, len)| FreeHandle { heap, va, len })
            })
            .collect();
        handles.sort_by_key(|c| std::cmp::Reverse(c.len));
        let mut chosen_bytes = 0;
        let mut chosen = Vec::new();
        for h in handles {
            if chosen_bytes + h.len > budget {
                continue;
            }
            chosen_bytes += h.len;
            chosen.push(h);
        }
        self.return_handles(&chosen)
    }

    /// Unmaps the wholly free handles and gives them back in one request; returns the bytes given
    /// back (a handle whose unmap fails stays).
    pub(super) fn return_handles(&mut self, handles: &[FreeHandle]) -> u64 {
        if handles.is_empty() {
            return 0;
        }
        let mut returned = 0;
        let mut grants: Vec<GrantId> = Vec::with_capacity(handles.len());
        for h in handles {
            if let Some(m) = self.unmap_free(h.heap, h.va) {
                self.stats.on_return(m.len);
                returned += m.len;
                grants.push(m.grant);
            }
        }
        if !grants.is_empty() {
            self.backing.release(&grants);
        }
        returned
    }

    /// Takes the wholly free handle at `va` out of `heap` and unmaps it. When the unmap fails, the
    /// handle stays mapped and held, and its range is set aside for good (never mapped again,
    /// which would fail), so `None`.
    pub(super) fn unmap_free(&mut self, heap: HeapKind, va: u64) -> Option<Mapped> {
        let m = self.heaps.get_mut(heap).remove(va);
        self.stats.unmaps += 1;
        if self.backing.unmap(m.grant, va) {
            return Some(m);
        }
        self.heaps.get_mut(heap).set_aside(va, m.len);
        None
    }
}
