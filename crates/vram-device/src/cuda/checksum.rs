//! The shared-buffer checksum (`vram_core::shared::checksum`) computed by a kernel over mapped
//! device memory, so that publish, verify and the scrub read a version at the GPU's memory
//! bandwidth instead of copying it to the host.
//!
//! The kernel is PTX written by hand (no nvcc at build time); the driver JIT-compiles it for the
//! GPU at the first use in a process. Each thread adds the terms `mix64(w_i ^ i·K)` of the words
//! it reads (a grid-stride loop, two loads in flight), the warp adds its 32 partial sums with
//! shuffles, and one lane per warp adds the warp's sum into an 8-byte result in device memory
//! (`red.global.add.u64`): wrapping addition is associative and commutative, so the result does not
//! depend on the order. A partial last word is read on the host (at most 7 bytes).

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;
use vram_core::shared::checksum::{MIX_1, MIX_2, POSITION_KEY};

use super::driver::{check, log_failure, Context};
use crate::Result;

/// `vramd_checksum(const u64 *data, u64 words, u64 first_word, u64 *out)`: adds to `*out` the
/// terms of `words` words at `data`, numbered from `first_word`. Any grid of warps-sized blocks.
const PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry vramd_checksum(
    .param .u64 p_data,
    .param .u64 p_words,
    .param .u64 p_first,
    .param .u64 p_out
)
{
    .reg .pred %p<4>;
    .reg .b32 %r<12>;
    .reg .b64 %rd<24>;

    ld.param.u64 %rd1, [p_data];
    ld.param.u64 %rd2, [p_words];
    ld.param.u64 %rd3, [p_first];
    ld.param.u64 %rd4, [p_out];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd4, %rd4;

    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %nctaid.x;
    mul.wide.u32 %rd5, %r1, %r2;
    cvt.u64.u32 %rd6, %r3;
    add.u64 %rd5, %rd5, %rd6;
    mul.wide.u32 %rd7, %r4, %r2;
    mov.u64 %rd8, 0;

    // Two words per step, i and i + stride, while both exist.
PAIR:
    add.u64 %rd9, %rd5, %rd7;
    setp.ge.u64 %p1, %rd9, %rd2;
    @%p1 bra ONE;
    shl.b64 %rd10, %rd5, 3;
    add.u64 %rd10, %rd1, %rd10;
    shl.b64 %rd11, %rd9, 3;
    add.u64 %rd11, %rd1, %rd11;
    ld.global.nc.u64 %rd12, [%rd10];
    ld.global.nc.u64 %rd13, [%rd11];
    add.u64 %rd14, %rd3, %rd5;
    mul.lo.u64 %rd14, %rd14, {KEY};
    xor.b64 %rd12, %rd12, %rd14;
    add.u64 %rd15, %rd3, %rd9;
    mul.lo.u64 %rd15, %rd15, {KEY};
    xor.b64 %rd13, %rd13, %rd15;
    shr.u64 %rd14, %rd12, 30;
    xor.b64 %rd12, %rd12, %rd14;
    shr.u64 %rd15, %rd13, 30;
    xor.b64 %rd13, %rd13, %rd15;
    mul.lo.u64 %rd12, %rd12, {MIX1};
    mul.lo.u64 %rd13, %rd13, {MIX1};
    shr.u64 %rd14, %rd12, 27;
    xor.b64 %rd12, %rd12, %rd14;
    shr.u64 %rd15, %rd13, 27;
    xor.b64 %rd13, %rd13, %rd15;
    mul.lo.u64 %rd12, %rd12, {MIX2};
    mul.lo.u64 %rd13, %rd13, {MIX2};
    shr.u64 %rd14, %rd12, 31;
    xor.b64 %rd12, %rd12, %rd14;
    shr.u64 %rd15, %rd13, 31;
    xor.b64 %rd13, %rd13, %rd15;
    add.u64 %rd8, %rd8, %rd12;
    add.u64 %rd8, %rd8, %rd13;
    add.u64 %rd5, %rd9, %rd7;
    bra.uni PAIR;

    // At most one word left for this thread.
ONE:
    setp.ge.u64 %p2, %rd5, %rd2;
    @%p2 bra REDUCE;
    shl.b64 %rd10, %rd5, 3;
    add.u64 %rd10, %rd1, %rd10;
    ld.global.nc.u64 %rd12, [%rd10];
    add.u64 %rd14, %rd3, %rd5;
    mul.lo.u64 %rd14, %rd14, {KEY};
    xor.b64 %rd12, %rd12, %rd14;
    shr.u64 %rd14, %rd12, 30;
    xor.b64 %rd12, %rd12, %rd14;
    mul.lo.u64 %rd12, %rd12, {MIX1};
    shr.u64 %rd14, %rd12, 27;
    xor.b64 %rd12, %rd12, %rd14;
    mul.lo.u64 %rd12, %rd12, {MIX2};
    shr.u64 %rd14, %rd12, 31;
    xor.b64 %rd12, %rd12, %rd14;
    add.u64 %rd8, %rd8, %rd12;

    // The warp's 32 sums into lane 0, then one atomic add per warp.
REDUCE:
    mov.b64 {%r5, %r6}, %rd8;
    shfl.sync.down.b32 %r7, %r5, 16, 31, 0xffffffff;
    shfl.sync.down.b32 %r8, %r6, 16, 31, 0xffffffff;
    mov.b64 %rd16, {%r7, %r8};
    add.u64 %rd8, %rd8, %rd16;
    mov.b64 {%r5, %r6}, %rd8;
    shfl.sync.down.b32 %r7, %r5, 8, 31, 0xffffffff;
    shfl.sync.down.b32 %r8, %r6, 8, 31, 0xffffffff;
    mov.b64 %rd16, {%r7, %r8};
    add.u64 %rd8, %rd8, %rd16;
    mov.b64 {%r5, %r6}, %rd8;
    shfl.sync.down.b32 %r7, %r5, 4, 31, 0xffffffff;
    shfl.sync.down.b32 %r8, %r6, 4, 31, 0xffffffff;
    mov.b64 %rd16, {%r7, %r8};
    add.u64 %rd8, %rd8, %rd16;
    mov.b64 {%r5, %r6}, %rd8;
    shfl.sync.down.b32 %r7, %r5, 2, 31, 0xffffffff;
    shfl.sync.down.b32 %r8, %r6, 2, 31, 0xffffffff;
    mov.b64 %rd16, {%r7, %r8};
    add.u64 %rd8, %rd8, %rd16;
    mov.b64 {%r5, %r6}, %rd8;
    shfl.sync.down.b32 %r7, %r5, 1, 31, 0xffffffff;
    shfl.sync.down.b32 %r8, %r6, 1, 31, 0xffffffff;
    mov.b64 %rd16, {%r7, %r8};
    add.u64 %rd8, %rd8, %rd16;
    and.b32 %r9, %r3, 31;
    setp.ne.u32 %p3, %r9, 0;
    @%p3 bra END;
    red.global.add.u64 [%rd4], %rd8;
END:
    ret;
}
"#;

