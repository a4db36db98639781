//! Returns the tenant does not wait for: the allocator gives handles back with a send, not a
//! round trip, and relies on the daemon answering a connection's requests in order.

mod common;

use std::sync::Arc;

use common::Daemon;
use vram_client::alloc::{CachingAllocator, DaemonSource, HostEvents, MappedBacking};
use vram_client::{Client, TenantOptions};
use vram_core::alloc::{AllocConfig, StreamId};
use vram_core::Bytes;
use vram_proto::GrantId;

fn tenant(d: &Daemon, name: &str, limit: Bytes) -> Client {
    Client::connect(
        Some(&d.socket),
        &TenantOptions {
            limit: Some(limit),
            ..TenantOptions::named(name)
        },
    )
    .unwrap()
}

#[test]
fn a_return_not_waited_for_is_back_before_the_next_request_is_answered() {
    let d = Daemon::start("capacity = \"1 GiB\"\n");
    let client = tenant(&d, "ordered", Bytes::mib(16));
    for round in 0..50 {
        // The whole limit each round: the grant fits only if the return before it has landed.
        let grants = client.grant_many(&[Bytes::mib(16)]).unwrap_or_else(|e| {
            panic!("round {round}: the return sent before this grant was not handled first: {e}")
        });
        let ids: Vec<GrantId> = grants.iter().map(|g| g.id).collect();
        drop(grants);
        client.give_back_unanswered(ids).unwrap();
    }
    client.ping().unwrap();
    assert_eq!(d.held_by("ordered"), Bytes::ZERO);
    drop(client);
    d.wait_for_no_tenants();
    d.stop();
}

#[test]
fn a_refused_return_not_waited_for_leaves_the_connection_working() {
    let d = Daemon::start("capacity = \"1 GiB\"\n");
    let client = tenant(&d, "confused", Bytes::mib(16));
    let grants = client.grant_many(&[Bytes::mib(4)]).unwrap();
    // An id the daemon never gave: it answers with an error nobody waits for.
    client
        .give_back_unanswered(vec![GrantId(u64::MAX - 7)])
        .unwrap();
    client.ping().unwrap();
    assert_eq!(d.held_by("confused"), Bytes::mib(4));
    let more = client.grant_many(&[Bytes::mib(8)]).unwrap();
    assert_eq!(d.held_by("confused"), Bytes::mib(12));
    client
        .give_back(grants.into_iter().chain(more).collect())
        .unwrap();
    assert_eq!(d.held_by("confused"), Bytes::ZERO);
    drop(client);
    d.stop();
}

#[test]
fn trim_returns_once_the_daemon_has_everything_back() {
    let d = Daemon::start("capacity = \"1 GiB\"\n");
    let client = Arc::new(tenant(&d, "trimmer", Bytes::mib(512)));
    let device = client.device().clone();
    let config = AllocConfig {
        granularity: device.info().granularity,
        ..AllocConfig::default()
    };
    let backing =
        MappedBacking::new(device, config.va_bytes, DaemonSource::new(client.clone())).unwrap();
    let alloc = CachingAllocator::new(config, backing, Box::new(HostEvents));
    let s = StreamId(0);
    for round in 0..20 {
        let blocks: Vec<u64> = [Bytes::mib(3), Bytes::mib(40), Bytes::mib(130)]
            .into_iter()
            .map(|b| alloc.alloc(b, s).unwrap())
            .collect();
        assert!(d.held_by("trimmer") >= Bytes::mib(173), "round {round}");
        for b in blocks {
            alloc.free(b, s).unwrap();
        }
        let trimmed = alloc.trim();
        assert!(
            trimmed >= Bytes::mib(173),
            "round {round}: trimmed {trimmed}"
        );
        // Asked on another connection, right after the trim returned.
        assert_eq!(d.held_by("trimmer"), Bytes::ZERO, "round {round}");
    }
    drop(alloc);
    drop(client);
    d.wait_for_no_tenants();
    d.stop();
}

#[test]
fn answers_nobody_waits_for_never_clog_the_connection() {
    let d = Daemon::start("capacity = \"1 GiB\"\n");
    let client = tenant(&d, "flood", Bytes::mib(16));
    // Thousands of refusals (each answer ~100 bytes) and no call to read them: more than a socket
    // buffer holds, so the daemon blocks writing unless this process drains them on its own.
    for _ in 0..5000 {
        client
            .give_back_unanswered(vec![GrantId(u64::MAX - 1)])
            .unwrap();
    }
    client.ping().unwrap();
    let grants = client.grant_many(&[Bytes::mib(2)]).unwrap();
    assert_eq!(d.held_by("flood"), Bytes::mib(2));
    drop(grants);
    drop(client);
    d.wait_for_no_tenants();
    d.stop();
}
