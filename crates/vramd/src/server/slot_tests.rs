//! The slot's books under events that interleave with a waiting grant.

use std::cell::Cell;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use vram_core::broker::{Policy, TenantId, TenantRequest};
use vram_core::Bytes;
use vram_device::{Device, HostDevice};
use vram_proto::{GrantId, Resume};

use super::pool::Pool;
use super::slot::{ReclaimSender, Slot};
use crate::config::PoolConfig;

fn slot(capacity: Bytes) -> Slot {
    slot_with(Policy::with_capacity(capacity))
}

fn slot_with(policy: Policy) -> Slot {
    let capacity = policy.capacity;
    let dev: Arc<dyn Device> = Arc::new(HostDevice::new(capacity, Bytes::mib(2)).unwrap());
    let pool = Pool::new(
        dev.clone(),
        PoolConfig {
            max: Bytes::ZERO,
            sizes: vec![Bytes::mib(2)],
            initial: 0,
        },
    );
    Slot::new(0, dev, policy, pool).unwrap()
}

fn uid() -> u32 {
    rustix::process::getuid().as_raw()
}

/// A tenant of this process as a daemon before saved it: `name`, its `limit`, its `grants`.
fn saved(name: &str, limit: Bytes, grants: Vec<(GrantId, Bytes)>) -> super::state::SavedTenant {
    let pid = std::process::id();
    super::state::SavedTenant {
        gpu: 0,
        uuid: String::new(),
        name: name.into(),
        class: "normal".into(),
        guarantee: Bytes::ZERO,
        limit,
        pid,
        uid: uid(),
        start_time: super::state::process_start_time(pid).unwrap(),
        grants,
        charged: Bytes::ZERO,
        invitation: None,
    }
}

fn connect(slot: &Slot, name: &str, conn: u64) -> TenantId {
    connect_resuming(slot, name, conn, None)
}

/// This process asking to be tenant `name`, with no class, guarantee or limit of its own.
fn request(name: &str) -> TenantRequest {
    TenantRequest {
        name: name.into(),
        class: None,
        guarantee: None,
        limit: None,
        pid: std::process::id(),
        uid: uid(),
        gids: Vec::new(),
    }
}

fn connect_resuming(slot: &Slot, name: &str, conn: u64, resume: Option<&Resume>) -> TenantId {
    slot.connect(request(name), conn, resume).unwrap().0
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

/// A tenant whose connection the daemon dropped while its process still mapped a grant (kept, on
/// the host backend, which can tell) and that reconnects saying it holds that grant: the handle
/// is its grant again, booked once, and a return of it takes it back.
#[test]
fn a_kept_grant_claimed_on_reconnect_is_booked_once() {
    let slot = slot(Bytes::mib(64));
    let never = OnAsk(Cell::new(None));
    let wait = Duration::from_secs(1);
    let t = connect(&slot, "job", 1);
    let (g, size, fd) = slot
        .grant_many(t, 1, &[Bytes::mib(8)], wait, &never)
        .unwrap()
        .pop()
        .unwrap();
    // The tenant's own open of the memory (its import), apart from the daemon's.
    let import = std::fs::File::open(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap();
    drop(fd);
    slot.disconnect(t).unwrap();
    let resume = Resume {
        grants: vec![(g, size)],
        charged: Bytes::ZERO,
    };
    let t = connect_resuming(&slot, "job", 2, Some(&resume));
    let books = slot.budget(t).unwrap();
    if books.held == Bytes::ZERO {
        // Leases are off here: the device cannot tell a reached handle, nothing was kept, and
        // the claim was booked as an adopted grant.
        eprintln!("skipped: file leases are not available, so no handle is kept");
        return;
    }
    assert_eq!(books.held, Bytes::mib(8), "{books:?}");
    assert_eq!(slot.device().used(), Bytes::mib(8));
    let status = slot.status().1;
    let job = status.iter().find(|s| s.name == "job").unwrap();
    assert_eq!(job.kept, Bytes::ZERO, "{job:?}");
    drop(import);
    let (returned, held) = slot.give_back(t, &[g]).unwrap();
    assert_eq!((returned, held), (Bytes::mib(8), Bytes::ZERO));
}

/// A host device that runs a hook (once, when armed) at an export, as another connection's
/// request would run between the steps of a return.
struct OnExport {
    inner: HostDevice,
    hook: std::sync::Mutex<Option<ExportHook>>,
    /// Run (once, when armed) where the daemon asks whether a handle is reached elsewhere, which
    /// it then is.
    reached: std::sync::Mutex<Option<ExportHook>>,
}

type ExportHook = Box<dyn FnOnce() + Send>;

impl std::fmt::Debug for OnExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.inner.fmt(f)
    }
}

