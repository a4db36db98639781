//! Allocation traces: PyTorch memory snapshots (`torch.cuda.memory._snapshot()`, pickled,
//! optionally gzipped) read into a plain list of allocations and frees.
//!
//! Input is bytes, so this module does no I/O. The pickle is read as plain data (`pickle.rs`):
//! any class, object or call in it is an error, never run. Each device's history
//! (`device_traces[i]`) is a trace of its own: its `alloc` events paired by address with
//! `free_completed`. A process that ran on one GPU has events on that one alone, whichever its
//! index ([`parse_snapshot`]); [`parse_devices`] gives every device whose history has any.
//!
//! A history is a ring buffer: a long run's snapshot begins in the middle, while blocks allocated
//! before it (a model's weights) are live. The snapshot says which: a free whose alloc the history
//! never saw, and a block still allocated in the snapshot's `segments` at an address no event
//! names. [`parse_snapshot`] puts those blocks back as allocations at the start of the trace, in
//! address order (the process held them, and the allocator must place them too);
//! [`Trace::window_only`] drops them again, skipping the frees the history cannot pair.

use std::collections::{HashMap, HashSet};
use std::io::Read;

pub use pickle::PickleError;
use pickle::{Pickle, Value};

mod pickle;

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
    /// `us` as a share of the trace's wall time; none for a trace without duration (a history
    /// recorded without event times, or of one instant).
    pub fn share_of_wall(&self, us: f64) -> Option<f64> {
        match self.wall_us() {
            0 => None,
            wall => Some(us / wall as f64),
        }
    }

    /// Microseconds from the earliest event to the latest (events recorded by several threads
    /// need not be in time order).
    pub fn wall_us(&self) -> u64 {
        let times = self.events.iter().map(|e| e.time_us);
        match (times.clone().min(), times.max()) {
            (Some(first), Some(last)) => last - first,
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
    Pickle(#[from] PickleError),
    #[error("not a PyTorch memory snapshot: {0}")]
    Shape(String),
    #[error(
        "a zip archive (what torch.save writes), not a pickled snapshot: write it with \
         torch.cuda.memory._dump_snapshot(path) or pickle.dump(torch.cuda.memory._snapshot(), f)"
    )]
    Zip,
    #[error(
        "the snapshot's device histories ({devices} of them) record no allocation or free (was \
         torch.cuda.memory._record_memory_history() on before the program allocated?)"
    )]
    NoEvents { devices: usize },
    #[error(
        "the snapshot records allocations on devices {devices:?}, each a trace of its own \
         (read them with parse_devices)"
    )]
    SeveralDevices { devices: Vec<usize> },
    #[error("device {device}, event {index}: alloc at {addr:#x}, which is already allocated")]
    DoubleAlloc {
        device: usize,
        index: usize,
        addr: u64,
    },
}

const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];
/// A zip archive's first bytes: what `torch.save` writes.
const ZIP_MAGIC: [u8; 4] = *b"PK\x03\x04";

/// The parts of a snapshot a trace is made of. Everything else in it (frames, annotations, the
/// allocator's settings) is left unread.
struct Snapshot {
    device_traces: Vec<Vec<RawEvent>>,
    /// Read leniently: a `segments` list of another shape (another PyTorch version's) only hides
    /// the blocks still allocated that no event names; the events replay all the same.
    segments: Vec<RawSegment>,
}

/// A segment of the allocator's state when the snapshot was taken: its blocks lie side by side
/// from `address`.
struct RawSegment {
    device: u64,
    address: u64,
    stream: u64,
    blocks: Vec<RawBlock>,
}

struct RawBlock {
    size: u64,
    requested_size: Option<u64>,
    state: String,
}

struct RawEvent {
    action: String,
    addr: u64,
    size: u64,
    stream: u64,
    time_us: u64,
}

impl Snapshot {
    fn read(p: &Pickle) -> Result<Snapshot, String> {
        let root = p.root();
        let traces = p.get(root, "device_traces").ok_or_else(|| {
            format!(
                "its top value is {} without `device_traces`",
                Pickle::kind(root)
            )
        })?;
        let device_traces = list(p, traces, "device_traces")?
            .iter()
            .enumerate()
            .map(|(d, &history)| {
                list(p, history, &format!("device_traces[{d}]"))?
                    .iter()
                    .enumerate()
                    .map(|(i, &e)| RawEvent::read(p, e, (d, i)))
                    .collect()
            })
            .collect::<Result<_, String>>()?;
        let segments = p
            .get(root, "segments")
            .and_then(|s| p.items(s))
            .and_then(|s| s.iter().map(|&seg| RawSegment::read(p, seg)).collect())
            .unwrap_or_default();
        Ok(Snapshot {
            device_traces,
            segments,
        })
    }
}

