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
    first_answer_as(d, (uid, 0), name, flags)
}

/// `vramd tenant --name NAME FLAGS` run as (uid, gid), without supplementary groups.
fn first_answer_as(
    d: &Daemon,
    (uid, gid): (u32, u32),
    name: &str,
    flags: &[&str],
) -> serde_json::Value {
    let out = Command::new(VRAMD)
        .args(["tenant", "--socket"])
        .arg(&d.socket)
        .args(["--name", name])
        .args(flags)
        .uid(uid)
        .gid(gid)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let line = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(line.lines().next().unwrap_or("null"))
        .unwrap_or_else(|e| panic!("{e}: {line} {}", String::from_utf8_lossy(&out.stderr)))
}

/// `vramd tenant ARGS` as uid nobody, left running once it is welcomed (its input open).
fn welcomed_as_nobody(d: &Daemon, args: &[&str]) -> std::process::Child {
    let mut child = Command::new(VRAMD)
        .args(["tenant", "--socket"])
        .arg(&d.socket)
        .args(args)
        .uid(NOBODY)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    assert!(line.contains("\"welcome\""), "{line}");
    child
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
    std::fs::set_permissions(d.dir(), std::fs::Permissions::from_mode(0o755)).unwrap();

    let w = first_answer(&d, NOBODY, "prod", &[]);
    assert_eq!(w["event"], "refused_at_connect", "{w}");
    let msg = w["message"].as_str().unwrap();
    assert!(
        msg.contains(&format!(
            "uid {NOBODY} (groups [0]) may not connect as tenant `prod`"
        )),
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
    let mut mine = welcomed_as_nobody(&d, &["--name", "mine"]);
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

#[test]
fn groups_from_the_kernel_may_own_tenants_and_classes() {
    if !rustix::process::getuid().is_root() {
        eprintln!("skipped: starting a tenant as another uid needs root");
        return;
    }
    const TEAM: u32 = 4242;
    let d = Daemon::start(&format!(
        "capacity = \"4 GiB\"\nmetrics = \"off\"\nsocket_mode = \"0666\"\n\
         allowed_uids = [0, {NOBODY}]\n\
         [tenants.team]\nclass = \"normal\"\ngroups = [{TEAM}]\n\
         [classes.high]\npriority = 100\ngroups = [{TEAM}]\n"
    ));
    std::fs::set_permissions(d.dir(), std::fs::Permissions::from_mode(0o755)).unwrap();

    let w = first_answer_as(&d, (NOBODY, NOBODY), "team", &[]);
    assert_eq!(w["event"], "refused_at_connect", "{w}");
    assert!(
        w["message"]
            .as_str()
            .unwrap()
            .contains("tenants.team.groups"),
        "{w}"
    );
    let w = first_answer_as(&d, (NOBODY, NOBODY), "climber", &["--class", "high"]);
    assert!(
        w["message"]
            .as_str()
            .unwrap()
            .contains("classes.high.groups"),
        "{w}"
    );
    assert_eq!(
        first_answer_as(&d, (NOBODY, TEAM), "team", &[])["event"],
        "welcome"
    );
    assert_eq!(
        first_answer_as(&d, (NOBODY, TEAM), "climber", &["--class", "high"])["event"],
        "welcome"
    );
}

#[test]
fn a_reload_disconnects_the_tenants_its_rules_no_longer_admit() {
    if !rustix::process::getuid().is_root() {
        eprintln!("skipped: starting a tenant as another uid needs root");
        return;
    }
    let config = |users: &str| {
        format!(
            "capacity = \"4 GiB\"\nmetrics = \"off\"\nsocket_mode = \"0666\"\n\
             allowed_uids = [0, {NOBODY}]\n[classes.high]\npriority = 100\nusers = [{users}]\n"
        )
    };
    let d = Daemon::start(&config(&NOBODY.to_string()));
    std::fs::set_permissions(d.dir(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut climber = welcomed_as_nobody(&d, &["--name", "climber", "--class", "high"]);
    std::fs::write(d.dir().join("vramd.toml"), config("")).unwrap();
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(d.pid() as i32).unwrap(),
        rustix::process::Signal::HUP,
    )
    .unwrap();
    let gone = common::wait_until(std::time::Duration::from_secs(5), || {
        d.status().tenants.is_empty()
    });
    assert!(gone, "{:?}\n{}", d.status().tenants, d.log());
    assert!(
        d.log().contains("the policy in force does not admit it"),
        "{}",
        d.log()
    );
    drop(climber.stdin.take());
    let _ = climber.wait();
}
