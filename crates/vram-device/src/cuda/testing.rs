//! The one rule every GPU test follows: run where a GPU is found, otherwise skip saying why —
//! unless `VRAMD_REQUIRE_GPU=1`, which makes a missing GPU a failure (`.gpu/run` sets it).

use super::{probe, CudaDevice};

/// Why the GPU tests cannot run here, or `None` where the driver finds a GPU.
pub fn no_gpu() -> Option<String> {
    match probe() {
        Ok(found) if found.is_empty() => Some("the driver sees no GPU".to_owned()),
        Ok(_) => None,
        Err(e) => Some(e.to_string()),
    }
}

/// Whether a missing GPU must fail the tests (`VRAMD_REQUIRE_GPU=1`).
pub fn gpu_required() -> bool {
    std::env::var("VRAMD_REQUIRE_GPU").as_deref() == Ok("1")
}

/// The GPU named by `which` (ordinal or UUID), or `None` after printing why there is none.
///
/// # Panics
/// Where there is no usable GPU and `VRAMD_REQUIRE_GPU=1` is set.
pub fn gpu_or_skip(which: &str) -> Option<CudaDevice> {
    let reason = match no_gpu() {
        Some(reason) => reason,
        None => match CudaDevice::open(which) {
            Ok(dev) => return Some(dev),
            Err(e) => e.to_string(),
        },
    };
    if gpu_required() {
        panic!("no GPU: {reason} (VRAMD_REQUIRE_GPU=1)");
    }
    println!("skipping: no GPU: {reason}");
    None
}
