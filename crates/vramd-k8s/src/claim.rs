//! What the scheduler gave a claim on this node, read from the ResourceClaim as the API server
//! returns it: the device of this driver, the memory consumed from it, and the claim's opaque
//! configuration for this driver (a limit above the request, a priority class, the uids that may
//! connect as its tenant).

use k8s_openapi::api::resource::v1::{DeviceAllocationConfiguration, ResourceClaim};
use serde::Deserialize;
use vram_core::Bytes;

use crate::quantity;

/// The capacity name the plugin publishes and the scheduler divides.
pub const MEMORY: &str = "memory";

/// The `apiVersion` of the opaque configuration this driver reads.
pub const CONFIG_API_VERSION: &str = "vramd.io/v1alpha1";
/// The `kind` of the opaque configuration.
pub const CONFIG_KIND: &str = "MemoryConfig";

/// One claim's allocation on this driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocated {
    pub pool: String,
    pub device: String,
    /// The claim's requests served by this device.
    pub requests: Vec<String>,
    /// The memory the scheduler took from the device's capacity for the claim (`None`: the
    /// allocation names none, so the claim has the whole device).
    pub consumed: Option<Bytes>,
    pub config: MemoryConfig,
}

/// The opaque parameters a claim or its device class gives this driver.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct MemoryConfig {
    #[serde(default)]
    pub api_version: Option<String>,
    #[serde(default)]
    pub kind: Option<String>,
    /// The most the tenant may hold (at least what the scheduler gave it): it borrows above its
    /// guarantee when the device has memory free. Unset: the guarantee.
    #[serde(default)]
    pub limit: Option<String>,
    /// The daemon's priority class for the tenant. Unset: the daemon's default class.
    #[serde(default)]
    pub priority_class: Option<String>,
    /// Whether `priority_class` is the claim's own choice, not its device class's: a claim's
    /// author may name only the classes the plugin allows claims (`--claim-classes`).
    #[serde(skip)]
    pub class_from_claim: bool,
    /// The uids that may connect as the tenant. Unset: any uid the daemon allows.
    #[serde(default)]
    pub uids: Vec<u32>,
}

impl MemoryConfig {
    /// The limit, parsed.
    pub fn limit(&self) -> Result<Option<Bytes>, ClaimError> {
        self.limit
            .as_deref()
            .map(quantity::parse)
            .transpose()
            .map_err(ClaimError::Config)
    }
}

/// Why a claim cannot be prepared from what the API server returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClaimError {
    #[error("claim {claim} is not allocated yet")]
    NotAllocated { claim: String },
    #[error("claim {claim} has no device of driver {driver} in its allocation")]
    NoDevice { claim: String, driver: String },
    #[error("claim {claim}'s device {pool}/{device} is in another pool than this node's ({node})")]
    OtherNode {
        claim: String,
        pool: String,
        device: String,
        node: String,
    },
    #[error(
        "claim {claim} has devices {devices:?} of driver {driver}: one claim may hold memory on \
         one GPU (make one claim per GPU)"
    )]
    SeveralDevices {
        claim: String,
        driver: String,
        devices: Vec<String>,
    },
    #[error("claim {claim}: consumed {name} `{value}`: {source}")]
    Consumed {
        claim: String,
        name: String,
        value: String,
        source: quantity::QuantityError,
    },
    #[error("opaque configuration: {0}")]
    Config(quantity::QuantityError),
    #[error("opaque configuration for {driver}: {message}")]
    BadConfig { driver: String, message: String },
}

