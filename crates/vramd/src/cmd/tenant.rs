//! `vramd tenant`: a scripted tenant process for the demo and the tests. It reads one command per
//! line on stdin and answers each with one JSON line on stdout:
//!
//! - `take SIZE [CHUNK]`: take CHUNK-sized grants (default 256 MiB) until SIZE more is held or a
//!   grant is refused; write a pattern into each.
//! - `give SIZE`: give back grants until SIZE has been returned.
//! - `cache SIZE`: mark SIZE of what is held as idle (reported to the daemon, returned on reclaim).
//! - `verify`: check every pattern written so far.
//! - `cycles N SIZE`: N rounds of take SIZE, write, verify, give back.
//! - `exit` (or end of input): give everything back and exit.

use std::io::{BufRead, Write};
use std::sync::{Arc, Mutex};

use anyhow::Context;
use serde_json::json;
use vram_client::{Client, ClientError, Grant, TenantOptions};
use vram_core::Bytes;
use vram_device::{Access, ByteAccess, Reservation};

use super::SocketArg;

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub socket: SocketArg,
    #[arg(long)]
    pub name: String,
    #[arg(long)]
    pub class: Option<String>,
    #[arg(long)]
    pub guarantee: Option<Bytes>,
    #[arg(long)]
    pub limit: Option<Bytes>,
    #[arg(long)]
    pub gpu: Option<u32>,
}

/// Bytes of pattern written per MiB of memory: enough to catch crossed or lost memory without
/// touching (and so paying RAM for) every page of a large virtual device.
const PATTERN_STRIDE: u64 = Bytes::MIB;
const PATTERN_LEN: usize = 64;

struct Held {
    grant: Grant,
    res: Reservation,
    seed: u64,
    cached: bool,
}

struct Tenant {
    client: Client,
    held: Arc<Mutex<Vec<Held>>>,
    seed: u64,
    /// Grants whose memory was not all zeros when it arrived.
    dirty: std::sync::atomic::AtomicU64,
}

pub fn run(args: Args) -> anyhow::Result<std::process::ExitCode> {
    let opts = TenantOptions {
        name: args.name.clone(),
        class: args.class,
        guarantee: args.guarantee,
        limit: args.limit,
        gpu: args.gpu,
        // Under `vramd run`, join the tenant it registered, as libvram.so does.
        join: std::env::var(vram_proto::JOIN_ENV)
            .ok()
            .filter(|t| !t.is_empty()),
    };
    let client = match Client::connect(Some(&args.socket.path()), &opts) {
        Ok(c) => c,
        Err(e) => {
            emit(json!({"event": "refused_at_connect", "message": e.to_string()}));
            return Ok(std::process::ExitCode::from(3));
        }
    };
    let w = client.welcome().clone();
    let tenant = Tenant {
        client,
        held: Arc::new(Mutex::new(Vec::new())),
        seed: std::process::id() as u64,
        dirty: std::sync::atomic::AtomicU64::new(0),
    };
    let held = tenant.held.clone();
    tenant.client.on_reclaim(Box::new(move |client, want| {
        give_back_cached(client, &held, want)
    }));
    emit(
        json!({"event": "welcome", "name": w.name, "class": w.class, "guarantee": w.guarantee.get(),
                "limit": w.limit.get(), "pid": std::process::id()}),
    );
    for line in std::io::stdin().lock().lines() {
        let line = line.context("reading commands")?;
        let words: Vec<&str> = line.split_whitespace().collect();
        let out = match words.as_slice() {
            [] => continue,
            ["take", size, rest @ ..] => {
                tenant.take(parse(size)?, rest.first().map(|c| parse(c)).transpose()?)
            }
            ["give", size] => tenant.give(parse(size)?),
            ["cache", size] => tenant.cache(parse(size)?),
            ["verify"] => tenant.verify(),
            ["cycles", n, size] => tenant.cycles(n.parse().context("cycles N")?, parse(size)?),
            ["exit"] => break,
            _ => json!({"event": "error", "message": format!("unknown command `{line}`")}),
        };
        emit(out);
    }
    let all: Vec<Held> = std::mem::take(&mut *tenant.held.lock().expect("held"));
    let n = all.len();
    tenant
        .client
        .give_back(all.into_iter().map(|h| h.grant).collect())?;
    emit(json!({"event": "bye", "returned_grants": n}));
    Ok(std::process::ExitCode::SUCCESS)
}

fn parse(s: &str) -> anyhow::Result<Bytes> {
    Ok(s.parse::<Bytes>()?)
}

fn emit(v: serde_json::Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{v}");
    let _ = out.flush();
}

