use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::*;
use crate::broker::{Policy, TenantRequest};

const SIZE: Bytes = Bytes::gib(1);

fn connect(b: &mut Broker, name: &str, class: &str) -> TenantId {
    connect_as(b, name, class, 0)
}

fn connect_as(b: &mut Broker, name: &str, class: &str, uid: u32) -> TenantId {
    b.connect(TenantRequest {
        name: name.into(),
        class: Some(class.into()),
        guarantee: None,
        limit: None,
        pid: 1,
        uid,
        gids: Vec::new(),
    })
    .unwrap()
}

struct World {
    broker: Broker,
    books: SharedBuffers,
    owner: TenantId,
    readers: Vec<TenantId>,
    id: BufferId,
}

/// A 64 GiB device; `trainer` owns `weights` (1 GiB a version), readable by class `low`.
fn world() -> World {
    let mut p = Policy::with_capacity(Bytes::gib(64));
    p.priority_reserve = Bytes::ZERO;
    // The tests connect as uid 0, which may ask for `high`.
    p.classes.get_mut("high").unwrap().users = vec![0];
    let mut broker = Broker::new(p).unwrap();
    let owner = connect(&mut broker, "trainer", "high");
    let readers = (0..3)
        .map(|i| connect(&mut broker, &format!("reader{i}"), "low"))
        .collect();
    let mut books = SharedBuffers::new();
    let spec = BufferSpec {
        name: "weights".into(),
        size: SIZE,
        acl: Acl {
            readers: vec![Principal::Class("low".into())],
            writers: vec![Principal::Tenant("reader2".into())],
        },
    };
    let id = books.create(&broker, owner, spec).unwrap().id;
    World {
        broker,
        books,
        owner,
        readers,
        id,
    }
}

impl World {
    fn write_publish(&mut self, who: TenantId, now: u64) -> Version {
        let base = self.books.current(self.id);
        let (v, _) = self
            .books
            .begin_write(&mut self.broker, who, self.id, base, now)
            .unwrap();
        self.books
            .publish(&mut self.broker, who, self.id, v, v.0 * 11, now)
            .unwrap();
        v
    }

    fn held(&self) -> Bytes {
        self.broker.tenant(self.owner).unwrap().held
    }
}

#[test]
fn readers_keep_their_version_and_memory_is_counted_once() {
    let mut w = world();
    assert!(matches!(
        w.books.pin(&w.broker, w.readers[0], w.id),
        Err(SharedError::NothingPublished(_))
    ));
    w.books
        .acquire(&mut w.broker, w.owner, w.id, 1000, 0)
        .unwrap();
    let v1 = w.write_publish(w.owner, 1);
    for &r in &w.readers {
        assert_eq!(w.books.pin(&w.broker, r, w.id).unwrap(), (v1, 11));
    }
    assert_eq!(w.held(), SIZE, "three readers, one copy");
    let v2 = w.write_publish(w.owner, 2);
    assert_eq!(w.held(), Bytes(2 * SIZE.get()), "v1 pinned, v2 current");
    assert_eq!(w.books.pin(&w.broker, w.readers[0], w.id).unwrap().0, v2);
    for &r in &w.readers {
        let freed = w.books.unpin(&mut w.broker, r, w.id, v1).unwrap();
        assert_eq!(
            freed.is_empty(),
            r != w.readers[2],
            "v1 goes with its last pin"
        );
    }
    assert_eq!(w.held(), SIZE);
    for r in &w.readers {
        assert_eq!(w.broker.tenant(*r).unwrap().held, Bytes::ZERO);
    }
}

#[test]
fn a_second_writer_gets_a_conflict_naming_holder_and_version() {
    let mut w = world();
    let other = w.readers[2];
    w.books
        .acquire(&mut w.broker, w.owner, w.id, 1000, 0)
        .unwrap();
    w.write_publish(w.owner, 1);
    let e = w
        .books
        .acquire(&mut w.broker, other, w.id, 1000, 10)
        .unwrap_err();
    assert!(e.is_conflict());
    assert_eq!(
        e.to_string(),
        "shared buffer `weights`: tenant `trainer` holds the writer lease for 990 ms more; current version 1"
    );
    let e = w
        .books
        .acquire(&mut w.broker, w.readers[0], w.id, 1000, 10)
        .unwrap_err();
    assert_eq!(e.reason(), "forbidden");
}

