//! A daemon restart loses nothing: tenants keep their memory, reconnect by themselves, carry on,
//! and the new daemon's books say exactly what they hold. Real processes on the host backend: a
//! `vramd serve` killed (SIGKILL) or stopped (SIGTERM) and started again on the same socket, and
//! scripted tenants (`vramd tenant`, which use vram-client as any tenant does).

use std::ffi::OsStr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use vram_client::Observer;
use vram_core::Bytes;
use vram_proto::StatusReport;
use vramd::own_daemon::OwnDaemon;

mod common;
use common::{wait_until, Tenant, VRAMD};

/// A daemon that can be stopped and started again in the same place (`vramd::own_daemon`).
struct Restartable {
    d: OwnDaemon,
}

impl Restartable {
    fn new(config: &str) -> Restartable {
        let dir = tempfile::Builder::new()
            .prefix("vramd-restart-")
            .tempdir()
            .unwrap();
        let config_path = dir.path().join("vramd.toml");
        std::fs::write(&config_path, config).unwrap();
        let args = [
            OsStr::new("--backend"),
            OsStr::new("host"),
            OsStr::new("--metrics"),
            OsStr::new("off"),
            OsStr::new("--config"),
            config_path.as_os_str(),
        ];
        let d = OwnDaemon::spawn(Path::new(VRAMD), dir, &args).unwrap_or_else(|e| panic!("{e:#}"));
        Restartable { d }
    }

    fn start(&mut self) {
        self.d.start_again().unwrap_or_else(|e| panic!("{e:#}"));
    }

    /// Stops the daemon with `signal` and waits for it to be gone.
    fn stop(&mut self, signal: rustix::process::Signal) {
        self.d.signal(signal).unwrap();
    }

    fn try_status(&self) -> Option<StatusReport> {
        Observer::connect(Some(self.d.socket()))
            .and_then(|o| o.status())
            .ok()
    }

    fn status(&self) -> StatusReport {
        self.try_status()
            .unwrap_or_else(|| panic!("no status:\n{}", self.log()))
    }

    fn log(&self) -> String {
        self.d.log()
    }

    fn socket(&self) -> &Path {
        self.d.socket()
    }
}

fn held_by(s: &StatusReport, name: &str) -> Option<Bytes> {
    s.tenants.iter().find(|t| t.name == name).map(|t| t.held)
}

const CONFIG: &str = "capacity = \"8 GiB\"\n[pool]\nmax = \"64 MiB\"\n";

#[test]
fn tenants_keep_their_memory_and_carry_on_across_a_restart() {
    for signal in [rustix::process::Signal::KILL, rustix::process::Signal::TERM] {
        let mut d = Restartable::new(CONFIG);
        let mut a = Tenant::spawn(d.socket(), "a", &["--limit", "2GiB"]);
        assert_eq!(a.next()["event"], "welcome");
        let mut b = Tenant::spawn(d.socket(), "b", &["--guarantee", "1GiB"]);
        assert_eq!(b.next()["event"], "welcome");
        assert_eq!(a.cmd("take 512MiB 64MiB")["taken"], Bytes::mib(512).get());
        assert_eq!(b.cmd("take 256MiB 64MiB")["taken"], Bytes::mib(256).get());

        // The state file is rewritten within 100 ms of a change: let it hold the takes, so that
        // the new daemon adopts them from the file (the next test covers a file that lags).
        std::thread::sleep(Duration::from_millis(300));
        d.stop(signal);
        d.start();
        let s = d.status();
        assert_eq!(
            held_by(&s, "a"),
            Some(Bytes::mib(512)),
            "{signal:?}: {s:?}\n{}",
            d.log()
        );
        assert_eq!(held_by(&s, "b"), Some(Bytes::mib(256)), "{signal:?}");
        assert_eq!(
            s.tenants.iter().find(|t| t.name == "b").unwrap().guarantee,
            Bytes::gib(1)
        );
        assert!(d.log().contains("adopted a tenant"), "{}", d.log());

        // Their memory is intact, and they go on taking and giving back.
        let v = a.cmd("verify");
        assert_eq!(v["bad"], 0, "{v}");
        let took = a.cmd("take 256MiB 64MiB");
        assert_eq!(took["taken"], Bytes::mib(256).get(), "{took}\n{}", d.log());
        assert_eq!(a.cmd("give 512MiB")["held"], Bytes::mib(256).get());
        assert!(wait_until(Duration::from_secs(5), || {
            held_by(&d.status(), "a") == Some(Bytes::mib(256))
        }));
        // The limit still holds across the restart: 256 MiB held, 2 GiB limit.
        let took = a.cmd("take 4GiB 256MiB");
        assert_eq!(took["refused"]["reason"], "over_limit", "{took}");
        assert_eq!(b.cmd("verify")["bad"], 0);
        a.exit();
        b.exit();
        assert!(wait_until(Duration::from_secs(5), || {
            let s = d.status();
            s.tenants.is_empty() && s.devices[0].held == Bytes::ZERO
        }));
    }
}

