//! A tenant that stops reading its socket (SIGSTOP, a debugger) must not stall anyone else: the
//! daemon's reclaim requests to it are never waited for, and once its socket has stayed full for
//! `[connections] unread_timeout_ms` it is disconnected and its memory comes back as on a crash.

mod common;

use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{wait_until, Daemon};
use vram_core::Bytes;

/// A short reclaim wait, so that the stopped tenant's socket fills within a second or two.
const CONFIG: &str = r#"
capacity = "1 GiB"
reclaim_timeout_ms = 20
metrics = "off"
[pool]
max = "64 MiB"
sizes = ["2 MiB"]
initial = 2
"#;

const NEEDY: usize = 8;
/// What a grant may take here: the reclaim wait (20 ms) and a handle's creation, on a loaded
/// 2-core machine. The daemon never waits on the stopped tenant.
const ANSWER_BOUND: Duration = Duration::from_secs(2);
/// The default `[connections] unread_timeout_ms` (10 s), and time for the socket to fill first.
const DISCONNECT_BOUND: Duration = Duration::from_secs(25);

#[test]
fn a_stopped_tenant_holding_cached_memory_stalls_no_one() {
    let d = Daemon::start(CONFIG);
    let sleeper = d.stopped_tenant_with_cache("sleeper", Bytes::mib(896));

    // Eight tenants take and give back 64 MiB in turns; only two fit beside the sleeper's memory,
    // so the others ask it for its cache, again and again.
    let started = Instant::now();
    let (tx, rx) = mpsc::channel::<(usize, Duration, serde_json::Value)>();
    let mut needy: Vec<_> = (0..NEEDY)
        .map(|i| d.tenant(&format!("needy-{i}"), &["--limit", "128MiB"]))
        .collect();
    std::thread::scope(|s| {
        for (i, t) in needy.iter_mut().enumerate() {
            let tx = tx.clone();
            s.spawn(move || {
                while started.elapsed() < DISCONNECT_BOUND {
                    let asked = Instant::now();
                    let took = t.cmd("take 64MiB 64MiB");
                    let granted = took["taken"] == Bytes::mib(64).get();
                    if tx.send((i, asked.elapsed(), took)).is_err() {
                        return;
                    }
                    if granted {
                        assert_eq!(t.cmd("give 64MiB")["event"], "gave");
                    }
                }
            });
        }
        drop(tx);
        let mut answers = 0usize;
        let mut refused = 0usize;
        let mut granted_after_disconnect = [false; NEEDY];
        let mut disconnected_at = None;
        let mut slowest = Duration::ZERO;
        loop {
            match rx.recv_timeout(ANSWER_BOUND * 2) {
                Ok((i, took, answer)) => {
                    answers += 1;
                    slowest = slowest.max(took);
                    assert!(
                        took < ANSWER_BOUND,
                        "needy-{i}'s grant was answered after {took:?} (bound {ANSWER_BOUND:?}): \
                         {answer}"
                    );
                    if answer["taken"] == Bytes::mib(64).get() {
                        if disconnected_at.is_some() {
                            granted_after_disconnect[i] = true;
                        }
                    } else {
                        assert!(!answer["refused"].is_null(), "{answer}");
                        refused += 1;
                    }
                    if disconnected_at.is_none()
                        && !d.status().tenants.iter().any(|t| t.name == "sleeper")
                    {
                        disconnected_at = Some(started.elapsed());
                    }
                    if granted_after_disconnect.iter().all(|g| *g) {
                        break;
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => panic!(
                    "a needy tenant's grant got no answer within {:?} ({answers} answers so far)",
                    ANSWER_BOUND * 2
                ),
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
        let disconnected_at = disconnected_at.unwrap_or_else(|| {
            panic!(
                "the stopped tenant was never disconnected ({answers} answers, {refused} refused)"
            )
        });
        eprintln!(
            "{answers} grants answered ({refused} refused), slowest {slowest:?}; the stopped \
             tenant was disconnected after {disconnected_at:?}"
        );
        assert!(
            granted_after_disconnect.iter().all(|g| *g),
            "after the stopped tenant was disconnected every needy tenant gets its memory: \
             {granted_after_disconnect:?}"
        );
        // The needy threads stop at DISCONNECT_BOUND; stop them sooner.
        drop(rx);
    });
    let log = d.log();
    assert!(
        log.contains("does not read its socket"),
        "the log says why the tenant was disconnected:\n{log}"
    );
    assert!(
        wait_until(Duration::from_secs(5), || d.held_by("sleeper")
            == Bytes::ZERO),
        "the sleeper's memory is back"
    );
    sleeper.kill(); // SIGKILL ends a stopped process too
    for t in needy {
        t.exit();
    }
    d.wait_for_no_tenants();
    d.stop();
}
