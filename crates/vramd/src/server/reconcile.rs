//! The books checked against the driver: once a period, each device's used memory and its
//! processes' figures are read (a [`DriverProbe`], NVML on a GPU) and set beside what the daemon
//! has created and granted (`vram_core::books::reconcile`). What the driver shows beyond the books
//! is counted: a tenant's own (its CUDA context, anything it took by a route vramd does not serve)
//! against its limit and guarantee, everybody else's as outside use that the broker lends to no
//! one. When outside use grows into memory already promised, the guarantees at risk are named,
//! borrowing stops (the broker's free memory is zero) and borrowers are asked for their idle
//! memory back.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use vram_core::books::Reconciled;
use vram_core::Bytes;

use super::driver::DriverProbe;
use super::Daemon;

/// The least change of a figure that is logged (a process appearing or going always is): the
/// driver's own use moves by a few MiB as contexts come and go.
const LOG_STEP: Bytes = Bytes::mib(64);

/// The probe and what it last showed of each device, shared by the periodic check and the
/// check a tenant's first grant asks for.
pub(crate) struct DriverCheck {
    probe: Arc<dyn DriverProbe>,
    period: Duration,
    last: Mutex<Vec<Option<Reconciled>>>,
}

impl DriverCheck {
    pub(crate) fn new(
        probe: Arc<dyn DriverProbe>,
        devices: usize,
        period: Duration,
    ) -> DriverCheck {
        DriverCheck {
            probe,
            period,
            last: Mutex::new(vec![None; devices]),
        }
    }

    pub(crate) fn period(&self) -> Duration {
        self.period
    }

    /// One round over every device (see [`reconcile_once`]); rounds never overlap.
    pub(crate) fn check(&self, daemon: &Daemon) {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        reconcile_once(daemon, self.probe.as_ref(), &mut last);
    }
}

/// Checks the books every `period` until the daemon shuts down.
pub(super) fn start(
    daemon: Arc<Daemon>,
    period: Duration,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("vramd-books".into())
        .spawn(move || {
            while !daemon.is_shutting_down() {
                daemon.sleep_unless_shutdown(period);
                if let Some(check) = &daemon.driver_check {
                    check.check(&daemon);
                }
            }
        })
}

/// One round over every device: read, reconcile, apply, report what changed, ask for memory back
/// where a promise is broken or a tenant's own memory took it past its limit. `last` holds each
/// device's previous result, for logging on change.
fn reconcile_once(daemon: &Daemon, probe: &dyn DriverProbe, last: &mut [Option<Reconciled>]) {
    for (i, slot) in daemon.slots.iter().enumerate() {
        let uuid = slot.device().info().uuid.clone();
        let before = slot.books();
        let reading = match probe.read(&uuid) {
            Ok(r) => r,
            Err(e) => {
                if last[i].is_some() {
                    tracing::warn!(gpu = i, "cannot read the driver's memory figures: {e}");
                }
                last[i] = None;
                continue;
            }
        };
        // Memory granted or charged while the driver was read is in the books as well.
        let books = before.spanning(&slot.books());
        let r = vram_core::books::reconcile(&books, &reading);
        let applied = slot.apply_reading(reading.used, &r);
        let changed = last[i]
            .as_ref()
            .is_none_or(|prev| vram_core::books::changed(prev, &r, LOG_STEP));
        if changed {
            log_reading(i, reading.used, &books.created, &r);
        }
        if !applied.at_risk.is_empty() && (changed || applied.newly_at_risk) {
            let names: Vec<String> = applied.at_risk.iter().map(ToString::to_string).collect();
            let culprits: Vec<String> = r.outside_processes.iter().map(describe).collect();
            tracing::warn!(
                gpu = i,
                deficit = %applied.deficit,
                outside_use = %r.outside_use,
                "outside use puts guarantees at risk: {}; outside: [{}]{}; borrowing stopped, \
                 borrowers asked for idle memory",
                names.join(", "),
                culprits.join(", "),
                if r.unattributed > Bytes::ZERO {
                    format!(", {} not attributed to any process", r.unattributed)
                } else {
                    String::new()
                },
            );
        }
        for (conn, bytes) in applied.asks {
            daemon.ask_reclaim(conn, bytes);
        }
        last[i] = Some(r);
    }
}

fn log_reading(gpu: usize, used: Bytes, created: &Bytes, r: &Reconciled) {
    let tenants: Vec<String> = r
        .tenant_outside
        .iter()
        .filter(|(_, b)| *b > Bytes::ZERO)
        .map(|(id, b)| format!("tenant {} {}", id.0, b))
        .collect();
    let outside: Vec<String> = r.outside_processes.iter().map(describe).collect();
    tracing::info!(
        gpu,
        driver_used = %used,
        created = %created,
        outside_use = %r.outside_use,
        unattributed = %r.unattributed,
        "driver's figures: tenants' own [{}], outside processes [{}]",
        tenants.join(", "),
        outside.join(", "),
    );
    if r.surplus > Bytes::ZERO {
        tracing::warn!(
            gpu,
            surplus = %r.surplus,
            "the books hold more than the driver shows in use (imported memory attributed to \
             its importer?); outside figures may be low"
        );
    }
}

fn describe(p: &vram_core::books::OutsideProcess) -> String {
    match p.bytes {
        Some(b) => format!("pid {} `{}` {b}", p.pid, p.name),
        None => format!(
            "pid {} `{}` (its figure unknown to the driver)",
            p.pid, p.name
        ),
    }
}
