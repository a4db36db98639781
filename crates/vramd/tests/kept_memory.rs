//! Memory a tenant gave back stays booked to it while its process still reaches it: a kept
//! descriptor, a mapping left after the descriptor is closed, and descriptors kept across
//! reconnects all count against the tenant's limit, its uid's limits and the device, until they are
//! really gone (host backend, where the kernel tells the daemon).

use std::time::Duration;

use vram_client::{Client, ClientError, TenantOptions};
use vram_core::Bytes;
use vram_device::Access;

mod common;
use common::{wait_until, Daemon};

const CONFIG: &str = "capacity = \"256 MiB\"\nmetrics = \"off\"\n";

fn tenant(d: &Daemon, name: &str, limit: Bytes) -> Client {
    let opts = TenantOptions {
        limit: Some(limit),
        ..TenantOptions::named(name)
    };
    Client::connect(Some(&d.socket), &opts).unwrap()
}

fn kept_by(d: &Daemon, name: &str) -> Bytes {
    let s = d.status();
    let connected = s.tenants.iter().find(|t| t.name == name).map(|t| t.kept);
    let offline = s.devices[0]
        .kept_offline
        .iter()
        .find(|k| k.tenant == name)
        .map(|k| k.bytes);
    connected.or(offline).unwrap_or(Bytes::ZERO)
}

fn refusal_reason(e: ClientError) -> String {
    match e {
        ClientError::Daemon(e) => e.reason.unwrap_or_default(),
        other => panic!("expected a refusal, got {other}"),
    }
}

#[test]
fn a_grant_given_back_with_its_descriptor_or_mapping_kept_stays_booked_until_it_is_gone() {
    let d = Daemon::start(CONFIG);
    let c = tenant(&d, "keeper", Bytes::mib(64));

    // Given back while the descriptor is still open here.
    let g = c.grant(Bytes::mib(64)).unwrap();
    c.give_back_ids(vec![g.id]).unwrap();
    assert_eq!(kept_by(&d, "keeper"), Bytes::mib(64));
    assert_eq!(
        refusal_reason(c.grant(Bytes::mib(2)).unwrap_err()),
        "over_limit"
    );
    drop(g);
    assert!(
        wait_until(Duration::from_secs(2), || kept_by(&d, "keeper")
            == Bytes::ZERO),
        "kept memory not booked back after its descriptor closed: {:?}",
        d.status().tenants
    );
    let g = c.grant(Bytes::mib(64)).unwrap();

    // Mapped, the descriptor closed, then given back: the mapping alone keeps the memory.
    let dev = c.device().clone();
    let res = dev.reserve(Bytes::mib(64)).unwrap();
    dev.map(&res, Bytes::ZERO, &g.handle, Access::ReadWrite)
        .unwrap();
    let id = g.id;
    drop(g);
    c.give_back_ids(vec![id]).unwrap();
    assert_eq!(kept_by(&d, "keeper"), Bytes::mib(64));
    dev.write(&res, Bytes::ZERO, b"still mine").unwrap();
    dev.unmap(&res, Bytes::ZERO, Bytes::mib(64)).unwrap();
    assert!(wait_until(Duration::from_secs(2), || kept_by(&d, "keeper")
        == Bytes::ZERO));
    c.grant(Bytes::mib(64)).unwrap();
    assert!(d.log().contains("still reaches"), "{}", d.log());
}

#[test]
fn descriptors_kept_across_reconnects_count_against_the_limit_and_the_device() {
    let d = Daemon::start(CONFIG);
    let mut kept = Vec::new();
    let mut refused = 0;
    for _ in 0..8 {
        let c = tenant(&d, "hoarder", Bytes::mib(64));
        match c.grant(Bytes::mib(64)) {
            Ok(g) => kept.push(g),
            Err(e) => {
                assert_eq!(refusal_reason(e), "over_limit");
                refused += 1;
            }
        }
        drop(c);
        d.wait_for_no_tenants();
        let s = d.status();
        assert!(
            s.devices[0].device_used <= s.devices[0].capacity,
            "{:?}",
            s.devices[0]
        );
    }
    assert_eq!(kept.len(), 1, "only the first round's grant fits the limit");
    assert_eq!(refused, 7);
    assert_eq!(kept_by(&d, "hoarder"), Bytes::mib(64));
    assert_eq!(d.status().devices[0].kept, Bytes::mib(64));

    drop(kept);
    assert!(wait_until(Duration::from_secs(2), || {
        let s = d.status();
        s.devices[0].kept == Bytes::ZERO && s.devices[0].kept_offline.is_empty()
    }));
    let s = d.status();
    assert_eq!(s.devices[0].held, Bytes::ZERO);
    assert!(s.tenants.is_empty());
}

