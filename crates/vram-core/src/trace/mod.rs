//! Allocation traces: PyTorch memory snapshots (`torch.cuda.memory._snapshot()`, pickled, optionally
//! gzipped) read into a plain list of allocations and frees.
//!
//! Input is bytes, so this module does no I/O. The pickle is decoded strictly: any class or other
//! global reference (`GLOBAL`, `STACK_GLOBAL`, `REDUCE` on anything but the builtin containers
//! serde-pickle knows, such as `set`) is an error, never a call. Only `device_traces[0]` is read:
//! its `alloc` events paired by address with `free_completed`; a free whose alloc the history never
//! saw (the ring buffer dropped it) is skipped and counted.

use std::collections::HashMap;
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
    /// Frees skipped because their alloc happened before the history began.
    pub skipped_frees: usize,
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
    pair(raw)
}

fn pair(raw: Vec<RawEvent>) -> Result<Trace, TraceError> {
    let mut live: HashMap<u64, u64> = HashMap::new();
    let mut trace = Trace::default();
    for (index, e) in raw.into_iter().enumerate() {
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
