//! Series read from the daemon's status at scrape time: every gauge, and the counters the broker
//! already keeps. A scrape costs one `Daemon::status()` (each device's lock, briefly) and nothing
//! on the grant path.

use std::fmt;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Unit;
use vram_core::broker::AtRisk;
use vram_core::Bytes;
use vram_proto::{DeviceStatus, OutsideProcess, StatusReport, TenantStatus};
use MetricType::{Counter, Gauge};

use super::{tenant_labels, TenantLabels};
use crate::server::Daemon;

pub struct StatusCollector {
    pub daemon: Arc<Daemon>,
    /// Series per tenant, by name; otherwise summed by class ([`by_class`]).
    pub per_tenant: bool,
}

impl fmt::Debug for StatusCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("StatusCollector")
    }
}

impl Collector for StatusCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        // The metrics show no access list: none is copied.
        let report = self.daemon.status_with(0);
        let report = if self.per_tenant {
            report
        } else {
            by_class(report)
        };
        encode_report(&report, &mut encoder)
    }
}

/// The report with its tenants summed by class and device, under an empty name, and every tenant
/// name elsewhere in it blanked: for readers who may see the devices' figures but not who uses
/// them (`metrics_tenants = false`). Shared buffers are left out (their names and owners are the
/// tenants'), and counted.
pub fn by_class(mut r: StatusReport) -> StatusReport {
    let mut sums: std::collections::BTreeMap<(u32, String), vram_proto::TenantStatus> =
        std::collections::BTreeMap::new();
    for t in std::mem::take(&mut r.tenants) {
        let key = (t.gpu, t.class.clone());
        let s = sums.entry(key).or_insert_with(|| vram_proto::TenantStatus {
            id: 0,
            name: String::new(),
            pid: 0,
            uid: 0,
            refusals: Default::default(),
            handles: 0,
            grants: 0,
            returns: 0,
            guarantee: vram_core::Bytes::ZERO,
            limit: vram_core::Bytes::ZERO,
            held: vram_core::Bytes::ZERO,
            charged: vram_core::Bytes::ZERO,
            outside: vram_core::Bytes::ZERO,
            kept: vram_core::Bytes::ZERO,
            in_use: vram_core::Bytes::ZERO,
            cached: vram_core::Bytes::ZERO,
            ..t.clone()
        });
        s.guarantee += t.guarantee;
        s.limit = s.limit.saturating_add(t.limit);
        s.held += t.held;
        s.charged += t.charged;
        s.outside += t.outside;
        s.kept += t.kept;
        s.in_use += t.in_use;
        s.cached += t.cached;
        s.handles += t.handles;
        s.grants += t.grants;
        s.returns += t.returns;
        for (reason, n) in t.refusals {
            *s.refusals.entry(reason).or_default() += n;
        }
    }
    r.tenants = sums.into_values().collect();
    for d in &mut r.devices {
        d.at_risk = at_risk_summed(std::mem::take(&mut d.at_risk));
        d.outside_processes = outside_summed(std::mem::take(&mut d.outside_processes));
        for k in &mut d.kept_offline {
            k.tenant.clear();
        }
    }
    r.shared.buffers_left_out += r.shared.buffers.len() as u64;
    r.shared.buffers.clear();
    r
}

/// A device's guarantees at risk as one entry without a name: entries per tenant with their
/// names blanked would be series with the same labels, which a scrape cannot tell apart.
fn at_risk_summed(at_risk: Vec<AtRisk>) -> Vec<AtRisk> {
    if at_risk.is_empty() {
        return at_risk;
    }
    let sum = |f: fn(&AtRisk) -> Bytes| at_risk.iter().map(f).sum();
    vec![AtRisk {
        tenant: String::new(),
        guarantee: sum(|a| a.guarantee),
        unfilled: sum(|a| a.unfilled),
    }]
}

/// A device's processes outside vramd as one entry without a pid or name (see
/// [`at_risk_summed`]); who they are is for `vramd status`, not for whoever reaches the port.
fn outside_summed(processes: Vec<OutsideProcess>) -> Vec<OutsideProcess> {
    if processes.is_empty() {
        return processes;
    }
    vec![OutsideProcess {
        pid: 0,
        name: String::new(),
        bytes: processes.iter().map(|p| p.bytes).sum(),
    }]
}

