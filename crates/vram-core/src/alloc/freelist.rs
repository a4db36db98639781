//! Free regions of mapped memory, coalesced, indexed by address and by (owner, size) for best fit.
//!
//! Invariants: regions never overlap; two adjacent regions never share an owner (they would have
//! been merged), except where one of them was freed during a graph capture and the other not; a
//! region owned by a stream carries the sequence number of its latest free on that stream, so it
//! becomes usable by every stream once that stream's fence for the sequence completes (never, for
//! `Seq::MAX`). A region freed by a stream takes in the neighbours every stream may use (see
//! `insert`), unless it was freed during a capture.

use std::collections::{BTreeMap, BTreeSet};

use super::stream::{Seq, StreamId};

/// Who may allocate from a free region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Owner {
    /// Every stream: the work that used it has completed.
    Any,
    /// Only this stream, until its fence for the region's sequence completes.
    Stream(StreamId),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Region {
    pub len: u64,
    pub owner: Owner,
    pub seq: Seq,
}

/// The index holds one entry per region, whatever the number of frees: a program that frees on
/// one stream and records no fence for a long time (the allocator fences such a program's frees
/// only when it needs them) keeps its free memory in a few stream-owned regions, not in a record
/// of every free.
#[derive(Debug, Default)]
pub(crate) struct FreeList {
    by_addr: BTreeMap<u64, Region>,
    by_size: BTreeSet<(Owner, u64, u64)>,
}

impl FreeList {
    pub(crate) fn get(&self, start: u64) -> Option<Region> {
        self.by_addr.get(&start).copied()
    }

    /// The region containing `addr`, as `(start, region)`.
    pub(crate) fn containing(&self, addr: u64) -> Option<(u64, Region)> {
        let (&s, &r) = self.by_addr.range(..=addr).next_back()?;
        (addr < s + r.len).then_some((s, r))
    }

    /// Free bytes in `[start, end)`.
    pub(crate) fn bytes_within(&self, start: u64, end: u64) -> u64 {
        let first = self.containing(start).map_or(start, |(s, _)| s);
        self.by_addr
            .range(first..end)
            .map(|(&s, r)| (s + r.len).min(end) - s.max(start))
            .sum()
    }

    /// The region that ends exactly at `addr`.
    pub(crate) fn ending_at(&self, addr: u64) -> Option<(u64, Region)> {
        let (&s, &r) = self.by_addr.range(..addr).next_back()?;
        (s + r.len == addr).then_some((s, r))
    }

    /// Regions owned by every stream with at least `min_len` bytes, as `(start, len)`.
    pub(crate) fn any_at_least(&self, min_len: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.by_size
            .range((Owner::Any, min_len, 0)..(Owner::Any, u64::MAX, u64::MAX))
            .map(|&(_, len, start)| (start, len))
    }

    /// Whether `stream` owns free regions that one of its fences would give every stream (not
    /// those freed during a capture, which no fence releases).
    pub(crate) fn fenced(&self, stream: StreamId) -> bool {
        self.starts_of(stream)
            .any(|start| self.by_addr[&start].seq != Seq::MAX)
    }

    /// Start of the smallest region of at least `len` bytes that `stream` may use.
    pub(crate) fn best_fit(&self, len: u64, stream: StreamId) -> Option<u64> {
        let first = |owner| {
            self.by_size
                .range((owner, len, 0)..=(owner, u64::MAX, u64::MAX))
                .next()
                .map(|&(_, l, s)| (l, s))
        };
        match (first(Owner::Any), first(Owner::Stream(stream))) {
            (Some(a), Some(b)) => Some(a.min(b).1),
            (a, b) => a.or(b).map(|(_, s)| s),
        }
    }

