//! The Kubernetes DRA plugin end to end, with this test playing the kubelet and the container
//! runtime: a real `vramd serve --backend host`, the real `vramd-k8s-plugin` binary talking to an
//! in-process stand-in of the API server (`vramd_k8s::stand_in`), the kubelet's registration
//! handshake and prepare/unprepare calls over the plugin's unix sockets, and two "containers"
//! started from the CDI specs the plugin wrote (their environment, their mounts resolved as bind
//! mounts would, libvram.so preloaded). No real cluster is involved.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use common::{wait_until, Daemon, VRAMD};
use serde_json::json;
use tonic::transport::{Channel, Endpoint, Uri};
use vram_core::Bytes;
use vramd_k8s::cdi::Spec;
use vramd_k8s::proto::dra::dra_plugin_client::DraPluginClient;
use vramd_k8s::proto::dra::{
    Claim, NodePrepareResourceResponse, NodePrepareResourcesRequest, NodeUnprepareResourcesRequest,
};
use vramd_k8s::proto::registration::registration_client::RegistrationClient;
use vramd_k8s::proto::registration::{InfoRequest, RegistrationStatus};
use vramd_k8s::stand_in::StandIn;

const NODE: &str = "node-a";
const DRIVER: &str = "vramd.io";
const CONTAINER_SOCKET: &str = "/run/vramd-in-pod/vramd.sock";
const CONTAINER_LIB: &str = "/opt/vramd/libvram.so";

/// A program a pod runs: it takes memory through `vram_alloc`, which it finds only because the
/// runtime preloaded libvram.so (it is not linked against it). One command per line:
/// `alloc MIB` answers `ok` or `refused REASON`; `exit` ends it.
const POD_C: &str = r#"
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
typedef void *(*alloc_fn)(ssize_t, int, void *);
typedef const char *(*err_fn)(void);
int main(void) {
    alloc_fn alloc = (alloc_fn)dlsym(RTLD_DEFAULT, "vram_alloc");
    err_fn err = (err_fn)dlsym(RTLD_DEFAULT, "vram_last_error");
    if (!alloc || !err) { printf("no libvram.so preloaded\n"); return 2; }
    char line[128];
    while (fgets(line, sizeof line, stdin)) {
        long mib;
        if (sscanf(line, "alloc %ld", &mib) == 1) {
            size_t n = (size_t)mib << 20;
            char *p = alloc((ssize_t)n, 0, NULL);
            if (p) { memset(p, 0x5a, n); printf("ok\n"); }
            else printf("refused %s\n", err());
        } else if (strncmp(line, "exit", 4) == 0) {
            return 0;
        }
        fflush(stdout);
    }
    return 0;
}
"#;

/// libvram.so next to the vramd binary, built if `cargo test` has not built it.
fn library() -> PathBuf {
    built(
        "libvram.so",
        &["build", "-p", "vram-ffi", "--lib"],
        "libvram.so",
    )
}

/// The plugin's binary next to the vramd binary, built if `cargo test` has not built it.
fn plugin_binary() -> PathBuf {
    built(
        "vramd-k8s-plugin",
        &["build", "-p", "vramd-k8s", "--bin", "vramd-k8s-plugin"],
        "the plugin",
    )
}

fn built(file: &str, cargo_args: &[&str], what: &str) -> PathBuf {
    static BUILDING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = BUILDING.lock().unwrap_or_else(|p| p.into_inner());
    let dir = Path::new(VRAMD).parent().unwrap();
    let path = dir.join(file);
    if !path.is_file() {
        let mut cargo = Command::new(env!("CARGO"));
        cargo.args(cargo_args);
        if dir.file_name().is_some_and(|n| n == "release") {
            cargo.arg("--release");
        }
        cargo.env("CARGO_TARGET_DIR", dir.parent().unwrap());
        assert!(cargo.status().unwrap().success(), "building {what} failed");
    }
    path
}

