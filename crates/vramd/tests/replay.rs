//! `vramd replay` as a user runs it: a snapshot written by Python's pickle (as PyTorch writes
//! them), replayed with handles created in process and with handles from a daemon the command
//! starts; a file that is not a snapshot is a clear error.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

mod common;

use common::VRAMD;

/// A snapshot of `n` rounds of allocations of assorted sizes on two streams, freed in another
/// order, gzipped; written with Python's own pickle and gzip.
fn write_snapshot(path: &Path, n: usize) {
    write_snapshot_spaced(path, n, 1);
}

/// The same, with the events `us` times as far apart (3 µs between allocations, 5 between frees,
/// times `us`).
fn write_snapshot_spaced(path: &Path, n: usize, us: u64) {
    let script = r#"
import gzip, pickle, sys
ev, t, live = [], 0, []
for i in range(int(sys.argv[2])):
    for j, size in enumerate([512, 3 << 20, (12 << 20) + 4096 * i, 70 << 20, 100]):
        addr = (i * 16 + j + 1) << 30
        t += 3 * int(sys.argv[3])
        ev.append({"action": "alloc", "addr": addr, "size": size, "stream": j % 2, "time_us": t})
        live.append((addr, j % 2))
    while len(live) > 3:
        addr, s = live.pop(1)
        t += 5 * int(sys.argv[3])
        ev.append({"action": "free_requested", "addr": addr, "size": 0, "stream": s, "time_us": t})
        ev.append({"action": "free_completed", "addr": addr, "size": 0, "stream": s, "time_us": t})
with gzip.open(sys.argv[1], "wb") as f:
    pickle.dump({"segments": [], "device_traces": [ev], "allocator_settings": {}}, f)
"#;
    let st = Command::new("python3")
        .args([
            "-c",
            script,
            path.to_str().unwrap(),
            &n.to_string(),
            &us.to_string(),
        ])
        .status()
        .expect("python3 runs");
    assert!(st.success());
}

fn replay_json(args: &[&str]) -> Vec<Value> {
    common::vramd_stdout(&[&["replay", "--json"], args].concat())
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Runs `vramd replay ARGS...` (with `TMPDIR` set to `tmp`, if given), which must fail with a
/// message containing `expected`.
fn replay_fails<S: AsRef<std::ffi::OsStr>>(args: &[S], tmp: Option<&Path>, expected: &str) {
    let mut cmd = Command::new(VRAMD);
    cmd.arg("replay").args(args);
    if let Some(tmp) = tmp {
        cmd.env("TMPDIR", tmp);
    }
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "succeeded; stderr: {err}");
    assert!(err.contains(expected), "{err}");
}

/// A replay through a daemon accounts for every grant's handle: ready in the pool, given back
/// earlier, or made on the grant's path.
fn assert_every_grant_was_a_pool_take(o: &Value) {
    let takes = &o["pool_takes"];
    let sum: u64 = ["hits", "recycled", "misses"]
        .iter()
        .map(|k| takes[k].as_u64().unwrap())
        .sum();
    assert_eq!(sum, o["grants"].as_u64().unwrap(), "{takes}");
}

