use std::path::PathBuf;

use super::*;
use crate::trace::{parse_snapshot, Event};

const FRAGMENTATION_GOAL: f64 = 0.03;
const DRIVER_SHARE_GOAL: f64 = 0.01;
/// Traces on which the default configuration misses a goal today, with the figures it reached
/// (fragmentation, driver time share): the test holds them to those figures (no regression) and
/// says loudly that the goal is missed. Remove an entry once the allocator meets the goals on it.
/// docs/ARCHITECTURE.md ("The allocator's policy") says what each miss is made of.
const KNOWN_MISSES: [(&str, f64, f64); 4] = [
    ("bert_train_varlen", 0.0293, 0.0125),
    ("efficientnet_progressive", 0.0100, 0.0117),
    ("gpt2_generate", 0.0108, 0.0143),
    ("lstm_lm_train", 0.0398, 0.0030),
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
    let mut failures = Vec::new();
    for name in TRACES {
        if !dir.join(format!("{name}.pickle.gz")).is_file() {
            eprintln!("skipped {name}: not in {}", dir.display());
            continue;
        }
        let trace = load(&dir, name);
        let r = replay_priced(name, &trace, &AllocConfig::default());
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

/// Diagnosis, run by hand (`cargo test -p vram-core --release replay::tests::diagnose --
/// --ignored --nocapture`): per trace, the figures; at the moment of peak held, the layout of every
/// segment (live block sizes in MiB, free ones in brackets) and a histogram of the free regions;
/// and, for the traces named in `LOG_GROWTH`, one line per allocation that mapped memory (what it
/// granted, mapped and unmapped). `VRAMD_SCALE=0.99` scales every request as `vramd replay --scale` does;
/// `VRAMD_DIAG_AT=N` shows the layout after event N instead of at the peak (the moment before a
/// growth that set the peak is often the telling one).
#[test]
#[ignore]
fn diagnose() {
    let Some(dir) = traces_dir() else {
        return;
    };
    let mut rows = Vec::new();
    for name in trace_names() {
        let name = name.as_str();
        let trace = scaled(load(&dir, name));
        let config = settings_from_env();
        let mut a = Allocator::new(config.clone(), ModelBacking::new());
        let mut blocks: HashMap<u64, u64> = HashMap::new();
        // `VRAMD_LOG_GROWTH=bert_train_varlen,...` prints every growth of those traces.
        let log = std::env::var("VRAMD_LOG_GROWTH").is_ok_and(|v| v.split(',').any(|n| n == name));
        let mut peak = 0;
        let mut at_peak = (
            0,
            Vec::new(),
            crate::alloc::AllocStats::default(),
            Vec::new(),
        );
        let diag_at: Option<usize> = std::env::var("VRAMD_DIAG_AT")
            .ok()
            .map(|v| v.parse().expect("VRAMD_DIAG_AT is an event index"));
        for (i, e) in trace.events.iter().enumerate() {
            let s = StreamId(e.stream);
            match e.action {
                Action::Alloc => {
                    let c0 = a.backing().counts();
                    let b = a.alloc(Bytes(e.size), s, &AlwaysComplete).unwrap();
                    let c1 = a.backing().counts();
                    if log && c1.maps != c0.maps {
                        let st = a.stats();
                        eprintln!(
                            "grow@{i} t={}ms len {:.2} alloc {} held {} +grants {} ({} MiB) +maps {} +unmaps {}",
                            e.time_us.saturating_sub(trace.events[0].time_us) / 1000,
                            e.size as f64 / Bytes::MIB as f64,
                            st.allocated.get() >> 20,
                            st.held.get() >> 20,
                            c1.grants - c0.grants,
                            (c1.granted_bytes - c0.granted_bytes) >> 20,
                            c1.maps - c0.maps,
                            c1.unmaps - c0.unmaps
                        );
                    }
                    blocks.insert(e.addr, b.offset);
                }
                Action::Free => {
                    let o = blocks.remove(&e.addr).unwrap();
                    a.free(o, s, Fence(0), &AlwaysComplete).unwrap();
                }
            }
            a.tick(e.time_us, &AlwaysComplete);
            let held = a.backing().held().get();
            if diag_at.map_or(held > peak, |at| at == i) {
                peak = peak.max(held);
                at_peak = (i, a.segments(), a.stats(), a.handles());
            }
        }
        let r = replay_priced(name, &trace, &config);
        rows.push(format!(
            "{name:20} frag {:5.2} % driver {:5.2} % grants {} maps {} unmaps {} held {} MiB req {} MiB",
            r.fragmentation * 100.0,
            r.modelled_driver_time_share * 100.0,
            r.grants,
            r.maps,
            r.unmaps,
            r.peak_held >> 20,
            r.peak_requested >> 20
        ));
        let (i, segs, st, handles) = at_peak;
        let starts: std::collections::BTreeSet<u64> = handles.iter().map(|h| h.0).collect();
        eprintln!(
            "== {name}: held {} MiB at event {i}/{}; allocated {} MiB, requested {} MiB",
            st.held.get() >> 20,
            trace.events.len(),
            st.allocated.get() >> 20,
            st.requested.get() >> 20
        );
        let mut hist: std::collections::BTreeMap<u64, (u32, u64)> = Default::default();
        let (mut whole_granules, mut partial) = (0u64, 0u64);
        for s in &segs {
            for b in s
                .blocks
                .iter()
                .filter(|b| b.state != crate::alloc::BlockState::Allocated)
            {
                let g = config.granularity.get();
                let (lo, hi) = (b.offset.next_multiple_of(g), (b.offset + b.len) / g * g);
                let whole = hi.saturating_sub(lo);
                whole_granules += whole;
                partial += b.len - whole;
            }
            let mut layout = String::new();
            for b in &s.blocks {
                let mib = b.len as f64 / Bytes::MIB as f64;
                for h in starts
                    .range(b.offset..b.offset + b.len)
                    .filter(|&&h| h != s.offset)
                {
                    layout += &format!("|{:.1} ", (h - b.offset) as f64 / Bytes::MIB as f64);
                }
                if b.state == crate::alloc::BlockState::Allocated {
                    layout += &format!("{mib:.2} ");
                } else {
                    layout += &format!("[{mib:.2}] ");
                    let e = hist.entry((b.len * 4).div_ceil(Bytes::MIB)).or_default();
                    e.0 += 1;
                    e.1 += b.len;
                }
            }
            if !s.small {
                eprintln!("segment {:#x} {} MiB: {layout}", s.offset, s.len >> 20);
            } else {
                eprintln!("small segment {:#x} {} MiB", s.offset, s.len >> 20);
            }
        }
        let h: Vec<String> = hist
            .iter()
            .map(|(q, (n, b))| {
                format!(
                    "<={:.2}MiB:{n}x={:.1}",
                    *q as f64 / 4.0,
                    *b as f64 / Bytes::MIB as f64
                )
            })
            .collect();
        eprintln!("free histogram: {}", h.join(" "));
        eprintln!(
            "free at peak: {} MiB in whole granules, {} MiB in granules partly live",
            whole_granules >> 20,
            partial >> 20
        );
    }
    for r in rows {
        eprintln!("{r}");
    }
}

/// `trace` with every request scaled by `VRAMD_SCALE` (default 1), as `vramd replay --scale` does.
fn scaled(trace: Trace) -> Trace {
    match std::env::var("VRAMD_SCALE") {
        Ok(s) => trace.scaled(s.parse().expect("VRAMD_SCALE is a number")),
        Err(_) => trace,
    }
}

/// The default settings with those of `VRAMD_ALLOC` applied, as a tenant takes them
/// (`min_grow=16MiB,max_handle=32MiB`).
fn settings_from_env() -> AllocConfig {
    let mut config = AllocConfig::default();
    if let Ok(v) = std::env::var("VRAMD_ALLOC") {
        config.set_all(&v).unwrap();
    }
    config
}

/// The traces to replay: `VRAMD_TRACE_NAMES` (comma-separated), else all of them.
fn trace_names() -> Vec<String> {
    std::env::var("VRAMD_TRACE_NAMES").map_or(TRACES.iter().map(|s| s.to_string()).collect(), |v| {
        v.split(',').map(str::to_string).collect()
    })
}
