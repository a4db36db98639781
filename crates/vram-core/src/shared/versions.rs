//! Versions: drafts written by the lease holder, published atomically, pinned by readers, freed
//! when neither current nor pinned.

use std::collections::BTreeMap;

use super::{tenant, BufferId, Freed, SharedBuffers, SharedError, Version, VersionState};
use crate::broker::{Broker, TenantId};
use crate::Bytes;

impl SharedBuffers {
    /// Starts version `v+1` from `base` (the version the writer read, or `None` before the first
    /// publish): charges a version's memory to the owner and returns the draft's number. A draft
    /// begun earlier and not published is discarded.
    pub fn begin_write(
        &mut self,
        broker: &mut Broker,
        who: TenantId,
        id: BufferId,
        base: Option<Version>,
        now_ms: u64,
    ) -> Result<(Version, Vec<Freed>), SharedError> {
        self.expire_one(broker, id, now_ms);
        let mut freed = Vec::new();
        self.holder(broker, who, id)?;
        let b = self.buffers.get_mut(&id).expect("checked");
        if base != b.current {
            return Err(SharedError::StaleBase {
                buffer: b.name.clone(),
                base,
                current: b.current,
            });
        }
        broker
            .grant(b.owner, b.size)
            .map_err(|source| SharedError::Memory {
                buffer: b.name.clone(),
                source,
            })?;
        let v = Version(b.next_version);
        b.next_version += 1;
        b.versions.insert(
            v,
            VersionState {
                checksum: None,
                pins: BTreeMap::new(),
                corrupt: false,
            },
        );
        let lease = b.lease.as_mut().expect("checked");
        let old = lease.draft.replace(v);
        freed.extend(old.and_then(|o| self.free_if_unused(broker, id, o)));
        Ok((v, freed))
    }

    /// Checks that `version` is `who`'s draft of `id` and may be published now (before the daemon
    /// spends time checksumming it); [`SharedBuffers::publish`] checks again.
    pub fn check_draft(
        &self,
        broker: &Broker,
        who: TenantId,
        id: BufferId,
        version: Version,
        now_ms: u64,
    ) -> Result<Bytes, SharedError> {
        let b = self.live(id)?;
        let t = tenant(broker, who)?;
        let current = b.current;
        let lease = match &b.lease {
            Some(l) if l.holder == who && l.expires_ms > now_ms => l,
            _ => {
                return Err(SharedError::NoLease {
                    buffer: b.name.clone(),
                    tenant: t.name.clone(),
                    current,
                })
            }
        };
        if lease.draft != Some(version) {
            let stale = current.is_some_and(|c| c > version);
            return Err(if stale {
                SharedError::StaleBase {
                    buffer: b.name.clone(),
                    base: Some(Version(version.0.saturating_sub(1))),
                    current,
                }
            } else {
                SharedError::NoDraft {
                    buffer: b.name.clone(),
                    version,
                    draft: lease.draft,
                    current,
                }
            });
        }
        Ok(b.size)
    }

    /// Makes `who`'s draft `version` the current version, with the checksum the daemon computed.
    /// The previous current version is freed unless pinned. The writer keeps its lease.
    pub fn publish(
        &mut self,
        broker: &mut Broker,
        who: TenantId,
        id: BufferId,
        version: Version,
        checksum: u64,
        now_ms: u64,
    ) -> Result<Vec<Freed>, SharedError> {
        self.expire_one(broker, id, now_ms);
        let mut freed = Vec::new();
        self.check_draft(broker, who, id, version, now_ms)?;
        let b = self.buffers.get_mut(&id).expect("checked");
        b.lease.as_mut().expect("checked").draft = None;
        b.versions.get_mut(&version).expect("draft").checksum = Some(checksum);
        let old = b.current.replace(version);
        b.publishes += 1;
        freed.extend(old.and_then(|o| self.free_if_unused(broker, id, o)));
        Ok(freed)
    }

    /// Pins the current published version for `who`; returns it and its checksum. A version found
    /// corrupt is not pinned: its readers were told, and a reader coming later must be too.
    pub fn pin(
        &mut self,
        broker: &Broker,
        who: TenantId,
        id: BufferId,
    ) -> Result<(Version, u64), SharedError> {
        self.check(broker, who, id, "read")?;
        let b = self.buffers.get_mut(&id).expect("checked");
        let Some(v) = b.current else {
            return Err(SharedError::NothingPublished(b.name.clone()));
        };
        let s = b.versions.get_mut(&v).expect("current is held");
        if s.corrupt {
            return Err(SharedError::Corrupt {
                buffer: b.name.clone(),
                version: v,
            });
        }
        *s.pins.entry(who).or_default() += 1;
        Ok((v, s.checksum.expect("published")))
    }

    /// Drops one of `who`'s pins on `version`; the version goes if that was the last use of it.
    pub fn unpin(
        &mut self,
        broker: &mut Broker,
        who: TenantId,
        id: BufferId,
        version: Version,
    ) -> Result<Vec<Freed>, SharedError> {
        let b = self
            .buffers
            .get_mut(&id)
            .ok_or_else(|| SharedError::NoSuchBuffer(format!("#{}", id.0)))?;
        let not_pinned = || SharedError::NotPinned {
            buffer: b.name.clone(),
            version,
        };
        let s = b.versions.get_mut(&version).ok_or_else(not_pinned)?;
        let n = s.pins.get_mut(&who).ok_or_else(not_pinned)?;
        *n -= 1;
        if *n == 0 {
            s.pins.remove(&who);
        }
        Ok(self
            .free_if_unused(broker, id, version)
            .into_iter()
            .collect())
    }

    /// The checksum recorded at publish of a version still held (for verification).
    pub fn checksum_of(&self, id: BufferId, version: Version) -> Result<u64, SharedError> {
        let b = self
            .buffers
            .get(&id)
            .ok_or_else(|| SharedError::NoSuchBuffer(format!("#{}", id.0)))?;
        b.versions
            .get(&version)
            .and_then(|s| s.checksum)
            .ok_or_else(|| SharedError::NoSuchVersion {
                buffer: b.name.clone(),
                version,
            })
    }

    /// Takes back a draft whose memory could not be made; the writer keeps its lease.
    pub fn discard_draft(
        &mut self,
        broker: &mut Broker,
        who: TenantId,
        id: BufferId,
        version: Version,
    ) -> Vec<Freed> {
        let Some(lease) = self.buffers.get_mut(&id).and_then(|b| b.lease.as_mut()) else {
            return Vec::new();
        };
        if lease.holder != who || lease.draft != Some(version) {
            return Vec::new();
        }
        lease.draft = None;
        self.free_if_unused(broker, id, version)
            .into_iter()
            .collect()
    }

    pub(super) fn free_if_unused(
        &mut self,
        broker: &mut Broker,
        id: BufferId,
        v: Version,
    ) -> Option<Freed> {
        let b = self.buffers.get_mut(&id)?;
        if !b.versions.contains_key(&v) || !b.unused(v) {
            return None;
        }
        b.versions.remove(&v);
        broker.release(b.owner, b.size);
        if b.deleted && b.versions.is_empty() {
            self.buffers.remove(&id);
        }
        Some(Freed {
            buffer: id,
            version: v,
        })
    }
}
