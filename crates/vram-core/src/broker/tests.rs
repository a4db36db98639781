use proptest::prelude::*;

use super::*;

fn req(name: &str, class: &str, guarantee: u64, limit: u64) -> TenantRequest {
    TenantRequest {
        name: name.to_string(),
        class: Some(class.to_string()),
        guarantee: Some(Bytes::gib(guarantee)),
        limit: Some(Bytes::gib(limit)),
        pid: 1,
        uid: 0,
        gids: vec![0],
    }
}

/// The default classes; uid 0, which the tests connect as, may ask for `high`.
fn policy(capacity: Bytes) -> Policy {
    let mut p = Policy::with_capacity(capacity);
    p.classes.get_mut("high").unwrap().users = vec![0];
    p
}

fn broker(capacity_gib: u64) -> Broker {
    let mut p = policy(Bytes::gib(capacity_gib));
    p.priority_reserve = Bytes::ZERO;
    Broker::new(p).unwrap()
}

#[test]
fn guarantees_never_exceed_capacity() {
    let mut b = broker(16);
    b.connect(req("a", "high", 10, 16)).unwrap();
    let err = b.connect(req("b", "normal", 8, 16)).unwrap_err();
    assert!(
        matches!(err, AdmissionError::GuaranteeUnavailable { free, .. } if free == Bytes::gib(6))
    );
    assert!(
        err.to_string()
            .contains("only 6 GiB of the device's 16 GiB"),
        "{err}"
    );
    b.connect(req("b", "normal", 6, 16)).unwrap();
}

#[test]
fn a_guarantee_above_the_device_says_the_capacity_and_one_above_a_limit_the_limit() {
    let mut b = broker(16);
    let mut r = req("big", "normal", 99, 16);
    r.limit = None;
    let e = b.connect(r).unwrap_err().to_string();
    assert!(e.contains("99 GiB, more than the device's 16 GiB"), "{e}");
    let e = b
        .connect(req("capped", "normal", 8, 4))
        .unwrap_err()
        .to_string();
    assert!(e.contains("8 GiB above its limit of 4 GiB"), "{e}");
}

#[test]
fn borrower_cannot_take_a_guarantee() {
    let mut b = broker(16);
    let t = b.connect(req("trainer", "high", 8, 16)).unwrap();
    let x = b.connect(req("x", "low", 0, 16)).unwrap();
    b.grant(x, Bytes::gib(8)).unwrap();
    let err = b.grant(x, Bytes::gib(1)).unwrap_err();
    assert_eq!(err.reason(), "device_full");
    // The trainer is below its guarantee: never refused.
    b.grant(t, Bytes::gib(8)).unwrap();
    assert_eq!(b.free(), Bytes::ZERO);
    assert_eq!(b.tenant(x).unwrap().refusals["device_full"], 1);
}

#[test]
fn limit_is_enforced_with_numbers() {
    let mut b = broker(64);
    let t = b.connect(req("trainer", "normal", 0, 20)).unwrap();
    b.grant(t, Bytes::gib(18)).unwrap();
    let err = b.grant(t, Bytes::gib(4)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "tenant `trainer` asked for 4 GiB; its limit is 20 GiB and it holds 18 GiB"
    );
}

#[test]
fn name_in_use_and_unknown_class_are_refused() {
    let mut b = broker(16);
    b.connect(req("a", "normal", 0, 1)).unwrap();
    assert!(matches!(
        b.connect(req("a", "normal", 0, 1)),
        Err(AdmissionError::NameInUse { .. })
    ));
    assert!(matches!(
        b.connect(req("c", "platinum", 0, 1)),
        Err(AdmissionError::UnknownClass { .. })
    ));
    assert!(matches!(
        b.connect(req("bad name", "normal", 0, 1)),
        Err(AdmissionError::BadName { .. })
    ));
}

#[test]
fn priority_reserve_refuses_low_priority_borrowers_first() {
    let mut p = policy(Bytes::gib(16));
    p.priority_reserve = Bytes::gib(2);
    let mut b = Broker::new(p).unwrap();
    let hi = b.connect(req("hi", "high", 0, 16)).unwrap();
    let lo = b.connect(req("lo", "low", 0, 16)).unwrap();
    b.grant(lo, Bytes::gib(13)).unwrap();
    assert_eq!(
        b.grant(lo, Bytes::gib(2)).unwrap_err().reason(),
        "priority_reserve"
    );
    b.grant(hi, Bytes::gib(3)).unwrap();
}

