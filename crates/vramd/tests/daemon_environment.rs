//! The daemon survives its environment: a broken stderr, signals (SIGHUP reloads, SIGQUIT and
//! SIGTERM stop), failed starts, files at its socket path that are not its own, and it tells a
//! service manager when it is ready.

mod common;

use std::io::BufRead;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{wait_until, Daemon, Tenant, VRAMD};
use rustix::process::{kill_process, Pid, Signal};
use vram_client::Observer;
use vram_core::Bytes;

fn signal(child: &Child, sig: Signal) {
    kill_process(Pid::from_child(child), sig).unwrap();
}

fn answers(socket: &Path) -> bool {
    Observer::connect(Some(socket))
        .and_then(|o| o.status())
        .is_ok()
}

/// Waits up to 10 s for the child to exit; its status.
fn exits(child: &mut Child) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the daemon did not exit within 10 s");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `vramd serve --backend host --metrics off --socket SOCKET ARGS...`, output to `log`.
fn serve(socket: &Path, log: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(VRAMD);
    c.args(["serve", "--backend", "host", "--metrics", "off", "--socket"])
        .arg(socket)
        .args(args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(log).unwrap())
        .stderr(std::fs::File::create(log.with_extension("err")).unwrap());
    c
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

#[test]
fn a_broken_stderr_drops_lines_and_the_daemon_serves_on() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("vramd.sock");
    // `vramd serve 2>&1 | head -1`: one line read, then the pipe is closed.
    let mut child = Command::new(VRAMD)
        .args([
            "serve",
            "--backend",
            "host",
            "--capacity",
            "1GiB",
            "--metrics",
            "off",
            "--socket",
        ])
        .arg(&socket)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    std::io::BufReader::new(child.stderr.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert!(!first.is_empty());
    assert!(wait_until(Duration::from_secs(10), || answers(&socket)));

    // Tenants connect, take, verify, give back: every one of those is logged.
    let (tx, rx) = mpsc::channel();
    let sock = socket.clone();
    std::thread::spawn(move || {
        for i in 0..3 {
            let mut t = Tenant::spawn(&sock, &format!("t{i}"), &[]);
            let hello = t.next();
            let took = t.cmd("take 8MiB 2MiB");
            let verified = t.cmd("verify");
            t.exit();
            let _ = tx.send((hello, took, verified));
        }
    });
    for i in 0..3 {
        let (hello, took, verified) =
            rx.recv_timeout(Duration::from_secs(20))
                .unwrap_or_else(|_| {
                    panic!("tenant {i} got no answer from a daemon whose stderr broke")
                });
        assert_eq!(hello["event"], "welcome", "{hello}");
        assert_eq!(took["taken"], Bytes::mib(8).get(), "{took}");
        assert_eq!(verified["ok"], true, "{verified}");
    }
    let s = Observer::connect(Some(&socket)).unwrap().status().unwrap();
    assert!(
        s.daemon.log_lines_dropped > 0,
        "dropped lines are counted: {:?}",
        s.daemon
    );
    signal(&child, Signal::TERM);
    let status = exits(&mut child);
    assert!(status.success(), "{status}");
    assert!(!socket.exists(), "the socket outlived the daemon");
}

const RELOAD_V1: &str = r#"
capacity = "1 GiB"
metrics = "off"
[classes.batch]
priority = 10
default_limit = "64 MiB"
[tenants.trainer]
class = "high"
guarantee = "128 MiB"
"#;

const RELOAD_V2: &str = r#"
capacity = "2 GiB"
metrics = "off"
reclaim_timeout_ms = 100
[classes.batch]
priority = 20
default_limit = "32 MiB"
[tenants.trainer]
class = "high"
guarantee = "256 MiB"
"#;

fn welcome_limit(d: &Daemon, name: &str) -> u64 {
    let t = d.tenant(name, &["--class", "batch"]);
    let pid = t.pid();
    let limit = d
        .status()
        .tenants
        .iter()
        .find(|x| x.name == name)
        .map(|x| x.limit.get())
        .unwrap_or_else(|| panic!("{name} (pid {pid}) is not listed"));
    t.exit();
    limit
}

fn sighup(d: &Daemon) {
    kill_process(Pid::from_raw(d.pid() as i32).unwrap(), Signal::HUP).unwrap();
}

/// Waits until the log holds `n` occurrences of `what`.
fn logged(d: &Daemon, what: &str, n: usize) -> bool {
    wait_until(Duration::from_secs(10), || {
        d.log().matches(what).count() >= n
    })
}

#[test]
fn sighup_reloads_what_can_change_and_keeps_the_old_config_on_a_bad_file() {
    let d = Daemon::start(RELOAD_V1);
    let config = d.dir().join("vramd.toml");
    assert_eq!(welcome_limit(&d, "b1"), Bytes::mib(64).get());
    assert_eq!(d.status().devices[0].reserved, Bytes::mib(128));

    std::fs::write(&config, RELOAD_V2).unwrap();
    sighup(&d);
    assert!(logged(&d, "configuration reloaded", 1), "{}", d.log());
    assert_eq!(welcome_limit(&d, "b2"), Bytes::mib(32).get());
    let s = d.status();
    assert_eq!(s.devices[0].reserved, Bytes::mib(256));
    assert_eq!(
        s.devices[0].capacity,
        Bytes::gib(1),
        "capacity cannot change live"
    );
    let log = d.log();
    assert!(
        log.contains("capacity") && log.contains("cannot change while serving"),
        "{log}"
    );

    // A file that does not parse, then one whose guarantees cannot fit: both refused, with the
    // reason, and the configuration in force stays.
    std::fs::write(&config, "capacity = \n").unwrap();
    sighup(&d);
    assert!(logged(&d, "configuration reload refused", 1), "{}", d.log());
    std::fs::write(
        &config,
        RELOAD_V2.replace("guarantee = \"256 MiB\"", "guarantee = \"4 GiB\""),
    )
    .unwrap();
    sighup(&d);
    assert!(logged(&d, "configuration reload refused", 2), "{}", d.log());
    assert!(d.log().contains("4 GiB"), "{}", d.log());
    assert_eq!(welcome_limit(&d, "b3"), Bytes::mib(32).get());
    assert_eq!(d.status().devices[0].reserved, Bytes::mib(256));

    // A capacity (which applies at the next start) below the declared guarantees: the next
    // start would be refused, so the reload is.
    std::fs::write(
        &config,
        RELOAD_V2.replace("capacity = \"2 GiB\"", "capacity = \"128 MiB\""),
    )
    .unwrap();
    sighup(&d);
    assert!(logged(&d, "configuration reload refused", 3), "{}", d.log());
    assert!(
        d.log().contains("would not start again with this file"),
        "{}",
        d.log()
    );
    d.stop();
}

#[test]
fn sigquit_stops_the_daemon_cleanly() {
    let d = Daemon::start("capacity = \"1 GiB\"\nmetrics = \"off\"\n");
    let t = d.tenant("worker", &[]);
    kill_process(Pid::from_raw(d.pid() as i32).unwrap(), Signal::QUIT).unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || !d.socket.exists()),
        "the socket outlived SIGQUIT:\n{}",
        d.log()
    );
    // The socket goes before the last line is written: wait for that line rather than read
    // the log once.
    assert!(
        wait_until(Duration::from_secs(10), || d.log().contains("stopped")),
        "no `stopped` after SIGQUIT:\n{}",
        d.log()
    );
    assert!(d.log().contains("signal received"), "{}", d.log());
    t.kill();
    // The daemon is gone already; `stop` checks that it exited 0.
    d.stop();
}

