use std::path::PathBuf;

use super::*;
use crate::trace::{parse_snapshot, Event};

const FRAGMENTATION_GOAL: f64 = 0.03;
const DRIVER_SHARE_GOAL: f64 = 0.01;
/// Traces on which the default configuration misses a goal, with the figures it reaches
/// (fragmentation, driver time share): the test holds them to those figures (no regression) and
/// says loudly that the goal is missed. An entry goes once the allocator meets the goals on it.
/// docs/ARCHITECTURE.md ("The allocator's policy") says what each miss is made of.
const KNOWN_MISSES: [(&str, f64, f64); 3] = [
    ("bert_train_varlen", 0.0300, 0.0132),
    ("efficientnet_progressive", 0.0100, 0.0124),
    ("gpt2_generate", 0.0240, 0.0140),
];
const TRACES: [&str; 9] = [
    "resnet50_train",
    "bert_train_varlen",
    "gpt2_generate",
    "fasterrcnn_varsize",
    "maskrcnn_train",
    "lstm_lm_train",
    "multi_model_serve",
    "bart_train_varlen",
    "efficientnet_progressive",
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

/// Replays `trace` with `config`, priced with the H200's measured costs.
fn replay_priced(name: &str, trace: &Trace, config: &AllocConfig) -> ReplayResult {
    replay(
        name,
        trace,
        config,
        &CostModel::H200_MEASURED,
        &mut |_, _| {},
    )
    .unwrap()
}

fn load(dir: &std::path::Path, name: &str) -> Trace {
    let bytes = std::fs::read(dir.join(format!("{name}.pickle.gz"))).unwrap();
    parse_snapshot(&bytes).unwrap()
}

#[test]
fn real_traces_meet_the_fragmentation_and_driver_time_goals() {
    let Some(dir) = traces_dir() else {
        eprintln!("skipped: no traces (set VRAMD_TRACES to the folder of *.pickle.gz)");
        return;
    };
    let present: Vec<&str> = TRACES
        .into_iter()
        .filter(|name| {
            let there = dir.join(format!("{name}.pickle.gz")).is_file();
            if !there {
                eprintln!("skipped {name}: not in {}", dir.display());
            }
            there
        })
        .collect();
    let failures = goals_missed(&dir, &present, &KNOWN_MISSES);
    assert!(failures.is_empty(), "goals missed on {failures:?}");
}

/// Replays each of `names` from `dir` at the default configuration and returns those that miss
/// the goals, or for a trace in `known`, the figures it is held to.
fn goals_missed<'a>(
    dir: &std::path::Path,
    names: &[&'a str],
    known: &[(&str, f64, f64)],
) -> Vec<&'a str> {
    let mut failures = Vec::new();
    for &name in names {
        let trace = load(dir, name);
        let r = replay_priced(name, &trace, &AllocConfig::default());
        eprintln!("{}", serde_json::to_string(&r).unwrap());
        check_held_at_peak(&r);
        let (frag_bound, share_bound) = match known.iter().find(|m| m.0 == name) {
            Some(&(_, f, s)) => {
                eprintln!("GOAL MISSED on {name} (known): held to fragmentation {f}, share {s}");
                (f, s)
            }
            None => (FRAGMENTATION_GOAL, DRIVER_SHARE_GOAL),
        };
        let share = r
            .modelled_driver_time_share
            .expect("the shared traces carry event times");
        if r.fragmentation > frag_bound || share > share_bound {
            failures.push(name);
        }
    }
    failures
}

/// Traces recorded by `scripts/h200/record_traces.py` of workloads the policy was not tuned on,
/// kept in the repository (docs/results/2026-12-04-h200-traces), with the figures the default
/// configuration reaches where it misses a goal (fragmentation, driver time share), as above.
const HELD_OUT: [&str; 8] = [
    "dcgan_train",
    "vit_serve",
    "unet_train",
    "llama_generate",
    "gpt2_ckpt_train",
    "gnn_train",
    "dlrm_train",
    "lora_finetune",
];
const HELD_OUT_MISSES: [(&str, f64, f64); 1] = [("dcgan_train", 0.0445, 0.0112)];

#[test]
fn traces_the_policy_was_not_tuned_on_meet_the_goals_or_their_known_figures() {
    let dir =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/results/2026-12-04-h200-traces");
    let failures = goals_missed(&dir, &HELD_OUT, &HELD_OUT_MISSES);
    assert!(failures.is_empty(), "goals missed on {failures:?}");
}

/// The memory held at its peak is the replay's peak held, and its parts add up to it.
fn check_held_at_peak(r: &ReplayResult) {
    let p = r.held_at_peak;
    assert_eq!(p.held, r.peak_held, "{}: held at the peak", r.trace);
    let free = p.free.whole_handles + p.free.partly_used_handles + p.free.small_heap;
    assert_eq!(
        p.requested + p.allocated_beyond_requested + free.get(),
        p.held,
        "{}: the parts of the peak do not add up: {p:?}",
        r.trace
    );
    assert!(p.requested <= r.peak_requested);
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
        ..Trace::default()
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
    check_held_at_peak(&r);
    // At the peak, 3 MiB and 1 MiB live in the large heap and nothing in the small one.
    assert_eq!(
        (r.held_at_peak.requested, r.held_at_peak.free.small_heap),
        (4 * mib, Bytes::ZERO)
    );
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

#[test]
fn blocks_live_before_the_history_count_in_the_peaks_but_not_in_the_driver_time() {
    let mib = Bytes::MIB;
    let window = [
        ev(Action::Alloc, 2, 3 * mib, 0),
        ev(Action::Free, 2, 3 * mib, 10),
        ev(Action::Free, 1, 64 * mib, 1_000_000),
    ];
    let mut events = vec![ev(Action::Alloc, 1, 64 * mib, 0)];
    events.extend(window.iter().copied());
    let with = Trace {
        events,
        before_history: 1,
        ..Trace::default()
    };
    let run = |t: &Trace| {
        let config = AllocConfig::default();
        replay("t", t, &config, &CostModel::DESIGN_TABLE, &mut |_, _| {}).unwrap()
    };
    let (r, w) = (run(&with), run(&with.window_only()));
    assert_eq!(
        (r.before_history_blocks, r.before_history_bytes),
        (1, 64 * mib)
    );
    assert_eq!((w.peak_requested, r.peak_requested), (3 * mib, 67 * mib));
    assert!(r.peak_held >= 67 * mib, "{}", r.peak_held);
    // Only the growth for the 3 MiB block falls in the history: one request, as without.
    assert_eq!((r.grant_requests, w.grant_requests), (1, 1));
    assert_eq!(w.skipped_frees, 1);
}
