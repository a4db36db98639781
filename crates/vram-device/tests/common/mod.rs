//! Multi-process test support: a test re-runs its own test binary as a child, which runs one
//! child test (flagged ignored, so that only a run naming it with `--ignored` runs it), and passes
//! it a handle's fd by inheritance.
#![allow(dead_code)] // each test binary uses part of it

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Output};

const ROLE: &str = "VRAMD_TEST_CHILD_ROLE";
const FD: &str = "VRAMD_TEST_CHILD_FD";

/// Runs the child test `child_test` (flagged ignored) of this binary in a child process with
/// `role`, giving it `fd` (read back with [`inherited_fd`]) and `env`. Core dumps are off in the
/// child.
pub fn run_child(
    child_test: &str,
    role: &str,
    fd: BorrowedFd<'_>,
    env: &[(&str, String)],
) -> Output {
    let raw: RawFd = fd.as_raw_fd();
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        child_test,
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(ROLE, role)
    .env(FD, raw.to_string())
    .envs(env.iter().map(|(k, v)| (k, v)));
    // SAFETY: runs in the forked child before exec, calling only fcntl and setrlimit, which are
    // async-signal-safe system calls. `raw` stays open in the parent until `output` returns, so
    // the child's copy of the descriptor table holds it.
    unsafe {
        cmd.pre_exec(move || {
            // SAFETY: `raw` is open in this (child) process, see above.
            let fd = BorrowedFd::borrow_raw(raw);
            rustix::io::fcntl_setfd(fd, rustix::io::FdFlags::empty())?;
            let none = rustix::process::Rlimit {
                current: Some(0),
                maximum: Some(0),
            };
            rustix::process::setrlimit(rustix::process::Resource::Core, none)?;
            Ok(())
        })
    };
    let out = cmd.output().unwrap();
    eprintln!(
        "--- child {role} ({:?}) ---\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The role this process was started with by [`run_child`], if it is a child.
pub fn child_role() -> Option<String> {
    std::env::var(ROLE).ok()
}

/// The fd [`run_child`] passed to this child. Call at most once.
pub fn inherited_fd() -> OwnedFd {
    let raw: RawFd = std::env::var(FD).unwrap().parse().unwrap();
    // SAFETY: the parent left `raw` open across exec for this child alone, and this is the only
    // place that takes ownership of it.
    unsafe { OwnedFd::from_raw_fd(raw) }
}

/// An environment variable the parent passed to the child.
pub fn env_u64(name: &str) -> u64 {
    std::env::var(name).unwrap().parse().unwrap()
}

/// A pattern that differs per byte and per `seed`.
pub fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}
