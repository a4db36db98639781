//! Growth: mapping memory into a heap when no free region fits a block.
//!
//! Where: next to the usable free region that needs the least new memory, or into a gap whose
//! filling joins the free regions on both sides (see `Heap::growth_site`): stitching lets new
//! memory extend free memory that is already held, so a block needs only what is missing.
//!
//! How much: what the block is missing, rounded up to the granularity and to `min_grow`. While
//! the program's memory in use is at a new peak, each growth doubles the step of the one before,
//! up to the room left under the growth cap (`grow_slack` above the peak in use), so that a
//! footprint climbing a little at a time costs a few requests rather than one per step, and the
//! memory it adds ahead of need stays within the cap.
//!
//! From where: below the cap, new handles from the backing (one request). At the cap, wholly free
//! handles elsewhere are reused first: moved (unmapped and mapped at the site) when they are one
//! handle of just the size needed, or together at most twice a need of four granules or more;
//! otherwise returned, with the need granted as one request (a handle returned comes back to the
//! tenant first). Memory passes between the heaps only by moves: the large heap takes a small-heap
//! handle only when one is just the size needed, and the small heap, which takes handles within
//! its need, takes the large heap's smallest larger one when no handle within its need is free.
//!
//! In what pieces: the largest handle is `max_handle`, at most 1/32 of the peak in use (so a small
//! program's handles are as small a share of it as a large one's), or smaller while the
//! driver-time budget affords more handles (`budget.rs`). A grant up to that size is one handle;
//! a larger one is cut into handles that are smallest (a quarter of it) at both ends and double
//! toward the middle. A region is later reused in part, usually from one end, and a handle goes
//! back only whole: small handles at the ends keep what a partial reuse strands small, and large
//! ones in the middle keep the count of handles (driver calls each) low.

use super::backing::{Backing, GrantId, Refused};
use super::heap::{Mapped, Site};
use super::placement::HeapKind;
use super::stream::StreamId;
use super::{AllocError, Allocator};
use crate::Bytes;

/// How much a growth adds: its usual step, or only what the block needs (after the usual step
/// was refused).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Step {
    Usual,
    NeedOnly,
}

/// A wholly free handle that a growth may reuse.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct FreeHandle {
    pub heap: HeapKind,
    pub va: u64,
    pub len: u64,
}

/// The step of a run of growths at a new peak of memory in use (0: no run).
#[derive(Debug, Default)]
pub(super) struct Climb {
    step: u64,
}

impl<B: Backing> Allocator<B> {
    /// The most the tenant may hold, while growth adds memory, with `len` more bytes allocated:
    /// `grow_slack` above the peak allocated. Past it, growth reuses wholly free handles first.
    pub(super) fn growth_cap(&self, len: u64) -> u64 {
        let peak = self.peak_in_use(len);
        peak.saturating_add((peak as f64 * self.config.grow_slack) as u64)
    }

    /// The peak of memory in use, counting `len` more bytes allocated.
    fn peak_in_use(&self, len: u64) -> u64 {
        self.stats
            .allocated_peak
            .get()
            .max(self.stats.allocated.get() + len)
    }

    /// [`Self::grow`] by the usual step; when that is refused (the tenant's limit, or the
    /// device), gives back every wholly free handle and tries again, then once more for the
    /// block's need alone, without the step that growth usually rounds up to.
    pub(super) fn grow_or_retry(
        &mut self,
        kind: HeapKind,
        len: u64,
        stream: StreamId,
    ) -> Result<(), AllocError> {
        let refused = |r: &Result<(), AllocError>| matches!(r, Err(AllocError::OutOfMemory { .. }));
        let first = self.grow(kind, len, stream, Step::Usual);
        if !refused(&first) {
            return first;
        }
        self.release_free(u64::MAX);
        let second = self.grow(kind, len, stream, Step::Usual);
        if !refused(&second) {
            return second;
        }
        self.grow(kind, len, stream, Step::NeedOnly)
    }

    /// Maps more memory into heap `kind` so that a block of `len` bytes fits for `stream`.
    fn grow(
        &mut self,
        kind: HeapKind,
        len: u64,
        stream: StreamId,
        step: Step,
    ) -> Result<(), AllocError> {
        let gran = self.config.granularity.get();
        let site =
            self.heaps
                .get(kind)
                .growth_site(len, gran, stream)
                .ok_or(AllocError::TooLarge {
                    requested: Bytes(len),
                    va: self.config.va_bytes,
                })?;
        let moves = self.handles_to_move(kind, &site, len);
        let moved: u64 = moves.iter().map(|m| m.len).sum();
        let missing = site.need.saturating_sub(moved);
        let room = site.gap.len - moved;
        let grants = if missing == 0 {
            Vec::new()
        } else {
            let floor = match (kind, step) {
                (_, Step::NeedOnly) | (HeapKind::Small, _) => gran,
                (HeapKind::Large, Step::Usual) => self.step(len),
            };
            self.grant(missing.max(floor).min(room), len)?
        };
        let mut pieces: Vec<Mapped> = moves
            .iter()
            .filter_map(|m| self.unmap_free(m.heap, m.va))
            .collect();
        pieces.extend(grants);
        self.map_at_site(kind, &site, pieces, len)
    }

