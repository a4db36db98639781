//! A daemon that one of vramd's tools starts for itself (`vramd demo`, `bench`, `replay
//! --through-daemon`) stops when that tool ends, however it ends: killed, it cannot stop its
//! daemon, and the daemon's standard input, a pipe only the tool held, reaching its end does.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{wait_until, VRAMD};

#[test]
fn a_daemon_told_to_stops_cleanly_when_its_standard_input_closes() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("vramd.sock");
    let log = std::fs::File::create(dir.path().join("vramd.log")).unwrap();
    let mut child = Command::new(VRAMD)
        .args(["serve", "--backend", "host", "--metrics", "off"])
        .arg("--socket")
        .arg(&socket)
        .arg("--stop-on-stdin-close")
        .stdin(Stdio::piped())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    assert!(wait_until(Duration::from_secs(10), || socket.exists()));
    // What it reads is ignored: it keeps serving until the end.
    stdin.write_all(b"anything\n").unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert!(child.try_wait().unwrap().is_none(), "it stopped on input");
    drop(stdin);
    let log = || std::fs::read_to_string(dir.path().join("vramd.log")).unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || child
            .try_wait()
            .unwrap()
            .is_some()),
        "still running after its standard input closed; its log:\n{}",
        log()
    );
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0), "{}", log());
    assert!(!socket.exists(), "its socket outlived it");
    assert!(
        log().contains("standard input closed: stopping"),
        "{}",
        log()
    );
}

#[test]
fn the_daemon_of_a_killed_demo_stops() {
    let mut demo = Command::new(VRAMD)
        .arg("demo")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // "  socket and daemon log in DIR (removed at the end; ...)"
    let mut lines = BufReader::new(demo.stdout.take().unwrap()).lines();
    let dir: PathBuf = loop {
        let line = lines
            .next()
            .expect("the demo ended before naming its directory")
            .unwrap();
        if let Some(rest) = line.trim().strip_prefix("socket and daemon log in ") {
            break rest.split(" (").next().unwrap().into();
        }
    };
    let socket = dir.join("vramd.sock");
    assert!(
        wait_until(Duration::from_secs(10), || socket.exists()),
        "the demo's daemon did not come up"
    );
    demo.kill().unwrap();
    demo.wait().unwrap();
    drop(lines);
    let stopped = wait_until(Duration::from_secs(10), || !socket.exists());
    let log = std::fs::read_to_string(dir.join("vramd.log")).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        stopped,
        "the daemon of the killed demo still serves; its log:\n{log}"
    );
    assert!(log.contains("standard input closed: stopping"), "{log}");
}