#[test]
fn a_replay_through_a_daemon_gives_the_same_figures_and_times_the_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("small.pickle.gz");
    write_snapshot(&trace, 40);
    let local = replay_json(&[trace.to_str().unwrap()]);
    let through = replay_json(&["--through-daemon", trace.to_str().unwrap()]);
    assert_eq!((local.len(), through.len()), (1, 1));
    let (a, b) = (&local[0], &through[0]);
    for key in [
        "trace",
        "peak_requested",
        "peak_held",
        "fragmentation",
        "maps",
        "unmaps",
        "grants",
        "modelled_driver_time_share",
        "held_at_peak",
    ] {
        assert!(a.get(key).is_some(), "{key} missing");
        assert_eq!(a[key], b[key], "{key} differs through the daemon");
    }
    assert!(a["peak_requested"].as_u64().unwrap() > 70 << 20);
    // The memory held at its peak, by where it lay, adds up to the peak.
    let p = &a["held_at_peak"];
    let part = |v: &Value, k: &str| v[k].as_u64().unwrap();
    let parts = part(p, "requested")
        + part(p, "allocated_beyond_requested")
        + ["whole_handles", "partly_used_handles", "small_heap"]
            .iter()
            .map(|k| part(&p["free"], k))
            .sum::<u64>();
    assert_eq!(parts, part(p, "held"), "{p}");
    assert_eq!(p["held"], a["peak_held"], "{p}");
    assert!(a["grants"].as_u64().unwrap() > 0);
    for o in [a, b] {
        let calls = o["measured_driver_us"].as_f64().unwrap();
        let all = o["measured_allocator_us"].as_f64().unwrap();
        assert!(calls > 0.0 && calls <= all, "calls {calls} µs of {all} µs");
        // The same time by kind of call, and one take's spread.
        let by_kind: f64 = ["take", "map", "unmap", "release"]
            .iter()
            .map(|k| o["measured_calls_us"][k].as_f64().unwrap())
            .sum();
        assert!((by_kind - calls).abs() < 1.0, "{by_kind} against {calls}");
        let spread = |k: &str| o["take_us"][format!("{k}_us")].as_f64().unwrap();
        assert!(
            0.0 < spread("p50")
                && spread("p50") <= spread("p90")
                && spread("p90") <= spread("p99")
                && spread("p99") <= spread("max"),
            "{}",
            o["take_us"]
        );
    }
    // Through the daemon, every grant's handle is accounted for: ready in the pool, given back
    // earlier, or made on the grant's path. In process there is no pool to report.
    assert!(a.get("pool_takes").is_none());
    assert_every_grant_was_a_pool_take(b);
    // The takes' time splits into round trips and imports.
    assert!(a.get("take_import_us").is_none());
    let import = b["take_import_us"].as_f64().unwrap();
    let take = b["measured_calls_us"]["take"].as_f64().unwrap();
    assert!(
        0.0 < import && import < take,
        "import {import} µs of {take} µs"
    );
}

#[test]
fn a_file_that_is_not_a_snapshot_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("notes.txt");
    std::fs::write(&bad, "not a pickle").unwrap();
    replay_fails(&[&bad], None, "notes.txt: not a PyTorch memory snapshot");
}

/// Processes whose command line names a replay's own daemon socket under `tmp`.
fn replay_daemons(tmp: &Path) -> Vec<u32> {
    let tmp = tmp.to_string_lossy();
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline);
        if cmdline.contains("serve") && cmdline.contains(&format!("{tmp}/vramd-replay-")) {
            out.push(pid);
        }
    }
    out
}

#[test]
fn a_replay_through_a_daemon_that_fails_part_way_leaves_no_daemon_behind() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.pickle.gz");
    write_snapshot(&good, 4);
    let bad = dir.path().join("bad.pickle.gz");
    std::fs::write(&bad, "not a pickle").unwrap();
    // The replay's daemon lives in a directory under TMPDIR: this test's own, so that replays of
    // other tests running meanwhile are not counted.
    let tmp = dir.path().join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    replay_fails(
        &[Path::new("--through-daemon"), &good, &bad],
        Some(&tmp),
        "bad.pickle.gz: not a PyTorch memory snapshot",
    );
    let left = replay_daemons(&tmp);
    assert!(left.is_empty(), "daemons left running: {left:?}");
}

#[test]
fn scales_replay_the_trace_at_other_sizes_and_absurd_ones_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("small.pickle.gz");
    write_snapshot(&trace, 10);
    let rows = replay_json(&["--scale", "0.5,2", trace.to_str().unwrap()]);
    let names: Vec<&str> = rows.iter().map(|r| r["trace"].as_str().unwrap()).collect();
    assert_eq!(names, ["small", "small@0.5", "small@2"]);
    let peak = |i: usize| rows[i]["peak_requested"].as_u64().unwrap();
    assert!(peak(1) < peak(0) && peak(0) < peak(2), "{rows:?}");
    for bad in ["0", "-1", "NaN", "100"] {
        let scale = format!("--scale={bad}");
        replay_fails(&[scale.as_str(), trace.to_str().unwrap()], None, "--scale");
    }
}

