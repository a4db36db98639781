//! Free regions of mapped memory, coalesced, indexed by address and by (owner, size) for best fit.
//!
//! Invariants: regions never overlap; two adjacent regions never share an owner (they would have
//! been merged), except where one of them was freed during a graph capture and the other not; a
//! region owned by a stream carries the sequence number of its latest free on that stream, so it
//! becomes usable by every stream once that stream's fence for the sequence completes (never, for
//! `Seq::MAX`). A region freed by a stream takes in the neighbours every stream may use (see
//! `insert`), unless it was freed during a capture.

use std::collections::{BTreeMap, BTreeSet};

use rustc_hash::FxHashMap;

use super::stream::{Seq, StreamId};

/// Who may allocate from a free region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
///
/// By size, each owner's regions are a set of their own, keyed by [`size_key`]: a best fit looks
/// through every stream's set and its own stream's, and a stream that owns no region has no set.
#[derive(Debug, Default)]
pub(crate) struct FreeList {
    by_addr: BTreeMap<u64, Region>,
    any: BTreeSet<u128>,
    streams: FxHashMap<StreamId, BTreeSet<u128>>,
}

/// A region's key in the by-size sets: ordered by length, then start (one integer compares faster
/// than a tuple, on every lookup of the allocation path).
fn size_key(len: u64, start: u64) -> u128 {
    (u128::from(len) << 64) | u128::from(start)
}

/// `(len, start)` of a [`size_key`].
fn from_key(key: u128) -> (u64, u64) {
    ((key >> 64) as u64, key as u64)
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
        self.any.range(size_key(min_len, 0)..).map(|&k| {
            let (len, start) = from_key(k);
            (start, len)
        })
    }

    /// Whether `stream` owns free regions that one of its fences would give every stream (not
    /// those freed during a capture, which no fence releases).
    pub(crate) fn fenced(&self, stream: StreamId) -> bool {
        self.starts_of(stream)
            .any(|start| self.by_addr[&start].seq != Seq::MAX)
    }

    /// Start of the smallest region of at least `len` bytes that `stream` may use.
    pub(crate) fn best_fit(&self, len: u64, stream: StreamId) -> Option<u64> {
        let first = |set: &BTreeSet<u128>| set.range(size_key(len, 0)..).next().copied();
        let any = first(&self.any);
        let own = self.streams.get(&stream).and_then(first);
        // The smaller key: the shorter region, the lower start among equals.
        any.into_iter().chain(own).min().map(|k| from_key(k).1)
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
        self.streams
            .get(&stream)
            .into_iter()
            .flatten()
            .map(|&k| from_key(k).1)
    }

    /// Checks that the by-size sets hold exactly the regions by address, each under its owner,
    /// that no stream keeps an empty set, and that no two regions overlap.
    #[cfg(test)]
    pub(crate) fn check(&self) {
        let mut end = 0;
        for (&start, r) in &self.by_addr {
            assert!(
                start >= end,
                "free region at {start:#x} overlaps the one before"
            );
            end = start + r.len;
            let set = match r.owner {
                Owner::Any => &self.any,
                Owner::Stream(s) => &self.streams[&s],
            };
            assert!(
                set.contains(&size_key(r.len, start)),
                "{start:#x} {r:?} not by size"
            );
        }
        assert!(
            self.streams.values().all(|set| !set.is_empty()),
            "a stream's set is empty"
        );
        let by_size = self.any.len() + self.streams.values().map(BTreeSet::len).sum::<usize>();
        assert_eq!(
            by_size,
            self.by_addr.len(),
            "by-size entries without a region"
        );
    }

    fn link(&mut self, start: u64, r: Region) {
        self.by_addr.insert(start, r);
        let key = size_key(r.len, start);
        match r.owner {
            Owner::Any => self.any.insert(key),
            Owner::Stream(s) => self.streams.entry(s).or_default().insert(key),
        };
    }

    fn unlink(&mut self, start: u64) {
        let r = self
            .by_addr
            .remove(&start)
            .expect("unlinking a missing region");
        let key = size_key(r.len, start);
        match r.owner {
            Owner::Any => {
                self.any.remove(&key);
            }
            Owner::Stream(s) => {
                let set = self
                    .streams
                    .get_mut(&s)
                    .expect("a stream's region without its set");
                set.remove(&key);
                if set.is_empty() {
                    self.streams.remove(&s);
                }
            }
        }
    }
}
