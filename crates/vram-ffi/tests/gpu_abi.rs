//! libvram.so's allocator on a real GPU: a daemon on the cuda backend (in process, the one
//! starter's thread mode), allocations from several threads on two streams, bytes written and
//! read on the device, everything back with the daemon after a trim, a block freed behind work
//! still queued on its stream included. Reported as ignored where the driver finds no GPU
//! (`vram_testing`'s runner), unless `VRAMD_REQUIRE_GPU=1`.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys::{self, CUresult};
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
    // A block freed behind queued work: the trim waits for it, and the block goes back too.
    let queued = free_behind_queued_work(&copier);
    let started = std::time::Instant::now();
    assert!(vram::vram_trim() >= 0, "{:?}", vram::last_error());
    println!(
        "MEASURED trim after a free behind queued work: {:?}",
        started.elapsed()
    );
    assert!(
        queued,
        "the queued work was done before the free: nothing to wait for"
    );
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

/// Allocates 64 MiB on the per-thread stream, queues 4,000 fills of it there (250 GiB of writes:
/// tens of milliseconds at a Hopper card's bandwidth, far longer than queueing them takes) and
/// frees it on that stream while they run, as a program frees a tensor its queued kernels still
/// write. A trim right after must wait for that work (the stream's fence) to give the block's
/// memory back. Returns whether the work was still running after the free (if not, the trim had
/// nothing to wait for).
fn free_behind_queued_work(dev: &CudaDevice) -> bool {
    const SIZE: usize = 64 << 20;
    let stream = PER_THREAD_STREAM as *mut c_void;
    let p = vram::vram_alloc(SIZE as isize, 0, stream);
    assert!(!p.is_null(), "{:?}", vram::last_error());
    let ordinal = vram_device::cuda::probe()
        .unwrap()
        .iter()
        .position(|d| d.uuid == dev.info().uuid)
        .unwrap() as i32;
    let (mut device, mut ctx) = (0, std::ptr::null_mut());
    // SAFETY: the driver is loaded (the device is open); the out pointers are valid. The device
    // already holds its primary context: retained once more and made current on this thread for
    // the fills below.
    unsafe {
        assert_eq!(
            sys::cuDeviceGet(&mut device, ordinal),
            CUresult::CUDA_SUCCESS
        );
        assert_eq!(
            sys::cuDevicePrimaryCtxRetain(&mut ctx, device),
            CUresult::CUDA_SUCCESS
        );
        assert_eq!(sys::cuCtxSetCurrent(ctx), CUresult::CUDA_SUCCESS);
    }
    for i in 0..4000u32 {
        // SAFETY: `p` is a live 64 MiB block of this context, mapped read-write; the per-thread
        // stream is valid in any context.
        let r = unsafe { sys::cuMemsetD8Async(p as u64, i as u8, SIZE, stream as sys::CUstream) };
        assert_eq!(r, CUresult::CUDA_SUCCESS, "fill {i}");
    }
    vram::vram_free(p, SIZE as isize, 0, stream);
    // SAFETY: the stream is valid (above); the query takes no pointers.
    let r = unsafe { sys::cuStreamQuery(stream as sys::CUstream) };
    r == CUresult::CUDA_ERROR_NOT_READY
}

vram_testing::gpu_main! {
    tests: [
        threads_allocate_write_and_free_on_the_gpu,
    ],
}