#[test]
fn declared_tenants_reserve_their_guarantee_while_offline() {
    let mut p = policy(Bytes::gib(16));
    p.tenants.insert(
        "trainer".into(),
        DeclaredTenant {
            class: "high".into(),
            guarantee: Bytes::gib(10),
            limit: None,
            owners: Vec::new(),
            groups: Vec::new(),
        },
    );
    let mut b = Broker::new(p).unwrap();
    let x = b.connect(req("x", "low", 0, 16)).unwrap();
    assert_eq!(b.free(), Bytes::gib(6));
    assert!(b.grant(x, Bytes::gib(7)).is_err());
    // The declaration wins over what the process asks for.
    let t = b.connect(req("trainer", "low", 1, 16)).unwrap();
    let tt = b.tenant(t).unwrap();
    assert_eq!((tt.class.as_str(), tt.guarantee), ("high", Bytes::gib(10)));
}

/// A declared tenant without a limit of its own takes its class's `default_limit`, at connect
/// and when a reload declares it; with neither, the whole device.
#[test]
fn a_declared_tenant_without_a_limit_takes_its_classs_default() {
    let declared = |class: &str| DeclaredTenant {
        class: class.into(),
        guarantee: Bytes::gib(1),
        limit: None,
        owners: Vec::new(),
        groups: Vec::new(),
    };
    let mut p = policy(Bytes::gib(16));
    p.classes.get_mut("low").unwrap().default_limit = Some(Bytes::gib(4));
    p.tenants.insert("small".into(), declared("low"));
    p.tenants.insert("big".into(), declared("normal"));
    let mut b = Broker::new(p.clone()).unwrap();
    let small = b.connect(req("small", "low", 0, 16)).unwrap();
    let big = b.connect(req("big", "normal", 0, 16)).unwrap();
    assert_eq!(b.tenant(small).unwrap().limit, Bytes::gib(4));
    assert_eq!(b.tenant(big).unwrap().limit, Bytes::gib(16));
    assert!(b.grant(small, Bytes::gib(5)).is_err());

    // Declared by a reload while connected: the class's limit applies from then on.
    let other = b.connect(req("other", "low", 0, 16)).unwrap();
    assert_eq!(b.tenant(other).unwrap().limit, Bytes::gib(16));
    p.tenants.insert("other".into(), declared("low"));
    b.replace_policy(p).unwrap();
    assert_eq!(b.tenant(other).unwrap().limit, Bytes::gib(4));

    // A guarantee above the class's limit is an error of the configuration.
    let mut bad = policy(Bytes::gib(16));
    bad.classes.get_mut("low").unwrap().default_limit = Some(Bytes::gib(4));
    bad.tenants.insert(
        "greedy".into(),
        DeclaredTenant {
            guarantee: Bytes::gib(8),
            ..declared("low")
        },
    );
    assert!(Broker::new(bad).is_err());
}

#[test]
fn reclaim_plan_asks_lowest_priority_cache_first() {
    let mut b = broker(16);
    let hi = b.connect(req("hi", "high", 0, 16)).unwrap();
    let lo = b.connect(req("lo", "low", 0, 16)).unwrap();
    let mid = b.connect(req("mid", "normal", 0, 16)).unwrap();
    b.grant(lo, Bytes::gib(6)).unwrap();
    b.grant(mid, Bytes::gib(6)).unwrap();
    b.report_usage(lo, Bytes::gib(2), Bytes::gib(4));
    b.report_usage(mid, Bytes::gib(1), Bytes::gib(5));
    // 4 GiB is free; 4 GiB more must come back, from the lowest priority first.
    let plan = b.reclaim_plan(hi, Bytes::gib(8), &|_| false);
    assert_eq!(
        plan,
        vec![ReclaimAsk {
            tenant: lo,
            bytes: Bytes::gib(4)
        }]
    );
    let plan = b.reclaim_plan(hi, Bytes::gib(11), &|_| false);
    assert_eq!(
        plan,
        vec![
            ReclaimAsk {
                tenant: lo,
                bytes: Bytes::gib(4)
            },
            ReclaimAsk {
                tenant: mid,
                bytes: Bytes::gib(3)
            },
        ]
    );
    // A tenant the daemon says cannot answer now is left out: the next is asked instead.
    let plan = b.reclaim_plan(hi, Bytes::gib(8), &|t| t == lo);
    assert_eq!(
        plan,
        vec![ReclaimAsk {
            tenant: mid,
            bytes: Bytes::gib(4)
        }]
    );
    // Nothing to ask when the request would be over the limit anyway.
    assert!(b.reclaim_plan(hi, Bytes::gib(17), &|_| false).is_empty());
}