fn pattern(seed: u64, offset: u64) -> [u8; PATTERN_LEN] {
    let mut x = seed ^ offset.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut out = [0u8; PATTERN_LEN];
    for chunk in out.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes());
    }
    out
}

/// Whether fresh memory reads as zeros where the pattern will go: no tenant may see another's data.
fn is_clean(dev: &dyn ByteAccess, h: &Held) -> anyhow::Result<bool> {
    let mut buf = [0u8; PATTERN_LEN];
    for off in (0..h.grant.size().get()).step_by(PATTERN_STRIDE as usize) {
        dev.read(&h.res, Bytes(off), &mut buf)?;
        if buf.iter().any(|b| *b != 0) {
            return Ok(false);
        }
    }
    Ok(true)
}

fn write_pattern(dev: &dyn ByteAccess, h: &Held) -> anyhow::Result<()> {
    for off in (0..h.grant.size().get()).step_by(PATTERN_STRIDE as usize) {
        dev.write(&h.res, Bytes(off), &pattern(h.seed, off))?;
    }
    Ok(())
}

fn check_pattern(dev: &dyn ByteAccess, h: &Held) -> anyhow::Result<bool> {
    let mut buf = [0u8; PATTERN_LEN];
    for off in (0..h.grant.size().get()).step_by(PATTERN_STRIDE as usize) {
        dev.read(&h.res, Bytes(off), &mut buf)?;
        if buf != pattern(h.seed, off) {
            return Ok(false);
        }
    }
    Ok(true)
}

fn give_back_cached(client: &Client, held: &Mutex<Vec<Held>>, want: Bytes) -> Bytes {
    let mut back = Vec::new();
    {
        let mut h = held.lock().expect("held");
        let mut got = Bytes::ZERO;
        let mut i = 0;
        while i < h.len() && got < want {
            if h[i].cached {
                let x = h.swap_remove(i);
                got += x.grant.size();
                back.push(x.grant);
            } else {
                i += 1;
            }
        }
    }
    let bytes = back.iter().map(Grant::size).sum();
    if back.is_empty() || client.give_back(back).is_err() {
        return Bytes::ZERO;
    }
    let _ = report(client, held);
    bytes
}

fn report(client: &Client, held: &Mutex<Vec<Held>>) -> Result<(), ClientError> {
    let (mut in_use, mut cached) = (Bytes::ZERO, Bytes::ZERO);
    for h in held.lock().expect("held").iter() {
        if h.cached {
            cached += h.grant.size();
        } else {
            in_use += h.grant.size();
        }
    }
    client.report_usage(in_use, cached)
}

impl Tenant {
    fn held_bytes(&self) -> Bytes {
        self.held
            .lock()
            .expect("held")
            .iter()
            .map(|h| h.grant.size())
            .sum()
    }