#[test]
fn a_failed_start_leaves_no_socket() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("vramd.sock");
    let log = dir.path().join("log");

    // The metrics address asked for is taken.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let mut c = Command::new(VRAMD);
    c.args(["serve", "--backend", "host", "--metrics", &addr, "--socket"])
        .arg(&socket)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
    let status = c.status().unwrap();
    assert!(!status.success(), "{}", read(&log));
    assert!(!socket.exists(), "a stale socket after a metrics failure");

    // A policy the device cannot hold.
    let config = dir.path().join("vramd.toml");
    std::fs::write(
        &config,
        "capacity = \"1 GiB\"\n[tenants.big]\nclass = \"high\"\nguarantee = \"2 GiB\"\n",
    )
    .unwrap();
    let mut c = serve(&socket, &log, &["--config", config.to_str().unwrap()]);
    let status = c.status().unwrap();
    let text = read(&log.with_extension("err"));
    assert!(!status.success(), "{text}");
    assert!(text.contains("2 GiB"), "{text}");
    assert!(!socket.exists(), "a stale socket after a policy error");
}

#[test]
fn a_file_at_the_socket_path_that_is_not_a_socket_is_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("vramd.sock");
    std::fs::write(&socket, "precious").unwrap();
    let log = dir.path().join("log");
    let status = serve(&socket, &log, &[]).status().unwrap();
    let text = read(&log.with_extension("err"));
    assert!(!status.success(), "{text}");
    assert!(text.contains("not a socket"), "{text}");
    assert_eq!(read(&socket), "precious");
}

