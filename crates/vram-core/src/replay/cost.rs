//! What the driver calls an allocator made would cost on an H200.

use crate::alloc::{BackingCounts, CallCost};

/// Per-call costs in microseconds. A grant request is one daemon round trip, whatever the number of
/// handles it brings, and each handle is then imported (creating and exporting it is the daemon's,
/// ahead of need, hidden by its pool); each map is a `cuMemMap` and a `cuMemSetAccess` of the whole
/// handle.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct CostModel {
    pub name: &'static str,
    pub grant_request_us: f64,
    pub import_us: f64,
    pub map_us: f64,
    pub set_access_per_map_us: f64,
    pub set_access_per_mib_us: f64,
    pub unmap_us: f64,
    pub release_us: f64,
}

impl CostModel {
    /// The cost table of docs/design.md as written, set-access priced per MiB. Priced that way a
    /// large handle costs far more than the driver charges for it (set-access is mostly a
    /// per-handle cost), so replays report it beside [`CostModel::H200_MEASURED`] only.
    pub const DESIGN_TABLE: CostModel = CostModel {
        name: "design-table",
        grant_request_us: 30.0,
        import_us: 31.0,
        map_us: 1.5,
        set_access_per_map_us: 0.0,
        set_access_per_mib_us: 15.0,
        unmap_us: 19.0,
        release_us: 21.0,
    };

    /// The costs measured on an H200 (docs/benchmarks.md, "Grant latency" and "Driver time of
    /// the traces, measured on the H200"): set-access a per-handle cost plus a little per MiB,
    /// whether one call covers one handle or many; import per handle, whatever its size.
    pub const H200_MEASURED: CostModel = CostModel {
        name: "h200-measured",
        set_access_per_map_us: 25.0,
        set_access_per_mib_us: 0.028,
        ..Self::DESIGN_TABLE
    };

    /// One handle over its life: imported, mapped with its access set, unmapped and released.
    pub fn handle_life_us(&self) -> f64 {
        self.import_us + self.map_us + self.set_access_per_map_us + self.unmap_us + self.release_us
    }

    /// The calls in `c` as an allocator weighs them ([`CallCost`]).
    pub fn call_cost(&self, c: &BackingCounts) -> CallCost {
        CallCost {
            spent_us: self.driver_us(c),
            request_us: self.grant_request_us,
            handle_us: self.handle_life_us(),
        }
    }

    /// Modelled driver time of the calls in `c`, in microseconds.
    pub fn driver_us(&self, c: &BackingCounts) -> f64 {
        let mib = c.mapped_bytes as f64 / (1u64 << 20) as f64;
        c.grant_requests as f64 * self.grant_request_us
            + c.grants as f64 * self.import_us
            + c.maps as f64 * (self.map_us + self.set_access_per_map_us)
            + mib * self.set_access_per_mib_us
            + c.unmaps as f64 * self.unmap_us
            + c.releases as f64 * self.release_us
    }
}