#[derive(Debug, Clone)]
enum Op {
    Connect {
        class: u8,
        guarantee: u64,
        limit: u64,
    },
    Grant {
        who: usize,
        mib: u64,
    },
    Release {
        who: usize,
        mib: u64,
    },
    Report {
        who: usize,
        cached: u64,
    },
    Disconnect {
        who: usize,
    },
    Charge {
        who: usize,
        mib: u64,
    },
    Uncharge {
        who: usize,
        mib: u64,
    },
    /// A driver reading: what a tenant's process holds beyond its books.
    TenantOutside {
        who: usize,
        mib: u64,
    },
    /// A driver reading: memory no tenant holds.
    OutsideUse {
        mib: u64,
    },
}

#[test]
fn charges_count_against_the_limit_like_grants() {
    let mut b = broker(64);
    let t = b.connect(req("nccl", "normal", 0, 4)).unwrap();
    b.grant(t, Bytes::gib(3)).unwrap();
    let err = b.charge(t, Bytes::gib(2)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "tenant `nccl` asked for 2 GiB; its limit is 4 GiB and it holds 3 GiB"
    );
    b.charge(t, Bytes::gib(1)).unwrap();
    assert_eq!(b.tenant(t).unwrap().total(), Bytes::gib(4));
    assert_eq!(b.uncharge(t, Bytes::gib(8)), Bytes::gib(1));
    assert_eq!(b.tenant(t).unwrap().charged, Bytes::ZERO);
    b.count_refusal(t, "over_limit");
    assert_eq!(b.tenant(t).unwrap().refusals["over_limit"], 2);
}

#[test]
fn a_tenants_context_fills_its_guarantee_and_counts_against_its_limit() {
    let mut b = broker(16);
    let t = b.connect(req("torch", "normal", 4, 4)).unwrap();
    b.set_tenant_outside(t, Bytes::mib(512));
    let err = b.grant(t, Bytes::gib(4)).unwrap_err();
    assert_eq!(err.reason(), "over_limit");
    b.grant(t, Bytes::mib(3584)).unwrap();
    // Its guarantee is filled, so nothing more is reserved for it.
    assert_eq!(b.snapshot().reserved, Bytes::ZERO);
    assert_eq!(b.free(), Bytes::gib(12));
}

#[test]
fn outside_use_is_not_lent_and_a_broken_promise_is_named() {
    let mut b = broker(16);
    let g = b.connect(req("guaranteed", "high", 10, 16)).unwrap();
    let x = b.connect(req("borrower", "low", 0, 16)).unwrap();
    b.grant(x, Bytes::gib(4)).unwrap();
    b.report_usage(x, Bytes::gib(1), Bytes::gib(3));
    b.set_outside_use(Bytes::gib(1));
    assert_eq!(b.free(), Bytes::gib(1));
    assert!(b.at_risk().is_empty());
    // A process vramd did not start takes 4 GiB more: 3 GiB of the guarantee cannot be met.
    b.set_outside_use(Bytes::gib(5));
    assert_eq!(b.deficit(), Bytes::gib(3));
    let risk = b.at_risk();
    assert_eq!(risk.len(), 1);
    assert_eq!(risk[0].tenant, "guaranteed");
    assert_eq!(risk[0].unfilled, Bytes::gib(10));
    // No more borrowing; the borrower is asked for its idle memory.
    assert_eq!(
        b.grant(x, Bytes::mib(2)).unwrap_err().reason(),
        "device_full"
    );
    assert_eq!(
        b.deficit_plan(),
        vec![ReclaimAsk {
            tenant: x,
            bytes: Bytes::gib(3)
        }]
    );
    // The guaranteed tenant is still granted what it was promised, as far as the books go.
    b.grant(g, Bytes::gib(2)).unwrap();
    b.release(x, Bytes::gib(3));
    assert_eq!(b.deficit(), Bytes::ZERO);
    assert!(b.at_risk().is_empty());
}

