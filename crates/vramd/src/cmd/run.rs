//! `vramd run`: starts a program as a tenant, unchanged.
//!
//! First the tenant is registered (`registration.rs`): a tenant the daemon cannot admit, a daemon
//! that is not running, allocator settings (`VRAMD_ALLOC`) that do not parse or a variable no
//! longer read (`vram_proto::env::RENAMED`) stop here, with the reason and a non-zero exit, before
//! the program runs. The program then gets the registration's invitation (`VRAMD_JOIN`), which its
//! libvram.so joins with when it first needs memory, and libvram.so preloaded (`LD_PRELOAD`, in
//! both torch modes): its `dlsym`, `cuGetProcAddress` and the driver's allocation, `cuMemCreate`
//! and memory-info calls are libvram.so's, so every device allocation of the program goes through
//! vramd, whichever library makes it (PyTorch, JAX, CuPy, NCCL). An invitation is taken once: a
//! process the program starts that uses the GPU too is refused its memory, with the reason. For
//! Python, a private directory goes first on `PYTHONPATH`, holding the `vramd_torch` package and a
//! `sitecustomize` that installs vramd's allocator into PyTorch right after `torch` is imported,
//! before any CUDA allocation (see the repository's `python/vramd_torch/`). The program's exit
//! status is ours, and the daemon is told it (a normal end is logged as such, a signal as a crash);
//! SIGTERM, SIGHUP, SIGQUIT and SIGINT sent to us by a process are passed on, but not those the
//! kernel generated (a terminal's Ctrl-C, Ctrl-\ or hangup), which reach the program itself, in
//! our process group; a signal we were started ignoring (`nohup`) is neither caught nor passed on,
//! so that the program inherits the ignoring too.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{bail, Context};
use signal_hook::iterator::exfiltrator::WithOrigin;
use signal_hook::iterator::SignalsInfo;
use signal_hook::low_level::siginfo::Cause;
use vram_core::Bytes;

use super::registration::{Ask, Registration};
use super::SocketArg;

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub socket: SocketArg,
    /// The tenant's name [default: pid-N, N the pid of this `vramd run`].
    #[arg(long)]
    pub tenant: Option<String>,
    /// Memory the daemon keeps for the tenant (e.g. 20GiB).
    #[arg(long)]
    pub guarantee: Option<Bytes>,
    /// The most the tenant may hold.
    #[arg(long)]
    pub limit: Option<Bytes>,
    /// The tenant's class, as named in the daemon's configuration (its priority, default
    /// guarantee and limit).
    #[arg(long = "class", value_name = "CLASS")]
    pub class: Option<String>,
    /// Daemon device index.
    #[arg(long)]
    pub gpu: Option<u32>,
    /// How PyTorch takes vramd's allocator: `pool` keeps PyTorch's caching allocator on top of
    /// vramd's segments (libvram.so serves the CUDA runtime's cudaMalloc and cudaFree, so every
    /// PyTorch feature works); `full` gives vramd every tensor (its own fragmentation handling;
    /// PyTorch's statistics answered from vramd's). In both, libvram.so is preloaded and serves
    /// the driver's allocation calls, so memory taken past PyTorch (cuBLAS workspaces, NCCL, JAX,
    /// CuPy) goes through vramd too.
    #[arg(long, value_enum, default_value_t = TorchMode::Full)]
    pub torch_mode: TorchMode,
    /// Where NVIDIA MPS runs, also set the driver's own cap for this client
    /// (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT) to the tenant's limit, as a hard backstop behind vramd's
    /// books: memory imported from vramd counts against that cap, and so does the client's context
    /// (docs/benchmarks.md, "Outside use, guarantees that fill the device, and MPS"). The cap names
    /// the device by the program's CUDA ordinal, taken as `--gpu` (0 by default): under
    /// CUDA_VISIBLE_DEVICES they may differ.
    #[arg(long)]
    pub mps_limit: bool,
    /// The program and its arguments.
    #[arg(required = true, trailing_var_arg = true)]
    pub command: Vec<OsString>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TorchMode {
    Pool,
    Full,
}

impl TorchMode {
    fn as_str(self) -> &'static str {
        match self {
            TorchMode::Pool => "pool",
            TorchMode::Full => "full",
        }
    }
}

