//! Copies between this process's own buffers and memory that other processes map and may write
//! at the same time (the host backend's memfd mappings).
//!
//! Every access to the shared side is a volatile load or store: the compiler may not merge,
//! split, repeat, elide or invent any of them, nor assume the memory holds what it held before,
//! as it may for memory only Rust code of this process reaches. Aligned 8-byte words are moved
//! with one access each, so a word another process writes whole is read whole (on the 64-bit
//! targets vramd runs on); the unaligned bytes at either end go one by one. These helpers order
//! nothing with respect to other processes: when a writer's bytes are visible to a reader is the
//! protocol's (a shared-buffer version is published through the daemon's socket, a system call).

use std::ptr::{read_volatile, write_volatile};

const WORD: usize = size_of::<u64>();

/// How `len` bytes starting at `addr` split: bytes before the first aligned word, whole words,
/// bytes after the last.
fn split(addr: usize, len: usize) -> (usize, usize, usize) {
    let head = (addr.wrapping_neg() % WORD).min(len);
    let words = (len - head) / WORD;
    (head, words, len - head - words * WORD)
}

/// Copies `out.len()` bytes from `src` into `out`.
///
/// # Safety
/// `src..src + out.len()` must be mapped readable for the whole call. Other processes may write
/// it meanwhile; nothing else of this process may hold a Rust reference into it.
pub(super) unsafe fn copy_from(src: *const u8, out: &mut [u8]) {
    let (head, words, _) = split(src as usize, out.len());
    let (start, rest) = out.split_at_mut(head);
    let (body, tail) = rest.split_at_mut(words * WORD);
    for (i, b) in start.iter_mut().enumerate() {
        // SAFETY: `src + i` lies in the readable range the caller vouches for (i < head ≤ len).
        *b = unsafe { read_volatile(src.add(i)) };
    }
    // SAFETY: `head ≤ len`, so this stays inside the range (or one past its end when empty).
    let words_at = unsafe { src.add(head) }.cast::<u64>();
    for (w, chunk) in body.chunks_exact_mut(WORD).enumerate() {
        // SAFETY: `words_at` is 8-byte aligned (`split` skipped the unaligned head) and word `w`
        // lies inside the range, since `w < words` and the words end at `head + words·8 ≤ len`.
        let v = unsafe { read_volatile(words_at.add(w)) };
        chunk.copy_from_slice(&v.to_ne_bytes());
    }
    let tail_at = head + words * WORD;
    for (i, b) in tail.iter_mut().enumerate() {
        // SAFETY: `tail_at + i < len`: inside the range.
        *b = unsafe { read_volatile(src.add(tail_at + i)) };
    }
}

/// Copies `data` to `dst`.
///
/// # Safety
/// `dst..dst + data.len()` must be mapped writable for the whole call and must not overlap
/// `data`. Other processes may read or write it meanwhile; nothing else of this process may hold
/// a Rust reference into it.
pub(super) unsafe fn copy_to(dst: *mut u8, data: &[u8]) {
    let (head, words, _) = split(dst as usize, data.len());
    let (start, rest) = data.split_at(head);
    let (body, tail) = rest.split_at(words * WORD);
    for (i, &b) in start.iter().enumerate() {
        // SAFETY: `dst + i` lies in the writable range the caller vouches for (i < head ≤ len).
        unsafe { write_volatile(dst.add(i), b) };
    }
    // SAFETY: `head ≤ len`, so this stays inside the range (or one past its end when empty).
    let words_at = unsafe { dst.add(head) }.cast::<u64>();
    for (w, chunk) in body.chunks_exact(WORD).enumerate() {
        let v = u64::from_ne_bytes(chunk.try_into().expect("chunks of one word"));
        // SAFETY: aligned and inside the range, as in `copy_from`.
        unsafe { write_volatile(words_at.add(w), v) };
    }
    let tail_at = head + words * WORD;
    for (i, &b) in tail.iter().enumerate() {
        // SAFETY: `tail_at + i < len`: inside the range.
        unsafe { write_volatile(dst.add(tail_at + i), b) };
    }
}

