//! The checksum of a published version: a position-keyed sum of mixed 64-bit words, the same on
//! the host and on a GPU (the cuda backend computes it with a kernel over device memory, without
//! copying the version to the host: `vram_device::Device::checksum`).
//!
//! The bytes are read as little-endian 64-bit words `w_i` (a partial last word padded with zero
//! bytes). Each word gives one term, `mix64(w_i ^ i·K)`, where `i` is the word's index from the
//! start of the version and `mix64` is SplitMix64's finaliser (xor-shift-multiply, a bijection of
//! 64-bit values); the terms are added with wrapping arithmetic, and the sum is finished with the
//! length: `mix64(sum + mix64(len ^ L))`.
//!
//! Properties:
//! - any change confined to one word (a flipped bit or byte anywhere) changes the checksum with
//!   certainty: the word's term changes (a bijection of a changed input), so the sum changes, and
//!   the finish is a bijection of the sum for a given length;
//! - swapped or moved words change it (each term is keyed by its position), as do different
//!   lengths, trailing zeros included;
//! - other corruption goes unnoticed with a probability of about 2⁻⁶⁴ (it is no defence against
//!   an adversary: anyone can forge a version with a given checksum);
//! - the terms are independent, so the sum is computed in any order, in pieces, on any number of
//!   threads, and GPU pieces and host pieces combine ([`Checksummer::add_words`]).

/// The multiplier of the position key (2⁶⁴ / φ, odd).
pub const POSITION_KEY: u64 = 0x9E37_79B9_7F4A_7C15;
/// Mixed into the length at the finish.
pub const LENGTH_KEY: u64 = 0xD6E8_FEB8_6659_FD93;
/// The multipliers of [`mix64`] (SplitMix64's finaliser).
pub const MIX_1: u64 = 0xBF58_476D_1CE4_E5B9;
pub const MIX_2: u64 = 0x94D0_49BB_1331_11EB;

/// SplitMix64's finaliser: a bijection of 64-bit values with good avalanche.
#[inline(always)]
pub const fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(MIX_1);
    z = (z ^ (z >> 27)).wrapping_mul(MIX_2);
    z ^ (z >> 31)
}

/// The term of word `w` at word index `i`.
#[inline(always)]
pub const fn term(w: u64, i: u64) -> u64 {
    mix64(w ^ i.wrapping_mul(POSITION_KEY))
}

/// The wrapping sum of the terms of `bytes` read as words numbered from `first_word`; a partial
/// last word is padded with zero bytes.
pub fn sum_words(bytes: &[u8], first_word: u64) -> u64 {
    let mut chunks = bytes.chunks_exact(32);
    // The position keys by addition (`i·K` for consecutive `i`), four words per step in
    // independent accumulators so that the multiplies of different words overlap.
    let mut key = first_word.wrapping_mul(POSITION_KEY);
    const STEP: u64 = POSITION_KEY.wrapping_mul(4);
    let (mut a0, mut a1, mut a2, mut a3) = (0u64, 0u64, 0u64, 0u64);
    let word = |c: &[u8], k: usize| u64::from_le_bytes(c[8 * k..8 * k + 8].try_into().expect("8"));
    for c in &mut chunks {
        a0 = a0.wrapping_add(mix64(word(c, 0) ^ key));
        a1 = a1.wrapping_add(mix64(word(c, 1) ^ key.wrapping_add(POSITION_KEY)));
        a2 = a2.wrapping_add(mix64(
            word(c, 2) ^ key.wrapping_add(POSITION_KEY.wrapping_mul(2)),
        ));
        a3 = a3.wrapping_add(mix64(
            word(c, 3) ^ key.wrapping_add(POSITION_KEY.wrapping_mul(3)),
        ));
        key = key.wrapping_add(STEP);
    }
    let mut sum = a0.wrapping_add(a1).wrapping_add(a2).wrapping_add(a3);
    for c in chunks.remainder().chunks(8) {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        sum = sum.wrapping_add(mix64(u64::from_le_bytes(w) ^ key));
        key = key.wrapping_add(POSITION_KEY);
    }
    sum
}

/// The checksum of `len` bytes whose terms add up to `sum`.
pub const fn finish(sum: u64, len: u64) -> u64 {
    mix64(sum.wrapping_add(mix64(len ^ LENGTH_KEY)))
}

/// The checksum of `bytes` in one piece.
pub fn checksum(bytes: &[u8]) -> u64 {
    finish(sum_words(bytes, 0), bytes.len() as u64)
}

/// A checksum fed in pieces of any length; equal to [`checksum`] of the concatenation.
#[derive(Clone, Default)]
pub struct Checksummer {
    sum: u64,
    /// Bytes fed so far.
    len: u64,
    /// The bytes of a partial word not yet added (`len % 8` of them).
    pending: [u8; 8],
    /// A sum added by [`Checksummer::add_words`] ended inside a word, its padded last word
    /// included: nothing more may be fed.
    sealed: bool,
}

impl Checksummer {
    pub fn new() -> Checksummer {
        Checksummer::default()
    }

    /// Bytes fed so far.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the bytes fed so far end on a word boundary: only then can
    /// [`Checksummer::add_words`] take a sum computed elsewhere.
    pub fn at_word_boundary(&self) -> bool {
        self.len.is_multiple_of(8)
    }

    /// The index of the next word.
    pub fn next_word(&self) -> u64 {
        self.len / 8
    }