/// The Python files `vramd run` puts on `PYTHONPATH`, relative to that directory: the
/// repository's `python/` (the same files `pip install ./python` installs, and the
/// `sitecustomize` that only `vramd run` uses).
const PYTHON_FILES: &[(&str, &str)] = &[
    (
        "sitecustomize.py",
        include_str!("../../../../python/sitecustomize.py"),
    ),
    (
        "vramd/__init__.py",
        include_str!("../../../../python/vramd/__init__.py"),
    ),
    (
        "vramd/_lib.py",
        include_str!("../../../../python/vramd/_lib.py"),
    ),
    (
        "vramd/ray.py",
        include_str!("../../../../python/vramd/ray.py"),
    ),
    (
        "vramd_torch/__init__.py",
        include_str!("../../../../python/vramd_torch/__init__.py"),
    ),
    (
        "vramd_torch/_lib.py",
        include_str!("../../../../python/vramd_torch/_lib.py"),
    ),
    (
        "vramd_torch/_full.py",
        include_str!("../../../../python/vramd_torch/_full.py"),
    ),
    (
        "vramd_torch/_pool.py",
        include_str!("../../../../python/vramd_torch/_pool.py"),
    ),
    (
        "vramd_torch/_hook.py",
        include_str!("../../../../python/vramd_torch/_hook.py"),
    ),
];

/// Signals passed on to the program.
const FORWARDED: [i32; 4] = [
    signal_hook::consts::SIGINT,
    signal_hook::consts::SIGTERM,
    signal_hook::consts::SIGHUP,
    signal_hook::consts::SIGQUIT,
];

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let lib = find_library()?;
    // The program inherits this environment: a variable its libvram.so would refuse stops here.
    vram_proto::env::check_renamed().map_err(anyhow::Error::msg)?;
    if let Ok(settings) = std::env::var(vram_proto::env::ALLOC) {
        vram_core::alloc::AllocConfig::default()
            .set_all(&settings)
            .map_err(|e| {
                // An error that quotes the setting it is about says the rest.
                let e = e.to_string();
                if e.contains(&format!("`{settings}`")) {
                    anyhow::anyhow!("VRAMD_ALLOC {e}")
                } else {
                    anyhow::anyhow!("VRAMD_ALLOC `{settings}`: {e}")
                }
            })?;
    }
    let registration = Registration::register(
        &args.socket.path(),
        Ask {
            name: args
                .tenant
                .clone()
                .unwrap_or_else(|| format!("pid-{}", std::process::id())),
            class: args.class.clone(),
            guarantee: args.guarantee,
            limit: args.limit,
            gpu: args.gpu,
        },
    )?;
    let python = tempfile::Builder::new()
        .prefix("vramd-run-")
        .tempdir()
        .context("cannot create the directory for vramd's Python helpers")?;
    write_python_files(python.path())?;

    let mut cmd = Command::new(&args.command[0]);
    cmd.args(&args.command[1..])
        .env(vram_proto::env::SOCKET, args.socket.path())
        .env(vram_proto::env::LIB, &lib)
        .env(vram_proto::env::TORCH_MODE, args.torch_mode.as_str())
        .env("PYTHONPATH", python_path(python.path()))
        // libvram.so's dlsym, cuGetProcAddress and driver allocation calls go before the
        // driver's (and, in pool mode, its cudaMalloc / cudaFree before the CUDA runtime's).
        .env("LD_PRELOAD", preload(&lib));
    // The program joins the tenant registered here: a name inherited from our environment would
    // make it a tenant of its own instead (see `TenantOptions::from_env`).
    cmd.env(vram_proto::JOIN_ENV, registration.token())
        .env_remove(vram_proto::env::TENANT);
    if args.mps_limit {
        let w = registration.welcome();
        cmd.env(
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
            mps_cap(args.gpu.unwrap_or(0), w.limit),
        );
    }

    // Installed before the program starts, so that no signal meant for it is lost. A signal
    // caught here would be the program's default at its exec, so one we ignore is left alone.
    let ignored = ignored_signals();
    let forwarded: Vec<i32> = FORWARDED
        .into_iter()
        .filter(|s| !ignored.contains(s))
        .collect();
    let mut signals =
        SignalsInfo::<WithOrigin>::new(&forwarded).context("cannot install signal handlers")?;
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot start `{}`", Path::new(&args.command[0]).display()))?;
    let pid = rustix::process::Pid::from_child(&child);
    let handle = signals.handle();
    let forwarder = std::thread::Builder::new()
        .name("vramd-run-signals".into())
        .spawn(move || {
            for origin in signals.forever() {
                // The kernel's own (a terminal's) went to our whole process group: the program
                // has it already.
                if origin.cause == Cause::Kernel {
                    continue;
                }
                if let Some(s) = rustix::process::Signal::from_named_raw(origin.signal) {
                    let _ = rustix::process::kill_process(pid, s);
                }
            }
        })?;
    let status = child.wait().context("cannot wait for the program")?;
    handle.close();
    let _ = forwarder.join();
    drop(python);
    registration.exited(ended(status));
    Ok(exit_code(status))
}

