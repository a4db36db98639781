//! Shared buffers between real processes: a real `vramd serve`, a writer, and readers that are
//! child processes (this test binary re-run with a role). On the host backend by default; with
//! `VRAMD_TEST_BACKEND=cuda` the same tests run on a GPU (the H200 runs do that).
//!
//! Every version the tests write embeds, in its last 8 bytes, the checksum of the rest: a reader
//! that ever saw a half-written or mixed version would find it wrong.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{wait_until, Daemon};
use vram_client::{checksum, Acl, Client, ClientError, Principal, SharedBuffer, TenantOptions};
use vram_core::Bytes;
use vram_proto::ErrorCode;

const CONFIG: &str = r#"
capacity = "8 GiB"
metrics = "off"
[shared]
scrub_rate = "256 MiB"
"#;

const ROLE: &str = "VRAMD_SHARED_TEST_ROLE";

/// The daemon's backend for these tests: `VRAMD_TEST_BACKEND`, else host.
fn backend() -> String {
    std::env::var("VRAMD_TEST_BACKEND").unwrap_or_else(|_| "host".into())
}

fn start() -> Daemon {
    Daemon::start_on(&backend(), CONFIG)
}

/// Version `v`'s bytes: a 64 KiB pattern seeded by `v`, repeated, each repetition stamped with
/// its index, ending with the checksum of the rest.
fn content(v: u64, size: usize) -> Vec<u8> {
    const BLOCK: usize = 64 << 10;
    let mut x = v.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let block: Vec<u8> = (0..BLOCK)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let mut data = block.repeat(size / BLOCK);
    for (i, chunk) in data.chunks_mut(BLOCK).enumerate() {
        chunk[..8].copy_from_slice(&(i as u64).to_le_bytes());
    }
    let sum = checksum(&data[..size - 8]);
    data[size - 8..].copy_from_slice(&sum.to_le_bytes());
    data
}

/// Whether `data` is a whole version as [`content`] writes them.
fn whole(data: &[u8]) -> bool {
    let n = data.len();
    checksum(&data[..n - 8]).to_le_bytes() == data[n - 8..]
}

fn tenant(d: &Daemon, name: &str) -> Client {
    Client::connect(Some(&d.socket), &TenantOptions::named(name)).unwrap()
}

/// A buffer any tenant may read and `writer1` and `writer2` may also write.
fn create<'c>(owner: &'c Client, name: &str, size: Bytes) -> SharedBuffer<'c> {
    let acl = Acl {
        readers: vec![Principal::Anyone],
        writers: vec![
            Principal::Tenant("writer1".into()),
            Principal::Tenant("writer2".into()),
        ],
    };
    owner.create_shared(name, size, acl).unwrap()
}

fn publish(buf: &SharedBuffer<'_>, lease: &vram_client::WriterLease<'_>, v: u64) -> u64 {
    let draft = lease.begin_write(current(buf)).unwrap();
    draft
        .write(Bytes::ZERO, &content(v, draft.size().get() as usize))
        .unwrap();
    let version = draft.version().0;
    draft.publish().unwrap();
    version
}

/// Starts this binary as a child running `role` against the daemon.
fn spawn(d: &Daemon, role: &str, env: &[(&str, String)]) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "child",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, role)
        .env("VRAMD_SOCKET", &d.socket)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::piped())
        .stdin(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Reads the child's stdout until a line with `prefix` (the test harness may have written its
/// own `test child ... ` before it on the same line); returns that line.
fn expect_line(child: &mut Child, prefix: &str) -> String {
    let out = child.stdout.as_mut().unwrap();
    let mut reader = BufReader::new(out);
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            reader.read_line(&mut line).unwrap() > 0,
            "child ended before `{prefix}`"
        );
        if line.contains(prefix) {
            return line.trim().to_string();
        }
    }
}

