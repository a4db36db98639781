//! Building the C programs of `tests/c/` with gcc: test programs linked against libvram.so, and
//! the stand-in libraries some of them load. Each test crate uses the part it needs.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// The directory of the libvram.so to test: the one cargo built with this test (beside it in
/// `target/<profile>/deps`; `target/<profile>/libvram.so` is only refreshed by `cargo build`),
/// else `target/<profile>`, or, for a bundle run on a machine without cargo (`.gpu/run` copies
/// the library into the project's `target/release`), that directory.
pub fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap().to_path_buf();
    if deps.join("libvram.so").exists() {
        return deps;
    }
    let beside = deps.parent().unwrap().to_path_buf();
    let project = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/release");
    let no_cargo = !Path::new(env!("CARGO")).exists();
    if no_cargo && !beside.join("libvram.so").exists() && project.join("libvram.so").exists() {
        return project;
    }
    beside
}

/// libvram.so, built for this test's profile if it is missing (where cargo built the tests
/// without it).
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
pub fn build(name: &str, out: &Path) -> PathBuf {
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
        .arg("-ldl")
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        // An RPATH, searched before LD_LIBRARY_PATH (a RUNPATH is searched after): cargo test's
        // LD_LIBRARY_PATH names `target/<profile>`, whose libvram.so only `cargo build` refreshes,
        // and the program must load the library built with this test.
        .arg("-Wl,--disable-new-dtags")
        .status()
        .expect("gcc runs");
    assert!(cc.success(), "gcc failed");
    exe
}

/// Builds `tests/c/{name}.c` into the shared library `out/{soname}` (its soname that name),
/// binding its calls of its own functions to themselves, as the libraries it stands in for do:
/// libvram.so, preloaded, defines the same names.
pub fn build_shared(name: &str, soname: &str, out: &Path) -> PathBuf {
    build_shared_linked(name, soname, out, &[])
}

/// [`build_shared`], linked against the libraries `libs` (each a file name in `out`, found there
/// at run time too).
pub fn build_shared_linked(name: &str, soname: &str, out: &Path, libs: &[&str]) -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let lib = out.join(soname);
    let cc = Command::new(std::env::var("CC").unwrap_or_else(|_| "gcc".into()))
        .args([
            "-O1",
            "-Wall",
            "-Werror",
            "-shared",
            "-fPIC",
            "-Wl,-Bsymbolic",
        ])
        .arg(format!("-Wl,-soname,{soname}"))
        .arg(manifest.join(format!("tests/c/{name}.c")))
        .arg("-o")
        .arg(&lib)
        .arg(format!("-L{}", out.display()))
        .args(libs.iter().map(|l| format!("-l:{l}")))
        .arg(format!("-Wl,-rpath,{}", out.display()))
        .status()
        .expect("gcc runs");
    assert!(cc.success(), "gcc failed on {name}.c");
    lib
}
