//! vramd under a real Ray cluster: two nodes on loopback (a head and a worker raylet started with
//! `ray start`), each with its own daemon on the host backend, and actors and tasks asking for
//! memory through `vramd.ray.options` on them (`tests/ray/two_nodes.py`, which makes the checks
//! and prints them): Ray places by the memory each node's `vramd ray-resources` reported, each
//! daemon enforces what its actors asked for (plain `@ray.remote` actors given
//! `**vramd.ray.options(...)` as well as `vramd.ray.remote`'s), killed actors' memory is back
//! within 1 s, ten tasks in a row on a reused worker (plain Ray functions with `.options(**...)`
//! too) are ten tenants that start with nothing, a task with `torch_mode="pool"` gets libvram.so
//! preloaded and the allocator installed at `import torch` (a stand-in torch),
//! `vramd.ray.become_tenant` works outside Ray, and bad input (larger than any node, more than the
//! daemon can give, a daemon that is down) ends in a clear message rather than a hang.
//!
//! Needs Ray for Python 3 (`.ci/run` installs it); without it the test says `skipped` and why.

mod common;

use std::path::Path;
use std::process::Command;

use common::{library, vramd_stdout, Daemon, VRAMD};

/// What `.ci/run` installs, and what docs/ray.md was checked against.
const RAY: &str = "ray==2.60.0";

fn ray_missing() -> Option<String> {
    let out = Command::new("python3")
        .args(["-c", "import ray; print(ray.__version__)"])
        .output();
    match out {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(
            String::from_utf8_lossy(&o.stderr)
                .lines()
                .last()
                .unwrap_or("no output")
                .to_string(),
        ),
        Err(e) => Some(format!("python3: {e}")),
    }
}

fn resources(socket: &Path) -> serde_json::Value {
    let out = vramd_stdout(&[
        "ray-resources".as_ref(),
        "--socket".as_ref(),
        socket.as_os_str(),
    ]);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("`{out}`: {e}"))
}

#[test]
fn ray_places_by_each_nodes_memory_and_each_daemon_enforces_it() {
    if let Some(why) = ray_missing() {
        println!(
            "skipped: Ray is not installed for python3 (`python3 -m pip install '{RAY}'`): {why}"
        );
        return;
    }
    let lib = library().expect("libvram.so builds");
    let bin = lib.parent().unwrap();
    // The head's daemon keeps 1 GiB for a declared tenant: it offers 3 GiB; the worker's 2 GiB.
    let head = Daemon::start(
        "capacity = \"4 GiB\"\n[tenants.reserved]\nclass = \"normal\"\nguarantee = \"1 GiB\"\n",
    );
    let worker = Daemon::start("capacity = \"2 GiB\"\n");
    let (head_res, worker_res) = (resources(&head.socket), resources(&worker.socket));
    assert_eq!(head_res, serde_json::json!({"vramd_memory_mib": 3072}));
    assert_eq!(worker_res, serde_json::json!({"vramd_memory_mib": 2048}));

    // The package as a user installs it (pip, from the repository's python/).
    let tmp = tempfile::Builder::new().prefix("vrt-").tempdir().unwrap();
    let site = tmp.path().join("site");
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    // From a copy, so that pip's build leaves nothing in the repository.
    let src = tmp.path().join("python");
    let cp = Command::new("cp")
        .arg("-r")
        .arg(repo.join("python"))
        .arg(&src)
        .status()
        .unwrap();
    assert!(cp.success());
    let pip = Command::new("python3")
        .args(["-m", "pip", "install", "--quiet", "--no-deps", "--target"])
        .arg(&site)
        .arg(&src)
        .output()
        .unwrap();
    assert!(
        pip.status.success(),
        "pip install ./python failed:\n{}",
        String::from_utf8_lossy(&pip.stderr)
    );

    // libvram.so is found next to `vramd` on PATH, as docs/ray.md says.
    assert_eq!(Path::new(VRAMD).parent(), Some(bin));
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/ray/two_nodes.py");
    let out = Command::new("timeout")
        .arg("400")
        .arg("python3")
        .arg(&script)
        .arg(&head.socket)
        .arg(&worker.socket)
        .arg(head_res.to_string())
        .arg(worker_res.to_string())
        .arg(worker.pid().to_string())
        .arg(tmp.path())
        .env("PATH", path)
        .env("PYTHONPATH", &site)
        // Ray keeps per-user state (an auth token) under ~/.ray: a user's own Ray session must
        // not be this cluster's.
        .env("HOME", tmp.path())
        .env_remove("VRAMD_LIB")
        .env_remove("VRAMD_SOCKET")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "the Ray checks failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("ok: done"), "{stdout}\n{stderr}");
}
