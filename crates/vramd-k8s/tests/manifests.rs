//! Every manifest under `deploy/kubernetes/` (the plain ones and the examples) parses as the
//! k8s-openapi type its `apiVersion` and `kind` name, and reads back the same: a field the type
//! does not have, or a value of the wrong shape, fails. The Helm chart's templates are not
//! rendered here (there is no Helm in the build); its Chart.yaml and values.yaml are parsed, and
//! every `.Values` path its templates use is checked to exist in values.yaml.

use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaimTemplate};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/kubernetes")
}

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n != "helm") {
                yaml_files(&p, out);
            }
        } else if p.extension().is_some_and(|x| x == "yaml") {
            out.push(p);
        }
    }
}

/// Nulls and empty objects dropped: what a typed round trip cannot tell apart.
fn normalized(v: Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.into_iter()
                .map(|(k, v)| (k, normalized(v)))
                .filter(|(_, v)| !v.is_null())
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.into_iter().map(normalized).collect()),
        other => other,
    }
}

fn round_trip<T: DeserializeOwned + Serialize>(doc: &Value, file: &Path) {
    let typed: T = serde_json::from_value(doc.clone()).unwrap_or_else(|e| {
        panic!(
            "{}: {} {}: {e}",
            file.display(),
            doc["apiVersion"],
            doc["kind"]
        )
    });
    let back = normalized(serde_json::to_value(&typed).unwrap());
    assert_eq!(
        back,
        normalized(doc.clone()),
        "{}: {} does not read back the same (a misspelt or misplaced field?)",
        file.display(),
        doc["kind"]
    );
}

#[test]
fn every_manifest_parses_as_the_kubernetes_type_it_claims_to_be() {
    let mut files = Vec::new();
    yaml_files(&deploy(), &mut files);
    files.sort();
    let mut kinds = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let docs: Vec<Value> = serde_saphyr::from_multiple(&text)
            .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        for doc in docs.into_iter().filter(|d| !d.is_null()) {
            let key = (
                doc["apiVersion"].as_str().unwrap_or("").to_string(),
                doc["kind"].as_str().unwrap_or("").to_string(),
            );
            match (key.0.as_str(), key.1.as_str()) {
                ("v1", "Namespace") => round_trip::<Namespace>(&doc, file),
                ("v1", "ServiceAccount") => round_trip::<ServiceAccount>(&doc, file),
                ("v1", "ConfigMap") => round_trip::<ConfigMap>(&doc, file),
                ("v1", "Pod") => round_trip::<Pod>(&doc, file),
                ("apps/v1", "DaemonSet") => round_trip::<DaemonSet>(&doc, file),
                ("rbac.authorization.k8s.io/v1", "ClusterRole") => {
                    round_trip::<ClusterRole>(&doc, file)
                }
                ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => {
                    round_trip::<ClusterRoleBinding>(&doc, file)
                }
                ("resource.k8s.io/v1", "DeviceClass") => round_trip::<DeviceClass>(&doc, file),
                ("resource.k8s.io/v1", "ResourceClaimTemplate") => {
                    round_trip::<ResourceClaimTemplate>(&doc, file)
                }
                other => panic!("{}: no type checked for {other:?}", file.display()),
            }
            kinds.push(key.1);
        }
    }
    for want in [
        "DaemonSet",
        "ClusterRole",
        "DeviceClass",
        "ResourceClaimTemplate",
        "Pod",
    ] {
        assert!(kinds.iter().any(|k| k == want), "no {want} in {kinds:?}");
    }
    assert_eq!(kinds.iter().filter(|k| *k == "Pod").count(), 2);
}