#[test]
fn an_expired_writer_loses_its_draft_and_a_stale_base_is_refused() {
    let mut w = world();
    let other = w.readers[2];
    w.books
        .acquire(&mut w.broker, w.owner, w.id, 100, 0)
        .unwrap();
    let v1 = w.write_publish(w.owner, 1);
    let (draft, _) = w
        .books
        .begin_write(&mut w.broker, w.owner, w.id, Some(v1), 2)
        .unwrap();
    assert_eq!(w.held(), Bytes(2 * SIZE.get()));
    // The writer stops renewing; its lease runs out at 100.
    let freed = w.books.expire(&mut w.broker, 100);
    assert_eq!(
        freed,
        vec![Freed {
            buffer: w.id,
            version: draft
        }]
    );
    assert_eq!(w.held(), SIZE);
    let e = w
        .books
        .publish(&mut w.broker, w.owner, w.id, draft, 0, 101)
        .unwrap_err();
    assert_eq!(e.reason(), "no_lease");
    assert!(e.to_string().contains("current version 1"), "{e}");
    // Another writer publishes twice; the old writer comes back with its stale base.
    w.books
        .acquire(&mut w.broker, other, w.id, 100, 101)
        .unwrap();
    w.write_publish(other, 102);
    let v3 = w.write_publish(other, 103);
    w.books
        .release_lease(&mut w.broker, other, w.id, 104)
        .unwrap();
    w.books
        .acquire(&mut w.broker, w.owner, w.id, 100, 105)
        .unwrap();
    let e = w
        .books
        .begin_write(&mut w.broker, w.owner, w.id, Some(v1), 106)
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "shared buffer `weights`: the write started from version 1 but the current version is {}",
            v3.0
        )
    );
    assert_eq!(w.books.pin(&w.broker, w.readers[0], w.id).unwrap().0, v3);
}

#[test]
fn versions_are_charged_to_the_owner_within_its_limit() {
    let mut p = Policy::with_capacity(Bytes::gib(64));
    p.priority_reserve = Bytes::ZERO;
    let mut broker = Broker::new(p).unwrap();
    let owner = broker
        .connect(TenantRequest {
            name: "small".into(),
            class: None,
            guarantee: None,
            limit: Some(Bytes::gib(1)),
            pid: 1,
            uid: 0,
            gids: Vec::new(),
        })
        .unwrap();
    let mut books = SharedBuffers::new();
    let spec = BufferSpec {
        name: "big".into(),
        size: Bytes::gib(2),
        acl: Acl::default(),
    };
    let id = books.create(&broker, owner, spec).unwrap().id;
    books.acquire(&mut broker, owner, id, 100, 0).unwrap();
    let e = books
        .begin_write(&mut broker, owner, id, None, 1)
        .unwrap_err();
    assert_eq!(e.reason(), "over_limit");
    assert!(e.to_string().contains("its limit is 1 GiB"), "{e}");
}

#[test]
fn delete_and_owner_death_give_everything_back() {
    let mut w = world();
    w.books
        .acquire(&mut w.broker, w.owner, w.id, 1000, 0)
        .unwrap();
    let v1 = w.write_publish(w.owner, 1);
    w.books.pin(&w.broker, w.readers[0], w.id).unwrap();
    w.write_publish(w.owner, 2);
    let e = w
        .books
        .delete(&mut w.broker, w.readers[0], w.id)
        .unwrap_err();
    assert_eq!(e.reason(), "forbidden");
    let freed = w.books.delete(&mut w.broker, w.owner, w.id).unwrap();
    assert_eq!(freed.len(), 1, "the pinned v1 stays: {freed:?}");
    assert_eq!(w.books.list(&w.broker, w.owner, None).count(), 0);
    let freed = w
        .books
        .unpin(&mut w.broker, w.readers[0], w.id, v1)
        .unwrap();
    assert_eq!(freed.len(), 1);
    assert_eq!(w.held(), Bytes::ZERO);
    assert!(w.books.all().is_empty());

    let mut w = world();
    w.books
        .acquire(&mut w.broker, w.owner, w.id, 1000, 0)
        .unwrap();
    w.write_publish(w.owner, 1);
    w.books.pin(&w.broker, w.readers[0], w.id).unwrap();
    let freed = w.books.disconnect(&mut w.broker, w.owner);
    assert_eq!(freed.len(), 1);
    assert_eq!(w.held(), Bytes::ZERO);
    assert!(w.books.all().is_empty());
}