#[test]
fn realtime_keeps_the_traces_pace_and_gives_the_same_figures() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("paced.pickle.gz");
    // 12 rounds, 3 ms between allocations and 5 ms between frees: about half a second.
    write_snapshot_spaced(&trace, 12, 1000);
    let fast = replay_json(&[trace.to_str().unwrap()]);
    let started = std::time::Instant::now();
    let paced = replay_json(&["--realtime", trace.to_str().unwrap()]);
    let took = started.elapsed();
    let wall_us = paced[0]["wall_us"].as_u64().unwrap();
    assert!(wall_us >= 400_000, "{paced:?}");
    assert!(
        took.as_micros() as u64 >= wall_us,
        "took {took:?} for a trace spanning {wall_us} µs"
    );
    for key in ["peak_requested", "peak_held", "grants", "maps", "unmaps"] {
        assert_eq!(fast[0][key], paced[0][key], "{key}");
    }
}

#[test]
fn a_replay_can_take_its_handles_from_a_running_daemon_with_its_own_configuration() {
    // A daemon whose pool keeps nothing ready: every grant creates its handle on the way.
    let d = common::Daemon::start("capacity = \"4 GiB\"\n[pool]\nmax = \"0 B\"\n");
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("small.pickle.gz");
    write_snapshot(&trace, 20);
    let local = replay_json(&[trace.to_str().unwrap()]);
    let socket = d.socket.to_str().unwrap();
    let through = replay_json(&[
        "--through-daemon",
        "--socket",
        socket,
        trace.to_str().unwrap(),
    ]);
    let (a, b) = (&local[0], &through[0]);
    for key in ["peak_held", "fragmentation", "grants", "maps", "unmaps"] {
        assert_eq!(a[key], b[key], "{key} differs through the running daemon");
    }
    let takes = &b["pool_takes"];
    assert_eq!(takes["hits"], 0, "{takes}");
    assert_eq!(takes["recycled"], 0, "{takes}");
    assert_eq!(takes["misses"], b["grants"], "{takes}");
    // The replay was a tenant like any other: gone, and holding nothing, once it ended.
    d.wait_for_no_tenants();
    assert_eq!(d.status().devices[0].held, vram_core::Bytes::ZERO);
    // The socket only makes sense with --through-daemon.
    replay_fails(
        &["--socket", socket, trace.to_str().unwrap()],
        None,
        "--through-daemon",
    );
    d.stop();
}

/// A snapshot of a long run's last events: 20 blocks of 8 MiB (weights) allocated before its
/// history, and one still allocated that no event names, live while 30 rounds of activations come
/// and go, the 20 freed at the end.
fn write_ring_buffer_snapshot(path: &Path) {
    let script = r#"
import gzip, pickle, sys
ev, t = [], 0
for i in range(30):
    for j, size in enumerate([(6 << 20) + 4096 * i, 3 << 20, 100]):
        addr = (1000 + i * 4 + j) << 24
        t += 7
        ev.append({"action": "alloc", "addr": addr, "size": size, "stream": 0, "time_us": t})
        t += 7
        ev.append({"action": "free_completed", "addr": addr, "size": size, "stream": 0, "time_us": t})
for w in range(20):
    t += 1
    ev.append({"action": "free_completed", "addr": (w + 1) << 24, "size": 8 << 20, "stream": 0, "time_us": t})
segs = [{"device": 0, "address": 500 << 24, "total_size": 2 << 20, "stream": 0,
         "blocks": [{"size": 2 << 20, "requested_size": 1 << 20, "state": "active_allocated"}]}]
with gzip.open(sys.argv[1], "wb") as f:
    pickle.dump({"segments": segs, "device_traces": [ev], "allocator_settings": {}}, f)
"#;
    let st = Command::new("python3")
        .args(["-c", script, path.to_str().unwrap()])
        .status()
        .expect("python3 runs");
    assert!(st.success());
}