/// `claim`'s allocation on `driver` for `node`.
pub fn allocated(claim: &ResourceClaim, driver: &str, node: &str) -> Result<Allocated, ClaimError> {
    let label = format!(
        "{}/{}",
        claim.metadata.namespace.as_deref().unwrap_or(""),
        claim.metadata.name.as_deref().unwrap_or("")
    );
    let devices = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .ok_or_else(|| ClaimError::NotAllocated {
            claim: label.clone(),
        })?;
    let ours: Vec<_> = devices
        .results
        .iter()
        .flatten()
        .filter(|r| r.driver == driver)
        .collect();
    let Some(first) = ours.first() else {
        return Err(ClaimError::NoDevice {
            claim: label,
            driver: driver.into(),
        });
    };
    if ours
        .iter()
        .any(|r| r.pool != first.pool || r.device != first.device)
    {
        let mut names: Vec<String> = ours
            .iter()
            .map(|r| format!("{}/{}", r.pool, r.device))
            .collect();
        names.dedup();
        return Err(ClaimError::SeveralDevices {
            claim: label,
            driver: driver.into(),
            devices: names,
        });
    }
    if first.pool != node {
        return Err(ClaimError::OtherNode {
            claim: label,
            pool: first.pool.clone(),
            device: first.device.clone(),
            node: node.into(),
        });
    }
    // Several requests of one claim on the same device: the memory they consumed together.
    let mut consumed: Option<Bytes> = None;
    for r in &ours {
        let Some(q) = r.consumed_capacity.as_ref().and_then(|c| c.get(MEMORY)) else {
            continue;
        };
        let b = quantity::parse(&q.0).map_err(|source| ClaimError::Consumed {
            claim: label.clone(),
            name: MEMORY.into(),
            value: q.0.clone(),
            source,
        })?;
        consumed = Some(consumed.unwrap_or(Bytes::ZERO).saturating_add(b));
    }
    let requests: Vec<String> = ours.iter().map(|r| r.request.clone()).collect();
    let config = config_for(devices.config.iter().flatten(), driver, &requests)?;
    Ok(Allocated {
        pool: first.pool.clone(),
        device: first.device.clone(),
        requests,
        consumed,
        config,
    })
}

