//! The daemon's books checked against the driver's reading of one device.
//!
//! The driver (NVML) reports the device's used memory and, per process, what it attributes to that
//! process. What the driver attributes to whom:
//! - memory the daemon creates (grants, pool, memory in flight) is attributed to no process: the
//!   daemon has no CUDA context and is not listed, and a tenant that imports a handle is not
//!   charged for it;
//! - a tenant is listed with its CUDA context and with memory it creates itself (which it reports
//!   to the daemon, which books it as the tenant's `charged` memory);
//! - a process that is not a tenant is listed with all it holds;
//! - processes the driver cannot show (other pid namespaces) and the driver's own overhead are in
//!   the device's used memory and under no process.
//!
//! So `used ≈ created + Σ listed`, and [`reconcile`] splits the device's used memory into what the
//! books account for and what lies outside them. Pure: the caller reads the driver and passes the
//! reading in. All arithmetic saturates: no input makes it wrap or panic.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::broker::TenantId;
use crate::Bytes;

/// One reading of a device from the driver.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverReading {
    /// The device's installed memory.
    pub total: Bytes,
    /// Memory the driver sets aside for itself (not in `used`; 0 where the driver does not say).
    pub reserved: Bytes,
    /// Memory allocated on the device, by anyone.
    pub used: Bytes,
    /// Of `used`, what the driver may hold for itself that no process accounts for (its overhead
    /// at start, and room for the page tables and context state that grow as tenants map
    /// memory): not counted as outside use.
    pub allowance: Bytes,
    /// Processes the driver lists on the device.
    pub processes: Vec<ProcessUse>,
}

/// One process the driver lists on a device.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessUse {
    pub pid: u32,
    /// What the driver attributes to the process; `None` where the driver does not know.
    pub used: Option<Bytes>,
    /// The process's command name; empty where it could not be read.
    pub name: String,
}

/// A tenant as the books have it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BooksTenant {
    pub id: TenantId,
    /// The connected process's pid (one tenant is one process).
    pub pid: u32,
    pub name: String,
    /// Memory the daemon granted the tenant and it has not returned.
    pub held: Bytes,
    /// Memory the tenant created itself and reported to the daemon.
    pub charged: Bytes,
    pub guarantee: Bytes,
}

/// The daemon's books for one device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Books {
    pub daemon_pid: u32,
    /// Physical memory the daemon created and has not released: grants, pool, memory in flight.
    pub created: Bytes,
    pub tenants: Vec<BooksTenant>,
}

impl Books {
    /// The books over a span: `self` read before a driver reading, `later` after it. Memory made
    /// or charged in between may be in the reading, so each figure is the larger of the two
    /// (every tenant of either, matched by id, with its later pid): memory the books made is never
    /// taken for outside use. Memory released in between shows as surplus for one reading, which
    /// is only logged.
    pub fn spanning(&self, later: &Books) -> Books {
        let mut tenants = self.tenants.clone();
        for t in &later.tenants {
            match tenants.iter_mut().find(|u| u.id == t.id) {
                Some(u) => {
                    u.held = u.held.max(t.held);
                    u.charged = u.charged.max(t.charged);
                    // A program that joined its tenant in between is the tenant's process now,
                    // and the reading lists it (`vramd run`'s own process has no context).
                    u.pid = t.pid;
                }
                None => tenants.push(t.clone()),
            }
        }
        Books {
            daemon_pid: self.daemon_pid,
            created: self.created.max(later.created),
            tenants,
        }
    }
}

/// A process on the device that is neither a tenant nor the daemon.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutsideProcess {
    pub pid: u32,
    pub name: String,
    /// What the driver attributes to it; `None` where the driver does not know (counted as 0).
    pub bytes: Option<Bytes>,
}

