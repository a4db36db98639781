//! An in-process stand-in for the parts of the Kubernetes API server's HTTP interface the plugin
//! uses, for tests: ResourceSlices (list with field selectors, create, replace with
//! `resourceVersion` checked, delete) and ResourceClaims (get). Bodies the plugin sends are
//! checked to parse as their k8s-openapi types; errors are `Status` objects, as the API server
//! answers them. It is not a Kubernetes API server: no watch, no validation beyond the types,
//! no authentication.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use axum::extract::{Path as UrlPath, Query, State};
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use k8s_openapi::api::resource::v1::ResourceSlice;
use serde_json::{json, Value};

const SLICES: &str = "/apis/resource.k8s.io/v1/resourceslices";

#[derive(Default)]
struct Store {
    slices: BTreeMap<String, Value>,
    claims: BTreeMap<(String, String), Value>,
    version: u64,
    /// Whether written slices lose the consumable-capacity fields, as an API server without
    /// that feature drops them.
    no_consumable_capacity: bool,
    /// `METHOD PATH?QUERY` of every request, in order.
    requests: Vec<String>,
    /// Claims (namespace, name) whose reads are never answered, as by a server that stalled.
    stalled: std::collections::BTreeSet<(String, String)>,
}

type Shared = Arc<Mutex<Store>>;

fn lock(s: &Shared) -> MutexGuard<'_, Store> {
    s.lock().unwrap_or_else(|p| p.into_inner())
}

/// The stand-in, serving on a loopback port until dropped.
pub struct StandIn {
    pub addr: SocketAddr,
    store: Shared,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

fn status(code: StatusCode, reason: &str, message: String) -> Response {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code.as_u16()
    });
    (code, Json(body)).into_response()
}

fn not_found(what: &str) -> Response {
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        format!("{what} not found"),
    )
}

async fn list_slices(
    State(s): State<Shared>,
    Query(q): Query<BTreeMap<String, String>>,
) -> Response {
    let st = lock(&s);
    // `spec.nodeName=a,spec.driver=b`: every term must hold.
    let terms: Vec<(String, String)> = q
        .get("fieldSelector")
        .map(|f| {
            f.split(',')
                .filter_map(|t| t.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        })
        .unwrap_or_default();
    let items: Vec<&Value> = st
        .slices
        .values()
        .filter(|v| {
            terms.iter().all(|(k, want)| {
                let pointer = format!("/{}", k.replace('.', "/"));
                v.pointer(&pointer).and_then(Value::as_str) == Some(want.as_str())
            })
        })
        .collect();
    Json(json!({
        "kind": "ResourceSliceList", "apiVersion": "resource.k8s.io/v1",
        "metadata": {"resourceVersion": st.version.to_string()}, "items": items
    }))
    .into_response()
}

/// The body as a ResourceSlice the API server would take, or the error it would answer.
fn checked_slice(body: &Value) -> Result<String, Box<Response>> {
    let slice: ResourceSlice = serde_json::from_value(body.clone()).map_err(|e| {
        Box::new(status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            format!("not a ResourceSlice: {e}"),
        ))
    })?;
    if body["apiVersion"] != "resource.k8s.io/v1" || body["kind"] != "ResourceSlice" {
        return Err(Box::new(status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            format!(
                "apiVersion {} kind {}: not resource.k8s.io/v1 ResourceSlice",
                body["apiVersion"], body["kind"]
            ),
        )));
    }
    slice.metadata.name.ok_or_else(|| {
        Box::new(status(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            "metadata.name: Required value".into(),
        ))
    })
}

async fn create_slice(State(s): State<Shared>, Json(mut body): Json<Value>) -> Response {
    let name = match checked_slice(&body) {
        Ok(n) => n,
        Err(r) => return *r,
    };
    let mut st = lock(&s);
    if st.slices.contains_key(&name) {
        return status(
            StatusCode::CONFLICT,
            "AlreadyExists",
            format!("resourceslices.resource.k8s.io \"{name}\" already exists"),
        );
    }
    st.version += 1;
    body["metadata"]["resourceVersion"] = json!(st.version.to_string());
    body["metadata"]["uid"] = json!(format!("slice-uid-{}", st.version));
    if st.no_consumable_capacity {
        drop_consumable_capacity(&mut body);
    }
    st.slices.insert(name, body.clone());
    (StatusCode::CREATED, Json(body)).into_response()
}

async fn replace_slice(
    State(s): State<Shared>,
    UrlPath(name): UrlPath<String>,
    Json(mut body): Json<Value>,
) -> Response {
    match checked_slice(&body) {
        Ok(n) if n == name => {}
        Ok(n) => {
            return status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                format!("the name in the body ({n}) is not the one in the path ({name})"),
            )
        }
        Err(r) => return *r,
    }
    let mut st = lock(&s);
    let Some(current) = st.slices.get(&name).cloned() else {
        return not_found(&format!("resourceslices.resource.k8s.io \"{name}\""));
    };
    if body["metadata"]["resourceVersion"] != current["metadata"]["resourceVersion"] {
        return status(
            StatusCode::CONFLICT,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on resourceslices.resource.k8s.io \"{name}\": the \
                 object has been modified"
            ),
        );
    }
    st.version += 1;
    body["metadata"]["resourceVersion"] = json!(st.version.to_string());
    body["metadata"]["uid"] = current["metadata"]["uid"].clone();
    if st.no_consumable_capacity {
        drop_consumable_capacity(&mut body);
    }
    st.slices.insert(name, body.clone());
    Json(body).into_response()
}