impl Device for OnExport {
    fn info(&self) -> &vram_device::DeviceInfo {
        self.inner.info()
    }
    fn used(&self) -> Bytes {
        self.inner.used()
    }
    fn create(&self, size: Bytes) -> vram_device::Result<vram_device::Handle> {
        self.inner.create(size)
    }
    fn export(&self, handle: &vram_device::Handle) -> vram_device::Result<std::os::fd::OwnedFd> {
        let hook = self.hook.lock().unwrap().take();
        if let Some(f) = hook {
            f();
        }
        self.inner.export(handle)
    }
    fn reached_elsewhere(&self, handle: &vram_device::Handle) -> Option<bool> {
        let hook = self.reached.lock().unwrap().take();
        if let Some(f) = hook {
            f();
            return Some(true);
        }
        self.inner.reached_elsewhere(handle)
    }
    fn import(
        &self,
        fd: std::os::fd::OwnedFd,
        size: Bytes,
    ) -> vram_device::Result<vram_device::Handle> {
        self.inner.import(fd, size)
    }
    fn reserve(&self, size: Bytes) -> vram_device::Result<vram_device::Reservation> {
        self.inner.reserve(size)
    }
    fn map(
        &self,
        res: &vram_device::Reservation,
        offset: Bytes,
        handle: &vram_device::Handle,
        access: vram_device::Access,
    ) -> vram_device::Result<()> {
        self.inner.map(res, offset, handle, access)
    }
    fn set_access(
        &self,
        res: &vram_device::Reservation,
        offset: Bytes,
        len: Bytes,
        access: vram_device::Access,
    ) -> vram_device::Result<()> {
        self.inner.set_access(res, offset, len, access)
    }
    fn unmap(
        &self,
        res: &vram_device::Reservation,
        offset: Bytes,
        len: Bytes,
    ) -> vram_device::Result<()> {
        self.inner.unmap(res, offset, len)
    }
}

/// A slot of 64 MiB on a hooked host device, its pool keeping up to `pool_max` for recycling.
fn hooked_slot(pool_max: Bytes) -> (Arc<OnExport>, Arc<Pool>, Arc<Slot>) {
    let capacity = Bytes::mib(64);
    let dev = Arc::new(OnExport {
        inner: HostDevice::new(capacity, Bytes::mib(2)).unwrap(),
        hook: std::sync::Mutex::new(None),
        reached: std::sync::Mutex::new(None),
    });
    let config = PoolConfig {
        max: pool_max,
        sizes: vec![Bytes::mib(2)],
        initial: 0,
    };
    let pool = Pool::new(dev.clone(), config);
    let slot = Slot::new(
        0,
        dev.clone(),
        Policy::with_capacity(capacity),
        pool.clone(),
    );
    (dev, pool, Arc::new(slot.unwrap()))
}

/// The tenant `job` of connection 1, with a grant of 8 MiB.
fn job_with_a_grant(slot: &Slot) -> (TenantId, Vec<GrantId>) {
    let never = OnAsk(Cell::new(None));
    let t = connect(slot, "job", 1);
    let grants = slot
        .grant_many(t, 1, &[Bytes::mib(8)], Duration::from_secs(1), &never)
        .unwrap()
        .into_iter()
        .map(|(g, _, _)| g)
        .collect();
    (t, grants)
}

/// A tenant's return that its own disconnect (another connection of the same tenant) overtakes
/// keeps nothing in the pool for it: the memory is released, not left waiting for a tenant that
/// is gone.
#[test]
fn a_return_overtaken_by_its_tenants_disconnect_keeps_nothing_for_it() {
    let (dev, pool, slot) = hooked_slot(Bytes::mib(32));
    let (t, grants) = job_with_a_grant(&slot);
    let other = slot.clone();
    *dev.hook.lock().unwrap() = Some(Box::new(move || {
        other.disconnect(t).unwrap();
    }));
    // The return's handles are exported for recycling: the disconnect runs there.
    slot.give_back(t, &grants).unwrap();
    assert!(dev.hook.lock().unwrap().is_none(), "the disconnect ran");
    assert_eq!(pool.pooled(), Bytes::ZERO);
    assert_eq!(dev.used(), Bytes::ZERO);
}