#[test]
fn a_tenant_that_died_while_the_daemon_was_down_is_not_adopted() {
    let mut d = Restartable::new(CONFIG);
    let mut a = Tenant::spawn(d.socket(), "a", &[]);
    assert_eq!(a.next()["event"], "welcome");
    assert_eq!(a.cmd("take 128MiB")["taken"], Bytes::mib(128).get());
    // The state file is rewritten within 100 ms of a change: let it name the tenant.
    std::thread::sleep(Duration::from_millis(300));
    d.stop(rustix::process::Signal::KILL);
    a.kill();
    d.start();
    let s = d.status();
    assert!(s.tenants.is_empty(), "{s:?}");
    assert_eq!(s.devices[0].free, s.devices[0].capacity);
    assert!(d.log().contains("not adopted"), "{}", d.log());
}

#[test]
fn grants_the_state_file_has_not_caught_up_with_are_booked_when_the_tenant_reconnects() {
    let mut d = Restartable::new(CONFIG);
    let mut a = Tenant::spawn(d.socket(), "a", &["--limit", "1GiB"]);
    assert_eq!(a.next()["event"], "welcome");
    // Killed at once: the file may not name the tenant or its grants yet.
    assert_eq!(a.cmd("take 512MiB 64MiB")["taken"], Bytes::mib(512).get());
    d.stop(rustix::process::Signal::KILL);
    d.start();
    // The tenant says what it holds when it reconnects.
    assert!(
        wait_until(Duration::from_secs(10), || {
            held_by(&d.status(), "a") == Some(Bytes::mib(512))
        }),
        "{:?}\n{}",
        d.status(),
        d.log()
    );
    assert_eq!(a.cmd("verify")["bad"], 0);
    let took = a.cmd("take 1GiB 256MiB");
    assert_eq!(took["taken"], Bytes::mib(512).get(), "{took}");
    assert_eq!(took["refused"]["reason"], "over_limit", "{took}");
    a.exit();
    assert!(wait_until(Duration::from_secs(5), || d
        .status()
        .tenants
        .is_empty()));
}

/// A tenant holding thousands of grants (more than `RESUME_PART`, the most one part of an
/// account split across frames names) reconnects with every one of them. The daemon is killed at
/// once, so that its state file cannot have caught up: what the tenant says is what the new
/// daemon books. (An account too long for one frame, sent in parts, is tested where it is made,
/// `vram-client`'s `send_ahead`, and where it is taken, `protocol_abuse.rs`.)
#[test]
fn a_tenant_holding_thousands_of_grants_reconnects_with_all_of_them() {
    let mut d = Restartable::new("capacity = \"24 GiB\"\n[pool]\nmax = \"64 MiB\"\n");
    let mut a = Tenant::spawn(d.socket(), "many", &["--limit", "20GiB"]);
    assert_eq!(a.next()["event"], "welcome");
    let grants = vram_proto::RESUME_PART as u64 + 100;
    let total = Bytes::mib(2 * grants);
    let took = a.cmd(&format!("take {}MiB 2MiB", 2 * grants));
    assert_eq!(took["taken"], total.get(), "{took}");
    d.stop(rustix::process::Signal::KILL);
    d.start();
    assert!(
        wait_until(Duration::from_secs(20), || {
            held_by(&d.status(), "many") == Some(total)
        }),
        "{:?}\n{}",
        d.status().tenants,
        d.log()
    );
    // Reconnected (a take needs the connection), its memory intact.
    let took = a.cmd("take 2MiB 2MiB");
    assert_eq!(took["taken"], Bytes::mib(2).get(), "{took}\n{}", d.log());
    assert_eq!(held_by(&d.status(), "many"), Some(total + Bytes::mib(2)));
    assert_eq!(a.cmd("verify")["bad"], 0);
    a.exit();
    assert!(wait_until(Duration::from_secs(10), || d
        .status()
        .tenants
        .is_empty()));
}