fn pod_program(dir: &Path) -> PathBuf {
    let src = dir.join("pod.c");
    std::fs::write(&src, POD_C).unwrap();
    let exe = dir.join("pod");
    let cc = Command::new(std::env::var("CC").unwrap_or_else(|_| "gcc".into()))
        .args(["-O1", "-Wall", "-Werror"])
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .arg("-ldl")
        .status()
        .expect("gcc runs");
    assert!(cc.success(), "gcc failed");
    exe
}

/// The plugin process, its directories and the stand-in it talks to.
struct Node {
    plugin: Child,
    dir: tempfile::TempDir,
    api: StandIn,
}

impl Node {
    fn start(daemon: &Daemon) -> Node {
        let dir = tempfile::Builder::new()
            .prefix("vramd-k8s-")
            .tempdir()
            .unwrap();
        Node::start_in(daemon, dir, StandIn::start())
    }

    /// The plugin started on `dir` (its checkpoint, CDI specs and sockets) against `api`.
    fn start_in(daemon: &Daemon, dir: tempfile::TempDir, api: StandIn) -> Node {
        let kubeconfig = dir.path().join("kubeconfig");
        api.write_kubeconfig(&kubeconfig).unwrap();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.path().join("plugin.log"))
            .unwrap();
        let _ = std::fs::remove_file(dir.path().join("plugins_registry/vramd.io-reg.sock"));
        let plugin = Command::new(plugin_binary())
            .env("KUBECONFIG", &kubeconfig)
            .env("NODE_NAME", NODE)
            .arg("--socket")
            .arg(&daemon.socket)
            .args(["--container-socket", CONTAINER_SOCKET])
            .arg("--library")
            .arg(library())
            .args(["--container-library", CONTAINER_LIB])
            .arg("--cdi-dir")
            .arg(dir.path().join("cdi"))
            .arg("--registrar-dir")
            .arg(dir.path().join("plugins_registry"))
            .arg("--plugin-dir")
            .arg(dir.path().join("plugins/vramd.io"))
            .args(["--resync-ms", "200"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let node = Node { plugin, dir, api };
        let up = wait_until(Duration::from_secs(20), || node.registry_socket().exists());
        assert!(up, "the plugin did not come up:\n{}", node.log());
        node
    }

    /// SIGKILL, then the plugin started again on the same directories, against `daemon`.
    fn restart(mut self, daemon: &Daemon) -> Node {
        let _ = self.plugin.kill();
        let _ = self.plugin.wait();
        // Taken out so that this Node's drop leaves them to the new one.
        let dir = std::mem::replace(&mut self.dir, tempfile::tempdir().unwrap());
        let api = std::mem::replace(&mut self.api, StandIn::start());
        drop(self);
        Node::start_in(daemon, dir, api)
    }

    fn dra_socket(&self) -> PathBuf {
        self.dir.path().join("plugins/vramd.io/dra.sock")
    }

    fn registry_socket(&self) -> PathBuf {
        self.dir.path().join("plugins_registry/vramd.io-reg.sock")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("plugin.log")).unwrap_or_default()
    }

    fn cdi_specs(&self) -> Vec<PathBuf> {
        std::fs::read_dir(self.dir.path().join("cdi"))
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.plugin.kill();
        let _ = self.plugin.wait();
        if std::thread::panicking() {
            eprintln!("--- plugin log ---\n{}", self.log());
        }
    }
}

/// A gRPC channel over a unix socket, as the kubelet dials a plugin.
async fn dial(path: PathBuf) -> Channel {
    Endpoint::try_from("http://kubelet.invalid")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(path).await?,
                ))
            }
        }))
        .await
        .expect("the socket answers")
}

