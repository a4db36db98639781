//! The CUDA backend on a real GPU. Where the driver finds no GPU every test is reported as
//! ignored (`vram_testing`'s runner says why), and one that finds no usable GPU skips saying why,
//! unless `VRAMD_REQUIRE_GPU=1` is set, in which case a missing GPU fails them. `VRAMD_TEST_GPU`
//! picks the GPU (ordinal or UUID; default 0).
//!
//! Two tests are experiments whose findings are printed (grep the output for `FINDING`), with no
//! assertion about the driver: whether new memory shows a previous owner's bytes (freshness), and
//! which calls work without a current context.

mod common;

use std::os::fd::AsFd;

use common::{child_role, env_u64, inherited_fd, pattern, run_child};
use cudarc::driver::sys::{self, CUresult};
use vram_core::Bytes;
use vram_device::cuda::{self, CudaDevice};
use vram_device::{Access, ByteAccess, Device, DeviceError};

/// The GPU to test on, or `None` (after saying why) where there is none.
fn gpu() -> Option<CudaDevice> {
    vram_testing::gpu_or_skip(&std::env::var("VRAMD_TEST_GPU").unwrap_or_else(|_| "0".to_owned()))
}

/// Environment that tells a child which GPU and handle size to use.
fn child_env(dev: &CudaDevice, size: Bytes) -> [(&'static str, String); 2] {
    [
        ("VRAMD_TEST_GPU", dev.info().uuid.clone()),
        ("VRAMD_TEST_SIZE", size.get().to_string()),
    ]
}

const MIB: usize = 1 << 20;

fn map_write_read_unmap() {
    let Some(dev) = gpu() else { return };
    let g = dev.info().granularity;
    println!("device: {:?}", dev.info());
    let a = dev.create(g).unwrap();
    let b = dev.create(Bytes(2 * g.get())).unwrap();
    assert_eq!(dev.used(), Bytes(3 * g.get()));
    let r = dev.reserve(Bytes(4 * g.get())).unwrap();
    dev.map(&r, Bytes::ZERO, &a, Access::ReadWrite).unwrap();
    dev.map(&r, g, &b, Access::ReadWrite).unwrap();
    // Two handles stitched into one range: a copy may cross the boundary.
    let data = pattern(7, 3 * MIB);
    let at = Bytes(g.get() - MIB as u64);
    dev.write(&r, at, &data).unwrap();
    let mut out = vec![0; data.len()];
    dev.read(&r, at, &mut out).unwrap();
    assert_eq!(out, data);
    dev.fill(&r, Bytes(5), Bytes(3), 0xEE).unwrap();
    let mut out = [0; 5];
    dev.read(&r, Bytes(4), &mut out).unwrap();
    assert_eq!(&out[1..4], &[0xEE; 3]);

    assert!(matches!(
        dev.unmap(&r, Bytes::ZERO, Bytes(2 * g.get())),
        Err(DeviceError::SplitsMapping { .. })
    ));
    dev.unmap(&r, Bytes::ZERO, g).unwrap();
    assert!(matches!(
        dev.read(&r, Bytes::ZERO, &mut [0; 1]),
        Err(DeviceError::NotMapped { .. })
    ));
    drop(a);
    drop(b);
    assert_eq!(dev.used(), Bytes::ZERO);
    // `b` is still mapped: the memory lives on until the mapping goes with the reservation.
    let mut out = vec![0; MIB];
    dev.read(&r, g, &mut out).unwrap();
    assert_eq!(out, data[MIB..2 * MIB]);
    drop(r);
    println!("memory (free, total): {:?}", dev.memory().unwrap());
}

fn export_import_across_processes() {
    let Some(dev) = gpu() else { return };
    let size = Bytes(4 * dev.info().granularity.get());
    let h = dev.create(size).unwrap();
    let r = dev.reserve(size).unwrap();
    dev.map(&r, Bytes::ZERO, &h, Access::ReadWrite).unwrap();
    dev.write(&r, Bytes::ZERO, &pattern(1, 2 * MIB)).unwrap();

    let started = std::time::Instant::now();
    let fd = dev.export(&h).unwrap();
    println!("first export took {:?}", started.elapsed());
    let started = std::time::Instant::now();
    drop(dev.export(&h).unwrap());
    println!("second export (a duplicate) took {:?}", started.elapsed());

    let out = run_child(
        "child",
        "import-check-write",
        fd.as_fd(),
        &child_env(&dev, size),
    );
    assert!(out.status.success(), "child failed: {:?}", out.status);
    let mut seen = vec![0; 2 * MIB];
    dev.read(&r, Bytes(2 * MIB as u64), &mut seen).unwrap();
    assert_eq!(
        seen,
        pattern(2, 2 * MIB),
        "the child's GPU writes are visible here"
    );
}

fn read_only_mapping_refuses_writes() {
    let Some(dev) = gpu() else { return };
    let size = dev.info().granularity;
    let h = dev.create(size).unwrap();
    let r = dev.reserve(size).unwrap();
    dev.map(&r, Bytes::ZERO, &h, Access::ReadWrite).unwrap();
    dev.write(&r, Bytes::ZERO, &pattern(3, MIB)).unwrap();

    // Through the API: refused before the driver is asked.
    let ro = dev.reserve(size).unwrap();
    dev.map(&ro, Bytes::ZERO, &h, Access::ReadOnly).unwrap();
    assert!(matches!(
        dev.write(&ro, Bytes::ZERO, b"x"),
        Err(DeviceError::ReadOnly { .. })
    ));
    let mut seen = vec![0; MIB];
    dev.read(&ro, Bytes::ZERO, &mut seen).unwrap();
    assert_eq!(seen, pattern(3, MIB));

    // Past the API, straight to the driver, in a child (a faulting write may spoil its context).
    for method in ["memset", "htod"] {
        let mut env = child_env(&dev, size).to_vec();
        env.push(("VRAMD_TEST_METHOD", method.to_owned()));
        let fd = dev.export(&h).unwrap();
        let out = run_child("child", "raw-write-read-only", fd.as_fd(), &env);
        let stdout = String::from_utf8_lossy(&out.stdout);
        println!("FINDING read-only via {method}: child {:?}", out.status);
        dev.read(&r, Bytes::ZERO, &mut seen).unwrap();
        assert_eq!(
            seen,
            pattern(3, MIB),
            "a {method} through a read-only mapping changed memory"
        );
        assert!(
            stdout.contains("REFUSED"),
            "the driver accepted a {method} through a read-only mapping"
        );
    }
}

/// Whether memory that one process filled and gave up can be seen in memory created afterwards.
/// vramd's daemon creates every handle, so "afterwards" means: in the daemon, after a tenant's
/// handle was released.
fn freshness_experiment() {
    let Some(dev) = gpu() else { return };
    let size = Bytes::gib(1).round_up(dev.info().granularity).unwrap();

    // A tenant (child) fills a daemon-created handle; the daemon then releases it.
    let h = dev.create(size).unwrap();
    let fd = dev.export(&h).unwrap();
    let out = run_child("child", "fill-magic", fd.as_fd(), &child_env(&dev, size));
    assert!(out.status.success(), "child failed: {:?}", out.status);
    drop(fd);
    drop(h);
    for i in 0..4 {
        let (hits, nonzero, words) = scan_new_handle(&dev, size, MAGIC_CHILD);
        println!(
            "FINDING freshness, another process's memory: new handle {i}: {hits} of {words} words \
             hold its pattern, {nonzero} words are not zero"
        );
    }

    // Control: the same process fills, releases and creates again.
    let h = dev.create(size).unwrap();
    let r = dev.reserve(size).unwrap();
    dev.map(&r, Bytes::ZERO, &h, Access::ReadWrite).unwrap();
    fill_magic(&dev, &r, size, MAGIC_SELF);
    drop(r);
    drop(h);
    let (hits, nonzero, words) = scan_new_handle(&dev, size, MAGIC_SELF);
    println!(
        "FINDING freshness, this process's own released memory: {hits} of {words} words hold its \
         pattern, {nonzero} words are not zero"
    );
}

const MAGIC_CHILD: u64 = 0x5652_414d_4446_5231; // "VRAMDFR1"
const MAGIC_SELF: u64 = 0x5652_414d_4446_5232;
const CHUNK: usize = 64 * MIB;

fn fill_magic(dev: &CudaDevice, r: &vram_device::Reservation, size: Bytes, magic: u64) {
    let chunk: Vec<u8> = std::iter::repeat_n(magic.to_ne_bytes(), CHUNK / 8)
        .flatten()
        .collect();
    for at in (0..size.get()).step_by(CHUNK) {
        let len = CHUNK.min((size.get() - at) as usize);
        dev.write(r, Bytes(at), &chunk[..len]).unwrap();
    }
}

/// Creates a handle, maps it and counts the words equal to `magic`, the non-zero words, and all.
fn scan_new_handle(dev: &CudaDevice, size: Bytes, magic: u64) -> (u64, u64, u64) {
    let h = dev.create(size).unwrap();
    let r = dev.reserve(size).unwrap();
    dev.map(&r, Bytes::ZERO, &h, Access::ReadOnly).unwrap();
    let (mut hits, mut nonzero) = (0, 0);
    let mut buf = vec![0u8; CHUNK];
    for at in (0..size.get()).step_by(CHUNK) {
        let len = CHUNK.min((size.get() - at) as usize);
        dev.read(&r, Bytes(at), &mut buf[..len]).unwrap();
        for w in buf[..len].chunks_exact(8) {
            let w = u64::from_ne_bytes(w.try_into().unwrap());
            hits += u64::from(w == magic);
            nonzero += u64::from(w != 0);
        }
    }
    (hits, nonzero, size.get() / 8)
}

/// Which driver calls work in a fresh process with no current context (the backend always pushes
/// the primary context; this records whether it has to).
fn context_experiment() {
    let Some(dev) = gpu() else { return };
    let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
    let out = run_child(
        "child",
        "no-context",
        a.as_fd(),
        &child_env(&dev, dev.info().granularity),
    );
    assert!(out.status.success(), "child failed: {:?}", out.status);
}

/// The child side of the tests above; does nothing unless started by one of them.
fn child() {
    let Some(role) = child_role() else { return };
    let size = Bytes(env_u64("VRAMD_TEST_SIZE"));
    if role == "no-context" {
        return no_context(size);
    }
    let dev = gpu().expect("the parent found a GPU");
    let h = dev.import(inherited_fd(), size).unwrap();
    let r = dev.reserve(size).unwrap();
    match role.as_str() {
        "import-check-write" => {
            dev.map(&r, Bytes::ZERO, &h, Access::ReadWrite).unwrap();
            let mut seen = vec![0; 2 * MIB];
            dev.read(&r, Bytes::ZERO, &mut seen).unwrap();
            assert_eq!(
                seen,
                pattern(1, 2 * MIB),
                "the parent's GPU writes are visible here"
            );
            dev.write(&r, Bytes(2 * MIB as u64), &pattern(2, 2 * MIB))
                .unwrap();
        }
        "fill-magic" => {
            dev.map(&r, Bytes::ZERO, &h, Access::ReadWrite).unwrap();
            fill_magic(&dev, &r, size, MAGIC_CHILD);
        }
        "raw-write-read-only" => {
            dev.map(&r, Bytes::ZERO, &h, Access::ReadOnly).unwrap();
            let method = std::env::var("VRAMD_TEST_METHOD").unwrap();
            let results = raw_write(&dev, r.base() as u64, &method);
            println!("{method}: {results:?}");
            if results.iter().any(|(_, r)| *r != CUresult::CUDA_SUCCESS) {
                println!("REFUSED");
            }
        }
        other => panic!("unknown child role {other}"),
    }
}

/// Writes to `ptr` with the driver directly, bypassing the API's checks; returns each call's
/// result.
fn raw_write(dev: &CudaDevice, ptr: u64, method: &str) -> Vec<(&'static str, CUresult)> {
    let devices = cuda::probe().unwrap();
    let ordinal = devices
        .iter()
        .position(|d| d.uuid == dev.info().uuid)
        .unwrap() as i32;
    let mut results = Vec::new();
    let (mut device, mut ctx) = (0, std::ptr::null_mut());
    // SAFETY: the driver is loaded (the device opened); out pointers are valid. Retaining the
    // primary context the device already holds, and making it current on this test thread.
    unsafe {
        results.push(("cuDeviceGet", sys::cuDeviceGet(&mut device, ordinal)));
        results.push((
            "cuDevicePrimaryCtxRetain",
            sys::cuDevicePrimaryCtxRetain(&mut ctx, device),
        ));
        results.push(("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctx)));
    }
    let data = vec![0xFFu8; MIB];
    // SAFETY: not sound on purpose for the GPU (the range is mapped read-only, and the point is to
    // see the driver refuse); the host side passes a live buffer of the given length.
    unsafe {
        match method {
            "memset" => results.push(("cuMemsetD8", sys::cuMemsetD8_v2(ptr, 0xFF, MIB))),
            _ => results.push((
                "cuMemcpyHtoD",
                sys::cuMemcpyHtoD_v2(ptr, data.as_ptr().cast(), data.len()),
            )),
        }
        results.push(("cuCtxSynchronize", sys::cuCtxSynchronize()));
    }
    results
}

/// In a process that has made no context: which VMM calls succeed?
fn no_context(size: Bytes) {
    let found = cuda::probe();
    println!(
        "FINDING no context: cuInit + device queries + cuMemGetAllocationGranularity: {}",
        match &found {
            Ok(_) => "ok".to_owned(),
            Err(e) => e.to_string(),
        }
    );
    let uuid = std::env::var("VRAMD_TEST_GPU").unwrap();
    let ordinal = found.unwrap().iter().position(|d| d.uuid == uuid).unwrap() as i32;
    let mut current = std::ptr::null_mut();
    let mut device = 0;
    let mut handle = 0;
    let mut va = 0;
    let mut fd: std::ffi::c_int = -1;
    let prop = sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes:
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ordinal,
        },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    };
    // SAFETY: the driver is loaded (probe succeeded); every pointer is a valid out pointer or
    // the property struct above; each object made is released at the end.
    let results = unsafe {
        let get = sys::cuCtxGetCurrent(&mut current);
        println!("current context before: {current:?} ({get:?})");
        sys::cuDeviceGet(&mut device, ordinal);
        let create = sys::cuMemCreate(&mut handle, size.get() as usize, &prop, 0);
        let export = if create == CUresult::CUDA_SUCCESS {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut std::ffi::c_int).cast(),
                handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        } else {
            create
        };
        let reserve = sys::cuMemAddressReserve(&mut va, size.get() as usize, 0, 0, 0);
        let map = if create == CUresult::CUDA_SUCCESS && reserve == CUresult::CUDA_SUCCESS {
            sys::cuMemMap(va, size.get() as usize, 0, handle, 0)
        } else {
            create
        };
        let unmap = sys::cuMemUnmap(va, size.get() as usize);
        let free = sys::cuMemAddressFree(va, size.get() as usize);
        let release = sys::cuMemRelease(handle);
        sys::cuCtxGetCurrent(&mut current);
        [
            ("cuMemCreate", create),
            ("cuMemExportToShareableHandle", export),
            ("cuMemAddressReserve", reserve),
            ("cuMemMap", map),
            ("cuMemUnmap", unmap),
            ("cuMemAddressFree", free),
            ("cuMemRelease", release),
        ]
    };
    for (call, r) in results {
        println!("FINDING no context: {call}: {r:?}");
    }
    println!("current context after: {current:?}; exported fd {fd}");
}