/// The chaos run: daemon restarts (SIGKILL and SIGTERM, alternating) while 16 tenants
/// take memory, write patterns, verify them and give it back throughout, each also keeping a
/// block written before the first restart. No allocation fails, no pattern is lost, and once
/// every tenant has exited the last daemon's books and its device hold nothing.
#[test]
fn restarts_under_sixteen_busy_tenants_lose_nothing() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    let restarts: u32 = 50;
    let mut d = Restartable::new("capacity = \"16 GiB\"\n[pool]\nmax = \"64 MiB\"\n");
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..16)
        .map(|i| {
            let mut t = Tenant::spawn(d.socket(), &format!("t{i}"), &["--limit", "1GiB"]);
            assert_eq!(t.next()["event"], "welcome");
            assert_eq!(t.cmd("take 64MiB")["taken"], Bytes::mib(64).get());
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut rounds = 0;
                while !stop.load(Ordering::Acquire) {
                    let r = t.cmd("cycles 10 4MiB");
                    assert_eq!(r["errors"], 0, "t{i} round {rounds}: {r}");
                    rounds += 1;
                }
                let v = t.cmd("verify");
                assert_eq!(v["bad"], 0, "t{i}: {v}");
                t.exit();
                rounds
            })
        })
        .collect();
    for r in 0..restarts {
        std::thread::sleep(Duration::from_millis(40 + 13 * u64::from(r % 7)));
        let signal = if r % 2 == 0 {
            rustix::process::Signal::KILL
        } else {
            rustix::process::Signal::TERM
        };
        d.stop(signal);
        d.start();
    }
    stop.store(true, Ordering::Release);
    for w in workers {
        let rounds = w.join().expect("a tenant failed");
        assert!(rounds > 0);
    }
    assert!(
        wait_until(Duration::from_secs(10), || {
            let s = d.status();
            let dev = &s.devices[0];
            s.tenants.is_empty() && dev.held == Bytes::ZERO && dev.device_used == dev.pooled
        }),
        "{:?}",
        d.status()
    );
}

/// `vramd run` registered the tenant and the daemon restarted before the program first asked for
/// memory: the invitation survives in the state file, and the program joins the new daemon.
#[test]
fn a_program_joins_its_registration_after_a_restart() {
    use std::io::{BufRead, Write};
    let mut d = Restartable::new(CONFIG);
    let mut run = Command::new(VRAMD)
        .args(["run", "--socket"])
        .arg(d.socket())
        .args(["--tenant", "late", "--limit", "1GiB", "--", "sh", "-c"])
        .arg("read go; exec \"$0\" tenant --socket \"$1\" --name late")
        .arg(VRAMD)
        .arg(d.socket())
        .env("VRAMD_LIB", VRAMD)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    assert!(wait_until(Duration::from_secs(5), || held_by(
        &d.status(),
        "late"
    )
    .is_some()));
    // The state file is rewritten within 100 ms of a change.
    std::thread::sleep(Duration::from_millis(300));
    d.stop(rustix::process::Signal::KILL);
    d.start();
    let mut stdin = run.stdin.take().unwrap();
    let mut lines = std::io::BufReader::new(run.stdout.take().unwrap()).lines();
    writeln!(stdin, "go").unwrap();
    let welcome = lines.next().unwrap().unwrap();
    assert!(welcome.contains("\"welcome\""), "{welcome}\n{}", d.log());
    writeln!(stdin, "take 128MiB").unwrap();
    let took = lines.next().unwrap().unwrap();
    assert!(
        took.contains(&format!("\"taken\":{}", Bytes::mib(128).get())),
        "{took}"
    );
    assert_eq!(held_by(&d.status(), "late"), Some(Bytes::mib(128)));
    drop(stdin);
    assert!(run.wait().unwrap().success());
    // The program is gone and so is `vramd run`, which registered it: nothing is left.
    assert!(wait_until(Duration::from_secs(5), || d
        .status()
        .tenants
        .is_empty()));
}

