//! The status report cut to fit one frame ([`vram_proto::MAX_PAYLOAD`]) when it would not: first
//! shared buffers' access lists (shortened step by step), then whole buffers, then the devices'
//! lists of outside processes and of memory kept offline (to their largest entries; the totals
//! stay), then tenants (those holding least go first), each cut of buffers and tenants counted in
//! the report itself so that a reader knows what it does not see. Metrics' `/status` is served
//! over HTTP whole.

use vram_proto::{payload_len, Reply, StatusReport, MAX_PAYLOAD};

/// Access-list lengths tried, longest first, before buffers are left out.
const ACL_STEPS: [usize; 6] = [1024, 256, 64, 16, 4, 0];

/// What had to be cut, for the log; `None` when the report fit whole.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Cut {
    pub acl_entries: u64,
    pub buffers: u64,
    pub tenants: u64,
}

fn fits(id: u64, report: StatusReport) -> (bool, StatusReport) {
    let reply = Reply::Status(Box::new(report));
    let ok = payload_len(id, &reply).is_ok_and(|n| n <= MAX_PAYLOAD);
    let Reply::Status(report) = reply else {
        unreachable!("built above")
    };
    (ok, *report)
}

/// `report` as the reply to request `id` can carry it, and what was cut.
pub fn fit(id: u64, report: StatusReport) -> (StatusReport, Option<Cut>) {
    let (ok, mut report) = fits(id, report);
    if ok {
        return (report, None);
    }
    let mut cut = Cut::default();
    for keep in ACL_STEPS {
        for b in &mut report.shared.buffers {
            let acl = &mut b.info.acl;
            let keep_readers = keep.min(acl.readers.len());
            let keep_writers = keep.saturating_sub(keep_readers).min(acl.writers.len());
            let dropped = (acl.readers.len() - keep_readers) + (acl.writers.len() - keep_writers);
            acl.readers.truncate(keep_readers);
            acl.writers.truncate(keep_writers);
            let dropped = u32::try_from(dropped).unwrap_or(u32::MAX);
            b.acl_left_out = b.acl_left_out.saturating_add(dropped);
            cut.acl_entries = cut.acl_entries.saturating_add(u64::from(dropped));
        }
        let (ok, r) = fits(id, report);
        report = r;
        if ok {
            return (report, Some(cut));
        }
    }
    while !report.shared.buffers.is_empty() {
        let n = report.shared.buffers.len();
        let drop_n = n.div_ceil(4);
        report.shared.buffers.truncate(n - drop_n);
        report.shared.buffers_left_out += drop_n as u64;
        cut.buffers += drop_n as u64;
        let (ok, r) = fits(id, report);
        report = r;
        if ok {
            return (report, Some(cut));
        }
    }
    // The devices' lists of what no connected tenant holds, before any tenant: their totals
    // (`outside_use`, `kept`) stay whole, and the largest entries stay listed.
    for d in &mut report.devices {
        d.outside_processes.truncate(DEVICE_LIST);
        d.kept_offline.sort_by_key(|k| std::cmp::Reverse(k.bytes));
        d.kept_offline.truncate(DEVICE_LIST);
    }
    let (ok, r) = fits(id, report);
    report = r;
    if ok {
        return (report, Some(cut));
    }
    // Largest holders first, so that those left out matter least.
    report.tenants.sort_by_key(|t| std::cmp::Reverse(t.held));
    while !report.tenants.is_empty() {
        let n = report.tenants.len();
        let drop_n = n.div_ceil(4);
        report.tenants.truncate(n - drop_n);
        report.daemon.tenants_left_out += drop_n as u64;
        cut.tenants += drop_n as u64;
        let (ok, r) = fits(id, report);
        report = r;
        if ok {
            return (report, Some(cut));
        }
    }
    for d in &mut report.devices {
        d.outside_processes.clear();
        d.kept_offline.clear();
        d.at_risk.clear();
    }
    (report, Some(cut))
}

/// Entries of a device's lists of outside processes and of memory kept offline that a cut
/// report keeps (the largest).
const DEVICE_LIST: usize = 16;

#[cfg(test)]
mod tests {
    use vram_core::shared::{Acl, BufferId, BufferInfo, Principal};
    use vram_core::Bytes;
    use vram_proto::{DaemonInfo, SharedBufferStatus, SharedStatus};

    use super::*;