/// The kernel's name in [`PTX`].
const ENTRY: &[u8] = b"vramd_checksum\0";
/// Threads per block: a multiple of the warp size (the reduction assumes whole warps).
const BLOCK: u32 = 256;
/// At most this many blocks (about 30 per SM of an H200): enough to keep every SM's memory
/// pipeline busy; beyond it each thread loops.
const MAX_BLOCKS: u64 = 4096;

/// The PTX with the algorithm's constants filled in (as the signed decimals nvcc writes).
fn ptx() -> String {
    PTX.replace("{KEY}", &(POSITION_KEY as i64).to_string())
        .replace("{MIX1}", &(MIX_1 as i64).to_string())
        .replace("{MIX2}", &(MIX_2 as i64).to_string())
        + "\0"
}

/// The loaded kernel and its 8-byte result buffer, in one context. One launch at a time (the
/// result buffer is shared): callers hold the lock.
pub(crate) struct Kernel {
    ctx: Arc<Context>,
    module: sys::CUmodule,
    function: sys::CUfunction,
    result: sys::CUdeviceptr,
    lock: Mutex<()>,
}

// SAFETY: the module, function and result buffer are driver objects usable from any thread with
// their context current; every use pushes the context, and launches hold the lock.
unsafe impl Send for Kernel {}
// SAFETY: as for Send.
unsafe impl Sync for Kernel {}

impl std::fmt::Debug for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("checksum::Kernel").finish_non_exhaustive()
    }
}