/// One family: its descriptor, then one sample per label set.
fn family<L: EncodeLabelSet>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    kind: MetricType,
    samples: impl IntoIterator<Item = (L, u64)>,
) -> fmt::Result {
    let mut metric = encoder.encode_descriptor(name, help, unit, kind)?;
    for (labels, value) in samples {
        let mut sample = metric.encode_family(&labels)?;
        match kind {
            MetricType::Counter => sample.encode_counter::<NoLabelSet, u64, u64>(&value, None)?,
            _ => sample.encode_gauge(&value)?,
        }
    }
    Ok(())
}

/// A family with one sample per device, per tenant or per daemon, read from the report: its
/// name, help text, whether it counts bytes, its type, and the figure.
struct Series<T> {
    name: &'static str,
    help: &'static str,
    bytes: bool,
    kind: MetricType,
    value: fn(&T) -> u64,
}

impl<T> Series<T> {
    fn encode<'a, L: EncodeLabelSet>(
        &self,
        e: &mut DescriptorEncoder,
        items: impl IntoIterator<Item = (L, &'a T)>,
    ) -> fmt::Result
    where
        T: 'a,
    {
        let unit = self.bytes.then_some(&Unit::Bytes);
        let samples = items.into_iter().map(|(l, t)| (l, (self.value)(t)));
        family(e, self.name, self.help, unit, self.kind, samples)
    }
}

const DEVICE_SERIES: &[Series<DeviceStatus>] = &[
    Series {
        name: "device_capacity",
        help: "Memory vramd may hand out on the device",
        bytes: true,
        kind: Gauge,
        value: |d| d.capacity.get(),
    },
    Series {
        name: "device_held",
        help: "Memory granted to tenants",
        bytes: true,
        kind: Gauge,
        value: |d| d.held.get(),
    },
    Series {
        name: "device_pooled",
        help: "Memory created ahead of demand and not yet granted",
        bytes: true,
        kind: Gauge,
        value: |d| d.pooled.get(),
    },
    Series {
        name: "device_reserved",
        help: "Guarantees not taken up yet",
        bytes: true,
        kind: Gauge,
        value: |d| d.reserved.get(),
    },
    Series {
        name: "device_free",
        help: "Memory a tenant without a guarantee could still borrow",
        bytes: true,
        kind: Gauge,
        value: |d| d.free.get(),
    },
    Series {
        name: "device_used",
        help: "Physical memory the daemon has created and not released",
        bytes: true,
        kind: Gauge,
        value: |d| d.device_used.get(),
    },
    Series {
        name: "device_outside_use",
        help: "Memory in use that is no tenant's (other processes, what the driver does not \
               attribute): lent to no one",
        bytes: true,
        kind: Gauge,
        value: |d| d.outside_use.get(),
    },
    Series {
        name: "device_unattributed",
        help: "The part of the outside use that no process accounts for",
        bytes: true,
        kind: Gauge,
        value: |d| d.unattributed.get(),
    },
    Series {
        name: "device_guarantee_deficit",
        help: "By how much outside use has grown into memory already promised to tenants",
        bytes: true,
        kind: Gauge,
        value: |d| d.deficit.get(),
    },
];

const TENANT_SERIES: &[Series<TenantStatus>] = &[
    Series {
        name: "tenant_guarantee",
        help: "Memory reserved for the tenant",
        bytes: true,
        kind: Gauge,
        value: |t| t.guarantee.get(),
    },
    Series {
        name: "tenant_limit",
        help: "The most the tenant may hold",
        bytes: true,
        kind: Gauge,
        value: |t| t.limit.get(),
    },
    Series {
        name: "tenant_held",
        help: "Memory granted to the tenant",
        bytes: true,
        kind: Gauge,
        value: |t| t.held.get(),
    },
    Series {
        name: "tenant_charged",
        help: "Memory the tenant created itself and charged (a framework's own cuMemCreate)",
        bytes: true,
        kind: Gauge,
        value: |t| t.charged.get(),
    },
    Series {
        name: "tenant_outside",
        help: "What the driver attributes to the tenant's process beyond its charges (its CUDA \
               context, anything not intercepted); counted against its limit",
        bytes: true,
        kind: Gauge,
        value: |t| t.outside.get(),
    },
    Series {
        name: "tenant_in_use",
        help: "Memory the tenant's allocator reports in use",
        bytes: true,
        kind: Gauge,
        value: |t| t.in_use.get(),
    },
    Series {
        name: "tenant_cached",
        help: "Memory the tenant's allocator holds idle (reclaimable)",
        bytes: true,
        kind: Gauge,
        value: |t| t.cached.get(),
    },
    Series {
        name: "tenant_handles",
        help: "Grants (device handles) the tenant holds",
        bytes: false,
        kind: Gauge,
        value: |t| t.handles,
    },
    Series {
        name: "tenant_grants",
        help: "Grants made to the tenant",
        bytes: false,
        kind: Counter,
        value: |t| t.grants,
    },
    Series {
        name: "tenant_returns",
        help: "Grants the tenant gave back",
        bytes: false,
        kind: Counter,
        value: |t| t.returns,
    },
];

