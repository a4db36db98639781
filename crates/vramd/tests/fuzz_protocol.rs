//! The protocol fuzzed against a real daemon (host backend): random peers never crash or stall
//! it, never get a tenant past its limit (nor its uid past its own, nor the device past its
//! capacity), and leave the books at zero once they have all gone.
//!
//! Each round, `PEERS` peers play scripts that proptest generates from the round's seed, at once,
//! each on connections of its own (`fuzz/gen.rs` says what they send), while the test reads the
//! status on fresh connections and checks every rule on it (`fuzz/rules.rs`); the peers check
//! every reply against their own view (`fuzz/peer.rs`). When the peers are done and every
//! connection is closed, the daemon must answer a ping on a fresh connection, show no tenant,
//! nothing held and no shared buffer within 5 s, and be back to its file descriptors and threads
//! of before.
//!
//! The run stops once `FUZZ_PROTOCOL_INPUTS` inputs are sent (default 100,000 in a release
//! build, 5,000 in a debug one) or `FUZZ_PROTOCOL_SECS` have passed (default 240); a release run
//! stopped by the clock before its inputs fails. A failure names the round's seed: with
//! `FUZZ_PROTOCOL_SEED=SEED` the run starts with that round (the same inputs; the peers'
//! interleaving is the scheduler's).

mod common;
mod fuzz;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{wait_until, Daemon};
use fuzz::gen::{script, Script};
use fuzz::peer::{Counts, Peer, World};
use fuzz::rules::{check_idle, check_report, config, POOL_HANDLES};
use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use vram_client::Observer;
use vram_proto::{Conn, Reply, Request};

/// Peers playing at once in a round.
const PEERS: usize = 6;

/// The run's bounds and first seed, from the environment or the defaults.
struct Settings {
    inputs: u64,
    secs: u64,
    seed: u64,
}

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    let parsed = match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => v.parse(),
    };
    Some(parsed.unwrap_or_else(|e| panic!("{name}={v}: {e}")))
}

impl Settings {
    fn from_env() -> Settings {
        let default_inputs = if cfg!(debug_assertions) {
            5_000
        } else {
            100_000
        };
        let seed = env_u64("FUZZ_PROTOCOL_SEED").unwrap_or_else(|| {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .expect("after 1970");
            t.as_nanos() as u64 ^ u64::from(std::process::id())
        });
        Settings {
            inputs: env_u64("FUZZ_PROTOCOL_INPUTS").unwrap_or(default_inputs),
            secs: env_u64("FUZZ_PROTOCOL_SECS").unwrap_or(240),
            seed,
        }
    }
}

/// The next round's seed.
fn next_seed(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The round's scripts, from its seed alone.
fn scripts(seed: u64) -> Vec<Script> {
    let mut key = [0u8; 32];
    for (i, chunk) in key.chunks_mut(8).enumerate() {
        chunk.copy_from_slice(&next_seed(seed ^ i as u64).to_le_bytes());
    }
    let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &key);
    let mut runner = TestRunner::new_with_rng(Config::default(), rng);
    proptest::collection::vec(script(20..120), PEERS)
        .new_tree(&mut runner)
        .expect("scripts")
        .current()
}

/// The scripts one step a line, for a person reading a failure.
fn listing_of(scripts: &[Script]) -> String {
    let mut out = String::new();
    for (i, s) in scripts.iter().enumerate() {
        out.push_str(&format!("peer {i}: first {:?}\n", s.hello));
        for (n, op) in s.ops.iter().enumerate() {
            out.push_str(&format!("  {n}: {op:?}\n"));
        }
    }
    out
}

/// The daemon's open descriptors and threads.
fn resources(d: &Daemon) -> (usize, usize) {
    let threads = std::fs::read_dir(format!("/proc/{}/task", d.pid())).map_or(0, |t| t.count());
    (d.fd_count(), threads)
}

/// What the daemon's `/proc/PID/DIR` entries are, by `what`, counted.
fn listing(
    d: &Daemon,
    dir: &str,
    what: impl Fn(&std::path::Path) -> std::io::Result<String>,
) -> String {
    let mut kinds = std::collections::BTreeMap::<String, usize>::new();
    for e in std::fs::read_dir(format!("/proc/{}/{dir}", d.pid()))
        .into_iter()
        .flatten()
    {
        let path = e.map_or_else(|_| "?".into(), |e| e.path());
        let kind = what(&path).unwrap_or_else(|e| e.to_string());
        let kind = kind
            .split(['[', ':'])
            .next()
            .unwrap_or("")
            .trim()
            .to_string();
        *kinds.entry(kind).or_default() += 1;
    }
    format!("{kinds:?}")
}

/// A ping and a status on a fresh connection: the daemon is up and serving.
fn alive(d: &Daemon) -> Result<vram_proto::StatusReport, String> {
    let stream = std::os::unix::net::UnixStream::connect(&d.socket)
        .map_err(|e| format!("the daemon does not accept connections: {e}"))?;
    let conn = Conn::new(stream);
    conn.send(7, &Request::Ping, &[])
        .map_err(|e| format!("ping: {e}"))?;
    match conn.recv_within::<Reply>(Some(Duration::from_secs(5))) {
        Ok(r) if r.id == 7 && r.msg == Reply::Pong => {}
        other => return Err(format!("ping on a fresh connection answered {other:?}")),
    }
    Observer::connect(Some(&d.socket))
        .and_then(|o| o.status())
        .map_err(|e| format!("status on a fresh connection: {e}"))
}