impl Kernel {
    /// Loads the module (the driver compiles the PTX) and allocates the result buffer. Needs a
    /// context: a context-free device gets the driver's error.
    pub fn load(ctx: &Arc<Context>) -> Result<Kernel> {
        let ptx = ptx();
        let _entered = ctx.enter()?;
        let mut module = std::ptr::null_mut();
        // SAFETY: a context is current; `ptx` is a NUL-terminated PTX text that lives through the
        // call (the driver copies what it needs). Unloaded in Drop.
        check("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(&mut module, ptx.as_ptr().cast::<c_void>())
        })?;
        let mut kernel = Kernel {
            ctx: Arc::clone(ctx),
            module,
            function: std::ptr::null_mut(),
            result: 0,
            lock: Mutex::new(()),
        };
        // SAFETY: `module` was just loaded; ENTRY is NUL-terminated and names its one entry.
        check("cuModuleGetFunction", unsafe {
            sys::cuModuleGetFunction(&mut kernel.function, module, ENTRY.as_ptr().cast())
        })?;
        // SAFETY: a context is current; `result` is a valid out pointer. Freed in Drop.
        check("cuMemAlloc", unsafe {
            sys::cuMemAlloc_v2(&mut kernel.result, 8)
        })?;
        Ok(kernel)
    }

    /// The wrapping sum of the terms of `words` 8-byte words at device address `ptr` (8-byte
    /// aligned, mapped readable on this context's device), numbered from `first_word`.
    ///
    /// # Safety
    /// `ptr..ptr + 8·words` must stay mapped, readable by this device, for the whole call.
    pub unsafe fn sum_words(&self, ptr: u64, words: u64, first_word: u64) -> Result<u64> {
        if words == 0 {
            return Ok(0);
        }
        debug_assert_eq!(ptr % 8, 0);
        let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let _entered = self.ctx.enter()?;
        // SAFETY: `result` is our 8-byte device allocation; the legacy default stream orders this
        // fill before the launch below.
        check("cuMemsetD8", unsafe {
            sys::cuMemsetD8_v2(self.result, 0, 8)
        })?;
        let blocks = words.div_ceil(u64::from(BLOCK)).min(MAX_BLOCKS) as u32;
        let (mut data, mut n, mut first, mut out) = (ptr, words, first_word, self.result);
        let mut params: [*mut c_void; 4] = [
            (&mut data as *mut u64).cast(),
            (&mut n as *mut u64).cast(),
            (&mut first as *mut u64).cast(),
            (&mut out as *mut u64).cast(),
        ];
        // SAFETY: `function` takes four .u64 parameters, each pointed to by `params` (alive
        // through the call, which copies them); the kernel reads `words` words at `ptr` (mapped
        // and readable: the caller's contract) and adds to `result`. Stream 0: the legacy default
        // stream, ordered with the fill above and the copy below.
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                self.function,
                blocks,
                1,
                1,
                BLOCK,
                1,
                1,
                0,
                std::ptr::null_mut(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })?;
        let mut sum = 0u64;
        // SAFETY: copies the 8-byte result into a live host u64; synchronous for pageable
        // memory, and on the legacy default stream it waits for the kernel (whose failure this
        // call reports).
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2((&mut sum as *mut u64).cast(), self.result, 8)
        })?;
        Ok(sum)
    }
}

impl Drop for Kernel {
    fn drop(&mut self) {
        let Ok(_entered) = self.ctx.enter() else {
            return;
        };
        if self.result != 0 {
            // SAFETY: allocated by cuMemAlloc in `load`, freed once; no launch is running (launches
            // end with a synchronous copy before they return).
            log_failure("cuMemFree", unsafe { sys::cuMemFree_v2(self.result) });
        }
        // SAFETY: loaded in `load`, unloaded once; its function is not used after this.
        log_failure("cuModuleUnload", unsafe {
            sys::cuModuleUnload(self.module)
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptx_has_every_constant_filled_in() {
        let p = ptx();
        for placeholder in ["{KEY}", "{MIX1}", "{MIX2}"] {
            assert!(!p.contains(placeholder), "{placeholder} left in the PTX");
        }
        assert!(p.contains("-7046029254386353131"));
        assert!(p.ends_with('\0'));
    }
}
