//! The runner of vramd's GPU test targets (`harness = false`), so that a run without a GPU says
//! so in its summary: where the driver finds no GPU, every GPU test is reported as ignored
//! ("0 passed; 0 failed; N ignored"), not as passed. With `VRAMD_REQUIRE_GPU=1` they run anyway
//! and fail, each in its own way ([`gpu_or_skip`] panics).
//!
//! The runner is libtest-mimic, which takes libtest's arguments: a name filter, `--exact`,
//! `--ignored`, `--include-ignored`, `--nocapture`, `--test-threads=N`, `--list`. A target's
//! child processes (a test that re-runs its own executable with `CHILD --exact --ignored` and a
//! role in the environment) find their child test as before: it is always flagged ignored, so
//! that only such a call runs it.
//!
//! ```ignore
//! vram_testing::gpu_main! {
//!     tests: [map_write_read_unmap, export_import_across_processes],
//!     children: [child],
//! }
//! ```

#![forbid(unsafe_code)]

use std::process::ExitCode;

use libtest_mimic::{Arguments, Trial};
use vram_device::CudaDevice;

/// One test: its name (the function's) and its body.
pub type Test = (&'static str, fn());

/// Why the GPU tests cannot run here, or `None` where the driver finds a GPU.
pub fn no_gpu() -> Option<String> {
    match vram_device::cuda::probe() {
        Ok(found) if found.is_empty() => Some("the driver sees no GPU".to_owned()),
        Ok(_) => None,
        Err(e) => Some(e.to_string()),
    }
}

/// Whether a missing GPU must fail the tests (`VRAMD_REQUIRE_GPU=1`; `.gpu/run` sets it).
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

/// Runs `tests` (ignored where there is no GPU, unless one is required) and `children` (always
/// ignored: run only when named with `--ignored`), with the process's arguments.
pub fn run(tests: &[Test], children: &[Test]) -> ExitCode {
    let args = Arguments::from_args();
    let skip = match no_gpu() {
        Some(reason) if gpu_required() => {
            eprintln!("no GPU: {reason}; VRAMD_REQUIRE_GPU=1, so the GPU tests fail");
            false
        }
        Some(reason) => {
            if !args.list {
                eprintln!(
                    "no GPU: {reason}; the {} GPU test(s) are ignored (VRAMD_REQUIRE_GPU=1 \
                     makes a missing GPU a failure)",
                    tests.len()
                );
            }
            true
        }
        None => false,
    };
    let trial = |&(name, body): &Test, ignored: bool| {
        Trial::test(name, move || {
            body();
            Ok(())
        })
        .with_ignored_flag(ignored)
    };
    let trials = tests
        .iter()
        .map(|t| trial(t, skip))
        .chain(children.iter().map(|t| trial(t, true)))
        .collect();
    libtest_mimic::run(&args, trials).exit_code()
}

/// `fn main` of a GPU test target: its tests and its child tests, by function name.
#[macro_export]
macro_rules! gpu_main {
    (tests: [$($test:ident),* $(,)?] $(, children: [$($child:ident),* $(,)?])? $(,)?) => {
        fn main() -> ::std::process::ExitCode {
            $crate::run(
                &[$((stringify!($test), $test as fn())),*],
                &[$($((stringify!($child), $child as fn())),*)?],
            )
        }
    };
}
