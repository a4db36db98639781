//! vramd's Kubernetes DRA kubelet plugin: publishes each GPU the node's daemon serves as a
//! device whose memory is consumable capacity, and turns each claim the scheduler allocated on
//! this node into a tenant the daemon declares (its guarantee what the scheduler gave it) and a
//! CDI spec that makes the pod's processes that tenant. See `docs/kubernetes.md`.
#![forbid(unsafe_code)]

pub mod cdi;
pub mod checkpoint;
pub mod claim;
pub mod daemon;
pub mod grpc;
pub mod plugin;
pub mod quantity;
pub mod slices;
pub mod stand_in;

/// The kubelet's gRPC definitions (`proto/`), compiled at build time.
pub mod proto {
    /// `pluginregistration/v1`: the registration handshake.
    #[allow(clippy::all, missing_docs)]
    pub mod registration {
        tonic::include_proto!("pluginregistration");
    }
    /// `dra/v1`: prepare and unprepare.
    #[allow(clippy::all, missing_docs)]
    pub mod dra {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
    }
}
