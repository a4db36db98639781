//! The CDI spec written for each prepared claim: what the container runtime adds to each
//! container that uses the claim. The daemon's socket directory (read-only: connecting to a
//! socket needs no write access to its file system), libvram.so, preloaded, the variables that
//! make the process the claim's tenant, and the GPU's device nodes.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use vram_proto::BackendKind;

/// The CDI kind of the devices this plugin writes: `vendor/class`.
pub const KIND: &str = "vramd.io/claim";
const CDI_VERSION: &str = "0.6.0";

/// Where things are on the host and in the container.
#[derive(Debug, Clone)]
pub struct Layout {
    /// Where the runtime reads CDI specs from.
    pub cdi_dir: PathBuf,
    /// The daemon's socket on the host.
    pub socket: PathBuf,
    /// The daemon's socket in the container.
    pub container_socket: PathBuf,
    /// libvram.so on the host.
    pub library: PathBuf,
    /// libvram.so in the container.
    pub container_library: PathBuf,
}

/// A CDI spec file (the parts this plugin writes).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Spec {
    pub cdi_version: String,
    pub kind: String,
    pub devices: Vec<CdiDevice>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CdiDevice {
    pub name: String,
    pub container_edits: ContainerEdits,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerEdits {
    /// `NAME=VALUE`.
    pub env: Vec<String>,
    pub device_nodes: Vec<DeviceNode>,
    pub mounts: Vec<Mount>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceNode {
    pub path: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Mount {
    pub host_path: String,
    pub container_path: String,
    pub options: Vec<String>,
}

/// The fully qualified CDI device id of claim `uid`'s device.
pub fn device_id(uid: &str) -> String {
    format!("{KIND}={uid}")
}

/// The file name of a claim's spec: this prefix, its uid, `.json`.
const SPEC_PREFIX: &str = "vramd.io-claim_";

fn spec_path(layout: &Layout, uid: &str) -> PathBuf {
    layout.cdi_dir.join(format!("{SPEC_PREFIX}{uid}.json"))
}

/// The claims (uids) that have a spec of this plugin's in the CDI directory (none if there is no
/// directory yet).
pub fn claims_with_specs(layout: &Layout) -> std::io::Result<Vec<String>> {
    let entries = match std::fs::read_dir(&layout.cdi_dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut uids = Vec::new();
    for entry in entries {
        let name = entry?.file_name();
        // A write's temporary file left by a stop midway counts as the claim's too.
        let uid = name
            .to_str()
            .and_then(|n| n.strip_prefix(SPEC_PREFIX))
            .and_then(|n| {
                n.strip_suffix(".json")
                    .or_else(|| n.strip_suffix(".json.tmp"))
            });
        if let Some(uid) = uid.filter(|u| !u.is_empty()) {
            uids.push(uid.to_string());
        }
    }
    uids.sort_unstable();
    uids.dedup();
    Ok(uids)
}

/// The spec for claim `uid`: its tenant `tenant` on the daemon's device `gpu`, with the device
/// nodes `nodes`.
pub fn spec(layout: &Layout, uid: &str, tenant: &str, gpu: u32, nodes: &[PathBuf]) -> Spec {
    let dir = |p: &Path| p.parent().unwrap_or(Path::new("/")).display().to_string();
    let lib = layout.container_library.display().to_string();
    Spec {
        cdi_version: CDI_VERSION.into(),
        kind: KIND.into(),
        devices: vec![CdiDevice {
            name: uid.into(),
            container_edits: ContainerEdits {
                env: vec![
                    format!(
                        "{}={}",
                        vram_proto::SOCKET_ENV,
                        layout.container_socket.display()
                    ),
                    format!("{}={tenant}", vram_proto::TENANT_ENV),
                    format!("{}={gpu}", vram_proto::GPU_ENV),
                    format!("LD_PRELOAD={lib}"),
                ],
                device_nodes: nodes
                    .iter()
                    .map(|p| DeviceNode {
                        path: p.display().to_string(),
                    })
                    .collect(),
                mounts: vec![
                    Mount {
                        host_path: dir(&layout.socket),
                        container_path: dir(&layout.container_socket),
                        options: vec!["ro".into(), "rbind".into(), "nosuid".into()],
                    },
                    Mount {
                        host_path: layout.library.display().to_string(),
                        container_path: lib,
                        options: vec!["ro".into(), "bind".into()],
                    },
                ],
            },
        }],
    }
}

/// Writes `spec` for claim `uid` whole (a temporary file renamed over it: a runtime reading the
/// directory never sees half a spec).
pub fn write(layout: &Layout, uid: &str, spec: &Spec) -> std::io::Result<()> {
    std::fs::create_dir_all(&layout.cdi_dir)?;
    let path = spec_path(layout, uid);
    let tmp = path.with_extension("json.tmp");
    std::fs::write(
        &tmp,
        serde_json::to_vec_pretty(spec).expect("a spec serializes"),
    )?;
    std::fs::rename(&tmp, &path)
}

/// Removes claim `uid`'s spec, and a temporary file a write of it left; one already gone is not
/// an error.
pub fn remove(layout: &Layout, uid: &str) -> std::io::Result<()> {
    let path = spec_path(layout, uid);
    for p in [path.with_extension("json.tmp"), path] {
        match std::fs::remove_file(p) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    Ok(())
}

/// Reads claim `uid`'s spec back, if it is there.
pub fn read(layout: &Layout, uid: &str) -> Option<Spec> {
    let text = std::fs::read(spec_path(layout, uid)).ok()?;
    serde_json::from_slice(&text).ok()
}

/// The device nodes a container needs for the daemon's device of `backend` with `uuid`: none on
/// the host backend; on cuda the control and unified-memory nodes and the GPU's own node, whose
/// minor number the NVIDIA driver lists in `/proc/driver/nvidia/gpus/*/information`.
pub fn device_nodes(backend: BackendKind, uuid: &str) -> Result<Vec<PathBuf>, String> {
    if backend != BackendKind::Cuda {
        return Ok(Vec::new());
    }
    let gpus = Path::new("/proc/driver/nvidia/gpus");
    let entries = std::fs::read_dir(gpus).map_err(|e| format!("{}: {e}", gpus.display()))?;
    let mut minor = None;
    for e in entries.flatten() {
        let info = std::fs::read_to_string(e.path().join("information")).unwrap_or_default();
        let field = |name: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(name))
                .map(|v| v.trim_start_matches(':').trim().to_string())
        };
        if field("GPU UUID").is_some_and(|u| u.eq_ignore_ascii_case(uuid)) {
            minor = field("Device Minor");
        }
    }
    let minor = minor.ok_or_else(|| {
        format!(
            "GPU {uuid} is not listed in {}: cannot name its device node",
            gpus.display()
        )
    })?;
    let mut nodes = vec![PathBuf::from(format!("/dev/nvidia{minor}"))];
    for n in ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"] {
        if Path::new(n).exists() {
            nodes.push(n.into());
        }
    }
    Ok(nodes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spec_round_trips_and_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let layout = Layout {
            cdi_dir: dir.path().join("cdi"),
            socket: "/run/vramd/vramd.sock".into(),
            container_socket: "/var/run/vramd/vramd.sock".into(),
            library: "/opt/vramd/libvram.so".into(),
            container_library: "/usr/lib/vramd/libvram.so".into(),
        };
        let s = spec(&layout, "u-1", "k8s-u-1", 1, &["/dev/nvidia1".into()]);
        write(&layout, "u-1", &s).unwrap();
        assert_eq!(read(&layout, "u-1").unwrap(), s);
        let edits = &s.devices[0].container_edits;
        assert!(edits.env.contains(&"VRAMD_GPU=1".to_string()));
        assert!(edits
            .env
            .contains(&"LD_PRELOAD=/usr/lib/vramd/libvram.so".to_string()));
        assert_eq!(edits.mounts[0].host_path, "/run/vramd");
        assert_eq!(edits.mounts[0].container_path, "/var/run/vramd");
        assert_eq!(device_id("u-1"), "vramd.io/claim=u-1");
        std::fs::write(layout.cdi_dir.join("other-vendor.json"), "{}").unwrap();
        assert_eq!(claims_with_specs(&layout).unwrap(), ["u-1"]);
        // A write's temporary file left behind names its claim, and goes with its spec.
        let tmp = spec_path(&layout, "u-1").with_extension("json.tmp");
        std::fs::write(&tmp, "{").unwrap();
        assert_eq!(claims_with_specs(&layout).unwrap(), ["u-1"]);
        remove(&layout, "u-1").unwrap();
        assert!(!tmp.exists());
        remove(&layout, "u-1").unwrap();
        assert!(read(&layout, "u-1").is_none());
        assert!(claims_with_specs(&layout).unwrap().is_empty());
        assert!(device_nodes(BackendKind::Host, "x").unwrap().is_empty());
    }
}