    fn buffer(i: u64, readers: usize) -> SharedBufferStatus {
        SharedBufferStatus {
            gpu: 0,
            info: BufferInfo {
                id: BufferId(i),
                name: format!("b{i}"),
                size: Bytes::mib(2),
                owner: "owner".into(),
                acl: Acl {
                    readers: (0..readers)
                        .map(|r| Principal::Tenant(format!("reader-{r:08}")))
                        .collect(),
                    writers: vec![Principal::Anyone],
                },
                current: None,
                checksum: None,
                lease: None,
                versions: 0,
                pins: 0,
                bytes: Bytes::ZERO,
                publishes: 0,
                corrupt: Vec::new(),
                deleted: false,
            },
            acl_left_out: 0,
        }
    }

    fn report(buffers: Vec<SharedBufferStatus>) -> StatusReport {
        StatusReport {
            daemon: DaemonInfo {
                pid: 1,
                version: "0".into(),
                uptime_seconds: 0.0,
                socket: "/s".into(),
                protocol_errors: 0,
                connections: 0,
                log_lines_dropped: 0,
                connections_refused: 0,
                tenants_left_out: 0,
            },
            devices: Vec::new(),
            tenants: Vec::new(),
            shared: SharedStatus {
                buffers,
                ..SharedStatus::default()
            },
        }
    }

    #[test]
    fn a_report_that_fits_is_untouched() {
        let r = report(vec![buffer(1, 10)]);
        let (out, cut) = fit(1, r.clone());
        assert_eq!((out, cut), (r, None));
    }

    #[test]
    fn long_access_lists_are_cut_and_counted() {
        let (out, cut) = fit(1, report(vec![buffer(1, 12_000), buffer(2, 12_000)]));
        let cut = cut.expect("cut");
        assert!(payload_len(1, &Reply::Status(Box::new(out.clone()))).unwrap() <= MAX_PAYLOAD);
        assert_eq!(out.shared.buffers.len(), 2);
        for b in &out.shared.buffers {
            let shown = b.info.acl.readers.len() + b.info.acl.writers.len();
            assert_eq!(shown + b.acl_left_out as usize, 12_001);
        }
        assert_eq!(cut.buffers, 0);
        assert!(cut.acl_entries > 0);
    }

    /// A device's status and a tenant's, from a slot on the host backend.
    fn device_and_tenant() -> (vram_proto::DeviceStatus, vram_proto::TenantStatus) {
        use std::sync::Arc;
        use vram_core::broker::{Policy, TenantRequest};
        use vram_device::{Device, HostDevice};

        let capacity = Bytes::gib(1);
        let dev: Arc<dyn Device> = Arc::new(HostDevice::new(capacity, Bytes::mib(2)).unwrap());
        let pool = crate::server::pool::Pool::new(
            dev.clone(),
            crate::config::PoolConfig {
                max: Bytes::ZERO,
                sizes: vec![Bytes::mib(2)],
                initial: 0,
            },
        );
        let slot =
            crate::server::slot::Slot::new(0, dev, Policy::with_capacity(capacity), pool).unwrap();
        let req = TenantRequest {
            name: "trainer".into(),
            class: None,
            guarantee: None,
            limit: None,
            pid: std::process::id(),
            uid: 0,
            gids: Vec::new(),
        };
        slot.connect(req, 1, None).unwrap();
        let (device, mut tenants) = slot.status();
        (device, tenants.remove(0))
    }

    #[test]
    fn a_devices_long_lists_are_cut_before_any_tenant() {
        let (mut device, tenant) = device_and_tenant();
        device.kept_offline = (0..5_000u64)
            .map(|i| vram_proto::KeptOffline {
                tenant: format!("{i:064}"),
                uid: 1,
                bytes: Bytes(i),
            })
            .collect();
        let mut r = report(Vec::new());
        r.devices = vec![device];
        r.tenants = vec![tenant];
        let (out, cut) = fit(1, r);
        assert!(cut.is_some());
        assert!(payload_len(1, &Reply::Status(Box::new(out.clone()))).unwrap() <= MAX_PAYLOAD);
        assert_eq!((out.tenants.len(), out.daemon.tenants_left_out), (1, 0));
        let kept = &out.devices[0].kept_offline;
        assert_eq!(kept.len(), DEVICE_LIST);
        assert_eq!(kept[0].bytes, Bytes(4_999), "the largest stay");
    }

    #[test]
    fn too_many_buffers_are_left_out_and_counted() {
        let buffers = (0..20_000).map(|i| buffer(i, 0)).collect();
        let (out, cut) = fit(1, report(buffers));
        let cut = cut.expect("cut");
        assert!(payload_len(1, &Reply::Status(Box::new(out.clone()))).unwrap() <= MAX_PAYLOAD);
        assert_eq!(
            out.shared.buffers.len() as u64 + out.shared.buffers_left_out,
            20_000
        );
        assert_eq!(cut.buffers, out.shared.buffers_left_out);
    }
}