/// Sets `len` bytes at `dst` to `byte`.
///
/// # Safety
/// As for [`copy_to`]: `dst..dst + len` mapped writable for the whole call.
pub(super) unsafe fn fill(dst: *mut u8, len: usize, byte: u8) {
    let (head, words, tail) = split(dst as usize, len);
    for i in 0..head {
        // SAFETY: `i < head ≤ len`: inside the writable range the caller vouches for.
        unsafe { write_volatile(dst.add(i), byte) };
    }
    // SAFETY: `head ≤ len`, so this stays inside the range (or one past its end when empty).
    let words_at = unsafe { dst.add(head) }.cast::<u64>();
    let word = u64::from_ne_bytes([byte; WORD]);
    for w in 0..words {
        // SAFETY: aligned and inside the range, as in `copy_from`.
        unsafe { write_volatile(words_at.add(w), word) };
    }
    let tail_at = head + words * WORD;
    for i in 0..tail {
        // SAFETY: `tail_at + i < len`: inside the range.
        unsafe { write_volatile(dst.add(tail_at + i), byte) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPAN: usize = 64;

    /// Every start within two words and every length across a few words: the unaligned ends,
    /// empty copies, copies with no whole word.
    fn cases() -> impl Iterator<Item = (usize, usize)> {
        (0..2 * WORD).flat_map(|at| (0..=SPAN - at).map(move |len| (at, len)))
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    /// A buffer aligned to a word, so that `at` fixes the alignment of the copy's start.
    fn aligned() -> Box<[u64; SPAN / WORD]> {
        Box::new([0; SPAN / WORD])
    }

    #[test]
    fn split_covers_the_range_with_aligned_words() {
        for addr in 0..3 * WORD {
            for len in 0..SPAN {
                let (head, words, tail) = split(addr, len);
                assert_eq!(head + words * WORD + tail, len);
                assert!(head < WORD && (words == 0 || tail < WORD));
                if words > 0 {
                    assert_eq!((addr + head) % WORD, 0);
                }
            }
        }
    }

    #[test]
    fn copy_from_reads_exactly_the_range() {
        let mut words = aligned();
        let src = words.as_mut_ptr().cast::<u8>();
        let all = pattern(SPAN, 7);
        // SAFETY: `src` is the start of a live, exclusively borrowed buffer of SPAN bytes.
        unsafe { std::ptr::copy_nonoverlapping(all.as_ptr(), src, SPAN) };
        for (at, len) in cases() {
            let mut out = vec![0xEE; len];
            // SAFETY: `at + len ≤ SPAN`, inside the buffer, which nothing else refers to.
            unsafe { copy_from(src.add(at), &mut out) };
            assert_eq!(out, all[at..at + len], "at {at}, {len} bytes");
        }
    }

    #[test]
    fn copy_to_and_fill_write_exactly_the_range() {
        for (at, len) in cases() {
            let mut words = aligned();
            let dst = words.as_mut_ptr().cast::<u8>();
            let data = pattern(len, 3);
            // SAFETY: `at + len ≤ SPAN`, inside the buffer, which nothing else refers to.
            unsafe { copy_to(dst.add(at), &data) };
            let mut expected = vec![0; SPAN];
            expected[at..at + len].copy_from_slice(&data);
            // SAFETY: the whole buffer, read after the copy returned.
            let seen = unsafe { std::slice::from_raw_parts(dst, SPAN) };
            assert_eq!(seen, expected, "copy_to at {at}, {len} bytes");

            // SAFETY: as above.
            unsafe { fill(dst.add(at), len, 0xA5) };
            expected[at..at + len].fill(0xA5);
            // SAFETY: as above.
            let seen = unsafe { std::slice::from_raw_parts(dst, SPAN) };
            assert_eq!(seen, expected, "fill at {at}, {len} bytes");
        }
    }
}
