//! The slot's books under events that interleave with a waiting grant.

use std::cell::Cell;
use std::sync::Arc;
use std::time::Duration;

use vram_core::broker::{Policy, TenantId, TenantRequest};
use vram_core::Bytes;
use vram_device::{Device, HostDevice};
use vram_proto::GrantId;

use super::pool::Pool;
use super::slot::{ReclaimSender, Slot};
use crate::config::PoolConfig;

fn slot(capacity: Bytes) -> Slot {
    let dev: Arc<dyn Device> = Arc::new(HostDevice::new(capacity, Bytes::mib(2)).unwrap());
    let pool = Pool::new(
        dev.clone(),
        PoolConfig {
            max: Bytes::ZERO,
            sizes: vec![Bytes::mib(2)],
            initial: 0,
        },
    );
    Slot::new(0, dev, Policy::with_capacity(capacity), pool).unwrap()
}

fn uid() -> u32 {
    rustix::process::getuid().as_raw()
}

fn connect(slot: &Slot, name: &str, conn: u64) -> TenantId {
    let req = TenantRequest {
        name: name.into(),
        class: None,
        guarantee: None,
        limit: None,
        pid: std::process::id(),
        uid: uid(),
        gids: Vec::new(),
    };
    slot.connect(req, conn, None).unwrap().0
}

/// Runs `on_ask` the first time a reclaim is asked for, as another connection's request would
/// run while the grant waits.
struct OnAsk<'a>(Cell<Option<Box<dyn FnOnce() + 'a>>>);

impl ReclaimSender for OnAsk<'_> {
    fn ask(&self, _conn: u64, _bytes: Bytes) {
        if let Some(f) = self.0.take() {
            f();
        }
    }

    fn settled(&self, _satisfied: bool, _waited: Duration) {}

    fn asker_gone(&self) -> bool {
        false
    }
}

/// A grant of the registering connection that waits on a reclaim while its tenant's program
/// joins is refused when the wait ends: the tenant's memory is the program's from the join on,
/// and the program's close takes back everything the tenant holds.
#[test]
fn a_grant_waiting_while_a_program_joins_is_refused_and_books_nothing() {
    let slot = slot(Bytes::mib(64));
    let idle = connect(&slot, "idle", 1);
    let never = OnAsk(Cell::new(None));
    let wait = Duration::from_secs(5);
    let idle_grants: Vec<GrantId> = slot
        .grant_many(idle, 1, &[Bytes::mib(64)], wait, &never)
        .unwrap()
        .into_iter()
        .map(|(id, _, _)| id)
        .collect();
    slot.report_usage(idle, Bytes::ZERO, Bytes::mib(64));

    let job = connect(&slot, "job", 2);
    let token = slot.invite(job, uid()).unwrap();
    // While the grant waits: the program joins on connection 3, then the idle tenant gives its
    // memory back, which ends the wait.
    let joins = OnAsk(Cell::new(Some(Box::new(|| {
        slot.join(&token, std::process::id(), uid(), 3).unwrap();
        slot.give_back(idle, &idle_grants).unwrap();
    }))));
    let e = slot
        .grant_many(job, 2, &[Bytes::mib(4)], wait, &joins)
        .unwrap_err();
    assert_eq!(e.reason.as_deref(), Some("program_joined"), "{e:?}");
    let books = slot.budget(job).unwrap();
    assert_eq!((books.held, books.charged), (Bytes::ZERO, Bytes::ZERO));
    // The program's own grant is booked as usual.
    slot.grant_many(job, 3, &[Bytes::mib(4)], wait, &never)
        .unwrap();
    assert_eq!(slot.budget(job).unwrap().held, Bytes::mib(4));
}