fn finish(child: Child) -> (std::process::ExitStatus, String) {
    let out = child.wait_with_output().unwrap();
    (
        out.status,
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// The current version, asked of the daemon (the info from open goes stale).
fn current(buf: &SharedBuffer<'_>) -> Option<vram_client::Version> {
    buf.wait_newer(None, Duration::ZERO).unwrap()
}

#[test]
fn no_torn_read_while_a_writer_publishes_continuously() {
    let d = start();
    let owner = tenant(&d, "trainer");
    let buf = create(&owner, "weights", Bytes::mib(4));
    let lease = buf.lease(Duration::from_secs(2)).unwrap();
    publish(&buf, &lease, 1);
    let readers: Vec<Child> = (0..3)
        .map(|i| {
            let env = [("VRAMD_TEST_READER", format!("reader{i}"))];
            spawn(&d, "reader", &env)
        })
        .collect();
    let started = Instant::now();
    let mut published = 1;
    while started.elapsed() < Duration::from_secs(3) {
        published = publish(&buf, &lease, published + 1);
    }
    let mut reads = 0;
    for r in readers {
        let (status, out) = finish(r);
        assert!(status.success(), "reader failed: {status:?}\n{out}");
        let line = out.lines().find_map(|l| l.split("reads ").nth(1)).unwrap();
        reads += line.split(' ').next().unwrap().parse::<u64>().unwrap();
    }
    println!("{published} versions published, {reads} whole versions read by 3 readers");
    assert!(
        published > 10 && reads > 10,
        "{published} published, {reads} reads"
    );
    drop(lease);
    let s = d.status();
    assert_eq!(s.shared.scrub.mismatches, 0);
    let b = &s.shared.buffers[0].info;
    assert_eq!(
        (b.versions, b.pins),
        (1, 0),
        "only the current version is left"
    );
    d.stop();
}

#[test]
fn a_writer_that_stops_mid_write_loses_its_lease_after_the_ttl() {
    let d = start();
    let owner = tenant(&d, "trainer");
    let buf = create(&owner, "policy", Bytes::mib(4));
    let mut writer = spawn(&d, "half-writer", &[]);
    expect_line(&mut writer, "half-written");
    // Frozen mid-write: its connection stays open but nobody renews its lease (TTL 300 ms).
    let pid = rustix::process::Pid::from_child(&writer);
    rustix::process::kill_process(pid, rustix::process::Signal::STOP).unwrap();

    let second = tenant(&d, "writer2");
    let buf2 = second.open_shared("policy").unwrap();
    match buf2.lease(Duration::from_secs(1)) {
        Err(ClientError::Daemon(e)) => {
            assert_eq!(e.code, ErrorCode::Conflict);
            assert!(
                e.message
                    .contains("tenant `writer1` holds the writer lease")
                    && e.message.contains("current version 1"),
                "{e}"
            );
        }
        other => panic!("expected a conflict, got {:?}", other.map(|_| ())),
    }
    let pinned = buf.pin().unwrap();
    assert_eq!(pinned.version().0, 1);
    assert!(whole(&pinned.to_vec().unwrap()));
    drop(pinned);

    let lease = wait_lease(&buf2);
    let info = &d.status().shared;
    assert!(info.leases_expired >= 1, "{info:?}");
    assert_eq!(
        info.buffers[0].info.versions, 1,
        "the half-written draft is gone"
    );
    // The next version is written from 1: the draft never became current.
    let v = publish(&buf2, &lease, 7);
    let pinned = buf.pin().unwrap();
    assert_eq!(pinned.version().0, v);
    assert!(whole(&pinned.to_vec().unwrap()));
    drop(pinned);
    rustix::process::kill_process(pid, rustix::process::Signal::KILL).unwrap();
    let _ = writer.wait();
    // The next writer takes the same tenant name: wait until the daemon has seen this one go.
    assert!(
        wait_until(Duration::from_secs(5), || {
            !d.status().tenants.iter().any(|t| t.name == "writer1")
        }),
        "the killed writer is still a tenant"
    );

    // A writer killed mid-write loses its lease at once (its connection closed).
    drop(lease);
    let mut writer = spawn(&d, "half-writer", &[]);
    expect_line(&mut writer, "half-written");
    writer.kill().unwrap();
    let _ = writer.wait();
    let lease = wait_lease(&buf2);
    assert_eq!(
        buf.pin().unwrap().version().0,
        v,
        "the killed writer's draft is invisible"
    );
    drop(lease);
    d.stop();
}

fn wait_lease<'c>(buf: &SharedBuffer<'c>) -> vram_client::WriterLease<'c> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match buf.lease(Duration::from_secs(2)) {
            Ok(l) => return l,
            Err(e) if Instant::now() < deadline => {
                assert!(
                    matches!(&e, ClientError::Daemon(r) if r.code == ErrorCode::Conflict),
                    "{e}"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("the lease never came free: {e}"),
        }
    }
}