const DAEMON_SERIES: &[Series<StatusReport>] = &[
    Series {
        name: "tenants",
        help: "Connected tenants",
        bytes: false,
        kind: Gauge,
        value: |r| r.tenants.len() as u64,
    },
    Series {
        name: "connections",
        help: "Open connections (tenants and observers)",
        bytes: false,
        kind: Gauge,
        value: |r| r.daemon.connections,
    },
    Series {
        name: "protocol_errors",
        help: "Frames refused (malformed, oversized, wrong version)",
        bytes: false,
        kind: Counter,
        value: |r| r.daemon.protocol_errors,
    },
    Series {
        name: "connections_refused",
        help: "Connections refused at accept (uid not allowed, [connections] caps, out of file \
               descriptors)",
        bytes: false,
        kind: Counter,
        value: |r| r.daemon.connections_refused,
    },
    Series {
        name: "log_lines_dropped",
        help: "Log lines dropped because the daemon's stderr refused them",
        bytes: false,
        kind: Counter,
        value: |r| r.daemon.log_lines_dropped,
    },
];

fn encode_report(r: &StatusReport, e: &mut DescriptorEncoder) -> fmt::Result {
    let bytes = Some(&Unit::Bytes);
    let device_labels = |d: &DeviceStatus| [("gpu", d.index.to_string()), ("uuid", d.uuid.clone())];
    for series in DEVICE_SERIES {
        series.encode(e, r.devices.iter().map(|d| (device_labels(d), d)))?;
    }
    let takes = r.devices.iter().flat_map(|d| {
        let p = d.pool;
        [
            ("hit", p.hits),
            ("recycled", p.recycled),
            ("miss", p.misses),
        ]
        .map(|(source, n)| {
            let labels = [
                ("gpu", d.index.to_string()),
                ("uuid", d.uuid.clone()),
                ("source", source.to_string()),
            ];
            (labels, n)
        })
    });
    family(
        e,
        "pool_takes",
        "Handles taken for grants, by source: hit (made ahead of demand), recycled (given back \
         earlier by the same tenant), miss (made on the grant's path: a create and an export)",
        None,
        Counter,
        takes,
    )?;
    family(
        e,
        "device_driver_used",
        "The driver's figure for the device's used memory (NVML), as last read",
        bytes,
        Gauge,
        r.devices
            .iter()
            .filter_map(|d| d.driver_used.map(|u| (device_labels(d), u.get()))),
    )?;
    let outside = r.devices.iter().flat_map(|d| {
        d.outside_processes.iter().map(move |p| {
            let labels = [
                ("gpu", d.index.to_string()),
                ("pid", p.pid.to_string()),
                ("process", p.name.clone()),
            ];
            (labels, p.bytes.get())
        })
    });
    family(
        e,
        "outside_process",
        "Memory a process that is not a tenant uses on the device",
        bytes,
        Gauge,
        outside,
    )?;
    let at_risk = r.devices.iter().flat_map(|d| {
        d.at_risk.iter().map(move |a| {
            let labels = [("gpu", d.index.to_string()), ("tenant", a.tenant.clone())];
            (labels, a.unfilled.get())
        })
    });
    family(
        e,
        "guarantee_at_risk",
        "The part of a tenant's guarantee the device cannot meet while outside use lasts",
        bytes,
        Gauge,
        at_risk,
    )?;

    for series in TENANT_SERIES {
        let tenants = r.tenants.iter();
        series.encode(
            e,
            tenants.map(|t| (tenant_labels(&t.name, &t.class, t.gpu), t)),
        )?;
    }
    let refusals = r.tenants.iter().flat_map(|t| {
        t.refusals.iter().map(|(reason, n)| {
            let [a, b, c]: TenantLabels = tenant_labels(&t.name, &t.class, t.gpu);
            ([a, b, c, ("reason", reason.clone())], *n)
        })
    });
    family(
        e,
        "tenant_refusals",
        "Allocations refused to the tenant, by the daemon or by its own library, by reason \
         (over_limit, device_full, priority_reserve, ...)",
        None,
        Counter,
        refusals,
    )?;

    for series in DAEMON_SERIES {
        series.encode(e, [([] as [(&str, &str); 0], r)])?;
    }
    encode_shared(r, e)?;
    let mut info = e.encode_descriptor("build", "The daemon's version", None, MetricType::Info)?;
    info.encode_info(&[("version", r.daemon.version.as_str())])?;
    Ok(())
}