/// One round: the peers at once, the status checked meanwhile, then everything gone.
fn round(d: &Daemon, seed: u64, scripts: &[Script], counts: &mut Counts) -> Result<(), String> {
    let world = World::default();
    let done = AtomicUsize::new(0);
    let mut results = std::thread::scope(|s| {
        let peers: Vec<_> = scripts
            .iter()
            .enumerate()
            .map(|(i, script)| {
                let (world, done) = (&world, &done);
                s.spawn(move || {
                    let mut peer = Peer::new(&d.socket, world, next_seed(seed ^ i as u64));
                    let played = peer.play(script).map_err(|e| format!("peer {i}: {e}"));
                    done.fetch_add(1, Ordering::Relaxed);
                    played.map(|()| peer.counts)
                })
            })
            .collect();
        let mut observed = Ok(Counts::default());
        while done.load(Ordering::Relaxed) < scripts.len() {
            if observed.is_ok() {
                observed = alive(d)
                    .and_then(|r| check_report(&r))
                    .map(|()| Counts::default());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut results: Vec<_> = peers
            .into_iter()
            .map(|p| p.join().unwrap_or_else(|_| Err("a peer panicked".into())))
            .collect();
        results.push(observed);
        results
    });
    for r in results.drain(..) {
        let c = r?;
        counts.inputs += c.inputs;
        counts.syncs += c.syncs;
    }
    Ok(())
}

/// Once every connection is closed: the books at zero within 5 s, and no more descriptors or
/// threads than the daemon had before (beyond what its pool may keep).
fn settled(d: &Daemon, before: (usize, usize)) -> Result<(), String> {
    let mut last = Err(String::new());
    let mut now = before;
    let idle = wait_until(Duration::from_secs(5), || {
        last = alive(d).and_then(|r| check_report(&r).and_then(|()| check_idle(&r)));
        now = resources(d);
        last.is_ok() && now.0 <= before.0 + POOL_HANDLES && now.1 <= before.1
    });
    if !idle {
        last?;
        return Err(format!(
            "the daemon holds {} descriptors and {} threads with no connection; {} and {} before\n\
             descriptors: {}\nthreads: {}",
            now.0,
            now.1,
            before.0,
            before.1,
            listing(d, "fd", |p| std::fs::read_link(p)
                .map(|l| l.display().to_string())),
            listing(d, "task", |p| std::fs::read_to_string(p.join("comm"))),
        ));
    }
    Ok(())
}

#[test]
fn random_peers_never_crash_the_daemon_exceed_a_limit_or_leave_memory_booked() {
    let settings = Settings::from_env();
    let d = Daemon::start(&config(rustix::process::getuid().as_raw()));
    let mut before = (0, 0);
    assert!(
        wait_until(Duration::from_secs(5), || {
            before = resources(&d);
            alive(&d).is_ok_and(|r| check_idle(&r).is_ok() && r.devices[0].pooled.get() > 0)
        }),
        "the daemon never settled after start"
    );
    println!(
        "fuzz_protocol: first seed {:#x}; {PEERS} peers a round; up to {} inputs or {} s",
        settings.seed, settings.inputs, settings.secs
    );
    let started = Instant::now();
    let budget = Duration::from_secs(settings.secs);
    let mut counts = Counts::default();
    let mut seed = settings.seed;
    let mut rounds = 0u64;
    while counts.inputs < settings.inputs && started.elapsed() < budget {
        let case = scripts(seed);
        if let Err(e) = round(&d, seed, &case, &mut counts).and_then(|()| settled(&d, before)) {
            let scripts = std::env::temp_dir().join(format!("fuzz_protocol-{seed:x}.txt"));
            let written = std::fs::write(&scripts, listing_of(&case));
            panic!(
                "round {rounds} (seed {seed:#x}; FUZZ_PROTOCOL_SEED={seed:#x} replays it) after \
                 {} inputs: {e}\nthe round's scripts: {} ({written:?})",
                counts.inputs,
                scripts.display()
            );
        }
        seed = next_seed(seed);
        rounds += 1;
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "fuzz_protocol: {} inputs ({} pings besides) in {rounds} rounds, {secs:.1} s: {:.0} \
         inputs/s; the daemon's protocol errors: {}",
        counts.inputs,
        counts.syncs,
        counts.inputs as f64 / secs,
        alive(&d).map_or(0, |r| r.daemon.protocol_errors)
    );
    if counts.inputs < settings.inputs {
        if cfg!(debug_assertions) {
            println!("fuzz_protocol: a debug build; the input count is enforced in release runs");
        } else {
            panic!(
                "only {} of {} inputs within {} s",
                counts.inputs, settings.inputs, settings.secs
            );
        }
    }
    d.stop();
}
