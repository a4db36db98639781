//! A process whose first allocation finds no daemon (not started yet, restarting, or its tenant
//! name still held by a predecessor the daemon has not reaped) gets memory once the daemon admits
//! it: libvram.so tries to connect again on later calls. Its own test binary, since the tenant
//! and the environment it is set up from are the process's.

use std::time::{Duration, Instant};

use vram_core::Bytes;

mod common;

#[test]
fn a_failed_first_connect_is_tried_again() {
    let dir = tempfile::tempdir().unwrap();
    let socket = common::Daemon::socket_in(dir.path());
    std::env::set_var("VRAMD_SOCKET", &socket);
    std::env::set_var("VRAMD_TENANT", "late-daemon");
    assert!(vram::vram_alloc(1 << 20, 0, std::ptr::null_mut()).is_null());
    let why = vram::last_error().unwrap();
    assert!(why.contains("cannot reach vramd"), "{why}");

    let _daemon = common::Daemon::start_in(dir, Bytes::gib(1));
    let started = Instant::now();
    let ptr = loop {
        let p = vram::vram_alloc(1 << 20, 0, std::ptr::null_mut());
        if !p.is_null() || started.elapsed() > Duration::from_secs(5) {
            break p;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(!ptr.is_null(), "{:?}", vram::last_error());
    vram::vram_free(ptr, 1 << 20, 0, std::ptr::null_mut());
}
