//! libvram.so's driver-level interposition (`src/interpose/`), tested on a machine without a GPU:
//! `tests/c/driver.c` loads a stand-in driver and NVML (`tests/c/fake_cuda.c`, `fake_nvml.c`,
//! built here as `libcuda.so.1` and `libnvidia-ml.so.1` and found through `LD_LIBRARY_PATH`) the
//! way XLA and ctypes load the real ones, with libvram.so preloaded, against a host-backend
//! daemon. The stand-ins test the mechanics: which lookups reach the hooks, what reaches the
//! driver and what never does. The proof against the real driver is the GPU run.

use std::io::{BufRead, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use vram_core::Bytes;

mod common;
mod cprog;

/// The stand-in libraries, built into `dir`.
fn stand_ins(dir: &Path) {
    cprog::build_shared("fake_cuda", "libcuda.so.1", dir);
    cprog::build_shared("fake_nvml", "libnvidia-ml.so.1", dir);
    cprog::build_shared("fake_cudart", "libcudart.so.13", dir);
}

/// `driver.c` run with libvram.so preloaded and the stand-ins on the library path.
fn driver_command(exe: &Path, libs: &Path, socket: &Path) -> Command {
    let mut cmd = Command::new(exe);
    cmd.env("LD_PRELOAD", cprog::lib_dir().join("libvram.so"))
        .env("LD_LIBRARY_PATH", libs)
        .env("VRAMD_SOCKET", socket)
        .env("VRAMD_TENANT", "c-driver")
        .env("VRAMD_LIMIT", "256MiB")
        .env("VRAMD_TORCH_MODE", "pool");
    cmd
}

#[test]
fn driver_calls_looked_up_by_name_or_proc_address_are_served_charged_and_refused() {
    let out = tempfile::tempdir().unwrap();
    stand_ins(out.path());
    let exe = cprog::build("driver", out.path());
    let daemon = common::Daemon::start(Bytes::gib(8));
    let mut child = driver_command(&exe, out.path(), &daemon.socket)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut seen = String::new();
    while !seen.contains("driver: ok") {
        let mut line = String::new();
        if stdout.read_line(&mut line).unwrap() == 0 {
            let _ = child.wait();
            panic!("driver.c stopped early:\n{seen}");
        }
        seen += &line;
    }
    assert!(
        seen.contains(
            "refused as expected: vramd: tenant `c-driver` could not allocate 512 MiB: out of memory"
        ),
        "{seen}"
    );
    assert!(
        seen.contains("charge refused as expected: vramd: tenant `c-driver` may not keep 512 MiB made with cuMemCreate"),
        "{seen}"
    );

    // The daemon's books: 66 MiB charged (a cuMemCreate handle released but still mapped, and an
    // exported one released), and
    // the refusal the library made itself (the allocator's limit check) counted.
    let observer = vram_client::Observer::connect(Some(&daemon.socket)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let tenant = loop {
        let status = observer.status().unwrap();
        let t = status
            .tenants
            .into_iter()
            .find(|t| t.name == "c-driver")
            .expect("the tenant is connected");
        if t.refusals.contains_key("over_limit") || Instant::now() > deadline {
            break t;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(tenant.charged, Bytes::mib(66), "{tenant:?}");
    assert!(tenant.refusals.get("over_limit") >= Some(&1), "{tenant:?}");
    child.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "driver.c failed:\n{seen}{rest}");
    assert!(rest.contains("unmapped: free"), "{rest}");
    assert!(rest.contains("disconnected"), "{rest}");

    // Released: the charge is taken back.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let gone = observer
            .status()
            .unwrap()
            .tenants
            .iter()
            .all(|t| t.name != "c-driver");
        if gone || Instant::now() > deadline {
            assert!(gone, "the tenant's connection closed with the process");
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs `cmd` (driver.c) in `mode` to its end, which must succeed and say `MODE: ok`; its
/// standard error.
fn run_mode(cmd: &mut Command, mode: &str) -> String {
    let run = cmd.arg(mode).output().unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr).into_owned();
    assert!(
        run.status.success() && stdout.contains(&format!("{mode}: ok")),
        "driver.c {mode} failed:\n{stdout}\n{stderr}"
    );
    stderr
}

#[test]
fn without_a_daemon_driver_allocations_are_refused_never_passed_on() {
    let out = tempfile::tempdir().unwrap();
    stand_ins(out.path());
    let exe = cprog::build("driver", out.path());
    let stderr = run_mode(
        &mut driver_command(&exe, out.path(), &out.path().join("no-daemon.sock")),
        "nodaemon",
    );
    assert_eq!(
        stderr.matches("cannot reach vramd").count(),
        1,
        "the reason is logged once, however many calls are refused:\n{stderr}"
    );
}

/// A process of `vramd run` that has not joined the run's tenant yet (a monitor the program
/// started, asking NVML or the driver about memory) gets their own figures: the question does not
/// take the run's invitation, which is for the process that first allocates.
#[test]
fn a_question_about_memory_does_not_take_the_runs_invitation() {
    let out = tempfile::tempdir().unwrap();
    stand_ins(out.path());
    let exe = cprog::build("driver", out.path());
    let daemon = common::Daemon::start(Bytes::gib(8));
    let mut cmd = driver_command(&exe, out.path(), &daemon.socket);
    cmd.env_remove("VRAMD_TENANT")
        .env("VRAMD_JOIN", "00112233445566778899aabbccddeeff");
    let stderr = run_mode(&mut cmd, "query");
    assert!(!stderr.contains("vramd"), "the daemon was asked:\n{stderr}");
}

/// A forked child of a tenant process is no tenant: its copy of the parent's connection stays
/// unused (had it spoken on it, the two would take each other's replies and the parent would hang
/// in a grant), and its allocations are refused with the reason.
#[test]
fn a_forked_child_leaves_its_parents_connection_alone() {
    let out = tempfile::tempdir().unwrap();
    stand_ins(out.path());
    let exe = cprog::build("fork", out.path());
    let daemon = common::Daemon::start(Bytes::gib(8));
    let run = driver_command(&exe, out.path(), &daemon.socket)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success() && stdout.contains("fork: ok"),
        "{:?}\n{stdout}\n{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(
        stdout.contains("was forked from a tenant process"),
        "{stdout}"
    );
    assert!(stdout.contains("child: pin refused"), "{stdout}");
}
