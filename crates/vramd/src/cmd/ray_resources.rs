//! `vramd ray-resources`: the node's GPU memory as the custom resource `ray start --resources`
//! takes, from the node's own daemon.
//!
//! The figure is what the daemon could still guarantee to a new tenant (each device's `free`:
//! capacity less every guarantee, declared or connected, less what tenants hold above their
//! guarantees and what is in use outside vramd), summed over the node's devices. Ray hands that
//! out as logical resources when it places tasks and actors; the daemon enforces it when their
//! workers connect (`docs/ray.md`).
//!
//! The unit is whole MiB (`vramd_memory_mib`). Ray keeps resource amounts as fixed-point numbers
//! with four decimals in 64 bits (about 9.2e14 units) and requires node amounts to be whole: bytes
//! would overflow at 92 TB, and GiB would round every request to whole GiB. MiB is exact for any
//! size granted (the device granularity is 2 MiB on CUDA, and the host backend's is a multiple of
//! a MiB) and leaves room for 2^40 GiB.

use std::process::ExitCode;

use vram_client::Observer;
use vram_core::Bytes;
use vram_proto::StatusReport;

use super::SocketArg;

/// The Ray resource's name; `vramd.ray` asks for the same one.
pub const RESOURCE: &str = "vramd_memory_mib";

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub socket: SocketArg,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let path = args.socket.path();
    let report = Observer::connect(Some(&path))
        .and_then(|o| o.status())
        .map_err(|e| anyhow::anyhow!("cannot ask the daemon at {}: {e}", path.display()))?;
    println!("{}", resources(&report));
    Ok(ExitCode::SUCCESS)
}

/// `{"vramd_memory_mib": N}`, N the whole MiB the node's devices could still guarantee.
fn resources(report: &StatusReport) -> serde_json::Value {
    let free: u64 = report
        .devices
        .iter()
        .map(|d| d.free.get() / Bytes::MIB)
        .sum();
    serde_json::json!({ RESOURCE: free })
}
