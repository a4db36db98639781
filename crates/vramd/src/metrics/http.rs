//! The metrics endpoint: `/metrics`, `/healthz` and `/status` over HTTP, served by axum on a
//! thread of its own with a single-threaded tokio runtime, so the daemon's socket server stays
//! plain threads and a slow scraper never touches a tenant's connection. Its connections are
//! bounded in number and idle time (`conn.rs`), and stopping it waits for open ones at most
//! [`STOP_GRACE`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::Context;
use axum::extract::{ConnectInfo, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use prometheus_client::encoding::prometheus_text;
use prometheus_client::registry::Registry;
use tokio::sync::oneshot;
use vram_proto::StatusReport;

use super::collector::{by_class, StatusCollector};
use super::conn::{self, Bounded, Peer};
use super::{Detail, HttpStatus};
use crate::server::{Daemon, Server};

/// How long a stop waits for requests in progress before it closes their connections.
pub const STOP_GRACE: Duration = Duration::from_secs(2);

struct Scrape {
    registry: Registry,
    daemon: Arc<Daemon>,
    detail: Detail,
    /// The port served, to find a local client's connection in the kernel's socket table.
    port: u16,
}

/// A running endpoint. Dropping it stops the endpoint and waits for its thread.
pub struct Exporter {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Exporter {
    /// Binds `addr` (port 0: any free port) and serves `server`'s figures with the detail the
    /// operator chose; turns on the grant and reclaim instruments.
    pub fn start(addr: SocketAddr, server: &Server, detail: Detail) -> anyhow::Result<Exporter> {
        let listener = std::net::TcpListener::bind(addr)
            .with_context(|| format!("cannot listen for metrics on {addr}"))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let daemon = server.daemon().clone();
        let mut registry = Registry::with_prefix("vramd");
        server
            .enable_metrics(detail.tenants)
            .register(&mut registry);
        registry.register_collector(Box::new(StatusCollector {
            daemon: daemon.clone(),
            per_tenant: detail.tenants,
        }));
        let app = Router::new()
            .route("/metrics", get(metrics))
            .route("/healthz", get(|| async { "ok\n" }))
            .route("/status", get(status))
            .with_state(Arc::new(Scrape {
                registry,
                daemon,
                detail,
                port: addr.port(),
            }))
            .into_make_service_with_connect_info::<Peer>();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .context("cannot start the metrics runtime")?;
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("vramd-metrics".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let served = match tokio::net::TcpListener::from_std(listener) {
                        Ok(l) => {
                            let listener = Bounded::new(l, conn::MAX_CONNECTIONS, conn::IDLE);
                            let stopping = Arc::new(tokio::sync::Notify::new());
                            let stop_serving = stopping.clone();
                            let serve =
                                axum::serve(listener, app).with_graceful_shutdown(async move {
                                    stop_serving.notified().await
                                });
                            let mut serve =
                                std::pin::pin!(std::future::IntoFuture::into_future(serve));
                            tokio::select! {
                                served = &mut serve => served,
                                _ = stopped => {
                                    stopping.notify_one();
                                    // A connection that never finishes its request would hold
                                    // the graceful stop, and with it the daemon's exit.
                                    tokio::time::timeout(STOP_GRACE, serve)
                                        .await
                                        .unwrap_or(Ok(()))
                                }
                            }
                        }
                        Err(e) => Err(e),
                    };
                    if let Err(e) = served {
                        tracing::error!(%addr, "metrics endpoint failed: {e}");
                    }
                });
                // Collections in progress on the blocking pool are not waited for past the grace.
                runtime.shutdown_timeout(STOP_GRACE);
            })?;
        Ok(Exporter {
            addr,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// The bound address (the real port when asked for port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn metrics(State(s): State<Arc<Scrape>>) -> Response {
    // Collecting takes the slots' locks: off the runtime's one thread, as for `status`.
    let encoded = tokio::task::spawn_blocking(move || {
        let mut body = String::with_capacity(16 * 1024);
        prometheus_text::encode(&mut body, &s.registry).map(|()| body)
    })
    .await;
    match encoded {
        Ok(Ok(body)) => (
            [(header::CONTENT_TYPE, prometheus_text::CONTENT_TYPE)],
            body,
        )
            .into_response(),
        Ok(Err(_)) | Err(_) => {
            (StatusCode::INTERNAL_SERVER_ERROR, "cannot encode metrics\n").into_response()
        }
    }
}

/// `vramd status`'s document. `http_status = "local"`: only to a client on this host whose uid
/// (the kernel's socket table) is in `allowed_uids`, whole, as the socket gives it. `"any"`:
/// to anyone who reaches the port, less what identifies processes, and tenants summed by class
/// unless `metrics_tenants` is on.
async fn status(
    State(s): State<Arc<Scrape>>,
    ConnectInfo(Peer(peer)): ConnectInfo<Peer>,
) -> Response {
    // The report takes the slots' locks, may read the kernel's socket table and is written out
    // whole: off the runtime's one thread, which also answers `/metrics` and `/healthz`.
    let json = tokio::task::spawn_blocking(move || {
        status_for(&s, peer).and_then(|report| {
            serde_json::to_string_pretty(&report)
                .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")))
        })
    })
    .await;
    match json {
        Ok(Ok(json)) => ([(header::CONTENT_TYPE, "application/json")], json).into_response(),
        Ok(Err(refusal)) => refusal.into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response(),
    }
}

/// The report `peer` may read under `http_status`, or why it may not.
fn status_for(s: &Scrape, peer: SocketAddr) -> Result<StatusReport, (StatusCode, String)> {
    let forbidden = |why: String| {
        Err((
            StatusCode::FORBIDDEN,
            format!(
                "{why}: /status is for the daemon's users on this host (http_status = \"local\")\n"
            ),
        ))
    };
    match s.detail.status {
        HttpStatus::Off => Err((
            StatusCode::NOT_FOUND,
            "/status is off (http_status = \"off\"); `vramd status` on the socket has it\n".into(),
        )),
        HttpStatus::Local => {
            let allowed = s.daemon.settings().allowed_uids.clone();
            match super::peer_uid::local_uid(peer, s.port) {
                Some(uid) if allowed.contains(&uid) => Ok(s.daemon.status()),
                Some(uid) => forbidden(format!("uid {uid} is not in allowed_uids {allowed:?}")),
                None => forbidden(format!(
                    "{peer} is not a connection from this host that the kernel's socket table names"
                )),
            }
        }
        HttpStatus::Any if s.detail.tenants => Ok(without_processes(s.daemon.status())),
        HttpStatus::Any => Ok(by_class(without_processes(s.daemon.status()))),
    }
}

/// The report with every pid, uid and process name blanked (tenants' names stay: they label the
/// metrics too).
pub fn without_processes(mut r: vram_proto::StatusReport) -> vram_proto::StatusReport {
    r.daemon.pid = 0;
    for t in &mut r.tenants {
        t.pid = 0;
        t.uid = 0;
    }
    for d in &mut r.devices {
        for p in &mut d.outside_processes {
            p.pid = 0;
            p.name.clear();
        }
        for k in &mut d.kept_offline {
            k.uid = 0;
        }
    }
    r
}
