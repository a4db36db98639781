//! Peers that misbehave get a clear error each, and the tenants that behave never notice.

mod common;

use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{Daemon, Tenant, VRAMD};
use vram_client::{ClientError, Observer, TenantOptions};
use vram_core::Bytes;
use vram_proto::{
    Conn, ErrorCode, ErrorReply, FrameHeader, ProtoError, Reply, Request, MAX_FDS, MAX_PAYLOAD,
};

/// A raw connection that gives up on a silent daemon after 10 s.
fn raw(socket: &Path) -> Conn {
    let stream = UnixStream::connect(socket).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    Conn::new(stream)
}

/// The daemon's unsolicited error reply on `conn`.
fn error_reply(conn: &Conn) -> ErrorReply {
    let r = conn.recv::<Reply>().expect("an error reply");
    assert_eq!(r.id, 0, "errors about frames carry id 0");
    match r.msg {
        Reply::Error(e) => e,
        other => panic!("expected an error, got {other:?}"),
    }
}

/// Sends `bytes`, expects a `Protocol` error whose message contains `says`, then the close.
fn refused_and_closed(socket: &Path, bytes: &[u8], shut_write: bool, says: &str) {
    let conn = raw(socket);
    conn.send_bytes(bytes).unwrap();
    if shut_write {
        conn.stream().shutdown(std::net::Shutdown::Write).unwrap();
    }
    let e = error_reply(&conn);
    assert_eq!(e.code, ErrorCode::Protocol, "{e:?}");
    assert!(e.message.contains(says), "`{}` lacks `{says}`", e.message);
    assert!(
        e.message.contains("closing the connection"),
        "{}",
        e.message
    );
    assert!(matches!(conn.recv::<Reply>(), Err(ProtoError::Closed)));
}

fn frame(header: FrameHeader, payload: &[u8]) -> Vec<u8> {
    let mut f = header.encode().to_vec();
    f.extend_from_slice(payload);
    f
}

/// The well-behaved tenant: takes, verifies everything it holds, gives back.
fn keeps_working(worker: &mut Tenant, after: &str) {
    let took = worker.cmd("take 4MiB 2MiB");
    assert_eq!(took["taken"], Bytes::mib(4).get(), "after {after}: {took}");
    let v = worker.cmd("verify");
    assert_eq!(v["ok"], true, "after {after}: {v}");
    let gave = worker.cmd("give 2MiB");
    assert_eq!(gave["event"], "gave", "after {after}: {gave}");
}

