//! `vramd bench` as a user runs it, against a daemon of its own on the host backend.

use serde_json::Value;

mod common;

fn bench_json(extra: &[&str]) -> Value {
    let args = ["bench", "--json", "--size", "2MiB", "--iterations", "40"];
    let args = [&args[..], &["--warmup", "4", "--map"], extra].concat();
    serde_json::from_str(&common::vramd_stdout(&args)).unwrap()
}

#[test]
fn round_trips_give_back_inside_the_trip_unless_fresh_handles_are_kept() {
    let plain = bench_json(&[]);
    let fresh = bench_json(&["--fresh", "--pause-us", "200"]);
    let us = |r: &Value, phase: &str, q: &str| r["results"][0][phase][q].as_f64().unwrap();
    for r in [&plain, &fresh] {
        assert_eq!(r["results"][0]["round_trips"], 40, "{r}");
        assert!(us(r, "grant", "p50_us") > 0.0, "{r}");
        // The grant's two parts: the round trip with the fd, and the import.
        assert!(us(r, "grant_reply", "p50_us") > 0.0, "{r}");
        assert!(us(r, "import", "p50_us") > 0.0, "{r}");
        assert!(
            us(r, "grant_reply", "p50_us") <= us(r, "grant", "p99_us"),
            "{r}"
        );
        assert!(us(r, "map", "p50_us") > 0.0, "{r}");
    }
    // Kept grants are given back after the measurement: no socket round trip inside it (the 90th
    // percentile, so that one descheduling on a loaded machine does not decide).
    assert!(
        us(&fresh, "give_back", "p90_us") < us(&plain, "give_back", "p50_us"),
        "fresh {fresh} plain {plain}"
    );
}
