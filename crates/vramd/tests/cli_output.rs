//! The commands an operator reads: `vramd status` written into a pipe its reader has closed
//! (`vramd status | head`) ends quietly, and `vramd top` refuses an interval it cannot keep.

mod common;

use std::process::{Command, Stdio};

use common::{Daemon, VRAMD};

#[test]
fn status_into_a_closed_pipe_ends_without_a_panic() {
    let d = Daemon::start("capacity = \"1 GiB\"\nmetrics = \"off\"\n");
    for json in [false, true] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let mut cmd = Command::new(VRAMD);
        cmd.arg("status").arg("--socket").arg(&d.socket);
        if json {
            cmd.arg("--json");
        }
        let out = cmd
            .stdout(Stdio::from(writer))
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert_eq!(out.status.code(), Some(0), "{stderr}");
    }
    d.stop();
}

#[test]
fn top_refuses_an_interval_it_cannot_keep() {
    for interval in ["0", "-1", "1e18", "nan"] {
        let out = Command::new(VRAMD)
            .args(["top", "--socket", "/nonexistent/vramd.sock"])
            .arg(format!("--interval={interval}"))
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{interval}");
        assert!(
            stderr.contains("--interval must be"),
            "{interval}: {stderr}"
        );
    }
}
