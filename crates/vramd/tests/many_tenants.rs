//! Many tenant processes at once.

mod common;

use std::time::Instant;

use common::Daemon;
use vram_core::Bytes;

const TENANTS: usize = 64;
const CYCLES: u64 = 1000;

#[test]
fn sixty_four_tenants_cycle_concurrently_without_error() {
    let d = Daemon::start("capacity = \"4 GiB\"\n[pool]\nmax = \"256 MiB\"\n");
    let mut tenants: Vec<_> = (0..TENANTS)
        .map(|i| d.tenant(&format!("cycler-{i}"), &["--limit", "64MiB"]))
        .collect();
    assert_eq!(d.status().tenants.len(), TENANTS);
    let started = Instant::now();
    // All start before any answer is read, so the cycles overlap.
    for t in &mut tenants {
        t.send(&format!("cycles {CYCLES} 2MiB"));
    }
    for (i, t) in tenants.iter_mut().enumerate() {
        let r = t.next();
        assert_eq!(r["event"], "cycled", "cycler-{i}: {r}");
        assert_eq!(r["n"], CYCLES, "cycler-{i}: {r}");
        assert_eq!(r["errors"], 0, "cycler-{i}: {r}");
    }
    let elapsed = started.elapsed();
    eprintln!(
        "{TENANTS} tenants x {CYCLES} take/verify/return cycles in {:.1} s ({:.0} round trips/s)",
        elapsed.as_secs_f64(),
        (TENANTS as u64 * CYCLES) as f64 / elapsed.as_secs_f64()
    );
    let s = d.status();
    for t in &s.tenants {
        assert_eq!((t.grants, t.returns), (CYCLES, CYCLES), "{}", t.name);
        assert_eq!(t.held, Bytes::ZERO, "{}", t.name);
    }
    for t in tenants {
        t.exit();
    }
    d.wait_for_no_tenants();
    assert_eq!(d.status().devices[0].held, Bytes::ZERO);
    d.stop();
}

/// One connection, many threads: each waits for its own replies while others read theirs.
#[test]
fn threads_share_one_tenant_connection() {
    const THREADS: usize = 8;
    const ROUNDS: usize = 300;
    let d = Daemon::start("capacity = \"1 GiB\"\n");
    let client = vram_client::Client::connect(
        Some(&d.socket),
        &vram_client::TenantOptions::named("threaded"),
    )
    .unwrap();
    std::thread::scope(|s| {
        for _ in 0..THREADS {
            s.spawn(|| {
                for _ in 0..ROUNDS {
                    let g = client.grant(Bytes::mib(2)).unwrap();
                    assert_eq!(g.size(), Bytes::mib(2));
                    client.give_back(vec![g]).unwrap();
                    client.ping().unwrap();
                }
            });
        }
    });
    let s = client.status().unwrap();
    let t = &s.tenants[0];
    assert_eq!(
        (t.grants, t.returns, t.held),
        (
            (THREADS * ROUNDS) as u64,
            (THREADS * ROUNDS) as u64,
            Bytes::ZERO
        )
    );
    drop(client);
    d.wait_for_no_tenants();
    d.stop();
}
