//! Builds `tests/c/stress.c` against libvram.so with gcc and runs it against a real daemon.

use std::path::PathBuf;
use std::process::Command;

use vram_core::Bytes;

mod common;

/// The directory cargo put libvram.so in (this test runs from `target/<profile>/deps`).
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

#[test]
fn c_program_uses_the_allocator_from_several_threads() {
    let lib = lib_dir();
    assert!(
        lib.join("libvram.so").exists(),
        "libvram.so not in {}",
        lib.display()
    );
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let out = tempfile::tempdir().unwrap();
    let exe = out.path().join("stress");
    let cc = Command::new(std::env::var("CC").unwrap_or_else(|_| "gcc".into()))
        .args(["-O1", "-Wall", "-Werror", "-pthread", "-I"])
        .arg(manifest.join("include"))
        .arg(manifest.join("tests/c/stress.c"))
        .arg("-o")
        .arg(&exe)
        .arg(format!("-L{}", lib.display()))
        .arg("-lvram")
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .status()
        .expect("gcc runs");
    assert!(cc.success(), "gcc failed");

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