#[test]
fn blocks_live_before_a_snapshots_history_are_placed_first_unless_window_only() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("ring.pickle.gz");
    write_ring_buffer_snapshot(&trace);
    let path = trace.to_str().unwrap();
    let (whole, through) = (
        &replay_json(&[path])[0],
        &replay_json(&["--through-daemon", path])[0],
    );
    let window = &replay_json(&["--window-only", path])[0];
    let mib = 1u64 << 20;
    for o in [whole, through] {
        assert_eq!(o["before_history_blocks"], 21, "{o}");
        assert_eq!(o["before_history_bytes"], 161 * mib, "{o}");
        assert_eq!(o["skipped_frees"], 0);
        // The weights and the largest round's activations.
        let peak = o["peak_requested"].as_u64().unwrap();
        assert_eq!(peak, 161 * mib + (6 << 20) + 4096 * 29, "{o}");
    }
    assert_eq!(whole["peak_held"], through["peak_held"]);
    assert_eq!(window["before_history_blocks"], 0);
    assert_eq!(window["skipped_frees"], 20);
    assert_eq!(
        window["peak_requested"].as_u64().unwrap(),
        (6 << 20) + 4096 * 29
    );
    // Placing the weights came before the history: the calls that mapped them are not counted
    // in it (they took 161 MiB; the history's few activations take a few handles at most).
    for o in [whole, through] {
        assert!(o["mapped_bytes"].as_u64().unwrap() < 32 * mib, "{o}");
        assert_eq!(
            o["wall_us"],
            window["wall_us"].as_u64().unwrap() + 20,
            "{o}"
        );
    }
    // Through a daemon, the pool's takes are counted over the history too.
    assert_every_grant_was_a_pool_take(through);
}

#[test]
fn settings_may_be_given_one_per_flag_or_comma_separated() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("small.pickle.gz");
    write_snapshot(&trace, 20);
    let path = trace.to_str().unwrap();
    // Handles of at most 4 MiB, cut evenly: far more of them than by default.
    let apart = &replay_json(&["--set", "max_handle=4MiB", "--set", "min_grow=2MiB", path])[0];
    let together = &replay_json(&["--set", "max_handle=4MiB,min_grow=2MiB", path])[0];
    let default = &replay_json(&[path])[0];
    for key in ["peak_held", "grants", "maps"] {
        assert_eq!(apart[key], together[key], "{key}");
    }
    let grants = |o: &Value| o["grants"].as_u64().unwrap();
    assert!(grants(apart) > grants(default), "{apart} against {default}");
    replay_fails(
        &["--set", "min_grow=8MiB,no_such=1", path],
        None,
        "`no_such` is not an allocator setting",
    );
}