#[test]
fn bad_peers_get_clear_errors_while_a_tenant_keeps_working() {
    let uid = rustix::process::getuid().as_raw();
    let root = uid == 0;
    let d = Daemon::start(&format!(
        "allowed_uids = [{uid}]\nsocket_mode = \"0666\"\ncapacity = \"1 GiB\"\n"
    ));
    let socket = d.socket.clone();
    let mut worker = d.tenant("worker", &["--limit", "256MiB"]);
    keeps_working(&mut worker, "start");

    refused_and_closed(
        &socket,
        b"GET / HTTP/1.1\r\nHost: vramd\r\n\r\n",
        false,
        "bad magic",
    );
    keeps_working(&mut worker, "garbage bytes");

    // A header announcing 100 bytes, 3 of them sent, then the peer stops writing.
    let truncated = frame(FrameHeader::new(0, 100), &[1, 2, 3]);
    refused_and_closed(&socket, &truncated, true, "in the middle of a frame");
    keeps_working(&mut worker, "a truncated frame");

    let oversized = FrameHeader::new(0, MAX_PAYLOAD + 1).encode();
    refused_and_closed(&socket, &oversized, false, "exceeds the limit");
    keeps_working(&mut worker, "an oversized frame");

    let fds = FrameHeader::new(MAX_FDS + 1, 1).encode();
    refused_and_closed(&socket, &fds, false, "file descriptors");
    keeps_working(&mut worker, "too many fds announced");

    let mut v99 = FrameHeader::new(0, 1);
    v99.version = 99;
    refused_and_closed(&socket, &frame(v99, &[0]), false, "version 99");
    keeps_working(&mut worker, "a wrong protocol version");

    // A well-framed payload that does not decode: an error, and the connection stays usable.
    let conn = raw(&socket);
    conn.send_bytes(&frame(FrameHeader::new(0, 3), &[0xff, 0xff, 0xff]))
        .unwrap();
    let e = error_reply(&conn);
    assert_eq!(e.code, ErrorCode::Malformed, "{e:?}");
    assert!(e.message.starts_with("malformed request"), "{}", e.message);
    conn.send(7, &Request::Ping, &[]).unwrap();
    let pong = conn.recv::<Reply>().unwrap();
    assert_eq!((pong.id, pong.msg), (7, Reply::Pong));
    drop(conn);
    keeps_working(&mut worker, "a malformed payload");

    // The same name again, from another connection.
    let worker_pid = worker.pid();
    let e = vram_client::Client::connect(Some(&socket), &TenantOptions::named("worker"))
        .expect_err("a second `worker`");
    let ClientError::Daemon(e) = e else {
        panic!("expected the daemon's refusal, got {e}")
    };
    assert_eq!(e.code, ErrorCode::Admission, "{e:?}");
    assert!(
        e.message.contains("`worker` is already connected")
            && e.message.contains(&format!("pid {worker_pid}")),
        "{}",
        e.message
    );
    keeps_working(&mut worker, "a name in use");

    // A uid that is not allowed, on this same daemon: a child running as `nobody` (needs root).
    if root {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(d.dir(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let out = Command::new(VRAMD)
            .args(["status", "--socket"])
            .arg(&socket)
            .uid(65534)
            .gid(65534)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains("uid 65534 is not allowed to use this vramd"),
            "{stderr}"
        );
        keeps_working(&mut worker, "a connection from uid 65534");
    } else {
        eprintln!("not root: the refused uid is checked on a second daemon only");
    }

    let s = d.status();
    assert_eq!(
        s.daemon.protocol_errors, 6,
        "garbage, truncated, oversized, fds, version, malformed"
    );
    let w = s.tenants.iter().find(|t| t.name == "worker").unwrap();
    // Each of its rounds kept 2 MiB.
    assert_eq!(w.held, Bytes::mib(2 * 8 + if root { 2 } else { 0 }));
    assert_eq!(worker.cmd("verify")["ok"], true);
    worker.exit();
    d.stop();
}

/// `allowed_uids` is an exact list: one without the test's own uid refuses the test.
#[test]
fn a_uid_outside_allowed_uids_is_refused_with_its_number() {
    let uid = rustix::process::getuid().as_raw();
    let d = Daemon::start(&format!("allowed_uids = [{}]\n", uid + 1));
    let e = Observer::connect(Some(&d.socket))
        .unwrap()
        .status()
        .expect_err("refused");
    let ClientError::Daemon(e) = e else {
        panic!("expected the daemon's refusal, got {e}")
    };
    assert_eq!(e.code, ErrorCode::PermissionDenied, "{e:?}");
    assert!(
        e.message
            .contains(&format!("uid {uid} is not allowed to use this vramd")),
        "{}",
        e.message
    );
    let t = vram_client::Client::connect(Some(&d.socket), &TenantOptions::named("intruder"))
        .expect_err("refused");
    assert!(
        matches!(&t, ClientError::Daemon(e) if e.code == ErrorCode::PermissionDenied),
        "{t}"
    );
    d.stop();
}

/// The daemon's connection threads (`vramd-conn-N`).
fn connection_threads(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.starts_with("vramd-conn"))
        .count()
}

/// A peer that sends the daemon its own end of the connection, in a frame that announces no
/// descriptor, is refused and closed; without that the daemon would hold the peer's end open, never
/// see it close, and keep the connection (a thread, a slot under the connection caps) for ever.
#[test]
fn descriptors_no_frame_announced_close_the_connection() {
    use std::io::IoSlice;
    use std::mem::MaybeUninit;
    use std::os::fd::AsFd;

    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    use vram_proto::Envelope;

    let d = Daemon::start("capacity = \"1 GiB\"\nmetrics = \"off\"\n");
    let conn = raw(&d.socket);
    let payload = postcard::to_stdvec(&Envelope {
        id: 1,
        msg: Request::Ping,
    })
    .unwrap();
    let bytes = frame(FrameHeader::new(0, payload.len()), &payload);
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let own = [conn.stream().as_fd()];
    assert!(control.push(SendAncillaryMessage::ScmRights(&own)));
    let iov = [IoSlice::new(&bytes)];
    rustix::net::sendmsg(conn.stream(), &iov, &mut control, SendFlags::empty()).unwrap();

    let e = error_reply(&conn);
    assert_eq!(e.code, ErrorCode::Protocol, "{e:?}");
    assert!(
        e.message
            .contains("1 file descriptors arrived that no frame announced; closing the connection"),
        "{}",
        e.message
    );
    drop(conn);
    assert!(
        common::wait_until(Duration::from_secs(5), || connection_threads(d.pid()) == 0),
        "the connection's thread outlived the peer's close"
    );
    assert_eq!(d.status().daemon.protocol_errors, 1);
    d.stop();
}

