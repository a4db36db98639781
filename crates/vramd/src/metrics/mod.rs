//! Prometheus metrics. Two kinds, so that the grant path pays almost nothing:
//!
//! - Figures the daemon already keeps (bytes per device and tenant, grants, returns, refusals,
//!   protocol errors) are read from [`Daemon::status`](crate::server::Daemon::status) at scrape
//!   time by a collector (`collector.rs`); the grant path does no extra work for them.
//! - What nothing else records — the grant latency histogram and the reclaim counters — lives in
//!   [`Instruments`], updated from `server/` through a few hooks. Each session looks up its own
//!   histogram once, at registration, so a grant costs one clock read and one uncontended lock.
//!
//! [`http`] serves them at `/metrics` (Prometheus text), with `/healthz` and `/status` (the JSON of
//! `vramd status --json`), on its own thread and single-threaded runtime.

mod collector;
mod conn;
pub mod http;
mod peer_uid;

use std::net::SocketAddr;
use std::str::FromStr;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

pub use collector::by_class;
pub use http::{without_processes, Exporter};

/// Where `serve` exposes metrics: `--metrics ADDR`, or `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(try_from = "String")]
pub enum MetricsAddr {
    Off,
    At(SocketAddr),
}

impl MetricsAddr {
    /// Loopback only: the endpoints are read-only but name every tenant.
    pub const DEFAULT: MetricsAddr = MetricsAddr::At(SocketAddr::V4(std::net::SocketAddrV4::new(
        std::net::Ipv4Addr::LOCALHOST,
        9464,
    )));
}

impl FromStr for MetricsAddr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.eq_ignore_ascii_case("off") {
            return Ok(MetricsAddr::Off);
        }
        s.parse().map(MetricsAddr::At).map_err(|_| {
            format!(
                "`{s}` is neither `off` nor an address like 127.0.0.1:9464 (port 0: any free port)"
            )
        })
    }
}

impl TryFrom<String> for MetricsAddr {
    type Error = String;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

/// What the HTTP endpoint shows beyond the devices' figures: the operator's choice
/// (`metrics_tenants`, `http_status` in the configuration).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Detail {
    /// Series per tenant, by name; otherwise summed by class.
    pub tenants: bool,
    pub status: HttpStatus,
}

/// Who may read `/status` over HTTP.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HttpStatus {
    /// Connections from this host whose uid is in `allowed_uids`, as for the socket.
    #[default]
    Local,
    Any,
    Off,
}