#[derive(Debug, Clone)]
enum Op {
    Acquire(usize, u64),
    Release(usize),
    Begin(usize, bool),
    Publish(usize),
    Pin(usize),
    Unpin(usize, usize),
    Tick(u64),
    Disconnect(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..4usize, 1..50u64).prop_map(|(t, ttl)| Op::Acquire(t, ttl)),
        (0..4usize).prop_map(Op::Release),
        (0..4usize, any::<bool>()).prop_map(|(t, stale)| Op::Begin(t, stale)),
        (0..4usize).prop_map(Op::Publish),
        (0..4usize).prop_map(Op::Pin),
        (0..4usize, 0..8usize).prop_map(|(t, i)| Op::Unpin(t, i)),
        (1..30u64).prop_map(Op::Tick),
        (1..4usize).prop_map(Op::Disconnect),
    ]
}

proptest! {
    /// Random leases, writes, publishes, pins and deaths (time passing): readers see published
    /// versions only, pinned versions are never freed, the owner is charged exactly the live
    /// versions, and everything comes back at the end.
    #[test]
    fn invariants_hold(ops in proptest::collection::vec(op(), 1..120)) {
        let mut w = world();
        let mut tenants = vec![w.owner];
        tenants.extend(w.readers.iter().copied());
        let mut gone = BTreeSet::new();
        let mut now = 0u64;
        let mut drafts: BTreeMap<usize, Version> = BTreeMap::new();
        let mut published: BTreeSet<Version> = BTreeSet::new();
        let mut pins: Vec<(usize, Version)> = Vec::new();
        let mut live: BTreeSet<Version> = BTreeSet::new();
        for op in ops {
            let mut freed = Vec::new();
            match op {
                Op::Acquire(t, ttl) if !gone.contains(&t) => {
                    if let Ok((_, f)) = w.books.acquire(&mut w.broker, tenants[t], w.id, ttl, now) {
                        freed = f;
                    }
                }
                Op::Release(t) if !gone.contains(&t) => {
                    if let Ok(f) = w.books.release_lease(&mut w.broker, tenants[t], w.id, now) {
                        freed = f;
                    }
                }
                Op::Begin(t, stale) if !gone.contains(&t) => {
                    let base = w.books.current(w.id).filter(|_| !stale);
                    match w.books.begin_write(&mut w.broker, tenants[t], w.id, base, now) {
                        Ok((v, f)) => {
                            prop_assert!(!live.contains(&v));
                            live.insert(v);
                            drafts.insert(t, v);
                            freed = f;
                        }
                        Err(e) => prop_assert!(e.is_conflict() || e.reason() == "forbidden", "{e}"),
                    }
                }
                Op::Publish(t) if !gone.contains(&t) => {
                    if let Some(&v) = drafts.get(&t) {
                        if let Ok(f) = w.books.publish(&mut w.broker, tenants[t], w.id, v, v.0, now) {
                            published.insert(v);
                            freed = f;
                        }
                    }
                }
                Op::Pin(t) if !gone.contains(&t) => {
                    if let Ok((v, sum)) = w.books.pin(&w.broker, tenants[t], w.id) {
                        prop_assert!(published.contains(&v), "pinned unpublished {v}");
                        prop_assert_eq!(sum, v.0);
                        pins.push((t, v));
                    }
                }
                Op::Unpin(t, i) => {
                    if let Some(pos) = pins.iter().enumerate().filter(|(_, p)| p.0 == t).map(|(i, _)| i).nth(i) {
                        let (t, v) = pins.remove(pos);
                        freed = w.books.unpin(&mut w.broker, tenants[t], w.id, v).unwrap();
                    }
                }
                Op::Tick(ms) => {
                    now += ms;
                    freed = w.books.expire(&mut w.broker, now);
                }
                Op::Disconnect(t) if !gone.contains(&t) => {
                    freed = w.books.disconnect(&mut w.broker, tenants[t]);
                    w.broker.disconnect(tenants[t]);
                    gone.insert(t);
                    pins.retain(|p| p.0 != t);
                }
                _ => {}
            }
            for f in &freed {
                prop_assert!(live.remove(&f.version), "freed twice or never held: {f:?}");
                prop_assert!(!pins.iter().any(|p| p.1 == f.version), "pinned version freed: {f:?}");
                prop_assert!(w.books.current(w.id) != Some(f.version), "current version freed");
            }
            prop_assert_eq!(w.held(), Bytes(SIZE.get() * live.len() as u64));
            prop_assert_eq!(w.books.totals().bytes, w.held());
        }
        for (t, v) in pins.drain(..) {
            w.books.unpin(&mut w.broker, tenants[t], w.id, v).unwrap();
        }
        w.books.delete(&mut w.broker, w.owner, w.id).unwrap();
        prop_assert_eq!(w.held(), Bytes::ZERO);
        prop_assert_eq!(w.broker.held(), Bytes::ZERO);
        prop_assert!(w.books.all().is_empty());
    }
}