/// A raw tenant connection, welcomed as `name` (claiming to resume with `resume`).
fn raw_tenant(socket: &Path, name: &str, resume: Option<vram_proto::Resume>) -> Conn {
    let conn = raw(socket);
    let hello = vram_proto::Hello {
        role: vram_proto::Role::Tenant {
            name: name.into(),
            class: None,
            guarantee: None,
            limit: None,
        },
        gpu: None,
        client: "protocol_abuse test".into(),
        resume,
    };
    conn.send(1, &Request::Hello(hello), &[]).unwrap();
    let r = conn.recv::<Reply>().unwrap();
    assert!(matches!(r.msg, Reply::Welcome(_)), "{:?}", r.msg);
    conn
}

/// One grant of `bytes` on `conn`: its id and its memory.
fn granted(conn: &Conn, id: u64, bytes: Bytes) -> (vram_proto::GrantId, std::fs::File) {
    conn.send(id, &Request::Grant { bytes }, &[]).unwrap();
    let r = conn.recv::<Reply>().unwrap();
    let Reply::Granted { grant, .. } = r.msg else {
        panic!("expected a grant, got {:?}", r.msg)
    };
    let fd = r.fds.into_iter().next().expect("the grant's fd");
    (grant, std::fs::File::from(fd))
}

/// A tenant that says it resumes holding a grant id the daemon has not given yet cannot take the
/// memory granted later under that id to another tenant: the id is never given while claimed.
#[test]
fn a_resume_claiming_an_id_not_yet_given_takes_nobody_elses_memory() {
    use std::os::unix::fs::FileExt;
    use vram_proto::{GrantId, Resume};

    let d = Daemon::start("capacity = \"1 GiB\"\nmetrics = \"off\"\n");
    let victim = raw_tenant(&d.socket, "victim", None);
    let (first, _) = granted(&victim, 2, Bytes::mib(2));
    // Grant ids are given in order: the next one is guessable.
    let next = GrantId(first.0 + 1);
    let claim = Resume {
        grants: vec![(next, Bytes::mib(2))],
        charged: Bytes::ZERO,
    };
    let thief = raw_tenant(&d.socket, "thief", Some(claim));
    let (second, memory) = granted(&victim, 3, Bytes::mib(2));
    assert_ne!(
        second, next,
        "the daemon gave an id a resuming tenant claims"
    );
    let secret = b"the victim's data";
    memory.write_all_at(secret, 0).unwrap();

    // The thief gives back what it claimed, then asks for memory of that size.
    thief
        .send(4, &Request::Return { grants: vec![next] }, &[])
        .unwrap();
    let r = thief.recv::<Reply>().unwrap();
    assert!(matches!(r.msg, Reply::Returned { .. }), "{:?}", r.msg);
    let (_, theirs) = granted(&thief, 5, Bytes::mib(2));
    let mut read = [0u8; 17];
    theirs.read_exact_at(&mut read, 0).unwrap();
    assert_eq!(
        read, [0; 17],
        "the thief's memory holds another tenant's data"
    );

    // The victim's grants are still its own, and go back whole (let go first: memory given back
    // while still reached stays booked).
    drop(memory);
    victim
        .send(
            6,
            &Request::Return {
                grants: vec![first, second],
            },
            &[],
        )
        .unwrap();
    let r = victim.recv::<Reply>().unwrap();
    assert_eq!(
        r.msg,
        Reply::Returned {
            bytes: Bytes::mib(4),
            held: Bytes::ZERO
        }
    );
    drop((victim, thief));
    d.wait_for_no_tenants();
    d.stop();
}