fn as_uid(name: &str, class: &str, uid: u32) -> TenantRequest {
    TenantRequest {
        uid,
        guarantee: None,
        limit: None,
        ..req(name, class, 0, 0)
    }
}

#[test]
fn a_declared_tenant_is_its_owners_alone() {
    let mut p = policy(Bytes::gib(16));
    p.tenants.insert(
        "prod".into(),
        DeclaredTenant {
            class: "high".into(),
            guarantee: Bytes::gib(4),
            limit: None,
            owners: vec![1001],
            groups: vec![2000],
        },
    );
    let mut b = Broker::new(p).unwrap();
    let err = b.connect(as_uid("prod", "low", 1002)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "uid 1002 (groups [0]) may not connect as tenant `prod`: its declaration names owners \
         [1001] and groups [2000] (tenants.prod.owners, tenants.prod.groups)"
    );
    let id = b.connect(as_uid("prod", "low", 1001)).unwrap();
    // Its owner gets the declared class, whatever it asked for.
    assert_eq!(b.tenant(id).unwrap().class, "high");
    b.disconnect(id);
    // A member of an owning group, by a supplementary group.
    let member = TenantRequest {
        gids: vec![1003, 2000],
        ..as_uid("prod", "low", 1003)
    };
    b.connect(member).unwrap();
}

#[test]
fn a_class_above_the_default_is_for_its_users_and_groups() {
    let mut p = policy(Bytes::gib(16));
    p.classes.get_mut("high").unwrap().groups = vec![2000];
    let mut b = Broker::new(p).unwrap();
    b.connect(as_uid("x", "high", 1002)).unwrap_err();
    let member = TenantRequest {
        gids: vec![1002, 2000],
        ..as_uid("x", "high", 1002)
    };
    let id = b.connect(member).unwrap();
    assert_eq!(b.tenant(id).unwrap().class, "high");
}

#[test]
fn a_new_policy_names_the_tenants_it_no_longer_admits() {
    let mut p = policy(Bytes::gib(16));
    p.classes.get_mut("high").unwrap().users = vec![1002];
    let mut b = Broker::new(p.clone()).unwrap();
    let x = b.connect(as_uid("x", "high", 1002)).unwrap();
    let y = b.connect(as_uid("y", "normal", 1002)).unwrap();
    assert!(b.breaking_rules().is_empty());
    p.classes.get_mut("high").unwrap().users.clear();
    p.tenants.insert(
        "y".into(),
        DeclaredTenant {
            class: "normal".into(),
            guarantee: Bytes::ZERO,
            limit: None,
            owners: vec![1001],
            groups: Vec::new(),
        },
    );
    b.replace_policy(p).unwrap();
    let breaking: Vec<(TenantId, String)> = b
        .breaking_rules()
        .into_iter()
        .map(|(id, e)| (id, e.to_string()))
        .collect();
    assert_eq!(breaking.len(), 2, "{breaking:?}");
    assert!(breaking[0].0 == x && breaking[0].1.contains("classes.high.users"));
    assert!(breaking[1].0 == y && breaking[1].1.contains("tenants.y.owners"));
}