    /// The wholly free handles that a growth at `site` for a block of `len` bytes moves there:
    /// none below the growth cap, where new memory is granted (the slack lets later blocks wrap
    /// around into old holes instead of every growth reusing handles). At the cap, the handles
    /// picked are moved (unmapped and mapped at the site, two driver calls each) when together
    /// they are at most twice a need of at least `MOVE_LEAST` granules, or are one handle of just
    /// the size needed or of the other heap: returned, the daemon would hand the same memory back
    /// for a request and an import per handle more. Otherwise they go back here (room under the
    /// tenant's limit too) and the growth grants its need as one request: a move brings a
    /// handle's whole size, which would lie free at the site, and a program that grows a granule
    /// or two at a time would move a handle at every growth while memory held stays at the cap,
    /// where giving back more than it needs leaves room under the cap.
    fn handles_to_move(&mut self, kind: HeapKind, site: &Site, len: u64) -> Vec<FreeHandle> {
        let gran = self.config.granularity.get();
        if self.stats.held.get() + site.need <= self.growth_cap(len) {
            return Vec::new();
        }
        let moves = self.pick_moves(kind, site);
        let picked: u64 = moves.iter().map(|m| m.len).sum();
        let move_them = matches!(moves.as_slice(), [m] if m.len == site.need || m.heap != kind)
            || (site.need >= MOVE_LEAST * gran && picked <= 2 * site.need);
        if move_them {
            return moves;
        }
        self.return_handles(&moves);
        Vec::new()
    }

    /// Maps `pieces` side by side into the gap of `site` (from its start, or up to its end when
    /// the region it extends starts there); when a map fails, the pieces not mapped are released
    /// and the growth for a block of `len` bytes fails.
    fn map_at_site(
        &mut self,
        kind: HeapKind,
        site: &Site,
        pieces: Vec<Mapped>,
        len: u64,
    ) -> Result<(), AllocError> {
        let total: u64 = pieces.iter().map(|m| m.len).sum();
        let mut va = if site.at_gap_end {
            site.gap.end() - total
        } else {
            site.gap.start
        };
        let mut pieces = pieces.into_iter();
        while let Some(m) = pieces.next() {
            if let Err(source) = self.backing.map(m.grant, va) {
                let unmapped: Vec<Mapped> = std::iter::once(m).chain(pieces).collect();
                let grants: Vec<GrantId> = unmapped.iter().map(|m| m.grant).collect();
                self.backing.release(&grants);
                for m in unmapped {
                    self.stats.on_return(m.len);
                }
                return Err(self.out_of_memory(len, source));
            }
            self.stats.on_map(m.len);
            self.heaps.get_mut(kind).place(va, m, site.owner, site.seq);
            va += m.len;
        }
        Ok(())
    }

    /// The least a growth of the large heap for a block of `len` adds: `min_grow`; while memory
    /// in use is at a new peak, twice the step of the growth before, up to the room left under
    /// the growth cap.
    fn step(&mut self, len: u64) -> u64 {
        let gran = self.config.granularity.get();
        let min = self.config.min_grow.get().next_multiple_of(gran);
        let new_peak = self.stats.allocated.get() + len > self.stats.allocated_peak.get();
        let room = self.growth_cap(len).saturating_sub(self.stats.held.get()) / gran * gran;
        self.climb.step = if new_peak {
            (self.climb.step * 2).max(gran).min(room)
        } else {
            0
        };
        self.climb.step.max(min)
    }