#[test]
fn a_draft_freed_by_a_lease_found_expired_in_a_failing_call_is_still_handed_out() {
    let mut w = world();
    w.books
        .acquire(&mut w.broker, w.owner, w.id, 100, 0)
        .unwrap();
    let (draft, _) = w
        .books
        .begin_write(&mut w.broker, w.owner, w.id, None, 1)
        .unwrap();
    // A renew after the lease ran out finds it expired (the draft is freed) and is refused.
    let e = w
        .books
        .renew(&mut w.broker, w.owner, w.id, 100, 200)
        .unwrap_err();
    assert_eq!(e.reason(), "no_lease", "{e}");
    assert_eq!(w.held(), Bytes::ZERO);
    assert_eq!(
        w.books.take_expired(),
        vec![Freed {
            buffer: w.id,
            version: draft
        }]
    );
    assert!(w.books.take_expired().is_empty(), "handed out once");
}

#[test]
fn an_old_owners_end_leaves_a_reused_name_to_its_new_buffer() {
    let mut w = world();
    w.books
        .acquire(&mut w.broker, w.owner, w.id, 1_000, 0)
        .unwrap();
    w.write_publish(w.owner, 0);
    let r = w.readers[0];
    w.books.pin(&w.broker, r, w.id).unwrap();
    // Deleted while a reader pins its version: the buffer stays, its name is free again.
    w.books.delete(&mut w.broker, w.owner, w.id).unwrap();
    let second_owner = connect(&mut w.broker, "second", "low");
    let spec = BufferSpec {
        name: "weights".into(),
        size: SIZE,
        acl: Acl {
            readers: vec![Principal::Anyone],
            writers: Vec::new(),
        },
    };
    let second = w.books.create(&w.broker, second_owner, spec).unwrap().id;
    w.books.disconnect(&mut w.broker, w.owner);
    let (opened, _) = w.books.open(&mut w.broker, r, "weights", 0).unwrap();
    assert_eq!(opened.id, second);
}

