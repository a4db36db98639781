//! vramd, the daemon and its command-line tools. The decisions live in `vram-core`; this crate is
//! the I/O shell around them: the socket server, configuration, and the commands.

#![forbid(unsafe_code)]

pub mod cmd;
pub mod config;
pub mod logging;
pub mod metrics;
pub mod notify;
pub mod own_daemon;
pub mod server;
