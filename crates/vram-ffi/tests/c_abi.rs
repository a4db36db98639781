//! Builds `tests/c/stress.c` against libvram.so with gcc and runs it against a real daemon.

use std::path::{Path, PathBuf};
use std::process::Command;

use vram_core::Bytes;

mod common;

/// The directory cargo put libvram.so in (this test runs from `target/<profile>/deps`), or, for
/// a bundle run on a machine without cargo (`.gpu/run` copies the library into the project's
/// `target/release`), that directory.
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let beside = exe.parent().unwrap().parent().unwrap().to_path_buf();
    let project = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/release");
    let no_cargo = !Path::new(env!("CARGO")).exists();
    if no_cargo && !beside.join("libvram.so").exists() && project.join("libvram.so").exists() {
        return project;
    }
    beside
}

/// libvram.so, built for this test's profile. `cargo test` builds the library as an rlib only,
/// so the shared object is built here once if it is missing.
fn ensure_lib(lib: &Path) {
    static BUILT: std::sync::Mutex<bool> = std::sync::Mutex::new(false);
    let mut built = BUILT.lock().unwrap_or_else(|p| p.into_inner());
    if *built || lib.join("libvram.so").exists() {
        *built = true;
        return;
    }
    let release = lib.file_name().is_some_and(|n| n == "release");
    let mut cargo = Command::new(env!("CARGO"));
    cargo.args(["build", "-p", "vram-ffi", "--lib"]);
    if release {
        cargo.arg("--release");
    }
    // The target directory is the one above `debug/` or `release/`.
    cargo.env("CARGO_TARGET_DIR", lib.parent().unwrap());
    let status = cargo.status().expect("cargo runs");
    assert!(status.success(), "building libvram.so failed");
    assert!(
        lib.join("libvram.so").exists(),
        "libvram.so not in {}",
        lib.display()
    );
    *built = true;
}

/// Builds `tests/c/{name}.c` against libvram.so into `out`.
fn build(name: &str, out: &Path) -> PathBuf {
    let lib = lib_dir();
    ensure_lib(&lib);
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let exe = out.join(name);
    let cc = Command::new(std::env::var("CC").unwrap_or_else(|_| "gcc".into()))
        .args(["-O1", "-Wall", "-Werror", "-pthread", "-I"])
        .arg(manifest.join("include"))
        .arg(manifest.join(format!("tests/c/{name}.c")))
        .arg("-o")
        .arg(&exe)
        .arg(format!("-L{}", lib.display()))
        .arg("-lvram")
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .status()
        .expect("gcc runs");
    assert!(cc.success(), "gcc failed");
    exe
}

#[test]
fn c_program_uses_the_allocator_from_several_threads() {
    let out = tempfile::tempdir().unwrap();
    let exe = build("stress", out.path());

    let daemon = common::Daemon::start(Bytes::gib(64));
    let run = Command::new(&exe)
        .env("VRAMD_SOCKET", &daemon.socket)
        .env("VRAMD_TENANT", "c-stress")
        .env("VRAMD_LIMIT", "8GiB")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "stress failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains("refused as expected: vramd: tenant `c-stress`"),
        "{stdout}"
    );
    assert!(stdout.contains("failures: 0"), "{stdout}");
}

#[test]
fn c_program_writes_publishes_pins_and_waits_on_a_shared_buffer() {
    let out = tempfile::tempdir().unwrap();
    let exe = build("shared", out.path());
    let daemon = common::Daemon::start(Bytes::gib(8));
    let run = Command::new(&exe)
        .env("VRAMD_SOCKET", &daemon.socket)
        .env("VRAMD_TENANT", "c-shared")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "shared.c failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains("conflict as expected: vramd: shared buffer `c-weights`: the write started from version none but the current version is 1"),
        "{stdout}"
    );
    assert!(stdout.contains("shared: ok, v1 then v2"), "{stdout}");
}

#[test]
fn c_program_gets_cuda_runtime_allocations_from_vramd_in_pool_mode() {
    use std::io::{BufRead, Write};
    let out = tempfile::tempdir().unwrap();
    let exe = build("interpose", out.path());
    let daemon = common::Daemon::start(Bytes::gib(8));
    let mut child = Command::new(&exe)
        .env("VRAMD_SOCKET", &daemon.socket)
        .env("VRAMD_TENANT", "c-pool")
        .env("VRAMD_LIMIT", "256MiB")
        .env("VRAMD_TORCH_MODE", "pool")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut seen = String::new();
    while !seen.contains("interpose: ok") {
        let mut line = String::new();
        if stdout.read_line(&mut line).unwrap() == 0 {
            panic!("interpose.c stopped early:\n{seen}");
        }
        seen += &line;
    }
    assert!(
        seen.contains(
            "refused as expected: vramd: tenant `c-pool` could not allocate 512 MiB: out of memory"
        ),
        "{seen}"
    );
    // The housekeeping thread passes the reported figure on within a few hundred milliseconds.
    let observer = vram_client::Observer::connect(Some(&daemon.socket)).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let tenant = loop {
        let status = observer.status().unwrap();
        let t = status
            .tenants
            .into_iter()
            .find(|t| t.name == "c-pool")
            .unwrap();
        if t.in_use == Bytes::mib(16) || std::time::Instant::now() > deadline {
            break t;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert_eq!(
        (tenant.held, tenant.in_use, tenant.cached),
        (Bytes::mib(64), Bytes::mib(16), Bytes::mib(48)),
        "held = the segment, in use = what the layer above reported, the rest cached"
    );
    child.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "interpose.c failed:\n{seen}");
}

#[test]
fn allocator_settings_come_from_vramd_alloc_and_a_bad_one_is_a_clear_error() {
    let out = tempfile::tempdir().unwrap();
    let exe = build("settings", out.path());
    let daemon = common::Daemon::start(Bytes::gib(1));
    let run = |value: &str| {
        let r = Command::new(&exe)
            .env("VRAMD_SOCKET", &daemon.socket)
            .env("VRAMD_ALLOC", value)
            .output()
            .unwrap();
        assert!(r.status.success());
        String::from_utf8_lossy(&r.stdout).into_owned()
    };
    assert_eq!(run("min_grow=16MiB,seal_every=2"), "allocated\n");
    let bad = run("min_grwo=16MiB");
    assert!(
        bad.starts_with("refused: vramd: VRAMD_ALLOC: `min_grwo` is not an allocator setting"),
        "{bad}"
    );
    assert!(run("seal_every=0").contains("seal_every must be at least 1"));
}
