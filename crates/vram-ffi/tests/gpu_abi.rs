//! libvram.so's allocator on a real GPU: a daemon on the cuda backend (in process, the one
//! starter's thread mode), allocations
//! from several threads on two streams, bytes written and read on the device, everything back with
//! the daemon after a trim. Reported as ignored where the driver finds no GPU (`vram_testing`'s
//! runner), unless `VRAMD_REQUIRE_GPU=1`.

use std::ffi::c_void;
use std::sync::Arc;

use vram_core::Bytes;
use vram_device::cuda::CudaDevice;
use vram_device::{ByteAccess, Device};
use vramd::config::Config;
use vramd::own_daemon::OwnDaemon;

mod common;

/// The GPU to test on, or `None` (after saying why) where there is none.
fn gpu() -> Option<CudaDevice> {
    vram_testing::gpu_or_skip("0")
}

/// The per-thread default stream's handle (`CU_STREAM_PER_THREAD`): a valid stream without setup.
const PER_THREAD_STREAM: usize = 2;

fn threads_allocate_write_and_free_on_the_gpu() {
    let Some(dev) = gpu() else { return };
    let dev = Arc::new(dev);
    // The tenant's backing holds its device as a `Device` (handles only); the bytes are copied
    // through this one, the same GPU's.
    let copier = dev.clone();
    let own = OwnDaemon::in_process(
        tempfile::tempdir().unwrap(),
        vec![dev as Arc<dyn Device>],
        &Config::default(),
    )
    .unwrap();
    let socket = own.socket().to_path_buf();
    std::env::set_var("VRAMD_SOCKET", &socket);
    std::env::set_var("VRAMD_TENANT", "gpu-abi");

    std::thread::scope(|s| {
        for t in 0..4usize {
            let copier = copier.clone();
            s.spawn(move || {
                let stream = if t % 2 == 0 { 0 } else { PER_THREAD_STREAM } as *mut c_void;
                let tenant = vram::tenant().expect("tenant");
                for i in 0..200usize {
                    let size = 1
                        + (i * 7919 + t * 104_729) % (if i % 10 == 0 { 64 << 20 } else { 1 << 20 });
                    let p = vram::vram_alloc(size as isize, 0, stream);
                    assert!(!p.is_null(), "{:?}", vram::last_error());
                    let data = vec![(i ^ t) as u8; size.min(4096)];
                    tenant.alloc.with_backing(|b| {
                        let off = Bytes(p as u64 - b.base());
                        copier.write(b.reservation(), off, &data).unwrap();
                        let mut back = vec![0; data.len()];
                        copier.read(b.reservation(), off, &mut back).unwrap();
                        assert_eq!(back, data, "bytes at {p:?}");
                    });
                    vram::vram_free(p, size as isize, 0, stream);
                }
            });
        }
    });
    assert!(vram::vram_trim() >= 0, "{:?}", vram::last_error());
    let tenant = vram::tenant().unwrap();
    let stats = tenant.alloc.stats();
    println!("MEASURED gpu abi stats: {stats:?}");
    assert_eq!(stats.core.held, Bytes::ZERO, "trim left memory held");
    // SAFETY: NULL asks the daemon at VRAMD_SOCKET.
    let status = common::take_json(unsafe { vram::vram_status_json(std::ptr::null()) });
    let held: u64 = status["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["held"].as_u64().unwrap())
        .sum();
    assert_eq!(
        held, 0,
        "the daemon still counts memory for the tenant: {status}"
    );
    own.stop().unwrap();
}

vram_testing::gpu_main! {
    tests: [
        threads_allocate_write_and_free_on_the_gpu,
    ],
}