#[test]
fn only_the_listed_uids_may_rank_above_the_default_class() {
    let mut b = broker(16);
    let err = b.connect(as_uid("x", "high", 1002)).unwrap_err();
    assert!(
        matches!(err, AdmissionError::ClassNotAllowed { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("classes.high.users"), "{err}");
    // The default class and those below it are anyone's.
    b.connect(as_uid("y", "normal", 1002)).unwrap();
    b.connect(as_uid("z", "low", 1002)).unwrap();
    b.connect(as_uid("w", "high", 0)).unwrap();
}

/// A reload that changes `[users]` says so, and names each connected uid over its new limits.
#[test]
fn a_reload_names_user_limits_it_changes_and_uids_over_them() {
    let mut p = policy(Bytes::gib(64));
    p.priority_reserve = Bytes::ZERO;
    let mut b = Broker::new(p.clone()).unwrap();
    let a = b.connect(as_uid("a", "normal", 1001)).unwrap();
    b.connect(as_uid("c", "normal", 1001)).unwrap();
    b.grant(a, Bytes::gib(3)).unwrap();
    p.users.insert(
        1001,
        UserLimits {
            max_memory: Some(Bytes::gib(2)),
            max_tenants: Some(1),
        },
    );
    let changes = b.replace_policy(p.clone()).unwrap().join("\n");
    assert!(
        changes.contains("users.1001: users.default → max_memory 2 GiB, max_tenants 1"),
        "{changes}"
    );
    assert!(
        changes.contains("uid 1001 holds 3 GiB, above its new max_memory 2 GiB"),
        "{changes}"
    );
    assert!(
        changes.contains("uid 1001 has 2 tenants connected, above its new max_tenants 1"),
        "{changes}"
    );
    p.default_user.max_tenants = Some(4);
    let changes = b.replace_policy(p).unwrap().join("\n");
    assert_eq!(
        changes,
        "users.default: max_memory none, max_tenants none → max_memory none, max_tenants 4"
    );
}

#[test]
fn a_uids_tenants_share_its_limits() {
    let mut p = policy(Bytes::gib(64));
    p.priority_reserve = Bytes::ZERO;
    p.users.insert(
        1001,
        UserLimits {
            max_memory: Some(Bytes::gib(2)),
            max_tenants: Some(2),
        },
    );
    let mut b = Broker::new(p).unwrap();
    let a = b.connect(as_uid("a", "normal", 1001)).unwrap();
    let c = b.connect(as_uid("c", "normal", 1001)).unwrap();
    let err = b.connect(as_uid("d", "normal", 1001)).unwrap_err();
    assert!(err.to_string().contains("users.1001.max_tenants"), "{err}");
    b.grant(a, Bytes::gib(1)).unwrap();
    b.grant(c, Bytes::mib(768)).unwrap();
    let err = b.grant(c, Bytes::mib(512)).unwrap_err();
    assert_eq!(err.reason(), "user_limit");
    assert_eq!(
        err.to_string(),
        "tenant `c` asked for 512 MiB; uid 1001's tenants hold 1.8 GiB of its 2 GiB \
         (users.1001.max_memory)"
    );
    // Other uids are not limited by it.
    let o = b.connect(as_uid("o", "normal", 1002)).unwrap();
    b.grant(o, Bytes::gib(8)).unwrap();
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..3, 0u64..6, 0u64..20).prop_map(|(class, guarantee, limit)| Op::Connect {
            class,
            guarantee,
            limit
        }),
        (0usize..8, 1u64..8192).prop_map(|(who, mib)| Op::Grant { who, mib }),
        (0usize..8, 1u64..8192).prop_map(|(who, mib)| Op::Release { who, mib }),
        (0usize..8, 0u64..8192).prop_map(|(who, cached)| Op::Report { who, cached }),
        (0usize..8).prop_map(|who| Op::Disconnect { who }),
        (0usize..8, 1u64..4096).prop_map(|(who, mib)| Op::Charge { who, mib }),
        (0usize..8, 1u64..4096).prop_map(|(who, mib)| Op::Uncharge { who, mib }),
        (0usize..8, 0u64..1024).prop_map(|(who, mib)| Op::TenantOutside { who, mib }),
        (0u64..8192).prop_map(|mib| Op::OutsideUse { mib }),
    ]
}