fn events_complete_and_recycle() {
    let Some(dev) = gpu() else { return };
    let pool = vram_device::cuda::EventPool::new(&dev);
    assert!(!pool
        .is_capturing(vram_device::cuda::DEFAULT_STREAM)
        .unwrap());
    let mut ids = Vec::new();
    for _ in 0..100 {
        ids.push(pool.record(vram_device::cuda::DEFAULT_STREAM).unwrap());
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !ids.iter().all(|id| pool.is_complete(*id)) {
        assert!(
            std::time::Instant::now() < deadline,
            "events never completed"
        );
    }
    // Recycled: a new record reuses a slot with a new generation; old ids stay complete.
    let again = pool.record(vram_device::cuda::DEFAULT_STREAM).unwrap();
    assert!(!ids.contains(&again));
    assert!(pool.is_complete(ids[0]));
    // A wait returns once the device has passed the event, well within its bound, and a
    // completed (recycled) fence needs no wait.
    let limit = std::time::Duration::from_secs(5);
    let started = std::time::Instant::now();
    assert!(pool.wait(again, limit), "an idle stream's event completes");
    assert!(started.elapsed() < limit);
    assert!(pool.wait(ids[0], std::time::Duration::ZERO));
}

vram_testing::gpu_main! {
    tests: [
        map_write_read_unmap,
        export_import_across_processes,
        read_only_mapping_refuses_writes,
        freshness_experiment,
        context_experiment,
        events_complete_and_recycle,
    ],
    children: [child],
}
