//! Every peer is bounded: how long it may stay silent before its first request, how long one
//! frame may take, how many connections one uid may open, how many waits one tenant may have in
//! flight, and the status report always fits in a frame. With the default settings.

mod common;

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{wait_until, Daemon, VRAMD};
use vram_client::Observer;
use vram_core::shared::{Acl, BufferId, Principal};
use vram_core::Bytes;
use vram_proto::{
    Conn, ErrorCode, Hello, ProtoError, Reply, Request, Role, SharedReply, SharedRequest,
};

/// A raw connection whose reads give up after `patience`.
fn raw(socket: &Path, patience: Duration) -> Conn {
    let stream = UnixStream::connect(socket).unwrap();
    stream.set_read_timeout(Some(patience)).unwrap();
    Conn::new(stream)
}

fn hello_tenant(conn: &Conn, name: &str) {
    let hello = Hello {
        role: Role::Tenant {
            name: name.into(),
            class: None,
            guarantee: None,
            limit: None,
        },
        gpu: None,
        client: "peer_bounds test".into(),
        resume: None,
    };
    conn.send(1, &Request::Hello(hello), &[]).unwrap();
    let r = conn.recv::<Reply>().unwrap();
    assert!(matches!(r.msg, Reply::Welcome(_)), "{:?}", r.msg);
}

