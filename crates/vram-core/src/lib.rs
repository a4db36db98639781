//! vram-core: the pure logic of vramd. No I/O, no unsafe, no clocks read here: callers pass time
//! in.
#![forbid(unsafe_code)]

pub mod alloc;
pub mod books;
pub mod broker;
pub mod replay;
pub mod shared;
pub mod trace;
pub mod units;

pub use units::Bytes;