/// The device's used memory split against the books. See [`reconcile`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reconciled {
    /// Per tenant, in the books' order: the driver's figure for its pid less what it charged (its
    /// context, anything it made that was not reported); 0 when the driver does not list it.
    pub tenant_outside: Vec<(TenantId, Bytes)>,
    /// Processes that are neither tenants nor the daemon, by pid.
    pub outside_processes: Vec<OutsideProcess>,
    /// Used memory that neither the books nor any listed process account for (processes the
    /// driver cannot show, driver overhead), floored at 0.
    pub unattributed: Bytes,
    /// `Σ outside_processes + the daemon's own figure + unattributed`: memory the broker must
    /// not lend. The daemon's own figure is its CUDA context (made once it reads shared buffers),
    /// which no capacity measured before it left out; where the daemon's pid is a tenant's (a
    /// daemon in process), the figure is that tenant's.
    pub outside_use: Bytes,
    /// The driver's figure for the daemon's own pid; 0 when not listed.
    pub daemon_own: Bytes,
    /// How much more the books and the listed processes account for than the driver shows used
    /// (0 when not more). Memory counted twice, e.g. by a driver that attributes imported memory
    /// to the importer: a sign to log.
    pub surplus: Bytes,
}

impl Reconciled {
    /// Everything on the device the books do not account for: `outside_use` (the daemon's own
    /// figure in it) and the tenants' memory beyond what they charged.
    pub fn not_in_books(&self) -> Bytes {
        let tenants = sum(self.tenant_outside.iter().map(|(_, b)| *b));
        self.outside_use.saturating_add(tenants)
    }
}

/// Splits `reading` against `books`.
///
/// A pid the driver lists twice counts once, with its larger figure. A tenant's process counts in
/// the accounted total with `max(its figure, what its tenants charged)`: charged memory is on the
/// device whether the driver lists it under the tenant's pid or under none, so it is never
/// counted twice nor left in `unattributed`. Then `unattributed = used − created − accounted −
/// allowance` and `surplus = created + accounted − used`, each floored at 0.
pub fn reconcile(books: &Books, reading: &DriverReading) -> Reconciled {
    let listed = by_pid(&reading.processes);
    let figure = |pid: u32| -> Bytes { listed.get(&pid).and_then(|p| p.used).unwrap_or_default() };

    let tenant_pids: BTreeSet<u32> = books.tenants.iter().map(|t| t.pid).collect();
    // One process may be several tenants (one connection each): the driver's figure for its pid
    // covers all of them, so it is counted once, against the sum of their charges.
    let mut charged_by_pid: BTreeMap<u32, Bytes> = BTreeMap::new();
    for t in &books.tenants {
        let e = charged_by_pid.entry(t.pid).or_default();
        *e = e.saturating_add(t.charged);
    }
    // The pid's memory beyond its charges is its first tenant's (in the books' order), so that
    // a context is one tenant's outside memory, not each of them.
    let mut outside_given: BTreeSet<u32> = BTreeSet::new();
    let tenant_outside: Vec<(TenantId, Bytes)> = books
        .tenants
        .iter()
        .map(|t| {
            let bytes = if outside_given.insert(t.pid) {
                figure(t.pid).saturating_sub(charged_by_pid[&t.pid])
            } else {
                Bytes::ZERO
            };
            (t.id, bytes)
        })
        .collect();
    let tenants_accounted: BTreeMap<u32, Bytes> = charged_by_pid
        .iter()
        .map(|(&pid, &charged)| (pid, figure(pid).max(charged)))
        .collect();

    let daemon_own = figure(books.daemon_pid);
    let outside_processes: Vec<OutsideProcess> = listed
        .values()
        .filter(|p| p.pid != books.daemon_pid && !tenant_pids.contains(&p.pid))
        .map(|p| OutsideProcess {
            pid: p.pid,
            name: p.name.clone(),
            bytes: p.used,
        })
        .collect();
    let outside_listed = sum(outside_processes
        .iter()
        .map(|p| p.bytes.unwrap_or_default()));

    let daemon_outside = if tenant_pids.contains(&books.daemon_pid) {
        Bytes::ZERO
    } else {
        daemon_own
    };
    let accounted = books
        .created
        .saturating_add(sum(tenants_accounted.values().copied()))
        .saturating_add(daemon_outside)
        .saturating_add(outside_listed);
    let unattributed = reading
        .used
        .saturating_sub(accounted)
        .saturating_sub(reading.allowance);
    let surplus = accounted.saturating_sub(reading.used);

    Reconciled {
        tenant_outside,
        outside_processes,
        unattributed,
        outside_use: outside_listed
            .saturating_add(daemon_outside)
            .saturating_add(unattributed),
        daemon_own,
        surplus,
    }
}

