//! The allocator's memory as segments and blocks: what PyTorch's memory snapshot shows.
//!
//! A segment is a maximal run of mapped memory in one heap (handles mapped side by side are one
//! segment, since blocks may span them); its blocks tile it exactly, live or free.

use serde::Serialize;

use super::freelist::Owner;
use super::heap::Heap;
use super::Live;

/// A contiguous range of mapped memory and the blocks that tile it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Segment {
    pub offset: u64,
    pub len: u64,
    /// In the small-request heap.
    pub small: bool,
    pub blocks: Vec<SegmentBlock>,
}

/// One block of a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct SegmentBlock {
    pub offset: u64,
    pub len: u64,
    /// Bytes asked for (0 for free blocks).
    pub requested: u64,
    pub state: BlockState,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockState {
    /// Handed to the application.
    Allocated,
    /// Free, but only its last stream may reuse it until that stream's fence completes.
    PendingFree,
    /// Free for every stream.
    Free,
}

/// The segments of `heap`, in address order.
pub(super) fn segments(
    heap: &Heap,
    live: &rustc_hash::FxHashMap<u64, Live>,
    small: bool,
) -> Vec<Segment> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for (&va, m) in &heap.handles {
        match runs.last_mut() {
            Some((start, len)) if *start + *len == va => *len += m.len,
            _ => runs.push((va, m.len)),
        }
    }
    runs.into_iter()
        .map(|(start, len)| Segment {
            offset: start,
            len,
            small,
            blocks: blocks_of(heap, live, start, start + len),
        })
        .collect()
}

fn blocks_of(
    heap: &Heap,
    live: &rustc_hash::FxHashMap<u64, Live>,
    start: u64,
    end: u64,
) -> Vec<SegmentBlock> {
    let mut blocks = Vec::new();
    let mut at = start;
    while at < end {
        let block = if let Some(b) = live.get(&at) {
            SegmentBlock {
                offset: at,
                len: b.len,
                requested: b.requested,
                state: BlockState::Allocated,
            }
        } else if let Some((s, r)) = heap.free.containing(at) {
            let state = match r.owner {
                Owner::Any => BlockState::Free,
                Owner::Stream(_) => BlockState::PendingFree,
            };
            SegmentBlock {
                offset: at,
                len: (s + r.len).min(end) - at,
                requested: 0,
                state,
            }
        } else {
            // Every mapped byte is in a live block or a free region; never reached.
            debug_assert!(false, "{at:#x} is mapped but neither live nor free");
            SegmentBlock {
                offset: at,
                len: end - at,
                requested: 0,
                state: BlockState::Free,
            }
        };
        at += block.len.max(1);
        blocks.push(block);
    }
    blocks
}
