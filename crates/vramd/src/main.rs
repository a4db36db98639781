//! The `vramd` command line.

#![forbid(unsafe_code)]

use clap::{Parser, Subcommand};
use vramd::cmd;

/// vramd: a GPU memory broker. One daemon per node owns the GPUs' memory and hands it to tenant
/// processes under guarantees, limits and priorities; a crashed tenant's memory comes back at once.
///
/// Without a GPU, the host backend serves memfd-backed shared memory, so everything runs anywhere.
/// Try `vramd demo`.
#[derive(Parser)]
#[command(version, propagate_version = true)]
struct Cli {
    /// Log format of the daemon and tools.
    #[arg(long, global = true, value_enum, default_value = "text")]
    log_format: cmd::LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the daemon.
    Serve(cmd::serve::Args),
    /// Show devices and tenants of a running daemon.
    Status(cmd::status::Args),
    /// A live view of devices and tenants: held, in use and cached against guarantee and limit,
    /// refusals, grant rate; sortable (s, r, 1-9), q quits.
    Top(cmd::top::Args),
    /// Start a daemon on a 16 GiB host-backend device and three tenant processes, one of which is
    /// killed midway; report grants, refusals, reclaimed memory and whether every pattern verified.
    Demo(cmd::demo::Args),
    /// Measure the take+return round trip through a real daemon (p50/p90/p99/max per size).
    Bench(cmd::bench::Args),
    /// Replay PyTorch memory snapshots through vramd's allocator: fragmentation, driver calls and
    /// their modelled H200 cost.
    Replay(cmd::replay::Args),
    /// Start a program as a tenant (PyTorch programs get vramd's allocator, unchanged).
    Run(cmd::run::Args),
    /// Print what the daemon can still guarantee as the JSON `ray start --resources` takes
    /// (`{"vramd_memory_mib": N}`; see docs/ray.md).
    RayResources(cmd::ray_resources::Args),
    /// A scripted tenant process (used by `demo` and the tests).
    #[command(hide = true)]
    Tenant(cmd::tenant::Args),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    cmd::init_logging(cli.log_format, matches!(cli.command, Command::Serve(_)));
    let result = match cli.command {
        Command::Serve(a) => cmd::serve::run(a),
        Command::Status(a) => cmd::status::run(a),
        Command::Top(a) => cmd::top::run(a),
        Command::Demo(a) => cmd::demo::run(a),
        Command::Bench(a) => cmd::bench::run(a),
        Command::Replay(a) => cmd::replay::run(a),
        Command::Run(a) => cmd::run::run(a),
        Command::RayResources(a) => cmd::ray_resources::run(a),
        Command::Tenant(a) => cmd::tenant::run(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            vramd::logging::eprint_line(&format!("vramd: {}", vramd::logging::Chain(&e)));
            std::process::ExitCode::from(2)
        }
    }
}
