//! Stream events for the client allocator's stream-ordered reuse: a fence is an event recorded on
//! the freeing stream; it is complete once the GPU has passed it.
//!
//! Events are pooled (creating one per free would cost a driver call each time) and named by a
//! slot index and a generation, so a fence whose event was recycled reads as complete — it was,
//! when it was recycled.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::sys::{self, CUresult};

use super::driver::{check, log_failure, Context};
use super::CudaDevice;
use crate::Result;

struct Slot {
    event: sys::CUevent,
    generation: u32,
    in_flight: bool,
}

#[derive(Default)]
struct Slab {
    slots: Vec<Slot>,
    free: Vec<usize>,
}

/// A pool of CUDA events on one device's primary context.
pub struct EventPool {
    ctx: Arc<Context>,
    slab: Mutex<Slab>,
}

// SAFETY: CUevent handles are opaque driver objects usable from any thread once their context is
// current; every use here pushes the context first and holds the slab lock.
unsafe impl Send for EventPool {}
// SAFETY: as for Send; all state is behind the mutex.
unsafe impl Sync for EventPool {}

impl std::fmt::Debug for EventPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventPool").finish_non_exhaustive()
    }
}

/// `CUstream` of the legacy default stream, and what an opaque stream id of 0 means.
pub const DEFAULT_STREAM: u64 = 0;

impl EventPool {
    pub fn new(dev: &CudaDevice) -> EventPool {
        EventPool {
            ctx: dev.context().clone(),
            slab: Mutex::new(Slab::default()),
        }
    }

    /// Whether `stream` is being captured into a CUDA graph: nothing may be recorded on it then.
    pub fn is_capturing(&self, stream: u64) -> Result<bool> {
        let _entered = self.ctx.enter()?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: `stream` is a CUstream of this context given by the application (or 0, the
        // default stream); `status` is a valid out pointer.
        check("cuStreamIsCapturing", unsafe {
            sys::cuStreamIsCapturing(stream as sys::CUstream, &mut status)
        })?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// Waits until all work queued on the context so far has finished.
    pub fn synchronize(&self) -> Result<()> {
        let _entered = self.ctx.enter()?;
        // SAFETY: the context is current (entered above); the call takes no pointers.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    /// Records a fence on `stream` now; returns its id.
    pub fn record(&self, stream: u64) -> Result<u64> {
        let _entered = self.ctx.enter()?;
        let mut slab = self.slab.lock().unwrap_or_else(|p| p.into_inner());
        let index = match slab.free.pop() {
            Some(i) => i,
            None => {
                let mut event = std::ptr::null_mut();
                // SAFETY: the context is current; `event` is a valid out pointer. Destroyed in
                // Drop.
                check("cuEventCreate", unsafe {
                    sys::cuEventCreate(
                        &mut event,
                        sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
                    )
                })?;
                slab.slots.push(Slot {
                    event,
                    generation: 0,
                    in_flight: false,
                });
                slab.slots.len() - 1
            }
        };
        let slot = &mut slab.slots[index];
        // SAFETY: `slot.event` was created in this context and is not destroyed while pooled;
        // `stream` is the application's stream of this context (or 0).
        let r = unsafe { sys::cuEventRecord(slot.event, stream as sys::CUstream) };
        if let Err(e) = check("cuEventRecord", r) {
            slab.free.push(index);
            return Err(e);
        }
        slot.in_flight = true;
        Ok(((index as u64) << 32) | u64::from(slot.generation))
    }

    /// Waits until the GPU has passed the fence `id`, for at most `limit`: true if it has. It
    /// polls the event with a growing pause instead of blocking in the driver, so that a fence
    /// that cannot complete while this thread waits (queued behind a collective whose peer this
    /// thread has yet to launch) costs `limit`, never a hang.
    pub fn wait(&self, id: u64, limit: Duration) -> bool {
        let started = Instant::now();
        let mut pause = Duration::from_micros(20);
        loop {
            if self.is_complete(id) {
                return true;
            }
            let left = limit.saturating_sub(started.elapsed());
            if left.is_zero() {
                return false;
            }
            std::thread::sleep(pause.min(left));
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }

    /// Whether the GPU has passed the fence `id`. A completed event goes back to the pool.
    pub fn is_complete(&self, id: u64) -> bool {
        let (index, generation) = ((id >> 32) as usize, id as u32);
        let mut slab = self.slab.lock().unwrap_or_else(|p| p.into_inner());
        let Some(slot) = slab.slots.get_mut(index) else {
            return true;
        };
        if slot.generation != generation || !slot.in_flight {
            return true;
        }
        let Ok(_entered) = self.ctx.enter() else {
            return false;
        };
        // SAFETY: the event is live (pooled, never destroyed before Drop) and its context current.
        let r = unsafe { sys::cuEventQuery(slot.event) };
        match r {
            CUresult::CUDA_SUCCESS => {
                slot.in_flight = false;
                slot.generation = slot.generation.wrapping_add(1);
                slab.free.push(index);
                true
            }
            CUresult::CUDA_ERROR_NOT_READY => false,
            other => {
                // An error here (a failed kernel poisons the context) must not let memory be reused
                // early: report it and keep waiting.
                log_failure("cuEventQuery", other);
                false
            }
        }
    }
}

impl Drop for EventPool {
    fn drop(&mut self) {
        let Ok(_entered) = self.ctx.enter() else {
            return;
        };
        let slab = self.slab.get_mut().unwrap_or_else(|p| p.into_inner());
        for slot in &slab.slots {
            // SAFETY: each event was created by this pool in this context and is destroyed once.
            let r = unsafe { sys::cuEventDestroy_v2(slot.event) };
            log_failure("cuEventDestroy", r);
        }
    }
}