/// A ResourceClaim as the API server returns it once the scheduler allocated it: `memory` of
/// device `device` on this node, with `params` as the claim's opaque configuration.
fn claim(
    name: &str,
    uid: &str,
    device: &str,
    memory: &str,
    params: serde_json::Value,
) -> serde_json::Value {
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "team", "uid": uid, "resourceVersion": "7"},
        "spec": {"devices": {
            "requests": [{"name": "gpu-memory", "exactly": {
                "deviceClassName": DRIVER, "allocationMode": "ExactCount", "count": 1,
                "capacity": {"requests": {"memory": memory}}}}],
            "config": [{"requests": ["gpu-memory"], "opaque": {"driver": DRIVER, "parameters": params}}]
        }},
        "status": {
            "allocation": {
                "devices": {
                    "results": [{"request": "gpu-memory", "driver": DRIVER, "pool": NODE,
                        "device": device, "shareID": format!("share-{uid}"),
                        "consumedCapacity": {"memory": memory}}],
                    "config": [{"source": "FromClaim", "requests": ["gpu-memory"],
                        "opaque": {"driver": DRIVER, "parameters": params}}]
                },
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": [NODE]}]}]}
            },
            "reservedFor": [{"resource": "pods", "name": format!("pod-{name}"), "uid": format!("pod-{uid}")}]
        }
    })
}

fn claim_ref(name: &str, uid: &str) -> Claim {
    Claim {
        namespace: "team".into(),
        uid: uid.into(),
        name: name.into(),
    }
}

/// A container started as the runtime would from a CDI spec: its environment, each path under
/// a mount's container path resolved to the host path the bind mount shows there, and its
/// preload.
struct Container {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Container {
    fn start(exe: &Path, spec: &Spec) -> Container {
        let edits = &spec.devices[0].container_edits;
        let resolve = |value: &str| -> String {
            for m in &edits.mounts {
                if let Some(rest) = value.strip_prefix(&m.container_path) {
                    return format!("{}{rest}", m.host_path);
                }
            }
            value.to_string()
        };
        let mut cmd = Command::new(exe);
        cmd.env_clear();
        for e in &edits.env {
            let (k, v) = e.split_once('=').unwrap();
            cmd.env(k, resolve(v));
        }
        assert!(
            edits.device_nodes.is_empty(),
            "the host backend has no device nodes"
        );
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        Container {
            stdin: child.stdin.take().unwrap(),
            stdout: BufReader::new(child.stdout.take().unwrap()),
            child,
        }
    }

    fn cmd(&mut self, line: &str) -> String {
        writeln!(self.stdin, "{line}").unwrap();
        let mut answer = String::new();
        self.stdout.read_line(&mut answer).unwrap();
        answer.trim().to_string()
    }