/// Reads until the daemon closes the connection; the error replies it sent on the way.
fn errors_until_closed(conn: &Conn) -> Result<Vec<vram_proto::ErrorReply>, ProtoError> {
    let mut errors = Vec::new();
    loop {
        match conn.recv::<Reply>() {
            Ok(r) => match r.msg {
                Reply::Error(e) => errors.push(e),
                other => panic!("unexpected reply {other:?}"),
            },
            Err(ProtoError::Closed) => return Ok(errors),
            Err(ProtoError::Io(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                return Ok(errors)
            }
            Err(e) => return Err(e),
        }
    }
}

fn threads_of(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .count()
}

/// The default `[connections] hello_timeout_ms`.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// The default `[connections] frame_timeout_ms`.
const FRAME_TIMEOUT: Duration = Duration::from_secs(5);

#[test]
fn a_silent_peer_is_closed_after_the_first_request_deadline() {
    let d = Daemon::start("capacity = \"1 GiB\"\nmetrics = \"off\"\n");
    let started = Instant::now();
    let conn = raw(&d.socket, HELLO_TIMEOUT * 2);
    let errors = errors_until_closed(&conn).unwrap_or_else(|e| {
        panic!(
            "the daemon kept a silent connection open for {:?}: {e}",
            started.elapsed()
        )
    });
    let waited = started.elapsed();
    assert!(
        waited >= HELLO_TIMEOUT - Duration::from_millis(100)
            && waited < HELLO_TIMEOUT + Duration::from_secs(3),
        "closed after {waited:?}"
    );
    assert!(
        errors
            .iter()
            .any(|e| e.code == ErrorCode::Protocol && e.message.contains("no request within 10 s")),
        "{errors:?}"
    );
    // A peer that asks at once is served as ever.
    Observer::connect(Some(&d.socket))
        .unwrap()
        .status()
        .unwrap();
    d.stop();
}

#[test]
fn a_frame_dripped_one_byte_every_3_s_is_cut_off() {
    let d = Daemon::start("capacity = \"1 GiB\"\nmetrics = \"off\"\n");
    let conn = Arc::new(raw(&d.socket, Duration::from_secs(30)));
    let mut frame = vram_proto::FrameHeader::new(0, 2).encode().to_vec();
    frame.extend_from_slice(&[0, 0]);
    let started = Instant::now();
    let dripper = {
        let conn = conn.clone();
        std::thread::spawn(move || {
            for b in frame {
                if conn.send_bytes(&[b]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_secs(3));
            }
        })
    };
    let errors = errors_until_closed(&conn)
        .unwrap_or_else(|e| panic!("no close {:?} after the first byte: {e}", started.elapsed()));
    let waited = started.elapsed();
    assert!(
        waited < FRAME_TIMEOUT + Duration::from_secs(2),
        "a frame stayed open {waited:?}"
    );
    assert!(
        errors
            .iter()
            .any(|e| e.code == ErrorCode::Protocol && e.message.contains("one frame")),
        "{errors:?}"
    );
    let _ = conn.stream().shutdown(std::net::Shutdown::Both);
    dripper.join().unwrap();
    d.stop();
}

/// The default `[connections] max_per_uid`.
const MAX_PER_UID: usize = 256;

#[test]
fn one_uid_may_open_max_per_uid_connections_and_the_next_is_told_why_not() {
    let d = Daemon::start("capacity = \"1 GiB\"\nmetrics = \"off\"\n");
    let mut open = Vec::new();
    for i in 0..MAX_PER_UID {
        let c = raw(&d.socket, Duration::from_secs(10));
        c.send(1, &Request::Ping, &[]).unwrap();
        let r = c.recv::<Reply>().unwrap();
        assert_eq!(r.msg, Reply::Pong, "connection {i}");
        open.push(c);
    }
    let extra = raw(&d.socket, Duration::from_secs(10));
    let errors = errors_until_closed(&extra).unwrap();
    let uid = rustix::process::getuid().as_raw();
    let e = errors.first().expect("an error reply before the close");
    assert_eq!(e.code, ErrorCode::Refused, "{e:?}");
    assert_eq!(e.reason.as_deref(), Some("too_many_connections"), "{e:?}");
    assert!(
        e.message
            .contains(&format!("uid {uid} has {MAX_PER_UID} connections open")),
        "{}",
        e.message
    );
    // One closed: room for one more.
    drop(open.pop());
    assert!(wait_until(Duration::from_secs(5), || {
        Observer::connect(Some(&d.socket))
            .and_then(|o| o.status())
            .is_ok()
    }));
    drop(open);
    d.stop();
}

/// Out of file descriptors, the daemon refuses what it cannot serve with a reason, and says so in
/// its log once in a while, not at every attempt.
#[test]
fn out_of_fds_the_daemon_refuses_clearly_and_logs_rarely() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("vramd.sock");
    let log_path = dir.path().join("vramd.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let child = Command::new("sh")
        .arg("-c")
        .arg(r#"ulimit -n 40 && exec "$0" serve --backend host --capacity 1GiB --metrics off --socket "$1""#)
        .arg(VRAMD)
        .arg(&socket)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let mut child = KillOnDrop(child);
    assert!(wait_until(Duration::from_secs(10), || Observer::connect(
        Some(&socket)
    )
    .and_then(|o| o.status())
    .is_ok()));
    // Far more peers than the daemon has descriptors for.
    let mut served = Vec::new();
    let mut refused = 0;
    let started = Instant::now();
    for _ in 0..80 {
        let c = raw(&socket, Duration::from_secs(5));
        // A refused peer may find the connection closed before it writes: it reads why.
        let _ = c.send(1, &Request::Ping, &[]);
        match c.recv::<Reply>() {
            Ok(r) if r.msg == Reply::Pong => served.push(c),
            Ok(r) => match r.msg {
                Reply::Error(e) => {
                    assert!(e.message.contains("file descriptors"), "{e:?}");
                    refused += 1;
                }
                other => panic!("{other:?}"),
            },
            Err(e) => panic!(
                "a peer beyond the fd limit got no answer ({} served): {e}",
                served.len()
            ),
        }
    }
    std::thread::sleep(Duration::from_secs(2));
    let text = std::fs::read_to_string(&log_path).unwrap();
    let lines = text.matches("accept failed").count();
    eprintln!(
        "{} served, {refused} refused in {:?}; {lines} `accept failed` lines",
        served.len(),
        started.elapsed()
    );
    assert!(refused > 0, "the fd limit was never reached");
    assert!(lines <= 3, "{lines} lines:\n{text}");
    drop(served);
    assert!(wait_until(Duration::from_secs(5), || Observer::connect(
        Some(&socket)
    )
    .and_then(|o| o.status())
    .is_ok()));
    rustix::process::kill_process(
        rustix::process::Pid::from_child(&child.0),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    assert!(child.0.wait().unwrap().success(), "{text}");
}

/// A daemon of a test's own making, killed if the test fails first.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn create_buffer(conn: &Conn, id: u64, name: &str, readers: Vec<Principal>) -> BufferId {
    let acl = Acl {
        readers,
        writers: Vec::new(),
    };
    let create = SharedRequest::Create {
        name: name.into(),
        size: Bytes::mib(2),
        acl,
    };
    conn.send(id, &Request::Shared(create), &[]).unwrap();
    match conn.recv::<Reply>().unwrap().msg {
        Reply::Shared(SharedReply::Buffer(info)) => info.id,
        other => panic!("{other:?}"),
    }
}

/// The default `[connections] max_waits`.
const MAX_WAITS: usize = 16;

#[test]
fn waits_are_bounded_per_tenant_and_end_with_their_connection() {
    let d = Daemon::start("capacity = \"1 GiB\"\nmetrics = \"off\"\n");
    let baseline = threads_of(d.pid());
    for round in 0..3 {
        let conn = Arc::new(raw(&d.socket, Duration::from_secs(30)));
        hello_tenant(&conn, &format!("waiter-{round}"));
        let buffer = create_buffer(&conn, 2, &format!("weights-{round}"), Vec::new());
        let refused = Arc::new(AtomicUsize::new(0));
        let reader = {
            let (conn, refused) = (conn.clone(), refused.clone());
            std::thread::spawn(move || {
                while let Ok(r) = conn.recv::<Reply>() {
                    match r.msg {
                        Reply::Error(e) => {
                            assert_eq!(e.reason.as_deref(), Some("too_many_waits"), "{e:?}");
                            assert!(e.message.contains("at most 16"), "{}", e.message);
                            refused.fetch_add(1, Ordering::Relaxed);
                        }
                        other => panic!("a wait ended early: {other:?}"),
                    }
                }
            })
        };
        for i in 0..1000 {
            let wait = SharedRequest::WaitNewer {
                buffer,
                than: None,
                timeout_ms: 600_000,
            };
            conn.send(10 + i, &Request::Shared(wait), &[]).unwrap();
        }
        assert!(
            wait_until(Duration::from_secs(10), || refused.load(Ordering::Relaxed)
                == 1000 - MAX_WAITS),
            "round {round}: {} of 1000 waits refused",
            refused.load(Ordering::Relaxed)
        );
        let during = threads_of(d.pid());
        assert!(
            during <= baseline + MAX_WAITS + 2,
            "round {round}: {during} threads with 1000 waits asked (baseline {baseline})"
        );
        conn.stream().shutdown(std::net::Shutdown::Both).unwrap();
        reader.join().unwrap();
        assert!(
            wait_until(Duration::from_secs(3), || threads_of(d.pid()) <= baseline),
            "round {round}: {} threads after the connection closed (baseline {baseline})",
            threads_of(d.pid())
        );
    }
    d.stop();
}

#[test]
fn a_status_report_too_large_for_a_frame_is_cut_and_says_so() {
    let d = Daemon::start("capacity = \"1 GiB\"\nmetrics = \"off\"\n");
    let conn = raw(&d.socket, Duration::from_secs(30));
    hello_tenant(&conn, "owner");
    // Access lists as long as allowed, of names as long as allowed (64 bytes, about 17 KiB a
    // list): twenty such buffers pass a frame.
    let entries = vram_core::shared::MAX_ACL_ENTRIES;
    let buffers = 20;
    let readers = |b: usize| -> Vec<Principal> {
        (0..entries)
            .map(|i| Principal::Tenant(format!("r{b:02}-{i:04}-{}", "r".repeat(55))))
            .collect()
    };
    for b in 0..buffers {
        create_buffer(&conn, 2 + b as u64, &format!("wide-{b}"), readers(b));
    }
    let s = Observer::connect(Some(&d.socket))
        .unwrap()
        .status()
        .unwrap_or_else(|e| panic!("status failed: {e}"));
    assert_eq!(s.shared.buffers.len(), buffers);
    for b in s.shared.buffers.iter().filter(|b| b.acl_left_out > 0) {
        let shown = b.info.acl.readers.len();
        assert_eq!(
            shown + b.acl_left_out as usize,
            entries,
            "{}: {shown} shown, {} left out",
            b.info.name,
            b.acl_left_out
        );
    }
    assert!(s.shared.buffers.iter().any(|b| b.acl_left_out > 0));
    let log = d.log();
    assert!(log.contains("status report cut"), "{log}");
    // `vramd status` shows it, and says what it left out.
    let out = Command::new(VRAMD)
        .args(["status", "--socket"])
        .arg(&d.socket)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("left out"), "{text}");
    drop(conn);
    let _ = std::io::stderr().flush();
    d.stop();
}