    /// Adds `[start, start + len)` and merges it with neighbours of the same owner. A region of a
    /// stream also takes in neighbours every stream may use: they become that stream's until its
    /// fence completes (only a restriction, so safe), and a program on one stream sees its free
    /// memory in one piece instead of split where fenced and unfenced frees meet.
    pub(crate) fn insert(&mut self, mut start: u64, mut len: u64, owner: Owner, mut seq: Seq) {
        debug_assert!(len > 0);
        // Memory freed during a graph capture (sequence `Seq::MAX`: no fence ever releases it)
        // stays apart from memory that a fence will release.
        let never = seq == Seq::MAX;
        let joins = |other: Region| {
            (other.owner == owner && (other.seq == Seq::MAX) == never)
                || (other.owner == Owner::Any && !never)
        };
        if let Some((ls, l)) = self.ending_at(start) {
            if joins(l) {
                self.unlink(ls);
                start = ls;
                len += l.len;
                seq = seq.max(l.seq);
            }
        }
        if let Some(r) = self.get(start + len) {
            if joins(r) {
                self.unlink(start + len);
                len += r.len;
                seq = seq.max(r.seq);
            }
        }
        self.link(start, Region { len, owner, seq });
    }

    /// Removes `[start, start + len)`, which must lie inside one region; the rest stays free.
    pub(crate) fn take(&mut self, start: u64, len: u64) {
        let (rs, r) = self
            .containing(start)
            .expect("taking a range that is not free");
        assert!(
            start + len <= rs + r.len,
            "taking past the end of a free region"
        );
        self.unlink(rs);
        if start > rs {
            self.link(
                rs,
                Region {
                    len: start - rs,
                    ..r
                },
            );
        }
        if start + len < rs + r.len {
            let len_after = rs + r.len - (start + len);
            self.link(
                start + len,
                Region {
                    len: len_after,
                    ..r
                },
            );
        }
    }

    /// Makes every region that `stream` freed up to `seq` usable by all streams. It looks through
    /// the regions the stream owns, which are few: a region becomes every stream's once a fence
    /// covering it completes, and a stream's neighbouring regions merge.
    pub(crate) fn complete(&mut self, stream: StreamId, seq: Seq) {
        let done: Vec<(u64, Region)> = self
            .starts_of(stream)
            .map(|start| (start, self.by_addr[&start]))
            .filter(|(_, r)| r.seq <= seq)
            .collect();
        // Each becomes `Any` and joins the `Any` regions beside it, whichever comes first.
        for (start, r) in done {
            self.unlink(start);
            self.insert(start, r.len, Owner::Any, 0);
        }
    }

    /// Makes every region that `stream` holds for good (sequence `Seq::MAX`: freed during a
    /// capture, or into a private pool) usable by all streams. The caller knows that no work
    /// queued so far can use them any more.
    pub(crate) fn release_never(&mut self, stream: StreamId) {
        let starts: Vec<u64> = self
            .starts_of(stream)
            .filter(|start| self.by_addr[start].seq == Seq::MAX)
            .collect();
        // Each becomes `Any` and merges with `Any` neighbours only: the stream's other regions
        // keep their starts until their turn.
        for start in starts {
            let r = self.by_addr[&start];
            self.unlink(start);
            self.insert(start, r.len, Owner::Any, 0);
        }
    }

    /// Gives every region of stream `from` to stream `to`, which owns none, with its sequence
    /// number: what `from` could reuse at once, or once its fences complete, is `to`'s now.
    pub(crate) fn rename(&mut self, from: StreamId, to: StreamId) {
        let starts: Vec<u64> = self.starts_of(from).collect();
        for start in starts {
            let r = self.by_addr[&start];
            self.unlink(start);
            self.link(
                start,
                Region {
                    owner: Owner::Stream(to),
                    ..r
                },
            );
        }
    }

    /// The starts of the regions `stream` owns.
    fn starts_of(&self, stream: StreamId) -> impl Iterator<Item = u64> + '_ {
        let owner = Owner::Stream(stream);
        self.by_size
            .range((owner, 0, 0)..=(owner, u64::MAX, u64::MAX))
            .map(|&(_, _, start)| start)
    }

    fn link(&mut self, start: u64, r: Region) {
        self.by_addr.insert(start, r);
        self.by_size.insert((r.owner, r.len, start));
    }

    fn unlink(&mut self, start: u64) {
        let r = self
            .by_addr
            .remove(&start)
            .expect("unlinking a missing region");
        self.by_size.remove(&(r.owner, r.len, start));
    }
}
