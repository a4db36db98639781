//! The kubelet's gRPC services, as tonic serves them on the plugin's unix sockets: plugin
//! registration on the kubelet's registry socket, DRA v1 on the plugin's own.

use std::path::Path;
use std::sync::Arc;

use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};

use crate::plugin::{ClaimRef, Plugin};
use crate::proto::dra::{
    dra_plugin_server::{DraPlugin, DraPluginServer},
    Device, NodePrepareResourceResponse, NodePrepareResourcesRequest, NodePrepareResourcesResponse,
    NodeUnprepareResourceResponse, NodeUnprepareResourcesRequest, NodeUnprepareResourcesResponse,
};
use crate::proto::registration::{
    registration_server::{Registration, RegistrationServer},
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};

/// The service version the plugin serves, as the kubelet names it in registration.
pub const DRA_SERVICE: &str = "v1.DRAPlugin";

/// Answers the kubelet's registration handshake.
pub struct RegistrationService {
    pub driver: String,
    /// The DRA socket, as the kubelet reaches it.
    pub endpoint: String,
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(PluginInfo {
            r#type: "DRAPlugin".into(),
            name: self.driver.clone(),
            endpoint: self.endpoint.clone(),
            supported_versions: vec![DRA_SERVICE.into()],
        }))
    }

    async fn notify_registration_status(
        &self,
        r: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let r = r.into_inner();
        if r.plugin_registered {
            tracing::info!(driver = self.driver, "registered with the kubelet");
        } else {
            tracing::error!(
                driver = self.driver,
                "the kubelet refused the registration: {}",
                r.error
            );
        }
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

/// Serves the kubelet's prepare and unprepare calls.
pub struct DraService {
    pub plugin: Arc<Plugin>,
}

fn claim_ref(c: crate::proto::dra::Claim) -> ClaimRef {
    ClaimRef {
        namespace: c.namespace,
        uid: c.uid,
        name: c.name,
    }
}

#[tonic::async_trait]
impl DraPlugin for DraService {
    async fn node_prepare_resources(
        &self,
        r: Request<NodePrepareResourcesRequest>,
    ) -> Result<Response<NodePrepareResourcesResponse>, Status> {
        let plugin = self.plugin.clone();
        let asked = r.into_inner().claims;
        to_the_end(async move {
            let mut claims = std::collections::HashMap::new();
            for c in asked.into_iter().map(claim_ref) {
                claims.insert(c.uid.clone(), prepare(&plugin, &c).await);
            }
            NodePrepareResourcesResponse { claims }
        })
        .await
    }

    async fn node_unprepare_resources(
        &self,
        r: Request<NodeUnprepareResourcesRequest>,
    ) -> Result<Response<NodeUnprepareResourcesResponse>, Status> {
        let plugin = self.plugin.clone();
        let asked = r.into_inner().claims;
        to_the_end(async move {
            let mut claims = std::collections::HashMap::new();
            for c in asked.into_iter().map(claim_ref) {
                let error = match plugin.unprepare(&c).await {
                    Ok(()) => String::new(),
                    Err(e) => {
                        tracing::warn!(claim = %c, "unprepare failed: {e}");
                        e
                    }
                };
                claims.insert(c.uid, NodeUnprepareResourceResponse { error });
            }
            NodeUnprepareResourcesResponse { claims }
        })
        .await
    }
}

/// Runs a call's work in a task of its own, to its end: the kubelet gives up waiting after its
/// deadline, which drops the call's future, and a claim's work dropped midway would leave its
/// checkpoint write running unlocked (a later call's write could then land before it and be
/// lost) or a tenant withdrawn with its claim still checkpointed.
async fn to_the_end<T: Send + 'static>(
    work: impl std::future::Future<Output = T> + Send + 'static,
) -> Result<Response<T>, Status> {
    tokio::spawn(work)
        .await
        .map(Response::new)
        .map_err(|e| Status::internal(format!("the plugin's work on the call failed: {e}")))
}

/// Prepares one claim: its devices, or the error in the claim's answer.
async fn prepare(plugin: &Plugin, c: &ClaimRef) -> NodePrepareResourceResponse {
    match plugin.prepare(c).await {
        Ok(devices) => NodePrepareResourceResponse {
            devices: devices
                .into_iter()
                .map(|d| Device {
                    request_names: d.requests,
                    pool_name: d.pool,
                    device_name: d.device,
                    cdi_device_ids: d.cdi_device_ids,
                })
                .collect(),
            error: String::new(),
        },
        Err(error) => {
            tracing::warn!(claim = %c, "prepare failed: {error}");
            NodePrepareResourceResponse {
                devices: Vec::new(),
                error,
            }
        }
    }
}

/// A unix socket at `path`, replacing what a plugin before left there, and its file.
pub fn bind(path: &Path) -> anyhow::Result<(UnixListener, Bound)> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            anyhow::bail!("cannot remove the old socket {}: {e}", path.display())
        }
        _ => {}
    }
    let listener = UnixListener::bind(path)
        .map_err(|e| anyhow::anyhow!("cannot bind {}: {e}", path.display()))?;
    let inode = identity(path)
        .ok_or_else(|| anyhow::anyhow!("cannot read back the socket {}", path.display()))?;
    let bound = Bound {
        path: path.to_path_buf(),
        inode,
    };
    Ok((listener, bound))
}

/// The file of a socket this plugin bound (its path, device and inode).
#[derive(Debug)]
pub struct Bound {
    path: std::path::PathBuf,
    inode: (u64, u64),
}

impl Bound {
    /// Removes the socket's file if it is still the one bound here: a plugin started after this
    /// one (an update that starts the new pod first) has replaced it with its own, which stays.
    pub fn remove(&self) {
        if identity(&self.path) == Some(self.inode) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

fn identity(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

/// Serves registration on `registry` and DRA on `dra` until `stop` resolves.
pub async fn serve(
    registration: RegistrationService,
    dra: DraService,
    registry: UnixListener,
    dra_socket: UnixListener,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let (tx, rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let dra_server = tonic::transport::Server::builder()
        .add_service(DraPluginServer::new(dra))
        .serve_with_incoming_shutdown(UnixListenerStream::new(dra_socket), stopped(rx.clone()));
    let reg_server = tonic::transport::Server::builder()
        .add_service(RegistrationServer::new(registration))
        .serve_with_incoming_shutdown(UnixListenerStream::new(registry), stopped(rx));
    tokio::spawn(async move {
        stop.await;
        let _ = tx.send(true);
    });
    let (a, b) = tokio::join!(dra_server, reg_server);
    a?;
    b?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A socket's file is removed at stop only while it is the one bound here: a plugin started
    /// since has its own file at the path, which stays.
    #[tokio::test]
    async fn a_socket_replaced_by_another_plugin_is_not_removed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dra.sock");
        let (_first, first) = bind(&path).unwrap();
        let (_second, second) = bind(&path).unwrap();
        first.remove();
        assert!(path.exists(), "the later plugin's socket stays");
        second.remove();
        assert!(!path.exists());
    }
}