/// A daemon that does not come back: calls wait for it only within the client's reconnect
/// window, then fail at once (one try each), and the client carries on once a daemon is back.
#[test]
fn once_the_reconnect_window_passed_calls_fail_at_once_until_a_daemon_is_back() {
    use std::time::Instant;
    use vram_client::{Client, TenantOptions};

    let mut d = Restartable::new(CONFIG);
    let client = Client::connect(Some(d.socket()), &TenantOptions::named("patient")).unwrap();
    let window = Duration::from_secs(2);
    client.set_reconnect_for(window);
    let first = client.grant(Bytes::mib(2)).unwrap();
    d.stop(rustix::process::Signal::KILL);

    // The first call waits out the window (the reconnect began when the connection was lost, a
    // moment before the call), the later ones do not wait.
    let started = Instant::now();
    let e = client.grant(Bytes::mib(2)).unwrap_err().to_string();
    let waited = started.elapsed();
    assert!(e.contains("did not come back within 2.0 s"), "{e}");
    assert!(
        waited >= window / 2 && waited < Duration::from_secs(30),
        "{waited:?}"
    );
    for _ in 0..3 {
        let started = Instant::now();
        let e = client.grant(Bytes::mib(2)).unwrap_err().to_string();
        assert!(e.contains("still unreachable"), "{e}");
        assert!(started.elapsed() < window / 2, "{:?}", started.elapsed());
    }

    d.start();
    let again = client.grant(Bytes::mib(2)).unwrap();
    assert!(client.reconnects() >= 1);
    assert_eq!(
        held_by(&d.status(), "patient"),
        Some(Bytes::mib(4)),
        "{}",
        d.log()
    );
    client.give_back(vec![first, again]).unwrap();
    client.close();
}

/// A state file that cannot be written for a while is written once it can, though the books did
/// not change meanwhile: a restart after that knows what the tenants hold.
#[test]
fn the_state_is_saved_once_it_can_be_though_nothing_changed_since() {
    let d = Restartable::new(CONFIG);
    let mut state = d.socket().as_os_str().to_owned();
    state.push(".state");
    let state = std::path::PathBuf::from(state);
    // The daemon writes a temporary file beside the state and renames it over the state: a
    // folder (not empty) in the state's place makes every write fail. (The daemon may write the
    // file again between its removal and the folder's creation: tried until the folder is made.)
    let blocker = state.clone();
    assert!(wait_until(Duration::from_secs(5), || {
        let _ = std::fs::remove_file(&blocker);
        std::fs::create_dir(&blocker).is_ok()
    }));
    std::fs::write(blocker.join("keep"), "").unwrap();
    let mut a = Tenant::spawn(d.socket(), "a", &[]);
    assert_eq!(a.next()["event"], "welcome");
    assert_eq!(a.cmd("take 128MiB")["taken"], Bytes::mib(128).get());
    assert!(
        wait_until(Duration::from_secs(5), || d
            .log()
            .contains("cannot save the daemon's state")),
        "{}",
        d.log()
    );
    std::fs::remove_dir_all(&blocker).unwrap();
    let names_a = || {
        std::fs::read(&state)
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .is_some_and(|v| {
                v["tenants"]
                    .as_array()
                    .is_some_and(|t| t.iter().any(|t| t["name"] == "a"))
            })
    };
    assert!(
        wait_until(Duration::from_secs(5), names_a),
        "the state file does not name the tenant:\n{}",
        d.log()
    );
    assert!(
        wait_until(Duration::from_secs(5), || d
            .log()
            .contains("state is saved again")),
        "{}",
        d.log()
    );
    a.exit();
}

