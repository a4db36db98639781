//! The node's ResourceSlice: one device per GPU the daemon serves, its memory published as
//! consumable capacity (`allowMultipleAllocations`: the scheduler divides it between claims),
//! kept current with what the daemon measures.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute, DeviceCapacity,
    ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::Api;
use vram_core::Bytes;
use vram_proto::{BackendKind, StatusReport};

use crate::claim::MEMORY;
use crate::plugin::{device_name, Identity};
use crate::quantity;

/// How a claim's memory request is shaped: what a request that names no amount gets, and the
/// step every request is rounded up to.
#[derive(Debug, Clone, Copy)]
pub struct RequestPolicy {
    pub default: Bytes,
    pub step: Bytes,
}

/// The slice's name for this node and driver.
pub fn slice_name(id: &Identity) -> String {
    format!("{}-{}", id.node, id.driver.replace('.', "-"))
}

/// The driver's version on this node, where an NVIDIA driver is loaded.
fn nvidia_driver_version() -> Option<String> {
    let v = std::fs::read_to_string("/sys/module/nvidia/version").ok()?;
    Some(v.trim().to_string()).filter(|v| !v.is_empty())
}

fn string(s: &str) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(s.to_string()),
        ..Default::default()
    }
}

/// The slice for what the daemon serves now (`generation` for the pool).
pub fn desired(
    id: &Identity,
    status: &StatusReport,
    policy: RequestPolicy,
    generation: i64,
) -> ResourceSlice {
    let driver_version = nvidia_driver_version();
    let devices = status
        .devices
        .iter()
        .map(|d| {
            let mut attributes = BTreeMap::from([
                ("uuid".to_string(), string(&d.uuid)),
                ("productName".to_string(), string(&d.name)),
                ("backend".to_string(), string(d.backend.name())),
                (
                    "vramdVersion".to_string(),
                    DeviceAttribute {
                        version: Some(status.daemon.version.clone()),
                        ..Default::default()
                    },
                ),
            ]);
            if let Some(v) = driver_version
                .as_deref()
                .filter(|_| d.backend == BackendKind::Cuda)
            {
                attributes.insert("driverVersion".into(), string(v));
            }
            let step = policy.step.max(d.granularity);
            let default = policy.default.min(d.capacity).max(step);
            let capacity = DeviceCapacity {
                value: Quantity(quantity::format(d.capacity)),
                request_policy: Some(CapacityRequestPolicy {
                    default: Some(Quantity(quantity::format(round_up(default, step)))),
                    valid_range: Some(CapacityRequestPolicyRange {
                        min: Quantity(quantity::format(step)),
                        step: Some(Quantity(quantity::format(step))),
                        max: None,
                    }),
                    valid_values: None,
                }),
            };
            Device {
                name: device_name(d.index),
                attributes: Some(attributes),
                capacity: Some(BTreeMap::from([(MEMORY.to_string(), capacity)])),
                allow_multiple_allocations: Some(true),
                ..Default::default()
            }
        })
        .collect();
    ResourceSlice {
        metadata: kube::api::ObjectMeta {
            name: Some(slice_name(id)),
            ..Default::default()
        },
        spec: ResourceSliceSpec {
            driver: id.driver.clone(),
            node_name: Some(id.node.clone()),
            pool: ResourcePool {
                name: id.node.clone(),
                generation,
                resource_slice_count: 1,
            },
            devices: Some(devices),
            ..Default::default()
        },
    }
}

fn round_up(b: Bytes, step: Bytes) -> Bytes {
    if step == Bytes::ZERO {
        return b;
    }
    Bytes(b.get().div_ceil(step.get()).saturating_mul(step.get()))
}

/// What publishing did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Published {
    Created,
    Updated,
    Unchanged,
}

/// Publishes the node's slice, round after round, remembering what it last wrote: an API server
/// may keep less of a slice than it was sent (one without consumable capacity drops
/// `allowMultipleAllocations` and the request policy), so a slice as read back can differ from
/// the one wanted while being exactly what the last write made of it; that is no change.
#[derive(Debug, Default)]
pub struct Publisher {
    /// The spec last written and the `resourceVersion` the write gave the slice.
    written: Option<(ResourceSliceSpec, Option<String>)>,
}

impl Publisher {
    /// Makes the API server's slices of this node and driver exactly the one for `status`:
    /// created if missing, replaced if it differs from what is wanted (with the pool's generation
    /// one higher), unless it is what this publisher last wrote, unchanged since; others of this
    /// node and driver deleted.
    pub async fn publish(
        &mut self,
        client: &kube::Client,
        id: &Identity,
        status: &StatusReport,
        policy: RequestPolicy,
    ) -> Result<Published, kube::Error> {
        let api: Api<ResourceSlice> = Api::all(client.clone());
        let fields = format!("spec.nodeName={},spec.driver={}", id.node, id.driver);
        let existing = api.list(&ListParams::default().fields(&fields)).await?;
        let name = slice_name(id);
        let mut current = None;
        for s in existing.items {
            if s.metadata.name.as_deref() == Some(name.as_str()) {
                current = Some(s);
            } else if let Some(other) = s.metadata.name.as_deref() {
                api.delete(other, &DeleteParams::default()).await?;
            }
        }
        let (sent, made, published) = match current {
            None => {
                let want = desired(id, status, policy, 1);
                let made = api.create(&PostParams::default(), &want).await?;
                (want.spec, made, Published::Created)
            }
            Some(cur) => {
                let generation = cur.spec.pool.generation;
                let want = desired(id, status, policy, generation);
                let as_written = self.written.as_ref().is_some_and(|(spec, version)| {
                    *spec == want.spec && *version == cur.metadata.resource_version
                });
                if want.spec == cur.spec || as_written {
                    return Ok(Published::Unchanged);
                }
                let mut next = desired(id, status, policy, generation + 1);
                next.metadata.resource_version = cur.metadata.resource_version.clone();
                let made = api.replace(&name, &PostParams::default(), &next).await?;
                (next.spec, made, Published::Updated)
            }
        };
        self.written = Some((sent, made.metadata.resource_version));
        Ok(published)
    }
}
