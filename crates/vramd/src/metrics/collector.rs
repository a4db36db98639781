//! Series read from the daemon's status at scrape time: every gauge, and the counters the broker
//! already keeps. A scrape costs one `Daemon::status()` (each device's lock, briefly) and nothing
//! on the grant path.

use std::fmt;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Unit;
use vram_proto::StatusReport;

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
        let report = self.daemon.status();
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
        for a in &mut d.at_risk {
            a.tenant.clear();
        }
        for k in &mut d.kept_offline {
            k.tenant.clear();
        }
    }
    r.shared.buffers_left_out += r.shared.buffers.len() as u64;
    r.shared.buffers.clear();
    r
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

fn encode_report(r: &StatusReport, e: &mut DescriptorEncoder) -> fmt::Result {
    use MetricType::{Counter, Gauge};
    let bytes = Some(&Unit::Bytes);

    let dev = |f: fn(&vram_proto::DeviceStatus) -> u64| {
        r.devices.iter().map(move |d| {
            let labels = [("gpu", d.index.to_string()), ("uuid", d.uuid.clone())];
            (labels, f(d))
        })
    };
    family(
        e,
        "device_capacity",
        "Memory vramd may hand out on the device",
        bytes,
        Gauge,
        dev(|d| d.capacity.get()),
    )?;
    family(
        e,
        "device_held",
        "Memory granted to tenants",
        bytes,
        Gauge,
        dev(|d| d.held.get()),
    )?;
    family(
        e,
        "device_pooled",
        "Memory created ahead of demand and not yet granted",
        bytes,
        Gauge,
        dev(|d| d.pooled.get()),
    )?;
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
        "device_reserved",
        "Guarantees not taken up yet",
        bytes,
        Gauge,
        dev(|d| d.reserved.get()),
    )?;
    family(
        e,
        "device_free",
        "Memory a tenant without a guarantee could still borrow",
        bytes,
        Gauge,
        dev(|d| d.free.get()),
    )?;
    family(
        e,
        "device_used",
        "Physical memory the daemon has created and not released",
        bytes,
        Gauge,
        dev(|d| d.device_used.get()),
    )?;

    family(
        e,
        "device_driver_used",
        "The driver's figure for the device's used memory (NVML), as last read",
        bytes,
        Gauge,
        r.devices.iter().filter_map(|d| {
            let labels = [("gpu", d.index.to_string()), ("uuid", d.uuid.clone())];
            d.driver_used.map(|u| (labels, u.get()))
        }),
    )?;
    family(
        e,
        "device_outside_use",
        "Memory in use that is no tenant's (other processes, what the driver does not attribute): \
         lent to no one",
        bytes,
        Gauge,
        dev(|d| d.outside_use.get()),
    )?;
    family(
        e,
        "device_unattributed",
        "The part of the outside use that no process accounts for",
        bytes,
        Gauge,
        dev(|d| d.unattributed.get()),
    )?;
    family(
        e,
        "device_guarantee_deficit",
        "By how much outside use has grown into memory already promised to tenants",
        bytes,
        Gauge,
        dev(|d| d.deficit.get()),
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

    let ten = |f: fn(&vram_proto::TenantStatus) -> u64| {
        r.tenants
            .iter()
            .map(move |t| (tenant_labels(&t.name, &t.class, t.gpu), f(t)))
    };
    family(
        e,
        "tenant_guarantee",
        "Memory reserved for the tenant",
        bytes,
        Gauge,
        ten(|t| t.guarantee.get()),
    )?;
    family(
        e,
        "tenant_limit",
        "The most the tenant may hold",
        bytes,
        Gauge,
        ten(|t| t.limit.get()),
    )?;
    family(
        e,
        "tenant_held",
        "Memory granted to the tenant",
        bytes,
        Gauge,
        ten(|t| t.held.get()),
    )?;
    family(
        e,
        "tenant_charged",
        "Memory the tenant created itself and charged (a framework's own cuMemCreate)",
        bytes,
        Gauge,
        ten(|t| t.charged.get()),
    )?;
    family(
        e,
        "tenant_outside",
        "What the driver attributes to the tenant's process beyond its charges (its CUDA \
         context, anything not intercepted); counted against its limit",
        bytes,
        Gauge,
        ten(|t| t.outside.get()),
    )?;
    family(
        e,
        "tenant_in_use",
        "Memory the tenant's allocator reports in use",
        bytes,
        Gauge,
        ten(|t| t.in_use.get()),
    )?;
    family(
        e,
        "tenant_cached",
        "Memory the tenant's allocator holds idle (reclaimable)",
        bytes,
        Gauge,
        ten(|t| t.cached.get()),
    )?;
    family(
        e,
        "tenant_handles",
        "Grants (device handles) the tenant holds",
        None,
        Gauge,
        ten(|t| t.handles),
    )?;
    family(
        e,
        "tenant_grants",
        "Grants made to the tenant",
        None,
        Counter,
        ten(|t| t.grants),
    )?;
    family(
        e,
        "tenant_returns",
        "Grants the tenant gave back",
        None,
        Counter,
        ten(|t| t.returns),
    )?;
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

    let none = |v: u64| [([] as [(&str, &str); 0], v)];
    family(
        e,
        "tenants",
        "Connected tenants",
        None,
        Gauge,
        none(r.tenants.len() as u64),
    )?;
    family(
        e,
        "connections",
        "Open connections (tenants and observers)",
        None,
        Gauge,
        none(r.daemon.connections),
    )?;
    family(
        e,
        "protocol_errors",
        "Frames refused (malformed, oversized, wrong version)",
        None,
        Counter,
        none(r.daemon.protocol_errors),
    )?;
    family(
        e,
        "connections_refused",
        "Connections refused at accept (uid not allowed, [connections] caps, out of file \
         descriptors)",
        None,
        Counter,
        none(r.daemon.connections_refused),
    )?;
    family(
        e,
        "log_lines_dropped",
        "Log lines dropped because the daemon's stderr refused them",
        None,
        Counter,
        none(r.daemon.log_lines_dropped),
    )?;
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
