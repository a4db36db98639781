//! `vramd top` in a real pseudo-terminal, its screen read back through a terminal emulator
//! (vt100): it shows the daemon's tenants, sorts on keys, and quits on q.

mod common;

use std::fs::File;
use std::io::{Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

use common::{Daemon, VRAMD};
use rustix::termios::{tcsetwinsize, Winsize};

const ROWS: u16 = 30;
const COLS: u16 = 160;

/// A program on the slave side of a fresh pty; the test reads the master into a vt100 screen.
struct Screen {
    child: Child,
    keys: File,
    output: Receiver<Vec<u8>>,
    parser: vt100::Parser,
}

impl Screen {
    fn spawn(args: &[&std::ffi::OsStr]) -> Screen {
        let (master, slave) = common::pty();
        let size = Winsize {
            ws_row: ROWS,
            ws_col: COLS,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        tcsetwinsize(&slave, size).unwrap();
        let child = Command::new(VRAMD)
            .args(args)
            .env("TERM", "xterm-256color")
            .stdin(Stdio::from(slave.try_clone().unwrap()))
            .stdout(Stdio::from(slave.try_clone().unwrap()))
            .stderr(Stdio::from(slave))
            .spawn()
            .unwrap();
        let mut reader = File::from(master);
        let keys = reader.try_clone().unwrap();
        let (tx, output) = mpsc::channel();
        std::thread::spawn(move || {
            let mut buf = [0u8; 8192];
            // Ends with EIO once the program has exited and closed the slave.
            while let Ok(n @ 1..) = reader.read(&mut buf) {
                if tx.send(buf[..n].to_vec()).is_err() {
                    break;
                }
            }
        });
        Screen {
            child,
            keys,
            output,
            parser: vt100::Parser::new(ROWS, COLS, 0),
        }
    }

    /// `vramd top` on `d`'s socket, polling every 0.2 s.
    fn top(d: &Daemon) -> Screen {
        Screen::spawn(&[
            "top".as_ref(),
            "--socket".as_ref(),
            d.socket.as_os_str(),
            "--interval".as_ref(),
            "0.2".as_ref(),
        ])
    }

    /// The program's exit status once it has exited, within 5 s; `None` if it has not.
    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some(s);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn text(&self) -> String {
        self.parser.screen().contents()
    }

    /// Reads output until the screen satisfies `cond` (10 s at most).
    fn wait_for(&mut self, what: &str, cond: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let text = self.text();
            if cond(&text) {
                return text;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.output.recv_timeout(left) {
                Ok(bytes) => self.parser.process(&bytes),
                Err(_) => panic!("the screen never showed {what}:\n{text}"),
            }
        }
    }

    fn press(&mut self, key: &str) {
        self.keys.write_all(key.as_bytes()).unwrap();
    }
}

impl Drop for Screen {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether `first` appears on a line above `second`.
fn above(text: &str, first: &str, second: &str) -> bool {
    let line = |name: &str| text.lines().position(|l| l.contains(name));
    matches!((line(first), line(second)), (Some(a), Some(b)) if a < b)
}

#[test]
fn top_shows_tenants_sorts_on_keys_and_quits_on_q() {
    let d = Daemon::start("capacity = \"4 GiB\"\nmetrics = \"off\"\n");
    let mut small = d.tenant("small-one", &["--limit", "1GiB"]);
    let mut large = d.tenant("large-one", &["--limit", "2GiB", "--guarantee", "1GiB"]);
    assert_eq!(small.cmd("take 256MiB")["event"], "took");
    assert_eq!(large.cmd("take 1GiB")["event"], "took");
    assert_eq!(large.cmd("cache 512MiB")["event"], "cached");

    let mut top = Screen::top(&d);
    // Largest holder first.
    let s = top.wait_for("both tenants, by held", |s| {
        above(s, "large-one", "small-one") && s.contains("HELD▼")
    });
    assert!(s.contains("held 1.2 GiB of 4 GiB"), "{s}");
    assert!(s.contains("2 tenant(s)"), "{s}");

    top.press("r");
    top.wait_for("the order reversed", |s| {
        above(s, "small-one", "large-one") && s.contains("HELD▲")
    });
    // Column 6, CACHED: only large-one has idle memory.
    top.press("6");
    top.wait_for("sorted by cached", |s| {
        above(s, "large-one", "small-one") && s.contains("CACHED▼")
    });
    // A new grant shows at the next poll.
    assert_eq!(small.cmd("take 512MiB")["event"], "took");
    top.wait_for("small-one's new holding", |s| {
        s.lines()
            .any(|l| l.contains("small-one") && l.contains("768 MiB"))
    });

    top.press("q");
    let status = top.exited().expect("top did not quit on q");
    assert!(status.success(), "top exited with {status}");
    small.exit();
    large.exit();
    d.stop();
}

/// A daemon that stops answering (stopped here with SIGSTOP) keeps a poll waiting, not the
/// screen: top says how long the daemon has been silent and still quits on q at once.
#[test]
fn top_answers_keys_while_the_daemon_does_not_answer() {
    use rustix::process::{kill_process, Pid, Signal};

    let d = Daemon::start("capacity = \"1 GiB\"\nmetrics = \"off\"\n");
    let mut top = Screen::top(&d);
    top.wait_for("the daemon's figures", |s| s.contains("tenant(s)"));
    let pid = Pid::from_raw(d.pid() as i32).unwrap();
    kill_process(pid, Signal::STOP).unwrap();
    let s = top.wait_for("the daemon's silence", |s| {
        s.contains("the daemon has not answered for")
    });
    assert!(
        s.contains("tenant(s)"),
        "the last figures stay on the screen: {s}"
    );
    top.press("q");
    let status = top.exited();
    kill_process(pid, Signal::CONT).unwrap();
    let status = status.expect("top did not quit on q while the daemon was stopped");
    assert!(status.success(), "top exited with {status}");
    d.stop();
}