#[test]
fn the_helm_chart_parses_and_its_templates_use_only_values_it_defines() {
    let chart = deploy().join("helm/vramd");
    let meta: Value =
        serde_saphyr::from_str(&std::fs::read_to_string(chart.join("Chart.yaml")).unwrap())
            .unwrap();
    assert_eq!(meta["apiVersion"], "v2");
    assert_eq!(meta["name"], "vramd");
    let values: Value =
        serde_saphyr::from_str(&std::fs::read_to_string(chart.join("values.yaml")).unwrap())
            .unwrap();
    let mut used = 0;
    for e in std::fs::read_dir(chart.join("templates"))
        .unwrap()
        .flatten()
    {
        let text = std::fs::read_to_string(e.path()).unwrap();
        for (i, _) in text.match_indices(".Values.") {
            let path: String = text[i + ".Values.".len()..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '.' || *c == '_')
                .collect();
            let pointer = format!("/{}", path.trim_end_matches('.').replace('.', "/"));
            assert!(
                values.pointer(&pointer).is_some(),
                "{}: .Values.{path} is not in values.yaml",
                e.path().display()
            );
            used += 1;
        }
    }
    assert!(used > 0);
}

/// The daemon's configuration, as the ConfigMap and the chart's values give it.
fn daemon_configs() -> Vec<(String, String)> {
    let cm: ConfigMap =
        serde_saphyr::from_str(&std::fs::read_to_string(deploy().join("configmap.yaml")).unwrap())
            .unwrap();
    let values: Value = serde_saphyr::from_str(
        &std::fs::read_to_string(deploy().join("helm/vramd/values.yaml")).unwrap(),
    )
    .unwrap();
    vec![
        (
            "configmap.yaml".into(),
            cm.data.unwrap()["vramd.toml"].clone(),
        ),
        (
            "values.yaml".into(),
            values["config"].as_str().unwrap().to_string(),
        ),
    ]
}

/// On a node where the daemon cannot open the GPU (no driver in its container), it stops with
/// the reason: `auto` would serve host memory, published as the node's GPU.
#[test]
fn the_daemon_serves_the_gpu_or_does_not_start() {
    for (file, text) in daemon_configs() {
        let config: toml::Table = toml::from_str(&text).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(
            config.get("backend").and_then(|b| b.as_str()),
            Some("cuda"),
            "{file}"
        );
    }
}

/// The init container installs libvram.so beside the old one and renames it over: a pod that
/// has the old one loaded keeps its pages (a copy over the file would rewrite them under it).
#[test]
fn libvram_is_installed_by_rename_so_running_pods_keep_the_one_they_loaded() {
    let ds: DaemonSet =
        serde_saphyr::from_str(&std::fs::read_to_string(deploy().join("daemonset.yaml")).unwrap())
            .unwrap();
    let init = ds
        .spec
        .unwrap()
        .template
        .spec
        .unwrap()
        .init_containers
        .unwrap();
    let install = init.iter().find(|c| c.name == "install-libvram").unwrap();
    let command = install.command.clone().unwrap();
    let chart =
        std::fs::read_to_string(deploy().join("helm/vramd/templates/daemonset.yaml")).unwrap();
    assert!(
        chart.contains(command.last().unwrap()),
        "the chart installs libvram.so otherwise: {command:?}"
    );
    assert_eq!(&command[..2], ["sh", "-c"], "{command:?}");

    let image = tempfile::tempdir().unwrap();
    let host = tempfile::tempdir().unwrap();
    std::fs::write(image.path().join("libvram.so"), b"new").unwrap();
    std::fs::write(host.path().join("libvram.so"), b"old").unwrap();
    let loaded = std::fs::File::open(host.path().join("libvram.so")).unwrap();
    let script = command[2]
        .replace("/usr/lib/vramd/", &format!("{}/", image.path().display()))
        .replace("/host-lib/", &format!("{}/", host.path().display()));
    let ran = std::process::Command::new("sh")
        .args(["-c", &script])
        .status()
        .unwrap();
    assert!(ran.success(), "{script}");
    let mut kept = String::new();
    std::io::Read::read_to_string(&mut &loaded, &mut kept).unwrap();
    assert_eq!(kept, "old", "the file a pod has open was rewritten");
    assert_eq!(
        std::fs::read(host.path().join("libvram.so")).unwrap(),
        b"new"
    );
    let left: Vec<_> = std::fs::read_dir(host.path()).unwrap().flatten().collect();
    assert_eq!(left.len(), 1, "{left:?}");
}
