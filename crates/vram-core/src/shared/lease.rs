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
        self.expire_one(broker, id, now_ms);
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
            Vec::new(),
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
        self.expire_one(broker, id, now_ms);
        self.holder(broker, who, id)?;
        self.acquire(broker, who, id, ttl_ms, now_ms)
    }

    /// Gives the lease up; an unpublished draft is discarded.
    pub fn release_lease(
        &mut self,
        broker: &mut Broker,
        who: TenantId,
        id: BufferId,
        now_ms: u64,
    ) -> Result<Vec<Freed>, SharedError> {
        self.expire_one(broker, id, now_ms);
        self.holder(broker, who, id)?;
        let b = self.buffers.get_mut(&id).expect("checked");
        let draft = b.lease.take().and_then(|l| l.draft);
        Ok(draft
            .and_then(|v| self.free_if_unused(broker, id, v))
            .into_iter()
            .collect())
    }

    /// Takes every lease that ran out by `now_ms` away; their drafts are discarded. Returns
    /// every version freed by an expiry so far ([`SharedBuffers::take_expired`]).
    pub fn expire(&mut self, broker: &mut Broker, now_ms: u64) -> Vec<Freed> {
        let ids: Vec<BufferId> = self.buffers.keys().copied().collect();
        for id in ids {
            self.expire_one(broker, id, now_ms);
        }
        self.take_expired()
    }

    /// The versions freed when leases were found expired, since the last call: their memory is
    /// the caller's to let go, as with any other [`Freed`].
    pub fn take_expired(&mut self) -> Vec<Freed> {
        std::mem::take(&mut self.expired)
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

    /// Takes the lease of `id` away if it ran out by `now_ms`; its draft, discarded, goes to
    /// [`SharedBuffers::take_expired`].
    pub(super) fn expire_one(&mut self, broker: &mut Broker, id: BufferId, now_ms: u64) {
        let Some(b) = self.buffers.get_mut(&id) else {
            return;
        };
        if b.lease.as_ref().is_none_or(|l| l.expires_ms > now_ms) {
            return;
        }
        let draft = b.lease.take().and_then(|l| l.draft);
        self.leases_expired += 1;
        let freed = draft.and_then(|v| self.free_if_unused(broker, id, v));
        self.expired.extend(freed);
    }
}
