//! `GrantMany`: several handles in one round trip, all of them or none.

mod common;

use std::os::unix::net::UnixStream;
use std::time::Duration;

use common::Daemon;
use vram_client::{Client, TenantOptions};
use vram_core::Bytes;
use vram_proto::{Conn, ErrorCode, Hello, Reply, Request, Role, MAX_FDS};

/// A tenant registered on a raw connection, to see the frames themselves.
fn raw_tenant(d: &Daemon, name: &str, limit: Bytes) -> Conn {
    let stream = UnixStream::connect(&d.socket).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let conn = Conn::new(stream);
    let hello = Request::Hello(Hello {
        role: Role::Tenant {
            name: name.into(),
            class: None,
            guarantee: None,
            limit: Some(limit),
        },
        gpu: None,
        client: "grant_many test".into(),
        resume: None,
    });
    conn.send(1, &hello, &[]).unwrap();
    let r = conn.recv::<Reply>().unwrap();
    assert!(matches!(r.msg, Reply::Welcome(_)), "{:?}", r.msg);
    conn
}

#[test]
fn one_reply_carries_every_handle_asked_for() {
    let d = Daemon::start("capacity = \"1 GiB\"\n");
    let conn = raw_tenant(&d, "batch", Bytes::mib(64));
    let sizes = vec![Bytes::mib(2), Bytes::mib(24), Bytes(3 << 20)];
    conn.send(2, &Request::GrantMany { sizes }, &[]).unwrap();
    let r = conn.recv::<Reply>().unwrap();
    assert_eq!(r.id, 2);
    let Reply::GrantedMany { grants } = r.msg else {
        panic!("expected GrantedMany, got {:?}", r.msg);
    };
    let got: Vec<Bytes> = grants.iter().map(|g| g.1).collect();
    // In the order asked, each rounded up to the 2 MiB granularity.
    assert_eq!(got, [Bytes::mib(2), Bytes::mib(24), Bytes::mib(4)]);
    assert_eq!(r.fds.len(), 3, "one fd per handle, in the same frame");
    assert_eq!(d.held_by("batch"), Bytes::mib(30));
    let t = d.status().tenants.into_iter().find(|t| t.name == "batch");
    assert_eq!(t.map(|t| t.grants), Some(3));
    drop(conn);
    d.wait_for_no_tenants();
    assert_eq!(d.status().devices[0].held, Bytes::ZERO);
    d.stop();
}

#[test]
fn a_refused_handle_leaves_the_tenant_holding_nothing_of_the_request() {
    let d = Daemon::start("capacity = \"1 GiB\"\n");
    let conn = raw_tenant(&d, "greedy", Bytes::mib(32));
    let first = Request::GrantMany {
        sizes: vec![Bytes::mib(8)],
    };
    conn.send(2, &first, &[]).unwrap();
    assert!(matches!(
        conn.recv::<Reply>().unwrap().msg,
        Reply::GrantedMany { .. }
    ));
    // 8 + 16 fit the 32 MiB limit, the third does not: nothing of this request is kept.
    let sizes = vec![Bytes::mib(16), Bytes::mib(2), Bytes::mib(16)];
    conn.send(3, &Request::GrantMany { sizes }, &[]).unwrap();
    let r = conn.recv::<Reply>().unwrap();
    let Reply::Error(e) = r.msg else {
        panic!("expected a refusal, got {:?}", r.msg);
    };
    assert_eq!(e.code, ErrorCode::Refused, "{e:?}");
    assert!(e.message.contains("limit"), "{}", e.message);
    assert!(
        e.message
            .contains("handle 3 of a request for 34 MiB in 3 handles; none of it is granted"),
        "{}",
        e.message
    );
    assert!(r.fds.is_empty());
    assert_eq!(d.held_by("greedy"), Bytes::mib(8), "only the first request");

    // Asked again and again, the refusal is logged once (within the 10 s between lines).
    for id in 100..150 {
        let sizes = vec![Bytes::mib(64)];
        conn.send(id, &Request::GrantMany { sizes }, &[]).unwrap();
        assert!(matches!(conn.recv::<Reply>().unwrap().msg, Reply::Error(_)));
    }
    let logged = d.log().matches("refused: tenant `greedy`").count();
    assert!((1..=2).contains(&logged), "{logged} lines:\n{}", d.log());

    // Empty and oversized requests get a clear refusal; the connection goes on.
    for (id, n) in [(4, 0), (5, MAX_FDS + 1)] {
        let sizes = vec![Bytes::mib(2); n];
        conn.send(id, &Request::GrantMany { sizes }, &[]).unwrap();
        let r = conn.recv::<Reply>().unwrap();
        let Reply::Error(e) = r.msg else {
            panic!("expected a refusal of {n} handles, got {:?}", r.msg);
        };
        assert_eq!(e.reason.as_deref(), Some("bad_size"), "{e:?}");
        assert!(e.message.contains(&n.to_string()), "{}", e.message);
    }
    conn.send(6, &Request::Ping, &[]).unwrap();
    assert!(matches!(conn.recv::<Reply>().unwrap().msg, Reply::Pong));
    assert_eq!(d.held_by("greedy"), Bytes::mib(8));
    d.stop();
}

#[test]
fn the_client_takes_more_than_one_frame_of_handles_and_gives_all_back_on_refusal() {
    let d = Daemon::start("capacity = \"1 GiB\"\n");
    let client = Client::connect(
        Some(&d.socket),
        &TenantOptions {
            limit: Some(Bytes::mib(80)),
            ..TenantOptions::named("client")
        },
    )
    .unwrap();
    // 20 handles: two round trips (16 + 4).
    let sizes = [Bytes::mib(2); 20];
    let grants = client.grant_many(&sizes).unwrap();
    assert_eq!(grants.len(), 20);
    assert!(grants.iter().all(|g| g.size() == Bytes::mib(2)));
    assert_eq!(d.held_by("client"), Bytes::mib(40));
    client.give_back(grants).unwrap();
    // 24 of 4 MiB: the first 16 fit (64 MiB), the second frame does not; the first goes back.
    let e = client.grant_many(&[Bytes::mib(4); 24]).unwrap_err();
    assert!(e.is_refusal(), "{e}");
    assert_eq!(d.held_by("client"), Bytes::ZERO);
    drop(client);
    d.stop();
}
