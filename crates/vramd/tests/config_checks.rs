//! Configurations that cannot work are refused at start with the reason, and `vramd serve
//! --check-config FILE` says whether a file is valid without starting anything.

mod common;

use std::process::{Command, Stdio};

use common::VRAMD;

/// Runs `vramd serve --check-config FILE ARGS...`: (exit code, stdout + stderr).
fn check(config: &str, args: &[&str]) -> (Option<i32>, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vramd.toml");
    std::fs::write(&path, config).unwrap();
    let out = Command::new(VRAMD)
        .arg("serve")
        .arg("--check-config")
        .arg(&path)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

/// Starts `vramd serve --backend host` with `config`: it must exit non-zero at once, leave no
/// socket, and say `says`.
fn refused_at_start(config: &str, says: &str) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vramd.toml");
    let socket = dir.path().join("vramd.sock");
    std::fs::write(&path, config).unwrap();
    let out = Command::new(VRAMD)
        .args(["serve", "--backend", "host", "--metrics", "off", "--config"])
        .arg(&path)
        .arg("--socket")
        .arg(&socket)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started with {config}:\n{text}");
    assert!(text.contains(says), "`{says}` not said:\n{text}");
    assert!(!socket.exists(), "a socket left by a refused start");
}

/// Each configuration that cannot work, and what its refusal must say.
const BAD: &[(&str, &str)] = &[
    ("capacity = \"0\"\n", "capacity is 0"),
    (
        "capacity = \"1 GiB\"\n[pool]\nmax = \"1 KiB\"\n",
        "[pool] max = 1 KiB is below the device's granularity (2 MiB)",
    ),
    (
        "capacity = \"1 GiB\"\n[pool]\nsizes = [\"1 KiB\"]\n",
        "[pool] sizes: 1 KiB is below the device's granularity (2 MiB)",
    ),
    (
        "capacity = \"1 GiB\"\nallowed_uids = []\n",
        "allowed_uids is empty",
    ),
    (
        "capacity = \"1 GiB\"\n[tenants.\"bad name\"]\nclass = \"normal\"\n",
        "`bad name` is not a valid tenant name",
    ),
    (
        // 1 GiB + (2^64 - 512 MiB): the sum wraps to 512 MiB in 64 bits.
        "capacity = \"8 GiB\"\n\
         [tenants.a]\nclass = \"normal\"\nguarantee = \"1 GiB\"\n\
         [tenants.b]\nclass = \"normal\"\nguarantee = \"18446744073172680704\"\n\
         limit = \"18446744073709551615\"\n",
        "guarantees",
    ),
    (
        "capacity = \"8 GiB\"\n\
         [tenants.a]\nclass = \"normal\"\nguarantee = \"5 GiB\"\n\
         [tenants.b]\nclass = \"normal\"\nguarantee = \"4 GiB\"\n",
        "declared guarantees sum to 9 GiB",
    ),
    (
        "capacity = \"8 GiB\"\n[tenants.a]\nclass = \"nosuch\"\n",
        "unknown class `nosuch`",
    ),
    (
        "capacity = \"8 GiB\"\npriority_reserve = \"9 GiB\"\n",
        "priority_reserve",
    ),
    (
        "capacity = \"1 GiB\"\n[connections]\nmax_per_uid = 0\n",
        "max_per_uid",
    ),
    ("capacty = \"1 GiB\"\n", "unknown field `capacty`"),
];

#[test]
fn check_config_says_why_a_file_is_invalid() {
    for (config, says) in BAD {
        let (code, text) = check(config, &["--backend", "host"]);
        assert_eq!(code, Some(1), "{config}:\n{text}");
        assert!(text.contains(says), "{config}: `{says}` not said:\n{text}");
        assert!(text.contains("invalid"), "{text}");
    }
}

#[test]
fn check_config_names_every_fault_at_once() {
    let (code, text) = check(
        "capacity = \"8 GiB\"\npriority_reserve = \"9 GiB\"\n\
         [tenants.a]\nclass = \"nope\"\nguarantee = \"6 GiB\"\nlimit = \"1 GiB\"\n\
         [tenants.b]\nguarantee = \"6 GiB\"\n",
        &["--backend", "host"],
    );
    assert_eq!(code, Some(1), "{text}");
    for says in [
        "priority_reserve 9 GiB",
        "unknown class `nope`",
        "[tenants.a]: guarantee 6 GiB is above its limit 1 GiB",
        "declared guarantees sum to 12 GiB",
    ] {
        assert!(text.contains(says), "`{says}` not said:\n{text}");
    }
}

#[test]
fn auto_is_checked_as_the_backend_a_start_here_would_take() {
    // Without a GPU a start takes the host backend, whose granularity the check then knows.
    if vram_device::cuda::probe().is_ok_and(|d| !d.is_empty()) {
        return;
    }
    let (code, text) = check("capacity = 8\n", &[]);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("backend auto is host"), "{text}");
    assert!(text.contains("below the device's granularity"), "{text}");
}

#[test]
fn check_config_accepts_a_good_file_and_the_shipped_one() {
    let (code, text) = check(
        "capacity = \"8 GiB\"\n[tenants.a]\nclass = \"high\"\nguarantee = \"4 GiB\"\n\
         [tenants.b]\nguarantee = \"1 GiB\"\n",
        &["--backend", "host"],
    );
    // A declared tenant without a class takes the default one.
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("valid"), "{text}");
    let shipped = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/vramd.toml");
    let (code, text) = check(&std::fs::read_to_string(shipped).unwrap(), &[]);
    assert_eq!(code, Some(0), "deploy/vramd.toml:\n{text}");
}

#[test]
fn configurations_that_cannot_work_are_refused_at_start() {
    for (config, says) in BAD {
        refused_at_start(config, says);
    }
}

/// The shipped example starts on a small host device.
#[test]
fn the_shipped_config_starts_on_a_small_machine() {
    let shipped = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/vramd.toml");
    let config = std::fs::read_to_string(shipped)
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with("socket ") && !l.starts_with("metrics "))
        .collect::<Vec<_>>()
        .join("\n");
    let d = common::Daemon::start_on("host", &format!("capacity = \"4 GiB\"\n{config}"));
    d.stop();
}

/// The shipped unit passes `systemd-analyze verify` (where systemd is installed), with the binary
/// path pointed at this build, and names documentation the install steps put in place.
#[test]
fn the_shipped_unit_verifies() {
    let unit = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/vramd.service");
    let text = std::fs::read_to_string(unit).unwrap();
    for needed in [
        "Type=notify",
        "ExecReload=/bin/kill -HUP $MAINPID",
        "Documentation=file:/usr/share/doc/vramd/operations.md",
        "install -D -m 0644 docs/operations.md /usr/share/doc/vramd/operations.md",
        "RuntimeDirectoryPreserve=yes",
    ] {
        assert!(text.contains(needed), "the unit lacks `{needed}`");
    }
    let Ok(probe) = Command::new("systemd-analyze").arg("--version").output() else {
        eprintln!("systemd-analyze is not installed: not verified");
        return;
    };
    assert!(probe.status.success());
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("vramd.service");
    std::fs::write(&copy, text.replace("/usr/local/bin/vramd", VRAMD)).unwrap();
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&copy)
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && !said.contains("vramd.service:"),
        "systemd-analyze verify:\n{said}"
    );
}
