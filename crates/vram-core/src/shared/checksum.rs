//! The checksum of a published version: XXH3, 64 bits. Fast enough to run at memory bandwidth, and
//! the same function in the daemon (at publish, in the scrub) and in clients (local verification).

use xxhash_rust::xxh3::Xxh3;

/// The checksum of `bytes` in one piece.
pub fn checksum(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// A checksum fed in pieces; equal to [`checksum`] of the concatenation.
#[derive(Clone, Default)]
pub struct Checksummer(Xxh3);

impl Checksummer {
    pub fn new() -> Checksummer {
        Checksummer(Xxh3::new())
    }

    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    pub fn finish(&self) -> u64 {
        self.0.digest()
    }
}

impl std::fmt::Debug for Checksummer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Checksummer({:016x})", self.finish())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_equal_the_whole() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut c = Checksummer::new();
        for piece in data.chunks(4093) {
            c.update(piece);
        }
        assert_eq!(c.finish(), checksum(&data));
        assert_ne!(checksum(&data[1..]), checksum(&data));
    }
}