proptest! {
    #[test]
    fn invariants_hold_for_any_sequence(ops in prop::collection::vec(op(), 1..200)) {
        let mut p = policy(Bytes::gib(16));
        p.priority_reserve = Bytes::mib(512);
        let mut b = Broker::new(p).unwrap();
        let mut live: Vec<TenantId> = Vec::new();
        let mut n = 0;
        for op in ops {
            match op {
                Op::Connect { class, guarantee, limit } => {
                    n += 1;
                    let class = ["high", "normal", "low"][class as usize];
                    if let Ok(id) = b.connect(req(&format!("t{n}"), class, guarantee, limit)) {
                        live.push(id);
                    }
                }
                Op::Grant { who, mib } | Op::Charge { who, mib } if !live.is_empty() => {
                    let id = live[who % live.len()];
                    let t = b.tenant(id).unwrap().clone();
                    let asked = Bytes::mib(mib);
                    let in_deficit = b.deficit() > Bytes::ZERO;
                    let r = if matches!(op, Op::Grant { .. }) {
                        b.grant(id, asked)
                    } else {
                        b.charge(id, asked)
                    };
                    // A tenant staying within its guarantee is never refused.
                    if t.total() + asked <= t.guarantee {
                        prop_assert!(r.is_ok(), "below guarantee refused: {:?}", r);
                    }
                    // While outside use breaks a promise, nobody borrows.
                    if in_deficit && t.total() + asked > t.guarantee {
                        prop_assert!(r.is_err(), "borrowed during a deficit");
                    }
                    // What a grant books keeps the invariant unless the world already broke it.
                    if r.is_ok() && !in_deficit {
                        prop_assert!(b.committed() <= b.capacity());
                    }
                }
                Op::Uncharge { who, mib } if !live.is_empty() => {
                    let id = live[who % live.len()];
                    b.uncharge(id, Bytes::mib(mib));
                }
                Op::TenantOutside { who, mib } if !live.is_empty() => {
                    let id = live[who % live.len()];
                    b.set_tenant_outside(id, Bytes::mib(mib));
                }
                Op::OutsideUse { mib } => b.set_outside_use(Bytes::mib(mib)),
                Op::Release { who, mib } if !live.is_empty() => {
                    let id = live[who % live.len()];
                    b.release(id, Bytes::mib(mib));
                }
                Op::Report { who, cached } if !live.is_empty() => {
                    let id = live[who % live.len()];
                    b.report_usage(id, Bytes::ZERO, Bytes::mib(cached));
                }
                Op::Disconnect { who } if !live.is_empty() => {
                    let id = live.remove(who % live.len());
                    prop_assert!(b.disconnect(id).is_some());
                }
                _ => {}
            }
            for (_, t) in b.tenants() {
                let booked = t.held + t.charged;
                prop_assert!(booked <= t.limit, "{} holds {} over limit {}", t.name, booked, t.limit);
                prop_assert!(t.guarantee <= t.limit);
            }
            prop_assert!(b.held() <= b.capacity());
            // The deficit is exactly what the promises exceed the capacity by.
            prop_assert_eq!(b.deficit(), b.committed().saturating_sub(b.capacity()));
            if b.deficit() == Bytes::ZERO {
                prop_assert!(b.at_risk().is_empty());
            }
        }
        b.set_outside_use(Bytes::ZERO);
        for id in live {
            b.disconnect(id);
        }
        prop_assert_eq!(b.held(), Bytes::ZERO);
        prop_assert_eq!(b.free(), b.capacity());
    }
}

#[test]
fn kept_memory_follows_its_tenant_across_connections_and_stays_committed() {
    let mut p = policy(Bytes::gib(8));
    p.priority_reserve = Bytes::ZERO;
    let mut b = Broker::new(p).unwrap();
    let kept_req = || TenantRequest {
        limit: Some(Bytes::gib(2)),
        ..as_uid("k", "normal", 7)
    };
    let a = b.connect(kept_req()).unwrap();
    b.grant(a, Bytes::gib(2)).unwrap();
    b.release(a, Bytes::gib(2));
    b.add_kept("k", 7, Bytes::gib(2));
    assert!(matches!(
        b.grant(a, Bytes::mib(2)),
        Err(GrantError::OverLimit { .. })
    ));
    b.disconnect(a);
    assert_eq!(b.free(), Bytes::gib(6), "kept memory stays committed");
    // The same name of another uid starts clean; the same name and uid start with it.
    let other = b
        .connect(TenantRequest {
            limit: Some(Bytes::gib(2)),
            ..as_uid("k2", "normal", 8)
        })
        .unwrap();
    assert_eq!(b.tenant(other).unwrap().kept, Bytes::ZERO);
    let again = b.connect(kept_req()).unwrap();
    assert_eq!(b.tenant(again).unwrap().kept, Bytes::gib(2));
    b.take_kept("k", 7, Bytes::gib(2));
    assert_eq!(b.free(), Bytes::gib(8));
    b.grant(again, Bytes::gib(2)).unwrap();
}
