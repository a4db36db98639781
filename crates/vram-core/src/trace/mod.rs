//! Allocation traces: PyTorch memory snapshots (`torch.cuda.memory._snapshot()`, pickled,
//! optionally gzipped) read into a plain list of allocations and frees.
//!
//! Input is bytes, so this module does no I/O. The pickle is decoded strictly: any class or other
//! global reference (`GLOBAL`, `STACK_GLOBAL`, `REDUCE` on anything but the builtin containers
//! serde-pickle knows, such as `set`) is an error, never a call. Only `device_traces[0]` is read:
//! its `alloc` events paired by address with `free_completed`.
//!
//! A history is a ring buffer: a long run's snapshot begins in the middle, while blocks allocated
//! before it (a model's weights) are live. The snapshot says which: a free whose alloc the history
//! never saw, and a block still allocated in the snapshot's `segments` at an address no event
//! names. [`parse_snapshot`] puts those blocks back as allocations at the start of the trace, in
//! address order (the process held them, and the allocator must place them too);
//! [`Trace::window_only`] drops them again, skipping the frees the history cannot pair.

use std::collections::{HashMap, HashSet};
use std::io::Read;

use serde::Deserialize;

/// What an event does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Action {
    Alloc,
    Free,
}

/// One allocation or free. `size` is the bytes requested (a free carries its alloc's size).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Event {
    pub action: Action,
    pub addr: u64,
    pub size: u64,
    pub stream: u64,
    pub time_us: u64,
}

/// The replayable events of one trace, in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Trace {
    pub events: Vec<Event>,
    /// Frees skipped because their alloc happened before the history began (none unless
    /// [`Trace::window_only`]: otherwise those allocs are the first `before_history` events).
    pub skipped_frees: usize,
    /// The first this many events allocate blocks that were live when the history began.
    pub before_history: usize,
}

impl Trace {
    /// `us` as a share of the trace's wall time (0 for a trace without duration).
    pub fn share_of_wall(&self, us: f64) -> f64 {
        match self.wall_us() {
            0 => 0.0,
            wall => us / wall as f64,
        }
    }

    /// Microseconds from the first event to the last.
    pub fn wall_us(&self) -> u64 {
        match (self.events.first(), self.events.last()) {
            (Some(a), Some(b)) => b.time_us.saturating_sub(a.time_us),
            _ => 0,
        }
    }

    /// The requested bytes of the blocks live when the history began.
    pub fn before_history_bytes(&self) -> u64 {
        self.events[..self.before_history]
            .iter()
            .map(|e| e.size)
            .sum()
    }

    /// The trace as its history recorded it: without the blocks live when it began, and so
    /// without the frees of those.
    pub fn window_only(&self) -> Trace {
        let (before, rest) = self.events.split_at(self.before_history);
        let mut unpaired: HashSet<u64> = before.iter().map(|e| e.addr).collect();
        let mut t = Trace {
            events: Vec::with_capacity(rest.len()),
            skipped_frees: self.skipped_frees,
            before_history: 0,
        };
        for e in rest {
            if e.action == Action::Free && unpaired.remove(&e.addr) {
                t.skipped_frees += 1;
            } else {
                t.events.push(*e);
            }
        }
        t
    }