/// An access list names tenants and classes as names can be, each once: a name no tenant or
/// class can have is refused, and a repeated entry is kept once.
#[test]
fn an_access_list_names_what_a_name_can_be_each_once() {
    let mut w = world();
    let spec = |name: &str, entry: Principal| BufferSpec {
        name: name.into(),
        size: SIZE,
        acl: Acl {
            readers: vec![entry.clone(), entry.clone(), Principal::Anyone],
            writers: vec![entry],
        },
    };
    for bad in ["a".repeat(65), String::new(), "no spaces".into()] {
        let e = w
            .books
            .create(&w.broker, w.owner, spec("bad", Principal::Tenant(bad)))
            .unwrap_err();
        assert!(matches!(e, SharedError::BadAccessEntry { .. }), "{e}");
        assert_eq!(e.reason(), "bad_name");
        assert!(
            e.to_string()
                .starts_with("shared buffer `bad`: its access list names tenant"),
            "{e}"
        );
    }
    let e = w
        .books
        .create(
            &w.broker,
            w.owner,
            spec("bad", Principal::Class("x".repeat(200))),
        )
        .unwrap_err();
    assert!(matches!(e, SharedError::BadAccessEntry { .. }), "{e}");
    // The entry is named, cut to its start and its length when it is long.
    assert!(
        e.to_string()
            .contains(&format!("class `{}... (200 bytes)`", "x".repeat(128))),
        "{e}"
    );
    assert!(e.to_string().contains("longer than 64 bytes"), "{e}");
    let info = w
        .books
        .create(
            &w.broker,
            w.owner,
            spec("ok", Principal::Tenant("reader0".into())),
        )
        .unwrap();
    assert_eq!(info.acl.readers.len(), 2, "{:?}", info.acl);
    assert_eq!(info.acl.writers.len(), 1, "{:?}", info.acl);
}

/// The status copy of the books carries at most the access-list entries it is given, readers
/// first, and counts the rest per buffer; everything else is as `all` has it.
#[test]
fn a_capped_copy_keeps_at_most_its_budget_of_acl_entries() {
    let mut w = world();
    let spec = BufferSpec {
        name: "many".into(),
        size: SIZE,
        acl: Acl {
            readers: (0..5).map(|i| Principal::Tenant(format!("r{i}"))).collect(),
            writers: (0..3).map(|i| Principal::Tenant(format!("w{i}"))).collect(),
        },
    };
    w.books.create(&w.broker, w.owner, spec).unwrap();
    // `weights`: 1 reader, 1 writer; `many`: 5 and 3.
    let full = w.books.all();
    for budget in [0, 1, 2, 3, 6, 9, 10, 100] {
        let capped = w.books.all_capped(budget);
        assert_eq!(capped.len(), full.len());
        let mut shown = 0;
        for ((info, left_out), whole) in capped.iter().zip(&full) {
            let n = info.acl.readers.len() + info.acl.writers.len();
            let all_n = whole.acl.readers.len() + whole.acl.writers.len();
            assert_eq!(n + *left_out as usize, all_n, "budget {budget}");
            assert!(whole.acl.readers.starts_with(&info.acl.readers));
            assert!(whole.acl.writers.starts_with(&info.acl.writers));
            if !info.acl.writers.is_empty() {
                assert_eq!(info.acl.readers.len(), whole.acl.readers.len());
            }
            let mut rest = info.clone();
            rest.acl = whole.acl.clone();
            assert_eq!(&rest, whole);
            shown += n;
        }
        assert_eq!(shown, budget.min(10), "budget {budget}");
    }
}

#[test]
fn buffer_ids_start_where_told_so_an_earlier_daemons_ids_name_nothing() {
    let mut w = world();
    assert_eq!(w.id, BufferId(1));
    w.books.start_ids_at(1 << 40);
    let spec = BufferSpec {
        name: "bias".into(),
        size: SIZE,
        acl: Acl::default(),
    };
    let id = w.books.create(&w.broker, w.owner, spec).unwrap().id;
    assert_eq!(id, BufferId(1 << 40));
    // Told a lower start later, ids still only grow.
    w.books.start_ids_at(5);
    let spec = BufferSpec {
        name: "head".into(),
        size: SIZE,
        acl: Acl::default(),
    };
    assert_eq!(
        w.books.create(&w.broker, w.owner, spec).unwrap().id,
        BufferId((1 << 40) + 1)
    );
}