/// Starts a daemon on `socket` and waits until it answers.
fn started(socket: &Path, log: &Path) -> Child {
    let child = serve(socket, log, &["--capacity", "1GiB"]).spawn().unwrap();
    assert!(wait_until(Duration::from_secs(10), || answers(socket)));
    child
}

#[test]
fn a_daemon_removes_only_the_socket_it_created() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("vramd.sock");
    let mut a = started(&socket, &dir.path().join("a.log"));
    // Someone removes A's socket and a second daemon takes the path.
    std::fs::remove_file(&socket).unwrap();
    let mut b = started(&socket, &dir.path().join("b.log"));
    signal(&a, Signal::TERM);
    assert!(exits(&mut a).success());
    assert!(socket.exists(), "A removed B's socket");
    assert!(answers(&socket), "B no longer answers");
    signal(&b, Signal::TERM);
    assert!(exits(&mut b).success());
    assert!(!socket.exists());
}

fn notifications(sock: UnixDatagram) -> (mpsc::Receiver<String>, std::thread::JoinHandle<()>) {
    let (tx, rx) = mpsc::channel();
    let h = std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = sock.recv(&mut buf) {
            if tx
                .send(String::from_utf8_lossy(&buf[..n]).into_owned())
                .is_err()
            {
                return;
            }
        }
    });
    (rx, h)
}

fn readiness(notify_socket: &str, bound: UnixDatagram, dir: &Path) {
    bound
        .set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    let socket: PathBuf = dir.join("vramd.sock");
    let log = dir.join("log");
    let mut c = serve(&socket, &log, &["--capacity", "1GiB"]);
    c.env("NOTIFY_SOCKET", notify_socket);
    let mut child = c.spawn().unwrap();
    let (rx, _reader) = notifications(bound);
    let ready = rx
        .recv_timeout(Duration::from_secs(15))
        .unwrap_or_else(|_| panic!("no READY=1:\n{}", read(&log.with_extension("err"))));
    assert!(ready.lines().any(|l| l == "READY=1"), "{ready}");
    // Ready means serving.
    assert!(answers(&socket));
    signal(&child, Signal::TERM);
    let stopping = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(stopping.lines().any(|l| l == "STOPPING=1"), "{stopping}");
    assert!(exits(&mut child).success());
}

#[test]
fn the_daemon_tells_the_service_manager_when_it_is_ready() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("notify.sock");
    let bound = UnixDatagram::bind(&path).unwrap();
    readiness(path.to_str().unwrap(), bound, dir.path());

    // An abstract-namespace socket, as systemd may pass it.
    use std::os::linux::net::SocketAddrExt;
    let name = format!("vramd-test-notify-{}", std::process::id());
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let bound = UnixDatagram::bind_addr(&addr).unwrap();
    let dir = tempfile::tempdir().unwrap();
    readiness(&format!("@{name}"), bound, dir.path());
}