#[test]
fn a_reader_cannot_write_through_its_mapping() {
    let d = start();
    let owner = tenant(&d, "trainer");
    let buf = create(&owner, "ro", Bytes::mib(2));
    let lease = buf.lease(Duration::from_secs(2)).unwrap();
    publish(&buf, &lease, 1);
    let reader = tenant(&d, "reader");
    let rbuf = reader.open_shared("ro").unwrap();
    let pinned = rbuf.pin().unwrap();
    let e = pinned.try_write(Bytes::ZERO, &[1, 2, 3]).unwrap_err();
    assert!(e.to_string().contains("read-only"), "{e}");
    if backend() == "host" {
        // Asking for a writable mapping is refused too: the descriptor is read-only.
        let e = pinned.try_make_writable().unwrap_err();
        assert!(e.to_string().contains("mprotect"), "{e}");
        assert!(pinned.try_write(Bytes::ZERO, &[1]).is_err());
    }
    drop(pinned);

    // On the host the mapping is a CPU pointer: a raw write through it must fault. (On a GPU the
    // driver refuses writes into a read-only mapping: vram-device's
    // read_only_mapping_refuses_writes.)
    if backend() == "host" {
        let child = spawn(&d, "raw-writer", &[]);
        let (status, out) = finish(child);
        assert_eq!(
            status.signal(),
            Some(rustix::process::Signal::SEGV.as_raw()),
            "the reader's raw write should fault: {status:?}\n{out}"
        );
        assert!(out.contains("mapped read-only"), "{out}");
    }
    let p = buf.pin().unwrap();
    assert!(whole(&p.to_vec().unwrap()) && p.verify().unwrap());
    drop(p);
    drop(lease);
    d.stop();
}

#[test]
fn a_byte_flipped_behind_the_daemons_back_is_found_by_the_scrub() {
    let d = start();
    let owner = tenant(&d, "trainer");
    let buf = create(&owner, "scrubbed", Bytes::mib(16));
    let lease = buf.lease(Duration::from_secs(2)).unwrap();
    let draft = lease.begin_write(None).unwrap();
    draft
        .write(Bytes::ZERO, &content(1, Bytes::mib(16).get() as usize))
        .unwrap();
    draft.publish_keeping_mapping().unwrap();
    let pinned = buf.pin().unwrap();
    assert!(pinned.verify().unwrap());
    let reader = tenant(&d, "reader");
    let theirs = reader.open_shared("scrubbed").unwrap();
    let their_pin = theirs.pin().unwrap();
    // The writer's mapping outlived its publish: flip one byte in the published version.
    let mut byte = [0u8];
    pinned.read(Bytes(123_457), &mut byte).unwrap();
    draft.write(Bytes(123_457), &[!byte[0]]).unwrap();
    let flipped = Instant::now();
    // 256 MiB/s over 16 MiB of published versions: one pass every 62.5 ms.
    let found = wait_until(Duration::from_secs(2), || {
        d.status().shared.scrub.mismatches >= 1
    });
    assert!(found, "the scrub never noticed:\n{}", d.log());
    println!("scrub found the flipped byte after {:?}", flipped.elapsed());
    let s = d.status().shared;
    assert_eq!(s.buffers[0].info.corrupt, vec![pinned.version()]);
    assert!(!pinned.verify().unwrap(), "verify on request agrees");
    assert!(!pinned.verify_here().unwrap());
    assert!(d.log().contains("shared buffer corrupted"), "{}", d.log());
    // The owner and the reader are told, not only the daemon's log, once.
    for who in [&owner, &reader] {
        assert!(
            wait_until(Duration::from_secs(2), || !who.corruptions().is_empty()),
            "{} was not told",
            who.welcome().name
        );
        let told = who.corruptions();
        assert_eq!(told.len(), 1, "{told:?}");
        assert_eq!(told[0].name, "scrubbed");
        assert_eq!(told[0].version, pinned.version());
        assert_eq!(told[0].found_by, "scrub");
        assert_ne!(told[0].expected, told[0].actual);
    }
    // Found again at every pass (counted), logged once; and no reader pins it any more.
    assert!(wait_until(Duration::from_secs(2), || {
        d.status().shared.scrub.mismatches >= 3
    }));
    assert_eq!(
        d.log().matches("shared buffer corrupted").count(),
        1,
        "{}",
        d.log()
    );
    let late = tenant(&d, "late-reader");
    let e = late.open_shared("scrubbed").unwrap().pin().unwrap_err();
    assert!(
        e.to_string().contains("no longer matches its checksum"),
        "{e}"
    );
    drop(their_pin);
    drop(pinned);
    drop(draft);
    drop(lease);
    d.stop();
}