#[test]
fn pytorch_figures_come_from_the_readme_beside_the_trace_and_scales_are_summed_up() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("small.pickle.gz");
    write_snapshot(&trace, 10);
    std::fs::write(
        dir.path().join("README.md"),
        "| workload | fragmentation, default | fragmentation, expandable segments |\n\
         |---|---|---|\n| small | 12.5 % | 3.25 % |\n",
    )
    .unwrap();
    let path = trace.to_str().unwrap();
    let rows = replay_json(&["--scale", "0.5", path]);
    assert_eq!(rows[0]["pytorch_fragmentation"]["expandable"], 0.0325);
    assert_eq!(rows[0]["pytorch_fragmentation"]["default"], 0.125);
    // The recorded run's figures belong to the trace as recorded, not to its scaled copies.
    assert!(
        rows[1].get("pytorch_fragmentation").is_none(),
        "{}",
        rows[1]
    );
    let table =
        common::vramd_stdout(&["replay", "--compare", "expandable", "--scale", "0.5", path]);
    let header = table.lines().next().unwrap();
    assert!(
        header.ends_with("PT EXPANDABLE") && !header.contains("PT DEFAULT"),
        "{table}"
    );
    let row = table.lines().find(|l| l.starts_with("small ")).unwrap();
    assert!(row.trim_end().ends_with("3.25%"), "{table}");
    let summary = table.lines().skip_while(|l| !l.starts_with("OVER SCALES"));
    let small: Vec<&str> = summary.filter(|l| l.starts_with("small")).collect();
    assert_eq!(
        small.len(),
        1,
        "one line per trace over its scales: {table}"
    );
    assert!(small[0].split_whitespace().nth(1) == Some("2"), "{table}");
    // Its means are the replays' own figures averaged: fragmentation, then driver time.
    let percents = |line: &str| -> Vec<f64> {
        line.split_whitespace()
            .filter_map(|w| w.strip_suffix('%')?.parse::<f64>().ok())
            .collect()
    };
    let replays: Vec<Vec<f64>> = table
        .lines()
        .take_while(|l| !l.is_empty())
        .filter(|l| l.starts_with("small"))
        .map(percents)
        .collect();
    assert_eq!(replays.len(), 2, "{table}");
    let over = percents(small[0]);
    for (column, at) in [(0, 0), (1, 2)] {
        let mean = (replays[0][column] + replays[1][column]) / 2.0;
        assert!(
            (over[at] - mean).abs() < 0.011,
            "{over:?} against {replays:?}: {table}"
        );
    }
    // Where the memory held lay at its peak: a row per replay whose shares add up to 100 %.
    let at_peak: Vec<&str> = table
        .lines()
        .skip_while(|l| !l.starts_with("AT PEAK HELD"))
        .skip(1)
        .take_while(|l| !l.is_empty())
        .collect();
    assert_eq!(at_peak.len(), 2, "the trace and its scaled copy: {table}");
    for row in at_peak {
        let shares: f64 = row
            .split_whitespace()
            .filter_map(|w| w.strip_suffix('%')?.parse::<f64>().ok())
            .sum();
        assert!((shares - 100.0).abs() < 0.05, "{shares} in {row}");
    }
    // Without a README beside it, a trace has no figures: a dash.
    std::fs::remove_file(dir.path().join("README.md")).unwrap();
    let table = common::vramd_stdout(&["replay", "--compare", "default", path]);
    let row = table.lines().find(|l| l.starts_with("small ")).unwrap();
    assert!(row.trim_end().ends_with('-'), "{table}");
}

/// A snapshot of a process that used two GPUs replays each device's history as a trace of its
/// own; one whose events carry no times has figures but no shares of time (`null`, not 0); one
/// whose histories record no allocation is refused rather than replayed as an idle workload.
#[test]
fn each_device_is_a_trace_and_a_history_without_times_has_no_shares() {
    let dir = tempfile::tempdir().unwrap();
    let script = r#"
import pickle, sys
def allocs(n, size, timed):
    return [dict({"action": "alloc", "addr": (i + 1) << 30, "size": size, "stream": 0},
                 **({"time_us": 10 * i} if timed else {})) for i in range(n)]
with open(sys.argv[1] + "/two.pickle", "wb") as f:
    pickle.dump({"segments": [], "device_traces": [allocs(3, 8 << 20, True),
                                                   allocs(5, 4 << 20, False)]}, f)
with open(sys.argv[1] + "/idle.pickle", "wb") as f:
    pickle.dump({"segments": [], "device_traces": [[], []]}, f)
"#;
    let st = Command::new("python3")
        .args(["-c", script, dir.path().to_str().unwrap()])
        .status()
        .expect("python3 runs");
    assert!(st.success());
    let two = dir.path().join("two.pickle");
    let out = replay_json(&[two.to_str().unwrap()]);
    let names: Vec<&str> = out.iter().map(|o| o["trace"].as_str().unwrap()).collect();
    assert_eq!(names, ["two:cuda0", "two:cuda1"]);
    assert_eq!(out[0]["peak_requested"], 24u64 << 20);
    assert_eq!(out[1]["peak_requested"], 20u64 << 20);
    assert!(out[0]["modelled_driver_time_share"].as_f64().unwrap() > 0.0);
    for key in [
        "modelled_driver_time_share",
        "design_table_driver_time_share",
        "measured_allocator_time_share",
        "measured_driver_time_share",
    ] {
        assert!(out[1][key].is_null(), "{key}: {}", out[1][key]);
    }
    let idle = dir.path().join("idle.pickle");
    replay_fails(&[idle], None, "record no allocation or free");
}