/// A tenant that owns a shared buffer (or pins a version, or holds a lease) gets no invitation,
/// and an invitation given before it made one is not taken: the program's close would take back
/// what is the registering connection's.
#[test]
fn a_tenant_with_shared_buffers_gets_no_program_joined() {
    use vram_core::shared::{Acl, BufferSpec};
    let slot = slot(Bytes::mib(64));
    let job = connect(&slot, "job", 1);
    let token = slot.invite(job, uid()).unwrap();
    let spec = BufferSpec {
        name: "weights".into(),
        size: Bytes::mib(2),
        acl: Acl::default(),
    };
    slot.with_shared(|broker, books| books.core.create(broker, job, spec))
        .unwrap();
    let e = slot.invite(job, uid()).unwrap_err();
    assert!(e.message.contains("owns a shared buffer"), "{e:?}");
    let e = slot.join(&token, std::process::id(), uid(), 2).unwrap_err();
    assert!(e.message.contains("owns a shared buffer"), "{e:?}");
}

/// Grants adopted after a daemon restart are memory on the device that none of the daemon's own
/// handles keeps (the tenant's imports do): the books count them as created, so a reading of the
/// driver does not take them for outside use on top of the tenant's held memory.
#[test]
fn adopted_grants_count_as_created_in_the_driver_books() {
    use vram_core::books::{reconcile, DriverReading};

    let slot = slot(Bytes::gib(1));
    let saved = saved(
        "back",
        Bytes::mib(512),
        vec![(GrantId(7), Bytes::mib(64)), (GrantId(9), Bytes::mib(32))],
    );
    slot.adopt(&saved).unwrap();
    let books = slot.books();
    assert_eq!(books.created, Bytes::mib(96));
    let reading = DriverReading {
        total: Bytes::gib(1),
        reserved: Bytes::ZERO,
        used: Bytes::mib(96),
        allowance: Bytes::ZERO,
        processes: Vec::new(),
    };
    let r = reconcile(&books, &reading);
    assert_eq!((r.outside_use, r.unattributed), (Bytes::ZERO, Bytes::ZERO));
}

/// A grant a reconnecting tenant claims that its rules no longer allow is not booked, yet is known
/// as the tenant's: a return that names it with others takes them all back, rather than refusing
/// the request and leaving the others booked.
#[test]
fn a_claimed_grant_not_booked_does_not_hold_back_a_return() {
    let slot = slot(Bytes::mib(64));
    let saved = saved("back", Bytes::mib(64), vec![(GrantId(7), Bytes::mib(32))]);
    slot.adopt(&saved).unwrap();
    // The state file missed the second grant, which is more than the device has room for now.
    let resume = Resume {
        grants: vec![(GrantId(7), Bytes::mib(32)), (GrantId(8), Bytes::mib(128))],
        charged: Bytes::ZERO,
    };
    let t = connect_resuming(&slot, "back", 1, Some(&resume));
    assert_eq!(slot.budget(t).unwrap().held, Bytes::mib(32));
    let (_, held) = slot.give_back(t, &[GrantId(8), GrantId(7)]).unwrap();
    assert_eq!(held, Bytes::ZERO);
    assert_eq!(slot.budget(t).unwrap().held, Bytes::ZERO);
}