/// A reconnecting tenant's account sent ahead of its `Hello` in parts (`ResumeMore`) is booked
/// with the `Hello`'s; a peer cannot make the daemon keep more of it than the device could have
/// granted, nor send it after the `Hello`.
#[test]
fn an_account_sent_ahead_is_bounded_and_only_before_the_hello() {
    use vram_proto::{GrantId, Resume};

    let d = Daemon::start("capacity = \"1 GiB\"\nmetrics = \"off\"\n");
    let part = |from: u64, n: u64| Request::ResumeMore {
        grants: (from..from + n)
            .map(|i| (GrantId(1 << 40 | i), Bytes::mib(2)))
            .collect(),
    };
    // 1 GiB in 2 MiB granules: 512 grants at most.
    let greedy = raw(&d.socket);
    assert_eq!(ask(&greedy, 1, part(0, 300)), Reply::Ack);
    let e = error_of(ask(&greedy, 2, part(300, 300)));
    assert_eq!(e.code, ErrorCode::Malformed, "{e:?}");
    assert!(e.message.contains("(512)"), "{e:?}");

    let conn = raw(&d.socket);
    assert_eq!(ask(&conn, 1, part(0, 10)), Reply::Ack);
    let hello = vram_proto::Hello {
        role: vram_proto::Role::Tenant {
            name: "back".into(),
            class: None,
            guarantee: None,
            limit: None,
        },
        gpu: None,
        client: "protocol_abuse test".into(),
        resume: Some(Resume {
            grants: vec![(GrantId(1 << 41), Bytes::mib(2))],
            charged: Bytes::ZERO,
        }),
    };
    let welcome = ask(&conn, 2, Request::Hello(hello));
    assert!(matches!(welcome, Reply::Welcome(_)), "{welcome:?}");
    assert_eq!(d.held_by("back"), Bytes::mib(22));
    let e = error_of(ask(&conn, 3, part(20, 1)));
    assert_eq!(e.code, ErrorCode::Malformed, "{e:?}");
    assert!(e.message.contains("before the Hello"), "{e:?}");
    assert_eq!(d.held_by("back"), Bytes::mib(22));
    // Nor after a Hello of another role.
    let watcher = raw(&d.socket);
    let hello = vram_proto::Hello {
        role: vram_proto::Role::Observer,
        gpu: None,
        client: "protocol_abuse test".into(),
        resume: None,
    };
    assert_eq!(ask(&watcher, 1, Request::Hello(hello)), Reply::Ack);
    let e = error_of(ask(&watcher, 2, part(30, 1)));
    assert_eq!(e.code, ErrorCode::Malformed, "{e:?}");
    drop((greedy, conn, watcher));
    d.wait_for_no_tenants();
    d.stop();
}

/// The reply to `request`, sent with id `id`, skipping anything unasked.
fn ask(conn: &Conn, id: u64, request: Request) -> Reply {
    conn.send(id, &request, &[]).unwrap();
    loop {
        let r = conn.recv::<Reply>().unwrap();
        if r.id == id {
            return r.msg;
        }
    }
}

/// A connection that joins a registered tenant with `token`, and the daemon's answer.
fn join(socket: &Path, token: String) -> (Conn, Reply) {
    let program = raw(socket);
    let hello = vram_proto::Hello {
        role: vram_proto::Role::Join { token },
        gpu: None,
        client: "protocol_abuse test".into(),
        resume: None,
    };
    let welcome = ask(&program, 1, Request::Hello(hello));
    (program, welcome)
}

fn error_of(reply: Reply) -> ErrorReply {
    match reply {
        Reply::Error(e) => e,
        other => panic!("expected an error, got {other:?}"),
    }
}

