//! What PyTorch's integration (`vramd_torch`) reads through the C ABI: the snapshot of segments and
//! blocks, the peak reset, and the count of reclaim requests and the wait for one.

use std::ffi::CString;

use vram_core::Bytes;

mod common;

#[test]
fn snapshot_lists_live_blocks_and_peaks_reset() {
    let daemon = common::Daemon::start(Bytes::gib(16));
    let (socket, name) = (
        CString::new(daemon.socket.to_str().unwrap()).unwrap(),
        CString::new("torch-abi").unwrap(),
    );
    let opts = vram::VramOptions {
        socket: socket.as_ptr(),
        tenant: name.as_ptr(),
        ..Default::default()
    };
    // SAFETY: a whole `VramOptions` of its own size; its strings live past the call.
    let init = unsafe { vram::vram_init(&opts) };
    assert_eq!(init, 0, "{:?}", vram::last_error());
    let stream = std::ptr::null_mut();
    let big = vram::vram_alloc(8 << 20, 0, stream);
    let small = vram::vram_alloc(4096, 0, stream);
    assert!(
        !big.is_null() && !small.is_null(),
        "{:?}",
        vram::last_error()
    );

    let snap = common::take_json(vram::vram_snapshot_json());
    let blocks: Vec<&serde_json::Value> = snap["segments"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["blocks"].as_array().unwrap())
        .collect();
    let find = |p: *mut std::ffi::c_void| {
        blocks
            .iter()
            .find(|b| b["address"].as_u64() == Some(p as u64))
            .copied()
    };
    let b = find(big).expect("the large block is in the snapshot");
    assert_eq!(b["state"], "allocated");
    assert_eq!(b["requested_size"], 8 << 20);
    assert!(find(small).is_some());
    for s in snap["segments"].as_array().unwrap() {
        let sum: u64 = s["blocks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["size"].as_u64().unwrap())
            .sum();
        assert_eq!(Some(sum), s["size"].as_u64(), "blocks tile the segment");
    }

    vram::vram_free(big, 0, 0, stream);
    let core = |v: &serde_json::Value, k: &str| v["stats"]["core"][k].as_u64().unwrap();
    let before = common::take_json(vram::vram_stats_json());
    assert!(core(&before, "allocated_peak") > core(&before, "allocated"));
    assert_eq!(vram::vram_reset_peak(), 0);
    let after = common::take_json(vram::vram_stats_json());
    assert_eq!(core(&after, "allocated_peak"), core(&after, "allocated"));
    assert_eq!(vram::vram_reclaim_requests(), 0);
    // Waiting for a request: at once when the count is not the one seen, else until the timeout.
    let t = std::time::Instant::now();
    assert_eq!(vram::vram_wait_reclaim(7, 10_000), 0);
    assert!(t.elapsed() < std::time::Duration::from_secs(5));
    assert_eq!(vram::vram_wait_reclaim(0, 30), 0);
    assert!(t.elapsed() >= std::time::Duration::from_millis(30));
    vram::vram_free(small, 0, 0, stream);
}