impl RawSegment {
    fn read(p: &Pickle, seg: Value) -> Option<RawSegment> {
        let blocks = match p.get(seg, "blocks") {
            Some(b) => p
                .items(b)?
                .iter()
                .map(|&b| {
                    Some(RawBlock {
                        size: uint(p.get(b, "size")?)?,
                        requested_size: match p.get(b, "requested_size") {
                            None | Some(Value::None) => None,
                            Some(v) => Some(uint(v)?),
                        },
                        state: p.str(p.get(b, "state")?)?.to_owned(),
                    })
                })
                .collect::<Option<_>>()?,
            None => Vec::new(),
        };
        let or_zero = |key| p.get(seg, key).map_or(Some(0), uint);
        Some(RawSegment {
            device: or_zero("device")?,
            address: uint(p.get(seg, "address")?)?,
            stream: or_zero("stream")?,
            blocks,
        })
    }
}

impl RawEvent {
    /// Event `e`, `device_traces[d][i]`: its `action`, and its numbers (0 where one is
    /// missing). The event's place is written out only for an error.
    fn read(p: &Pickle, e: Value, (d, i): (usize, usize)) -> Result<RawEvent, String> {
        let at = format_args!("device_traces[{d}][{i}]");
        if !matches!(e, Value::Dict(_)) {
            return Err(format!("{at} is {}, not a dict", Pickle::kind(e)));
        }
        let action = p
            .get(e, "action")
            .ok_or_else(|| format!("{at} has no `action`"))?;
        let action = p
            .str(action)
            .ok_or_else(|| format!("{at}.action is {}, not a str", Pickle::kind(action)))?;
        let number = |key: &str| match p.get(e, key) {
            None => Ok(0),
            Some(v) => uint(v).ok_or_else(|| {
                format!(
                    "{at}.{key} is {}, not an int of 0 to 2^64-1",
                    Pickle::kind(v)
                )
            }),
        };
        Ok(RawEvent {
            action: action.to_owned(),
            addr: number("addr")?,
            size: number("size")?,
            stream: number("stream")?,
            time_us: number("time_us")?,
        })
    }
}

/// `v`'s items, where it is a list (or tuple), else what it is instead.
fn list<'p>(p: &'p Pickle, v: Value, at: &str) -> Result<&'p [Value], String> {
    p.items(v)
        .ok_or_else(|| format!("{at} is {}, not a list", Pickle::kind(v)))
}

/// `v` as an unsigned 64-bit integer, if it is one.
fn uint(v: Value) -> Option<u64> {
    match v {
        Value::Int(i) => u64::try_from(i).ok(),
        Value::UInt(u) => Some(u),
        _ => None,
    }
}

/// One device's trace in a snapshot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceTrace {
    /// The device's index in the snapshot (`device_traces[device]`, as CUDA numbered it there).
    pub device: usize,
    pub trace: Trace,
}

/// Reads a snapshot (gzipped or not, told apart by the gzip magic number) whose history records
/// one device's allocations: the trace of that device, whichever its index.
pub fn parse_snapshot(bytes: &[u8]) -> Result<Trace, TraceError> {
    let mut devices = parse_devices(bytes)?;
    match devices.len() {
        1 => Ok(devices.remove(0).trace),
        _ => Err(TraceError::SeveralDevices {
            devices: devices.iter().map(|d| d.device).collect(),
        }),
    }
}

/// Reads a snapshot: a trace for each device whose history records an allocation or a free, in
/// device order (a device with none is left out; a snapshot with none at all is an error, so an
/// empty history is never replayed as a workload that allocated nothing).
pub fn parse_devices(bytes: &[u8]) -> Result<Vec<DeviceTrace>, TraceError> {
    let inflated;
    if bytes.starts_with(&ZIP_MAGIC) {
        return Err(TraceError::Zip);
    }
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
    let snapshot = Snapshot::read(&pickle::read(pickle)?).map_err(TraceError::Shape)?;
    let mut traces = Vec::new();
    for (device, raw) in snapshot.device_traces.iter().enumerate() {
        if !raw.iter().any(|e| e.is_alloc() || e.is_free()) {
            continue;
        }
        let before = before_history(&snapshot.segments, device, raw);
        let trace = pair(before, device, raw)?;
        traces.push(DeviceTrace { device, trace });
    }
    if traces.is_empty() {
        return Err(TraceError::NoEvents {
            devices: snapshot.device_traces.len(),
        });
    }
    Ok(traces)
}

impl RawEvent {
    fn is_alloc(&self) -> bool {
        self.action == "alloc"
    }

    /// A free whose work has finished (the allocator may reuse the block).
    fn is_free(&self) -> bool {
        self.action == "free_completed"
    }
}

/// The blocks live on `device` when its history began, as allocations in address order at the
/// history's first timestamp: blocks still allocated on it at an address no event names, and
/// blocks freed without an alloc in the history.
fn before_history(segments: &[RawSegment], device: usize, raw: &[RawEvent]) -> Vec<Event> {
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
    for seg in segments.iter().filter(|s| s.device == device as u64) {
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
        .find(|e| e.is_alloc() || e.is_free())
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

/// The trace of `raw` (`device`'s history) allocs paired with their completed frees, after
/// `before`: allocations of blocks live when the history began.
fn pair(before: Vec<Event>, device: usize, raw: &[RawEvent]) -> Result<Trace, TraceError> {
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
                        device,
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
