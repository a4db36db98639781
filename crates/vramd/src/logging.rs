//! Where the daemon and the tools log: stderr, through a writer that never fails the thread that
//! logs. A line that cannot be written (stderr a closed pipe, as under `vramd serve | head -1`, or
//! a full disk) is dropped and counted ([`dropped`]: `log_lines_dropped` in the status report and
//! `vramd_log_lines_dropped_total`), and the daemon serves on.
//!
//! A stderr that blocks (a pipe nobody reads) still blocks the logging thread; systemd's journal
//! and files do not.

use std::io::{self, Write};
use std::sync::atomic::{AtomicU64, Ordering};

static DROPPED: AtomicU64 = AtomicU64::new(0);

/// Lines dropped since the process started because stderr refused them.
pub fn dropped() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

/// A `tracing_subscriber` writer over stderr that drops what it cannot write.
#[derive(Debug, Clone, Copy, Default)]
pub struct Stderr;

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Stderr {
    type Writer = Line;

    fn make_writer(&'a self) -> Line {
        Line
    }
}

/// One event's line: written whole in one call, or dropped and counted.
#[derive(Debug)]
pub struct Line;

impl Write for Line {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if io::stderr().lock().write_all(buf).is_err() {
            DROPPED.fetch_add(1, Ordering::Relaxed);
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        let _ = io::stderr().flush();
        Ok(())
    }
}

/// Writes a message to stderr as `eprintln!` would, without panicking when stderr is gone.
pub fn eprint_line(message: &str) {
    let _ = Line.write(format!("{message}\n").as_bytes());
}

/// A peer's text as a log line shows it: whole up to `max` bytes, else its start and its length
/// (a peer's strings can be as long as a frame, and a connection loop would write each whole).
#[derive(Debug, Clone, Copy)]
pub struct Clipped<'a>(pub &'a str, pub usize);

impl std::fmt::Display for Clipped<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Clipped(s, max) = *self;
        if s.len() <= max {
            return f.write_str(s);
        }
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        write!(f, "{}... ({} bytes)", &s[..end], s.len())
    }
}

/// An error and its causes on one line, `what: why: why`, each said once: an error here often
/// says its source in its own message as well (thiserror's `{source}`), which `{:#}` would repeat.
#[derive(Debug, Clone, Copy)]
pub struct Chain<'a>(pub &'a anyhow::Error);

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut said = String::new();
        for cause in self.0.chain() {
            let text = cause.to_string();
            if said.contains(&text) {
                continue;
            }
            if !said.is_empty() {
                said.push_str(": ");
            }
            said.push_str(&text);
        }
        f.write_str(&said)
    }
}

/// How often a recurring failure or refusal is logged at most.
pub const LOG_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// A line logged once per [`LOG_EVERY`]: the first at once, then a count of the rest. What repeats
/// at a peer's pace (refusals, malformed requests, failed accepts) goes through one, so that a
/// peer in a loop cannot fill the daemon's log; the metrics count every occurrence.
#[derive(Debug, Default)]
pub struct Every {
    last: Option<std::time::Instant>,
    suppressed: u64,
}

impl Every {
    /// `Some(n)`: log now, mentioning the `n` occurrences not logged since the last line.
    pub fn due(&mut self) -> Option<u64> {
        let now = std::time::Instant::now();
        if self
            .last
            .is_some_and(|at| now.duration_since(at) < LOG_EVERY)
        {
            self.suppressed += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.suppressed))
    }
}

#[cfg(test)]
mod every_tests {
    use super::*;

    #[test]
    fn a_recurring_line_is_logged_once_per_interval_with_a_count() {
        let mut e = Every::default();
        assert_eq!(e.due(), Some(0));
        for _ in 0..5 {
            assert_eq!(e.due(), None);
        }
        e.last = Some(std::time::Instant::now() - LOG_EVERY);
        assert_eq!(e.due(), Some(5));
    }
}

#[cfg(test)]
mod chain_tests {
    use super::Chain;

    #[derive(Debug, thiserror::Error)]
    #[error("outer: {0}")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn each_cause_is_said_once() {
        let io = std::io::Error::other("disk full");
        let e = anyhow::Error::new(Outer(io)).context("saving x");
        assert_eq!(Chain(&e).to_string(), "saving x: outer: disk full");
        let plain = anyhow::anyhow!("inner").context("middle").context("top");
        assert_eq!(Chain(&plain).to_string(), "top: middle: inner");
    }
}

#[cfg(test)]
mod clipped_tests {
    use super::Clipped;

    #[test]
    fn long_text_is_cut_on_a_character_boundary_with_its_length() {
        assert_eq!(
            Clipped("vramd-client 0.1", 256).to_string(),
            "vramd-client 0.1"
        );
        let long = "é".repeat(300);
        let shown = Clipped(&long, 9).to_string();
        assert_eq!(shown, "éééé... (600 bytes)");
    }
}
