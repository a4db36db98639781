//! Shared buffers on a real GPU (`--backend cuda`). Where the driver finds no GPU every test is
//! reported as ignored (`vram_testing`'s runner says why), unless `VRAMD_REQUIRE_GPU=1`, which
//! makes a missing GPU a failure. Figures are printed with `MEASURED` for docs/benchmarks.md.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::Daemon;
use vram_client::{Acl, Client, Principal, TenantOptions};
use vram_core::Bytes;
use vram_device::cuda::CudaDevice;

const CONFIG: &str =
    "[pool]\nmax = \"64 MiB\"\nsizes = [\"2 MiB\"]\ninitial = 2\n[shared]\nscrub_rate = \"0\"\n";
const ROLE: &str = "VRAMD_GPU_SHARED_ROLE";

fn gpu() -> Option<CudaDevice> {
    vram_testing::gpu_or_skip("0")
}

fn free_on_gpu(dev: &CudaDevice) -> Bytes {
    dev.memory().expect("cuMemGetInfo").0
}

fn owner(d: &Daemon) -> Client {
    Client::connect(Some(&d.socket), &TenantOptions::named("trainer")).unwrap()
}

fn anyone() -> Acl {
    Acl {
        readers: vec![Principal::Anyone],
        writers: Vec::new(),
    }
}

fn line_with(child: &mut Child, what: &str) {
    let mut r = BufReader::new(child.stdout.as_mut().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            r.read_line(&mut line).unwrap() > 0,
            "child ended before `{what}`"
        );
        if line.contains(what) {
            return;
        }
    }
}

