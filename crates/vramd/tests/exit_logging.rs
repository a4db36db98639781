//! How a tenant ends and how its end is logged: one that said `Bye` finished (INFO, with what it
//! held then); one that did not crashed (WARN `crash reclaim`, with what came back and, when the
//! daemon can still read it, the signal that ended the process). A client's close returns once the
//! daemon has released what the tenant held.

mod common;

use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use common::{wait_until, Daemon};
use vram_client::{Client, Observer, TenantOptions};
use vram_core::Bytes;
use vram_proto::{Conn, Hello, Reply, Request, Role};

#[test]
fn what_a_closed_client_held_is_back_when_its_close_returns() {
    let d = Daemon::start("capacity = \"1 GiB\"\nmetrics = \"off\"\n");
    let observer = Observer::connect(Some(&d.socket)).unwrap();
    for round in 0..30 {
        let client = Client::connect(Some(&d.socket), &TenantOptions::named("closer")).unwrap();
        let grants = client.grant_many(&[Bytes::mib(2); 4]).unwrap();
        let started = Instant::now();
        client.close();
        let took = started.elapsed();
        // The grants' handles are this process's to drop; the daemon's books are what count.
        drop(grants);
        let status = observer.status().unwrap();
        let names: Vec<_> = status.tenants.iter().map(|t| t.name.as_str()).collect();
        assert!(
            !names.contains(&"closer"),
            "round {round}: still listed: {names:?}"
        );
        let held: u64 = status.devices.iter().map(|dev| dev.held.get()).sum();
        assert_eq!(
            held, 0,
            "round {round}: the daemon still holds {held} B for tenants"
        );
        // The daemon answered: the close did not run out its wait.
        assert!(
            took < Duration::from_secs(4),
            "round {round}: close took {took:?}"
        );
    }
    d.stop();
}

fn tenant_conn(d: &Daemon, name: &str) -> Conn {
    let stream = UnixStream::connect(&d.socket).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let conn = Conn::new(stream);
    let hello = Hello {
        role: Role::Tenant {
            name: name.into(),
            class: None,
            guarantee: None,
            limit: None,
        },
        gpu: None,
        client: "exit_logging test".into(),
        resume: None,
    };
    conn.send(1, &Request::Hello(hello), &[]).unwrap();
    assert!(matches!(
        conn.recv::<Reply>().unwrap().msg,
        Reply::Welcome(_)
    ));
    conn
}

/// The log lines that mention `tenant`.
fn lines_of(d: &Daemon, tenant: &str) -> Vec<String> {
    let quoted = format!("\"{tenant}\"");
    d.log()
        .lines()
        .filter(|l| l.contains(&quoted))
        .map(str::to_string)
        .collect()
}

#[test]
fn a_tenant_that_says_bye_is_logged_as_finished_with_what_it_held() {
    let d = Daemon::start("capacity = \"1 GiB\"\nmetrics = \"off\"\n");
    let conn = tenant_conn(&d, "finisher");
    conn.send(
        2,
        &Request::Grant {
            bytes: Bytes::mib(64),
        },
        &[],
    )
    .unwrap();
    let granted = conn.recv::<Reply>().unwrap();
    assert!(matches!(granted.msg, Reply::Granted { .. }), "{granted:?}");
    conn.send(3, &Request::Bye, &[]).unwrap();
    assert_eq!(conn.recv::<Reply>().unwrap().msg, Reply::Ack);
    drop(conn);
    d.wait_for_no_tenants();
    assert!(wait_until(Duration::from_secs(5), || lines_of(
        &d, "finisher"
    )
    .iter()
    .any(|l| l.contains("tenant finished"))));
    let lines = lines_of(&d, "finisher");
    let finished = lines
        .iter()
        .find(|l| l.contains("tenant finished"))
        .unwrap();
    assert!(finished.contains("INFO"), "{finished}");
    assert!(finished.contains("held=64 MiB"), "{finished}");
    assert!(
        !lines.iter().any(|l| l.contains("crash reclaim")),
        "{lines:#?}"
    );
    d.stop();
}

#[test]
fn a_killed_tenant_is_a_crash_reclaim_with_its_signal() {
    let d = Daemon::start("capacity = \"1 GiB\"\nmetrics = \"off\"\n");
    let mut t = d.tenant("victim", &[]);
    let took = t.cmd("take 32MiB 2MiB");
    assert_eq!(took["taken"], Bytes::mib(32).get(), "{took}");
    // SIGKILL, but not reaped yet: the daemon finds a zombie and reads how it ended.
    t.child().kill().unwrap();
    assert!(
        wait_until(Duration::from_secs(5), || lines_of(&d, "victim")
            .iter()
            .any(|l| l.contains("crash reclaim"))),
        "{}",
        d.log()
    );
    let lines = lines_of(&d, "victim");
    let crash = lines.iter().find(|l| l.contains("crash reclaim")).unwrap();
    assert!(crash.contains("WARN"), "{crash}");
    assert!(crash.contains("reclaimed=32 MiB"), "{crash}");
    assert!(crash.contains("signal=9"), "{crash}");
    t.kill();
    d.stop();
}

#[test]
fn a_tenant_that_closes_without_bye_while_alive_is_a_crash_reclaim_without_a_signal() {
    let d = Daemon::start("capacity = \"1 GiB\"\nmetrics = \"off\"\n");
    let conn = tenant_conn(&d, "closer");
    conn.send(
        2,
        &Request::Grant {
            bytes: Bytes::mib(4),
        },
        &[],
    )
    .unwrap();
    conn.recv::<Reply>().unwrap();
    drop(conn);
    assert!(wait_until(Duration::from_secs(5), || lines_of(
        &d, "closer"
    )
    .iter()
    .any(|l| l.contains("crash reclaim"))));
    let lines = lines_of(&d, "closer");
    let crash = lines.iter().find(|l| l.contains("crash reclaim")).unwrap();
    assert!(!crash.contains("signal="), "{crash}");
    d.stop();
}