#[test]
fn n_readers_of_a_buffer_use_its_memory_once() {
    const N: usize = 4;
    let d = start();
    let owner = tenant(&d, "trainer");
    let size = Bytes::mib(256);
    let buf = create(&owner, "big", size);
    let lease = buf.lease(Duration::from_secs(2)).unwrap();
    let draft = lease.begin_write(None).unwrap();
    draft.fill(Bytes::ZERO, size, 7).unwrap();
    draft.publish().unwrap();
    let mut readers: Vec<Child> = (0..N)
        .map(|i| spawn(&d, "holder", &[("VRAMD_TEST_READER", format!("holder{i}"))]))
        .collect();
    for r in &mut readers {
        expect_line(r, "pinned");
    }
    let s = d.status();
    let b = &s.shared.buffers[0].info;
    assert_eq!((b.pins, b.versions, b.bytes), (N as u64, 1, size));
    let held: Bytes = s.tenants.iter().map(|t| t.held).sum();
    assert_eq!(held, size, "{N} readers, one copy: {:?}", s.tenants);
    assert_eq!(s.devices[0].held, size);
    let trainer = s.tenants.iter().find(|t| t.name == "trainer").unwrap();
    assert_eq!(trainer.held, size, "counted against the owner");
    for mut r in readers {
        drop(r.stdin.take());
        let (status, out) = finish(r);
        assert!(status.success(), "{out}");
    }
    drop(lease);
    drop(buf);
    drop(owner);
    assert!(wait_until(Duration::from_secs(5), || {
        let s = d.status();
        s.devices[0].held == Bytes::ZERO && s.shared.buffers.is_empty()
    }));
    d.stop();
}

/// The child side of the tests above; does nothing unless started by one of them.
#[test]
#[ignore = "child process of the multi-process tests"]
fn child() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let socket = std::path::PathBuf::from(std::env::var("VRAMD_SOCKET").unwrap());
    let connect = |name: &str| Client::connect(Some(&socket), &TenantOptions::named(name)).unwrap();
    let reader_name = std::env::var("VRAMD_TEST_READER").unwrap_or_else(|_| "reader".into());
    match role.as_str() {
        "reader" => {
            let c = connect(&reader_name);
            let buf = c.open_shared("weights").unwrap();
            let (mut reads, mut torn, mut last) = (0u64, 0u64, 0u64);
            let started = Instant::now();
            while started.elapsed() < Duration::from_millis(2500) {
                let p = buf.pin().unwrap();
                assert!(p.version().0 >= last, "versions went backwards");
                last = p.version().0;
                let data = p.to_vec().unwrap();
                if !whole(&data) || checksum(&data) != p.checksum() {
                    torn += 1;
                }
                reads += 1;
            }
            println!("reads {reads} torn {torn} last v{last}");
            assert_eq!(torn, 0, "torn or unverified reads");
        }
        "half-writer" => {
            let c = connect("writer1");
            let buf = c.open_shared("policy").unwrap();
            let lease = buf.lease(Duration::from_millis(300)).unwrap();
            if buf.info().current.is_none() {
                let draft = lease.begin_write(None).unwrap();
                draft
                    .write(Bytes::ZERO, &content(1, Bytes::mib(4).get() as usize))
                    .unwrap();
                draft.publish().unwrap();
            }
            let draft = lease.begin_write(current(&buf)).unwrap();
            let half = content(99, Bytes::mib(4).get() as usize);
            draft.write(Bytes::ZERO, &half[..half.len() / 2]).unwrap();
            println!("half-written v{}", draft.version().0);
            std::io::stdout().flush().unwrap();
            std::thread::sleep(Duration::from_secs(60));
        }
        "raw-writer" => {
            let c = connect("raw");
            let buf = c.open_shared("ro").unwrap();
            let p = buf.pin().unwrap();
            disable_core_dumps();
            println!("mapped read-only; writing through a raw pointer");
            std::io::stdout().flush().unwrap();
            let ptr = p.ptr() as *mut u8;
            // SAFETY: not sound on purpose: the page is mapped PROT_READ from a read-only fd, so
            // this write must kill the process with SIGSEGV, which the parent test checks.
            unsafe { ptr.write_volatile(1) };
            println!("the write went through");
        }
        "holder" => {
            let c = connect(&reader_name);
            let buf = c.open_shared("big").unwrap();
            let p = buf.pin().unwrap();
            let mut first = [0u8; 4];
            p.read(Bytes::ZERO, &mut first).unwrap();
            assert_eq!(first, [7; 4]);
            println!("pinned v{}", p.version().0);
            std::io::stdout().flush().unwrap();
            let mut line = String::new();
            let _ = std::io::stdin().read_line(&mut line);
        }
        other => panic!("unknown child role {other}"),
    }
}