    pub fn update(&mut self, mut bytes: &[u8]) {
        assert!(
            !self.sealed || bytes.is_empty(),
            "nothing may follow a sum that ended inside a word"
        );
        let have = (self.len % 8) as usize;
        if have != 0 {
            let take = (8 - have).min(bytes.len());
            self.pending[have..have + take].copy_from_slice(&bytes[..take]);
            self.len += take as u64;
            bytes = &bytes[take..];
            if !self.len.is_multiple_of(8) {
                return;
            }
            let w = u64::from_le_bytes(self.pending);
            self.sum = self.sum.wrapping_add(term(w, self.len / 8 - 1));
        }
        let whole = bytes.len() / 8 * 8;
        self.sum = self
            .sum
            .wrapping_add(sum_words(&bytes[..whole], self.len / 8));
        self.len += whole as u64;
        let rest = &bytes[whole..];
        self.pending = [0; 8];
        self.pending[..rest.len()].copy_from_slice(rest);
        self.len += rest.len() as u64;
    }

    /// Adds `sum`, the sum of the terms of `len` bytes that come next, computed elsewhere (a GPU
    /// kernel) with words numbered from [`Checksummer::next_word`]. The bytes fed so far must end
    /// on a word boundary; `len` may end inside a word (its padded last word is in `sum`) only if
    /// nothing is fed after it.
    pub fn add_words(&mut self, sum: u64, len: u64) {
        assert!(
            self.at_word_boundary(),
            "a sum computed elsewhere must start on a word boundary (at byte {})",
            self.len
        );
        assert!(
            !self.sealed,
            "nothing may follow a sum that ended inside a word"
        );
        self.sum = self.sum.wrapping_add(sum);
        self.len += len;
        self.pending = [0; 8];
        self.sealed = !len.is_multiple_of(8);
    }

    pub fn finish(&self) -> u64 {
        let mut sum = self.sum;
        if !self.len.is_multiple_of(8) && !self.sealed {
            sum = sum.wrapping_add(term(u64::from_le_bytes(self.pending), self.len / 8));
        }
        finish(sum, self.len)
    }
}

impl std::fmt::Debug for Checksummer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Checksummer({} bytes, {:016x})", self.len, self.finish())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed;
        (0..n)
            .map(|_| {
                x = x.wrapping_add(POSITION_KEY);
                (mix64(x) >> 56) as u8
            })
            .collect()
    }

    /// The definition, word by word, without the unrolling of `sum_words`.
    fn reference(bytes: &[u8]) -> u64 {
        let mut sum = 0u64;
        for (i, c) in bytes.chunks(8).enumerate() {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            sum = sum.wrapping_add(mix64(
                u64::from_le_bytes(w) ^ (i as u64).wrapping_mul(POSITION_KEY),
            ));
        }
        finish(sum, bytes.len() as u64)
    }

    #[test]
    fn known_values_do_not_change() {
        // Pinned, so that a change of the function (which would make old clients and daemons
        // disagree) cannot pass unnoticed. The GPU test compares the kernel against `checksum`.
        assert_eq!(mix64(0), 0);
        assert_eq!(mix64(1), 0x5692_161d_100b_05e5);
        assert_eq!(checksum(&[]), 0x1418_ad48_6594_e4da);
        assert_eq!(checksum(b"vramd"), 0x0f2d_5033_d495_d088);
        let d: Vec<u8> = (0..=255u8).collect();
        assert_eq!(checksum(&d), 0x8837_1467_a339_1ca7);
        assert_eq!(checksum(&d), reference(&d));
    }

    #[test]
    fn unrolled_sum_equals_the_definition() {
        for n in [0, 1, 7, 8, 9, 31, 32, 33, 63, 64, 65, 1000, 4096, 4099] {
            let d = data(n, n as u64);
            assert_eq!(checksum(&d), reference(&d), "length {n}");
        }
    }

    #[test]
    fn pieces_equal_the_whole() {
        let d = data(100_000, 1);
        for piece in [1, 3, 7, 8, 13, 4093, 65536] {
            let mut c = Checksummer::new();
            for p in d.chunks(piece) {
                c.update(p);
            }
            assert_eq!(c.finish(), checksum(&d), "pieces of {piece}");
            assert_eq!(c.len(), d.len() as u64);
        }
        assert_ne!(checksum(&d[1..]), checksum(&d));
    }

    #[test]
    fn sums_computed_elsewhere_combine() {
        let d = data(10_003, 2);
        let mut c = Checksummer::new();
        c.update(&d[..4000]);
        let (mid, last) = (&d[4000..8000], &d[8000..]);
        c.add_words(sum_words(mid, c.next_word()), mid.len() as u64);
        c.add_words(sum_words(last, c.next_word()), last.len() as u64);
        assert_eq!(c.finish(), checksum(&d));
    }

    #[test]
    fn any_flipped_bit_changes_it() {
        for n in [1usize, 5, 8, 13, 64, 257] {
            let d = data(n, 3);
            let sum = checksum(&d);
            for byte in 0..n {
                for bit in 0..8 {
                    let mut e = d.clone();
                    e[byte] ^= 1 << bit;
                    assert_ne!(checksum(&e), sum, "length {n}, byte {byte}, bit {bit}");
                }
            }
        }
    }

    #[test]
    fn moved_words_and_trailing_zeros_change_it() {
        let d = data(64, 4);
        let sum = checksum(&d);
        let mut swapped = d.clone();
        let (a, b) = swapped.split_at_mut(8);
        a.swap_with_slice(&mut b[..8]);
        assert_ne!(checksum(&swapped), sum);
        let mut moved = d.clone();
        moved.rotate_left(8);
        assert_ne!(checksum(&moved), sum);
        let zeros = vec![0u8; 16];
        assert_ne!(checksum(&zeros[..8]), checksum(&zeros));
        assert_ne!(checksum(&zeros[..3]), checksum(&zeros[..4]));
        let mut padded = d.clone();
        padded.push(0);
        assert_ne!(checksum(&padded), sum);
    }
}