/// Whether `now` differs from `prev` enough to log: a tenant or outside process appeared or went,
/// a process's figure became known or unknown, or any figure moved by at least `threshold` (the
/// device's granularity, say). Figures that move by less are reading noise.
pub fn changed(prev: &Reconciled, now: &Reconciled, threshold: Bytes) -> bool {
    let moved = |a: Bytes, b: Bytes| a.max(b).saturating_sub(a.min(b)) >= threshold.max(Bytes(1));
    let tenants = |r: &Reconciled| {
        r.tenant_outside
            .iter()
            .map(|(id, _)| *id)
            .collect::<Vec<_>>()
    };
    let pids = |r: &Reconciled| {
        r.outside_processes
            .iter()
            .map(|p| p.pid)
            .collect::<Vec<_>>()
    };
    if tenants(prev) != tenants(now) || pids(prev) != pids(now) {
        return true;
    }
    let tenant_moved = prev
        .tenant_outside
        .iter()
        .zip(&now.tenant_outside)
        .any(|((_, a), (_, b))| moved(*a, *b));
    let process_moved = prev
        .outside_processes
        .iter()
        .zip(&now.outside_processes)
        .any(|(a, b)| match (a.bytes, b.bytes) {
            (Some(x), Some(y)) => moved(x, y),
            (None, None) => false,
            _ => true,
        });
    tenant_moved
        || process_moved
        || moved(prev.unattributed, now.unattributed)
        || moved(prev.outside_use, now.outside_use)
        || moved(prev.daemon_own, now.daemon_own)
        || moved(prev.surplus, now.surplus)
}

/// The listed processes by pid, a pid listed twice kept with its larger figure (a known figure
/// wins over an unknown one) and its first non-empty name.
fn by_pid(processes: &[ProcessUse]) -> BTreeMap<u32, ProcessUse> {
    let mut out: BTreeMap<u32, ProcessUse> = BTreeMap::new();
    for p in processes {
        match out.get_mut(&p.pid) {
            None => {
                out.insert(p.pid, p.clone());
            }
            Some(seen) => {
                seen.used = seen.used.max(p.used);
                if seen.name.is_empty() {
                    seen.name = p.name.clone();
                }
            }
        }
    }
    out
}