/// A tenant's account claims only whole granules, and at most as many grants as its limit holds:
/// claims of single bytes, or past that count, are ignored and cost the daemon's books nothing.
#[test]
fn an_account_books_whole_granules_and_no_more_grants_than_the_limit_holds() {
    let slot = slot(Bytes::mib(64));
    let bytes = Resume {
        grants: (1..=1000).map(|i| (GrantId(i), Bytes(1))).collect(),
        charged: Bytes::ZERO,
    };
    let t = connect_resuming(&slot, "bytes", 1, Some(&bytes));
    assert_eq!(slot.budget(t).unwrap().held, Bytes::ZERO);
    assert!(slot.give_back(t, &[GrantId(1)]).is_err(), "not known");
    slot.disconnect(t).unwrap();

    let many = Resume {
        grants: (1..=100).map(|i| (GrantId(i), Bytes::mib(2))).collect(),
        charged: Bytes::ZERO,
    };
    let t = connect_resuming(&slot, "many", 2, Some(&many));
    assert_eq!(slot.budget(t).unwrap().held, Bytes::mib(64));
    assert!(
        slot.give_back(t, &[GrantId(33)]).is_err(),
        "past the limit's count"
    );
    let first: Vec<GrantId> = (1..=32).map(GrantId).collect();
    let (_, held) = slot.give_back(t, &first).unwrap();
    assert_eq!(held, Bytes::ZERO);
    slot.disconnect(t).unwrap();

    // Of the claims refused for want of room, at most MAX_UNBOOKED_CLAIMS are kept as the
    // tenant's at nothing.
    let slot = slot_with({
        let mut p = vram_core::broker::Policy::with_capacity(Bytes::gib(64));
        p.priority_reserve = Bytes::ZERO;
        p
    });
    let full = Resume {
        grants: (1..=5000).map(|i| (GrantId(i), Bytes::gib(64))).collect(),
        charged: Bytes::ZERO,
    };
    let t = connect_resuming(&slot, "full", 4, Some(&full));
    assert_eq!(slot.budget(t).unwrap().held, Bytes::gib(64));
    let kept: Vec<GrantId> = (1..=1025).map(GrantId).collect();
    slot.give_back(t, &kept).unwrap();
    assert!(slot.give_back(t, &[GrantId(1026)]).is_err(), "past the cap");
}

/// A tenant adopted after a restart comes back only as the rules in force admit it: once the
/// configuration declares its name for other owners, its process's reconnect is refused with
/// that rule, and its memory stays booked to it.
#[test]
fn an_adopted_tenant_reconnects_only_as_the_rules_in_force_admit_it() {
    use vram_core::broker::DeclaredTenant;

    let slot = slot(Bytes::mib(64));
    let saved = saved("x", Bytes::mib(64), vec![(GrantId(7), Bytes::mib(8))]);
    slot.adopt(&saved).unwrap();
    slot.with_shared(|broker, _| {
        let mut policy = broker.policy().clone();
        let owner = DeclaredTenant {
            class: "normal".into(),
            guarantee: Bytes::ZERO,
            limit: None,
            owners: vec![uid().wrapping_add(1)],
            groups: Vec::new(),
        };
        policy.tenants.insert("x".into(), owner);
        broker.replace_policy(policy).unwrap();
    });
    let req = request("x");
    let resume = Resume {
        grants: vec![(GrantId(7), Bytes::mib(8))],
        charged: Bytes::ZERO,
    };
    let e = slot.connect(req, 1, Some(&resume)).unwrap_err();
    assert_eq!(e.reason.as_deref(), Some("not_owner"), "{e:?}");
    let held: Bytes = slot
        .status()
        .1
        .iter()
        .filter(|t| t.name == "x")
        .map(|t| t.held)
        .sum();
    assert_eq!(held, Bytes::mib(8));
}

/// A return whose handle another process still reaches, overtaken by its tenant's disconnect
/// (another connection of the same tenant) while the daemon looks: the handle is booked as kept
/// under the tenant's name and uid all the same, never dropped from the books while it lives.
#[test]
fn a_reached_return_overtaken_by_its_tenants_disconnect_stays_booked() {
    let (dev, _pool, slot) = hooked_slot(Bytes::ZERO);
    let (t, grants) = job_with_a_grant(&slot);
    let other = slot.clone();
    *dev.reached.lock().unwrap() = Some(Box::new(move || {
        other.disconnect(t).unwrap();
    }));
    slot.give_back(t, &grants).unwrap();
    assert!(dev.reached.lock().unwrap().is_none(), "the disconnect ran");
    assert_eq!(dev.used(), Bytes::mib(8), "the reached handle lives");
    let kept: Bytes = slot
        .status()
        .0
        .kept_offline
        .iter()
        .filter(|k| k.tenant == "job")
        .map(|k| k.bytes)
        .sum();
    assert_eq!(kept, Bytes::mib(8));
}

/// Records the connections asked for memory.
#[derive(Default)]
struct Asked(std::cell::RefCell<Vec<u64>>);

impl ReclaimSender for Asked {
    fn ask(&self, conn: u64, _bytes: Bytes) {
        self.0.borrow_mut().push(conn);
    }

    fn settled(&self, _satisfied: bool, _waited: Duration) {}

    fn asker_gone(&self) -> bool {
        false
    }
}

/// Tenant `name` of class `class` on connection `conn`, holding `bytes`, all of it idle.
fn idle_tenant(
    slot: &Slot,
    name: &str,
    class: &str,
    conn: u64,
    bytes: Bytes,
) -> (TenantId, Vec<GrantId>) {
    idle_tenant_of(slot, name, class, conn, &[bytes])
}