/// The shared buffers: per-GPU gauges of what they hold, and the daemon-wide counters of publish,
/// conflicts, expired leases and the scrub.
fn encode_shared(r: &StatusReport, e: &mut DescriptorEncoder) -> fmt::Result {
    use MetricType::{Counter, Gauge};
    let bytes = Some(&Unit::Bytes);
    let s = &r.shared;
    // One sample per device, zero where it has no buffer, so that the series exist from the start.
    let per_gpu = |f: fn(&vram_proto::SharedBufferStatus) -> u64| {
        r.devices.iter().map(move |d| {
            let total = s
                .buffers
                .iter()
                .filter(|b| b.gpu == d.index)
                .map(f)
                .sum::<u64>();
            (
                [("gpu", d.index.to_string()), ("uuid", d.uuid.clone())],
                total,
            )
        })
    };
    family(
        e,
        "shared_buffers",
        "Shared buffers (deleted ones still pinned by readers excluded)",
        None,
        Gauge,
        per_gpu(|b| u64::from(!b.info.deleted)),
    )?;
    family(
        e,
        "shared_versions",
        "Versions of shared buffers holding memory: current, pinned old ones, drafts",
        None,
        Gauge,
        per_gpu(|b| u64::from(b.info.versions)),
    )?;
    family(
        e,
        "shared",
        "Memory held by shared-buffer versions (counted once, however many readers map it)",
        bytes,
        Gauge,
        per_gpu(|b| b.info.bytes.get()),
    )?;
    family(
        e,
        "shared_pins",
        "Readers' pins on shared-buffer versions",
        None,
        Gauge,
        per_gpu(|b| b.info.pins),
    )?;
    family(
        e,
        "shared_corrupt_versions",
        "Published versions still held whose bytes no longer match their checksum",
        None,
        Gauge,
        per_gpu(|b| b.info.corrupt.len() as u64),
    )?;

    let none = |v: u64| [([] as [(&str, &str); 0], v)];
    family(
        e,
        "shared_publishes",
        "Versions published",
        None,
        Counter,
        none(s.publishes),
    )?;
    family(
        e,
        "shared_publish",
        "Bytes checksummed at publish",
        bytes,
        Counter,
        none(s.publish_bytes),
    )?;
    family(
        e,
        "shared_conflicts",
        "Writer conflicts refused (lease held, lease lost, stale base)",
        None,
        Counter,
        none(s.conflicts),
    )?;
    family(
        e,
        "shared_leases_expired",
        "Writer leases that ran out unrenewed (their drafts discarded)",
        None,
        Counter,
        none(s.leases_expired),
    )?;
    family(
        e,
        "shared_scrub_rate",
        "The scrub's configured rate, bytes per second (0: off)",
        Some(&Unit::Other("bytes_per_second".into())),
        Gauge,
        none(s.scrub.rate),
    )?;
    family(
        e,
        "shared_scrub",
        "Bytes the scrub re-checksummed",
        bytes,
        Counter,
        none(s.scrub.bytes),
    )?;
    family(
        e,
        "shared_scrub_passes",
        "Scrub passes over every published version",
        None,
        Counter,
        none(s.scrub.passes),
    )?;
    family(
        e,
        "shared_scrub_versions",
        "Versions the scrub re-checksummed",
        None,
        Counter,
        none(s.scrub.versions),
    )?;
    family(
        e,
        "shared_scrub_mismatches",
        "Published versions found changed since publish (by the scrub or a verify on request)",
        None,
        Counter,
        none(s.scrub.mismatches),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summed_by_class_a_device_has_one_at_risk_and_one_outside_entry() {
        let risk = |t: &str, g, u| AtRisk {
            tenant: t.into(),
            guarantee: Bytes::gib(g),
            unfilled: Bytes::gib(u),
        };
        let summed = at_risk_summed(vec![risk("a", 4, 1), risk("b", 6, 2)]);
        assert_eq!(summed, vec![risk("", 10, 3)]);
        assert!(at_risk_summed(Vec::new()).is_empty());
        let outside = |pid, name: &str, g| OutsideProcess {
            pid,
            name: name.into(),
            bytes: Bytes::gib(g),
        };
        let summed = outside_summed(vec![outside(7, "hog", 3), outside(9, "other", 2)]);
        assert_eq!(summed, vec![outside(0, "", 5)]);
        assert!(outside_summed(Vec::new()).is_empty());
    }
}
