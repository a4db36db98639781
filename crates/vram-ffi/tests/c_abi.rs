//! Builds the C programs of `tests/c/` against libvram.so with gcc and runs them against a real
//! daemon.

use std::process::Command;

use vram_core::Bytes;

use cprog::build;

mod common;
mod cprog;

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
fn c_program_sets_its_tenant_up_with_vram_init() {
    let out = tempfile::tempdir().unwrap();
    let exe = build("init", out.path());
    let daemon = common::Daemon::start(Bytes::gib(1));
    // Nothing from the environment: every option the program sets is in its vram_options_t.
    let mut cmd = Command::new(&exe);
    for v in vram_proto::env::ALL {
        cmd.env_remove(v.name);
    }
    let run = cmd.arg(&daemon.socket).output().unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "init.c failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains("refused as expected: vramd: vram_init: options of 16 bytes"),
        "{stdout}"
    );
    assert!(
        stdout.contains("second init: vramd: vram_init: this process is tenant `c-init` already"),
        "{stdout}"
    );
    assert!(
        stdout.contains(r#""tenant":"c-init""#) && stdout.contains(r#""limit":67108864"#),
        "{stdout}"
    );
    assert!(stdout.contains("init: ok"), "{stdout}");
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

/// A CUDA runtime that a library loaded with `RTLD_LOCAL` brought in (a Python extension's), which
/// `RTLD_NEXT` does not search, still gets the calls libvram.so passes on (outside pool mode,
/// all of them): they are not refused for want of a runtime. Also under the name a wheel gives
/// the runtime it bundles (auditwheel's `libcudart-<hash>.so.N`).
#[test]
fn a_runtime_loaded_locally_gets_the_calls_libvram_passes_on() {
    for runtime in ["libcudart.so.13", "libcudart-3c0a7d1f.so.12"] {
        let out = tempfile::tempdir().unwrap();
        cprog::build_shared("fake_cudart", runtime, out.path());
        cprog::build_shared_linked("runtime_user", "libruntime_user.so", out.path(), &[runtime]);
        let exe = cprog::build("local_runtime", out.path());
        let run = Command::new(&exe)
            .arg(runtime)
            .env("LD_LIBRARY_PATH", out.path())
            .env_remove("VRAMD_TORCH_MODE")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&run.stdout);
        assert!(
            run.status.success() && stdout.contains("local_runtime: ok"),
            "{runtime}: {stdout}{}",
            String::from_utf8_lossy(&run.stderr)
        );
    }
}

/// Pool mode's `cudaMallocAsync` serves the memory of the stream's device (the runtime's
/// `cudaStreamGetDevice`), not the current device's: a stream on another GPU than the tenant's
/// gets the runtime's own memory.
#[test]
fn pool_mode_serves_a_stream_ordered_allocation_on_its_streams_device() {
    let out = tempfile::tempdir().unwrap();
    cprog::build_shared("fake_cudart", "libcudart.so.13", out.path());
    let exe = build("stream_device", out.path());
    let daemon = common::Daemon::start(Bytes::gib(8));
    let run = Command::new(&exe)
        .env("LD_LIBRARY_PATH", out.path())
        .env("VRAMD_SOCKET", &daemon.socket)
        .env("VRAMD_TENANT", "c-streams")
        .env("VRAMD_LIMIT", "256MiB")
        .env("VRAMD_TORCH_MODE", "pool")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success() && stdout.contains("stream_device: ok"),
        "{stdout}{}",
        String::from_utf8_lossy(&run.stderr)
    );
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
    assert_eq!(run("min_grow=16MiB,grow_slack=0.02"), "allocated\n");
    let bad = run("min_grwo=16MiB");
    assert!(
        bad.starts_with("refused: vramd: VRAMD_ALLOC: `min_grwo` is not an allocator setting"),
        "{bad}"
    );
    assert!(run("grow_slack=-1").contains("grow_slack must be a fraction of at least 0"));
}

#[test]
fn a_graphs_private_pool_keeps_its_blocks_until_its_last_release() {
    let out = tempfile::tempdir().unwrap();
    let exe = build("pools", out.path());
    let daemon = common::Daemon::start(Bytes::gib(1));
    let run = Command::new(&exe)
        .env("VRAMD_SOCKET", &daemon.socket)
        .env("VRAMD_TENANT", "c-pools")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "pools.c failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains("unknown pool refused: vramd: tenant `c-pools` could not allocate 4 KiB: no private pool (0, 9) is in use"),
        "{stdout}"
    );
    assert!(stdout.contains("pools: ok"), "{stdout}");
    eprintln!("DEBUG {stdout}");
}
