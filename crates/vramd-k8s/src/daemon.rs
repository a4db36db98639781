//! The plugin's calls to the daemon: its status (the devices to publish and to check claims
//! against) and the admin calls that declare and withdraw claims' tenants. Each call opens a
//! connection of its own (the daemon may have restarted since the last), on a blocking thread.

use std::path::{Path, PathBuf};

use vram_client::{ClientError, Observer};
use vram_core::Bytes;
use vram_proto::{Declaration, ErrorCode, StatusReport};

/// A failed call to the daemon, as the kubelet's user reads it.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("vramd at {socket}: {source}")]
    Call {
        socket: String,
        #[source]
        source: ClientError,
    },
    #[error("vramd call did not finish: {0}")]
    Join(String),
}

impl DaemonError {
    /// Whether the daemon answered that it has no such declaration.
    pub fn is_not_found(&self) -> bool {
        matches!(self, DaemonError::Call { source: ClientError::Daemon(r), .. } if r.code == ErrorCode::NotFound)
    }
}

/// The daemon at one socket.
#[derive(Debug, Clone)]
pub struct DaemonLink {
    socket: PathBuf,
}

impl DaemonLink {
    pub fn new(socket: &Path) -> DaemonLink {
        DaemonLink {
            socket: socket.to_path_buf(),
        }
    }

    async fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Observer) -> Result<T, ClientError> + Send + 'static,
    ) -> Result<T, DaemonError> {
        let socket = self.socket.clone();
        tokio::task::spawn_blocking(move || {
            Observer::connect(Some(&socket))
                .and_then(|o| f(&o))
                .map_err(|source| DaemonError::Call {
                    socket: socket.display().to_string(),
                    source,
                })
        })
        .await
        .map_err(|e| DaemonError::Join(e.to_string()))?
    }

    pub async fn status(&self) -> Result<StatusReport, DaemonError> {
        self.call(|o| o.status()).await
    }

    /// Declares `d`; whether the daemon changed anything.
    pub async fn declare(&self, d: &Declaration) -> Result<bool, DaemonError> {
        let d = d.clone();
        self.call(move |o| o.declare(&d)).await
    }

    /// Withdraws tenant `name`: what its connections held, now back, and how many were closed.
    pub async fn withdraw(&self, name: &str) -> Result<(Bytes, u32), DaemonError> {
        let name = name.to_string();
        self.call(move |o| o.withdraw(&name)).await
    }

    pub async fn declarations(&self) -> Result<Vec<Declaration>, DaemonError> {
        self.call(|o| o.declarations()).await
    }
}