/// What a joined program's close takes back is its own only: a tenant invites no program while it
/// holds memory or has one joined, and its registering connection takes no memory while a program
/// is joined. Otherwise the program's close took back grants of the registering connection (or of
/// an earlier program), which kept their memory and could then be granted as much again.
#[test]
fn a_joined_programs_close_takes_back_only_its_own_memory() {
    let d = Daemon::start("capacity = \"1 GiB\"\nmetrics = \"off\"\n");
    let reg = raw_tenant(&d.socket, "reg", None);
    let (held, _memory) = granted(&reg, 2, Bytes::mib(2));
    let e = error_of(ask(&reg, 3, Request::Invite));
    assert_eq!(e.code, ErrorCode::Admission, "{e:?}");
    assert!(
        e.message.contains("the tenant holds 2 MiB"),
        "{}",
        e.message
    );
    let returned = ask(&reg, 4, Request::Return { grants: vec![held] });
    assert!(matches!(returned, Reply::Returned { .. }), "{returned:?}");

    let join = |token: String| join(&d.socket, token);
    let invitation = |id| match ask(&reg, id, Request::Invite) {
        Reply::Invitation { token } => token,
        other => panic!("no invitation for a tenant holding nothing: {other:?}"),
    };
    // Memory taken between the invitation and the join is the registration's: no join.
    let token = invitation(5);
    let charged = ask(
        &reg,
        6,
        Request::Charge {
            bytes: Bytes::mib(2),
        },
    );
    assert_eq!(charged, Reply::Ack);
    let (_, refused) = join(token.clone());
    let e = error_of(refused);
    assert_eq!(e.code, ErrorCode::Admission, "{e:?}");
    assert!(e.message.contains("has charged 2 MiB"), "{}", e.message);
    let uncharged = ask(
        &reg,
        7,
        Request::Uncharge {
            bytes: Bytes::mib(2),
        },
    );
    assert_eq!(uncharged, Reply::Ack);

    // The refused join left the invitation: taken now that the tenant holds nothing.
    let (program, welcome) = join(token);
    assert!(matches!(welcome, Reply::Welcome(_)), "{welcome:?}");
    let (_, _program_memory) = granted(&program, 2, Bytes::mib(2));

    for request in [
        Request::Grant {
            bytes: Bytes::mib(2),
        },
        Request::Charge {
            bytes: Bytes::mib(2),
        },
    ] {
        let e = error_of(ask(&reg, 6, request));
        assert_eq!(e.code, ErrorCode::Refused, "{e:?}");
        assert_eq!(e.reason.as_deref(), Some("program_joined"), "{e:?}");
    }
    for conn in [&reg, &program] {
        let e = error_of(ask(conn, 7, Request::Invite));
        assert_eq!(e.code, ErrorCode::Admission, "{e:?}");
        assert!(
            e.message.contains("has joined this tenant already"),
            "{}",
            e.message
        );
    }

    drop(program);
    assert!(common::wait_until(Duration::from_secs(5), || d
        .held_by("reg")
        == Bytes::ZERO));
    // The program gone, the registration may take memory again.
    granted(&reg, 8, Bytes::mib(2));
    assert_eq!(d.held_by("reg"), Bytes::mib(2));
    drop(reg);
    d.wait_for_no_tenants();
    d.stop();
}

/// A joined program's shared buffers are its memory too: its close deletes them with every
/// version, as a crash would, and the books and the device agree afterwards. While it runs, the
/// registering connection creates no shared buffer (its memory would go with the program's).
#[test]
fn a_joined_programs_close_takes_back_its_shared_buffers() {
    use vram_proto::{LeaseOp, SharedReply, SharedRequest};

    let d = Daemon::start("capacity = \"1 GiB\"\nmetrics = \"off\"\n");
    let reg = raw_tenant(&d.socket, "reg", None);
    let token = match ask(&reg, 2, Request::Invite) {
        Reply::Invitation { token } => token,
        other => panic!("no invitation: {other:?}"),
    };
    let (program, welcome) = join(&d.socket, token);
    assert!(matches!(welcome, Reply::Welcome(_)), "{welcome:?}");

    let create = |name: &str| {
        Request::Shared(SharedRequest::Create {
            name: name.into(),
            size: Bytes::mib(2),
            acl: Default::default(),
        })
    };
    let e = error_of(ask(&reg, 3, create("registration")));
    assert_eq!(e.reason.as_deref(), Some("program_joined"), "{e:?}");

    let Reply::Shared(SharedReply::Buffer(info)) = ask(&program, 2, create("weights")) else {
        panic!("the program could not create a buffer")
    };
    let buffer = info.id;
    let leased = ask(
        &program,
        3,
        Request::Shared(SharedRequest::Lease {
            buffer,
            op: LeaseOp::Acquire,
            ttl_ms: 60_000,
        }),
    );
    assert!(
        matches!(leased, Reply::Shared(SharedReply::Lease { .. })),
        "{leased:?}"
    );
    program
        .send(
            4,
            &Request::Shared(SharedRequest::BeginWrite { buffer, base: None }),
            &[],
        )
        .unwrap();
    let r = program.recv::<Reply>().unwrap();
    let Reply::Shared(SharedReply::Draft { version, .. }) = r.msg else {
        panic!("no draft: {:?}", r.msg)
    };
    // The program's descriptor closes with it, below.
    let draft = std::fs::File::from(r.fds.into_iter().next().expect("the draft's fd"));
    let published = ask(
        &program,
        5,
        Request::Shared(SharedRequest::Publish {
            buffer,
            version,
            checksum: None,
        }),
    );
    assert!(
        matches!(published, Reply::Shared(SharedReply::Published { .. })),
        "{published:?}"
    );
    assert_eq!(d.held_by("reg"), Bytes::mib(2));

    drop((program, draft));
    let settled = common::wait_until(Duration::from_secs(5), || {
        let s = d.status();
        s.shared.buffers.is_empty() && s.devices[0].held == Bytes::ZERO
    });
    let s = d.status();
    assert!(
        settled,
        "after the program's close: buffers {:?}, device held {}, kept {}",
        s.shared.buffers, s.devices[0].held, s.devices[0].kept
    );
    assert_eq!(d.held_by("reg"), Bytes::ZERO);
    drop(reg);
    d.wait_for_no_tenants();
    d.stop();
}