/// A restart under a configuration that no longer admits a live tenant as it was (its class
/// gone, its declared owners changed) keeps what the tenant holds in the books while its process
/// lives: the class's tenant is adopted in the default class, the other stays booked, refused
/// at its reconnect, until it ends.
#[test]
fn a_tenant_the_new_configuration_refuses_stays_booked_until_it_ends() {
    let uid = rustix::process::getuid().as_raw();
    let before =
        format!("{CONFIG}[classes.batch]\npriority = 20\n[tenants.owned]\nowners = [{uid}]\n");
    let mut d = Restartable::new(&before);
    let mut x = Tenant::spawn(d.socket(), "x", &["--class", "batch"]);
    assert_eq!(x.next()["event"], "welcome");
    let mut owned = Tenant::spawn(d.socket(), "owned", &[]);
    assert_eq!(owned.next()["event"], "welcome");
    assert_eq!(x.cmd("take 512MiB 64MiB")["taken"], Bytes::mib(512).get());
    assert_eq!(
        owned.cmd("take 256MiB 64MiB")["taken"],
        Bytes::mib(256).get()
    );
    std::thread::sleep(Duration::from_millis(300));
    d.stop(rustix::process::Signal::TERM);
    let after = format!("{CONFIG}[tenants.owned]\nowners = [{}]\n", uid + 1);
    std::fs::write(d.d.dir().join("vramd.toml"), after).unwrap();
    d.start();

    let s = d.status();
    assert_eq!(held_by(&s, "x"), Some(Bytes::mib(512)), "{}", d.log());
    assert_eq!(held_by(&s, "owned"), Some(Bytes::mib(256)), "{}", d.log());
    assert_eq!(s.devices[0].held, Bytes::mib(768), "{s:?}");
    // x comes back in the default class and carries on.
    assert!(wait_until(Duration::from_secs(10), || x
        .cmd("verify")
        .get("bad")
        == Some(&serde_json::json!(0))));
    let t = d.status();
    let tx = t.tenants.iter().find(|t| t.name == "x").unwrap();
    assert_eq!(tx.class, "normal", "{t:?}");
    // `owned` is refused when it reconnects, and its memory stays booked while it lives.
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(held_by(&d.status(), "owned"), Some(Bytes::mib(256)));
    owned.kill();
    assert!(
        wait_until(Duration::from_secs(10), || held_by(&d.status(), "owned")
            .is_none()),
        "{}",
        d.log()
    );
    assert_eq!(d.status().devices[0].held, Bytes::mib(512));
    x.exit();
}

/// A restart that finds no state file (lost, or set aside) adopts nobody; a tenant of the daemon
/// before then reconnects with the grant ids it holds. The new daemon's ids are not those: a
/// tenant that connected first and took memory holds other ids, and the reconnecting tenant's
/// claims are all booked (with ids counted from 1 again, its claim of the other's id was dropped
/// unbooked, its memory lent twice).
#[test]
fn without_a_state_file_a_reconnecting_tenants_ids_are_not_the_new_daemons() {
    let mut d = Restartable::new(CONFIG);
    let mut a = Tenant::spawn(d.socket(), "a", &[]);
    assert_eq!(a.next()["event"], "welcome");
    assert_eq!(a.cmd("take 128MiB")["taken"], Bytes::mib(128).get());
    // Held still while the daemon is away, so that another tenant takes memory first.
    a.signal(rustix::process::Signal::STOP);
    d.stop(rustix::process::Signal::KILL);
    let mut state = d.socket().as_os_str().to_owned();
    state.push(".state");
    std::fs::remove_file(&state).unwrap();
    d.start();
    let mut b = Tenant::spawn(d.socket(), "b", &[]);
    assert_eq!(b.next()["event"], "welcome");
    assert_eq!(b.cmd("take 64MiB")["taken"], Bytes::mib(64).get());
    a.resume();
    assert!(
        wait_until(Duration::from_secs(10), || {
            held_by(&d.status(), "a") == Some(Bytes::mib(128))
        }),
        "{:?}\n{}",
        d.status(),
        d.log()
    );
    assert_eq!(held_by(&d.status(), "b"), Some(Bytes::mib(64)));
    assert_eq!(a.cmd("verify")["bad"], 0);
    a.exit();
    b.exit();
}