/// Tenant `name` of class `class` on connection `conn`, holding grants of `sizes`, all idle.
fn idle_tenant_of(
    slot: &Slot,
    name: &str,
    class: &str,
    conn: u64,
    sizes: &[Bytes],
) -> (TenantId, Vec<GrantId>) {
    let req = TenantRequest {
        class: Some(class.into()),
        ..request(name)
    };
    let t = slot.connect(req, conn, None).unwrap().0;
    let never = OnAsk(Cell::new(None));
    let grants = slot
        .grant_many(t, conn, sizes, Duration::from_secs(1), &never)
        .unwrap()
        .into_iter()
        .map(|(id, _, _)| id)
        .collect();
    slot.report_usage(t, Bytes::ZERO, sizes.iter().copied().sum());
    (t, grants)
}

/// Two tenants of one priority that grow at once, each with idle memory the other could use: the
/// second to ask does not ask the first, whose grant waits (it could answer only once that wait
/// ended), and is refused at once; its answer to the first's ask then ends the first's wait.
#[test]
fn a_tenant_waiting_for_memory_is_not_asked_for_its_own() {
    let slot = slot(Bytes::mib(64));
    let (a, _) = idle_tenant(&slot, "a", "normal", 1, Bytes::mib(32));
    let (b, b_grants) = idle_tenant(&slot, "b", "normal", 2, Bytes::mib(32));
    let wait = Duration::from_secs(5);
    let b_grows_meanwhile = OnAsk(Cell::new(Some(Box::new(|| {
        let asked = Asked::default();
        let started = std::time::Instant::now();
        let e = slot
            .grant_many(b, 2, &[Bytes::mib(4)], wait, &asked)
            .unwrap_err();
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "b waited {:?}: {e:?}",
            started.elapsed()
        );
        assert!(asked.0.borrow().is_empty(), "b asked {:?}", asked.0);
        slot.give_back(b, &b_grants).unwrap();
    }))));
    let started = std::time::Instant::now();
    slot.grant_many(a, 1, &[Bytes::mib(4)], wait, &b_grows_meanwhile)
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(1));
}

/// A tenant whose grant waits on a reclaim, asked for its idle memory by a tenant of higher
/// priority, gives way: its wait ends at once, refused (`gave_way`), so that it can answer.
#[test]
fn a_waiting_tenant_gives_way_to_a_higher_priority_ask() {
    let mut policy = Policy::with_capacity(Bytes::mib(64));
    policy.classes.get_mut("high").unwrap().users.push(uid());
    let slot = slot_with(policy);
    let (low, low_grants) = idle_tenant(&slot, "low", "low", 1, Bytes::mib(32));
    // The tenant `low` asks, which never answers.
    idle_tenant(&slot, "mute", "normal", 2, Bytes::mib(32));
    let high = slot.connect(
        TenantRequest {
            class: Some("high".into()),
            ..request("high")
        },
        3,
        None,
    );
    let high = high.unwrap().0;
    let wait = Duration::from_secs(10);
    let slot = &slot;
    std::thread::scope(|scope| {
        let (waiting, low_is_waiting) = std::sync::mpsc::channel();
        let low_grows = scope.spawn(move || {
            let started = std::time::Instant::now();
            let tell = OnAsk(Cell::new(Some(Box::new(move || {
                let _ = waiting.send(());
            }))));
            let e = slot.grant_many(low, 1, &[Bytes::mib(4)], wait, &tell);
            (e.map(|_| ()), started.elapsed())
        });
        low_is_waiting.recv_timeout(wait).unwrap();
        let low_answers = OnAsk(Cell::new(Some(Box::new(|| {
            let (e, waited) = low_grows.join().unwrap();
            let e = e.unwrap_err();
            assert_eq!(e.reason.as_deref(), Some("gave_way"), "{e:?}");
            assert!(waited < Duration::from_secs(2), "{waited:?}");
            slot.give_back(low, &low_grants).unwrap();
        }))));
        let started = std::time::Instant::now();
        slot.grant_many(high, 3, &[Bytes::mib(4)], wait, &low_answers)
            .unwrap();
        assert!(started.elapsed() < Duration::from_secs(2));
    });
}