    fn exit(mut self) {
        writeln!(self.stdin, "exit").unwrap();
        assert!(self.child.wait().unwrap().success());
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// The kubelet's DRA calls for one claim at a time, on the plugin's endpoint.
struct Kubelet {
    rt: tokio::runtime::Runtime,
    dra: DraPluginClient<Channel>,
}

impl Kubelet {
    fn dial(endpoint: &Path) -> Kubelet {
        let rt = runtime();
        let dra = rt.block_on(async { DraPluginClient::new(dial(endpoint.to_path_buf()).await) });
        Kubelet { rt, dra }
    }

    fn prepare(&mut self, name: &str, uid: &str) -> NodePrepareResourceResponse {
        let request = NodePrepareResourcesRequest {
            claims: vec![claim_ref(name, uid)],
        };
        let mut r = self
            .rt
            .block_on(self.dra.node_prepare_resources(request))
            .unwrap()
            .into_inner();
        r.claims.remove(uid).expect("an answer for the claim")
    }

    /// The claim's error, empty when it was unprepared.
    fn unprepare(&mut self, name: &str, uid: &str) -> String {
        let request = NodeUnprepareResourcesRequest {
            claims: vec![claim_ref(name, uid)],
        };
        let mut r = self
            .rt
            .block_on(self.dra.node_unprepare_resources(request))
            .unwrap()
            .into_inner();
        r.claims.remove(uid).expect("an answer for the claim").error
    }
}

const UID_A: &str = "0a1b2c3d-0000-4000-8000-00000000000a";
const UID_B: &str = "0a1b2c3d-0000-4000-8000-00000000000b";

#[test]
fn the_kubelet_prepares_two_claims_their_pods_are_tenants_and_unprepare_takes_everything_back() {
    let daemon = Daemon::start("capacity = \"8 GiB\"\npriority_reserve = \"0\"\n");
    let node = Node::start(&daemon);
    let rt = runtime();
    let pods = tempfile::tempdir().unwrap();
    let exe = pod_program(pods.path());

    // Registration, as the kubelet's plugin watcher does it.
    let endpoint = rt.block_on(async {
        let mut reg = RegistrationClient::new(dial(node.registry_socket()).await);
        let info = reg.get_info(InfoRequest {}).await.unwrap().into_inner();
        assert_eq!(info.r#type, "DRAPlugin");
        assert_eq!(info.name, DRIVER);
        assert_eq!(info.supported_versions, vec!["v1.DRAPlugin".to_string()]);
        reg.notify_registration_status(RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        })
        .await
        .unwrap();
        PathBuf::from(info.endpoint)
    });
    assert!(endpoint.exists(), "{}", endpoint.display());

    // The node's slice: one device, the daemon's capacity as consumable memory.
    assert!(
        wait_until(Duration::from_secs(10), || !node.api.slices().is_empty()),
        "no ResourceSlice published:\n{}",
        node.log()
    );
    let slice = node.api.slices().remove(0);
    assert_eq!(slice.spec.driver, DRIVER);
    assert_eq!(slice.spec.node_name.as_deref(), Some(NODE));
    let devices = slice.spec.devices.unwrap();
    assert_eq!(devices.len(), 1);
    assert_eq!(devices[0].name, "gpu-0");
    assert_eq!(devices[0].allow_multiple_allocations, Some(true));
    let memory = &devices[0].capacity.as_ref().unwrap()["memory"];
    assert_eq!(memory.value.0, "8Gi");
    let policy = memory.request_policy.as_ref().unwrap();
    assert_eq!(policy.default.as_ref().unwrap().0, "1Gi");
    let attrs = devices[0].attributes.as_ref().unwrap();
    assert_eq!(
        attrs["uuid"].string.as_deref(),
        Some(daemon.status().devices[0].uuid.as_str())
    );
    assert!(attrs.contains_key("productName") && attrs.contains_key("vramdVersion"));

    // Two claims on the one GPU: A was given 512 MiB (its limit), B 1 GiB with a limit of 2 GiB.
    node.api
        .put_claim(claim("a", UID_A, "gpu-0", "512Mi", json!({})));
    // B's priority class is its device class's (the administrators'): a claim may not name it.
    let mut b = claim(
        "b",
        UID_B,
        "gpu-0",
        "1Gi",
        json!({"apiVersion": "vramd.io/v1alpha1", "kind": "MemoryConfig", "limit": "2Gi"}),
    );
    b["status"]["allocation"]["devices"]["config"]
        .as_array_mut()
        .unwrap()
        .push(json!({"source": "FromClass", "requests": ["gpu-memory"],
            "opaque": {"driver": DRIVER, "parameters": {"priorityClass": "high"}}}));
    node.api.put_claim(b);
    let both = vec![claim_ref("a", UID_A), claim_ref("b", UID_B)];
    let mut dra = rt.block_on(async { DraPluginClient::new(dial(endpoint.clone()).await) });
    let prepared = rt
        .block_on(dra.node_prepare_resources(NodePrepareResourcesRequest {
            claims: both.clone(),
        }))
        .unwrap()
        .into_inner();
    for uid in [UID_A, UID_B] {
        let r = &prepared.claims[uid];
        assert_eq!(r.error, "", "{uid}");
        assert_eq!(r.devices.len(), 1);
        assert_eq!(r.devices[0].pool_name, NODE);
        assert_eq!(r.devices[0].device_name, "gpu-0");
        assert_eq!(r.devices[0].request_names, vec!["gpu-memory".to_string()]);
        assert_eq!(
            r.devices[0].cdi_device_ids,
            vec![format!("vramd.io/claim={uid}")]
        );
    }
    // Both guarantees are reserved before any process connects.
    assert_eq!(daemon.status().devices[0].reserved, Bytes::mib(1536));

    // The kubelet retries a prepare: the same answer, nothing doubled.
    let again = rt
        .block_on(dra.node_prepare_resources(NodePrepareResourcesRequest {
            claims: vec![claim_ref("a", UID_A)],
        }))
        .unwrap()
        .into_inner();
    assert_eq!(again.claims[UID_A], prepared.claims[UID_A]);
    assert_eq!(daemon.status().devices[0].reserved, Bytes::mib(1536));

    // The runtime starts one container per claim from the specs.
    let spec = |uid: &str| -> Spec {
        let path = node
            .dir
            .path()
            .join(format!("cdi/vramd.io-claim_{uid}.json"));
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
    };
    let spec_a = spec(UID_A);
    assert!(spec_a.devices[0]
        .container_edits
        .env
        .contains(&format!("LD_PRELOAD={CONTAINER_LIB}")));
    let mut a = Container::start(&exe, &spec_a);
    let mut b = Container::start(&exe, &spec(UID_B));
    assert_eq!(a.cmd("alloc 256"), "ok");
    assert_eq!(b.cmd("alloc 1024"), "ok");
    // A passes its limit: a clean refusal with the numbers, and B goes on, past its guarantee.
    let refused = a.cmd("alloc 512");
    assert!(
        refused.starts_with("refused") && refused.contains("limit"),
        "{refused}"
    );
    assert_eq!(b.cmd("alloc 512"), "ok");
    assert_eq!(a.cmd("alloc 128"), "ok", "A carries on within its limit");
    let st = daemon.status();
    let tenant = |uid: &str| {
        st.tenants
            .iter()
            .find(|t| t.name == format!("k8s-{uid}"))
            .unwrap_or_else(|| panic!("no tenant for {uid}: {:?}", st.tenants))
            .clone()
    };
    let (ta, tb) = (tenant(UID_A), tenant(UID_B));
    assert_eq!((ta.guarantee, ta.limit), (Bytes::mib(512), Bytes::mib(512)));
    assert_eq!((tb.guarantee, tb.limit), (Bytes::gib(1), Bytes::gib(2)));
    assert_eq!(tb.class, "high");
    assert!(
        ta.held >= Bytes::mib(384) && ta.held <= Bytes::mib(512),
        "{ta:?}"
    );
    assert!(tb.held >= Bytes::mib(1536), "{tb:?}");

    // The pods end; the kubelet unprepares: nothing is held or reserved for either.
    a.exit();
    b.exit();
    let done = rt
        .block_on(dra.node_unprepare_resources(NodeUnprepareResourcesRequest {
            claims: both.clone(),
        }))
        .unwrap()
        .into_inner();
    for uid in [UID_A, UID_B] {
        assert_eq!(done.claims[uid].error, "", "{uid}");
    }
    let d = &daemon.status().devices[0];
    assert_eq!((d.held, d.reserved), (Bytes::ZERO, Bytes::ZERO), "{d:?}");
    daemon.wait_for_no_tenants();
    assert!(node.cdi_specs().is_empty(), "{:?}", node.cdi_specs());
    // A retried unprepare is done already.
    let retried = rt
        .block_on(dra.node_unprepare_resources(NodeUnprepareResourcesRequest { claims: both }))
        .unwrap()
        .into_inner();
    assert_eq!(retried.claims[UID_A].error, "");
    assert!(node
        .api
        .requests()
        .iter()
        .any(|r| r.starts_with("GET /apis/resource.k8s.io/v1/namespaces/team/resourceclaims/a")));
}

#[test]
fn bad_claims_and_a_daemon_that_is_down_are_clear_errors_that_leave_nothing_behind() {
    let daemon = Daemon::start("capacity = \"8 GiB\"\npriority_reserve = \"0\"\n");
    let node = Node::start(&daemon);
    let endpoint = node.dra_socket();
    assert!(wait_until(Duration::from_secs(10), || endpoint.exists()));
    let mut kubelet = Kubelet::dial(&endpoint);
    let nothing_left = |what: &str| {
        let d = &daemon.status().devices[0];
        assert_eq!(
            (d.held, d.reserved),
            (Bytes::ZERO, Bytes::ZERO),
            "{what}: {d:?}"
        );
        assert!(
            node.cdi_specs().is_empty(),
            "{what}: {:?}",
            node.cdi_specs()
        );
    };

    node.api
        .put_claim(claim("far", "u-far", "gpu-7", "1Gi", json!({})));
    let e = kubelet.prepare("far", "u-far").error;
    assert!(e.contains("gpu-7") && e.contains("does not serve"), "{e}");
    nothing_left("a GPU the daemon does not serve");

    node.api
        .put_claim(claim("big", "u-big", "gpu-0", "16Gi", json!({})));
    let e = kubelet.prepare("big", "u-big").error;
    assert!(e.contains("16 GiB") && e.contains("8 GiB"), "{e}");
    nothing_left("a claim larger than the device");

    node.api.put_claim(claim(
        "low",
        "u-low",
        "gpu-0",
        "1Gi",
        json!({"limit": "512Mi"}),
    ));
    let e = kubelet.prepare("low", "u-low").error;
    assert!(e.contains("limit 512 MiB"), "{e}");
    nothing_left("a limit below what the claim was given");

    // Two claims the device cannot both guarantee: the daemon refuses the second, with numbers.
    node.api
        .put_claim(claim("six", "u-six", "gpu-0", "6Gi", json!({})));
    node.api
        .put_claim(claim("more", "u-more", "gpu-0", "6Gi", json!({})));
    assert_eq!(kubelet.prepare("six", "u-six").error, "");
    let e = kubelet.prepare("more", "u-more").error;
    assert!(e.contains("6 GiB") && e.contains("capacity 8 GiB"), "{e}");
    assert_eq!(daemon.status().devices[0].reserved, Bytes::gib(6));
    assert_eq!(kubelet.unprepare("six", "u-six"), "");
    nothing_left("after unprepare");

    // The kubelet unprepares a claim whose prepare failed, and one it never got to prepare
    // here: done, with nothing to take back (the pod is not held in Terminating).
    assert_eq!(kubelet.unprepare("more", "u-more"), "");
    assert_eq!(kubelet.unprepare("ghost", "u-ghost"), "");
    nothing_left("after unpreparing claims never prepared");

    // A uid no Kubernetes object has (it would name a file elsewhere) is refused either way.
    for uid in ["../../u-out", ""] {
        let e = kubelet.unprepare("odd", uid);
        assert!(e.contains("its uid is not one Kubernetes gives"), "{e}");
        let e = kubelet.prepare("odd", uid).error;
        assert!(e.contains("its uid is not one Kubernetes gives"), "{e}");
    }

    // A priority class the claim names itself, not its device class: only those the plugin
    // allows claims (`--claim-classes`, by default the daemon's default class).
    node.api.put_claim(claim(
        "vip",
        "u-vip",
        "gpu-0",
        "1Gi",
        json!({"priorityClass": "high"}),
    ));
    let e = kubelet.prepare("vip", "u-vip").error;
    assert!(
        e.contains("names priority class `high`, which claims may not name")
            && e.contains("--claim-classes: normal"),
        "{e}"
    );
    nothing_left("a priority class the claim may not name");
    node.api.put_claim(claim(
        "plain",
        "u-plain",
        "gpu-0",
        "1Gi",
        json!({"priorityClass": "normal"}),
    ));
    assert_eq!(kubelet.prepare("plain", "u-plain").error, "");
    assert_eq!(kubelet.unprepare("plain", "u-plain"), "");
    nothing_left("after unprepare");

    let e = kubelet.prepare("missing", "u-missing").error;
    assert!(e.contains("cannot read claim team/missing"), "{e}");

    // The daemon goes down: a prepare says so and leaves nothing; an unprepare of a prepared
    // claim says so and keeps it prepared (its spec, its checkpoint entry) for the kubelet's
    // retry.
    node.api
        .put_claim(claim("kept", "u-kept", "gpu-0", "1Gi", json!({})));
    assert_eq!(kubelet.prepare("kept", "u-kept").error, "");
    daemon.stop();
    node.api
        .put_claim(claim("late", "u-late", "gpu-0", "1Gi", json!({})));
    let e = kubelet.prepare("late", "u-late").error;
    assert!(e.contains("cannot reach vramd"), "{e}");
    let e = kubelet.unprepare("kept", "u-kept");
    assert!(e.contains("cannot reach vramd"), "{e}");
    // A claim never prepared here is unprepared without the daemon: its pod can go.
    assert_eq!(kubelet.unprepare("late", "u-late"), "");
    let specs = node.cdi_specs();
    assert_eq!(specs.len(), 1, "{specs:?}");
    assert!(specs[0].to_string_lossy().contains("u-kept"), "{specs:?}");
}

#[test]
fn a_plugin_restart_or_a_daemon_restart_loses_no_claim_and_doubles_none() {
    let daemon = Daemon::start("capacity = \"8 GiB\"\npriority_reserve = \"0\"\n");
    let node = Node::start(&daemon);
    node.api
        .put_claim(claim("a", UID_A, "gpu-0", "512Mi", json!({})));
    let prepare = |endpoint: PathBuf| Kubelet::dial(&endpoint).prepare("a", UID_A);
    let first = prepare(node.dra_socket());
    assert_eq!(first.error, "");

    // The plugin is killed and started again: the kubelet's retry gets the same answer. A spec
    // of the plugin's that no prepared claim names (it stopped between writing the spec and its
    // checkpoint) is removed when it starts; the prepared claim's stays.
    let stray = node
        .dir
        .path()
        .join("cdi/vramd.io-claim_ffffffff-0000-4000-8000-00000000000e.json");
    std::fs::write(&stray, "{}").unwrap();
    assert_eq!(node.cdi_specs().len(), 2);
    let node = node.restart(&daemon);
    assert!(wait_until(Duration::from_secs(10), || node
        .dra_socket()
        .exists()));
    assert_eq!(prepare(node.dra_socket()), first);
    assert!(wait_until(Duration::from_secs(10), || !stray.exists()));
    assert_eq!(node.cdi_specs().len(), 1, "{:?}", node.cdi_specs());
    assert_eq!(daemon.status().devices[0].reserved, Bytes::mib(512));

    // A declaration of the plugin's that no prepared claim names (it stopped between declaring
    // and its checkpoint) is withdrawn when it starts; a daemon without the prepared claim's
    // declaration (restarted) gets it again.
    let fresh = Daemon::start("capacity = \"8 GiB\"\npriority_reserve = \"0\"\n");
    let orphan = vram_proto::Declaration {
        name: "k8s-ffffffff-0000-4000-8000-00000000000f".into(),
        gpu: 0,
        class: "normal".into(),
        guarantee: Bytes::gib(1),
        limit: None,
        owners: vec![],
    };
    vram_client::Observer::connect(Some(&fresh.socket))
        .unwrap()
        .declare(&orphan)
        .unwrap();
    let node = node.restart(&fresh);
    let declared = || {
        vram_client::Observer::connect(Some(&fresh.socket))
            .unwrap()
            .declarations()
            .unwrap()
    };
    assert!(
        wait_until(Duration::from_secs(10), || {
            let d = declared();
            d.len() == 1 && d[0].name == format!("k8s-{UID_A}")
        }),
        "{:?}\n{}",
        declared(),
        node.log()
    );
    assert_eq!(fresh.status().devices[0].reserved, Bytes::mib(512));
    assert_eq!(Kubelet::dial(&node.dra_socket()).unprepare("a", UID_A), "");
    assert!(declared().is_empty());
    assert!(node.cdi_specs().is_empty());
}

/// An API server that stops answering holds up only the claim whose read it never answers: other
/// claims are prepared and unprepared meanwhile, and the stalled one fails with the reason
/// within the plugin's limit.
#[test]
fn a_stalled_api_server_read_holds_up_no_other_claim() {
    let daemon = Daemon::start("capacity = \"8 GiB\"\npriority_reserve = \"0\"\n");
    let node = Node::start(&daemon);
    let endpoint = node.dra_socket();
    assert!(wait_until(Duration::from_secs(10), || endpoint.exists()));
    node.api.stall_claim("team", "slow");
    node.api
        .put_claim(claim("quick", "u-quick", "gpu-0", "1Gi", json!({})));
    let stalled = {
        let endpoint = endpoint.clone();
        std::thread::spawn(move || {
            let started = Instant::now();
            let answer = Kubelet::dial(&endpoint).prepare("slow", "u-slow");
            (answer.error, started.elapsed())
        })
    };
    assert!(wait_until(Duration::from_secs(5), || node
        .api
        .requests()
        .iter()
        .any(|r| r.contains("resourceclaims/slow"))));
    // The other claims' calls, on a thread of their own: a call held up would hang the test.
    let (done, answers) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut kubelet = Kubelet::dial(&endpoint);
        let _ = done.send((
            kubelet.prepare("quick", "u-quick").error,
            kubelet.unprepare("quick", "u-quick"),
            kubelet.unprepare("ghost", "u-ghost"),
        ));
    });
    let answers = answers.recv_timeout(Duration::from_secs(5));
    assert_eq!(
        answers,
        Ok((String::new(), String::new(), String::new())),
        "the other claims' calls (none within 5 s: held up by the stalled read)"
    );
    let (error, took) = stalled.join().unwrap();
    assert!(
        error.contains("cannot read claim team/slow") && error.contains("no answer within"),
        "{error}"
    );
    assert!(took < Duration::from_secs(30), "{took:?}");
    assert!(node.cdi_specs().is_empty(), "{:?}", node.cdi_specs());
}

/// A declaration of the plugin's that no prepared claim names while a tenant is connected as it
/// (the checkpoint lost while its pod runs) is not withdrawn under the pod: it goes once the
/// tenant has.
#[test]
fn a_declaration_no_claim_names_is_withdrawn_only_once_its_tenant_is_gone() {
    let daemon = Daemon::start("capacity = \"8 GiB\"\npriority_reserve = \"0\"\n");
    let orphan = vram_proto::Declaration {
        name: "k8s-ffffffff-0000-4000-8000-00000000000f".into(),
        gpu: 0,
        class: "normal".into(),
        guarantee: Bytes::gib(1),
        limit: None,
        owners: vec![],
    };
    let observer = vram_client::Observer::connect(Some(&daemon.socket)).unwrap();
    observer.declare(&orphan).unwrap();
    let tenant = vram_client::Client::connect(
        Some(&daemon.socket),
        &vram_client::TenantOptions::named(&orphan.name),
    )
    .unwrap();
    let node = Node::start(&daemon);
    // Several resyncs (every 200 ms) pass: it stays.
    assert!(wait_until(Duration::from_secs(10), || node
        .log()
        .contains("has a connected tenant: kept")));
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(observer.declarations().unwrap(), vec![orphan.clone()]);
    drop(tenant);
    assert!(
        wait_until(Duration::from_secs(10), || observer
            .declarations()
            .unwrap()
            .is_empty()),
        "{}",
        node.log()
    );
}
