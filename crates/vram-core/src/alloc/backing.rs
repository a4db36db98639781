//! Where physical memory comes from: the [`Backing`] trait, and [`ModelBacking`], a checking and
//! counting implementation for tests and trace replay.

use std::collections::{BTreeMap, HashMap};

use crate::replay::CostModel;
use crate::Bytes;

/// One physical handle granted by the daemon (its size a multiple of the granularity).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GrantId(pub u64);

/// The backing could not provide memory (the daemon refused, or mapping failed).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{bytes} could not be granted or mapped: {reason}")]
pub struct Refused {
    pub bytes: Bytes,
    pub reason: String,
}

/// Physical memory for the allocator. Offsets are relative to the one virtual reservation of
/// `AllocConfig::va_bytes` that the implementation made. A handle is mapped whole, at one offset,
/// at most once at a time; the allocator never asks otherwise.
pub trait Backing {
    /// New handles of exactly these sizes (multiples of the granularity), in one request to the
    /// daemon: all of them, in order, or none (`Refused` with nothing held).
    fn grant(&mut self, sizes: &[Bytes]) -> Result<Vec<GrantId>, Refused>;
    /// Maps the whole handle at `va` (granularity-aligned) with read-write access.
    fn map(&mut self, grant: GrantId, va: u64) -> Result<(), Refused>;
    /// Unmaps the handle, which is mapped at `va`. False when that failed: the handle then stays
    /// mapped there, is never given back, and its range is never mapped again.
    fn unmap(&mut self, grant: GrantId, va: u64) -> bool;
    /// Gives the (unmapped) handles back to the daemon, in one request.
    fn release(&mut self, grants: &[GrantId]);
    /// What the calls have cost so far and what they cost each ([`CallCost`]), given the
    /// allocator's counts of the calls it made here, or `None` when the backing cannot tell yet;
    /// the allocator weighs it against its driver-time budget.
    fn cost(&self, calls: &BackingCounts) -> Option<CallCost>;
}

/// A backing's calls in time: measured on a device, or priced by a cost model in a replay.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CallCost {
    /// Microseconds spent in the backing's calls so far.
    pub spent_us: f64,
    /// One grant request, whatever it brings.
    pub request_us: f64,
    /// One handle over its life: granted, mapped, unmapped and given back.
    pub handle_us: f64,
}

/// Counts of the calls a backing received.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct BackingCounts {
    /// Handles granted.
    pub grants: u64,
    /// Requests that granted them (one per growth: a daemon round trip each).
    pub grant_requests: u64,
    pub maps: u64,
    pub unmaps: u64,
    pub releases: u64,
    pub granted_bytes: u64,
    pub mapped_bytes: u64,
}

impl BackingCounts {
    /// The calls made since `earlier`, a reading of the same backing.
    pub fn since(&self, earlier: &BackingCounts) -> BackingCounts {
        BackingCounts {
            grants: self.grants - earlier.grants,
            grant_requests: self.grant_requests - earlier.grant_requests,
            maps: self.maps - earlier.maps,
            unmaps: self.unmaps - earlier.unmaps,
            releases: self.releases - earlier.releases,
            granted_bytes: self.granted_bytes - earlier.granted_bytes,
            mapped_bytes: self.mapped_bytes - earlier.mapped_bytes,
        }
    }
}

/// A backing with no memory behind it that checks the allocator's use of it (panics on a misuse),
/// counts calls, and can refuse grants beyond a capacity.
#[derive(Debug, Default)]
pub struct ModelBacking {
    capacity: Option<u64>,
    next: u64,
    grants: HashMap<GrantId, (u64, Option<u64>)>,
    mappings: BTreeMap<u64, (u64, GrantId)>,
    held: u64,
    peak_held: u64,
    counts: BackingCounts,
    pricing: Option<CostModel>,
    /// Addresses whose unmap fails (a failing driver, in tests).
    failing_unmaps: Vec<u64>,
}

impl ModelBacking {
    /// A backing whose calls cost nothing: [`Backing::cost`] is `None`.
    pub fn new() -> Self {
        Self::default()
    }