fn disable_core_dumps() {
    let none = rustix::process::Rlimit {
        current: Some(0),
        maximum: Some(0),
    };
    rustix::process::setrlimit(rustix::process::Resource::Core, none).unwrap();
}

/// A writer that asks for a longer lease than the daemon's `max_lease_ms` grants keeps it: the
/// lease is renewed by the time granted, not the time asked for.
#[test]
fn a_lease_longer_than_the_daemons_most_is_renewed_by_what_was_granted() {
    let d = Daemon::start_on(
        &backend(),
        "capacity = \"1 GiB\"\nmetrics = \"off\"\n[shared]\nmax_lease_ms = 300\n",
    );
    let owner = tenant(&d, "trainer");
    let buf = create(&owner, "short", Bytes::mib(2));
    let lease = buf.lease(Duration::from_secs(3)).unwrap();
    std::thread::sleep(Duration::from_millis(900));
    assert!(!lease.lost());
    assert_eq!(publish(&buf, &lease, 1), 1);
    drop(lease);
    d.stop();
}

/// A version freed while the scrub makes its pass (slowly here) goes back to the device at once:
/// the pass names the versions it will read, it does not hold their memory.
#[test]
fn a_version_freed_during_a_scrub_pass_goes_back_at_once() {
    let d = Daemon::start_on(
        &backend(),
        "capacity = \"1 GiB\"\nmetrics = \"off\"\n[shared]\nscrub_rate = \"4 MiB\"\n",
    );
    let owner = tenant(&d, "trainer");
    let first = create(&owner, "first", Bytes::mib(2));
    let second = create(&owner, "second", Bytes::mib(64));
    for buf in [&first, &second] {
        let lease = buf.lease(Duration::from_secs(10)).unwrap();
        assert_eq!(publish(buf, &lease, 1), 1);
    }
    // After a first pass, the next names both versions and reads the small one first.
    assert!(wait_until(Duration::from_secs(30), || d
        .status()
        .shared
        .scrub
        .passes
        > 0));
    let used = d.status().devices[0].device_used;
    second.delete().unwrap();
    assert!(
        wait_until(Duration::from_millis(500), || {
            d.status().devices[0].device_used + Bytes::mib(64) <= used
        }),
        "device used {} after the delete, {used} before",
        d.status().devices[0].device_used
    );
    drop(first);
    d.stop();
}

/// A scrub rate a reload changes applies to the pass under way: a slow pass over a large version
/// does not keep its rate for the minute it would take, and a rate of 0 ends it.
#[test]
fn a_reloaded_scrub_rate_applies_to_the_pass_under_way() {
    let slow = "capacity = \"1 GiB\"\nmetrics = \"off\"\n[shared]\nscrub_rate = \"1 MiB\"\n";
    let d = Daemon::start_on(&backend(), slow);
    let owner = tenant(&d, "trainer");
    let buf = create(&owner, "weights", Bytes::mib(64));
    let lease = buf.lease(Duration::from_secs(10)).unwrap();
    assert_eq!(publish(&buf, &lease, 1), 1);
    // At 1 MiB/s the first pass would take a minute.
    assert!(wait_until(Duration::from_secs(10), || d
        .status()
        .shared
        .scrub
        .bytes
        > 0));
    d.reload(&slow.replace("1 MiB", "4 GiB"));
    assert!(
        wait_until(Duration::from_secs(5), || d.status().shared.scrub.passes
            > 0),
        "the pass kept its rate: {:?}",
        d.status().shared.scrub
    );
    // Turned off, the scrub reads nothing more, in the pass under way or after it.
    d.reload(&slow.replace("1 MiB", "0"));
    std::thread::sleep(Duration::from_millis(300));
    let read = d.status().shared.scrub.bytes;
    std::thread::sleep(Duration::from_millis(700));
    assert_eq!(d.status().shared.scrub.bytes, read);
    drop(lease);
    d.stop();
}