fn sum(it: impl Iterator<Item = Bytes>) -> Bytes {
    it.fold(Bytes::ZERO, Bytes::saturating_add)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const DAEMON: u32 = 100;

    fn gib_f(x: f64) -> Bytes {
        Bytes((x * Bytes::GIB as f64) as u64)
    }

    fn tenant(id: u64, pid: u32, held: Bytes, charged: Bytes) -> BooksTenant {
        BooksTenant {
            id: TenantId(id),
            pid,
            name: format!("t{id}"),
            held,
            charged,
            guarantee: Bytes::ZERO,
        }
    }

    fn process(pid: u32, used: Option<Bytes>, name: &str) -> ProcessUse {
        ProcessUse {
            pid,
            used,
            name: name.to_owned(),
        }
    }

    fn reading(used: Bytes, processes: Vec<ProcessUse>) -> DriverReading {
        DriverReading {
            total: Bytes::gib(141),
            reserved: Bytes::ZERO,
            used,
            allowance: Bytes::ZERO,
            processes,
        }
    }

    #[test]
    fn tenant_listed_with_its_context_only() {
        // A tenant holding 6 GiB of the daemon's memory is listed with its context alone.
        let books = Books {
            daemon_pid: DAEMON,
            created: Bytes::gib(6),
            tenants: vec![tenant(1, 200, Bytes::gib(6), Bytes::ZERO)],
        };
        let r = reconcile(
            &books,
            &reading(gib_f(6.6), vec![process(200, Some(gib_f(0.6)), "python3")]),
        );
        assert_eq!(r.tenant_outside, vec![(TenantId(1), gib_f(0.6))]);
        assert!(r.outside_processes.is_empty());
        assert_eq!(r.unattributed, Bytes::ZERO);
        assert_eq!(r.outside_use, Bytes::ZERO);
        assert_eq!(r.daemon_own, Bytes::ZERO, "the daemon is not listed");
        assert_eq!(r.surplus, Bytes::ZERO);
        assert_eq!(r.not_in_books(), gib_f(0.6));
    }

    #[test]
    fn memory_made_while_the_driver_is_read_is_not_outside_use() {
        // A 2 GiB grant and a 1 GiB charge of a tenant land between the books read before the
        // driver's reading and the books read after it; the reading has them.
        let before = Books {
            daemon_pid: DAEMON,
            created: Bytes::gib(4),
            tenants: vec![tenant(1, 200, Bytes::gib(4), Bytes::ZERO)],
        };
        let after = Books {
            daemon_pid: DAEMON,
            created: Bytes::gib(6),
            tenants: vec![
                tenant(1, 200, Bytes::gib(6), Bytes::gib(1)),
                tenant(2, 300, Bytes::ZERO, Bytes::ZERO),
            ],
        };
        let read = reading(
            Bytes::gib(7),
            vec![process(200, Some(Bytes::gib(1)), "python3")],
        );
        let spanned = before.spanning(&after);
        assert_eq!(spanned.created, Bytes::gib(6));
        assert_eq!(spanned.tenants.len(), 2);
        let r = reconcile(&spanned, &read);
        assert_eq!(r.outside_use, Bytes::ZERO, "{r:?}");
        assert_eq!(
            r.tenant_outside,
            vec![(TenantId(1), Bytes::ZERO), (TenantId(2), Bytes::ZERO)]
        );
        // The books before alone take the new memory for outside use.
        assert_eq!(reconcile(&before, &read).outside_use, Bytes::gib(2));
    }

    #[test]
    fn a_program_that_joins_while_the_driver_is_read_is_its_tenants() {
        // `vramd run` (pid 10) is the tenant's process in the books before; the program it
        // started (pid 20), with its context, joins before the books after.
        let before = Books {
            daemon_pid: DAEMON,
            created: Bytes::ZERO,
            tenants: vec![tenant(1, 10, Bytes::ZERO, Bytes::ZERO)],
        };
        let after = Books {
            daemon_pid: DAEMON,
            created: Bytes::ZERO,
            tenants: vec![tenant(1, 20, Bytes::ZERO, Bytes::ZERO)],
        };
        let read = reading(
            Bytes::mib(512),
            vec![process(20, Some(Bytes::mib(512)), "python3")],
        );
        let r = reconcile(&before.spanning(&after), &read);
        assert_eq!(r.tenant_outside, vec![(TenantId(1), Bytes::mib(512))]);
        assert_eq!(r.outside_use, Bytes::ZERO, "{r:?}");
    }

    #[test]
    fn plain_process_is_outside_with_all_it_holds() {
        let books = Books {
            daemon_pid: DAEMON,
            created: Bytes::gib(6),
            tenants: vec![tenant(1, 200, Bytes::gib(6), Bytes::ZERO)],
        };
        let r = reconcile(
            &books,
            &reading(
                gib_f(16.6),
                vec![
                    process(200, Some(gib_f(0.6)), "python3"),
                    process(300, Some(Bytes::gib(10)), "torchrun"),
                ],
            ),
        );
        assert_eq!(
            r.outside_processes,
            vec![OutsideProcess {
                pid: 300,
                name: "torchrun".into(),
                bytes: Some(Bytes::gib(10)),
            }]
        );
        assert_eq!(r.unattributed, Bytes::ZERO);
        assert_eq!(r.outside_use, Bytes::gib(10));
        assert_eq!(r.surplus, Bytes::ZERO);
    }

    #[test]
    fn memory_under_no_listed_process_is_unattributed() {
        // A process in another pid namespace: in `used`, under no pid the driver shows.
        let books = Books {
            daemon_pid: DAEMON,
            created: Bytes::gib(6),
            tenants: vec![tenant(1, 200, Bytes::gib(4), Bytes::ZERO)],
        };
        let r = reconcile(
            &books,
            &reading(gib_f(9.6), vec![process(200, Some(gib_f(0.6)), "python3")]),
        );
        assert_eq!(r.unattributed, Bytes::gib(3));
        assert_eq!(r.outside_use, Bytes::gib(3));
        assert_eq!(r.surplus, Bytes::ZERO);
    }

    #[test]
    fn memory_counted_twice_is_surplus() {
        // A driver that attributes imported memory to the importer.
        let books = Books {
            daemon_pid: DAEMON,
            created: Bytes::gib(6),
            tenants: vec![tenant(1, 200, Bytes::gib(6), Bytes::ZERO)],
        };
        let r = reconcile(
            &books,
            &reading(gib_f(6.6), vec![process(200, Some(gib_f(6.6)), "python3")]),
        );
        assert_eq!(r.surplus, Bytes::gib(6));
        assert_eq!(r.unattributed, Bytes::ZERO);
        assert_eq!(r.tenant_outside, vec![(TenantId(1), gib_f(6.6))]);
    }

    #[test]
    fn charged_memory_counts_once_wherever_the_driver_lists_it() {
        let books = Books {
            daemon_pid: DAEMON,
            created: Bytes::gib(6),
            tenants: vec![tenant(1, 200, Bytes::gib(6), Bytes::gib(2))],
        };
        // Listed under the tenant's pid, with its context.
        let r = reconcile(
            &books,
            &reading(gib_f(8.6), vec![process(200, Some(gib_f(2.6)), "python3")]),
        );
        assert_eq!(r.tenant_outside, vec![(TenantId(1), gib_f(0.6))]);
        assert_eq!((r.unattributed, r.surplus), (Bytes::ZERO, Bytes::ZERO));
        // Listed under no pid: the charge still accounts for it; the context the driver did
        // not show under the pid is unattributed.
        let r = reconcile(
            &books,
            &reading(gib_f(8.6), vec![process(200, Some(gib_f(0.6)), "python3")]),
        );
        assert_eq!(r.tenant_outside, vec![(TenantId(1), Bytes::ZERO)]);
        assert_eq!(r.unattributed, gib_f(0.6));
        assert_eq!(r.surplus, Bytes::ZERO);
    }

    #[test]
    fn unknown_figures_count_as_zero_but_are_named() {
        let books = Books {
            daemon_pid: DAEMON,
            created: Bytes::gib(1),
            tenants: vec![tenant(1, 200, Bytes::gib(1), Bytes::ZERO)],
        };
        let r = reconcile(
            &books,
            &reading(
                Bytes::gib(2),
                vec![process(200, None, "python3"), process(300, None, "Xorg")],
            ),
        );
        assert_eq!(r.tenant_outside, vec![(TenantId(1), Bytes::ZERO)]);
        assert_eq!(r.outside_processes.len(), 1);
        assert_eq!(r.outside_processes[0].name, "Xorg");
        assert_eq!(r.outside_processes[0].bytes, None);
        assert_eq!(r.unattributed, Bytes::gib(1));
        assert_eq!(r.outside_use, Bytes::gib(1));
    }

    #[test]
    fn one_process_that_is_two_tenants_is_counted_once() {
        // Pid 200 is two tenants, each charging 1 GiB; the driver shows 2.5 GiB for it.
        let books = Books {
            daemon_pid: DAEMON,
            created: Bytes::ZERO,
            tenants: vec![
                tenant(1, 200, Bytes::ZERO, Bytes::gib(1)),
                tenant(2, 200, Bytes::ZERO, Bytes::gib(1)),
            ],
        };
        let r = reconcile(
            &books,
            &reading(gib_f(2.5), vec![process(200, Some(gib_f(2.5)), "python3")]),
        );
        assert_eq!(
            r.tenant_outside,
            vec![(TenantId(1), gib_f(0.5)), (TenantId(2), Bytes::ZERO)]
        );
        assert_eq!(r.unattributed, Bytes::ZERO);
        assert_eq!(r.surplus, Bytes::ZERO);
        assert_eq!(r.not_in_books(), gib_f(0.5));
    }

    #[test]
    fn daemon_and_duplicate_pids() {
        let books = Books {
            daemon_pid: DAEMON,
            created: Bytes::gib(1),
            tenants: vec![],
        };
        let r = reconcile(
            &books,
            &reading(
                Bytes::gib(4),
                vec![
                    process(DAEMON, Some(gib_f(0.5)), "vramd"),
                    process(300, None, ""),
                    process(300, Some(Bytes::gib(2)), "app"),
                    process(300, Some(Bytes::gib(1)), "app"),
                ],
            ),
        );
        assert_eq!(r.daemon_own, gib_f(0.5));
        assert_eq!(
            r.outside_processes,
            vec![OutsideProcess {
                pid: 300,
                name: "app".into(),
                bytes: Some(Bytes::gib(2)),
            }]
        );
        assert_eq!(r.unattributed, gib_f(0.5));
        // The daemon's own context is on the device as much as another process's memory: not
        // lent to anyone.
        assert_eq!(r.outside_use, Bytes::gib(3));
        assert_eq!(r.not_in_books(), Bytes::gib(3));
    }

    #[test]
    fn absurd_sizes_saturate() {
        let max = Bytes(u64::MAX);
        let books = Books {
            daemon_pid: DAEMON,
            created: max,
            tenants: vec![tenant(1, 200, max, max), tenant(2, 201, max, Bytes::ZERO)],
        };
        let r = reconcile(
            &books,
            &reading(
                max,
                vec![
                    process(200, Some(max), "a"),
                    process(201, Some(max), "b"),
                    process(300, Some(max), "c"),
                    process(301, Some(max), "d"),
                    process(DAEMON, Some(max), "vramd"),
                ],
            ),
        );
        assert_eq!(r.outside_use, max);
        assert_eq!(r.not_in_books(), max);
        assert_eq!(r.unattributed, Bytes::ZERO);
        let empty = Reconciled::default();
        assert!(changed(&empty, &r, max));
        assert!(!changed(&r, &r, Bytes::ZERO));
    }

    #[test]
    fn change_is_an_arrival_a_departure_or_a_move_past_the_threshold() {
        let books = Books {
            daemon_pid: DAEMON,
            created: Bytes::gib(6),
            tenants: vec![tenant(1, 200, Bytes::gib(6), Bytes::ZERO)],
        };
        let grain = Bytes::mib(2);
        let at = |used: Bytes, ctx: Bytes, others: Vec<ProcessUse>| {
            let mut p = vec![process(200, Some(ctx), "python3")];
            p.extend(others);
            reconcile(&books, &reading(used, p))
        };
        let base = at(gib_f(6.5), Bytes::mib(512), vec![]);
        assert!(!changed(&base, &base, grain));
        let small = at(gib_f(6.5) + Bytes::mib(1), Bytes::mib(512), vec![]);
        assert!(
            !changed(&base, &small, grain),
            "1 MiB is below the threshold"
        );
        let grown = at(gib_f(6.5) + Bytes::mib(2), Bytes::mib(514), vec![]);
        assert!(changed(&base, &grown, grain));
        let arrived = at(gib_f(6.5), Bytes::mib(512), vec![process(300, None, "x")]);
        assert!(changed(&base, &arrived, grain));
        assert!(changed(&arrived, &base, grain));
        let known = at(
            gib_f(6.5),
            Bytes::mib(512),
            vec![process(300, Some(Bytes(0)), "x")],
        );
        assert!(changed(&arrived, &known, grain));
        let gone = reconcile(
            &Books {
                tenants: vec![],
                ..books.clone()
            },
            &reading(gib_f(6.5), vec![]),
        );
        assert!(changed(&base, &gone, grain));
    }

    fn arb_books() -> impl Strategy<Value = (Books, DriverReading)> {
        let size = prop_oneof![0u64..(1 << 40), Just(u64::MAX), any::<u64>()].prop_map(Bytes);
        let pid = 0u32..8;
        (
            pid.clone(),
            size.clone(),
            prop::collection::vec((pid.clone(), size.clone(), size.clone()), 0..4),
            size.clone(),
            prop::collection::vec((pid, prop::option::of(size)), 0..8),
        )
            .prop_map(|(daemon_pid, created, tenants, used, processes)| {
                let books = Books {
                    daemon_pid,
                    created,
                    tenants: tenants
                        .into_iter()
                        .enumerate()
                        .map(|(i, (pid, held, charged))| tenant(i as u64, pid, held, charged))
                        .collect(),
                };
                let processes = processes
                    .into_iter()
                    .map(|(pid, used)| process(pid, used, "p"))
                    .collect();
                (books, reading(used, processes))
            })
    }

    proptest! {
        #[test]
        fn never_wraps_and_balances((books, reading) in arb_books()) {
            let r = reconcile(&books, &reading);
            prop_assert!(r.unattributed == Bytes::ZERO || r.surplus == Bytes::ZERO);
            prop_assert!(r.outside_use >= r.unattributed);
            prop_assert_eq!(r.tenant_outside.len(), books.tenants.len());
            prop_assert!(!changed(&r, &r, Bytes::ZERO));
            let _ = r.not_in_books();
            // With sizes small enough not to saturate, used + surplus is exactly what the books
            // and the listed processes account for, plus the unattributed rest.
            let small = |b: Bytes| b.get() < 1 << 40;
            let all_small = small(books.created)
                && small(reading.used)
                && books.tenants.iter().all(|t| small(t.charged))
                && reading.processes.iter().all(|p| p.used.is_none_or(small));
            if all_small {
                let listed = by_pid(&reading.processes);
                let fig = |pid: u32| listed.get(&pid).and_then(|p| p.used).unwrap_or_default().get();
                // A process counts with its figure or, if more, all its tenants charged.
                let mut charged: BTreeMap<u32, u64> = BTreeMap::new();
                for t in &books.tenants {
                    *charged.entry(t.pid).or_default() += t.charged.get();
                }
                let tenants: BTreeMap<u32, u64> =
                    charged.iter().map(|(&pid, &c)| (pid, fig(pid).max(c))).collect();
                let others: u64 = listed
                    .keys()
                    .filter(|pid| !tenants.contains_key(pid))
                    .map(|pid| fig(*pid))
                    .sum();
                let accounted = books.created.get() + tenants.values().sum::<u64>() + others;
                prop_assert_eq!(
                    reading.used.get() + r.surplus.get(),
                    accounted + r.unattributed.get()
                );
            }
        }
    }
}