#[test]
fn a_version_found_corrupt_is_not_pinned_until_another_is_published() {
    let mut w = world();
    w.books
        .acquire(&mut w.broker, w.owner, w.id, 1000, 0)
        .unwrap();
    let v1 = w.write_publish(w.owner, 1);
    let reader = w.readers[0];
    assert_eq!(w.books.pin(&w.broker, reader, w.id).unwrap().0, v1);
    // The first finding tells the owner and the reader that pinned it; the next, nobody.
    assert_eq!(w.books.mark_corrupt(w.id, v1), vec![w.owner, reader]);
    assert!(w.books.mark_corrupt(w.id, v1).is_empty());
    let e = w.books.pin(&w.broker, w.readers[1], w.id).unwrap_err();
    assert!(
        matches!(e, SharedError::Corrupt { version, .. } if version == v1),
        "{e}"
    );
    assert_eq!(e.reason(), "corrupt");
    let v2 = w.write_publish(w.owner, 2);
    assert_eq!(w.books.pin(&w.broker, w.readers[1], w.id).unwrap().0, v2);
}

/// Names and classes a process asks for are bound to uids only where the operator bound them:
/// an access list naming an undeclared tenant, or a class anyone may ask for, admits the owner's
/// uid only; a tenant declared with owners, or a class above the default (for tenants not
/// declared without owners), admits whoever holds it.
#[test]
fn access_lists_admit_other_uids_only_by_names_and_classes_bound_to_uids() {
    let mut p = Policy::with_capacity(Bytes::gib(64));
    p.priority_reserve = Bytes::ZERO;
    p.classes.get_mut("high").unwrap().users = vec![2000];
    p.tenants.insert(
        "infer".into(),
        crate::broker::DeclaredTenant {
            class: "normal".into(),
            guarantee: Bytes::ZERO,
            limit: None,
            owners: vec![2000],
            groups: Vec::new(),
        },
    );
    p.tenants.insert(
        "open-door".into(),
        crate::broker::DeclaredTenant {
            class: "high".into(),
            guarantee: Bytes::ZERO,
            limit: None,
            owners: Vec::new(),
            groups: Vec::new(),
        },
    );
    let mut broker = Broker::new(p).unwrap();
    let owner = connect_as(&mut broker, "trainer", "normal", 1000);
    let mut books = SharedBuffers::new();
    let acl = Acl {
        readers: vec![
            Principal::Tenant("infer".into()),
            Principal::Tenant("ingest".into()),
            Principal::Class("low".into()),
            Principal::Class("high".into()),
        ],
        writers: Vec::new(),
    };
    let spec = BufferSpec {
        name: "weights".into(),
        size: SIZE,
        acl,
    };
    let id = books.create(&broker, owner, spec).unwrap().id;
    let may_read = |broker: &Broker, books: &SharedBuffers, t: TenantId| {
        books.check(broker, t, id, "read").is_ok()
    };
    let cases = [
        // A declared name with owners: its owner's process, whatever its uid.
        ("infer", "normal", 2000, true),
        // An undeclared name: the owner's uid only.
        ("ingest", "normal", 1000, true),
        ("ingest", "normal", 3000, false),
        // A class anyone may ask for: the owner's uid only.
        ("batch", "low", 1000, true),
        ("batch2", "low", 3000, false),
        // A class above the default: whoever holds it (only its users may ask for it).
        ("serve", "high", 2000, true),
        // ... but not through a declaration without owners, which any uid may connect as.
        ("open-door", "high", 3000, false),
    ];
    for (name, class, uid, expected) in cases {
        let t = connect_as(&mut broker, name, class, uid);
        assert_eq!(
            may_read(&broker, &books, t),
            expected,
            "{name} (class {class}, uid {uid})"
        );
        if let Err(e) = books.check(&broker, t, id, "read") {
            // Named but not admitted: the refusal says why.
            assert!(e.to_string().contains("bound to uids"), "{e}");
        }
        let listed = books.list(&broker, t, None).count() == 1;
        assert_eq!(listed, expected, "{name} lists it");
        broker.disconnect(t);
    }
}