/// The configuration for `driver` that applies to `requests`: the class's first, the claim's
/// over it (a later setting wins, field by field), but for the priority class: one the device
/// class sets is the administrators' and binds the claim, which may not name another.
fn config_for<'a>(
    configs: impl Iterator<Item = &'a DeviceAllocationConfiguration>,
    driver: &str,
    requests: &[String],
) -> Result<MemoryConfig, ClaimError> {
    let mut applicable: Vec<&DeviceAllocationConfiguration> = configs
        .filter(|c| c.opaque.as_ref().is_some_and(|o| o.driver == driver))
        .filter(|c| match &c.requests {
            None => true,
            Some(rs) if rs.is_empty() => true,
            // A request of a claim may be named `request/subrequest`.
            Some(rs) => rs.iter().any(|r| {
                requests
                    .iter()
                    .any(|ours| ours == r || ours.split('/').next() == Some(r.as_str()))
            }),
        })
        .collect();
    applicable.sort_by_key(|c| c.source != "FromClass");
    let mut out = MemoryConfig::default();
    for c in applicable {
        let raw = &c.opaque.as_ref().expect("filtered").parameters.0;
        let bad = |message: String| ClaimError::BadConfig {
            driver: driver.into(),
            message,
        };
        let m: MemoryConfig =
            serde_json::from_value(raw.clone()).map_err(|e| bad(format!("{e} in {raw}")))?;
        if m.api_version
            .as_deref()
            .is_some_and(|v| v != CONFIG_API_VERSION)
            || m.kind.as_deref().is_some_and(|k| k != CONFIG_KIND)
        {
            return Err(bad(format!(
                "apiVersion {:?} kind {:?}; this driver reads apiVersion {CONFIG_API_VERSION} \
                 kind {CONFIG_KIND}",
                m.api_version, m.kind
            )));
        }
        m.limit()?;
        if m.limit.is_some() {
            out.limit = m.limit;
        }
        if let Some(class) = m.priority_class {
            let from_claim = c.source != "FromClass";
            match &out.priority_class {
                Some(set) if from_claim && !out.class_from_claim && *set != class => {
                    return Err(bad(format!(
                        "the claim names priority class `{class}`, but its device class sets `{set}`"
                    )));
                }
                Some(_) if from_claim && !out.class_from_claim => {}
                _ => {
                    out.priority_class = Some(class);
                    out.class_from_claim = from_claim;
                }
            }
        }
        if !m.uids.is_empty() {
            out.uids = m.uids;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(results: serde_json::Value, config: serde_json::Value) -> ResourceClaim {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "c", "namespace": "ns", "uid": "u-1"},
            "spec": {"devices": {"requests": [{"name": "mem", "exactly": {
                "deviceClassName": "vramd.io",
                "capacity": {"requests": {"memory": "4Gi"}}}}]}},
            "status": {"allocation": {"devices": {"results": results, "config": config}}}
        }))
        .unwrap()
    }

    #[test]
    fn the_allocation_and_the_configuration_are_read() {
        let c = claim(
            serde_json::json!([{"request": "mem", "driver": "vramd.io", "pool": "node-a",
                "device": "gpu-0", "consumedCapacity": {"memory": "4Gi"}, "shareID": "s1"}]),
            serde_json::json!([
                {"source": "FromClass", "opaque": {"driver": "vramd.io",
                    "parameters": {"priorityClass": "low", "limit": "5Gi"}}},
                {"source": "FromClaim", "requests": ["mem"], "opaque": {"driver": "vramd.io",
                    "parameters": {"apiVersion": "vramd.io/v1alpha1", "kind": "MemoryConfig",
                        "limit": "6Gi", "uids": [1000]}}},
                {"source": "FromClaim", "opaque": {"driver": "other.example.com",
                    "parameters": {"anything": true}}}
            ]),
        );
        let a = allocated(&c, "vramd.io", "node-a").unwrap();
        assert_eq!(a.device, "gpu-0");
        assert_eq!(a.consumed, Some(Bytes::gib(4)));
        assert_eq!(a.config.limit().unwrap(), Some(Bytes::gib(6)));
        assert_eq!(a.config.priority_class.as_deref(), Some("low"));
        assert!(!a.config.class_from_claim);
        assert_eq!(a.config.uids, vec![1000]);
    }

    #[test]
    fn a_priority_class_its_device_class_sets_binds_the_claim() {
        let results = serde_json::json!([{"request": "mem", "driver": "vramd.io",
            "pool": "node-a", "device": "gpu-0"}]);
        let config = |source: &str, class: &str| {
            serde_json::json!({"source": source, "opaque": {"driver": "vramd.io",
                "parameters": {"priorityClass": class}}})
        };
        let read = |configs: Vec<serde_json::Value>| {
            allocated(
                &claim(results.clone(), serde_json::Value::Array(configs)),
                "vramd.io",
                "node-a",
            )
        };
        // The claim's own: said so, for the plugin to check against what claims may name.
        let own = read(vec![config("FromClaim", "high")]).unwrap().config;
        assert_eq!(own.priority_class.as_deref(), Some("high"));
        assert!(own.class_from_claim);
        // The device class's, and the claim naming the same: the class's.
        let same = read(vec![config("FromClaim", "low"), config("FromClass", "low")]);
        let same = same.unwrap().config;
        assert_eq!(same.priority_class.as_deref(), Some("low"));
        assert!(!same.class_from_claim);
        // Another than its device class's: refused, whatever the order they are listed in.
        let e = read(vec![
            config("FromClaim", "high"),
            config("FromClass", "low"),
        ])
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("names priority class `high`, but its device class sets `low`"),
            "{e}"
        );
    }

    #[test]
    fn claims_that_cannot_be_served_here_say_why() {
        let one = |pool: &str| {
            serde_json::json!([{"request": "mem", "driver": "vramd.io", "pool": pool,
                "device": "gpu-0", "consumedCapacity": {"memory": "4Gi"}}])
        };
        let e = allocated(
            &claim(one("node-b"), serde_json::json!([])),
            "vramd.io",
            "node-a",
        );
        assert!(matches!(e, Err(ClaimError::OtherNode { .. })), "{e:?}");
        let e = allocated(
            &claim(one("node-a"), serde_json::json!([])),
            "x.io",
            "node-a",
        );
        assert!(matches!(e, Err(ClaimError::NoDevice { .. })), "{e:?}");
        let two = serde_json::json!([
            {"request": "a", "driver": "vramd.io", "pool": "node-a", "device": "gpu-0"},
            {"request": "b", "driver": "vramd.io", "pool": "node-a", "device": "gpu-1"}]);
        let e = allocated(&claim(two, serde_json::json!([])), "vramd.io", "node-a");
        assert!(matches!(e, Err(ClaimError::SeveralDevices { .. })), "{e:?}");
        let bad = serde_json::json!([{"source": "FromClaim", "opaque": {"driver": "vramd.io",
            "parameters": {"limt": "6Gi"}}}]);
        let e = allocated(&claim(one("node-a"), bad), "vramd.io", "node-a").unwrap_err();
        assert!(e.to_string().contains("limt"), "{e}");
        let mut c = claim(one("node-a"), serde_json::json!([]));
        c.status = None;
        assert!(matches!(
            allocated(&c, "vramd.io", "node-a"),
            Err(ClaimError::NotAllocated { .. })
        ));
    }
}