    /// A backing whose calls are priced by `costs` (what a replay's allocator is given).
    pub fn priced(costs: CostModel) -> Self {
        Self {
            pricing: Some(costs),
            ..Self::default()
        }
    }

    /// A backing that refuses grants that would take it past `capacity`.
    pub fn with_capacity(capacity: Bytes) -> Self {
        Self {
            capacity: Some(capacity.get()),
            ..Self::default()
        }
    }

    pub fn counts(&self) -> BackingCounts {
        self.counts
    }

    /// Makes the unmap of whatever is mapped at `va` fail from now on, as a failing driver's
    /// would: the handle stays mapped.
    pub fn fail_unmaps_at(&mut self, va: u64) {
        self.failing_unmaps.push(va);
    }

    /// Bytes granted and not yet released.
    pub fn held(&self) -> Bytes {
        Bytes(self.held)
    }

    pub fn peak_held(&self) -> Bytes {
        Bytes(self.peak_held)
    }

    /// Handles granted and not yet released.
    pub fn outstanding(&self) -> usize {
        self.grants.len()
    }

    /// Whether every byte of `[va, va + len)` is mapped.
    pub fn is_mapped(&self, va: u64, len: u64) -> bool {
        let mut at = va;
        let end = va + len;
        while at < end {
            match self.mappings.range(..=at).next_back() {
                Some((&s, &(l, _))) if at < s + l => at = s + l,
                _ => return false,
            }
        }
        true
    }
}

impl Backing for ModelBacking {
    fn grant(&mut self, sizes: &[Bytes]) -> Result<Vec<GrantId>, Refused> {
        let total: u64 = sizes.iter().map(|b| b.get()).sum();
        if let Some(cap) = self.capacity {
            if self.held + total > cap {
                return Err(Refused {
                    bytes: Bytes(total),
                    reason: format!("{} of {} held", Bytes(self.held), Bytes(cap)),
                });
            }
        }
        self.counts.grant_requests += 1;
        let ids = sizes
            .iter()
            .map(|&bytes| {
                self.next += 1;
                let id = GrantId(self.next);
                self.grants.insert(id, (bytes.get(), None));
                self.counts.grants += 1;
                self.counts.granted_bytes += bytes.get();
                id
            })
            .collect();
        self.held += total;
        self.peak_held = self.peak_held.max(self.held);
        Ok(ids)
    }

    fn map(&mut self, grant: GrantId, va: u64) -> Result<(), Refused> {
        let (len, at) = self
            .grants
            .get_mut(&grant)
            .expect("mapping an unknown grant");
        assert!(at.is_none(), "grant {grant:?} mapped twice");
        let len = *len;
        if let Some((&s, &(l, _))) = self.mappings.range(..va + len).next_back() {
            assert!(s + l <= va, "mapping at {va:#x} overlaps another");
        }
        *at = Some(va);
        self.mappings.insert(va, (len, grant));
        self.counts.maps += 1;
        self.counts.mapped_bytes += len;
        Ok(())
    }

    fn unmap(&mut self, grant: GrantId, va: u64) -> bool {
        if self.failing_unmaps.contains(&va) {
            return false;
        }
        let (_, at) = self
            .grants
            .get_mut(&grant)
            .expect("unmapping an unknown grant");
        assert_eq!(*at, Some(va), "unmapping {grant:?} where it is not mapped");
        *at = None;
        self.mappings.remove(&va);
        self.counts.unmaps += 1;
        true
    }

    fn release(&mut self, grants: &[GrantId]) {
        for grant in grants {
            let (len, at) = self
                .grants
                .remove(grant)
                .expect("releasing an unknown grant");
            assert!(at.is_none(), "releasing {grant:?} while mapped");
            self.held -= len;
            self.counts.releases += 1;
        }
    }

    fn cost(&self, calls: &BackingCounts) -> Option<CallCost> {
        self.pricing.map(|m| m.call_cost(calls))
    }
}