/// A peer whose pid has no number in the daemon's pid namespace (the kernel reports 0) is refused
/// with a reason: the daemon could not tell it from another process. Here the daemon runs in a
/// pid namespace of its own (`unshare`, unprivileged through a user namespace) and the test
/// connects from outside it.
#[test]
fn a_peer_outside_the_daemons_pid_namespace_is_refused_with_a_reason() {
    let probe = Command::new("unshare").args(["-Urpf", "true"]).output();
    if !probe.as_ref().is_ok_and(|o| o.status.success()) {
        eprintln!("skipped: `unshare -Urpf` cannot make a user and pid namespace here: {probe:?}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("vramd.sock");
    let config = dir.path().join("vramd.toml");
    std::fs::write(&config, "capacity = \"1 GiB\"\nmetrics = \"off\"\n").unwrap();
    /// Stops the daemon however the test ends (`--kill-child`: the daemon goes with `unshare`).
    struct Stopped(std::process::Child);
    impl Drop for Stopped {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let daemon = Command::new("unshare")
        .args(["-Urpf", "--mount-proc", "--kill-child"])
        .arg(VRAMD)
        .args(["serve", "--backend", "host", "--config"])
        .arg(&config)
        .arg("--socket")
        .arg(&socket)
        .stderr(std::fs::File::create(dir.path().join("log")).unwrap())
        .spawn()
        .unwrap();
    let daemon = Stopped(daemon);
    let log = || std::fs::read_to_string(dir.path().join("log")).unwrap_or_default();
    let up = common::wait_until(Duration::from_secs(10), || {
        UnixStream::connect(&socket).is_ok()
    });
    assert!(up, "the daemon did not start:\n{}", log());
    let conn = raw(&socket);
    let e = error_reply(&conn);
    assert_eq!(e.code, ErrorCode::Refused, "{e:?}");
    assert_eq!(e.reason.as_deref(), Some("pid_not_visible"), "{e:?}");
    assert!(e.message.contains("pid namespace"), "{}", e.message);
    assert!(matches!(conn.recv::<Reply>(), Err(ProtoError::Closed)));
    drop(daemon);
    assert!(
        log().contains("no pid in the daemon's pid namespace"),
        "{}",
        log()
    );
}

/// Another tenant's shared buffers cannot end a tenant's connection or hide from it: an access
/// list is bounded, and a List of buffers too wide for one message comes in pages, each a message,
/// that together name every buffer, while the connection and what it holds stay.
#[test]
fn a_list_too_large_for_a_message_comes_in_pages() {
    use vram_core::shared::{Acl, Principal, MAX_ACL_ENTRIES};
    use vram_proto::{SharedReply, SharedRequest};

    let d = Daemon::start("capacity = \"1 GiB\"\nmetrics = \"off\"\n");
    let wide = raw_tenant(&d.socket, "wide", None);
    let acl = |tag: &str, n: usize| Acl {
        readers: std::iter::once(Principal::Anyone)
            .chain((1..n).map(|i| Principal::Tenant(format!("{tag}-{i:04}-{}", "r".repeat(50)))))
            .collect(),
        writers: Vec::new(),
    };
    let create = |id, name: &str, acl| {
        let request = SharedRequest::Create {
            name: name.into(),
            size: Bytes::mib(2),
            acl,
        };
        ask(&wide, id, Request::Shared(request))
    };
    let e = error_of(create(2, "too-wide", acl("x", MAX_ACL_ENTRIES + 1)));
    assert_eq!(e.reason.as_deref(), Some("too_many"), "{e:?}");
    // Names are at most 64 bytes: twenty lists as long as allowed pass a message together.
    for i in 0..20 {
        let name = format!("wide{i:02}");
        let made = create(3 + i as u64, &name, acl(&name, MAX_ACL_ENTRIES));
        assert!(
            matches!(made, Reply::Shared(SharedReply::Buffer(_))),
            "{made:?}"
        );
    }

    let lister = raw_tenant(&d.socket, "lister", None);
    let (_, _memory) = granted(&lister, 2, Bytes::mib(8));
    let (mut names, mut pages, mut after) = (Vec::new(), 0, None);
    loop {
        let reply = ask(
            &lister,
            3 + pages,
            Request::Shared(SharedRequest::List { after }),
        );
        let Reply::Shared(SharedReply::Buffers { buffers, next }) = reply else {
            panic!("page {pages}: {reply:?}");
        };
        pages += 1;
        names.extend(buffers.into_iter().map(|b| b.name));
        match next {
            Some(n) => after = Some(n),
            None => break,
        }
    }
    let wanted: Vec<String> = (0..20).map(|i| format!("wide{i:02}")).collect();
    assert_eq!(names, wanted, "every buffer once, in order");
    assert!(pages > 1, "twenty wide lists take more than one message");
    let (_, _more) = granted(&lister, 100, Bytes::mib(2));
    assert_eq!(d.held_by("lister"), Bytes::mib(10));
}

/// Reads of a whole version (`Verify`, each on a thread of its own) stop soon after their
/// connection closes, instead of reading on for nobody: sixteen verifies of a 512 MiB version
/// asked and left are gone within a fraction of what reading them all would take.
#[test]
fn reads_of_a_whole_version_stop_with_their_connection() {
    use vram_proto::{LeaseOp, SharedReply, SharedRequest};

    let d = Daemon::start("capacity = \"1 GiB\"\nmetrics = \"off\"\n");
    let w = raw_tenant(&d.socket, "w", None);
    let Reply::Shared(SharedReply::Buffer(info)) = ask(
        &w,
        2,
        Request::Shared(SharedRequest::Create {
            name: "big".into(),
            size: Bytes::mib(512),
            acl: Default::default(),
        }),
    ) else {
        panic!("no buffer")
    };
    let buffer = info.id;
    let lease = SharedRequest::Lease {
        buffer,
        op: LeaseOp::Acquire,
        ttl_ms: 60_000,
    };
    assert!(matches!(
        ask(&w, 3, Request::Shared(lease)),
        Reply::Shared(SharedReply::Lease { .. })
    ));
    let begin = SharedRequest::BeginWrite { buffer, base: None };
    w.send(4, &Request::Shared(begin), &[]).unwrap();
    let r = w.recv::<Reply>().unwrap();
    let Reply::Shared(SharedReply::Draft { version, .. }) = r.msg else {
        panic!("no draft: {:?}", r.msg)
    };
    drop(r.fds);
    let started = std::time::Instant::now();
    let publish = SharedRequest::Publish {
        buffer,
        version,
        checksum: None,
    };
    let published = ask(&w, 5, Request::Shared(publish));
    assert!(matches!(
        published,
        Reply::Shared(SharedReply::Published { .. })
    ));
    let one_read = started.elapsed();
    let threads = |pid: u32| {
        std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .filter(|comm| comm.starts_with("vramd-shared"))
            .count()
    };
    for id in 6..22 {
        let verify = SharedRequest::Verify { buffer, version };
        w.send(id, &Request::Shared(verify), &[]).unwrap();
    }
    std::thread::sleep(Duration::from_millis(20));
    drop(w);
    let left = std::time::Instant::now();
    // Reading all sixteen takes a few times one read, on however many cores (about 2.5 times on
    // two); each stops after a piece of it.
    let limit = one_read + Duration::from_millis(300);
    assert!(
        common::wait_until(limit, || threads(d.pid()) == 0),
        "{} verify threads still read {:?} after their connection closed (one read: {one_read:?})",
        threads(d.pid()),
        left.elapsed()
    );
    println!(
        "one read of 512 MiB: {one_read:?}; the reads stopped within {:?}",
        left.elapsed()
    );
}
