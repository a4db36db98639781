//! How a tenant's process ended, read from `/proc/PID/stat` while it is a zombie (exited, not yet
//! reaped by its parent): field 52, `exit_code`, is the wait status its parent will get. Field
//! 22, the start time (`state::process_start_time`, read when it registered), tells the process
//! apart from a later one that reused its pid.

use std::time::{Duration, Instant};

/// How long to look for the process to become a zombie once its connection closed: the kernel
/// closes a dying process's files a moment before it marks it exited.
const ZOMBIE_WAIT: Duration = Duration::from_millis(100);

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// Killed by a signal (`core`: it dumped core).
    Signal { signal: i32, core: bool },
    /// It called exit with this status.
    Exited(i32),
}

/// The fields of `/proc/PID/stat` after the command name, which may itself hold spaces and
/// parentheses; `fields[0]` is field 3 (the state).
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &text[text.rfind(')')? + 1..];
    Some(after.split_whitespace().map(str::to_string).collect())
}

/// Field `n` (1-based, as proc(5) numbers them) of the fields after the name.
fn field(fields: &[String], n: usize) -> Option<&str> {
    fields.get(n.checked_sub(3)?).map(String::as_str)
}

/// How `pid` ended, if it is a zombie (for up to [`ZOMBIE_WAIT`]) and the same process that
/// started at `start` (clock ticks since boot). `None`: still running, already reaped, or
/// unreadable.
pub fn how_it_ended(pid: u32, start: Option<u64>) -> Option<Ended> {
    let deadline = Instant::now() + ZOMBIE_WAIT;
    loop {
        let f = stat_fields(pid)?;
        if start.is_some_and(|s| field(&f, 22) != Some(s.to_string().as_str())) {
            return None;
        }
        if matches!(field(&f, 3), Some("Z" | "X")) {
            return decode(field(&f, 52)?.parse().ok()?);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A wait status: the low 7 bits a signal, bit 7 a core dump, bits 8 to 15 an exit status.
fn decode(status: i32) -> Option<Ended> {
    let signal = status & 0x7f;
    match signal {
        0 => Some(Ended::Exited((status >> 8) & 0xff)),
        // 0x7f is a stopped process, not an ended one.
        0x7f => None,
        _ => Some(Ended::Signal {
            signal,
            core: status & 0x80 != 0,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_statuses_decode() {
        assert_eq!(
            decode(9),
            Some(Ended::Signal {
                signal: 9,
                core: false
            })
        );
        assert_eq!(
            decode(0x86),
            Some(Ended::Signal {
                signal: 6,
                core: true
            })
        );
        assert_eq!(decode(3 << 8), Some(Ended::Exited(3)));
        assert_eq!(decode(0), Some(Ended::Exited(0)));
        assert_eq!(decode(0x137f), None);
    }

    #[test]
    fn a_zombie_child_is_read_and_a_live_process_is_not() {
        let me = std::process::id();
        let start = super::super::state::process_start_time(me).expect("this process runs");
        assert_eq!(how_it_ended(me, Some(start)), None, "alive");
        let mut child = std::process::Command::new("sh")
            .args(["-c", "exit 7"])
            .spawn()
            .unwrap();
        let pid = child.id();
        let ended = (0..200).find_map(|_| {
            std::thread::sleep(Duration::from_millis(5));
            how_it_ended(pid, None)
        });
        assert_eq!(ended, Some(Ended::Exited(7)));
        // Another start time: another process.
        assert_eq!(how_it_ended(pid, Some(1)), None);
        child.wait().unwrap();
        assert_eq!(how_it_ended(pid, None), None, "reaped");
    }
}