    fn take_one(&self, size: Bytes, n: u64) -> Result<(), ClientError> {
        let grant = self.client.grant(size)?;
        let dev = self.client.device();
        // A grant this tenant could not map is given back, not kept unused until it exits.
        let mapped = dev.reserve(grant.size()).and_then(|res| {
            dev.map(&res, Bytes::ZERO, &grant.handle, Access::ReadWrite)?;
            Ok(res)
        });
        let res = match mapped {
            Ok(res) => res,
            Err(e) => {
                let _ = self.client.give_back(vec![grant]);
                return Err(e.into());
            }
        };
        let h = Held {
            seed: self.seed.wrapping_mul(1_000_003).wrapping_add(n),
            grant,
            res,
            cached: false,
        };
        let checked = is_clean(dev.as_ref(), &h).and_then(|clean| {
            if !clean {
                self.dirty
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            write_pattern(dev.as_ref(), &h)
        });
        if let Err(e) = checked {
            // Unmapped first, so that the daemon finds it reached by no one.
            let Held { grant, res, .. } = h;
            drop(res);
            let _ = self.client.give_back(vec![grant]);
            return Err(ClientError::Lost(e.to_string()));
        }
        self.held.lock().expect("held").push(h);
        Ok(())
    }

    fn take(&self, size: Bytes, chunk: Option<Bytes>) -> serde_json::Value {
        let chunk = chunk.unwrap_or(Bytes::mib(256));
        let mut taken = Bytes::ZERO;
        let mut grants = 0u64;
        let mut refused = serde_json::Value::Null;
        while taken < size {
            let this = chunk.min(size - taken);
            match self.take_one(this, grants) {
                Ok(()) => {
                    taken += this;
                    grants += 1;
                }
                Err(ClientError::Daemon(e)) => {
                    refused = json!({"reason": e.reason, "message": e.message});
                    break;
                }
                Err(e) => return json!({"event": "error", "message": e.to_string()}),
            }
        }
        let _ = report(&self.client, &self.held);
        json!({"event": "took", "taken": taken.get(), "grants": grants, "held": self.held_bytes().get(),
               "refused": refused, "dirty": self.dirty.load(std::sync::atomic::Ordering::Relaxed)})
    }

    fn give(&self, size: Bytes) -> serde_json::Value {
        let mut back = Vec::new();
        {
            let mut h = self.held.lock().expect("held");
            let mut got = Bytes::ZERO;
            while got < size {
                let Some(x) = h.pop() else { break };
                got += x.grant.size();
                back.push(x.grant);
            }
        }
        let n = back.len();
        match self.client.give_back(back) {
            Ok(held) => {
                let _ = report(&self.client, &self.held);
                json!({"event": "gave", "grants": n, "held": held.get()})
            }
            Err(e) => json!({"event": "error", "message": e.to_string()}),
        }
    }

    fn cache(&self, size: Bytes) -> serde_json::Value {
        let mut marked = Bytes::ZERO;
        for h in self.held.lock().expect("held").iter_mut().rev() {
            if marked >= size {
                break;
            }
            if !h.cached {
                h.cached = true;
                marked += h.grant.size();
            }
        }
        let _ = report(&self.client, &self.held);
        json!({"event": "cached", "bytes": marked.get()})
    }

    fn verify(&self) -> serde_json::Value {
        let dev = self.client.device();
        let held = self.held.lock().expect("held");
        let mut bad = 0;
        for h in held.iter() {
            if !check_pattern(dev.as_ref(), h).unwrap_or(false) {
                bad += 1;
            }
        }
        json!({"event": "verified", "ok": bad == 0, "checked": held.len(), "bad": bad})
    }

    fn cycles(&self, n: u64, size: Bytes) -> serde_json::Value {
        let mut errors = Vec::new();
        for i in 0..n {
            if let Err(e) = self.take_one(size, 1_000_000 + i) {
                errors.push(e.to_string());
                continue;
            }
            let h = self.held.lock().expect("held").pop().expect("just taken");
            if !check_pattern(self.client.device().as_ref(), &h).unwrap_or(false) {
                errors.push(format!("cycle {i}: pattern mismatch"));
            }
            // Unmapped before it goes back: memory given back while still mapped stays booked
            // to this tenant until the mapping is gone.
            let Held { grant, res, .. } = h;
            drop(res);
            if let Err(e) = self.client.give_back(vec![grant]) {
                errors.push(e.to_string());
            }
        }
        json!({"event": "cycled", "n": n, "errors": errors.len(), "first_error": errors.first()})
    }
}

/// A `vramd tenant` process driven from another process: one command per line in, one JSON line
/// out. `vramd demo` and the multi-process tests drive their tenants with it.
pub struct Scripted {
    pub name: String,
    pub child: std::process::Child,
    stdin: Option<std::process::ChildStdin>,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Scripted {
    /// How long an answer may take.
    pub const ANSWER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

    /// Starts `exe tenant --socket SOCKET --name NAME FLAGS...`; does not wait for its welcome.
    pub fn spawn(
        exe: &std::path::Path,
        socket: &std::path::Path,
        name: &str,
        flags: &[&str],
    ) -> anyhow::Result<Scripted> {
        use std::process::{Command, Stdio};
        let mut child = Command::new(exe)
            .arg("tenant")
            .arg("--socket")
            .arg(socket)
            .args(["--name", name])
            .args(flags)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot start tenant {name}"))?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("stdout is piped");
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(Scripted {
            name: name.to_string(),
            child,
            stdin,
            lines,
        })
    }

    /// The next JSON line the tenant printed.
    pub fn answer(&mut self) -> anyhow::Result<serde_json::Value> {
        let line = self
            .lines
            .recv_timeout(Self::ANSWER_TIMEOUT)
            .with_context(|| format!("tenant {} did not answer", self.name))?;
        serde_json::from_str(&line)
            .with_context(|| format!("tenant {} printed `{line}`", self.name))
    }

    /// Sends a command without waiting for its answer.
    pub fn send(&mut self, line: &str) -> anyhow::Result<()> {
        let stdin = self
            .stdin
            .as_mut()
            .with_context(|| format!("tenant {}'s input is closed", self.name))?;
        writeln!(stdin, "{line}")
            .and_then(|()| stdin.flush())
            .with_context(|| format!("tenant {} is gone", self.name))
    }

    /// Sends a command and returns its answer.
    pub fn cmd(&mut self, line: &str) -> anyhow::Result<serde_json::Value> {
        self.send(line)?;
        self.answer()
    }

    /// Closes the tenant's input (end of commands).
    pub fn close_input(&mut self) {
        self.stdin = None;
    }
}