/// A tenant that reports idle memory but gives none back when asked (stopped, or saying what is
/// not so) makes one grant wait in vain, not every one: the next are not held up by it (it is
/// still asked, so that one that does not read is disconnected in time), and the tenants that
/// answer are asked, until it gives something back.
#[test]
fn a_tenant_that_gave_nothing_back_holds_up_no_later_grant() {
    let slot = slot(Bytes::mib(64));
    let (liar, liar_grants) = idle_tenant_of(
        &slot,
        "liar",
        "normal",
        1,
        &[Bytes::mib(20), Bytes::mib(20)],
    );
    let (honest, honest_grants) = idle_tenant(&slot, "honest", "normal", 2, Bytes::mib(24));
    let needy = connect(&slot, "needy", 3);
    let wait = Duration::from_millis(500);
    // The largest idle memory is asked first: the liar's, which never comes.
    let asked = Asked::default();
    let started = std::time::Instant::now();
    let e = slot
        .grant_many(needy, 3, &[Bytes::mib(4)], wait, &asked)
        .unwrap_err();
    assert_eq!(*asked.0.borrow(), vec![1], "{e:?}");
    assert!(started.elapsed() >= wait);
    // Then the honest tenant is asked too, and its answer is enough.
    let mut returns = honest_grants.into_iter();
    struct Answers<F: FnMut(u64)>(std::cell::RefCell<F>);
    impl<F: FnMut(u64)> ReclaimSender for Answers<F> {
        fn ask(&self, conn: u64, _bytes: Bytes) {
            (self.0.borrow_mut())(conn);
        }
        fn settled(&self, _satisfied: bool, _waited: Duration) {}
        fn asker_gone(&self) -> bool {
            false
        }
    }
    let answers = |conn: u64| {
        if conn == 2 {
            slot.give_back(honest, &[returns.next().unwrap()]).unwrap();
        }
    };
    let started = std::time::Instant::now();
    slot.grant_many(needy, 3, &[Bytes::mib(4)], wait, &Answers(answers.into()))
        .unwrap();
    assert!(started.elapsed() < wait / 2, "{:?}", started.elapsed());
    // No one else has idle memory: the liar is asked, and refused at once rather than waited on.
    let more = || {
        let asked = Asked::default();
        let started = std::time::Instant::now();
        let _ = slot.grant_many(needy, 3, &[Bytes::mib(48)], wait, &asked);
        let asked = asked.0.borrow().clone();
        (asked, started.elapsed())
    };
    let (asked, took) = more();
    assert_eq!(asked, vec![1]);
    assert!(took < wait / 2, "{took:?}");
    // A return of nothing changes nothing; once it gives something back, it is waited on again.
    slot.give_back(liar, &[]).unwrap();
    assert!(more().1 < wait / 2);
    slot.give_back(liar, &liar_grants[..1]).unwrap();
    slot.report_usage(liar, Bytes::ZERO, Bytes::mib(20));
    let (asked, took) = more();
    assert_eq!(asked, vec![1]);
    assert!(took >= wait, "{took:?}");
}

/// A device awaits the adopted tenant's own process only (its reconnect is routed there by
/// name and process, whatever device number it names), and no longer once it is back.
#[test]
fn a_device_awaits_its_adopted_tenants_process_until_it_reconnects() {
    let slot = slot(Bytes::mib(64));
    let me = std::process::id();
    slot.adopt(&saved(
        "back",
        Bytes::mib(64),
        vec![(GrantId(7), Bytes::mib(32))],
    ))
    .unwrap();
    assert!(slot.awaits("back", me, uid()));
    assert!(!slot.awaits("back", me + 1, uid()));
    assert!(!slot.awaits("back", me, uid() + 1));
    assert!(!slot.awaits("other", me, uid()));
    let resume = Resume {
        grants: vec![(GrantId(7), Bytes::mib(32))],
        charged: Bytes::ZERO,
    };
    connect_resuming(&slot, "back", 1, Some(&resume));
    assert!(!slot.awaits("back", me, uid()));
}

/// A tenant whose registration ended gets no invitation (its joined program's connection may
/// outlive it and ask): one would never be taken, nor ever removed.
#[test]
fn an_ended_tenant_gets_no_invitation() {
    let slot = slot(Bytes::mib(64));
    let job = connect(&slot, "job", 1);
    slot.disconnect(job);
    let e = slot.invite(job, uid()).unwrap_err();
    assert!(e.message.contains("the tenant has ended"), "{e:?}");
    assert!(slot.saved().1.is_empty());
}
