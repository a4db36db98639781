//! Who may be which tenant, decided by the kernel's word (SO_PEERCRED) and the operator's
//! configuration, with real processes of another uid. Starting a process as another uid needs
//! root: elsewhere the test says it is skipped.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

mod common;
use common::{Daemon, VRAMD};

const NOBODY: u32 = 65534;

/// `vramd tenant --name NAME FLAGS` run as `uid`: its first answer.
fn first_answer(d: &Daemon, uid: u32, name: &str, flags: &[&str]) -> serde_json::Value {
    let out = Command::new(VRAMD)
        .args(["tenant", "--socket"])
        .arg(&d.socket)
        .args(["--name", name])
        .args(flags)
        .uid(uid)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let line = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(line.lines().next().unwrap_or("null"))
        .unwrap_or_else(|e| panic!("{e}: {line} {}", String::from_utf8_lossy(&out.stderr)))
}

#[test]
fn declared_names_classes_and_per_uid_counts_follow_the_configuration() {
    if !rustix::process::getuid().is_root() {
        eprintln!("skipped: starting a tenant as another uid needs root");
        return;
    }
    let d = Daemon::start(&format!(
        "capacity = \"4 GiB\"\nmetrics = \"off\"\nsocket_mode = \"0666\"\n\
         allowed_uids = [0, {NOBODY}]\n\
         [tenants.prod]\nclass = \"high\"\nguarantee = \"1 GiB\"\nowners = [0]\n\
         [users.{NOBODY}]\nmax_tenants = 1\n"
    ));
    // The socket's directory must let the other uid reach the socket.
    std::fs::set_permissions(d.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();

    let w = first_answer(&d, NOBODY, "prod", &[]);
    assert_eq!(w["event"], "refused_at_connect", "{w}");
    let msg = w["message"].as_str().unwrap();
    assert!(
        msg.contains(&format!("uid {NOBODY} may not connect as tenant `prod`")),
        "{msg}"
    );

    let w = first_answer(&d, NOBODY, "climber", &["--class", "high"]);
    assert_eq!(w["event"], "refused_at_connect", "{w}");
    assert!(
        w["message"]
            .as_str()
            .unwrap()
            .contains("classes.high.users"),
        "{w}"
    );

    // Its own tenant in the default class is admitted, and the kernel's uid is the one booked.
    let mut mine = Command::new(VRAMD)
        .args(["tenant", "--socket"])
        .arg(&d.socket)
        .args(["--name", "mine"])
        .uid(NOBODY)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(mine.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    assert!(line.contains("\"welcome\""), "{line}");
    let s = d.status();
    let t = s.tenants.iter().find(|t| t.name == "mine").unwrap();
    assert_eq!(t.uid, NOBODY);
    // One tenant at a time for that uid.
    let w = first_answer(&d, NOBODY, "second", &[]);
    assert!(
        w["message"].as_str().unwrap().contains("max_tenants"),
        "{w}"
    );
    drop(mine.stdin.take());
    assert!(mine.wait().unwrap().success());
}