#[test]
fn memory_kept_by_a_closed_tenant_counts_against_its_uids_limit() {
    let uid = rustix::process::getuid().as_raw();
    let d = Daemon::start(&format!(
        "{CONFIG}[users.{uid}]\nmax_memory = \"128 MiB\"\n"
    ));
    let first = tenant(&d, "one", Bytes::mib(128));
    let g = first.grant(Bytes::mib(128)).unwrap();
    drop(first);
    d.wait_for_no_tenants();
    // Another name of the same uid: what the first one's process still reaches counts.
    let second = tenant(&d, "two", Bytes::mib(128));
    assert_eq!(
        refusal_reason(second.grant(Bytes::mib(2)).unwrap_err()),
        "user_limit"
    );
    drop(g);
    assert!(wait_until(Duration::from_secs(2), || d.status().devices[0]
        .kept_offline
        .is_empty()));
    second.grant(Bytes::mib(2)).unwrap();
}

/// The descriptors of memfds this process has open now, each reopened (a kept copy of them).
fn keep_open_memfds() -> Vec<std::fs::File> {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| {
            let path = e.ok()?.path();
            let target = std::fs::read_link(&path).ok()?;
            target
                .to_string_lossy()
                .starts_with("/memfd:")
                .then(|| std::fs::File::open(&path).ok())?
        })
        .collect()
}

#[test]
fn a_shared_version_a_reader_keeps_after_it_is_freed_stays_booked_to_the_owner() {
    use vram_client::{Acl, Principal};
    let d = Daemon::start(CONFIG);
    let owner = tenant(&d, "owner", Bytes::mib(128));
    let acl = Acl {
        readers: vec![Principal::Anyone],
        writers: vec![],
    };
    let buf = owner.create_shared("weights", Bytes::mib(32), acl).unwrap();
    let lease = buf.lease(Duration::from_secs(30)).unwrap();
    let first = lease.begin_write(None).unwrap();
    first.fill(Bytes::ZERO, Bytes::mib(32), 1).unwrap();
    let v1 = first.version();
    first.publish().unwrap();

    let reader = tenant(&d, "reader", Bytes::mib(64));
    let theirs = reader.open_shared("weights").unwrap();
    let pin = theirs.pin().unwrap();
    // A reader that keeps the version's memory past its pin: a copy of its descriptor.
    let kept = keep_open_memfds();
    assert!(
        !kept.is_empty(),
        "the pinned version's descriptor is open here"
    );
    drop(pin);

    // A new version frees the first one (current no more, pinned by nobody).
    let second = lease.begin_write(Some(v1)).unwrap();
    second.fill(Bytes::ZERO, Bytes::mib(32), 2).unwrap();
    second.publish().unwrap();
    assert!(
        wait_until(Duration::from_secs(2), || kept_by(&d, "owner")
            == Bytes::mib(32)),
        "the freed version still reached by a reader is not booked: {:?}",
        d.status().tenants
    );
    // The owner's limit counts it: 32 MiB live, 32 MiB kept, 64 MiB left of 128 MiB.
    assert_eq!(
        refusal_reason(owner.grant(Bytes::mib(66)).unwrap_err()),
        "over_limit"
    );
    drop(kept);
    assert!(
        wait_until(Duration::from_secs(2), || kept_by(&d, "owner")
            == Bytes::ZERO),
        "the version's memory is not booked back once the reader let go"
    );
    owner.grant(Bytes::mib(66)).unwrap();
    assert!(d.log().contains("still reached"), "{}", d.log());
}
