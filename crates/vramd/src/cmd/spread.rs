//! Percentiles of measured times, shared by `vramd bench` and `vramd replay`.

use serde::Serialize;

/// Percentiles (nearest rank) and mean of a set of samples, in microseconds; all 0 for no samples.
#[derive(Debug, Default, PartialEq, Serialize)]
pub struct Spread {
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
    pub mean_us: f64,
}

impl Spread {
    /// The spread of `nanos` (sorted in place).
    pub fn of(nanos: &mut [u64]) -> Spread {
        if nanos.is_empty() {
            return Spread::default();
        }
        nanos.sort_unstable();
        let us = |ns: u64| ns as f64 / 1e3;
        // Nearest rank: the smallest sample with at least q of all samples at or below it.
        let at = |q: f64| {
            us(nanos[((q * nanos.len() as f64).ceil() as usize).clamp(1, nanos.len()) - 1])
        };
        let sum: u64 = nanos.iter().sum();
        Spread {
            p50_us: at(0.50),
            p90_us: at(0.90),
            p99_us: at(0.99),
            max_us: us(nanos[nanos.len() - 1]),
            mean_us: us(sum / nanos.len() as u64),
        }
    }

    /// The spread of `times`.
    pub fn of_durations(times: &[std::time::Duration]) -> Spread {
        Spread::of(
            &mut times
                .iter()
                .map(|d| d.as_nanos() as u64)
                .collect::<Vec<_>>(),
        )
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::Spread;

    #[test]
    fn a_spread_takes_nearest_rank_percentiles() {
        assert_eq!(Spread::of(&mut []), Spread::default());
        let times: Vec<Duration> = (1..=200).rev().map(Duration::from_micros).collect();
        let s = Spread::of_durations(&times);
        assert_eq!(
            (s.p50_us, s.p90_us, s.p99_us, s.max_us, s.mean_us),
            (100.0, 180.0, 198.0, 200.0, 100.5)
        );
        let one = Spread::of(&mut [7_000]);
        assert_eq!((one.p50_us, one.p99_us, one.max_us), (7.0, 7.0, 7.0));
    }
}
