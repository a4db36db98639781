//! The writer lease: one writer at a time, with a time-to-live its client renews.

use super::{tenant, BufferId, Freed, Lease, LeaseInfo, SharedBuffers, SharedError};
use crate::broker::{Broker, TenantId};

impl SharedBuffers {
    /// Takes the writer lease for `ttl_ms`, or renews it if `who` holds it already.
    pub fn acquire(
        &mut self,
        broker: &mut Broker,
        who: TenantId,
        id: BufferId,
        ttl_ms: u64,
        now_ms: u64,
    ) -> Result<(LeaseInfo, Vec<Freed>), SharedError> {
        let freed = self.expire_one(broker, id, now_ms);
        self.check(broker, who, id, "write")?;
        let name = tenant(broker, who)?.name.clone();
        let b = self.buffers.get_mut(&id).expect("checked");
        match &mut b.lease {
            Some(l) if l.holder == who => l.expires_ms = now_ms.saturating_add(ttl_ms),
            Some(l) => {
                return Err(SharedError::LeaseHeld {
                    buffer: b.name.clone(),
                    holder: l.holder_name.clone(),
                    expires_in_ms: l.expires_ms.saturating_sub(now_ms),
                    current: b.current,
                })
            }
            None => {
                b.lease = Some(Lease {
                    holder: who,
                    holder_name: name.clone(),
                    expires_ms: now_ms.saturating_add(ttl_ms),
                    draft: None,
                })
            }
        }
        let expires_ms = b.lease.as_ref().expect("just set").expires_ms;
        Ok((
            LeaseInfo {
                holder: name,
                expires_ms,
            },
            freed,
        ))
    }

    /// Extends a lease `who` still holds. A lease that ran out is lost, not renewed.
    pub fn renew(
        &mut self,
        broker: &mut Broker,
        who: TenantId,
        id: BufferId,
        ttl_ms: u64,
        now_ms: u64,
    ) -> Result<(LeaseInfo, Vec<Freed>), SharedError> {
        let freed = self.expire_one(broker, id, now_ms);
        self.holder(broker, who, id)?;
        self.acquire(broker, who, id, ttl_ms, now_ms)
            .map(|(l, more)| (l, freed.into_iter().chain(more).collect()))
    }

    /// Gives the lease up; an unpublished draft is discarded.
    pub fn release_lease(
        &mut self,
        broker: &mut Broker,
        who: TenantId,
        id: BufferId,
        now_ms: u64,
    ) -> Result<Vec<Freed>, SharedError> {
        let mut freed = self.expire_one(broker, id, now_ms);
        self.holder(broker, who, id)?;
        let b = self.buffers.get_mut(&id).expect("checked");
        let draft = b.lease.take().and_then(|l| l.draft);
        freed.extend(draft.and_then(|v| self.free_if_unused(broker, id, v)));
        Ok(freed)
    }

    /// Takes every lease that ran out by `now_ms` away; their drafts are discarded.
    pub fn expire(&mut self, broker: &mut Broker, now_ms: u64) -> Vec<Freed> {
        let ids: Vec<BufferId> = self.buffers.keys().copied().collect();
        ids.into_iter()
            .flat_map(|id| self.expire_one(broker, id, now_ms))
            .collect()
    }

    /// Checks that `who` holds the (unexpired: call `expire_one` first) lease of `id`.
    pub(super) fn holder(
        &self,
        broker: &Broker,
        who: TenantId,
        id: BufferId,
    ) -> Result<(), SharedError> {
        let b = self.live(id)?;
        match &b.lease {
            Some(l) if l.holder == who => Ok(()),
            _ => Err(SharedError::NoLease {
                buffer: b.name.clone(),
                tenant: tenant(broker, who)?.name.clone(),
                current: b.current,
            }),
        }
    }

    pub(super) fn expire_one(
        &mut self,
        broker: &mut Broker,
        id: BufferId,
        now_ms: u64,
    ) -> Vec<Freed> {
        let Some(b) = self.buffers.get_mut(&id) else {
            return Vec::new();
        };
        if b.lease.as_ref().is_none_or(|l| l.expires_ms > now_ms) {
            return Vec::new();
        }
        let draft = b.lease.take().and_then(|l| l.draft);
        self.leases_expired += 1;
        draft
            .and_then(|v| self.free_if_unused(broker, id, v))
            .into_iter()
            .collect()
    }
}
