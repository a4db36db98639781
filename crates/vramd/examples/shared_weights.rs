//! A trainer publishes new weights every step into a shared buffer; four reader processes (rollout
//! workers) always compute on a complete, verified version.
//!
//! `cargo run --release --example shared_weights` starts its own daemon on the host backend,
//! unless `VRAMD_SOCKET` names a running one. Exits non-zero if any reader ever saw a torn or
//! unverified version. `SHARED_WEIGHTS_STEPS` (default 100) and `SHARED_WEIGHTS_MIB` (default 16)
//! change the run.

use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use vram_client::{checksum, Acl, Client, Principal, TenantOptions, Version};
use vram_core::Bytes;
use vram_device::{Device, HostDevice};
use vramd::config::Config;
use vramd::own_daemon::OwnDaemon;

const BUFFER: &str = "policy-weights";
const READERS: usize = 4;
/// The last step's version carries this in its header: readers stop after it.
const LAST: u64 = u64::MAX;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let result = match args.get(1).map(String::as_str) {
        Some("reader") => reader(&args[2]),
        _ => trainer(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("shared_weights: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Step `step`'s weights: header (step, float count), floats, trailer (checksum of the rest).
fn weights(step: u64, header_step: u64, size: usize) -> Vec<u8> {
    // Whole 16 KiB blocks of floats; the rest is padding before the trailer.
    let floats = (size - 24) / 4 / 4096 * 4096;
    let mut data = Vec::with_capacity(size);
    data.extend_from_slice(&header_step.to_le_bytes());
    data.extend_from_slice(&(floats as u64).to_le_bytes());
    let phase = step as f32 * 0.01;
    let block: Vec<u8> = (0..4096)
        .flat_map(|i| (i as f32 * 0.001 + phase).sin().to_le_bytes())
        .collect();
    while data.len() + block.len() <= 16 + floats * 4 {
        data.extend_from_slice(&block);
    }
    data.resize(size - 8, 0);
    let sum = checksum(&data);
    data.extend_from_slice(&sum.to_le_bytes());
    data
}

fn trainer() -> anyhow::Result<()> {
    let steps = env_u64("SHARED_WEIGHTS_STEPS", 100).max(1);
    let size = Bytes::mib(env_u64("SHARED_WEIGHTS_MIB", 16).max(1));
    let (socket, _daemon) = match std::env::var_os(vram_proto::SOCKET_ENV) {
        Some(s) => (std::path::PathBuf::from(s), None),
        None => {
            // A daemon of the example's own, on the host backend, in this process.
            let dev: Arc<dyn Device> = Arc::new(HostDevice::new(Bytes::gib(16), Bytes::mib(2))?);
            let d = OwnDaemon::in_process(tempfile::tempdir()?, vec![dev], &Config::default())?;
            println!("started a vramd (host backend) at {}", d.socket().display());
            (d.socket().to_path_buf(), Some(d))
        }
    };
    let client = Client::connect(Some(&socket), &TenantOptions::named("trainer"))?;
    let acl = Acl {
        readers: vec![Principal::Anyone],
        writers: Vec::new(),
    };
    let buf = client.create_shared(BUFFER, size, acl)?;
    let lease = buf.lease(Duration::from_secs(2))?;
    let exe = std::env::current_exe()?;
    let mut current: Option<Version> = None;
    let mut publish = |step: u64, header: u64| -> anyhow::Result<Duration> {
        let data = weights(step, header, size.get() as usize);
        let draft = lease.begin_write(current)?;
        draft.write(Bytes::ZERO, &data)?;
        let version = draft.version();
        let t = Instant::now();
        let sum = draft.publish_checked(checksum(&data))?;
        let took = t.elapsed();
        debug_assert_eq!(sum, checksum(&data));
        current = Some(version);
        Ok(took)
    };
    publish(0, 0)?;
    let mut readers = Vec::new();
    for i in 0..READERS {
        let child = Command::new(&exe)
            .args(["reader", &format!("worker{i}")])
            .env(vram_proto::SOCKET_ENV, &socket)
            .stdout(Stdio::inherit())
            .spawn()
            .context("cannot start a reader")?;
        readers.push(child);
    }
    let started = Instant::now();
    let mut publish_times = Vec::new();
    for step in 1..=steps {
        let header = if step == steps { LAST } else { step };
        publish_times.push(publish(step, header)?);
        std::thread::sleep(Duration::from_millis(5));
    }
    let elapsed = started.elapsed();
    let mut failed = 0;
    for mut r in readers {
        if !r.wait()?.success() {
            failed += 1;
        }
    }
    publish_times.sort();
    let median = publish_times[publish_times.len() / 2];
    println!(
        "trainer: {steps} versions of {size} published in {elapsed:.2?}; publish (checksum in the \
         daemon) median {median:.2?}"
    );
    drop(lease);
    if failed > 0 {
        bail!("{failed} of {READERS} readers saw a torn or unverified version");
    }
    println!("all {READERS} readers computed on complete, verified versions only");
    Ok(())
}

fn reader(name: &str) -> anyhow::Result<()> {
    let client = Client::connect(None, &TenantOptions::named(name))?;
    let buf = client.open_shared(BUFFER)?;
    let (mut seen, mut bad, mut last) = (0u64, 0u64, None);
    loop {
        let Some(v) = buf.wait_newer(last, Duration::from_secs(10))? else {
            bail!("{name}: no new version for 10 s");
        };
        let pinned = buf.pin()?;
        let data = pinned.to_vec()?;
        let n = data.len();
        let whole = checksum(&data[..n - 8]).to_le_bytes() == data[n - 8..];
        let verified = checksum(&data) == pinned.checksum();
        if !(whole && verified) {
            bad += 1;
            eprintln!("{name}: version {v} torn ({whole}) or unverified ({verified})");
        }
        // The computation: a sum over the weights of a complete version.
        let header = u64::from_le_bytes(data[..8].try_into()?);
        let floats = u64::from_le_bytes(data[8..16].try_into()?) as usize;
        let sum: f64 = data[16..16 + floats * 4]
            .chunks_exact(4)
            .map(|c| f64::from(f32::from_le_bytes(c.try_into().expect("4 bytes"))))
            .sum();
        seen += 1;
        last = Some(pinned.version());
        drop(pinned);
        if header == LAST {
            println!(
                "{name}: {seen} versions read, last {v}, weight sum {sum:.3}; {bad} torn or unverified"
            );
            break;
        }
    }
    if bad > 0 {
        bail!("{name}: {bad} torn or unverified versions");
    }
    Ok(())
}