/// What an API server without consumable capacity keeps of a slice's devices.
fn drop_consumable_capacity(slice: &mut Value) {
    let Some(devices) = slice["spec"]["devices"].as_array_mut() else {
        return;
    };
    for d in devices {
        if let Some(d) = d.as_object_mut() {
            d.remove("allowMultipleAllocations");
        }
        if let Some(capacities) = d["capacity"].as_object_mut() {
            for c in capacities.values_mut().filter_map(Value::as_object_mut) {
                c.remove("requestPolicy");
            }
        }
    }
}

async fn delete_slice(State(s): State<Shared>, UrlPath(name): UrlPath<String>) -> Response {
    match lock(&s).slices.remove(&name) {
        Some(v) => Json(v).into_response(),
        None => not_found(&format!("resourceslices.resource.k8s.io \"{name}\"")),
    }
}

async fn get_claim(
    State(s): State<Shared>,
    UrlPath((ns, name)): UrlPath<(String, String)>,
) -> Response {
    let key = (ns, name.clone());
    if lock(&s).stalled.contains(&key) {
        return std::future::pending().await;
    }
    match lock(&s).claims.get(&key) {
        Some(v) => Json(v.clone()).into_response(),
        None => not_found(&format!("resourceclaims.resource.k8s.io \"{name}\"")),
    }
}

async fn fallback(method: Method, uri: Uri) -> Response {
    not_found(&format!("{method} {uri}: the stand-in does not serve it"))
}

impl StandIn {
    /// Starts serving on a free loopback port, on a thread of its own.
    pub fn start() -> StandIn {
        let store: Shared = Arc::default();
        let logged = store.clone();
        let app = Router::new()
            .route(SLICES, get(list_slices).post(create_slice))
            .route(
                &format!("{SLICES}/{{name}}"),
                axum::routing::put(replace_slice).delete(delete_slice),
            )
            .route(
                "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{name}",
                get(get_claim),
            )
            .fallback(fallback)
            .layer(axum::middleware::from_fn(
                move |req: axum::extract::Request, next: axum::middleware::Next| {
                    let line = format!("{} {}", req.method(), req.uri());
                    lock(&logged).requests.push(line);
                    next.run(req)
                },
            ))
            .with_state(store.clone());
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a loopback port");
        std_listener.set_nonblocking(true).expect("nonblocking");
        let addr = std_listener.local_addr().expect("bound");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name("api-stand-in".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a runtime");
                rt.block_on(async move {
                    let listener =
                        tokio::net::TcpListener::from_std(std_listener).expect("a listener");
                    let _ = axum::serve(listener, app)
                        .with_graceful_shutdown(async {
                            let _ = stopped.await;
                        })
                        .await;
                });
            })
            .expect("a thread");
        StandIn {
            addr,
            store,
            stop: Some(stop),
        }
    }

    /// From now on, slices written lose the consumable-capacity fields (`allowMultipleAllocations`
    /// and the request policy), as an API server without consumable capacity drops them.
    pub fn drop_consumable_capacity(&self) {
        lock(&self.store).no_consumable_capacity = true;
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kubeconfig that points a client at the stand-in.
    pub fn write_kubeconfig(&self, path: &Path) -> std::io::Result<()> {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: stand-in\n  cluster:\n    server: \
             {}\nusers:\n- name: plugin\n  user: {{}}\ncontexts:\n- name: stand-in\n  context:\n    \
             cluster: stand-in\n    user: plugin\ncurrent-context: stand-in\n",
            self.url()
        );
        std::fs::write(path, text)
    }

    /// Stores `claim` (a ResourceClaim as JSON) as the API server would return it.
    pub fn put_claim(&self, claim: Value) {
        let ns = claim["metadata"]["namespace"]
            .as_str()
            .unwrap_or("")
            .to_string();
        let name = claim["metadata"]["name"].as_str().unwrap_or("").to_string();
        lock(&self.store).claims.insert((ns, name), claim);
    }

    /// From now on, reads of claim `namespace/name` are never answered.
    pub fn stall_claim(&self, namespace: &str, name: &str) {
        lock(&self.store)
            .stalled
            .insert((namespace.to_string(), name.to_string()));
    }

    /// The ResourceSlices stored now.
    pub fn slices(&self) -> Vec<ResourceSlice> {
        lock(&self.store)
            .slices
            .values()
            .map(|v| serde_json::from_value(v.clone()).expect("checked when stored"))
            .collect()
    }

    /// The requests served so far, `METHOD PATH?QUERY`.
    pub fn requests(&self) -> Vec<String> {
        lock(&self.store).requests.clone()
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        // Not joined: a client that keeps its connection open would hold the graceful
        // shutdown up; the thread ends with it.
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}