    /// Wholly free handles to reuse for the growth site instead of adding memory: the smallest
    /// one that covers the need, else the largest ones first.
    fn pick_moves(&self, kind: HeapKind, site: &Site) -> Vec<FreeHandle> {
        let gran = self.config.granularity.get();
        let room = site.gap.len;
        let mut candidates: Vec<FreeHandle> = Vec::new();
        // The small heap's last resort: the smallest wholly free handle of the large heap larger
        // than its need.
        let mut larger: Option<FreeHandle> = None;
        for (from, heap) in self.heaps.iter() {
            let skip = if from == kind {
                site.uses
            } else {
                [None, None]
            };
            for (va, len) in heap.free_handles(gran, skip) {
                let usable = match (kind, from) {
                    // The small heap takes only what it needs: what it holds serves small blocks
                    // only.
                    (HeapKind::Small, _) => len <= site.need,
                    // The large heap takes a small-heap handle only to move it, when it is just
                    // the size needed: given back to make room for a grant, each would cost a
                    // return of a granule or two, and the small heap, whose blocks keep coming,
                    // would grant them again one at a time.
                    (HeapKind::Large, HeapKind::Small) => len == site.need,
                    (HeapKind::Large, HeapKind::Large) => true,
                };
                let handle = FreeHandle {
                    heap: from,
                    va,
                    len,
                };
                if len <= room && usable {
                    candidates.push(handle);
                } else if len <= room
                    && (kind, from) == (HeapKind::Small, HeapKind::Large)
                    && larger.is_none_or(|l| len < l.len)
                {
                    larger = Some(handle);
                }
            }
        }
        // Nothing within its need anywhere: rather than grow past the cap a granule at a time
        // while the large heap's memory lies free in whole handles, the small heap moves in the
        // smallest of them. Once wholly free again, it goes back with the timed release, or to
        // the large heap when it is just the size a growth there needs.
        if candidates.is_empty() {
            return larger.into_iter().collect();
        }
        if let Some(&one) = candidates
            .iter()
            .filter(|c| c.len >= site.need)
            .min_by_key(|c| c.len)
        {
            return vec![one];
        }
        candidates.sort_by_key(|c| std::cmp::Reverse(c.len));
        let mut total = 0;
        let mut out = Vec::new();
        for c in candidates {
            if total >= site.need {
                break;
            }
            if total + c.len <= room {
                total += c.len;
                out.push(c);
            }
        }
        out
    }

    /// Grants `bytes` in one request, as the handles of [`split_grant`] with the largest handle
    /// the driver-time budget affords ([`budget::Clock::next_handle_size`]).
    fn grant(&mut self, bytes: u64, wanted: u64) -> Result<Vec<Mapped>, AllocError> {
        let gran = self.config.granularity.get();
        let peak = self.peak_in_use(wanted);
        let max = self.clock.next_handle_size(
            bytes,
            self.backing.cost(&self.stats.calls()),
            self.config.driver_budget,
            largest_handle(self.config.max_handle.get(), peak, gran),
            gran,
        );
        let sizes: Vec<Bytes> = split_grant(bytes, max, gran)
            .into_iter()
            .map(Bytes)
            .collect();
        let grants = self
            .backing
            .grant(&sizes)
            .map_err(|source| self.out_of_memory(wanted, source))?;
        assert_eq!(
            grants.len(),
            sizes.len(),
            "the backing granted another count"
        );
        self.stats.grant_requests += 1;
        Ok(grants
            .into_iter()
            .zip(sizes)
            .map(|(grant, len)| {
                self.stats.on_grant(len.get());
                Mapped {
                    grant,
                    len: len.get(),
                }
            })
            .collect())
    }

    pub(super) fn out_of_memory(&self, wanted: u64, source: Refused) -> AllocError {
        AllocError::OutOfMemory {
            requested: Bytes(wanted),
            held: self.stats.held,
            allocated: self.stats.allocated,
            source,
        }
    }
}

/// A handle is at most this share of the peak in use (see [`largest_handle`]).
const HANDLE_SHARE: u64 = 32;

/// The least need, in granules, for which a growth at the cap moves several free handles, or one
/// larger than the need, rather than giving them back (see `grow`).
const MOVE_LEAST: u64 = 4;

/// The largest handle for a program whose memory in use peaks at `peak`: `max_handle`, or for a
/// program under `HANDLE_SHARE` times it, the power of two at or above `peak / HANDLE_SHARE` (at
/// least a granule). A handle goes back only whole, so the free memory it strands beside a live
/// block is then a share of the program's own memory, the same for a small program as a large one.
fn largest_handle(max_handle: u64, peak: u64, gran: u64) -> u64 {
    let max = (max_handle / gran * gran).max(gran);
    (peak / HANDLE_SHARE).next_power_of_two().max(gran).min(max)
}

/// The handle sizes, in address order, that a grant of `bytes` (a multiple of the granularity
/// `gran`) is split into: one handle up to `max_handle`; above it, handles of a quarter of
/// `max_handle`, twice that, and so on from both ends toward the middle, and the middle in
/// handles of `max_handle` at most.
pub(super) fn split_grant(bytes: u64, max_handle: u64, gran: u64) -> Vec<u64> {
    let max = (max_handle / gran * gran).max(gran);
    let mut ends = Vec::new();
    let mut left = bytes;
    if bytes > max {
        let mut rung = (max / 4 / gran * gran).max(gran);
        while left >= 2 * rung && rung < max {
            ends.push(rung);
            left -= 2 * rung;
            rung = (rung * 2).min(max);
        }
    }
    let mut out = ends.clone();
    while left > 0 {
        out.push(left.min(max));
        left -= left.min(max);
    }
    out.extend(ends.iter().rev());
    out
}
