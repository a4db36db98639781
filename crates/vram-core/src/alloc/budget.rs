//! The driver-time budget: the share of the program's time (`driver_budget`) that its allocator
//! may spend in the calls that grant, map and give back memory. A grant is cut into handles as
//! small as the time left under the budget affords. A handle goes back only whole, so a smaller
//! handle strands less free memory beside a live block; each handle costs driver calls over its
//! life, so a program whose calls already take their share gets the largest handles.

use super::backing::CallCost;

/// The allocator's time, from its ticks (how long since the first), and the largest handle of
/// the last grant.
#[derive(Debug, Default)]
pub(super) struct Clock {
    first_us: Option<u64>,
    elapsed_us: u64,
    last_handle: u64,
}

impl Clock {
    pub(super) fn observe(&mut self, now_us: u64) {
        let first = *self.first_us.get_or_insert(now_us);
        self.elapsed_us = now_us.saturating_sub(first);
    }

    /// [`handle_size`] for the next grant, never below half the last grant's largest handle: a
    /// handle's price is what handles cost so far, and a size not asked for before may cost more
    /// (a daemon keeps ready the sizes it was asked for), so sizes step down one halving at a
    /// time while their price shows.
    pub(super) fn next_handle_size(
        &mut self,
        bytes: u64,
        cost: Option<CallCost>,
        budget: f64,
        max_handle: u64,
        gran: u64,
    ) -> u64 {
        let size = handle_size(bytes, cost, budget, self.elapsed_us, max_handle, gran)
            .max(self.last_handle / 2);
        self.last_handle = size;
        size
    }
}

/// The largest handle that a grant of `bytes` is cut into. With `budget` of the `elapsed_us` so
/// far, less what the calls have spent and one request, left for the grant's handles, it is the
/// smallest power of two that keeps their count within what that time pays for at `handle_us`
/// each, and never below a quarter of `max_handle` (rounded up to the granularity) or above
/// `max_handle`. With no time left, or a backing that cannot tell its costs, it is `max_handle`.
pub(super) fn handle_size(
    bytes: u64,
    cost: Option<CallCost>,
    budget: f64,
    elapsed_us: u64,
    max_handle: u64,
    gran: u64,
) -> u64 {
    let max = (max_handle / gran * gran).max(gran);
    let least = (max / 4).next_multiple_of(gran).min(max);
    let Some(c) = cost else { return max };
    let left = budget * elapsed_us as f64 - c.spent_us - c.request_us;
    if c.handle_us <= 0.0 {
        return least;
    }
    let affordable = (left / c.handle_us).floor();
    if affordable < 1.0 {
        return max;
    }
    let each = (bytes as f64 / affordable).ceil() as u64;
    each.next_power_of_two().clamp(least, max)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const COST: CallCost = CallCost {
        spent_us: 0.0,
        request_us: 30.0,
        handle_us: 100.0,
    };

    fn size(bytes: u64, cost: Option<CallCost>, elapsed_us: u64) -> u64 {
        handle_size(bytes, cost, 0.01, elapsed_us, 64 * MIB, 2 * MIB)
    }

    #[test]
    fn handles_are_as_small_as_the_time_left_affords() {
        // 1 s at 1 %: 10 ms, less a 30 µs request, pays for 99 handles of 100 µs.
        assert_eq!(size(1024 * MIB, Some(COST), 1_000_000), 16 * MIB);
        // 100 ms: 9 handles for 1 GiB: the largest, 64 MiB.
        assert_eq!(size(1024 * MIB, Some(COST), 100_000), 64 * MIB);
        // 300 ms: 29 handles for 1 GiB: 1024/29 = 35.3 MiB, so 64; 512 MiB: 17.7 MiB, so 32.
        assert_eq!(size(1024 * MIB, Some(COST), 300_000), 64 * MIB);
        assert_eq!(size(512 * MIB, Some(COST), 300_000), 32 * MIB);
    }

    #[test]
    fn time_already_spent_leaves_the_largest_handles() {
        let spent = CallCost {
            spent_us: 10_000.0,
            ..COST
        };
        assert_eq!(size(64 * MIB, Some(spent), 1_000_000), 64 * MIB);
        assert_eq!(size(64 * MIB, Some(COST), 0), 64 * MIB, "no time yet");
    }

    #[test]
    fn sizes_step_down_one_halving_per_grant() {
        let next = |clock: &mut Clock| {
            clock.next_handle_size(1024 * MIB, Some(COST), 0.01, 64 * MIB, 2 * MIB)
        };
        let mut clock = Clock::default();
        clock.observe(0);
        assert_eq!(next(&mut clock), 64 * MIB, "no time yet");
        clock.observe(10_000_000);
        assert_eq!(next(&mut clock), 32 * MIB);
        assert_eq!(next(&mut clock), 16 * MIB);
        assert_eq!(
            next(&mut clock),
            16 * MIB,
            "a quarter of max_handle at least"
        );
    }

    #[test]
    fn a_backing_that_cannot_tell_its_costs_gets_max_handle() {
        assert_eq!(size(16 * MIB, None, 10_000_000), 64 * MIB);
    }

    #[test]
    fn the_size_stays_within_a_quarter_of_max_handle_and_max_handle() {
        let free = CallCost {
            handle_us: 0.0,
            ..COST
        };
        assert_eq!(size(2 * MIB, Some(free), 1_000_000), 16 * MIB);
        assert_eq!(size(2 * MIB, Some(COST), 100_000_000), 16 * MIB);
        // A max_handle below four granules: a quarter rounds up to one granule.
        assert_eq!(
            handle_size(64 * MIB, Some(COST), 0.01, 100_000_000, 4 * MIB, 2 * MIB),
            2 * MIB
        );
    }
}
