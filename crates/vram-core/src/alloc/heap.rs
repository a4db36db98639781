//! One heap: a range of the reservation into which handles are mapped side by side ("stitching"),
//! the handles mapped there, the unmapped gaps, and the free regions of mapped memory.
//!
//! Invariants: handles never overlap and lie inside the heap; every byte of the heap is in exactly
//! one of a handle, a gap, or a range set aside (a handle whose unmap failed stays mapped there);
//! free regions lie in mapped memory, so a free region's neighbours by address are mapped too, and
//! merging them (across handles that were never adjacent before) is sound.

use std::collections::BTreeMap;

use super::backing::GrantId;
use super::freelist::{FreeList, Owner, Region};
use super::stream::{Seq, StreamId};

#[derive(Clone, Copy, Debug)]
pub(crate) struct Mapped {
    pub grant: GrantId,
    pub len: u64,
}

/// Where new memory goes so that a block of the wanted size fits.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Site {
    /// The free regions the new memory extends (their starts): none, one, or the two that a
    /// filled gap joins.
    pub uses: [Option<u64>; 2],
    /// Bytes of new mapped memory needed, a multiple of the granularity.
    pub need: u64,
    /// The gap the new memory goes in, and whether it is placed at the gap's start (growing a
    /// region that ends there) or its end (growing a region that starts there).
    pub gap: Gap,
    pub at_gap_end: bool,
    pub owner: Owner,
    pub seq: Seq,
}

/// An unmapped range of a heap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Gap {
    pub start: u64,
    pub len: u64,
}

impl Gap {
    pub(crate) fn end(&self) -> u64 {
        self.start + self.len
    }
}

#[derive(Debug)]
pub(crate) struct Heap {
    range: std::ops::Range<u64>,
    pub handles: BTreeMap<u64, Mapped>,
    gaps: BTreeMap<u64, u64>,
    pub free: FreeList,
    pub mapped: u64,
}

impl Heap {
    pub(crate) fn new(start: u64, end: u64) -> Self {
        Self {
            range: start..end,
            handles: BTreeMap::new(),
            gaps: BTreeMap::from([(start, end - start)]),
            free: FreeList::default(),
            mapped: 0,
        }
    }

    pub(crate) fn range(&self) -> std::ops::Range<u64> {
        self.range.clone()
    }

    /// Chooses where to map memory so that a block of `len` bytes fits for `stream`: the site that
    /// needs the least new memory among extending a usable free region that borders a gap, filling
    /// a gap whole so that the usable free regions on both sides of it join, and (when neither
    /// fits) the lowest gap large enough.
    pub(crate) fn growth_site(&self, len: u64, gran: u64, stream: StreamId) -> Option<Site> {
        let usable = |o: Owner| o == Owner::Any || o == Owner::Stream(stream);
        // Regions freed during a capture never merge with others (see `FreeList::insert`).
        let joinable = |r: &Region| usable(r.owner) && r.seq != Seq::MAX;
        let round = |n: u64| n.div_ceil(gran) * gran;
        let mut best: Option<Site> = None;
        let mut consider = |site: Site| {
            if best.is_none_or(|b| site.need < b.need) {
                best = Some(site);
            }
        };
        for (&g, &glen) in &self.gaps {
            let left = self.free.ending_at(g);
            let right = self.free.get(g + glen).map(|r| (g + glen, r));
            for ((start, r), at_gap_end) in left
                .map(|l| (l, false))
                .into_iter()
                .chain(right.map(|r| (r, true)))
            {
                let need = round(len.saturating_sub(r.len));
                if !usable(r.owner) || need > glen {
                    continue;
                }
                consider(Site {
                    uses: [Some(start), None],
                    need,
                    gap: Gap {
                        start: g,
                        len: glen,
                    },
                    at_gap_end,
                    owner: r.owner,
                    seq: r.seq,
                });
            }
            if let (Some((ls, l)), Some((rs, r))) = (left, right) {
                if joinable(&l) && joinable(&r) && l.len + glen + r.len >= len {
                    let owner = if l.owner == Owner::Any {
                        r.owner
                    } else {
                        l.owner
                    };
                    consider(Site {
                        uses: [Some(ls), Some(rs)],
                        need: glen,
                        gap: Gap {
                            start: g,
                            len: glen,
                        },
                        at_gap_end: false,
                        owner,
                        seq: l.seq.max(r.seq),
                    });
                }
            }
        }
        best.or_else(|| {
            let need = round(len);
            let (&g, &glen) = self.gaps.iter().find(|(_, &l)| l >= need)?;
            Some(Site {
                uses: [None, None],
                need,
                gap: Gap {
                    start: g,
                    len: glen,
                },
                at_gap_end: false,
                owner: Owner::Any,
                seq: 0,
            })
        })
    }

    /// Maps `m` at `va` (inside a gap) and adds its bytes to the free regions.
    pub(crate) fn place(&mut self, va: u64, m: Mapped, owner: Owner, seq: Seq) {
        self.take_gap(va, m.len);
        self.handles.insert(va, m);
        self.mapped += m.len;
        self.free.insert(va, m.len, owner, seq);
    }

    /// Takes the handle at `va`, which must be wholly free, out of the heap; its range becomes a
    /// gap.
    pub(crate) fn remove(&mut self, va: u64) -> Mapped {
        let m = self
            .handles
            .remove(&va)
            .expect("removing an unknown handle");
        self.free.take(va, m.len);
        self.mapped -= m.len;
        let (mut start, mut len) = (va, m.len);
        if let Some((&g, &glen)) = self.gaps.range(..va).next_back() {
            if g + glen == va {
                self.gaps.remove(&g);
                start = g;
                len += glen;
            }
        }
        if let Some(glen) = self.gaps.remove(&(va + m.len)) {
            len += glen;
        }
        self.gaps.insert(start, len);
        m
    }

    /// Takes `[va, va + len)`, which lies in a gap, out of the gaps for good: a handle whose unmap
    /// failed stays mapped there.
    pub(crate) fn set_aside(&mut self, va: u64, len: u64) {
        self.take_gap(va, len);
    }

    /// Takes `[va, va + len)` out of the gap it lies in.
    fn take_gap(&mut self, va: u64, len: u64) {
        let (&g, &glen) = self
            .gaps
            .range(..=va)
            .next_back()
            .expect("taking a range outside a gap");
        assert!(
            va + len <= g + glen,
            "taking a range across a mapped handle"
        );
        self.gaps.remove(&g);
        if va > g {
            self.gaps.insert(g, va - g);
        }
        if va + len < g + glen {
            self.gaps.insert(va + len, g + glen - (va + len));
        }
    }

    /// Free bytes in handles that hold no live block, and in handles that also hold one.
    pub(crate) fn free_by_handle(&self) -> (u64, u64) {
        let (mut whole, mut partly) = (0, 0);
        for (&va, m) in &self.handles {
            match self.free.bytes_within(va, va + m.len) {
                f if f == m.len => whole += f,
                f => partly += f,
            }
        }
        (whole, partly)
    }

    /// Handles lying wholly inside a free region that every stream may use, except the regions
    /// that start at `skip`, as `(va, len)`.
    pub(crate) fn free_handles(&self, gran: u64, skip: [Option<u64>; 2]) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        for (start, len) in self.free.any_at_least(gran) {
            if skip.contains(&Some(start)) {
                continue;
            }
            for (&va, m) in self.handles.range(start..start + len) {
                if va + m.len <= start + len {
                    out.push((va, m.len));
                }
            }
        }
        out
    }
}
