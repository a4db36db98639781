//! The subcommands. Each module has its `Args` (clap) and a `run`.

pub mod bench;
pub mod demo;
mod pytorch_figures;
pub mod ray_resources;
mod registration;
pub mod replay;
pub mod run;
pub mod serve;
mod spread;
pub mod status;
pub mod tenant;
pub mod top;

use std::path::PathBuf;

/// How the daemon and tools log.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per event, for log collectors.
    Json,
}

/// Logs to stderr; `RUST_LOG` overrides the level (info for the daemon, warn for tools). A line
/// stderr refuses is dropped and counted ([`crate::logging`]), never a panic. Colours only on a
/// terminal: a file or the journal gets plain text.
pub fn init_logging(format: LogFormat, daemon: bool) {
    use tracing_subscriber::EnvFilter;
    let default = if daemon { "info" } else { "warn" };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(crate::logging::Stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .log_internal_errors(false);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

/// `--socket`, else `VRAMD_SOCKET`, else the default path.
#[derive(Debug, Clone, clap::Args)]
pub struct SocketArg {
    /// The daemon's socket [env: VRAMD_SOCKET; default: /run/vramd/vramd.sock]
    #[arg(long, short = 's')]
    pub socket: Option<PathBuf>,
}

impl SocketArg {
    pub fn path(&self) -> PathBuf {
        self.socket
            .clone()
            .unwrap_or_else(vram_client::default_socket)
    }
}
