//! `vramd-k8s-plugin`: the kubelet plugin of vramd's DRA driver (see `docs/kubernetes.md`).
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use vram_core::Bytes;
use vramd_k8s::cdi::Layout;
use vramd_k8s::daemon::DaemonLink;
use vramd_k8s::grpc::{self, DraService, RegistrationService};
use vramd_k8s::plugin::{Identity, Plugin};
use vramd_k8s::slices::{self, RequestPolicy};

#[derive(Debug, Parser)]
#[command(
    version,
    about = "vramd's Kubernetes DRA kubelet plugin: GPU memory as consumable \
    capacity, each claim a tenant of the node's vramd"
)]
struct Args {
    /// The DRA driver's name (DeviceClass selectors and claims name it).
    #[arg(long, default_value = "vramd.io")]
    driver: String,
    /// This node's name (the downward API's spec.nodeName).
    #[arg(long, env = "NODE_NAME")]
    node_name: String,
    /// The daemon's socket on the host.
    #[arg(long, env = vram_proto::SOCKET_ENV, default_value = vram_proto::DEFAULT_SOCKET)]
    socket: PathBuf,
    /// The daemon's socket as containers see it [default: the host's path].
    #[arg(long)]
    container_socket: Option<PathBuf>,
    /// libvram.so on the host, mounted into each container that uses a claim.
    #[arg(long, default_value = "/var/lib/vramd/lib/libvram.so")]
    library: PathBuf,
    /// Where libvram.so appears in the container (and is preloaded from).
    #[arg(long, default_value = "/opt/vramd/libvram.so")]
    container_library: PathBuf,
    /// Where the container runtime reads CDI specs.
    #[arg(long, default_value = "/var/run/cdi")]
    cdi_dir: PathBuf,
    /// The kubelet's plugin registry directory.
    #[arg(long, default_value = "/var/lib/kubelet/plugins_registry")]
    registrar_dir: PathBuf,
    /// The plugin's own directory (its DRA socket and checkpoint) [default:
    /// /var/lib/kubelet/plugins/DRIVER].
    #[arg(long)]
    plugin_dir: Option<PathBuf>,
    /// How often the ResourceSlice is checked against the daemon's devices and the daemon's
    /// declarations against the checkpoint, in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    resync_ms: u64,
    /// What a request that names no memory gets.
    #[arg(long, default_value = "1GiB")]
    default_request: Bytes,
    /// Every memory request is rounded up to a multiple of this (at least the device's
    /// granularity).
    #[arg(long, default_value = "64MiB")]
    request_step: Bytes,
    /// The daemon's priority classes a claim's own configuration may name, comma-separated. A
    /// DeviceClass's configuration, which the cluster's administrators write, may set any class
    /// and binds the claims of that class; a claim that names a class not listed here is
    /// refused, so that whoever may create a claim does not choose its priority.
    #[arg(long, value_delimiter = ',', default_value = vram_core::broker::Policy::DEFAULT_CLASS)]
    claim_classes: Vec<String>,
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(serve(args))
}

async fn serve(args: Args) -> anyhow::Result<()> {
    let plugin_dir = args
        .plugin_dir
        .clone()
        .unwrap_or_else(|| PathBuf::from("/var/lib/kubelet/plugins").join(&args.driver));
    let id = Identity {
        driver: args.driver.clone(),
        node: args.node_name.clone(),
    };
    let layout = Layout {
        cdi_dir: args.cdi_dir.clone(),
        socket: args.socket.clone(),
        container_socket: args
            .container_socket
            .clone()
            .unwrap_or_else(|| args.socket.clone()),
        library: args.library.clone(),
        container_library: args.container_library.clone(),
    };
    if !layout.library.is_file() {
        tracing::warn!(
            library = %layout.library.display(),
            "libvram.so is not there: containers given a claim would fail to start"
        );
    }
    let kube = kube::Client::try_default()
        .await
        .context("cannot set up the Kubernetes API client (in-cluster or KUBECONFIG)")?;
    let daemon = DaemonLink::new(&args.socket);
    let plugin = Plugin::new(
        id.clone(),
        layout,
        daemon.clone(),
        kube.clone(),
        &plugin_dir.join("checkpoint.json"),
        args.claim_classes.clone(),
    )?;
    if let Err(e) = plugin.reconcile().await {
        tracing::warn!("cannot check the daemon's declarations at start: {e}");
    }

    let dra_path = plugin_dir.join("dra.sock");
    let reg_path = args.registrar_dir.join(format!("{}-reg.sock", args.driver));
    let (dra_socket, dra_file) = grpc::bind(&dra_path)?;
    let (registry, reg_file) = grpc::bind(&reg_path)?;
    let registration = RegistrationService {
        driver: args.driver.clone(),
        endpoint: dra_path.display().to_string(),
    };
    let policy = RequestPolicy {
        default: args.default_request,
        step: args.request_step,
    };
    let period = Duration::from_millis(args.resync_ms.max(100));
    let resync = {
        let plugin = plugin.clone();
        tokio::spawn(async move {
            let mut publisher = slices::Publisher::default();
            loop {
                resync(&plugin, &mut publisher, &kube, &id, policy).await;
                tokio::time::sleep(period).await;
            }
        })
    };
    tracing::info!(
        driver = args.driver, node = args.node_name, registry = %reg_path.display(),
        dra = %dra_path.display(), "serving the kubelet"
    );
    let stop = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    };
    let served = grpc::serve(
        registration,
        DraService { plugin },
        registry,
        dra_socket,
        stop,
    )
    .await;
    resync.abort();
    // Gone from the registry, the kubelet stops calling; the DRA socket goes with it.
    // Only the files bound here: a plugin started since may have its own at the same paths.
    reg_file.remove();
    dra_file.remove();
    tracing::info!("stopped");
    served
}

/// One round of keeping things current: the slice from the daemon's devices, the daemon's
/// declarations from the checkpoint. A daemon that does not answer leaves the slice as it is.
async fn resync(
    plugin: &Plugin,
    publisher: &mut slices::Publisher,
    kube: &kube::Client,
    id: &Identity,
    policy: RequestPolicy,
) {
    let status = match plugin.daemon.status().await {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("the daemon does not answer; the ResourceSlice stays as it is: {e}");
            return;
        }
    };
    match publisher.publish(kube, id, &status, policy).await {
        Ok(slices::Published::Unchanged) => {}
        Ok(p) => tracing::info!(devices = status.devices.len(), "ResourceSlice {p:?}"),
        Err(e) => tracing::warn!("cannot publish the ResourceSlice: {e}"),
    }
    if let Err(e) = plugin.reconcile().await {
        tracing::warn!("cannot check the daemon's declarations: {e}");
    }
}