/// The signals this process was started ignoring (`SigIgn` in /proc/self/status); none where
/// that cannot be read.
fn ignored_signals() -> Vec<i32> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let mask = status
        .lines()
        .find_map(|l| l.strip_prefix("SigIgn:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .unwrap_or(0);
    (1..=64).filter(|s| mask & (1u64 << (s - 1)) != 0).collect()
}

/// `VRAMD_LIB`, else libvram.so next to this executable.
fn find_library() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os(vram_proto::env::LIB).filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        if !p.is_file() {
            bail!("VRAMD_LIB is {}, which is not a file", p.display());
        }
        return Ok(p);
    }
    let exe = std::env::current_exe().context("cannot locate the vramd executable")?;
    let dir = exe.parent().unwrap_or(Path::new("."));
    let lib = dir.join("libvram.so");
    if !lib.is_file() {
        bail!(
            "libvram.so is not next to {} (build it with `cargo build --release -p vram-ffi`), \
             and VRAMD_LIB is not set",
            exe.display()
        );
    }
    Ok(lib)
}

fn write_python_files(dir: &Path) -> anyhow::Result<()> {
    for (rel, text) in PYTHON_FILES {
        let path = dir.join(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

/// MPS's per-client cap for one device: `ORDINAL=NM`, whole MiB, rounded down so that the cap
/// never exceeds the limit.
fn mps_cap(ordinal: u32, limit: Bytes) -> String {
    format!("{ordinal}={}M", limit.get() / Bytes::MIB)
}

/// libvram.so first, then whatever `LD_PRELOAD` was.
fn preload(lib: &Path) -> OsString {
    let mut v = lib.as_os_str().to_owned();
    if let Some(old) = std::env::var_os("LD_PRELOAD").filter(|v| !v.is_empty()) {
        v.push(":");
        v.push(old);
    }
    v
}

/// Our directory first, then whatever `PYTHONPATH` was.
fn python_path(ours: &Path) -> OsString {
    let mut p = OsString::from(ours);
    if let Some(old) = std::env::var_os("PYTHONPATH").filter(|v| !v.is_empty()) {
        p.push(OsStr::new(":"));
        p.push(old);
    }
    p
}

/// How the program ended, for the daemon.
fn ended(status: std::process::ExitStatus) -> vram_proto::ExitStatus {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => vram_proto::ExitStatus::Code(c),
        (None, Some(sig)) => vram_proto::ExitStatus::Signal(sig),
        (None, None) => vram_proto::ExitStatus::Code(-1),
    }
}

/// The program's exit code; killed by signal N, 128 + N as shells report it.
fn exit_code(status: std::process::ExitStatus) -> ExitCode {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => ExitCode::from(c.clamp(0, 255) as u8),
        (None, Some(sig)) => ExitCode::from((128 + sig).clamp(0, 255) as u8),
        (None, None) => ExitCode::FAILURE,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn parse(argv: &[&str]) -> Result<Vec<String>, String> {
        use clap::Parser;
        Cli::try_parse_from(std::iter::once("run").chain(argv.iter().copied()))
            .map(|c| {
                c.args
                    .command
                    .iter()
                    .map(|a| a.to_string_lossy().into_owned())
                    .collect()
            })
            .map_err(|e| e.to_string())
    }

    #[test]
    fn the_program_is_what_follows_the_flags_and_a_mistyped_flag_is_an_error() {
        assert_eq!(
            parse(&["--limit", "1GiB", "python3", "-c", "pass"]).unwrap(),
            ["python3", "-c", "pass"]
        );
        assert_eq!(parse(&["--", "-weird", "--x"]).unwrap(), ["-weird", "--x"]);
        let e = parse(&["--limt", "1GiB", "--", "true"]).unwrap_err();
        assert!(e.contains("unexpected argument '--limt'"), "{e}");
    }

    #[test]
    fn the_mps_cap_names_the_ordinal_and_never_exceeds_the_limit() {
        assert_eq!(mps_cap(0, Bytes::gib(4)), "0=4096M");
        assert_eq!(mps_cap(2, Bytes(Bytes::MIB * 3 + 5)), "2=3M");
    }

    #[test]
    fn our_directory_comes_first_on_the_python_path() {
        std::env::set_var("PYTHONPATH", "/a:/b");
        assert_eq!(
            python_path(Path::new("/ours")),
            OsString::from("/ours:/a:/b")
        );
    }
}
