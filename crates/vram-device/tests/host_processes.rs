//! The host backend between real processes: a handle exported by one process and imported by
//! another is the same memory, and a read-only mapping is enforced by the page tables.

mod common;

use std::os::fd::AsFd;
use std::os::unix::process::ExitStatusExt;

use common::{child_role, env_u64, inherited_fd, pattern, run_child};
use vram_core::Bytes;
use vram_device::{host::DEFAULT_GRANULARITY, Access, ByteAccess, Device, HostDevice};

const SIZE: Bytes = Bytes::mib(4);
const PARENT_AT: u64 = 12_345;
const CHILD_AT: u64 = 3 * 1024 * 1024 - 17;
const LEN: usize = 70_000;

#[test]
fn writes_cross_processes_both_ways() {
    let dev = HostDevice::new(Bytes::gib(1), DEFAULT_GRANULARITY).unwrap();
    let h = dev.create(SIZE).unwrap();
    let r = dev.reserve(SIZE).unwrap();
    dev.map(&r, Bytes::ZERO, &h, Access::ReadWrite).unwrap();
    dev.write(&r, Bytes(PARENT_AT), &pattern(1, LEN)).unwrap();

    let fd = dev.export(&h).unwrap();
    let env = [("VRAMD_TEST_SIZE", SIZE.get().to_string())];
    let out = run_child("child", "import-check-write", fd.as_fd(), &env);
    assert!(out.status.success(), "child failed: {:?}", out.status);

    let mut seen = vec![0; LEN];
    dev.read(&r, Bytes(CHILD_AT), &mut seen).unwrap();
    assert_eq!(seen, pattern(2, LEN), "the child's bytes are visible here");
}

#[test]
fn read_only_mapping_faults_on_a_raw_write() {
    let dev = HostDevice::new(Bytes::gib(1), DEFAULT_GRANULARITY).unwrap();
    let h = dev.create(SIZE).unwrap();
    let fd = dev.export(&h).unwrap();
    let env = [("VRAMD_TEST_SIZE", SIZE.get().to_string())];
    let out = run_child("child", "write-read-only", fd.as_fd(), &env);
    assert_eq!(
        out.status.signal(),
        Some(rustix::process::Signal::SEGV.as_raw()),
        "child should die of SIGSEGV, got {:?}",
        out.status
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("mapped read-only"));
}

/// The child side of the tests above; does nothing unless started by one of them.
#[test]
#[ignore = "child process of the multi-process tests"]
fn child() {
    let Some(role) = child_role() else { return };
    let size = Bytes(env_u64("VRAMD_TEST_SIZE"));
    let dev = HostDevice::for_client(DEFAULT_GRANULARITY).unwrap();
    let h = dev.import(inherited_fd(), size).unwrap();
    let r = dev.reserve(size).unwrap();
    match role.as_str() {
        "import-check-write" => {
            dev.map(&r, Bytes::ZERO, &h, Access::ReadWrite).unwrap();
            let mut seen = vec![0; LEN];
            dev.read(&r, Bytes(PARENT_AT), &mut seen).unwrap();
            assert_eq!(seen, pattern(1, LEN), "the parent's bytes are visible here");
            dev.write(&r, Bytes(CHILD_AT), &pattern(2, LEN)).unwrap();
        }
        "write-read-only" => {
            dev.map(&r, Bytes::ZERO, &h, Access::ReadOnly).unwrap();
            println!("mapped read-only; writing through a raw pointer");
            let p = r.base() as *mut u8;
            // SAFETY: not sound on purpose: the page is mapped PROT_READ, so this write must
            // kill the process with SIGSEGV, which the parent test checks.
            unsafe { p.write_volatile(1) };
            println!("the write went through");
        }
        other => panic!("unknown child role {other}"),
    }
}