fn n_readers_of_a_1_gib_buffer_use_1_gib_of_the_gpu() {
    const N: usize = 4;
    let Some(dev) = gpu() else { return };
    let d = Daemon::start_on("cuda", CONFIG);
    let c = owner(&d);
    let buf = c.create_shared("weights", Bytes::gib(1), anyone()).unwrap();
    let lease = buf.lease(Duration::from_secs(10)).unwrap();
    let draft = lease.begin_write(None).unwrap();
    draft.fill(Bytes::ZERO, Bytes::gib(1), 7).unwrap();
    draft.publish().unwrap();
    let mut readers: Vec<Child> = (0..N)
        .map(|i| {
            Command::new(std::env::current_exe().unwrap())
                .args(["child", "--exact", "--ignored", "--nocapture"])
                .env(ROLE, format!("reader{i}"))
                .env("VRAMD_SOCKET", &d.socket)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    // Their CUDA contexts exist now; what pinning adds is measured from here.
    for r in &mut readers {
        line_with(r, "ready");
    }
    let before = free_on_gpu(&dev);
    for r in &mut readers {
        writeln!(r.stdin.as_mut().unwrap(), "pin").unwrap();
        line_with(r, "pinned");
    }
    let after = free_on_gpu(&dev);
    let used = before.saturating_sub(after);
    println!("MEASURED {N} readers pinning a 1 GiB version: cuMemGetInfo free {before} -> {after} ({used} more used)");
    assert!(used < Bytes::mib(512), "readers took copies: {used}");
    let s = d.status();
    assert_eq!(s.shared.buffers[0].info.pins, N as u64);
    assert_eq!(s.devices[0].held, Bytes::gib(1));
    for mut r in readers {
        drop(r.stdin.take());
        assert!(r.wait().unwrap().success());
    }
    drop(lease);
    d.stop();
}

fn publish_latency_and_checksum_throughput_on_the_gpu() {
    let Some(_dev) = gpu() else { return };
    let d = Daemon::start_on("cuda", CONFIG);
    let c = owner(&d);
    for size in [Bytes::mib(64), Bytes::gib(1)] {
        let name = format!("w{}", size.get() >> 20);
        let buf = c.create_shared(&name, size, anyone()).unwrap();
        let lease = buf.lease(Duration::from_secs(30)).unwrap();
        let mut times = Vec::new();
        let mut current = None;
        for i in 0..5u8 {
            let draft = lease.begin_write(current).unwrap();
            draft.fill(Bytes::ZERO, size, i).unwrap();
            current = Some(draft.version());
            let t = Instant::now();
            draft.publish().unwrap();
            times.push(t.elapsed());
        }
        times.sort();
        let median = times[times.len() / 2];
        let p = buf.pin().unwrap();
        let t = Instant::now();
        assert!(p.verify().unwrap());
        let verify = t.elapsed();
        println!(
            "MEASURED publish of {size} on the GPU (the daemon maps the draft read-only and \
             checksums it with a kernel on the GPU, nothing copied to the host): \
             median {median:.2?} ({:.2} GiB/s); verify {verify:.2?}",
            size.get() as f64 / (1u64 << 30) as f64 / median.as_secs_f64()
        );
        drop(p);
        drop(lease);
    }
    d.stop();
}

/// Whether a reader can make its import of a read-only version writable on CUDA (the driver has
/// no read-only export: an importer sets its own mapping's access). Either the platform refuses,
/// or the write is caught by the checksum and the owner and the reader are told.
fn a_reader_that_makes_a_version_writable_is_refused_or_caught() {
    let Some(_dev) = gpu() else { return };
    let d = Daemon::start_on("cuda", CONFIG);
    let c = owner(&d);
    let buf = c
        .create_shared("ro-probe", Bytes::mib(2), anyone())
        .unwrap();
    let lease = buf.lease(Duration::from_secs(30)).unwrap();
    let draft = lease.begin_write(None).unwrap();
    draft.fill(Bytes::ZERO, Bytes::mib(2), 7).unwrap();
    draft.publish().unwrap();
    let reader = Client::connect(Some(&d.socket), &TenantOptions::named("reader")).unwrap();
    let theirs = reader.open_shared("ro-probe").unwrap();
    let pin = theirs.pin().unwrap();
    assert!(
        pin.try_write(Bytes::ZERO, &[1]).is_err(),
        "mapped read-only"
    );
    match pin.try_make_writable() {
        Err(e) => {
            println!("MEASURED cuda read-only: cuMemSetAccess(READWRITE) on an imported version refused: {e}");
            assert!(pin.try_write(Bytes::ZERO, &[1]).is_err());
        }
        Ok(()) => {
            let wrote = pin.try_write(Bytes::ZERO, &[0xAB; 64]);
            println!(
                "MEASURED cuda read-only: cuMemSetAccess(READWRITE) on an imported version \
                 allowed; the write {}",
                if wrote.is_ok() {
                    "went through"
                } else {
                    "failed"
                }
            );
            if wrote.is_ok() {
                assert!(!pin.verify().unwrap(), "the checksum catches the write");
                for who in [&c, &reader] {
                    let told = common::wait_until(Duration::from_secs(5), || {
                        !who.corruptions().is_empty()
                    });
                    assert!(told, "{} not told of the corruption", who.welcome().name);
                }
            }
        }
    }
    drop(pin);
    drop(lease);
    d.stop();
}

/// The child side of the tests above; does nothing unless started by one of them.
fn child() {
    let Ok(name) = std::env::var(ROLE) else {
        return;
    };
    let c = Client::connect(None, &TenantOptions::named(name)).unwrap();
    let buf = c.open_shared("weights").unwrap();
    println!("ready");
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    let p = buf.pin().unwrap();
    let mut first = [0u8; 4];
    p.read(Bytes::ZERO, &mut first).unwrap();
    assert_eq!(first, [7; 4]);
    assert!(
        p.try_write(Bytes::ZERO, &[1]).is_err(),
        "a reader's mapping must refuse writes"
    );
    println!("pinned");
    std::io::stdout().flush().unwrap();
    let _ = std::io::stdin().read_line(&mut line);
}

vram_testing::gpu_main! {
    tests: [
        n_readers_of_a_1_gib_buffer_use_1_gib_of_the_gpu,
        publish_latency_and_checksum_throughput_on_the_gpu,
        a_reader_that_makes_a_version_writable_is_refused_or_caught,
    ],
    children: [child],
}
