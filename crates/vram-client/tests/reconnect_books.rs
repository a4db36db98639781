//! What a tenant says it holds when it reconnects to a restarted daemon, against a daemon played
//! here on the protocol (`vram_proto::Conn`), so that each step can be held where a race would
//! fall: a return made while the reconnect is under way reaches the new daemon, and a reply the
//! client cannot read ends the connection for the daemon too.

use std::os::fd::AsFd;
use std::os::unix::net::UnixListener;
use std::sync::Arc;
use std::time::Duration;

use vram_client::{Client, TenantOptions};
use vram_core::Bytes;
use vram_proto::{
    BackendKind, Conn, DeviceDesc, FrameHeader, GrantId, ProtoError, Received, Reply, Request,
    Welcome,
};

fn welcome() -> Reply {
    Reply::Welcome(Welcome {
        tenant: 1,
        name: "t".into(),
        class: "normal".into(),
        priority: 0,
        guarantee: Bytes::ZERO,
        limit: Bytes::gib(1),
        device: DeviceDesc {
            index: 0,
            uuid: "host-0".into(),
            name: "host".into(),
            backend: BackendKind::Host,
            capacity: Bytes::gib(1),
            granularity: Bytes::mib(2),
        },
    })
}

/// A daemon played on a socket in a folder of its own (the folder, the listener), a client
/// registered with it, and the daemon's end of that registration.
fn connected() -> (tempfile::TempDir, UnixListener, Arc<Client>, Conn) {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("vramd.sock");
    let listener = UnixListener::bind(&socket).unwrap();
    let client =
        std::thread::spawn(move || Client::connect(Some(&socket), &TenantOptions::named("t")));
    let (stream, _) = listener.accept().unwrap();
    let daemon = Conn::new(stream);
    let hello: Received<Request> = daemon.recv().unwrap();
    assert!(matches!(hello.msg, Request::Hello(_)), "{:?}", hello.msg);
    daemon.send(hello.id, &welcome(), &[]).unwrap();
    (
        dir,
        listener,
        Arc::new(client.join().unwrap().unwrap()),
        daemon,
    )
}

/// Grant 7 of 2 MiB, asked by `client` and given by the daemon's end `daemon` (a file in `dir`
/// for its memory); the client's handle of it already dropped.
fn grant_seven(client: &Arc<Client>, daemon: &Conn, dir: &std::path::Path) -> GrantId {
    let c = client.clone();
    let grant = std::thread::spawn(move || c.grant_fd(Bytes::mib(2)).unwrap());
    let ask: Received<Request> = daemon.recv().unwrap();
    let memory = std::fs::File::create(dir.join("memory")).unwrap();
    let granted = Reply::Granted {
        grant: GrantId(7),
        size: Bytes::mib(2),
    };
    daemon.send(ask.id, &granted, &[memory.as_fd()]).unwrap();
    let (id, _, fd) = grant.join().unwrap();
    drop(fd);
    id
}

#[test]
fn a_return_made_while_the_client_reconnects_reaches_the_new_daemon() {
    let (dir, listener, client, old) = connected();

    let id = grant_seven(&client, &old, dir.path());

    // The daemon restarts; the client registers again, saying it holds grant 7.
    drop(old);
    let (stream, _) = listener.accept().unwrap();
    let new = Conn::new(stream);
    let hello: Received<Request> = new.recv().unwrap();
    let Request::Hello(h) = &hello.msg else {
        panic!("{:?}", hello.msg)
    };
    let resume = h.resume.clone().expect("a reconnect says what it holds");
    assert_eq!(resume.grants, vec![(GrantId(7), Bytes::mib(2))]);
    // While the Welcome is on its way, the tenant gives the grant back.
    let c = client.clone();
    let back = std::thread::spawn(move || c.give_back_ids(vec![id]));
    std::thread::sleep(Duration::from_millis(200));
    new.send(hello.id, &welcome(), &[]).unwrap();
    // The new daemon booked grant 7 from the account: the return must reach it.
    let next = new
        .recv_within::<Request>(Some(Duration::from_secs(5)))
        .expect("the return reaches the new daemon");
    assert!(
        matches!(&next.msg, Request::Return { grants } if grants == &[GrantId(7)]),
        "{:?}",
        next.msg
    );
    let returned = Reply::Returned {
        bytes: Bytes::mib(2),
        held: Bytes::ZERO,
    };
    new.send(next.id, &returned, &[]).unwrap();
    assert_eq!(back.join().unwrap().unwrap(), Bytes::ZERO);
}