/// Tenants declared at run time (a node agent's `Declare`) are in force again after a restart,
/// before the daemon before's tenants are adopted: one connected under a declaration of a class
/// the configuration admits no one to keeps its class and carries on, and one not connected yet
/// keeps its reservation.
#[test]
fn run_time_declarations_survive_a_restart() {
    let mut d = Restartable::new(CONFIG);
    let declaration = |name: &str, guarantee: Bytes| vram_proto::Declaration {
        name: name.into(),
        gpu: 0,
        class: "high".into(),
        guarantee,
        limit: Some(Bytes::gib(4)),
        owners: vec![],
    };
    let admin = Observer::connect(Some(d.socket())).unwrap();
    assert!(admin.declare(&declaration("job", Bytes::gib(1))).unwrap());
    assert!(admin
        .declare(&declaration("waiting", Bytes::gib(2)))
        .unwrap());
    drop(admin);
    let mut job = Tenant::spawn(d.socket(), "job", &[]);
    assert_eq!(job.next()["event"], "welcome");
    assert_eq!(job.cmd("take 256MiB")["taken"], Bytes::mib(256).get());
    // The state file is rewritten within 100 ms of a change.
    std::thread::sleep(Duration::from_millis(300));
    d.stop(rustix::process::Signal::KILL);
    d.start();
    let admin = Observer::connect(Some(d.socket())).unwrap();
    let mut names: Vec<String> = admin
        .declarations()
        .unwrap()
        .into_iter()
        .map(|d| d.name)
        .collect();
    names.sort();
    assert_eq!(names, ["job", "waiting"], "{}", d.log());
    assert!(
        wait_until(Duration::from_secs(10), || {
            held_by(&d.status(), "job") == Some(Bytes::mib(256))
        }),
        "{:?}\n{}",
        d.status(),
        d.log()
    );
    let st = d.status();
    let t = st.tenants.iter().find(|t| t.name == "job").unwrap();
    assert_eq!((t.class.as_str(), t.guarantee), ("high", Bytes::gib(1)));
    // The waiting claim's 2 GiB, and what of the job's guarantee it does not hold, are reserved.
    assert_eq!(
        st.devices[0].reserved,
        Bytes::gib(2) + Bytes::mib(768),
        "{st:?}"
    );
    let took = job.cmd("take 256MiB");
    assert_eq!(took["taken"], Bytes::mib(256).get(), "{took}\n{}", d.log());
    job.exit();
}

/// A tenant of the daemon before on a device this start does not see (a GPU off the bus) is not
/// adopted, but stays in the state file while its process lives, for a start that sees the
/// device again; once its process ends, it goes.
#[test]
fn a_tenant_on_a_device_gone_for_now_stays_in_the_state_file_while_it_lives() {
    let mut d = Restartable::new(CONFIG);
    let mut a = Tenant::spawn(d.socket(), "elsewhere", &[]);
    assert_eq!(a.next()["event"], "welcome");
    assert_eq!(a.cmd("take 64MiB")["taken"], Bytes::mib(64).get());
    std::thread::sleep(Duration::from_millis(300));
    a.signal(rustix::process::Signal::STOP);
    d.stop(rustix::process::Signal::KILL);
    let mut path = d.socket().as_os_str().to_owned();
    path.push(".state");
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains("\"host-0\""), "{text}");
    std::fs::write(&path, text.replace("\"host-0\"", "\"GPU-gone\"")).unwrap();
    d.start();
    assert!(d.log().contains("no such device now"), "{}", d.log());
    assert!(d.status().tenants.is_empty());
    let named = |path: &std::ffi::OsStr| {
        std::fs::read_to_string(path)
            .unwrap()
            .contains("\"elsewhere\"")
    };
    assert!(named(&path), "dropped from the state file while it lives");
    a.kill();
    assert!(
        wait_until(Duration::from_secs(5), || !named(&path)),
        "still in the state file after its process ended"
    );
}