/// Labels of every per-tenant series: `tenant`, `class`, `gpu`.
pub type TenantLabels = [(&'static str, String); 3];

pub fn tenant_labels(tenant: &str, class: &str, gpu: u32) -> TenantLabels {
    [
        ("tenant", tenant.to_string()),
        ("class", class.to_string()),
        ("gpu", gpu.to_string()),
    ]
}

/// Bucket bounds of the grant latency, in seconds: from a pooled handle handed over on the host
/// backend (tens of microseconds) to a grant that waited out a reclaim (the default deadline is
/// 250 ms) or created and exported a large CUDA handle.
const GRANT_BUCKETS: [f64; 16] = [
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3,
    500e-3, 1.0, 2.5,
];

fn grant_histogram() -> Histogram {
    Histogram::new(GRANT_BUCKETS)
}

/// Whether a grant that waited on a reclaim got its memory.
pub type OutcomeLabels = [(&'static str, &'static str); 1];

const OUTCOMES: [&str; 2] = ["satisfied", "short"];

/// What the grant and reclaim paths record. Clones share the same series.
#[derive(Debug, Clone)]
pub struct Instruments {
    /// Whether series are per tenant (else per class: the tenant label is empty).
    per_tenant: bool,
    grant_seconds: Family<TenantLabels, Histogram, fn() -> Histogram>,
    reclaim_requests: Counter,
    reclaim_answers: Counter,
    reclaim_returned_bytes: Counter,
    reclaim_outcomes: Family<OutcomeLabels, Counter>,
}

impl Instruments {
    /// Instruments with series per tenant or summed by class.
    pub fn new(per_tenant: bool) -> Self {
        Instruments {
            per_tenant,
            ..Instruments::default()
        }
    }

    /// The labels of tenant `name`'s series: its name only where per-tenant series are on.
    pub fn labels(&self, name: &str, class: &str, gpu: u32) -> TenantLabels {
        tenant_labels(if self.per_tenant { name } else { "" }, class, gpu)
    }
}

impl Default for Instruments {
    fn default() -> Self {
        let reclaim_outcomes: Family<OutcomeLabels, Counter> = Family::default();
        // Both outcomes exist from the start, at 0, so that rates over them are defined.
        for outcome in OUTCOMES {
            reclaim_outcomes.get_or_create_owned(&[("outcome", outcome)]);
        }
        Instruments {
            per_tenant: true,
            grant_seconds: Family::new_with_constructor(grant_histogram),
            reclaim_requests: Counter::default(),
            reclaim_answers: Counter::default(),
            reclaim_returned_bytes: Counter::default(),
            reclaim_outcomes,
        }
    }
}

impl Instruments {
    /// The tenant's grant latency histogram, to keep for the session's life.
    pub fn grant_histogram(&self, labels: &TenantLabels) -> Histogram {
        self.grant_seconds.get_or_create_owned(labels)
    }

    /// The tenant is gone: its series go with it, as its status figures do (a class's series
    /// stay).
    pub fn forget(&self, labels: &TenantLabels) {
        if self.per_tenant {
            self.grant_seconds.remove(labels);
        }
    }

    /// A tenant was asked to give back idle memory.
    pub fn reclaim_asked(&self) {
        self.reclaim_requests.inc();
    }

    /// A tenant answered a reclaim request, having returned `bytes`.
    pub fn reclaim_answered(&self, bytes: u64) {
        self.reclaim_answers.inc();
        self.reclaim_returned_bytes.inc_by(bytes);
    }

    /// A grant that waited on reclaim requests got its memory (`satisfied`) or did not.
    pub fn reclaim_settled(&self, satisfied: bool) {
        let outcome = OUTCOMES[usize::from(!satisfied)];
        self.reclaim_outcomes
            .get_or_create(&[("outcome", outcome)])
            .inc();
    }

    fn register(&self, registry: &mut Registry) {
        registry.register_with_unit(
            "tenant_grant_duration",
            "Time the daemon took to decide and hand over a grant (granted requests only), \
             including any wait for reclaimed memory",
            Unit::Seconds,
            self.grant_seconds.clone(),
        );
        registry.register(
            "reclaim_requests",
            "Requests sent to tenants to give back idle memory",
            self.reclaim_requests.clone(),
        );
        registry.register(
            "reclaim_answers",
            "Reclaim requests tenants answered",
            self.reclaim_answers.clone(),
        );
        registry.register_with_unit(
            "reclaim_returned",
            "Memory tenants gave back in answer to reclaim requests",
            Unit::Bytes,
            self.reclaim_returned_bytes.clone(),
        );
        registry.register(
            "reclaim_outcomes",
            "Grants that waited on reclaim requests, by outcome: satisfied (granted) or short \
             (the deadline passed without enough memory coming back)",
            self.reclaim_outcomes.clone(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse() {
        assert_eq!("off".parse::<MetricsAddr>(), Ok(MetricsAddr::Off));
        assert_eq!(
            "127.0.0.1:9464".parse::<MetricsAddr>(),
            Ok(MetricsAddr::DEFAULT)
        );
        assert!(matches!(
            "[::1]:0".parse::<MetricsAddr>(),
            Ok(MetricsAddr::At(a)) if a.port() == 0
        ));
        let e = "localhost".parse::<MetricsAddr>().unwrap_err();
        assert!(e.contains("localhost"), "{e}");
    }
}