/// A return sent without waiting while the daemon is away costs its sender no wait for the
/// reconnect (the allocator sends it under its lock), and the return travels with the account the
/// reconnect gives once the daemon is back.
#[test]
fn a_return_sent_while_the_daemon_is_away_does_not_wait_for_it() {
    let (dir, listener, client, old) = connected();
    client.set_reconnect_for(Duration::from_secs(20));
    let id = grant_seven(&client, &old, dir.path());

    // The daemon goes away, its socket with it.
    drop(old);
    drop(listener);
    std::fs::remove_file(dir.path().join("vramd.sock")).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let started = std::time::Instant::now();
    client.give_back_unanswered(vec![id]).unwrap();
    let took = started.elapsed();
    assert!(took < Duration::from_secs(2), "the return waited {took:?}");

    // Back: the reconnect's account no longer names the grant.
    let listener = UnixListener::bind(dir.path().join("vramd.sock")).unwrap();
    let (stream, _) = listener.accept().unwrap();
    let new = Conn::new(stream);
    let hello: Received<Request> = new.recv().unwrap();
    let Request::Hello(h) = &hello.msg else {
        panic!("{:?}", hello.msg)
    };
    assert_eq!(h.resume.as_ref().map(|r| r.grants.len()), Some(0));
    new.send(hello.id, &welcome(), &[]).unwrap();
}

#[test]
fn a_reply_the_client_cannot_read_closes_the_connection_for_the_daemon_too() {
    let (_dir, listener, client, old) = connected();
    // A frame whose payload is no reply this client knows.
    let mut frame = FrameHeader::new(0, 3).encode().to_vec();
    frame.extend_from_slice(&[0, 0xff, 0xff]);
    old.send_bytes(&frame).unwrap();
    // The client gives the connection up, and the daemon sees it closed: otherwise the
    // tenant's name stays taken there and the reconnect that follows is refused with it.
    match old.recv_within::<Request>(Some(Duration::from_secs(5))) {
        Err(ProtoError::Closed) => {}
        other => panic!("the old connection is still open: {other:?}"),
    }
    let (stream, _) = listener.accept().unwrap();
    let new = Conn::new(stream);
    let hello: Received<Request> = new.recv().unwrap();
    assert!(matches!(hello.msg, Request::Hello(_)), "{:?}", hello.msg);
    new.send(hello.id, &welcome(), &[]).unwrap();
    let c = client.clone();
    let ping = std::thread::spawn(move || c.ping());
    let p: Received<Request> = new.recv().unwrap();
    assert!(matches!(p.msg, Request::Ping), "{:?}", p.msg);
    new.send(p.id, &Reply::Pong, &[]).unwrap();
    ping.join().unwrap().unwrap();
    assert_eq!(client.reconnects(), 1);
}

#[test]
fn a_client_closed_while_it_reconnects_leaves_no_registration_open() {
    let (_dir, listener, client, old) = connected();
    // The daemon restarts; the client registers again.
    drop(old);
    let (stream, _) = listener.accept().unwrap();
    let new = Conn::new(stream);
    let hello: Received<Request> = new.recv().unwrap();
    assert!(matches!(hello.msg, Request::Hello(_)), "{:?}", hello.msg);
    // The owner closes before the Welcome comes.
    client.close();
    new.send(hello.id, &welcome(), &[]).unwrap();
    loop {
        match new.recv_within::<Request>(Some(Duration::from_secs(5))) {
            // A parting word is fine; the connection must end.
            Ok(r) if matches!(r.msg, Request::Bye) => continue,
            Err(ProtoError::Closed) => break,
            other => panic!("the new registration stays open: {other:?}"),
        }
    }
}
