//! The shared-buffer checksum computed on the GPU (`Device::checksum` on the cuda backend, a PTX
//! kernel) against the same function on the host (`vram_core::shared::checksum`). Where the driver
//! finds no GPU every test is reported as ignored (`vram_testing`'s runner), unless
//! `VRAMD_REQUIRE_GPU=1` is set, in which case a missing GPU fails them. `VRAMD_TEST_GPU` picks
//! the GPU (ordinal or UUID; default 0).
//!
//! `cargo test --release -p vram-device --test gpu_checksum -- --nocapture --test-threads=1`;
//! grep the output for `MEASURED`.

use std::time::Instant;

use vram_core::shared::checksum::{checksum, mix64};
use vram_core::shared::Checksummer;
use vram_core::Bytes;
use vram_device::cuda::CudaDevice;
use vram_device::{Access, ByteAccess, Device, Reservation};

/// The GPU to test on, or `None` (after saying why) where there is none.
fn gpu() -> Option<CudaDevice> {
    vram_testing::gpu_or_skip(&std::env::var("VRAMD_TEST_GPU").unwrap_or_else(|_| "0".to_owned()))
}

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Pseudo-random bytes (SplitMix64), reproducible from `seed`.
fn random(len: usize, seed: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(len.div_ceil(8) * 8);
    let mut x = seed;
    while out.len() < len {
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        out.extend_from_slice(&mix64(x).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// `size` bytes of GPU memory mapped read-write, holding a copy of `data` (written in pieces).
fn on_gpu(dev: &CudaDevice, data: &[u8]) -> (vram_device::Handle, Reservation) {
    let g = dev.info().granularity.get();
    let size = Bytes((data.len() as u64).div_ceil(g) * g);
    let h = dev.create(size).unwrap();
    let r = dev.reserve(size).unwrap();
    dev.map(&r, Bytes::ZERO, &h, Access::ReadWrite).unwrap();
    for (i, piece) in data.chunks(256 << 20).enumerate() {
        dev.write(&r, Bytes(i as u64 * (256 << 20)), piece).unwrap();
    }
    (h, r)
}

/// Compares the GPU's checksum of `data[offset..offset+len]` (at `r + offset`) with the host's;
/// on a mismatch, finds the first 1 MiB piece whose checksums differ and prints both values.
fn compare(dev: &CudaDevice, r: &Reservation, data: &[u8], offset: u64, len: u64) -> bool {
    let bytes = &data[offset as usize..(offset + len) as usize];
    let started = Instant::now();
    let on_gpu = dev.checksum(r, Bytes(offset), Bytes(len)).unwrap();
    let gpu_time = started.elapsed();
    let on_host = checksum(bytes);
    if on_gpu == on_host {
        println!("ok: offset {offset}, length {len}: {on_gpu:016x} (GPU {gpu_time:.2?})");
        return true;
    }
    println!(
        "MISMATCH: offset {offset}, length {len}: GPU {on_gpu:016x}, host {on_host:016x}; \
         looking for the first differing 1 MiB piece"
    );
    for (k, piece) in bytes.chunks(MIB as usize).enumerate() {
        let at = offset + k as u64 * MIB;
        let g = dev
            .checksum(r, Bytes(at), Bytes(piece.len() as u64))
            .unwrap();
        let h = checksum(piece);
        if g != h {
            println!(
                "  first differing piece: {k} (offset {at}, {} bytes): GPU {g:016x}, host {h:016x}; \
                 its first words: {:02x?}",
                piece.len(),
                &piece[..piece.len().min(32)]
            );
            break;
        }
    }
    false
}

fn gpu_checksum_equals_the_host_checksum() {
    let Some(dev) = gpu() else { return };
    println!("device: {:?}", dev.info());
    let total = 3 * GIB + 64 * MIB;
    let started = Instant::now();
    let data = random(total as usize, 42);
    let (_h, r) = on_gpu(&dev, &data);
    println!(
        "{} of random data on the GPU in {:.2?}",
        Bytes(total),
        started.elapsed()
    );
    let cases: &[(u64, u64)] = &[
        (0, 0),
        (0, 1),
        (0, 7),
        (0, 8),
        (0, 9),
        (8, 15),
        (16, 4093),
        (24, 8 * 256 * 2 + 8),
        (3, 1000), // unaligned offset: read to the host
        (4096, MIB + 3),
        (2 * MIB, 64 * MIB + 5),
        (0, GIB),
        (8, 3 * GIB + 7), // multi-GiB, not a multiple of 8
        (0, total),
    ];
    let mut failed = Vec::new();
    for &(offset, len) in cases {
        if !compare(&dev, &r, &data, offset, len) {
            failed.push((offset, len));
        }
    }
    assert!(failed.is_empty(), "GPU and host disagree on {failed:?}");

    // In pieces, as the daemon's scrub feeds it: equal to the whole.
    let mut sum = Checksummer::new();
    let len = 100 * MIB + 13;
    let mut at = 0;
    while at < len {
        let n = (len - at).min(8 * MIB);
        dev.feed_checksum(&r, Bytes(at), Bytes(n), &mut sum)
            .unwrap();
        at += n;
    }
    assert_eq!(
        sum.finish(),
        checksum(&data[..len as usize]),
        "8 MiB pieces on the GPU differ from the whole on the host"
    );
}

fn a_flipped_byte_changes_the_gpu_checksum() {
    let Some(dev) = gpu() else { return };
    let len = 256 * MIB + 5;
    let mut data = random(len as usize, 7);
    let (_h, r) = on_gpu(&dev, &data);
    let before = dev.checksum(&r, Bytes::ZERO, Bytes(len)).unwrap();
    assert_eq!(
        before,
        checksum(&data),
        "GPU and host differ before the flip"
    );
    for at in [0u64, 1, 12_345_677, len - 1] {
        data[at as usize] ^= 0x10;
        dev.write(&r, Bytes(at), &data[at as usize..at as usize + 1])
            .unwrap();
        let after = dev.checksum(&r, Bytes::ZERO, Bytes(len)).unwrap();
        assert_ne!(after, before, "a byte flipped at {at} went unnoticed");
        assert_eq!(
            after,
            checksum(&data),
            "GPU and host differ after a flip at {at}"
        );
        data[at as usize] ^= 0x10;
        dev.write(&r, Bytes(at), &data[at as usize..at as usize + 1])
            .unwrap();
        assert_eq!(dev.checksum(&r, Bytes::ZERO, Bytes(len)).unwrap(), before);
    }
}

fn gpu_checksum_throughput() {
    let Some(dev) = gpu() else { return };
    let len = GIB;
    let data = random(len as usize, 9);
    let (_h, r) = on_gpu(&dev, &data);
    let started = Instant::now();
    let first = dev.checksum(&r, Bytes::ZERO, Bytes(len)).unwrap();
    println!(
        "first call (loads and JIT-compiles the kernel): {:.2?}",
        started.elapsed()
    );
    let mut times = Vec::new();
    for _ in 0..20 {
        let t = Instant::now();
        assert_eq!(dev.checksum(&r, Bytes::ZERO, Bytes(len)).unwrap(), first);
        times.push(t.elapsed());
    }
    times.sort();
    let median = times[times.len() / 2];
    let started = Instant::now();
    let host = checksum(&data);
    let host_time = started.elapsed();
    assert_eq!(first, host, "GPU and host differ");
    println!(
        "MEASURED gpu checksum throughput: {:.1} GiB/s (1 GiB, median {median:.2?} of 20, best {:.2?}); \
         host, one thread: {:.1} GiB/s",
        len as f64 / GIB as f64 / median.as_secs_f64(),
        times[0],
        len as f64 / GIB as f64 / host_time.as_secs_f64(),
    );
    let mut small = Vec::new();
    for _ in 0..20 {
        let t = Instant::now();
        dev.checksum(&r, Bytes::ZERO, Bytes(8 * MIB)).unwrap();
        small.push(t.elapsed());
    }
    small.sort();
    println!(
        "MEASURED gpu checksum of 8 MiB (a scrub piece): median {:.2?}",
        small[small.len() / 2]
    );
}

vram_testing::gpu_main! {
    tests: [
        gpu_checksum_equals_the_host_checksum,
        a_flipped_byte_changes_the_gpu_checksum,
        gpu_checksum_throughput,
    ],
}