    /// The same trace with every request's size multiplied by `factor`: the same program at
    /// another batch or sequence size, for judging an allocator beyond one workload.
    pub fn scaled(&self, factor: f64) -> Trace {
        let mut t = self.clone();
        for e in &mut t.events {
            e.size = (e.size as f64 * factor) as u64;
        }
        t
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("not a gzip stream that decompresses: {0}")]
    Gzip(#[source] std::io::Error),
    #[error("not a PyTorch memory snapshot pickle (classes are refused): {0}")]
    Pickle(#[from] serde_pickle::Error),
    #[error("the snapshot has no device_traces[0]")]
    NoDeviceTrace,
    #[error("event {index}: alloc at {addr:#x}, which is already allocated")]
    DoubleAlloc { index: usize, addr: u64 },
}

const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

#[derive(Deserialize)]
struct Snapshot {
    device_traces: Vec<Vec<RawEvent>>,
    /// Read leniently: a `segments` list of another shape (another PyTorch version's) only hides
    /// the blocks still allocated that no event names; the events replay all the same.
    #[serde(default, deserialize_with = "lenient_segments")]
    segments: Vec<RawSegment>,
}

fn lenient_segments<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<RawSegment>, D::Error> {
    let value = serde_pickle::Value::deserialize(d)?;
    Ok(serde_pickle::from_value(value).unwrap_or_default())
}

/// A segment of the allocator's state when the snapshot was taken: its blocks lie side by side
/// from `address`.
#[derive(Deserialize)]
struct RawSegment {
    #[serde(default)]
    device: u64,
    address: u64,
    #[serde(default)]
    stream: u64,
    #[serde(default)]
    blocks: Vec<RawBlock>,
}

#[derive(Deserialize)]
struct RawBlock {
    size: u64,
    #[serde(default)]
    requested_size: Option<u64>,
    state: String,
}

#[derive(Deserialize)]
struct RawEvent {
    action: String,
    #[serde(default)]
    addr: u64,
    #[serde(default)]
    size: u64,
    #[serde(default)]
    stream: u64,
    #[serde(default)]
    time_us: u64,
}

/// Reads a snapshot, gzipped or not (told apart by the gzip magic number).
pub fn parse_snapshot(bytes: &[u8]) -> Result<Trace, TraceError> {
    let inflated;
    let pickle = if bytes.starts_with(&GZIP_MAGIC) {
        let mut out = Vec::new();
        flate2::read::MultiGzDecoder::new(bytes)
            .read_to_end(&mut out)
            .map_err(TraceError::Gzip)?;
        inflated = out;
        &inflated[..]
    } else {
        bytes
    };
    let snapshot: Snapshot = serde_pickle::from_slice(pickle, serde_pickle::DeOptions::new())?;
    let raw = snapshot
        .device_traces
        .into_iter()
        .next()
        .ok_or(TraceError::NoDeviceTrace)?;
    let before = before_history(&snapshot.segments, &raw);
    pair(before, &raw)
}

/// The blocks live when the history began, as allocations in address order at its first
/// timestamp: blocks still allocated on device 0 at an address no event names, and blocks freed
/// without an alloc in the history.
fn before_history(segments: &[RawSegment], raw: &[RawEvent]) -> Vec<Event> {
    let named: HashSet<u64> = raw
        .iter()
        .filter(|e| {
            matches!(
                e.action.as_str(),
                "alloc" | "free_requested" | "free_completed"
            )
        })
        .map(|e| e.addr)
        .collect();
    let mut before: Vec<Event> = Vec::new();
    for seg in segments.iter().filter(|s| s.device == 0) {
        let mut addr = seg.address;
        for b in &seg.blocks {
            if b.state.starts_with("active") && !named.contains(&addr) {
                before.push(Event {
                    action: Action::Alloc,
                    addr,
                    size: b.requested_size.unwrap_or(b.size),
                    stream: seg.stream,
                    time_us: 0,
                });
            }
            addr = addr.saturating_add(b.size);
        }
    }
    before.extend(unpaired_frees(raw));
    before.sort_by_key(|e| e.addr);
    let start = raw
        .iter()
        .find(|e| matches!(e.action.as_str(), "alloc" | "free_completed"))
        .map_or(0, |e| e.time_us);
    for e in &mut before {
        e.time_us = start;
    }
    before
}

/// The blocks freed without an alloc in the history, as allocations: they were live when it began.
fn unpaired_frees(raw: &[RawEvent]) -> Vec<Event> {
    let mut seen = HashSet::new();
    raw.iter()
        .filter(|e| match e.action.as_str() {
            "alloc" => {
                seen.insert(e.addr);
                false
            }
            "free_completed" => seen.insert(e.addr),
            _ => false,
        })
        .map(|e| Event {
            action: Action::Alloc,
            addr: e.addr,
            size: e.size,
            stream: e.stream,
            time_us: 0,
        })
        .collect()
}

/// The trace of `raw`'s allocs paired with their completed frees, after `before`: allocations of
/// blocks live when the history began.
fn pair(before: Vec<Event>, raw: &[RawEvent]) -> Result<Trace, TraceError> {
    let mut live: HashMap<u64, u64> = before.iter().map(|e| (e.addr, e.size)).collect();
    let mut trace = Trace {
        before_history: before.len(),
        events: before,
        skipped_frees: 0,
    };
    for (index, e) in raw.iter().enumerate() {
        let action = match e.action.as_str() {
            "alloc" => {
                if live.insert(e.addr, e.size).is_some() {
                    return Err(TraceError::DoubleAlloc {
                        index,
                        addr: e.addr,
                    });
                }
                Action::Alloc
            }
            "free_completed" => match live.remove(&e.addr) {
                Some(size) => {
                    trace.events.push(Event {
                        action: Action::Free,
                        addr: e.addr,
                        size,
                        stream: e.stream,
                        time_us: e.time_us,
                    });
                    continue;
                }
                None => {
                    trace.skipped_frees += 1;
                    continue;
                }
            },
            _ => continue,
        };
        trace.events.push(Event {
            action,
            addr: e.addr,
            size: e.size,
            stream: e.stream,
            time_us: e.time_us,
        });
    }
    Ok(trace)
}

#[cfg(test)]
mod tests;
